"""The topics of ShareFetch (78) and ShareAcknowledge (79) requests (KIP-932), and the answers
the proxy gives for those it refuses, as Kafka's broker gives them.

A share consumer names its topics by id. Kafka's broker needs READ on each topic of a
request's ``Topics`` array (not of ShareFetch's ``ForgottenTopicsData``, which it never
authorizes) and answers a topic it refuses on each of its partitions inside ``Responses``,
with TOPIC_AUTHORIZATION_FAILED (29), while it serves the others. The proxy does the same
without the broker ever seeing a refused topic:

    ids = request_topics(78, 1, frame, body_offset)            # [UUID(...), ...]
    forwarded = request_without(78, 1, frame, body_offset, allowed)
    parts = [(t, p) for t, p in request_partitions(78, 1, frame, body_offset)
             if not allowed(t)]
    answer = refused_response(78, 1, correlation_id, parts, 29,
                              **refusal_options(78, 1, frame, body_offset))
    to_client = add_topics(78, 1, broker_frame, answer)      # refused entries first

What Kafka 4.4's broker puts in a refused partition (KafkaApis.handleFetchFromShareFetchRequest
and handleAcknowledgements, through the public ShareFetchResponse.partitionResponse and
ShareAcknowledgeResponse.partitionResponse; then KafkaApis.getResponsePartitionData and the
combining of fetch and acknowledgement results in handleShareFetchRequest):

- ShareAcknowledge: PartitionIndex, ErrorCode; ErrorMessage null, CurrentLeader at its
  defaults (LeaderId 0, LeaderEpoch 0: the schema gives no -1).
- ShareFetch: PartitionIndex, ErrorCode, Records empty (not null), AcquiredRecords empty,
  CurrentLeader 0/0, ErrorMessage and AcknowledgeErrorMessage null, and AcknowledgeErrorCode
  0, unless the request carries acknowledgements anywhere (a non-empty AcknowledgementBatches
  in any partition of any topic): then the broker runs its acknowledgement path over every
  partition of every topic of the request and refuses those too, so AcknowledgeErrorCode is
  the error as well. With IsRenewAck (v2) the broker fetches nothing: a refused partition is
  answered on its acknowledgement only (ErrorCode 0, AcknowledgeErrorCode the error), and not
  at all when the request acknowledges nothing.

Partitions are grouped by topic, one Responses entry per topic id and one per partition
(Kafka keys them by topic-id-partition); their order is the request's (the broker's is a hash
map's). The broker sets AcquisitionLockTimeoutMs (ShareFetch; ShareAcknowledge from v2) to the
group's share.record.lock.duration.ms (30000 unless configured), which the proxy cannot know:
``refused_response`` writes 0 unless told, and Kafka's clients read 0 as "not given"
(ShareConsumeRequestManager keeps the value only when it is > 0).

Every version of both APIs is flexible (compact strings and arrays, tagged fields, response
header v1). The versions covered are the ones Apache Kafka 4.4's client jar knows: ShareFetch
1-2, ShareAcknowledge 1-2 (version 0, KIP-932's early access, is gone); ValueError for any
other key or version. Malformed or truncated frames raise ProtocolError.
"""
import uuid

from .errors import ProtocolError
from .wire import INT16, INT32, check_within, read_int16, read_uvarint, skip_tagged_fields, \
    write_uvarint

SHARE_FETCH, SHARE_ACKNOWLEDGE = 78, 79

# ---- field kinds, for the walker: a fixed width, or one of these --------------------------------
W_INT8, W_INT16, W_INT32, W_INT64, W_UUID = 1, 2, 4, 8, 16  # widths
STRING = "string"  # a compact nullable string, or compact bytes (records): uvarint N+1, N bytes
TAGS = "tags"  # a tagged-field section
IS_RENEW_ACK = "is_renew_ack"  # a boolean, read
ERROR_CODE = "error_code"  # an int16, read


def _array(*element):
    """A compact array of structures laid out as ``element`` (ending with their TAGS)."""
    return ("array", element)


def _values(width):
    """A compact array of fixed-width values (int8, int32)."""
    return ("values", width)


# The request fields before Topics, per key and version (ShareFetchRequest.json,
# ShareAcknowledgeRequest.json). ShareFetch: GroupId, MemberId, ShareSessionEpoch, MaxWaitMs,
# MinBytes, MaxBytes, MaxRecords, BatchSize; from v2 ShareAcquireMode and IsRenewAck.
# ShareAcknowledge: GroupId, MemberId, ShareSessionEpoch; from v2 IsRenewAck.
_FETCH_HEAD = (STRING, STRING) + (W_INT32,) * 6
_ACK_HEAD = (STRING, STRING, W_INT32)
_REQUEST_HEAD = {
    SHARE_FETCH: {1: _FETCH_HEAD, 2: _FETCH_HEAD + (W_INT8, IS_RENEW_ACK)},
    SHARE_ACKNOWLEDGE: {1: _ACK_HEAD, 2: _ACK_HEAD + (IS_RENEW_ACK,)},
}
# A Topics entry, in both APIs and every version covered: TopicId; Partitions, each a
# PartitionIndex (ShareFetch's PartitionMaxBytes is v0 only) and AcknowledgementBatches
# (FirstOffset, LastOffset, AcknowledgeTypes: []int8); tagged fields ending each structure.
_BATCH = (W_INT64, W_INT64, _values(W_INT8), TAGS)
# What follows Topics: ShareFetch's ForgottenTopicsData (TopicId, Partitions: []int32), then
# the body's tagged fields.
_AFTER_TOPICS = {
    SHARE_FETCH: (_array(W_UUID, _values(W_INT32), TAGS), TAGS),
    SHARE_ACKNOWLEDGE: (TAGS,),
}
# fewest bytes a Topics entry, a partition and a batch take: the bound on their counts
_MIN_TOPIC, _MIN_PARTITION, _MIN_BATCH = 16 + 1 + 1, 4 + 1 + 1, 8 + 8 + 1 + 1

# The response fields before Responses (ShareFetchResponse.json, ShareAcknowledgeResponse.json):
# ThrottleTimeMs, ErrorCode, ErrorMessage, then AcquisitionLockTimeoutMs (ShareFetch v1+,
# ShareAcknowledge v2+).
_RESPONSE_HEAD = (W_INT32, ERROR_CODE, STRING)
_LOCK_TIMEOUT = {SHARE_FETCH: (1, 2), SHARE_ACKNOWLEDGE: (2,)}
# A Responses entry: TopicId, Partitions, tagged fields. A ShareFetch partition: PartitionIndex,
# ErrorCode, ErrorMessage, AcknowledgeErrorCode, AcknowledgeErrorMessage, CurrentLeader
# (LeaderId, LeaderEpoch), Records, AcquiredRecords (FirstOffset, LastOffset, DeliveryCount).
# A ShareAcknowledge partition: PartitionIndex, ErrorCode, ErrorMessage, CurrentLeader.
_LEADER = (W_INT32, W_INT32, TAGS)
_RESPONSE_TOPIC = {
    SHARE_FETCH: (W_UUID, _array(W_INT32, W_INT16, STRING, W_INT16, STRING, *_LEADER, STRING,
                               _array(W_INT64, W_INT64, W_INT16, TAGS), TAGS), TAGS),
    SHARE_ACKNOWLEDGE: (W_UUID, _array(W_INT32, W_INT16, STRING, *_LEADER, TAGS), TAGS),
}
_VERSIONS = {SHARE_FETCH: (1, 2), SHARE_ACKNOWLEDGE: (1, 2)}

# ---- fields written at their defaults -----------------------------------------------------------
NULL_STRING = b"\x00"  # compact nullable string, null
EMPTY = b"\x01"  # compact array or bytes, empty (length + 1 = 1)
NO_TAGGED_FIELDS = b"\x00"
INT32_ZERO = b"\x00" * 4
INT16_ZERO = b"\x00" * 2
LEADER_DEFAULT = INT32_ZERO + INT32_ZERO + NO_TAGGED_FIELDS  # LeaderId 0, LeaderEpoch 0


def _check(api_key, api_version, what):
    if api_version not in _VERSIONS.get(api_key, ()):
        raise ValueError("no %s for API key %r version %r" % (what, api_key, api_version))


def _count(frame, pos, least, what):
    """A compact array's element count (never null here: Kafka's schemas make these arrays
    non-nullable) and where its elements start; ProtocolError when the bytes left cannot hold
    that many elements of ``least`` bytes."""
    n, pos = read_uvarint(frame, pos)
    n -= 1
    if n < 0:
        raise ProtocolError("null %s at offset %d (not nullable)" % (what, pos))
    if n * least > len(frame) - pos:
        raise ProtocolError("%d %s in %d bytes" % (n, what, len(frame) - pos))
    return n, pos


def _skip(frame, pos, layout):
    """The position after the fields of ``layout`` at ``pos``; ProtocolError if they run
    beyond the frame."""
    for kind in layout:
        if kind == TAGS:
            pos = skip_tagged_fields(frame, pos)
        elif kind == STRING:
            n, pos = read_uvarint(frame, pos)
            pos += max(n - 1, 0)
            check_within(frame, pos, 0, "string or bytes ending at offset %d" % pos)
        elif isinstance(kind, tuple):
            shape, inner = kind
            if shape == "values":
                n, pos = _count(frame, pos, inner, "values")
                pos += n * inner
            else:
                n, pos = _count(frame, pos, 1, "structures")
                for _ in range(n):
                    pos = _skip(frame, pos, inner)
        else:  # a fixed width (IS_RENEW_ACK, ERROR_CODE: read by their callers)
            width = 1 if kind == IS_RENEW_ACK else 2 if kind == ERROR_CODE else kind
            check_within(frame, pos, width, "field at offset %d" % pos)
            pos += width
    return pos


def _topic_id(frame, pos):
    check_within(frame, pos, 16, "topic id at offset %d" % pos)
    return uuid.UUID(bytes=bytes(frame[pos:pos + 16])), pos + 16


class _Request:
    """A ShareFetch or ShareAcknowledge request read through: where its Topics array starts
    (``at``, its count) and ends (``end``), each entry as (start, end, topic id, partition
    indexes), whether any partition carries acknowledgement batches, and IsRenewAck."""

    __slots__ = ("at", "end", "topics", "acknowledges", "renew_ack")

    def __init__(self, api_key, api_version, frame, body_offset):
        _check(api_key, api_version, "request layout")
        if not 0 <= body_offset <= len(frame):
            raise ProtocolError("body offset %d outside a frame of %d bytes"
                                % (body_offset, len(frame)))
        pos = body_offset
        self.renew_ack = False
        for kind in _REQUEST_HEAD[api_key][api_version]:
            if kind == IS_RENEW_ACK:
                check_within(frame, pos, 1, "IsRenewAck")
                self.renew_ack = frame[pos] != 0
            pos = _skip(frame, pos, (kind,))
        self.at = pos
        self.acknowledges = False
        self.topics = []
        count, pos = _count(frame, pos, _MIN_TOPIC, "topics")
        for _ in range(count):
            start = pos
            topic_id, pos = _topic_id(frame, pos)
            partitions, pos = _count(frame, pos, _MIN_PARTITION, "partitions")
            indexes = []
            for _ in range(partitions):
                check_within(frame, pos, 4, "partition index at offset %d" % pos)
                indexes.append(INT32.unpack_from(frame, pos)[0])
                batches, pos = _count(frame, pos + 4, _MIN_BATCH, "acknowledgement batches")
                if batches:
                    self.acknowledges = True
                for _ in range(batches):
                    pos = _skip(frame, pos, _BATCH)
                pos = skip_tagged_fields(frame, pos)
            pos = skip_tagged_fields(frame, pos)
            self.topics.append((start, pos, topic_id, indexes))
        self.end = pos
        _skip(frame, pos, _AFTER_TOPICS[api_key])  # ForgottenTopicsData, tagged fields


def request_topics(api_key, api_version, frame, body_offset):
    """The topic ids (uuid.UUID) of the ``Topics`` array of a whole framed ShareFetch (78) or
    ShareAcknowledge (79) request whose body starts at ``body_offset`` (after its request
    header v2), in order, repeats included; ShareFetch's ForgottenTopicsData is not read as
    topics. ProtocolError when the frame is truncated or malformed; ValueError for any other
    key or version."""
    return [t[2] for t in _Request(api_key, api_version, frame, body_offset).topics]


def request_partitions(api_key, api_version, frame, body_offset):
    """The ``Topics`` of the request as (topic id, [partition indexes]) pairs, in order: what
    ``refused_response`` takes."""
    return [(t[2], t[3]) for t in _Request(api_key, api_version, frame, body_offset).topics]


def refusal_options(api_key, api_version, frame, body_offset):
    """The keyword arguments ``refused_response`` needs to answer this request's refused
    topics as Kafka's broker does: for ShareFetch, ``acknowledgements`` (whether any partition
    of the request carries acknowledgement batches) and ``renew_ack`` (v2's IsRenewAck); none
    for ShareAcknowledge, whose refusals do not depend on them. Read from the request the
    client sent, before any topic is left out."""
    request = _Request(api_key, api_version, frame, body_offset)
    if api_key != SHARE_FETCH:
        return {}
    return {"acknowledgements": request.acknowledges, "renew_ack": request.renew_ack}


def request_without(api_key, api_version, frame, body_offset, keep):
    """The whole framed request with the ``Topics`` entries whose id ``keep(topic_id)``
    refuses left out (a new size prefix and array count), every other byte as it came:
    the header, the other fields, ShareFetch's ForgottenTopicsData and tagged fields. The
    same bytes (a copy) when ``keep`` keeps them all. ``keep`` is called once per entry, in
    order."""
    request = _Request(api_key, api_version, frame, body_offset)
    view = memoryview(frame)
    kept = [view[start:end] for start, end, topic_id, _ in request.topics if keep(topic_id)]
    if len(kept) == len(request.topics):
        return bytes(frame)
    body = b"".join((view[4:request.at], write_uvarint(len(kept) + 1), *kept,
                     view[request.end:]))
    return INT32.pack(len(body)) + body


def _error_code(error_code):
    if not -2 ** 15 <= error_code < 2 ** 15:
        raise ValueError("error code %r is not an int16" % (error_code,))
    return INT16.pack(error_code)


def _grouped(topics):
    """[(topic id, [partition indexes])] with one entry per topic id (at its first place) and
    each partition once, as Kafka's map of topic-id-partitions leaves them."""
    order = []
    partitions = {}
    for topic_id, indexes in topics:
        if not isinstance(topic_id, uuid.UUID):
            raise ValueError("topic id %r is not a uuid.UUID" % (topic_id,))
        if topic_id not in partitions:
            order.append(topic_id)
            partitions[topic_id] = {}
        for index in indexes:
            if not -2 ** 31 <= index < 2 ** 31:
                raise ValueError("partition index %r is not an int32" % (index,))
            partitions[topic_id].setdefault(index, None)
    return [(topic_id, list(partitions[topic_id])) for topic_id in order]


def refused_response(api_key, api_version, correlation_id, topics, error_code, *,
                     acknowledgements=False, renew_ack=False, acquisition_lock_timeout_ms=0):
    """The whole framed response (size prefix, response header v1) a broker gives to a
    ShareFetch (78) or ShareAcknowledge (79) request at ``api_version`` whose topics it all
    refuses: ThrottleTimeMs 0, ErrorCode 0, ErrorMessage null, AcquisitionLockTimeoutMs
    ``acquisition_lock_timeout_ms`` where the version has it (0, "not given" to Kafka's
    clients, unless told), NodeEndpoints empty, and for ``topics`` ((uuid.UUID, [partition
    indexes]) pairs, as ``request_partitions`` gives them) one Responses entry per topic id
    whose partitions carry ``error_code`` as Kafka's broker builds them (see the module's
    text). ShareFetch only: ``acknowledgements`` (the request carries acknowledgement batches)
    sets AcknowledgeErrorCode too, ``renew_ack`` (v2's IsRenewAck) answers on the
    acknowledgement only; ``refusal_options`` reads both from the request. ValueError for any
    other key or version, or for options the API or version does not have."""
    _check(api_key, api_version, "refused response")
    code = _error_code(error_code)
    if (acknowledgements or renew_ack) and api_key != SHARE_FETCH:
        raise ValueError("acknowledgements and renew_ack are ShareFetch's options")
    if renew_ack and api_version < 2:
        raise ValueError("ShareFetch v%d has no IsRenewAck" % api_version)
    entries = []
    grouped = _grouped(topics)
    if api_key == SHARE_FETCH:
        if renew_ack:
            # nothing fetched: only the acknowledgement results, ErrorCode 0
            fetch_code, ack_code = INT16_ZERO, code
            if not acknowledgements:
                grouped = []
        else:
            fetch_code, ack_code = code, code if acknowledgements else INT16_ZERO
        tail = (NULL_STRING + ack_code + NULL_STRING + LEADER_DEFAULT + EMPTY + EMPTY
                + NO_TAGGED_FIELDS)
    else:
        fetch_code, tail = code, NULL_STRING + LEADER_DEFAULT + NO_TAGGED_FIELDS
    for topic_id, indexes in grouped:
        partitions = b"".join(INT32.pack(i) + fetch_code + tail for i in indexes)
        entries.append(topic_id.bytes + write_uvarint(len(indexes) + 1) + partitions
                       + NO_TAGGED_FIELDS)
    lock = b""
    if api_version in _LOCK_TIMEOUT[api_key]:
        lock = INT32.pack(acquisition_lock_timeout_ms)
    body = (INT32_ZERO + INT16_ZERO + NULL_STRING + lock + write_uvarint(len(entries) + 1)
            + b"".join(entries) + EMPTY + NO_TAGGED_FIELDS)
    payload = INT32.pack(correlation_id) + NO_TAGGED_FIELDS + body
    return INT32.pack(len(payload)) + payload


def _responses_at(api_key, api_version, frame):
    """(top-level ErrorCode, where the Responses count starts, the count, where its first
    entry starts) of a whole framed response."""
    pos = skip_tagged_fields(frame, 8)  # size, correlation id; the header's tagged fields
    check_within(frame, pos, 6, "ThrottleTimeMs and ErrorCode")
    error, _ = read_int16(frame, pos + 4)
    pos = _skip(frame, pos, _RESPONSE_HEAD)
    if api_version in _LOCK_TIMEOUT[api_key]:
        pos = _skip(frame, pos, (W_INT32,))
    count, first = _count(frame, pos, 1, "topic responses")
    return error, pos, count, first


def add_topics(api_key, api_version, frame, answer):
    """The broker's whole framed ShareFetch (78) or ShareAcknowledge (79) response ``frame``
    with the Responses entries of ``answer`` (a ``refused_response`` of the same API, version
    and correlation id) put first in its Responses array: a new size prefix and count, the
    broker's bytes otherwise as they came (its entries, records undecoded, its
    AcquisitionLockTimeoutMs and NodeEndpoints). A response with a top-level error (the
    broker refused the whole request, e.g. a share session error) comes back unchanged, as
    Kafka answers such a request with no partitions at all; so does one ``answer`` adds
    nothing to. ProtocolError when either frame is malformed; ValueError for another key or
    version, or correlation ids that differ."""
    _check(api_key, api_version, "response layout")
    try:
        error, at, count, first = _responses_at(api_key, api_version, frame)
        _, _, added, start = _responses_at(api_key, api_version, answer)
        end = start
        for _ in range(added):
            end = _skip(answer, end, _RESPONSE_TOPIC[api_key])
    except IndexError as exc:  # defensive: the readers raise ProtocolError
        raise ProtocolError("malformed share response: %s" % exc) from None
    if bytes(frame[4:8]) != bytes(answer[4:8]):
        raise ValueError("correlation ids differ: %d and %d" % (
            INT32.unpack_from(frame, 4)[0], INT32.unpack_from(answer, 4)[0]))
    if error or not added:
        return bytes(frame)
    view = memoryview(frame)
    body = b"".join((view[4:at], write_uvarint(count + added + 1), memoryview(answer)[start:end],
                     view[first:]))
    return INT32.pack(len(body)) + body


def session_epoch(api_key, api_version, frame, body_offset):
    """A ShareFetch or ShareAcknowledge request's ShareSessionEpoch (after
    GroupId and MemberId): 0 opens a share session, -1 closes it, more: an
    incremental request of one. ProtocolError when the frame runs short."""
    _check(api_key, api_version, "request")
    try:
        pos = body_offset
        for _ in range(2):  # GroupId, MemberId: compact nullable strings
            size, pos = read_uvarint(frame, pos)
            pos += max(size - 1, 0)
        check_within(frame, pos, 4, "ShareSessionEpoch")
        return INT32.unpack_from(frame, pos)[0]
    except IndexError:
        raise ProtocolError("truncated request") from None
