#!/usr/bin/env python3
"""How long does one ``kthrottle spark-sync`` cycle take as the cluster grows?

Synthetic clusters of ``--sizes`` brokers (10 volumes each) and 100 partitions per broker
(replication factor 3, at most 100,000 partitions): each broker's volume report (the volume
agent's JSON, listing the replicas on each volume, some volumes past their soft or hard limit)
is published to a fresh report topic of 3 partitions on a local Tansu broker. One SparkSession
in local mode (``--master``) serves every size, as in ``--interval`` mode; the cluster's
Metadata (brokers, partition replicas) is the synthetic cluster's, since a Tansu broker is one
node. Each size runs a warm-up cycle and ``--cycles`` measured ones, each:

  read the reports (Spark, the Python data source) -> the latest per broker -> the snapshot
  (partition states) -> JSON -> written to a real ZooKeeper znode.

Reported: median cycle seconds, split into the Spark read, the snapshot computation and the
ZooKeeper write, and the snapshot's size.

Then the fleet-wide quota part of a cycle (``--fleet-proxies`` x ``--fleet-buckets``, each bucket
on 1 to 3 proxies): the proxies' usage reports in a topic, read with the same data source, the
shares computed on the driver, and one shares znode per proxy written.

Writes ``spark_sync_cycle.md`` and a plot ``spark_sync_cycle.png`` into ``--output-dir``.

Example (about 2 minutes)::

    python benchmarks/spark_sync_cycle.py
"""
import random
import statistics
import sys
import time
import uuid

import harness

from kthrottle.policy.storage import (
    BrokerReport,
    VolumeReport,
    cluster_snapshot,
    encode_snapshot,
    parse_limit,
)
from kthrottle.spark_sync import job as job_module

GB = 10 ** 9


def synthetic_cluster(brokers, partitions_per_broker=100, volumes=10, rf=3, seed=1):
    """(reports {id: BrokerReport}, replicas {(topic, p): [ids]})."""
    rng = random.Random(seed)
    ids = list(range(1, brokers + 1))
    total = min(brokers * partitions_per_broker, 100_000)
    replicas = {}
    on_volume = {(b, v): [] for b in ids for v in range(volumes)}
    for n in range(total):
        tp = ("topic-%d" % (n // 50), n % 50)
        holders = rng.sample(ids, min(rf, brokers))
        replicas[tp] = holders
        for b in holders:
            on_volume[b, rng.randrange(volumes)].append(tp)
    now = time.time()
    soft, hard = parse_limit("MinFreePercentage:20"), parse_limit("MinFreePercentage:10")
    reports = {}
    for b in ids:
        vols = []
        for v in range(volumes):
            used = rng.choice((30, 50, 70, 85, 95)) if rng.random() < 0.05 else rng.randint(5, 60)
            vols.append(VolumeReport("/dev/vd%s" % chr(97 + v), 4000 * GB, used * 40 * GB,
                                     "/var/kafka/data-%d" % v, tuple(on_volume[b, v])))
        reports[b] = BrokerReport(b, now, soft, hard, tuple(vols))
    return reports, replicas


def publish(bootstrap, topic, reports):
    """Each report ({key: report}) as one record keyed by its key, as the agents and the
    proxies publish them."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=5,
                             max_request_size=8 * 1024 * 1024)
    try:
        for key, report in reports.items():
            producer.send(topic, key=str(key).encode(), value=report.to_json().encode())
        producer.flush(120)
    finally:
        producer.close()


def synthetic_usage(proxies, buckets, seed=2):
    from kthrottle.policy.fleet import BucketUsage, UsageReport

    rng = random.Random(seed)
    ids = ["proxy-%04d" % i for i in range(proxies)]
    per_proxy = {p: [] for p in ids}
    for n in range(buckets):
        quota = float(rng.choice((1e5, 1e6, 1e7)))
        for p in rng.sample(ids, rng.randint(1, 3)):
            rate = rng.uniform(0, quota)
            per_proxy[p].append(BucketUsage("producer_byte_rate", "", "client-%d" % n,
                                            "clients/client-%d" % n, quota, rate,
                                            rate * rng.uniform(1, 3)))
    now = time.time()
    return {p: UsageReport(p, now, 5.0, (1,), tuple(b)) for p, b in per_proxy.items()}


def measure_fleet(sync, cycles):
    """[(total, read + shares, znode writes, proxies, bucket entries, bytes)]."""
    from kthrottle.policy.fleet import encode_shares_document, shares_document

    out = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        shares = sync.fleet_shares(time.time())
        t1 = time.perf_counter()
        written = 0
        sync.writer.ensure_connected()
        for proxy, proxy_shares in shares.items():
            data = encode_shares_document(shares_document(proxy_shares, time.time(), 1))
            sync.writer.write(data, znode="%s/shares/%s" % (sync.writer.znode, proxy))
            written += len(data)
        t2 = time.perf_counter()
        entries = sum(len(p.shares) for p in shares.values())
        out.append((t2 - t0, t1 - t0, t2 - t1, len(shares), entries, written))
    return out


def measure(sync, replicas_by_size, size, cycles):
    """[(total, read, compute, write, snapshot bytes)] for ``cycles`` cycles."""
    brokers, replicas = replicas_by_size[size]
    job_module.read_metadata = lambda settings, timeout_ms, leaders=None: (brokers, replicas)
    sync.leaders = {}
    out = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        offsets = sync.source.list_offsets(sync.settings, sync.topic, sync.timeout_ms)
        rows, _ = job_module.latest_reports(sync.session(), sync.settings, sync.topic, offsets,
                                            sync.timeout_ms)
        reports = job_module.parse_reports(rows)
        t1 = time.perf_counter()
        snap = cluster_snapshot(reports, brokers, replicas, time.time(), sync.freshness)
        data = encode_snapshot(snap)
        t2 = time.perf_counter()
        sync.writer.ensure_connected()
        sync.writer.write(data)
        t3 = time.perf_counter()
        assert len(reports) == len(brokers), (len(reports), len(brokers))
        out.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, len(data)))
    return out


FLAGS = (
    ("--sizes", harness.int_list, "10,100,1000", "broker counts"),
    ("--cycles", int, 3, "measured cycles per size"),
    ("--master", None, "local[2]", None),
    ("--fleet-proxies", int, 1000, None),
    ("--fleet-buckets", int, 100_000, None),
)


def medians(runs, columns):
    return [statistics.median(r[i] for r in runs) for i in range(columns)]


def run_sizes(run, args, out):
    """Every size, then the fleet part, with one SparkSession; fills ``out`` with the
    medians of each size's cycles and of the fleet part's."""
    zk = run.zookeeper()
    broker = run.broker()
    started = time.perf_counter()
    spark = job_module.spark_session(args.master)
    run.procs.on_stop(spark.stop)
    out["session_seconds"] = time.perf_counter() - started
    print("SparkSession (%s) started in %.1f s" % (args.master, out["session_seconds"]),
          flush=True)
    for size in args.sizes:
        topic = "usage-%d-%s" % (size, uuid.uuid4().hex[:6])
        broker.create_topic(topic, partitions=3)
        reports, replicas = synthetic_cluster(size)
        out["partitions"][size] = len(replicas)
        publish(broker.bootstrap, topic, reports)
        sync = job_module.SparkSync(broker.bootstrap, zk.hosts, topic=topic, spark=spark,
                                    freshness=3600)
        by_size = {size: (sorted(reports), replicas)}
        measure(sync, by_size, size, 1)  # warm-up
        runs = measure(sync, by_size, size, args.cycles)
        sync.writer.close()
        med = out["sizes"][size] = medians(runs, 5)
        print("  %5d brokers, %6d partitions: cycle %.2f s (read %.2f, snapshot %.2f, "
              "write %.3f), snapshot %d kB" % (size, len(replicas), med[0], med[1], med[2],
                                               med[3], med[4] // 1000), flush=True)
    usage = "proxy-usage-%s" % uuid.uuid4().hex[:6]
    broker.create_topic(usage, partitions=3)
    publish(broker.bootstrap, usage, synthetic_usage(args.fleet_proxies, args.fleet_buckets))
    sync = job_module.SparkSync(broker.bootstrap, zk.hosts, topic=usage, spark=spark,
                                usage_topic=usage, usage_freshness=3600)
    sync.leaders = {}
    measure_fleet(sync, 1)  # warm-up
    fleet = measure_fleet(sync, args.cycles)
    sync.writer.close()
    med = out["fleet"] = medians(fleet, 6)
    print("  fleet: %d proxies, %d bucket entries: %.2f s (read + shares %.2f, znodes "
          "%.2f s, %d kB)" % (med[3], med[4], med[0], med[1], med[2], med[5] // 1000),
          flush=True)


def report(args, out):
    lines = ["# One spark-sync cycle against the cluster's size", "",
             "`%s`; SparkSession (%s) start: %.1f s, once per run. Median of %d cycles after "
             "a warm-up one; 10 volumes per broker, 100 partitions per broker (replication "
             "factor 3)." % (args.command, args.master, out["session_seconds"], args.cycles),
             ""]
    rows = []
    for size, (cycle, read, snapshot, write, nbytes) in out["sizes"].items():
        rows.append((size, size * 10, out["partitions"][size], "%.2f" % cycle, "%.2f" % read,
                     "%.2f" % snapshot, "%.3f" % write, int(nbytes // 1000)))
    lines += harness.markdown_table(
        ["brokers", "volumes", "partitions", "cycle s", "Spark read s", "snapshot s",
         "ZooKeeper write s", "snapshot kB"], rows, align="r" * 8)
    fleet = out.get("fleet")
    if fleet:
        lines += ["", "Fleet-wide quota shares in the same cycle: %d proxies' usage reports, %d "
                  "buckets, each on 1 to 3 proxies (%d proxy-bucket entries): %.1f s (reading "
                  "the reports with Spark and computing the shares: %.1f s; writing %d shares "
                  "znodes, %d kB in all: %.1f s); median of %d cycles."
                  % (args.fleet_proxies, args.fleet_buckets, fleet[4], fleet[0], fleet[1],
                     fleet[3], fleet[5] // 1000, fleet[2], args.cycles)]
    if out.get("stopped"):
        lines += ["", "Stopped early (%s): only the sizes above were measured." % out["stopped"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True).parse_args(argv)
    args.command = harness.command_line("spark_sync_cycle", argv)
    out = {"sizes": {}, "partitions": {}}
    with harness.Run("spark_sync_cycle") as run:
        run_sizes(run, args, out)
    if not out["sizes"]:
        return run.finish(failed=True)
    out["stopped"] = run.stopped
    text = report(args, out)
    print(text)

    sizes = list(out["sizes"])
    draw = harness.line_chart(
        [(label, sizes, [out["sizes"][x][i] for x in sizes])
         for i, label in ((1, "Spark read"), (2, "snapshot"), (0, "whole cycle"))],
        "brokers (10 volumes, 100 partitions each)", "seconds",
        title="kthrottle spark-sync cycle, %s" % args.master, log_x=True, marker="o",
        figsize=(6, 3.5))
    harness.write_results(args.output_dir, "spark_sync_cycle", markdown=text, draw=draw)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
