"""Frames for the in-process pipeline benchmarks (``benchmarks/frame_cost.py``,
``topic_quotas.py``, ``storage_cost.py``): Produce and Fetch requests and responses of
``partitions`` partitions of the topic ``orders``, each with ``record_bytes`` of records, framed
as a client and a broker send them, cut into the reads a proxy gets; and the connection
pipeline they are fed to, on a fake clock, timed.

The frames and ``connection`` need only kafka-python's protocol classes and ``kthrottle``'s
pipeline, so that ``frame_cost.py``'s child process can load this file by its path while its
``kthrottle`` comes from the tree measured (it times exchanges its own way).
"""
import time
import uuid
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

from kthrottle.proxy.pipeline import Connection

TOPIC = "orders"
TOPIC_ID = uuid.UUID(int=0x0DE5)
READ = 65536  # bytes per read


def framed(message, cid, client_id="bench"):
    """``message`` with its header (a request's with ``client_id``; None: a response's),
    size-prefixed."""
    message.with_header(correlation_id=cid, **({"client_id": client_id} if client_id else {}))
    return bytes(message.encode(header=True, framed=True))


def produce_request(cid, version, partitions, record_bytes):
    D = ProduceRequest.TopicProduceData
    data = [D.PartitionProduceData(index=p, records=b"r" * record_bytes)
            for p in range(partitions)]
    return framed(ProduceRequest[version](
        transactional_id=None, acks=1, timeout_ms=30000,
        topic_data=[D(name=TOPIC, topic_id=TOPIC_ID, partition_data=data)]), cid)


def produce_response(cid, version, partitions=None):
    """The answer to ``produce_request``: each partition's offset (KIP-951's node endpoints
    empty); ``partitions`` None: no topic at all, the smallest answer."""
    T = ProduceResponse.TopicProduceResponse
    P = T.PartitionProduceResponse
    topics = [] if partitions is None else [T(name=TOPIC, topic_id=TOPIC_ID, partition_responses=[
        P(index=p, error_code=0, base_offset=5, log_append_time_ms=-1, log_start_offset=0,
          record_errors=[], error_message=None) for p in range(partitions)])]
    return framed(ProduceResponse[version](responses=topics, throttle_time_ms=0,
                                           node_endpoints=[]), cid, None)


def fetch_request(cid, version, partitions):
    F = FetchRequest
    parts = [F.FetchTopic.FetchPartition(partition=p, fetch_offset=5, partition_max_bytes=1 << 20)
             for p in range(partitions)]
    return framed(F[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20,
                             isolation_level=0, session_id=0, session_epoch=-1,
                             topics=[F.FetchTopic(topic=TOPIC, topic_id=TOPIC_ID,
                                                  partitions=parts)],
                             forgotten_topics_data=[], rack_id=""), cid)


def fetch_response(cid, version, partitions, record_bytes):
    T = FetchResponse.FetchableTopicResponse
    P = T.PartitionData
    parts = [P(partition_index=p, error_code=0, high_watermark=10, last_stable_offset=10,
               log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
               records=b"r" * record_bytes) for p in range(partitions)]
    return framed(FetchResponse[version](throttle_time_ms=0, error_code=0, session_id=9,
                                         node_endpoints=[], responses=[
        T(topic=TOPIC, topic_id=TOPIC_ID, partitions=parts)]), cid, None)


def reads(frame, size=READ):
    """``frame`` as the proxy reads it, in pieces of ``size`` bytes."""
    return [frame[i:i + size] for i in range(0, len(frame), size)]


def advertise(node_id):
    """The address the proxy gives out for a broker: one port per node id."""
    return ("127.0.0.1", 40000 + node_id)


def connection(table, manager=None):
    """A new pipeline (``proxy.pipeline.Connection``) of the filter table ``table``, its
    broker connected at time 0 of the fake clock."""
    conn = Connection(table, 100 * 1024 * 1024, manager)
    conn.broker_connected(0.0)
    return conn


def timed_exchanges(table, manager, exchanges, count):
    """Nanoseconds per exchange: ``count`` exchanges fed to pipelines of ``table`` (and the
    quota manager ``manager``), taking ``exchanges`` in turn ((request reads, response
    reads) each, one correlation id each: a new connection once they are all used), the
    fake clock 0.1 ms further for each; timed with the garbage collector off. Also the last
    connection, for the caller to check what it did."""
    from kthrottle_testkit.harness import gc_paused

    conn = connection(table, manager)
    now = 0.0
    with gc_paused():
        start = time.perf_counter_ns()
        for n in range(count):
            k = n % len(exchanges)
            if k == 0 and n:
                conn = connection(table, manager)  # the same correlation ids again
            now += 0.0001
            requests, responses = exchanges[k]
            for data in requests:
                conn.client_data(data, now)
            for data in responses:
                conn.broker_data(data, now)
        elapsed = time.perf_counter_ns() - start
    return elapsed / count, conn


def flags(what, repeats):
    """The flags of every in-process pipeline benchmark (for ``harness.flag_parser``):
    ``what`` the requests are, ``repeats`` the default of --repeats."""
    return (
        ("--requests", int, 20000, "%s per run" % what),
        ("--partitions", int, 4, "partitions per request"),
        ("--record-bytes", int, 4096, "record batch bytes per partition"),
        ("--repeats", int, repeats, "runs per configuration (median)"),
    )
