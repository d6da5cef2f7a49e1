"""What benchmarks/scale.py showed growing with the number of quota entities, fixed:

* a ZooKeeper resync (the proxy's start, a reconnect) read every entity znode, and every
  user's clients/ directory, with a request and its round trip each: 100,000 entities were
  some 130,000 round trips in a row. The reads are now pipelined (READ_BATCH in flight), with
  the same snapshot as a result;
* QuotaConfig.has_topic_quotas and has_ip_quotas scanned every configured entity each time
  they were asked, and every /metrics scrape asks both (22 ms at 100,000 entities, on the
  event loop). A configuration is immutable: each is now known once."""
import json
import uuid

import pytest

from kthrottle.policy.quotas import QuotaConfig

pytestmark = pytest.mark.integration


def test_has_topic_and_ip_quotas_scan_the_entities_once_per_configuration():
    config = QuotaConfig({"clients/a": {"request_rate": 10.0},
                          "topics/orders": {"producer_byte_rate": 1e6}})
    assert config.has_topic_quotas and not config.has_ip_quotas

    class Unscannable(dict):
        def __iter__(self):
            raise AssertionError("the entities were scanned again")

    config._paths = Unscannable(config._paths)  # asked again: no scan
    for _ in range(3):
        assert config.has_topic_quotas and not config.has_ip_quotas
    assert QuotaConfig({"ips/10.0.0.1": {"connection_creation_rate": 5.0}}).has_ip_quotas
    assert not QuotaConfig({}).has_topic_quotas


def _write_entities(zk, users, clients):
    """users/u-i (some with clients/c-j under them) and clients/c-j, Kafka's layout; a
    users/<u>/clients directory per user, empty for some. Returns the expected snapshot."""
    expected = {}

    def config(rate):
        return json.dumps({"version": 1, "config": {"request_rate": str(rate)}}).encode()

    for i in range(users):
        zk.create("/config/users/u-%d" % i, config(100 + i), makepath=True)
        expected["users/u-%d" % i] = {"request_rate": float(100 + i)}
        if i % 3 == 0:
            continue  # no clients directory at all
        zk.create("/config/users/u-%d/clients" % i, b"")
        for j in range(i % 4):  # some directories empty
            zk.create("/config/users/u-%d/clients/c-%d" % (i, j), config(j + 1))
            expected["users/u-%d/clients/c-%d" % (i, j)] = {"request_rate": float(j + 1)}
    for j in range(clients):
        zk.create("/config/clients/c-%d" % j, config(5000 + j), makepath=True)
        expected["clients/c-%d" % j] = {"request_rate": float(5000 + j)}
    zk.create("/config/clients/bare", b"")  # a znode with no data: no quotas
    return expected


def test_a_zookeeper_resync_reads_in_batches_not_a_round_trip_per_znode(zookeeper,
                                                                         monkeypatch):
    from kazoo.client import KazooClient

    from kthrottle.sources.zookeeper import ZooKeeperQuotaSource, ZooKeeperQuotaStore

    chroot = "/scale-fix-%s" % uuid.uuid4().hex[:8]
    root = KazooClient(hosts=zookeeper.hosts)
    root.start(timeout=10)
    root.ensure_path(chroot)
    root.stop()
    root.close()
    hosts = zookeeper.hosts + chroot
    writer = KazooClient(hosts=hosts)
    writer.start(timeout=10)
    try:
        expected = _write_entities(writer, users=300, clients=200)
    finally:
        writer.stop()
        writer.close()
    # small batches: several of them, and a last one not full
    monkeypatch.setattr(ZooKeeperQuotaStore, "READ_BATCH", 64, raising=False)
    source = ZooKeeperQuotaSource(hosts)
    source.store.connect()
    try:
        zk = source.store.zk
        one_by_one = []
        for name in ("get", "get_children"):
            real = getattr(zk, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                one_by_one.append(_name)
                return _real(*args, **kwargs)
            monkeypatch.setattr(zk, name, counted)
        snapshot = source._resync()
        # the notification directories and /config/users, /config/clients, ... are listed one
        # by one; no entity and no user's clients directory is
        assert len(one_by_one) < 10, one_by_one
        assert snapshot == expected
        # the store's own one-by-one read (kthrottle quotas describe) agrees
        monkeypatch.undo()
        assert source.store.read() == expected
        # a single entity is still read on its own (a change notification)
        assert source._entity("clients/c-3", {}) == {"request_rate": 5003.0}
        assert source._entity("clients/missing", {}) is None
    finally:
        source.store.close()
