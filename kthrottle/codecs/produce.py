"""Streaming read of the topic-partitions a Produce request writes to.

``ProducePartitions`` is fed one framed Produce request chunk by chunk, as it
streams to the broker, and forwards every chunk unchanged. It reads the
request header and the topic and partition fields; record batches are skipped
by their length prefix, never gathered, so a chunk inside one costs O(1).
Chunk boundaries may fall anywhere (inside the size prefix, an int, a varint,
a topic name).

Versions: 0 to ``MAX_VERSION`` (kafka-python's ``ProduceRequest.max_version``);
versions 0-2 are version 3 without transactional_id. Flexible versions (9+)
use compact strings, arrays and bytes, and tagged-field sections (KIP-482),
which are skipped. From version 13 topics are named by topic id (KIP-516):
the topic in ``partitions`` is then a ``uuid.UUID``, not a name.

``topic_bytes`` sums the record bytes each topic is sent (the partitions'
records lengths: the batches' sizes), for per-topic quotas.

It is a ``fields.FieldReader``, the chunk-driven walker it shares with
``fetch_topics.FetchTopicBytes`` and ``stream.StreamRewriter``.
"""
import uuid

from ._kafka import ProduceRequest
from .errors import ProtocolError
from .fields import (
    _ARRAY,
    _CARRAY,
    _INT16,
    _INT32,
    _SKIP,
    _UUID,
    _VARINT,
    FieldReader,
    _tags,
    _topic_name,
)
from struct import Struct, error as StructError

from .wire import (
    INT16,
    INT32,
    read_array_length,
    read_string,
    read_uvarint,
    skip_tagged_fields,
    string_length,
)

_INT16_INT16 = Struct(">hh")

PRODUCE = 0
MAX_VERSION = ProduceRequest.max_version
FLEXIBLE_FROM = 9  # request header v2, compact types, tagged fields
TRANSACTIONAL_ID_FROM = 3
TOPIC_ID_FROM = 13


class ProducePartitions(FieldReader):
    """Reads the (topic, partition) pairs of one framed Produce request of
    ``api_version`` as its bytes go by.

    ``partitions``: [(topic, partition_index)] in request order, filled in as
    they are read; ``topic`` is the name (str) before version 13, the topic id
    (``uuid.UUID``) from version 13 on. ``topic_bytes``: {topic: record
    bytes} (null and empty records count 0). ``done`` is set by the feed call
    that takes the frame's last byte.

    Null arrays count as empty; any other negative length, a null topic name
    or one that is not UTF-8, a length running past the frame's end, a header
    naming another API or version, or bytes after the request are a
    ProtocolError, after which the reader must not be fed again.
    """

    __slots__ = ("partitions", "topic_bytes")
    what = "Produce request"
    api = "Produce"
    max_version = MAX_VERSION

    def __init__(self, api_version):
        FieldReader.__init__(self, api_version)
        self.partitions = []
        self.topic_bytes = {}

    def _new_walk(self):
        return _walk_produce(self.api_version, self.partitions, self.topic_bytes)

    def _read_whole(self, frame, out):
        read = _whole(frame, self.api_version)
        if read is None:
            return False
        self.partitions.extend(read[0])
        self.topic_bytes.update(read[1])
        return True


def produce_partitions(frame, api_version):
    """[(topic, partition_index)] of one whole framed Produce request (see
    ProducePartitions). ProtocolError if it is malformed or shorter than its
    size prefix says, ValueError if it runs past it."""
    return ProducePartitions(api_version).read_frame(frame).partitions


def _whole(buf, version):
    """(partitions, topic bytes) of a whole, well-formed frame read straight
    from the buffer (several times faster than the walker); None when
    anything is amiss, for the walker to say what."""
    flexible = version >= FLEXIBLE_FROM
    try:
        api_key, api_version = _INT16_INT16.unpack_from(buf, 4)
        if api_key != PRODUCE or api_version != version:
            return None
        size = INT16.unpack_from(buf, 12)[0]
        if size < -1:
            return None
        pos = 14 + (size if size > 0 else 0)
        if flexible:
            pos = skip_tagged_fields(buf, pos)
        if version >= TRANSACTIONAL_ID_FROM:
            size, pos = string_length(buf, pos, flexible)
            if size < -1:
                return None
            if size > 0:
                pos += size
        pos += 6  # acks, timeout_ms
        topics, pos = read_array_length(buf, pos, flexible)
        if topics < -1:
            return None
        out = []
        sizes = {}
        for _ in range(max(topics, 0)):
            if version >= TOPIC_ID_FROM:
                topic = uuid.UUID(bytes=bytes(buf[pos:pos + 16]))
                pos += 16
            else:
                topic, pos = read_string(buf, pos, flexible)
                if topic is None:
                    return None
            count, pos = read_array_length(buf, pos, flexible)
            if count < -1:
                return None
            for _ in range(max(count, 0)):
                out.append((topic, INT32.unpack_from(buf, pos)[0]))
                pos += 4
                if flexible:
                    n, pos = read_uvarint(buf, pos)
                    length = n - 1
                else:
                    length = INT32.unpack_from(buf, pos)[0]
                    pos += 4
                if length < -1:
                    return None
                if length > 0:
                    pos += length
                    if pos > len(buf):
                        return None
                    sizes[topic] = sizes.get(topic, 0) + length
                if flexible:
                    pos = skip_tagged_fields(buf, pos)
            if flexible:
                pos = skip_tagged_fields(buf, pos)
        if flexible:
            pos = skip_tagged_fields(buf, pos)
    except (ProtocolError, StructError, ValueError, IndexError):
        return None
    return (out, sizes) if pos == len(buf) else None


def _walk_produce(version, partitions, topic_bytes):
    """The request header (v1, or v2 from FLEXIBLE_FROM) and ProduceRequest
    body of ``version``, appending (topic, index) to ``partitions`` and
    adding each partition's record bytes to ``topic_bytes[topic]``."""
    flexible = version >= FLEXIBLE_FROM
    api_key = yield _INT16
    if api_key != PRODUCE:
        raise ProtocolError("api key %d in a Produce request" % api_key)
    api_version = yield _INT16
    if api_version != version:
        raise ProtocolError("Produce v%d request read as v%d" % (api_version, version))
    # correlation_id; client_id: a nullable int16 string in every header version
    skip = _string16((yield 4 << 4 | _INT16), "client_id")
    if flexible:
        yield from _tags(skip)  # header tagged fields
        skip = 0
    if version >= TRANSACTIONAL_ID_FROM:
        if flexible:
            n = yield skip << 4 | _VARINT
            skip = n - 1 if n else 0
        else:
            skip = _string16((yield skip << 4 | _INT16), "transactional_id")
    # acks, timeout_ms; topic_data
    for _ in range((yield (skip + 6) << 4 | (_CARRAY if flexible else _ARRAY))):
        if version >= TOPIC_ID_FROM:
            topic = yield _UUID
        else:
            topic = yield from _topic_name(flexible)
        for _ in range((yield _CARRAY if flexible else _ARRAY)):  # partition_data
            index = yield _INT32
            partitions.append((topic, index))
            if flexible:
                n = yield _VARINT  # records: N+1, 0 = null
                n = n - 1 if n else 0
                yield from _tags(n)  # partition tagged fields
            else:
                n = yield _INT32  # records: N, -1 = null
                if n < -1:
                    raise ProtocolError("negative records length %d" % n)
                if n > 0:
                    yield n << 4 | _SKIP
            if n > 0:
                topic_bytes[topic] = topic_bytes.get(topic, 0) + n
        if flexible:
            yield from _tags(0)  # topic tagged fields
    if flexible:
        yield from _tags(0)  # top-level tagged fields


def _string16(n, what):
    """Bytes to skip for a nullable int16-length string of length ``n``."""
    if n < -1:
        raise ProtocolError("negative %s length %d" % (what, n))
    return n if n > 0 else 0
