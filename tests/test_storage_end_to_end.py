"""Storage-aware throttling end to end, every part real: a volume agent
reporting a log dir laid out by the test, ``kthrottle spark-sync`` (PySpark in
local mode) writing the cluster state to ZooKeeper, a kthrottle proxy
following it in front of a Tansu broker, and aiokafka producers and a consumer.

The test moves the agent's limits relative to the free space it measures, so
that the volume is past its soft limit (THROTTLE, factor 0.5), then past its
hard limit (PAUSE), then clear; then stops the agent, whose report goes stale,
and the fail-safe (PAUSE) takes over."""
import asyncio
import os
import subprocess
import sys
import time
import uuid

import pytest

from kthrottle.embedded import stop_process
from kthrottle_testkit import ROOT, TANSU_NODE_ID
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import produce_rate
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper")]

pyspark = pytest.importorskip("pyspark", reason="scripts/test installs PySpark")


@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: the Spark job reads every partition of the cluster and the volume reports of every earlier test."""
    return own_kafka


class Process:
    """A kthrottle command run by the test, stopped by its own PID: by the test, or at the
    latest by the ``_no_process_left`` fixture when a test fails half-way."""

    started = []

    def __init__(self, args, log_path):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        Process.started.append(self)

    def stop(self):
        stop_process(self.proc, grace=20)


@pytest.fixture(autouse=True)
def _no_process_left():
    yield
    while Process.started:
        Process.started.pop().stop()

    def log(self):
        return self.log_path.read_text(errors="replace")


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_bfree * st.f_frsize


def start_cluster(broker, zookeeper, tmp_path, *proxy_args):
    chroot = "/e2e-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=zookeeper.hosts)
    zk.start(timeout=10)
    zk.ensure_path(chroot)
    zk.stop()
    zk.close()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--zookeeper", hosts, "--storage-scope", "cluster", "--storage-base-rate", "400000",
                          "--storage-max-age-ms", "60000", *proxy_args])
    proxy.start()
    job = Process(["spark-sync", "--bootstrap-server", broker.bootstrap, "--zookeeper", hosts,
                   "--master", "local[2]", "--interval", "2s", "--freshness", "8s",
                   "--state-dir", str(tmp_path / "job-state")],
                  tmp_path / "job.log")
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    return proxy, job, tmp_path, zk


def stop_cluster(proxy, job, tmp_path, zk):
    zk.stop()
    zk.close()
    job.stop()
    proxy.stop()


@pytest.fixture
def cluster(broker, zookeeper, tmp_path):
    parts = start_cluster(broker, zookeeper, tmp_path, "--storage-pause-max-ms", "25000")
    yield parts
    stop_cluster(*parts)


@pytest.fixture
def partition_cluster(broker, zookeeper, tmp_path):
    parts = start_cluster(broker, zookeeper, tmp_path, "--storage-scope", "partition",
                          "--storage-pause-max-ms", "4000")
    yield parts
    stop_cluster(*parts)


def current_cycle(zk):
    import json

    if not zk.exists("/kthrottle/cluster-state"):
        return 0
    return json.loads(zk.get("/kthrottle/cluster-state")[0]).get("cycle", 0)


def wait_for_state(zk, job, state, timeout=90, since_cycle=None):
    """Until the job's snapshot says ``state`` for the cluster, every broker
    known; with ``since_cycle``, it must take at most three cycles from
    then (the agent's first report, then two cycles)."""
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if zk.exists("/kthrottle/cluster-state"):
            snap = json.loads(zk.get("/kthrottle/cluster-state")[0])
            if snap["cluster"]["state"] == state and not snap["cluster"]["unknown_brokers"]:
                if since_cycle:
                    assert snap["cycle"] - since_cycle <= 3, (snap["cycle"], since_cycle)
                time.sleep(0.5)  # the proxy applies it within milliseconds
                return snap
        time.sleep(0.2)
    raise AssertionError("the cluster state did not become %s; job log:\n%s"
                         % (state, job.log()[-3000:]))


def agent(broker, tmp_path, log_dir, soft, hard, name):
    return Process(["volume-agent", "--bootstrap-server", broker.bootstrap, "--broker-id",
                    str(TANSU_NODE_ID), "--log-dir", str(log_dir), "--soft-limit", soft,
                    "--hard-limit", hard, "--interval", "1s"], tmp_path / ("%s.log" % name))


def test_a_filling_volume_slows_then_pauses_producers_and_clearing_it_restores_them(
        broker, cluster):
    proxy, job, tmp, zk = cluster
    topic = "e2e-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    log_dir = tmp / "kafka-logs"
    (log_dir / ("%s-0" % topic)).mkdir(parents=True)
    free = free_bytes(log_dir)[0]  # f_bavail: what the agent counts as free

    def run(soft_factor, hard_factor, expect, name):
        """Limits as MinFreeBytes, multiples of today's free space."""
        since = current_cycle(zk)
        a = agent(broker, tmp, log_dir, "MinFreeBytes:%d" % int(free * soft_factor),
                  "MinFreeBytes:%d" % int(free * hard_factor), name)
        return a, wait_for_state(zk, job, expect, since_cycle=since)

    # OPEN: well inside both limits
    a, _ = run(0.01, 0.005, "OPEN", "agent-open")
    baseline = asyncio.run(produce_rate(proxy.bootstrap, topic, 3))
    a.stop()
    # THROTTLE: the free space is half-way between soft (1.5x) and hard (0.5x)
    a, snap = run(1.5, 0.5, "THROTTLE", "agent-soft")
    assert 0.3 < snap["cluster"]["factor"] < 0.7  # half-way, give or take the disk's use
    proxy.wait_for_log("producers now meet THROTTLE")
    throttled = asyncio.run(produce_rate(proxy.bootstrap, topic, 8))
    a.stop()
    # the base rate times the factor, measured as Kafka measures it (sampled windows: a fresh
    # rate lets more through at first; 8 s of it read 1.35x the factor twice on a loaded
    # machine), and under the base rate; and clearly below what the same producer reached
    # unthrottled (which a busy machine lowers)
    factor = snap["cluster"]["factor"]
    assert throttled < min(1.5 * factor, 0.8) * 400_000, (throttled, factor)
    assert throttled < 0.8 * baseline, (throttled, baseline)
    # PAUSE: past the hard limit; a consumer keeps reading meanwhile
    a, _ = run(3.0, 2.0, "PAUSE", "agent-hard")
    proxy.wait_for_log("producers now meet PAUSE")

    async def paused():
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap, request_timeout_ms=40000)
        await producer.start()
        consumer = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            pending = asyncio.ensure_future(producer.send_and_wait(topic, b"held", partition=0))
            consumer.assign([TopicPartition(topic, 0)])
            read = 0
            deadline = time.monotonic() + 20
            while read == 0 and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=1000)
                read += sum(len(r) for r in batch.values())
            await asyncio.sleep(2)
            return pending, producer, consumer, read, pending.done()
        except BaseException:
            await consumer.stop()
            await producer.stop()
            raise

    async def pause_then_clear():
        nonlocal a
        pending, producer, consumer, read, done = await paused()
        try:
            # clear: the limits far below the free space
            a.stop()
            a = agent(broker, tmp, log_dir, "MinFreeBytes:1MB", "MinFreeBytes:1KB",
                      "agent-clear")
            cleared = time.monotonic()
            await asyncio.wait_for(pending, 60)
            return read, done, time.monotonic() - cleared
        finally:
            await consumer.stop()
            await producer.stop()

    read, done_while_paused, release = asyncio.run(pause_then_clear())
    assert read > 0 and not done_while_paused  # consumers read, the producer waited
    proxy.wait_for_log("producers now meet OPEN", timeout=60)
    restored = asyncio.run(produce_rate(proxy.bootstrap, topic, 3))
    assert restored > 2 * throttled, (restored, throttled)
    # the agent stops: its report goes stale and the fail-safe (PAUSE) applies
    a.stop()
    proxy.wait_for_log("no fresh volume report from broker(s) %d" % TANSU_NODE_ID, timeout=60)
    assert job.proc.poll() is None and proxy.alive()


def test_partition_scope_pauses_only_the_producer_of_the_filling_volume(broker,
                                                                         partition_cluster):
    """Two log dirs on two volumes (the test's disk and /dev/shm): the topic
    on the disk is past the hard limit, the one on /dev/shm is not."""
    proxy, job, tmp, zk = partition_cluster
    shm = "/dev/shm"
    disk_free = 100.0 * free_bytes(tmp)[1] / (os.statvfs(tmp).f_blocks * os.statvfs(tmp).f_frsize)
    if os.stat(shm).st_dev == os.stat(tmp).st_dev or disk_free > 97:
        pytest.skip("needs /dev/shm as its own, emptier volume")
    hot, cold = ("hot-%s" % uuid.uuid4().hex[:6]), ("cold-%s" % uuid.uuid4().hex[:6])
    for topic in (hot, cold):
        broker.create_topic(topic, partitions=1)
    disk_dir = tmp / "kafka-logs"
    (disk_dir / ("%s-0" % hot)).mkdir(parents=True)
    shm_dir = os.path.join(shm, "kthrottle-e2e-%s" % uuid.uuid4().hex[:8])
    os.makedirs(os.path.join(shm_dir, "%s-0" % cold))
    hard = (disk_free + 100.0) / 2  # the disk has less free than this, /dev/shm more
    a = Process(["volume-agent", "--bootstrap-server", broker.bootstrap, "--broker-id",
                 str(TANSU_NODE_ID), "--log-dir", str(disk_dir), "--log-dir", shm_dir,
                 "--soft-limit", "MinFreePercentage:%.3f" % (hard + 0.5 * (100 - hard)),
                 "--hard-limit", "MinFreePercentage:%.3f" % hard, "--interval", "1s"],
                tmp / "agent.log")
    try:
        snap = wait_for_state(zk, job, "PAUSE")
        listed = {(p[0], p[1]): p[2] for p in snap["partitions"]}
        # the cold topic's only replica is on /dev/shm: not listed (OPEN); partitions no
        # volume lists (other tests' topics) take their broker's strongest volume
        assert listed[hot, 0] == "PAUSE" and (cold, 0) not in listed, snap

        async def three_sends(topic):
            from aiokafka import AIOKafkaProducer

            producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap,
                                        request_timeout_ms=40000)
            await producer.start()
            try:
                start = time.monotonic()
                for i in range(3):
                    await producer.send_and_wait(topic, b"v%d" % i, partition=0)
                return time.monotonic() - start
            finally:
                await producer.stop()

        async def both():
            return await asyncio.gather(three_sends(hot), three_sends(cold))

        hot_seconds, cold_seconds = asyncio.run(both())
        assert hot_seconds >= 3.5  # throttled for the pause after its first request
        assert cold_seconds < 2.0  # the other topic keeps its speed
    finally:
        a.stop()
        import shutil

        shutil.rmtree(shm_dir, ignore_errors=True)
