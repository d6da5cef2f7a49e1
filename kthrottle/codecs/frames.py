"""Kafka framing: 4-byte big-endian size, then a request or response.

No I/O here (h11 style): bytes go in through ``FrameReader.feed`` and whole
frames come out, each as a memoryview that still includes its size prefix so
that it can be forwarded exactly as it arrived.
"""
from typing import NamedTuple

from .errors import ProtocolError
from .wire import INT16, INT16_INT16_INT32, INT32, read_uvarint, skip_tagged_fields

# Kafka's socket.request.max.bytes default (100 MiB): larger requests are
# refused by brokers too, so no legitimate client sends them.
DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024

# api_key(2) + api_version(2) + correlation_id(4) + client_id length(2)
_MIN_REQUEST_SIZE = 10
# correlation_id(4)
_MIN_RESPONSE_SIZE = 4


class FrameReader:
    """Cuts a byte stream into whole frames.

    Raises ProtocolError on a negative size, a size above ``max_frame_size``
    or a frame too short to hold a header (``min_frame_size``).
    """

    __slots__ = ("max_frame_size", "min_frame_size", "_pending", "_have", "_need")

    def __init__(self, max_frame_size=DEFAULT_MAX_FRAME_SIZE, min_frame_size=_MIN_RESPONSE_SIZE):
        self.max_frame_size = max_frame_size
        self.min_frame_size = min_frame_size
        self._pending = []  # chunks of an incomplete frame
        self._have = 0  # bytes in _pending
        self._need = 4  # bytes needed in _pending before a frame can complete

    @property
    def buffered(self):
        """Bytes received that do not yet make a whole frame."""
        return self._have

    def eof(self):
        """The peer closed its side; a partial frame left over is an error."""
        if self._have:
            raise ProtocolError(
                "connection closed in the middle of a frame (%d bytes of %d)"
                % (self._have, self._need)
            )

    def feed(self, data):
        """Take bytes from the peer; return the whole frames now available."""
        if self._pending:
            self._pending.append(data)
            self._have += len(data)
            if self._have < self._need:
                return ()
            data = b"".join(self._pending)
            self._pending = []
            self._have = 0
        n = len(data)
        pos = 0
        frames = []
        view = memoryview(data)
        max_size = self.max_frame_size
        while n - pos >= 4:
            size = INT32.unpack_from(data, pos)[0]
            if size > max_size:
                raise ProtocolError(
                    "frame of %d bytes exceeds the maximum of %d bytes" % (size, max_size)
                )
            if size < self.min_frame_size:
                raise ProtocolError("frame size %d is too small for a header" % size)
            end = pos + 4 + size
            if end > n:
                self._need = end - pos
                break
            frames.append(view[pos:end])
            pos = end
        else:
            self._need = 4
        if pos < n:
            self._pending.append(bytes(view[pos:]))
            self._have = n - pos
        return frames


def request_frame_reader(max_frame_size=DEFAULT_MAX_FRAME_SIZE):
    return FrameReader(max_frame_size, _MIN_REQUEST_SIZE)


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
