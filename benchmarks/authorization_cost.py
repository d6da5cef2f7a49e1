#!/usr/bin/env python3
"""What does enforcing the cluster's ACLs at the proxy cost per request?

A pure in-process microbenchmark of one connection's pipeline (``proxy.pipeline.Connection``
with the standard filters, no sockets, no broker, no event loop): a Produce request of one
16 KiB batch and its response, and a Fetch request and its response, fed through the pipeline
the way the connection adapter feeds them (the short way first), in four setups:

* ``no filter``       - the proxy without the authorization filter (``--authorization none``,
  or ``--sasl-mode passthrough``);
* ``no authorizer``   - the filter with a cluster that has no authorizer (nothing to enforce);
* ``allowed every``   - ACLs enforced, the principal allowed WRITE and READ on every topic
  and WRITE on every transactional id (``*``): decided once, the requests take the short way;
* ``prefixed ACLs``   - ACLs enforced, the principal allowed its own ``alice-`` topics: each
  request read whole and its topics checked (Produce with the proxy's own walker, Fetch decoded).

Means are total time / requests over a timed loop (``time.perf_counter_ns``, garbage collector
off), median of ``--repeats`` runs; the ratio is against ``no filter`` in the same run.

Writes ``authorization_cost.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``); never over a committed result.

Example (about 20 s on the 2-core project VM)::

    python benchmarks/authorization_cost.py
"""
import argparse
import os
import platform
import statistics
import sys
import time
import warnings

from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.authorization import AclView, Authorization
from kthrottle.proxy.pipeline import Connection, FilterTable
from kthrottle.sources.acls import AclSnapshot
from kthrottle_testkit import harness
from kthrottle_testkit.harness import gc_paused

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID = 2, 3, 4, 5
READ, WRITE, DESCRIBE = 3, 4, 8
LITERAL, PREFIXED = 3, 4
ALLOW = 3
MAX_FRAME = 100 << 20


def advertise(node_id):
    return "127.0.0.1", 19092 + node_id


def framed(request, cid):
    request.with_header(correlation_id=cid, client_id="bench")
    return bytes(request.encode(header=True, framed=True))


def framed_response(response, cid):
    response.with_header(correlation_id=cid)
    return bytes(response.encode(header=True, framed=True))


def produce(cid, topic="alice-orders"):
    D = ProduceRequest.TopicProduceData
    return framed(ProduceRequest[9](transactional_id=None, acks=-1, timeout_ms=30000, topic_data=[
        D(name=topic, partition_data=[D.PartitionProduceData(index=0, records=b"r" * 16384)])]),
        cid)


def produce_answer(cid, topic="alice-orders"):
    T = ProduceResponse.TopicProduceResponse
    return framed_response(ProduceResponse[9](throttle_time_ms=0, responses=[T(
        name=topic, partition_responses=[T.PartitionProduceResponse(
            index=0, error_code=0, base_offset=5, log_append_time_ms=-1, log_start_offset=0,
            record_errors=[], error_message=None)])]), cid)


def fetch(cid, topic="alice-orders"):
    F = FetchRequest
    P = F.FetchTopic.FetchPartition
    return framed(F[12](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20,
                        isolation_level=0, session_id=0, session_epoch=-1, topics=[F.FetchTopic(
                            topic=topic, partitions=[P(partition=0, current_leader_epoch=-1,
                                                       fetch_offset=5, last_fetched_epoch=-1,
                                                       log_start_offset=-1,
                                                       partition_max_bytes=1 << 20)])],
                        forgotten_topics_data=[], rack_id=""), cid)


def fetch_answer(cid, topic="alice-orders"):
    T = FetchResponse.FetchableTopicResponse
    P = T.PartitionData
    return framed_response(FetchResponse[12](throttle_time_ms=0, error_code=0, session_id=0,
                                             responses=[T(topic=topic, partitions=[P(
                                                 partition_index=0, error_code=0,
                                                 high_watermark=10, last_stable_offset=10,
                                                 log_start_offset=0, aborted_transactions=[],
                                                 preferred_read_replica=-1,
                                                 records=b"r" * 65536)])]), cid)


def view(kind):
    if kind == "no filter":
        return None
    v = AclView()
    if kind == "no authorizer":
        v.update(AclSnapshot(False, (), frozenset(), False))
        return v
    name, pattern = ("*", LITERAL) if kind == "allowed every" else ("alice-", PREFIXED)
    bindings = tuple((TOPIC, name, pattern, "User:alice", "*", op, ALLOW)
                     for op in (READ, WRITE, DESCRIBE))
    if kind == "allowed every":  # and every transactional id (Kafka's LITERAL "*" leaves
        # out the ids starting with "*": PREFIXED "*" covers them)
        bindings += tuple((TRANSACTIONAL_ID, "*", pattern, "User:alice", "*", WRITE, ALLOW)
                          for pattern in (LITERAL, PREFIXED))
    # other tenants' ACLs, as a shared cluster has them
    bindings += tuple((TOPIC, "team-%d-" % i, PREFIXED, "User:team-%d" % i, "*", op, ALLOW)
                      for i in range(200) for op in (READ, WRITE))
    v.update(AclSnapshot(True, bindings, frozenset(), False))
    return v


def connection(kind):
    filters = standard_filters(advertise)
    v = view(kind)
    if v is not None:
        filters.append(Authorization(v))
    conn = Connection(FilterTable(filters), MAX_FRAME)
    conn.client_host = "10.0.0.1"
    conn.client_accepted(0.0, principal="alice")
    conn.broker_connected(0.0)
    return conn


def exchange(conn, request, answer, now):
    """One request and its answer, as the adapter feeds them (the short way first)."""
    if conn.pass_request(request, now) is False:
        conn.client_data(request, now)
    if conn.pass_response(answer) is False:
        conn.broker_data(answer, now)


def measure(kind, api, requests):
    conn = connection(kind)
    make, answer = (produce, produce_answer) if api == "produce" else (fetch, fetch_answer)
    frames = [(make(i), answer(i)) for i in range(1, 65)]  # correlation ids in turn
    now = 0.0
    n = 0
    with gc_paused():
        start = time.perf_counter_ns()
        while n < requests:
            for request, response in frames:
                exchange(conn, request, response, now)
                now += 1e-5
            n += len(frames)
        elapsed = time.perf_counter_ns() - start
    assert conn.requests >= n, (kind, api, conn.requests)
    return elapsed / n


KINDS = ("no filter", "no authorizer", "allowed every", "prefixed ACLs")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000,
                        help="requests per timed loop (default 20000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per cell (default 5)")
    parser.add_argument("--output-dir", help="where authorization_cost.md goes (default: a new "
                        "directory under benchmarks/runs/)")
    args = parser.parse_args(argv)
    out = harness.output_dir(args, "authorization_cost")
    started = time.time()
    rows = {}
    for api in ("produce", "fetch"):
        for kind in KINDS:
            rows[api, kind] = statistics.median(measure(kind, api, args.requests)
                                                for _ in range(args.repeats))
            print("%-7s %-14s %7.2f us per request and response"
                  % (api, kind, rows[api, kind] / 1000), flush=True)
    lines = ["# What enforcing ACLs at the proxy costs per request", "",
             "Machine: %d CPUs, %s; Python %s." % (os.cpu_count(), platform.processor() or
                                                   platform.machine(),
                                                   platform.python_version()), "",
             "Command: `python benchmarks/authorization_cost.py %s` (%.0f s); one connection's "
             "pipeline, standard filters, a Produce of one 16 KiB batch and its answer, a Fetch "
             "and its 64 KiB answer; median of %d loops of %d requests."
             % (" ".join(argv or sys.argv[1:]), time.time() - started, args.repeats,
                args.requests), "",
             "| request | setup | us per request and answer | vs no filter |",
             "|---|---|---:|---:|"]
    for (api, kind), ns in rows.items():
        lines.append("| %s | %s | %.2f | %.2fx |" % (api, kind, ns / 1000,
                                                    ns / rows[api, "no filter"]))
    path = os.path.join(out, "authorization_cost.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %s" % path)


if __name__ == "__main__":
    sys.exit(main())
