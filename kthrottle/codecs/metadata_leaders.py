"""The topics a Metadata response names, every version (v0-v13): their
names, ids and partition leaders, what a quota callback that splits quotas
by leader needs to know as soon as a client does, and what names the topic
ids of Fetch and Produce. A walk over the framed response that reads those
and skips the rest.

Fields by version (Kafka's MetadataResponse.json): throttle_time_ms v3+;
broker rack v1+; cluster_id v2+; controller_id v1+; topic name nullable
v12+, topic_id v10+, is_internal v1+; partition leader_epoch v7+,
offline_replicas v5+; topic_authorized_operations v8+; flexible (compact
arrays and strings, tagged fields) v9+.
"""
from .errors import ProtocolError
from .wire import (
    read_array_length,
    read_int16,
    read_int32,
    read_string,
    skip_string,
    skip_tagged_fields,
)

FLEXIBLE_FROM = 9
MAX_VERSION = 13


def metadata_leaders(frame, api_version):
    """{(topic, partition): leader node id (-1: none)} of one whole framed
    Metadata response, for the topics it answers without an error; a topic
    without a name (asked by id, v12+) is left out. ProtocolError on a
    malformed frame or a version past MAX_VERSION."""
    leaders = {}
    for error, name, _topic_id, partitions in metadata_topics(frame, api_version):
        if error or not name:
            continue
        for perror, index, leader in partitions:
            if perror in (0, 9):  # 9: REPLICA_NOT_AVAILABLE, still led
                leaders[(name, index)] = leader
    return leaders


def metadata_topics(frame, api_version):
    """[(error code, name or None, topic id bytes (v10+) or None, [(error
    code, partition index, leader id)])] of one whole framed Metadata
    response, in its order. ProtocolError on a malformed frame or a version
    past MAX_VERSION."""
    if not 0 <= api_version <= MAX_VERSION:
        raise ProtocolError("Metadata v%d: not a version this reader knows" % api_version)
    try:
        return _walk(frame, api_version)
    except (IndexError, ValueError, TypeError) as exc:  # a frame cut short
        raise ProtocolError("malformed Metadata v%d response: %s" % (api_version, exc)) from None


def _skip(frame, pos, nbytes):
    pos += nbytes
    if pos > len(frame):
        raise ProtocolError("Metadata response cut short at offset %d" % pos)
    return pos


def _walk(frame, v):
    compact = v >= FLEXIBLE_FROM
    pos = 8  # size, correlation_id
    if compact:
        pos = skip_tagged_fields(frame, pos)
    if v >= 3:
        pos = _skip(frame, pos, 4)  # throttle_time_ms
    count, pos = read_array_length(frame, pos, compact)  # brokers
    for _ in range(max(count, 0)):
        pos = _skip(frame, pos, 4)  # node_id
        pos = skip_string(frame, pos, compact)  # host
        pos = _skip(frame, pos, 4)  # port
        if v >= 1:
            pos = skip_string(frame, pos, compact)  # rack
        if compact:
            pos = skip_tagged_fields(frame, pos)
    if v >= 2:
        pos = skip_string(frame, pos, compact)  # cluster_id
    if v >= 1:
        pos = _skip(frame, pos, 4)  # controller_id
    topics = []
    count, pos = read_array_length(frame, pos, compact)  # topics
    for _ in range(max(count, 0)):
        error, pos = read_int16(frame, pos)
        name, pos = read_string(frame, pos, compact)
        topic_id = None
        if v >= 10:
            end = _skip(frame, pos, 16)
            topic_id, pos = bytes(frame[pos:end]), end
        if v >= 1:
            pos = _skip(frame, pos, 1)  # is_internal
        partitions = []
        n_partitions, pos = read_array_length(frame, pos, compact)
        for _ in range(max(n_partitions, 0)):
            perror, pos = read_int16(frame, pos)
            index, pos = read_int32(frame, pos)
            leader, pos = read_int32(frame, pos)
            if v >= 7:
                pos = _skip(frame, pos, 4)  # leader_epoch
            for _ in range(3 if v >= 5 else 2):  # replicas, isr (, offline_replicas)
                n, pos = read_array_length(frame, pos, compact)
                if n > 0:
                    pos = _skip(frame, pos, 4 * n)
            if compact:
                pos = skip_tagged_fields(frame, pos)
            partitions.append((perror, index, leader))
        if v >= 8:
            pos = _skip(frame, pos, 4)  # topic_authorized_operations
        if compact:
            pos = skip_tagged_fields(frame, pos)
        topics.append((error, name, topic_id, partitions))
    return topics
