"""Cut-through rewrite of KIP-951 NodeEndpoints (kthrottle/codecs/stream.py):
frames built with kafka-python, fed in many chunkings, no sockets."""
import random
import warnings

import pytest

from kthrottle.codecs import Node, ProtocolError, apis, rewrite_response
from kthrottle.codecs.stream import _padding, stream_rewriter, untouched_check
from kthrottle_testkit.frames import (
    BROKERS,
    advertise,
    fetch,
    fetch_many,
    frame_response,
    produce,
    produce_many,
    proxied,
    with_partition_unknown_tag,
    with_top_level_tags,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.producer import ProduceResponse

pytestmark = pytest.mark.unit

ALL_NODES = [Node(n, h, p) for n, h, p, _ in BROKERS]
BROKER_HOSTS = [h.encode() for _, h, _, _ in BROKERS]
CLASSES = {apis.FETCH: FetchResponse, apis.PRODUCE: ProduceResponse}
FETCH_VERSIONS = range(16, apis.MAX_DECODABLE_VERSION[apis.FETCH] + 1)
PRODUCE_VERSIONS = range(10, apis.MAX_DECODABLE_VERSION[apis.PRODUCE] + 1)
# (api key, version, builder(addresses, with_endpoints) -> body)
CASES = ([(apis.FETCH, v, lambda a, e, v=v: fetch_many(v, a, e)) for v in FETCH_VERSIONS]
         + [(apis.PRODUCE, v, lambda a, e, v=v: produce_many(v, a, e)) for v in PRODUCE_VERSIONS])


def case_id(case):
    return "%s-v%d" % (CLASSES[case[0]].name, case[1])


def same_length(node_id):
    # as long as "kafka-N.internal.example": the rewrite is in place
    return "proxy-%d.equal-length.net" % node_id, 31000 + node_id


def longer(node_id):
    return "kthrottle-proxy-%d.a-much-longer-domain.example.org" % node_id, 32000 + node_id


def chunkings(frame, seed):
    """Ways a proxy may read a frame: whole, the cutter's 512-byte head then
    64 KiB reads, a size prefix split in two, random sizes (seeded); bytes or
    memoryview slices (as FrameCutter passes them)."""
    yield [frame]
    yield [frame[:512]] + [frame[p : p + 65536] for p in range(512, len(frame), 65536)]
    yield [frame[:2], frame[2:7]] + [frame[p : p + 4096] for p in range(7, len(frame), 4096)]
    rng = random.Random(seed)
    for trial in range(4):
        source = memoryview(frame) if trial % 2 else frame
        chunks, pos = [], 0
        while pos < len(frame):
            step = rng.choice([1, 2, 3, 5, 8, 13, 64, 511, 512, 4096, 65536])
            chunks.append(source[pos : pos + step])
            pos += step
        yield chunks


def stream(api_key, version, chunks, advertise_fn=advertise):
    rewriter = stream_rewriter(api_key, version, advertise_fn)
    out = []
    for chunk in chunks:
        assert not rewriter.done
        rewriter.feed(chunk, out)
    assert rewriter.done
    return b"".join(bytes(o) for o in out), rewriter.nodes, out


def decode(api_key, version, frame):
    return CLASSES[api_key].decode(frame, version=version, header=True, framed=True)


def check_no_broker_host(frame):
    for host in BROKER_HOSTS:
        assert host not in frame


# -- the common case: no NodeEndpoints ---------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("extra", [{}, {3: b"future", 200: b"x" * 300}], ids=["plain", "unknown-tags"])
def test_without_node_endpoints_the_frame_is_forwarded_as_slices_of_the_input(case, extra):
    api_key, version, build = case
    bare = build(BROKERS, False)
    body = with_top_level_tags(bare, None, extra) if extra else bare
    tail_len = len(body) - len(bare) + 1
    frame = frame_response(api_key, version, body)
    for chunks in chunkings(frame, seed=version):
        got, nodes, out = stream(api_key, version, chunks)
        assert got == frame and nodes == []
        # Every piece forwarded is a chunk or a view of one (no copy of the
        # records), but for the top-level tag section when it straddled reads.
        bases = {id(c.obj if isinstance(c, memoryview) else c) for c in chunks}
        copied = sum(len(piece) for piece in out
                     if not (isinstance(piece, memoryview) and id(piece.obj) in bases)
                     and not any(piece is c for c in chunks))
        assert copied <= tail_len


@pytest.mark.parametrize("version", FETCH_VERSIONS)
def test_one_byte_reads(version):
    frame = frame_response(apis.FETCH, version, fetch(version))
    got, nodes, _ = stream(apis.FETCH, version, [frame[p : p + 1] for p in range(len(frame))])
    assert len(got) == len(frame) and nodes == ALL_NODES
    assert decode(apis.FETCH, version, got) == decode(
        apis.FETCH, version, frame_response(apis.FETCH, version, fetch(version, proxied(BROKERS))))
    bare = frame_response(apis.FETCH, version, fetch(version, with_endpoints=False))
    got, nodes, _ = stream(apis.FETCH, version, [bare[p : p + 1] for p in range(len(bare))])
    assert got == bare and nodes == []


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("endpoints", [False, True])
def test_chunks_inside_records_pass_without_feed_and_change_nothing(case, endpoints):
    api_key, version, build = case
    frame = frame_response(api_key, version, build(BROKERS, endpoints))
    passed = 0
    for chunks in chunkings(frame, seed=version + 50):
        expected = stream(api_key, version, chunks)[:2]
        rewriter = stream_rewriter(api_key, version, advertise)
        out = []
        for i, chunk in enumerate(chunks):
            if i and rewriter.passes(len(chunk)):  # as the proxy's short way: no feed
                out.append(chunk)
                passed += 1
            else:
                rewriter.feed(chunk, out)
        assert rewriter.done
        assert (b"".join(bytes(o) for o in out), rewriter.nodes) == expected
    if api_key == apis.FETCH:  # its records are long enough for whole reads inside them
        assert passed


def test_a_chunk_that_ends_the_frame_never_passes_without_feed():
    frame = frame_response(apis.FETCH, 16, fetch_many(16, BROKERS, False))
    rewriter = stream_rewriter(apis.FETCH, 16, advertise)
    out = []
    rewriter.feed(frame[:600], out)
    assert not rewriter.passes(len(frame) - 600)  # its tail must be walked
    assert rewriter._pos == 600


# -- NodeEndpoints present ----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_shorter_proxy_host_is_padded_to_the_same_length(case):
    api_key, version, build = case
    body = with_top_level_tags(build(BROKERS, False), build(BROKERS, True), {5: b"keep me"})
    frame = frame_response(api_key, version, body)
    expected = decode(api_key, version, frame_response(api_key, version, with_top_level_tags(
        build(proxied(BROKERS), False), build(proxied(BROKERS), True), {5: b"keep me"})))
    tail_at = len(frame) - (len(body) - len(build(BROKERS, False)) + 1)
    for chunks in chunkings(frame, seed=version):
        got, nodes, _ = stream(api_key, version, chunks)
        assert len(got) == len(frame)
        assert got[:tail_at] == frame[:tail_at]  # records and all: untouched
        assert nodes == ALL_NODES
        check_no_broker_host(got)
        response = decode(api_key, version, got)
        assert response == expected
        assert [(e.host, e.port) for e in response.node_endpoints] == [advertise(n) for n, *_ in BROKERS]
        # the unknown tag survives; the padding is tag 127, all zeros
        assert response.unknown_tags.keys() == {"_5", "_127"}
        assert response.unknown_tags["_5"] == b"keep me"
        assert set(response.unknown_tags["_127"]) == {0}
    # the same response as rewrite_response gives, padding aside
    whole, whole_nodes = rewrite_response(frame, api_key, version, advertise)
    assert decode(api_key, version, whole) == response and whole_nodes == nodes


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_host_of_the_same_length_gives_exactly_what_rewrite_response_gives(case):
    api_key, version, build = case
    frame = frame_response(api_key, version, with_top_level_tags(
        build(BROKERS, False), build(BROKERS, True), {1: b"\x01", 77: b""}))
    whole, whole_nodes = rewrite_response(frame, api_key, version, same_length)
    for chunks in chunkings(frame, seed=version + 1):
        got, nodes, _ = stream(api_key, version, chunks, same_length)
        assert got == whole
        assert nodes == whole_nodes == ALL_NODES
        check_no_broker_host(got)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_longer_proxy_host_drops_node_endpoints(case):
    api_key, version, build = case
    frame = frame_response(api_key, version, with_top_level_tags(
        build(BROKERS, False), build(BROKERS, True), {2: b"\xff" * 3}))
    # what the client then sees: a pre-KIP-951 answer (it refreshes metadata)
    expected = decode(api_key, version, frame_response(api_key, version, build(BROKERS, False)))
    for chunks in chunkings(frame, seed=version + 2):
        got, nodes, _ = stream(api_key, version, chunks, longer)
        assert len(got) == len(frame)
        assert nodes == ALL_NODES  # still learnt, as the broker advertised them
        check_no_broker_host(got)
        response = decode(api_key, version, got)
        assert response == expected and response.node_endpoints == []
        assert response.unknown_tags["_2"] == b"\xff" * 3
        assert response.unknown_tags.keys() == {"_2", "_127"}


@pytest.mark.parametrize("broker_host_len", [24, 60])
def test_every_length_difference_keeps_the_frame_length(broker_host_len):
    """Kept when the section shrinks by 0 or 2+ bytes (padding fits), dropped
    when it grows or shrinks by exactly 1 (no tagged field is 1 byte long).
    Covers the NodeEndpoints size varint shrinking from 2 bytes to 1, and a
    130-byte deficit, which a 1-byte tag cannot pad (tag 16383 does)."""
    seen = set()
    for count in (1, 3):
        brokers = [(n, ("b%d." % n).ljust(broker_host_len, "k"), 9092, None)
                   for n in range(1, count + 1)]
        frame = frame_response(apis.FETCH, 16, fetch(16, brokers, records=b"r" * 100))
        for host_len in range(3, 80):
            def adv(node_id):
                return ("p%d." % node_id).ljust(host_len, "q"), 9000 + node_id
            got, nodes, _ = stream(apis.FETCH, 16, [frame[:200], frame[200:]], adv)
            assert len(got) == len(frame)
            assert nodes == [Node(n, h, p) for n, h, p, _ in brokers]
            response = decode(apis.FETCH, 16, got)
            # what a broker advertising the proxy would have sent is this much shorter
            as_proxy = [(n, *adv(n), r) for n, _, _, r in brokers]
            shrink = len(frame) - len(frame_response(apis.FETCH, 16, fetch(16, as_proxy, records=b"r" * 100)))
            tags = response.unknown_tags or {}
            if shrink == 0:
                assert got == rewrite_response(frame, apis.FETCH, 16, adv)[0] and not tags
            elif shrink >= 2:
                assert [(e.node_id, e.host, e.port) for e in response.node_endpoints] == [
                    (n, *adv(n)) for n, *_ in brokers]
                assert list(tags) == ["_16383" if shrink == 130 else "_127"]
            else:
                assert response.node_endpoints == [] and list(tags) == ["_127"]
            assert not any(tags.get("_127", b"")) and not any(tags.get("_16383", b""))
            for _, host, _, _ in brokers:
                assert host.encode() not in got
            seen.add("kept" if response.node_endpoints else "dropped")
            seen.add(shrink)
    assert {"kept", "dropped", 1, 0} <= seen


def test_a_one_byte_deficit_drops_node_endpoints():
    broker = [(1, "kafka-1.internal.example", 9092, "rack-a")]
    frame = frame_response(apis.FETCH, 17, fetch(17, broker))
    got, nodes, _ = stream(apis.FETCH, 17, [frame], lambda n: ("proxy-1.equal-length.ne", 1))
    assert len(got) == len(frame) and nodes == [Node(1, "kafka-1.internal.example", 9092)]
    response = decode(apis.FETCH, 17, got)
    assert response.node_endpoints == [] and list(response.unknown_tags) == ["_127"]


def test_padding_follows_unknown_tags_above_127_and_a_tag_count_past_127():
    bare, full = fetch_many(16, with_endpoints=False), fetch_many(16)
    # an unknown tag above 127: the padding takes the next varint length's tag
    frame = frame_response(apis.FETCH, 16, with_top_level_tags(bare, full, {300: b"later"}))
    got, _, _ = stream(apis.FETCH, 16, [frame[:512], frame[512:]])
    response = decode(apis.FETCH, 16, got)
    assert len(got) == len(frame) and len(response.node_endpoints) == 3
    assert list(response.unknown_tags) == ["_300", "_16383"]
    # 127 fields: adding the padding makes the count a 2-byte varint
    extra = {tag: b"" for tag in range(1, 127)}
    frame = frame_response(apis.FETCH, 16, with_top_level_tags(bare, full, extra))
    got, _, _ = stream(apis.FETCH, 16, [frame])
    response = decode(apis.FETCH, 16, got)
    assert len(got) == len(frame) and len(response.node_endpoints) == 3
    assert len(response.unknown_tags) == 127 and "_127" in response.unknown_tags
    check_no_broker_host(got)


def test_padding_fields_have_exactly_the_length_asked_for():
    def parse(field):
        tag = size = shift = pos = 0
        for target in ("tag", "size"):
            value = shift = 0
            while True:
                b = field[pos]
                pos += 1
                value |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            if target == "tag":
                tag = value
            else:
                size = value
        return tag, size, pos

    assert _padding(1, -1) is None  # nothing is 1 byte long: the 1-byte deficit
    # above 126 the tag takes 2 bytes, so 3 is the least (2 bytes: dropped)
    assert _padding(2, 127) is None
    for above, least in ((-1, 2), (0, 2), (126, 2), (127, 3), (5000, 3), (16383, 4)):
        # every length up to 300, and each side of where the size's varint grows a byte
        edges = [edge + d for edge in (2**7, 2**14, 2**21) for d in range(-8, 9)]
        for nbytes in list(range(least, 300)) + [n for n in edges if n >= least]:
            pad = _padding(nbytes, above)
            assert len(pad) == nbytes, (nbytes, above)
            tag, size, header = parse(pad)
            assert tag > above and header + size == nbytes and not any(pad[header:])


@pytest.mark.parametrize("version", FETCH_VERSIONS)
def test_unknown_tags_inside_partitions_and_topics_pass_untouched(version):
    bare = with_partition_unknown_tag(fetch_many(version, with_endpoints=False))
    full = with_partition_unknown_tag(fetch_many(version))
    frame = frame_response(apis.FETCH, version, with_top_level_tags(bare, full, {}))
    got, nodes, _ = stream(apis.FETCH, version, list(chunkings(frame, seed=9))[-1])
    assert len(got) == len(frame) and nodes == ALL_NODES
    tail_at = len(frame) - (len(full) - len(bare)) - 1
    assert got[:tail_at] == frame[:tail_at]
    response = decode(apis.FETCH, version, got)
    parts = [p for t in response.responses for p in t.partitions if p.unknown_tags]
    assert len(parts) == 2 and all(p.unknown_tags == {"_9": b"\xde\xad"} for p in parts)
    check_no_broker_host(got)


def test_advertise_errors_propagate():
    def refuse(node_id):
        raise ValueError("node id %d maps to no port" % node_id)

    frame = frame_response(apis.FETCH, 16, fetch(16))
    with pytest.raises(ValueError, match="maps to no port"):
        stream(apis.FETCH, 16, [frame], refuse)


# -- malformed input --------------------------------------------------------


def reframe(frame, cut):
    body = frame[4:cut]
    return len(body).to_bytes(4, "big") + body


SMALL = ([(apis.FETCH, v, frame_response(apis.FETCH, v, fetch(v))) for v in FETCH_VERSIONS]
         + [(apis.FETCH, 16, frame_response(apis.FETCH, 16, fetch(16, with_endpoints=False)))]
         + [(apis.PRODUCE, v, frame_response(apis.PRODUCE, v, produce_many(v)))
            for v in PRODUCE_VERSIONS]
         + [(apis.PRODUCE, 11, frame_response(apis.PRODUCE, 11, produce(11, with_endpoints=False)))])


@pytest.mark.parametrize("api_key,version,frame", SMALL)
def test_every_truncation_raises_protocol_error(api_key, version, frame):
    for cut in range(5, len(frame)):
        short = reframe(frame, cut)
        pieces = [short] if cut % 2 else [short[p : p + 7] for p in range(0, len(short), 7)]
        with pytest.raises(ProtocolError):
            stream(api_key, version, pieces)


def test_truncations_of_a_large_fetch_raise_protocol_error():
    # around its start and its tail, and at random
    rng = random.Random(3)
    big = frame_response(apis.FETCH, 16, fetch_many(16))
    cuts = list(range(5, 300)) + list(range(len(big) - 400, len(big))) + rng.sample(range(len(big)), 100)
    for cut in cuts:
        with pytest.raises(ProtocolError):
            stream(apis.FETCH, 16, [reframe(big, cut)])


def garble(frame, rng, most):
    """``frame`` with 1 to ``most`` bytes after its size prefix set at random."""
    garbled = bytearray(frame)
    for _ in range(rng.randint(1, most)):
        garbled[rng.randrange(4, len(garbled))] = rng.randrange(256)
    return bytes(garbled)


@pytest.mark.parametrize("api_key,version,frame", SMALL)
def test_garbage_raises_only_protocol_error(api_key, version, frame):
    rng = random.Random(version * 7 + api_key)
    rejected = 0
    for trial in range(400):
        garbled = garble(frame, rng, 5)
        pieces = ([garbled] if trial % 2
                  else [bytes(garbled[p : p + 3]) for p in range(0, len(garbled), 3)])
        try:
            got, _, _ = stream(api_key, version, pieces, advertise)
        except ProtocolError:
            rejected += 1
        else:
            assert len(got) == len(garbled)
    assert rejected > 10
    # trailing bytes after the top-level tags, or a varint running past the end
    for junk in (b"\x00", b"\x80\x80"):
        with pytest.raises(ProtocolError):
            stream(api_key, version, [reframe(frame + junk, len(frame) + len(junk))])
    with pytest.raises(ProtocolError):  # a frame too short for any response
        stream(api_key, version, [b"\x00\x00\x00\x03abc"])


def test_a_huge_count_fails_fast():
    body = bytearray(fetch(16, with_endpoints=False))
    # responses count (after throttle_time_ms, error_code, session_id): 2**28
    body[10:11] = b"\x81\x80\x80\x80\x01"
    frame = frame_response(apis.FETCH, 16, bytes(body))
    with pytest.raises(ProtocolError, match="runs past the frame"):
        stream(apis.FETCH, 16, [frame])


# -- a whole frame with nothing to rewrite (Connection.pass_response) ----------


def _plain_bodies():
    for v in PRODUCE_VERSIONS:
        yield apis.PRODUCE, v, produce(v, with_endpoints=False)
    for v in FETCH_VERSIONS:
        yield apis.FETCH, v, fetch(v, with_endpoints=False)
        yield apis.FETCH, v, fetch(v, with_endpoints=False, records=b"")


def forwarded_unchanged(api_key, version, frame):
    try:
        got, nodes, _ = stream(api_key, version, [frame])
    except ProtocolError:
        return False
    return got == frame and nodes == []


def untouched_whole(api_key, api_version, frame):
    """untouched_check's answer for one frame (False where there is no check)."""
    untouched = untouched_check(api_key, api_version)
    return untouched is not None and untouched(frame)


@pytest.mark.parametrize("api_key,version,body", list(_plain_bodies()))
def test_untouched_whole_says_yes_only_where_the_rewrite_forwards_the_frame_as_it_came(
        api_key, version, body):
    frame = frame_response(api_key, version, body)
    assert untouched_whole(api_key, version, frame)
    assert forwarded_unchanged(api_key, version, frame)
    # any top-level tag, NodeEndpoints first of all, is the rewriter's to read
    full = (produce if api_key == apis.PRODUCE else fetch)(version)
    for other in (full, with_top_level_tags(body, None, {3: b"future"})):
        assert not untouched_whole(api_key, version, frame_response(api_key, version, other))
    # a truncated or garbled frame: never yes where the rewriter would refuse
    # it or change it
    for cut in range(5, len(frame)):
        assert not untouched_whole(api_key, version, reframe(frame, cut))
    rng = random.Random(version * 13 + api_key)
    said_yes = 0
    for _ in range(300):
        garbled = garble(frame, rng, 3)
        if untouched_whole(api_key, version, garbled):
            said_yes += 1
            assert forwarded_unchanged(api_key, version, garbled)
    assert said_yes  # bytes changed inside fixed-size fields leave it plain


def test_untouched_whole_never_for_a_version_newer_than_the_proxy_decodes():
    version = apis.MAX_DECODABLE_VERSION[apis.PRODUCE]
    frame = frame_response(apis.PRODUCE, version, produce(version, with_endpoints=False))
    assert untouched_whole(apis.PRODUCE, version, frame)
    assert not untouched_whole(apis.PRODUCE, version + 1, frame)


# -- the interface ------------------------------------------------------------


def test_which_responses_get_a_rewriter():
    for api_key, version in [(apis.FETCH, 15), (apis.PRODUCE, 9), (apis.METADATA, 12),
                             (apis.API_VERSIONS, 3), (9, 9)]:
        assert stream_rewriter(api_key, version, advertise) is None
    for api_key, version in [(apis.FETCH, 16), (apis.PRODUCE, 10)]:
        rewriter = stream_rewriter(api_key, version, advertise)
        assert rewriter.nodes == [] and rewriter.done is False
    with pytest.raises(ProtocolError, match="newer"):
        stream_rewriter(apis.FETCH, apis.MAX_DECODABLE_VERSION[apis.FETCH] + 1, advertise)


def test_feeding_past_the_frame_is_a_caller_error():
    frame = frame_response(apis.FETCH, 16, fetch(16))
    rewriter = stream_rewriter(apis.FETCH, 16, advertise)
    with pytest.raises(ValueError):
        rewriter.feed(frame + b"\x00", [])
    rewriter = stream_rewriter(apis.FETCH, 16, advertise)
    rewriter.feed(frame, [])
    with pytest.raises(ValueError):
        rewriter.feed(b"\x00", [])
    assert rewriter.feed(b"", []) is None  # empty reads are fine



def test_a_header_tag_section_of_several_varint_bytes_is_left_to_the_generator_walk():
    # 128 header tags (a two-byte count) in a Produce v10 response: the plain
    # loop gives up, and the walk that takes over reads it properly
    body = produce(10, with_endpoints=False)
    frame = frame_response(apis.PRODUCE, 10, body)
    head, rest = frame[4:8], frame[9:]  # correlation_id; after the header's tag count 0
    tags = b"\x80\x01" + b"".join(bytes([t, 0]) for t in range(128))
    odd = head + tags + rest
    odd = len(odd).to_bytes(4, "big") + odd
    assert not untouched_whole(apis.PRODUCE, 10, odd)
    got, nodes, _ = stream(apis.PRODUCE, 10, [odd])
    assert got == odd and nodes == []
