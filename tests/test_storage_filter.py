"""The storage filter in the connection pipeline, without sockets: a fake
clock, the cluster state set by hand as the ZooKeeper source would."""
import pytest

from kthrottle.codecs.frames import DEFER, FrameCutter
from kthrottle.policy.entities import PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.policy.storage import (
    OPEN_STATE,
    PAUSE,
    PAUSE_STATE,
    THROTTLE,
    UNKNOWN,
    ClusterState,
    State,
    StoragePolicy,
)
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.storage import BEHIND_RELEASE_SECONDS, StorageThrottle
from kthrottle_testkit.frames import advertise
from test_pipeline import Harness, fetch_req, produce_req, produce_resp, req_cids

pytestmark = pytest.mark.unit

WALL = 1_800_000_000.0


class StorageHarness(Harness):
    def __init__(self, snapshot=None, fail_safe=PAUSE, **kw):
        self.storage = StorageThrottle(StoragePolicy("cluster", fail_safe, max_age=60), **kw)
        manager = QuotaManager(snapshot) if snapshot is not None else None
        super().__init__(filters=standard_filters(advertise, manager, storage=self.storage))
        self.conn.quota_manager = self.manager = manager

    def cluster(self, state, unknown=(), generated_at=WALL):
        self.storage.policy.update(ClusterState(generated_at, state, unknown))
        return self.storage.refresh(WALL, self.now)


def test_open_costs_nothing_and_changes_nothing():
    h = StorageHarness()
    h.client(produce_req(1) + produce_req(2))
    assert req_cids(h.take_broker()) == [1, 2] and h.client_paused_until is None


def test_before_any_snapshot_producers_are_not_held():
    h = StorageHarness()
    assert h.storage.refresh(WALL) == (OPEN_STATE, None)
    h.client(produce_req(1))
    assert req_cids(h.take_broker()) == [1]


@pytest.mark.parametrize("chunk", [None, 7])
def test_pause_holds_a_produce_unread_until_the_state_clears(chunk):
    h = StorageHarness()
    h.cluster(PAUSE_STATE)
    h.client(produce_req(1) + fetch_req(2), chunk=chunk)
    assert h.take_broker() == b""  # nothing of it reached the broker, nor what came after
    assert h.client_paused_until == pytest.approx(0.25)
    h.at(0.25)
    assert h.take_broker() == b"" and h.client_paused_until == pytest.approx(0.5)
    h.cluster(OPEN_STATE)
    h.at(0.5)
    assert req_cids(h.take_broker()) == [1, 2]  # in order, once
    assert h.conn.requests == 2 and h.storage.deferred == 2
    h.broker(produce_resp(1))
    assert h.take_client()  # answered as usual, no throttle time


def test_a_held_produce_goes_on_at_the_cap_with_what_was_sent_behind_it():
    """A pipelining client (the Java producer keeps 5 in flight) must have
    every request answered within its request.timeout.ms: those sent while
    the first was held go on with it, none is held a second time."""
    h = StorageHarness(pause_max_ms=1000)
    h.cluster(PAUSE_STATE)
    h.client(b"".join(produce_req(c) for c in range(1, 6)))
    t = 0.0
    while not h.to_broker and t < 2:
        t = h.client_paused_until
        h.at(t)
    assert req_cids(h.take_broker()) == [1, 2, 3, 4, 5] and t == pytest.approx(1.0)
    assert h.storage.released_at_cap == 5 and h.storage.deferred == 4  # 1 held, 4 rechecks
    # one sent in the next cycle, after the answers: held again, for the cap
    h.at(1.0 + BEHIND_RELEASE_SECONDS + 0.1)
    h.client(produce_req(6))
    assert h.take_broker() == b"" and h.client_paused_until is not None
    start = h.now
    while not h.to_broker and h.now < start + 2:
        h.at(h.client_paused_until)
    assert req_cids(h.take_broker()) == [6] and h.now == pytest.approx(start + 1.0)


def test_a_request_sent_behind_a_held_one_arrives_later_still_goes_on_with_it():
    """What the client wrote while the first was held may reach the proxy in
    the next read, just after the release: it goes on too."""
    h = StorageHarness(pause_max_ms=1000)
    h.cluster(PAUSE_STATE)
    h.client(produce_req(1))
    while not h.to_broker and h.now < 2:
        h.at(h.client_paused_until)
    assert req_cids(h.take_broker()) == [1]
    h.at(h.now + 0.01)
    h.client(produce_req(2) + produce_req(3))
    assert req_cids(h.take_broker()) == [2, 3]


def test_fetches_and_other_apis_carry_on_during_a_pause():
    h = StorageHarness()
    h.cluster(PAUSE_STATE)
    h.client(fetch_req(1) + fetch_req(2))
    assert req_cids(h.take_broker()) == [1, 2]


def test_excluded_principals_are_never_held():
    h = StorageHarness(excluded=["volume-agent"])
    h.conn.principal = "volume-agent"
    h.cluster(PAUSE_STATE)
    h.client(produce_req(1))
    assert req_cids(h.take_broker()) == [1]


def test_throttle_keeps_the_factor_of_the_producers_quota():
    quota = {"clients/app-1": {PRODUCER_BYTE_RATE: 100_000.0}}
    h = StorageHarness(quota)
    h.cluster(State(THROTTLE, 0.1))  # 10,000 B/s kept
    h.client(produce_req(1, nbytes=200_000))  # 20 kB/s over the padded 10 s window
    assert req_cids(h.take_broker()) == [1]  # it goes on; the client then waits
    assert h.storage.throttled == 1 and h.client_paused_until is not None
    # the same traffic at factor 1 is within the quota: no storage throttle
    h2 = StorageHarness(quota)
    h2.cluster(State(THROTTLE, 1.0))
    h2.client(produce_req(1, nbytes=200_000))
    assert h2.storage.throttled == 0


def test_a_producer_without_a_quota_keeps_the_factor_of_the_base_rate():
    slow = StorageHarness(base_rate=1000.0)
    slow.cluster(State(THROTTLE, 0.5))
    slow.client(produce_req(1, nbytes=20_000))
    fast = StorageHarness(base_rate=10_000_000.0)
    fast.cluster(State(THROTTLE, 0.5))
    fast.client(produce_req(1, nbytes=20_000))
    assert slow.client_paused_until is not None and fast.client_paused_until is None


def test_unknown_brokers_and_stale_snapshots_take_the_fail_safe():
    h = StorageHarness(fail_safe=PAUSE)
    state, reason = h.cluster(State(THROTTLE, 0.5), unknown=[3])
    assert state == PAUSE_STATE and "broker(s) 3" in str(reason)
    o = StorageHarness(fail_safe="OPEN")
    assert o.cluster(State(THROTTLE, 0.5), unknown=[3])[0] == State(THROTTLE, 0.5)
    assert o.cluster(OPEN_STATE, generated_at=WALL - 61)[0] == OPEN_STATE  # stale, OPEN
    state, reason = h.cluster(OPEN_STATE, generated_at=WALL - 61)
    assert (state, str(reason)) == (PAUSE_STATE, "the cluster state is 61 s old (max 60 s)")


def test_the_cutter_defers_a_frame_and_keeps_every_byte_in_order():
    seen = []

    def on_head(head, frame_len):
        seen.append(bytes(head[:8]))
        return DEFER if len(seen) == 2 else 0

    cutter = FrameCutter(on_head, None)
    data = produce_req(1) + produce_req(2) + produce_req(3)
    out = []
    cutter.feed(data, out)
    assert b"".join(bytes(c) for c in out) == produce_req(1)
    assert cutter.rest == produce_req(2) + produce_req(3) and cutter.at_boundary


def produce_to(cid, partitions, nbytes=600, version=8):
    """A Produce request writing ``nbytes`` to each (topic, partition); from version 13 the
    topic is a uuid.UUID (named by id alone, KIP-516)."""
    import uuid
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka.protocol.producer import ProduceRequest
    D = ProduceRequest.TopicProduceData
    topics = {}
    for topic, partition in partitions:
        topics.setdefault(topic, []).append(D.PartitionProduceData(index=partition,
                                                                   records=b"r" * nbytes))
    req = ProduceRequest[version](transactional_id=None, acks=1, timeout_ms=30000, topic_data=[
        D(name=None, topic_id=t, partition_data=p) if isinstance(t, uuid.UUID) else
        D(name=t, topic_id=uuid.UUID(int=1), partition_data=p) for t, p in topics.items()])
    req.with_header(correlation_id=cid, client_id="app-1")
    return bytes(req.encode(header=True, framed=True))


class PartitionHarness(StorageHarness):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.storage.policy.scope = "partition"

    def partitions(self, states, generated_at=WALL, topic_names=None):
        self.storage.policy.update(ClusterState(generated_at, OPEN_STATE, (), states,
                                                topic_names=topic_names))
        return self.storage.refresh(WALL, self.now)


@pytest.mark.parametrize("chunk", [None, 5, 333])
def test_partition_scope_touches_only_producers_of_a_filling_partition(chunk):
    h = PartitionHarness(pause_max_ms=8000)
    h.partitions({("hot", 1): PAUSE_STATE})
    # a producer writing elsewhere keeps its full speed
    h.client(produce_to(1, [("cold", 0), ("hot", 0)]) + produce_to(2, [("cold", 1)]),
             chunk=chunk)
    assert req_cids(h.take_broker()) == [1, 2] and h.client_paused_until is None
    # one that writes to the paused partition (among others) goes on, then waits
    h.client(produce_to(3, [("cold", 0), ("hot", 1)], nbytes=5000) + produce_to(4, [("cold", 0)]),
             chunk=chunk)
    assert req_cids(h.take_broker()) == [3]  # whole, streamed; 4 is not read
    assert h.client_paused_until == pytest.approx(8.0)
    h.at(8.0)
    assert req_cids(h.take_broker()) == [4]


def test_partition_scope_finds_a_partition_named_by_topic_id_in_produce_v13():
    """Produce v13 names topics by id alone: the snapshot's map of the ids of the topics it
    lists decides, so only a producer to the paused partition waits."""
    import uuid

    hot, cold = uuid.UUID(int=0xA1), uuid.UUID(int=0xB2)
    h = PartitionHarness(pause_max_ms=8000)
    h.partitions({("hot", 1): PAUSE_STATE}, topic_names={hot: "hot"})
    h.client(produce_to(1, [(cold, 0), (hot, 0)], version=13)
             + produce_to(2, [(cold, 1)], version=13))
    assert req_cids(h.take_broker()) == [1, 2] and h.client_paused_until is None
    h.client(produce_to(3, [(cold, 0), (hot, 1)], version=13) + produce_to(4, [(cold, 0)],
                                                                          version=13))
    assert req_cids(h.take_broker()) == [3]
    assert h.client_paused_until == pytest.approx(8.0)


def test_a_snapshot_without_topic_ids_leaves_v13_producers_to_the_cluster_state():
    import uuid

    h = PartitionHarness(pause_max_ms=8000)
    h.storage.policy.update(ClusterState(WALL, State(THROTTLE, 0.5), (),
                                         {("hot", 1): PAUSE_STATE}))
    h.storage.refresh(WALL, h.now)
    # by name: only hot-1's producer; by id, with no map: the cluster's THROTTLE
    by_id = h.storage.policy.partition_by_id(uuid.UUID(int=5), 0, WALL)
    assert by_id == State(THROTTLE, 0.5)
    h.storage.policy.update(ClusterState(WALL, State(THROTTLE, 0.5), (),
                                         {("hot", 1): PAUSE_STATE},
                                         topic_names={uuid.UUID(int=5): "hot"}))
    assert h.storage.policy.partition_by_id(uuid.UUID(int=5), 1, WALL) == PAUSE_STATE
    assert h.storage.policy.partition_by_id(uuid.UUID(int=5), 0, WALL) == OPEN_STATE
    assert h.storage.policy.partition_by_id(uuid.UUID(int=6), 1, WALL) == OPEN_STATE


def test_partition_scope_throttles_once_for_what_was_sent_behind_the_throttled_request():
    """Five requests to a paused partition, pipelined: the first earns the
    pause, the four read when the client is read again go on unthrottled (a
    second pause each would put the last past the client's timeout); the
    next one after them earns it again."""
    h = PartitionHarness(pause_max_ms=8000)
    h.partitions({("hot", 1): PAUSE_STATE})
    h.client(b"".join(produce_to(c, [("hot", 1)]) for c in range(1, 6)))
    assert req_cids(h.take_broker()) == [1] and h.client_paused_until == pytest.approx(8.0)
    h.at(8.0)
    assert req_cids(h.take_broker()) == [2, 3, 4, 5] and h.client_paused_until is None
    h.at(8.0 + BEHIND_RELEASE_SECONDS + 0.1)
    h.client(produce_to(6, [("hot", 1)]) + produce_to(7, [("hot", 1)]))
    assert req_cids(h.take_broker()) == [6] and h.client_paused_until is not None


def test_partition_scope_throttles_by_the_strongest_partition():
    h = PartitionHarness(base_rate=1000.0)
    h.partitions({("warm", 0): State(THROTTLE, 0.9), ("hotter", 0): State(THROTTLE, 0.1)})
    h.client(produce_to(1, [("warm", 0)], nbytes=8000))  # 800 B/s of 900 kept: fine
    assert h.client_paused_until is None
    h.client(produce_to(2, [("warm", 0), ("hotter", 0)], nbytes=3000))
    assert h.client_paused_until is not None and h.storage.throttled == 1


def test_partition_scope_reads_nothing_while_every_partition_is_open():
    h = PartitionHarness()
    h.partitions({})
    assert not h.storage.watch_partitions
    h.client(produce_to(1, [("any", 0)]))
    assert req_cids(h.take_broker()) == [1]


# the fail-safe's reach (--storage-unknown-scope) and the first snapshot's clock ------

def _unknown_broker_state(cluster=OPEN_STATE):
    """Broker 3 has no fresh report: ("b", 0) has a replica on it."""
    return ClusterState(WALL, cluster, (3,), {("b", 0): State(UNKNOWN, 1.0)})


@pytest.mark.parametrize("scope", ["cluster", "partition"])
def test_cluster_reach_holds_every_producer_in_either_scope(scope):
    h = StorageHarness(pause_max_ms=5000)
    h.storage.policy.scope = scope
    assert h.storage.policy.unknown_scope == "cluster"  # the default
    h.storage.policy.update(_unknown_broker_state())
    state, reason = h.storage.refresh(WALL, h.now)
    assert "broker(s) 3" in str(reason)
    h.client(produce_to(1, [("a", 0)]))  # no replica on broker 3, held all the same
    if scope == "cluster":
        assert state == PAUSE_STATE and h.take_broker() == b""  # left unread
    else:
        assert req_cids(h.take_broker()) == [1] and h.client_paused_until == pytest.approx(5.0)


@pytest.mark.parametrize("scope", ["cluster", "partition"])
def test_broker_reach_holds_only_producers_to_the_unknown_brokers_partitions(scope):
    h = StorageHarness(pause_max_ms=5000)
    h.storage.policy.scope = scope
    h.storage.policy.unknown_scope = "broker"
    h.storage.policy.update(_unknown_broker_state())
    state, reason = h.storage.refresh(WALL, h.now)
    assert state == OPEN_STATE and "broker(s) 3" in str(reason)  # the known brokers' state
    assert h.storage.watch_partitions  # the requests' partitions are read
    h.client(produce_to(1, [("a", 0), ("a", 1)]))
    assert req_cids(h.take_broker()) == [1] and h.client_paused_until is None
    h.client(produce_to(2, [("a", 0), ("b", 0)]) + produce_to(3, [("a", 0)]))
    assert req_cids(h.take_broker()) == [2]  # streamed whole; then the producer waits
    assert h.client_paused_until == pytest.approx(5.0)


def test_broker_reach_still_meets_what_the_known_brokers_say():
    h = StorageHarness(base_rate=1000.0)
    h.storage.policy.unknown_scope = "broker"
    h.storage.policy.update(_unknown_broker_state(State(THROTTLE, 0.1)))
    h.storage.refresh(WALL, h.now)
    h.client(produce_to(1, [("a", 0)], nbytes=5000))  # 500 B/s over 100 kept
    assert req_cids(h.take_broker()) == [1] and h.storage.throttled == 1
    h2 = StorageHarness()
    h2.storage.policy.unknown_scope = "broker"
    h2.storage.policy.update(_unknown_broker_state(PAUSE_STATE))
    h2.storage.refresh(WALL, h2.now)
    h2.client(produce_to(1, [("a", 0)]))
    assert h2.take_broker() == b""  # a known broker past its hard limit: held unread


@pytest.mark.parametrize("reach", ["cluster", "broker"])
def test_no_first_snapshot_within_the_maximum_age_is_unknown_as_a_stale_one(reach):
    h = StorageHarness()  # max_age 60 s
    h.storage.policy.unknown_scope = reach
    assert h.storage.refresh(WALL, h.now) == (OPEN_STATE, None)  # the clock starts
    assert h.storage.refresh(WALL + 59, h.now) == (OPEN_STATE, None)
    h.client(produce_req(1))
    assert req_cids(h.take_broker()) == [1]
    state, reason = h.storage.refresh(WALL + 61, h.now)
    assert state == PAUSE_STATE and str(reason) == (
        "no cluster state 61 s after this proxy began following it (max 60 s)")
    h.client(produce_req(2))
    assert h.take_broker() == b""
    # as with a snapshot that has gone stale
    stale = StorageHarness()
    stale.storage.policy.unknown_scope = reach
    stale.storage.policy.update(ClusterState(WALL - 61, OPEN_STATE))
    assert stale.storage.refresh(WALL, stale.now)[0] == PAUSE_STATE


def test_the_reach_is_an_option_checked_at_start():
    from kthrottle.config import ConfigError, build_config

    base = {"bootstrap_servers": [("k", 1)], "zookeeper": "127.0.0.1:2181",
            "storage_scope": "cluster"}
    config = build_config({}, dict(base, storage_unknown_scope="broker"))
    assert StorageThrottle.build(config, None).policy.unknown_scope == "broker"
    assert build_config({}, base).storage_unknown_scope == "cluster"
    with pytest.raises(ConfigError, match="storage-unknown-scope must be cluster or broker"):
        build_config({}, dict(base, storage_unknown_scope="volume"))


def test_zookeeper_alone_means_quotas_and_no_storage_throttling():
    """Nobody asked for storage-aware throttling: no filter, so no fail-safe
    that would pause producers when no cluster state comes."""
    from kthrottle.config import build_config

    base = {"bootstrap_servers": [("k", 1)], "zookeeper": "127.0.0.1:2181"}
    assert StorageThrottle.build(build_config({}, base), None) is None
    assert StorageThrottle.build(build_config({}, dict(base, storage_scope="off")), None) is None
    for scope in ("cluster", "partition"):
        built = StorageThrottle.build(build_config({}, dict(base, storage_scope=scope)), None)
        assert built is not None and built.policy.scope == scope


@pytest.mark.parametrize("values,message", [
    ({"storage_fail_safe": "OPEN"}, "storage-fail-safe: storage-aware throttling is off unless "
     "storage-scope is given"),
    ({"storage_max_age_ms": 5000, "storage_excluded_principals": ["User:agent"]},
     "storage-max-age-ms, storage-excluded-principals: storage-aware throttling is off"),
    ({"storage_scope": "cluster", "zookeeper": None}, "storage-scope cluster follows the "
     "cluster state kthrottle spark-sync writes to ZooKeeper: give --zookeeper"),
])
def test_storage_settings_that_would_do_nothing_are_refused(values, message):
    from kthrottle.config import ConfigError, build_config

    base = {"bootstrap_servers": [("k", 1)], "zookeeper": "127.0.0.1:2181"}
    with pytest.raises(ConfigError, match=message):
        build_config({}, dict(base, **values))
