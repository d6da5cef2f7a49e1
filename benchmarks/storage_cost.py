#!/usr/bin/env python3
"""What does storage-aware throttling cost, and how fast does a proxy follow the cluster state?

1. Per Produce request, in-process: the connection pipeline (``proxy.pipeline.Connection``,
   no sockets, a fake clock) fed ``--requests`` Produce requests of ``--partitions`` partitions
   x ``--record-bytes`` each, in 64 KiB reads, with their responses, under:

   * ``no storage``             - the proxy without ``--zookeeper`` (the filter is absent);
   * ``cluster, OPEN``          - cluster scope, every volume below its soft limit;
   * ``cluster, THROTTLE``      - cluster scope, THROTTLE (the rate is measured and compared
     per request; the limit is set high enough that nobody is delayed);
   * ``partition, none listed`` - partition scope, the snapshot lists no partition (requests
     are not read);
   * ``partition, watching``    - partition scope, the snapshot lists ``--listed`` partitions
     in THROTTLE elsewhere: every Produce request's partitions are read as it streams and looked
     up (the requests write to OPEN partitions, so nobody is delayed).

   Mean over a timed loop (``time.perf_counter_ns``, garbage collector off), median of
   ``--repeats`` runs, the configurations taking turns; "added" is the difference from
   ``no storage``.

2. Snapshot to proxy: a real ZooKeeper (Debian's package), a Tansu broker and a ``kthrottle
   proxy --zookeeper ... --admin-listen ...`` process. ``--writes`` times, the cluster state
   znode is set (alternately PAUSE and OPEN) and ``/metrics`` is polled every
   ``--poll-ms`` until ``kthrottle_storage_state{scope="cluster"}`` shows it: the time from
   the write returning to the proxy applying it (polling adds up to ``--poll-ms`` plus one
   HTTP request, about 1 ms).

Writes ``storage_cost.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``).

Example (about 40 s)::

    python benchmarks/storage_cost.py
"""
import statistics
import sys
import time

from kthrottle.policy.storage import (
    OPEN_STATE,
    THROTTLE,
    ClusterState,
    State,
    StoragePolicy,
)
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.storage import StorageThrottle
from kthrottle.proxy.pipeline import FilterTable
from kthrottle_testkit import harness
from kthrottle_testkit import pipeline_frames as frames

WALL = 1_800_000_000.0


def make_table(config, listed):
    storage = None
    if config != "no storage":
        scope = config.split(",")[0]
        storage = StorageThrottle(StoragePolicy(scope, "PAUSE", max_age=1e9), base_rate=1e15)
        if config == "cluster, OPEN":
            state = ClusterState(WALL, OPEN_STATE)
        elif config == "cluster, THROTTLE":
            state = ClusterState(WALL, State(THROTTLE, 0.5))
        elif config == "partition, none listed":
            state = ClusterState(WALL, OPEN_STATE)
        else:
            state = ClusterState(WALL, OPEN_STATE, (), {
                ("elsewhere-%d" % (i // 10), i % 10): State(THROTTLE, 0.5) for i in range(listed)})
        storage.policy.update(state)
        storage.refresh(WALL, 0.0)
    return FilterTable(standard_filters(frames.advertise, None, storage=storage))


BATCH = 1024  # distinct correlation ids per connection


def time_requests(config, args):
    """ns per request (request in 64 KiB reads, then its response)."""
    table = make_table(config, args.listed)
    exchanges = [
        (frames.reads(frames.produce_request(i, 8, args.partitions, args.record_bytes)),
         [frames.produce_response(i, 8)]) for i in range(BATCH)]
    return frames.timed_exchanges(table, None, exchanges, args.requests)[0]


CONFIGS = ("no storage", "cluster, OPEN", "cluster, THROTTLE", "partition, none listed",
           "partition, watching")


def request_costs(args):
    """Median per configuration; the configurations take turns in each
    repeat, so that a slow spell of the machine touches them all alike."""
    runs = {config: [] for config in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            runs[config].append(time_requests(config, args))
    out = {config: statistics.median(r) for config, r in runs.items()}
    for config in CONFIGS:
        print("  %-24s %8.0f ns per request" % (config, out[config]), flush=True)
    return out


STATE_METRIC = 'kthrottle_storage_state{broker="",scope="cluster",volume=""}'
STATE_ZNODE = "/kthrottle/cluster-state"


def follow_latency(run, args):
    """ms from each snapshot write returning to the proxy's /metrics showing it."""
    zk_server = run.zookeeper()
    broker = run.broker()
    proxy = run.kthrottle(broker, ["--zookeeper", zk_server.hosts, "--storage-scope", "cluster"],
                          admin=True, name="proxy",
                          probe=False)
    zk = harness.zk_client(run.procs, zk_server.hosts)
    latencies = []
    for i in range(args.writes):
        consumed, want = (85, 2.0) if i % 2 == 0 else (10, 0.0)
        harness.write_znode(zk, STATE_ZNODE, harness.storage_snapshot(consumed))
        written = time.perf_counter()
        while harness.metric_sum(proxy.metrics(), STATE_METRIC) != want:
            if time.perf_counter() - written > 10:
                raise RuntimeError("the proxy did not apply write %d within 10 s" % i)
            time.sleep(args.poll_ms / 1000)
        latencies.append((time.perf_counter() - written) * 1000)
    return latencies


FLAGS = frames.flags("Produce requests", repeats=9) + (
    ("--listed", int, 1000, "partitions the snapshot lists (partition, watching)"),
    ("--writes", int, 40, "snapshot writes to follow"),
    ("--poll-ms", float, 2.0, "/metrics polling interval"),
)


def main(argv=None):
    args = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True).parse_args(argv)
    args.command = harness.command_line("storage_cost", argv)
    harness.output_dir(args, "storage_cost")
    print("per Produce request (%d partitions x %d B):" % (args.partitions, args.record_bytes))
    costs = request_costs(args)
    print("snapshot to proxy (%d writes):" % args.writes, flush=True)
    with harness.Run("storage_cost") as run:
        lat = sorted(follow_latency(run, args))
    if run.stopped:
        return run.finish()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
    lines = [
        "# Storage-aware throttling: cost per Produce request, and snapshot to proxy",
        "",
        "`%s`" % args.command,
        "",
        "Per Produce request (%d partitions x %d B, 64 KiB reads, with its response; "
        "median of %d runs of %d requests):" % (args.partitions, args.record_bytes,
                                                  args.repeats, args.requests),
        "",
    ]
    base = costs["no storage"]
    lines += harness.markdown_table(
        ["configuration", "ns per request", "added"],
        [(config, "%.0f" % costs[config], "%+.0f" % (costs[config] - base))
         for config in CONFIGS])
    lines += [
        "",
        "Snapshot written to ZooKeeper until the proxy applies it (%d writes, /metrics polled "
        "every %.0f ms): median %.1f ms, p90 %.1f ms, max %.1f ms."
        % (len(lat), args.poll_ms, statistics.median(lat), q[89], lat[-1]),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    harness.write_results(args.output_dir, "storage_cost", markdown=text)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
