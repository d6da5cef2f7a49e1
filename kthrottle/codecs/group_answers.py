"""Answers the proxy gives in a broker's place to the group-protocol requests kafka-python
cannot build (those of the new consumer groups, of share groups and of streams groups), and
what it reads out of their heartbeats.

When the proxy refuses such a request it must still answer in the form the client expects: the
error a broker would give, with every other field left as Kafka's generated classes leave it.
kafka-python has no schema for these APIs, so their layouts live here as short tables: for
each API and version, the kinds of the fields that follow the error, which are all written at
their defaults. Every one of these versions is flexible: compact strings and arrays,
a tagged-field section ending each structure, and response header v1 (correlation id and an
empty tagged-field section).

    error_response(68, 1, correlation_id, 30)           # a framed ConsumerGroupHeartbeat answer
    describe_groups_error_response(69, 1, cid, ["g1"], 30)   # one refused group per id
    subscribed_topics(68, 1, frame, body_offset)         # (["orders"], None)

The versions covered are the ones Apache Kafka 4.4's client jar knows, no others:
ConsumerGroupHeartbeat (68) 0-1, ConsumerGroupDescribe (69) 0-1, ShareGroupHeartbeat (76) 1,
ShareGroupDescribe (77) 1, ShareFetch (78) 1-2, ShareAcknowledge (79) 1-2,
StreamsGroupHeartbeat (88) 0-1, StreamsGroupDescribe (89) 0-1, AlterShareGroupOffsets (91) 0
and DeleteShareGroupOffsets (92) 0. (The early-access version 0 of the share-group APIs is gone
from 4.4: ValueError, as for any key or version not listed.)
"""
from .errors import ProtocolError
from .wire import (
    INT16,
    INT32,
    check_within,
    encode_string,
    read_array_length,
    read_string,
    skip_string,
    skip_tagged_fields,
    write_uvarint,
)

# Kinds of field, each as it is written at its default value.
INT8 = b"\x00"
BOOLEAN = b"\x00"
INT32_ZERO = b"\x00" * 4
INT64_MINUS_ONE = b"\xff" * 8
STRING = b"\x01"  # a compact string, default "" (length + 1 = 1)
NULLABLE_STRING = b"\x00"  # a compact nullable string, default null
ARRAY = b"\x01"  # a compact array, default empty
NULLABLE_ARRAY_NULL = b"\x00"  # a nullable compact array whose default is null
NULLABLE_STRUCT_NULL = b"\xff"  # a nullable structure whose default is null (marker -1)
# Kafka's default of AuthorizedOperations: "not asked for" (Integer.MIN_VALUE)
AUTHORIZED_OPERATIONS = INT32.pack(-2 ** 31)
NO_TAGGED_FIELDS = b"\x00"

# ConsumerGroupHeartbeatResponse.json and ShareGroupHeartbeatResponse.json alike:
# MemberId (nullable, null), MemberEpoch, HeartbeatIntervalMs, Assignment (nullable, null)
_HEARTBEAT = (NULLABLE_STRING, INT32_ZERO, INT32_ZERO, NULLABLE_STRUCT_NULL)
# StreamsGroupHeartbeatResponse.json: MemberId, MemberEpoch, HeartbeatIntervalMs, then v0's
# AcceptableRecoveryLag (int32) and TaskOffsetIntervalMs, or v1's TaskOffsetIntervalMs and
# AcceptableRecoveryLag (int64, default -1); Status (nullable, default empty), ActiveTasks,
# StandbyTasks, WarmupTasks (nullable, null); v1's TopologyDescriptionRequired;
# EndpointInformationEpoch, PartitionsByUserEndpoint (nullable, null)
_STREAMS_HEARTBEAT_HEAD = (STRING, INT32_ZERO, INT32_ZERO)
_STREAMS_HEARTBEAT_TASKS = (ARRAY,) + (NULLABLE_ARRAY_NULL,) * 3
_STREAMS_HEARTBEAT_TAIL = (INT32_ZERO, NULLABLE_ARRAY_NULL)

# api key -> {version: the fields after ThrottleTimeMs, ErrorCode, ErrorMessage}
_AFTER_ERROR = {
    68: {0: _HEARTBEAT, 1: _HEARTBEAT},
    76: {1: _HEARTBEAT},
    # ShareFetchResponse.json: AcquisitionLockTimeoutMs, Responses, NodeEndpoints
    78: {1: (INT32_ZERO, ARRAY, ARRAY), 2: (INT32_ZERO, ARRAY, ARRAY)},
    # ShareAcknowledgeResponse.json: AcquisitionLockTimeoutMs from v2, Responses, NodeEndpoints
    79: {1: (ARRAY, ARRAY), 2: (INT32_ZERO, ARRAY, ARRAY)},
    88: {
        0: _STREAMS_HEARTBEAT_HEAD + (INT32_ZERO, INT32_ZERO) + _STREAMS_HEARTBEAT_TASKS
        + _STREAMS_HEARTBEAT_TAIL,
        1: _STREAMS_HEARTBEAT_HEAD + (INT32_ZERO, INT64_MINUS_ONE) + _STREAMS_HEARTBEAT_TASKS
        + (BOOLEAN,) + _STREAMS_HEARTBEAT_TAIL,
    },
    # AlterShareGroupOffsetsResponse.json, DeleteShareGroupOffsetsResponse.json: Responses
    91: {0: (ARRAY,)},
    92: {0: (ARRAY,)},
}

# ConsumerGroupDescribeResponse.json and ShareGroupDescribeResponse.json: GroupState,
# GroupEpoch, AssignmentEpoch, AssignorName, Members, AuthorizedOperations
_DESCRIBED_GROUP = (STRING, INT32_ZERO, INT32_ZERO, STRING, ARRAY, AUTHORIZED_OPERATIONS)
# StreamsGroupDescribeResponse.json: GroupState, GroupEpoch, AssignmentEpoch, Topology
# (nullable, null), Members, AuthorizedOperations; from v1 TopologyDescription (nullable,
# null), TopologyDescriptionStatus and AssignorName (nullable, null)
_DESCRIBED_STREAMS_GROUP = (STRING, INT32_ZERO, INT32_ZERO, NULLABLE_STRUCT_NULL, ARRAY,
                            AUTHORIZED_OPERATIONS)

# api key -> {version: the fields of a DescribedGroup after ErrorCode, ErrorMessage, GroupId}
_AFTER_GROUP_ID = {
    69: {0: _DESCRIBED_GROUP, 1: _DESCRIBED_GROUP},
    77: {1: _DESCRIBED_GROUP},
    89: {
        0: _DESCRIBED_STREAMS_GROUP,
        1: _DESCRIBED_STREAMS_GROUP + (NULLABLE_STRUCT_NULL, INT8, NULLABLE_STRING),
    },
}

# The heartbeat requests' fields before SubscribedTopicNames, by how to skip them; and whether
# SubscribedTopicRegex follows it.
_SKIP_STRING, _SKIP_INT32 = "string", "int32"
# ConsumerGroupHeartbeatRequest.json: GroupId, MemberId, MemberEpoch, InstanceId, RackId,
# RebalanceTimeoutMs; SubscribedTopicRegex from v1
_CONSUMER_HEARTBEAT_HEAD = (_SKIP_STRING, _SKIP_STRING, _SKIP_INT32, _SKIP_STRING, _SKIP_STRING,
                            _SKIP_INT32)
# ShareGroupHeartbeatRequest.json: GroupId, MemberId, MemberEpoch, RackId
_SHARE_HEARTBEAT_HEAD = (_SKIP_STRING, _SKIP_STRING, _SKIP_INT32, _SKIP_STRING)
# api key -> {version: (fields before SubscribedTopicNames, has SubscribedTopicRegex)}
_SUBSCRIPTIONS = {
    68: {0: (_CONSUMER_HEARTBEAT_HEAD, False), 1: (_CONSUMER_HEARTBEAT_HEAD, True)},
    76: {1: (_SHARE_HEARTBEAT_HEAD, False)},
}


def _layout(table, api_key, api_version, what):
    try:
        return table[api_key][api_version]
    except KeyError:
        raise ValueError("no %s for API key %r version %r" % (what, api_key, api_version)) \
            from None


def _nullable_string(value):
    return NULLABLE_STRING if value is None else encode_string(value, True)


def _error_code(error_code):
    if not -2 ** 15 <= error_code < 2 ** 15:
        raise ValueError("error code %r is not an int16" % (error_code,))
    return INT16.pack(error_code)


def _framed(correlation_id, body):
    """Size prefix, response header v1 (correlation id, no tagged fields), body."""
    payload = INT32.pack(correlation_id) + NO_TAGGED_FIELDS + body
    return INT32.pack(len(payload)) + payload


def error_response(api_key, api_version, correlation_id, error_code, error_message=None):
    """The whole framed response to a request of ``api_key`` at ``api_version`` that failed
    with ``error_code``: ThrottleTimeMs 0, ErrorCode and ErrorMessage (null unless given) at
    the top level, every other field at its default. For ConsumerGroupHeartbeat (68),
    ShareGroupHeartbeat (76), ShareFetch (78), ShareAcknowledge (79), StreamsGroupHeartbeat
    (88), AlterShareGroupOffsets (91) and DeleteShareGroupOffsets (92); each has a top-level
    ErrorCode in every version covered.

    This is what Kafka's ``getErrorResponse`` of these requests answers, except that for 91
    and 92 Kafka also sets ErrorMessage, to the error's standard text (Java's
    ``Errors.message()``, e.g. "Group authorization failed."): pass it as ``error_message``
    for the same bytes. ValueError for any other key or version, or a code beyond int16."""
    after = _layout(_AFTER_ERROR, api_key, api_version, "error response")
    body = (INT32_ZERO + _error_code(error_code) + _nullable_string(error_message)
            + b"".join(after) + NO_TAGGED_FIELDS)
    return _framed(correlation_id, body)


def describe_groups_error_response(api_key, api_version, correlation_id, groups, error_code,
                                   error_message=None):
    """The whole framed response to a ConsumerGroupDescribe (69), ShareGroupDescribe (77) or
    StreamsGroupDescribe (89) request at ``api_version`` that refuses every group it names:
    one DescribedGroup per id in ``groups``, in order, with ``error_code``, ErrorMessage null
    (or ``error_message``), and every other field at its default (AuthorizedOperations
    -2147483648, Kafka's "not asked for"), as Kafka's ``getErrorResponse`` of these requests
    builds them. ValueError for any other key or version."""
    after = b"".join(_layout(_AFTER_GROUP_ID, api_key, api_version, "describe response"))
    code = _error_code(error_code)
    message = _nullable_string(error_message)
    groups = list(groups)
    entries = b"".join(code + message + encode_string(group, True) + after + NO_TAGGED_FIELDS
                       for group in groups)
    body = INT32_ZERO + write_uvarint(len(groups) + 1) + entries + NO_TAGGED_FIELDS
    return _framed(correlation_id, body)


def subscribed_topics(api_key, api_version, frame, body_offset):
    """The subscription in a whole framed ConsumerGroupHeartbeat (68) or ShareGroupHeartbeat
    (76) request whose body starts at ``body_offset`` (after its request header v2):
    (SubscribedTopicNames, a list of str or None when null; SubscribedTopicRegex, a str or
    None when null or before ConsumerGroupHeartbeat v1 and in ShareGroupHeartbeat, which has
    none). ProtocolError if the frame runs short or is malformed; ValueError for any other
    key or version."""
    head, has_regex = _layout(_SUBSCRIPTIONS, api_key, api_version, "subscription")
    if not 0 <= body_offset <= len(frame):
        raise ProtocolError("body offset %d outside a frame of %d bytes"
                            % (body_offset, len(frame)))
    pos = body_offset
    for kind in head:
        if kind == _SKIP_STRING:
            pos = skip_string(frame, pos, True)
        else:
            check_within(frame, pos, 4, "int32 at offset %d" % pos)
            pos += 4
    count, pos = read_array_length(frame, pos, True)
    names = None
    if count >= 0:
        if count > len(frame) - pos:  # each name takes one byte at least
            raise ProtocolError("%d subscribed topic names in %d bytes"
                                % (count, len(frame) - pos))
        names = []
        for _ in range(count):
            name, pos = read_string(frame, pos, True)
            if name is None:
                raise ProtocolError("a null subscribed topic name at offset %d" % pos)
            names.append(name)
    regex = None
    if has_regex:
        regex, pos = read_string(frame, pos, True)
    return names, regex


# the heartbeat responses whose Assignment is read (ConsumerGroupHeartbeatResponse.json,
# ShareGroupHeartbeatResponse.json): key -> versions
_ASSIGNMENTS = {68: (0, 1), 76: (1,)}


def assignment_without(api_key, api_version, frame, keep):
    """A whole framed ConsumerGroupHeartbeat (68) or ShareGroupHeartbeat (76)
    response with the assigned topics whose id ``keep(topic_id)`` (a
    uuid.UUID) refuses left out of its Assignment; None when it keeps them
    all (or assigns nothing). ProtocolError when the frame is malformed."""
    import uuid

    if api_version not in _ASSIGNMENTS.get(api_key, ()):
        raise ValueError("no assignment read for API key %r version %r" % (api_key, api_version))
    try:
        pos = skip_tagged_fields(frame, 8)  # size, correlation id; the header's tagged fields
        pos += 6  # ThrottleTimeMs, ErrorCode
        pos = skip_string(frame, pos, True)  # ErrorMessage
        pos = skip_string(frame, pos, True)  # MemberId
        pos += 8  # MemberEpoch, HeartbeatIntervalMs
        check_within(frame, pos, 1, "the assignment's marker")
        if frame[pos] == 0xFF:
            return None  # no assignment
        at = pos + 1
        count, pos = read_array_length(frame, at, True)
        kept = []
        dropped = False
        for _ in range(max(count, 0)):
            start = pos
            check_within(frame, pos, 16, "a topic id")
            topic_id = uuid.UUID(bytes=bytes(frame[pos:pos + 16]))
            partitions, pos = read_array_length(frame, pos + 16, True)
            pos += 4 * max(partitions, 0)
            pos = skip_tagged_fields(frame, pos)
            if keep(topic_id):
                kept.append(bytes(frame[start:pos]))
            else:
                dropped = True
        check_within(frame, pos, 0, "the assignment")
    except (IndexError, ValueError) as exc:
        raise ProtocolError("malformed heartbeat response: %s" % exc) from None
    if not dropped:
        return None
    view = memoryview(frame)
    body = b"".join((view[4:at], write_uvarint(len(kept) + 1), *kept, view[pos:]))
    return INT32.pack(len(body)) + body


def groups_request_without(frame, body_offset, keep):
    """A whole framed request whose body starts with a compact array of group
    ids (ConsumerGroupDescribe, ShareGroupDescribe, StreamsGroupDescribe),
    with the ids ``keep(group_id)`` refuses left out; the rest as it came."""
    try:
        count, pos = read_array_length(frame, body_offset, True)
        kept = []
        for _ in range(max(count, 0)):
            start = pos
            group, pos = read_string(frame, pos, True)
            if keep(group or ""):
                kept.append(bytes(frame[start:pos]))
    except (IndexError, ValueError) as exc:
        raise ProtocolError("malformed group list: %s" % exc) from None
    view = memoryview(frame)
    body = b"".join((view[4:body_offset], write_uvarint(len(kept) + 1), *kept, view[pos:]))
    return INT32.pack(len(body)) + body


def _groups_at(frame):
    """Where the Groups array of a framed describe response starts (after the
    response header and ThrottleTimeMs), and its count and first entry."""
    at = skip_tagged_fields(frame, 8) + 4
    count, pos = read_array_length(frame, at, True)
    return at, max(count, 0), pos


def add_described_groups(frame, answer):
    """The framed describe response ``frame`` (69, 77, 89) with the groups of
    ``answer`` (describe_groups_error_response of the same API and version)
    put first in its Groups array, the broker's entries left as they are."""
    try:
        at, count, pos = _groups_at(frame)
        _, added, first = _groups_at(answer)
    except (IndexError, ValueError) as exc:
        raise ProtocolError("malformed describe response: %s" % exc) from None
    view = memoryview(frame)
    entries = memoryview(answer)[first:len(answer) - 1]  # the body's empty tagged fields
    body = b"".join((view[4:at], write_uvarint(count + added + 1), entries, view[pos:]))
    return INT32.pack(len(body)) + body
