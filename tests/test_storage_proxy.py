"""A kthrottle process following the cluster state in a real ZooKeeper, in
front of a real Tansu broker, with real producers and consumers. The test
writes the snapshot znode itself, as the Spark job does, so that each state
is reached on cue."""
import asyncio
import json
import time
import uuid

import pytest

import zookeeper as zk_server
from conftest import ProxyProcess
from kthrottle.embedded import free_port
from kthrottle.policy.storage import (
    BrokerReport,
    VolumeReport,
    cluster_snapshot,
    parse_limit,
)
from quota_clients import admin_get

pytestmark = pytest.mark.skipif(not zk_server.available(),
                                reason="scripts/test installs ZooKeeper")
GB = 10 ** 9


def snapshot(consumed_pct, generated_at=None):
    now = time.time() if generated_at is None else generated_at
    report = BrokerReport(111, now, parse_limit("MinFreePercentage:40"),
                          parse_limit("MinFreePercentage:20"),
                          (VolumeReport("sda1", 100 * GB, int(consumed_pct * GB)),))
    return json.dumps(cluster_snapshot({111: report}, [111], {}, now, 60)).encode()


@pytest.fixture
def storage_proxy(broker, zookeeper, tmp_path):
    from kazoo.client import KazooClient

    chroot = "/st-%s" % uuid.uuid4().hex[:8]
    zk = KazooClient(hosts=zookeeper.hosts + chroot)
    zk.start(timeout=10)
    zk.ensure_path("/")
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--zookeeper", zookeeper.hosts + chroot, "--storage-base-rate", "200000",
                      "--storage-pause-max-ms", "20000"])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
    p.start()
    yield p, zk
    p.stop()
    zk.stop()
    zk.close()


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
