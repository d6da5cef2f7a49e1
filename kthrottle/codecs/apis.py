"""API keys and versions the proxy must understand (Kafka's own numbering)."""
from ._kafka import (
    ApiVersionsResponse,
    DescribeClusterResponse,
    FetchResponse,
    FindCoordinatorResponse,
    MetadataResponse,
    ProduceResponse,
)

PRODUCE = 0
FETCH = 1
METADATA = 3
FIND_COORDINATOR = 10
API_VERSIONS = 18
DESCRIBE_CLUSTER = 60
# Share groups (KIP-932): ShareFetch moves record data, as Fetch does
SHARE_FETCH = 78
SHARE_ACKNOWLEDGE = 79

# Responses the proxy decodes (to rewrite broker addresses or version ranges):
# the highest version it can decode is the highest kafka-python's schemas know.
# ApiVersions answers are clamped to these, so clients never pick a version
# the proxy would have to pass through blind.
DECODED_RESPONSES = {
    PRODUCE: ProduceResponse,
    FETCH: FetchResponse,
    METADATA: MetadataResponse,
    FIND_COORDINATOR: FindCoordinatorResponse,
    API_VERSIONS: ApiVersionsResponse,
    DESCRIBE_CLUSTER: DescribeClusterResponse,
}
MAX_DECODABLE_VERSION = {key: cls.max_version for key, cls in DECODED_RESPONSES.items()}

# First versions whose responses use a flexible (tagged) header. ApiVersions
# is the exception: its response header is always v0 (KIP-511).
FLEXIBLE_FROM = {
    key: cls._flexible_versions[0]
    for key, cls in DECODED_RESPONSES.items()
    if cls._flexible_versions is not None
}

# KIP-951: NodeEndpoints tagged field at the top level of these responses.
NODE_ENDPOINTS_FROM = {PRODUCE: 10, FETCH: 16}


def is_flexible(api_key, api_version):
    first = FLEXIBLE_FROM.get(api_key)
    return first is not None and api_version >= first


def response_header_is_flexible(api_key, api_version):
    return api_key != API_VERSIONS and is_flexible(api_key, api_version)


def needs_rewrite(api_key, api_version):
    """Whether a response of this API and version may carry broker addresses."""
    if api_key in (METADATA, FIND_COORDINATOR, DESCRIBE_CLUSTER, API_VERSIONS):
        return True
    first = NODE_ENDPOINTS_FROM.get(api_key)
    return first is not None and api_version >= first


# Every response kafka-python's schemas describe, by API key (for layouts the
# proxy needs for all APIs, such as the response header and throttle_time_ms).
def _all_response_classes():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Importing these registers their response classes.
        import kafka.protocol.admin  # noqa: F401
        import kafka.protocol.consumer  # noqa: F401
        import kafka.protocol.metadata  # noqa: F401
        import kafka.protocol.producer  # noqa: F401
        import kafka.protocol.sasl  # noqa: F401
        from kafka.protocol.api_header import ResponseClassRegistry
    return dict(sorted(ResponseClassRegistry._response_class_registry.items()))


ALL_RESPONSES = _all_response_classes()

# api_key -> (first, last) versions with a flexible body, or None if never.
FLEXIBLE_VERSIONS = {
    key: (cls._flexible_versions
          if cls._flexible_versions is not None and cls._flexible_versions[0] >= 0 else None)
    for key, cls in ALL_RESPONSES.items()
}


def response_header_flexible(api_key, api_version):
    """Whether a response of any API kafka-python knows has a flexible header
    (v1: tagged fields after the correlation id). ApiVersions never does
    (KIP-511). None for an API key kafka-python does not know."""
    if api_key == API_VERSIONS:
        return False
    if api_key not in FLEXIBLE_VERSIONS:
        return None
    versions = FLEXIBLE_VERSIONS[api_key]
    return versions is not None and versions[0] <= api_version <= versions[1]
