"""ApiVersions (and Metadata) requests and answers the proxy makes itself.

A proxy that authenticates clients before it connects to a broker answers
their ApiVersions request itself (clients send it before SASL, KIP-511), from
the version ranges a broker gave it earlier, clamped to what the proxy can
decode. The answer's header is always v0, whatever the request's version
(KIP-511).
"""
from ._kafka import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest, MetadataResponse
from . import apis
from .errors import ProtocolError
from .rewrite import Node
from .wire import (
    INT16,
    INT32,
    read_array_length,
    read_int16,
    skip_tagged_fields,
    write_uvarint,
)

# The version the proxy asks a broker with: every broker since 0.10 has it,
# and the ranges it lists are the same at every version.
PROBE_VERSION = 0


def api_versions_request(correlation_id, client_id="kthrottle"):
    """A framed ApiVersions v0 request."""
    request = ApiVersionsRequest[PROBE_VERSION]()
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def parse_api_versions(frame, version=PROBE_VERSION):
    """A framed ApiVersions response -> ((api_key, min, max), ...), sorted.
    ProtocolError if it does not decode or carries an error."""
    try:
        answer = ApiVersionsResponse[version].decode(bytes(frame[8:]))
    except Exception as exc:  # kafka-python raises several types on bad input
        raise ProtocolError("malformed ApiVersions response: %s" % exc) from None
    if answer.error_code:
        raise ProtocolError("the broker answered ApiVersions with error %d" % answer.error_code)
    if answer.api_keys is None:  # ApiKeys is not nullable (ApiVersionsResponse.json)
        raise ProtocolError("malformed ApiVersions response: null api_keys")
    return tuple(sorted((int(k[0]), int(k[1]), int(k[2])) for k in answer.api_keys))


def api_versions_answer(correlation_id, version, ranges):
    """The answer to an ApiVersions request of ``version`` listing ``ranges``
    ((api_key, min, max), as a broker gave them) as apis.advertised_range
    says: each narrowed to what the proxy decodes, the APIs it refuses left
    out. None when ``version`` is newer than the proxy can encode (the caller
    answers UNSUPPORTED_VERSION then)."""
    if not 0 <= version <= ApiVersionsResponse.max_version:
        return None
    keys = []
    for api_key, low, high in ranges:
        advertised = apis.advertised_range(api_key, low, high)
        if advertised is not None:
            keys.append((api_key, *advertised))
    cls = ApiVersionsResponse[version]
    fields = {"error_code": 0, "api_keys": keys}
    if version >= 1:
        fields["throttle_time_ms"] = 0
    body = cls(**fields).encode()
    return INT32.pack(len(body) + 4) + INT32.pack(correlation_id) + bytes(body)


def with_api_ranges(ranges, answered=None, clamped=None, withheld=()):
    """Version ranges ((api_key, min, max), ...) as the proxy advertises them:
    the APIs it answers itself (``answered``: {api_key: (min, max)}) listed
    with its own range whatever the broker said (or added when the broker
    lacks them), the max of the ones it passes on after a look
    (``clamped``: {api_key: max}) lowered to what it can answer for, and the
    ones it refuses (``withheld``) left out."""
    answered = answered or {}
    clamped = clamped or {}
    out = []
    for api_key, low, high in ranges:
        if api_key in answered or api_key in withheld:
            continue
        limit = clamped.get(api_key)
        if limit is not None and high > limit:
            high = limit
        out.append((api_key, low, high))
    out.extend((key, low, high) for key, (low, high) in answered.items())
    return tuple(sorted(out))


def splice_api_ranges(frame, version, answered=None, clamped=None, withheld=()):
    """A framed ApiVersions response from a broker with the ranges
    ``with_api_ranges`` gives (None: nothing to change). Only the api_keys
    array is rewritten, an entry's own tagged fields kept; every other byte
    (throttle time, features) is copied as it came. An error answer is left
    alone."""
    if not answered and not clamped and not withheld:
        return None
    answered = answered or {}
    clamped = clamped or {}
    pos = 8  # size, correlation id (ApiVersions answers have header v0, KIP-511)
    error_code, pos = read_int16(frame, pos)
    if error_code != 0:
        return None
    compact = version >= 3
    start = pos
    count, pos = read_array_length(frame, pos, compact)
    if count < 0:
        raise ProtocolError("malformed ApiVersions response: null api_keys")
    entries = []
    changed = False
    for _ in range(count):
        api_key, pos = read_int16(frame, pos)
        low, pos = read_int16(frame, pos)
        high, pos = read_int16(frame, pos)
        tags_at = pos
        if compact:
            pos = skip_tagged_fields(frame, pos)
        if api_key in answered or api_key in withheld:
            changed = True
            continue
        limit = clamped.get(api_key)
        if limit is not None and high > limit:
            high, changed = limit, True
        entries.append(INT16.pack(api_key) + INT16.pack(low) + INT16.pack(high)
                       + bytes(frame[tags_at:pos]))
    tail = b"\x00" if compact else b""  # no tagged fields
    for api_key, (low, high) in sorted(answered.items()):
        changed = True
        entries.append(INT16.pack(api_key) + INT16.pack(low) + INT16.pack(high) + tail)
    if not changed:
        return None
    count = write_uvarint(len(entries) + 1) if compact else INT32.pack(len(entries))
    rest = bytes(frame[4:start]) + count + b"".join(entries) + bytes(frame[pos:])
    return INT32.pack(len(rest)) + rest


# Metadata v1 (every broker since 0.10): an empty topic list asks for the
# brokers alone (from v1 a null list, not an empty one, means every topic).
METADATA_PROBE_VERSION = 1


def metadata_request(correlation_id, client_id="kthrottle"):
    """A framed Metadata v1 request for the brokers and no topic."""
    request = MetadataRequest[METADATA_PROBE_VERSION](topics=[])
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def parse_metadata_brokers(frame):
    """A framed Metadata v1 response -> [Node, ...]; ProtocolError if it
    does not decode."""
    try:
        answer = MetadataResponse[METADATA_PROBE_VERSION].decode(bytes(frame[8:]))
        return [Node(int(b.node_id), b.host, int(b.port)) for b in answer.brokers or ()]
    except Exception as exc:  # kafka-python raises several types on bad input
        raise ProtocolError("malformed Metadata response: %s" % exc) from None
