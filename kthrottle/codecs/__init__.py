"""Kafka wire format: bytes in, values out, and back. No I/O, no clocks."""
from .errors import ProtocolError
from .frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameReader,
    RequestHeader,
    parse_request_header,
    produce_acks,
    response_correlation_id,
)
from .rewrite import Node, rewrite_response, unsupported_api_versions_response

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameReader",
    "Node",
    "ProtocolError",
    "RequestHeader",
    "parse_request_header",
    "produce_acks",
    "response_correlation_id",
    "rewrite_response",
    "unsupported_api_versions_response",
]
