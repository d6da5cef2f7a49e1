"""A request's head, parsed once: header fields, then body offsets on demand.

The proxy sees a request's first bytes (its head) before the rest streams on.
``RequestHead`` reads the header (api key, version, correlation id,
client-id) when made; the body fields a decision may need (Produce ``acks``,
Fetch ``replica_id`` and ``max_bytes``) are located only when asked for, and
each only once. A field that lies past the head but inside the frame raises
``HeadTooShort`` with the number of bytes the head must have, so the framing
can gather that much (never the whole frame) and parse again; a field past
the end of the frame is a ProtocolError.
"""
from . import apis
from .errors import ProtocolError
from .wire import INT16, INT16_INT16_INT32, INT32, read_uvarint, skip_tagged_fields

# Longest request head the proxy gathers to read the fields it needs. Kafka
# strings (client-id, transactional.id) are at most 32767 bytes, so 64 KiB
# holds any valid header and Produce prefix; a frame claiming more is garbage.
MAX_HEAD_SIZE = 64 * 1024

# ControlledShutdown v0 is the one request sent with header v0 (no client-id).
_CONTROLLED_SHUTDOWN = 7

_UNREAD = object()


class HeadTooShort(Exception):
    """The head ends before a field that the frame still holds."""

    def __init__(self, needed):
        super().__init__(needed)
        self.needed = needed


def request_header_flexible(api_key, api_version):
    """Whether the request uses header v2 (tagged fields after the client-id):
    the same versions as the body is flexible (ApiVersions included, whose
    *response* header alone stays v0). None for an API kafka-python's
    schemas do not know."""
    if api_key not in apis.FLEXIBLE_VERSIONS:
        return None
    versions = apis.FLEXIBLE_VERSIONS[api_key]
    return versions is not None and versions[0] <= api_version <= versions[1]


def produce_acks(buf, version):
    """(acks, client_id, its length, the offset after acks) of a Produce
    request at ``version`` from ``buf``, its framed head, when that has the
    usual layout: a short UTF-8 client-id, no header tags, a short or null
    transactional.id; a few slices instead of RequestHead's general walk.
    None otherwise."""
    n = len(buf)
    if n < 14:
        return None
    size = buf[12] << 8 | buf[13]
    pos = 14 + size
    if size >= 0x8000 or pos + 4 > n:
        return None
    try:
        client_id = str(buf[14:pos], "utf-8")
    except UnicodeDecodeError:
        return None
    if version >= 9:  # header v2: no tags; compact transactional_id
        t = buf[pos + 1]
        if buf[pos] or t >= 0x80:
            return None
        pos += 2 + (t - 1 if t > 1 else 0)
    elif version >= 3:  # nullable string
        t = buf[pos] << 8 | buf[pos + 1]
        pos += 2 + (t if t < 0x8000 else 0)
    if pos + 2 > n:
        return None
    acks = buf[pos] << 8 | buf[pos + 1]
    return (acks - 0x10000 if acks >= 0x8000 else acks), client_id, size, pos + 2


def fetch_head(buf, version):
    """(client_id, replica_id, max_bytes (None before v3), the client-id's
    length, the offset after max_bytes (after min_bytes before v3)) of a
    Fetch request at ``version`` from ``buf``, its framed head, when that has
    the usual layout: a short UTF-8 client-id and no header tags. None
    otherwise (RequestHead reads every layout)."""
    n = len(buf)
    if n < 14:
        return None
    size = buf[12] << 8 | buf[13]
    pos = 14 + size
    if size >= 0x8000 or pos > n:
        return None
    try:
        client_id = str(buf[14:pos], "utf-8")
    except UnicodeDecodeError:
        return None
    if version >= 12:  # header v2: no tags
        if pos >= n or buf[pos]:
            return None
        pos += 1
    if version >= 15:  # replica_id moved to a tag only brokers set (KIP-903)
        replica_id = -1
    elif pos + 4 <= n:
        replica_id = INT32.unpack_from(buf, pos)[0]
        pos += 4
    else:
        return None
    pos += 8  # max_wait_ms, min_bytes
    max_bytes = None
    if version >= 3:
        pos += 4
        if pos > n:
            return None
        max_bytes = INT32.unpack_from(buf, pos - 4)[0]
    elif pos > n:
        return None
    return client_id, replica_id, max_bytes, size, pos


class RequestHead:
    """The first bytes of one framed request (size prefix included)."""

    __slots__ = ("buf", "frame_len", "api_key", "api_version", "correlation_id",
                 "_client_id", "_body", "_acks", "_fetch")

    def __init__(self, buf, frame_len):
        self.buf = buf
        self.frame_len = frame_len
        if len(buf) < 12:
            raise ProtocolError("truncated request header")
        self.api_key, self.api_version, self.correlation_id = INT16_INT16_INT32.unpack_from(buf, 4)
        if self.api_key < 0 or self.api_version < 0:
            raise ProtocolError("invalid api key %d version %d" % (self.api_key, self.api_version))
        self._client_id = _UNREAD
        self._body = self._acks = self._fetch = None
        if self.api_key == _CONTROLLED_SHUTDOWN and self.api_version == 0:
            self._client_id = None
            self._body = 12

    @property
    def client_id(self):
        """The header's client-id (None when null)."""
        client_id = self._client_id
        if client_id is _UNREAD:
            buf = self.buf
            self._need(14, "request header")
            size = INT16.unpack_from(buf, 12)[0]
            if size < 0:
                client_id = None
            else:
                end = self._need(14 + size, "request header client_id")
                try:
                    client_id = bytes(buf[14:end]).decode("utf-8")
                except UnicodeDecodeError:
                    raise ProtocolError("request client_id is not UTF-8") from None
            self._client_id = client_id
        return client_id

    def _need(self, end, what):
        """``end`` if the head reaches that far; else HeadTooShort (the frame
        holds it) or ProtocolError (it does not, or it is absurdly far)."""
        if end <= len(self.buf):
            return end
        if end > self.frame_len:
            raise ProtocolError("truncated %s" % what)
        if end > MAX_HEAD_SIZE:
            raise ProtocolError("%s ends at byte %d, past the %d bytes a head may take"
                                % (what, end, MAX_HEAD_SIZE))
        raise HeadTooShort(end)

    @property
    def body_offset(self):
        """Offset of the body (after the header's tagged fields, if any)."""
        pos = self._body
        if pos is None:
            flexible = request_header_flexible(self.api_key, self.api_version)
            if flexible is None:
                raise ProtocolError("api key %d has no known request header" % self.api_key)
            self.client_id  # reaches past the client-id, and it is UTF-8
            pos = 14 + max(INT16.unpack_from(self.buf, 12)[0], 0)
            if flexible:
                pos = self._skip_tags(pos)
            self._body = pos
        return pos

    def _more(self, what):
        """A varint ran past the head: ask for more of the frame, if any."""
        n = len(self.buf)
        if n >= self.frame_len:
            raise ProtocolError("truncated %s" % what)
        self._need(min(self.frame_len, n + 256), what)

    def _after_compact_string(self, pos, what):
        """The offset after the compact nullable string ``what`` at ``pos``."""
        try:
            n, pos = read_uvarint(self.buf, pos)
        except ProtocolError:
            self._more(what)
        return pos + max(n - 1, 0)

    def _skip_tags(self, pos):
        buf = self.buf
        try:
            count, pos = read_uvarint(buf, pos)
            for _ in range(count):
                _tag, pos = read_uvarint(buf, pos)
                size, pos = read_uvarint(buf, pos)
                pos += size
        except ProtocolError:
            self._more("request header tagged fields")
        return self._need(pos, "request header tagged fields")

    @property
    def acks(self):
        """Produce ``acks`` (0: the broker sends no response)."""
        acks = self._acks
        if acks is None:
            acks = self._acks = self._acks_in_head()
        return acks

    def _acks_in_head(self):
        """acks read straight from a head that holds it (every Produce a
        client sends; see produce_acks), else by the general walk below,
        which answers every other case (and every error) the same way."""
        if self.api_key == apis.PRODUCE and self._client_id is _UNREAD:
            found = produce_acks(self.buf, self.api_version)
            if found is not None:
                acks, self._client_id, size, _ = found
                self._body = 14 + size + (1 if self.api_version >= 9 else 0)
                return acks
        return self._acks_walked()

    def _acks_walked(self):
        if self.api_key != apis.PRODUCE:
            raise ValueError("acks of a non-Produce request")
        buf = self.buf
        pos = self.body_offset
        version = self.api_version
        if version >= 3:  # transactional_id, nullable string
            if version >= 9:
                pos = self._after_compact_string(pos, "Produce transactional_id")
            else:
                self._need(pos + 2, "Produce transactional_id")
                n = INT16.unpack_from(buf, pos)[0]
                pos += 2 + max(n, 0)
        self._need(pos + 2, "Produce acks")
        return INT16.unpack_from(buf, pos)[0]

    def _fetch_fields(self):
        fields = self._fetch
        if fields is None:
            if self.api_key != apis.FETCH:
                raise ValueError("fetch fields of a non-Fetch request")
            pos = self.body_offset
            version = self.api_version
            if version >= 15:
                # replica_id moved into a tagged field at the end (KIP-903),
                # which only brokers set
                replica_id = -1
                max_bytes_at = pos + 8  # max_wait_ms, min_bytes
            else:
                self._need(pos + 4, "Fetch replica_id")
                replica_id = INT32.unpack_from(self.buf, pos)[0]
                max_bytes_at = pos + 12  # replica_id, max_wait_ms, min_bytes
            session_at = None
            if version >= 7:
                # isolation_level (v4+), then session_id and session_epoch
                # (KIP-227)
                session_at = max_bytes_at + 5
                self._need(session_at + 8, "Fetch session_id")
            elif version >= 3:
                self._need(max_bytes_at + 4, "Fetch max_bytes")
            else:
                max_bytes_at = None
            fields = self._fetch = (replica_id, max_bytes_at, session_at)
        return fields

    @property
    def replica_id(self):
        """Fetch ``replica_id``: a broker's id when a follower replicates,
        -1 for a consumer (always -1 from v15, see _fetch_fields)."""
        return self._fetch_fields()[0]

    @property
    def max_bytes_offset(self):
        """Offset of Fetch ``max_bytes`` (v3+), else None."""
        return self._fetch_fields()[1]

    @property
    def fetch_session_id(self):
        """Fetch ``session_id`` (KIP-227, v7+): 0 when the request is in no
        incremental fetch session (and before v7)."""
        at = self._fetch_fields()[2]
        return 0 if at is None else INT32.unpack_from(self.buf, at)[0]

    @property
    def fetch_session_epoch(self):
        """Fetch ``session_epoch`` (KIP-227, v7+): 0 opens a session, -1 asks
        for none (also before v7), more: an incremental request of one."""
        at = self._fetch_fields()[2]
        return -1 if at is None else INT32.unpack_from(self.buf, at + 4)[0]

    @property
    def share_fetch_max_bytes_offset(self):
        """Offset of ShareFetch ``MaxBytes`` (KIP-932; after GroupId,
        MemberId, ShareSessionEpoch, MaxWaitMs and MinBytes)."""
        at = self._fetch
        if at is None:
            if self.api_key != apis.SHARE_FETCH:
                raise ValueError("MaxBytes of a non-ShareFetch request")
            pos = self._after_compact_string(self.body_offset, "ShareFetch GroupId")
            at = self._after_compact_string(pos, "ShareFetch MemberId") + 12
            self._need(at + 4, "ShareFetch MaxBytes")
            self._fetch = at
        return at

    def fields_for_policy(self):
        """Locate every body field a decision on this request may read, so
        that HeadTooShort comes before any decision is made, never after
        one was counted."""
        self.client_id
        key = self.api_key
        if key == apis.PRODUCE:
            self.acks
        elif key == apis.FETCH:
            self._fetch_fields()
        elif key == apis.SHARE_FETCH:
            self.share_fetch_max_bytes_offset


def with_int32(buf, offset, value):
    """A copy of ``buf`` with the int32 at ``offset`` set to ``value``
    (same length: a patched head forwarded in place of the original)."""
    patched = bytearray(buf)
    INT32.pack_into(patched, offset, value)
    return bytes(patched)


def capped_fetch_head(head, max_bytes):
    """The Fetch head with ``max_bytes`` lowered to ``max_bytes``, or None when
    it already asks for no more (or the version has no such field, v0-2)."""
    offset = head.max_bytes_offset
    if offset is None or INT32.unpack_from(head.buf, offset)[0] <= max_bytes:
        return None
    return with_int32(head.buf, offset, max_bytes)


def capped_fetch_partitions(frame, max_bytes):
    """For a whole framed Fetch request of v0-2 (no request-wide max_bytes,
    KIP-74 came with v3): a copy with each partition's partition_max_bytes
    lowered to ``max_bytes``, or None when none asks for more. ProtocolError
    when the frame is malformed."""
    n = len(frame)
    if n < 14:
        raise ProtocolError("truncated Fetch request")
    api_version = INT16.unpack_from(frame, 6)[0]
    if not 0 <= api_version <= 2:
        raise ValueError("Fetch v%d has a request-wide max_bytes" % api_version)
    size = INT16.unpack_from(frame, 12)[0]
    pos = 14 + max(size, 0) + 12  # client-id; replica_id, max_wait_ms, min_bytes
    patched = None
    try:
        topics = INT32.unpack_from(frame, pos)[0]
        pos += 4
        for _ in range(max(topics, 0)):
            pos += 2 + max(INT16.unpack_from(frame, pos)[0], 0)
            partitions = INT32.unpack_from(frame, pos)[0]
            pos += 4
            for _ in range(max(partitions, 0)):
                at = pos + 12  # partition, fetch_offset
                if INT32.unpack_from(frame, at)[0] > max_bytes:
                    if patched is None:
                        patched = bytearray(frame)
                    INT32.pack_into(patched, at, max_bytes)
                pos = at + 4
    except Exception:  # struct.error: past the end
        raise ProtocolError("truncated Fetch request") from None
    if pos > n:
        raise ProtocolError("truncated Fetch request")
    return None if patched is None else bytes(patched)


def fetch_replica_state(buf, body, version):
    """The replica id a whole framed Fetch request v15 or later names in its
    ReplicaState tag (KIP-903: only a follower, a broker, sets it), or -1
    without one; ``body`` is where its body starts. ProtocolError when it is
    malformed. Read on every such Fetch, so written for speed: the fields up
    to the topics are fixed, and so is each partition but for its tags."""
    n = len(buf)
    # max_wait_ms, min_bytes, max_bytes, isolation_level, session_id, session_epoch
    pos = body + 21
    try:
        for array in (0, 1):  # Topics, then ForgottenTopicsData
            count = buf[pos]
            if count < 0x80:
                pos += 1
            else:
                count, pos = read_uvarint(buf, pos)
            for _ in range(count - 1):
                pos += 16  # topic id (v13+)
                parts = buf[pos]
                if parts < 0x80:
                    pos += 1
                else:
                    parts, pos = read_uvarint(buf, pos)
                if array:  # forgotten: partition indexes
                    pos += 4 * (parts - 1)
                else:
                    for _ in range(parts - 1):
                        # partition, current_leader_epoch, fetch_offset,
                        # last_fetched_epoch, log_start_offset, partition_max_bytes
                        pos += 32
                        if buf[pos]:
                            pos = skip_tagged_fields(buf, pos)
                        else:
                            pos += 1
                if buf[pos]:  # the topic's tags
                    pos = skip_tagged_fields(buf, pos)
                else:
                    pos += 1
        size, pos = read_uvarint(buf, pos)  # rack_id, a compact string
        pos += size - 1 if size else 0
        tags, pos = read_uvarint(buf, pos)
        for _ in range(tags):
            tag, pos = read_uvarint(buf, pos)
            size, pos = read_uvarint(buf, pos)
            if tag == 1 and pos + 4 <= n:  # ReplicaState: ReplicaId, ReplicaEpoch
                return INT32.unpack_from(buf, pos)[0]
            pos += size
    except IndexError:
        raise ProtocolError("truncated Fetch v%d request" % version) from None
    if pos > n:
        raise ProtocolError("truncated Fetch v%d request" % version)
    return -1
