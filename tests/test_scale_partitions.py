"""What a proxy does with frames naming many partitions grows with the frame, no faster,
and copies it no more than once (issue 48's partitions curve; its benchmark is
``benchmarks/scale_partitions.py``). No I/O and no timing: the bounds are on allocations
(tracemalloc's peak), on the objects made, on the calls made, and on the result.

- the address rewrite of a Metadata answer copies the frame once (its slices are views);
- the Metadata walks (partition leaders, topic ids) make no object per partition where
  none is kept, and read every version alike, counts of several bytes included;
- the authorization filter's Metadata answer is spliced, never decoded whole, with the
  answer the decode-and-encode it replaced gave;
- a Produce v10+ or Fetch v16+ response of 127 topics or partitions or more is still walked
  in one loop (not left to the generator walker) and still passes untouched on the short way;
- per-topic quotas forget the topic ids past their bound in one pass.
"""
import random
import tracemalloc
import uuid
import warnings

import pytest

from kthrottle.codecs import apis
from kthrottle.codecs import acl_requests as wire
from kthrottle.codecs.fetch_topics import metadata_topic_ids
from kthrottle.codecs.metadata_leaders import metadata_layout, metadata_leaders, metadata_topics
from kthrottle.codecs.rewrite import rewrite_response, splice
from kthrottle.codecs.stream import StreamRewriter, stream_rewriter, untouched_check
from kthrottle.policy.acls import Operation, PatternType, Permission, ResourceType
from kthrottle.proxy.filters import authorization as authz
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.authorization import AclView, Authorization
from kthrottle.proxy.filters.topic_quotas import TopicQuotas
from kthrottle.proxy.pipeline import Connection, FilterTable, SendToClient
from kthrottle.sources.acls import AclSnapshot
from kthrottle_testkit.frames import advertise, frame_response

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.metadata import MetadataRequest, MetadataResponse
    from kafka.protocol.producer import ProduceResponse

pytestmark = pytest.mark.unit

NODES = (1, 2, 3)
ASKED = None  # kafka-python's authorized_operations for INT32_MIN: not asked for


def topic_id(t):
    return uuid.UUID(int=0xABC000 + t + 1)


def metadata(version, topics, per_topic, replicas=NODES, cid=42, errors=(), names=None,
             ops=ASKED, cluster_ops=ASKED):
    """A framed Metadata answer of ``topics`` topics of ``per_topic`` partitions; topic ``t``
    is named ``names[t]`` (default ``t-<t>``), answered with error ``errors[t]`` if given."""
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    body = [T(error_code=errors[t] if t < len(errors) else 0,
              name=names[t] if names else "t-%d" % t, topic_id=topic_id(t), is_internal=False,
              authorized_operations=ops,
              partitions=[P(error_code=9 if i % 7 == 3 else 0, partition_index=i,
                            leader_id=NODES[i % 3], leader_epoch=2, replica_nodes=list(replicas),
                            isr_nodes=list(replicas[:2]), offline_replicas=[])
                          for i in range(per_topic)])
            for t in range(topics)]
    brokers = [M.MetadataResponseBroker(node_id=n, host="kafka-%d.internal" % n, port=9092,
                                        rack="r%d" % n) for n in NODES]
    return frame_response(apis.METADATA, version, M[version](
        throttle_time_ms=0, brokers=brokers, cluster_id="c", controller_id=1, topics=body,
        authorized_operations=cluster_ops, error_code=0).encode(), cid)


def decoded(version, frame):
    return MetadataResponse[version].decode(bytes(frame[4:]), header=True)


def peak_of(fn):
    """(fn(), tracemalloc's peak of the allocations it made, in bytes)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- the address rewrite --------------------------------------------------------------------

def test_the_metadata_address_rewrite_copies_the_frame_once():
    frame = metadata(12, 200, 100)  # 20,000 partitions, some 770 kB
    (new, nodes), peak = peak_of(lambda: rewrite_response(frame, apis.METADATA, 12, advertise))
    # the new frame and the few replaced addresses; the old splice also held every slice of
    # the frame (bytes slices copy) and a second join: three frames at once
    assert peak < 1.2 * len(frame)
    assert [n.node_id for n in nodes] == list(NODES)
    answer = decoded(12, new)
    assert [(b.host, b.port) for b in answer.brokers] == [advertise(n) for n in NODES]
    assert answer.topics == decoded(12, frame).topics


def test_splice_applies_its_edits_in_one_new_frame_of_the_right_size():
    frame = b"\x00\x00\x00\x0c" + b"0123456789ab"
    assert splice(frame, []) == frame and splice(frame, []) is not frame
    out = splice(memoryview(bytearray(frame)), [(4, 6, b""), (8, 9, b"XYZ"), (16, 16, b"!")])
    assert out == b"\x00\x00\x00\x0d" + b"23" + b"XYZ" + b"56789ab" + b"!"
    assert type(out) is bytes


# -- the Metadata walks -----------------------------------------------------------------------

VERSIONS = (0, 1, 4, 5, 7, 8, 9, 10, 12, 13)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_walks_read_every_version_as_kafka_python_does(version):
    # 130 replicas: compact counts of two bytes (N+1 > 127) on v9+
    frame = metadata(version, 3, 140, replicas=tuple(range(1, 131)), errors=(0, 3))
    answer = decoded(version, frame)
    topics = metadata_topics(frame, version)
    assert [(t[0], t[1]) for t in topics] == [(t.error_code, t.name) for t in answer.topics]
    assert [t[3] for t in topics] == [[(p.error_code, p.partition_index, p.leader_id)
                                       for p in t.partitions] for t in answer.topics]
    assert metadata_leaders(frame, version) == {
        (t.name, p.partition_index): p.leader_id for t in answer.topics if not t.error_code
        for p in t.partitions if p.error_code in (0, 9)}
    layout = metadata_layout(frame, version)
    assert all(t.partitions is None for t in layout.topics)  # skipped, not read
    assert [(t.start, t.end) for t in layout.topics] == [(t.start, t.end) for t in
                                                          metadata_layout(frame, version,
                                                                          True).topics]
    if version >= 10:
        assert metadata_topic_ids(frame, version) == {topic_id(t): "t-%d" % t
                                                      for t in range(3)}


def test_the_topic_ids_of_a_large_answer_cost_no_object_per_partition():
    frame = metadata(12, 100, 200)  # 20,000 partitions
    ids, peak = peak_of(lambda: metadata_topic_ids(frame, 12))
    assert len(ids) == 100
    # a tuple per partition (the old walk's) is some 1.5 MB here; a topic's entry ~300 bytes
    assert peak < 150_000


def test_the_leaders_of_a_large_answer_keep_only_the_dict():
    frame = metadata(12, 100, 200)
    leaders, peak = peak_of(lambda: metadata_leaders(frame, 12))
    assert len(leaders) == 20_000
    # the dict and its keys; not also a list of (error, index, leader) per partition
    assert peak < 2_600_000


# -- authorization: the Metadata answer spliced ------------------------------------------------

class _Ctx:
    def __init__(self, ask):
        self.ask = ask

    def noted(self, inflight):
        return self.ask


class _InFlight:
    def __init__(self, version, cid=42):
        self.api_version, self.correlation_id, self.api_key = version, cid, apis.METADATA


def _view():
    view = AclView()
    view.update(AclSnapshot(True, (
        (int(ResourceType.TOPIC), "alice-", int(PatternType.PREFIXED), "User:alice", "*",
         int(Operation.DESCRIBE), int(Permission.ALLOW)),
        (int(ResourceType.TOPIC), "alice-w", int(PatternType.PREFIXED), "User:alice", "*",
         int(Operation.WRITE), int(Permission.ALLOW)),
        (int(ResourceType.CLUSTER), "kafka-cluster", int(PatternType.LITERAL), "User:alice", "*",
         int(Operation.DESCRIBE), int(Permission.ALLOW)),
    ), frozenset(), False))
    return view


def _decider(view):
    return authz._Decider(view.authorizer, "User:alice", "10.0.0.1")


def _reference(view, ask, version, frame, cid=42):
    """What the filter answered before the splice: the answer decoded whole with
    kafka-python, changed, encoded again (its code as it was)."""
    response = wire.decode_response(apis.METADATA, version, frame)
    names = {}
    kept = []
    changed = False
    cluster_ops = getattr(response, "authorized_operations", None)
    if cluster_ops is not None:
        response.authorized_operations = authz._operations(
            ask.allowed, authz.CLUSTER, authz.CLUSTER_NAME, authz.CLUSTER_OPERATIONS)
        changed = True
    for topic in response.topics or []:
        name = topic.name
        tid = getattr(topic, "topic_id", None)
        if name and tid is not None and tid != wire.NO_TOPIC_ID:
            names[tid] = name
        if not name or ask.allowed(authz.TOPIC, name, authz.DESCRIBE):
            ops = getattr(topic, "authorized_operations", None)
            if name and ops is not None:
                topic.authorized_operations = authz._operations(
                    ask.allowed, authz.TOPIC, name, authz.TOPIC_OPERATIONS)
                changed = True
            kept.append(topic)
            continue
        changed = True
        if ask.named:
            topic.error_code = wire.TOPIC_AUTHORIZATION_FAILED
            topic.partitions = []
            if tid is not None and tid in ask.by_id:
                topic.name = None
            elif tid is not None:
                topic.topic_id = wire.NO_TOPIC_ID
            kept.append(topic)
    if not changed:
        return frame, names
    response.topics = kept
    return wire.encode_response(response, cid), names


def _names(rng, count):
    return [rng.choice(("alice-", "alice-w", "bob-", "")) + "t%d" % t for t in range(count)]


@pytest.mark.parametrize("version", (1, 4, 7, 8, 9, 10, 11, 12))
@pytest.mark.parametrize("seed", range(6))
def test_the_spliced_metadata_answer_is_the_one_decoding_gave(version, seed):
    rng = random.Random(seed * 100 + version)
    count = rng.randint(1, 12)
    names = _names(rng, count)
    asked_ops = version >= 8 and rng.random() < 0.5
    ops = {3, 8} if asked_ops else ASKED
    frame = metadata(version, count, rng.randint(0, 5), names=names, ops=ops,
                     cluster_ops=ops if 8 <= version <= 10 else ASKED,
                     errors=[rng.choice((0, 0, 3)) for _ in range(count)])
    view = _view()
    by_id = frozenset(topic_id(t) for t in range(count) if rng.random() < 0.5)
    ask = authz._MetadataAsk(rng.random() < 0.5, _decider(view), by_id if version >= 12
                             else frozenset())
    f = Authorization(view)
    got = f._metadata_response(_Ctx(ask), _InFlight(version), frame)
    want, names_seen = _reference(view, ask, version, frame)
    if want is frame:
        assert got is frame  # nothing to change: the frame itself, not a copy
    assert decoded(version, got) == decoded(version, want)
    assert got == want  # byte for byte, too
    assert f.topic_names == names_seen


@pytest.mark.parametrize("version", (10, 12))
def test_a_refused_topic_asked_by_id_keeps_its_name_to_itself(version):
    frame = metadata(version, 3, 2, names=["alice-a", "bob-b", "c"])
    view = _view()
    ask = authz._MetadataAsk(True, _decider(view), frozenset({topic_id(1)}))
    got = Authorization(view)._metadata_response(_Ctx(ask), _InFlight(version), frame)
    if version >= 12:  # (before v12 a name is not nullable: the reference cannot encode it)
        assert got == _reference(view, ask, version, frame)[0]
    answer = decoded(version, got).topics
    assert [(t.error_code, t.name, t.topic_id, len(t.partitions)) for t in answer] == [
        (0, "alice-a", topic_id(0), 2),
        (wire.TOPIC_AUTHORIZATION_FAILED, None if version >= 12 else "", topic_id(1), 0),
        (wire.TOPIC_AUTHORIZATION_FAILED, "c", None, 0)]  # (kafka-python reads the null id so)


def test_a_large_metadata_answer_is_filtered_without_decoding_it(monkeypatch):
    def refused(*args):
        raise AssertionError("the Metadata answer was decoded whole")
    monkeypatch.setattr(wire, "decode_response", refused)
    names = ["alice-%d" % t if t % 2 else "bob-%d" % t for t in range(100)]
    frame = metadata(12, 100, 200, names=names)  # 20,000 partitions
    view = _view()
    f = Authorization(view)
    ask = authz._MetadataAsk(False, _decider(view), frozenset())
    got, peak = peak_of(lambda: f._metadata_response(_Ctx(ask), _InFlight(12), frame))
    assert peak < 1.5 * len(frame)  # the new frame; the decoded answer was some 10 of it
    monkeypatch.undo()
    assert [t.name for t in decoded(12, got).topics] == names[1::2]
    assert len(f.topic_names) == 100


# -- NodeEndpoints responses of many topics or partitions --------------------------------------

def produce_answer(version, topics, per_topic):
    T = ProduceResponse.TopicProduceResponse
    P = T.PartitionProduceResponse
    return frame_response(apis.PRODUCE, version, ProduceResponse[version](
        throttle_time_ms=0, node_endpoints=[], responses=[
            T(name="t-%d" % t, topic_id=topic_id(t), partition_responses=[
                P(index=i, error_code=0, base_offset=5, log_append_time_ms=-1,
                  log_start_offset=0, record_errors=[], error_message=None)
                for i in range(per_topic)])
            for t in range(topics)]).encode())


def fetch_answer(version, topics, per_topic, endpoints=()):
    T = FetchResponse.FetchableTopicResponse
    P = T.PartitionData
    E = FetchResponse.NodeEndpoint
    return frame_response(apis.FETCH, version, FetchResponse[version](
        throttle_time_ms=0, error_code=0, session_id=0,
        node_endpoints=[E(node_id=n, host="kafka-%d.internal.example" % n, port=9092, rack=None)
                        for n in endpoints],
        responses=[T(topic="t-%d" % t, topic_id=topic_id(t), partitions=[
            P(partition_index=i, error_code=0, high_watermark=1, last_stable_offset=1,
              log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
              records=b"r" * 20) for i in range(per_topic)]) for t in range(topics)]).encode())


SHAPES = [(1, 1000), (1000, 1), (10, 130), (130, 2)]


@pytest.mark.parametrize("topics,per_topic", SHAPES)
@pytest.mark.parametrize("version", (10, 11))
def test_a_produce_answer_of_many_partitions_passes_untouched(version, topics, per_topic):
    # the short way's check: a walk of one loop, which once gave up at a count of 127
    assert untouched_check(apis.PRODUCE, version)(produce_answer(version, topics, per_topic))


@pytest.mark.parametrize("topics,per_topic", SHAPES)
def test_a_whole_fetch_answer_of_many_partitions_is_walked_in_one_loop(topics, per_topic):
    frame = fetch_answer(16, topics, per_topic, endpoints=NODES)
    rewriter = stream_rewriter(apis.FETCH, 16, advertise)
    out = []
    rewriter.feed(frame, out)
    assert rewriter.done and rewriter._walk is None  # no generator made
    assert [n.node_id for n in rewriter.nodes] == list(NODES)
    # the same as the walker gives, fed in pieces
    walked = StreamRewriter(rewriter._walker, advertise)
    pieces = []
    for i in range(0, len(frame), 4096):
        walked.feed(frame[i:i + 4096], pieces)
    assert b"".join(bytes(p) for p in out) == b"".join(bytes(p) for p in pieces)
    answer = FetchResponse[16].decode(b"".join(bytes(p) for p in out)[4:], header=True)
    assert [(e.host, e.port) for e in answer.node_endpoints] == [advertise(n) for n in NODES]


# -- the pipeline -------------------------------------------------------------------------------

def test_a_large_metadata_answer_through_the_pipeline_is_held_at_most_twice():
    frame = metadata(12, 100, 200, cid=5)
    T = MetadataRequest
    request = T[12](topics=None, allow_auto_topic_creation=False,
                    include_topic_authorized_operations=False)
    request.with_header(correlation_id=5, client_id="app-1")
    conn = Connection(FilterTable(standard_filters(advertise)), 100 << 20)
    conn.broker_connected(0.0)
    conn.client_data(bytes(request.encode(header=True, framed=True)), 0.0)
    reads = [frame[i:i + 65536] for i in range(0, len(frame), 65536)]

    def feed():
        out = []
        for data in reads:
            for action in conn.broker_data(data, 0.0):
                if isinstance(action, SendToClient):
                    out += action.chunks
        return out

    out, peak = peak_of(feed)
    # gathered (a bytearray, then bytes) and rewritten (a new frame): the old rewrite held
    # four frames at once
    assert peak < 2.3 * len(frame)
    assert b"".join(bytes(c) for c in out) == rewrite_response(frame, apis.METADATA, 12,
                                                               advertise)[0]


# -- per-topic quotas' topic ids ----------------------------------------------------------------

class _CountingDict(dict):
    iterations = 0

    def __iter__(self):
        type(self).iterations += 1
        return super().__iter__()


def test_topic_ids_past_the_bound_are_forgotten_in_one_pass(monkeypatch):
    from kthrottle.proxy.filters import topic_quotas

    monkeypatch.setattr(topic_quotas, "TOPIC_IDS_KEPT", 10)
    f = TopicQuotas.__new__(TopicQuotas)
    f.topic_names = _CountingDict((uuid.UUID(int=k), "old-%d" % k) for k in range(10))
    f._learn(metadata(12, 30, 1), 12)
    assert _CountingDict.iterations == 1  # deleting the first key 30 times iterated 30
    assert dict(f.topic_names) == {topic_id(t): "t-%d" % t for t in range(20, 30)}


# -- authorization: a request's refused entries left out ----------------------------------------

class _Entry:
    """A request's entry that may not be compared (kafka-python's compare field by field)."""

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        raise AssertionError("entries compared")

    __hash__ = object.__hash__


def test_refused_entries_are_left_out_in_one_pass_without_comparing_them():
    entries = [_Entry(i) for i in range(1000)]
    kept = authz._without(entries, entries[1::2])  # `not in refused`: 500,000 comparisons
    assert [e.n for e in kept] == list(range(0, 1000, 2))
    names = ["a", None, "a", "b", None]
    assert authz._without(names, [n for n in names if n != "b"]) == ["b"]
    assert authz._without(names, [n for n in names if n is None]) == ["a", "a", "b"]
    assert authz._without(names, []) == names


# -- benchmarks/scale_partitions.py: its pure parts -------------------------------------------

@pytest.mark.parametrize("version", (0, 1, 4, 9, 12))
def test_the_benchmarks_fake_broker_tells_every_topic_from_the_brokers_only(version):
    from kthrottle.codecs.versions import metadata_request as discovery_request
    from kthrottle_testkit import load_benchmark

    sp = load_benchmark("scale_partitions")
    assert sp._metadata_asks_topics(sp.metadata_request(version, 3), version)
    if version >= 1:
        T = MetadataRequest.MetadataRequestTopic
        named = MetadataRequest[version](
            topics=[T(name="x", topic_id=uuid.UUID(int=0))], allow_auto_topic_creation=False,
            include_cluster_authorized_operations=False, include_topic_authorized_operations=False)
        named.with_header(correlation_id=4, client_id="c")
        assert sp._metadata_asks_topics(bytes(named.encode(header=True, framed=True)), version)
    assert not sp._metadata_asks_topics(discovery_request(1), 1)  # the proxy's own, v1


def test_the_benchmarks_in_process_rows_at_a_small_size():
    from argparse import Namespace

    from kthrottle_testkit import load_benchmark

    sp = load_benchmark("scale_partitions")
    args = Namespace(partitions=[200], partitions_per_topic=[100],
                     partitions_metadata_versions=[1, 12], partitions_repeats=1)
    rows = sp.measure_inproc(args, lambda v, n, per: sp.metadata_response(v, n, per),
                             lambda line: None)
    assert {(r["version"], r["config"]) for r in rows} == {
        (v, c) for v in (1, 12) for c in sp.INPROC_CONFIGS if v >= 10 or c != "topic quotas"}
    full = [r for r in rows if r["config"] != "acls"]
    assert all(r["sent_mib"] == pytest.approx(r["frame_mib"], rel=0.01) for r in full)
    acls = [r for r in rows if r["config"] == "acls"]  # half of the topics left out
    assert all(r["sent_mib"] < 0.6 * r["frame_mib"] for r in acls)
