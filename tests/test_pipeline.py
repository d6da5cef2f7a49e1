"""The connection pipeline without sockets: bytes and a fake clock in,
actions out (as h11's tests feed bytes and check events)."""
import random
import struct
import uuid
import warnings

import pytest

from kthrottle.codecs import apis
from kthrottle.codecs.frames import HEAD_SIZE
from kthrottle.codecs.request import fetch_head
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.policy.quotas import FETCH_GRANT_FRACTION, LEASE_SECONDS, WINDOW, QuotaManager, QuotaSettings
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.pipeline import (
    ANONYMOUS,
    HEAD,
    NOTHING,
    Close,
    Connection,
    ConnectUpstream,
    Filter,
    FilterTable,
    HELD,
    HoldResponses,
    InFlight,
    NodesSeen,
    PauseClient,
    Phase,
    ResumeBroker,
    ResumeClient,
    RunJob,
    WHOLE_RESPONSE_MAX,
    SendToBroker,
    SendToClient,
    Throttle,
)
from kthrottle_testkit.frames import (advertise, api_versions, fetch, frame_response, metadata,
                                      produce)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest
    from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

pytestmark = pytest.mark.unit

MAX_FRAME = 100 * 1024 * 1024


# frames -------------------------------------------------------------------

def produce_req(cid, nbytes=70, version=8, acks=1, client_id="app-1", transactional_id=None):
    R = ProduceRequest
    D = R.TopicProduceData
    req = R[version](transactional_id=transactional_id, acks=acks, timeout_ms=30000,
                     topic_data=[D(name="orders", topic_id=uuid.UUID(int=7),
                                   partition_data=[D.PartitionProduceData(index=0,
                                                                          records=b"x" * nbytes)])])
    req.with_header(correlation_id=cid, client_id=client_id)
    return req.encode(header=True, framed=True)


def fetch_req(cid, version=11, max_bytes=50 * 1024 * 1024, replica_id=-1, client_id="app-1"):
    F = FetchRequest
    part = F.FetchTopic.FetchPartition(partition=0, fetch_offset=5, partition_max_bytes=1 << 20)
    req = F[version](replica_id=replica_id, max_wait_ms=500, min_bytes=1, max_bytes=max_bytes,
                     isolation_level=0, session_id=0, session_epoch=-1,
                     topics=[F.FetchTopic(topic="t", topic_id=uuid.UUID(int=3), partitions=[part])],
                     forgotten_topics_data=[], rack_id="")
    req.with_header(correlation_id=cid, client_id=client_id)
    return req.encode(header=True, framed=True)


def metadata_req(cid, version=8, client_id="app-1"):
    req = MetadataRequest[version](topics=None, allow_auto_topic_creation=False,
                                   include_cluster_authorized_operations=False,
                                   include_topic_authorized_operations=False)
    req.with_header(correlation_id=cid, client_id=client_id)
    return req.encode(header=True, framed=True)


def api_versions_req(cid, version=3):
    if version > apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS]:
        return raw_request(cid, apis.API_VERSIONS, version, b"\x00\x00")  # kafka-python cannot
    req = ApiVersionsRequest[version](client_software_name="t", client_software_version="1")
    req.with_header(correlation_id=cid, client_id="app-1")
    return req.encode(header=True, framed=True)


def raw_request(cid, api_key, version, body=b"", client_id=b"app-1"):
    payload = struct.pack(">hhih", api_key, version, cid, len(client_id)) + client_id + body
    return struct.pack(">i", len(payload)) + payload


def produce_resp(cid, version=8, **kw):
    return frame_response(apis.PRODUCE, version, produce(version, **kw), cid)


def fetch_resp(cid, version=11, records=b"\x00" * 300, **kw):
    return frame_response(apis.FETCH, version, fetch(version, records=records, **kw), cid)


def metadata_resp(cid, version=8):
    return frame_response(apis.METADATA, version, metadata(version), cid)


def generic_resp(cid, body=b"\x00\x00\x00\x00\x00\x00"):
    return frame_response(apis.METADATA, 0, body, cid)  # header v0, any body


# a harness that carries out actions the way the adapter does --------------

class Harness:
    def __init__(self, snapshot=None, settings=None, filters=None, connect=True,
                 whole_response_max=WHOLE_RESPONSE_MAX, short_way=True, table=None):
        self.short_way = short_way  # try pass_request/pass_response first, as the adapter
        self.manager = QuotaManager(snapshot, settings) if snapshot is not None else None
        if table is None:  # (given: another connection of the same proxy)
            table = FilterTable(filters if filters is not None
                                else standard_filters(advertise, self.manager))
        self.conn = Connection(table, MAX_FRAME, self.manager,
                               whole_response_max=whole_response_max)
        # the heads the long way reads (the short way reads none)
        self.long_heads = {"request": 0, "response": 0}
        for kind, cutter in (("request", self.conn.requests_in),
                             ("response", self.conn.responses_in)):
            cutter.on_head = self._counted(kind, cutter.on_head)
        self.now = 0.0
        self.to_broker = bytearray()
        self.to_client = bytearray()
        self.client_paused_until = None
        self.broker_paused_until = None
        self.closed = None
        self.nodes = []
        self.log = []  # action kinds, in order
        self.connects = 0  # ConnectUpstream actions
        self.jobs = []  # RunJob actions not carried out yet
        self.run_jobs = True  # carry them out at once (as a fast worker would)
        self.refused = None  # Close.refused
        if connect:
            self.run(self.conn.client_accepted(self.now))

    def _counted(self, kind, on_head):
        def counted(head, frame_len):
            self.long_heads[kind] += 1
            return on_head(head, frame_len)
        return counted

    def run(self, actions):
        connect = False
        for a in actions:
            self.log.append(type(a).__name__)
            if isinstance(a, ConnectUpstream):
                self.connects += 1
                connect = True
            elif isinstance(a, RunJob):
                self.jobs.append(a)
            if isinstance(a, SendToBroker):
                self.to_broker += b"".join(bytes(c) for c in a.chunks)
            elif isinstance(a, SendToClient):
                assert self.closed is None
                self.to_client += b"".join(bytes(c) for c in a.chunks)
            elif isinstance(a, PauseClient):
                self.client_paused_until = float("inf") if a.until is None else a.until
            elif isinstance(a, ResumeClient):
                self.client_paused_until = None
            elif isinstance(a, HoldResponses):
                self.broker_paused_until = a.until
            elif isinstance(a, ResumeBroker):
                self.broker_paused_until = None
            elif isinstance(a, NodesSeen):
                # the listener must exist before the response reaches the client
                self.nodes.append((list(a.nodes), len(self.to_client)))
            elif isinstance(a, Close):
                self.closed = a.reason
                self.refused = a.refused
        # each side's state is the one its fields make (Reading, Responding)
        assert self.conn.reading is self.conn._reading_now()
        assert self.conn.responding is self.conn._responding_now()
        if connect and self.closed is None:
            self.run(self.conn.broker_connected(self.now))
        if self.run_jobs:
            self.finish_jobs()

    def finish_jobs(self):
        while self.jobs:
            a = self.jobs.pop(0)
            try:
                result, error = a.job(), None
            except Exception as exc:  # as the adapter hands a job's exception on
                result, error = None, exc
            self.run(self.conn.job_done(a.token, result, error, self.now))

    def client(self, data, chunk=None):
        for i in range(0, len(data), chunk or max(len(data), 1)):
            piece = data[i : i + (chunk or len(data))]
            passed = self.short_way and self.conn.pass_request(piece, self.now)
            if passed:  # as the adapter does
                self.log.append("pass_request")
                if passed is True:
                    self.to_broker += piece
                else:
                    self.run(passed)
                continue
            self.run(self.conn.client_data(piece, self.now))

    def broker(self, data, chunk=None):
        for i in range(0, len(data), chunk or max(len(data), 1)):
            piece = data[i : i + (chunk or len(data))]
            passed = self.short_way and self.conn.pass_response(piece)
            if passed:  # as the adapter does
                self.log.append("pass_response")
                assert self.closed is None
                if passed is True:
                    self.to_client += piece
                elif passed is not HELD:
                    self.to_client += b"".join(bytes(c) for c in passed)
                continue
            self.run(self.conn.broker_data(piece, self.now))

    def at(self, t):
        self.now = t
        self.run(self.conn.tick(t))

    def take_broker(self):
        out, self.to_broker = bytes(self.to_broker), bytearray()
        return out

    def take_client(self):
        out, self.to_client = bytes(self.to_client), bytearray()
        return out


def frames_of(stream):
    out, pos = [], 0
    while pos < len(stream):
        n = struct.unpack_from(">i", stream, pos)[0] + 4
        out.append(stream[pos : pos + n])
        pos += n
    assert pos == len(stream)
    return out


def cids(stream):
    """Correlation ids of framed responses."""
    return [struct.unpack_from(">i", f, 4)[0] for f in frames_of(stream)]


def req_cids(stream):
    """Correlation ids of framed requests."""
    return [struct.unpack_from(">i", f, 8)[0] for f in frames_of(stream)]


# pass-through -------------------------------------------------------------

@pytest.mark.parametrize("chunk", [None, 1, 7, 513, 4096])
def test_pipelined_requests_pass_unchanged_and_responses_come_back_in_order(chunk):
    h = Harness()
    requests = produce_req(1) + fetch_req(2) + produce_req(3, nbytes=5000) + fetch_req(4)
    h.client(requests, chunk)
    assert h.take_broker() == requests
    responses = produce_resp(1) + fetch_resp(2) + produce_resp(3) + fetch_resp(4, records=b"r" * 9000)
    h.broker(responses, chunk)
    assert h.take_client() == responses
    assert not h.conn.pending and h.closed is None
    assert h.conn.requests == 4


def test_a_response_out_of_order_closes_the_connection_with_the_reason():
    h = Harness()
    h.client(produce_req(1) + produce_req(2))
    h.broker(produce_resp(2))
    assert "correlation id 2, expected 1" in h.closed
    assert h.conn.phase is Phase.CLOSED


def test_client_bytes_before_the_broker_connection_are_replayed_in_order():
    h = Harness(connect=False)
    assert h.conn.phase is Phase.CONNECTING
    h.client(produce_req(1) + metadata_req(2), chunk=100)
    assert h.to_broker == b"" and h.log == []
    h.run(h.conn.broker_connected(0.0))
    assert h.conn.phase is Phase.READY
    assert req_cids(h.take_broker()) == [1, 2]
    assert h.log[-1] == "ResumeClient"


def test_garbage_replayed_after_connecting_closes_instead_of_leaving_the_client_paused():
    h = Harness(connect=False)
    h.client(b"\x00\x00\x00\x05\x00\xff\xff\xff\xff")  # a frame too short for a header
    h.run(h.conn.broker_connected(0.0))
    assert h.closed and "too small" in h.closed
    assert "ResumeClient" not in h.log


# the short way: a read that is one plain frame ---------------------------

def _plain_exchanges():
    """(request, response) pairs, each read whole: the plain ones take the short way."""
    return [(produce_req(1, nbytes=5000), produce_resp(1)),
            (fetch_req(2), fetch_resp(2, records=b"f" * 4000)),
            (produce_req(3, version=10), produce_resp(3, version=10)),  # response walked
            (metadata_req(4), metadata_resp(4)),  # response rewritten
            (produce_req(5, acks=0), None),  # awaits nothing
            (produce_req(6, version=3, transactional_id="tx"), produce_resp(6, version=3)),
            (fetch_req(7, version=16), fetch_resp(7, version=16, records=b"g" * 3000)),
            (produce_req(8, version=9, client_id=""), produce_resp(8, version=9)),
            # no NodeEndpoints: nothing to rewrite, so the short way passes them
            (produce_req(9, version=10), produce_resp(9, version=10, with_endpoints=False)),
            (fetch_req(10, version=16),
             fetch_resp(10, version=16, records=b"h" * 2000, with_endpoints=False))]


def both_ways(snapshot, exchanges):
    """Two harnesses fed ``exchanges`` ((request, response or None), each
    read whole), one trying the short way first and one not; what they sent
    and counted is the same. Returns (short, long)."""
    short, long = Harness(snapshot), Harness(snapshot, short_way=False)
    for h in (short, long):
        for request, response in exchanges:
            h.client(request)
            if response is not None:
                h.broker(response)
        assert h.closed is None and not h.conn.pending
    assert short.take_broker() == long.take_broker()
    assert short.take_client() == long.take_client()
    for counter in ("requests", "bytes_from_client", "bytes_from_broker"):
        assert getattr(short.conn, counter) == getattr(long.conn, counter)
    return short, long


@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12}}])
def test_a_read_of_one_plain_frame_takes_the_short_way_with_the_same_result(snapshot):
    short, long = both_ways(snapshot, _plain_exchanges())
    if snapshot is None:  # no filter reads Produce v3+ acks=1 or Fetch v11 requests
        assert short.log.count("pass_request") == 9  # all but acks=0
        # Produce v8, v3 and v9, Fetch v11, and Produce v10 and Fetch v16
        # without NodeEndpoints; not those with broker addresses, nor Metadata
        assert short.log.count("pass_response") == 6
    else:  # every request is counted against the quota, the short way
        assert short.log.count("pass_request") == 8  # all but acks=0 and Metadata
        assert short.long_heads["request"] == 2
        # Produce v8, v3, v9 and the v10 without NodeEndpoints pass as they
        # are; the Fetch v11 response is counted on the short way (in
        # broker_data); Fetch v16 responses are walked for NodeEndpoints
        assert short.log.count("pass_response") == 4
        assert short.long_heads["response"] == 4  # Produce v10, Metadata, Fetch v16 x2
        assert long.long_heads == {"request": 10, "response": 9}
        assert short.conn.client_quotas.keys() == long.conn.client_quotas.keys()
        assert bucket_totals(short) == bucket_totals(long)
        assert bucket_totals(short)  # something was counted


def _slots(inflight):
    """An InFlight's fields, the filters' objects in them by their types
    (two harnesses have filters of their own)."""
    fields = {name: getattr(inflight, name) for name in InFlight.__slots__}
    fields["response_filters"] = [(type(f), i) for f, i in fields["response_filters"]]
    if fields["notes"] is not None:
        fields["notes"] = {type(f): type(v) for f, v in fields["notes"].items()}
    return fields


@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12,
                                                                 CONSUMER_BYTE_RATE: 1e12}}])
@pytest.mark.parametrize("api", ["produce", "produce v10", "fetch"])
def test_the_short_way_takes_again_an_in_flight_whose_response_it_passed_as_a_new_one(
        snapshot, api):
    def exchange(h, cid):
        if api == "produce":
            h.client(produce_req(cid, nbytes=900))
            return h.conn.pending[0], produce_resp(cid)
        if api == "produce v10":  # its response's filter has nothing to do (its check)
            h.client(produce_req(cid, nbytes=900, version=10))
            return h.conn.pending[0], produce_resp(cid, version=10, with_endpoints=False)
        h.client(fetch_req(cid))
        return h.conn.pending[0], fetch_resp(cid, records=b"a" * 500)  # counted, with a quota

    short, long = Harness(snapshot), Harness(snapshot, short_way=False)
    first, response = exchange(short, 1)
    short.broker(response)
    long.broker(exchange(long, 1)[1])
    assert short.conn._spare is first
    # whatever a filter may have left on it is gone when it stands for the next
    first.notes, first.throttle_reason = {"f": 1}, "noted"
    first.raw_answer = first.ctx = object()
    again, response = exchange(short, 2)
    assert again is first and short.conn._spare is None
    assert _slots(again) == _slots(exchange(long, 2)[0])
    assert again.correlation_id == 2
    short.broker(response)
    long.broker(response)
    assert short.take_client() == long.take_client()
    if snapshot is not None:
        assert bucket_totals(short) == bucket_totals(long)


def test_an_in_flight_whose_request_was_throttled_is_not_taken_again():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=3000))  # over the burst: throttled
    throttled = h.conn.pending[0]
    assert throttled.throttle_ms > 0
    h.broker(produce_resp(1))  # the long way writes its throttle in
    assert h.conn._spare is None and throttled.throttle_ms > 0


def _several_responses(h, kinds):
    """Requests of ``kinds`` sent one by one; their responses, in one read."""
    responses = b""
    for cid, kind in enumerate(kinds, 1):
        if kind == "v10":  # the usual Produce v10 answer: no NodeEndpoints
            h.client(produce_req(cid, nbytes=900, version=10))
            responses += produce_resp(cid, version=10, with_endpoints=False)
        elif kind == "v10 endpoints":  # a leader moved: the addresses are rewritten
            h.client(produce_req(cid, nbytes=900, version=10))
            responses += produce_resp(cid, version=10)
        elif kind == "v8":
            h.client(produce_req(cid, nbytes=900))
            responses += produce_resp(cid)
        else:  # a Fetch: counted against a quota
            h.client(fetch_req(cid))
            responses += fetch_resp(cid, records=b"a" * 500)
    return responses


@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12,
                                                                 CONSUMER_BYTE_RATE: 1e12}}])
@pytest.mark.parametrize("kinds,short", [
    (["v10", "v10"], True), (["v10", "v8", "v10"], True), (["v8", "v8"], True),
    (["v10", "v10 endpoints"], False), (["v10 endpoints", "v10"], False),
    (["v10", "fetch"], None)])  # None: short without a quota, long with one
def test_a_read_of_several_responses_each_passing_as_it_is_takes_the_short_way(
        snapshot, kinds, short):
    results = []
    for h in (Harness(snapshot), Harness(snapshot, short_way=False)):
        responses = _several_responses(h, kinds)
        h.take_broker()
        last = h.conn.pending[-1]
        taken = h.conn.pass_response(responses) if h.short_way else False
        if not taken:
            h.broker(responses)
        assert h.closed is None and not h.conn.pending
        if h.short_way:
            expected = short if short is not None else snapshot is None
            assert taken is expected
            if taken:  # the last one's InFlight is the spare
                assert h.conn._spare is last
                h.to_client += responses  # as the adapter writes it
        results.append((h.take_client(), h.conn.bytes_from_broker,
                        h.manager and bucket_totals(h)))
    assert results[0] == results[1]


def test_several_responses_in_a_read_go_the_long_way_for_a_throttle_or_an_answer_behind():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=300))
    h.client(produce_req(2, nbytes=3000))  # over the burst: throttled
    assert h.conn.pending[1].throttle_ms > 0
    assert not h.conn.pass_response(produce_resp(1) + produce_resp(2))
    h = Harness()
    h.client(produce_req(1))
    h.client(produce_req(2))
    h.client(api_versions_req(3, version=apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1))
    both = produce_resp(1) + produce_resp(2)
    assert not h.conn.pass_response(both)  # the proxy's answer follows them
    assert not h.conn.pass_response(both + produce_resp(3))  # not the response awaited
    assert not h.conn.pass_response(both[:-1])  # the second one does not end here
    h.broker(both)
    assert cids(h.take_client()) == [1, 2, 3] and not h.conn.pending


def _producer_heads():
    """Produce requests whose heads change under the short way's copy of the
    last one: acks, client-id, version, transactional.id, a client cycling
    client-ids past CLIENT_IDS_KEPT, and other client-ids' Fetches doing so;
    (request, response or None)."""
    heads = [dict(), dict(acks=-1), dict(acks=0), dict(), dict(client_id="app-2"),
             dict(client_id="app-2", version=9), dict(version=9), dict(client_id="app-1x"),
             dict(transactional_id="tx"), dict(version=3), dict()]
    heads += [dict(client_id="cycling-%d" % i) for i in range(70)] + [dict(), dict()]
    # Fetches of other client-ids forget the client-ids kept, app-1's among them
    heads += [dict(fetch="dropping-%d" % i) for i in range(70)] + [dict()]
    out = []
    for cid, kw in enumerate(heads, 1):
        if "fetch" in kw:
            out.append((fetch_req(cid, client_id=kw["fetch"]), fetch_resp(cid)))
            continue
        version = kw.get("version", 8)
        out.append((produce_req(cid, **kw),
                    None if kw.get("acks") == 0 else produce_resp(cid, version=version)))
    return out


@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12},
                                             "clients/app-2": {PRODUCER_BYTE_RATE: 1e12,
                                                               REQUEST_RATE: 1e9}}])
def test_a_producer_changing_its_head_is_read_again_on_the_short_way(snapshot):
    short, long = both_ways(snapshot, _producer_heads())
    # all but acks=0 (the Fetches too, under quotas: a consumer's head is
    # read once as well)
    assert short.log.count("pass_request") == len(_producer_heads()) - 1
    assert short.conn.client_quotas.keys() == long.conn.client_quotas.keys()
    if snapshot is not None:
        totals = bucket_totals(short)
        assert totals == bucket_totals(long)
        # app-2 counted against its own quotas: its bytes and requests
        assert len([k for k in totals if "app-2" in str(k)]) == 2


def test_a_frame_shorter_than_the_head_the_short_way_knows_goes_the_long_way():
    results = []
    for short_way in (True, False):
        h = Harness(short_way=short_way)
        h.client(produce_req(1))
        h.broker(produce_resp(1))
        frame = produce_req(2)
        assert frame[22] == 1  # acks' last byte
        # the same head through acks, but the frame says it ends before acks'
        # last byte; the next frame (a large one, its start in this read)
        # begins with that byte
        nxt = produce_req(3, nbytes=HEAD_SIZE)
        nxt = struct.pack(">i", 0x01000000 + len(nxt) - 4) + nxt[4:]
        h.client(struct.pack(">i", 18) + frame[4:22] + nxt)
        results.append((h.closed, h.take_broker(), h.conn.requests))
    assert results[0] == results[1] and results[0][0] is not None


def test_only_responses_whose_filters_all_have_a_quick_response_check_are_offered_to_them():
    plain = FilterTable(standard_filters(advertise, None))
    for key in ((apis.PRODUCE, 10), (apis.FETCH, 16)):  # NodeEndpoints: AddressRewrite's
        assert key in plain.quick_responses
    manager = QuotaManager({"clients/<default>": {CONSUMER_BYTE_RATE: 1e12}})
    quota = FilterTable(standard_filters(advertise, manager))
    assert (apis.PRODUCE, 10) in quota.quick_responses
    # a Fetch response counts against the quota whatever its tags: never
    # walked for them first, only to go the long way after
    assert (apis.FETCH, 16) not in quota.quick_responses
    assert (apis.FETCH, 11) not in quota.quick_responses
    assert (apis.METADATA, 8) not in quota.quick_responses  # gathered: always rewritten
    h = Harness({"clients/<default>": {CONSUMER_BYTE_RATE: 1e12}})
    calls = []
    checks = h.conn.table.quick_responses
    for key, found in checks.items():
        checks[key] = tuple(lambda frame, c=c, key=key: calls.append(key) or c(frame)
                            for c in found)
    h.client(fetch_req(1, version=16))
    h.broker(fetch_resp(1, version=16, with_endpoints=False))
    assert calls == [] and h.closed is None and not h.conn.pending
    h.client(produce_req(2, version=10))
    h.broker(produce_resp(2, version=10, with_endpoints=False))
    assert calls == [(apis.PRODUCE, 10)] and h.log[-1] == "pass_response"


def bucket_totals(h):
    """What the buckets counted, the connections' leases settled first, as
    every reader of the buckets does (metrics, the workers' exchange)."""
    h.manager.settle_leases(h.now)
    return {key: bucket.total for key, bucket in h.manager.buckets.items()}


@pytest.mark.parametrize("whole", [True, False])
def test_a_throttle_earned_on_the_short_way_mutes_the_client_as_the_long_way(whole):
    results = []
    for short_way in (True, False):
        h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}}, short_way=short_way)
        first, second = produce_req(1, nbytes=5000), produce_req(2)
        if whole:
            h.client(first)
        else:  # the throttled request's end comes in a later read, with the next
            h.client(first[:1000])
            h.client(first[1000:] + second)
        paused = h.client_paused_until
        assert paused is not None and paused > 0
        h.client(second if whole else b"")  # not read while muted
        assert req_cids(h.to_broker) == [1]
        h.broker(produce_resp(1))
        throttle = ProduceResponse[8].decode(h.to_client[8:]).throttle_time_ms
        h.at(paused)
        assert req_cids(h.take_broker()) == [1, 2]
        results.append((paused, throttle, bucket_totals(h), h.conn.requests,
                        [a for a in h.log if a not in ("pass_request", "SendToBroker")]))
        if short_way:
            assert "pass_request" in h.log
    assert results[0] == results[1]


@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12},
                                             "clients/app-2": {PRODUCER_BYTE_RATE: 1e12,
                                                               REQUEST_RATE: 1e9}}])
def test_reads_of_several_judged_produce_requests_take_the_short_way(snapshot):
    # a producer with many batches ready sends several requests at once
    # (librdkafka: a read of some 200 KB holds three or four of them)
    reads = [(produce_req(1) + produce_req(2, nbytes=3000) + produce_req(3),
              produce_resp(1) + produce_resp(2) + produce_resp(3)),
             (produce_req(4, client_id="app-2") + produce_req(5) + produce_req(6, acks=-1),
              produce_resp(4) + produce_resp(5) + produce_resp(6)),
             # the last one's end comes in the next read
             (produce_req(7) + produce_req(8, nbytes=9000)[:HEAD_SIZE + 10], None),
             (produce_req(8, nbytes=9000)[HEAD_SIZE + 10:] + produce_req(9, version=9),
              produce_resp(7) + produce_resp(8) + produce_resp(9, version=9)),
             # versions mixed in one read go the long way under quotas (a
             # plain read without them); acks=0 the long way always
             (produce_req(10) + produce_req(11, version=9), produce_resp(10)
              + produce_resp(11, version=9)),
             (produce_req(12) + produce_req(13, acks=0), produce_resp(12))]
    short, long = both_ways(snapshot, reads)
    assert short.log.count("pass_request") == (5 if snapshot is None else 4)
    assert short.conn.requests == 13
    if snapshot is not None:
        totals = bucket_totals(short)
        assert totals == bucket_totals(long)
        assert len([k for k in totals if "app-2" in str(k)]) == 2


@pytest.mark.parametrize("before", [0, 1, 2])
def test_a_throttle_earned_within_a_read_on_the_short_way_holds_what_follows(before):
    """A request that earns a delay in the middle of a read: it goes on,
    what follows it in the read waits for the mute's end, as the long way
    stops after it; ``before``: the requests before it in the read."""
    results = []
    for short_way in (True, False):
        h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}}, short_way=short_way)
        cid = iter(range(1, 10))
        read = b"".join(produce_req(next(cid), nbytes=100) for _ in range(before))
        throttled = next(cid)
        read += produce_req(throttled, nbytes=5000)
        after = [next(cid), next(cid)]
        read += produce_req(after[0]) + produce_req(after[1], nbytes=2000)
        start = len(h.log)
        h.client(read)
        took = h.log[start]
        paused = h.client_paused_until
        assert paused is not None and paused > 0
        assert req_cids(h.to_broker) == list(range(1, throttled + 1))
        assert [p.correlation_id for p in h.conn.pending] == list(range(1, throttled + 1))
        h.client(produce_req(9))  # read while muted: after what the read left
        assert req_cids(h.to_broker) == list(range(1, throttled + 1))
        h.broker(b"".join(produce_resp(c) for c in range(1, throttled + 1)))
        throttle = ProduceResponse[8].decode(frames_of(h.to_client)[-1][8:]).throttle_time_ms
        assert throttle > 0
        for _ in range(10):  # what follows earns mutes of its own at 1000 B/s
            h.at(h.client_paused_until)
            if h.client_paused_until is None:
                break
        rest = req_cids(h.take_broker())[throttled:]
        results.append((paused, throttle, rest, bucket_totals(h), h.conn.requests,
                        h.conn.bytes_from_client, h.client_paused_until,
                        [a for a in h.log if a not in ("pass_request", "SendToBroker")]))
        assert took == ("pass_request" if short_way else "SendToBroker")
    assert results[0] == results[1]
    # what followed it went on after the mute, in order
    assert results[0][2] == after + [9]


# a producer's lease: requests that fit go on unjudged --------------------------

LEASED = {"clients/app-1": {PRODUCER_BYTE_RATE: 1e7, REQUEST_RATE: 1000.0}}
PRODUCED = (PRODUCER_BYTE_RATE, "", "app-1")
REQUESTED = (REQUEST_RATE, "", "app-1")


def test_a_producers_requests_within_its_lease_are_counted_when_it_is_settled():
    h = Harness(LEASED)
    h.client(produce_req(1, nbytes=1000))  # its head read and judged: a lease taken
    lease = h.conn._lease
    produce, request = h.manager.buckets[PRODUCED], h.manager.buckets[REQUESTED]
    frame_len = len(produce_req(1, nbytes=1000))
    assert (produce.total, request.total) == (frame_len, 1)
    # an eighth of what the buckets hold: 10 MB and 1000 requests, less the first
    assert lease.bytes_given == int((1e7 - frame_len) / 8) and lease.requests_given == int(999 / 8)
    assert (produce.leased, request.leased) == (lease.bytes_given, lease.requests_given)
    h.client(produce_req(2, nbytes=1000))  # one read: the short way
    h.client(produce_req(3, nbytes=1000) + produce_req(4, nbytes=1000))  # the loop
    h.client(produce_req(5, nbytes=1000))
    assert h.log.count("pass_request") == 4 and h.to_broker == b"".join(
        produce_req(c, nbytes=1000) for c in range(1, 6))
    assert (produce.total, request.total) == (frame_len, 1)  # taken from the lease
    assert (lease.bytes_left, lease.requests_left) == (lease.bytes_given - 4 * frame_len,
                                                       lease.requests_given - 4)
    assert bucket_totals(h)[PRODUCED] == 5 * frame_len  # settled: counted
    assert bucket_totals(h)[REQUESTED] == 5
    assert (produce.leased, request.leased) == (0, 0)
    h.client(produce_req(6, nbytes=1000))  # judged again, and a new lease
    assert request.total == 6 and h.conn._lease is not lease and request.leased > 0


def test_a_lease_ends_when_it_runs_out_its_time_passes_or_the_connection_closes():
    h = Harness(LEASED)
    frame_len = len(produce_req(1, nbytes=1000))
    h.client(produce_req(1, nbytes=1000))
    given = h.conn._lease.requests_given
    for cid in range(2, given + 4):  # the lease's requests and two more
        h.client(produce_req(cid, nbytes=1000))
    request = h.manager.buckets[REQUESTED]
    # one judged, the lease's, then one judged past it (the lease settled, a
    # new one taken, which the last is in)
    assert request.total == 2 + given and request.leased == h.conn._lease.requests_given
    h.now += LEASE_SECONDS  # its time is over: the next request is judged
    h.client(produce_req(99, nbytes=1000))
    assert request.total == given + 4  # the last lease's one request, and this one
    h.run(h.conn.close("the broker went away"))
    assert request.leased == 0 and not h.manager.leases
    assert request.total == given + 4
    assert h.manager.buckets[PRODUCED].total == (given + 4) * frame_len


@pytest.mark.parametrize("change", ["quota", "client"])
def test_after_a_lease_a_lowered_quota_or_another_client_id_judges_as_the_long_way(change):
    results = []
    for short_way in (True, False):
        h = Harness(dict(LEASED, **{"clients/app-2": {REQUEST_RATE: 1000.0}}),
                    short_way=short_way)
        for cid in range(1, 6):
            h.client(produce_req(cid, nbytes=1000))
        h.at(0.01)
        if change == "quota":  # the configuration settles every lease
            h.manager.update({"clients/app-1": {PRODUCER_BYTE_RATE: 500.0}})
            h.client(produce_req(6, nbytes=1000))
        else:  # another head: the lease of the one before is settled
            for cid in range(6, 9):
                h.client(produce_req(cid, nbytes=1000, client_id="app-2"))
            h.client(produce_req(9, nbytes=1000))
            # both heads in one read (the loop), each way round
            h.client(produce_req(10, nbytes=1000, client_id="app-2") + produce_req(11))
            h.client(produce_req(12) + produce_req(13, nbytes=1000, client_id="app-2"))
            h.client(produce_req(14, nbytes=1000, client_id="app-2"))
        h.broker(b"".join(produce_resp(c) for c in req_cids(h.to_broker)))
        throttles = [ProduceResponse[8].decode(f[8:]).throttle_time_ms
                     for f in frames_of(h.to_client)]
        results.append((throttles, h.client_paused_until, bucket_totals(h)))
    assert results[0] == results[1]
    if change == "quota":
        assert results[0][0][-1] > 0  # over the lowered quota: throttled


def test_a_lease_is_never_given_in_window_mode_nor_from_a_bucket_nearly_empty():
    h = Harness(LEASED, QuotaSettings(mode=WINDOW))
    for cid in range(1, 4):
        h.client(produce_req(cid, nbytes=1000))
    assert h.conn._lease is None and h.manager.buckets[REQUESTED].total == 3
    # 4 requests' worth left at most: a lease would be used up at once
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 30000.0}})
    h.client(produce_req(1, nbytes=1000))
    assert h.conn._lease is None and h.manager.buckets[PRODUCED].leased == 0


# a consumer's Fetches on the short way under quotas ---------------------------

CONSUMER_QUOTAS = {"clients/app-1": {CONSUMER_BYTE_RATE: 1e12, REQUEST_RATE: 1e9},
                   "clients/app-2": {CONSUMER_BYTE_RATE: 1e12}}


def _consumer_exchanges():
    """Fetches at the usual layouts, of two client-ids."""
    return [(fetch_req(1), fetch_resp(1, records=b"a" * 4000)),
            (fetch_req(2), fetch_resp(2, records=b"b" * 100)),  # the same head: compared
            (fetch_req(3, version=4), fetch_resp(3, version=4)),
            (fetch_req(4, version=0), fetch_resp(4, version=0)),  # no max_bytes
            (fetch_req(5, version=12), fetch_resp(5, version=12)),  # header tags
            (fetch_req(6, version=15), fetch_resp(6, version=15)),  # no replica_id
            (fetch_req(7, version=16), fetch_resp(7, version=16)),  # NodeEndpoints: walked
            (fetch_req(8, client_id="app-2"), fetch_resp(8, records=b"c" * 700)),
            (fetch_req(10), fetch_resp(10, records=b"d" * 50))]


def test_a_consumers_fetches_take_the_short_way_under_quotas_with_the_same_result():
    short, long = both_ways(CONSUMER_QUOTAS, _consumer_exchanges())
    # the v16 response alone, and the v0 request, gathered for its
    # partitions' max (FetchCap)
    assert short.long_heads == {"request": 1, "response": 1}
    assert long.long_heads == {"request": 9, "response": 9}
    assert short.conn.client_quotas.keys() == long.conn.client_quotas.keys()
    totals = bucket_totals(short)
    assert totals == bucket_totals(long)
    fetched = {k[2]: v for k, v in totals.items() if k[0] == CONSUMER_BYTE_RATE}
    assert fetched["app-1"] > 4000 and fetched["app-2"] > 700
    requests = {k[2]: v for k, v in totals.items() if k[0] == REQUEST_RATE}
    assert requests == {"app-1": 8}


@pytest.mark.parametrize("version", [11, 4])  # a client that backs off itself, one held
@pytest.mark.parametrize("quota", [{REQUEST_RATE: 3.0}, {CONSUMER_BYTE_RATE: 3000.0}])
def test_a_fetch_over_its_quota_on_the_short_way_is_throttled_as_the_long_way(quota, version):
    results = []
    for short_way in (True, False):
        h = Harness({"clients/app-1": quota}, short_way=short_way)
        states = []
        t = 0.0
        for cid in range(1, 9):
            h.client(fetch_req(cid, version=version, max_bytes=1000))  # under the cap
            while cid not in req_cids(h.to_broker):  # held for its quota's debt
                t = h.client_paused_until
                h.at(t)
            h.broker(fetch_resp(cid, version=version, records=b"r" * 400))
            states.append((h.take_broker(), h.take_client(), h.client_paused_until,
                           h.broker_paused_until, bucket_totals(h)))
            t = max(t + 0.05, h.client_paused_until or 0.0, h.broker_paused_until or 0.0)
            h.at(t)
            states.append((h.take_client(), h.client_paused_until, h.broker_paused_until))
        assert h.closed is None and not h.conn.pending
        results.append((states, [a for a in h.log  # the mutes, in order
                                 if a not in ("pass_request", "pass_response", "SendToBroker",
                                              "SendToClient")]))
        if short_way:
            # under a byte quota, a fetch asking for more than its grant
            # goes the long way, to be capped (FetchCap) or held for a debt
            assert h.long_heads["request"] == 0 or CONSUMER_BYTE_RATE in quota
            assert h.long_heads["response"] < 8  # those that earned a throttle
    assert results[0] == results[1]
    assert any(state[2] for state in results[0][0][::2])  # the client was muted


def test_a_fetch_cap_lowered_meanwhile_sends_the_next_fetch_the_long_way_capped():
    results = []
    for short_way in (True, False):
        h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1e12}}, short_way=short_way)
        for cid in (1, 2):
            h.client(fetch_req(cid, max_bytes=1 << 20))
            h.broker(fetch_resp(cid))
        h.manager.update({"clients/app-1": {CONSUMER_BYTE_RATE: 5000.0}})
        h.client(fetch_req(3, max_bytes=1 << 20))
        h.broker(fetch_resp(3))
        sent = frames_of(h.take_broker())
        assert [fetch_head(f, 11)[2] for f in sent] == [1 << 20, 1 << 20,
                                                        5000 * FETCH_GRANT_FRACTION]
        results.append((sent, h.take_client(), bucket_totals(h)))
        if short_way:
            assert h.long_heads["request"] == 1  # the capped one
    assert results[0] == results[1]


def test_fetches_under_topic_quotas_go_the_long_way_and_count_the_same():
    snapshot = {"clients/app-1": {CONSUMER_BYTE_RATE: 1e12}}
    results = []
    for short_way in (True, False):
        h = Harness(snapshot, short_way=short_way)
        h.client(fetch_req(1))
        # topic quotas arrive while the response is on its way: it is
        # counted for its topic, as the long way counts it
        h.manager.update(dict(snapshot, **{"topics/orders": {CONSUMER_BYTE_RATE: 1e12}}))
        h.broker(fetch_resp(1, records=b"a" * 900))
        h.client(fetch_req(2))
        h.broker(fetch_resp(2, records=b"b" * 800))
        topics = {k: b.total for k, b in h.manager.topic_buckets.items()}
        assert topics == {(CONSUMER_BYTE_RATE, "orders"): 1700 * 2}  # two partitions
        results.append((h.take_broker(), h.take_client(), bucket_totals(h), topics))
        if short_way:
            assert h.long_heads == {"request": 1, "response": 2}
    assert results[0] == results[1]


def test_the_short_way_declines_what_the_long_way_must_see():
    h = Harness()
    assert not h.conn.pass_request(produce_req(1) + produce_req(2, acks=0))
    # the start of a frame shorter than the head the long way gathers first
    assert not h.conn.pass_request(produce_req(1) + produce_req(2, nbytes=5000)[:300])
    assert not h.conn.pass_request(produce_req(1) + fetch_req(2)[:11])
    assert not h.conn.pass_request(produce_req(1, acks=0))
    assert not h.conn.pass_request(produce_req(2, acks=0))  # its head known by now
    assert not h.conn.pass_request(raw_request(1, apis.PRODUCE, 7, b"\xff\xff\xff", b"\xff\xfe"))
    assert not h.conn.pass_request(raw_request(1, 9999, 0))  # unknown API
    # a whole frame too short for a request header (no client-id): the long way refuses it
    assert not h.conn.pass_request(struct.pack(">ihhi", 8, apis.METADATA, 0, 1))
    assert h.conn.requests == 0 and not h.conn.pending
    h.client(produce_req(1))
    assert not h.conn.pass_response(produce_resp(2))  # not the response awaited
    assert not h.conn.pass_response(produce_resp(1)[:-1])
    assert h.conn.pass_response(produce_resp(1))


def test_reads_of_several_frames_and_of_parts_of_frames_take_the_short_way():
    h = Harness()
    big = produce_req(3, nbytes=5000)
    stream = produce_req(1) + fetch_req(2) + big + metadata_req(4)
    cut = len(stream) - len(metadata_req(4)) - 3000  # within the third frame's records
    h.client(stream[:cut])
    assert h.log == ["ResumeClient", "pass_request"] or h.log[-1] == "pass_request"
    assert [p.correlation_id for p in h.conn.pending] == [1, 2, 3]
    assert h.conn.requests == 3 and h.conn.requests_in.passing == 3000
    h.client(stream[cut : cut + 1000])  # the middle of that frame
    assert h.conn.requests_in.passing == 2000 and h.conn.requests == 3
    h.client(stream[cut + 1000 :])  # its end, then a whole frame
    assert h.log[-3:] == ["pass_request"] * 3
    assert [p.correlation_id for p in h.conn.pending] == [1, 2, 3, 4]
    assert h.take_broker() == stream and h.conn.requests_in.at_boundary
    assert h.conn.requests == 4 and h.conn.bytes_from_client == len(stream)
    h.broker(produce_resp(1) + fetch_resp(2) + produce_resp(3) + metadata_resp(4))
    assert cids(h.take_client()) == [1, 2, 3, 4] and not h.conn.pending
    # a frame the long way must see, after the rest of one passed on
    h.client(big[:4000])
    h.client(big[4000:] + produce_req(5, acks=0))
    assert h.log[-1] != "pass_request"
    assert h.take_broker() == big + produce_req(5, acks=0)
    assert [p.correlation_id for p in h.conn.pending] == [3]


@pytest.mark.parametrize("version", [11, 16])  # v16: its NodeEndpoints tail walked
@pytest.mark.parametrize("whole_max", [WHOLE_RESPONSE_MAX, 5000])
def test_a_response_read_in_parts_takes_the_short_way_held_until_whole_or_streamed(whole_max,
                                                                                    version):
    h = Harness(whole_response_max=whole_max)
    long = Harness(whole_response_max=whole_max, short_way=False)
    for each in (h, long):
        each.client(fetch_req(1, version=version) + produce_req(2))
    response = fetch_resp(1, version=version, records=b"r" * 20000)
    parts = [response[:600], response[600:9000], response[9000:18000], response[18000:]]
    streamed = len(response) > whole_max
    for i, part in enumerate(parts):
        h.broker(part)
        long.broker(part)
        last = i == len(parts) - 1
        # v16: its start and its tail are walked the long way, the records in between not
        assert (h.log[-1] == "pass_response") == (version == 11 or 0 < i < len(parts) - 1)
        # a response up to whole_max reaches the client only once whole
        sent = sum(map(len, parts[: i + 1])) if streamed or last else 0
        assert bytes(h.to_client) == bytes(long.to_client) and len(h.to_client) == sent
        assert h.conn.responses_in.at_boundary == last
        assert h.conn.holding_response == (not streamed and not last)
    assert h.conn.bytes_from_broker == len(response)
    assert [p.correlation_id for p in h.conn.pending] == [2]
    h.take_client()
    # the end of a response and the next in one read: the long way, the same bytes
    second = produce_resp(2)
    h.client(fetch_req(3))
    third = fetch_resp(3, records=b"s" * 3000)
    h.broker(second + third[:700])
    assert h.log[-1] != "pass_response"
    h.broker(third[700:])
    assert h.take_client() == second + third and not h.conn.pending


def test_a_short_way_response_never_takes_a_start_shorter_than_the_long_way_reads():
    h = Harness()
    h.client(fetch_req(1))
    response = fetch_resp(1, records=b"r" * 3000)
    assert not h.conn.pass_response(response[:100])
    h.broker(response[:100])
    assert h.conn.responses_in.buffered == 100  # a head gathered, as before


def test_an_answer_of_the_proxys_own_behind_a_response_in_parts_goes_out_after_it():
    h = Harness()
    h.client(fetch_req(1))
    h.client(api_versions_req(2, version=apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1))
    response = fetch_resp(1, records=b"r" * 5000)
    h.broker(response[:1000])
    assert h.log[-1] == "pass_response" and h.take_client() == b""
    h.broker(response[1000:])
    assert h.log[-1] != "pass_response"  # the long way sends the answer behind it
    assert cids(h.take_client()) == [1, 2] and not h.conn.pending


def test_an_answer_of_the_proxys_own_behind_a_short_way_response_still_goes_out():
    h = Harness()
    h.client(produce_req(1))
    assert h.log[-1] == "pass_request"
    h.client(api_versions_req(2, version=apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1))
    assert h.take_client() == b""  # the proxy's answer waits for the response before it
    h.broker(produce_resp(1))
    assert cids(h.take_client()) == [1, 2]


class ThrottleProduce(Filter):
    name = "throttle-produce"

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.PRODUCE else NOTHING

    def on_request(self, ctx, head, inflight):
        return Throttle(500, "a test's throttle")


def test_while_muted_nothing_takes_the_short_way():
    h = Harness(filters=[ThrottleProduce()])
    h.client(produce_req(1))
    assert h.client_paused_until == 0.5
    assert not h.conn.pass_request(metadata_req(2))  # no filter reads it, but it must wait
    h.client(metadata_req(2))
    assert req_cids(h.take_broker()) == [1]
    h.at(0.5)
    assert req_cids(h.take_broker()) == [2]
    assert h.conn.pass_request(metadata_req(3))


@pytest.mark.parametrize("whole_max", [WHOLE_RESPONSE_MAX, 3000])  # held until whole, or not
@pytest.mark.parametrize("snapshot", [None, {"clients/app-1": {PRODUCER_BYTE_RATE: 1e12,
                                                                 CONSUMER_BYTE_RATE: 1e12,
                                                                 REQUEST_RATE: 1e9}}])
def test_random_reads_give_the_same_stream_the_short_way_or_not(snapshot, whole_max):
    rng = random.Random(5)
    short_reads = short_responses = 0
    for trial in range(20):
        exchanges = [rng.choice(_plain_exchanges()) for _ in range(12)]
        exchanges = [(with_cid(q, i, 8), None if r is None else with_cid(r, i, 4))
                     for i, (q, r) in enumerate(exchanges, 1)]
        requests = b"".join(q for q, _ in exchanges)
        responses = b"".join(r for _, r in exchanges if r is not None)
        # reads along frame bounds, anywhere, or parts of frames that end with them
        cut = rng.choice(["frames", "anywhere", "within"])
        results = []
        for short_way in (True, False):
            h = Harness(snapshot, short_way=short_way, whole_response_max=whole_max)
            states = []  # after every read: what went out, what is counted and awaited
            for stream, feed, parts in ((requests, h.client, [q for q, _ in exchanges]),
                                        (responses, h.broker,
                                         [r for _, r in exchanges if r is not None])):
                rs = random.Random(trial)
                if cut == "frames":
                    reads = parts
                else:
                    reads = []
                    for part in [stream] if cut == "anywhere" else parts:
                        pos = 0
                        while pos < len(part):
                            n = rs.choice([1, 50, 600, 4096, 9000, 30000])
                            reads.append(part[pos : pos + n])
                            pos += n
                for read in reads:
                    feed(read)
                    states.append((len(h.to_broker), len(h.to_client), h.conn.requests,
                                   h.conn.bytes_from_client, h.conn.bytes_from_broker,
                                   [p.correlation_id for p in h.conn.pending],
                                   h.manager and bucket_totals(h)))
            assert h.closed is None and not h.conn.pending
            results.append((states, h.take_broker(), h.take_client()))
            if short_way:
                taken = h.log.count("pass_request")
                taken_responses = h.log.count("pass_response")
        assert results[0] == results[1]
        assert results[0][1] == requests
        short_reads += taken
        short_responses += taken_responses
    assert short_reads > (50 if snapshot is None else 20)  # the short way was taken, the same
    assert short_responses > 50


def with_cid(frame, cid, at):
    out = bytearray(frame)
    struct.pack_into(">i", out, at, cid)
    return bytes(out)


# acks=0 -------------------------------------------------------------------

def test_acks_0_expects_no_response_and_a_brokers_stray_answer_is_dropped():
    h = Harness()
    h.client(produce_req(1, acks=0) + produce_req(2, acks=1))
    assert req_cids(h.take_broker()) == [1, 2]
    assert [p.correlation_id for p in h.conn.pending] == [2]
    h.broker(produce_resp(1) + produce_resp(2))  # Tansu answers acks=0 anyway
    assert cids(h.take_client()) == [2]
    assert h.closed is None


# the proxy's own answers keep their place in the response order ----------

def test_too_new_api_versions_is_answered_at_once_when_nothing_is_pending():
    h = Harness()
    h.client(api_versions_req(7, version=apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1))
    assert h.take_broker() == b""
    answer = h.take_client()
    assert cids(answer) == [7]
    assert struct.unpack_from(">h", answer, 8)[0] == 35  # UNSUPPORTED_VERSION


@pytest.mark.parametrize("chunk", [None, 1, 100, 4096])
def test_a_response_goes_to_the_client_only_once_it_is_whole(chunk):
    h = Harness()
    h.client(fetch_req(1) + fetch_req(2))
    first, second = fetch_resp(1, records=b"r" * 20000), fetch_resp(2, records=b"s" * 9000)
    h.broker(first[:-1], chunk)
    assert h.to_client == b""
    h.broker(first[-1:] + second[:5000], chunk)
    assert h.take_client() == first  # the first whole, nothing of the second
    h.broker(second[5000:], chunk)
    assert h.take_client() == second


def test_a_broker_gone_mid_response_leaves_the_client_no_part_of_it():
    h = Harness()
    h.client(fetch_req(1) + fetch_req(2))
    first, second = fetch_resp(1, records=b"r" * 300), fetch_resp(2, records=b"s" * 9000)
    h.broker(first + second[:4000])
    h.run(h.conn.close("broker connection lost"))
    assert h.closed == "broker connection lost"
    assert h.take_client() == first


def test_a_response_above_the_whole_limit_streams():
    h = Harness(whole_response_max=10000)
    h.client(fetch_req(1) + fetch_req(2))
    big, small = fetch_resp(1, records=b"r" * 20000), fetch_resp(2, records=b"s" * 900)
    h.broker(big[:15000])
    assert h.take_client() == big[:15000]  # streams: above the limit
    h.broker(big[15000:] + small[:500])
    assert h.take_client() == big[15000:]  # and the small one waits to be whole
    h.broker(small[500:])
    assert h.take_client() == small


@pytest.mark.parametrize("chunk", [None, 1, 100, 700])
def test_a_local_answer_waits_behind_a_response_being_streamed(chunk):
    h = Harness(whole_response_max=0)  # every response streams
    too_new = apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1
    h.client(fetch_req(1))
    big = fetch_resp(1, records=b"r" * 5000)
    h.broker(big[:1000])  # the response is part-way through
    h.client(api_versions_req(2, version=too_new))
    assert h.to_client == big[:1000]  # the answer did not cut into the response
    h.broker(big[1000:], chunk)
    out = h.take_client()
    assert cids(out) == [1, 2]
    assert out[: len(big)] == big


def test_a_local_answer_waits_behind_a_gathered_response():
    h = Harness()
    too_new = apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1
    h.client(metadata_req(1) + api_versions_req(2, version=too_new) + metadata_req(3))
    assert req_cids(h.take_broker()) == [1, 3]
    assert h.to_client == b""
    resp = metadata_resp(1) + metadata_resp(3)
    h.broker(resp[:50])
    h.broker(resp[50:])
    assert cids(h.take_client()) == [1, 2, 3]


def test_a_local_answer_waits_behind_a_held_response():
    # Produce v2: the client does not back off itself (KIP-219), so the
    # throttled response is held; an answer due after it must wait too
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    too_new = apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1
    h.client(produce_req(1, nbytes=3000, version=2))
    delay = h.conn.pending[0].throttle_ms
    assert delay > 0
    h.at(delay / 1000.0)  # the mute ends; the next request is read
    h.client(api_versions_req(2, version=too_new))
    h.broker(produce_resp(1, version=2))
    assert h.to_client == b"" and h.broker_paused_until is not None
    h.at(h.broker_paused_until)
    assert cids(h.take_client()) == [1, 2]


# throttling ---------------------------------------------------------------

def test_a_throttled_request_goes_on_whole_and_nothing_after_it_is_read_until_the_mute_ends():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    first = produce_req(1, nbytes=3000)  # over the 1 s burst: throttled
    rest = produce_req(2) + produce_req(3)
    stream = first + rest
    h.client(stream[: len(first) + 30])  # the mute begins mid-frame of request 2
    assert h.take_broker() == first
    until = h.client_paused_until
    assert until is not None and until > 0
    h.client(stream[len(first) + 30 :])  # bytes already on their way are kept
    assert h.take_broker() == b""
    h.at(until - 0.01)
    assert h.take_broker() == b""
    h.at(until)
    got = h.take_broker()
    assert got.startswith(produce_req(2))
    while h.client_paused_until is not None:  # each request over quota mutes again
        h.at(h.client_paused_until)
        got += h.take_broker()
    assert got == rest


def test_the_response_says_the_throttle_time_and_new_clients_get_it_at_once():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=3000, version=8))
    delay = h.conn.pending[0].throttle_ms
    h.broker(produce_resp(1, version=8))
    out = h.take_client()
    assert ProduceResponse[8].decode(out[8:]).throttle_time_ms == delay
    assert h.broker_paused_until is None


def test_a_fetch_response_over_quota_mutes_the_client_and_its_fetch_is_capped():
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 2000.0}})
    h.client(fetch_req(1, max_bytes=50 * 1024 * 1024))
    sent = h.take_broker()
    decoded = FetchRequest[11].decode(sent[4:], header=True)
    # its grant: part of what the token bucket holds (1 s of quota, full)
    assert decoded.max_bytes == 2000 * FETCH_GRANT_FRACTION
    h.broker(fetch_resp(1, records=b"r" * 6000))
    out = h.take_client()
    assert struct.unpack_from(">i", out, 8)[0] > 0  # throttle_time_ms, patched in the head
    assert h.client_paused_until is not None


@pytest.mark.parametrize("short_way", [True, False])
@pytest.mark.parametrize("request_frame", [
    fetch_req(2, replica_id=3, max_bytes=1 << 20, client_id="broker-3"),  # a follower's Fetch
    raw_request(2, 4, 0),  # LeaderAndIsr
])
def test_replication_fetches_and_cluster_actions_are_refused_and_count_nowhere(
        request_frame, short_way):
    """Kafka exempts them from client quotas (KIP-124) because brokers send
    them; from a client they are refused, so that no one fetches past a
    quota by claiming to be a follower."""
    snapshot = {"clients/<default>": {REQUEST_RATE: 1e6, CONSUMER_BYTE_RATE: 1e9}}
    h = Harness(snapshot, short_way=short_way)
    h.client(fetch_req(1, max_bytes=1 << 20))  # a consumer's head first: kept, compared
    assert req_cids(h.take_broker()) == [1]
    h.broker(fetch_resp(1, records=b"r" * 5))
    assert cids(h.take_client()) == [1]
    counted = bucket_totals(h)
    h.client(request_frame + fetch_req(3))
    assert h.take_broker() == b"" and h.refused == "broker_only_api"
    assert "is sent by brokers" in h.closed
    assert bucket_totals(h) == counted


@pytest.mark.parametrize("short_way", [True, False])
def test_acks_0_counts_against_the_request_quota_and_mutes_the_client(short_way):
    """Kafka exempts acks=0 from request quotas (no response carries a
    throttle time); a client sending acks=0 would then have no request quota
    at all. The proxy counts it and stops reading the client instead."""
    h = Harness({"clients/app-1": {REQUEST_RATE: 1.0}}, short_way=short_way)
    h.client(b"".join(produce_req(cid, acks=0) for cid in range(1, 20)))
    # the 1 s burst is one request; the next earns the throttle, and the
    # client is not read after it
    assert req_cids(h.take_broker()) == [1, 2]
    assert h.client_paused_until is not None
    assert h.take_client() == b""  # nothing to answer
    h.at(h.client_paused_until)
    assert req_cids(h.take_broker()) == [3]  # one more, then muted again
    assert h.client_paused_until is not None


def test_request_rate_throttles_are_capped_at_one_window():
    # a coordinator connection muted for 10 s would miss its heartbeats
    h = Harness({"clients/app-1": {REQUEST_RATE: 0.1}})
    for cid in range(1, 40):
        h.client(metadata_req(cid))
        if h.client_paused_until is not None:
            break
    assert h.client_paused_until == pytest.approx(1.0)
    assert h.conn.pending[-1].throttle_ms == 1000
    assert h.conn.pending[-1].throttle_reason == REQUEST_RATE


def test_byte_rate_throttles_keep_their_own_cap():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 100.0}})
    h.client(produce_req(1, nbytes=5000))
    assert h.conn.pending[-1].throttle_ms == 10_000  # W, not one window


def test_a_header_longer_than_the_head_is_counted_once():
    h = Harness({"clients/<default>": {REQUEST_RATE: 1000.0}})
    long_id = "c" * 900  # the header runs past the first 512 bytes
    frame = produce_req(1, client_id=long_id, nbytes=20000)
    h.client(frame, chunk=300)
    assert h.take_broker() == frame
    (bucket,) = h.manager.buckets.values()
    assert bucket.rate.total() == 1
    assert h.conn.requests == 1


@pytest.mark.parametrize("snapshot", [None, {"clients/<default>": {
    REQUEST_RATE: 1e9, PRODUCER_BYTE_RATE: 1e12}}], ids=["no-quota", "quota"])
@pytest.mark.parametrize("short_way", [True, False], ids=["short", "long"])
def test_a_whole_request_over_the_frame_limit_is_refused_though_its_head_is_known(
        snapshot, short_way):
    h = Harness(snapshot, short_way=short_way)
    h.conn.requests_in.max_frame_size = 4096
    h.client(produce_req(1, nbytes=100))  # the head the short way keeps
    sent = len(h.to_broker)
    h.client(produce_req(2, nbytes=8000))  # the same head, one read, over the limit
    assert h.closed and "exceeds the maximum of 4096 bytes" in h.closed
    assert len(h.to_broker) == sent


def test_a_garbage_frame_is_refused_from_its_head():
    h = Harness()
    # 100 MiB frame, client_id length 0x7fff: refused once the head shows it
    # cannot be a request (no UTF-8 client-id), long before 100 MiB arrive
    head = struct.pack(">ihhih", 100 * 1024 * 1024, 0, 8, 1, 0x7FFF) + b"\xff" * 40000
    h.client(head)
    assert h.closed and "UTF-8" in h.closed
    assert h.conn.requests_in.buffered <= 64 * 1024


def test_the_quota_lookup_follows_the_principal():
    snapshot = {"users/alice": {PRODUCER_BYTE_RATE: 100.0},
                "clients/app-1": {PRODUCER_BYTE_RATE: 1e9}}
    h = Harness(snapshot)
    h.client(produce_req(1, nbytes=50))
    assert h.conn.quotas_for("app-1").produce.entity == "clients/app-1"
    h.conn.principal = "alice"  # authenticated (a later filter sets it)
    h.client(produce_req(2, nbytes=5000))
    assert h.conn.quotas_for("app-1").produce.entity == "users/alice"
    assert h.client_paused_until is not None
    assert set(h.conn.client_quotas) == {(ANONYMOUS, "app-1"), ("alice", "app-1")}


def test_clients_without_a_quota_get_no_bucket():
    h = Harness({"clients/someone-else": {PRODUCER_BYTE_RATE: 100.0}})
    for cid in range(1, 10):
        h.client(produce_req(cid, client_id="free-%d" % cid))
    assert h.manager.buckets == {}
    assert h.client_paused_until is None


def test_bytes_read_during_a_mute_are_counted_once():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    stream = produce_req(1, nbytes=3000) + b"".join(produce_req(c) for c in range(2, 6))
    h.client(stream, chunk=200)
    h.at(60.0)
    h.at(120.0)
    assert h.conn.bytes_from_client == len(stream)
    assert h.take_broker() == stream


# address rewriting --------------------------------------------------------

def test_metadata_addresses_are_rewritten_and_reported_before_the_client_sees_them():
    h = Harness()
    h.client(metadata_req(1))
    h.broker(metadata_resp(1), chunk=64)
    out = h.take_client()
    assert b"kafka-1.internal.example" not in out and b"proxy.example" in out
    (nodes, client_bytes_then), = h.nodes
    assert client_bytes_then == 0
    assert sorted(n.node_id for n in nodes) == [1, 2, 3]


@pytest.mark.parametrize("chunk", [None, 1, 100, 4096])
def test_fetch_v16_endpoints_are_rewritten_while_the_records_stream(chunk):
    h = Harness(whole_response_max=0)  # every response streams
    h.client(fetch_req(1, version=16))
    resp = fetch_resp(1, version=16, records=b"r" * 20000)
    h.broker(resp[:3000], chunk)
    streamed = bytes(h.to_client)
    assert len(streamed) >= 2500  # the records went on before the tail came
    h.broker(resp[3000:], chunk)
    out = streamed + h.take_client()[len(streamed):]
    assert len(out) == len(resp)
    assert b"kafka-1.internal.example" not in out
    assert b"r" * 20000 in out
    assert sorted(n.node_id for n in h.nodes[0][0]) == [1, 2, 3]


def test_api_versions_answers_are_clamped_to_what_the_proxy_decodes():
    h = Harness()
    h.client(api_versions_req(1))
    body = api_versions(3, [(apis.PRODUCE, 0, 99), (apis.FETCH, 0, 99), (999, 0, 5)])
    h.broker(frame_response(apis.API_VERSIONS, 3, body, 1))
    from kafka.protocol.metadata import ApiVersionsResponse

    decoded = ApiVersionsResponse[3].decode(h.take_client()[8:])
    ranges = {k.api_key: k.max_version for k in decoded.api_keys}
    assert ranges[apis.PRODUCE] == apis.MAX_DECODABLE_VERSION[apis.PRODUCE]
    assert ranges[apis.FETCH] == apis.MAX_DECODABLE_VERSION[apis.FETCH]
    assert 999 not in ranges  # an API the proxy does not know is never advertised


def test_a_too_new_request_of_a_decoded_api_closes_before_reaching_the_broker():
    h = Harness()
    h.client(raw_request(1, apis.METADATA, apis.MAX_DECODABLE_VERSION[apis.METADATA] + 1))
    assert h.take_broker() == b""
    assert "newer than the proxy can decode" in h.closed


# filters: the table, own requests, phases ---------------------------------

class Recorder(Filter):
    name = "recorder"

    def __init__(self):
        self.requests = []

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.METADATA else 0

    def on_request(self, ctx, head, inflight):
        self.requests.append((head.api_key, head.correlation_id, head.client_id))


def test_the_table_sends_a_filter_only_what_it_asked_for():
    rec = Recorder()
    h = Harness(filters=[rec])
    h.client(produce_req(1) + metadata_req(2) + fetch_req(3) + metadata_req(4, client_id="x"))
    assert rec.requests == [(apis.METADATA, 2, "app-1"), (apis.METADATA, 4, "x")]
    table = h.conn.table
    assert table.lookup(apis.PRODUCE, 8).request_filters == ()
    assert table.lookup(apis.METADATA, 8).request_filters == ((rec, 0),)  # the filter and its place


class Handshake(Filter):
    """Sends an ApiVersions of its own as soon as the broker is up and holds
    the connection for authentication until the answer comes."""

    name = "handshake"

    def __init__(self):
        self.answers = []

    def on_connect(self, ctx):
        ctx.begin_authentication()
        ctx.send_request(api_versions_req(0), apis.API_VERSIONS, 3, self._answered)

    def _answered(self, ctx, frame):
        self.answers.append(frame)
        ctx.authenticated("proxy-user")


def test_a_filter_sends_its_own_request_and_sees_the_answer_the_client_never_does():
    f = Handshake()
    h = Harness(filters=[f], connect=False)
    h.client(metadata_req(1))
    h.run(h.conn.broker_connected(0.0))
    assert h.conn.phase is Phase.AUTHENTICATING
    sent = frames_of(h.take_broker())
    own_cid = struct.unpack_from(">i", sent[0], 8)[0]
    assert struct.unpack_from(">h", sent[0], 4)[0] == apis.API_VERSIONS
    assert req_cids(sent[1]) == [1]  # the client's request goes after it
    body = api_versions(3, [(apis.PRODUCE, 0, 8)])
    h.broker(frame_response(apis.API_VERSIONS, 3, body, own_cid) + metadata_resp(1))
    assert len(f.answers) == 1
    assert cids(h.take_client()) == [1]
    assert h.conn.phase is Phase.READY and h.conn.principal == "proxy-user"


def test_random_chunking_of_a_mixed_stream_never_changes_what_arrives():
    rng = random.Random(11)
    for trial in range(15):
        h = Harness()
        reqs = [produce_req(1, nbytes=rng.randrange(10, 3000)), fetch_req(2),
                metadata_req(3), fetch_req(4, version=16), produce_req(5, acks=0),
                produce_req(6, version=10)]
        stream = b"".join(reqs)
        pos = 0
        while pos < len(stream):
            n = rng.choice([1, 3, 50, HEAD_SIZE, 2000])
            h.client(stream[pos : pos + n])
            pos += n
        assert h.take_broker() == stream
        resps = (produce_resp(1) + fetch_resp(2) + metadata_resp(3)
                 + fetch_resp(4, version=16, records=b"z" * 7000) + produce_resp(6, version=10))
        pos = 0
        while pos < len(resps):
            n = rng.choice([1, 3, 50, HEAD_SIZE, 2000])
            h.broker(resps[pos : pos + n])
            pos += n
        out = h.take_client()
        assert cids(out) == [1, 2, 3, 4, 6]
        # only the gathered Metadata answer changes length (shorter hosts)
        assert len(out) == len(resps) - 3 * (len("kafka-1.internal.example") - len("proxy.example"))
        assert h.closed is None


def test_a_timer_that_fires_early_is_set_again_not_lost():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=3000) + produce_req(2))
    until = h.client_paused_until
    h.client_paused_until = None
    h.at(until - 0.05)  # far too early: nothing is read, the timer is set again
    assert h.client_paused_until == until and h.take_broker() == produce_req(1, nbytes=3000)
    h.at(until - 0.0005)  # within a millisecond: due
    assert h.take_broker().startswith(produce_req(2))
