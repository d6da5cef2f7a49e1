"""Access to kafka-python 3's schema-generated protocol classes.

Importing ``kafka.protocol`` emits a few hundred DeprecationWarnings; they are
silenced here once so that nothing else in the package has to care.
"""
import warnings

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
]
