"""Share groups (KIP-932) through the proxy, on a real Apache Kafka 4 broker, consumed by Kafka's
own share consumer (kafka-tools' ConsoleShareConsumer, a KafkaShareConsumer): every record
arrives, the consumer only ever talks to the proxy, and a consumer_byte_rate quota on its
client-id holds it (ShareFetch counts on the fetch quota sensor, as Fetch does: apache/kafka
PR #20163).

The proxy is put in front of the broker's [::1]-only listener and the share consumer runs with
IPv4 sockets only: it cannot reach the broker at all, so a broker address left unrewritten
(Metadata, FindCoordinator for the share coordinator) shows as records that never arrive. The
consumer's own connections, and every connection to the broker's listener, are watched too
(psutil). A healthy one-node cluster never sends the KIP-951 NodeEndpoints of ShareFetch and
ShareAcknowledge (they come with NOT_LEADER_OR_FOLLOWER): codec tests cover their rewriting.
"""
import os
import signal
import subprocess
import threading
import time
import uuid

import psutil
import pytest

from kthrottle.kafka_kit import CONSOLE_SHARE_CONSUMER, IPV4_ONLY_JVM_ARGS
from kthrottle.embedded import _die_with_parent, free_port
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

QUOTA = 100_000  # consumer_byte_rate, bytes per second
WINDOW = 15.0  # seconds of share consumption measured against the quota


class ShareConsumer:
    """ConsoleShareConsumer as a process: each record it prints, with the time it arrived;
    every TCP peer it connects to; and every process connected to ``watch`` (the (ip, port) of
    the broker listener the proxy uses) while it runs."""

    def __init__(self, kafka, bootstrap, topic, group, log_path, client_id=None,
                 max_messages=None, idle_timeout_ms=None, properties=None, watch=None):
        args = ["--bootstrap-server", bootstrap, "--topic", topic, "--group", group]
        if max_messages is not None:
            args += ["--max-messages", max_messages]
        if idle_timeout_ms is not None:
            args += ["--timeout-ms", idle_timeout_ms]
        props = dict(properties or {})
        if client_id:
            props["client.id"] = client_id
        for name, value in props.items():
            args += ["--command-property", "%s=%s" % (name, value)]
        self.command = kafka.java_command(CONSOLE_SHARE_CONSUMER, *args,
                                          jvm_args=IPV4_ONLY_JVM_ARGS)
        self.log_path = log_path
        self.watch = watch
        self.records = []  # (monotonic time, value)
        self.peers = set()  # (ip, port) the consumer connected to
        self.watched = set()  # pids with a connection to watch
        self.proc = None
        self._threads = []

    def start(self):
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._watch, daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            self.records.append((time.monotonic(), line.rstrip(b"\n")))

    def _watch(self):
        me = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                for c in me.net_connections(kind="tcp"):
                    if c.raddr:
                        self.peers.add((c.raddr.ip, c.raddr.port))
                if self.watch:
                    for c in psutil.net_connections(kind="tcp"):
                        if c.raddr and (c.raddr.ip, c.raddr.port) == self.watch and c.pid:
                            self.watched.add(c.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            time.sleep(0.05)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # its shutdown hook closes the consumer
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for t in self._threads:
            t.join(5)
        self._log.close()

    def log(self):
        return self.log_path.read_text(errors="replace")


def upstream_of(kafka):
    """The broker listener the proxy is put in front of: [::1] only, where there is one."""
    return kafka.bootstrap_ipv6 or kafka.bootstrap


def upstream_address(kafka):
    return ("::1", kafka.ipv6_port) if kafka.ipv6_port else (kafka.host, kafka.port)


def produce(bootstrap, topic, values, client_id="share-test-producer"):
    from confluent_kafka import Producer

    # the Java client's batch size: a share fetch hands out whole batches, and librdkafka's
    # 1 MB ones would come in 10 s steps at the quota below
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                         "linger.ms": 5, "acks": "all", "batch.size": 16384})
    failed = []
    for value in values:
        while True:
            try:
                producer.produce(topic, value,
                                 on_delivery=lambda err, msg: err and failed.append(err))
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0
    assert not failed, failed[:3]


@pytest.fixture(scope="module")
def share_run(apache_kafka, tmp_path_factory):
    """One share consumer through a plain proxy (no quotas) reading N records produced through
    the same proxy: what tests (a) and (b) look at."""
    kafka = apache_kafka
    tmp = tmp_path_factory.mktemp("share-groups")
    run = uuid.uuid4().hex[:8]
    topic, group = "share-%s" % run, "share-group-%s" % run
    kafka.create_topic(topic, partitions=3)
    # a share group starts at the latest offset unless told otherwise (KIP-932)
    kafka.set_group_config(group, share_auto_offset_reset="earliest")
    proxy = ProxyProcess(upstream_of(kafka), tmp / "proxy.log", node_id=kafka.node_id).start()
    values = [b"record-%05d" % i for i in range(300)]
    try:
        produce(proxy.bootstrap, topic, values)
        consumer = ShareConsumer(kafka, proxy.bootstrap, topic, group, tmp / "consumer.log",
                                 client_id="share-test", max_messages=len(values),
                                 idle_timeout_ms=20000, watch=upstream_address(kafka))
        started = time.monotonic()
        consumer.start().wait(90)
        consumer.took = time.monotonic() - started
    finally:
        proxy.stop()
    yield values, consumer, proxy


def test_every_record_reaches_a_share_consumer_through_the_proxy(share_run):
    values, consumer, proxy = share_run
    got = [v for _, v in consumer.records]
    assert sorted(got) == values, (
        "%d of %d records arrived (%d distinct) in %.1f s\nconsumer log:\n%s\nproxy log:\n%s"
        % (len(got), len(values), len(set(got)), consumer.took, consumer.log()[-3000:],
           proxy.log()[-3000:]))


def test_the_share_consumer_only_ever_connects_to_the_proxy(share_run, apache_kafka):
    values, consumer, proxy = share_run
    kafka = apache_kafka
    proxy_ports = {("127.0.0.1", p) for p in proxy.ports}
    assert consumer.peers, "no connection of the share consumer was seen"
    assert consumer.peers <= proxy_ports, (
        "the share consumer connected to %s; the proxy listens on %s, the broker on %s"
        % (sorted(consumer.peers), sorted(proxy_ports), kafka.bootstrap_ipv6 or kafka.bootstrap))
    # it fetched from the node listener (the address the proxy rewrote), not only bootstrap
    assert ("127.0.0.1", proxy.node_port) in consumer.peers
    # nobody but the proxy was connected to the broker's listener while it ran (and the
    # proxy was seen there: the watch works)
    assert consumer.watched == {proxy.proc.pid}, (consumer.watched, proxy.proc.pid)


def test_a_share_consumer_that_cannot_use_ipv6_cannot_reach_the_broker_itself(apache_kafka,
                                                                              tmp_path):
    """The premise of the test above: without the proxy the same consumer gets nothing."""
    kafka = apache_kafka
    if not kafka.bootstrap_ipv6:
        pytest.skip("no IPv6 loopback here: the broker has no [::1]-only listener, and only the "
                    "connections observed show that the share consumer kept to the proxy")
    run = uuid.uuid4().hex[:8]
    topic, group = "share-direct-%s" % run, "share-direct-%s" % run
    kafka.create_topic(topic)
    kafka.set_group_config(group, share_auto_offset_reset="earliest")
    produce(kafka.bootstrap, topic, [b"direct"])
    consumer = ShareConsumer(kafka, kafka.bootstrap_ipv6, topic, group, tmp_path / "consumer.log",
                             max_messages=1, idle_timeout_ms=5000)
    consumer.start().wait(60)
    assert consumer.records == [], consumer.log()[-3000:]
    assert not consumer.peers, consumer.peers
    # and for the reason meant: an IPv4-only JVM cannot open a socket to [::1]
    assert "UnsupportedAddressTypeException" in consumer.log(), consumer.log()[-3000:]


def metrics(port):
    import urllib.request

    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        return r.read().decode()


def test_a_consumer_byte_rate_quota_holds_a_share_consumer(apache_kafka, tmp_path):
    kafka = apache_kafka
    run = uuid.uuid4().hex[:8]
    topic, group, client_id = "share-quota-%s" % run, "share-quota-%s" % run, "share-quota"
    kafka.create_topic(topic)
    kafka.set_group_config(group, share_auto_offset_reset="earliest")
    value = b"x" * 1000
    # far more than WINDOW s of quota: unthrottled, the consumer reads it all in a second or two
    produce(kafka.bootstrap, topic, [value] * 4000)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."%s"]\nconsumer_byte_rate = %d\n' % (client_id, QUOTA))
    admin = free_port()
    proxy = ProxyProcess(upstream_of(kafka), tmp_path / "proxy.log", node_id=kafka.node_id,
                         extra_args=["--quota-file", str(quotas),
                                     "--admin-listen", "127.0.0.1:%d" % admin]).start()
    try:
        # small share fetches, so that one response is a small part of the quota
        consumer = ShareConsumer(kafka, proxy.bootstrap, topic, group, tmp_path / "consumer.log",
                                 client_id=client_id,
                                 properties={"max.poll.records": 50, "fetch.max.bytes": 65536,
                                             "max.partition.fetch.bytes": 65536}).start()
        deadline = time.monotonic() + 60
        while not consumer.records and time.monotonic() < deadline and consumer.proc.poll() is None:
            time.sleep(0.05)
        assert consumer.records, "no record arrived:\n%s\n%s" % (consumer.log()[-3000:],
                                                                 proxy.log()[-3000:])
        first = consumer.records[0][0]
        time.sleep(max(0.0, first + WINDOW - time.monotonic()))
        text = metrics(admin)
        consumer.stop()
    finally:
        proxy.stop()
    received = sum(len(v) for t, v in consumer.records if t <= first + WINDOW)
    rate = received / WINDOW
    throttle = [line for line in text.splitlines() if client_id in line and "throttle" in line]
    print("share consumer: %d bytes in %.0f s = %.0f B/s (quota %d); %s"
          % (received, WINDOW, rate, QUOTA, throttle))
    print("bytes by second:", [sum(len(v) for t, v in consumer.records if s <= t - first < s + 1)
                               for s in range(int(WINDOW) + 1)])
    assert rate <= 1.3 * QUOTA, (
        "the share consumer read %.0f B/s, over 1.3 x its consumer_byte_rate %d (%d records of "
        "4000 in %.0f s); proxy metrics: %s" % (rate, QUOTA, received // len(value), WINDOW,
                                                throttle))
    # held to its quota, not starved
    assert rate >= 0.5 * QUOTA
