"""The chunk-driven field walker behind the streaming readers of framed messages.

``FieldReader`` is fed one framed message chunk by chunk, as it streams through
the proxy, and reads the few fields it needs as they go by; what lies between
(records, above all) is skipped by its length prefix, never gathered, so a
chunk inside it costs O(1). Chunk boundaries may fall anywhere (inside the
size prefix, an int, a varint, a string). What is read is said by a walker, a
generator made per message (``_new_walk``), which yields what to skip and
read next and is sent each value read; this module's loop feeds it.

It serves ``produce.ProducePartitions`` (a Produce request's topics and
partitions), ``fetch_topics.FetchTopicBytes`` (a Fetch response's bytes per
topic) and ``stream.StreamRewriter`` (the NodeEndpoints tail of a Fetch,
Produce, ShareFetch or ShareAcknowledge response, rewritten as it streams).
"""
import uuid

from .errors import ProtocolError
from .wire import INT16, INT32

# Kafka's strings hold at most 32767 bytes, compact ones too.
MAX_STRING = 0x7FFF

# What a walker yields: ``skip << 4 | kind``, to skip ``skip`` bytes (forwarded
# unread), then read one value of this kind, which it is sent; or ``_STRING +
# n`` to read a UTF-8 string of ``n`` bytes (``n`` > 0), which it is sent as a str:
_VARINT = 0  # an unsigned varint (tag, size, compact string or bytes length N+1)
_COUNT = 1  # a tag count (unsigned varint), bounded by the bytes left
_CARRAY = 2  # a compact array count (N+1, 0 = null): answered N, or 0 for null
_INT16 = 3
_INT32 = 4
_ARRAY = 5  # an int32 array count: answered N, or 0 for null (-1)
_UUID = 6  # 16 bytes: answered a uuid.UUID
_TEXT = 7  # (the loop's own) the string asked for as _STRING + n
_SKIP = 8  # nothing: only the skip (answered None)
_WIDTH = {_INT16: 2, _INT32: 4, _ARRAY: 4, _UUID: 16}
# Above any skip a frame holds (2**31 bytes): the loop tells a string from the
# others only when the skip seems to run past the frame, a test it makes anyway.
_STRING = 1 << 40


class FieldReader:
    """Walks one framed message chunk by chunk with a walker generator (the
    ``_VARINT`` ... ``_SKIP`` requests above), forwarding every chunk
    unchanged until the walker returns. ``done`` is set by the feed call
    that takes the frame's last byte.

    Subclasses make the walker (``_new_walk``) and may take a whole frame
    in one chunk another way (``_read_whole``); ``_walked`` takes the frame
    from where the walker returned (a reader: its end; by default that
    must be the frame's end). ``what`` and ``kind`` name the message in
    errors, ``truncated`` and ``past_end`` word them (``%`` a mapping of
    ``kind``, ``skip``, ``at`` and ``end``). A reader of an ``api`` takes
    its versions 0 to ``max_version`` (an ``api_version`` is checked)."""

    __slots__ = ("done", "api_version", "_walk", "_req", "_want", "_pos", "_end",
                 "_size", "_varint", "_shift", "_buf")
    what = "message"
    kind = "request"  # or "response"
    truncated = "truncated %(kind)s: the frame ends at %(end)d inside its structure"
    past_end = "truncated %(kind)s: %(skip)d bytes at offset %(at)d run past its end at %(end)d"
    api = None  # "Produce"
    max_version = None

    def __init__(self, api_version=None):
        if api_version is not None and not 0 <= api_version <= self.max_version:
            raise ProtocolError("%s v%d is not supported (versions 0 to %d are)"
                                % (self.api, api_version, self.max_version))
        self.done = False
        self.api_version = api_version
        self._walk = None  # the walker, made once the size prefix is in
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

    def _read_whole(self, frame, out):
        """Take a whole frame fed in one chunk another way (faster than the
        walker: a reader reads it straight): True once taken, and then it
        goes on as it came unless this forwarded something else (and set
        ``done``); False to leave it to the walker (which then says what is
        amiss)."""
        return False

    def _frame_end(self, size):
        """The frame's length from its size prefix, checked."""
        if size < 0:
            raise ProtocolError("negative %s size %d" % (self.kind, size))
        return size + 4

    def _walked(self, chunk, view, base, i, out):
        """The walker returned at ``chunk[i]`` (frame offset ``base + i``):
        a reader's message ends there, which must be the frame's end. Each
        chunk fed after that comes here too, at ``i`` 0 (the walker, spent,
        returns at once)."""
        end = self._end
        if base + i != end:
            raise ProtocolError("%d bytes after the end of the %s"
                                % (end - base - i, self.what)) from None
        self.done = True
        out.append(chunk)

    def read_frame(self, frame):
        """Read one whole framed message; ProtocolError if it is malformed or
        shorter than its size prefix says, ValueError if it runs past it."""
        self.feed(frame, [])
        if not self.done:
            raise ProtocolError("truncated %s: the frame is shorter than its size prefix"
                                % self.kind)
        return self

    def feed(self, chunk, out):
        """chunk: the next bytes of ONE framed message (bytes or
        memoryview), starting with its 4-byte size prefix on the first call;
        chunks never extend past the frame's end. Appends to ``out`` what to
        forward (a reader: ``chunk`` itself, unchanged, not copied; an empty
        chunk is ignored). Raises ProtocolError on a malformed or truncated
        structure, ValueError on a chunk past the frame's end."""
        n = len(chunk)
        if not n:
            return
        if self.done:
            raise ValueError("the frame is already complete")
        base = self._pos  # frame offset of chunk[0]
        if (not base and n >= 4 and INT32.unpack_from(chunk, 0)[0] + 4 == n
                and self._read_whole(chunk, out)):  # the whole frame in one chunk (the common case)
            if not self.done:  # as it came
                self._pos = n
                self.done = True
                out.append(chunk)
            return
        end = self._end
        i = 0  # where the walk resumes in this chunk
        if end is None:  # the size prefix
            i = 4 - len(self._size)
            self._size += bytes(chunk[:i])
            if len(self._size) < 4:
                self._pos = base + n
                out.append(chunk)
                return
            end = self._end = self._frame_end(INT32.unpack(self._size)[0])
        if base + n > end:
            raise ValueError("chunk runs %d bytes past the end of the frame" % (base + n - end))
        self._pos = base + n

        req = self._req
        if req is None:  # the walk starts
            self._walk = self._new_walk()
            req = next(self._walk)
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
                if req <= _CARRAY:  # a varint (the most asked for, tested first)
                    if i == n:
                        break
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
                    req = send(value)
                elif req == _SKIP:
                    req = send(None)
                else:  # a fixed number of bytes
                    if i == n:
                        break
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
                if req >> 4 > left - i:  # past the frame's end, or a string asked for
                    skip = req - _STRING if req > _STRING else req >> 4
                    if skip > left - i:
                        raise ProtocolError(self.past_end % {"kind": self.kind, "skip": skip,
                                                             "at": base + i, "end": end})
                    self._want = skip
                    req = _TEXT
        except StopIteration:  # the walker returned, at i
            self._req = _SKIP
            self._shift = 0
            self._walked(chunk, view, base, i, out)
            return
        self._req = req
        self._shift = shift
        if base + n == end:
            raise ProtocolError(self.truncated % {"kind": self.kind, "end": end})
        out.append(chunk)


def _tags(skip):
    """Skip ``skip`` bytes, then a tagged-field section (KIP-482)."""
    for _ in range((yield skip << 4 | _COUNT)):
        yield _VARINT  # tag
        yield (yield _VARINT) << 4 | _SKIP  # size, then the value


def _topic_name(flexible):
    """A topic name: a compact string when ``flexible``, else an int16 one;
    neither null nor longer than MAX_STRING."""
    n = (yield _VARINT) - 1 if flexible else (yield _INT16)
    if n < 0:
        raise ProtocolError("null topic name" if n == -1
                            else "negative topic name length %d" % n)
    if n > MAX_STRING:
        raise ProtocolError("topic name of %d bytes" % n)
    return (yield _STRING + n) if n else ""
