"""Realistic multi-broker Kafka frames, built with kafka-python's schema-generated
classes, for codec tests that need no network."""
import uuid
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import DescribeClusterResponse
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.metadata import ApiVersionsResponse, FindCoordinatorResponse, MetadataResponse
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

from kthrottle.codecs.apis import response_header_is_flexible

BROKERS = [(1, "kafka-1.internal.example", 9092, "rack-a"),
           (2, "kafka-2.internal.example", 9093, "rack-b"),
           (3, "kafka-3.internal.example", 19094, None)]
PROXY_HOST = "proxy.example"


def advertise(node_id):
    return PROXY_HOST, 30000 + node_id


def frame_response(api_key, version, body, correlation_id=42):
    header = correlation_id.to_bytes(4, "big", signed=True)
    if response_header_is_flexible(api_key, version):
        header += b"\x00"
    payload = header + bytes(body)
    return len(payload).to_bytes(4, "big") + payload


def _brokers(cls, addresses, id_name="node_id"):
    return [cls(**{id_name: n, "host": h, "port": p, "rack": r}) for n, h, p, r in addresses]


def proxied(addresses):
    return [(n, *advertise(n), r) for n, _h, _p, r in addresses]


def metadata(version, addresses=BROKERS):
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    topics = [T(error_code=0, name="orders", topic_id=uuid.UUID(int=7), is_internal=False,
                partitions=[P(error_code=0, partition_index=i, leader_id=i + 1, leader_epoch=3,
                              replica_nodes=[1, 2, 3], isr_nodes=[1, 2, 3], offline_replicas=[])
                            for i in range(3)],
)]
    return M[version](throttle_time_ms=5, brokers=_brokers(M.MetadataResponseBroker, addresses),
                      cluster_id="cluster-x", controller_id=2, topics=topics,
                      error_code=0).encode()


def find_coordinator(version, addresses=BROKERS, error_code=0):
    F = FindCoordinatorResponse
    n, h, p, _ = addresses[1]
    if version < 4:
        if error_code:
            n, h, p = -1, "", -1
        return F[version](throttle_time_ms=0, error_code=error_code, error_message=None,
                          node_id=n, host=h, port=p).encode()
    coordinators = [F.Coordinator(key="group-%d" % i, node_id=a[0], host=a[1], port=a[2],
                                  error_code=0, error_message=None)
                    for i, a in enumerate(addresses)]
    if error_code:
        coordinators.append(F.Coordinator(key="bad", node_id=-1, host="", port=-1,
                                          error_code=error_code, error_message="not available"))
    return F[version](throttle_time_ms=0, coordinators=coordinators).encode()


def describe_cluster(version, addresses=BROKERS):
    D = DescribeClusterResponse
    brokers = [D.DescribeClusterBroker(broker_id=n, host=h, port=p, rack=r, is_fenced=False)
               for n, h, p, r in addresses]
    return D[version](throttle_time_ms=0, error_code=0, error_message=None, endpoint_type=1,
                      cluster_id="cluster-x", controller_id=1, brokers=brokers).encode()


def produce(version, addresses=BROKERS, with_endpoints=True):
    R = ProduceResponse
    T = R.TopicProduceResponse
    P = T.PartitionProduceResponse
    topics = [T(name="orders", topic_id=uuid.UUID(int=7),
                partition_responses=[P(index=i, error_code=6 if i == 1 else 0, base_offset=100 * i,
                                       log_append_time_ms=-1, log_start_offset=0,
                                       record_errors=[], error_message=None)
                                     for i in range(3)])]
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return R[version](responses=topics, throttle_time_ms=0, node_endpoints=endpoints).encode()


def fetch(version, addresses=BROKERS, with_endpoints=True, records=b"\x00" * 300):
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    parts = [P(partition_index=i, error_code=0, high_watermark=10, last_stable_offset=10,
               log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
               records=records if i != 1 else None)
             for i in range(3)]
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return R[version](throttle_time_ms=0, error_code=0, session_id=9,
                      responses=[T(topic="orders", topic_id=uuid.UUID(int=7), partitions=parts)],
                      node_endpoints=endpoints).encode()


def api_versions(version, ranges):
    A = ApiVersionsResponse
    return A[version](error_code=0,
                      api_keys=[A.ApiVersion(api_key=k, min_version=lo, max_version=hi)
                                for k, lo, hi in ranges],
                      throttle_time_ms=0).encode()


def produce_request(version, acks, transactional_id=None, client_id="app-1"):
    R = ProduceRequest
    D = R.TopicProduceData
    req = R[version](transactional_id=transactional_id, acks=acks, timeout_ms=30000,
                     topic_data=[D(name="orders", topic_id=uuid.UUID(int=7),
                                   partition_data=[D.PartitionProduceData(index=0, records=b"x" * 70)])])
    req.with_header(correlation_id=11, client_id=client_id)
    return req.encode(header=True, framed=True)
