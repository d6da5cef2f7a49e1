"""Per-topic byte counts of a Fetch response, read as it streams; topic ids
from a Metadata response.

``FetchTopicBytes`` is fed one framed Fetch response chunk by chunk, as it
streams to the client, and forwards every chunk unchanged. It reads the
partition headers and adds each partition's records length to its topic;
the records themselves are skipped by their length prefix, never gathered,
so a chunk inside them costs O(1). Chunk boundaries may fall anywhere.

Versions 0 to ``MAX_VERSION`` (kafka-python's ``FetchResponse.max_version``),
as FetchResponse.json lays them out: throttle_time_ms from v1, the
partition's last_stable_offset and aborted_transactions from v4,
log_start_offset from v5, the top-level error_code and session_id from v7,
preferred_read_replica from v11, flexible encodings (response header v1,
compact types, tagged fields) from v12, topics named by id (KIP-516) from
v13: ``topic_bytes`` is then keyed by ``uuid.UUID``, and ``metadata_topic_ids``
reads the names those ids stand for from the Metadata responses (v10+) a
client is given.
"""
from ._kafka import FetchResponse
from .errors import ProtocolError
from .metadata_leaders import metadata_layout
from .fields import (
    _ARRAY,
    _CARRAY,
    _INT32,
    _SKIP,
    _UUID,
    _VARINT,
    MAX_STRING,
    FieldReader,
    _tags,
    _topic_name,
)
from .wire import (
    read_array_length,
    read_int32,
    read_string,
    read_uvarint,
    skip_tagged_fields,
)

import uuid

MAX_VERSION = FetchResponse.max_version
FLEXIBLE_FROM = 12
TOPIC_ID_FROM = 13
METADATA_TOPIC_ID_FROM = 10  # Metadata v10+ gives each topic its id (KIP-516)

# Topic ids met lately, as UUIDs (making one costs more than the rest of a
# partition's reading); past this many, forgotten all at once.
IDS_KEPT = 4096
_IDS = {}


class FetchTopicBytes(FieldReader):
    """Reads the record bytes per topic of one framed Fetch response of
    ``api_version`` as its bytes go by.

    ``topic_bytes``: {topic: records bytes}, the topic a name (str) before
    version 13, its id (``uuid.UUID``) from 13 on; a null or empty records
    field counts 0, a topic answered with no records is still listed.
    ``done`` is set by the feed call that takes the frame's last byte.
    Malformed or truncated structure: ProtocolError, after which the reader
    must not be fed again."""

    __slots__ = ("topic_bytes",)
    what = "Fetch response"
    kind = "response"
    api = "Fetch"
    max_version = MAX_VERSION

    def __init__(self, api_version):
        FieldReader.__init__(self, api_version)
        self.topic_bytes = {}

    def _new_walk(self):
        return _walk_fetch(self.api_version, self.topic_bytes)

    def _read_whole(self, frame, out):
        counted = _whole(frame, self.api_version)
        if counted is None:
            return False
        self.topic_bytes.update(counted)
        return True


def fetch_topic_bytes(frame, api_version):
    """{topic: record bytes} of one whole framed Fetch response (see
    FetchTopicBytes)."""
    return FetchTopicBytes(api_version).read_frame(frame).topic_bytes


def _whole(buf, version):
    """{topic: record bytes} of a whole, well-formed frame read straight from
    the buffer (several times faster than the walker); None when anything is
    amiss, for the walker to say what."""
    flexible = version >= FLEXIBLE_FROM
    try:
        pos = skip_tagged_fields(buf, 8) if flexible else 8
        if version >= 1:
            pos += 4  # throttle_time_ms
        if version >= 7:
            pos += 6  # error_code, session_id
        topics, pos = read_array_length(buf, pos, flexible)
        if topics < -1:
            return None
        sizes = {}
        for _ in range(topics if topics > 0 else 0):
            if version >= TOPIC_ID_FROM:
                raw = bytes(buf[pos:pos + 16])
                if len(raw) < 16:
                    return None
                topic = _IDS.get(raw)
                if topic is None:
                    if len(_IDS) >= IDS_KEPT:
                        _IDS.clear()
                    topic = _IDS[raw] = uuid.UUID(bytes=raw)
                pos += 16
            else:
                topic, pos = read_string(buf, pos, flexible)
                if topic is None or (len(topic) > MAX_STRING // 4
                                     and len(topic.encode()) > MAX_STRING):
                    return None
            total = sizes.get(topic, 0)
            partitions, pos = read_array_length(buf, pos, flexible)
            if partitions < -1:
                return None
            for _ in range(partitions if partitions > 0 else 0):
                pos += 30 if version >= 5 else (22 if version >= 4 else 14)
                if version >= 4:
                    aborted, pos = read_array_length(buf, pos, flexible)
                    if aborted < -1:
                        return None
                    if not flexible:
                        pos += 16 * aborted if aborted > 0 else 0
                    else:
                        for _ in range(aborted if aborted > 0 else 0):
                            pos = skip_tagged_fields(buf, pos + 16)
                if version >= 11:
                    pos += 4  # preferred_read_replica
                if flexible:
                    n, pos = read_uvarint(buf, pos)
                    n -= 1
                else:
                    n, pos = read_int32(buf, pos)
                if n < -1:
                    return None
                if n > 0:
                    pos += n
                    total += n
                if flexible:
                    pos = skip_tagged_fields(buf, pos)
            sizes[topic] = total
            if flexible:
                pos = skip_tagged_fields(buf, pos)
        if flexible:
            pos = skip_tagged_fields(buf, pos)
    except ProtocolError:
        return None
    return sizes if pos == len(buf) else None


def _walk_fetch(version, topic_bytes):
    """The response header and FetchResponse body of ``version`` (see the
    module doc), adding each partition's records length to its topic."""
    flexible = version >= FLEXIBLE_FROM
    array = _CARRAY if flexible else _ARRAY
    if flexible:
        yield from _tags(4)  # correlation_id; header tagged fields
        skip = 0
    else:
        skip = 4  # correlation_id
    if version >= 1:
        skip += 4  # throttle_time_ms
    if version >= 7:
        skip += 6  # error_code, session_id
    for _ in range((yield skip << 4 | array)):  # responses
        if version >= TOPIC_ID_FROM:
            topic = yield _UUID
        else:
            topic = yield from _topic_name(flexible)
        total = topic_bytes.get(topic, 0)
        for _ in range((yield array)):  # partitions
            # partition_index, error_code, high_watermark
            skip = 14
            if version >= 4:
                skip += 8  # last_stable_offset
            if version >= 5:
                skip += 8  # log_start_offset
            if version >= 4:
                for _ in range((yield skip << 4 | array)):  # aborted_transactions
                    if flexible:  # producer_id, first_offset; tagged fields
                        yield from _tags(16)
                    else:
                        yield 16 << 4 | _SKIP
                skip = 0
            if version >= 11:
                skip += 4  # preferred_read_replica
            if flexible:
                n = yield skip << 4 | _VARINT  # records: N+1, 0 = null
                n = n - 1 if n else 0
                yield from _tags(n)  # the records, then the partition's tagged fields
            else:
                n = yield skip << 4 | _INT32  # records: N, -1 = null
                if n < -1:
                    raise ProtocolError("negative records length %d" % n)
                if n > 0:
                    yield n << 4 | _SKIP
            if n > 0:
                total += n
        topic_bytes[topic] = total
        if flexible:
            yield from _tags(0)  # topic tagged fields
    if flexible:
        yield from _tags(0)  # top-level tagged fields (NodeEndpoints from v16)


def metadata_topic_ids(frame, api_version):
    """{topic id: name} of one whole framed Metadata response; empty before
    v10 (no ids). Topics without a name or with the null id (all zeros) are
    left out. ProtocolError on a malformed frame."""
    if api_version < METADATA_TOPIC_ID_FROM:
        return {}
    ids = {}
    for topic in metadata_layout(frame, api_version).topics:  # partitions skipped, not read
        name = topic.name
        if name:
            topic_id = uuid.UUID(bytes=topic.topic_id)
            if topic_id.int:
                ids[topic_id] = name
    return ids


__all__ = ["FetchTopicBytes", "MAX_VERSION", "fetch_topic_bytes", "metadata_topic_ids"]
