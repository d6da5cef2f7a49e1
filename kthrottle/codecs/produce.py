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

``FieldReader`` is the chunk-driven walker behind it, shared with
``fetch_topics.FetchTopicBytes`` (the same reading of a Fetch response).
"""
import uuid

from ._kafka import ProduceRequest
from .errors import ProtocolError
from struct import Struct, error as StructError

from .wire import (
    INT16,
    INT32,
    read_array_length,
    read_string,
    read_uvarint,
    skip_tagged_fields,
)

_INT16_INT16 = Struct(">hh")

PRODUCE = 0
MAX_VERSION = ProduceRequest.max_version
FLEXIBLE_FROM = 9  # request header v2, compact types, tagged fields
TRANSACTIONAL_ID_FROM = 3
TOPIC_ID_FROM = 13
# Kafka's strings hold at most 32767 bytes, compact ones too.
MAX_STRING = 0x7FFF

# What the walker (a generator) yields: ``skip << 4 | kind``, to skip ``skip``
# bytes (forwarded unread), then read one value of this kind, which it is sent:
_VARINT = 0  # an unsigned varint (tag, size, compact string or bytes length N+1)
_COUNT = 1  # a tag count (unsigned varint), bounded by the bytes left
_CARRAY = 2  # a compact array count (N+1, 0 = null): answered N, or 0 for null
_INT16 = 3
_INT32 = 4
_ARRAY = 5  # an int32 array count: answered N, or 0 for null (-1)
_UUID = 6  # 16 bytes: answered a uuid.UUID
_TEXT = 7  # here ``skip`` is the byte count of a UTF-8 string to read (no skip)
_SKIP = 8  # nothing: only the skip (answered None)
_WIDTH = {_INT16: 2, _INT32: 4, _ARRAY: 4, _UUID: 16}
# The walker returns at the end of the request, which must be the frame's end.


class FieldReader:
    """Walks one framed message chunk by chunk with a walker generator (the
    ``_VARINT`` ... ``_SKIP`` requests above), forwarding every chunk
    unchanged. Subclasses make the walker (``_new_walk``) and may read a
    whole frame straight (``_read_whole``); ``done`` is set by the feed call
    that takes the frame's last byte. ``what`` and ``kind`` name the message
    in errors."""

    __slots__ = ("done", "api_version", "_walk", "_req", "_want", "_pos", "_end",
                 "_size", "_varint", "_shift", "_buf")
    what = "message"
    kind = "request"  # or "response"

    def __init__(self, api_version):
        self.done = False
        self.api_version = api_version
        self._walk = None  # made on the first chunk that is not a whole frame
        self._req = None  # what the walker waits for
        self._want = 0  # the byte count of a _TEXT read
        self._pos = 0  # bytes of the frame fed so far
        self._end = None  # the frame's length, size prefix included, once known
        self._size = b""  # the size prefix, while it straddles chunks
        self._varint = 0  # a varint straddling chunks: value so far
        self._shift = 0  # and the shift of its next byte (> 0 while it straddles)
        self._buf = None  # a fixed-size value straddling chunks: its bytes so far

    def _new_walk(self):
        raise NotImplementedError

    def _read_whole(self, frame):
        """Read a whole well-formed frame straight; False to leave it to the
        walker (which then says what is amiss)."""
        return False

    def feed(self, chunk, out):
        """chunk: the next bytes of ONE framed message (bytes or
        memoryview), starting with its 4-byte size prefix on the first call;
        chunks never extend past the frame's end. Appends ``chunk`` itself to
        ``out`` (forwarded unchanged, not copied; an empty chunk is ignored).
        Raises ProtocolError on a malformed or truncated structure, ValueError
        on a chunk past the frame's end."""
        n = len(chunk)
        if not n:
            return
        if self.done:
            raise ValueError("the frame is already complete")
        base = self._pos  # frame offset of chunk[0]
        if not base and n >= 4 and INT32.unpack_from(chunk, 0)[0] + 4 == n:
            # the whole frame in one chunk (the common case): read it straight
            if self._read_whole(chunk):
                self._pos = n
                self.done = True
                out.append(chunk)
                return
        if self._walk is None:
            self._walk = self._new_walk()
            self._req = next(self._walk)
        end = self._end
        i = 0  # where the walk resumes in this chunk
        if end is None:  # the size prefix
            i = 4 - len(self._size)
            self._size += bytes(chunk[:i])
            if len(self._size) < 4:
                self._pos = base + n
                out.append(chunk)
                return
            size = INT32.unpack(self._size)[0]
            if size < 0:
                raise ProtocolError("negative %s size %d" % (self.kind, size))
            end = self._end = size + 4
        if base + n > end:
            raise ValueError("chunk runs %d bytes past the end of the frame" % (base + n - end))
        self._pos = base + n

        req = self._req
        if req >> 4 > n - i:  # the hot path: a skip (inside records) covers the chunk
            self._req = req - ((n - i) << 4)
            out.append(chunk)
            return  # cannot be the frame's end: the skip was checked to fit in it
        view = chunk if chunk.__class__ is memoryview else memoryview(chunk)
        send = self._walk.send
        left = end - base  # frame bytes from chunk[0] on
        shift = self._shift
        try:
            while True:
                skip = req >> 4
                if skip:
                    if skip > n - i:
                        req -= (n - i) << 4
                        i = n
                        break
                    i += skip
                    req &= 15
                if req == _SKIP:
                    req = send(None)
                else:
                    if i == n:
                        break
                    if req <= _CARRAY:  # a varint
                        value = view[i]
                        i += 1
                        if value >= 0x80 or shift:  # of several bytes
                            b = value
                            value = (self._varint if shift else 0) | (b & 0x7F) << shift
                            while b >= 0x80:
                                shift += 7
                                if shift > 28:
                                    raise ProtocolError("varint longer than 5 bytes at offset %d"
                                                        % (base + i))
                                if i == n:
                                    break
                                b = view[i]
                                i += 1
                                value |= (b & 0x7F) << shift
                            if b >= 0x80:  # the chunk ends inside it
                                self._varint = value
                                break
                            shift = 0
                        if req:  # a count: each element takes a byte or more
                            if req == _CARRAY:
                                value = value - 1 if value else 0
                            if value > left - i:
                                raise ProtocolError("count of %d at offset %d runs past the frame"
                                                    % (value, base + i))
                    else:  # a fixed number of bytes
                        want = self._want if req == _TEXT else _WIDTH[req]
                        buf = self._buf
                        if buf is None and n - i >= want:
                            raw = view[i : i + want]
                            i += want
                        else:  # straddling chunks: gathered
                            if buf is None:
                                buf = self._buf = bytearray()
                            take = min(want - len(buf), n - i)
                            buf += view[i : i + take]
                            i += take
                            if len(buf) < want:
                                break
                            raw = buf
                            self._buf = None
                        if req == _INT32 or req == _ARRAY:
                            value = INT32.unpack(raw)[0]
                            if req == _ARRAY:
                                if value < 0:
                                    if value != -1:
                                        raise ProtocolError("negative array count %d at offset %d"
                                                            % (value, base + i - 4))
                                    value = 0
                                elif value > left - i:
                                    raise ProtocolError("count of %d at offset %d runs past the frame"
                                                        % (value, base + i))
                        elif req == _INT16:
                            value = INT16.unpack(raw)[0]
                        elif req == _UUID:
                            value = uuid.UUID(bytes=bytes(raw))
                        else:
                            try:
                                value = str(raw, "utf-8")
                            except UnicodeDecodeError:
                                raise ProtocolError("topic name at offset %d is not UTF-8"
                                                    % (base + i - want)) from None
                    req = send(value)
                skip = req >> 4
                if skip > left - i:
                    raise ProtocolError("truncated %s: %d bytes at offset %d run past its end at %d"
                                        % (self.kind, skip, base + i, end))
                if req & 15 == _TEXT:
                    self._want = skip
                    req = _TEXT
        except StopIteration:  # the walker reached the end of the request, at i
            if base + i != end:
                raise ProtocolError("%d bytes after the end of the %s"
                                    % (end - base - i, self.what)) from None
            self._req = _SKIP
            self._shift = 0
            self.done = True
            out.append(chunk)
            return
        self._req = req
        self._shift = shift
        if base + n == end:
            raise ProtocolError("truncated %s: the frame ends at %d inside its structure"
                                % (self.kind, end))
        out.append(chunk)



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

    def __init__(self, api_version):
        if not 0 <= api_version <= MAX_VERSION:
            raise ProtocolError("Produce v%d is not supported (versions 0 to %d are)"
                                % (api_version, MAX_VERSION))
        FieldReader.__init__(self, api_version)
        self.partitions = []
        self.topic_bytes = {}

    def _new_walk(self):
        return _walk_produce(self.api_version, self.partitions, self.topic_bytes)

    def _read_whole(self, frame):
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
    reader = ProducePartitions(api_version)
    reader.feed(frame, [])
    if not reader.done:
        raise ProtocolError("truncated request: the frame is shorter than its size prefix")
    return reader.partitions


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
            if flexible:
                size, pos = read_uvarint(buf, pos)
                size -= 1
            else:
                size = INT16.unpack_from(buf, pos)[0]
                pos += 2
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


def _tags(skip):
    """Skip ``skip`` bytes, then a tagged-field section (KIP-482)."""
    for _ in range((yield skip << 4 | _COUNT)):
        yield _VARINT  # tag
        yield (yield _VARINT) << 4 | _SKIP  # size, then the value


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
            if flexible:
                n = (yield _VARINT) - 1
            else:
                n = yield _INT16
            if n < 0:
                raise ProtocolError("null topic name" if n == -1
                                    else "negative topic name length %d" % n)
            if n > MAX_STRING:
                raise ProtocolError("topic name of %d bytes" % n)
            topic = (yield n << 4 | _TEXT) if n else ""
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
