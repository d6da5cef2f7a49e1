"""Cut-through rewrite of KIP-951 NodeEndpoints in Fetch v16+ and Produce v10+,
and of KIP-932's in ShareFetch and ShareAcknowledge v1+ (at the end of this doc).

These responses name brokers in a top-level tagged field (tag 0, NodeEndpoints)
that comes after everything else, after all the records of a Fetch. The frame's
size prefix goes out before that tail is seen, so the rewrite must keep the
frame's length: the records stream through untouched (forwarded as slices of
the chunks given, never copied), only the top-level tagged section at the end
is held back, rewritten to the same byte count and then forwarded.

How the length is kept (``_rewrite_tail``):

- each endpoint gets the proxy's host and port (as rewrite._broker_entry does,
  which also leaves an entry with a negative node id alone);
- when that makes the section shorter, one more top-level tagged field, all
  zeros, pads it back to its length (``_padding``). Its tag is 127, the
  largest one-byte tag, or the largest tag of the next varint length (16383,
  ...) when 127 cannot make up the exact byte count (a 130-byte deficit) or is
  not above the tags already there. That is safe: readers skip tags they do
  not know (KIP-482; Java keeps them as unknown tagged fields, librdkafka's
  rd_kafka_buf_skip_tags and kafka-python skip them), and at every version
  the proxy lets clients use (ApiVersions answers are clamped to what it can
  decode) Fetch and Produce define only tag 0 at the top level. It goes last,
  so the tags stay in ascending order;
- when the section would grow, or no padding fits (a 1-byte deficit: no
  tagged field is shorter than 2 bytes), the NodeEndpoints field is dropped
  and padding takes its place: the client then refreshes its metadata, as
  before KIP-951, and no broker address leaks.

A ValueError from ``advertise`` propagates (the proxy closes that connection).

A response without tag 0 (the common case: brokers fill NodeEndpoints only for
partitions answering NOT_LEADER_OR_FOLLOWER or FENCED_LEADER_EPOCH) comes out
byte for byte as it came.

ShareFetch and ShareAcknowledge (KIP-932) name the leaders in a plain
NodeEndpoints field after their responses, followed by the top-level tagged
section, which they define no tag of: the tail is that field and that section
(``_rewrite_share_tail``). The endpoints are rewritten as above; a shorter
tail is padded with one more top-level tagged field; when the tail would
grow, or no padding fits, NodeEndpoints is left empty and padding takes the
rest (the share consumer then looks the leaders up in Metadata). An empty
NodeEndpoints (the common case again) comes out as it came.
"""
import functools

from . import apis
from .errors import ProtocolError
from .fields import _CARRAY, _COUNT, _SKIP, _VARINT, FieldReader, _tags
from .rewrite import Node
from .wire import (
    INT32,
    encode_string,
    read_int32,
    read_string,
    read_uvarint,
    skip_string,
    skip_tagged_fields,
    write_uvarint,
)

# The walkers (fields.FieldReader's) return once they reach the tail: the
# top-level tagged section, which runs to the end of the frame (for ShareFetch
# and ShareAcknowledge, NodeEndpoints and that section).


def stream_rewriter(api_key, api_version, advertise):
    """A fresh StreamRewriter for one framed response of this API/version, or None
    when the response carries no broker addresses (Produce < v10, Fetch < v16, any
    other API). Raises ProtocolError for a version newer than the proxy can decode
    (as rewrite_response does): its layout is unknown, addresses could leak."""
    first = apis.NODE_ENDPOINTS_FROM.get(api_key)
    if first is None or api_version < first:
        return None
    if api_version > apis.MAX_DECODABLE_VERSION[api_key]:
        raise ProtocolError("api_key %d v%d is newer than the proxy can decode" % (api_key, api_version))
    if api_key in _SHARE:
        fetch = api_key == apis.SHARE_FETCH
        return StreamRewriter(functools.partial(_walk_share, fetch, api_version), advertise,
                              _tail_at_of(api_key, api_version), _rewrite_share_tail)
    walker = (_walk_fetch if api_key == apis.FETCH
              else functools.partial(_walk_produce, api_version))
    return StreamRewriter(walker, advertise, _tail_at_of(api_key, api_version))


_SHARE = (apis.SHARE_FETCH, apis.SHARE_ACKNOWLEDGE)


def _tail_at_of(api_key, api_version):
    """The one-loop walk to the tail of a whole response of this API/version."""
    if api_key == apis.FETCH:
        return _topic_ids_tail_at  # its defaults: Fetch
    if api_key == apis.SHARE_FETCH:
        return _share_fetch_tail_at
    if api_key == apis.SHARE_ACKNOWLEDGE:
        return _share_acknowledge_v2_tail_at if api_version >= 2 else _share_acknowledge_tail_at
    return _produce_v13_tail_at if api_version >= 13 else _produce_tail_at


def untouched_check(api_key, api_version):
    """For a version that stream_rewriter takes and the proxy decodes, a
    function ``untouched(frame)``: True when ``frame``, a whole framed
    response, has no top-level tagged fields, so that its rewrite would
    forward it byte for byte (every Produce response the broker sends with no
    leader change, an empty Fetch); False when that is not so, or not plainly
    so (the rewriter then takes the frame, with its errors). None for any
    other API or version."""
    tail_at = _WHOLE_TAIL_AT.get((api_key, api_version))
    if tail_at is None:  # newer than the proxy can decode (or no NodeEndpoints)
        return None
    if api_key in _SHARE:
        def untouched_share(frame):
            # an empty NodeEndpoints (N+1 = 1), no tagged fields
            n = len(frame)
            return tail_at(frame, n) == n - 2 and frame[n - 2] == 1 and not frame[n - 1]
        return untouched_share

    def untouched(frame):
        n = len(frame)
        at = tail_at(frame, n)
        return at == n - 1 and not frame[at]
    return untouched


class StreamRewriter(FieldReader):
    """Rewrites one framed response as its bytes go by (see the module doc).

    ``nodes``: Node(node_id, host, port) for each endpoint, as the broker
    advertised it; complete once ``done``, which is set by the feed call that
    takes the frame's last byte (that call appends the tail to ``out``, so a
    caller can learn the nodes before writing that output).

    ``feed`` (``fields.FieldReader``'s) appends to ``out`` the bytes to
    forward, in order: over the whole frame the output has exactly the
    input's length and is byte-identical except the NodeEndpoints tail (and
    it raises whatever ``advertise`` raises). The walker returns at the tail.
    """

    __slots__ = ("nodes", "_advertise", "_walker", "_tail", "_tail_at", "_rewrite")
    what = kind = "response"
    truncated = "truncated response: it ends before its tagged fields"
    past_end = "truncated response: %(skip)d bytes to skip at offset %(at)d of %(end)d"

    def __init__(self, walker, advertise, tail_at=None, rewrite=None):
        """``walker()``: a new walk of the structure (made when first needed);
        ``rewrite(tail, advertise, nodes)``: the tail at the same length, or
        None to forward it as it came (the top-level tagged section's
        rewrite by default)."""
        FieldReader.__init__(self)
        self.nodes = []
        self._advertise = advertise
        self._walker = walker
        self._tail_at = tail_at  # the whole frame's walk, for a frame in one chunk
        self._rewrite = rewrite or _rewrite_tail
        self._tail = None  # the tail gathered so far, once it straddles chunks

    def passes(self, n):
        """True when the next ``n`` bytes of the frame all lie inside data the
        walk skips (records) and are not its last: they are taken as fed, and
        go on as they are. False: nothing was done, ``feed`` them."""
        req = self._req
        pos = self._pos + n
        if req is None or req >> 4 < n or self._tail is not None or self._end is None \
                or pos >= self._end or self._shift:
            return False
        self._req = req - (n << 4)
        self._pos = pos
        return True

    def _new_walk(self):
        return self._walker()

    def _frame_end(self, size):
        end = size + 4
        if end < 9:  # correlation_id and at least one byte of body
            raise ProtocolError("response frame of %d bytes is too short" % end)
        return end

    def _read_whole(self, chunk, out):
        # the whole frame in one chunk (every Produce response, an empty
        # Fetch): walked in one go
        n = len(chunk)
        if n <= 8 or self._tail_at is None:
            return False
        at = self._tail_at(chunk, n)
        if at is None:
            return False
        if at != n - 1 or chunk[at] != 0:  # tagged fields (else none: as it came)
            self._pos = n
            view = chunk if chunk.__class__ is memoryview else memoryview(chunk)
            out.append(view[:at])
            self._finish(view[at:], out)
        return True

    def _walked(self, chunk, view, base, i, out):
        end = self._end
        n = len(chunk)
        if self._tail is not None:  # all of this chunk is tail
            self._tail += chunk
            if base + n == end:
                self._finish(self._tail, out)
            return
        if i > 0:
            out.append(view[:i])
        if base + i == end:
            raise ProtocolError(self.truncated)
        if base + n == end:
            self._finish(view[i:], out)  # the whole tail is in this chunk: no copy
        else:
            self._tail = bytearray(view[i:])

    def _finish(self, tail, out):
        self._tail = None
        new = self._rewrite(tail, self._advertise, self.nodes)
        out.append(tail if new is None else new)
        self.done = True
        self._end = None


# The walkers make their requests above 256 once: Python makes such an int
# anew each time it computes one.


def _walk_fetch():
    """Fetch v16+ up to its top-level tagged fields (FetchResponse.json).
    Skips are folded into the next read: a partition costs three requests."""
    topic = 16 << 4 | _CARRAY  # topic_id; partitions
    # partition_index, error_code, high_watermark, last_stable_offset,
    # log_start_offset; aborted_transactions (nullable)
    partition = 30 << 4 | _CARRAY
    yield from _tags(4)  # correlation_id, header tagged fields (response header v1)
    # throttle_time_ms, error_code, session_id; responses
    for _ in range((yield 10 << 4 | _CARRAY)):
        for _ in range((yield topic)):
            for _ in range((yield partition)):
                yield from _tags(16)  # producer_id, first_offset; tagged fields
            n = yield 4 << 4 | _VARINT  # preferred_read_replica; records (N+1, 0: null)
            # the records; the partition's tagged fields (diverging_epoch,
            # current_leader, snapshot_id)
            for _ in range((yield (n - 1 if n > 1 else 0) << 4 | _COUNT)):
                yield _VARINT  # tag
                yield (yield _VARINT) << 4 | _SKIP  # size, then the value
        yield from _tags(0)


def _walk_produce(version):
    """Produce v10+ up to its top-level tagged fields (ProduceResponse.json;
    the same walk as throttle.walk_produce)."""
    topic_id = 16 << 4 | _CARRAY  # topic_id (KIP-516); partition_responses
    # index, error_code, base_offset, log_append_time_ms, log_start_offset;
    # record_errors
    partition = 30 << 4 | _CARRAY
    yield from _tags(4)  # correlation_id, header tagged fields (response header v1)
    for _ in range((yield _CARRAY)):  # responses
        if version >= 13:
            partitions = topic_id
        else:
            n = yield _VARINT  # name; partition_responses
            partitions = (n - 1 if n > 1 else 0) << 4 | _CARRAY
        for _ in range((yield partitions)):
            for _ in range((yield partition)):
                n = yield 4 << 4 | _VARINT  # batch_index; batch_index_error_message
                yield from _tags(n - 1 if n > 1 else 0)
            n = yield _VARINT  # error_message
            yield from _tags(n - 1 if n > 1 else 0)  # current_leader lives here
        yield from _tags(0)
    yield 4 << 4 | _SKIP  # throttle_time_ms


def _walk_share(fetch, version):
    """ShareFetch (``fetch``) or ShareAcknowledge v1+ up to NodeEndpoints, a
    plain field after the responses (ShareFetchResponse.json,
    ShareAcknowledgeResponse.json; KIP-932)."""
    topic = 16 << 4 | _CARRAY  # topic_id; partitions
    yield from _tags(4)  # correlation_id, header tagged fields (response header v1)
    n = yield 6 << 4 | _VARINT  # throttle_time_ms, error_code; error_message
    skip = n - 1 if n > 1 else 0
    if fetch or version >= 2:
        skip += 4  # acquisition_lock_timeout_ms (ShareFetch v1+, ShareAcknowledge v2+)
    for _ in range((yield skip << 4 | _CARRAY)):  # responses
        for _ in range((yield topic)):
            n = yield 6 << 4 | _VARINT  # partition_index, error_code; error_message
            if fetch:
                # acknowledge_error_code; acknowledge_error_message
                n = yield ((n - 1 if n > 1 else 0) + 2) << 4 | _VARINT
            # current_leader (leader_id, leader_epoch; its tagged fields)
            yield from _tags((n - 1 if n > 1 else 0) + 8)
            if fetch:
                n = yield _VARINT  # records (N+1)
                # the records; acquired_records
                for _ in range((yield (n - 1 if n > 1 else 0) << 4 | _CARRAY)):
                    yield from _tags(18)  # first_offset, last_offset, delivery_count
            yield from _tags(0)  # the partition's tagged fields
        yield from _tags(0)  # the topic's


# -- the same walks over a whole frame ------------------------------------------
#
# Plain loops over a frame held in one chunk: what the walkers above do, without
# a generator step per field. They return the tail's offset, or None for
# anything unusual (a tagged field of a varint of several bytes, a count past
# the frame: _Unusual, or an IndexError), which the walkers then take over from
# the start, with their errors. The counts (N+1, one byte below 127) are read
# inline: they are on the way of every Produce response and every empty Fetch.


class _Unusual(IndexError):
    """What the one-loop walks leave to the walkers."""


def _tags_at(buf, pos):
    """The offset after a tagged-field section."""
    count = buf[pos]
    pos += 1
    if count:
        if count >= 0x80:
            raise _Unusual
        for _ in range(count):
            if buf[pos] >= 0x80 or buf[pos + 1] >= 0x80:
                raise _Unusual
            pos += 2 + buf[pos + 1]
    return pos


def _string_end(buf, pos):
    """The offset after a compact (nullable) string."""
    length = buf[pos]
    if length >= 0x80:  # 127 bytes or more (a topic name may have 249)
        length, pos = read_uvarint(buf, pos)
        return pos + length - 1
    return pos + (length if length else 1)


def _count_at(buf, pos, n):
    """A compact array's count (N+1; null counts 0) at ``pos`` of a frame of
    ``n`` bytes, and the offset after it. A count of 127 or more takes
    several bytes (a topic of 1,000 partitions, an answer of 1,000 topics):
    read here, not left to the generator walkers, which cost several times
    as much per partition. _Unusual when the count is more than the bytes
    left."""
    count = buf[pos]
    if count < 0x80:
        return (count - 1 if count else 0), pos + 1
    count, pos = read_uvarint(buf, pos)
    count -= 1
    if count > n - pos:  # each element takes a byte or more
        raise _Unusual
    return count, pos


# A Produce v10+ response partition's end after its 30 fixed bytes, when it has
# no record errors, no error message and no tagged fields (the usual one)
_PLAIN_PARTITION_END = b"\x01\x00\x00"


def _produce_tail_at(buf, n, topic_ids=False):
    """Produce v10+ (ProduceResponse.json): the tail's offset, or None."""
    try:
        # size, correlation_id; header tagged fields (none, as usual)
        pos = _tags_at(buf, 8) if buf[8] else 9
        topics = buf[pos]  # (the counts inline when of one byte: the usual)
        if topics < 0x80:
            topics -= 1
            pos += 1
        else:
            topics, pos = _count_at(buf, pos, n)
        for _ in range(topics):
            if topic_ids:
                pos += 16
            else:  # name
                length = buf[pos]
                if length < 0x80:
                    pos += length if length else 1
                else:
                    pos = _string_end(buf, pos)
            partitions = buf[pos]
            if partitions < 0x80:
                partitions -= 1
                pos += 1
            else:
                partitions, pos = _count_at(buf, pos, n)
            for _ in range(partitions):
                if buf[pos + 30:pos + 33] == _PLAIN_PARTITION_END:
                    pos += 33  # the usual partition, in one comparison
                    continue
                pos += 30  # index, error_code, base_offset, log_append_time_ms, log_start_offset
                if buf[pos] != 1:  # record_errors: anything but empty
                    return None
                pos = _tags_at(buf, _string_end(buf, pos + 1))  # error_message; tagged fields
            pos = _tags_at(buf, pos) if buf[pos] else pos + 1  # the topic's tagged fields
        pos += 4  # throttle_time_ms
    except (IndexError, ProtocolError):
        return None
    return pos if pos < n else None


def _produce_v13_tail_at(buf, n):
    return _produce_tail_at(buf, n, True)


def _topic_ids_tail_at(buf, n, share=False, fetch=True, lock_timeout=False):
    """Fetch v16+ (FetchResponse.json; the defaults), ShareFetch (``share``)
    or ShareAcknowledge v1+ (``share``, not ``fetch``; ``lock_timeout`` from
    v2): NodeEndpoints' offset, or None (as the walkers). Their topics are
    keyed by topic_id; the flags say the fields that differ."""
    try:
        pos = _tags_at(buf, 8)  # size, correlation_id; header tagged fields
        if share:
            pos = _string_end(buf, pos + 6)  # throttle_time_ms, error_code; error_message
            if lock_timeout:
                pos += 4  # acquisition_lock_timeout_ms
        else:
            pos += 10  # throttle_time_ms, error_code, session_id
        topics = buf[pos]  # (the counts inline when of one byte: the usual)
        if topics < 0x80:
            topics -= 1
            pos += 1
        else:
            topics, pos = _count_at(buf, pos, n)
        for _ in range(topics):
            partitions = buf[pos + 16]  # topic_id; partitions
            if partitions < 0x80:
                partitions -= 1
                pos += 17
            else:
                partitions, pos = _count_at(buf, pos + 16, n)
            for _ in range(partitions):
                if share:
                    pos = _string_end(buf, pos + 6)  # partition_index, error_code; error_message
                    if fetch:
                        # acknowledge_error_code; acknowledge_error_message
                        pos = _string_end(buf, pos + 2)
                    pos = _tags_at(buf, pos + 8)  # current_leader
                else:
                    # partition_index, error_code, high_watermark, last_stable_offset,
                    # log_start_offset
                    pos += 30
                    if buf[pos] > 1:  # aborted_transactions: anything but null or empty
                        return None
                    pos += 5  # that, preferred_read_replica
                if fetch:
                    length, pos = read_uvarint(buf, pos)  # records
                    pos += length - 1 if length else 0
                    if share:
                        ranges, pos = _count_at(buf, pos, n)  # acquired_records
                        for _ in range(ranges):
                            pos = _tags_at(buf, pos + 18)
                pos = _tags_at(buf, pos)
            pos = _tags_at(buf, pos)
    except (IndexError, ProtocolError):
        return None
    return pos if pos < n else None


def _share_fetch_tail_at(buf, n):
    return _topic_ids_tail_at(buf, n, True, True, True)


def _share_acknowledge_tail_at(buf, n):
    return _topic_ids_tail_at(buf, n, True, False, False)


def _share_acknowledge_v2_tail_at(buf, n):
    return _topic_ids_tail_at(buf, n, True, False, True)


# untouched_check's walk for each API/version stream_rewriter takes and the
# proxy can decode
_WHOLE_TAIL_AT = {(api_key, version): _tail_at_of(api_key, version)
                  for api_key, first in apis.NODE_ENDPOINTS_FROM.items()
                  for version in range(first, apis.MAX_DECODABLE_VERSION[api_key] + 1)}


# -- the tail ---------------------------------------------------------------

# Padding tag numbers: the largest of each varint length (see the module doc).
_PAD_TAGS = (127, 16383, 2097151, 268435455, 2**31 - 1)


def _uvarint_size(value):
    return len(write_uvarint(value))


def _padding(nbytes, above):
    """A tagged field of exactly ``nbytes`` bytes (tag, size, zeros) whose tag
    number is above ``above``, or None if there is none."""
    for tag in _PAD_TAGS:
        if tag <= above:
            continue
        rest = nbytes - _uvarint_size(tag)
        for k in range(1, 6):  # bytes of the size varint
            size = rest - k
            if size >= 0 and _uvarint_size(size) == k:
                return write_uvarint(tag) + write_uvarint(size) + bytes(size)
    return None


def _rewrite_tail(tail, advertise, nodes):
    """The top-level tagged section ``tail`` (to the frame's end) with
    NodeEndpoints rewritten, at the same length; None when it has none."""
    count, pos = read_uvarint(tail, 0)
    total = len(tail)
    if count > total:
        raise ProtocolError("%d tagged fields in %d bytes" % (count, total))
    others = []  # the other fields, as they came
    node_field = None
    top = -1
    for _ in range(count):
        start = pos
        tag, pos = read_uvarint(tail, pos)
        size, pos = read_uvarint(tail, pos)
        end = pos + size
        if end > total:
            raise ProtocolError("truncated tagged field %d at the end of the response" % tag)
        if tag == 0:
            if node_field is not None:
                raise ProtocolError("NodeEndpoints appears twice")
            node_field = (start, pos, end)
        else:
            others.append(tail[start:end])
        if tag > top:
            top = tag
        pos = end
    if pos != total:
        raise ProtocolError("%d bytes after the response's tagged fields" % (total - pos))
    if node_field is None:
        return None
    start, value_at, end = node_field
    value = _rewrite_endpoints(tail, value_at, end, advertise, nodes)
    rest = b"".join(others)
    kept = b"\x00" + write_uvarint(len(value)) + value + rest
    deficit = total - _uvarint_size(count) - len(kept)
    if deficit == 0:
        return write_uvarint(count) + kept
    if deficit > 0:
        deficit = total - _uvarint_size(count + 1) - len(kept)
        pad = _padding(deficit, top) if deficit > 0 else None
        if pad is not None:
            return write_uvarint(count + 1) + kept + pad
    # Longer, or no padding fits: drop NodeEndpoints (padding in its place).
    pad = _padding(end - start, top)
    if pad is None:
        raise ProtocolError("no padding for NodeEndpoints with tag numbers up to %d" % top)
    return write_uvarint(count) + rest + pad


def _rewrite_share_tail(tail, advertise, nodes):
    """ShareFetch's or ShareAcknowledge's tail (NodeEndpoints, then the
    top-level tagged section, to the frame's end) with NodeEndpoints
    rewritten, at the same length; None when it names no broker."""
    total = len(tail)
    if total == 2 and tail[0] == 1 and not tail[1]:
        return None  # no endpoints, no tagged fields: the usual tail
    n, p = read_uvarint(tail, 0)
    n -= 1  # compact array; null (-1) counts as empty
    if n > total - p:
        raise ProtocolError("NodeEndpoints of %d entries in %d bytes" % (n, total - p))
    for _ in range(n):  # where the array ends: node_id, host, port, rack, tagged fields
        p = skip_tagged_fields(tail, skip_string(tail, skip_string(tail, p + 4, True) + 4, True))
    array_end = p
    count, fields_at = read_uvarint(tail, array_end)
    if count > total - fields_at:
        raise ProtocolError("%d tagged fields in %d bytes" % (count, total - fields_at))
    pos = fields_at
    top = -1
    for _ in range(count):
        tag, pos = read_uvarint(tail, pos)
        size, pos = read_uvarint(tail, pos)
        pos += size
        if pos > total:
            raise ProtocolError("truncated tagged field %d at the end of the response" % tag)
        if tag > top:
            top = tag
    if pos != total:
        raise ProtocolError("%d bytes after the response's tagged fields" % (total - pos))
    if n <= 0:
        return None
    fields = tail[fields_at:]  # the tagged fields, as they came
    value = _rewrite_endpoints(tail, 0, array_end, advertise, nodes)
    deficit = total - len(value) - _uvarint_size(count) - len(fields)
    if deficit == 0:
        return b"".join((value, write_uvarint(count), fields))
    if deficit > 0:
        deficit = total - len(value) - _uvarint_size(count + 1) - len(fields)
        pad = _padding(deficit, top) if deficit > 0 else None
        if pad is not None:
            return b"".join((value, write_uvarint(count + 1), fields, pad))
    # Longer, or no padding fits: NodeEndpoints left empty (padding for the rest).
    pad = _padding(total - 1 - _uvarint_size(count + 1) - len(fields), top)
    if pad is None:
        raise ProtocolError("no padding for NodeEndpoints with tag numbers up to %d" % top)
    return b"".join((b"\x01", write_uvarint(count + 1), fields, pad))


def _rewrite_endpoints(buf, pos, end, advertise, nodes):
    """The NodeEndpoints array in ``buf[pos:end]``, each host and port replaced
    by what ``advertise(node_id)`` gives (ValueError from it propagates)."""
    n, p = read_uvarint(buf, pos)
    n -= 1  # compact array; null (-1) counts as empty
    if n > end - p:
        raise ProtocolError("NodeEndpoints of %d entries in %d bytes" % (n, end - p))
    parts = [buf[pos:p]]
    for _ in range(n):
        entry = p
        node_id, p = read_int32(buf, p)
        host, p = read_string(buf, p, True)
        if host is None:
            raise ProtocolError("null host in NodeEndpoints")
        port, p = read_int32(buf, p)
        rest = p
        p = skip_string(buf, p, True)  # rack
        p = skip_tagged_fields(buf, p)
        if node_id < 0:  # as rewrite._broker_entry: not a broker, left alone
            parts.append(buf[entry:p])
            continue
        nodes.append(Node(node_id, host, port))
        new_host, new_port = advertise(node_id)
        parts += (INT32.pack(node_id), encode_string(new_host, True), INT32.pack(new_port), buf[rest:p])
    if p != end:
        raise ProtocolError("NodeEndpoints size does not match its contents")
    return b"".join(parts)
