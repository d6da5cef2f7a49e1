"""A kthrottle process following the cluster state in a real ZooKeeper, in
front of a real Tansu broker, with real producers and consumers. The test
writes the snapshot znode itself, as the Spark job does, so that each state
is reached on cue."""
import asyncio
import contextlib
import json
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle.policy.storage import (
    BrokerReport,
    VolumeReport,
    cluster_snapshot,
    parse_limit,
)
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import admin_get
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper")]
GB = 10 ** 9


def snapshot(consumed_pct, generated_at=None):
    now = time.time() if generated_at is None else generated_at
    report = BrokerReport(111, now, parse_limit("MinFreePercentage:40"),
                          parse_limit("MinFreePercentage:20"),
                          (VolumeReport("sda1", 100 * GB, int(consumed_pct * GB)),))
    return json.dumps(cluster_snapshot({111: report}, [111], {}, now, 60)).encode()


@contextlib.contextmanager
def proxy_following(broker, zookeeper, tmp_path, *args):
    """A proxy given ``--zookeeper`` (a chroot of its own) and ``args``, its
    admin endpoint on ``p.admin``; and a ZooKeeper client on that chroot."""
    from kazoo.client import KazooClient

    chroot = "/st-%s" % uuid.uuid4().hex[:8]
    zk = KazooClient(hosts=zookeeper.hosts + chroot)
    zk.start(timeout=10)
    zk.ensure_path("/")
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--zookeeper", zookeeper.hosts + chroot, *args])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
    try:
        p.start()
        yield p, zk
    finally:
        p.stop()
        zk.stop()
        zk.close()


@pytest.fixture
def storage_proxy(broker, zookeeper, tmp_path):
    with proxy_following(broker, zookeeper, tmp_path, "--storage-scope", "cluster",
                         "--storage-base-rate", "200000",
                         "--storage-pause-max-ms", "20000") as parts:
        yield parts


def _set(zk, data):
    if zk.exists("/kthrottle/cluster-state"):
        zk.set("/kthrottle/cluster-state", data)
    else:
        zk.create("/kthrottle/cluster-state", data, makepath=True)


def test_pause_holds_producers_while_consumers_read_and_open_releases_them(storage_proxy, broker):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    p, zk = storage_proxy
    topic = "st-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id="writer",
                                    request_timeout_ms=40000)
        await producer.start()
        consumer = AIOKafkaConsumer(bootstrap_servers=p.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            await producer.send_and_wait(topic, b"before", partition=0)
            _set(zk, snapshot(85))  # past the hard limit: PAUSE
            await asyncio.to_thread(p.wait_for_log, "producers now meet PAUSE")
            pending = asyncio.ensure_future(producer.send_and_wait(topic, b"held", partition=0))
            await asyncio.sleep(2.0)
            held = not pending.done()
            # a consumer carries on meanwhile
            consumer.assign([TopicPartition(topic, 0)])
            got = []
            while not got:
                batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 20)
                got += [r.value for records in batch.values() for r in records]
            metrics = admin_get(p.admin, "/metrics")
            _set(zk, snapshot(10))  # back under the soft limit
            released_at = time.monotonic()
            await asyncio.wait_for(pending, 15)
            return held, got, metrics, time.monotonic() - released_at
        finally:
            await consumer.stop()
            await producer.stop()

    held, got, metrics, release = asyncio.run(run())
    assert held  # the produce waited while the cluster was paused
    assert got[0] == b"before"
    assert 'kthrottle_storage_state{broker="",scope="cluster",volume=""} 2.0' in metrics
    assert "kthrottle_storage_deferred_requests_total" in metrics
    assert release < 5  # the held request went on soon after the state cleared
    p.wait_for_log("producers now meet OPEN")


def test_a_stale_snapshot_takes_the_fail_safe_and_a_malformed_one_is_refused(storage_proxy):
    p, zk = storage_proxy
    _set(zk, snapshot(10, generated_at=time.time() - 600))
    p.wait_for_log("the cluster state is 600 s old")
    assert 'scope="cluster",volume=""} 2.0' in admin_get(p.admin, "/metrics")  # PAUSE
    _set(zk, b'{"format": "kthrottle-cluster-state", "version": 99}')
    p.wait_for_log("refused the cluster state in /kthrottle/cluster-state")
    assert "kthrottle_cluster_state_rejected_total 1.0" in admin_get(p.admin, "/metrics")
    _set(zk, snapshot(10))
    p.wait_for_log("the cluster state is known again")
    assert p.alive()


def test_a_proxy_given_only_zookeeper_never_holds_a_producer_for_storage(
        broker, zookeeper, tmp_path):
    """--zookeeper alone means quotas: a PAUSE in the cluster-state znode (a
    job some other proxy follows) holds nobody here, and there is no fail-safe
    to fall into when the state is missing or stale."""
    from aiokafka import AIOKafkaProducer

    topic = "zk-only-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)

    async def produce(values):
        producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id="writer",
                                    request_timeout_ms=10000)
        await producer.start()
        try:
            started = time.monotonic()
            for value in values:
                await asyncio.wait_for(producer.send_and_wait(topic, value, partition=0), 8)
            return time.monotonic() - started
        finally:
            await producer.stop()

    with proxy_following(broker, zookeeper, tmp_path) as (p, zk):
        p.wait_for_log("quotas from ZooKeeper")
        _set(zk, snapshot(85))  # past the hard limit: PAUSE, for a proxy that follows it
        time.sleep(1.5)
        assert asyncio.run(produce([b"a", b"b", b"c"])) < 8
        _set(zk, snapshot(10, generated_at=time.time() - 600))  # stale: no fail-safe either
        time.sleep(1.5)
        assert asyncio.run(produce([b"d"])) < 8
        metrics = admin_get(p.admin, "/metrics")
        assert "kthrottle_storage_state{" not in metrics
        assert "kthrottle_storage_fail_safe 1" not in metrics
        status = json.loads(admin_get(p.admin, "/status.json"))
        assert status["storage"] == {"configured": False}
        assert "storage:" not in p.log() and p.alive()


def test_a_pipelining_producer_held_by_a_pause_has_every_request_answered_in_time(
        broker, zookeeper, tmp_path):
    """librdkafka with 5 requests in flight, as the Java producer keeps them:
    each was held in turn before, the fifth answered after 5 x the cap and
    expired at the client; now the ones sent behind the first go on with it."""
    from confluent_kafka import Producer

    topic = "pipe-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    with proxy_following(broker, zookeeper, tmp_path, "--storage-scope", "cluster",
                         "--storage-pause-max-ms", "3000") as (p, zk):
        producer = Producer({"bootstrap.servers": p.bootstrap, "linger.ms": 0,
                             "max.in.flight.requests.per.connection": 5,
                             "request.timeout.ms": 11000, "message.timeout.ms": 11500,
                             "retries": 0, "enable.idempotence": False})
        producer.produce(topic, b"warm", partition=0)
        assert producer.flush(15) == 0
        _set(zk, snapshot(85))  # PAUSE
        p.wait_for_log("producers now meet PAUSE")
        sent, done = {}, {}

        def delivered(err, msg):
            done[msg.value()] = (err, time.monotonic())

        for i in range(5):  # one request each: the one before is in flight
            value = b"m%d" % i
            sent[value] = time.monotonic()
            producer.produce(topic, value, partition=0, on_delivery=delivered)
            producer.poll(0.2)
        producer.flush(30)
        assert sorted(done) == sorted(sent)
        assert [v for v, (err, _) in done.items() if err is not None] == []
        waited = {v: done[v][1] - sent[v] for v in sent}
        assert max(waited.values()) < 9, waited  # at the cap (3 s) and no more, with margin
        assert min(waited.values()) > 1.5, waited  # they were held
        _set(zk, snapshot(10))
