"""Codec tests: bytes in, bytes out, no sockets."""
import random

import pytest

from kthrottle.codecs.frames import DROP, HEAD_SIZE, MIN_REQUEST_SIZE, PASS, WHOLE, FrameCutter, NeedHead
from kthrottle.codecs import (
    FrameReader,
    HeadTooShort,
    Node,
    ProtocolError,
    RequestHead,
    rewrite_response,
    unsupported_api_versions_response,
)
from kthrottle.codecs.request import MAX_HEAD_SIZE, capped_fetch_head
from kthrottle.codecs import apis
from kthrottle.codecs._kafka import ApiVersionsResponse
from kthrottle_testkit.frames import (
    BROKERS,
    advertise,
    api_versions,
    describe_cluster,
    fetch,
    find_coordinator,
    frame_response,
    metadata,
    produce,
    produce_request,
    proxied,
)

pytestmark = pytest.mark.unit

ALL_NODES = [Node(n, h, p) for n, h, p, _ in BROKERS]

# (api key, version, builder(addresses) -> body, nodes the rewrite must report)
REWRITE_CASES = (
    [(apis.METADATA, v, lambda a, v=v: metadata(v, a), ALL_NODES) for v in range(14)]
    + [(apis.FIND_COORDINATOR, v, lambda a, v=v: find_coordinator(v, a), [ALL_NODES[1]]) for v in range(4)]
    + [(apis.FIND_COORDINATOR, v, lambda a, v=v: find_coordinator(v, a), ALL_NODES) for v in range(4, 7)]
    + [(apis.DESCRIBE_CLUSTER, v, lambda a, v=v: describe_cluster(v, a), ALL_NODES) for v in range(3)]
    + [(apis.PRODUCE, v, lambda a, v=v: produce(v, a), ALL_NODES) for v in range(10, 14)]
    + [(apis.FETCH, v, lambda a, v=v: fetch(v, a), ALL_NODES) for v in range(16, 19)]
)


def _case_id(case):
    return "%s-v%d" % (apis.DECODED_RESPONSES[case[0]].name, case[1])


@pytest.mark.parametrize("case", REWRITE_CASES, ids=_case_id)
def test_three_broker_response_is_rewritten_and_nothing_else_changes(case):
    api_key, version, build, expected_nodes = case
    original = frame_response(api_key, version, build(BROKERS))
    # What a broker would have sent had it advertised the proxy's addresses:
    # every other byte must be the same.
    expected = frame_response(api_key, version, build(proxied(BROKERS)))
    new, nodes = rewrite_response(memoryview(original), api_key, version, advertise)
    assert new is not None
    assert bytes(new) == expected
    assert nodes == expected_nodes


@pytest.mark.parametrize("version", range(9, 14))
def test_unknown_tagged_fields_survive_a_rewrite(version):
    # A newer broker may send tags this proxy's schemas do not know; they must
    # reach the client. Flexible Metadata ends with the top-level tag section.
    unknown = b"\x01\x07\x03\xab\xcd\xef"  # one tag: number 7, 3 bytes
    body = bytes(metadata(version))
    assert body[-1] == 0
    original = frame_response(apis.METADATA, version, body[:-1] + unknown)
    expected = frame_response(apis.METADATA, version, bytes(metadata(version, proxied(BROKERS)))[:-1] + unknown)
    new, _ = rewrite_response(original, apis.METADATA, version, advertise)
    assert new == expected


@pytest.mark.parametrize(
    "api_key,version,body",
    [(apis.PRODUCE, v, produce(v)) for v in range(0, 10)]
    + [(apis.PRODUCE, v, produce(v, with_endpoints=False)) for v in range(10, 14)]
    + [(apis.FETCH, v, fetch(v)) for v in range(0, 16)]
    + [(apis.FETCH, v, fetch(v, with_endpoints=False)) for v in range(16, 19)]
    + [(apis.FIND_COORDINATOR, v, find_coordinator(v, error_code=15)) for v in range(4)]
    + [(apis.API_VERSIONS, v, api_versions(v, [(0, 0, 9), (1, 0, 12), (3, 0, 12)])) for v in range(5)],
)
def test_frames_without_addresses_pass_through_untouched(api_key, version, body):
    frame = frame_response(api_key, version, body)
    new, nodes = rewrite_response(memoryview(frame), api_key, version, advertise)
    assert new is None and nodes == []


def test_coordinator_errors_are_left_alone_in_batched_find_coordinator():
    body = find_coordinator(4, error_code=15)
    frame = frame_response(apis.FIND_COORDINATOR, 4, body)
    new, nodes = rewrite_response(frame, apis.FIND_COORDINATOR, 4, advertise)
    assert nodes == ALL_NODES
    decoded = apis.FindCoordinatorResponse.decode(new[9:], version=4)
    ok = [(c.host, c.port) for c in decoded.coordinators if c.error_code == 0]
    assert ok == [advertise(n.node_id) for n in ALL_NODES]
    bad = [c for c in decoded.coordinators if c.error_code]
    assert [(c.node_id, c.host, c.port) for c in bad] == [(-1, "", -1)]


@pytest.mark.parametrize("version", range(5))
def test_api_versions_never_advertise_what_the_proxy_cannot_decode(version):
    broker = [(0, 0, 20), (1, 4, 30), (3, 0, 13), (10, 0, 9), (18, 0, 9), (19, 2, 7), (60, 0, 5)]
    clamped = [(0, 0, 13), (1, 4, 18), (3, 0, 13), (10, 0, 6), (18, 0, 4), (19, 2, 7), (60, 0, 2)]
    frame = frame_response(apis.API_VERSIONS, version, api_versions(version, broker))
    new, nodes = rewrite_response(frame, apis.API_VERSIONS, version, advertise)
    assert new == frame_response(apis.API_VERSIONS, version, api_versions(version, clamped))
    assert nodes == []


def test_unsupported_api_versions_answer_is_a_valid_v0_error():
    frame = unsupported_api_versions_response(77)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert int.from_bytes(frame[4:8], "big") == 77
    resp = ApiVersionsResponse.decode(frame[8:], version=0)
    assert resp.error_code == 35
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.api_keys] == [(18, 0, 4)]


def test_newer_version_than_the_schemas_know_is_refused():
    frame = frame_response(apis.METADATA, 13, metadata(13))
    with pytest.raises(ProtocolError, match="newer"):
        rewrite_response(frame, apis.METADATA, 14, advertise)


def _reframe(frame, cut):
    body = bytes(frame[4:cut])
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("case", REWRITE_CASES, ids=_case_id)
def test_truncated_responses_raise_protocol_error(case):
    api_key, version, build, _ = case
    frame = frame_response(api_key, version, build(BROKERS))
    walked_to_end = api_key in (apis.PRODUCE, apis.FETCH)
    raised = 0
    for cut in range(8, len(frame)):
        try:
            rewrite_response(_reframe(frame, cut), api_key, version, advertise)
        except ProtocolError:
            raised += 1
        else:
            # Only a cut past the last address may go unnoticed: those bytes are
            # forwarded as they came, not read.
            assert not walked_to_end, "cut at %d of %d not detected" % (cut, len(frame))
    assert raised >= 10


@pytest.mark.parametrize("case", REWRITE_CASES, ids=_case_id)
def test_garbage_raises_only_protocol_error(case):
    api_key, version, build, _ = case
    rng = random.Random(version * 1000 + api_key)
    original = bytearray(frame_response(api_key, version, build(BROKERS)))
    for _ in range(300):
        frame = bytearray(original)
        for _ in range(rng.randint(1, 6)):
            frame[rng.randrange(8, len(frame))] = rng.randrange(256)
        try:
            rewrite_response(bytes(frame), api_key, version, advertise)
        except ProtocolError:
            pass
    for size in (0, 1, 5, 64):
        junk = bytes(rng.randrange(256) for _ in range(size))
        try:
            rewrite_response(_reframe(b"\x00\x00\x00\x00\x00\x00\x00\x2a" + junk, 8 + size), api_key, version, advertise)
        except ProtocolError:
            pass


def test_absurd_broker_count_is_a_protocol_error():
    body = b"\x00\x00\x00\x00" + (10**9).to_bytes(4, "big") + b"\x00\x00\x00\x01"
    with pytest.raises(ProtocolError):
        rewrite_response(frame_response(apis.METADATA, 3, body), apis.METADATA, 3, advertise)


# -- framing ------------------------------------------------------------------


def _frames(n):
    return [frame_response(apis.FETCH, 4, fetch(4, records=bytes([i]) * (i * 37))) for i in range(n)]


def test_frame_reader_reassembles_any_chunking():
    frames = _frames(6)
    stream = b"".join(frames)
    rng = random.Random(5)
    for _ in range(50):
        reader = FrameReader()
        out = []
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 2, 3, 7, 64, 1000, 5000])
            out += [bytes(f) for f in reader.feed(stream[pos : pos + step])]
            pos += step
        reader.eof()
        assert out == frames


def test_frame_cutter_streams_passes_gathers_wholes_and_drops_under_any_chunking():
    # frames of many sizes around HEAD_SIZE; the mode depends on the frame
    sizes = [0, 1, HEAD_SIZE - 8, HEAD_SIZE - 7, HEAD_SIZE, 3 * HEAD_SIZE, 70000, 5, 200000]
    frames = []
    for i, n in enumerate(sizes * 2):
        payload = i.to_bytes(4, "big") + bytes([i % 251]) * n
        frames.append(len(payload).to_bytes(4, "big") + payload)
    modes = {i: (PASS, WHOLE, DROP)[i % 3] for i in range(len(frames))}
    expected = b"".join(b"<%d>" % i + f if modes[i] == WHOLE else f
                        for i, f in enumerate(frames) if modes[i] != DROP)
    stream = b"".join(frames)
    rng = random.Random(9)
    for trial in range(60):
        heads = []

        def on_head(head, total):
            head = bytes(head)
            assert len(head) == min(total, HEAD_SIZE)
            i = int.from_bytes(head[4:8], "big")
            heads.append((i, total))
            return modes[i]

        def on_whole(frame):
            frame = bytes(frame)
            return b"<%d>" % int.from_bytes(frame[4:8], "big") + frame

        cutter = FrameCutter(on_head, on_whole)
        out = []
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 3, 4, 5, 100, HEAD_SIZE, 4096, 65536, 300000])
            cutter.feed(stream[pos : pos + step], out)
            pos += step
        cutter.eof()
        assert cutter.buffered == 0 and cutter.at_boundary
        assert heads == [(i, len(f)) for i, f in enumerate(frames)]
        assert b"".join(bytes(o) for o in out) == expected


def test_frame_cutter_passes_without_holding_back_the_frame():
    big = (100000).to_bytes(4, "big") + b"\x00" * 100000
    cutter = FrameCutter(lambda head, total: PASS, None)
    out = cutter.feed(big[:50000], [])
    # the first half goes on before the frame is complete (cut-through)
    assert sum(len(o) for o in out) == 50000 and cutter.buffered == 0
    with pytest.raises(ProtocolError, match="middle of a frame"):
        cutter.eof()


def test_frame_reader_rejects_oversized_negative_and_short_frames():
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameReader(max_frame_size=1000).feed((1001).to_bytes(4, "big") + b"x" * 10)
    with pytest.raises(ProtocolError):
        FrameReader().feed(b"\xff\xff\xff\xfb")  # size -5
    with pytest.raises(ProtocolError, match="too small"):
        FrameReader(min_frame_size=MIN_REQUEST_SIZE).feed(b"\x00\x00\x00\x03abc")
    with pytest.raises(ProtocolError):
        FrameReader().feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # "GET " is 1.2 GB


def test_frame_reader_reports_a_frame_cut_short_by_eof():
    reader = FrameReader()
    frame = _frames(2)[1]
    assert reader.feed(frame[:-3]) == []
    with pytest.raises(ProtocolError, match="middle of a frame"):
        reader.eof()


@pytest.mark.parametrize("version", range(3, 14))
@pytest.mark.parametrize("acks", [0, 1, -1])
def test_produce_request_header_and_acks(version, acks):
    txn = "txn-1" if version % 2 else None
    frame = produce_request(version, acks, transactional_id=txn)
    head = RequestHead(frame[:HEAD_SIZE], len(frame))
    assert (head.api_key, head.api_version, head.correlation_id, head.client_id) == (
        apis.PRODUCE, version, 11, "app-1")
    assert head.acks == acks


def test_truncated_request_header_is_a_protocol_error():
    frame = produce_request(9, 1)
    with pytest.raises(ProtocolError):
        RequestHead(frame[:10], 10)
    with pytest.raises(ProtocolError):
        RequestHead(frame[:22], 22).acks


@pytest.mark.parametrize("version", [3, 9])
def test_a_head_too_short_for_its_fields_asks_for_exactly_what_it_needs(version):
    # a transactional.id longer than the head: the head must grow to reach
    # acks, and nothing past acks is asked for
    txn = "t" * 700
    frame = produce_request(version, 1, transactional_id=txn)
    head = RequestHead(frame[:HEAD_SIZE], len(frame))
    with pytest.raises(HeadTooShort) as err:
        head.acks
    needed = err.value.needed
    assert HEAD_SIZE < needed < len(frame)
    assert RequestHead(frame[:needed], len(frame)).acks == 1
    with pytest.raises(HeadTooShort):
        RequestHead(frame[: needed - 1], len(frame)).acks


def test_a_garbage_header_is_refused_without_gathering_the_frame():
    # client_id length 30000 in a 100 MiB frame whose bytes are garbage: the
    # head may grow to hold the client-id, never to the frame
    frame_len = 100 * 1024 * 1024
    head = frame_len.to_bytes(4, "big") + bytes([0, 0, 0, 9, 0, 0, 0, 1, 0x75, 0x30]) + b"\xff" * 498
    with pytest.raises(HeadTooShort) as err:
        RequestHead(head, frame_len + 4).client_id
    assert err.value.needed == 14 + 30000 <= MAX_HEAD_SIZE
    with pytest.raises(ProtocolError, match="not UTF-8"):
        RequestHead(head + b"\xff" * 30000, frame_len + 4).client_id
    # a client-id longer than the frame holds is refused at once
    short = (100).to_bytes(4, "big") + head[4:104]
    with pytest.raises(ProtocolError, match="truncated"):
        RequestHead(short, 104).client_id


def test_frame_cutter_grows_the_head_on_request_under_any_chunking():
    frames = [(n + 4).to_bytes(4, "big") + i.to_bytes(4, "big") + bytes([i]) * n
              for i, n in enumerate([10, 2000, 300000, 900, 600])]
    stream = b"".join(frames)
    rng = random.Random(5)
    for trial in range(30):
        heads = []

        def on_head(head, total):
            want = min(total, 1500)
            if len(head) < want:
                return NeedHead(want)
            heads.append(bytes(head))
            return PASS

        cutter = FrameCutter(on_head, None)
        out, pos = [], 0
        while pos < len(stream):
            step = rng.choice([1, 3, 100, HEAD_SIZE, 1000, 4096, 100000])
            cutter.feed(stream[pos : pos + step], out)
            pos += step
        assert b"".join(bytes(o) for o in out) == stream
        assert heads == [f[:1500] for f in frames]


class _Upper:
    """A stream that forwards every byte of its frame upper-cased."""

    def __init__(self):
        self.seen = 0

    def feed(self, chunk, out):
        self.seen += len(chunk)
        out.append(bytes(chunk).upper())


def test_frame_cutter_hands_a_streamed_frame_to_its_stream_chunk_by_chunk():
    frames = [(n + 4).to_bytes(4, "big") + b"abcd" + b"x" * n for n in (10, 3000, 200000, 5)]
    stream = b"".join(frames)
    rng = random.Random(9)
    for trial in range(20):
        streams = []

        def on_head(head, total):
            s = _Upper()
            streams.append(s)
            if len(streams) == 2:  # a patched head, then the stream
                return b"P" * len(head), s
            return s

        cutter = FrameCutter(on_head, None)
        out, pos = [], 0
        while pos < len(stream):
            step = rng.choice([1, 7, 600, 70000])
            cutter.feed(stream[pos : pos + step], out)
            pos += step
        got = b"".join(bytes(o) for o in out)
        second = b"P" * HEAD_SIZE + frames[1][HEAD_SIZE:].upper()
        assert got == frames[0].upper() + second + frames[2].upper() + frames[3].upper()
        assert [s.seen for s in streams] == [len(f) for f in frames]


def test_frame_cutter_forwards_a_patched_head_in_place_of_the_original():
    frames = [(n + 4).to_bytes(4, "big") + i.to_bytes(4, "big") + bytes([i]) * n
              for i, n in enumerate([10, 2000, 300000])]
    stream = b"".join(frames)

    def patch(head, total):
        return b"\xee" * len(head)

    for step in (1, 7, 600, 70000, len(stream)):
        cutter = FrameCutter(patch, None)
        out = []
        for pos in range(0, len(stream), step):
            cutter.feed(stream[pos : pos + step], out)
        got = b"".join(bytes(o) for o in out)
        expected = b"".join(b"\xee" * min(len(f), HEAD_SIZE) + f[HEAD_SIZE:] for f in frames)
        assert got == expected


@pytest.mark.parametrize("version", [3, 4, 11, 12, 13, 15, 17])
def test_fetch_max_bytes_offset_replica_id_and_the_cap_patch(version):
    import struct
    import uuid as uuidlib
    from kthrottle.codecs._kafka import FetchRequest as F

    part = F.FetchTopic.FetchPartition(partition=0, fetch_offset=5, partition_max_bytes=1 << 20)
    req = F[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=52428800,
                     isolation_level=0, session_id=0, session_epoch=-1,
                     topics=[F.FetchTopic(topic="t", topic_id=uuidlib.UUID(int=3), partitions=[part])],
                     forgotten_topics_data=[], rack_id="")
    req.with_header(correlation_id=1, client_id="consumer-1")
    frame = req.encode(header=True, framed=True)
    head = RequestHead(frame, len(frame))
    offset = head.max_bytes_offset
    assert struct.unpack_from(">i", frame, offset)[0] == 52428800
    assert head.replica_id == -1
    patched = capped_fetch_head(head, 4096)
    assert len(patched) == len(frame)
    assert F.decode(patched[4:], version=version, header=True).max_bytes == 4096
    assert capped_fetch_head(RequestHead(patched, len(patched)), 4096) is None
    if version < 15:  # a follower's fetch names its broker id
        follower = F[version](replica_id=3, max_wait_ms=500, min_bytes=1, max_bytes=1,
                              isolation_level=0, session_id=0, session_epoch=-1, topics=[],
                              forgotten_topics_data=[], rack_id="")
        follower.with_header(correlation_id=2, client_id="broker-3-fetcher")
        encoded = follower.encode(header=True, framed=True)
        assert RequestHead(encoded, len(encoded)).replica_id == 3


def test_frame_cutter_stops_after_the_frame_in_progress_and_hands_back_the_rest():
    # a throttled client: the request being read goes on whole, nothing after it
    frames = _frames(5)
    stream = b"".join(frames)
    rng = random.Random(3)
    for trial in range(40):
        stop_at = rng.randrange(len(frames))
        seen = []

        def on_head(head, total):
            seen.append(total)
            if len(seen) - 1 == stop_at:
                cutter.stop_after_frame = True
            return PASS

        cutter = FrameCutter(on_head, None)
        out, pos, rest = [], 0, None
        while pos < len(stream) and rest is None:
            step = rng.choice([1, 5, 100, HEAD_SIZE, 4096, 100000])
            cutter.feed(stream[pos : pos + step], out)
            pos += step
            if cutter.rest is not None:
                rest, cutter.rest = cutter.rest, None
            elif cutter.stop_after_frame and cutter.at_boundary:
                rest = b""  # the frame ended exactly where the bytes did
        forwarded = b"".join(bytes(o) for o in out)
        assert forwarded == b"".join(frames[: stop_at + 1])
        assert len(seen) == stop_at + 1
        # what was handed back and what had not been fed are the rest of the stream
        assert rest + stream[pos:] == b"".join(frames[stop_at + 1 :])


def test_the_proxys_own_metadata_request_asks_for_brokers_only_and_its_answer_parses():
    from kthrottle.codecs._kafka import MetadataRequest, MetadataResponse
    from kthrottle.codecs.versions import metadata_request, parse_metadata_brokers

    frame = metadata_request(42)
    request = MetadataRequest[1].decode(frame[4:], header=True)
    assert request.topics == []  # [] is no topic; null would be all of them
    R = MetadataResponse[1]
    body = R(brokers=[R.MetadataResponseBroker(node_id=7, host="kafka-7.internal", port=9092,
                                                rack=None)],
             controller_id=7, topics=[]).encode()
    answer = (len(body) + 4).to_bytes(4, "big") + (42).to_bytes(4, "big") + bytes(body)
    assert parse_metadata_brokers(answer) == [(7, "kafka-7.internal", 9092)]
    with pytest.raises(ProtocolError):
        parse_metadata_brokers(answer[:20])
