#!/usr/bin/env python3
"""How fast does a fleet of kthrottle proxies converge on one quota?

For each ``--proxies`` count N: N ``kthrottle proxy --proxy-id`` processes in front of one local
Tansu broker, a client-id quota Q (``--quota``) in a real ZooKeeper, one aiokafka producer per
proxy with that client-id writing 1 KiB records as fast as it is let, and ``kthrottle
spark-sync --interval`` (PySpark local[2]) computing the shares. The fleet's total rate is
sampled every second: before the job runs (about N x Q), then from the job's first shares
until the total stays within 10% of Q for ``--hold`` seconds. Reported: the total before,
the seconds and job cycles from the first shares to convergence, and the settled total.

Everything runs on this machine's 2 cores, so each proxy, producer and the Spark job compete
for CPU; the figures are an upper bound of what a fleet on its own machines sees.

Writes ``fleet_convergence.md`` and ``fleet_convergence.png`` into ``--output-dir``.

Example (about 5 minutes)::

    python benchmarks/fleet_convergence.py --proxies 2,3,10
"""
import statistics
import sys
import time
import uuid

import harness
from quota_clients import BackgroundProducer


def run_fleet(n, args, run, broker, zk_hosts, zk):
    """One fleet of ``n`` proxies under their own ZooKeeper chroot; stops it at the end."""
    chroot = "/conv-%d-%s" % (n, uuid.uuid4().hex[:6])
    zk.ensure_path(chroot)
    hosts = zk_hosts + chroot
    harness.SourceTree().cli("quotas", "alter", "--zookeeper", hosts, "--entity-type",
                             "clients", "--entity-name", "fleet-app", "--add-config",
                             "producer_byte_rate=%d" % args.quota)
    topic = "conv-%d-%s" % (n, uuid.uuid4().hex[:6])
    broker.create_topic(topic, partitions=1)
    proxies, producers, job = [], [], None
    samples = []
    try:
        for i in range(n):
            proxies.append(run.kthrottle(
                broker, ["--zookeeper", hosts, "--proxy-id", "p%d" % i,
                         "--usage-interval", str(args.usage_interval_ms)],
                name="proxy-%d-%d" % (n, i), probe=False))
        for proxy in proxies:
            producers.append(BackgroundProducer(proxy.bootstrap, topic, "fleet-app").__enter__())
        time.sleep(5)

        def total(seconds=1.0):
            t0 = time.monotonic()
            time.sleep(seconds)
            return sum(p.rate(t0, time.monotonic()) for p in producers)

        before = statistics.median(total() for _ in range(5))
        job = harness.spawn_kthrottle(
            run.procs, "job-%d" % n, "spark-sync", "--bootstrap-server", broker.bootstrap,
            "--zookeeper", hosts, "--master", "local[2]", "--interval", "%gs" % args.interval,
            "--usage-freshness", "%gs" % (4 * args.interval + 5))
        shares = chroot + "/kthrottle/cluster-state/shares/p0"
        deadline = time.monotonic() + 180
        while not zk.exists(shares):
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError("no shares from the job (see %s)"
                                   % run.path("job-%d.log" % n))
            time.sleep(0.25)
        first = time.monotonic()
        within_since = None
        converged = None
        while time.monotonic() - first < args.max_seconds:
            rate = total()
            now = time.monotonic() - first
            samples.append((now, rate))
            if abs(rate - args.quota) <= 0.1 * args.quota:
                within_since = now if within_since is None else within_since
                if now - within_since >= args.hold:
                    converged = within_since
                    break
            else:
                within_since = None
        settled = statistics.median(r for t, r in samples[-args.hold:]) if samples else None
        return {"proxies": n, "before": before, "converged_s": converged,
                "cycles": None if converged is None else converged / args.interval,
                "settled": settled, "samples": samples}
    finally:
        if job is not None:
            run.procs.stop(job, timeout=30)
        for p in producers:
            p.__exit__(None, None, None)
        for proxy in proxies:
            run.procs.stop(proxy.proc, timeout=10)


FLAGS = (
    ("--proxies", harness.int_list, "2,3,10", "fleet sizes"),
    ("--quota", int, 300_000, "Q, bytes/s for the client-id"),
    ("--interval", float, 5.0, "the job's interval, seconds"),
    ("--usage-interval-ms", int, 1000, "the proxies' usage report interval"),
    ("--hold", int, 5, "seconds the total must stay within 10%% of Q"),
    ("--max-seconds", float, 90.0, None),
)


def report(results, args, stopped):
    lines = ["# Fleet-wide quota: convergence", "",
             "`%s`: Q = %d B/s for one client-id, one producer per proxy writing as fast as it "
             "is let, job interval %g s, usage reports every %d ms; all on one 2-core machine. "
             "Time counted from the job's first shares (its SparkSession start is not included)."
             % (args.command, args.quota, args.interval, args.usage_interval_ms), ""]
    rows = []
    for r in results:
        settled = r["settled"] or 0
        rows.append((r["proxies"], "%.0f B/s (%.1f Q)" % (r["before"], r["before"] / args.quota),
                     "%.0f s" % r["converged_s"] if r["converged_s"] is not None
                     else "not within %.0f s" % args.max_seconds,
                     "%.1f" % r["cycles"] if r["cycles"] is not None else "-",
                     "%.0f B/s (%.2f Q)" % (settled, settled / args.quota)))
    lines += harness.markdown_table(["proxies", "total before the job", "within 10% of Q after",
                                     "job cycles", "settled total"], rows, align="r" * 5)
    if stopped:
        lines += ["", "Stopped early (%s): only the fleet sizes above were measured." % stopped]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True).parse_args(argv)
    args.command = harness.command_line("fleet_convergence", argv)
    results = []
    with harness.Run("fleet_convergence") as run:
        zk_server = run.zookeeper()
        broker = run.broker()
        zk = harness.zk_client(run.procs, zk_server.hosts)
        for n in args.proxies:
            r = run_fleet(n, args, run, broker, zk_server.hosts, zk)
            results.append(r)
            print("  %2d proxies: before %.0f B/s (%.1f Q); within 10%% of Q after %s; settled "
                  "%.0f B/s" % (n, r["before"], r["before"] / args.quota,
                                "%.0f s (%.1f cycles)" % (r["converged_s"], r["cycles"])
                                if r["converged_s"] is not None else "never (%.0f s)"
                                % args.max_seconds, r["settled"] or 0), flush=True)
    if not results:
        return run.finish(failed=True)
    text = report(results, args, run.stopped)
    print(text)

    draw = harness.line_chart(
        [("%d proxies" % r["proxies"], [t for t, _ in r["samples"]],
          [v / args.quota for _, v in r["samples"]]) for r in results],
        "seconds since the job's first shares", "fleet total / Q",
        band=(0.9, 1.1, "Q +/- 10%"))
    harness.write_results(args.output_dir, "fleet_convergence", markdown=text, draw=draw)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
