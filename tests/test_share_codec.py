"""ShareFetch (78) and ShareAcknowledge (79) responses (KIP-932): their NodeEndpoints, a
plain field after the responses, become the proxy's addresses, at the same length while the
records stream (kthrottle/codecs/stream.py) and spliced when gathered (rewrite.py); their
throttle_time_ms is patched (throttle.py). kafka-python has no schema for them: the frames
are built byte by byte from Kafka's ShareFetchResponse.json and ShareAcknowledgeResponse.json
(kthrottle_testkit/frames.py) and read back by a parser of the test's own (parse_share_tail)."""
import struct

import pytest

from kthrottle.codecs import Node, ProtocolError, rewrite_response
from kthrottle.codecs.frames import HEAD_SIZE
from kthrottle.codecs.stream import stream_rewriter, untouched_check
from kthrottle.codecs.throttle import (
    clients_back_off_from,
    raise_throttle_time,
    throttle_time_at,
    throttle_time_offset,
    throttle_time_patch,
)
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.address_rewrite import AddressRewrite
from kthrottle.proxy.pipeline import NOTHING, STREAM
from kthrottle_testkit.frames import (
    BROKERS,
    advertise,
    frame_response,
    parse_share_tail,
    proxied,
    share_acknowledge_parts,
    share_fetch_parts,
    tagged_field,
)
from test_pipeline import Harness, cids, req_cids
from test_stream_rewrite import chunkings, longer, same_length

pytestmark = pytest.mark.unit

SHARE_FETCH, SHARE_ACKNOWLEDGE = 78, 79
CASES = [(SHARE_FETCH, 1), (SHARE_FETCH, 2), (SHARE_ACKNOWLEDGE, 1), (SHARE_ACKNOWLEDGE, 2)]
PARTS = {SHARE_FETCH: share_fetch_parts, SHARE_ACKNOWLEDGE: share_acknowledge_parts}
ALL_NODES = [Node(n, h, p) for n, h, p, _ in BROKERS]
BROKER_HOSTS = [h.encode() for _, h, _, _ in BROKERS]
KEEP = (5, b"keep me")  # an unknown top-level tagged field, from a newer broker


def case_id(case):
    return "%s-v%d" % ({78: "ShareFetch", 79: "ShareAcknowledge"}[case[0]], case[1])


def share_frame(body, correlation_id=42):
    """Response header v1 (every version of both is flexible): correlation id, no tags."""
    payload = struct.pack(">i", correlation_id) + b"\x00" + body
    return struct.pack(">i", len(payload)) + payload


def build(api_key, version, addresses=BROKERS, with_endpoints=True, tags=(KEEP,), **kw):
    """(frame, offset of NodeEndpoints in it)"""
    top = bytes([len(tags)]) + b"".join(tagged_field(t, v) for t, v in tags)
    head, endpoints, top = PARTS[api_key](version, addresses, with_endpoints, top_tags=top, **kw)
    frame = share_frame(head + endpoints + top)
    return frame, len(frame) - len(endpoints) - len(top)


def stream(api_key, version, chunks, advertise_fn=advertise):
    rewriter = stream_rewriter(api_key, version, advertise_fn)
    out = []
    for chunk in chunks:
        assert not rewriter.done
        rewriter.feed(chunk, out)
    assert rewriter.done
    return b"".join(bytes(o) for o in out), rewriter.nodes


def check_no_broker_host(frame):
    for host in BROKER_HOSTS:
        assert host not in frame


def test_the_frames_are_what_the_specs_say():
    # the header is v1 (flexible), as the proxy's own table says too
    for api_key, version in CASES:
        frame, at = build(api_key, version)
        body = frame[9:]
        assert frame_response(api_key, version, body) == frame
        endpoints, tags = parse_share_tail(frame[at:])
        assert endpoints == BROKERS and tags == [KEEP]
    # ShareFetch v1 and ShareAcknowledge v2 carry acquisition_lock_timeout_ms (30000) after
    # error_message; ShareAcknowledge v1 does not
    for api_key, version, has in [(78, 1, True), (79, 1, False), (79, 2, True)]:
        frame, _ = build(api_key, version)
        assert (frame[16:20] == struct.pack(">i", 30000)) == has


# -- no NodeEndpoints: as it came ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("tags", [(), (KEEP, (200, b"x" * 300))], ids=["plain", "unknown-tags"])
def test_without_node_endpoints_the_frame_goes_on_as_it_came(case, tags):
    api_key, version = case
    frame, _ = build(api_key, version, with_endpoints=False, tags=tags)
    for chunks in chunkings(frame, seed=version):
        assert stream(api_key, version, chunks) == (frame, [])
    assert rewrite_response(frame, api_key, version, advertise) == (None, [])
    # the usual answer (no endpoints, no tags) is known to need nothing at once
    assert untouched_check(api_key, version)(frame) is (not tags)
    with_endpoints, _ = build(api_key, version, tags=())
    assert untouched_check(api_key, version)(with_endpoints) is False


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_one_byte_reads(case):
    api_key, version = case
    frame, at = build(api_key, version)
    got, nodes = stream(api_key, version, [frame[p:p + 1] for p in range(len(frame))])
    assert len(got) == len(frame) and got[:at] == frame[:at] and nodes == ALL_NODES
    check_no_broker_host(got)


# -- NodeEndpoints present -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_shorter_proxy_host_is_padded_to_the_same_length(case):
    api_key, version = case
    frame, at = build(api_key, version)
    for chunks in chunkings(frame, seed=version + 10):
        got, nodes = stream(api_key, version, chunks)
        assert len(got) == len(frame)
        assert got[:at] == frame[:at]  # records and all: untouched
        assert nodes == ALL_NODES
        check_no_broker_host(got)
        endpoints, tags = parse_share_tail(got[at:])
        assert endpoints == proxied(BROKERS)
        # the unknown tag kept; the padding is tag 127, all zeros
        assert [t for t, _ in tags] == [5, 127] and tags[0] == KEEP
        assert not any(tags[1][1])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_host_of_the_same_length_gives_exactly_what_the_gathered_rewrite_gives(case):
    api_key, version = case
    frame, at = build(api_key, version)
    whole, whole_nodes = rewrite_response(frame, api_key, version, same_length)
    assert len(whole) == len(frame) and whole_nodes == ALL_NODES
    assert parse_share_tail(whole[at:]) == (
        [(n, *same_length(n), r) for n, _, _, r in BROKERS], [KEEP])
    for chunks in chunkings(frame, seed=version + 20):
        assert stream(api_key, version, chunks, same_length) == (whole, whole_nodes)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_gathered_rewrite_splices_any_host_length(case):
    api_key, version = case
    frame, at = build(api_key, version)
    for adv in (advertise, longer):
        whole, nodes = rewrite_response(frame, api_key, version, adv)
        assert nodes == ALL_NODES
        assert struct.unpack_from(">i", whole)[0] == len(whole) - 4
        assert whole[4:at] == frame[4:at]
        check_no_broker_host(whole)
        assert parse_share_tail(whole[at:]) == ([(n, *adv(n), r) for n, _, _, r in BROKERS],
                                                [KEEP])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_longer_proxy_host_empties_node_endpoints(case):
    """The share consumer then looks the leader up in Metadata, as before KIP-951."""
    api_key, version = case
    frame, at = build(api_key, version)
    for chunks in chunkings(frame, seed=version + 30):
        got, nodes = stream(api_key, version, chunks, longer)
        assert len(got) == len(frame) and got[:at] == frame[:at]
        assert nodes == ALL_NODES  # still learnt, as the broker advertised them
        check_no_broker_host(got)
        endpoints, tags = parse_share_tail(got[at:])
        assert endpoints == [] and [t for t, _ in tags] == [5, 127] and tags[0] == KEEP


@pytest.mark.parametrize("api_key", [SHARE_FETCH, SHARE_ACKNOWLEDGE])
def test_every_length_difference_keeps_the_frame_length(api_key):
    """Kept when the tail shrinks by 0 or 2+ bytes (padding fits), emptied when it grows
    or shrinks by exactly 1 (no tagged field is 1 byte long)."""
    seen = set()
    for count in (1, 3):
        brokers = [(n, ("b%d." % n).ljust(24, "k"), 9092, None) for n in range(1, count + 1)]
        frame, at = build(api_key, 2, brokers, tags=())
        for host_len in range(3, 60):
            def adv(node_id):
                return ("p%d." % node_id).ljust(host_len, "q"), 9000 + node_id
            got, nodes = stream(api_key, 2, [frame[:100], frame[100:]], adv)
            assert len(got) == len(frame) and got[:at] == frame[:at]
            assert nodes == [Node(n, h, p) for n, h, p, _ in brokers]
            endpoints, tags = parse_share_tail(got[at:])
            shrink = count * (24 - host_len)
            if shrink == 0:
                assert tags == []
            if shrink == 0 or shrink >= 2:
                assert endpoints == [(n, *adv(n), None) for n, *_ in brokers]
                seen.add("kept")
            else:
                assert endpoints == []
                seen.add("emptied")
            assert all(t == 127 and not any(v) for t, v in tags)
            for _, host, _, _ in brokers:
                assert host.encode() not in got
    assert seen == {"kept", "emptied"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_unknown_partition_tags_and_long_error_messages_pass_untouched(case):
    api_key, version = case
    frame, at = build(api_key, version, partition_tag=(9, b"\xde\xad"),
                      error_message="e" * 200)  # a 2-byte length varint
    got, nodes = stream(api_key, version, [frame])
    assert got[:at] == frame[:at] and nodes == ALL_NODES
    assert parse_share_tail(got[at:])[0] == proxied(BROKERS)
    assert rewrite_response(frame, api_key, version, advertise)[1] == ALL_NODES


# -- what is not a share response of a version the proxy decodes -------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_truncation_is_a_protocol_error(case):
    api_key, version = case
    frame, _ = build(api_key, version, tags=())
    n = len(frame)
    # every cut in the first and last 1500 bytes, some inside the records
    for cut in sorted(set(range(9, min(n, 1500))) | set(range(max(9, n - 1500), n))
                      | set(range(9, n, 997))):
        short = struct.pack(">i", cut - 4) + frame[4:cut]
        with pytest.raises(ProtocolError):
            stream(api_key, version, [short])
        with pytest.raises(ProtocolError):
            rewrite_response(short, api_key, version, advertise)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_garbage_is_a_protocol_error_or_a_frame_of_the_same_length(case):
    import random

    api_key, version = case
    rng = random.Random(version * 100 + api_key)
    small = {"record_sizes": (3, 0, 130)} if api_key == SHARE_FETCH else {}
    for source in (build(api_key, version, tags=(), **small)[0],
                   build(api_key, version, BROKERS[:2], **small)[0]):
        for _ in range(300):
            garbled = bytearray(source)
            for _ in range(rng.choice([1, 2, 5])):
                garbled[rng.randrange(8, len(garbled))] = rng.randrange(256)
            garbled = bytes(garbled)
            for chunks in ([garbled], [garbled[:50], garbled[50:]]):
                try:
                    got, nodes = stream(api_key, version, chunks)
                except ProtocolError:
                    continue
                assert len(got) == len(garbled)
                assert all(isinstance(node, Node) for node in nodes)
            try:
                rewrite_response(garbled, api_key, version, advertise)
            except ProtocolError:
                pass


def test_versions_the_proxy_does_not_decode_get_no_rewriter():
    f = AddressRewrite(advertise)
    for api_key in (SHARE_FETCH, SHARE_ACKNOWLEDGE):
        # v0 (Kafka 4.0's early access): never advertised, refused when sent
        assert stream_rewriter(api_key, 0, advertise) is None
        assert f.response_need(api_key, 0) == NOTHING
        with pytest.raises(ProtocolError, match="older than the proxy can decode"):
            rewrite_response(build(api_key, 1)[0], api_key, 0, advertise)
        for version in (1, 2):
            assert f.response_need(api_key, version) == STREAM
            assert untouched_check(api_key, version) is not None
        with pytest.raises(ProtocolError, match="newer than the proxy can decode"):
            stream_rewriter(api_key, 3, advertise)
        assert untouched_check(api_key, 3) is None


# -- throttle_time_ms ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_throttle_time_is_found_raised_and_patched_in_place(case):
    api_key, version = case
    frame, _ = build(api_key, version)
    assert throttle_time_offset(api_key, version) == 0  # the first body field
    assert throttle_time_at(frame, api_key, version) == 9  # size, correlation id, no tags
    raised = raise_throttle_time(frame, api_key, version, 54321)
    assert len(raised) == len(frame)
    assert raised[:9] == frame[:9] and raised[13:] == frame[13:]
    assert struct.unpack_from(">i", raised, 9)[0] == 54321
    assert raise_throttle_time(raised, api_key, version, 100) is None  # never lowered
    assert throttle_time_patch(frame[:HEAD_SIZE], api_key, version) == 9
    assert throttle_time_patch(frame[:12], api_key, version) is None  # not in the head
    # a header with tags of its own: the field follows them
    tagged = share_frame(b"", 42)[:8] + b"\x01\x03\x02ab" + frame[9:]
    tagged = struct.pack(">i", len(tagged) - 4) + tagged[4:]
    assert throttle_time_at(tagged, api_key, version) == 13
    # the Java client does not back off on these (ShareFetchResponse and
    # ShareAcknowledgeResponse keep AbstractResponse's shouldClientThrottle): the
    # proxy holds them itself
    assert clients_back_off_from(api_key) is None


# -- through the pipeline --------------------------------------------------------------------


def share_request(cid, api_key, version, client_id=b"share-1"):
    """A request head (header v2) and a body the proxy never reads."""
    payload = (struct.pack(">hhih", api_key, version, cid, len(client_id)) + client_id
               + b"\x00" + b"\x00" * 30)
    return struct.pack(">i", len(payload)) + payload


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("chunk", [None, 100, 4096])
def test_a_share_consumer_behind_the_proxy_is_given_the_proxys_addresses(case, chunk):
    api_key, version = case
    h = Harness(filters=standard_filters(advertise), whole_response_max=0)
    h.client(share_request(3, api_key, version))
    assert req_cids(h.take_broker()) == [3]
    frame, at = build(api_key, version)
    frame = frame[:4] + struct.pack(">i", 3) + frame[8:]
    h.broker(frame, chunk)
    out = h.take_client()
    assert cids(out) == [3] and len(out) == len(frame)
    check_no_broker_host(out)
    assert parse_share_tail(out[at:])[0] == proxied(BROKERS)
    # the listeners for those nodes exist before their addresses reach the client
    assert h.nodes and h.nodes[0][0] == ALL_NODES and h.nodes[0][1] <= at
