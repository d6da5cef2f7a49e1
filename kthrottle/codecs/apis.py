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

# Client APIs the proxy passes through although kafka-python has no schema
# for them (numbers, names and "listeners" from Kafka's message specs,
# clients/src/main/resources/common/message/*Request.json, as of 4.4). None of
# their responses names a broker, except ShareFetch and ShareAcknowledge,
# whose NodeEndpoints the proxy rewrites (codecs/stream.py). StreamsGroup
# responses carry the endpoints of Streams application instances (KIP-1071),
# not of brokers. api key -> (Kafka's name, the first version whose body is
# flexible (all later ones are too), the newest version Kafka 4.4 has)
PASSED_THROUGH = {
    # delegation tokens (KIP-48)
    38: ("CreateDelegationToken", 2, 3), 39: ("RenewDelegationToken", 2, 2),
    40: ("ExpireDelegationToken", 2, 2), 41: ("DescribeDelegationToken", 2, 3),
    64: ("UnregisterBroker", 0, 0),  # an admin request (KIP-500), not a broker's
    68: ("ConsumerGroupHeartbeat", 0, 1), 69: ("ConsumerGroupDescribe", 0, 1),  # KIP-848
    71: ("GetTelemetrySubscriptions", 0, 0), 72: ("PushTelemetry", 0, 0),  # KIP-714
    76: ("ShareGroupHeartbeat", 0, 1), 77: ("ShareGroupDescribe", 0, 1),  # KIP-932
    SHARE_FETCH: ("ShareFetch", 0, 2), SHARE_ACKNOWLEDGE: ("ShareAcknowledge", 0, 2),
    # an administrator's, to a broker that forwards them to the controllers (KIP-853)
    80: ("AddRaftVoter", 0, 1), 81: ("RemoveRaftVoter", 0, 0),
    88: ("StreamsGroupHeartbeat", 0, 1), 89: ("StreamsGroupDescribe", 0, 1),  # KIP-1071
    90: ("DescribeShareGroupOffsets", 0, 1), 91: ("AlterShareGroupOffsets", 0, 0),  # KIP-932
    92: ("DeleteShareGroupOffsets", 0, 0),
    93: ("StreamsGroupTopologyDescriptionUpdate", 0, 0),  # KIP-1071
    94: ("UnregisterController", 0, 0),  # an admin request (KIP-853)
}

# Requests only brokers and controllers send: Kafka authorizes them as
# ClusterAction on the cluster (proxy/filters/broker_only.py refuses them
# from clients, and ApiVersions answers never list them). api key -> name
BROKER_ONLY_APIS = {
    # the ZooKeeper-mode controller and brokers
    4: "LeaderAndIsr", 5: "StopReplica", 6: "UpdateMetadata", 7: "ControlledShutdown",
    # the KRaft quorum (KIP-595, KIP-630, KIP-853) and brokers towards the
    # controllers (KIP-631, KIP-590, KIP-730, KIP-858, KIP-919)
    52: "Vote", 53: "BeginQuorumEpoch", 54: "EndQuorumEpoch", 56: "AlterPartition",
    58: "Envelope", 59: "FetchSnapshot", 62: "BrokerRegistration", 63: "BrokerHeartbeat",
    67: "AllocateProducerIds", 70: "ControllerRegistration", 73: "AssignReplicasToDirs",
    82: "UpdateRaftVoter",
    # a share partition's leader towards the share coordinator (KIP-932)
    83: "InitializeShareGroupState", 84: "ReadShareGroupState", 85: "WriteShareGroupState",
    86: "DeleteShareGroupState", 87: "ReadShareGroupStateSummary",
}

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
# ShareFetch and ShareAcknowledge, decoded by codecs/stream.py and rewrite.py
# (ShareFetchResponse.json, ShareAcknowledgeResponse.json): v0 was Kafka 4.0's
# early access of KIP-932, whose layout changed while it lasted and which 4.1
# removed, so the proxy takes v1 (4.1) and v2 (KIP-1206, KIP-1222) alone.
MAX_DECODABLE_VERSION[SHARE_FETCH] = MAX_DECODABLE_VERSION[SHARE_ACKNOWLEDGE] = 2
MIN_DECODABLE_VERSION = {SHARE_FETCH: 1, SHARE_ACKNOWLEDGE: 1}

# First versions whose responses use a flexible (tagged) header. ApiVersions
# is the exception: its response header is always v0 (KIP-511).
FLEXIBLE_FROM = {
    key: cls._flexible_versions[0]
    for key, cls in DECODED_RESPONSES.items()
    if cls._flexible_versions is not None
}
FLEXIBLE_FROM[SHARE_FETCH] = FLEXIBLE_FROM[SHARE_ACKNOWLEDGE] = 0

# Broker addresses at the top level of these responses, from these versions:
# KIP-951's NodeEndpoints tagged field (Produce, Fetch), and ShareFetch's and
# ShareAcknowledge's NodeEndpoints, a plain field after their responses (KIP-932).
NODE_ENDPOINTS_FROM = {PRODUCE: 10, FETCH: 16, SHARE_FETCH: 1, SHARE_ACKNOWLEDGE: 1}


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
FLEXIBLE_VERSIONS.update((key, (first, 32767)) for key, (_, first, _) in PASSED_THROUGH.items()
                         if key not in FLEXIBLE_VERSIONS)

# The newest version of each client API the proxy knows of: kafka-python's,
# and Kafka 4.4's for those it passes through (a table of every API and
# version, such as the pipeline's filter table, can be built from it)
KNOWN_MAX_VERSION = {key: cls.max_version for key, cls in ALL_RESPONSES.items()}
KNOWN_MAX_VERSION.update((key, newest) for key, (_, _, newest) in PASSED_THROUGH.items())

# The API keys a client may send through the proxy, and that its ApiVersions
# answers list: those kafka-python describes and those passed through on
# purpose, never one only brokers send. Any other key (one Kafka adds later,
# one it never had) is refused (proxy/filters/unknown_api_keys.py): a new API
# could carry data past the quotas, or broker addresses past the rewriting.
CLIENT_API_KEYS = frozenset(set(ALL_RESPONSES) | set(PASSED_THROUGH)) - set(BROKER_ONLY_APIS)
# and every key the proxy knows what to do with (refusing a broker's is one)
KNOWN_API_KEYS = CLIENT_API_KEYS | frozenset(BROKER_ONLY_APIS)


def advertised_range(api_key, low, high):
    """A broker's version range for ``api_key`` as the proxy's ApiVersions
    answers give it to clients: (low, high) narrowed to what the proxy
    decodes, or None when the API is not to be listed at all (one the proxy
    refuses, or no version of it the proxy would take)."""
    if api_key not in CLIENT_API_KEYS:
        return None
    limit = MAX_DECODABLE_VERSION.get(api_key)
    if limit is not None and high > limit:
        high = limit
    first = MIN_DECODABLE_VERSION.get(api_key)
    if first is not None and low < first:
        low = first
    return None if low > high else (low, high)


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
