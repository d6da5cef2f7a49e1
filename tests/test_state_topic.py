"""The cluster state and the fleet's quota shares in a compacted topic of the
cluster, no ZooKeeper (Kafka 4): ``kthrottle spark-sync`` without
``--zookeeper`` writes them there, proxies started with
``--cluster-state-topic`` follow them, and the job may read the volumes from
the brokers themselves (DescribeLogDirs v4+, KIP-827).

The pure parts first (no I/O); then real components on Apache Kafka (the
``apache_kafka`` fixture): the job as a process, proxies as processes, aiokafka
clients, volume agents."""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest

from kthrottle.config import ConfigError, build_config
from kthrottle.policy.fleet import parse_shares_document
from kthrottle.policy.storage import (
    OPEN,
    PAUSE,
    SNAPSHOT_FORMAT,
    SNAPSHOT_VERSION,
    THROTTLE,
    BrokerReport,
    ClusterState,
    VolumeReport,
    encode_snapshot,
    parse_limit,
)
from kthrottle.sources.state_topic import (
    DEFAULT_TOPIC,
    STATE_KEY,
    ClusterStateTopic,
    SharesTopic,
    StateTopicReader,
    caught_up,
    latest_of_keys,
    shares_key,
)
from kthrottle.spark_sync import job
from kthrottle_testkit import ROOT
from kthrottle_testkit.clients import produce_rate
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

SOFT = parse_limit("MinFreeBytes:2GB")
HARD = parse_limit("MinFreeBytes:1GB")
GB = 10 ** 9


def _name(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


def _snapshot(state, generated_at=None, cycle=1, unknown=()):
    """A cluster-state document as the job writes it (only what a proxy reads)."""
    return {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
            "generated_by": "test", "cycle": cycle,
            "generated_at": time.time() if generated_at is None else generated_at,
            "cluster": {"state": state, "factor": 0.0 if state == PAUSE else 1.0,
                        "unknown_brokers": list(unknown)},
            "brokers": {}, "partitions": []}


# the pure parts ---------------------------------------------------------------------

def test_the_keys_of_the_topic():
    assert DEFAULT_TOPIC == "__kthrottle_cluster_state"  # beside __kthrottle_volume_usage
    assert STATE_KEY == "cluster-state"
    assert shares_key("proxy-a") == "shares/proxy-a"
    assert job.DEFAULT_STATE_TOPIC == DEFAULT_TOPIC


def test_the_latest_record_of_each_key_wins_and_keys_are_text():
    records = [(0, 0, b"cluster-state", b"old"), (0, 1, b"shares/a", b"a1"),
               (0, 2, None, b"no key"), (0, 3, b"\xff\xfe", b"not utf-8"),
               (0, 4, b"cluster-state", b"new"), (0, 5, b"shares/b", None)]
    assert latest_of_keys(records) == {"cluster-state": (b"new", 4), "shares/a": (b"a1", 1),
                                       "shares/b": (None, 5)}
    assert latest_of_keys(records, {"shares/a"}) == {"shares/a": (b"a1", 1)}


def test_caught_up_means_every_partition_reached_its_end_at_start():
    assert caught_up({0: 5, 1: 3}, {0: 5, 1: 3})
    assert caught_up({}, {})  # an empty topic
    assert not caught_up({0: 5}, {0: 5, 1: 0})  # a partition not positioned yet
    assert not caught_up({0: 4, 1: 3}, {0: 5, 1: 3})
    assert caught_up({0: 7}, {0: 5})  # records came after the listing


def test_a_cycle_writes_the_shares_first_and_the_snapshot_last():
    records = job.state_records([("a", b"A"), ("b", b"B")], b"S")
    assert records == [(b"shares/a", b"A"), (b"shares/b", b"B"), (b"cluster-state", b"S")]
    assert job.state_records([("a", b"A")], None) == [(b"shares/a", b"A")]
    # a restarted job carries on from the greatest cycle among what it wrote last
    assert job.last_cycle_of([encode_snapshot({"cycle": 7}), b"{not json", None,
                              encode_snapshot({"cycle": 9}), encode_snapshot({"x": 1})]) == 9
    assert job.last_cycle_of([]) == 0


def test_the_job_writes_the_topic_without_zookeeper_and_the_znodes_with_it():
    """Which outputs SparkSync builds (no I/O until a cycle runs)."""
    spark = object()  # a session handed in: none is started
    alone = job.SparkSync("127.0.0.1:9", None, spark=spark, state_dir="/tmp/unused")
    assert [o.where for o in alone.outputs] == ["topic __kthrottle_cluster_state"]
    assert alone.writer is None and alone.recommender is None  # nowhere to put them
    named = job.SparkSync("127.0.0.1:9", None, spark=spark, state_topic="mine",
                          state_dir="/tmp/unused", recommend_file="/tmp/r.json")
    assert named.where == "topic mine" and named.recommender is not None
    zk = job.SparkSync("127.0.0.1:9", "127.0.0.1:2181/k", spark=spark, state_dir="/tmp/unused")
    assert zk.where == "127.0.0.1:2181/k/kthrottle/cluster-state"  # as before: no topic
    both = job.SparkSync("127.0.0.1:9", "127.0.0.1:2181", spark=spark, state_topic="s",
                         state_dir="/tmp/unused")
    assert both.where == "127.0.0.1:2181/kthrottle/cluster-state and topic s"
    with pytest.raises(ValueError, match="needs the soft and the hard limit"):
        job.SparkSync("127.0.0.1:9", None, spark=spark, volume_source="describe-log-dirs")


def _dir(path, total, usable, topics=(), error=0, **extra):
    return dict({"log_dir": path, "error_code": error, "total_bytes": total,
                 "usable_bytes": usable,
                 "topics": [{"name": t, "partitions": [
                     {"partition_index": p, "partition_size": 10, "offset_lag": 0,
                      "is_future_key": future} for p, future in parts]}
                     for t, parts in topics]}, **extra)


def test_describe_log_dirs_answers_become_volume_reports():
    now = 1_700_000_000.0
    answers = {
        1: [_dir("/data/b", 100 * GB, 50 * GB, [("orders", [(0, False), (1, True)])]),
            _dir("/data/a", 200 * GB, GB // 2, [("logs", [(3, False)])]),
            _dir("/data/gone", -1, -1, error=56)],  # KAFKA_STORAGE_ERROR: offline
        2: [_dir("/old", -1, -1)],  # DescribeLogDirs before v4: no TotalBytes
        3: [],  # no DESCRIBE on the cluster: Kafka answers no log dir
        4: OSError("connection refused"),
    }
    reports, problems = job.reports_from_log_dirs(answers, SOFT, HARD, now)
    assert sorted(reports) == [1]
    r = reports[1]
    assert r.snapshot_at == now and (r.soft, r.hard) == (SOFT, HARD)
    # each log dir a volume named by its path; free space is UsableBytes
    assert [(v.name, v.capacity, v.consumed, v.log_dir) for v in r.volumes] == [
        ("/data/a", 200 * GB, 200 * GB - GB // 2, "/data/a"),
        ("/data/b", 100 * GB, 50 * GB, "/data/b")]
    assert r.volumes[0].partitions == (("logs", 3),)
    assert r.volumes[1].partitions == (("orders", 0),)  # not the future log of a move
    states = [s.state for _, s in r.volume_states()]
    assert states == [PAUSE, OPEN]  # 0.5 GB free is past the hard limit (1 GB must stay free)
    text = "\n".join(problems)
    assert "broker 1: log dir /data/gone left out: KafkaStorageError" in text
    assert "broker 2 does not report its log dirs' space (DescribeLogDirs v4, KIP-827" in text
    assert "broker 3 answered DescribeLogDirs with no log dir" in text
    assert "broker 4: DescribeLogDirs failed: OSError: connection refused" in text
    # the same report the agent would give goes through the agent's parser
    from kthrottle.policy.storage import parse_report

    assert parse_report(r.to_json(), now) == r


def test_auto_takes_a_fresh_agent_report_else_the_brokers_answer():
    now = 1_000_000.0

    def report(broker, age):
        return BrokerReport(broker, now - age, SOFT, HARD, (VolumeReport("sda", 10, 1),))

    agents = {1: report(1, 5), 2: report(2, 500), 3: report(3, 5)}
    brokers = {2: report(2, 0), 4: report(4, 0)}
    assert job.fresh_agent_brokers(agents, now, 90) == {1, 3}
    merged, used = job.merge_reports(agents, brokers, now, 90)
    assert used == {1: "agent", 2: "broker", 3: "agent", 4: "broker"}
    assert merged[2] is brokers[2] and merged[1] is agents[1]
    # a broker the brokers could not answer for keeps its stale agent report (UNKNOWN)
    merged, used = job.merge_reports({2: report(2, 500)}, {}, now, 90)
    assert used == {2: "agent"}


@pytest.mark.parametrize("extra,message", [
    (["--soft-limit", "MinFreeBytes:1GB"], "are for --volume-source describe-log-dirs or auto"),
    (["--volume-source", "describe-log-dirs"], "needs --soft-limit and --hard-limit"),
    (["--volume-source", "auto", "--soft-limit", "MinFreeBytes:1GB", "--hard-limit",
      "MinFreeBytes:2GB"], "stricter than --soft-limit"),
    (["--state-topic", "no spaces"], "--state-topic must be a Kafka topic name"),
])
def test_spark_sync_flags_that_do_not_fit_say_why(extra, message, capsys):
    from kthrottle.cli import main

    with pytest.raises(SystemExit) as err:
        raise SystemExit(main(["spark-sync", "--bootstrap-server", "127.0.0.1:9092", *extra]))
    assert err.value.code == 2
    assert message in capsys.readouterr().err


BASE = {"bootstrap_servers": [("k1", 9092)]}


def test_the_proxy_follows_the_topic_for_storage_and_shares_without_zookeeper():
    from kthrottle.proxy.filters.storage import StorageThrottle

    config = build_config({}, dict(BASE, cluster_state_topic="__kthrottle_cluster_state",
                                   storage_scope="cluster", proxy_id="a", quota_file="q.toml"))
    assert StorageThrottle.enabled(config) and config.fleet_enabled
    assert not StorageThrottle.enabled(build_config({}, BASE))  # nothing configured: nothing acts
    with pytest.raises(ConfigError, match="cluster-state-topic must be a Kafka topic name"):
        build_config({}, dict(BASE, cluster_state_topic="a/b", storage_scope="cluster"))
    with pytest.raises(ConfigError, match="give --zookeeper HOST:PORT.*or --cluster-state-topic"):
        build_config({}, dict(BASE, storage_scope="cluster"))
    with pytest.raises(ConfigError, match="give --zookeeper HOST:PORT.* or --cluster-state-topic"):
        build_config({}, dict(BASE, proxy_id="a", quota_file="q.toml"))
    with pytest.raises(ConfigError, match="cluster-state-topic: the proxy reads the topic as "
                       "itself, and in sasl-mode passthrough"):
        build_config({}, dict(BASE, cluster_state_topic="t", security_protocol="SASL_PLAINTEXT",
                              sasl_mode="passthrough", storage_scope="cluster"))
    with pytest.raises(ConfigError, match="proxy-id a: a fleet shares the quotas it enforces"):
        build_config({}, dict(BASE, proxy_id="a", cluster_state_topic="t"))
    with pytest.raises(ConfigError, match="cluster-state-topic is followed for storage-aware "
                       "throttling .* give one of them too"):
        build_config({}, dict(BASE, cluster_state_topic="t"))
    # ZooKeeper stays an option: the quotas there, the state in the topic
    both = build_config({}, dict(BASE, zookeeper="127.0.0.1:2181", cluster_state_topic="t",
                                 storage_scope="partition"))
    assert both.quota_source == "zookeeper" and StorageThrottle.enabled(both)


def test_a_watch_refuses_what_does_not_read_and_keeps_the_last_good_one(caplog):
    """TopicWatch.take as the reader hands it records (no consumer started)."""
    reader = StateTopicReader({}, "t", [STATE_KEY])
    watch = ClusterStateTopic(reader)
    got = []
    watch._on_update = got.append
    good = encode_snapshot(_snapshot(PAUSE))
    watch.take(good, 3)
    watch.take(good, 3)  # handed twice (attach after the catch-up): taken once
    assert [s.cluster.state for s in got] == [PAUSE] and watch.updates == 1
    caplog.set_level("ERROR", logger="kthrottle.storage")
    for offset in (4, 5):  # the same bad content twice: one line, two refusals
        watch.take(b"{not json", offset)
    ahead = encode_snapshot(_snapshot(OPEN, generated_at=time.time() + 3600))
    watch.take(ahead, 6)  # dated an hour ahead: it would never age
    assert watch.rejected == 3 and len(got) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused the cluster state in topic t key cluster-state "
                               "(offset 4)")
    assert "ahead of this machine's clock" in lines[1]
    watch.take(None, 7)  # a tombstone: the last one stays (it ages)
    assert len(got) == 1 and watch.seen
    # the shares of another proxy are refused
    shares = SharesTopic(reader, "a")
    shares._on_update = got.append
    from kthrottle.policy.fleet import ProxyShares, encode_shares_document, shares_document

    doc = encode_shares_document(shares_document(ProxyShares("b", ("b",), 1.0, []),
                                                 time.time(), 1))
    shares.take(doc, 8)
    assert shares.rejected == 1


# real components on Apache Kafka -----------------------------------------------------

class Process:
    """A kthrottle command run by the test, stopped by its own PID."""

    def __init__(self, args, log_path):
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("PYSPARK_PYTHON", None)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, cwd=ROOT)

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError("%s did not end within %d s:\n%s"
                                 % (self.proc.args[3], timeout, self.log()[-3000:]))

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def log(self):
        return self.log_path.read_text(errors="replace")


def read_topic(bootstrap, topic, timeout=30):
    """{key: (value, offset)}: the latest record of each key, the whole
    topic read to its end (kafka-python, no group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest")
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return {}
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ends = c.end_offsets(tps)
        records = []
        deadline = time.monotonic() + timeout
        while any(c.position(tp) < ends[tp] for tp in tps):
            for tp, batch in c.poll(timeout_ms=500).items():
                records += [(tp.partition, r.offset, r.key, r.value) for r in batch]
            assert time.monotonic() < deadline, "reading %s took over %d s" % (topic, timeout)
        return latest_of_keys(records)
    finally:
        c.close()


def publish(bootstrap, topic, records):
    """[(key str, value bytes or None)], acknowledged in order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for key, value in records:
            p.send(topic, key=key.encode(), value=value).get(30)
    finally:
        p.close()


def broker_log_dir(kafka):
    return str(kafka.workdir / "data")


def plausible_volume(volume, log_dir):
    """The volume DescribeLogDirs gave matches what statvfs says of the log
    dir now: its whole size exactly, its free space within what other
    processes on this machine write meanwhile."""
    usage = shutil.disk_usage(log_dir)
    assert volume["capacity"] == usage.total, (volume, usage)
    free = volume["capacity"] - volume["consumed"]
    assert abs(free - usage.free) < max(2 * 1024 ** 3, usage.total // 50), (volume, usage)
    return usage


def test_describe_log_dirs_gives_the_broker_volume(apache_kafka):
    topic = _name("dld")
    apache_kafka.create_topic(topic, partitions=2)
    node = apache_kafka.node_id
    replicas = {(topic, 0): [node], (topic, 1): [node]}
    # CreateTopics is answered before the node has made every partition's log: the
    # job would see the late one next cycle, the test looks again for a while
    deadline = time.monotonic() + 20
    while True:
        answers = job.read_log_dirs({"bootstrap": apache_kafka.bootstrap}, 20000, [node],
                                    replicas)
        now = time.time()
        reports, problems = job.reports_from_log_dirs(answers, SOFT, HARD, now)
        assert problems == [] and list(reports) == [node], (answers, problems)
        (volume,) = reports[node].volumes
        if {(topic, 0), (topic, 1)} <= set(volume.partitions) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert os.path.realpath(volume.name) == os.path.realpath(broker_log_dir(apache_kafka))
    usage = plausible_volume({"capacity": volume.capacity, "consumed": volume.consumed},
                             broker_log_dir(apache_kafka))
    assert {(topic, 0), (topic, 1)} <= set(volume.partitions)
    print("DescribeLogDirs: total %d usable %d; statvfs total %d free %d"
          % (volume.capacity, volume.capacity - volume.consumed, usage.total, usage.free))


def spark_sync(kafka, tmp_path, name, *args):
    return Process(["spark-sync", "--bootstrap-server", kafka.bootstrap, "--master", "local[2]",
                    "--state-dir", str(tmp_path / "job-state"), *args],
                   tmp_path / ("%s.log" % name))


def test_the_job_without_zookeeper_reads_the_brokers_and_writes_the_state_topic(
        apache_kafka, tmp_path):
    """Two runs of ``spark-sync --once``, no ZooKeeper, no agent: the
    brokers' DescribeLogDirs answers, the snapshot in the state topic; the
    second run carries on the cycle numbers from the topic."""
    data, state = _name("payments"), _name("state")
    apache_kafka.create_topic(data, partitions=1)
    log_dir = broker_log_dir(apache_kafka)
    limits = ["--soft-limit", "MinFreeBytes:2KB", "--hard-limit", "MinFreeBytes:1KB"]
    unused = ["--usage-topic", _name("no-usage")]  # the session's other proxies are not ours
    first = spark_sync(apache_kafka, tmp_path, "job-1", "--once", "--state-topic", state,
                       "--volume-source", "describe-log-dirs", *limits, *unused)
    assert first.wait(240) == 0, first.log()[-3000:]
    out = first.log()
    assert "quota recommendations are not computed" in out
    assert "1 report(s) read (DescribeLogDirs), cluster OPEN" in out
    assert "written to topic %s" % state in out
    assert "Traceback" not in out
    records = read_topic(apache_kafka.bootstrap, state)
    assert set(records) == {STATE_KEY}
    snap = json.loads(records[STATE_KEY][0])
    assert snap["cycle"] == 1 and snap["cluster"] == {"state": OPEN, "factor": 1.0,
                                                      "unknown_brokers": []}
    entry = snap["brokers"][str(apache_kafka.node_id)]
    (volume,) = entry["volumes"]
    plausible_volume(volume, log_dir)
    assert ClusterState.from_json(records[STATE_KEY][0]).cluster.state == OPEN
    # the topic the job made: compacted, one partition
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka import KafkaAdminClient
        from kafka.admin import ConfigResource, ConfigResourceType
    admin = KafkaAdminClient(bootstrap_servers=apache_kafka.bootstrap)
    try:
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, state)])
        text = str(configs)
        assert "cleanup.policy" in text and "compact" in text
        assert len(admin.describe_topics([state])[0]["partitions"]) == 1
    finally:
        admin.close()

    # past the hard limit: every byte of the volume must stay free
    total = shutil.disk_usage(log_dir).total
    second = spark_sync(apache_kafka, tmp_path, "job-2", "--once", "--state-topic", state,
                        "--volume-source", "describe-log-dirs", "--soft-limit",
                        "MinFreeBytes:%d" % total, "--hard-limit", "MinFreeBytes:%d" % total,
                        *unused)
    assert second.wait(240) == 0, second.log()[-3000:]
    snap = json.loads(read_topic(apache_kafka.bootstrap, state)[STATE_KEY][0])
    assert snap["cycle"] == 2 and snap["cluster"]["state"] == PAUSE
    assert [data, 0, PAUSE, 0.0] in snap["partitions"]  # the broker listed it in its log dir

    # auto: the broker's agent report is stale, so the broker itself answers for it
    reports = _name("volumes")
    apache_kafka.create_topic(reports, partitions=1)
    stale = BrokerReport(apache_kafka.node_id, time.time() - 600, SOFT, HARD,
                         (VolumeReport("/dev/sda", 10 * GB, 9 * GB, "/agent"),))
    publish(apache_kafka.bootstrap, reports, [(str(apache_kafka.node_id),
                                               stale.to_json().encode())])
    third = spark_sync(apache_kafka, tmp_path, "job-3", "--once", "--state-topic", state,
                       "--volume-source", "auto", "--topic", reports, *limits, *unused)
    assert third.wait(300) == 0, third.log()[-3000:]
    assert "1 report(s) read (1 new record(s), " in third.log()
    assert "of %s; DescribeLogDirs for broker(s) %d)" % (reports, apache_kafka.node_id) \
        in third.log()
    snap = json.loads(read_topic(apache_kafka.bootstrap, state)[STATE_KEY][0])
    assert snap["cycle"] == 3 and snap["cluster"]["state"] == OPEN
    (volume,) = snap["brokers"][str(apache_kafka.node_id)]["volumes"]
    assert volume["log_dir"] == log_dir and volume["name"] == log_dir  # not the agent's /dev/sda


def wait_for_state(kafka, topic, job_process, state, timeout=120, since_cycle=None):
    """Until the snapshot in the state topic says ``state``, every broker
    known; with ``since_cycle``, within three cycles of it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = read_topic(kafka.bootstrap, topic).get(STATE_KEY)
        if held is not None:
            snap = json.loads(held[0])
            if snap["cluster"]["state"] == state and not snap["cluster"]["unknown_brokers"]:
                if since_cycle:
                    assert snap["cycle"] - since_cycle <= 4, (snap["cycle"], since_cycle)
                time.sleep(0.5)  # the proxy reads it within a fetch
                return snap
        time.sleep(0.3)
    raise AssertionError("the cluster state did not become %s; job log:\n%s"
                         % (state, job_process.log()[-3000:]))


def current_cycle(kafka, topic):
    held = read_topic(kafka.bootstrap, topic).get(STATE_KEY)
    return json.loads(held[0])["cycle"] if held else 0


def test_a_proxy_follows_the_state_topic_and_slows_pauses_and_releases_producers(
        apache_kafka, tmp_path):
    """The storage end-to-end test without ZooKeeper: volume agents report
    to the report topic, the job (running) writes the state topic, the proxy
    follows it."""
    kafka = apache_kafka
    data, reports, state = _name("e2e"), _name("volumes"), _name("state")
    kafka.create_topic(data, partitions=1)
    log_dir = tmp_path / "kafka-logs"
    (log_dir / ("%s-0" % data)).mkdir(parents=True)
    free = shutil.disk_usage(log_dir).free  # f_bavail: what the agent counts as free
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log",
                         ["--cluster-state-topic", state, "--storage-scope", "cluster",
                          "--storage-base-rate", "400000", "--storage-max-age-ms", "60000",
                          "--storage-pause-max-ms", "25000"], node_id=kafka.node_id)
    job_process = spark_sync(kafka, tmp_path, "job", "--state-topic", state, "--topic", reports,
                             "--interval", "2s", "--freshness", "8s", "--usage-topic",
                             _name("no-usage"))
    agents = []

    def agent(soft, hard, name):
        for a in agents:
            a.stop()
        agents[:] = [Process(["volume-agent", "--bootstrap-server", kafka.bootstrap,
                              "--broker-id", str(kafka.node_id), "--log-dir", str(log_dir),
                              "--topic", reports, "--soft-limit", soft, "--hard-limit", hard,
                              "--interval", "1s"], tmp_path / ("%s.log" % name))]

    def run(soft_factor, hard_factor, expect, name):
        since = current_cycle(kafka, state)
        agent("MinFreeBytes:%d" % int(free * soft_factor),
              "MinFreeBytes:%d" % int(free * hard_factor), name)
        return wait_for_state(kafka, state, job_process, expect, since_cycle=since)

    proxy.start()
    try:
        proxy.wait_for_log("topic %s does not exist on" % state, timeout=30)
        run(0.01, 0.005, OPEN, "agent-open")
        proxy.wait_for_log("topic %s exists now: following it" % state, timeout=30)
        baseline = asyncio.run(produce_rate(proxy.bootstrap, data, 3))
        snap = run(1.5, 0.5, THROTTLE, "agent-soft")
        assert 0.3 < snap["cluster"]["factor"] < 0.7
        proxy.wait_for_log("producers now meet THROTTLE", timeout=30)
        throttled = asyncio.run(produce_rate(proxy.bootstrap, data, 8))
        assert throttled < 0.8 * 400_000 and throttled < baseline / 2, (throttled, baseline)
        run(3.0, 2.0, PAUSE, "agent-hard")
        proxy.wait_for_log("producers now meet PAUSE", timeout=30)

        async def paused_then_cleared():
            from aiokafka import AIOKafkaProducer

            producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap,
                                        request_timeout_ms=40000)
            await producer.start()
            try:
                pending = asyncio.ensure_future(producer.send_and_wait(data, b"held",
                                                                       partition=0))
                await asyncio.sleep(3)
                held = not pending.done()
                agent("MinFreeBytes:1MB", "MinFreeBytes:1KB", "agent-clear")
                cleared = time.monotonic()
                await asyncio.wait_for(pending, 60)
                return held, time.monotonic() - cleared
            finally:
                await producer.stop()

        held, release = asyncio.run(paused_then_cleared())
        assert held, "the Produce request went through while the state said PAUSE"
        proxy.wait_for_log("producers now meet OPEN", timeout=60)
        restored = asyncio.run(produce_rate(proxy.bootstrap, data, 3))
        assert restored > 2 * throttled, (restored, throttled)
        assert "refused the cluster state" not in proxy.log()
        assert "ZooKeeper" not in proxy.log()
        print("state topic: baseline %.0f B/s, throttled %.0f, released %.1f s after the clear, "
              "restored %.0f" % (baseline, throttled, release, restored))
        assert job_process.proc.poll() is None and proxy.alive()
    finally:
        for a in agents:
            a.stop()
        job_process.stop()
        proxy.stop()


class Writer:
    """Writes a fresh OPEN snapshot to the state topic every ``every``
    seconds, on a thread, straight to the broker (as a running job would)."""

    def __init__(self, bootstrap, topic, every=1.0):
        self.bootstrap, self.topic, self.every = bootstrap, topic, every
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def _main(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from kafka import KafkaProducer

        p = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
        try:
            while not self._stop.is_set():
                p.send(self.topic, key=STATE_KEY.encode(),
                       value=encode_snapshot(_snapshot(OPEN, cycle=self.written + 10))).get(30)
                self.written += 1
                self._stop.wait(self.every)
        finally:
            p.close()


def test_the_proxy_reads_only_the_latest_state_at_start_and_rides_out_a_broker_outage(
        apache_kafka, tmp_path):
    """The proxy reaches the cluster through a second kthrottle (a relay, the
    proxy's only way to the broker): the relay stopped is the broker gone.
    The state ages into the fail-safe, and once the relay is back the reader
    reconnects and follows the topic again."""
    kafka = apache_kafka
    state = _name("state")
    kafka.create_topic(state, partitions=1, config={"cleanup.policy": "compact"})
    # what the topic holds at start: an old OPEN (would be stale if applied), a
    # malformed one, then the latest, PAUSE: only that one is applied
    publish(kafka.bootstrap, state, [
        (STATE_KEY, encode_snapshot(_snapshot(OPEN, generated_at=time.time() - 3600))),
        (STATE_KEY, b"{not json"),
        (shares_key("someone-else"), b"{}"),
        (STATE_KEY, encode_snapshot(_snapshot(PAUSE)))])
    relay = ProxyProcess(kafka.bootstrap, tmp_path / "relay.log", node_id=kafka.node_id)
    relay.start()
    proxy = ProxyProcess(relay.bootstrap, tmp_path / "proxy.log",
                         ["--cluster-state-topic", state, "--storage-scope", "cluster",
                          "--storage-max-age-ms", "6000"], node_id=kafka.node_id)
    try:
        proxy.start()
        proxy.wait_for_log("producers now meet PAUSE", timeout=30)
        log = proxy.log()
        assert "4 record(s) read to its end; following it" in log
        assert "old (max" not in log and "refused" not in log  # only the latest was applied
        # a malformed record while following: refused, the last good one stays
        publish(kafka.bootstrap, state, [(STATE_KEY, b"[1, 2")])
        proxy.wait_for_log("refused the cluster state in topic %s key cluster-state" % state)
        assert "producers now meet OPEN" not in proxy.log()
        with Writer(kafka.bootstrap, state):
            proxy.wait_for_log("producers now meet OPEN", timeout=30)
            relay.stop()  # the broker is gone for the proxy
            wait_for_count(proxy, "storage: the cluster state is ", 1, 40)  # N s old (max 6 s)
            wait_for_count(proxy, "producers now meet PAUSE", 2, 10)
            proxy.wait_for_log("cannot read topic %s" % state, timeout=40)
            assert proxy.alive()
            relay.start()  # back on the same ports
            proxy.wait_for_log("the cluster state is known again", timeout=90)
            proxy.wait_for_log("reading topic %s on" % state, timeout=30)
        assert proxy.log().count("producers now meet OPEN") == 2
        assert proxy.alive()
    finally:
        proxy.stop()
        relay.stop()


def wait_for_count(proxy, text, count, timeout):
    deadline = time.monotonic() + timeout
    while proxy.log().count(text) < count:
        assert time.monotonic() < deadline, "%r not %d times in the proxy's log:\n%s" % (
            text, count, proxy.log()[-3000:])
        time.sleep(0.1)


def test_fleet_shares_flow_through_the_state_topic_without_zookeeper(apache_kafka, tmp_path):
    """Two fleet proxies, the same client-id quota Q in each one's quota file,
    a producer through each: with the job's shares (in the state topic)
    they hold Q together."""
    from kthrottle_testkit.clients import BackgroundProducer

    kafka = apache_kafka
    q = 200_000
    topic, usage, state = _name("fleet"), _name("usage"), _name("state")
    kafka.create_topic(topic, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients.fleet-app]\nproducer_byte_rate = %d\n' % q)
    proxies = [ProxyProcess(kafka.bootstrap, tmp_path / ("proxy-%s.log" % name),
                            ["--quota-file", str(quotas), "--cluster-state-topic", state,
                             "--proxy-id", name, "--usage-topic", usage, "--usage-interval",
                             "1000", "--share-max-age-ms", "8000"], node_id=kafka.node_id)
               for name in ("a", "b")]
    job_process = None
    try:
        for p in proxies:
            p.start()
        with BackgroundProducer(proxies[0].bootstrap, topic, "fleet-app") as pa, \
                BackgroundProducer(proxies[1].bootstrap, topic, "fleet-app") as pb:
            time.sleep(4)
            t0 = time.monotonic()
            time.sleep(6)
            alone = [p.rate(t0, time.monotonic()) for p in (pa, pb)]
            assert sum(alone) > 1.5 * q, alone  # each proxy holds Q by itself
            job_process = spark_sync(kafka, tmp_path, "job", "--state-topic", state,
                                     "--usage-topic", usage, "--usage-freshness", "10s",
                                     "--interval", "3s", "--topic", _name("no-volumes"))
            deadline = time.monotonic() + 180
            while not {shares_key("a"), shares_key("b")} <= set(read_topic(kafka.bootstrap,
                                                                            state)):
                assert time.monotonic() < deadline, job_process.log()[-3000:]
                time.sleep(1)
            docs = read_topic(kafka.bootstrap, state)
            a = parse_shares_document(docs[shares_key("a")][0])
            assert a.proxy == "a" and a.fleet_size == 2
            assert STATE_KEY not in docs  # no volume reports: no snapshot, shares still
            for p in proxies:
                p.wait_for_log("fleet: quota shares of cycle", timeout=30)
            time.sleep(9)  # three cycles
            t0 = time.monotonic()
            time.sleep(6)
            shared = [p.rate(t0, time.monotonic()) for p in (pa, pb)]
            assert 0.85 * q < sum(shared) < 1.15 * q, (shared, q)
            print("fleet via the state topic: alone %s, shared %s"
                  % ([round(r) for r in alone], [round(r) for r in shared]))
        for p in proxies:
            assert p.alive() and "ZooKeeper" not in p.log()
            assert "follows its quota shares in topic %s key shares/" % state in p.log()
    finally:
        if job_process is not None:
            job_process.stop()
        for p in proxies:
            p.stop()
