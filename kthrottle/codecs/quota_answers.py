"""Answers the proxy gives in the broker's place to a request its quota
holds past what a client waits for.

A Fetch is answered as Kafka's broker answers a fetch while its quota is
violated (KIP-219): no partitions, ``throttle_time_ms`` set, no error. A
Produce is answered REQUEST_TIMED_OUT on every partition it names: the error
a broker gives a Produce it could not complete in time, which every client
retries (the records were not written, so an idempotent producer's retry
keeps its sequence).
"""
from ._kafka import FetchResponse, ProduceResponse
from .errors import REQUEST_TIMED_OUT
from .produce import produce_partitions


def empty_fetch_response(correlation_id, api_version, throttle_ms):
    """A framed Fetch response of ``api_version`` holding no partitions, in
    no fetch session (session_id 0: the client's next fetch is a full one,
    KIP-227)."""
    cls = FetchResponse[api_version]
    response = cls(throttle_time_ms=throttle_ms, error_code=0, session_id=0, responses=[])
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def produce_timed_out_response(frame, api_version, correlation_id, throttle_ms):
    """A framed Produce response of ``api_version`` answering every partition
    of the whole framed request ``frame`` with REQUEST_TIMED_OUT.
    ProtocolError if the request is malformed."""
    cls = ProduceResponse[api_version]
    topic_cls = cls.TopicProduceResponse
    partition_cls = topic_cls.PartitionProduceResponse
    topics = {}
    for topic, index in produce_partitions(frame, api_version):
        topics.setdefault(topic, []).append(partition_cls(
            index=index, error_code=REQUEST_TIMED_OUT, base_offset=-1, log_append_time_ms=-1,
            log_start_offset=-1, record_errors=[], error_message=None))
    by_id = api_version >= 13  # topics named by id (KIP-516)
    responses = [topic_cls(partition_responses=partitions,
                           **({"topic_id": topic} if by_id else {"name": topic}))
                 for topic, partitions in topics.items()]
    response = cls(responses=responses, throttle_time_ms=throttle_ms)
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))
