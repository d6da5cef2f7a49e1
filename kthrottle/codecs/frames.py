"""Kafka framing: 4-byte big-endian size, then a request or response.

No I/O here (h11 style): bytes go in through ``feed`` and come out as what
to forward, cut at frame boundaries. Frames keep their size prefix so they
can be forwarded exactly as they arrived.
"""
from struct import error as StructError

from .errors import ProtocolError
from .wire import INT32, skip_tagged_fields

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
DEFER = 3  # not now: stop before this frame, leaving it and what follows in ``rest``


_DEFERRED = -1  # _start's answer for DEFER


class NeedHead:
    """on_head's answer when the head must be longer: call again once
    ``size`` bytes of the frame are in (at most the frame's length)."""

    __slots__ = ("size",)

    def __init__(self, size):
        self.size = size


class FrameCutter:
    """Cut-through framing for a proxy.

    ``feed(data, out)`` appends to ``out`` what should be written to the other
    side, in order. At each frame start, once ``min(frame size, HEAD_SIZE)``
    bytes are in, ``on_head(head, frame_len)`` decides:

    - PASS streams the frame on as its bytes arrive, without waiting for its
      end or copying it;
    - a bytes object of the head's length: the same, with that head forwarded
      in place of the original (to patch a field in it);
    - WHOLE gathers it and appends whatever ``on_whole(frame)`` returns (None:
      nothing);
    - DROP swallows it;
    - NeedHead(n): ask again once n bytes of the frame are in;
    - DEFER: stop before the frame; its bytes and everything after them are
      left unread in ``rest``, for the caller to feed again later (the head
      is then asked about again);
    - a stream object (with ``feed(chunk, out)``), or a ``(patched head,
      stream)`` pair: every byte of the frame goes through the stream's feed,
      which appends what to forward (a rewrite that keeps the frame's length).

    Lengths include the 4-byte size prefix. Raises ProtocolError on a
    negative size, a size above ``max_frame_size`` or a frame too short to
    hold a header (``min_frame_size``).
    """

    __slots__ = ("on_head", "on_whole", "max_frame_size", "min_frame_size",
                 "stop_after_frame", "rest", "head", "_need", "mode", "left", "_whole",
                 "_frame_out", "_frame_len")

    def __init__(self, on_head, on_whole, max_frame_size=DEFAULT_MAX_FRAME_SIZE,
                 min_frame_size=MIN_RESPONSE_SIZE):
        self.on_head = on_head
        self.on_whole = on_whole
        self.max_frame_size = max_frame_size
        self.min_frame_size = min_frame_size
        # Read freely; changed only by feed and the verbs below (went_by,
        # pass_rest, skip):
        self.head = bytearray()  # the start of a frame whose head straddles reads
        self.mode = PASS  # what is done with the frame in progress
        self.left = 0  # bytes of the frame in progress still to come
        self._need = HEAD_SIZE  # how much of the frame the head must hold
        self._whole = None  # a WHOLE frame being gathered
        # Set (by on_head, say) to stop at the end of the frame in progress:
        # feed then leaves the bytes after it unread, in ``rest``, for the
        # caller to feed again later (a throttled client is not read further).
        self.stop_after_frame = False
        self.rest = None
        self._frame_out = 0  # where in ``out`` the frame in progress starts
        self._frame_len = 0  # and its length

    @property
    def buffered(self):
        """Bytes held back: a partial head or a partial WHOLE frame."""
        return len(self.head) + (len(self._whole) if self._whole is not None else 0)

    @property
    def at_boundary(self):
        """True between frames (nothing of a next frame seen yet)."""
        return not self.left and not self.head

    @property
    def passing(self):
        """Bytes still to come of the frame in progress when they are to be
        forwarded exactly as they arrive (PASS: no stream reads them, nothing
        gathers them, nothing stops after the frame); 0 otherwise."""
        mode = self.mode
        if mode.__class__ is int and mode == PASS and not self.stop_after_frame:
            return self.left
        return 0

    def skip(self, nbytes):
        """``nbytes`` of the frame in progress were forwarded without going
        through ``feed`` (socket to socket), after ``passing`` offered them
        (a stop after the frame may have been asked for since)."""
        mode = self.mode
        left = self.left if mode.__class__ is int and mode == PASS else 0
        if not 0 <= nbytes <= left:
            raise ValueError("skip(%d) with %d bytes of a passed frame left" % (nbytes, left))
        self.left = left - nbytes

    def went_by(self, nbytes):
        """``nbytes`` of the frame in progress (at most ``left``) went on as
        they came without ``feed``: a caller's short way for a frame it
        passes on, or whose stream lets them through unchanged."""
        self.left -= nbytes

    def pass_rest(self, left, frame_len=0):
        """A frame whose start went by without ``feed`` passes on as it
        comes (PASS), ``left`` bytes of it still to come (0: it is through);
        ``frame_len``: its length, for ``take_partial`` (whose output then
        starts with the frame)."""
        self.mode = PASS
        self.left = left
        self._frame_len = frame_len
        self._frame_out = 0

    def take_partial(self, out, limit):
        """The bytes of a frame still in progress that ``feed`` put in
        ``out``, cut from it, when the frame is at most ``limit`` bytes long
        in all (None otherwise): for a caller that sends a frame only once it
        is whole. Give them back first in the next ``out``."""
        if not self.left or self._whole is not None or self._frame_len > limit:
            return None
        mode = self.mode
        if mode == DROP:
            return None
        start = self._frame_out
        partial = out[start:]
        del out[start:]
        self._frame_out = 0  # the next output starts with them
        return partial

    def eof(self):
        """The peer closed its side; a partial frame left over is an error."""
        if not self.at_boundary:
            raise ProtocolError(
                "connection closed in the middle of a frame (%d bytes missing)"
                % max(self.left, 1)
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

    def _start(self, frame_start, total, available, out, whole=None):
        """Decide on a frame whose first ``available`` bytes are in
        ``frame_start``. Returns how many of them were used, or None when
        they are not enough for the head on_head asked for (the caller keeps
        them and waits for more). ``whole``: the object read, when those
        bytes are all of it and all of the frame (forwarded as it is)."""
        head_len = self._need if self._need < total else total
        mode = self.on_head(frame_start[:head_len], total)
        while mode.__class__ is NeedHead:
            need = mode.size
            if not head_len < need <= total:
                raise ValueError("NeedHead(%d) with a head of %d in a frame of %d"
                                 % (need, head_len, total))
            if available < need:
                self._need = need
                return None
            head_len = need
            mode = self.on_head(frame_start[:head_len], total)
        self._need = HEAD_SIZE
        if mode is DEFER:
            return _DEFERRED
        self._frame_out = len(out)
        self._frame_len = total
        skip = 0
        cls = mode.__class__
        if cls is not int:
            if cls is tuple:  # a patched head, then a stream
                head, mode = mode
                if len(head) != head_len:
                    raise ValueError("a patched head must keep its length")
                mode.feed(head, out)
                skip = head_len
            elif cls is bytes or cls is bytearray:  # PASS with a patched head
                if len(mode) != head_len:
                    raise ValueError("a patched head must keep its length")
                out.append(mode)
                mode = PASS
                skip = head_len
        used = available if available < total else total
        if mode == PASS:
            if skip < used:
                out.append(whole if whole is not None and not skip else frame_start[skip:used])
        elif mode == WHOLE:
            if used == total:
                result = self.on_whole(frame_start[:total])
                if result is not None:
                    out.append(result)
            else:
                self._whole = bytearray(frame_start[:used])
        elif mode != DROP:  # a stream
            if skip < used:
                mode.feed(whole if whole is not None and not skip else frame_start[skip:used], out)
        if used < total:
            self.mode = mode
            self.left = total - used
        return used

    def feed(self, data, out):
        view = memoryview(data)
        n = len(data)
        pos = 0
        if self.head:
            head = self.head
            while True:
                want = self._need - len(head)
                take = want if want < n - pos else n - pos
                head += view[pos : pos + take]
                pos += take
                if len(head) < 4:
                    return out
                total = self._size(head, 0)
                head_len = total if total < self._need else self._need
                if len(head) < head_len:
                    return out
                extra = len(head) - head_len
                if extra:  # give back what the head did not need
                    pos -= extra
                    del head[head_len:]
                used = self._start(bytes(head), total, head_len, out)
                if used == _DEFERRED:
                    self.rest = bytes(head) + bytes(view[pos:])
                    head.clear()
                    return out
                if used is not None:
                    head.clear()
                    break
                # on_head asked for a longer head (self._need): gather on
        while pos < n:
            left = self.left
            if not left and self.stop_after_frame:
                self.stop_after_frame = False
                self.rest = bytes(view[pos:])
                break
            if left:
                take = n - pos if n - pos < left else left
                mode = self.mode
                # all of ``data`` goes on as the object read: a write of it
                # costs less than one of a view on it
                if mode == PASS:
                    out.append(data if take == n else view[pos : pos + take])
                elif mode == WHOLE:
                    self._whole += view[pos : pos + take]
                elif mode != DROP:
                    mode.feed(data if take == n else view[pos : pos + take], out)
                pos += take
                self.left = left - take
                if left == take and mode == WHOLE:
                    frame, self._whole = bytes(self._whole), None
                    result = self.on_whole(frame)
                    if result is not None:
                        out.append(result)
                continue
            available = n - pos
            if available >= 4:
                total = self._size(data, pos)
                if available >= total or available >= self._need:
                    used = self._start(view[pos:], total, available, out,
                                       data if not pos and available == total else None)
                    if used is not None:
                        if used == _DEFERRED:
                            self.rest = bytes(view[pos:])
                            break
                        pos += used
                        continue
            self.head += view[pos:]
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


def response_correlation_id(frame):
    try:
        return INT32.unpack_from(frame, 4)[0]
    except StructError:
        raise ProtocolError("response of %d bytes has no correlation id" % len(frame)) from None


def response_body_offset(frame, flexible_header):
    """Offset of the response body in a framed response (header v0 or v1)."""
    if flexible_header:
        return skip_tagged_fields(frame, 8)
    return 8
