#!/usr/bin/env python3
"""How long does a consumer group take to get records again after its
coordinator dies, through the proxy and direct, in the same run?

One Tansu broker keeps its data in a local S3 server (moto), so it can be
killed (SIGKILL) and started again with its topics, records and committed
offsets. A producer writes a record every 10 ms straight to the broker. For
each client library (aiokafka, confluent-kafka) two consumer groups read the
topic: one through a kthrottle proxy, one straight from the broker. Every
Tansu broker is node 111 and its own group coordinator, so killing it kills
the coordinator of every group; it is started again ``--down-seconds``
later, on the same port.

Reported per round and group: the seconds from the broker's kill to the
group's first record after it, and the part of that after the broker listens
again (the recovery each client adds). Also: how long after the kill a TCP
connection to the proxy's node port is refused, against the broker's own port.

This machine has one broker, so "failover" is the coordinator's restart, not
a move to another broker; what it shows is whether the proxy makes a client
wait longer than the broker's own absence does.

Example (about 2 minutes)::

    python benchmarks/broker_failover.py --rounds 5
"""
import asyncio
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from kthrottle_testkit.harness import (Run, add_output_dir, check_src, markdown_table, names,
                                       output_dir, parser, write_results)


class Group(threading.Thread):
    """A consumer group member in a thread of its own; ``seen`` holds the
    monotonic time of every record it receives."""

    def __init__(self, library, bootstrap, topic, path):
        super().__init__(daemon=True)
        self.library, self.bootstrap, self.topic, self.path = library, bootstrap, topic, path
        self.group = "failover-%s-%s-%s" % (library, path, uuid.uuid4().hex[:6])
        self.seen = []
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.error = None

    def first_after(self, t):
        return next((s for s in self.seen if s > t), None)

    def run(self):
        try:
            if self.library == "aiokafka":
                asyncio.run(self._aiokafka())
            else:
                self._confluent()
        except Exception as exc:  # reported with the results
            self.error = exc
            self.ready.set()

    async def _aiokafka(self):
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(self.topic, bootstrap_servers=self.bootstrap,
                                    group_id=self.group, auto_offset_reset="latest",
                                    retry_backoff_ms=100)
        await consumer.start()
        try:
            while not self.stopping.is_set():
                batches = await consumer.getmany(timeout_ms=100)
                now = time.monotonic()
                for messages in batches.values():
                    self.seen.extend(now for _ in messages)
                if self.seen:
                    self.ready.set()
        finally:
            await consumer.stop()

    def _confluent(self):
        from confluent_kafka import Consumer

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "auto.offset.reset": "latest", "log_level": 0,
                             "logger": _quiet_logger()})
        consumer.subscribe([self.topic])
        try:
            while not self.stopping.is_set():
                message = consumer.poll(0.1)
                if message is not None and message.error() is None:
                    self.seen.append(time.monotonic())
                    self.ready.set()
        finally:
            consumer.close()


def _quiet_logger():
    import logging

    logger = logging.getLogger("librdkafka")
    logger.setLevel(logging.CRITICAL)
    return logger


class Producer(threading.Thread):
    """A record every ``interval`` seconds, straight to the broker, retrying
    through the broker's absence."""

    def __init__(self, bootstrap, topic, interval=0.01):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.interval = bootstrap, topic, interval
        self.stopping = threading.Event()

    def run(self):
        from confluent_kafka import Producer as Kafka

        producer = Kafka({"bootstrap.servers": self.bootstrap, "linger.ms": 0,
                          "message.timeout.ms": 60000, "log_level": 0,
                          "logger": _quiet_logger()})
        while not self.stopping.is_set():
            try:
                producer.produce(self.topic, b"%f" % time.time())
            except BufferError:
                pass
            producer.poll(0)
            time.sleep(self.interval)
        producer.flush(10)


def refused_after(port, since, timeout=10.0):
    """Seconds from ``since`` until a TCP connection to ``port`` is refused."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                pass
        except ConnectionRefusedError:
            return time.monotonic() - since
        except OSError:
            pass
        time.sleep(0.001)
    return None


def main(argv=None):
    p = parser(__doc__.split("\n\n")[0], raw=True)
    p.add_argument("--rounds", type=int, default=3, help="kills of the broker (default 3)")
    p.add_argument("--down-seconds", type=float, default=2.0,
                   help="how long the broker stays down each time (default 2)")
    p.add_argument("--libraries", default="aiokafka,confluent-kafka",
                   help="client libraries, comma-separated (default both)")
    p.add_argument("--proxy-src", type=Path, metavar="TREE",
                   help="run the proxy from this source tree (a worktree of an older "
                   "commit, say) instead of this one")
    add_output_dir(p, help="where broker_failover.md goes (broker_failover_other_tree.md with "
                   "--proxy-src)")
    args = p.parse_args(argv)
    libraries = names(args.libraries)
    if args.proxy_src is not None:
        args.proxy_src = check_src(p, "--proxy-src", args.proxy_src)
    output_dir(args, "broker_failover")

    groups, producer = [], None
    rows = []
    with Run("kthrottle-failover", catch=False) as run:
        s3 = run.s3("moto")
        broker = run.broker("tansu", storage_url=s3.storage_url, env=s3.tansu_env())
        topic = "failover-%s" % uuid.uuid4().hex[:6]
        broker.create_topic(topic, partitions=1)
        proxy = run.kthrottle(broker, name="proxy", src=args.proxy_src)
        try:
            producer = Producer(broker.bootstrap, topic)
            producer.start()
            for library in libraries:
                for path, bootstrap in (("proxy", proxy.bootstrap), ("direct", broker.bootstrap)):
                    groups.append(Group(library, bootstrap, topic, path))
            for g in groups:
                g.start()
            for g in groups:
                if not g.ready.wait(60) or g.error:
                    raise RuntimeError("%s %s group never got a record: %s"
                                       % (g.library, g.path, g.error))
            for round_ in range(1, args.rounds + 1):
                rows += kill_and_restart(round_, broker, proxy, groups, args.down_seconds)
        finally:
            if producer is not None:
                producer.stopping.set()
            for g in groups:
                g.stopping.set()
            for g in groups:
                g.join(15)
            if producer is not None:
                producer.join(15)

    lines = ["# Consumer group recovery after its coordinator is killed",
             "",
             "`python benchmarks/broker_failover.py --rounds %d --down-seconds %g%s`: one Tansu "
             "broker on S3 storage (moto), killed with SIGKILL and started again on the same "
             "port %g s later; a group per client library through kthrottle and one direct, "
             "same run." % (args.rounds, args.down_seconds,
                            " --proxy-src %s" % args.proxy_src if args.proxy_src else "",
                            args.down_seconds),
             "",
             ]
    table = []
    for library in libraries:
        for path in ("proxy", "direct"):
            mine = [r for r in rows if r[1] == library and r[2] == path]
            firsts = [r[4] for r in mine if r[4] is not None]
            after = [r[5] for r in mine if r[5] is not None]
            refused = [r[6] * 1000 for r in mine if r[6] is not None]
            table.append((library, path, _stats(firsts), _stats(after),
                          "%.1f" % statistics.median(refused) if refused else "never"))
    lines += markdown_table(
        ("client", "path", "first record after the kill, s (median, max)",
         "of which after the broker is back, s (median, max)",
         "connection refused after the kill, ms (median)"), table, align="lllll")
    missing = [r for r in rows if r[4] is None]
    if missing:
        lines.append("")
        lines.append("No record within 60 s after the restart: %d group-round(s)." % len(missing))
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.output_dir, "broker_failover_other_tree" if args.proxy_src
                  else "broker_failover", text)
    return run.finish(missing)


def kill_and_restart(round_, broker, proxy, groups, down_seconds):
    """Kill the broker, start it again ``down_seconds`` later; one row per group."""
    time.sleep(3)  # steady state
    killed = time.monotonic()
    broker.kill()
    refused = {}  # while the broker is down: are its ports refused?
    watchers = [threading.Thread(target=lambda k=k, port=port: refused.__setitem__(
        k, refused_after(port, killed, down_seconds * 0.9))) for k, port in
        (("proxy", proxy.node_port), ("direct", broker.port))]
    for w in watchers:
        w.start()
    time.sleep(max(0.0, down_seconds - (time.monotonic() - killed)))
    for w in watchers:
        w.join()
    proxy_refused, direct_refused = refused["proxy"], refused["direct"]
    broker.start()  # returns once the port listens
    up = time.monotonic()
    deadline = up + 60
    while time.monotonic() < deadline and not all(g.first_after(up) for g in groups):
        time.sleep(0.05)
    rows = []
    for g in groups:
        first = g.first_after(killed)
        rows.append((round_, g.library, g.path, up - killed,
                     None if first is None else first - killed,
                     None if first is None else first - up,
                     proxy_refused if g.path == "proxy" else direct_refused))
    print("round %d: broker down %.2f s; node port refused after %s (proxy) / %s "
          "(broker)" % (round_, up - killed, _ms(proxy_refused), _ms(direct_refused)))
    return rows


def _ms(seconds):
    return "never" if seconds is None else "%.1f ms" % (seconds * 1000)


def _stats(values):
    if not values:
        return "none"
    return "%.2f, %.2f" % (statistics.median(values), max(values))


if __name__ == "__main__":
    sys.exit(main())
