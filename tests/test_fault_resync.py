"""What the proxy keeps in force while a part of the system is gone, and how
it resyncs when it is back, with the metrics an operator alerts on (scraped
from the proxy's admin endpoint); and that a state that lasts is logged once,
not once per check.

First the logging rules without I/O (a fake clock). Then, every part real: a
ZooKeeper killed by its PID and started again on the same port (quotas and
the cluster state); the cluster state no longer refreshed, because the job
stopped (no new snapshot) or a volume agent stopped (a snapshot whose broker
has no fresh report); a fleet proxy whose usage reports cannot reach the
cluster. The test plays the Spark job: it writes the snapshot and the shares
znodes as the job's cycle does (``cluster_snapshot`` over the latest report of
each broker, read from the report topic; ``shares_document``), so that
stopping those writes stands for the job going away."""
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kthrottle.config import build_config
from kthrottle.kafka_kit import KafkaBroker
from kthrottle.embedded import free_port
from kthrottle.policy.fleet import ProxyShares, encode_shares_document, shares_document
from kthrottle.policy.quotas import QuotaManager
from kthrottle.policy.storage import (
    OPEN_STATE,
    PAUSE,
    PAUSE_STATE,
    THROTTLE,
    ClusterState,
    State,
    StoragePolicy,
    cluster_snapshot,
    encode_snapshot,
    parse_report,
)
from kthrottle.proxy.fleet import FleetMember, SharesFollower
from kthrottle.proxy.filters.storage import StorageThrottle
from kthrottle.sources.cluster_state import DEFAULT_ZNODE, shares_znode
from kthrottle.sources.kafka_publisher import PublishError
from kthrottle.sources.outage import Outage
from kthrottle_testkit import BROKER_NODE_ID, ROOT
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import BackgroundProducer, admin_get, produce_quotas, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

P = "producer_byte_rate"
WALL = 1_800_000_000.0


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# logged once per change (no I/O, the clock passed in) ---------------------------------

def storage_causes(log):
    """The storage throttle's changes of cause, in the order logged: each
    line's reason, its figures taken out (a state "5 s old" and "6 s old"
    have one cause)."""
    found = re.findall(r"kthrottle\.storage: storage: (.*?)(?:; the fail-safe|\n)", log)
    return [re.sub(r"[\d.]+ s", "N s", cause) for cause in found
            if "producers now meet" not in cause]


def test_an_outage_is_said_when_it_starts_when_its_reason_changes_and_when_it_ends():
    o = Outage(max_reasons=3)
    assert not o.failing and o.recovered() == 0
    assert [o.failed("refused") for _ in range(100)] == [True] + [False] * 99
    assert o.failed("timed out") and not o.failed("refused") and not o.failed("timed out")
    assert o.failed("a third reason") and not o.failed("a fourth")  # at most 3 lines
    assert o.failing and o.failures == 105 and o.reason == "a fourth"
    assert o.recovered() == 105 and not o.failing
    assert o.failed("refused")  # a new outage is said again
    # a reason that differs only in a number (a time waited) is the same reason
    o = Outage()
    assert o.failed("timed out after 2.999 secs") and not o.failed("timed out after 3.0 secs")


def test_a_stale_cluster_state_is_logged_once_not_every_second(caplog):
    caplog.set_level(logging.DEBUG, "kthrottle.storage")
    storage = StorageThrottle(StoragePolicy("cluster", PAUSE, max_age=120))
    storage.policy.update(ClusterState(WALL, OPEN_STATE))
    for t in range(600):  # ten minutes of the proxy's refresh every second
        storage.refresh(WALL + t, float(t))
    assert messages(caplog, logging.WARNING) == [
        "storage: the cluster state is 121 s old (max 120 s); the fail-safe (PAUSE) applies "
        "where the state is unknown"]
    assert messages(caplog, logging.INFO) == ["storage: producers now meet PAUSE"]
    # what the pause tells a held request is today's figure
    assert storage.current == PAUSE_STATE and str(storage.reason).startswith(
        "the cluster state is 599 s old")

    caplog.clear()  # fresh again for two minutes, then stale again: a line each way
    storage.policy.update(ClusterState(WALL + 600, OPEN_STATE))
    for t in range(600, 900):
        storage.refresh(WALL + t, float(t))
    assert messages(caplog, logging.INFO) == [
        "storage: the cluster state is known again", "storage: producers now meet OPEN",
        "storage: producers now meet PAUSE"]
    assert len(messages(caplog, logging.WARNING)) == 1

    caplog.clear()  # brokers without a fresh report: one line per set of brokers
    for t, unknown in [(t, [3]) for t in range(900, 960)] + [(t, [3, 4]) for t in
                                                              range(960, 1000)]:
        storage.policy.update(ClusterState(WALL + t, OPEN_STATE, unknown))
        storage.refresh(WALL + t, float(t))
    assert [m.split(";")[0] for m in messages(caplog, logging.WARNING)] == [
        "storage: no fresh volume report from broker(s) 3",
        "storage: no fresh volume report from broker(s) 3, 4"]


def test_a_throttle_factor_drifting_each_cycle_is_logged_per_tenth(caplog):
    caplog.set_level(logging.INFO, "kthrottle.storage")
    storage = StorageThrottle(StoragePolicy("cluster", PAUSE, max_age=120))
    for cycle in range(20):  # a filling volume: the factor falls a little each job cycle
        factor = round(0.95 - 0.03 * cycle, 2)
        storage.policy.update(ClusterState(WALL + cycle, State(THROTTLE, factor)))
        storage.refresh(WALL + cycle, float(cycle))
    logged = [float(re.search(r"factor ([0-9.]+)", m).group(1))
              for m in messages(caplog, logging.INFO)]
    assert logged == [0.95, 0.83, 0.71, 0.59, 0.47]  # each 0.1 or more from the last
    assert storage.current == State(THROTTLE, 0.38)  # every factor applied all the same


def test_stale_quota_shares_are_logged_once_not_every_second(caplog):
    from kthrottle.policy.fleet import parse_shares_document

    caplog.set_level(logging.DEBUG, "kthrottle.fleet")
    manager = QuotaManager({"clients/app": {P: 100_000.0}})
    follower = SharesFollower(manager, "a", max_age=60.0, fail_safe="equal", znode="/z")
    document = parse_shares_document(encode_shares_document(shares_document(
        ProxyShares("a", ("a", "b"), 0.5, [(P, "", "app", 25_000.0, 100_000.0)]), WALL, 1)))
    follower.update(document, WALL)
    caplog.clear()
    for t in range(600):
        follower.check(WALL + t)
    assert [m.split(";")[0] for m in messages(caplog, logging.WARNING)] == [
        "fleet: the quota shares (cycle 1) are 61 s old, more than --share-max-age-ms 60000"]
    assert not messages(caplog, logging.INFO)


class _Metadata:  # what KafkaPublisher.publish returns once acknowledged
    topic, partition, offset = "__kthrottle_proxy_usage", 0, 41


def test_usage_reports_failing_every_interval_are_logged_per_reason_and_once_back(caplog):
    caplog.set_level(logging.INFO, "kthrottle.fleet")
    config = build_config({}, {"bootstrap_servers": [("127.0.0.1", 9)], "proxy_id": "a",
                               "zookeeper": "127.0.0.1:9"})
    member = FleetMember(config, QuotaManager({}))  # nothing started: no I/O
    refused = PublishError("not published within 10s (127.0.0.1:9 PLAINTEXT): "
                           "KafkaTimeoutError: ...; last connection error: ECONNREFUSED")
    for _ in range(720):  # an hour of reports every 5 s
        member._published(False, refused)
    member._published(False, PublishError("publication failed: TopicAuthorizationFailed"))
    for _ in range(10):
        member._published(False, refused)
    member._published(True, _Metadata())
    member._published(True, _Metadata())
    assert member.errors == 731 and member.reports == 2
    errors = messages(caplog, logging.ERROR)
    assert len(errors) == 2
    assert errors[0].startswith("fleet: usage report not published: not published within 10s")
    assert errors[1] == ("fleet: usage reports still not published (721 failed so far), now: "
                         "publication failed: TopicAuthorizationFailed")
    assert messages(caplog, logging.INFO) == [
        "fleet: usage reports reach the cluster again (__kthrottle_proxy_usage-0 at offset "
        "41), after 731 failed publication(s)"]


# real components ----------------------------------------------------------------------

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="scripts/test installs ZooKeeper")

SLOW, FAST = 50_000, 20_000_000  # bytes/s


def metric(port, name, **labels):
    """The value of one series of the proxy's /metrics (None if absent)."""
    for line in admin_get(port, "/metrics").splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return None


def admin_proxy(bootstrap, log_path, *args):
    proxy = ProxyProcess(bootstrap, log_path, list(args))
    proxy.admin = free_port()
    proxy.extra_args += ["--admin-listen", "127.0.0.1:%d" % proxy.admin]
    return proxy.start()


def set_znode(zk, path, data):
    if zk.exists(path):
        zk.set(path, data)
    else:
        zk.create(path, data, makepath=True)


def alter_quota(hosts, client_id, rate):
    """As kafka-configs --zookeeper --alter writes it (the znode and the
    change notification)."""
    from kthrottle.sources.zookeeper import ZooKeeperQuotaStore

    store = ZooKeeperQuotaStore(hosts).connect()
    try:
        store.alter("clients/%s" % client_id, {P: rate})
    finally:
        store.close()


def kazoo(hosts):
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    return zk


@needs_zookeeper
def test_zookeeper_killed_keeps_the_quotas_and_a_change_made_meanwhile_is_picked_up(
        broker, tmp_path):
    server = zk_server.ZooKeeperServer(tmp_path / "zookeeper").start()
    interim = proxy = writer = None
    client, entity = "zk-app", "clients/zk-app"
    try:
        chroot = "/resync-%s" % uuid.uuid4().hex[:8]
        hosts = server.hosts + chroot
        alter_quota(hosts, client, SLOW)
        writer = kazoo(hosts)
        report = {111: parse_report(_report_json(time.time()))}
        set_znode(writer, DEFAULT_ZNODE, encode_snapshot(cluster_snapshot(
            report, [111], {}, time.time(), 60)))
        writer.stop()
        writer.close()
        writer = None
        topic = "resync-%s" % uuid.uuid4().hex[:8]
        broker.create_topic(topic)
        proxy = admin_proxy(broker.bootstrap, tmp_path / "proxy.log", "--zookeeper", hosts,
                            "--storage-scope", "cluster")
        proxy.wait_for_log("quotas from ZooKeeper %s: 1 entities" % hosts)
        a = proxy.admin
        with BackgroundProducer(proxy.bootstrap, topic, client) as producer:
            assert wait_until(lambda: set(produce_quotas(a, client).values()) == {(SLOW, entity)},
                              10)
            for source in ("quotas", "cluster_state"):
                assert metric(a, "kthrottle_zookeeper_connected", source=source) == 1
                assert metric(a, "kthrottle_zookeeper_disconnects_total", source=source) == 0

            # ZooKeeper dies: every session of the proxy says so, what was read stays
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            server.proc = None
            down = time.monotonic()
            assert wait_until(lambda: metric(a, "kthrottle_quota_source_healthy") == 0 and all(
                metric(a, "kthrottle_zookeeper_connected", source=s) == 0
                for s in ("quotas", "cluster_state")), 15)
            for source in ("quotas", "cluster_state"):
                assert metric(a, "kthrottle_zookeeper_disconnects_total", source=source) == 1
            assert metric(a, "kthrottle_storage_fail_safe") == 0  # the snapshot is not old yet
            assert metric(a, "kthrottle_storage_state", scope="cluster") == 0

            # the quota changes while the proxy cannot see it: another server on the same data
            interim = zk_server.ZooKeeperServer(server.dir).start()
            alter_quota(interim.hosts + chroot, client, FAST)
            interim.stop()
            interim = None
            before_restart = time.monotonic()
            assert set(produce_quotas(a, client).values()) == {(SLOW, entity)}
            assert producer.rate(down + 1, before_restart) < 2 * SLOW  # still held to it

            # back on the same port: resynced, the change applied to the live connection
            server.start()
            assert wait_until(lambda: metric(a, "kthrottle_quota_source_healthy") == 1 and all(
                metric(a, "kthrottle_zookeeper_connected", source=s) == 1
                for s in ("quotas", "cluster_state")), 20)
            assert wait_until(lambda: set(produce_quotas(a, client).values())
                              == {(FAST, entity)}, 10)
            changed = time.monotonic()
            time.sleep(2.0)
            assert producer.rate(changed + 0.5, changed + 2.0) > 10 * SLOW
        assert producer.error is None
        log = proxy.log()
        assert log.count("the last known quotas stay in force until it is back") == 1
        assert log.count("the cluster state in %s is not followed until it is back"
                         % DEFAULT_ZNODE) == 1
        assert log.count("ZooKeeper is back (%s): quotas resynced" % hosts) == 1
        assert log.count("following the cluster state in %s again" % DEFAULT_ZNODE) == 1
        assert proxy.alive()
    finally:
        for thing in (proxy, interim, server):
            if thing is not None:
                thing.stop()
        if writer is not None:
            writer.stop()
            writer.close()


def _report_json(at, soft="MinFreeBytes:2MiB", hard="MinFreeBytes:1MiB"):
    """A report of broker 111 with one volume far from its limits."""
    from kthrottle.policy.storage import BrokerReport, VolumeReport, parse_limit

    return BrokerReport(111, at, parse_limit(soft), parse_limit(hard),
                        (VolumeReport("sda1", 100 * 10 ** 9, 10 * 10 ** 9),)).to_json()


class Command:
    """A kthrottle command run by the test, stopped (or killed) by its own PID."""

    def __init__(self, log_path, *args):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class _PlayedJob:
    """A thread standing in for a periodic job: ``_cycle`` every ``interval``
    while running; ``pause`` stands for the job going away."""

    def __init__(self, interval):
        self.interval = interval
        self.running = threading.Event()
        self.error = None
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self):
        self.running.set()
        self._thread.start()
        return self

    def pause(self):
        self.running.clear()
        time.sleep(self.interval)  # a cycle under way ends

    def resume(self):
        self.running.set()

    def close(self):
        self._quit.set()
        self.running.set()
        self._thread.join(10)

    def _main(self):
        try:
            self._run()
        except Exception as exc:  # reported by the test
            self.error = exc

    def _run(self):
        while not self._quit.is_set():
            self.running.wait()
            if not self._quit.is_set():
                self._cycle()
            time.sleep(self.interval)


class StorageJob(_PlayedJob):
    """Plays ``kthrottle spark-sync`` for the cluster state, as its cycle
    does: the latest report of each broker in the report topic, then
    ``cluster_snapshot`` over them, written whole to the snapshot znode, every
    ``interval`` while running."""

    def __init__(self, bootstrap, topic, zk, freshness, interval=0.5):
        super().__init__(interval)
        self.bootstrap, self.topic, self.zk = bootstrap, topic, zk
        self.freshness = freshness
        self.written = 0
        self._latest = {}
        self._consumer = None

    def _run(self):
        from kafka import KafkaConsumer

        self._consumer = KafkaConsumer(bootstrap_servers=self.bootstrap,
                                       enable_auto_commit=False)
        try:
            super()._run()
        finally:
            self._consumer.close()

    def _cycle(self):
        from kafka import TopicPartition

        consumer = self._consumer
        if not consumer.assignment() and consumer.partitions_for_topic(self.topic):
            tp = TopicPartition(self.topic, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
        if consumer.assignment():
            for records in consumer.poll(timeout_ms=100).values():
                for r in records:
                    report = parse_report(r.value)
                    self._latest[report.broker_id] = report
        if self._latest:
            set_znode(self.zk, DEFAULT_ZNODE, encode_snapshot(cluster_snapshot(
                self._latest, [BROKER_NODE_ID], {}, time.time(), self.freshness)))
            self.written += 1


class TrickleProducer:
    """One record at a time through the proxy, each waited for (kafka-python,
    on a thread): ``acked(t0, t1)`` counts the acknowledgements between two
    time.monotonic() instants."""

    def __init__(self, bootstrap, topic):
        from kafka import KafkaProducer

        self.producer = KafkaProducer(bootstrap_servers=bootstrap, client_id="trickle",
                                      request_timeout_ms=30000, linger_ms=0)
        self.topic = topic
        self.acks = []
        self.error = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self):
        try:
            while not self._stop.is_set():
                self.producer.send(self.topic, b"x" * 100, partition=0).get(timeout=30)
                self.acks.append(time.monotonic())
                time.sleep(0.1)
        except Exception as exc:  # reported by the test
            self.error = exc

    def acked(self, t0, t1=float("inf")):
        return sum(1 for t in list(self.acks) if t0 <= t < t1)

    def close(self):
        self._stop.set()
        self._thread.join(40)
        self.producer.close(timeout=5)


@needs_zookeeper
def test_a_cluster_state_no_longer_refreshed_takes_the_fail_safe_then_resyncs(
        broker, zookeeper, tmp_path):
    chroot = "/state-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    zk = kazoo(hosts)
    reports = "vu-%s" % uuid.uuid4().hex[:8]
    log_dir = tmp_path / "kafka-logs"
    (log_dir / "orders-0").mkdir(parents=True)
    agent_args = ("volume-agent", "--bootstrap-server", broker.bootstrap, "--broker-id",
                  str(BROKER_NODE_ID), "--log-dir", str(log_dir), "--soft-limit",
                  "MinFreeBytes:2MiB", "--hard-limit", "MinFreeBytes:1MiB", "--interval",
                  "500ms", "--topic", reports)
    agent = Command(tmp_path / "agent.log", *agent_args)
    job = StorageJob(broker.bootstrap, reports, zk, freshness=3.0).start()
    proxy = producer = None
    topic = "state-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    try:
        proxy = admin_proxy(broker.bootstrap, tmp_path / "proxy.log", "--zookeeper", hosts,
                            "--storage-scope", "cluster", "--storage-max-age-ms", "3000")
        a = proxy.admin

        def known():
            return (metric(a, "kthrottle_storage_fail_safe") == 0
                    and metric(a, "kthrottle_storage_state", scope="broker",
                               broker=str(BROKER_NODE_ID)) == 0
                    and metric(a, "kthrottle_storage_state", scope="cluster") == 0)

        assert wait_until(known, 20), proxy.log()[-2000:]
        assert metric(a, "kthrottle_cluster_state_age_seconds") < 2
        producer = TrickleProducer(proxy.bootstrap, topic)
        assert wait_until(lambda: producer.acked(0) >= 3, 10)

        # the job goes away: no new snapshot; it ages, then the fail-safe (PAUSE)
        job.pause()
        stopped = time.monotonic()
        time.sleep(1.0)
        young = metric(a, "kthrottle_cluster_state_age_seconds")
        assert metric(a, "kthrottle_storage_fail_safe") == 0 and young < 3
        assert wait_until(lambda: metric(a, "kthrottle_storage_fail_safe") == 1, 8)
        assert metric(a, "kthrottle_cluster_state_age_seconds") > 3 > young
        assert metric(a, "kthrottle_storage_state", scope="cluster") == 2  # PAUSE
        held = time.monotonic()
        deferred = metric(a, "kthrottle_storage_deferred_requests_total")
        time.sleep(2.0)  # the proxy checks every second meanwhile
        assert producer.acked(held + 0.5) == 0  # its produce waits, unread
        assert metric(a, "kthrottle_storage_deferred_requests_total") > deferred
        assert proxy.log().count("storage: the cluster state is") == 1  # once, not per second

        # the job is back: a fresh snapshot ends the fail-safe, the held produce goes on
        job.resume()
        assert wait_until(known, 5)
        resumed = time.monotonic()
        assert wait_until(lambda: producer.acked(resumed) >= 3, 10)
        assert proxy.log().count("storage: the cluster state is known again") == 1
        assert time.monotonic() - stopped < 30

        # the volume agent goes away: the job writes on, its broker has no fresh report
        agent.kill()
        assert wait_until(lambda: metric(a, "kthrottle_storage_fail_safe") == 1, 10)
        assert metric(a, "kthrottle_storage_state", scope="broker",
                      broker=str(BROKER_NODE_ID)) == 3  # UNKNOWN
        assert metric(a, "kthrottle_storage_state", scope="cluster") == 2
        assert metric(a, "kthrottle_cluster_state_age_seconds") < 2  # the job is alive
        time.sleep(1.5)
        # said when it began, not at each check (1 s) since; a slow machine
        # may see the state's cause change meanwhile (a job cycle late: the
        # state is old for a moment), each change said once
        causes = storage_causes(proxy.log())
        assert causes[-1] == "no fresh volume report from broker(s) %d" % BROKER_NODE_ID
        assert all(a != b for a, b in zip(causes, causes[1:])), causes

        # and back: its first report makes the broker known again
        agent = Command(tmp_path / "agent.log", *agent_args)
        assert wait_until(known, 15)
        back = time.monotonic()
        assert wait_until(lambda: producer.acked(back) >= 3, 10)
        assert proxy.log().count("storage: the cluster state is known again") == 2
        assert job.error is None and producer.error is None
        assert proxy.alive()
    finally:
        if producer is not None:
            producer.close()
        job.close()
        agent.stop()
        if proxy is not None:
            proxy.stop()
        zk.stop()
        zk.close()


class SharesJob(_PlayedJob):
    """Plays ``kthrottle spark-sync`` for one fleet member's quota shares:
    a shares document (``shares_document``, as the job writes it) every
    ``interval`` while running."""

    def __init__(self, zk, proxy_id, entries, proxies, interval=0.5):
        super().__init__(interval)
        self.zk, self.znode = zk, shares_znode(proxy_id)
        self.shares = ProxyShares(proxy_id, tuple(proxies), 1.0 / len(proxies), entries)
        self.cycle = 0

    def start(self):
        self._cycle()  # in force before the proxy starts
        return super().start()

    def _cycle(self):
        self.cycle += 1
        set_znode(self.zk, self.znode, encode_shares_document(
            shares_document(self.shares, time.time(), self.cycle)))


@needs_zookeeper
def test_usage_reports_that_cannot_reach_the_cluster_take_the_share_fail_safe_then_resync(
        zookeeper, tmp_path):
    from kafka import KafkaProducer

    quota, client = 200_000.0, "fleet-app"
    # an Apache Kafka node of the test's own, killed and started again on its data; after a
    # kill -9 its controller takes the new registration once the old session has expired:
    # 4 s, not the default 9 s
    cluster = KafkaBroker(node_id=BROKER_NODE_ID, workdir=tmp_path / "kafka",
                          log_path=tmp_path / "kafka.log", keep=True,
                          config={"broker.session.timeout.ms": "4000",
                                  "broker.heartbeat.interval.ms": "500"})
    chroot = "/fleet-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    usage_topic = "usage-%s" % uuid.uuid4().hex[:8]
    topic = "fleet-%s" % uuid.uuid4().hex[:8]
    zk = job = proxy = None
    try:
        cluster.start()
        alter_quota(hosts, client, quota)
        zk = kazoo(hosts)
        job = SharesJob(zk, "a", [(P, "", client, quota / 4, quota)], ("a", "b")).start()
        cluster.create_topic(topic)
        proxy = admin_proxy(cluster.bootstrap, tmp_path / "proxy.log", "--zookeeper", hosts,
                            "--proxy-id", "a", "--usage-topic", usage_topic,
                            "--usage-interval", "500", "--share-max-age-ms", "3000",
                            "--share-fail-safe", "equal")
        a = proxy.admin
        producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id=client)
        for _ in range(5):
            producer.send(topic, b"x" * 100, partition=0).get(timeout=10)
        producer.close(timeout=5)

        def share():
            return metric(a, "kthrottle_fleet_share", key=P, client_id=client)

        assert wait_until(lambda: share() == quota / 4, 10)
        assert wait_until(lambda: metric(a, "kthrottle_usage_reports_total") >= 1, 10)
        assert metric(a, "kthrottle_fleet_fail_safe") == 0
        assert metric(a, "kthrottle_usage_report_errors_total") == 0

        # the cluster goes away: no report is published, and the job, which reads
        # them there, writes no shares; once they are too old, the fail-safe
        cluster.kill()
        job.pause()
        assert wait_until(lambda: metric(a, "kthrottle_fleet_fail_safe") == 1, 8)
        assert share() == quota / 2  # equal: the quota / the 2 proxies last seen
        assert metric(a, "kthrottle_fleet_shares_age_seconds") > 3
        assert wait_until(lambda: metric(a, "kthrottle_usage_report_errors_total") >= 3, 20)
        reports = metric(a, "kthrottle_usage_reports_total")
        log = proxy.log()
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert errors and errors[0].endswith(
            "logged again when the reason changes and once they are published")
        assert len(errors) < metric(a, "kthrottle_usage_report_errors_total")
        assert len(set(line.split(" ERROR ", 1)[1] for line in errors)) == len(errors)
        assert log.count("fleet: the quota shares (cycle") == 1  # the fail-safe, once

        # back on the same port, on its data (a JVM: seconds): the reports go through again
        cluster.start()
        assert wait_until(lambda: metric(a, "kthrottle_usage_reports_total") > reports, 30)
        failed = metric(a, "kthrottle_usage_report_errors_total")
        proxy.wait_for_log("fleet: usage reports reach the cluster again")
        assert "after %d failed publication(s)" % failed in proxy.log()
        # and the job, reading them, writes fresh shares: the fail-safe is over
        job.resume()
        assert wait_until(lambda: metric(a, "kthrottle_fleet_fail_safe") == 0, 5)
        assert share() == quota / 4
        assert proxy.log().count("fleet: usage reports reach the cluster again") == 1
        assert job.error is None
        assert proxy.alive()
    finally:
        if job is not None:
            job.close()
        if proxy is not None:
            proxy.stop()
        if zk is not None:
            zk.stop()
            zk.close()
        cluster.stop(keep=False)
