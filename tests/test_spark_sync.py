"""``kthrottle spark-sync``: the kthrottle-kafka Python data source and whole
cycles, with real PySpark (local[2], one session for the module), a real
Tansu broker and a real ZooKeeper; two runs of the command as users run it."""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle.policy.storage import (
    PAUSE,
    THROTTLE,
    UNKNOWN,
    BrokerReport,
    ClusterState,
    State,
    VolumeReport,
    parse_limit,
)
from kthrottle_testkit import ROOT, TANSU_NODE_ID
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed")
pytest.importorskip("pyarrow", reason="Python data sources need pyarrow (the spark extra)")

from kthrottle.spark_sync import job, kafka_source  # noqa: E402

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="ZooKeeper (Debian package zookeeper) not installed")

@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: the Spark job reads every partition of the cluster and the report topics of every earlier test."""
    return own_kafka


SOFT = parse_limit("ConsumedSpace:500")
HARD = parse_limit("ConsumedSpace:1000")


def _name(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


@pytest.fixture(scope="module")
def spark():
    """One local[2] session for the module; its JVM is stopped by its PID."""
    from pyspark import SparkContext

    session = job.spark_session("local[2]")
    gateway = SparkContext._gateway
    yield session
    session.stop()
    proc = getattr(gateway, "proc", None)
    try:
        gateway.shutdown()
    except Exception:
        pass
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _producer(bootstrap, **kw):
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=bootstrap, **kw)


def _publish(bootstrap, topic, records, **kw):
    """records: [(key str or None, value bytes/str or None, partition)] ->
    their (partition, offset)s, in order."""
    p = _producer(bootstrap, **kw)
    try:
        futures = [p.send(topic, key=None if k is None else k.encode(),
                          value=v.encode() if isinstance(v, str) else v, partition=part)
                   for k, v, part in records]
        p.flush(30)
        return [(m.partition, m.offset) for m in (f.get(30) for f in futures)]
    finally:
        p.close()


def _report(consumed, age=0.0, partitions=(), broker=TANSU_NODE_ID, capacity=2000):
    return BrokerReport(broker, time.time() - age, SOFT, HARD,
                        (VolumeReport("sda", capacity, consumed, "/var/lib/kafka",
                                      tuple(partitions)),)).to_json()


def _znode(zookeeper, chroot, path=job.DEFAULT_ZNODE):
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=zookeeper.hosts)
    zk.start(timeout=10)
    try:
        data, _ = zk.get(chroot + path)
        return data
    finally:
        zk.stop()
        zk.close()


# the data source ------------------------------------------------------------------

def test_the_data_source_reads_every_record_of_every_partition(broker, spark):
    topic = _name("ds")
    broker.create_topic(topic, partitions=3)
    records = []
    for i in range(12):  # several per key, two keys per partition, sent in batches
        part = i % 3
        records.append(("k%d%s" % (part, "ab"[(i // 3) % 2]), "v%d" % i, part))
    records.append(("k0a", None, 0))  # a tombstone
    records.append((None, "no key", 2))
    where = _publish(broker.bootstrap, topic, records, linger_ms=50)

    expected = sorted((part, off, k, v) for (k, v, _), (part, off) in zip(records, where))
    # the reader lists the offsets itself ...
    df = kafka_source.load(spark, broker.bootstrap, topic)
    assert df.rdd.getNumPartitions() == 3
    rows = df.collect()
    assert sorted((r.partition, r.offset, r.key, r.value) for r in rows) == expected
    assert {r.topic for r in rows} == {topic} and all(r.timestamp is not None for r in rows)
    # ... or is handed them by the driver
    offsets = kafka_source.list_offsets({"bootstrap": broker.bootstrap}, topic)
    assert sorted(offsets) == [0, 1, 2] and all(start == 0 for start, _ in offsets.values())
    rows = kafka_source.load(spark, broker.bootstrap, topic, offsets).collect()
    assert sorted((r.partition, r.offset, r.key, r.value) for r in rows) == expected

    # the last record of each key, reduced by Spark
    latest = {r.key: r for r in kafka_source.latest_per_key(df).collect()}
    last = {}
    counts = {}
    for (k, v, _), (part, off) in zip(records, where):
        last[k] = (v, part, off)
        counts[k] = counts.get(k, 0) + 1
    assert {k: (r.value, r.partition, r.offset) for k, r in latest.items()} == last
    assert latest["k0a"].value is None  # the tombstone is the latest of k0a
    assert {k: r.records for k, r in latest.items()} == counts


def test_a_partition_read_that_cannot_finish_fails_the_query_with_one_line(broker, spark):
    topic = _name("short")
    broker.create_topic(topic, partitions=1)
    _publish(broker.bootstrap, topic, [("k", "v", 0)])
    df = kafka_source.load(spark, broker.bootstrap, topic, {0: (0, 50)}, timeout_ms=1500)
    with pytest.raises(Exception) as err:
        df.collect()
    assert job.one_line(err.value) == (
        "kthrottle-kafka: reading %s-0 stopped at offset 1 (end 50, high watermark 1) "
        "after 2 s" % topic)


def test_the_data_source_explains_a_missing_topic(broker):
    with pytest.raises(kafka_source.KafkaReadError, match="topic 'nope-.*' does not exist"):
        kafka_source.list_offsets({"bootstrap": broker.bootstrap}, _name("nope"),
                                  timeout_ms=5000)


# whole cycles, in-process -----------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def state_root(tmp_path_factory):
    """Every job of the module keeps its state under this directory (never
    the user's own state directory)."""
    global STATE_ROOT
    STATE_ROOT = str(tmp_path_factory.mktemp("spark-sync-state"))
    return STATE_ROOT


STATE_ROOT = None


def _sync(broker, zookeeper, spark, topic, chroot, **kw):
    kw.setdefault("state_dir", os.path.join(STATE_ROOT, _name("job")))
    return job.SparkSync(broker.bootstrap, zookeeper.hosts + chroot, topic=topic, spark=spark,
                         kafka_timeout=10, **kw)


@needs_zookeeper
def test_one_cycle_writes_the_cluster_state_a_proxy_reads(broker, zookeeper, spark):
    reports, data = _name("reports"), _name("orders")
    broker.create_topic(reports, partitions=2)
    broker.create_topic(data, partitions=2)
    # an older OPEN report, then the latest: its volume past the soft limit
    _publish(broker.bootstrap, reports, [("111", _report(100, partitions=[(data, 1)]), 1),
                                         ("111", _report(750, partitions=[(data, 1)]), 1)])
    sync = _sync(broker, zookeeper, spark, reports, "/one-cycle")
    try:
        snap = sync.cycle()
        state = ClusterState.from_json(_znode(zookeeper, "/one-cycle"))
    finally:
        sync.close()
    assert snap["cycle"] == 1 and snap["cycle_seconds"] > 0
    assert state.cluster == State(THROTTLE, 0.5)
    assert state.unknown_brokers == ()
    assert state.partitions[data, 1] == State(THROTTLE, 0.5)
    broker_entry = state.brokers[str(TANSU_NODE_ID)]
    assert broker_entry["state"] == THROTTLE and broker_entry["volumes"][0]["consumed"] == 750
    assert sync.spark is spark  # a session handed in is not stopped by close()
    assert not spark.sparkContext._jsc.sc().isStopped()


@needs_zookeeper
def test_the_same_cycle_writes_each_fleet_proxy_its_quota_shares(broker, zookeeper, spark):
    """Usage reports of three proxies: a and b share a client-id bucket
    (demand 3:1), b alone has another, c's report is stale."""
    import time as _time

    from kthrottle.policy.fleet import BucketUsage, UsageReport, parse_shares_document

    reports, usage = _name("vol"), _name("usage")
    broker.create_topic(reports, partitions=1)
    broker.create_topic(usage, partitions=2)
    _publish(broker.bootstrap, reports, [("111", _report(100), 0)])
    now = _time.time()

    def usage_report(proxy, buckets, age=0.0):
        return UsageReport(proxy, now - age, 5.0, (TANSU_NODE_ID,), tuple(
            BucketUsage("producer_byte_rate", "", cid, "clients/" + cid, 1000.0, rate, demand)
            for cid, rate, demand in buckets)).to_json()

    _publish(broker.bootstrap, usage, [
        ("a", usage_report("a", [("app", 600.0, 3000.0)]), 0),
        ("b", usage_report("b", [("app", 400.0, 1000.0), ("solo", 10.0, 10.0)]), 1),
        ("c", usage_report("c", [("app", 900.0, 9000.0)], age=600), 1)])
    sync = _sync(broker, zookeeper, spark, reports, "/fleet", usage_topic=usage)
    try:
        snap = sync.cycle()
    finally:
        sync.close()
    assert snap["quota_shares"] == {"proxies": ["a", "b"], "usage_reports": 2, "buckets": 2}
    docs = {p: parse_shares_document(_znode(zookeeper, "/fleet",
                                            job.DEFAULT_ZNODE + "/shares/" + p))
            for p in ("a", "b")}
    a = docs["a"].shares["producer_byte_rate", "", "app"]
    b = docs["b"].shares["producer_byte_rate", "", "app"]
    assert a.share + b.share == pytest.approx(1000.0) and a.share > 2 * b.share
    assert docs["b"].shares["producer_byte_rate", "", "solo"].share == 1000.0  # one proxy
    assert docs["a"].fleet_size == 2 and docs["a"].cycle == snap["cycle"]


@needs_zookeeper
def test_a_stale_report_and_a_malformed_one_make_the_broker_unknown(
        broker, zookeeper, spark, caplog):
    stale_topic, bad_topic, data = _name("stale"), _name("bad"), _name("events")
    for t in (stale_topic, bad_topic, data):
        broker.create_topic(t, partitions=1)
    _publish(broker.bootstrap, stale_topic,
             [("111", _report(1500, age=600, partitions=[(data, 0)]), 0)])
    # a valid report, then a malformed one: the latest is the one that counts
    _publish(broker.bootstrap, bad_topic, [("111", _report(100), 0), ("111", "{not json", 0),
                                           ("112", '{"BrokerId": "x"}', 0)])

    sync = _sync(broker, zookeeper, spark, stale_topic, "/stale", freshness=90)
    try:
        snap = sync.cycle()
        state = ClusterState.from_json(_znode(zookeeper, "/stale"))
    finally:
        sync.close()
    assert state.unknown_brokers == (TANSU_NODE_ID,)
    assert snap["brokers"]["111"]["state"] == UNKNOWN
    assert re.search(r"report is 6\d\d s old \(freshness 90 s\)",
                     snap["brokers"]["111"]["reason"])
    assert state.partitions[data, 0].state == UNKNOWN  # though its report said PAUSE

    caplog.set_level(logging.INFO, logger="kthrottle.spark_sync")
    sync = _sync(broker, zookeeper, spark, bad_topic, "/bad")
    try:
        snap = sync.cycle()
    finally:
        sync.close()
    assert snap["cluster"]["unknown_brokers"] == [TANSU_NODE_ID]
    assert snap["brokers"]["111"] == {"state": UNKNOWN, "reason": "no report"}
    assert "112" not in snap["brokers"]
    skipped = [r.getMessage() for r in caplog.records if "malformed report" in r.getMessage()]
    assert len(skipped) == 2, skipped
    assert any("key '111'" in m for m in skipped)
    assert any("key '112'" in m and "BrokerId must be an integer" in m for m in skipped)
    assert any("cycle 1: 1 broker(s), 0 report(s) read" in r.getMessage()
               for r in caplog.records)


@needs_zookeeper
def test_a_failed_cycle_leaves_the_last_snapshot_and_the_next_one_recovers(
        broker, zookeeper, spark):
    reports, data = _name("reports"), _name("logs")
    broker.create_topic(reports, partitions=1)
    broker.create_topic(data, partitions=1)
    _publish(broker.bootstrap, reports, [("111", _report(1000, partitions=[(data, 0)]), 0)])
    sync = _sync(broker, zookeeper, spark, reports, "/recover")
    try:
        sync.cycle()
        written = _znode(zookeeper, "/recover")
        assert ClusterState.from_json(written).cluster == State(PAUSE, 0.0)

        # Kafka unreachable: a one-line error, the znode untouched
        good = sync.settings
        sync.settings = dict(good, bootstrap="127.0.0.1:%d" % free_port())
        sync.timeout_ms = 2000
        with pytest.raises(job.CycleError, match="Unable to bootstrap") as err:
            sync.cycle()
        assert "\n" not in str(err.value)
        # a report topic no agent has published to yet: no storage state is
        # written (the fleet's shares would be), the last snapshot stays
        sync.settings, sync.topic = good, _name("missing")
        assert sync.cycle() is None
        assert _znode(zookeeper, "/recover") == written
        assert sync.cycles == 3

        sync.topic = reports
        _publish(broker.bootstrap, reports, [("111", _report(200, partitions=[(data, 0)]), 0)])
        snap = sync.cycle()
        assert snap["cycle"] == 4  # the failed cycle's number is not used again
        assert ClusterState.from_json(_znode(zookeeper, "/recover")).partitions == {}
    finally:
        sync.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    tmp = tmp_path_factory.mktemp("pki")
    ca = trustme.CA(organization_name="kthrottle tests")
    files = {"ca": tmp / "ca.pem", "server": tmp / "server.pem", "server_key": tmp / "server.key",
             "client": tmp / "client.pem", "client_key": tmp / "client.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert("127.0.0.1", "localhost")
    for i, pem in enumerate(server.cert_chain_pems):
        pem.write_to_path(str(files["server"]), append=i > 0)
    server.private_key_pem.write_to_path(str(files["server_key"]))
    client = ca.issue_cert("spark@example.com", common_name="spark-sync")
    client.cert_chain_pems[0].write_to_path(str(files["client"]))
    client.private_key_pem.write_to_path(str(files["client_key"]))
    return {k: str(v) for k, v in files.items()}


@needs_zookeeper
def test_a_cycle_over_sasl_ssl_with_a_client_certificate(
        broker, zookeeper, spark, pki, tmp_path, monkeypatch):
    """Through a kthrottle proxy terminating SASL_SSL (mutual TLS required)
    in front of Tansu: the driver and the executors alike use the flags' CA,
    client certificate and SCRAM credentials (handed over as text)."""
    from kthrottle_testkit.clients import kthrottle_quotas

    creds = tmp_path / "creds.toml"
    done = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "users",
                            "--entity-name", "sync", "--add-config",
                            "SCRAM-SHA-256=[password=sync-secret]")
    assert done.returncode == 0, done.stderr
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log", [
        "--security-protocol", "SASL_SSL", "--ssl-cert", pki["server"],
        "--ssl-key", pki["server_key"], "--ssl-ca", pki["ca"], "--ssl-client-auth", "required",
        "--credentials-file", str(creds)]).start()
    try:
        reports = _name("secure")
        broker.create_topic(reports, partitions=1)
        _publish(broker.bootstrap, reports, [("111", _report(750), 0)])
        (tmp_path / "password").write_text("sync-secret\n")
        args = job.add_parser(_subparsers()).parse_args([
            "--bootstrap-server", proxy.bootstrap, "--zookeeper", zookeeper.hosts,
            "--security-protocol", "sasl_ssl", "--ssl-ca", pki["ca"],
            "--ssl-cert", pki["client"], "--ssl-key", pki["client_key"],
            "--sasl-mechanism", "SCRAM-SHA-256", "--sasl-username", "sync",
            "--sasl-password-file", str(tmp_path / "password")])
        security = job.security_options(args)
        assert "-----BEGIN CERTIFICATE-----" in security["ssl_ca_pem"]  # text, not a path
        sync = job.SparkSync(proxy.bootstrap, zookeeper.hosts + "/secure", topic=reports,
                             spark=spark, security=security, kafka_timeout=10,
                             state_dir=str(tmp_path / "state"))
        try:
            snap = sync.cycle()
        finally:
            sync.close()
        assert snap["cluster"] == {"state": THROTTLE, "factor": 0.5, "unknown_brokers": []}
        assert ClusterState.from_json(_znode(zookeeper, "/secure")).cluster == State(THROTTLE, 0.5)
        assert "sync" in proxy.log()
    finally:
        proxy.stop()


def _subparsers():
    import argparse

    return argparse.ArgumentParser(prog="kthrottle").add_subparsers()


# reading only what is new --------------------------------------------------------------

def _versions(state_dir, topic):
    return sorted(os.listdir(os.path.join(state_dir, topic)))


@needs_zookeeper
def test_each_cycle_reads_only_what_is_new_and_a_restart_carries_on(
        broker, zookeeper, spark, tmp_path, caplog):
    reports = _name("incr")
    broker.create_topic(reports, partitions=2)
    _publish(broker.bootstrap, reports, [("111", _report(100), 0), ("111", _report(300), 0),
                                         ("112", _report(50, broker=112), 1)])
    state_dir = str(tmp_path / "state")
    caplog.set_level(logging.INFO, logger="kthrottle.spark_sync")
    sync = _sync(broker, zookeeper, spark, reports, "/incr", state_dir=state_dir)
    try:
        snap, counts = sync.snapshot()
        assert counts["records"] == 3 and counts["bytes"] > 0
        assert snap["brokers"]["111"]["volumes"][0]["consumed"] == 300
        _, counts = sync.snapshot()
        assert counts["records"] == 0 and counts["keys"] == 2  # nothing new: nothing read
        _publish(broker.bootstrap, reports, [("111", _report(700), 0)])
        snap = sync.cycle()
        assert snap["brokers"]["111"]["volumes"][0]["consumed"] == 700
        assert snap["brokers"]["112"]["volumes"][0]["consumed"] == 50  # kept from before
        assert any(re.search(r"cycle \d+: .* \(1 new record\(s\), \d+ bytes, of %s\)" % reports,
                             r.getMessage()) for r in caplog.records)
        # one complete version at a time: the previous is removed
        assert _versions(state_dir, reports) == ["v-0000000003"]
        assert sorted(os.listdir(os.path.join(state_dir, reports, "v-0000000003"))) == [
            ".offsets.json.crc", "latest", "offsets.json"]
        first_cycle = snap["cycle"]
    finally:
        sync.close()

    # a new job on the same state directory reads nothing old again
    _publish(broker.bootstrap, reports, [("112", _report(900, broker=112), 1)])
    again = _sync(broker, zookeeper, spark, reports, "/incr", state_dir=state_dir)
    try:
        snap, counts = again.snapshot()
        assert counts["records"] == 1
        assert snap["brokers"]["111"]["volumes"][0]["consumed"] == 700
        assert snap["brokers"]["112"]["volumes"][0]["consumed"] == 900
        assert again.cycle()["cycle"] == first_cycle + 1  # counted on from ZooKeeper's
    finally:
        again.close()


@needs_zookeeper
def test_a_topic_created_again_is_read_from_its_start_and_its_old_state_dropped(
        broker, zookeeper, spark, tmp_path, caplog):
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    reports = _name("again")
    broker.create_topic(reports, partitions=1)
    _publish(broker.bootstrap, reports, [("111", _report(100), 0),
                                         ("112", _report(1, broker=112), 0),
                                         ("111", _report(200), 0)])
    caplog.set_level(logging.WARNING, logger="kthrottle.spark_sync")
    sync = _sync(broker, zookeeper, spark, reports, "/again", state_dir=str(tmp_path / "s"))
    admin = KafkaAdminClient(bootstrap_servers=[broker.bootstrap])
    try:
        snap, _ = sync.snapshot()
        assert set(snap["brokers"]) == {"111", "112"}
        admin.delete_topics([reports])
        deadline = time.monotonic() + 10
        while reports in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.1)
        admin.create_topics([NewTopic(reports, 2, 1)])
        _publish(broker.bootstrap, reports, [("111", _report(600), 1)])
        snap, counts = sync.snapshot()
        assert counts["records"] == 1
        assert snap["brokers"]["111"]["volumes"][0]["consumed"] == 600
        assert "112" not in snap["brokers"]  # its report went with the old topic
        assert any("was deleted and created again" in r.getMessage() for r in caplog.records)
    finally:
        admin.close()
        sync.close()


def test_which_offsets_a_cycle_reads():
    asked = []

    def hw(value):
        def high_watermark(partition, near):
            asked.append((partition, near))
            return value
        return high_watermark

    # the first cycle: every partition from its log start
    assert job.plan_read("t", {}, {0: (0, 5), 1: (3, 3)}, None, "id", hw(0)) == (
        {0: (0, 5), 1: (3, 3)}, set(), [])
    # then from the next offsets kept; a new partition from its log start
    ranges, dropped, notes = job.plan_read("t", {0: 5, 1: 3}, {0: (0, 9), 1: (3, 3), 2: (0, 4)},
                                           "id", "id", hw(0))
    assert ranges == {0: (5, 9), 1: (3, 3), 2: (0, 4)} and dropped == set()
    assert notes == ["t-2 is new: read from its log start 0"]
    # records removed under the next offset (retention): from the log start
    ranges, dropped, notes = job.plan_read("t", {0: 5}, {0: (8, 12)}, "id", "id", hw(0))
    assert ranges == {0: (8, 12)} and not dropped and "past the next offset kept" in notes[0]
    # an end offset below the next offset kept: the high watermark decides
    assert not asked
    ranges, dropped, notes = job.plan_read("t", {0: 9}, {0: (0, 6)}, "id", "id", hw(9))
    assert ranges == {0: (9, 9)} and not dropped and not notes  # Tansu's end offset, no more
    assert asked == [(0, 5)]
    ranges, dropped, notes = job.plan_read("t", {0: 9}, {0: (0, 2)}, "id", "id", hw(2))
    assert ranges == {0: (0, 2)} and dropped == {0} and "truncated" in notes[0]
    # another topic id, or a partition gone: the state is dropped
    ranges, dropped, notes = job.plan_read("t", {0: 9, 1: 4}, {0: (0, 1)}, "old", "new", hw(1))
    assert ranges == {0: (0, 1)} and dropped == {0, 1} and "created again" in notes[0]
    ranges, dropped, notes = job.plan_read("t", {0: 9, 1: 4}, {0: (0, 9)}, None, None, hw(9))
    assert ranges == {0: (9, 9)} and dropped == {1} and notes == ["t-1 is gone: its state is dropped"]


# decided by offset, times checked ------------------------------------------------------

def _report_at(consumed, at, broker=TANSU_NODE_ID):
    return BrokerReport(broker, at, SOFT, HARD,
                        (VolumeReport("sda", 2000, consumed, "/var/lib/kafka", ()),)).to_json()


@needs_zookeeper
def test_a_report_from_a_clock_ahead_does_not_pin_its_broker(broker, zookeeper, spark, caplog):
    """The agent's clock jumps an hour ahead (its SnapshotAt and the record
    timestamp alike), then is put right: the later record wins."""
    from kthrottle.policy.fleet import UsageReport

    reports, usage = _name("clock"), _name("clock-usage")
    broker.create_topic(reports, partitions=1)
    broker.create_topic(usage, partitions=1)
    ahead = time.time() + 3600
    _publish(broker.bootstrap, reports, [("111", _report(100), 0)])
    p = _producer(broker.bootstrap)
    try:
        p.send(reports, key=b"111", value=_report_at(1000, ahead).encode(), partition=0,
               timestamp_ms=int(ahead * 1000)).get(30)
        p.send(usage, key=b"edge-1", value=UsageReport("edge-1", ahead, 5.0, (111,), ()).to_json()
               .encode(), partition=0, timestamp_ms=int(ahead * 1000)).get(30)
    finally:
        p.close()
    caplog.set_level(logging.INFO, logger="kthrottle.spark_sync")
    sync = _sync(broker, zookeeper, spark, reports, "/clock", usage_topic=usage)
    try:
        snap = sync.cycle()
        # refused, and said with the broker's name: the broker is UNKNOWN
        assert snap["brokers"]["111"] == {"state": UNKNOWN, "reason": "no report"}
        refused = [r.getMessage() for r in caplog.records if "ahead" in r.getMessage()]
        assert any("broker 111" in m and "SnapshotAt is 3600 s ahead" in m for m in refused), \
            refused
        assert any("proxy 'edge-1'" in m and "ReportedAt is 3600 s ahead" in m for m in refused)
        # the clock put right: a report dated now, at a higher offset, wins
        _publish(broker.bootstrap, reports, [("111", _report(750), 0)])
        snap = sync.cycle()
        assert snap["brokers"]["111"]["state"] == THROTTLE
        assert snap["brokers"]["111"]["volumes"][0]["consumed"] == 750
    finally:
        sync.close()


def test_the_latest_of_a_key_is_its_partitions_last_offset_and_between_partitions_its_time():
    import datetime

    def at(seconds):
        return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)

    rows = [{"key": "a", "partition": 0, "offset": 7, "timestamp": at(100), "value": "old"},
            {"key": "a", "partition": 2, "offset": 1, "timestamp": at(200), "value": "moved"},
            {"key": "b", "partition": 1, "offset": 3, "timestamp": at(100), "value": "b"}]
    latest = kafka_source.latest_of_keys(rows)
    assert {k: r["value"] for k, r in latest.items()} == {"a": "moved", "b": "b"}


def test_a_report_dated_far_ahead_is_refused_when_the_time_is_given():
    from kthrottle.policy.storage import parse_report

    now = time.time()
    text = _report_at(10, now + 600)
    assert parse_report(text).snapshot_at == pytest.approx(now + 600, abs=0.01)
    with pytest.raises(ValueError, match="SnapshotAt is 600 s ahead"):
        parse_report(text, now)
    assert parse_report(_report_at(10, now + 5), now).broker_id == TANSU_NODE_ID


# one cycle, one change -------------------------------------------------------------------

def _zk(zookeeper):
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=zookeeper.hosts)
    zk.start(timeout=10)
    return zk


@needs_zookeeper
def test_the_shares_and_the_snapshot_change_together_or_not_at_all(broker, zookeeper, spark):
    from kazoo.security import make_acl

    from kthrottle.policy.fleet import BucketUsage, UsageReport, parse_shares_document

    reports, usage = _name("txn"), _name("txn-usage")
    broker.create_topic(reports, partitions=1)
    broker.create_topic(usage, partitions=1)

    def usage_of(proxy, demand):
        return (proxy, UsageReport(proxy, time.time(), 5.0, (TANSU_NODE_ID,), (
            BucketUsage("producer_byte_rate", "", "app", "clients/app", 1000.0, demand / 2,
                        demand),)).to_json(), 0)

    _publish(broker.bootstrap, reports, [("111", _report(100), 0)])
    _publish(broker.bootstrap, usage, [usage_of("a", 100.0)])
    base = "/txn" + job.DEFAULT_ZNODE
    zk = _zk(zookeeper)
    sync = _sync(broker, zookeeper, spark, reports, "/txn", usage_topic=usage)
    try:
        assert sync.cycle()["cycle"] == 1
        before = {z: zk.get(z)[0] for z in (base, base + "/shares/a")}
        # proxy b's znode is there but no one may write it: the transaction fails
        zk.create(base + "/shares/b", b"", acl=[make_acl("world", "anyone", read=True)])
        _publish(broker.bootstrap, reports, [("111", _report(750), 0)])
        _publish(broker.bootstrap, usage, [usage_of("a", 300.0), usage_of("b", 100.0)])
        with pytest.raises(job.CycleError) as err:
            sync.cycle()
        assert "refused the transaction, nothing of it was written" in str(err.value)
        assert "setting %s/shares/b: NoAuthError" % job.DEFAULT_ZNODE in str(err.value)
        assert {z: zk.get(z)[0] for z in before} == before  # neither changed
        zk.delete(base + "/shares/b")
        snap = sync.cycle()
        assert snap["cycle"] == 3  # not 2 again
        assert ClusterState.from_json(zk.get(base)[0]).cluster == State(THROTTLE, 0.5)
        docs = [parse_shares_document(zk.get(base + "/shares/" + p)[0]) for p in "ab"]
        assert [d.cycle for d in docs] == [3, 3]
    finally:
        sync.close()
        zk.stop()
        zk.close()


@needs_zookeeper
def test_a_cycle_past_one_transaction_is_written_in_several_the_snapshot_last(zookeeper):
    zk = _zk(zookeeper)
    writer = job.ZnodeWriter(zookeeper.hosts + "/chunks", job.DEFAULT_ZNODE, 10)
    base = "/chunks" + job.DEFAULT_ZNODE
    try:
        writes = [("%s/shares/p%02d" % (job.DEFAULT_ZNODE, n), b"x" * 3000) for n in range(20)]
        writes.append((job.DEFAULT_ZNODE, b'{"snapshot": 1}'))
        # the znodes do not exist yet: created (the snapshot's empty first, set last)
        assert writer.commit(writes) == 1
        assert zk.get(base)[0] == b'{"snapshot": 1}'
        assert len(zk.get_children(base + "/shares")) == 20
        writes = [(z, d.replace(b"x", b"y").replace(b"1", b"2")) for z, d in writes]
        assert writer.commit(writes, limit=16 * 1024) == 4  # five shares (3.1 kB) in each
        assert zk.get(base)[0] == b'{"snapshot": 2}'
        assert all(zk.get(base + "/shares/p%02d" % n)[0] == b"y" * 3000 for n in range(20))
        # 1.5 MB in all: more than this server's jute.maxbuffer (1 MiB) takes in one request
        writes = [("%s/shares/q%02d" % (job.DEFAULT_ZNODE, n), b"z" * 50_000) for n in range(30)]
        assert writer.commit(writes + [(job.DEFAULT_ZNODE, b'{"snapshot": 3}')]) == 2
        assert zk.get(base)[0] == b'{"snapshot": 3}'
        assert zk.get(base + "/shares/q29")[0] == b"z" * 50_000
    finally:
        writer.close()
        zk.stop()
        zk.close()


# flags and helpers ------------------------------------------------------------------

@pytest.mark.parametrize("text,seconds", [("30s", 30.0), ("5m", 300.0), ("500ms", 0.5),
                                          ("45", 45.0), ("1.5h", 5400.0)])
def test_durations(text, seconds):
    assert job.parse_duration(text) == seconds


@pytest.mark.parametrize("extra,message", [
    (["--interval", "soon"], "not a duration"),
    (["--interval", "0s"], "must be positive"),
    (["--once", "--interval", "5s"], "not allowed with argument"),
    (["--znode", "cluster-state"], "absolute path"),
    (["--security-protocol", "SASL_SSL"], "needs --sasl-username"),
    (["--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "u"], "needs the password"),
    (["--ssl-ca", "/nonexistent.pem"], "--ssl-ca is for TLS: give --security-protocol SSL or SASL_SSL"),
    (["--security-protocol", "SSL", "--ssl-ca", "/nonexistent.pem"], "cannot read --ssl-ca"),
    (["--security-protocol", "SSL", "--ssl-cert", "/c.pem"], "go together"),
])
def test_bad_flags_say_why(extra, message, capsys, monkeypatch):
    from kthrottle.cli import main

    monkeypatch.delenv(job.PASSWORD_ENV, raising=False)
    with pytest.raises(SystemExit) as err:
        rc = main(["spark-sync", "--bootstrap-server", "127.0.0.1:9092",
                   "--zookeeper", "127.0.0.1:2181", *extra])
        raise SystemExit(rc)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag_with_an_example(capsys):
    from kthrottle.cli import main

    with pytest.raises(SystemExit):
        main(["spark-sync", "--help"])
    out = capsys.readouterr().out
    for flag in ("--bootstrap-server", "--zookeeper", "--master", "--interval", "--once",
                 "--topic", "--freshness", "--znode", "--state-dir", "hdfs://", "s3a://",
                 "--security-protocol", "--ssl-ca",
                 "--sasl-mechanism", "--sasl-username", "--sasl-password-file",
                 job.PASSWORD_ENV, "example:", "kthrottle spark-sync --bootstrap-server"):
        assert flag in out, flag


def test_the_other_commands_do_not_import_pyspark():
    """PySpark is an optional extra (and slow to import): building the CLI's
    parser must not need it; the job's copies of the source's names agree."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, kthrottle.cli; kthrottle.cli.make_parser(); "
         "print(sorted(m for m in sys.modules if m.startswith(('pyspark', 'pyarrow'))))"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert job.SOURCE_FORMAT == kafka_source.FORMAT
    assert job.SECURITY_PROTOCOLS == kafka_source.SECURITY_PROTOCOLS
    assert job.SASL_MECHANISMS == kafka_source.SASL_MECHANISMS


def test_the_password_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(job.PASSWORD_ENV, "from-env")
    args = job.add_parser(_subparsers()).parse_args([
        "--bootstrap-server", "127.0.0.1:9092", "--zookeeper", "127.0.0.1:2181",
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "u"])
    assert job.security_options(args)["sasl_password"] == "from-env"


def test_a_spark_error_becomes_one_line():
    text = ("\n  An exception was thrown from the Python worker. Please see the stack trace below."
            "\nTraceback (most recent call last):\n  File \"x.py\", line 1, in read\n"
            "kafka_source.KafkaReadError: kthrottle-kafka: reading t-0 stopped at offset 3\n"
            "\tat org.apache.spark...\n")
    assert job.one_line(RuntimeError(text)) == "kthrottle-kafka: reading t-0 stopped at offset 3"
    text = "Traceback (most recent call last):\n  File \"x\"\nValueError: bad thing\n\tat org"
    assert job.one_line(RuntimeError(text)) == "ValueError: bad thing"
    assert job.one_line(TimeoutError()) == "TimeoutError"
    # Py4J's error: the Java one on its second line (a Python worker that could not start)
    text = ("An error occurred while calling o56.load.\n: java.io.IOException: Cannot run "
            "program \"./environment/bin/python\": error=2, No such file or directory\n"
            "\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)\n")
    assert job.one_line(RuntimeError(text)) == (
        "IOException: Cannot run program \"./environment/bin/python\": error=2, No such file "
        "or directory")
    text = ("An error occurred while calling o48.collectToPython.\n: org.apache.spark."
            "SparkException: Python worker exited unexpectedly (crashed). Consider setting "
            "'spark.python.worker.faulthandler.enabled'\n\tat org.apache.spark.api.python\n")
    assert job.one_line(RuntimeError(text)) == (
        "SparkException: Python worker exited unexpectedly (crashed)" + job.WORKER_CRASHED)


# the command, as users run it ---------------------------------------------------------

def _run_command(*args, timeout=120):
    """Run ``kthrottle spark-sync`` and wait for it; (returncode, output,
    seconds, the PIDs of its children while it ran)."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYSPARK_PYTHON", None)
    started = time.monotonic()
    if "--state-dir" not in args:
        args += ("--state-dir", os.path.join(STATE_ROOT, _name("command")))
    proc = subprocess.Popen([sys.executable, "-m", "kthrottle", "spark-sync", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env, stdin=subprocess.DEVNULL)
    children = set()
    try:
        me = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() - started < timeout:
            try:
                children |= {c.pid for c in me.children(recursive=True)}
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("spark-sync did not end within %d s:\n%s" % (timeout, out[-3000:]))
    return proc.returncode, out, time.monotonic() - started, children


def _gone(pids, timeout=20):
    import psutil

    deadline = time.monotonic() + timeout
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return not alive


@needs_zookeeper
def test_the_command_once_writes_the_snapshot_under_the_chroot(broker, zookeeper):
    reports, data = _name("cli"), _name("payments")
    broker.create_topic(reports, partitions=1)
    broker.create_topic(data, partitions=2)
    _publish(broker.bootstrap, reports, [("111", _report(750, partitions=[(data, 1)]), 0)])
    rc, out, seconds, children = _run_command(
        "--bootstrap-server", broker.bootstrap, "--zookeeper", zookeeper.hosts + "/kafka/cli",
        "--topic", reports, "--once", "--freshness", "2m")
    assert rc == 0, out[-3000:]
    assert "cycle 1: 1 broker(s), 1 report(s) read" in out and "cluster THROTTLE 0.500" in out
    assert "Traceback" not in out
    state = ClusterState.from_json(_znode(zookeeper, "/kafka/cli"))
    assert state.cluster == State(THROTTLE, 0.5) and (data, 1) in state.partitions
    assert json.loads(_znode(zookeeper, "/kafka/cli"))["cycle"] == 1
    assert children and _gone(children), "the JVM or a Python worker outlived the command"


@needs_zookeeper
def test_spark_submit_runs_the_job_on_the_master_it_was_given(broker, zookeeper, tmp_path):
    """Under spark-submit its --master, --name and --conf stand: the job's own
    default master (local[2]) is not forced on it."""
    reports = _name("submit")
    broker.create_topic(reports, partitions=1)
    _publish(broker.bootstrap, reports, [("111", _report(750), 0)])
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYSPARK_PYTHON", None)
    done = subprocess.run([
        os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit"),
        "--master", "local[1]", "--name", "sync-under-submit",
        "--conf", "spark.pyspark.driver.python=%s" % sys.executable,
        "--conf", "spark.driver.bindAddress=127.0.0.1", "--conf", "spark.driver.host=127.0.0.1",
        str(ROOT / "kthrottle" / "spark_sync" / "submit.py"),
        "--bootstrap-server", broker.bootstrap, "--zookeeper", zookeeper.hosts + "/submit",
        "--topic", reports, "--once", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
        timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Spark session started (master local[1])" in out
    assert "Submitted application: sync-under-submit" in out
    assert ClusterState.from_json(_znode(zookeeper, "/submit")).cluster == State(THROTTLE, 0.5)


@needs_zookeeper
def test_the_command_once_fails_clearly_without_kafka(zookeeper):
    port = free_port()
    rc, out, seconds, _ = _run_command(
        "--bootstrap-server", "127.0.0.1:%d" % port, "--zookeeper", zookeeper.hosts + "/down",
        "--once", timeout=60)
    assert rc == 1, out
    assert seconds < 60
    error = [ln for ln in out.splitlines() if "ERROR" in ln]
    assert len(error) == 1, out
    assert "cycle failed" in error[0] and "Unable to bootstrap" in error[0]
    assert str(port) in error[0]
    assert "Traceback" not in out
