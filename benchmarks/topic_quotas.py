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

from kthrottle.codecs import apis
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.filters.topic_quotas import TopicQuotas
from kthrottle.proxy.pipeline import FilterTable
from kthrottle_testkit import harness
from kthrottle_testkit import pipeline_frames as frames

HIGH = 1e15  # bytes/s: counted, never delayed
CONFIGS = ("before", "no topic quota", "topic quota", "topic quota, ids")
BATCH = 1024  # distinct correlation ids per connection


def make(config):
    snapshot = {"clients/<default>": {PRODUCER_BYTE_RATE: HIGH, CONSUMER_BYTE_RATE: HIGH}}
    if config.startswith("topic quota"):
        snapshot["topics/orders"] = {PRODUCER_BYTE_RATE: HIGH, CONSUMER_BYTE_RATE: HIGH}
    manager = QuotaManager(snapshot)
    filters = standard_filters(frames.advertise, manager)
    if config == "before":
        filters = [f for f in filters if not isinstance(f, TopicQuotas)]
    for f in filters:
        if isinstance(f, TopicQuotas):
            f.topic_names[frames.TOPIC_ID] = "orders"  # as learnt from a Metadata response
    return manager, FilterTable(filters)


def time_exchanges(config, api_key, args):
    """ns per request and its response (each in 64 KiB reads)."""
    manager, table = make(config)
    parts, size = args.partitions, args.record_bytes
    if api_key == apis.PRODUCE:
        exchanges = [(frames.reads(frames.produce_request(i, 8, parts, size)),
                      frames.reads(frames.produce_response(i, 8))) for i in range(BATCH)]
    else:
        version = 13 if config.endswith("ids") else 11
        exchanges = [(frames.reads(frames.fetch_request(i, version, parts)),
                      frames.reads(frames.fetch_response(i, version, parts, size)))
                     for i in range(BATCH)]
    ns, conn = frames.timed_exchanges(table, manager, exchanges, args.requests)
    assert conn.muted_until == 0.0  # nobody was delayed
    counted = manager.topic_buckets
    if config.startswith("topic quota"):
        key = PRODUCER_BYTE_RATE if api_key == apis.PRODUCE else CONSUMER_BYTE_RATE
        assert counted[key, "orders"].total == args.requests * args.partitions * args.record_bytes
    else:
        assert not counted
    return ns


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


FLAGS = frames.flags("requests (each API)", repeats=7)


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
