"""Access to kafka-python 3's schema-generated protocol classes.

Importing ``kafka.protocol`` emits a few hundred DeprecationWarnings; they are
silenced here once so that nothing else in the package has to care.
"""
import warnings

from .errors import ProtocolError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import DescribeClusterResponse
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.metadata import (
        ApiVersionsRequest,
        ApiVersionsResponse,
        FindCoordinatorResponse,
        MetadataRequest,
        MetadataResponse,
    )
    from kafka.protocol.producer import ProduceRequest, ProduceResponse
    from kafka.protocol.api_header import ResponseClassRegistry



def decode_framed(cls, version, frame, what):
    """A whole framed message (size, header, body) read with kafka-python's
    schema class ``cls[version]``; ProtocolError "malformed <what>: why"
    when it does not decode (the version included)."""
    try:
        return cls[version].decode(bytes(frame[4:]), header=True)
    except Exception as exc:  # noqa: BLE001 (kafka-python raises several types on bad input)
        raise ProtocolError("malformed %s: %s" % (what, exc)) from None


def framed_request(request, correlation_id, client_id):
    """A request object framed, with its header."""
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def framed_response(response, correlation_id):
    """A response object framed, with its header."""
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


__all__ = [
    "ApiVersionsRequest",
    "ApiVersionsResponse",
    "DescribeClusterResponse",
    "FetchRequest",
    "FetchResponse",
    "FindCoordinatorResponse",
    "MetadataRequest",
    "MetadataResponse",
    "ProduceRequest",
    "ProduceResponse",
    "ResponseClassRegistry",
    "decode_framed",
    "framed_request",
    "framed_response",
]
