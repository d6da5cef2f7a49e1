"""Property-based fuzzing of the codecs (kthrottle/codecs) with hypothesis.

Inputs: random bytes, and real frames built with kafka-python 3's schema
classes (requests and responses of Produce, Fetch, Metadata, FindCoordinator,
DescribeCluster, ApiVersions, SaslHandshake, SaslAuthenticate, every version
it knows, flexible or not) mutated: length and count fields overwritten with
extreme values, bad varints and compact lengths spliced in, bytes flipped,
inserted, deleted, frames truncated, the size prefix kept or recomputed,
frames read as the wrong API or version, and cut into chunks at random points.

Properties:

1. only ``ProtocolError`` escapes an entry point, besides what its docstring
   says it raises (``HeadTooShort`` from a RequestHead, ValueError for a chunk
   fed past a frame's end or from ``advertise``);
2. nothing an attacker's count or length says is allocated or looped over
   beyond the bytes that carry it: huge counts in small frames run under a
   bound on executed lines and on the tracemalloc peak, both proportional to
   the input;
3. a frame read whole and read in chunks gives the same answer (the fast
   paths agree with the streaming walkers), and the answers are consistent
   (a rewrite keeps the length it must keep, offsets lie inside the frame).

Runs: by default the "ci" profile registered in tests/conftest.py: a fixed
number of examples per test, derandomized (the same examples every run), no
example database, no deadline. A long randomized run sets the environment
variable ``KTHROTTLE_FUZZ_EXAMPLES`` to the examples wanted per test:

    KTHROTTLE_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/test_fuzz_codecs.py tests/test_fuzz_pipeline.py

A failure prints the example and a ``@reproduce_failure`` blob.
"""
import functools
import os
import struct
import sys
import tracemalloc
import uuid
import warnings

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kthrottle.codecs import ProtocolError, apis, response_correlation_id, rewrite_response
from kthrottle.codecs import unsupported_api_versions_response
from kthrottle.codecs.frames import (
    DEFER,
    DROP,
    HEAD_SIZE,
    MIN_REQUEST_SIZE,
    MIN_RESPONSE_SIZE,
    PASS,
    WHOLE,
    FrameCutter,
    FrameReader,
    NeedHead,
    response_body_offset,
)
from kthrottle.codecs.produce import MAX_VERSION as PRODUCE_MAX_VERSION
from kthrottle.codecs.produce import ProducePartitions, produce_partitions
from kthrottle.codecs.request import (
    MAX_HEAD_SIZE,
    HeadTooShort,
    RequestHead,
    capped_fetch_head,
    request_header_flexible,
)
from kthrottle.codecs.rewrite import Node
from kthrottle.codecs.stream import stream_rewriter
from kthrottle.codecs.throttle import (
    clients_back_off_from,
    raise_throttle_time,
    throttle_time_at,
    throttle_time_offset,
    throttle_time_patch,
)
from kthrottle.codecs import wire
from kthrottle.codecs.versions import api_versions_answer, parse_api_versions
from kthrottle_testkit.frames import (
    api_versions,
    describe_cluster,
    fetch,
    fetch_many,
    filled_response,
    find_coordinator,
    metadata,
    produce,
    produce_many,
    with_top_level_tags,
    _fill,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import DescribeClusterRequest, DescribeClusterResponse
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.metadata import (
        ApiVersionsRequest,
        ApiVersionsResponse,
        FindCoordinatorRequest,
        FindCoordinatorResponse,
        MetadataRequest,
        MetadataResponse,
    )
    from kafka.protocol.producer import ProduceRequest, ProduceResponse
    from kafka.protocol.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )

pytestmark = pytest.mark.fuzz

INT32 = struct.Struct(">i")

# -- running modes --------------------------------------------------------------

# 0: the "ci" profile's fixed counts below; N: N examples per test, randomized.
LONG_EXAMPLES = int(os.environ.get("KTHROTTLE_FUZZ_EXAMPLES") or 0)


def examples(ci_count):
    """Settings of one test: ``ci_count`` examples in CI mode."""
    return settings(max_examples=LONG_EXAMPLES or ci_count)


# -- the corpus: real frames ----------------------------------------------------

SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36

REQUEST_CLASSES = {
    apis.PRODUCE: ProduceRequest, apis.FETCH: FetchRequest, apis.METADATA: MetadataRequest,
    apis.FIND_COORDINATOR: FindCoordinatorRequest, apis.API_VERSIONS: ApiVersionsRequest,
    apis.DESCRIBE_CLUSTER: DescribeClusterRequest, SASL_HANDSHAKE: SaslHandshakeRequest,
    SASL_AUTHENTICATE: SaslAuthenticateRequest,
}
RESPONSE_CLASSES = {
    apis.PRODUCE: ProduceResponse, apis.FETCH: FetchResponse, apis.METADATA: MetadataResponse,
    apis.FIND_COORDINATOR: FindCoordinatorResponse, apis.API_VERSIONS: ApiVersionsResponse,
    apis.DESCRIBE_CLUSTER: DescribeClusterResponse, SASL_HANDSHAKE: SaslHandshakeResponse,
    SASL_AUTHENTICATE: SaslAuthenticateResponse,
}


def filled_request(api_key, version, repeat=1, correlation_id=7, client_id="app-1", **values):
    """A framed request of ``api_key`` at ``version`` with every field set
    (kthrottle_testkit.frames._fill, as filled_response does for responses)."""
    cls = REQUEST_CLASSES[api_key]
    request = cls[version](**_fill(cls, version, values, repeat))
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def _produce_request(version, records, transactional_id, acks):
    R = ProduceRequest
    D = R.TopicProduceData
    P = D.PartitionProduceData
    topics = [D(name="orders", topic_id=uuid.UUID(int=7),
                partition_data=[P(index=i, records=r) for i, r in enumerate(records)]),
              D(name="zähler", topic_id=uuid.UUID(int=9), partition_data=[P(index=3, records=None)])]
    req = R[version](transactional_id=transactional_id, acks=acks, timeout_ms=30000,
                     topic_data=topics)
    req.with_header(correlation_id=11, client_id="app-1")
    return bytes(req.encode(header=True, framed=True))


def _frame(api_key, version, body, correlation_id=42):
    header = INT32.pack(correlation_id)
    if apis.response_header_is_flexible(api_key, version):
        header += b"\x00"
    payload = header + bytes(body)
    return INT32.pack(len(payload)) + payload


def _build_requests():
    out = []  # (api_key, version, frame)
    for api_key, cls in REQUEST_CLASSES.items():
        for version in range(cls.min_version, cls.max_version + 1):
            for repeat in (1, 2):
                out.append((api_key, version, filled_request(api_key, version, repeat)))
    for version in range(PRODUCE_MAX_VERSION + 1):
        # records with 1- and 2-byte lengths, empty, acks=0, a transactional id
        out.append((apis.PRODUCE, version,
                    _produce_request(version, [b"r" * 1500, b""], "tx-1", -1)))
        out.append((apis.PRODUCE, version, _produce_request(version, [b"x" * 3], None, 0)))
    return out


def _build_responses():
    out = []  # (api_key, version, frame)
    for api_key, cls in RESPONSE_CLASSES.items():
        for version in range(cls.min_version, cls.max_version + 1):
            for repeat in (1, 2):
                out.append((api_key, version, filled_response(cls, version, repeat=repeat)))
    # realistic three-broker answers (kthrottle_testkit/frames.py)
    for version in range(MetadataResponse.max_version + 1):
        out.append((apis.METADATA, version, _frame(apis.METADATA, version, metadata(version))))
    for version in range(FindCoordinatorResponse.max_version + 1):
        for error_code in (0, 15):
            out.append((apis.FIND_COORDINATOR, version, _frame(
                apis.FIND_COORDINATOR, version, find_coordinator(version, error_code=error_code))))
    for version in range(DescribeClusterResponse.max_version + 1):
        out.append((apis.DESCRIBE_CLUSTER, version,
                    _frame(apis.DESCRIBE_CLUSTER, version, describe_cluster(version))))
    for version in range(ApiVersionsResponse.max_version + 1):
        ranges = [(0, 0, 99), (1, 4, 99), (3, 0, 12), (18, 0, 4), (9999, 0, 1)]
        out.append((apis.API_VERSIONS, version,
                    _frame(apis.API_VERSIONS, version, api_versions(version, ranges))))
    for version in range(ProduceResponse.max_version + 1):
        out.append((apis.PRODUCE, version, _frame(apis.PRODUCE, version, produce(version))))
    for version in range(FetchResponse.max_version + 1):
        out.append((apis.FETCH, version, _frame(apis.FETCH, version, fetch(version, records=b"r" * 40))))
    for version in range(12, FetchResponse.max_version + 1):
        body = fetch_many(version)
        out.append((apis.FETCH, version, _frame(apis.FETCH, version, body)))
        if version >= 16:  # unknown top-level tags around NodeEndpoints (KIP-482)
            without = fetch_many(version, with_endpoints=False)
            out.append((apis.FETCH, version, _frame(apis.FETCH, version, with_top_level_tags(
                without, body, {5: b"\x01\x02", 90: b""}))))
    for version in range(10, ProduceResponse.max_version + 1):
        out.append((apis.PRODUCE, version, _frame(apis.PRODUCE, version, produce_many(version))))
    return out


REQUESTS = _build_requests()
RESPONSES = _build_responses()
PRODUCE_REQUESTS = [case for case in REQUESTS if case[0] == apis.PRODUCE]
FETCH_REQUESTS = [case for case in REQUESTS if case[0] == apis.FETCH]
# responses the address rewriting reads (gathered, or streamed: KIP-951)
REWRITTEN = [case for case in RESPONSES if apis.needs_rewrite(case[0], case[1])]
STREAMED = [case for case in RESPONSES
            if case[1] >= apis.NODE_ENDPOINTS_FROM.get(case[0], 1 << 20)]

# Responses of every API kafka-python knows, for throttle_time_ms (as
# tests/test_throttle_codec.py builds them), one version in three to keep the
# corpus small; the APIs above are in RESPONSES at every version.
ANY_RESPONSES = RESPONSES + [
    (api_key, version, filled_response(cls, version))
    for api_key, cls in apis.ALL_RESPONSES.items() if api_key not in RESPONSE_CLASSES
    for version in range(cls.min_version, cls.max_version + 1, 3)
]

# -- mutations --------------------------------------------------------------------

INT32_VALUES = [-2**31, -2, -1, 0, 1, 2, 0x7FFF, 0x8000, 0xFFFF, 2**24, 2**30, 2**31 - 1]
INT16_VALUES = [-2**15, -2, -1, 0, 1, 0x7FFF]
VARINTS = [
    b"\x00", b"\x01", b"\x02", b"\x7f", b"\x80\x01", b"\xff\x7f",
    b"\xff\xff\xff\xff\x0f",  # 2**32 - 1: a compact count or length of 2**32 - 2
    b"\xff\xff\xff\xff\x7f",  # the largest 5-byte varint
    b"\xff" * 5, b"\xff" * 6,  # longer than 5 bytes, or cut short
    b"\x80", b"\x80\x80\x80\x80\x00",  # cut short; over-long zero
]
HUGE = [2**31 - 1, 2**30, 0x7FFFFFF0]
HUGE_VARINTS = [b"\xff\xff\xff\xff\x0f", b"\xff\xff\xff\xff\x07", b"\x80\x80\x80\x80\x04",
                b"\xff\xff\xff\x7f"]

# where a mutation goes: from the start, or (negative) from the end, where
# the top-level tagged fields of a response are
_pos = st.one_of(st.integers(0, 64), st.integers(-256, -1), st.integers(-(1 << 12), 1 << 12))

mutation = st.one_of(
    st.tuples(st.just("int32"), _pos, st.sampled_from(INT32_VALUES)),
    st.tuples(st.just("int16"), _pos, st.sampled_from(INT16_VALUES)),
    st.tuples(st.just("varint"), _pos, st.sampled_from(VARINTS), st.integers(0, 2)),
    st.tuples(st.just("byte"), _pos, st.integers(0, 255)),
    st.tuples(st.just("flip"), _pos, st.integers(0, 7)),
    st.tuples(st.just("truncate"), _pos),
    st.tuples(st.just("delete"), _pos, st.integers(1, 16)),
    st.tuples(st.just("insert"), _pos, st.binary(min_size=1, max_size=8)),
)


def mutate(frame, mutations, reframe):
    """``frame`` with ``mutations`` applied in order; ``reframe``: the size
    prefix then says the new length (so the frame reads past the framing)."""
    buf = bytearray(frame)
    for m in mutations:
        kind, pos = m[0], m[1]
        pos = min(pos, len(buf)) if pos >= 0 else max(len(buf) + 1 + pos, 0)
        if kind == "int32":
            buf[pos : pos + 4] = INT32.pack(m[2])
        elif kind == "int16":
            buf[pos : pos + 2] = struct.pack(">h", m[2])
        elif kind == "varint":
            buf[pos : pos + m[3]] = m[2]
        elif kind == "byte" and pos < len(buf):
            buf[pos] = m[2]
        elif kind == "flip" and pos < len(buf):
            buf[pos] ^= 1 << m[2]
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "delete":
            del buf[pos : pos + m[2]]
        elif kind == "insert":
            buf[pos:pos] = m[2]
    if reframe and len(buf) >= 4:
        INT32.pack_into(buf, 0, len(buf) - 4)
    return bytes(buf)


@functools.lru_cache(maxsize=1024)
def count_positions(frame):
    """Offsets that may hold an array count or a length: small int32s (a few
    elements) and int16s (short strings), small bytes (compact counts and
    lengths, N+1)."""
    out = []
    for i in range(4, len(frame) - 1):
        if i + 4 <= len(frame) and 0 < INT32.unpack_from(frame, i)[0] <= 8:
            out.append(("int32", i))
        if 0 < struct.unpack_from(">h", frame, i)[0] <= 64:
            out.append(("int16", i))
        if 1 < frame[i] <= 65:
            out.append(("varint", i))
    return out


@st.composite
def mutated(draw, corpus, max_mutations=3):
    """(api_key, version, frame): a corpus frame, mutated (or not)."""
    api_key, version, frame = draw(st.sampled_from(corpus))
    muts = draw(st.lists(mutation, max_size=max_mutations))
    frame = mutate(frame, muts, reframe=draw(st.booleans()) or draw(st.booleans()))
    return api_key, version, frame


@st.composite
def with_huge_count(draw, corpus):
    """(api_key, version, frame): a corpus frame with a huge value where a
    count or length may be (property 2), the size prefix kept right."""
    api_key, version, frame = draw(st.sampled_from(corpus))
    buf = bytearray(frame)
    for _ in range(draw(st.integers(1, 2))):
        kind, pos = draw(st.sampled_from(count_positions(bytes(buf)) or [("int32", 4)]))
        if kind == "int32":
            buf[pos : pos + 4] = INT32.pack(draw(st.sampled_from(HUGE)))
        elif kind == "int16":
            buf[pos : pos + 2] = b"\x7f\xff"
        else:
            buf[pos : pos + 1] = draw(st.sampled_from(HUGE_VARINTS))
    INT32.pack_into(buf, 0, len(buf) - 4)
    return api_key, version, bytes(buf)


@st.composite
def split(draw, data, max_cuts=6):
    """``data`` cut into chunks at random points (bytes or memoryviews, as
    the framing hands them over)."""
    view = memoryview(data) if draw(st.booleans()) else data
    if len(data) <= 4096 and draw(st.integers(0, 3)) == 0:  # small steps: cuts everywhere
        step = draw(st.integers(1, 64))
        return [view[i : i + step] for i in range(0, len(data), step)]
    cuts = sorted(set(draw(st.lists(st.integers(0, max(len(data), 0)), max_size=max_cuts))))
    chunks, start = [], 0
    for cut in cuts + [len(data)]:
        if cut > start:
            chunks.append(view[start:cut])
            start = cut
    return chunks


def declared_length(frame):
    """The frame's length as its size prefix says (None without one)."""
    return INT32.unpack_from(frame, 0)[0] + 4 if len(frame) >= 4 else None


# a version drawn near the frame's own (a body read as the wrong version)
def near_version(version):
    return st.one_of(st.just(version), st.integers(max(version - 3, 0), version + 3))


any_api_key = st.one_of(st.sampled_from(sorted(apis.ALL_RESPONSES)), st.integers(-2, 1100),
                        st.integers(-2**15, 2**15 - 1))
any_version = st.one_of(st.integers(-1, 20), st.integers(-2**15, 2**15 - 1))


class AdvertiseError(ValueError):
    pass


def advertise(node_id):
    """As the proxy's (server.py): the port is a base plus the node id, and a
    node id that maps outside 1-65535 is a ValueError."""
    port = 30000 + node_id
    if not 0 < port < 65536:
        raise AdvertiseError("node id %d out of range" % node_id)
    return "proxy.example", port


# -- the entry points, with their contracts ---------------------------------------

def check_wire(buf, pos):
    """Every reader of wire.py at ``pos``: a value and a position inside the
    buffer, or ProtocolError."""
    n = len(buf)
    for read in (wire.read_int16, wire.read_int32, wire.read_uvarint,
                 lambda b, p: wire.read_array_length(b, p, True),
                 lambda b, p: wire.read_array_length(b, p, False),
                 lambda b, p: wire.read_string(b, p, True),
                 lambda b, p: wire.read_string(b, p, False)):
        try:
            _value, end = read(buf, pos)
        except ProtocolError:
            continue
        assert pos < end <= n
    for skip in (wire.skip_tagged_fields, wire.skip_compact_bytes,
                 lambda b, p: wire.skip_string(b, p, True),
                 lambda b, p: wire.skip_string(b, p, False)):
        try:
            end = skip(buf, pos)
        except ProtocolError:
            continue
        assert pos < end <= n


def read_request_head(frame, frame_len=None, max_bytes=1024):
    """The pipeline's use of RequestHead: the first min(frame size, HEAD_SIZE)
    bytes, grown while it asks for more (HeadTooShort) and the frame has
    them. Returns the head's fields, or the ProtocolError."""
    total = frame_len if frame_len is not None else declared_length(frame)
    if total is None or total < 4:
        return None
    head_len = min(total, HEAD_SIZE, len(frame))
    while True:
        try:
            head = RequestHead(frame[:head_len], total)
            fields = [head.api_key, head.api_version, head.correlation_id, head.client_id]
            head.fields_for_policy()
            if request_header_flexible(head.api_key, head.api_version) is not None:
                fields.append(head.body_offset)
            if head.api_key == apis.PRODUCE:
                fields.append(head.acks)
            elif head.api_key == apis.FETCH:
                fields += [head.replica_id, head.max_bytes_offset]
                patched = capped_fetch_head(head, max_bytes)
                assert patched is None or len(patched) == head_len
            return fields
        except HeadTooShort as exc:
            # never more than the frame holds, nor than a head may take
            assert head_len < exc.needed <= min(total, MAX_HEAD_SIZE)
            if exc.needed > len(frame):
                return None  # the frame's bytes ran out (truncated input)
            head_len = exc.needed
        except ProtocolError as exc:
            return exc


def read_partitions(chunks, version):
    """ProducePartitions fed ``chunks``: its partitions, the ProtocolError,
    or None when the frame is not complete."""
    reader = ProducePartitions(version)
    try:
        for chunk in chunks:
            reader.feed(chunk, [])
    except ProtocolError as exc:
        return exc
    return reader.partitions if reader.done else None


def within_frame(frame):
    """The bytes of ``frame`` up to the end its size prefix says, or None
    when the prefix says less than 4 bytes or more than there are (the
    stream readers are only ever fed one frame's bytes)."""
    total = declared_length(frame)
    if total is None or total < 4 or total > len(frame):
        return None
    return frame[:total]


def stream_through(api_key, version, chunks):
    """A StreamRewriter fed ``chunks``: (output, nodes) once done, the
    ProtocolError, or None when there is nothing to rewrite or the frame is
    not complete."""
    try:
        rewriter = stream_rewriter(api_key, version, advertise)
    except ProtocolError as exc:
        return exc
    if rewriter is None:
        return None
    out = []
    try:
        for chunk in chunks:
            rewriter.feed(chunk, out)
    except (ProtocolError, AdvertiseError) as exc:
        return exc
    if not rewriter.done:
        return None
    return b"".join(bytes(o) for o in out), rewriter.nodes


def exercise_response(frame, api_key, version, chunks=None):
    """Every codec that reads a response, as the proxy would call it on this
    frame; asserts the contracts and returns nothing."""
    try:
        response_correlation_id(frame)
    except ProtocolError:
        pass
    try:
        # the flexible header's tagged fields must lie inside the frame
        assert 8 < response_body_offset(frame, True) <= len(frame)
    except ProtocolError:
        pass
    # address rewriting, gathered
    try:
        new_frame, nodes = rewrite_response(frame, api_key, version, advertise)
    except (ProtocolError, AdvertiseError):
        pass
    else:
        assert all(isinstance(node, Node) and isinstance(node.host, str) for node in nodes)
        if new_frame is not None:
            assert declared_length(new_frame) == len(new_frame)
    # address rewriting, streamed: chunked as the whole
    one = within_frame(frame)
    if one is not None and apis.NODE_ENDPOINTS_FROM.get(api_key, 1 << 20) <= version:
        whole = stream_through(api_key, version, [one])
        if chunks is None:
            chunks = [one]
        in_chunks = stream_through(api_key, version, chunks)
        if isinstance(whole, tuple) or isinstance(in_chunks, tuple):
            assert whole == in_chunks
            out, nodes = whole
            assert len(out) == len(one)
        else:
            assert type(whole) is type(in_chunks)
    # throttle_time_ms
    try:
        at = throttle_time_at(frame, api_key, version)
    except ProtocolError:
        at = "error"
    else:
        assert at is None or 8 <= at <= len(frame) - 4
    try:
        patched = raise_throttle_time(frame, api_key, version, 2**40)
    except ProtocolError:
        assert at == "error"
    else:
        if patched is not None:
            assert len(patched) == len(frame)
            assert patched[:at] == frame[:at] and patched[at + 4:] == frame[at + 4:]
    total = declared_length(frame)
    for head_len in (HEAD_SIZE, 12, 64):
        head = frame[:head_len] if total is None else frame[:min(total, head_len)]
        try:
            offset = throttle_time_patch(head, api_key, version)
        except ProtocolError:
            continue
        if offset is not None:
            assert offset + 4 <= len(head)
            if at != "error":  # the same walk, cut short by the head or not
                assert offset == at


def exercise_request(frame, version, chunks=None):
    """Every codec that reads a request."""
    read_request_head(frame)
    if 0 <= version <= PRODUCE_MAX_VERSION:
        try:
            produce_partitions(frame, version)
        except ProtocolError:
            pass
        except ValueError:  # documented: the frame runs past its size prefix
            assert len(frame) > declared_length(frame) >= 4
        one = within_frame(frame)
        if one is not None:
            whole = read_partitions([one], version)
            walked = read_partitions(chunks or [one[:5], one[5:]], version)
            if isinstance(whole, list) or isinstance(walked, list):
                assert whole == walked
    else:
        try:
            ProducePartitions(version)
        except ProtocolError:
            pass
        else:
            raise AssertionError("ProducePartitions accepted version %d" % version)


# -- tests: primitive readers, framing ------------------------------------------------

@examples(300)
@given(st.binary(max_size=64), st.integers(0, 70))
def test_wire_readers_raise_only_protocol_error(buf, pos):
    check_wire(buf, pos)
    check_wire(memoryview(buf), pos)


@examples(200)
@given(mutated(REQUESTS + RESPONSES), st.data())
def test_wire_readers_on_real_frames(case, data):
    _key, _version, frame = case
    check_wire(frame, data.draw(st.integers(0, len(frame))))


@examples(300)
@given(st.one_of(st.binary(max_size=300), mutated(REQUESTS + RESPONSES).map(lambda c: c[2])),
       st.data())
def test_frame_reader_cuts_whole_frames_or_raises_protocol_error(stream, data):
    min_size = data.draw(st.sampled_from([0, MIN_RESPONSE_SIZE, MIN_REQUEST_SIZE]))
    max_size = data.draw(st.sampled_from([64, 1 << 20]))
    reader = FrameReader(max_size, min_size)
    frames = []
    try:
        for chunk in data.draw(split(stream)):
            frames += [bytes(f) for f in reader.feed(chunk)]
        reader.eof()
        failed = False
    except ProtocolError:
        failed = True
    # the frames are the stream's, in order, each as long as its prefix says
    joined = b"".join(frames)
    assert stream.startswith(joined)
    assert all(declared_length(f) == len(f) for f in frames)
    expected = _reference_frames(stream, min_size, max_size)
    if expected is None:  # a bad size prefix, or a frame cut short
        assert failed
    else:
        assert not failed and frames == expected


def _reference_frames(stream, min_size, max_size):
    """The frames of ``stream``, or None where a FrameReader must fail."""
    out, pos = [], 0
    while pos < len(stream):
        if len(stream) - pos < 4:
            return None
        size = INT32.unpack_from(stream, pos)[0]
        if not min_size <= size <= max_size or pos + 4 + size > len(stream):
            return None
        out.append(stream[pos : pos + 4 + size])
        pos += 4 + size
    return out


class _Echo:
    """A stream (FrameCutter's stream mode) that forwards what it is fed."""

    def __init__(self):
        self.fed = 0

    def feed(self, chunk, out):
        self.fed += len(chunk)
        out.append(chunk)


# frames longer than a head (HEAD_SIZE), which stream on in pieces
big_frame = st.binary(min_size=HEAD_SIZE - 16, max_size=3 * HEAD_SIZE).map(
    lambda body: INT32.pack(len(body)) + body)


@examples(400)
@given(st.lists(st.one_of(mutated(REQUESTS + RESPONSES).map(lambda c: c[2]), big_frame,
                          st.binary(max_size=12)), max_size=5),
       st.lists(st.sampled_from(["pass", "whole", "drop", "patch", "stream", "patch-stream",
                                 "need", "defer", "stop"]), min_size=1, max_size=8),
       st.data())
def test_frame_cutter_forwards_every_byte_it_should_under_any_chunking(parts, modes, data):
    """Whatever on_head answers, and wherever the chunks are cut, what comes
    out is the stream without the dropped frames (a patched head here equals
    the original), and a bad size prefix is the one error."""
    stream = b"".join(parts)
    frames = _reference_frames_prefix(stream, MIN_RESPONSE_SIZE, 1 << 16)
    state = {"frame": 0, "deferred": set()}
    dropped = set()

    def on_head(head, total):
        i = state["frame"]
        start, frame = frames[i]
        assert total == declared_length(frame) and bytes(head) == frame[: len(head)]
        mode = modes[i % len(modes)]
        if mode == "need" and len(head) < total:
            return NeedHead(min(total, len(head) + 1 + i * 37 % 700))
        if mode == "defer" and i not in state["deferred"]:
            state["deferred"].add(i)
            return DEFER
        state["frame"] += 1
        if mode == "stop":
            cutter.stop_after_frame = True
        if mode == "whole":
            return WHOLE
        if mode == "drop":
            dropped.add(i)
            return DROP
        if mode == "patch":
            return bytes(head)
        if mode == "stream":
            return _Echo()
        if mode == "patch-stream":
            return bytes(head), _Echo()
        return PASS

    cutter = FrameCutter(on_head, lambda frame: frame, 1 << 16, MIN_RESPONSE_SIZE)
    out = []
    queue = list(data.draw(split(stream)))
    failed = False
    try:
        while queue:
            chunk = queue.pop(0)
            cutter.feed(chunk, out)
            if cutter.rest is not None:  # DEFER, stop_after_frame: fed again later
                queue.insert(0, cutter.rest)
                cutter.rest = None
    except ProtocolError:
        failed = True
    sent = b"".join(bytes(o) for o in out)
    expected = b"".join(frame for i, (start, frame) in enumerate(frames) if i not in dropped)
    bad_prefix = frames and frames[-1][0] < 0
    if bad_prefix:
        assert failed
    else:
        assert not failed
        # the last frame may be incomplete: a WHOLE one is then not sent yet
        assert expected.startswith(sent)
        complete = [f for i, (s, f) in enumerate(frames) if i not in dropped and s >= 0
                    and len(f) == declared_length(f)]
        assert sent.startswith(b"".join(complete))


def _reference_frames_prefix(stream, min_size, max_size):
    """[(start, frame)] of ``stream`` (the last one may be incomplete); a
    frame whose size prefix must be refused ends the list as (-1, b"")."""
    out, pos = [], 0
    while len(stream) - pos >= 4:
        size = INT32.unpack_from(stream, pos)[0]
        if not min_size <= size <= max_size:
            out.append((-1, b""))
            return out
        out.append((pos, stream[pos : pos + 4 + size]))
        pos += 4 + size
    return out


# -- tests: requests --------------------------------------------------------------------

@examples(500)
@given(mutated(REQUESTS), st.one_of(st.none(), st.integers(0, 1 << 16)),
       st.integers(0, 2**31 - 1))
def test_request_head_raises_only_protocol_error_or_asks_for_more(case, frame_len, max_bytes):
    _api_key, _version, frame = case
    read_request_head(frame, frame_len, max_bytes)


@examples(300)
@given(st.binary(min_size=4, max_size=80), any_api_key, any_version)
def test_request_head_of_random_bytes(body, api_key, version):
    """Random bytes after a valid size prefix and a chosen api key and version."""
    frame = INT32.pack(len(body) + 4) + struct.pack(">hh", api_key, version) + body
    read_request_head(frame)
    assert request_header_flexible(api_key, version) in (True, False, None)


@examples(500)
@given(mutated(PRODUCE_REQUESTS, max_mutations=2), st.data())
def test_produce_partitions_read_whole_and_in_chunks_agree(case, data):
    _api_key, version, frame = case
    version = data.draw(near_version(version))
    one = within_frame(frame)
    chunks = data.draw(split(one)) if one is not None else None
    exercise_request(frame, version, chunks)


@examples(200)
@given(st.binary(max_size=200), st.integers(-3, PRODUCE_MAX_VERSION + 3), st.data())
def test_produce_partitions_of_random_bytes(body, version, data):
    frame = INT32.pack(len(body)) + body
    exercise_request(frame, version, data.draw(split(frame)))


# -- tests: responses -------------------------------------------------------------------

@examples(500)
@given(mutated(REWRITTEN), st.data())
def test_address_rewrites_whole_and_streamed(case, data):
    api_key, version, frame = case
    version = data.draw(near_version(version))
    one = within_frame(frame)
    exercise_response(frame, api_key, version, data.draw(split(one)) if one else None)


@examples(400)
@given(mutated(STREAMED, max_mutations=2), st.data())
def test_stream_rewriter_whole_and_chunked_agree(case, data):
    """The KIP-951 tail walkers, with many cuts (inside varints, the tail)."""
    api_key, version, frame = case
    one = within_frame(frame)
    assume(one is not None)
    exercise_response(frame, api_key, version, data.draw(split(one, max_cuts=20)))


@examples(500)
@given(mutated(ANY_RESPONSES), st.data())
def test_throttle_time_of_any_response(case, data):
    api_key, version, frame = case
    exercise_response(frame, api_key, data.draw(near_version(version)))


@examples(400)
@given(st.binary(max_size=300), any_api_key, any_version, st.booleans())
def test_every_response_codec_on_random_bytes(body, api_key, version, reframe):
    frame = (INT32.pack(len(body)) + body) if reframe else body
    exercise_response(frame, api_key, version)
    assert apis.response_header_flexible(api_key, version) in (True, False, None)
    assert apis.is_flexible(api_key, version) in (True, False)
    apis.needs_rewrite(api_key, version)
    throttle_time_offset(api_key, version)
    clients_back_off_from(api_key)


@examples(50)
@given(st.integers(-2**31, 2**31 - 1))
def test_the_unsupported_version_answer_is_a_frame(correlation_id):
    frame = unsupported_api_versions_response(correlation_id)
    assert declared_length(frame) == len(frame)
    assert response_correlation_id(frame) == correlation_id


API_VERSIONS_RESPONSES = [case for case in RESPONSES if case[0] == apis.API_VERSIONS]


@examples(300)
@given(st.one_of(mutated(API_VERSIONS_RESPONSES), with_huge_count(API_VERSIONS_RESPONSES)),
       st.data())
def test_api_versions_the_proxy_reads_and_answers_itself(case, data):
    """codecs/versions.py: a broker's ApiVersions answer is ranges or a
    ProtocolError; the proxy's own answer from them is a frame of the
    version asked for (or None when it cannot encode that version)."""
    _key, version, frame = case
    try:
        ranges = parse_api_versions(frame, version)
    except ProtocolError:
        ranges = data.draw(st.lists(st.tuples(*[st.integers(-2**15, 2**15 - 1)] * 3),
                                    max_size=8))
    else:
        assert all(len(r) == 3 for r in ranges)
    asked = data.draw(st.one_of(st.just(version), st.integers(-2, 10)))
    correlation_id = data.draw(st.integers(-2**31, 2**31 - 1))
    answer = api_versions_answer(correlation_id, asked, ranges)
    if answer is None:
        assert not 0 <= asked <= ApiVersionsResponse.max_version
    else:
        assert declared_length(answer) == len(answer)
        assert response_correlation_id(answer) == correlation_id
        decoded = ApiVersionsResponse[asked].decode(answer[8:])
        assert all(high <= apis.MAX_DECODABLE_VERSION.get(key, high)
                   for key, _low, high in decoded.api_keys)


@examples(100)
@given(with_huge_count(API_VERSIONS_RESPONSES))
def test_a_huge_count_in_an_api_versions_answer_costs_what_the_frame_carries(case):
    _key, version, frame = case

    def run():
        try:
            parse_api_versions(frame, version)
        except ProtocolError:
            pass

    run_bounded(run, len(frame), traced_dir=os.path.dirname(os.path.dirname(wire.__file__)))


# -- what the fuzzing found in the codecs (fixed), pinned ---------------------------------

def test_found_a_response_too_short_for_a_correlation_id_is_a_protocol_error():
    for frame in (b"", b"\x00\x00\x00\x01\x00"):
        try:
            response_correlation_id(frame)
        except ProtocolError:
            continue
        raise AssertionError("no ProtocolError for %r" % frame)


def test_found_a_null_broker_host_is_a_protocol_error_not_a_node():
    # FindCoordinator v1: throttle_time_ms, error_code 0, error_message null,
    # node_id 2, host null (int16 -1), port 9093
    frame = _frame(apis.FIND_COORDINATOR, 1, b"\x00\x00\x00\x00\x00\x00\xff\xff"
                   + b"\x00\x00\x00\x02\xff\xff\x00\x00\x23\x85")
    try:
        rewrite_response(frame, apis.FIND_COORDINATOR, 1, advertise)
    except ProtocolError as exc:
        assert "null host" in str(exc)
    else:
        raise AssertionError("a null host was taken for a broker address")


def test_found_a_null_api_keys_array_is_a_protocol_error():
    # ApiVersions v0: error_code 0, api_keys null (-1)
    frame = _frame(apis.API_VERSIONS, 0, b"\x00\x00\xff\xff\xff\xff")
    try:
        parse_api_versions(frame, 0)
    except ProtocolError as exc:
        assert "null api_keys" in str(exc)
    else:
        raise AssertionError("a null api_keys array was read as ranges")


# -- property 2: huge counts cost what the frame carries, not what they say ------------

# A run may execute this many traced lines per input byte, plus a constant:
# the walks take a few dozen lines per byte at most, a loop over a count of
# 2**31 would take billions.
LINES_PER_BYTE = 200
LINES_BASE = 20_000
# And allocate at most this (tracemalloc peak) per input byte, plus a constant:
# a few copies of the frame (a rewrite splices one) and the readers' lists.
BYTES_PER_BYTE = 64
BYTES_BASE = 256 * 1024

_CODECS_DIR = os.path.dirname(wire.__file__)


class _OverBudget(BaseException):
    """Raised into the code under test (a BaseException: no except clause of
    the codecs catches it)."""


def run_bounded(fn, size, traced_dir=_CODECS_DIR):
    """Run ``fn()``: fail if it executes more lines of the code under
    ``traced_dir`` than LINES_PER_BYTE * size + LINES_BASE, or its
    tracemalloc peak exceeds BYTES_PER_BYTE * size + BYTES_BASE."""
    limit = LINES_PER_BYTE * size + LINES_BASE
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > limit:
                raise _OverBudget
        return local

    def scope(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(traced_dir) else None

    fn()  # once untraced: first-call caches (struct, uuid) are not the input's doing
    old = sys.gettrace()
    tracemalloc.start()
    sys.settrace(scope)
    try:
        fn()
    except _OverBudget:
        raise AssertionError("more than %d lines for %d bytes of input" % (limit, size)) from None
    finally:
        sys.settrace(old)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= BYTES_PER_BYTE * size + BYTES_BASE, (
        "tracemalloc peak of %d bytes for %d bytes of input" % (peak, size))


@examples(250)
@given(with_huge_count(RESPONSES), st.data())
def test_huge_counts_in_responses_cost_what_the_frame_carries(case, data):
    api_key, version, frame = case
    one = within_frame(frame)
    chunks = data.draw(split(one)) if one else None
    run_bounded(lambda: exercise_response(frame, api_key, version, chunks), len(frame))


@examples(250)
@given(with_huge_count(REQUESTS), st.data())
def test_huge_counts_in_requests_cost_what_the_frame_carries(case, data):
    api_key, version, frame = case
    one = within_frame(frame)
    chunks = data.draw(split(one)) if one else None
    if api_key != apis.PRODUCE:
        version = data.draw(st.integers(0, PRODUCE_MAX_VERSION))  # read as a Produce anyway

    def run():
        exercise_request(frame, version, chunks)
        FrameReader(1 << 20, MIN_REQUEST_SIZE).feed(frame)

    run_bounded(run, len(frame))


def test_the_bounds_catch_a_loop_over_a_count_and_an_allocation_by_a_count():
    """The harness itself: a loop over a count read from 4 bytes, and a
    buffer of that size, are both caught."""
    count = INT32.unpack_from(b"\x00\x10\x00\x00", 0)[0]

    def loop():
        for _ in range(count):
            pass

    for fn, what in ((loop, "lines"), (lambda: bytearray(count * 16), "peak")):
        try:
            run_bounded(fn, 4, traced_dir=os.path.dirname(__file__))
        except AssertionError as exc:
            assert what in str(exc)
        else:
            raise AssertionError("run_bounded missed " + what)


def _acks_outcome(read):
    try:
        return read()
    except HeadTooShort as exc:
        return ("HeadTooShort", exc.needed)
    except ProtocolError as exc:
        return ("ProtocolError",)


@examples(300)
@given(version=st.integers(0, PRODUCE_MAX_VERSION),
       client_id=st.one_of(st.none(), st.text(max_size=40)),
       transactional_id=st.one_of(st.none(), st.text(max_size=300)),
       acks=st.sampled_from([0, 1, -1, 2, -32768]),
       header_tags=st.booleans(), bad_utf8=st.booleans(), data=st.data())
def test_acks_read_straight_from_the_head_matches_the_general_walk(
        version, client_id, transactional_id, acks, header_tags, bad_utf8, data):
    """RequestHead.acks' short cut (_acks_in_head) gives what the general walk
    gives, or defers to it, for any Produce head cut at any length: the same
    value, the same HeadTooShort, the same ProtocolError."""
    req = ProduceRequest[version](transactional_id=transactional_id, acks=acks,
                                  timeout_ms=30000, topic_data=[])
    req.with_header(correlation_id=5, client_id=client_id)
    frame = bytearray(req.encode(header=True, framed=True))
    if bad_utf8 and client_id:
        frame[14] = 0xFF  # the client-id's first byte: never valid UTF-8
    if header_tags and request_header_flexible(apis.PRODUCE, version):
        # one header tagged field (tag 3, 2 bytes) after the client-id
        at = 14 + len((client_id or "").encode())
        assert frame[at] == 0
        frame[at:at + 1] = b"\x01\x03\x02ab"
        INT32.pack_into(frame, 0, len(frame) - 4)
    frame = bytes(frame)
    cut = data.draw(st.integers(12, len(frame)))
    fast = _acks_outcome(lambda: RequestHead(frame[:cut], len(frame)).acks)
    walked = _acks_outcome(lambda: RequestHead(frame[:cut], len(frame))._acks_walked())
    assert fast == walked
    if cut == len(frame) and not (bad_utf8 and client_id):
        assert fast == acks
