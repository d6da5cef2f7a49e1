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

With ``--backlog``: the two report topics are first filled with ``--backlog-minutes`` of
reports (``--backlog-proxies`` proxies every ``--proxy-interval`` s, ``--backlog-brokers``
brokers every ``--broker-interval`` s, produced with confluent-kafka within
``--backlog-budget`` seconds), then on each of ``--backlog-masters`` (local[2]; ``standalone``:
a Spark master and two workers, 1 core and 1 GB each, started here from the PySpark install
on 127.0.0.1) whole cycles run (``SparkSync.cycle``: both topics, the snapshot, the shares,
one ZooKeeper transaction): the first reads the whole backlog, then ``--cycles`` steady ones,
each after one interval of new reports. Reported: cycle seconds and the records and bytes
read from Kafka, first and steady; written to ``spark_sync_backlog.md``.

Example (about 2 minutes)::

    python benchmarks/spark_sync_cycle.py
    python benchmarks/spark_sync_cycle.py --backlog   # about 6 minutes
"""
import random
import statistics
import sys
import time
import uuid

from kthrottle.policy.storage import (
    BrokerReport,
    VolumeReport,
    cluster_snapshot,
    encode_snapshot,
    parse_limit,
)
from kthrottle.spark_sync import job as job_module
from kthrottle_testkit import harness

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
    ("--backlog-proxies", int, 1000, None),
    ("--backlog-brokers", int, 1000, None),
    ("--backlog-minutes", float, 60.0, "how much reporting the topics hold"),
    ("--backlog-budget", float, 240.0, "seconds producing the backlog may take at most"),
    ("--backlog-partitions", int, 1, "partitions of each report topic (kthrottle makes 1)"),
    ("--backlog-masters", lambda t: t.split(","), "local[2],standalone",
     "masters to measure: local[N] and/or standalone (a master and two workers started here)"),
    ("--proxy-interval", float, 5.0, None),
    ("--broker-interval", float, 30.0, None),
)


# the backlog: report topics holding an hour of reports -------------------------------------

def backlog_templates(brokers, proxies, seed=3):
    """({broker key: report JSON with its time left out}, {proxy key: the same}): a volume
    report of two volumes listing a few partitions, a usage report of three buckets; the
    time is put in per record (``"__AT__"``), which keeps producing fast."""
    from kthrottle.policy.fleet import BucketUsage, UsageReport

    rng = random.Random(seed)
    soft, hard = parse_limit("MinFreePercentage:20"), parse_limit("MinFreePercentage:10")
    volume = {}
    for b in range(1, brokers + 1):
        vols = tuple(VolumeReport("/dev/vd%s" % "ab"[v], 4000 * GB, rng.randint(5, 60) * 40 * GB,
                                  "/var/kafka/data-%d" % v,
                                  tuple(("topic-%d" % rng.randrange(500), rng.randrange(50))
                                        for _ in range(5)))
                     for v in range(2))
        text = BrokerReport(b, 0.0, soft, hard, vols).to_json()
        volume[str(b)] = text.replace('"1970-01-01T00:00:00.000Z"', '"__AT__"')
    usage = {}
    for n in range(proxies):
        proxy = "proxy-%04d" % n
        buckets = tuple(BucketUsage("producer_byte_rate", "", "client-%d" % rng.randrange(2000),
                                    "clients/x", 1e6, rng.uniform(0, 1e6), rng.uniform(1e6, 2e6))
                        for _ in range(3))
        buckets = tuple({b.client_id: b for b in buckets}.values())
        text = UsageReport(proxy, 0.0, 5.0, (1,), buckets).to_json()
        usage[proxy] = text.replace('"1970-01-01T00:00:00.000Z"', '"__AT__"')
    return volume, usage


def produce_reports(bootstrap, batches, deadline):
    """Produce ``batches`` ([(topic, {key: template}, at epoch seconds)]) with
    confluent-kafka (the fastest client here); stops at ``deadline`` (monotonic).
    Returns (records, bytes) produced."""
    from confluent_kafka import Producer

    from kthrottle.policy.storage import iso_time

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50,
                         "batch.size": 1_000_000, "queue.buffering.max.messages": 500_000,
                         "queue.buffering.max.kbytes": 1_000_000, "acks": 1})
    records = nbytes = 0
    errors = []

    def delivered(err, msg):
        if err is not None:
            errors.append(err)

    for topic, templates, at in batches:
        if time.monotonic() > deadline:
            break
        stamp = '"%s"' % iso_time(at)
        ms = int(at * 1000)
        for key, template in templates.items():
            value = template.replace('"__AT__"', stamp).encode()
            while True:
                try:
                    producer.produce(topic, value=value, key=key.encode(), timestamp=ms,
                                     on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.05)
            records += 1
            nbytes += len(value) + len(key)
        producer.poll(0)
    producer.flush(120)
    if errors:
        raise RuntimeError("%d reports not delivered, the first: %s" % (len(errors), errors[0]))
    return records, nbytes


def interval_batches(volume_topic, usage_topic, volume, usage, start, end, broker_every,
                     proxy_every):
    """The reports sent between ``start`` and ``end``: every proxy every ``proxy_every`` s,
    every broker every ``broker_every`` s (the brokers spread over the interval)."""
    batches = []
    t = start
    keys = sorted(volume, key=int)
    slice_of = max(1, int(round(len(keys) * proxy_every / broker_every)))
    n = 0
    while t < end:
        batches.append((usage_topic, usage, t))
        first = (n * slice_of) % len(keys)
        part = keys[first:first + slice_of]
        batches.append((volume_topic, {k: volume[k] for k in part}, t))
        t += proxy_every
        n += 1
    return batches


def backlog_cycle(sync):
    """(seconds, records read, bytes read) of one whole cycle (both topics)."""
    t0 = time.perf_counter()
    sync.cycle()
    seconds = time.perf_counter() - t0
    counts = [sync.topics[t].last_counts for t in (sync.topic, sync.usage_topic)]
    return seconds, sum(c["records"] for c in counts), sum(c["bytes"] for c in counts)


def run_backlog(run, args, out):
    """The report topics filled with ``--backlog-minutes`` of reports, then on each master
    a first cycle (the whole backlog) and ``--cycles`` steady ones, each after one usage
    interval's new reports."""
    import tempfile

    from kthrottle_testkit.zookeeper import ZooKeeperServer

    # the shares of 1,000 proxies are megabytes a cycle (each document lists the whole
    # fleet): more than the tests' 128 MB heap holds in ZooKeeper's in-memory commit log
    zk = ZooKeeperServer(run.path("zookeeper"), heap="1g")
    run.procs.on_stop(zk.stop)
    zk.start()
    broker = run.broker()
    volume_topic, usage_topic = "volume-%s" % uuid.uuid4().hex[:6], "usage-%s" % uuid.uuid4().hex[:6]
    for topic in (volume_topic, usage_topic):
        broker.create_topic(topic, partitions=args.backlog_partitions)
    volume, usage = backlog_templates(args.backlog_brokers, args.backlog_proxies)
    now = time.time()
    span = args.backlog_minutes * 60.0
    t0 = time.perf_counter()
    records, nbytes = produce_reports(
        broker.bootstrap, interval_batches(volume_topic, usage_topic, volume, usage, now - span,
                                           now, args.broker_interval, args.proxy_interval),
        time.monotonic() + args.backlog_budget)
    out["backlog"] = {"records": records, "bytes": nbytes,
                      "seconds": time.perf_counter() - t0}
    print("backlog: %d reports (%.0f MB) produced in %.0f s" % (
        records, nbytes / 1e6, out["backlog"]["seconds"]), flush=True)

    brokers = list(range(1, args.backlog_brokers + 1))
    job_module.read_metadata = (lambda settings, timeout_ms, leaders=None, topic_ids=None:
                                (brokers, {}))
    out["masters"] = {}
    for master in args.backlog_masters:
        label = master
        conf = [("spark.executor.memory", "512m")]
        if master == "standalone":
            url = harness.spark_standalone(run.procs, workers=2, worker_cores=1,
                                           worker_memory="1g",
                                           work_dir=run.path("spark-standalone"))
            conf += [("spark.driver.host", "127.0.0.1"), ("spark.driver.bindAddress", "127.0.0.1"),
                     ("spark.cores.max", "2"), ("spark.executor.cores", "1")]
            master, label = url, "standalone (2 workers, 1 core and 1 GB each)"
        started = time.perf_counter()
        spark = job_module.spark_session(master, conf)
        session = time.perf_counter() - started
        assert spark.sparkContext.master == master, (spark.sparkContext.master, master)
        sync = job_module.SparkSync(broker.bootstrap, zk.hosts + "/backlog-%d" % len(out["masters"]),
                                    topic=volume_topic, usage_topic=usage_topic, spark=spark,
                                    freshness=3600, usage_freshness=3600, kafka_timeout=300,
                                    state_dir=tempfile.mkdtemp(prefix="spark-sync-state-",
                                                               dir=str(run.log_dir)))
        try:
            first = backlog_cycle(sync)
            print("  %s: first cycle %.1f s, %d records (%.0f MB) read" % (
                label, first[0], first[1], first[2] / 1e6), flush=True)
            steady = []
            clock = time.time()
            for _ in range(args.cycles):
                produce_reports(broker.bootstrap, interval_batches(
                    volume_topic, usage_topic, volume, usage, clock, clock + args.proxy_interval,
                    args.broker_interval, args.proxy_interval), time.monotonic() + 120)
                clock += args.proxy_interval
                steady.append(backlog_cycle(sync))
            med = medians(steady, 3)
            print("  %s: steady cycle %.2f s (median of %d), %d records (%.0f kB) read" % (
                label, med[0], len(steady), med[1], med[2] / 1e3), flush=True)
            executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
            print("  %s: %d executor(s) besides the driver" % (label, executors), flush=True)
            out["masters"][label] = {"session": session, "first": first, "steady": med,
                                     "steady_runs": steady}
        finally:
            sync.writer.close()
            spark.stop()


def backlog_report(args, out):
    b = out["backlog"]
    lines = ["# spark-sync cycles over a backlog of reports", "",
             "`%s`. The report topics (%d partition(s) each, on one Tansu broker, which does "
             "not compact) hold %.0f minutes of reports: %d proxies every %g s and %d brokers "
             "every %g s, %d records, %.0f MB (produced in %.0f s). Each cycle reads both "
             "topics, computes the snapshot and the quota shares, and writes them to a real "
             "ZooKeeper in one transaction. Steady: median of %d cycles, each after one "
             "%g s interval of new reports (%d proxies, %d brokers)." % (
                 args.command, args.backlog_partitions, args.backlog_minutes,
                 args.backlog_proxies, args.proxy_interval, args.backlog_brokers,
                 args.broker_interval, b["records"], b["bytes"] / 1e6, b["seconds"],
                 args.cycles, args.proxy_interval, args.backlog_proxies,
                 round(args.backlog_brokers * args.proxy_interval / args.broker_interval)), ""]
    rows = []
    for label, m in out["masters"].items():
        first, steady = m["first"], m["steady"]
        rows.append((label, "%.1f" % m["session"], "%.1f" % first[0], first[1],
                     "%.1f" % (first[2] / 1e6), "%.2f" % steady[0], int(steady[1]),
                     "%.0f" % (steady[2] / 1e3)))
    lines += harness.markdown_table(
        ["master", "session s", "first cycle s", "first: records read", "first: MB read",
         "steady cycle s", "steady: records read", "steady: kB read"], rows,
        align="l" + "r" * 7)
    if out.get("stopped"):
        lines += ["", "Stopped early (%s)." % out["stopped"]]
    return "\n".join(lines) + "\n"


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
                                    freshness=3600, state_dir=str(run.path("state-%d" % size)))
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
    # the first read is the whole topic; the measured ones only what is new (nothing)
    sync = job_module.SparkSync(broker.bootstrap, zk.hosts, topic=usage, spark=spark,
                                usage_topic=usage, usage_freshness=3600,
                                state_dir=str(run.path("state-fleet")))
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
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True)
    p.add_argument("--backlog", action="store_true",
                   help="measure cycles over report topics holding a backlog instead")
    args = p.parse_args(argv)
    args.command = harness.command_line("spark_sync_cycle", argv)
    harness.output_dir(args, "spark_sync_cycle")
    if args.backlog:
        return main_backlog(args)
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


def main_backlog(args):
    out = {}
    with harness.Run("spark_sync_cycle") as run:
        run_backlog(run, args, out)
    if not out.get("masters"):
        return run.finish(failed=True)
    out["stopped"] = run.stopped
    text = backlog_report(args, out)
    print(text)
    harness.write_results(args.output_dir, "spark_sync_backlog", markdown=text)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
