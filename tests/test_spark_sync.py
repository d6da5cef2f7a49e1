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

import zookeeper as zk_server
from conftest import ROOT, TANSU_NODE_ID, ProxyProcess
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

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed")
pytest.importorskip("pyarrow", reason="Python data sources need pyarrow (the spark extra)")

from kthrottle.spark_sync import job, kafka_source  # noqa: E402

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="ZooKeeper (Debian package zookeeper) not installed")

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

def _sync(broker, zookeeper, spark, topic, chroot, **kw):
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
    assert docs["a"].proxies == ("a", "b") and docs["a"].cycle == snap["cycle"]


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
        assert sync.cycles == 2

        sync.topic = reports
        _publish(broker.bootstrap, reports, [("111", _report(200, partitions=[(data, 0)]), 0)])
        snap = sync.cycle()
        assert snap["cycle"] == 3
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
    from quota_clients import kthrottle_quotas

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
                             spark=spark, security=security, kafka_timeout=10)
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
                 "--topic", "--freshness", "--znode", "--security-protocol", "--ssl-ca",
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


# the command, as users run it ---------------------------------------------------------

def _run_command(*args, timeout=120):
    """Run ``kthrottle spark-sync`` and wait for it; (returncode, output,
    seconds, the PIDs of its children while it ran)."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYSPARK_PYTHON", None)
    started = time.monotonic()
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
