#!/usr/bin/env python3
"""How close to its quota does kthrottle hold a client that sends or fetches as fast as it can,
and how does that compare with Apache Kafka's own quotas?

Default (``--broker tansu``): one local Tansu broker (in-memory storage) and, per quota mode, one
fresh ``python -m kthrottle proxy --quota-file FILE --quota-mode MODE`` in front of it. For every
quota size three clients run at once against that proxy, each with its own client-id, its own
1-partition topic and its own quota (KIP-55 ``clients/<client-id>`` entities):

* ``aio-producer``  - aiokafka, 1 KiB records, acks=1, as fast as it can with at most
  ``--max-in-flight`` unacknowledged records (producer_byte_rate);
* ``ck-producer``   - confluent-kafka (librdkafka), 1 KiB records, acks=1,
  ``batch.size=--ck-batch-size`` (16384, the Java client's default), otherwise librdkafka's
  defaults: it ignores throttle_time_ms and keeps up to a million requests in flight, so only the
  proxy holds it back (producer_byte_rate);
* ``aio-consumer``  - aiokafka, reading a topic preloaded directly against the broker, with
  ``max_partition_fetch_bytes=--fetch-bytes`` (consumer_byte_rate).

``--broker kafka``: an Apache Kafka 4.4 KRaft cluster of ``--kafka-nodes`` (3) nodes started
here (kthrottle/kafka_kit.py; jars through scripts/kafka-jars), and two more clients, Kafka's own
perf tools on the Java client:

* ``java-producer`` - ProducerPerformance, --throughput -1, 1 KiB records, acks=1, otherwise the
  Java client's defaults (producer_byte_rate); its rate is read at the brokers (log end offsets);
* ``java-consumer`` - ConsoleConsumer on the preloaded topic, the Java client's defaults
  (consumer_byte_rate), printing a line per record (its partition, not its value), timed as
  the lines come. (ConsumerPerformance counts a poll's records only at its next report, which
  comes after the next poll with records: seconds late, for a throttled consumer.)

Every topic has one partition per broker, leaders spread over the brokers, so that each client
writes to or reads from all of them. ``--enforcers`` (default on Kafka: both) says who holds the
clients to the same quotas: ``kthrottle`` (the quota file, the clients through a fresh proxy per
``--modes`` entry, no broker quota) and ``kafka`` (the same quotas set on the cluster as
``clients/<client-id>`` entities with the admin API, AlterClientQuotas, checked with Kafka's own
kafka-configs; the clients straight to the brokers, no proxy). Kafka enforces a quota on each
broker on its own, so a client spread over three brokers may get up to three times its quota;
the report's one table puts both side by side.

Every client records when its bytes arrive: a producer when a record is acknowledged (delivery
callback / future done; the Java producer when its records reach the brokers), a consumer when
its records are returned. Achieved rate / quota is reported for the first seconds (burst) and
for the steady state, with a per-second series per client for the plot. Rates count record-value
bytes; the proxy counts whole request/response frames, a few percent more (see the report). At
the end of each quota size the proxy's own ``/metrics`` (admin endpoint) is read for its
throttle counters and measured rate.

Writes ``throttle_accuracy.md`` and ``throttle_accuracy.png`` into ``--output-dir``
(default: a new directory under ``benchmarks/runs/``). Every process this script starts
binds 127.0.0.1 on a free port and is stopped by PID at the end, on Ctrl-C and on errors
too.

Example (smoke run, about 25 s)::

    python benchmarks/throttle_accuracy.py --seconds 8 --quotas 100000

Full run (about 5 minutes: 30 s per quota size and mode, 65 s for 200 KB/s, the quota of
Kafka's reference measurement, so that its windows can be compared)::

    python benchmarks/throttle_accuracy.py

Side by side with Kafka's own quotas (three brokers, five clients, the Java ones too; about
8 minutes: 30 s per quota size and enforcer, 9 of them, each with 10-20 s for the JVMs' start
and the clients' stop, and the cluster's start and the preload; the smoke run about 2)::

    python benchmarks/throttle_accuracy.py --broker kafka
    python benchmarks/throttle_accuracy.py --broker kafka --seconds 8 --quotas 100000  # smoke
"""
import asyncio
import logging
import re
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque, namedtuple
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kthrottle_testkit import harness

MODES = ("token-bucket", "window")
BROKERS = ("tansu", "kafka")
ENFORCERS = ("kthrottle", "kafka")
PY_CLIENTS = ("aio-producer", "ck-producer", "aio-consumer")
JAVA_CLIENTS = ("java-producer", "java-consumer")
CLIENTS = PY_CLIENTS + JAVA_CLIENTS
QUOTA_KEY = {"aio-producer": "producer_byte_rate", "ck-producer": "producer_byte_rate",
             "aio-consumer": "consumer_byte_rate", "java-producer": "producer_byte_rate",
             "java-consumer": "consumer_byte_rate"}
METRIC_KIND = {"producer_byte_rate": "produce", "consumer_byte_rate": "fetch"}
PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
CONFIG_COMMAND = "org.apache.kafka.tools.ConfigCommand"  # bin/kafka-configs.sh in 4.x
OFFSETS_EVERY = 0.1  # seconds between two looks at the Java producer's log end offsets
TAIL_EVERY = 0.05  # seconds between two looks at the Java consumer's output
# what a Java client writes when a request times out, a batch expires or a connection breaks
JAVA_TROUBLE = re.compile(r"TimeoutException|Expiring \d+ record|NetworkException|"
                          r"DisconnectException|due to request timeout|Cancelled in-flight")

# Measured by the team on this machine against Apache Kafka 2.2 broker quotas (client default
# producer_byte_rate = 200 KB/s; aiokafka and confluent-kafka writing 1 KiB records as fast as
# they can). Not measured by this script: shown for comparison only.
KAFKA_REFERENCE = {"quota": 200_000, "windows": (((12, 27), 1.43), ((25, 65), 0.83))}


class Setup(namedtuple("Setup", "enforcer mode")):
    """Who enforces the quotas in one part of a run: kthrottle in a quota mode, or Kafka."""

    @property
    def label(self):
        return "Kafka's quotas" if self.enforcer == "kafka" else "kthrottle %s" % self.mode

    def client_id(self, kind, quota):
        # Kafka's quotas are on client-ids of their own: the cluster keeps them for the
        # whole run, and must not hold the clients of the kthrottle parts
        base = "%s-%s" % (kind, quota_label(quota))
        return base + "-kafka" if self.enforcer == "kafka" else base


def setups(args):
    out = []
    for enforcer in args.enforcers:
        if enforcer == "kthrottle":
            out += [Setup("kthrottle", mode) for mode in args.modes]
        else:
            out.append(Setup("kafka", None))
    return out


# --------------------------------------------------------------------------- results


@dataclass
class ClientRun:
    """One client for one (quota mode or enforcer, quota size)."""

    mode: Optional[str]  # kthrottle's quota mode; None when Kafka enforces
    quota: int
    kind: str
    client_id: str
    topic: str
    enforcer: str = "kthrottle"
    partitions: int = 1
    leaders: tuple = ()  # the nodes leading the topic's partitions (Kafka)
    events: list = field(default_factory=list)  # (monotonic time, value bytes)
    errors: int = 0
    first_error: Optional[str] = None
    ran_out: bool = False  # consumer: reached the end of the preloaded data
    proxy: dict = field(default_factory=dict)  # read from the proxy's /metrics
    t0: Optional[float] = None
    seconds: float = 0.0  # length of the measured period

    @property
    def setup(self):
        return Setup(self.enforcer, self.mode)

    def error(self, text):
        self.errors += 1
        if self.first_error is None:
            self.first_error = text

    def rate(self, start, end):
        """Value bytes per second delivered in [start, end) seconds after t0."""
        if self.t0 is None or end <= start:
            return None
        t0 = self.t0
        return sum(n for t, n in self.events if start <= t - t0 < end) / (end - start)

    def series(self):
        bins = [0.0] * int(self.seconds)
        if self.t0 is None:
            return bins
        for t, n in self.events:
            i = int(t - self.t0)
            if 0 <= i < len(bins):
                bins[i] += n
        return bins


def run_seconds(quota, args):
    """The measured period for one quota size: Kafka's reference quota runs long enough to
    cover the reference's windows (up to 65 s)."""
    if quota == KAFKA_REFERENCE["quota"] and args.reference_seconds:
        return max(args.seconds, args.reference_seconds)
    return args.seconds


def quota_label(quota):
    return ("%gM" % (quota / 1e6)) if quota >= 1_000_000 else ("%gk" % (quota / 1e3))


# --------------------------------------------------------------------------- brokers


class Brokers:
    """The broker side: one Tansu broker (in memory), or (--broker kafka) an Apache Kafka
    KRaft cluster of --kafka-nodes nodes (kthrottle/kafka_kit.py), started here on 127.0.0.1
    and free ports and stopped by their own PIDs with the run (on Ctrl-C and errors too)."""

    def __init__(self, run, args):
        self.kind = args.broker
        self.tansu = self.cluster = None
        self.leaders = {}  # topic -> the node ids leading its partitions
        if self.kind == "tansu":
            self.tansu = run.broker()
            self.bootstrap = self.tansu.bootstrap
            self.partitions = 1
            self.description = "Tansu"
            print("Tansu broker pid %d on %s; logs and quota file in %s"
                  % (self.tansu.proc.pid, self.bootstrap, run.log_dir), flush=True)
            return
        from kthrottle import kafka_kit

        lib = kafka_kit.fetch_kafka_lib()
        self.cluster = kafka_kit.KafkaCluster(run.path("kafka"), n=args.kafka_nodes,
                                                  lib=lib, log_dir=run.log_dir)
        run.procs.on_stop(lambda: self.cluster.stop(keep=False))  # start stops it if it fails
        began = time.monotonic()
        self.cluster.start()
        self.bootstrap = self.cluster.bootstrap
        self.partitions = args.kafka_nodes  # one partition led by each broker
        self.description = "Apache Kafka %s (%d KRaft nodes, each broker and controller)" % (
            self.cluster.version, args.kafka_nodes)
        print("Apache Kafka %s: %d nodes (pids %s) on %s, up in %.1f s; logs and quota file "
              "in %s" % (self.cluster.version, args.kafka_nodes,
                         ", ".join(str(n.proc.pid) for n in self.cluster.nodes.values()),
                         self.bootstrap, time.monotonic() - began, run.log_dir), flush=True)

    def create_topic(self, name):
        if self.tansu is not None:
            self.tansu.create_topic(name, partitions=self.partitions)
            return
        # one replica: the brokers' own replication would only add load; Kafka stripes the
        # partitions' leaders over the brokers
        self.cluster.create_topic(name, partitions=self.partitions, replication_factor=1)
        leaders = self.cluster.leaders(name)
        self.leaders[name] = tuple(leaders[p] for p in sorted(leaders))
        if len(set(self.leaders[name])) < min(self.partitions, len(self.cluster.nodes)):
            print("    ! %s: leaders %s do not cover every broker" % (name, self.leaders[name]),
                  flush=True)

    def delete_topic(self, name):
        """Kafka keeps what the producers wrote on disk: their topics go after each cell."""
        if self.cluster is None:
            return
        try:
            admin = self.cluster.admin()  # kept until answered: a dropped client cancels
            for future in admin.delete_topics([name]).values():
                future.result(30)
        except Exception as exc:
            print("    ! deleting topic %s: %s" % (name, exc), flush=True)

    def alive(self):
        """None, or which broker exited."""
        if self.tansu is not None and self.tansu.proc.poll() is not None:
            return "the Tansu broker exited (code %s)" % self.tansu.proc.returncode
        for node in (self.cluster.nodes.values() if self.cluster else ()):
            if not node.alive():
                return "Kafka node %d exited; the end of its log:\n%s" % (node.node_id,
                                                                          node.log_tail())
        return None

    def java_command(self, main_class, *args):
        return self.cluster.java_command(main_class, *args, heap="256m")

    # Kafka's own quotas ------------------------------------------------------------------

    def set_client_quotas(self, quotas, timeout=30.0):
        """``quotas`` ({client_id: {key: bytes/s}}) as clients/<client-id> entities on the
        cluster with the admin API (AlterClientQuotas v0, KIP-546; one request for all, where
        kafka-configs takes a JVM start per entity); returns once every broker's
        DescribeClientQuotas shows all of them, and what Kafka's own kafka-configs
        --describe --entity-type clients lists then."""
        import warnings

        with warnings.catch_warnings():  # kafka.protocol warns about its own deprecations
            warnings.simplefilter("ignore", DeprecationWarning)
            from kafka.protocol.admin import (AlterClientQuotasRequest,
                                              AlterClientQuotasResponse,
                                              DescribeClientQuotasRequest,
                                              DescribeClientQuotasResponse)
        entry = AlterClientQuotasRequest[0].EntryData
        request = AlterClientQuotasRequest[0](validate_only=False, entries=[
            entry(entity=[entry.EntityData(entity_type="client-id", entity_name=cid)],
                  ops=[entry.OpData(key=k, value=float(v), remove=False)
                       for k, v in values.items()])
            for cid, values in quotas.items()])
        nodes = list(self.cluster.nodes.values())
        answer = kafka_call(nodes[0].host, nodes[0].port, request,
                            AlterClientQuotasResponse[0])
        refused = [(e.entity, e.error_code, e.error_message) for e in answer.entries
                   if e.error_code]
        if refused:
            raise RuntimeError("AlterClientQuotas refused: %s" % refused)
        # each broker applies them from the metadata log: wait until every one has them
        component = DescribeClientQuotasRequest[0].ComponentData
        describe = DescribeClientQuotasRequest[0](strict=False, components=[
            component(entity_type="client-id", match_type=2, match=None)])  # 2: any name
        want = {(cid, k, float(v)) for cid, values in quotas.items() for k, v in values.items()}
        deadline = time.monotonic() + timeout
        for node in nodes:
            while True:
                got = kafka_call(node.host, node.port, describe, DescribeClientQuotasResponse[0])
                seen = {(e.entity[0].entity_name, v.key, v.value)
                        for e in got.entries or () for v in e.values}
                if want <= seen:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("node %d has %d of the %d quotas after %.0f s"
                                       % (node.node_id, len(want & seen), len(want), timeout))
                time.sleep(0.2)
        listed = self.cluster.tool(CONFIG_COMMAND, "--bootstrap-server", self.bootstrap,
                                   "--describe", "--entity-type", "clients", timeout=120)
        return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def kafka_call(host, port, request, response_type, client_id="throttle-accuracy-setup"):
    """One request (a kafka-python request object of a non-flexible version) to
    host:port on a connection of its own; its answer decoded."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(harness.frame_of(request, 1, client_id))
        size = struct.unpack(">i", harness._recv_exact(sock, 4))[0]
        frame = harness._recv_exact(sock, size)
    return response_type.decode(frame[4:])  # after the correlation id (header v0)


# --------------------------------------------------------------------------- processes


def start_proxy(run, brokers, quota_file, mode, args):
    """A kthrottle proxy in front of the brokers with the quota file and an admin endpoint.
    On Kafka: every node as a bootstrap server and a port of its own for each node id
    (--node-ports), checked to be what Metadata through the proxy names, so that the clients
    stay behind it."""
    extra = ["--quota-file", str(quota_file), "--quota-mode", mode]
    if args.burst_seconds is not None:
        extra += ["--quota-burst-seconds", str(args.burst_seconds)]
    name = "kthrottle-%s" % mode
    if brokers.cluster is None:
        return run.kthrottle(brokers.tansu, extra, admin=True, name=name)
    from kthrottle_testkit.cluster_proxy import start_cluster_proxy

    return start_cluster_proxy(run, brokers.cluster, extra, name)


def write_quota_file(path, quotas, clients):
    lines = ["# written by benchmarks/throttle_accuracy.py"]
    for quota in quotas:
        for kind in clients:
            lines += ["", '[clients."%s"]' % Setup("kthrottle", None).client_id(kind, quota),
                      "%s = %d" % (QUOTA_KEY[kind], quota)]
    Path(path).write_text("\n".join(lines) + "\n")


def read_proxy_metrics(admin_port, client_ids):
    """Per client-id: the proxy's measured rate (Kafka's sampled rate, wire bytes), its
    throttle time total and throttled responses, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {cid: {} for cid in client_ids}
    for family in text_string_to_metric_families(harness.admin_get(admin_port)):
        for sample in family.samples:
            cid = sample.labels.get("client_id")
            if cid in out:
                out[cid][sample.name] = sample.value
    return out


# --------------------------------------------------------------------------- clients


def preload(bootstrap, topic, records, value, partitions):
    """Write ``records`` records straight to the broker for the consumers to fetch, spread
    over the partitions, in 16 KiB batches: a fetch returns at least one whole batch, so the
    batch size bounds how small a fetch response can be."""
    from confluent_kafka import Producer

    errors = []
    producer = Producer({**harness.ck_common(bootstrap, errors),
                         "client.id": "throttle-accuracy-preload", "acks": 1, "linger.ms": 10,
                         "batch.size": 16384, "enable.idempotence": False,
                         "compression.type": "none"})
    acks = harness.Acks()
    try:
        for i in range(records):
            while True:
                try:
                    producer.produce(topic, value, partition=i % partitions, on_delivery=acks)
                    break
                except BufferError:  # librdkafka's queue is full: let it drain
                    producer.poll(0.05)
            if i % 1000 == 999:
                producer.poll(0)
        while len(producer):
            producer.flush(1)
        acks.check(records, errors)
    finally:
        harness.ck_close(producer)


class Clock:
    """When the measured period starts and ends (monotonic seconds); set once every client
    is connected, read by the clients after ``go``."""

    t0 = None
    end = None


async def aio_produce(run, bootstrap, value, clock, args, ready, go):
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, client_id=run.client_id, acks=1, linger_ms=args.linger_ms,
        max_batch_size=16384, request_timeout_ms=60000,
    )

    closing = []

    def delivered(fut):
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            run.events.append((time.monotonic(), len(value)))
        elif not closing:  # failures of what is abandoned at the end do not count
            run.error("%s: %s" % (type(exc).__name__, exc))

    try:
        await producer.start()
        await producer.partitions_for(run.topic)  # metadata before the clock starts
        ready.set()
        await go.wait()
        in_flight = deque()
        sent = 0
        while time.monotonic() < clock.end:
            # round robin: every partition, so every broker that leads one
            fut = await producer.send(run.topic, value, partition=sent % run.partitions)
            sent += 1
            fut.add_done_callback(delivered)
            in_flight.append(fut)
            while in_flight and in_flight[0].done():
                in_flight.popleft()
            if len(in_flight) >= args.max_in_flight:
                remaining = clock.end - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait([in_flight[0]], timeout=remaining)
    finally:
        closing.append(True)
        await close_producer(producer)


async def close_producer(producer, timeout=15.0):
    """Stop without flushing: what is still queued is not part of the measurement, and
    flushing it could take many seconds at a small quota. The queued batches are failed
    first, so that aiokafka's stop() only waits for the one request in flight."""
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        batches = [b for queue in accumulator._batches.values() for b in queue]
        batches += list(accumulator._pending_batches)
        accumulator.fail_all(RuntimeError("benchmark period over"))
        for batch in batches:  # retrieved, so that asyncio does not report them
            for fut in (batch.future, getattr(batch, "_drain_waiter", None)):
                if fut is not None and fut.done() and not fut.cancelled():
                    fut.exception()
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # errors of the abandoned requests, not of the run
    try:
        await asyncio.wait_for(producer.stop(), timeout)
    except asyncio.CancelledError:
        # aiokafka's stop() re-raises the cancellation of its own sender task
        if asyncio.current_task().cancelling():
            raise  # we are being cancelled (Ctrl-C)
    except Exception as exc:
        print("    ! aiokafka producer stop: %s" % (exc or type(exc).__name__), flush=True)
    finally:
        quiet.setLevel(level)
    try:
        await asyncio.wait_for(producer.client.close(), 5)  # in case stop() did not get there
    except Exception:
        pass


async def aio_consume(run, bootstrap, clock, args, ready, go):
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, client_id=run.client_id, group_id=None,
        enable_auto_commit=False, auto_offset_reset="earliest",
        max_partition_fetch_bytes=args.fetch_bytes, fetch_max_bytes=args.fetch_max_bytes,
        request_timeout_ms=60000,
    )
    try:
        await consumer.start()
        tps = [TopicPartition(run.topic, p) for p in range(run.partitions)]
        ready.set()
        await go.wait()
        consumer.assign(tps)  # fetching starts here, not before the clock
        await consumer.seek_to_beginning(*tps)
        while True:
            remaining = clock.end - time.monotonic()
            if remaining <= 0:
                break
            batches = await consumer.getmany(
                *tps, timeout_ms=max(1, int(min(remaining, 0.2) * 1000)))
            n = sum(len(r.value) for records in batches.values() for r in records)
            if n:
                run.events.append((time.monotonic(), n))
        ran_out = True
        for tp in tps:
            highwater = consumer.highwater(tp)
            ran_out = ran_out and highwater is not None and await consumer.position(tp) >= highwater
        run.ran_out = ran_out
    finally:
        try:
            await asyncio.wait_for(consumer.stop(), 10)
        except asyncio.CancelledError:
            # aiokafka's stop() can re-raise the cancellation of its own fetch task
            if asyncio.current_task().cancelling():
                raise  # we are being cancelled (Ctrl-C)
        except Exception as exc:
            print("    ! aiokafka consumer stop: %s" % (exc or type(exc).__name__), flush=True)


def ck_produce(run, bootstrap, value, clock, args, ready, go, stop):
    """confluent-kafka in a thread of its own: librdkafka does its I/O on its own threads
    and runs delivery callbacks from poll()."""
    import confluent_kafka

    producer = None
    try:
        producer = confluent_kafka.Producer({
            "bootstrap.servers": bootstrap, "client.id": run.client_id, "acks": 1,
            "linger.ms": args.linger_ms,
            # librdkafka's default batch.size is 1,000,000 bytes: at these quotas one
            # request would be seconds of quota and the rate would move in whole requests.
            "batch.size": args.ck_batch_size,
        })

        def delivered(err, msg):
            if err is None:
                run.events.append((time.monotonic(), len(msg.value())))
            elif err.code() not in (confluent_kafka.KafkaError._PURGE_QUEUE,
                                    confluent_kafka.KafkaError._PURGE_INFLIGHT):
                run.error(str(err))

        producer.list_topics(run.topic, timeout=10)  # connected, leader known
        ready.set()
        while not go.wait(0.05):
            if stop.is_set():
                return
        sent = 0
        while not stop.is_set() and time.monotonic() < clock.end:
            try:
                producer.produce(run.topic, value, partition=sent % run.partitions,
                                 on_delivery=delivered)
                sent += 1
            except BufferError:  # librdkafka's queue is full (100,000 messages by default)
                producer.poll(0.02)
                continue
            producer.poll(0)
    except Exception as exc:
        run.error("%s: %s" % (type(exc).__name__, exc))
    finally:
        ready.set()
        if producer is not None:
            try:  # drop what is queued or in flight: not part of the measurement
                producer.purge(in_queue=True, in_flight=True, blocking=False)
                producer.flush(5)
            except Exception:
                pass


class JavaClient:
    """One of Kafka's perf tools as a client under test: a JVM started through the run's
    processes (its output in the run's log directory, stopped by its own PID), and a thread
    that turns what it does into the ClientRun's events. The producer's records are counted
    where they land, at the brokers (log end offsets, straight from the brokers); the
    consumer's as it prints them (a line each). Its period starts with its first records
    (``first``): the JVM's start and the consumer's group join are not counted."""

    def __init__(self, run, brokers, bootstrap, args, records, name):
        self.run = run
        self.brokers = brokers
        self.bootstrap = bootstrap  # the proxy's, or the brokers'
        self.args = args
        self.records = records  # the producer's --num-records; the consumer's preload
        self.name = name
        self.first = threading.Event()
        self.done = threading.Event()
        self.proc = self.log = self.thread = None

    def command(self):
        run, args = self.run, self.args
        if run.kind == "java-producer":
            return self.brokers.java_command(
                PRODUCER_PERFORMANCE, "--topic", run.topic, "--num-records", self.records,
                "--record-size", args.record_size, "--throughput", -1,
                "--reporting-interval", 1000, "--command-property",
                "bootstrap.servers=%s" % self.bootstrap, "client.id=%s" % run.client_id,
                "acks=1", "linger.ms=%d" % args.linger_ms)
        return self.brokers.java_command(
            CONSOLE_CONSUMER, "--bootstrap-server", self.bootstrap, "--topic", run.topic,
            "--from-beginning", "--max-messages", self.records,
            "--group", "%s-%s" % (self.name, uuid.uuid4().hex[:6]), "--timeout-ms", 60000,
            # a short line per record: its partition, not its 1 KiB value
            "--formatter-property", "print.value=false",
            "--formatter-property", "print.partition=true",
            "--command-property", "client.id=%s" % run.client_id)

    def start(self, procs):
        self.proc = procs.spawn(self.name, self.command())
        self.log = procs.log_dir / (self.name + ".log")
        watch = self._offsets if self.run.kind == "java-producer" else self._lines
        self.thread = threading.Thread(target=self._guarded, args=(watch,), daemon=True,
                                       name=self.name)
        self.thread.start()
        return self

    def _guarded(self, watch):
        try:
            watch()
        except Exception as exc:
            self.run.error("%s: %s" % (type(exc).__name__, exc))

    def _offsets(self):
        """The producer's records as they reach the brokers: the sum of its topic's log end
        offsets, looked at every OFFSETS_EVERY seconds."""
        from confluent_kafka import Consumer
        from confluent_kafka import TopicPartition as Tp

        run = self.run
        watcher = Consumer({"bootstrap.servers": self.brokers.bootstrap,
                            "group.id": "throttle-accuracy-watch",
                            "client.id": "throttle-accuracy-watch"})
        tps = [Tp(run.topic, p) for p in range(run.partitions)]
        try:
            last, last_at = 0, time.monotonic()
            while not self.done.is_set():
                total = sum(watcher.get_watermark_offsets(tp, timeout=5, cached=False)[1]
                            for tp in tps)
                now = time.monotonic()
                if total > last:
                    if run.t0 is None:  # they came after the previous look
                        run.t0 = last_at
                        self.first.set()
                    run.events.append((now, (total - last) * self.args.record_size))
                    last = total
                last_at = now
                self.done.wait(OFFSETS_EVERY)
        finally:
            watcher.close()

    def _lines(self):
        """The consumer's records as it prints them ("Partition:N" each; System.out flushes
        every write), timed as they come into its log."""
        run = self.run
        count, pos, rest = 0, 0, ""
        while True:
            over = self.done.is_set()  # one more look after the end
            with open(self.log, errors="replace") as f:
                f.seek(pos)
                rest += f.read()
                pos = f.tell()
            lines = rest.split("\n")
            rest = lines.pop()
            got = sum(1 for line in lines if line.startswith("Partition:"))
            if got and not over:
                now = time.monotonic()
                if run.t0 is None:
                    run.t0 = now
                    self.first.set()
                run.events.append((now, got * self.args.record_size))
            count += got
            if over:
                break
            self.done.wait(TAIL_EVERY)
        run.ran_out = count >= self.records

    def check(self):
        """Raises if the client cannot start: its JVM gone, or its watcher failed."""
        if self.run.errors:
            raise RuntimeError("%s: %s" % (self.run.kind, self.run.first_error))
        if self.proc.poll() is not None and not self.first.is_set():
            raise RuntimeError("%s exited with code %s before any record moved; its log ends "
                               "with: %s" % (self.run.kind, self.proc.returncode,
                                             harness.last_log_line(self.log)))

    def period_over(self):
        """At the end of the measured period, before the client is stopped: what its log
        says of trouble until now, and whether it ran to the end."""
        code = self.proc.poll()
        if code == 0:  # a producer no one held back, or a consumer that ran dry
            self.run.error("ended before the period did, done with its %d records"
                           % self.records)
        elif code is not None:
            self.run.error("exited with code %s before the period ended" % code)
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return
        trouble = [line.strip() for line in text.splitlines() if JAVA_TROUBLE.search(line)]
        if trouble:
            self.run.error("%d trouble lines in its log, first: %s" % (len(trouble),
                                                                      trouble[0][:200]))

    def stop(self, procs):
        self.done.set()
        if self.proc is not None:
            procs.stop(self.proc)
        if self.thread is not None:
            self.thread.join(10)


async def wait_java(javas, tasks, timeout):
    """Until every Java client has moved its first records; raises if one cannot, or if a
    Python client ends meanwhile."""
    deadline = time.monotonic() + timeout
    while not all(j.first.is_set() for j in javas):
        for j in javas:
            j.check()
        for task in tasks:
            if task.done():
                task.result()
                raise RuntimeError("a client ended before the measurement started")
        if time.monotonic() > deadline:
            raise TimeoutError("%s moved no records within %.0f s" % (
                ", ".join(j.run.kind for j in javas if not j.first.is_set()), timeout))
        await asyncio.sleep(0.05)


async def run_quota(cell, quota, topics, args):
    """All clients of one quota size at once against ``cell.bootstrap`` (a proxy, or the
    brokers themselves when Kafka enforces); returns their ClientRuns."""
    setup = cell.setup
    runs = {kind: ClientRun(setup.mode, quota, kind, setup.client_id(kind, quota),
                            topics[kind], enforcer=setup.enforcer,
                            partitions=cell.brokers.partitions,
                            leaders=cell.brokers.leaders.get(topics[kind], ()))
            for kind in args.clients}
    value = b"x" * args.record_size
    clock = Clock()
    go = asyncio.Event()
    aio_ready = {kind: asyncio.Event() for kind in ("aio-producer", "aio-consumer")
                 if kind in runs}
    ck_ready, ck_go, ck_stop = threading.Event(), threading.Event(), threading.Event()
    phase_start = time.monotonic()
    ck = None
    if "ck-producer" in runs:
        ck = threading.Thread(target=ck_produce, daemon=True, name="ck-producer",
                              args=(runs["ck-producer"], cell.bootstrap, value, clock, args,
                                    ck_ready, ck_go, ck_stop))
    javas = [JavaClient(runs[kind], cell.brokers, cell.bootstrap, args,
                        cell.java_records(kind, quota),
                        "%s-%s-%s" % (kind, setup.mode or "kafka", quota_label(quota)))
             for kind in JAVA_CLIENTS if kind in runs]
    measured = None
    tasks = []
    if "aio-producer" in runs:
        tasks.append(asyncio.ensure_future(aio_produce(
            runs["aio-producer"], cell.bootstrap, value, clock, args, aio_ready["aio-producer"],
            go)))
    if "aio-consumer" in runs:
        tasks.append(asyncio.ensure_future(aio_consume(
            runs["aio-consumer"], cell.bootstrap, clock, args, aio_ready["aio-consumer"], go)))
    if ck is not None:
        ck.start()
    try:
        # every client connected (and the producers' metadata known) before the clock starts
        waiting = [asyncio.ensure_future(e.wait()) for e in aio_ready.values()]
        if ck is not None:
            waiting.append(asyncio.ensure_future(asyncio.to_thread(ck_ready.wait, 30)))
        connect_by = time.monotonic() + 30
        not_ready = set(waiting)
        while not_ready:
            done, _ = await asyncio.wait(not_ready | set(tasks),
                                         timeout=max(0.0, connect_by - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError("clients did not connect within 30 s")
            for task in tasks:
                if task.done():
                    task.result()  # a client that failed to start: raise its error
                    raise RuntimeError("a client ended before the measurement started")
            not_ready -= done
        if ck is not None and not ck_ready.is_set():
            raise TimeoutError("the confluent-kafka producer did not connect")
        for run in runs.values():
            if run.errors:
                raise RuntimeError("%s: %s" % (run.kind, run.first_error))
        # the JVMs start now, and the clock once their records move: so every client's
        # period has all the others running (the Java ones start a second or two earlier)
        for java in javas:
            java.start(cell.procs)
        if javas:
            await wait_java(javas, tasks, 90)
        connected = time.monotonic()
        clock.t0 = time.monotonic() + 0.05
        clock.end = clock.t0 + run_seconds(quota, args)
        for run in runs.values():
            if run.kind not in JAVA_CLIENTS:
                run.t0 = clock.t0
            run.seconds = run_seconds(quota, args)
        await asyncio.sleep(max(0.0, clock.t0 - time.monotonic()))
        go.set()
        ck_go.set()
        await asyncio.sleep(max(0.0, clock.end - time.monotonic()))
        for java in javas:
            java.period_over()
        if cell.admin_port is not None:
            try:  # the proxy's view at the end of the period, before the clients disconnect
                metrics = await asyncio.to_thread(
                    read_proxy_metrics, cell.admin_port, [r.client_id for r in runs.values()])
                for run in runs.values():
                    run.proxy = metrics.get(run.client_id, {})
            except Exception as exc:
                print("    ! could not read the proxy's /metrics: %s" % exc, flush=True)
        measured = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        ck_stop.set()
        ck_go.set()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=15)
        if ck is not None:
            await asyncio.to_thread(ck.join, 20)
        for java in javas:
            await asyncio.to_thread(java.stop, cell.procs)
    if measured is not None:
        print("    (clients connected in %.1f s, stopped in %.1f s)"
              % (connected - phase_start, time.monotonic() - measured), flush=True)
    return [runs[kind] for kind in args.clients]


# --------------------------------------------------------------------------- reporting


def windows(args):
    """(early, steady) windows in seconds after t0, clipped to the run's length."""
    s = args.seconds
    early = (0.0, min(args.early_seconds, s))
    steady_from = args.steady_from if args.steady_from < s else s / 2
    return early, (steady_from, float(s))


def summarize(run, args):
    q = float(run.quota)
    (e0, e1), (s0, s1) = windows(args)
    series = run.series()
    kind = METRIC_KIND[QUOTA_KEY[run.kind]]
    p = run.proxy

    def x(v):
        return None if v is None else v / q

    return {
        "early": x(run.rate(e0, e1)),
        "steady": x(run.rate(s0, s1)),
        "whole": x(run.rate(0, args.seconds)),
        "peak": x(max(series)) if series else None,
        "series": series,
        "proxy_rate": x(p.get("kthrottle_%s_byte_rate" % kind)),
        "throttled": p.get("kthrottle_%s_throttled_responses_total" % kind),
        "throttle_s": (p["kthrottle_%s_throttle_time_ms_total" % kind] / 1000.0
                       if "kthrottle_%s_throttle_time_ms_total" % kind in p else None),
        "proxy_quota": p.get("kthrottle_%s_quota" % kind),
    }


def fx(value, missing="-"):
    return missing if value is None else "%.2fx" % value


def notes_of(run, s):
    notes = []
    if run.errors:
        notes.append("%d %s (first: %s)" % (
            run.errors, "errors" if run.kind in JAVA_CLIENTS else "delivery errors",
            run.first_error))
    if run.ran_out:
        notes.append("reached the end of the preloaded data")
    if run.t0 is None:
        notes.append("never started")
    if s["proxy_quota"] is not None and s["proxy_quota"] != run.quota:
        notes.append("proxy reports quota %g" % s["proxy_quota"])
    if not run.proxy and run.enforcer == "kthrottle":
        notes.append("no proxy metrics for this client-id")
    return "; ".join(notes)


def table_lines(runs, args):
    (e0, e1), (s0, s1) = windows(args)
    rows = []
    for run in runs:
        s = summarize(run, args)
        rows.append((run.mode if args.broker == "tansu" else run.setup.label,
                     "%s B/s" % format(run.quota, ","), run.kind, fx(s["early"]),
                     fx(s["steady"]), fx(s["whole"]), fx(s["peak"]), fx(s["proxy_rate"]),
                     harness.fmt(s["throttled"], ".0f"), harness.fmt(s["throttle_s"], ".1f"),
                     notes_of(run, s)))
    return harness.markdown_table(
        ["mode" if args.broker == "tansu" else "enforcer", "quota", "client",
         "%g-%g s" % (e0, e1), "%g-%g s" % (s0, s1),
         "0-%g s" % args.seconds, "peak 1 s", "proxy's rate at end", "throttled responses",
         "throttle time s", "notes"], rows, align="lrlrrrrrrrl")


def side_by_side_lines(runs, args):
    """The one table: per quota size and client, achieved / quota at the start (burst) and
    in the steady state under each enforcer, side by side."""
    (e0, e1), (s0, s1) = windows(args)
    present = [setup for setup in setups(args) if any(r.setup == setup for r in runs)]
    cells = {(r.quota, r.kind, r.setup): r for r in runs}
    headers = ["quota", "client", "brokers it uses"]
    for setup in present:
        headers += ["%s: burst %g-%g s" % (setup.label, e0, e1),
                    "%s: steady %g-%g s" % (setup.label, s0, s1)]
    rows = []
    for quota in args.quotas:
        for kind in args.clients:
            got = [cells.get((quota, kind, setup)) for setup in present]
            if not any(got):
                continue
            led = sorted({len(set(r.leaders)) for r in got if r is not None and r.leaders})
            row = ["%s B/s" % format(quota, ","), kind, "/".join(map(str, led)) or "-"]
            for run in got:
                s = summarize(run, args) if run is not None else {}
                flag = " (!)" if run is not None and notes_of(run, s) else ""
                row += [fx(s.get("early")) + flag, fx(s.get("steady")) + flag]
            rows.append(row)
    return harness.markdown_table(headers, rows, align="rll" + "r" * (2 * len(present)))


def reference_lines(runs, args):
    q = KAFKA_REFERENCE["quota"]
    spans = [span for span, _ in KAFKA_REFERENCE["windows"]]
    rows = [("**reference: Apache Kafka 2.2 broker quotas** (measured by the team on this "
             "machine, not by this script; aiokafka and confluent-kafka producers)",
             "%s B/s" % format(q, ","), *("%.2fx" % v for _, v in KAFKA_REFERENCE["windows"]))]
    for run in runs:
        if run.quota != q or not run.kind.endswith("producer"):
            continue  # the reference is of producers
        rows.append(("%s, %s (this run)" % (run.setup.label, run.kind),
                     "%s B/s" % format(q, ","),
                     *(fx(run.rate(a, b) / q) if run.seconds >= b
                       else "- (run %g s)" % run.seconds for a, b in spans)))
    return harness.markdown_table(["what", "quota", *("%g-%g s" % span for span in spans)],
                                  rows)


def report_head(title, facts, broker, command, interrupted):
    """The report's first lines: its title, the machine and the clients (``broker``: what
    they ran against), the command."""
    return [
        "# Throttle accuracy: %s" % title,
        "",
        "Machine: %s CPUs, %s; Python %s; aiokafka %s; confluent-kafka %s (librdkafka %s); "
        "client on %s; %s; kthrottle at %s."
        % (facts["nproc"], facts["cpu_model"], facts["python"], facts["aiokafka"],
           facts["confluent_kafka"], facts["librdkafka"], facts["client_loop"], broker,
           facts["kthrottle_commit"]),
        "",
        "Command: `%s`%s" % (command, " (interrupted)" if interrupted else ""),
        "",
    ]


def markdown_report(runs, facts, args, elapsed, command, interrupted, kafka=None):
    if args.broker == "kafka":
        return kafka_report(runs, facts, args, elapsed, command, interrupted, kafka)
    (e0, e1), (s0, s1) = windows(args)
    lines = report_head("achieved rate / quota through kthrottle", facts, facts["tansu"],
                        command, interrupted) + [
        "Settings: quota modes %s (a fresh proxy per mode%s); quotas %s B/s; %g s per quota "
        "size with the three clients running at once%s; %d B records, acks=1, linger %d ms; "
        "aiokafka producer max_batch_size 16384 and at most %d records unacknowledged; "
        "confluent-kafka batch.size %d, otherwise librdkafka's defaults; aiokafka consumer "
        "max_partition_fetch_bytes %d and fetch_max_bytes %d on a topic preloaded directly "
        "against the broker in 16 KiB batches. "
        "Each client has its own client-id (`<client>-<quota>`), topic (1 partition) and quota "
        "(`clients/<client-id>` entity in the quota file). Run took %.0f s."
        % (", ".join(args.modes),
           "" if args.burst_seconds is None else ", --quota-burst-seconds %g" % args.burst_seconds,
           ", ".join(format(q, ",") for q in args.quotas), args.seconds,
           "".join(" (%s B/s: %g s, to cover the Kafka reference's windows; the table's columns "
                   "are the same windows for every size)" % (format(q, ","), run_seconds(q, args))
                   for q in args.quotas if run_seconds(q, args) != args.seconds),
           args.record_size,
           args.linger_ms, args.max_in_flight, args.ck_batch_size, args.fetch_bytes,
           args.fetch_max_bytes, elapsed),
        "",
        "How to read it: each cell is the record-value bytes a client got through per second "
        "in that window, divided by its quota (producers: acknowledged records, timed at the "
        "delivery callback / future; consumer: bytes returned by getmany). %g-%g s is the "
        "start (burst allowance), %g-%g s the steady state, both counted from the moment all "
        "three clients start. The proxy charges whole request and response frames (record "
        "batch headers, per-record overhead and the request header come on top of the 1 KiB "
        "values, about 2%% for 16 KiB batches), so a client held exactly at its quota reads "
        "slightly under 1.00x here. \"proxy's rate at end\" is the proxy's own measure of the "
        "bucket (Kafka's sampled rate over the last ~11 s, wire bytes) from its /metrics at the "
        "end of the period; throttled responses and throttle time are its counters."
        % (e0, e1, s0, s1),
        "",
    ]
    lines += table_lines(runs, args)
    lines += [
        "",
        "## Against Kafka's own quotas",
        "",
    ]
    lines += reference_lines(runs, args)
    lines += [
        "",
        REFERENCE_TEXT,
        "",
        BATCH_SIZE_TEXT % args.ck_batch_size,
        "",
        MODES_TEXT,
        "",
        "The consumer in window mode runs further over its quota than the producers at small "
        "quotas: a fetch response is forwarded whole and the client is throttled afterwards "
        "(the proxy cannot answer an over-quota fetch empty as Kafka does without dropping "
        "records the broker counted as sent to an incremental fetch session, KIP-227), so the "
        "response that crosses the quota is delivered; at 50 KB/s one 64 KiB response is "
        "1.3 s of quota. Fetch responses are also why the consumer's per-second series "
        "alternates: each response is a whole 64 KiB. Tansu ignores a fetch's per-partition "
        "limit (max_partition_fetch_bytes) and honours only the request's max_bytes, so the "
        "consumer sets both: with aiokafka's default fetch_max_bytes (50 MiB) every response "
        "is as large as the proxy's fetch cap: quota x 10 s in window mode (Kafka's cap), "
        "the burst allowance (--quota-burst-seconds of quota) in token-bucket mode "
        "(`--fetch-max-bytes 52428800` shows it).",
        "",
        "![throttle accuracy](throttle_accuracy.png)",
    ]
    return "\n".join(lines) + "\n"


REFERENCE_TEXT = (
    "The reference row is the team's measurement of Apache Kafka 2.2's broker-side quotas "
    "(client default producer_byte_rate = 200 KB/s, aiokafka and confluent-kafka producers "
    "writing 1 KiB records as fast as they can): Kafka's sampled window lets a new client "
    "run at well over its quota for its first ten-odd seconds (it counts as having 10 s of "
    "silence behind it) and then holds it under the quota while that burst is repaid. The "
    "rows under it are this run's producers at the same quota over the same windows (the "
    "200 KB/s size runs for --reference-seconds so that they are covered).")

BATCH_SIZE_TEXT = (
    "Why confluent-kafka runs with batch.size=%d: librdkafka's default batch.size is "
    "1,000,000 bytes, and a producer that is held back fills its batches to the brim, so "
    "every produce request would carry about 1 MB: 5 s of a 200 KB/s quota, 20 s of a "
    "50 KB/s one. The proxy charges a request whole when it arrives and mutes the client "
    "for the debt, so deliveries would come in 1 MB steps several seconds apart and any "
    "window shorter than a few requests would read as 0x or as a multiple of the quota. "
    "16384 is the Java client's default batch.size; with it every request is a small "
    "fraction of a second of quota and the per-second series is smooth. librdkafka also "
    "ignores throttle_time_ms (KIP-219) and keeps up to a million requests in flight, so "
    "it is held only by the proxy not reading from its socket.")

MODES_TEXT = (
    "What to expect from each mode. token-bucket: a client starts with --quota-burst-seconds "
    "(1 s) of quota in hand, so the first second shows about 2x and 0-5 s about "
    "(5 + 1) / 5 = 1.2x; after that it is held to the quota. window: Kafka's sampled rate "
    "counts a new client as having 10 s of silence behind it, so the first second carries "
    "about 10 s of quota; then every response is delayed X = (O - T) / T x W, which allows "
    "about one request per second while the burst is in the window; when the sample holding "
    "the burst expires (about 11 s later) the client bursts again, about 10 s of quota in a "
    "second or two. Averaged over many cycles that is a little over the quota, but a window "
    "of one to four cycles reads high or low depending on how many bursts fall inside it: "
    "12-27 s holds one or two, 25-65 s three or four. The Kafka reference's two figures "
    "swing the same way; whether its bursts fell where kthrottle's do cannot be told from "
    "two numbers.")


def kafka_report(runs, facts, args, elapsed, command, interrupted, kafka):
    """--broker kafka: the side-by-side table first, then the details."""
    (e0, e1), (s0, s1) = windows(args)
    kafka = kafka or {}
    present = [setup for setup in setups(args) if any(r.setup == setup for r in runs)]
    python_kinds = [k for k in args.clients if k in PY_CLIENTS]
    broker = "%s; Java %s" % (kafka.get("description", "Apache Kafka"), kafka.get("java", "?"))
    lines = report_head("kthrottle beside Kafka's own quotas", facts, broker, command,
                        interrupted) + [
        "Settings: %d brokers started by this run on 127.0.0.1; every topic has %d partitions "
        "of one replica, %s, so that every client writes to or reads from every broker. "
        "Quotas %s B/s; %g s per quota size and enforcer, the clients (%s) running at "
        "once%s; %d B records. Enforcers: %s. Run took %.0f s."
        % (args.kafka_nodes, args.kafka_nodes,
           leaders_text(kafka.get("leaders_by_topic"), args.kafka_nodes),
           ", ".join(format(q, ",") for q in args.quotas), args.seconds,
           ", ".join(args.clients),
           "".join(" (%s B/s: %g s)" % (format(q, ","), run_seconds(q, args))
                   for q in args.quotas if run_seconds(q, args) != args.seconds),
           args.record_size, "; ".join(ENFORCER_TEXT[e] % {
               "modes": ", ".join(s.mode for s in present if s.enforcer == "kthrottle"),
               "entities": kafka.get("entities", "?"),
               "burst": "" if args.burst_seconds is None
               else ", --quota-burst-seconds %g" % args.burst_seconds}
               for e in args.enforcers if any(s.enforcer == e for s in present)), elapsed),
        "",
        "Clients: %s. Each has its own client-id per quota size and enforcer "
        "(`<client>-<quota>`, `<client>-<quota>-kafka`) and its own topic (the consumers read "
        "one preloaded straight to the brokers in 16 KiB batches)."
        % "; ".join(CLIENT_TEXT[k] % vars(args) for k in args.clients),
        "",
        "How to read it: each cell is the record-value bytes a client got through per second "
        "in that window, divided by its quota (%s). %g-%g s is the start (burst), %g-%g s the "
        "steady state, from each client's own start: the Python clients together once "
        "connected, the Java clients with their first records (the JVM's start and the group "
        "join are not counted), a second or two before them. **Kafka enforces a client-id's "
        "quota on each broker on its own**: a client whose partitions are led by N brokers may "
        "get up to N times its quota (\"brokers it uses\"), and Kafka's sampled window lets a "
        "new client start with about 10 s of quota in hand on each. kthrottle puts all of a "
        "client's connections to all brokers in one bucket. (!): see the notes under Details."
        % (MEASURED_BY, e0, e1, s0, s1),
        "",
    ]
    lines += side_by_side_lines(runs, args)
    lines += ["", "## Details", "",
              "Every client and enforcer, the whole period, the best second, and kthrottle's "
              "own view from its /metrics at the end of the period (Kafka's own throttle "
              "counters are in its JMX metrics, not read here).", ""]
    lines += table_lines(runs, args)
    if kafka.get("configs"):
        lines += ["", "Kafka's quotas as `kafka-configs --describe --entity-type clients` "
                  "listed them before its part of the run:", "", "```"]
        lines += kafka["configs"] + ["```"]
    if any(r.quota == KAFKA_REFERENCE["quota"] and r.kind.endswith("producer") for r in runs):
        lines += ["", "## Against the team's Kafka 2.2 reference", ""]
        lines += reference_lines(runs, args)
        lines += ["", REFERENCE_TEXT]
    if "kthrottle" in args.enforcers:
        lines += ["", MODES_TEXT]
    if "ck-producer" in python_kinds:
        lines += ["", BATCH_SIZE_TEXT % args.ck_batch_size]
    lines += ["", "![throttle accuracy](throttle_accuracy.png)"]
    return "\n".join(lines) + "\n"


def leaders_text(by_topic, nodes):
    """Whether every topic's partitions were led by as many brokers as it has partitions."""
    by_topic = by_topic or {}
    spread = [t for t, leaders in by_topic.items()
              if len(set(leaders)) >= min(len(leaders), nodes)]
    if len(spread) == len(by_topic):
        return "each led by another broker (all %d topics)" % len(by_topic)
    return "each led by another broker in %d of %d topics (the others: %s)" % (
        len(spread), len(by_topic), "; ".join("%s led by %s" % (t, list(leaders))
                                               for t, leaders in by_topic.items()
                                               if t not in spread))


ENFORCER_TEXT = {
    "kthrottle": "kthrottle (quota modes %(modes)s): the quotas in its quota file "
                 "(`clients/<client-id>`), a fresh proxy per mode in front of all brokers (a "
                 "port per node, --node-ports%(burst)s), the clients through it, no quota on "
                 "the brokers",
    "kafka": "Kafka's quotas: the same quotas as `clients/<client-id>` entities on the cluster "
             "(AlterClientQuotas, checked on every broker with DescribeClientQuotas; "
             "kafka-configs lists %(entities)s entities), the clients straight to the brokers, "
             "no proxy",
}
CLIENT_TEXT = {
    "aio-producer": "aio-producer, aiokafka, acks=1, linger %(linger_ms)d ms, max_batch_size "
                    "16384, at most %(max_in_flight)d records unacknowledged, round robin over "
                    "the partitions",
    "ck-producer": "ck-producer, confluent-kafka, acks=1, linger %(linger_ms)d ms, batch.size "
                   "%(ck_batch_size)d, otherwise librdkafka's defaults, round robin over the "
                   "partitions",
    "aio-consumer": "aio-consumer, aiokafka, max_partition_fetch_bytes %(fetch_bytes)d, "
                    "fetch_max_bytes %(fetch_max_bytes)d, every partition assigned",
    "java-producer": "java-producer, Kafka's ProducerPerformance --throughput -1, acks=1, "
                     "linger.ms %(linger_ms)d, otherwise the Java client's defaults (batch.size "
                     "16384, buffer.memory 32 MiB, its own partitioner)",
    "java-consumer": "java-consumer, Kafka's ConsoleConsumer (a classic consumer group) "
                     "printing each record's partition, the Java client's defaults "
                     "(fetch.max.bytes 50 MiB, max.partition.fetch.bytes 1 MiB, "
                     "max.poll.records 500)",
}
MEASURED_BY = ("Python producers: acknowledged records, timed at the delivery callback / "
               "future; java-producer: its records reaching the brokers, their log end offsets "
               "looked at every %g s; aio-consumer: bytes returned by getmany; java-consumer: "
               "the records it prints, as they come (looked at every %g s)"
               % (OFFSETS_EVERY, TAIL_EVERY))


def draw(plt, runs, args):
    """One panel per (mode or enforcer, quota size) measured: each client's per-second
    rate."""
    rows = [setup for setup in setups(args) if any(r.setup == setup for r in runs)]
    quotas = [q for q in args.quotas if any(r.quota == q for r in runs)]
    (e0, e1), (s0, s1) = windows(args)
    fig, axes = plt.subplots(len(rows), len(quotas), squeeze=False,
                             figsize=(max(4.6 * len(quotas), 6.5), 3.4 * len(rows)))
    style = {"aio-producer": ("tab:blue", "-", "o"), "ck-producer": ("tab:orange", "--", "s"),
             "aio-consumer": ("tab:green", "-", "^"), "java-producer": ("tab:red", "-.", "D"),
             "java-consumer": ("tab:purple", ":", "v")}
    for i, setup in enumerate(rows):
        for j, quota in enumerate(quotas):
            ax = axes[i][j]
            q_kb = quota / 1000.0
            top = 4.0 * q_kb
            for run in runs:
                if run.setup != setup or run.quota != quota:
                    continue
                series = [b / 1000.0 for b in run.series()]
                xs = [k + 0.5 for k in range(len(series))]
                label = run.kind
                clipped = [(k, y) for k, y in enumerate(series) if y > top]
                if clipped:  # say how high the clipped seconds went
                    label += " (%s)" % ", ".join("%gx at %d s" % (round(y / q_kb, 1), k)
                                                 for k, y in clipped[:2])
                color, line, marker = style[run.kind]
                ax.plot(xs, series, marker=marker, markersize=2.5, linewidth=1, color=color,
                        linestyle=line, label=label, alpha=0.85)
            ax.axhline(q_kb, color="k", linestyle="--", linewidth=1, label="quota")
            ax.axvspan(e0, e1, color="tab:red", alpha=0.06)
            ax.axvspan(s0, s1, color="tab:gray", alpha=0.08)
            ax.set_ylim(0, top * 1.02)
            ax.set_xlim(0, run_seconds(quota, args))
            ax.set_title("%s, quota %g KB/s" % (
                setup.mode if args.broker == "tansu" else setup.label, q_kb), fontsize=9)
            ax.set_xlabel("seconds since start", fontsize=8)
            ax.set_ylabel("KB/s delivered (per second)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper right")
    fig.suptitle("Achieved rate per second %s\n(shaded: start and steady windows; above "
                 "4x quota clipped, peaks in the legend)" % (
                     "through kthrottle" if args.broker == "tansu"
                     else "through kthrottle and under Kafka's own quotas"), fontsize=9)
    fig.tight_layout()
    return fig


def print_runs(runs, args):
    for run in runs:
        s = summarize(run, args)
        print("    %-13s %-18s start %s  steady %s  whole %s  peak %s  proxy %s%s" % (
            run.kind, run.client_id, fx(s["early"]), fx(s["steady"]), fx(s["whole"]),
            fx(s["peak"]), fx(s["proxy_rate"]),
            ("  [%s]" % notes_of(run, s)) if notes_of(run, s) else ""), flush=True)


# --------------------------------------------------------------------------- main


FLAGS = (
    ("--seconds", float, 30.0, "measured period per quota size (all clients of one size run "
     "at once)"),
    ("--quotas", None, "50000,200000,1000000", "comma-separated quota sizes in bytes per "
     "second; each client gets this as its producer_byte_rate or consumer_byte_rate"),
    ("--modes", None, ",".join(MODES), "comma-separated kthrottle --quota-mode values; a "
     "fresh proxy per mode"),
    ("--kafka-nodes", int, 3, "--broker kafka: the cluster's nodes (KRaft, each broker and "
     "controller); every topic gets a partition per node"),
    ("--clients", None, None, "comma-separated clients of %s (default: the Python ones on "
     "Tansu, all on Kafka; the Java ones need --broker kafka)" % ", ".join(CLIENTS)),
    ("--reference-seconds", float, None, "the quota size of Kafka's reference measurement "
     "(200000 B/s), when in --quotas, runs this long (if longer than --seconds) so that the "
     "reference's windows (12-27 s, 25-65 s) can be compared; 0: no longer (default: 65 on "
     "Tansu, 0 on Kafka, where Kafka's own quotas are measured)"),
    ("--early-seconds", float, 5.0, "the start window is 0 to this many seconds"),
    ("--steady-from", float, 10.0, "the steady window runs from here to --seconds (from "
     "--seconds/2 when the run is shorter than this)"),
    ("--burst-seconds", float, None, "pass --quota-burst-seconds to the proxy (token-bucket "
     "mode; default: the proxy's own default, 1 s)"),
    ("--record-size", int, 1024, "record value size in bytes"),
    ("--linger-ms", int, 5, "linger for both producers"),
    ("--max-in-flight", int, 256, "most unacknowledged records of the aiokafka producer"),
    ("--ck-batch-size", int, 16384, "confluent-kafka batch.size (librdkafka's default: 1000000)"),
    ("--fetch-bytes", int, 64 * 1024, "aiokafka consumer max_partition_fetch_bytes"),
    ("--fetch-max-bytes", int, None, "aiokafka consumer fetch_max_bytes, the whole response's "
     "limit (default: --fetch-bytes). Tansu ignores the per-partition limit and honours only "
     "this one, so with aiokafka's default (52428800) every fetch is as large as the proxy's "
     "cap (window mode: quota x 10 s; token-bucket: the burst allowance)"),
)


def parse_args(argv=None):
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, output_help="where "
                            "throttle_accuracy.md and throttle_accuracy.png are written")
    p.add_argument("--broker", choices=BROKERS, default="tansu",
                   help="tansu: one Tansu broker (in memory); kafka: an Apache Kafka 4.4 KRaft "
                   "cluster of --kafka-nodes nodes (kthrottle/kafka_kit.py, jars through "
                   "scripts/kafka-jars), started here")
    p.add_argument("--enforcers", "--enforcer", default=None,
                   help="comma-separated: kthrottle (the quota file, the clients through a "
                   "proxy per --modes entry) and kafka (the same quotas set on the cluster, the "
                   "clients straight to the brokers; --broker kafka only) (default: kthrottle on "
                   "Tansu, kthrottle,kafka on Kafka)")
    args = p.parse_args(argv)
    try:
        args.quotas = [int(float(q)) for q in args.quotas.split(",") if q.strip()]
    except ValueError:
        p.error("--quotas: comma-separated numbers, e.g. 50000,200000")
    args.modes = harness.names(args.modes)
    if not args.quotas or min(args.quotas) < 1:
        p.error("--quotas: at least one positive quota")
    if len(set(quota_label(q) for q in args.quotas)) != len(args.quotas):
        p.error("--quotas: give distinct quota sizes")
    unknown = set(args.modes) - set(MODES)
    if unknown or not args.modes:
        p.error("--modes: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(MODES)))
    kafka = args.broker == "kafka"
    args.enforcers = harness.names(args.enforcers or ("kthrottle,kafka" if kafka else "kthrottle"))
    unknown = set(args.enforcers) - set(ENFORCERS)
    if unknown or not args.enforcers:
        p.error("--enforcers: unknown %s (choose from %s)" % (sorted(unknown),
                                                              ", ".join(ENFORCERS)))
    if "kafka" in args.enforcers and not kafka:
        p.error("--enforcers kafka needs --broker kafka (Tansu enforces no quotas)")
    args.clients = harness.names(args.clients or ",".join(CLIENTS if kafka else PY_CLIENTS))
    unknown = set(args.clients) - set(CLIENTS)
    if unknown or not args.clients:
        p.error("--clients: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(CLIENTS)))
    args.clients = [k for k in CLIENTS if k in args.clients]  # one order for every table
    if not kafka and set(args.clients) & set(JAVA_CLIENTS):
        p.error("the Java clients need --broker kafka (the jars come with it)")
    if not 1 <= args.kafka_nodes <= 9:
        p.error("--kafka-nodes must be between 1 and 9")
    if args.reference_seconds is None:
        args.reference_seconds = 0.0 if kafka else 65.0
    if args.seconds < 2 or args.seconds > 600:
        p.error("--seconds must be between 2 and 600")
    if not 0 <= args.reference_seconds <= 600:
        p.error("--reference-seconds must be between 0 and 600")
    if args.fetch_max_bytes is None:
        args.fetch_max_bytes = args.fetch_bytes
    if min(args.record_size, args.max_in_flight, args.ck_batch_size, args.fetch_bytes,
           args.fetch_max_bytes) < 1:
        p.error("sizes must be >= 1")
    return args


def preload_records(quota, args):
    """Enough data that the consumers never run dry: the window mode's initial burst is
    about 10 s of quota, its steady state about 10% over; 1.5x on top of that. Kafka's own
    quotas hold a client on each broker on its own: up to that many times as much."""
    seconds = run_seconds(quota, args) + 15
    brokers = args.kafka_nodes if "kafka" in args.enforcers else 1
    return int(quota * seconds * 1.5 * brokers / args.record_size) + 1


def java_producer_records(quota, args):
    """ProducerPerformance's --num-records: more than it could write at ten times its quota
    (plus Kafka's bursts on every broker), so that it runs the whole period; bounded, so
    that a client no one holds back fills no disk."""
    seconds = run_seconds(quota, args) + 30
    return int(quota * seconds * 10 * args.kafka_nodes / args.record_size) + 1000


@dataclass
class Cell:
    """Where the clients of one enforcer (and quota mode) connect: a proxy, or the brokers
    themselves when Kafka enforces."""

    setup: Setup
    bootstrap: str
    brokers: Brokers
    procs: harness.Processes
    args: object
    proxy: Optional[harness.Endpoint] = None

    @property
    def admin_port(self):
        return self.proxy.admin_port if self.proxy is not None else None

    def java_records(self, kind, quota):
        if kind == "java-producer":
            return java_producer_records(quota, self.args)
        return preload_records(quota, self.args)  # the consumer ends at the preload's end


def measure_quota(runner, cell, quota, topics, args, failures):
    """All clients of one quota size in ``cell``: their ClientRuns, or none if the
    measurement failed (said, and added to ``failures``)."""
    producers = [kind for kind in args.clients if QUOTA_KEY[kind] == "producer_byte_rate"]
    for kind in producers:
        cell.brokers.create_topic(topics[kind])
    print("  %s, quota %s B/s, %g s ..." % (
        cell.setup.mode if args.broker == "tansu" else cell.setup.label, format(quota, ","),
        run_seconds(quota, args)), flush=True)
    try:
        got = runner.run(asyncio.wait_for(run_quota(cell, quota, topics, args),
                                          run_seconds(quota, args) + 180))
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise
    except Exception as exc:
        text = "%s, %s: %s: %s" % (cell.setup.label, quota, type(exc).__name__, exc)
        failures.append(text)
        print("    ! " + text, flush=True)
        got = []
    for kind in producers:
        cell.brokers.delete_topic(topics[kind])
    print_runs(got, args)
    if cell.proxy is not None and cell.proxy.proc.poll() is not None:
        raise RuntimeError("the proxy exited (code %s)" % cell.proxy.proc.returncode)
    gone = cell.brokers.alive()
    if gone:
        raise RuntimeError(gone)
    return got


def measure_all(run, args, runs, failures, kafka):
    """Every (enforcer and mode, quota size): one broker side, one proxy per kthrottle mode,
    Kafka's quotas set once for its part; adds to ``runs``, and what the report says of the
    Kafka cluster to ``kafka``."""
    brokers = Brokers(run, args)
    quota_file = run.path("quotas.toml")
    write_quota_file(quota_file, args.quotas, args.clients)
    if brokers.cluster is not None:
        from kthrottle import kafka_kit

        kafka.update(description=brokers.description, java=kafka_kit.java_version(),
                     leaders_by_topic=brokers.leaders)  # filled as topics are made
    run_id = uuid.uuid4().hex[:6]
    consumers = [kind for kind in args.clients if QUOTA_KEY[kind] == "consumer_byte_rate"]
    producers = [kind for kind in args.clients if QUOTA_KEY[kind] == "producer_byte_rate"]
    consumer_topics = {}
    value = b"x" * args.record_size
    for quota in (args.quotas if consumers else ()):  # one topic per size, for every consumer
        topic = consumer_topics[quota] = "ta-%s-%s-consumers" % (run_id, quota_label(quota))
        brokers.create_topic(topic)
        n = preload_records(quota, args)
        t = time.monotonic()
        preload(brokers.bootstrap, topic, n, value, brokers.partitions)
        print("preloaded %s: %d records (%.0f MB) in %.1f s"
              % (topic, n, n * args.record_size / 1e6, time.monotonic() - t), flush=True)
    with harness.new_runner() as runner:
        for setup in setups(args):
            proxy = None
            if setup.enforcer == "kthrottle":
                proxy = start_proxy(run, brokers, quota_file, setup.mode, args)
                print("kthrottle --quota-mode %s: pid %d on %s, admin on 127.0.0.1:%d"
                      % (setup.mode, proxy.proc.pid, proxy.bootstrap, proxy.admin_port),
                      flush=True)
                bootstrap = proxy.bootstrap
            else:
                t = time.monotonic()
                listed = brokers.set_client_quotas({
                    setup.client_id(kind, quota): {QUOTA_KEY[kind]: quota}
                    for quota in args.quotas for kind in args.clients})
                kafka.update(configs=listed, entities=len(listed))
                print("Kafka's quotas: %d clients/<client-id> entities on every broker, as "
                      "kafka-configs lists them (%.1f s)" % (len(listed), time.monotonic() - t),
                      flush=True)
                bootstrap = brokers.bootstrap
            cell = Cell(setup, bootstrap, brokers, run.procs, args, proxy)
            try:
                for quota in args.quotas:
                    topics = {kind: "ta-%s-%s-%s-%s" % (run_id, setup.mode or "kafka",
                                                        quota_label(quota), kind)
                              for kind in producers}
                    topics.update({kind: consumer_topics[quota] for kind in consumers})
                    runs += measure_quota(runner, cell, quota, topics, args, failures)
            finally:
                if proxy is not None:
                    run.procs.stop(proxy.proc)


def main(argv=None):
    args = parse_args(argv)
    harness.output_dir(args, "throttle_accuracy")
    command = harness.command_line("throttle_accuracy", argv)
    facts = harness.machine_facts()
    runs, failures, kafka = [], [], {}
    with harness.Run("throttle_accuracy") as run:
        measure_all(run, args, runs, failures, kafka)
    elapsed = run.elapsed
    failures += [run.failure] if run.failure else []
    if not runs:
        print("nothing measured", file=sys.stderr)
        return run.finish(failed=True)
    report = markdown_report(runs, facts, args, elapsed, command, run.interrupted, kafka)
    if failures:
        report += "\nFailures:\n\n" + "\n".join("- " + f for f in failures) + "\n"
    print()
    print(report)
    harness.write_results(args.output_dir, "throttle_accuracy", markdown=report,
                          draw=lambda plt: draw(plt, runs, args))
    return run.finish(failed=bool(failures))


if __name__ == "__main__":
    sys.exit(main())
