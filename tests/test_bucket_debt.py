"""The bucket owes the time, not the connection (issue 43, item 1): while a
quota bucket is in debt, every request counted in it waits, on whichever
connection it comes, and a request held as long as a client waits is answered
in the broker's place. Pipelines fed bytes with a fake clock, no I/O."""
import struct
import uuid

import pytest

from kthrottle.codecs._kafka import FetchResponse, ProduceResponse
from kthrottle.policy.quotas import FETCH_GRANT_FRACTION, FETCH_GRANT_LEAST
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.quotas import HOLD_SECONDS
from test_pipeline import (
    Harness,
    advertise,
    fetch_req,
    fetch_resp,
    frames_of,
    produce_req,
    produce_resp,
    req_cids,
)

from kafka.protocol.consumer import FetchRequest

pytestmark = pytest.mark.unit


def another(h, short_way=True):
    """A second connection of the same proxy: its filters and quota buckets are h's."""
    h2 = Harness(table=h.conn.table, short_way=short_way)
    h2.manager = h.manager
    h2.conn.quota_manager = h.manager
    return h2


def session_fetch_req(cid, session_id, epoch, version=11, client_id="app-1"):
    F = FetchRequest
    part = F.FetchTopic.FetchPartition(partition=0, fetch_offset=5, partition_max_bytes=1 << 20)
    req = F[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20,
                     isolation_level=0, session_id=session_id, session_epoch=epoch,
                     topics=[F.FetchTopic(topic="t", topic_id=uuid.UUID(int=3), partitions=[part])],
                     forgotten_topics_data=[], rack_id="")
    req.with_header(correlation_id=cid, client_id=client_id)
    return req.encode(header=True, framed=True)


def max_bytes_of(frame, version=11):
    return FetchRequest.decode(frame[4:], version=version, header=True).max_bytes


@pytest.mark.parametrize("short_way", [True, False])
def test_a_produce_on_a_new_connection_waits_for_the_debt_another_left(short_way):
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}}, short_way=short_way)
    h.client(produce_req(1, nbytes=3000))  # 1 s of burst, 2 s of debt
    assert req_cids(h.take_broker()) == [1]
    h.at(0.1)
    h2 = another(h, short_way)
    h2.at(0.1)
    h2.client(produce_req(7) + produce_req(8))
    assert h2.take_broker() == b""  # held: the bucket is in debt
    until = h2.client_paused_until
    assert until is not None and 1.9 < until < 2.2
    h2.at(until)
    # the debt is paid: the first goes on and is counted; the next waits for
    # the debt that one left, or goes on within what the bucket holds
    assert req_cids(h2.take_broker())[:1] == [7]
    h2.broker(produce_resp(7))
    assert h2.closed is None and h.closed is None


@pytest.mark.parametrize("short_way", [True, False])
def test_a_fetch_on_a_new_connection_waits_for_the_debt_of_a_response_on_another(short_way):
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}}, short_way=short_way)
    resp = fetch_resp(1, records=b"r" * 300)  # 760 bytes: within the burst
    for cid in (1, 2):  # the second takes more than the bucket holds: in debt
        h.client(fetch_req(cid))
        while cid not in req_cids(h.to_broker):
            h.at(h.client_paused_until)
        h.broker(fetch_resp(cid, records=b"r" * 300))
        assert len(frames_of(h.take_client())[-1]) == len(resp)
    owed = h.manager.buckets[(CONSUMER_BYTE_RATE, "", "app-1")].debt_seconds(h.now)
    assert owed > 0.3
    h.run(h.conn.client_eof())  # a client that reconnects to get past its throttle
    h2 = another(h, short_way)
    h2.at(h.now + 0.01)
    h2.client(fetch_req(3))
    assert h2.take_broker() == b""
    until = h2.client_paused_until
    assert until == pytest.approx(h.now + owed, abs=0.01)
    h2.at(until)
    # the debt is paid; it goes once the bucket holds enough for the least
    # grant (FETCH_GRANT_LEAST of the burst, twice over)
    until = h2.client_paused_until
    assert until == pytest.approx(h.now + owed + FETCH_GRANT_LEAST / FETCH_GRANT_FRACTION,
                                  abs=0.005)
    h2.at(until)
    [frame] = frames_of(h2.take_broker())
    assert max_bytes_of(frame) == pytest.approx(1000 * FETCH_GRANT_LEAST, abs=2)


@pytest.mark.parametrize("short_way", [True, False])
def test_a_response_larger_than_the_burst_is_paid_for_before_it_is_delivered(short_way):
    """A record batch larger than the bucket's burst (a broker sends one
    whole, KIP-74): the fetch is answered empty, as Kafka answers one over
    its quota; the bucket pays for it, holding the next fetches on any
    connection; fetched again, it goes out of what was paid."""
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}}, short_way=short_way)
    h.client(fetch_req(1))
    big = fetch_resp(1, records=b"r" * 2500)  # 5160 bytes: five times the burst
    h.broker(big)
    [frame] = frames_of(h.take_client())
    empty = FetchResponse.decode(frame[4:], version=11, header=True)
    assert empty.header.correlation_id == 1 and empty.responses == [] and empty.error_code == 0
    owed = len(big) / 1000.0 - 1.0  # taken from a full bucket of 1 s
    assert empty.throttle_time_ms == min(int(owed * 1000 + 0.5), 10000)
    h.run(h.conn.client_eof())
    h2 = another(h, short_way)
    h2.at(0.01)
    h2.client(fetch_req(2))
    t = 0.01
    while 2 not in req_cids(h2.to_broker):
        assert h2.take_client() == b""
        t = h2.client_paused_until
        h2.at(t)
    assert t >= owed
    again = fetch_resp(2, records=b"r" * 2500)
    h2.broker(again)
    assert len(h2.take_client()) == len(again)  # out of what was paid
    bucket = h.manager.buckets[(CONSUMER_BYTE_RATE, "", "app-1")]
    assert bucket.credit == 0 and bucket.total == len(again)


def test_reconnecting_after_each_fetch_gains_nothing():
    """One fetch per connection, then a new connection: over 30 s what the
    clients get stays within the quota (plus the burst, and the one response
    that may overshoot), where the throttle of one connection held nothing."""
    quota = 10000.0
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: quota}})
    h.run(h.conn.client_eof())
    got = 0
    t = 0.0
    cid = 0
    conns = 0
    while t < 30.0:
        conn = another(h)
        conns += 1
        conn.at(t)
        cid += 1
        conn.client(fetch_req(cid))
        if conn.take_broker():
            conn.broker(fetch_resp(cid, records=b"r" * 4000))
            got += len(conn.take_client())
        else:
            # held: it gives up and connects again at once, or waits its turn
            conn.at(min(conn.client_paused_until or t, t + 0.05))
            if conn.take_broker():
                conn.broker(fetch_resp(cid, records=b"r" * 4000))
                got += len(conn.take_client())
        conn.run(conn.conn.client_eof())
        t += 0.05
    assert conns > 500
    assert got <= quota * 30 + quota + 5000, got / (quota * 30)
    assert got >= quota * 30 * 0.8  # still served


def test_a_sessionless_fetch_held_as_long_as_a_client_waits_is_answered_empty_and_throttled():
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}})
    h.client(fetch_req(1))
    h.broker(fetch_resp(1, records=b"r" * 100000))  # 99 s of debt
    h.take_client()
    h2 = another(h)
    h2.at(0.5)
    h2.client(fetch_req(2, version=11))
    t = 0.5
    while not h2.to_client and t < 0.5 + HOLD_SECONDS + 1:
        assert h2.take_broker() == b""
        t = h2.client_paused_until
        h2.at(t)
    assert h2.take_broker() == b""  # the broker never saw it
    assert 0.5 + HOLD_SECONDS - 0.01 <= t <= 0.5 + HOLD_SECONDS + 0.01
    [frame] = frames_of(h2.take_client())
    resp = FetchResponse.decode(frame[4:], version=11, header=True)
    assert resp.header.correlation_id == 2
    assert resp.responses == [] and resp.error_code == 0 and resp.session_id == 0
    assert resp.throttle_time_ms == int(HOLD_SECONDS * 1000)
    assert h2.closed is None


def test_a_fetch_in_a_session_held_as_long_as_a_client_waits_goes_on_asking_for_one_byte():
    # an answer of the proxy's own would leave the broker's session epoch
    # behind the client's (KIP-227)
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}})
    h.client(fetch_req(1))
    h.broker(fetch_resp(1, records=b"r" * 100000))
    h2 = another(h)
    h2.client(session_fetch_req(2, session_id=77, epoch=4))
    assert h2.take_broker() == b""
    h2.at(HOLD_SECONDS)
    [frame] = frames_of(h2.take_broker())
    assert max_bytes_of(frame) == 1 and frame[8:12] == struct.pack(">i", 2)
    assert h2.take_client() == b""  # the broker answers it


@pytest.mark.parametrize("version", [3, 8, 9, 13])
def test_a_produce_held_as_long_as_a_client_waits_is_answered_request_timed_out(version):
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=100000, version=version))  # 99 s of debt
    h.take_broker()
    h2 = another(h)
    h2.client(produce_req(2, nbytes=5000, version=version))
    h2.at(5.0)
    assert h2.take_broker() == b"" and h2.take_client() == b""
    h2.at(HOLD_SECONDS)
    assert h2.take_broker() == b""  # not written
    [frame] = frames_of(h2.take_client())
    resp = ProduceResponse.decode(frame[4:], version=version, header=True)
    assert resp.header.correlation_id == 2
    [topic] = resp.responses
    if version >= 13:
        assert topic.topic_id == uuid.UUID(int=7)
    else:
        assert topic.name == "orders"
    [partition] = topic.partition_responses
    assert partition.index == 0 and partition.error_code == 7  # REQUEST_TIMED_OUT
    assert resp.throttle_time_ms == int(HOLD_SECONDS * 1000)
    # the client, muted for that long, is read again afterwards and its
    # retry waits for the debt in turn
    assert h2.client_paused_until >= HOLD_SECONDS + 1
    assert h2.closed is None


def test_an_acks_0_produce_is_held_for_the_debt_however_long():
    # no client waits for an answer to it: it goes when the debt is paid
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=31000))  # 30 s of debt
    h.take_broker()
    h2 = another(h)
    h2.client(produce_req(2, nbytes=50, acks=0))
    t = 0.0
    while t < 29.5:
        assert h2.take_broker() == b"" and h2.take_client() == b""
        t = h2.client_paused_until
        h2.at(t)
    assert req_cids(h2.take_broker()) == [2]


def test_a_read_of_two_clients_forwards_the_one_whose_bucket_owes_nothing():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0},
                 "clients/app-2": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(produce_req(1, nbytes=5000, client_id="app-2"))  # app-2 owes 4 s
    h.take_broker()
    h2 = another(h)
    h2.client(produce_req(3, client_id="app-1") + produce_req(4, client_id="app-2"))
    assert req_cids(h2.take_broker()) == [3]
    until = h2.client_paused_until
    assert 3.5 < until < 4.5
    h2.at(until)
    assert req_cids(h2.take_broker()) == [4]


def test_a_request_quota_in_debt_holds_every_api_on_every_connection():
    h = Harness({"clients/app-1": {REQUEST_RATE: 2.0}})
    for cid in range(1, 5):  # 2 of burst, then 2 in debt
        h.client(produce_req(cid))
    h2 = another(h)
    h2.client(produce_req(9))
    assert h2.take_broker() == b""
    assert h2.client_paused_until is not None and h2.client_paused_until > 0.2


def test_an_observe_only_bucket_holds_nothing():
    h = Harness({"clients/app-1": {PRODUCER_BYTE_RATE: 1000.0, "observe_only": True}})
    h.client(produce_req(1, nbytes=30000))
    h2 = another(h)
    h2.client(produce_req(2))
    assert req_cids(h2.take_broker()) == [2]


# a Fetch asks only for what its bucket may take (issue 43, item 2) ------------

@pytest.mark.parametrize("version", [0, 1, 2])
def test_an_old_fetch_has_each_partitions_max_capped_to_what_its_bucket_holds(version):
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}})
    h.client(fetch_req(1, version=version))  # 1 MiB per partition
    [frame] = frames_of(h.take_broker())
    req = FetchRequest.decode(frame[4:], version=version, header=True)
    [topic] = req.topics
    # half a full bucket (FETCH_GRANT_FRACTION)
    assert [p.partition_max_bytes for p in topic.partitions] == [1000 * FETCH_GRANT_FRACTION]


def test_a_fetch_asks_for_what_is_left_in_its_bucket():
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 10000.0}})
    h.client(fetch_req(1))
    assert max_bytes_of(h.take_broker()) == 10000 * FETCH_GRANT_FRACTION
    resp = fetch_resp(1, records=b"r" * 3000)
    h.broker(resp)
    h.take_client()
    # what it asked for is given back, what came is taken
    h.client(fetch_req(2))
    second = (10000 - len(resp)) * FETCH_GRANT_FRACTION
    assert max_bytes_of(h.take_broker()) == int(second)
    # while that one is in flight, the next asks for part of what is left
    h.at(0.1)  # 1000 more
    h.client(fetch_req(3))
    assert max_bytes_of(h.take_broker()) == pytest.approx(
        (10000 - len(resp) - int(second) + 1000) * FETCH_GRANT_FRACTION, abs=1)
    h.client(fetch_req(4, max_bytes=100))  # under its grant: as it is
    assert max_bytes_of(h.take_broker()) == 100


def test_capping_an_old_fetch_refuses_a_truncated_frame():
    from kthrottle.codecs.errors import ProtocolError
    from kthrottle.codecs.request import capped_fetch_partitions
    frame = fetch_req(1, version=2)
    assert capped_fetch_partitions(frame, 1 << 30) is None
    with pytest.raises(ProtocolError):
        capped_fetch_partitions(frame[:-6], 10)


# ShareFetch (KIP-932) asks only for what its bucket may take too -------------

def share_fetch_req(cid, max_bytes=0x7FFFFFFF, client_id="app-1", group="g1", member="m" * 22):
    """ShareFetch v1 (ShareFetchRequest.json): header v2, then GroupId,
    MemberId, ShareSessionEpoch, MaxWaitMs, MinBytes, MaxBytes, MaxRecords,
    BatchSize, one topic of one partition, no forgotten topics."""
    def cstr(s):
        b = s.encode()
        return bytes([len(b) + 1]) + b
    head = struct.pack(">hhih", 78, 1, cid, len(client_id)) + client_id.encode() + b"\x00"
    body = (cstr(group) + cstr(member) + struct.pack(">iiiiii", 0, 500, 1, max_bytes, 500, 500)
            + b"\x02" + uuid.UUID(int=3).bytes + b"\x02" + struct.pack(">i", 0) + b"\x01\x00"
            + b"\x00" + b"\x01" + b"\x00")
    payload = head + body
    return struct.pack(">i", len(payload)) + payload


def share_max_bytes(frame):
    pos = 4 + 8 + 2 + struct.unpack_from(">h", frame, 12)[0] + 1
    for _ in range(2):
        pos += frame[pos]  # compact strings of one-byte lengths: length + 1, then the text
    return struct.unpack_from(">i", frame, pos + 12)[0]


def test_a_share_fetch_asks_for_its_grant_and_waits_for_its_buckets_debt():
    h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 1000.0}})
    h.client(share_fetch_req(1))
    [frame] = frames_of(h.take_broker())
    assert share_max_bytes(frame) == 1000 * FETCH_GRANT_FRACTION
    assert len(frame) == len(share_fetch_req(1))
    # its response counts on the fetch quota; one larger than the burst is
    # not answered empty (its records are acquired for the member) but left
    # to be paid for by the next requests
    resp = _share_resp(1)
    assert len(resp) > 100000  # far larger than the burst: minutes of debt
    h.broker(resp)
    # (held for its throttle: clients do not back off on ShareFetch themselves)
    assert h.broker_paused_until is not None
    h.at(h.broker_paused_until)
    assert len(h.take_client()) == len(resp)
    bucket = h.manager.buckets[(CONSUMER_BYTE_RATE, "", "app-1")]
    assert bucket.total == len(resp) and bucket.debt_seconds(h.now) > 0
    h2 = another(h)
    h2.client(share_fetch_req(2))
    assert h2.take_broker() == b""  # held for the debt, on another connection
    h2.at(HOLD_SECONDS)
    # held as long as a client waits: it goes on asking for one byte
    [frame] = frames_of(h2.take_broker())
    assert share_max_bytes(frame) == 1


def _share_resp(cid):
    """A ShareFetch v1 response with records (kthrottle_testkit/frames.py)."""
    from kthrottle_testkit.frames import share_fetch

    payload = struct.pack(">i", cid) + b"\x00" + share_fetch(1, with_endpoints=False,
                                                            record_sizes=(20000,))
    return struct.pack(">i", len(payload)) + payload


@pytest.mark.parametrize("version", range(0, 19))
def test_the_empty_fetch_answer_decodes_at_every_version(version):
    from kthrottle.codecs.quota_answers import empty_fetch_response

    frame = empty_fetch_response(7, version, 1234)
    resp = FetchResponse.decode(frame[4:], version=version, header=True)
    assert resp.header.correlation_id == 7 and resp.responses == []
    assert version == 0 or resp.throttle_time_ms == 1234
    assert version < 7 or (resp.error_code == 0 and resp.session_id == 0)


def test_a_fetch_is_charged_alike_on_the_short_way_and_the_long_one():
    # QuotaAccounting says once what a Fetch counts (ClientQuotas.admit_fetch):
    # what it is charged, its cap, and when it waits for the least grant,
    # whichever way the pipeline takes it. 10 kB/s, a burst of 10 kB: a
    # grant is half what the bucket holds, and the least one 625 bytes.
    steps = [(0.0, 100, 3000),  # under its grant: the short way
             (0.1, 8000, 100),  # over it: capped, the long way
             (0.2, 300, 2500),  # under what is left
             (0.25, 300, 10),  # the bucket holds under 1250: it waits for the least grant
             (2.0, 200, 10)]

    def run(short_way):
        h = Harness({"clients/app-1": {CONSUMER_BYTE_RATE: 10000.0}}, short_way=short_way)
        seen = []
        for cid, (at, max_bytes, records) in enumerate(steps, 1):
            h.at(at)
            before = h.long_heads["request"]
            h.client(fetch_req(cid, max_bytes=max_bytes))
            sent = h.take_broker()
            quotas = h.conn.quotas_for("app-1")
            step = {"sent": req_cids(sent), "long": h.long_heads["request"] > before,
                    "asked": max_bytes_of(sent) if sent else None,
                    "held": round(quotas.fetch.tokens.held(h.now), 3)}
            if sent:
                h.broker(fetch_resp(cid, records=b"r" * records))
                h.take_client()
                step["after"] = round(quotas.fetch.tokens.held(h.now), 3)
            seen.append(step)
        return seen

    short, long_ = run(True), run(False)
    ways = [step.pop("long") for step in short]
    assert all(step.pop("long") for step in long_)
    assert short == long_
    assert ways[0] is False and ways[1] is True  # both ways were taken
    assert short[1]["asked"] < 8000  # capped to its grant
    assert short[3]["sent"] == [] and short[4]["sent"] == [4, 5]  # waited, then went
