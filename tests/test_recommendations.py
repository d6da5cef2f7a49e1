"""Quota recommendations: real PySpark (local[2], one session for the module)
on synthetic usage reports whose figures are known; `kthrottle quotas
recommend` on the document; a whole spark-sync cycle with a real Tansu
broker (the usage topic) and a real ZooKeeper (the document)."""
import json
import os
import subprocess
import sys

import pytest

from kthrottle import recommendations
from kthrottle.policy.fleet import BucketUsage, UsageReport
from kthrottle.policy.storage import encode_snapshot
from kthrottle_testkit import ROOT
from kthrottle_testkit import zookeeper as zk_server

pytestmark = pytest.mark.integration

pytest.importorskip("pyspark", reason="the spark extra is not installed")
pytest.importorskip("pyarrow", reason="Python data sources need pyarrow (the spark extra)")

from kthrottle.spark_sync import job, recommend  # noqa: E402
from test_spark_sync import spark  # noqa: E402,F401  (the module's one Spark session)

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="ZooKeeper (Debian package zookeeper) not installed")

@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: the Spark job reads the usage reports of every earlier test."""
    return own_kafka


DAY = 86400
MIDNIGHT = 19675 * DAY  # 2023-11-14T00:00Z
NOW = MIDNIGHT + 2 * DAY  # the end of the two synthetic days
SLOT = 600  # six slots an hour
WINDOW = 2 * DAY
P = "producer_byte_rate"
C = "consumer_byte_rate"
R = "request_rate"


def _bucket(key, user, client_id, rate, demand=None, quota=50000.0, entity="users/alice"):
    return BucketUsage(key, user, client_id, entity, quota, float(rate),
                       float(rate if demand is None else demand))


def _report(proxy, at, buckets, interval=300.0):
    return UsageReport(proxy, float(at), interval, (111,), tuple(buckets)).to_json()


def synthetic(days=(0, 1)):
    """[(proxy, report JSON)] whose figures are known:

    - alice (producer_byte_rate, user alice): hour 09 UTC, the i-th slot of
      the two days (i = 1..12) at a fleet rate of 1000 i: p1 reports twice a
      slot (0.25 and 0.35 of it: a mean of 0.3), p2 once (0.7); demand =
      rate. Hour 14: 500 i, only p1, one report of two listing alice at
      twice that (the other lists nothing: it counts 0 in the mean); demand
      three times the rate. Her quota changes from 50000 to 60000 in the
      latest report.
    - bob/app (consumer_byte_rate, user bob, client app): p2 in hour 09 at a
      constant 100.
    - batch (request_rate, client batch): once at 5, once three days ago
      (outside the window).
    """
    out = []
    for day in days:
        for k in range(6):
            i = day * 6 + k + 1
            slot9 = MIDNIGHT + day * DAY + 9 * 3600 + k * SLOT
            v = 1000.0 * i
            out.append(("p1", _report("p1", slot9, [_bucket(P, "alice", "", 0.25 * v)])))
            out.append(("p1", _report("p1", slot9 + 300, [_bucket(P, "alice", "", 0.35 * v)])))
            out.append(("p2", _report("p2", slot9 + 100, [
                _bucket(P, "alice", "", 0.7 * v),
                _bucket(C, "bob", "app", 100, quota=1e6, entity="users/bob/clients/app")],
                interval=600.0)))
            slot14 = MIDNIGHT + day * DAY + 14 * 3600 + k * SLOT
            w = 500.0 * i
            last = day == 1 and k == 5
            out.append(("p1", _report("p1", slot14 + 10, [
                _bucket(P, "alice", "", 2 * w, 6 * w, quota=60000.0 if last else 50000.0)])))
            out.append(("p1", _report("p1", slot14 + 310, [])))
    if 1 in days:
        out.append(("p3", _report("p3", NOW - 3600, [
            _bucket(R, "", "batch", 5, quota=50, entity="clients/<default>")])))
        out.append(("p3", _report("p3", NOW - 3 * DAY, [
            _bucket(R, "", "batch", 900, quota=50, entity="clients/<default>")])))
    return out


def linear(values, p):
    """The percentile by linear interpolation between closest ranks."""
    s = sorted(values)
    x = (len(s) - 1) * p
    lo = int(x)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)


def figures(values):
    return {"p50": linear(values, 0.5), "p95": linear(values, 0.95),
            "p99": linear(values, 0.99), "peak": max(values)}


HOUR9 = [1000.0 * i for i in range(1, 13)]
HOUR14 = [500.0 * i for i in range(1, 13)]


def approx(d):
    return {k: pytest.approx(v, abs=0.002) for k, v in d.items()}


def _records(spark, pairs, extra=()):
    return spark.createDataFrame([(v,) for _, v in pairs] + [(v,) for v in extra],
                                 "value STRING")


def _entity(doc, key, user, client_id):
    found = [e for e in doc["entities"]
             if (e["key"], e["user"], e["client_id"]) == (key, user, client_id)]
    assert len(found) == 1, doc["entities"]
    return found[0]


def _check_document(doc, proxies=3):
    """The figures of synthetic() over both days."""
    assert doc["format"] == recommend.FORMAT and doc["version"] == 1
    assert doc["proxies"] == proxies and doc["slot_seconds"] == SLOT
    assert doc["window"] == {"seconds": WINDOW, "start": "2023-11-14T00:00:00.000Z",
                             "end": "2023-11-16T00:00:00.000Z"}
    assert len(doc["entities"]) == 3

    alice = _entity(doc, P, "alice", "")
    assert alice["quota"] == 60000.0 and alice["entity"] == "users/alice"
    assert [h["hour"] for h in alice["hours"]] == [9, 14]
    h9, h14 = alice["hours"]
    assert h9["samples"] == h14["samples"] == 12
    assert h9["rate"] == approx(figures(HOUR9)) and h9["demand"] == approx(figures(HOUR9))
    # known by hand: 1000 x (1 + 11 p)
    assert h9["rate"] == approx({"p50": 6500, "p95": 11450, "p99": 11890, "peak": 12000})
    assert h14["rate"] == approx(figures(HOUR14))
    assert h14["demand"] == approx(figures([3 * x for x in HOUR14]))
    assert alice["samples"] == 24
    assert alice["rate"] == approx(figures(HOUR9 + HOUR14))
    assert alice["first_seen"] == "2023-11-14T09:00:00.000Z"
    assert alice["last_seen"] == "2023-11-15T15:00:00.000Z"

    bob = _entity(doc, C, "bob", "app")
    assert bob["samples"] == 12 and [h["hour"] for h in bob["hours"]] == [9]
    assert bob["rate"] == approx({"p50": 100, "p95": 100, "p99": 100, "peak": 100})

    batch = _entity(doc, R, "", "batch")  # the report of three days ago is outside
    assert batch["samples"] == 1 and batch["demand"]["peak"] == 5
    assert [h["hour"] for h in batch["hours"]] == [23]


def test_known_figures_per_hour_of_day(spark):
    pairs = synthetic()
    junk = [None, "not json", json.dumps({"ProxyId": "p9"}),  # no ReportedAt
            _report("p9", NOW - 60, [_bucket(P, "eve", "", -5)]),  # a negative rate
            pairs[0][1]]  # the same report twice (a cycle read again)
    history = recommend.to_history(_records(spark, pairs, junk))
    doc = recommend.compute(history, NOW, window=WINDOW, slot=SLOT)
    assert doc["reports"] == len(pairs) - 1 + 1  # the one outside gone; p9's empty one kept
    _check_document(doc, proxies=4)  # p9's report counts, not its bucket
    # a narrower window: only the second day
    day2 = recommend.compute(history, NOW, window=DAY, slot=SLOT)
    h9 = _entity(day2, P, "alice", "")["hours"][0]
    assert h9["samples"] == 6 and h9["rate"] == approx(figures(HOUR9[6:]))


def test_the_job_options(capsys):
    import argparse

    parser = job.add_parser(argparse.ArgumentParser().add_subparsers())
    need = ["--bootstrap-server", "h:1", "--zookeeper", "h:2"]
    args = parser.parse_args(need)
    assert (args.recommend_every, args.recommend_window, args.recommend_slot) == (
        3600.0, 7 * DAY, 60.0)
    assert args.recommend_znode == "/kthrottle/quota-recommendations"
    args = parser.parse_args(need + ["--recommend-every", "off", "--recommend-window", "30d",
                                     "--recommend-slot", "5m"])
    assert (args.recommend_every, args.recommend_window, args.recommend_slot) == (
        None, 30 * DAY, 300.0)
    with pytest.raises(SystemExit):
        parser.parse_args(need + ["--recommend-slot", "7m"])
    assert "a slot must divide an hour evenly" in capsys.readouterr().err


def _doc_file(tmp_path, spark):
    doc = recommend.compute(recommend.to_history(_records(spark, synthetic())), NOW,
                            window=WINDOW, slot=SLOT)
    path = tmp_path / "recommendations.json"
    path.write_bytes(encode_snapshot(doc))
    return path


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "kthrottle", "quotas", "recommend", *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_command_prints_kafka_configs_lines_and_the_figures(spark, tmp_path):
    path = _doc_file(tmp_path, spark)
    out = _cli("--file", str(path), "--bootstrap-server", "kafka-0:9092")
    assert out.returncode == 0, out.stderr
    commands = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith("#")]
    # p99 of the demand in the busiest hour x 1.2: alice's is hour 14 (3 x 5945)
    assert commands == [
        "kafka-configs --bootstrap-server kafka-0:9092 --alter --entity-type clients "
        "--entity-name batch --add-config request_rate=6",
        "kafka-configs --bootstrap-server kafka-0:9092 --alter --entity-type users "
        "--entity-name alice --add-config producer_byte_rate=21402",
        "kafka-configs --bootstrap-server kafka-0:9092 --alter --entity-type users "
        "--entity-name bob --entity-type clients --entity-name app "
        "--add-config consumer_byte_rate=120",
    ]
    table = [ln for ln in out.stdout.splitlines() if ln.startswith("# ")]
    row = next(ln for ln in table if "user=alice" in ln).split()
    # ENTITY KEY HOUR SAMPLES P50 P95 P99 PEAK BUSIEST CURRENT RECOMMENDED, of the demand
    demand = sorted(HOUR9 + [3 * x for x in HOUR14])
    assert row[1:5] == ["user=alice", P, "all", "24"]
    assert row[5:9] == ["%d" % round(linear(demand, p)) for p in (0.5, 0.95, 0.99)] + ["18000"]
    assert row[9:] == ["14:00", "17835", "60000", "21402"]

    # the rate instead, its peak, no headroom: alice's busiest hour is 09
    out = _cli("--file", str(path), "--measure", "rate", "--percentile", "peak",
               "--headroom", "1", "--by-hour")
    assert out.returncode == 0, out.stderr
    assert "--entity-name alice --add-config producer_byte_rate=12000" in out.stdout
    assert "--bootstrap-server localhost:9092" in out.stdout
    hours = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("#   ")]
    assert ["#", "09:00", "12", "6500", "11450", "11890", "12000"] in hours


def test_the_command_says_what_is_wrong(tmp_path):
    out = _cli("--file", str(tmp_path / "missing.json"))
    assert out.returncode == 1 and "No such file" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else", "version": 1}))
    out = _cli("--file", str(bad))
    assert out.returncode == 1 and "not a kthrottle-quota-recommendations" in out.stderr
    out = _cli("--file", str(bad), "--headroom", "0")
    assert out.returncode == 2 and "--headroom takes a number > 0" in out.stderr
    assert _cli().returncode == 2  # --zookeeper or --file


def _publish(bootstrap, topic, pairs):
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    try:
        for key, value in pairs:
            p.send(topic, key=key.encode(), value=value.encode())
        p.flush(30)
    finally:
        p.close()


@needs_zookeeper
def test_spark_sync_keeps_the_history_and_writes_the_document_to_zookeeper(
        broker, zookeeper, spark, tmp_path):
    from kazoo.client import KazooClient

    topic = "usage-recommend"
    broker.create_topic(topic, partitions=2)
    chroot = "/rec"
    znode = chroot + recommend.DEFAULT_ZNODE

    def sync():
        return job.SparkSync(broker.bootstrap, zookeeper.hosts + chroot,
                             topic="no-volume-reports", usage_topic=topic, spark=spark,
                             state_dir=str(tmp_path / "state"), recommend_every=DAY,
                             recommend_window=WINDOW, recommend_slot=SLOT)

    zk = KazooClient(hosts=zookeeper.hosts)
    zk.start(timeout=10)
    first = sync()
    try:
        _publish(broker.bootstrap, topic, synthetic(days=(0,)))
        first.cycle(now=MIDNIGHT + DAY)  # into the history; the document a day after
        assert not zk.exists(znode)
        _publish(broker.bootstrap, topic, [pair for pair in synthetic()
                                           if pair not in synthetic(days=(0,))])
        first.cycle(now=NOW - 1800)
        assert not zk.exists(znode)
        first.cycle(now=NOW)
        data = zk.get(znode)[0]
        _check_document(recommendations.parse_document(data))
        # compacted: one version left, the increments removed
        history = tmp_path / "state" / topic / "history"
        assert [n[:2] for n in sorted(os.listdir(history)) if not n.startswith(".")] == ["v-"]
    finally:
        first.close()
    # a restarted job goes by the document written: the next one a day after it
    again = sync()
    try:
        again.cycle(now=NOW + 1800)
        assert zk.get(znode)[0] == data
    finally:
        again.close()
        zk.stop()
        zk.close()

    out = _cli("--zookeeper", zookeeper.hosts + chroot)
    assert out.returncode == 0, out.stderr
    assert ("kafka-configs --bootstrap-server localhost:9092 --alter --entity-type users "
            "--entity-name alice --add-config producer_byte_rate=21402") in out.stdout
    out = _cli("--zookeeper", zookeeper.hosts + "/elsewhere")
    assert out.returncode == 1 and "no recommendations at" in out.stderr


def test_spark_sync_writes_the_document_to_a_file(spark, tmp_path):
    """--recommend-file: the Recommender as the job builds it, without Kafka."""
    target = tmp_path / "out" / "recommendations.json"
    target.parent.mkdir()
    sync = job.SparkSync.__new__(job.SparkSync)  # only what writing the file needs
    sync.recommend_file = str(target)
    assert sync.recommendations_written_at() is None
    files = lambda s: job.StateFiles(s, str(tmp_path / "state"))  # noqa: E731
    r = recommend.Recommender(files, "usage/history", sync.write_recommendations, every=DAY,
                              window=WINDOW, slot=SLOT, written_at=sync.recommendations_written_at)
    r.append(spark, _records(spark, synthetic()))
    assert r.run(spark, NOW - DAY) is None and not target.exists()  # the first: a day on
    doc = r.run(spark, NOW)
    assert recommendations.parse_document(target.read_bytes()) == json.loads(json.dumps(doc))
    _check_document(doc)
    assert sync.recommendations_written_at() == NOW
    out = _cli("--file", str(target))
    assert out.returncode == 0 and "producer_byte_rate=21402" in out.stdout


def test_a_quota_groups_bucket_is_recommended_as_the_group_not_as_a_user():
    """A group has no Kafka entity: its figure is said as a comment naming the
    group, never a kafka-configs line for a user called group=etl."""
    hour = {"hour": 9, "rate": {"p95": 1000.0}}
    doc = {"entities": [
        {"key": "producer_byte_rate", "user": "group=etl", "client_id": "",
         "entity": "groups/etl", "hours": [hour]},
        {"key": "producer_byte_rate", "user": "alice", "client_id": "",
         "entity": "users/alice", "hours": [hour]}]}
    recs = recommendations.recommend(doc, percentile="p95", headroom=1.2, measure="rate")
    assert [r.entity for r in recs] == [(("groups", "etl"),), (("users", "alice"),)]
    lines = recommendations.commands(recs)
    assert lines[0] == ("# quota group=etl: producer_byte_rate=1200 "
                        "(the quota file's [groups] table)")
    assert "--entity-type users --entity-name alice" in lines[1]
    assert not any("group=etl" in line and "--entity-name" in line for line in lines)
