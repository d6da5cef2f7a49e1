"""Storage policy without I/O: limits, volume states, the cluster snapshot
the Spark job writes, and what a proxy makes of it (fail-safes)."""
import json

import pytest

from kthrottle.policy.storage import (
    OPEN,
    PAUSE,
    THROTTLE,
    UNKNOWN,
    BrokerReport,
    ClusterState,
    Limit,
    State,
    StoragePolicy,
    VolumeReport,
    cluster_snapshot,
    encode_snapshot,
    parse_limit,
    parse_report,
    parse_size,
    volume_state,
)

pytestmark = pytest.mark.integration

GB = 10 ** 9
NOW = 1_800_000_000.0


@pytest.mark.parametrize("text,limit", [
    ("MinFreeBytes:10GiB", Limit("MinFreeBytes", 10 * 2 ** 30)),
    ("MinFreeBytes:10GB", Limit("MinFreeBytes", 10 * GB)),
    ("ConsumedSpace:900000", Limit("ConsumedSpace", 900000)),
    ("MinFreePercentage:5", Limit("MinFreePercentage", 5.0)),
    ("MinFreePercentage: 12.5", Limit("MinFreePercentage", 12.5)),
])
def test_limits_parse(text, limit):
    assert parse_limit(text) == limit


@pytest.mark.parametrize("text,message", [
    ("MinFreeBytes", "TYPE:LEVEL"),
    ("FreeSpace:10", "limit type must be one of ConsumedSpace, MinFreeBytes, MinFreePercentage"),
    ("MinFreePercentage:150", "within 0-100"),
    ("MinFreeBytes:-1", "not a size"),
    ("MinFreeBytes:ten", "not a size"),
])
def test_bad_limits_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_limit(text)


def test_each_limit_type_in_consumed_bytes():
    capacity = 100 * GB
    assert Limit("ConsumedSpace", 70 * GB).consumed_at(capacity) == 70 * GB
    assert Limit("MinFreeBytes", 10 * GB).consumed_at(capacity) == 90 * GB
    assert Limit("MinFreePercentage", 25).consumed_at(capacity) == 75 * GB
    assert parse_size("1.5KiB") == 1536


@pytest.mark.parametrize("soft,hard", [
    (Limit("ConsumedSpace", 60 * GB), Limit("ConsumedSpace", 80 * GB)),
    (Limit("MinFreeBytes", 40 * GB), Limit("MinFreeBytes", 20 * GB)),
    (Limit("MinFreePercentage", 40), Limit("MinFreePercentage", 20)),
])
def test_the_factor_falls_from_soft_to_hard_in_proportion(soft, hard):
    capacity = 100 * GB
    assert volume_state(capacity, 50 * GB, soft, hard) == State(OPEN, 1.0)
    assert volume_state(capacity, 60 * GB, soft, hard) == State(OPEN, 1.0)  # at soft: not yet
    assert volume_state(capacity, 65 * GB, soft, hard) == State(THROTTLE, 0.75)
    assert volume_state(capacity, 70 * GB, soft, hard) == State(THROTTLE, 0.5)
    assert volume_state(capacity, 79 * GB, soft, hard) == State(THROTTLE, 0.05)
    assert volume_state(capacity, 80 * GB, soft, hard) == State(PAUSE, 0.0)  # at hard: pause
    assert volume_state(capacity, 95 * GB, soft, hard) == State(PAUSE, 0.0)


def test_a_soft_limit_past_the_hard_one_has_no_throttle_band():
    soft, hard = Limit("ConsumedSpace", 90), Limit("ConsumedSpace", 80)
    assert volume_state(100, 85, soft, hard).state == PAUSE
    assert volume_state(100, 79, soft, hard).state == OPEN


def report(broker, volumes, at=NOW - 5, soft="MinFreePercentage:40", hard="MinFreePercentage:20"):
    return BrokerReport(broker, at, parse_limit(soft), parse_limit(hard), tuple(volumes))


def vol(name, consumed_pct, partitions=(), capacity=100 * GB):
    return VolumeReport(name, capacity, int(consumed_pct * capacity / 100), "/data/" + name,
                        tuple(partitions))


def test_a_report_round_trips_through_json_in_the_documented_form():
    r = report(7, [vol("sda1", 70, [("orders", 0), ("my-topic-x", 12)])])
    text = r.to_json()
    data = json.loads(text)
    assert data["BrokerId"] == 7 and data["SnapshotAt"].endswith("Z")
    assert data["SoftLimit"] == {"type": "MinFreePercentage", "level": 40}
    assert data["Volumes"][0]["Partitions"] == ["orders-0", "my-topic-x-12"]
    back = parse_report(text.encode())
    assert back.volumes == r.volumes and back.broker_id == 7
    assert abs(back.snapshot_at - r.snapshot_at) < 0.001


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("BrokerId"), "BrokerId must be an integer"),
    (lambda d: d.update(SnapshotAt="yesterday"), "not an ISO 8601"),
    (lambda d: d.update(SnapshotAt="2026-01-01T00:00:00"), "no time zone"),
    (lambda d: d.update(HardLimit={"type": "Nope", "level": 1}), "HardLimit: limit type"),
    (lambda d: d["Volumes"][0].update(Capacity=-5), "Capacity must be a number"),
    (lambda d: d["Volumes"][0].update(Partitions=["orders"]), "not <topic>-<partition>"),
    (lambda d: d.update(Volumes={}), "Volumes must be a list"),
])
def test_a_malformed_report_is_rejected_with_the_reason(mutate, message):
    data = json.loads(report(1, [vol("sda1", 10, [("t", 0)])]).to_json())
    mutate(data)
    with pytest.raises(ValueError, match=message):
        parse_report(json.dumps(data))


def test_per_volume_limits_override_the_brokers():
    r = report(1, [vol("a", 50), vol("b", 50)._replace(soft=parse_limit("ConsumedSpace:10GB"),
                                                       hard=parse_limit("ConsumedSpace:60GB"))])
    states = [s for _, s in parse_report(r.to_json()).volume_states()]
    assert states == [State(OPEN, 1.0), State(THROTTLE, 0.2)]


def test_the_strongest_volume_wins_and_any_pause_pauses_the_cluster():
    reports = {1: report(1, [vol("a", 30), vol("b", 70, [("t", 0)])]),  # b: THROTTLE 0.5
               2: report(2, [vol("a", 75, [("t", 1)])])}  # THROTTLE 0.25
    replicas = {("t", 0): [1], ("t", 1): [2], ("u", 0): [1, 2]}
    snap = cluster_snapshot(reports, [1, 2], replicas, NOW, freshness=60)
    assert snap["cluster"] == {"state": THROTTLE, "factor": 0.25, "unknown_brokers": []}
    # per partition: the replica's own volume; an unlisted replica takes its broker's worst
    assert snap["partitions"] == [["t", 0, THROTTLE, 0.5], ["t", 1, THROTTLE, 0.25],
                                  ["u", 0, THROTTLE, 0.25]]
    reports[2] = report(2, [vol("a", 85, [("t", 1)])])
    snap = cluster_snapshot(reports, [1, 2], replicas, NOW, freshness=60)
    assert snap["cluster"]["state"] == PAUSE
    assert ["t", 0, THROTTLE, 0.5] in snap["partitions"]  # volume 1b is only throttled
    assert ["t", 1, PAUSE, 0.0] in snap["partitions"]


def test_stale_and_missing_reports_make_brokers_and_their_partitions_unknown():
    reports = {1: report(1, [vol("a", 10, [("t", 0)])]),
               2: report(2, [vol("a", 10, [("t", 1)])], at=NOW - 300)}
    replicas = {("t", 0): [1], ("t", 1): [2], ("t", 2): [3], ("t", 3): [1, 3]}
    snap = cluster_snapshot(reports, [1, 2, 3], replicas, NOW, freshness=60)
    assert snap["cluster"] == {"state": OPEN, "factor": 1.0, "unknown_brokers": [2, 3]}
    assert snap["brokers"]["2"]["reason"].startswith("report is 300 s old")
    assert snap["brokers"]["3"]["reason"] == "no report"
    assert [p[:3] for p in snap["partitions"]] == [
        ["t", 1, UNKNOWN], ["t", 2, UNKNOWN], ["t", 3, UNKNOWN]]


def test_a_proxy_reads_the_snapshot_and_applies_its_fail_safe():
    reports = {1: report(1, [vol("a", 70, [("t", 0)])])}
    snap = cluster_snapshot(reports, [1, 2], {("t", 0): [1], ("t", 1): [2]}, NOW, 60)
    state = ClusterState.from_json(json.dumps(snap).encode())
    assert state.cluster == State(THROTTLE, 0.5) and state.unknown_brokers == (2,)
    paused = StoragePolicy("cluster", PAUSE, max_age=30)
    opened = StoragePolicy("partition", OPEN, max_age=30)
    for p in (paused, opened):
        assert p.cluster(NOW)[0].state == p.fail_safe  # nothing yet: the fail-safe
        assert str(p.cluster(NOW)[1]) == "no cluster state yet"
        p.update(state)
    # broker 2 is unknown: PAUSE under the PAUSE fail-safe, the known state under OPEN
    state_now, why = paused.cluster(NOW + 1)
    assert (state_now, str(why)) == (State(PAUSE, 0.0), "no fresh volume report from broker(s) 2")
    assert opened.cluster(NOW + 1)[0] == State(THROTTLE, 0.5)
    assert opened.partition("t", 0, NOW + 1) == State(THROTTLE, 0.5)
    assert opened.partition("t", 1, NOW + 1) == State(OPEN, 1.0)  # unknown, fail-safe OPEN
    assert paused.partition("t", 1, NOW + 1) == State(PAUSE, 0.0)
    assert opened.partition("elsewhere", 0, NOW + 1) == State(OPEN, 1.0)
    # a snapshot older than the maximum age is as good as none
    assert str(paused.cluster(NOW + 31)[1]).startswith("the cluster state is 31 s old")
    assert opened.partition("t", 0, NOW + 31) == State(OPEN, 1.0)


def test_the_snapshot_maps_the_ids_of_the_topics_it_lists_for_produce_v13():
    import uuid

    reports = {1: report(1, [vol("a", 70, [("t", 0)])]), 2: report(2, [vol("b", 10, [])])}
    replicas = {("t", 0): [1], ("quiet", 0): [2]}
    ids = {"t": str(uuid.UUID(int=1)), "quiet": str(uuid.UUID(int=2))}
    snap = cluster_snapshot(reports, [1, 2], replicas, NOW, 60, topic_ids=ids)
    assert snap["topic_ids"] == {"t": ids["t"]}  # only what is listed: the rest is OPEN
    assert "topic_ids" not in cluster_snapshot(reports, [1, 2], replicas, NOW, 60)
    state = ClusterState.from_json(json.dumps(snap).encode())
    assert state.topic_names == {uuid.UUID(int=1): "t"}
    policy = StoragePolicy("partition", PAUSE, max_age=30)
    policy.update(state)
    assert policy.partition_by_id(uuid.UUID(int=1), 0, NOW + 1) == State(THROTTLE, 0.5)
    assert policy.partition_by_id(uuid.UUID(int=2), 0, NOW + 1) == State(OPEN, 1.0)
    # stale: the fail-safe, by id as by name
    assert policy.partition_by_id(uuid.UUID(int=2), 0, NOW + 31) == State(PAUSE, 0.0)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(topic_ids=["t"]), "topic_ids must be an object"),
    (lambda d: d.update(topic_ids={"t": "not-an-id"}), "topic_ids.t is not a topic id"),
    (lambda d: d.update(format="other"), "not a kthrottle-cluster-state snapshot"),
    (lambda d: d.update(version=2), "snapshot version 2; this proxy reads version 1"),
    (lambda d: d["cluster"].update(state="MELTING"), "cluster state must be one of"),
    (lambda d: d["cluster"].update(factor=3), "factor must be within 0-1"),
    (lambda d: d.update(partitions=[["t", "0", "PAUSE", 0]]), "a partition entry is"),
    (lambda d: d.update(generated_at="now"), "generated_at must be epoch seconds"),
])
def test_a_malformed_snapshot_is_rejected_with_the_reason(mutate, message):
    snap = cluster_snapshot({1: report(1, [vol("a", 70, [("t", 0)])])}, [1], {("t", 0): [1]},
                            NOW, 60)
    mutate(snap)
    with pytest.raises(ValueError, match=message):
        ClusterState.from_json(json.dumps(snap))


# times that would switch the staleness checks off (issue 14) --------------------------

def test_a_report_dated_ahead_of_the_jobs_clock_or_not_a_time_is_unknown():
    from kthrottle.policy.storage import MAX_CLOCK_SKEW

    reports = {1: report(1, [vol("a", 10, [("t", 0)])], at=NOW + 3600),
               2: report(2, [vol("a", 10, [("t", 1)])], at=float("nan")),
               3: report(3, [vol("a", 10, [("t", 2)])], at=NOW + MAX_CLOCK_SKEW)}  # allowed
    replicas = {("t", 0): [1], ("t", 1): [2], ("t", 2): [3]}
    snap = cluster_snapshot(reports, [1, 2, 3], replicas, NOW, freshness=60)
    assert snap["cluster"]["unknown_brokers"] == [1, 2]
    assert snap["brokers"]["1"]["reason"].startswith("report is dated 3600 s ahead")
    assert snap["brokers"]["2"]["reason"] == "report time nan is not a time"
    assert snap["brokers"]["3"]["state"] == OPEN
    assert [p[:3] for p in snap["partitions"]] == [["t", 0, UNKNOWN], ["t", 1, UNKNOWN]]
    ClusterState.from_json(encode_snapshot(snap)).check_clock(NOW)  # it reads back


TOO_BIG = "1e999"  # parses as a float: infinity


def _snapshot_text(mutate=lambda snap: None, **generated):
    snap = cluster_snapshot({1: report(1, [vol("a", 70, [("t", 0)])])}, [1], {("t", 0): [1]},
                            NOW, 60)
    snap.update(generated)
    mutate(snap)
    # Python writes NaN and Infinity as such, as a careless writer would
    return json.dumps(snap).replace('"%s"' % TOO_BIG, TOO_BIG)


@pytest.mark.parametrize("text,message", [
    (_snapshot_text(generated_at=float("nan")), "NaN is not a JSON number"),
    (_snapshot_text(generated_at=float("inf")), "Infinity is not a JSON number"),
    (_snapshot_text(generated_at=-float("inf")), "-Infinity is not a JSON number"),
    (_snapshot_text(generated_at=TOO_BIG),
     r"generated_at must be epoch seconds \(a finite number\), got inf"),
    (_snapshot_text(lambda snap: snap["brokers"]["1"].update(reported_at=TOO_BIG)),
     r"brokers.1.reported_at must be epoch seconds \(a finite number\)"),
    (_snapshot_text(lambda snap: snap["brokers"]["1"].update(reported_at=NOW + 3600)),
     "brokers.1.reported_at is 3600 s after generated_at, yet the broker's state is 'THROTTLE'"),
])
def test_a_snapshot_whose_times_cannot_age_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        ClusterState.from_json(text)


def test_a_snapshot_within_the_clock_skew_is_taken_and_beyond_it_refused():
    from kthrottle.policy.storage import MAX_CLOCK_SKEW

    state = ClusterState.from_json(_snapshot_text(generated_at=NOW + 3600))
    with pytest.raises(ValueError, match="generated_at is 3600 s ahead of this machine's clock"):
        state.check_clock(NOW)
    state = ClusterState.from_json(_snapshot_text(generated_at=NOW + MAX_CLOCK_SKEW))
    state.check_clock(NOW)
    with pytest.raises(ValueError, match="generated_at is 31 s ahead of this machine's clock"):
        state.check_clock(NOW - 1)


@pytest.mark.parametrize("generated_at,reason", [
    (NOW + 3600, "the cluster state is dated 3600 s ahead of this proxy's clock"),
    (float("nan"), "the cluster state's time nan is not a time"),
    (float("inf"), "the cluster state's time inf is not a time"),
])
def test_a_proxy_never_counts_a_snapshot_dated_ahead_as_fresh(generated_at, reason):
    """A snapshot taken in while the clocks agreed, read after this clock was
    set back (or built by hand): the fail-safe applies, as for a stale one."""
    paused = StoragePolicy("cluster", PAUSE, max_age=30)
    paused.update(ClusterState(generated_at, State(OPEN, 1.0)))
    state, why = paused.cluster(NOW)
    assert state == State(PAUSE, 0.0) and str(why).startswith(reason)
    assert paused.partition("t", 0, NOW) == State(PAUSE, 0.0)


def test_the_job_never_writes_nan_nor_infinity():
    with pytest.raises(ValueError):
        encode_snapshot({"generated_at": float("nan")})


def test_a_large_snapshot_is_stored_compressed_and_read_back():
    from kthrottle.policy.storage import COMPRESS_ABOVE, decode_snapshot, encode_snapshot

    reports = {b: report(b, [vol("v%d" % i, 85 if i == 0 else 10, [("t%d" % b, i)])
                             for i in range(10)]) for b in range(1, 400)}
    replicas = {("t%d" % b, i): [b] for b in range(1, 400) for i in range(10)}
    snap = cluster_snapshot(reports, list(reports), replicas, NOW, 60)
    data = encode_snapshot(snap)
    assert len(json.dumps(snap)) > COMPRESS_ABOVE and data[:2] == b"\x1f\x8b"
    assert len(data) < len(json.dumps(snap)) / 5
    state = ClusterState.from_json(data)
    assert state.cluster == State(PAUSE, 0.0) and state.partitions[("t7", 0)].state == PAUSE
    assert decode_snapshot(encode_snapshot({"small": 1})) == {"small": 1}  # plain JSON
    with pytest.raises(ValueError, match="compressed snapshot is corrupt"):
        ClusterState.from_json(data[:100])


# the reading side, with a real ZooKeeper: a snapshot dated ahead is refused as a
# malformed one is (a log line, the rejected counter), and the last good one stays

def _zookeeper_available():
    from kthrottle_testkit import zookeeper as zk_server

    return zk_server.available()


async def _until(predicate, what, timeout=5.0):
    import asyncio

    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out waiting for %s" % what)


@pytest.mark.skipif(not _zookeeper_available(), reason="scripts/test installs ZooKeeper")
def test_the_source_refuses_a_snapshot_dated_ahead_and_keeps_the_last_good_one(
        zookeeper, caplog):
    import asyncio
    import logging
    import time
    import uuid

    from kazoo.client import KazooClient

    from kthrottle.sources.cluster_state import ClusterStateSource

    caplog.set_level(logging.INFO, logger="kthrottle.storage")
    path = "/storage-policy-%s/cluster-state" % uuid.uuid4().hex[:8]

    def snapshot(generated_at):
        snap = cluster_snapshot({1: report(1, [vol("a", 70)], at=generated_at)}, [1], {},
                                generated_at, 60)
        return json.dumps(snap).encode()  # NaN written as such

    def refused(why):
        return any(why in r.getMessage() and "the previous one stays" in r.getMessage()
                   for r in caplog.records if r.name == "kthrottle.storage")

    async def scenario(writer):
        seen = []
        writer.create(path, snapshot(time.time()), makepath=True)
        source = ClusterStateSource(zookeeper.hosts, path)
        await source.start(seen.append)
        try:
            await _until(lambda: len(seen) == 1, "the first snapshot")
            writer.set(path, snapshot(time.time() + 3600))
            await _until(lambda: source.rejected == 1, "the snapshot dated ahead refused")
            assert refused("generated_at is 3600 s ahead of this machine's clock")
            writer.set(path, snapshot(float("nan")))
            await _until(lambda: source.rejected == 2, "the NaN snapshot refused")
            assert refused("NaN is not a JSON number")
            await asyncio.sleep(0.05)
            assert len(seen) == 1  # the last good snapshot stays in force
            writer.set(path, snapshot(time.time()))
            await _until(lambda: len(seen) == 2, "the next good snapshot")
            assert source.rejected == 2 and seen[-1].generated_at <= time.time()
        finally:
            await source.stop()

    writer = KazooClient(hosts=zookeeper.hosts)
    writer.start(timeout=10)
    try:
        asyncio.run(scenario(writer))
    finally:
        writer.stop()
        writer.close()
