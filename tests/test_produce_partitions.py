"""Streaming read of a Produce request's topic-partitions
(kthrottle/codecs/produce.py): requests built with kafka-python and by hand,
fed in many chunkings, no sockets."""
import random
import uuid
import warnings

import pytest

from kthrottle.codecs import ProtocolError
from kthrottle.codecs.produce import MAX_VERSION, ProducePartitions, produce_partitions
from kthrottle.codecs.wire import write_uvarint

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.producer import ProduceRequest

pytestmark = pytest.mark.unit

VERSIONS = range(0, MAX_VERSION + 1)
FLEXIBLE = range(9, MAX_VERSION + 1)

# (name, topic id, [(partition index, records)]): records of many sizes (1-,
# 2- and 3-byte compact lengths, empty, null, larger than most chunks), an
# empty and a non-ASCII topic name.
TOPICS = [
    ("orders", uuid.UUID(int=7), [(0, b"\x01" * 700), (1, b""), (2, None), (7, b"x")]),
    ("zähler-€", uuid.UUID(int=0xABCDEF << 64 | 5), [(3, bytes(range(256)) * 80), (0, b"y" * 127)]),
    ("", uuid.UUID(int=2**128 - 1), [(2**31 - 1, b"z" * 128), (5, None)]),
    ("t" * 249, uuid.UUID(int=9), [(1, b"q" * 60)]),
]


def expected(version, topics=TOPICS):
    return [(topic_id if version >= 13 else name, index)
            for name, topic_id, parts in topics for index, _ in parts]


def kafka_request(version, topics=TOPICS, transactional_id="tx-1", client_id="app-1", cid=42):
    """A framed Produce request as kafka-python encodes it."""
    R = ProduceRequest
    D = R.TopicProduceData
    P = D.PartitionProduceData
    req = R[version](transactional_id=transactional_id, acks=-1, timeout_ms=30000,
                     topic_data=[D(name=name, topic_id=topic_id,
                                   partition_data=[P(index=i, records=r) for i, r in parts])
                                 for name, topic_id, parts in topics])
    req.with_header(correlation_id=cid, client_id=client_id)
    return bytes(req.encode(header=True, framed=True))


# -- a hand encoder, to place tagged fields and malformed values ---------------


def tags(fields):
    """A tagged-field section of {tag: value}."""
    out = write_uvarint(len(fields))
    for tag in sorted(fields):
        out += write_uvarint(tag) + write_uvarint(len(fields[tag])) + fields[tag]
    return out


def i16(n):
    return n.to_bytes(2, "big", signed=True)


def i32(n):
    return n.to_bytes(4, "big", signed=True)


def string(value, compact, length=None):
    """A (nullable) string; ``length`` overrides the encoded length."""
    data = value.encode() if isinstance(value, str) else value
    if length is None:
        length = -1 if value is None else len(data)
    if compact:
        return write_uvarint(length + 1) + (data or b"")
    return i16(length) + (data or b"")


def nbytes(value, compact):
    if compact:
        return write_uvarint(0 if value is None else len(value) + 1) + (value or b"")
    return i32(-1 if value is None else len(value)) + (value or b"")


def count(n, compact):
    return write_uvarint(n + 1) if compact else i32(n)


def hand_request(version, topics=TOPICS, transactional_id="tx-1", client_id="app-1", cid=42,
                 header_tags=None, partition_tags=None, topic_tags=None, top_tags=None,
                 api_key=0, header_version=None):
    """A framed Produce request; ``topics`` may give names as raw bytes. The
    tag arguments ({tag: value}) are sections for flexible versions."""
    flexible = version >= 9
    out = i16(api_key) + i16(version if header_version is None else header_version) + i32(cid)
    out += string(client_id, False)
    if flexible:
        out += tags(header_tags or {})
    if version >= 3:
        out += string(transactional_id, flexible)
    out += i16(-1) + i32(30000) + count(len(topics), flexible)
    for name, topic_id, parts in topics:
        out += topic_id.bytes if version >= 13 else string(name, flexible)
        out += count(len(parts), flexible)
        for index, records in parts:
            out += i32(index) + nbytes(records, flexible)
            if flexible:
                out += tags(partition_tags or {})
        if flexible:
            out += tags(topic_tags or {})
    if flexible:
        out += tags(top_tags or {})
    return frame(out)


def frame(payload):
    return len(payload).to_bytes(4, "big") + payload


# -- feeding -------------------------------------------------------------------


def chunkings(data, seed, bytewise=True):
    """Whole, byte by byte, the size prefix split, random sizes (seeded),
    bytes and memoryview slices."""
    yield [data]
    if bytewise:
        yield [data[p : p + 1] for p in range(len(data))]
    yield [data[:2], data[2:7]] + [data[p : p + 4096] for p in range(7, len(data), 4096)]
    rng = random.Random(seed)
    for trial in range(6):
        source = memoryview(data) if trial % 2 else data
        chunks, pos = [], 0
        while pos < len(data):
            step = rng.choice([1, 2, 3, 4, 5, 7, 13, 16, 64, 511, 512, 4096, 65536])
            chunks.append(source[pos : pos + step])
            pos += step
        yield chunks


def feed(version, chunks):
    reader = ProducePartitions(version)
    out = []
    for chunk in chunks:
        assert not reader.done
        reader.feed(chunk, out)
    assert reader.done
    return reader, out


def check_stream(version, data, want, seeds=(1, 2, 3), bytewise=True):
    for k, seed in enumerate(seeds):
        for chunks in chunkings(data, seed * 100 + version, bytewise and k == 0):
            reader, out = feed(version, chunks)
            assert reader.partitions == want
            # every chunk forwarded as given: the same objects, in order
            assert len(out) == len(chunks) and all(o is c for o, c in zip(out, chunks))
            assert b"".join(bytes(o) for o in out) == data


def feed_error(version, data, exc=ProtocolError, match=None):
    """Feeding ``data`` whole, then byte by byte, then in 7-byte chunks raises."""
    for step in (len(data), 1, 7):
        reader = ProducePartitions(version)
        with pytest.raises(exc, match=match):
            for p in range(0, len(data), step):
                reader.feed(data[p : p + step], [])
        assert not reader.done


# -- well-formed requests ------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_hand_encoder_matches_kafka_python(version):
    assert hand_request(version) == kafka_request(version)
    assert hand_request(version, transactional_id=None, client_id=None) == kafka_request(
        version, transactional_id=None, client_id=None)


@pytest.mark.parametrize("version", VERSIONS)
def test_partitions_in_request_order_under_any_chunking(version):
    data = kafka_request(version)
    check_stream(version, data, expected(version))
    assert produce_partitions(data, version) == expected(version)
    assert produce_partitions(memoryview(data), version) == expected(version)
    if version >= 13:
        assert all(isinstance(topic, uuid.UUID) for topic, _ in produce_partitions(data, version))


@pytest.mark.parametrize("version", VERSIONS)
def test_null_ids_and_no_topics(version):
    data = kafka_request(version, transactional_id=None, client_id=None)
    check_stream(version, data, expected(version), seeds=(4,))
    data = kafka_request(version, topics=[], client_id="")
    check_stream(version, data, [], seeds=(5,))
    data = kafka_request(version, topics=[("empty", uuid.UUID(int=1), [])])
    check_stream(version, data, [], seeds=(6,))


@pytest.mark.parametrize("version", VERSIONS)
def test_long_client_and_transactional_ids(version):
    data = kafka_request(version, transactional_id="T" * 5000, client_id="c" * 3000)
    check_stream(version, data, expected(version), seeds=(7,))


@pytest.mark.parametrize("version", [3, 8, 9, 12, MAX_VERSION])
def test_a_large_batch_spans_many_chunks(version):
    big = [("big", uuid.UUID(int=11), [(0, b"B" * 300000), (1, b"b" * 70000)])]
    data = kafka_request(version, topics=big)
    want = expected(version, big)
    check_stream(version, data, want, seeds=(8,), bytewise=False)
    reader, _ = feed(version, [data[p : p + 1000] for p in range(0, len(data), 1000)])
    assert reader.partitions == want


@pytest.mark.parametrize("version", FLEXIBLE)
def test_tagged_fields_at_every_level_are_skipped(version):
    sections = dict(header_tags={0: b"h" * 3, 7: b"", 200: b"H" * 300},
                    partition_tags={1: b"\x80\x80\x80", 130: b"p" * 130},
                    topic_tags={5: b"t"},
                    top_tags={0: b"\x00" * 20, 16383: b"T" * 1000})
    data = hand_request(version, **sections)
    check_stream(version, data, expected(version))
    # only the header's tags
    data = hand_request(version, header_tags={3: b"\x01\x02"})
    check_stream(version, data, expected(version), seeds=(9,))


@pytest.mark.parametrize("version", [0, 3, 8, 9, MAX_VERSION])
def test_a_null_array_counts_as_empty(version):
    flexible = version >= 9
    data = hand_request(version, topics=[])
    empty = count(0, flexible) + (tags({}) if flexible else b"")
    null = (b"\x00" if flexible else i32(-1)) + (tags({}) if flexible else b"")
    assert data.endswith(empty)
    assert produce_partitions(frame(data[4 : -len(empty)] + null), version) == []


def test_a_chunk_inside_a_record_batch_does_not_step_the_walker():
    data = kafka_request(9, topics=[("t", uuid.UUID(int=1), [(4, b"r" * 10000)])])
    reader = ProducePartitions(9)
    out = []
    at = data.index(b"r" * 100)
    reader.feed(data[:at + 10], out)
    assert reader.partitions == [("t", 4)]
    walk = reader._walk

    class Untouchable:
        def send(self, value):
            raise AssertionError("walker stepped inside a record batch")

    reader._walk = Untouchable()
    for p in range(at + 10, at + 9910, 100):  # up to 90 bytes before the batch's end
        reader.feed(data[p : p + 100], out)
    reader._walk = walk
    reader.feed(data[at + 9910 :], out)
    assert reader.done and b"".join(out) == data


# -- chunks past the end ---------------------------------------------------------


@pytest.mark.parametrize("version", [2, 8, 9, MAX_VERSION])
def test_a_chunk_past_the_end_is_a_value_error(version):
    data = kafka_request(version)
    with pytest.raises(ValueError, match="past the end"):
        ProducePartitions(version).feed(data + b"\x00", [])
    with pytest.raises(ValueError, match="past the end"):
        produce_partitions(data + b"next", version)
    reader = ProducePartitions(version)
    reader.feed(data[:100], [])
    with pytest.raises(ValueError, match="past the end"):
        reader.feed(data[100:] + b"\x00", [])
    reader = ProducePartitions(version)
    out = []
    reader.feed(data, out)
    assert reader.done
    with pytest.raises(ValueError, match="complete"):
        reader.feed(b"\x00", out)
    reader.feed(b"", out)  # nothing: nothing to say
    assert out == [data]


# -- malformed requests ----------------------------------------------------------


def shortened(data, by):
    """The frame without its last ``by`` bytes, the size prefix fixed."""
    return frame(data[4:-by])


@pytest.mark.parametrize("version", VERSIONS)
def test_records_running_past_the_frame(version):
    topics = [("t", uuid.UUID(int=1), [(0, b"r" * 500)])]
    data = hand_request(version, topics=topics)
    cut = 4 if version >= 9 else 1  # the tag sections, and 1 byte of records
    feed_error(version, shortened(data, cut), match="run past")


@pytest.mark.parametrize("version", VERSIONS)
def test_counts_running_past_the_frame(version):
    flexible = version >= 9
    topics = [("t", uuid.UUID(int=1), [(0, b"r")])]
    data = hand_request(version, topics=topics)
    head = hand_request(version, topics=[])[: -(2 if flexible else 4)]  # up to topic_data
    rest = data[len(head) + len(count(1, flexible)):]
    feed_error(version, frame(head[4:] + count(1000, flexible) + rest), match="runs past")
    partitions_at = rest.index(count(1, flexible) + i32(0))
    tail = rest[partitions_at + len(count(1, flexible)):]
    bad = head[4:] + count(1, flexible) + rest[:partitions_at] + count(10**6, flexible) + tail
    feed_error(version, frame(bad), match="runs past")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_frame_ending_inside_the_structure(version):
    # the last partition's records are null: cutting 1 to 4 bytes leaves no
    # length running past the end (for v9+: tag sections and null records)
    data = hand_request(version, topics=TOPICS + [("last", uuid.UUID(int=3), [(9, None)])])
    for by in (1, 2, 3, 4):
        feed_error(version, shortened(data, by), match="truncated")
    feed_error(version, frame(data[4:14]), match="truncated")  # the header alone
    feed_error(version, frame(b""), match="truncated")


@pytest.mark.parametrize("version", VERSIONS)
def test_bytes_after_the_request(version):
    feed_error(version, frame(hand_request(version)[4:] + b"\x00"), match="after the end")


@pytest.mark.parametrize("version", [0, 3, 8])
@pytest.mark.parametrize("where", ["topics", "partitions"])
def test_a_negative_array_count(version, where):
    topics = [("t", uuid.UUID(int=1), [(0, b"r")])]
    data = hand_request(version, topics=topics)
    marker = i32(1) + string("t", False) + i32(1)
    at = data.index(marker)
    if where == "topics":
        bad = data[:at] + i32(-2) + data[at + 4:]
    else:
        bad = data[:at + 7] + i32(-7) + data[at + 11:]
    feed_error(version, bad, match="negative array count")


@pytest.mark.parametrize("version", [0, 3, 8])
def test_negative_lengths(version):
    topics = [("t", uuid.UUID(int=1), [(0, b"")])]
    data = hand_request(version, topics=topics)
    assert data.endswith(i32(0) + i32(0))  # index, records length
    feed_error(version, data[:-4] + i32(-2), match="negative records length")
    assert produce_partitions(data[:-4] + i32(-1), version) == [("t", 0)]  # null records
    bad = hand_request(version, client_id=b"", topics=topics)
    assert bad[12:14] == i16(0)
    feed_error(version, bad[:12] + i16(-3) + bad[14:], match="negative client_id length")
    if version >= 3:
        bad = hand_request(version, transactional_id=b"", topics=topics)
        at = 12 + len(string("app-1", False))
        assert bad[at : at + 2] == i16(0)
        feed_error(version, bad[:at] + i16(-9) + bad[at + 2:], match="negative transactional_id")


@pytest.mark.parametrize("version", range(0, 13))
def test_a_bad_utf8_topic_name(version):
    topics = [("ok", uuid.UUID(int=1), [(0, b"r")]), (b"bad\xff\xfename", uuid.UUID(int=2), [(1, b"")])]
    feed_error(version, hand_request(version, topics=topics), match="not UTF-8")
    # straddling chunks: the name gathered first
    data = hand_request(version, topics=topics)
    reader = ProducePartitions(version)
    at = data.index(b"bad") + 3
    reader.feed(data[:at], [])
    with pytest.raises(ProtocolError, match="not UTF-8"):
        reader.feed(data[at:], [])
    assert reader.partitions == [("ok", 0)]


@pytest.mark.parametrize("version", range(0, 13))
def test_a_null_topic_name(version):
    topics = [(None, uuid.UUID(int=1), [(0, b"r")])]
    feed_error(version, hand_request(version, topics=topics), match="null topic name")


@pytest.mark.parametrize("version", FLEXIBLE)
def test_a_varint_longer_than_5_bytes(version):
    data = hand_request(version, topics=[("t", uuid.UUID(int=1), [(0, b"r")])],
                        header_tags={1: b""})
    at = 12 + len(string("app-1", False))
    assert data[at] == 1  # the header's tag count
    bad = data[:at] + b"\x81\x80\x80\x80\x80\x00" + data[at + 1:]
    feed_error(version, frame(bad[4:]), match="longer than 5 bytes")


def test_a_header_naming_another_api_or_version():
    feed_error(8, hand_request(8, api_key=1), match="api key 1")
    feed_error(8, hand_request(8, header_version=9), match="v9 request read as v8")
    feed_error(8, frame(b"\x00" * 3), match="truncated")


@pytest.mark.parametrize("version", [-1, MAX_VERSION + 1])
def test_unsupported_versions(version):
    with pytest.raises(ProtocolError, match="not supported"):
        ProducePartitions(version)


def test_a_negative_frame_size():
    with pytest.raises(ProtocolError, match="negative request size"):
        ProducePartitions(8).feed(i32(-5), [])
