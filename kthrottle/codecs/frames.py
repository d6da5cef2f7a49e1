"""Kafka framing: 4-byte big-endian size, then a request or response.

No I/O here (h11 style): bytes go in through ``feed`` and come out as what
to forward, cut at frame boundaries. Frames keep their size prefix so they
can be forwarded exactly as they arrived.
"""
from typing import NamedTuple

from .errors import ProtocolError
from .wire import INT16, INT16_INT16_INT32, INT32, read_uvarint, skip_tagged_fields

# Kafka's socket.request.max.bytes default (100 MiB): larger requests are
# refused by brokers too, so no legitimate client sends them.
DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024

# api_key(2) + api_version(2) + correlation_id(4) + client_id length(2)
MIN_REQUEST_SIZE = 10
# correlation_id(4)
MIN_RESPONSE_SIZE = 4


# How much of a frame the cutter gathers before asking what to do with it:
# enough for any request header with a sane client_id, and for the Produce
# fields after it (transactional_id, acks).
HEAD_SIZE = 512

# What to do with a frame once its head has been seen.
PASS = 0  # forward its bytes as they arrive (cut-through)
WHOLE = 1  # gather the whole frame and hand it to on_whole
DROP = 2  # swallow it


class FrameCutter:
    """Cut-through framing for a proxy.

    ``feed(data, out)`` appends to ``out`` what should be written to the other
    side, in order. At each frame start, once ``min(frame size, HEAD_SIZE)``
    bytes are in, ``on_head(head, frame_len)`` decides: PASS streams the frame
    on as its bytes arrive, without waiting for its end or copying it (a
    bytes object of the head's length instead of PASS: the same, with that
    head forwarded in place of the original, to patch a field in it); WHOLE
    gathers it and appends whatever ``on_whole(frame)`` returns (None: nothing);
    DROP swallows it. Lengths include the 4-byte size prefix.

    Raises ProtocolError on a negative size, a size above ``max_frame_size``
    or a frame too short to hold a header (``min_frame_size``).
    """

    __slots__ = ("on_head", "on_whole", "max_frame_size", "min_frame_size",
                 "stop_after_frame", "rest", "_head", "_mode", "_left", "_whole")

    def __init__(self, on_head, on_whole, max_frame_size=DEFAULT_MAX_FRAME_SIZE,
                 min_frame_size=MIN_RESPONSE_SIZE):
        self.on_head = on_head
        self.on_whole = on_whole
        self.max_frame_size = max_frame_size
        self.min_frame_size = min_frame_size
        self._head = bytearray()  # start of a frame whose head straddles reads
        self._mode = PASS  # mode of the frame in progress
        self._left = 0  # bytes of the frame in progress still to come
        self._whole = None  # a WHOLE frame being gathered
        # Set (by on_head, say) to stop at the end of the frame in progress:
        # feed then leaves the bytes after it unread, in ``rest``, for the
        # caller to feed again later (a throttled client is not read further).
        self.stop_after_frame = False
        self.rest = None

    @property
    def buffered(self):
        """Bytes held back: a partial head or a partial WHOLE frame."""
        return len(self._head) + (len(self._whole) if self._whole is not None else 0)

    @property
    def at_boundary(self):
        """True between frames (nothing of a next frame seen yet)."""
        return not self._left and not self._head

    def eof(self):
        """The peer closed its side; a partial frame left over is an error."""
        if not self.at_boundary:
            raise ProtocolError(
                "connection closed in the middle of a frame (%d bytes missing)"
                % max(self._left, 1)
            )

    def _size(self, buf, pos):
        size = INT32.unpack_from(buf, pos)[0]
        if size > self.max_frame_size:
            raise ProtocolError(
                "frame of %d bytes exceeds the maximum of %d bytes" % (size, self.max_frame_size)
            )
        if size < self.min_frame_size:
            raise ProtocolError("frame size %d is too small for a header" % size)
        return size + 4

    def _start(self, frame_start, total, available, out):
        """Decide on a frame whose head is ``frame_start[:HEAD_SIZE]``; ``available``
        bytes of it are in ``frame_start``. Returns how many of them were used."""
        head_len = total if total < HEAD_SIZE else HEAD_SIZE
        mode = self.on_head(frame_start[:head_len], total)
        skip = 0
        if mode.__class__ is not int:  # PASS with a patched head
            if len(mode) != head_len:
                raise ValueError("a patched head must keep its length")
            out.append(mode)
            mode = PASS
            skip = head_len
        if available >= total:
            if mode == PASS:
                if skip < total:
                    out.append(frame_start[skip:total])
            elif mode == WHOLE:
                result = self.on_whole(frame_start[:total])
                if result is not None:
                    out.append(result)
            return total
        if mode == PASS:
            if skip < available:
                out.append(frame_start[skip:available])
        elif mode == WHOLE:
            self._whole = bytearray(frame_start[:available])
        self._mode = mode
        self._left = total - available
        return available

    def feed(self, data, out):
        view = memoryview(data)
        n = len(data)
        pos = 0
        if self._head:
            head = self._head
            take = min(HEAD_SIZE - len(head), n)
            head += view[:take]
            if len(head) < 4:
                return out
            total = self._size(head, 0)
            head_len = total if total < HEAD_SIZE else HEAD_SIZE
            if len(head) < head_len:
                return out
            pos = take - (len(head) - head_len)  # give back what the head did not need
            frame_start = bytes(head[:head_len])
            head.clear()
            self._start(frame_start, total, head_len, out)
        while pos < n:
            left = self._left
            if not left and self.stop_after_frame:
                self.stop_after_frame = False
                self.rest = bytes(view[pos:])
                break
            if left:
                take = n - pos if n - pos < left else left
                mode = self._mode
                if mode == PASS:
                    out.append(view[pos : pos + take])
                elif mode == WHOLE:
                    self._whole += view[pos : pos + take]
                pos += take
                self._left = left - take
                if left == take and mode == WHOLE:
                    frame, self._whole = bytes(self._whole), None
                    result = self.on_whole(frame)
                    if result is not None:
                        out.append(result)
                continue
            available = n - pos
            if available >= 4:
                total = self._size(data, pos)
                if available >= total or available >= HEAD_SIZE:
                    pos += self._start(view[pos:], total, available, out)
                    continue
            self._head += view[pos:]
            break
        return out


class FrameReader:
    """Cuts a byte stream into whole frames (each a bytes-like object that
    includes its size prefix). Raises ProtocolError like FrameCutter."""

    __slots__ = ("_cutter",)

    def __init__(self, max_frame_size=DEFAULT_MAX_FRAME_SIZE, min_frame_size=MIN_RESPONSE_SIZE):
        self._cutter = FrameCutter(_whole, _same, max_frame_size, min_frame_size)

    @property
    def buffered(self):
        return self._cutter.buffered

    def eof(self):
        self._cutter.eof()

    def feed(self, data):
        """Take bytes from the peer; return the whole frames now available."""
        return self._cutter.feed(data, [])


def _whole(head, frame_len):
    return WHOLE


def _same(frame):
    return frame


class RequestHeader(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None


def parse_request_header(frame):
    """Read the header of a framed request (v1 and v2 share this prefix)."""
    try:
        api_key, api_version, correlation_id = INT16_INT16_INT32.unpack_from(frame, 4)
        n = INT16.unpack_from(frame, 12)[0]
    except Exception:
        raise ProtocolError("truncated request header") from None
    if n < 0:
        client_id = None
    else:
        if 14 + n > len(frame):
            raise ProtocolError("truncated request header client_id")
        try:
            client_id = bytes(frame[14 : 14 + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("request client_id is not UTF-8") from None
    if api_key < 0 or api_version < 0:
        raise ProtocolError("invalid api key %d version %d" % (api_key, api_version))
    return RequestHeader(api_key, api_version, correlation_id, client_id)


def request_body_offset(frame, flexible):
    """Offset of the request body in a framed request (header v1 or v2)."""
    n = INT16.unpack_from(frame, 12)[0]
    pos = 14 + max(n, 0)
    if flexible:
        pos = skip_tagged_fields(frame, pos)
    return pos


def fetch_max_bytes_offset(frame, api_version):
    """Offset of ``max_bytes`` in a framed Fetch request (v3+), else None."""
    if api_version < 3:
        return None
    try:
        pos = request_body_offset(frame, api_version >= 12)
    except Exception:
        raise ProtocolError("truncated Fetch request header") from None
    # v3-14: replica_id, max_wait_ms, min_bytes, max_bytes; v15+ moved
    # replica_id into a tagged field (KIP-903)
    pos += 8 if api_version >= 15 else 12
    if pos + 4 > len(frame):
        raise ProtocolError("truncated Fetch request")
    return pos


def fetch_replica_id(frame, api_version):
    """``replica_id`` of a framed Fetch request: a broker's id when a follower
    replicates, -1 for a consumer. From v15 it sits in a tagged field at the end
    (KIP-903), which only brokers set: -1 is returned for those versions."""
    if api_version >= 15:
        return -1
    try:
        pos = request_body_offset(frame, api_version >= 12)
        return INT32.unpack_from(frame, pos)[0]
    except Exception:
        raise ProtocolError("truncated Fetch request") from None


def response_correlation_id(frame):
    return INT32.unpack_from(frame, 4)[0]


def response_body_offset(frame, flexible_header):
    """Offset of the response body in a framed response (header v0 or v1)."""
    if flexible_header:
        return skip_tagged_fields(frame, 8)
    return 8


def produce_acks(frame, api_version):
    """The ``acks`` of a framed Produce request (0 means: no response comes)."""
    try:
        flexible = api_version >= 9
        pos = request_body_offset(frame, flexible)
        if api_version >= 3:  # transactional_id, nullable string
            if flexible:
                n, pos = read_uvarint(frame, pos)
                pos += max(n - 1, 0)
            else:
                n = INT16.unpack_from(frame, pos)[0]
                pos += 2 + max(n, 0)
        return INT16.unpack_from(frame, pos)[0]
    except ProtocolError:
        raise
    except Exception:
        raise ProtocolError("truncated Produce request") from None
