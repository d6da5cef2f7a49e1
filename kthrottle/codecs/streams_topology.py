"""The topics a StreamsGroupHeartbeat (88) request's Topology names (KIP-1071), as Kafka's broker
reads them to authorize the request.

A Kafka Streams member sends its application's topology in the nullable ``Topology`` field of
the heartbeat that joins the group (MemberEpoch 0); later heartbeats leave it null. What Kafka
4.4's broker does with it, in order (KafkaApis.handleStreamsGroupHeartbeat), once the streams
protocol is enabled (else UNSUPPORTED_VERSION) and READ on the group is granted (else
GROUP_AUTHORIZATION_FAILED):

1. When Topology is not null it collects, subtopology by subtopology, the SourceTopics, the
   RepartitionSinkTopics, the names of the RepartitionSourceTopics and the names of the
   StateChangelogTopics, keeping the first of any repeated name (``topology_topics``).
   SourceTopicRegex is not read, nor are the CopartitionGroups.
2. If one of those names is one of Kafka's internal topics (``__consumer_offsets``,
   ``__transaction_state``, ``__share_group_state``), or else if one is not a valid topic name
   (empty, ``.``, ``..``, longer than 249 characters, or with a character outside
   ``[a-zA-Z0-9._-]``: a non-ASCII name is invalid), it answers STREAMS_INVALID_TOPOLOGY (130)
   with an ErrorMessage naming them (``invalid_topology``).
3. Otherwise, if there is at least one name, it needs DESCRIBE on every one of them
   (AuthHelper.filterByAuthorized): a single refusal and it answers TOPIC_AUTHORIZATION_FAILED
   (29) for the whole request, ErrorMessage null, everything else at its defaults (which is
   ``group_answers.error_response(88, version, correlation_id, 29)``).
4. Then the group coordinator handles the heartbeat, and after it the broker checks CREATE on
   the internal topics it must create for the group (``internal_topics``), with a different
   outcome: no error, a status in the response.

    names = topology_topics(88, 1, frame, body_offset)     # None: no Topology
    refused = invalid_topology(names) if names else None   # (130, message) or None

Every version is flexible. The versions covered are the ones Apache Kafka 4.4's client jar
knows, StreamsGroupHeartbeat 0-1 (the same request in both); ValueError for any other key or
version. A truncated or malformed frame raises ProtocolError, as does a null where Kafka's
generated reader refuses one.
"""
from .errors import ProtocolError
from .wire import check_within, read_uvarint, skip_tagged_fields

STREAMS_GROUP_HEARTBEAT = 88
VERSIONS = (0, 1)
TOPIC_AUTHORIZATION_FAILED = 29
STREAMS_INVALID_TOPOLOGY = 130
# org.apache.kafka.common.internals.Topic's INTERNAL_TOPICS (not __cluster_metadata)
INTERNAL_TOPICS = frozenset(("__consumer_offsets", "__transaction_state", "__share_group_state"))
_MAX_NAME_LENGTH = 249
_LEGAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_MAX_STRING = 0x7FFF  # Kafka's generated readers refuse a longer string


def _check(api_key, api_version):
    if api_key != STREAMS_GROUP_HEARTBEAT or api_version not in VERSIONS:
        raise ValueError("no topology read for API key %r version %r" % (api_key, api_version))


def _count(frame, pos, what):
    """A compact array's length, not null, and where its first element starts."""
    n, pos = read_uvarint(frame, pos)
    if n == 0:
        raise ProtocolError("null %s at offset %d" % (what, pos))
    n -= 1
    if n > len(frame) - pos:  # each element takes one byte at least
        raise ProtocolError("%d %s in %d bytes" % (n, what, len(frame) - pos))
    return n, pos


def _string(frame, pos, what, decode=True, nullable=False):
    """A compact string (str, or None when not ``decode`` or null), and the position after;
    a null is a ProtocolError unless ``nullable``."""
    n, start = read_uvarint(frame, pos)
    if n == 0:
        if nullable:
            return None, start
        raise ProtocolError("null %s at offset %d" % (what, pos))
    n -= 1
    if n > _MAX_STRING:
        raise ProtocolError("%s of %d bytes at offset %d" % (what, n, pos))
    end = start + n
    check_within(frame, start, n, "%s at offset %d" % (what, pos))
    if not decode:
        return None, end
    try:
        return bytes(frame[start:end]).decode("utf-8"), end
    except UnicodeDecodeError:
        raise ProtocolError("%s at offset %d is not UTF-8" % (what, pos)) from None


def _strings(frame, pos, what, decode=True):
    n, pos = _count(frame, pos, what + "s")
    out = []
    for _ in range(n):
        value, pos = _string(frame, pos, what, decode)
        out.append(value)
    return out, pos


def _topic_infos(frame, pos, what):
    """A []TopicInfo: Name, Partitions, ReplicationFactor, TopicConfigs ([]KeyValue), tags."""
    n, pos = _count(frame, pos, what + "s")
    names = []
    for _ in range(n):
        name, pos = _string(frame, pos, what + " name")
        names.append(name)
        check_within(frame, pos, 6, "partitions and replication factor at offset %d" % pos)
        configs, pos = _count(frame, pos + 6, "topic configs")
        for _ in range(configs):
            _, pos = _string(frame, pos, "config key", False)
            _, pos = _string(frame, pos, "config value", False)
            pos = skip_tagged_fields(frame, pos)
        pos = skip_tagged_fields(frame, pos)
    return names, pos


def _int16s(frame, pos, what):
    n, pos = _count(frame, pos, what)
    check_within(frame, pos, 2 * n, "%s at offset %d" % (what, pos))
    return pos + 2 * n


def _subtopologies(frame, body_offset):
    """The request's Topology as a list of (SourceTopics, RepartitionSinkTopics, names of the
    RepartitionSourceTopics, names of the StateChangelogTopics), one per subtopology, in
    order; None when it is null."""
    if not 0 <= body_offset <= len(frame):
        raise ProtocolError("body offset %d outside a frame of %d bytes"
                            % (body_offset, len(frame)))
    pos = body_offset
    _, pos = _string(frame, pos, "group id", False)
    _, pos = _string(frame, pos, "member id", False)
    check_within(frame, pos, 8, "member epochs at offset %d" % pos)
    pos += 8  # MemberEpoch, EndpointInformationEpoch
    _, pos = _string(frame, pos, "instance id", False, nullable=True)
    _, pos = _string(frame, pos, "rack id", False, nullable=True)
    pos += 4  # RebalanceTimeoutMs
    check_within(frame, pos, 1, "the topology's marker at offset %d" % pos)
    if frame[pos] >= 0x80:  # a negative int8: null (Kafka writes -1)
        return None
    pos += 1
    check_within(frame, pos, 4, "the topology's epoch at offset %d" % pos)
    count, pos = _count(frame, pos + 4, "subtopologies")
    subtopologies = []
    for _ in range(count):
        _, pos = _string(frame, pos, "subtopology id", False)
        sources, pos = _strings(frame, pos, "source topic")
        _, pos = _strings(frame, pos, "source topic regex", False)
        changelogs, pos = _topic_infos(frame, pos, "state changelog topic")
        sinks, pos = _strings(frame, pos, "repartition sink topic")
        repartitions, pos = _topic_infos(frame, pos, "repartition source topic")
        groups, pos = _count(frame, pos, "copartition groups")
        for _ in range(groups):
            for what in ("copartition source topics", "copartition source topic regexes",
                         "copartition repartition source topics"):
                pos = _int16s(frame, pos, what)
            pos = skip_tagged_fields(frame, pos)
        pos = skip_tagged_fields(frame, pos)
        subtopologies.append((sources, sinks, repartitions, changelogs))
    skip_tagged_fields(frame, pos)  # the Topology's
    return subtopologies


def _distinct(names):
    seen = set()
    return [name for name in names if not (name in seen or seen.add(name))]


def topology_topics(api_key, api_version, frame, body_offset):
    """The topic names Kafka's broker needs DESCRIBE on for a whole framed StreamsGroupHeartbeat
    request (``frame``, bytes, bytearray or memoryview, with its size prefix) whose body starts
    at ``body_offset`` (after its request header v2): those of its Topology, in the order the
    broker collects them (per subtopology: SourceTopics, RepartitionSinkTopics,
    RepartitionSourceTopics, StateChangelogTopics), each once, at its first place; None when
    Topology is null. An empty list (a topology of regexes only, or of no subtopology) is
    checked on nothing. ProtocolError when the frame is truncated or malformed (anywhere up to
    the Topology's end); ValueError for any other key or version."""
    _check(api_key, api_version)
    subtopologies = _subtopologies(frame, body_offset)
    if subtopologies is None:
        return None
    return _distinct(name for sources, sinks, repartitions, changelogs in subtopologies
                     for name in (*sources, *sinks, *repartitions, *changelogs))


def internal_topics(api_key, api_version, frame, body_offset):
    """The internal topics of a StreamsGroupHeartbeat request's Topology, the ones Kafka's
    broker may have to create for the group: per subtopology the names of its
    RepartitionSourceTopics, then of its StateChangelogTopics, each once; None when Topology
    is null. Same arguments and errors as ``topology_topics``.

    Kafka's broker does not check these on the request itself. After the group coordinator has
    answered a heartbeat (any heartbeat of the group, with a Topology or not), it takes the
    internal topics of the topology the coordinator keeps for the group that are missing from
    the cluster (StreamsGroupHeartbeatResult.creatableTopics: repartition source and state
    changelog topics, as here), and needs CREATE on the cluster, or failing that CREATE on each
    of those topics (AuthHelper.partitionByAuthorized). If one is refused it creates none of
    them and answers with ErrorCode 0 and no ErrorMessage, but in the response's Status: the
    MISSING_INTERNAL_TOPICS (3) status the coordinator set gets "; Unauthorized to CREATE on
    topics a, b." appended to its StatusDetail (or, without one, such a status is added with
    StatusDetail "Unauthorized to CREATE on topics a, b."), naming the refused topics joined by
    ", " in no set order. Otherwise it has them created (AutoTopicCreationManager
    .createStreamsInternalTopics). Which of these names are missing depends on the cluster;
    this is what the request can tell."""
    _check(api_key, api_version)
    subtopologies = _subtopologies(frame, body_offset)
    if subtopologies is None:
        return None
    return _distinct(name for _, _, repartitions, changelogs in subtopologies
                     for name in (*repartitions, *changelogs))


def is_valid_topic_name(name):
    """Kafka's Topic.isValid: not empty, not "." or "..", at most 249 characters, all of them
    ASCII letters, digits, '.', '_' or '-'."""
    return (name not in ("", ".", "..") and len(name) <= _MAX_NAME_LENGTH
            and all(c in _LEGAL for c in name))


def invalid_topology(names):
    """What Kafka's broker answers instead of checking DESCRIBE on ``names`` (as
    ``topology_topics`` returns them): (STREAMS_INVALID_TOPOLOGY, ErrorMessage) when one of
    them is an internal topic of Kafka's ("Use of Kafka internal topics a,b in a Kafka Streams
    topology is prohibited."), else when one is not a valid topic name ("Topic names a,b are
    not valid topic names."), the names in order joined by ","; None when the topology passes.
    The rest of that answer is at its defaults: ``group_answers.error_response(88, version,
    correlation_id, code, message)``."""
    names = list(names)
    internal = [name for name in names if name in INTERNAL_TOPICS]
    if internal:
        return (STREAMS_INVALID_TOPOLOGY, "Use of Kafka internal topics %s in a Kafka Streams "
                "topology is prohibited." % ",".join(internal))
    invalid = [name for name in names if not is_valid_topic_name(name)]
    if invalid:
        return (STREAMS_INVALID_TOPOLOGY,
                "Topic names %s are not valid topic names." % ",".join(invalid))
    return None
