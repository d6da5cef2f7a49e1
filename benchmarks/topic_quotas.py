#!/usr/bin/env python3
"""What does a per-topic quota cost per request?

In-process: the connection pipeline (``proxy.pipeline.Connection``, no sockets, a fake clock)
with the proxy's chain of filters and a quota source holding a client quota (high: nobody is
delayed), fed ``--requests`` Produce requests (each ``--partitions`` partitions x
``--record-bytes``, in 64 KiB reads, with their responses) and as many Fetch requests with their
responses (the same partitions and records, in 64 KiB reads), under:

* ``before``         - the chain without the TopicQuotas filter (the proxy before per-topic
  quotas);
* ``no topic quota`` - the filter in the chain, the quota source holding no topic entity (what
  every proxy pays now: one check per Produce and Fetch, nothing read);
* ``topic quota``    - ``[topics.orders]`` with a producer_byte_rate and a consumer_byte_rate
  (high: nobody is delayed): every Produce request and Fetch response is read as it streams
  and counted in the topic's bucket;
* ``topic quota, ids`` - the same with Fetch v13 (topics named by id, KIP-516; the id is known
  from a Metadata response relayed before). Produce stays v8 there (Tansu offers up to v11).

Mean over a timed loop (``time.perf_counter_ns``, garbage collector off), median of
``--repeats`` runs, the configurations taking turns; "added" is the difference from ``before``.

Writes ``topic_quotas.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``).

Example (about 30 s)::

    python benchmarks/topic_quotas.py
"""
import statistics
import sys
import uuid
import warnings
import time

from kthrottle.codecs import apis
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.topic_quotas import TopicQuotas
from kthrottle.proxy.pipeline import Connection, FilterTable
from kthrottle_testkit import harness

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

TOPIC_ID = uuid.UUID(int=0x0DE5)
HIGH = 1e15  # bytes/s: counted, never delayed
CONFIGS = ("before", "no topic quota", "topic quota", "topic quota, ids")
BATCH = 1024  # distinct correlation ids per connection


def advertise(node_id):
    return ("127.0.0.1", 40000 + node_id)


def framed(message, cid):
    message.with_header(correlation_id=cid, client_id="bench")
    return bytes(message.encode(header=True, framed=True))


def produce_request(cid, partitions, record_bytes):
    D = ProduceRequest.TopicProduceData
    data = [D.PartitionProduceData(index=p, records=b"r" * record_bytes) for p in range(partitions)]
    return framed(ProduceRequest[8](transactional_id=None, acks=1, timeout_ms=30000, topic_data=[
        D(name="orders", topic_id=TOPIC_ID, partition_data=data)]), cid)


def produce_response(cid):
    resp = ProduceResponse[8](responses=[], throttle_time_ms=0)
    resp.with_header(correlation_id=cid)
    return bytes(resp.encode(header=True, framed=True))


def fetch_request(cid, version, partitions):
    F = FetchRequest
    parts = [F.FetchTopic.FetchPartition(partition=p, fetch_offset=5, partition_max_bytes=1 << 20)
             for p in range(partitions)]
    return framed(F[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20,
                             isolation_level=0, session_id=0, session_epoch=-1,
                             topics=[F.FetchTopic(topic="orders", topic_id=TOPIC_ID,
                                                  partitions=parts)],
                             forgotten_topics_data=[], rack_id=""), cid)


def fetch_response(cid, version, partitions, record_bytes):
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    parts = [P(partition_index=p, error_code=0, high_watermark=10, last_stable_offset=10,
               log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
               records=b"r" * record_bytes) for p in range(partitions)]
    resp = R[version](throttle_time_ms=0, error_code=0, session_id=9, node_endpoints=[],
                      responses=[T(topic="orders", topic_id=TOPIC_ID, partitions=parts)])
    resp.with_header(correlation_id=cid)
    return bytes(resp.encode(header=True, framed=True))


def make(config):
    snapshot = {"clients/<default>": {PRODUCER_BYTE_RATE: HIGH, CONSUMER_BYTE_RATE: HIGH}}
    if config.startswith("topic quota"):
        snapshot["topics/orders"] = {PRODUCER_BYTE_RATE: HIGH, CONSUMER_BYTE_RATE: HIGH}
    manager = QuotaManager(snapshot)
    filters = standard_filters(advertise, manager)
    if config == "before":
        filters = [f for f in filters if not isinstance(f, TopicQuotas)]
    for f in filters:
        if isinstance(f, TopicQuotas):
            f.topic_names[TOPIC_ID] = "orders"  # as learnt from a Metadata response
    return manager, FilterTable(filters)


def new_connection(table, manager):
    conn = Connection(table, 100 * 1024 * 1024, manager)
    conn.broker_connected(0.0)
    return conn


def chunks(frame):
    return [frame[i:i + 65536] for i in range(0, len(frame), 65536)]


def time_exchanges(config, api_key, args):
    """ns per request and its response (each in 64 KiB reads)."""
    manager, table = make(config)
    conn = new_connection(table, manager)
    if api_key == apis.PRODUCE:
        requests = [chunks(produce_request(i, args.partitions, args.record_bytes))
                    for i in range(BATCH)]
        responses = [chunks(produce_response(i)) for i in range(BATCH)]
    else:
        version = 13 if config.endswith("ids") else 11
        requests = [chunks(fetch_request(i, version, args.partitions)) for i in range(BATCH)]
        responses = [chunks(fetch_response(i, version, args.partitions, args.record_bytes))
                     for i in range(BATCH)]
    now = 0.0
    with harness.gc_paused():
        start = time.perf_counter_ns()
        for n in range(args.requests):
            k = n % BATCH
            if k == 0 and n:
                conn = new_connection(table, manager)  # the same correlation ids again
            now += 0.0001
            for chunk in requests[k]:
                conn.client_data(chunk, now)
            for chunk in responses[k]:
                conn.broker_data(chunk, now)
        elapsed = time.perf_counter_ns() - start
    assert conn.muted_until == 0.0  # nobody was delayed
    counted = manager.topic_buckets
    if config.startswith("topic quota"):
        key = PRODUCER_BYTE_RATE if api_key == apis.PRODUCE else CONSUMER_BYTE_RATE
        assert counted[key, "orders"].total == args.requests * args.partitions * args.record_bytes
    else:
        assert not counted
    return elapsed / args.requests


def costs(args):
    out = {}
    for api_key, name in ((apis.PRODUCE, "Produce"), (apis.FETCH, "Fetch")):
        runs = {config: [] for config in CONFIGS}
        for _ in range(args.repeats):
            for config in CONFIGS:
                runs[config].append(time_exchanges(config, api_key, args))
        for config in CONFIGS:
            out[name, config] = statistics.median(runs[config])
            print("  %-8s %-18s %8.0f ns" % (name, config, out[name, config]), flush=True)
    return out


FLAGS = (
    ("--requests", int, 20000, "requests per run (each API)"),
    ("--partitions", int, 4, "partitions per request"),
    ("--record-bytes", int, 4096, "record batch bytes per partition"),
    ("--repeats", int, 7, "runs per configuration (median)"),
)


def main(argv=None):
    args = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True).parse_args(argv)
    args.command = harness.command_line("topic_quotas", argv)
    harness.output_dir(args, "topic_quotas")
    print("per request and its response (%d partitions x %d B):"
          % (args.partitions, args.record_bytes))
    found = costs(args)
    lines = [
        "# Per-topic quotas: cost per Produce and Fetch",
        "",
        "`%s`" % args.command,
        "",
        "Per request with its response, in-process pipeline (%d partitions x %d B, 64 KiB "
        "reads; a client quota configured; median of %d runs of %d requests):"
        % (args.partitions, args.record_bytes, args.repeats, args.requests),
        "",
    ]
    rows = []
    for name in ("Produce", "Fetch"):
        base = found[name, "before"]
        for config in CONFIGS:
            rows.append((name, config, "%.0f" % found[name, config],
                         "%+.0f" % (found[name, config] - base)))
    lines += harness.markdown_table(["API", "configuration", "ns per request", "added"], rows,
                                    align="llrr")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    harness.write_results(args.output_dir, "topic_quotas", markdown=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
