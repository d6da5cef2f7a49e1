"""Rewriting broker addresses (and version ranges) in responses.

Every address a broker hands a client must become the proxy's, or the client
will connect around the proxy (KAFKA-NOTES section 4). Responses that carry
addresses are decoded with kafka-python's schema-generated classes, patched,
and re-encoded; everything else in them survives as it was. Produce and Fetch
responses are hot, so they are only walked (no copies, no objects) to see
whether they carry KIP-951 NodeEndpoints at all, which they rarely do.
"""
from typing import Callable, NamedTuple

from . import apis
from .errors import ProtocolError
from .frames import frame_bytes, response_body_offset
from .wire import (
    INT16,
    check_within,
    read_uvarint,
    skip_compact_bytes,
    skip_tagged_fields,
    tagged_field_tags,
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
    flexible_header = apis.response_header_is_flexible(api_key, api_version)
    try:
        body_off = response_body_offset(frame, flexible_header)
    except ProtocolError:
        raise
    except Exception:
        raise ProtocolError("truncated response header") from None
    return handler(frame, body_off, api_version, advertise)


def _decode(cls, frame, body_off, version):
    if version > cls.max_version:
        raise ProtocolError("%s v%d is newer than the proxy can decode" % (cls.name, version))
    try:
        return cls.decode(bytes(frame[body_off:]), version=version)
    except Exception as exc:
        raise ProtocolError("malformed %s v%d: %s" % (cls.name, version, exc)) from None


def _encode(resp, frame, body_off, version):
    # the decoded message carries its version; encode() re-encodes at it
    return frame_bytes((frame[4:body_off], resp.encode()))


def _patch(item, advertise, id_attr="node_id"):
    """Point one broker entry at the proxy; return the upstream Node it had."""
    node = Node(getattr(item, id_attr), item.host, item.port)
    item.host, item.port = advertise(node.node_id)
    return node


def _metadata(frame, body_off, version, advertise):
    resp = _decode(apis.MetadataResponse, frame, body_off, version)
    nodes = [_patch(b, advertise) for b in resp.brokers]
    if not nodes:
        return None, nodes
    return _encode(resp, frame, body_off, version), nodes


def _find_coordinator(frame, body_off, version, advertise):
    resp = _decode(apis.FindCoordinatorResponse, frame, body_off, version)
    if version < 4:
        entries = [resp] if resp.error_code == 0 and resp.node_id >= 0 else []
    else:
        entries = [c for c in resp.coordinators if c.error_code == 0 and c.node_id >= 0]
    nodes = [_patch(e, advertise) for e in entries]
    if not nodes:
        return None, nodes
    return _encode(resp, frame, body_off, version), nodes


def _describe_cluster(frame, body_off, version, advertise):
    resp = _decode(apis.DescribeClusterResponse, frame, body_off, version)
    nodes = [_patch(b, advertise, "broker_id") for b in resp.brokers]
    if not nodes:
        return None, nodes
    return _encode(resp, frame, body_off, version), nodes


def _node_endpoints(cls, find_tags_offset):
    def handler(frame, body_off, version, advertise):
        if version < apis.NODE_ENDPOINTS_FROM[cls.API_KEY]:
            return None, []
        try:
            tags_at = find_tags_offset(frame, body_off, version)
            tags = tagged_field_tags(frame, tags_at)
        except ProtocolError:
            raise
        except Exception:
            raise ProtocolError("malformed %s v%d response" % (cls.name, version)) from None
        if 0 not in tags:  # tag 0 is NodeEndpoints in both Produce and Fetch
            return None, []
        resp = _decode(cls, frame, body_off, version)
        nodes = [_patch(e, advertise) for e in resp.node_endpoints]
        return _encode(resp, frame, body_off, version), nodes

    return handler


def _fetch_top_level_tags(buf, pos, version):
    """Position of the top-level tagged fields of a Fetch v16+ response."""
    pos += 10  # throttle_time_ms, error_code, session_id
    topics, pos = read_uvarint(buf, pos)
    for _ in range(topics - 1):
        pos += 16  # topic_id (v13+)
        partitions, pos = read_uvarint(buf, pos)
        for _ in range(partitions - 1):
            # partition_index, error_code, high_watermark, last_stable_offset,
            # log_start_offset
            pos += 30
            aborted, pos = read_uvarint(buf, pos)
            for _ in range(aborted - 1):
                pos = skip_tagged_fields(buf, pos + 16)  # producer_id, first_offset
            pos += 4  # preferred_read_replica
            pos = skip_compact_bytes(buf, pos)  # records
            pos = skip_tagged_fields(buf, pos)
        pos = skip_tagged_fields(buf, pos)
    check_within(buf, pos, 1, "Fetch response")
    return pos


def _produce_top_level_tags(buf, pos, version):
    """Position of the top-level tagged fields of a Produce v10+ response."""
    topics, pos = read_uvarint(buf, pos)
    for _ in range(topics - 1):
        if version >= 13:
            pos += 16  # topic_id
        else:
            pos = skip_compact_bytes(buf, pos)  # name
        partitions, pos = read_uvarint(buf, pos)
        for _ in range(partitions - 1):
            # index, error_code, base_offset, log_append_time_ms, log_start_offset
            pos += 30
            errors, pos = read_uvarint(buf, pos)
            for _ in range(errors - 1):
                pos = skip_compact_bytes(buf, pos + 4)  # batch_index, message
                pos = skip_tagged_fields(buf, pos)
            pos = skip_compact_bytes(buf, pos)  # error_message
            pos = skip_tagged_fields(buf, pos)
        pos = skip_tagged_fields(buf, pos)
    pos += 4  # throttle_time_ms
    check_within(buf, pos, 1, "Produce response")
    return pos


def _api_versions(frame, body_off, version, advertise):
    """Clamp advertised versions to what the proxy can decode."""
    try:
        error_code = INT16.unpack_from(frame, body_off)[0]
    except Exception:
        raise ProtocolError("truncated ApiVersions response") from None
    if error_code != 0:
        return None, []  # an error answer lists versions for the retry only
    resp = _decode(apis.ApiVersionsResponse, frame, body_off, version)
    changed = False
    for entry in resp.api_keys:
        limit = apis.MAX_DECODABLE_VERSION.get(entry.api_key)
        if limit is not None and entry.max_version > limit:
            entry.max_version = limit
            changed = True
    if not changed:
        return None, []
    return _encode(resp, frame, body_off, version), []


_HANDLERS = {
    apis.METADATA: _metadata,
    apis.FIND_COORDINATOR: _find_coordinator,
    apis.DESCRIBE_CLUSTER: _describe_cluster,
    apis.API_VERSIONS: _api_versions,
    apis.PRODUCE: _node_endpoints(apis.ProduceResponse, _produce_top_level_tags),
    apis.FETCH: _node_endpoints(apis.FetchResponse, _fetch_top_level_tags),
}


def unsupported_api_versions_response(correlation_id):
    """ApiVersions v0 answer with UNSUPPORTED_VERSION (35), as a broker gives
    to a client that asked with a version newer than it knows; the client
    then retries with a version in the range listed."""
    resp = apis.ApiVersionsResponse[0](
        error_code=35,
        api_keys=[
            apis.ApiVersionsResponse.ApiVersion(
                api_key=apis.API_VERSIONS,
                min_version=0,
                max_version=apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS],
            )
        ],
    )
    return frame_bytes((correlation_id.to_bytes(4, "big", signed=True), resp.encode(version=0)))
