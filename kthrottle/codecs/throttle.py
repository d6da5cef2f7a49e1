"""throttle_time_ms in responses (KIP-219): find it, read it, raise it in place.

The proxy tells a client how long it is being throttled the way a broker does:
in the response's ``throttle_time_ms``. The field is an int32, so setting it
never changes the frame's length; every other byte is copied as it came (no
decode and re-encode, which would drop tagged fields kafka-python's schemas
do not know).

Where the field sits is computed once, at import, from kafka-python's JSON
schemas, for every response API and version they describe (and for ShareFetch
and ShareAcknowledge, which they do not, from Kafka's): in most it is the
first body field; in OffsetDelete it follows a fixed-size error code; in
Produce and ApiVersions it follows a variable-length array, so a small
hand-written walk finds it (``WALK``). Versions newer than kafka-python knows
are treated as having no known field (None): nothing is guessed.
"""
from struct import error as StructError

from . import apis
from .errors import ProtocolError
from .wire import INT32, read_array_length, read_int16, skip_string, skip_tagged_fields

# Marker returned by throttle_time_offset: the field follows variable-length
# data, so its offset depends on the response and is found by walking it.
WALK = "walk"

INT32_MAX = 2**31 - 1

# ApiVersions answers UNSUPPORTED_VERSION in the v0 layout whatever the version
# asked for (KIP-511), and v0 has no throttle_time_ms.
UNSUPPORTED_VERSION = 35

# Response header: size(4) + correlation_id(4), then (flexible) tagged fields.
_HEADER = 8
# Smallest frame: size prefix and correlation id.
_MIN_FRAME = 8

_FIXED_SIZES = {
    "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "float64": 8, "bool": 1, "uuid": 16,
}


def walk_produce(buf, pos, version):
    """Produce v1+: throttle_time_ms follows the ``responses`` array."""
    flexible = version >= 9
    # index, error_code, base_offset, log_append_time_ms (v2+), log_start_offset (v5+)
    partition_fixed = 14 + (8 if version >= 2 else 0) + (8 if version >= 5 else 0)
    topics, pos = _count(buf, pos, flexible)
    for _ in range(topics):
        if version >= 13:
            pos += 16  # topic_id
        else:
            pos = skip_string(buf, pos, flexible)  # name
        partitions, pos = _count(buf, pos, flexible)
        if version < 8:  # fixed-size partitions (v8 added record_errors, v9 tags)
            pos += partitions * partition_fixed
            continue
        for _ in range(partitions):
            pos += partition_fixed
            errors, pos = _count(buf, pos, flexible)
            for _ in range(errors):
                pos = skip_string(buf, pos + 4, flexible)  # batch_index, message
                if flexible:
                    pos = skip_tagged_fields(buf, pos)
            pos = skip_string(buf, pos, flexible)  # error_message
            if flexible:
                pos = skip_tagged_fields(buf, pos)  # current_leader (v10+) lives here
        if flexible:
            pos = skip_tagged_fields(buf, pos)
    return pos


def _walk_api_versions(buf, pos, version):
    """ApiVersions v1+: throttle_time_ms follows the ``api_keys`` array."""
    error_code, pos = read_int16(buf, pos)
    if error_code == UNSUPPORTED_VERSION:
        return None  # a v0 body, whatever version was asked for
    flexible = version >= 3
    count, pos = _count(buf, pos, flexible)
    if not flexible:
        return pos + 6 * count  # api_key, min_version, max_version
    for _ in range(count):
        pos = skip_tagged_fields(buf, pos + 6)
    return pos


_WALKERS = {apis.PRODUCE: walk_produce, apis.API_VERSIONS: _walk_api_versions}


def _count(buf, pos, compact):
    """An array's element count, checked against the bytes left (so that
    garbage cannot make a walk loop billions of times); null counts as 0."""
    n, pos = read_array_length(buf, pos, compact)
    if n > len(buf) - pos:
        raise ProtocolError("array of %d elements at offset %d runs past the frame" % (n, pos))
    return (n if n > 0 else 0), pos


def _in(versions, version):
    return versions is not None and versions[0] <= version <= versions[1]


def _schema_offset(fields, version):
    """Offset of ThrottleTimeMs in the body of one version, from the schema's
    top-level fields: an int, WALK (after variable-length data) or None."""
    from kafka.protocol.schemas import BaseField

    present = [
        field for field in fields
        if _in(BaseField.parse_versions(field["versions"]), version)
        # tagged fields live in the tagged section at the end of the body
        and not _in(BaseField.parse_versions(field.get("taggedVersions")), version)
    ]
    if not any(field["name"] == "ThrottleTimeMs" for field in present):
        return None
    pos = 0
    for field in present:
        if field["name"] == "ThrottleTimeMs":
            return pos
        size = _FIXED_SIZES.get(field["type"])
        if size is None:
            return WALK
        pos += size
    return None


def _build_tables():
    offsets = {}  # (api_key, version) -> int | WALK
    layout = {}  # (api_key, version) -> (flexible header, int offset | walker)
    for api_key, cls in apis.ALL_RESPONSES.items():
        fields = cls.json["fields"]
        for version in range(cls.max_version + 1):
            where = _schema_offset(fields, version)
            if where is None:
                continue
            offsets[api_key, version] = where
            if where is WALK:
                where = _WALKERS.get(api_key)
                if where is None:
                    continue  # no walker: treated as unknown (a test keeps this empty)
            layout[api_key, version] = (apis.response_header_flexible(api_key, version), where)
    # ShareFetch and ShareAcknowledge, which kafka-python has no schema for:
    # throttle_time_ms is their first body field, after a flexible header
    # (ShareFetchResponse.json, ShareAcknowledgeResponse.json; KIP-932)
    for api_key in (apis.SHARE_FETCH, apis.SHARE_ACKNOWLEDGE):
        for version in range(apis.MIN_DECODABLE_VERSION[api_key],
                             apis.MAX_DECODABLE_VERSION[api_key] + 1):
            offsets[api_key, version] = 0
            layout[api_key, version] = (True, 0)
    return offsets, layout


_OFFSETS, _LAYOUT = _build_tables()


def throttle_time_offset(api_key, api_version):
    """Where throttle_time_ms is, relative to the start of the response body:
    an int when at a fixed offset, WALK when it follows variable-length data,
    None when the response (as far as kafka-python's schemas know) has none."""
    return _OFFSETS.get((api_key, api_version))


def _locate(buf, entry, api_version):
    flexible, where = entry
    try:
        pos = skip_tagged_fields(buf, _HEADER) if flexible else _HEADER
        if where.__class__ is int:
            pos += where
        else:
            pos = where(buf, pos, api_version)
            if pos is None:
                return None
    except (IndexError, StructError):  # the wire readers raise ProtocolError; belt and braces
        raise ProtocolError("truncated response") from None
    if pos + 4 > len(buf):
        raise ProtocolError("truncated response: throttle_time_ms at offset %d of %d bytes"
                            % (pos, len(buf)))
    return pos


def throttle_time_at(frame, api_key, api_version):
    """Absolute offset of throttle_time_ms in a whole framed response, or None
    when it has none. Raises ProtocolError on a truncated or garbled frame."""
    n = len(frame)
    if n < _MIN_FRAME:
        raise ProtocolError("response frame of %d bytes is too short" % n)
    size = INT32.unpack_from(frame, 0)[0]
    if size != n - 4:
        raise ProtocolError("response frame says %d bytes but has %d" % (size, n - 4))
    entry = _LAYOUT.get((api_key, api_version))
    if entry is None:
        return None
    return _locate(frame, entry, api_version)


def raise_throttle_time(frame, api_key, api_version, throttle_ms):
    """A copy of the framed response with throttle_time_ms raised to
    ``throttle_ms`` (capped at the int32 maximum), or None when the response
    has no such field or already says as much or more. Same length; only
    those 4 bytes differ."""
    pos = throttle_time_at(frame, api_key, api_version)
    if pos is None:
        return None
    if throttle_ms > INT32_MAX:
        throttle_ms = INT32_MAX
    if INT32.unpack_from(frame, pos)[0] >= throttle_ms:
        return None
    view = memoryview(frame)
    return b"".join((view[:pos], INT32.pack(throttle_ms), view[pos + 4 :]))


def throttle_time_patch(head, api_key, api_version):
    """For cut-through: the absolute offset of throttle_time_ms if it lies
    within ``head``, the first bytes of a framed response (``min(frame size,
    HEAD_SIZE)`` of them, as FrameCutter hands them over), else None.

    Fixed offsets are found without reading the body; Produce and ApiVersions
    are walked as far as the head goes (None if the field lies beyond it).
    Raises ProtocolError when the head is the whole frame and it is garbled.
    """
    entry = _LAYOUT.get((api_key, api_version))
    if entry is None:
        return None
    if len(head) < 4:
        raise ProtocolError("response head of %d bytes has no size" % len(head))
    total = INT32.unpack_from(head, 0)[0] + 4
    if total < _MIN_FRAME:
        raise ProtocolError("response frame of %d bytes is too short" % total)
    if len(head) > total:
        head = memoryview(head)[:total]
    whole = len(head) == total
    try:
        return _locate(head, entry, api_version)
    except ProtocolError:
        if whole:
            raise
        return None  # the field, or what leads to it, lies beyond the head


# First response version from which clients back off on their own when a
# response carries throttle_time_ms (KIP-219: brokers of Kafka 2.0+ answer at
# once and then mute the channel; each throttled API's version was bumped so
# that clients know). The reference is the Java client: a response class's
# ``shouldClientThrottle(version)`` (AbstractResponse's default: never).
# Sources: "Starting in version N, on quota violation, brokers send out
# responses before throttling" in each schema's comments (kafka-python's
# copies, kafka/protocol/schemas/resources/*Response.json), KIP-219, and,
# for APIs whose schemas say nothing, apache/kafka's
# clients/.../common/requests/*Response.java.
#
# Not listed (None) means: no client is known to back off at any version, so
# the proxy must hold the response itself. That covers responses without the
# field and APIs whose Java class keeps the default (OffsetForLeaderEpoch,
# IncrementalAlterConfigs, DescribeClientQuotas, AlterClientQuotas,
# Describe/AlterUserScramCredentials, UpdateFeatures, DescribeCluster,
# DescribeTransactions, ListTransactions, ListConfigResources, ShareFetch,
# ShareAcknowledge), and any API not listed here (conservative choice for the
# unknown).
# librdkafka does not back off at any version (measured against it).
CLIENTS_BACK_OFF_FROM = {
    0: 6,  # Produce (ProduceResponse.shouldClientThrottle: version >= 6)
    1: 8,  # Fetch (schema comment; KIP-219)
    2: 3,  # ListOffsets (schema comment)
    3: 6,  # Metadata (schema comment; KIP-219)
    8: 4,  # OffsetCommit (schema comment)
    9: 4,  # OffsetFetch (schema comment)
    10: 2,  # FindCoordinator (schema comment; KIP-219)
    11: 3,  # JoinGroup (schema comment)
    12: 2,  # Heartbeat (schema comment)
    13: 2,  # LeaveGroup (schema comment)
    14: 2,  # SyncGroup (schema comment)
    15: 2,  # DescribeGroups (schema comment)
    16: 2,  # ListGroups (schema comment)
    18: 2,  # ApiVersions (schema comment; KIP-219)
    19: 3,  # CreateTopics (schema comment; KIP-219)
    20: 2,  # DeleteTopics (schema comment)
    21: 1,  # DeleteRecords (schema comment)
    22: 1,  # InitProducerId (schema comment)
    24: 1,  # AddPartitionsToTxn (schema comment)
    25: 1,  # AddOffsetsToTxn (schema comment)
    26: 1,  # EndTxn (schema comment)
    28: 1,  # TxnOffsetCommit (schema comment)
    29: 1,  # DescribeAcls (schema comment)
    30: 1,  # CreateAcls (schema comment)
    31: 1,  # DeleteAcls (schema comment)
    32: 2,  # DescribeConfigs (schema comment)
    33: 1,  # AlterConfigs (schema comment)
    34: 1,  # AlterReplicaLogDirs (schema comment)
    35: 1,  # DescribeLogDirs (schema comment)
    37: 1,  # CreatePartitions (schema comment)
    42: 1,  # DeleteGroups (schema comment)
    43: 0,  # ElectLeaders (Java: shouldClientThrottle returns true)
    45: 0,  # AlterPartitionReassignments (Java: true)
    46: 0,  # ListPartitionReassignments (Java: true)
    47: 0,  # OffsetDelete (Java: version >= 0)
    61: 0,  # DescribeProducers (Java: true)
    75: 0,  # DescribeTopicPartitions (Java: true)
}


def clients_back_off_from(api_key):
    """First response version whose throttle_time_ms clients honour by backing
    off on their own; None if no version is known to be honoured."""
    return CLIENTS_BACK_OFF_FROM.get(api_key)
