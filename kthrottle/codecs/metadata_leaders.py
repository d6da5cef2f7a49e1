"""The topics a Metadata response names, every version (v0-v13): their
names, ids and partition leaders, what a quota callback that splits quotas
by leader needs to know as soon as a client does, and what names the topic
ids of Fetch and Produce; and where each topic's fields lie in the frame
(``metadata_layout``), for the authorization filter to splice the answer a
principal may see. A walk over the framed response that reads those and
skips the rest: a cluster's answer may name 100,000 partitions (some 4 MB),
walked with no call per field and, where only the topics are wanted, no
object per partition.

Fields by version (Kafka's MetadataResponse.json): throttle_time_ms v3+;
broker rack v1+; cluster_id v2+; controller_id v1+; topic name nullable
v12+, topic_id v10+, is_internal v1+; partition leader_epoch v7+,
offline_replicas v5+; topic_authorized_operations v8+; flexible (compact
arrays and strings, tagged fields) v9+.
"""
from struct import Struct
from struct import error as StructError
from typing import NamedTuple, Optional

from .errors import ProtocolError
from .wire import (
    INT32,
    read_array_length,
    read_int16,
    read_string,
    read_uvarint,
    skip_string,
    skip_tagged_fields,
)

FLEXIBLE_FROM = 9
MAX_VERSION = 13

# a partition's error_code, partition_index, leader_id
_PARTITION = Struct(">hii")


class MetadataTopic(NamedTuple):
    """One topic of a Metadata response: what it says and where its fields
    lie in the frame (offsets into it, -1 for a field its version lacks)."""

    start: int  # its error_code, where the entry starts
    error: int
    name: Optional[str]  # None: null (v12+, a topic asked by id)
    name_at: int
    topic_id: Optional[bytes]  # 16 bytes (v10+), else None
    id_at: int
    partitions_at: int  # the partitions' count
    partitions_end: int
    ops_at: int  # topic_authorized_operations (v8+)
    end: int  # after its tagged fields
    partitions: Optional[list]  # [(error code, index, leader id)] when read, else None


class MetadataLayout(NamedTuple):
    """Where a Metadata response's topics lie (metadata_layout)."""

    topics_at: int  # the topics' count
    topics_count_end: int
    topics: list  # [MetadataTopic]
    cluster_ops_at: int  # cluster_authorized_operations (v8-10), else -1


def metadata_leaders(frame, api_version):
    """{(topic, partition): leader node id (-1: none)} of one whole framed
    Metadata response, for the topics it answers without an error; a topic
    without a name (asked by id, v12+) is left out. ProtocolError on a
    malformed frame or a version past MAX_VERSION."""
    leaders = {}
    _checked(frame, api_version, leaders)  # filled as the partitions are walked
    return leaders


def metadata_topics(frame, api_version):
    """[(error code, name or None, topic id bytes (v10+) or None, [(error
    code, partition index, leader id)])] of one whole framed Metadata
    response, in its order. ProtocolError on a malformed frame or a version
    past MAX_VERSION."""
    return [(t.error, t.name, t.topic_id, t.partitions)
            for t in _checked(frame, api_version, True).topics]


def metadata_layout(frame, api_version, partitions=False):
    """The MetadataLayout of one whole framed Metadata response: each
    topic's fields and where they lie, its partitions read too when
    ``partitions`` (else only skipped: a tuple per partition costs more than
    the walk past it). ProtocolError on a malformed frame or a version past
    MAX_VERSION."""
    return _checked(frame, api_version, bool(partitions))


def _checked(frame, api_version, partitions):
    """_walk, its version checked and its errors ProtocolError."""
    if not 0 <= api_version <= MAX_VERSION:
        raise ProtocolError("Metadata v%d: not a version this reader knows" % api_version)
    try:
        return _walk(frame, api_version, partitions)
    except (IndexError, ValueError, TypeError, StructError) as exc:  # a frame cut short
        raise ProtocolError("malformed Metadata v%d response: %s" % (api_version, exc)) from None


def _skip(frame, pos, nbytes):
    pos += nbytes
    if pos > len(frame):
        raise ProtocolError("Metadata response cut short at offset %d" % pos)
    return pos


def _walk(frame, v, partitions):
    """``partitions``: False (skipped), True (a list of each topic's) or a
    dict filled with the leaders (metadata_leaders: no tuple kept per
    partition)."""
    leaders = partitions if partitions.__class__ is dict else None
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
    topics_at = pos
    count, pos = read_array_length(frame, pos, compact)  # topics
    topics_count_end = pos
    # error_code, partition_index, leader_id (, leader_epoch v7+)
    fixed = 14 if v >= 7 else 10
    arrays = 3 if v >= 5 else 2  # replica_nodes, isr_nodes (, offline_replicas v5+)
    size = len(frame)
    for _ in range(max(count, 0)):
        start = pos
        error, pos = read_int16(frame, pos)
        name_at = pos
        name, pos = read_string(frame, pos, compact)
        topic_id = None
        id_at = -1
        if v >= 10:
            id_at = pos
            end = _skip(frame, pos, 16)
            topic_id, pos = bytes(frame[pos:end]), end
        if v >= 1:
            pos = _skip(frame, pos, 1)  # is_internal
        partitions_at = pos
        n_partitions, pos = read_array_length(frame, pos, compact)
        if leaders is not None:  # those of a topic answered with no error, and named
            out = leaders if name and not error else None
        else:
            out = [] if partitions else None
        if n_partitions > 0:
            if compact:
                pos = _compact_partitions(frame, pos, n_partitions, fixed, out, name)
            else:
                pos = _partitions(frame, pos, n_partitions, fixed, arrays, out, name)
            if pos > size:
                raise ProtocolError("Metadata response cut short at offset %d" % pos)
        partitions_end = pos
        ops_at = -1
        if v >= 8:
            ops_at = pos
            pos = _skip(frame, pos, 4)  # topic_authorized_operations
        if compact:
            pos = skip_tagged_fields(frame, pos)
        topics.append(MetadataTopic(start, error, name, name_at, topic_id, id_at,
                                    partitions_at, partitions_end, ops_at, pos,
                                    None if leaders is not None else out))
    cluster_ops_at = -1
    if 8 <= v <= 10:
        cluster_ops_at = pos
        _skip(frame, pos, 4)
    return MetadataLayout(topics_at, topics_count_end, topics, cluster_ops_at)


# The partition loops: the commonest part of a large Metadata answer (100,000
# partitions in a cluster of that size), each read in a few steps, not a call
# per field. Bytes past the frame's end raise IndexError or struct.error as
# they are read; a skip past it is caught by the caller's check of the end.

def _compact_partitions(frame, pos, count, fixed, out, name):
    """v9+: ``count`` partitions from ``pos``, (error code, index, leader)
    appended to ``out`` (a list), or the leader put in it at (``name``,
    index) when the partition has one (a dict), or skipped (None); the
    offset after them."""
    unpack = _PARTITION.unpack_from
    keyed = out.__class__ is dict
    for _ in range(count):
        if keyed:
            perror, index, leader = unpack(frame, pos)
            if perror == 0 or perror == 9:  # 9: REPLICA_NOT_AVAILABLE, still led
                out[name, index] = leader
        elif out is not None:
            out.append(unpack(frame, pos))
        pos += fixed
        # replica_nodes, isr_nodes, offline_replicas: compact arrays of int32,
        # N+1 then 4N bytes (0: null), one byte below 127 entries
        c = frame[pos]
        if c < 0x80:
            pos += 4 * c - 3 if c else 1
        else:
            c, pos = read_uvarint(frame, pos)
            pos += 4 * c - 4
        c = frame[pos]
        if c < 0x80:
            pos += 4 * c - 3 if c else 1
        else:
            c, pos = read_uvarint(frame, pos)
            pos += 4 * c - 4
        c = frame[pos]
        if c < 0x80:
            pos += 4 * c - 3 if c else 1
        else:
            c, pos = read_uvarint(frame, pos)
            pos += 4 * c - 4
        if frame[pos]:
            pos = skip_tagged_fields(frame, pos)
        else:
            pos += 1
    return pos


def _partitions(frame, pos, count, fixed, arrays, out, name):
    """v0-8: the same with int32 counts (-1: null)."""
    unpack = _PARTITION.unpack_from
    int32 = INT32.unpack_from
    keyed = out.__class__ is dict
    for _ in range(count):
        if keyed:
            perror, index, leader = unpack(frame, pos)
            if perror == 0 or perror == 9:
                out[name, index] = leader
        elif out is not None:
            out.append(unpack(frame, pos))
        pos += fixed
        for _ in range(arrays):
            c = int32(frame, pos)[0]
            pos += 4 + 4 * c if c > 0 else 4
    return pos
