"""Kafka wire format: bytes in, values out, and back. No I/O, no clocks."""
from .errors import ProtocolError
from .frames import DEFAULT_MAX_FRAME_SIZE, FrameReader, response_correlation_id
from .request import HeadTooShort, RequestHead
from .rewrite import Node, rewrite_response, unsupported_api_versions_response

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameReader",
    "HeadTooShort",
    "Node",
    "ProtocolError",
    "RequestHead",
    "response_correlation_id",
    "rewrite_response",
    "unsupported_api_versions_response",
]
