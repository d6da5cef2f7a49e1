"""Rewriting broker addresses (and version ranges) in responses.

Every address a broker hands a client must become the proxy's, or the client
connects around the proxy. The rewrite is a splice:
the response is walked just far enough to find each broker's host and port,
those bytes are replaced, and every other byte is copied as it came. Decoding
and re-encoding with kafka-python would drop tagged fields its schemas do not
know (a newer broker's) and default-valued ones, so it is used only in tests,
to build the frames this module is checked against.
"""
from typing import Callable, NamedTuple

from . import apis
from .errors import ProtocolError
from .frames import response_body_offset
from .throttle import walk_produce
from .wire import (
    INT16,
    INT32,
    encode_string,
    read_array_length,
    read_int16,
    read_int32,
    read_string,
    read_uvarint,
    skip_compact_bytes,
    skip_string,
    skip_tagged_fields,
    write_uvarint,
)


class Node(NamedTuple):
    """A broker as the upstream cluster advertises it."""

    node_id: int
    host: str
    port: int


# node id -> (host, port) the client must be given for that node
Advertise = Callable[[int], tuple]


def rewrite_response(frame, api_key, api_version, advertise):
    """Rewrite one framed response.

    Returns ``(new_frame, nodes)``: ``new_frame`` is None when the frame must
    be forwarded unchanged; ``nodes`` lists every broker address found, as the
    upstream advertised it, so the caller can route node ids to brokers.
    """
    handler = _HANDLERS.get(api_key)
    if handler is None:
        return None, []
    limit = apis.MAX_DECODABLE_VERSION[api_key]
    if api_version > limit:
        raise ProtocolError("api_key %d v%d is newer than the proxy can decode" % (api_key, api_version))
    if api_version < apis.MIN_DECODABLE_VERSION.get(api_key, 0):
        raise ProtocolError("api_key %d v%d is older than the proxy can decode"
                            % (api_key, api_version))
    body = response_body_offset(frame, apis.response_header_is_flexible(api_key, api_version))
    edits, nodes = handler(frame, body, api_version, advertise)
    if not edits:
        return None, nodes
    return splice(frame, edits), nodes


def splice(frame, edits):
    """``frame`` with ``(start, end, replacement)`` edits (in order, not
    overlapping) applied and its size prefix made right: one new bytes
    object, the frame's bytes copied into it once (the runs between the
    edits are views of it until then; a Metadata answer of 100,000
    partitions is some 4 MB)."""
    view = memoryview(frame)
    parts = [b""]
    pos = 4
    for start, end, replacement in edits:
        parts.append(view[pos:start])
        parts.append(replacement)
        pos = end
    parts.append(view[pos:])
    parts[0] = INT32.pack(sum(len(p) for p in parts))
    return b"".join(parts)


def _broker_entry(buf, pos, compact, advertise, edits, nodes, rewrite=True):
    """A node_id, host, port run (common to every address-carrying schema)."""
    node_id, pos = read_int32(buf, pos)
    host_at = pos
    host, pos = read_string(buf, pos, compact)
    port, pos = read_int32(buf, pos)
    if rewrite and node_id >= 0:
        if host is None:  # not nullable in any of these schemas
            raise ProtocolError("null host for node %d" % node_id)
        nodes.append(Node(node_id, host, port))
        new_host, new_port = advertise(node_id)
        edits.append((host_at, pos, encode_string(new_host, compact) + INT32.pack(new_port)))
    return pos


def _metadata(buf, pos, version, advertise):
    compact = version >= 9
    if version >= 3:
        pos += 4  # throttle_time_ms
    edits, nodes = [], []
    count, pos = read_array_length(buf, pos, compact)
    for _ in range(count):
        pos = _broker_entry(buf, pos, compact, advertise, edits, nodes)
        if version >= 1:
            pos = skip_string(buf, pos, compact)  # rack
        if compact:
            pos = skip_tagged_fields(buf, pos)
    return edits, nodes


def _find_coordinator(buf, pos, version, advertise):
    compact = version >= 3
    edits, nodes = [], []
    if version >= 1:
        pos += 4  # throttle_time_ms
    if version < 4:
        error_code, pos = read_int16(buf, pos)
        if version >= 1:
            pos = skip_string(buf, pos, compact)  # error_message
        _broker_entry(buf, pos, compact, advertise, edits, nodes, rewrite=error_code == 0)
        return edits, nodes
    count, pos = read_array_length(buf, pos, True)
    for _ in range(count):
        pos = skip_string(buf, pos, True)  # key
        entry_edits, entry_nodes = [], []
        pos = _broker_entry(buf, pos, True, advertise, entry_edits, entry_nodes)
        error_code, pos = read_int16(buf, pos)
        if error_code == 0:
            edits += entry_edits
            nodes += entry_nodes
        pos = skip_string(buf, pos, True)  # error_message
        pos = skip_tagged_fields(buf, pos)
    return edits, nodes


def _describe_cluster(buf, pos, version, advertise):
    edits, nodes = [], []
    pos += 6  # throttle_time_ms, error_code
    pos = skip_string(buf, pos, True)  # error_message
    if version >= 1:
        pos += 1  # endpoint_type
    pos = skip_string(buf, pos, True)  # cluster_id
    pos += 4  # controller_id
    count, pos = read_array_length(buf, pos, True)
    for _ in range(count):
        pos = _broker_entry(buf, pos, True, advertise, edits, nodes)
        pos = skip_string(buf, pos, True)  # rack
        if version >= 2:
            pos += 1  # is_fenced
        pos = skip_tagged_fields(buf, pos)
    return edits, nodes


def _node_endpoints_tag(buf, pos, advertise):
    """Rewrite tag 0 (KIP-951 NodeEndpoints) of the tagged section at ``pos``."""
    edits, nodes = [], []
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        tag, pos = read_uvarint(buf, pos)
        size_at = pos
        size, pos = read_uvarint(buf, pos)
        end = pos + size
        if end > len(buf):
            raise ProtocolError("truncated tagged field %d" % tag)
        if tag == 0:
            inner = []
            n, p = read_array_length(buf, pos, True)
            for _ in range(n):
                p = _broker_entry(buf, p, True, advertise, inner, nodes)
                p = skip_string(buf, p, True)  # rack
                p = skip_tagged_fields(buf, p)
            if p != end:
                raise ProtocolError("NodeEndpoints size does not match its contents")
            value = _splice_plain(buf, pos, end, inner)
            edits.append((size_at, end, write_uvarint(len(value)) + value))
        pos = end
    return edits, nodes


def _splice_plain(buf, start, end, edits):
    parts = []
    pos = start
    for s, e, replacement in edits:
        parts.append(buf[pos:s])
        parts.append(replacement)
        pos = e
    parts.append(buf[pos:end])
    return b"".join(parts)


def _fetch(buf, pos, version, advertise):
    """Fetch v16+: walk to the top-level tagged fields (no record copies)."""
    if version < apis.NODE_ENDPOINTS_FROM[apis.FETCH]:
        return [], []
    pos += 10  # throttle_time_ms, error_code, session_id
    topics, pos = read_array_length(buf, pos, True)
    for _ in range(topics):
        pos += 16  # topic_id (v13+)
        partitions, pos = read_array_length(buf, pos, True)
        for _ in range(partitions):
            # partition_index, error_code, high_watermark, last_stable_offset,
            # log_start_offset
            pos += 30
            aborted, pos = read_array_length(buf, pos, True)
            for _ in range(aborted):
                pos = skip_tagged_fields(buf, pos + 16)  # producer_id, first_offset
            pos += 4  # preferred_read_replica
            pos = skip_compact_bytes(buf, pos)  # records
            pos = skip_tagged_fields(buf, pos)
        pos = skip_tagged_fields(buf, pos)
    return _node_endpoints_tag(buf, pos, advertise)


def _produce(buf, pos, version, advertise):
    """Produce v10+: the NodeEndpoints tag follows throttle_time_ms."""
    if version < apis.NODE_ENDPOINTS_FROM[apis.PRODUCE]:
        return [], []
    pos = walk_produce(buf, pos, version) + 4  # past throttle_time_ms
    return _node_endpoints_tag(buf, pos, advertise)


def _api_versions(buf, pos, version, advertise):
    """The APIs advertised as apis.advertised_range says: version ranges
    narrowed to what the proxy decodes (in place), and the APIs it refuses
    (unknown ones, broker-only ones) left out, the array's count with them.
    Each kept entry's own tagged fields, and every byte after the array
    (throttle_time_ms, features), stay as they came."""
    error_code, pos = read_int16(buf, pos)
    if error_code != 0:
        return [], []  # an error answer is v0 and only lists versions to retry with
    compact = version >= 3
    edits = []
    count_at = pos
    count, pos = read_array_length(buf, pos, compact)
    if count < 0:
        return [], []  # null (not nullable, ApiVersionsResponse.json): the client's to refuse
    if count > (len(buf) - pos) // 6:  # each entry takes 6 bytes or more
        raise ProtocolError("ApiVersions answer of %d APIs in %d bytes" % (count, len(buf) - pos))
    kept = count
    for _ in range(count):
        entry_at = pos
        api_key, pos = read_int16(buf, pos)
        low, pos = read_int16(buf, pos)
        high, pos = read_int16(buf, pos)
        if compact:
            pos = skip_tagged_fields(buf, pos)
        advertised = apis.advertised_range(api_key, low, high)
        if advertised is None:
            edits.append((entry_at, pos, b""))
            kept -= 1
        elif advertised != (low, high):
            edits.append((entry_at + 2, entry_at + 6, INT16.pack(advertised[0])
                          + INT16.pack(advertised[1])))
    if kept != count:
        count_end = read_array_length(buf, count_at, compact)[1]
        edits.insert(0, (count_at, count_end,
                         write_uvarint(kept + 1) if compact else INT32.pack(kept)))
    return edits, []


def _share(buf, pos, version, advertise, fetch):
    """ShareFetch and ShareAcknowledge v1+ (ShareFetchResponse.json,
    ShareAcknowledgeResponse.json): NodeEndpoints is a plain field after the
    responses (KIP-932), each entry as in KIP-951's."""
    pos = skip_string(buf, pos + 6, True)  # throttle_time_ms, error_code; error_message
    if fetch or version >= 2:
        pos += 4  # acquisition_lock_timeout_ms (ShareFetch v1+, ShareAcknowledge v2+)
    topics, pos = read_array_length(buf, pos, True)
    for _ in range(topics):
        partitions, pos = read_array_length(buf, pos + 16, True)  # topic_id
        for _ in range(partitions):
            # partition_index, error_code; error_message
            pos = skip_string(buf, pos + 6, True)
            if fetch:
                # acknowledge_error_code; acknowledge_error_message
                pos = skip_string(buf, pos + 2, True)
            pos = skip_tagged_fields(buf, pos + 8)  # current_leader: leader_id, leader_epoch
            if fetch:
                pos = skip_compact_bytes(buf, pos)  # records
                ranges, pos = read_array_length(buf, pos, True)  # acquired_records
                for _ in range(ranges):
                    # first_offset, last_offset, delivery_count
                    pos = skip_tagged_fields(buf, pos + 18)
            pos = skip_tagged_fields(buf, pos)
        pos = skip_tagged_fields(buf, pos)
    edits, nodes = [], []
    count, pos = read_array_length(buf, pos, True)  # node_endpoints
    if count > len(buf) - pos:
        raise ProtocolError("NodeEndpoints of %d entries in %d bytes" % (count, len(buf) - pos))
    for _ in range(count):
        pos = _broker_entry(buf, pos, True, advertise, edits, nodes)
        pos = skip_string(buf, pos, True)  # rack
        pos = skip_tagged_fields(buf, pos)
    pos = skip_tagged_fields(buf, pos)
    if pos != len(buf):
        raise ProtocolError("%d bytes after the response's tagged fields" % (len(buf) - pos))
    return edits, nodes


def _share_fetch(buf, pos, version, advertise):
    return _share(buf, pos, version, advertise, True)


def _share_acknowledge(buf, pos, version, advertise):
    return _share(buf, pos, version, advertise, False)


_HANDLERS = {
    apis.METADATA: _metadata,
    apis.FIND_COORDINATOR: _find_coordinator,
    apis.DESCRIBE_CLUSTER: _describe_cluster,
    apis.API_VERSIONS: _api_versions,
    apis.PRODUCE: _produce,
    apis.FETCH: _fetch,
    apis.SHARE_FETCH: _share_fetch,
    apis.SHARE_ACKNOWLEDGE: _share_acknowledge,
}


def unsupported_api_versions_response(correlation_id):
    """ApiVersions v0 answer with UNSUPPORTED_VERSION (35), as a broker gives
    a client that asked with a version newer than it knows; the client then
    retries with a version in the range listed."""
    body = (
        INT32.pack(correlation_id)
        + INT16.pack(35)
        + INT32.pack(1)
        + INT16.pack(apis.API_VERSIONS)
        + INT16.pack(0)
        + INT16.pack(apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS])
    )
    return INT32.pack(len(body)) + body
