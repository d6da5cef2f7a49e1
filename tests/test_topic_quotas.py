"""Per-topic quotas without sockets: the Fetch response reader and the
Produce request's topic bytes (codecs), fuzzed with hypothesis as
test_fuzz_codecs fuzzes the other codecs; and the TopicQuotas filter in a
pipeline fed bytes with a fake clock."""
import uuid
import warnings

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from test_fuzz_codecs import (
    RESPONSES,
    examples,
    mutated,
    run_bounded,
    split,
    with_huge_count,
    within_frame,
)
from test_pipeline import Harness, fetch_req, produce_resp
from kthrottle.codecs import ProtocolError, apis
from kthrottle.codecs.fetch_topics import (
    MAX_VERSION,
    FetchTopicBytes,
    fetch_topic_bytes,
    metadata_topic_ids,
)
from kthrottle.codecs.produce import MAX_VERSION as PRODUCE_MAX_VERSION
from kthrottle.codecs.produce import ProducePartitions
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, OBSERVE_ONLY, PRODUCER_BYTE_RATE
from kthrottle.proxy.filter import Filter, HEAD, Observe, Throttle
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.topic_quotas import TopicQuotas
from kthrottle_testkit.frames import BROKERS, advertise, fetch_many, frame_response

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.metadata import MetadataRequest, MetadataResponse
    from kafka.protocol.producer import ProduceRequest

pytestmark = pytest.mark.unit

ORDERS_ID = uuid.UUID(int=0x0DE5)
CLICKS_ID = uuid.UUID(int=0xC11C)

# (name, id, [(partition, records)]): records of many sizes (1-, 2-, 3-byte
# compact lengths), empty and null; a topic twice (two entries, one total)
TOPICS = [
    ("orders", ORDERS_ID, [(0, b"o" * 700), (1, None), (2, b""), (5, b"p" * 20000)]),
    ("clicks", CLICKS_ID, [(3, b"c" * 127), (4, b"d" * 128)]),
    ("orders", ORDERS_ID, [(7, b"q" * 9)]),
]


def expected(version, topics=TOPICS, id_from=13):
    out = {}
    for name, topic_id, parts in topics:
        key = topic_id if version >= id_from else name
        out[key] = out.get(key, 0) + sum(len(r) for _, r in parts if r)
    return out


def fetch_response(version, topics=TOPICS, cid=42, endpoints=False):
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    responses = [T(topic=name, topic_id=topic_id, partitions=[
        P(partition_index=i, error_code=0, high_watermark=10, last_stable_offset=10,
          log_start_offset=0, preferred_read_replica=-1, records=records,
          aborted_transactions=[P.AbortedTransaction(producer_id=5, first_offset=1)] if i == 1
          else ([] if i else None))
        for i, records in parts]) for name, topic_id, parts in topics]
    body = R[version](throttle_time_ms=0, error_code=0, session_id=9, responses=responses,
                      node_endpoints=[R.NodeEndpoint(node_id=n, host=h, port=p, rack=r)
                                      for n, h, p, r in BROKERS] if endpoints else []).encode()
    return frame_response(apis.FETCH, version, body, cid)


def produce_request(version, topics=TOPICS, cid=7, acks=1, client_id="app-1"):
    R = ProduceRequest
    D = R.TopicProduceData
    req = R[version](transactional_id=None, acks=acks, timeout_ms=30000, topic_data=[
        D(name=name, topic_id=topic_id, partition_data=[
            D.PartitionProduceData(index=i, records=r) for i, r in parts])
        for name, topic_id, parts in topics])
    req.with_header(correlation_id=cid, client_id=client_id)
    return bytes(req.encode(header=True, framed=True))


def metadata_response(version, topics=(("orders", ORDERS_ID), ("clicks", CLICKS_ID)), cid=42):
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    body = M[version](throttle_time_ms=0, brokers=[M.MetadataResponseBroker(
        node_id=n, host=h, port=p, rack=r) for n, h, p, r in BROKERS], cluster_id="c",
        controller_id=1, topics=[T(error_code=0, name=name, topic_id=topic_id, is_internal=False,
                                   partitions=[P(error_code=0, partition_index=0, leader_id=1,
                                                 leader_epoch=0, replica_nodes=[1, 2],
                                                 isr_nodes=[1], offline_replicas=[])])
                                 for name, topic_id in topics]).encode()
    return frame_response(apis.METADATA, version, body, cid)


def fed(reader, frame, step):
    out = []
    for i in range(0, len(frame), step):
        reader.feed(memoryview(frame)[i:i + step], out)
    return out


# -- codecs: the Fetch response reader --------------------------------------------------

@pytest.mark.parametrize("version", range(MAX_VERSION + 1))
def test_a_fetch_response_is_counted_per_topic_at_every_version(version):
    frame = fetch_response(version, endpoints=version >= 16)
    assert fetch_topic_bytes(frame, version) == expected(version)
    for step in (1, 2, 5, 16, 1000):
        reader = FetchTopicBytes(version)
        out = fed(reader, frame, step)
        assert reader.done and reader.topic_bytes == expected(version)
        assert b"".join(bytes(c) for c in out) == frame  # forwarded unchanged


@pytest.mark.parametrize("version", range(12, MAX_VERSION + 1))
def test_the_tagged_fields_of_a_flexible_fetch_response_are_skipped(version):
    frame = frame_response(apis.FETCH, version, fetch_many(version))
    got = fetch_topic_bytes(frame, version)
    decoded = FetchResponse[version].decode(frame[9:])
    want = {}
    for topic in decoded.responses:
        key = topic.topic_id if version >= 13 else topic.topic
        want[key] = want.get(key, 0) + sum(len(p.records or b"") for p in topic.partitions)
    assert got == want and sum(got.values()) > 90000


def test_a_truncated_or_unknown_fetch_response_is_a_protocol_error():
    frame = fetch_response(11)
    with pytest.raises(ProtocolError, match="truncated"):
        fetch_topic_bytes(frame[:4] + frame[4:-3], 11)  # the size still says the whole
    cut = bytearray(frame[:-3])
    cut[0:4] = (len(cut) - 4).to_bytes(4, "big")
    with pytest.raises(ProtocolError):
        fetch_topic_bytes(bytes(cut), 11)
    with pytest.raises(ProtocolError, match="not supported"):
        FetchTopicBytes(MAX_VERSION + 1)


@pytest.mark.parametrize("version", range(14))
def test_metadata_names_the_topic_ids(version):
    ids = metadata_topic_ids(metadata_response(version), version)
    assert ids == ({ORDERS_ID: "orders", CLICKS_ID: "clicks"} if version >= 10 else {})


# -- codecs: the Produce request's bytes per topic -------------------------------------

@pytest.mark.parametrize("version", range(PRODUCE_MAX_VERSION + 1))
def test_a_produce_request_is_counted_per_topic_at_every_version(version):
    frame = produce_request(version)
    want = expected(version)
    for step in (len(frame), 1, 3, 64):  # whole (the straight read) and walked
        reader = ProducePartitions(version)
        fed(reader, frame, step)
        assert reader.done and reader.topic_bytes == want


# -- hypothesis: chunking and hostile frames ---------------------------------------------

FETCHES = [case for case in RESPONSES if case[0] == apis.FETCH] + [
    (apis.FETCH, v, fetch_response(v, endpoints=v >= 16)) for v in range(MAX_VERSION + 1)]
METADATAS = [case for case in RESPONSES if case[0] == apis.METADATA and case[1] >= 10]


def read_fetch(chunks, version):
    """FetchTopicBytes fed ``chunks``: its counts, the ProtocolError, or None
    when the frame is not complete."""
    reader = FetchTopicBytes(version)
    try:
        for chunk in chunks:
            reader.feed(chunk, [])
    except ProtocolError as exc:
        return exc
    return reader.topic_bytes if reader.done else None


def exercise_fetch(frame, version, chunks):
    one = within_frame(frame)
    if one is None or not 0 <= version <= MAX_VERSION:
        return
    whole = read_fetch([one], version)
    walked = read_fetch(chunks or [one], version)
    if isinstance(whole, dict) or isinstance(walked, dict):
        assert whole == walked
        assert all(0 <= n <= len(one) for n in whole.values())
        assert sum(whole.values()) <= len(one)
    else:
        assert type(whole) is type(walked)


@examples(400)
@given(mutated(FETCHES, max_mutations=2), st.data())
def test_fetch_topic_bytes_whole_and_chunked_agree(case, data):
    _api_key, version, frame = case
    version = data.draw(st.one_of(st.just(version), st.integers(0, MAX_VERSION)))
    one = within_frame(frame)
    assume(one is not None)
    exercise_fetch(frame, version, data.draw(split(one, max_cuts=20)))


@examples(150)
@given(st.binary(max_size=200), st.integers(0, MAX_VERSION), st.data())
def test_fetch_topic_bytes_of_random_bytes(body, version, data):
    frame = len(body).to_bytes(4, "big") + body
    exercise_fetch(frame, version, data.draw(split(frame)))


@examples(150)
@given(with_huge_count(FETCHES), st.data())
def test_huge_counts_in_a_fetch_response_cost_what_the_frame_carries(case, data):
    _api_key, version, frame = case
    one = within_frame(frame)
    chunks = data.draw(split(one)) if one else None
    run_bounded(lambda: exercise_fetch(frame, version, chunks), len(frame))


def read_ids(frame, version):
    try:
        ids = metadata_topic_ids(frame, version)
    except ProtocolError:
        return
    assert all(isinstance(k, uuid.UUID) and isinstance(v, str) and v for k, v in ids.items())


@examples(200)
@given(mutated(METADATAS), st.sampled_from(range(10, 14)))
def test_metadata_topic_ids_of_mutated_frames(case, version):
    read_ids(case[2], version)


@examples(100)
@given(with_huge_count(METADATAS))
def test_huge_counts_in_a_metadata_response_cost_what_the_frame_carries(case):
    run_bounded(lambda: read_ids(case[2], case[1]), len(case[2]))


# -- the filter in a pipeline (fake clock) --------------------------------------------------

def topic_filter(h):
    return next(f for f in h.conn.table.filters if isinstance(f, TopicQuotas))


def test_without_topic_quotas_nothing_is_read():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1e9}})
    frame = produce_request(8)
    h.client(frame)
    assert h.take_broker() == frame
    assert h.conn.pending[0].throttle_ms == 0
    f = topic_filter(h)
    assert not f.active and not f.buckets and not h.manager.topic_buckets
    # not even a reader: the request went by without an Observe
    assert f.on_request(h.conn.contexts[h.conn.table.filters.index(f)], None, None) is None


def test_a_topic_over_its_produce_quota_throttles_its_producer_and_only_it():
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0}})
    other = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_request(8, [("orders", ORDERS_ID, [(0, b"x" * 6000)])]))
    # burst 1 s (1000 bytes); 6000 bytes: 5 s of debt
    assert h.conn.pending[0].throttle_ms == 5000
    assert h.client_paused_until == pytest.approx(5.0)
    h.broker(produce_resp(7, version=8))
    assert int.from_bytes(h.take_client()[-4:], "big") == 5000  # throttle_time_ms (v8: last)
    other.client(produce_request(8, [("clicks", CLICKS_ID, [(0, b"x" * 60000)])]))
    assert other.conn.pending[0].throttle_ms == 0 and other.client_paused_until is None
    bucket = h.manager.topic_buckets[PRODUCER_BYTE_RATE, "orders"]
    assert bucket.total == 6000 and bucket.throttled == 1


def test_the_strongest_topic_throttle_applies_and_each_topic_counts_its_own_bytes():
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0},
                 "topics/<default>": {PRODUCER_BYTE_RATE: 2000.0}})
    h.client(produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 3000)]),
                                 ("clicks", CLICKS_ID, [(0, b"c" * 9000), (1, b"d" * 1000)])]))
    buckets = h.manager.topic_buckets
    assert buckets[PRODUCER_BYTE_RATE, "orders"].total == 3000  # 2 s over
    assert buckets[PRODUCER_BYTE_RATE, "clicks"].total == 10000  # the default: 4 s over
    assert buckets[PRODUCER_BYTE_RATE, "clicks"].entity == "topics/<default>"
    assert h.conn.pending[0].throttle_ms == 4000


@pytest.mark.parametrize("client_rate, client_wins", [(500.0, True), (100000.0, False)])
def test_a_topic_quota_and_the_clients_own_the_larger_delay_wins(client_rate, client_wins):
    # client: the whole frame (~3050 bytes) against client_rate; topic: 3000
    # record bytes against 1000 B/s (2 s over)
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0},
                 "clients/app-1": {PRODUCER_BYTE_RATE: client_rate}})
    frame = produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 3000)])])
    h.client(frame)
    client_ms = h.manager.buckets[PRODUCER_BYTE_RATE, "", "app-1"].throttle_ms_total
    topic_ms = h.manager.topic_buckets[PRODUCER_BYTE_RATE, "orders"].throttle_ms_total
    assert topic_ms == 2000
    assert h.conn.pending[0].throttle_ms == max(client_ms, topic_ms)
    assert (client_ms > topic_ms) == client_wins
    assert h.client_paused_until == pytest.approx(max(client_ms, topic_ms) / 1000.0)


def test_a_produce_request_cut_anywhere_is_counted_once():
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1e6}})
    frame = produce_request(9, [("orders", ORDERS_ID, [(0, b"o" * 5000), (1, b"p" * 300)])])
    h.client(frame, chunk=7)
    assert h.take_broker() == frame
    assert h.manager.topic_buckets[PRODUCER_BYTE_RATE, "orders"].total == 5300


def fetch_once(h, cid, version, topics, chunk=None, endpoints=False):
    h.client(fetch_req(cid, version=version))
    h.take_broker()
    response = fetch_response(version, topics, cid, endpoints)
    h.broker(response, chunk=chunk)
    return response, h.take_client()


@pytest.mark.parametrize("version", [4, 11, 12, 13, 16, MAX_VERSION])
def test_a_fetch_over_its_topics_quota_mutes_the_consumer(version):
    h = Harness({"topics/orders": {CONSUMER_BYTE_RATE: 1000.0}})
    topics = [("orders", ORDERS_ID, [(0, b"o" * 4000)]), ("clicks", CLICKS_ID, [(0, b"c" * 9000)])]
    if version >= 13:  # topics named by id: the proxy learns them from the Metadata relayed
        relay_metadata(h)
    sent, got = fetch_once(h, 1, version, topics, chunk=333, endpoints=version >= 16)
    if version >= 16:  # the addresses are rewritten while the topics are counted
        assert len(got) == len(sent) and got != sent
        assert h.nodes and h.nodes[0][0][0].node_id == 1
    else:
        assert got == sent
    bucket = h.manager.topic_buckets[CONSUMER_BYTE_RATE, "orders"]
    assert bucket.total == 4000
    assert h.client_paused_until == pytest.approx(3.0)  # 3000 bytes over at 1000 B/s
    assert (CONSUMER_BYTE_RATE, "clicks") not in h.manager.topic_buckets


def test_topic_ids_are_learnt_from_metadata_and_asked_when_unknown():
    h = Harness({"topics/orders": {CONSUMER_BYTE_RATE: 1000.0}})
    topics = [("orders", ORDERS_ID, [(0, b"o" * 4000)])]
    fetch_once(h, 1, 13, topics)
    # the id is unknown: not counted, and the broker is asked (Metadata v12, all topics)
    assert topic_filter(h).uncounted == 4000
    assert h.client_paused_until is None
    asked = h.conn.pending[-1]
    assert asked.api_key == apis.METADATA and asked.on_response is not None
    request = h.take_broker()
    decoded = MetadataRequest[12].decode(request[4:], header=True)
    assert decoded.topics is None and not decoded.allow_auto_topic_creation
    h.broker(metadata_response(12, cid=asked.correlation_id))
    assert h.take_client() == b""  # the proxy's own question: the client sees nothing
    fetch_once(h, 2, 13, topics)
    assert h.manager.topic_buckets[CONSUMER_BYTE_RATE, "orders"].total == 4000
    assert h.client_paused_until == pytest.approx(3.0)


def relay_metadata(h, cid=100):
    """A client's Metadata v12 request and its answer, through the proxy."""
    request = MetadataRequest[12](topics=None, allow_auto_topic_creation=False,
                                  include_topic_authorized_operations=False)
    request.with_header(correlation_id=cid, client_id="app-1")
    h.client(request.encode(header=True, framed=True))
    h.take_broker()
    h.broker(metadata_response(12, cid=cid))
    assert h.take_client()


def test_a_metadata_response_relayed_names_the_ids():
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0}})
    relay_metadata(h)
    h.client(produce_request(13, [("orders", ORDERS_ID, [(0, b"o" * 3000)])], cid=2))
    assert h.manager.topic_buckets[PRODUCER_BYTE_RATE, "orders"].total == 3000
    assert h.conn.pending[0].throttle_ms == 2000


def test_an_observe_only_topic_quota_delays_no_one_but_counts_what_it_would_have():
    h = Harness({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0, CONSUMER_BYTE_RATE: 1000.0,
                                   OBSERVE_ONLY: 1.0}})
    h.client(produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 6000)])]))
    assert h.conn.pending[0].throttle_ms == 0 and h.client_paused_until is None
    h.broker(produce_resp(7, version=8))
    h.take_client()
    fetch_once(h, 8, 11, [("orders", ORDERS_ID, [(0, b"o" * 6000)])])
    assert h.client_paused_until is None
    for key in (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE):
        bucket = h.manager.topic_buckets[key, "orders"]
        assert bucket.observed == 1 and bucket.observed_ms_total == 5000 and not bucket.throttled


def test_a_topic_quota_set_live_applies_to_the_next_request():
    h = Harness({})
    frame = produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 6000)])])
    h.client(frame)
    assert h.conn.pending[-1].throttle_ms == 0
    h.manager.update({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 6000)])], cid=8))
    assert h.conn.pending[-1].throttle_ms == 5000
    h.manager.update({})  # and removed: nothing read again
    h.at(h.client_paused_until)
    h.client(produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 6000)])], cid=9))
    assert h.conn.pending[-1].throttle_ms == 0 and not topic_filter(h).active


def test_a_follower_fetch_counts_against_no_topic_quota():
    h = Harness({"topics/orders": {CONSUMER_BYTE_RATE: 10.0}})
    h.client(fetch_req(1, replica_id=3, client_id="broker-3"))
    h.take_broker()
    h.broker(fetch_response(11, [("orders", ORDERS_ID, [(0, b"o" * 9000)])], cid=1))
    assert h.client_paused_until is None
    assert (CONSUMER_BYTE_RATE, "orders") not in h.manager.topic_buckets


def test_a_request_naming_an_illegal_topic_makes_no_bucket():
    h = Harness({"topics/<default>": {PRODUCER_BYTE_RATE: 10.0}})
    h.client(produce_request(8, [("<default>", ORDERS_ID, [(0, b"o" * 600)]),
                                 ("a/b", CLICKS_ID, [(0, b"o" * 600)])]))
    assert not h.manager.topic_buckets and h.client_paused_until is None


class _Reads(Filter):
    """A filter observing every Produce request (as the storage filter's
    partition scope does), to show two observers both decide."""

    name = "reads"

    def __init__(self, delay_ms):
        self.delay_ms = delay_ms
        self.seen = []

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.PRODUCE else 0

    def on_request(self, ctx, head, inflight):
        return Observe(ProducePartitions(head.api_version), self._done)

    def _done(self, ctx, reader):
        self.seen.append(dict(reader.topic_bytes))
        return Throttle(self.delay_ms, "reads")


@pytest.mark.parametrize("delay_ms, want", [(100, 2000), (7000, 7000)])
def test_two_filters_observing_one_request_both_decide(delay_ms, want):
    from kthrottle.policy.quotas import QuotaManager

    manager = QuotaManager({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0}})
    reads = _Reads(delay_ms)
    filters = standard_filters(advertise, manager) + [reads]
    h = Harness({}, filters=filters)
    h.conn.quota_manager = manager
    frame = produce_request(8, [("orders", ORDERS_ID, [(0, b"o" * 3000)])])
    h.client(frame, chunk=50)
    assert h.take_broker() == frame  # forwarded once
    assert reads.seen == [{"orders": 3000}]
    assert manager.topic_buckets[PRODUCER_BYTE_RATE, "orders"].total == 3000
    assert h.conn.pending[0].throttle_ms == want
