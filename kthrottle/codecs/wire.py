"""Primitive Kafka wire types, read straight out of a buffer without copies."""
from struct import Struct

from .errors import ProtocolError

INT16 = Struct(">h")
INT32 = Struct(">i")
INT16_INT16_INT32 = Struct(">hhi")


def read_uvarint(buf, pos):
    """Read an unsigned varint (the length prefix of compact types and tags)."""
    value = 0
    shift = 0
    while True:
        try:
            b = buf[pos]
        except IndexError:
            raise ProtocolError("truncated varint") from None
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise ProtocolError("varint longer than 5 bytes")


def write_uvarint(value):
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def skip_tagged_fields(buf, pos):
    """Skip a tagged-field section (KIP-482) and return the position after it."""
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
    if pos > len(buf):
        raise ProtocolError("truncated tagged fields")
    return pos


def tagged_field_tags(buf, pos):
    """The tags present in the tagged-field section starting at ``pos``."""
    count, pos = read_uvarint(buf, pos)
    tags = []
    for _ in range(count):
        tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
        tags.append(tag)
    if pos > len(buf):
        raise ProtocolError("truncated tagged fields")
    return tags


def skip_compact_bytes(buf, pos):
    """Skip a compact (nullable) string or bytes field: uvarint length + 1, then data."""
    n, pos = read_uvarint(buf, pos)
    if n:
        pos += n - 1
    return pos


def check_within(buf, pos, need, what):
    if pos + need > len(buf):
        raise ProtocolError("truncated %s" % what)
