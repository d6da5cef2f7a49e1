"""Primitive Kafka wire types, read straight out of a buffer without copies.

Readers take ``(buf, pos)`` and return ``(value, new_pos)``; they raise
ProtocolError, never IndexError or struct.error, on bytes that run short.
"""
from struct import Struct, error as StructError

from .errors import ProtocolError

INT8 = Struct(">b")
INT16 = Struct(">h")
INT32 = Struct(">i")
INT16_INT16_INT32 = Struct(">hhi")


def read_int16(buf, pos):
    try:
        return INT16.unpack_from(buf, pos)[0], pos + 2
    except StructError:
        raise ProtocolError("truncated int16 at offset %d" % pos) from None


def read_int32(buf, pos):
    try:
        return INT32.unpack_from(buf, pos)[0], pos + 4
    except StructError:
        raise ProtocolError("truncated int32 at offset %d" % pos) from None


def read_uvarint(buf, pos):
    """Read an unsigned varint (the length prefix of compact types and tags)."""
    value = 0
    shift = 0
    while True:
        try:
            b = buf[pos]
        except IndexError:
            raise ProtocolError("truncated varint at offset %d" % pos) from None
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise ProtocolError("varint longer than 5 bytes at offset %d" % pos)


def write_uvarint(value):
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_array_length(buf, pos, compact):
    """Element count of an array (compact: uvarint N+1; else int32); -1 is null."""
    if compact:
        n, pos = read_uvarint(buf, pos)
        return n - 1, pos
    return read_int32(buf, pos)


def string_length(buf, pos, compact):
    """A (nullable) string's length (-1: null) and where its bytes start:
    compact uvarint N+1, else int16 N."""
    if compact:
        n, pos = read_uvarint(buf, pos)
        return n - 1, pos
    return read_int16(buf, pos)


def skip_string(buf, pos, compact):
    """Skip a (nullable) string or bytes field."""
    n, pos = string_length(buf, pos, compact)
    if n > 0:
        pos += n
        if pos > len(buf):
            raise ProtocolError("truncated string ending at offset %d" % pos)
    return pos


def skip_compact_bytes(buf, pos):
    """Skip compact (nullable) bytes: uvarint N+1, then N bytes."""
    n, pos = read_uvarint(buf, pos)
    if n > 1:
        pos += n - 1
        if pos > len(buf):
            raise ProtocolError("truncated bytes ending at offset %d" % pos)
    return pos


def read_string(buf, pos, compact):
    """Read a (nullable) string; None for null."""
    n, data_start = string_length(buf, pos, compact)
    if n < 0:
        return None, data_start
    end = data_start + n
    if end > len(buf):
        raise ProtocolError("truncated string ending at offset %d" % end)
    try:
        return bytes(buf[data_start:end]).decode("utf-8"), end
    except UnicodeDecodeError:
        raise ProtocolError("string at offset %d is not UTF-8" % pos) from None


def encode_string(value, compact):
    data = value.encode("utf-8")
    if compact:
        return write_uvarint(len(data) + 1) + data
    return INT16.pack(len(data)) + data


def skip_tagged_fields(buf, pos):
    """Skip a tagged-field section (KIP-482) and return the position after it."""
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
    if pos > len(buf):
        raise ProtocolError("truncated tagged fields ending at offset %d" % pos)
    return pos


def check_within(buf, pos, need, what):
    if pos + need > len(buf):
        raise ProtocolError("truncated %s" % what)
