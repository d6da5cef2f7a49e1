"""The PROXY protocol header (HAProxy's specification, versions 1 and 2).

A TCP load balancer that forwards connections writes one header as the
connection's first bytes, naming the client it accepted the connection from;
the proxy reads it before anything else (before a TLS handshake too). Only
what a TCP listener needs is kept: the source address. TLVs (v2) are
skipped. No I/O: ``parse_header`` is given the bytes read so far and says
"need more" (None), the header and its length, or ProtocolError.

    v1: "PROXY TCP4 198.51.100.7 203.0.113.1 51234 9092\\r\\n", at most 107 bytes
        ("PROXY UNKNOWN ...\\r\\n": the sender does not know the client)
    v2: 12-byte signature, version/command, family/protocol, 2-byte length,
        then the addresses and TLVs (LOCAL: a connection of the balancer's own,
        such as a health check)
"""
import ipaddress
import struct
from typing import NamedTuple, Optional

from .errors import ProtocolError

V1_PREFIX = b"PROXY "
V1_MAX_SIZE = 107  # the specification's bound, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_HEADER_SIZE = 16
# Addresses plus TLVs. The specification allows 65535; what balancers send
# (addresses, an AWS/Azure/GCP endpoint id, TLS details) is far smaller, and a
# connection is not made to hold more than this before it is known.
V2_MAX_LENGTH = 4096
MAX_SIZE = V2_HEADER_SIZE + V2_MAX_LENGTH

_V2_HEAD = struct.Struct(">BBH")  # version/command, family/protocol, length
_V2_INET = struct.Struct(">4s4sHH")
_V2_INET6 = struct.Struct(">16s16sHH")
_LOCAL, _PROXY = 0x0, 0x1
_UNSPEC, _INET, _INET6, _UNIX = 0x0, 0x1, 0x2, 0x3
_STREAM, _DGRAM = 0x1, 0x2


class ProxyHeader(NamedTuple):
    """A parsed header. ``source``/``destination``: (address, port), or None
    when the header names no client (v1 UNKNOWN, v2 LOCAL or an unspecified
    or UNIX family): the socket's own peer then stands. ``length``: the bytes
    it took, where the client's own bytes begin."""

    version: int
    source: Optional[tuple]
    destination: Optional[tuple]
    length: int


def parse_header(data):
    """The header at the start of ``data`` (bytes-like): a ProxyHeader, None
    while ``data`` is a proper prefix of one (read more and call again with
    everything read), or ProtocolError when it cannot be one."""
    data = bytes(data[:MAX_SIZE])
    if not data:
        return None
    if data[0] == V1_PREFIX[0]:
        return _v1(data)
    if data[0] == V2_SIGNATURE[0]:
        return _v2(data)
    raise ProtocolError("not a PROXY protocol header: it starts with %s" % _shown(data))


def _shown(data):
    return repr(bytes(data[:16]))


def _v1(data):
    if not data.startswith(V1_PREFIX[:len(data)]):
        raise ProtocolError("not a PROXY protocol header: it starts with %s" % _shown(data))
    end = data.find(b"\r\n", 0, V1_MAX_SIZE)
    if end < 0:
        if len(data) >= V1_MAX_SIZE:
            raise ProtocolError("PROXY protocol v1 header without CRLF in its first %d bytes"
                                % V1_MAX_SIZE)
        if any(b < 0x20 and b != 0x0D for b in data) or b"\r" in data[:-1]:
            raise ProtocolError("PROXY protocol v1 header with a control character: %s"
                                % _shown(data))
        return None
    line = data[:end]
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("PROXY protocol v1 header that is not ASCII") from None
    if not text.isprintable():
        raise ProtocolError("PROXY protocol v1 header with a control character: %r" % text)
    parts = text.split(" ")
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return ProxyHeader(1, None, None, end + 2)  # the rest of the line is ignored
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProtocolError("PROXY protocol v1 header is not 'PROXY TCP4|TCP6 SRC DST SPORT "
                            "DPORT' nor 'PROXY UNKNOWN': %r" % text)
    kind = ipaddress.IPv4Address if parts[1] == "TCP4" else ipaddress.IPv6Address
    try:
        source = (str(kind(parts[2])), _port(parts[4]))
        destination = (str(kind(parts[3])), _port(parts[5]))
    except ValueError as exc:
        raise ProtocolError("PROXY protocol v1 header %r: %s" % (text, exc)) from None
    return ProxyHeader(1, source, destination, end + 2)


def _port(text):
    # decimal, 0-65535, without a sign or leading zeros
    if not text.isdigit() or not text.isascii() or len(text) > 5 \
            or (len(text) > 1 and text[0] == "0") or int(text) > 65535:
        raise ValueError("%r is not a port number" % text)
    return int(text)


def _v2(data):
    if not data.startswith(V2_SIGNATURE[:len(data)]):
        raise ProtocolError("not a PROXY protocol header: it starts with %s" % _shown(data))
    if len(data) < V2_HEADER_SIZE:
        return None
    version_command, family_protocol, length = _V2_HEAD.unpack_from(data, 12)
    version, command = version_command >> 4, version_command & 0x0F
    if version != 2:
        raise ProtocolError("PROXY protocol v2 signature with version %d" % version)
    if command not in (_LOCAL, _PROXY):
        raise ProtocolError("PROXY protocol v2 header with unknown command %d" % command)
    if length > V2_MAX_LENGTH:
        raise ProtocolError("PROXY protocol v2 header of %d bytes of addresses and TLVs, more "
                            "than the %d accepted" % (length, V2_MAX_LENGTH))
    total = V2_HEADER_SIZE + length
    if len(data) < total:
        return None
    if command == _LOCAL:
        return ProxyHeader(2, None, None, total)
    family, protocol = family_protocol >> 4, family_protocol & 0x0F
    if protocol == _DGRAM:
        raise ProtocolError("PROXY protocol v2 header for a datagram connection, not TCP")
    if family == _UNSPEC or family == _UNIX or protocol == _UNSPEC:
        return ProxyHeader(2, None, None, total)  # nothing to use: the socket's peer stands
    layout = {_INET: _V2_INET, _INET6: _V2_INET6}.get(family)
    if layout is None:
        raise ProtocolError("PROXY protocol v2 header with unknown address family %d" % family)
    if protocol != _STREAM:
        raise ProtocolError("PROXY protocol v2 header with unknown protocol %d" % protocol)
    if length < layout.size:
        raise ProtocolError("PROXY protocol v2 header of %d bytes, too short for its %s "
                            "addresses (%d)" % (length, "IPv4" if family == _INET else "IPv6",
                                                 layout.size))
    src, dst, sport, dport = layout.unpack_from(data, V2_HEADER_SIZE)
    kind = ipaddress.IPv4Address if family == _INET else ipaddress.IPv6Address
    # the TLVs after the addresses are skipped
    return ProxyHeader(2, (str(kind(src)), sport), (str(kind(dst)), dport), total)


# building headers (tests, and whoever relays through the proxy) --------------

def v1_header(source, destination):
    """``PROXY TCP4|TCP6 ...\\r\\n`` for (address, port) pairs."""
    kind = "TCP6" if ":" in source[0] else "TCP4"
    return ("PROXY %s %s %s %d %d\r\n" % (kind, source[0], destination[0], source[1],
                                           destination[1])).encode("ascii")


def v2_header(source=None, destination=None, tlvs=b"", local=False):
    """A v2 header: PROXY with the two (address, port) pairs, or LOCAL."""
    if local or source is None:
        body = tlvs
        return V2_SIGNATURE + _V2_HEAD.pack(0x20, 0x00, len(body)) + body
    six = ":" in source[0]
    layout, family = (_V2_INET6, _INET6) if six else (_V2_INET, _INET)
    body = layout.pack(ipaddress.ip_address(source[0]).packed,
                       ipaddress.ip_address(destination[0]).packed,
                       source[1], destination[1]) + tlvs
    return V2_SIGNATURE + _V2_HEAD.pack(0x21, family << 4 | _STREAM, len(body)) + body
