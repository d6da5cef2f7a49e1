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
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ProxyProcess  # noqa: E402
from quota_clients import BackgroundProducer, kthrottle_quotas  # noqa: E402

from kthrottle.embedded import TansuBroker  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


def run(n, args, broker, zk_hosts, work):
    from kazoo.client import KazooClient

    chroot = "/conv-%d-%s" % (n, uuid.uuid4().hex[:6])
    zk = KazooClient(hosts=zk_hosts)
    zk.start(timeout=10)
    zk.ensure_path(chroot)
    hosts = zk_hosts + chroot
    done = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "clients",
                            "--entity-name", "fleet-app", "--add-config",
                            "producer_byte_rate=%d" % args.quota)
    assert done.returncode == 0, done.stderr
    topic = "conv-%d-%s" % (n, uuid.uuid4().hex[:6])
    broker.create_topic(topic, partitions=1)
    proxies = [ProxyProcess(broker.bootstrap, work / ("proxy-%d-%d.log" % (n, i)),
                            ["--zookeeper", hosts, "--proxy-id", "p%d" % i,
                             "--usage-interval", str(args.usage_interval_ms),
                             "--log-level", "WARNING"]).start() for i in range(n)]
    producers = [BackgroundProducer(p.bootstrap, topic, "fleet-app") for p in proxies]
    job = None
    samples = []
    try:
        for p in producers:
            p.__enter__()
        time.sleep(5)

        def total(seconds=1.0):
            t0 = time.monotonic()
            time.sleep(seconds)
            return sum(p.rate(t0, time.monotonic()) for p in producers)

        before = statistics.median(total() for _ in range(5))
        log = open(work / ("job-%d.log" % n), "ab")
        job = subprocess.Popen(
            [sys.executable, "-m", "kthrottle", "spark-sync", "--bootstrap-server",
             broker.bootstrap, "--zookeeper", hosts, "--master", "local[2]", "--interval",
             "%gs" % args.interval, "--usage-freshness", "%gs" % (4 * args.interval + 5)],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        shares = chroot + "/kthrottle/cluster-state/shares/p0"
        deadline = time.monotonic() + 180
        while not zk.exists(shares):
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError("no shares from the job (see %s)" % log.name)
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
            job.terminate()
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
        for p in producers:
            p.__exit__(None, None, None)
        for p in proxies:
            p.stop()
        zk.stop()
        zk.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxies", default="2,3,10", help="fleet sizes")
    p.add_argument("--quota", type=int, default=300_000, help="Q, bytes/s for the client-id")
    p.add_argument("--interval", type=float, default=5.0, help="the job's interval, seconds")
    p.add_argument("--usage-interval-ms", type=int, default=1000,
                   help="the proxies' usage report interval")
    p.add_argument("--hold", type=int, default=5,
                   help="seconds the total must stay within 10%% of Q")
    p.add_argument("--max-seconds", type=float, default=90.0)
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args()

    from zookeeper import ZooKeeperServer, available

    if not available():
        raise SystemExit("ZooKeeper is not installed: scripts/test installs it")
    work = Path(tempfile.mkdtemp(prefix="fleet_convergence-"))
    zk = ZooKeeperServer(work / "zk")
    broker = TansuBroker(log_path=str(work / "tansu.log"))
    results = []
    try:
        zk.start()
        broker.start()
        for n in [int(x) for x in args.proxies.split(",")]:
            r = run(n, args, broker, zk.hosts, work)
            results.append(r)
            print("  %2d proxies: before %.0f B/s (%.1f Q); within 10%% of Q after %s; settled "
                  "%.0f B/s" % (n, r["before"], r["before"] / args.quota,
                                "%.0f s (%.1f cycles)" % (r["converged_s"], r["cycles"])
                                if r["converged_s"] is not None else "never (%.0f s)"
                                % args.max_seconds, r["settled"] or 0), flush=True)
    finally:
        broker.stop()
        zk.stop()

    lines = ["# Fleet-wide quota: convergence", "",
             "`python benchmarks/fleet_convergence.py %s`: Q = %d B/s for one client-id, one "
             "producer per proxy writing as fast as it is let, job interval %g s, usage "
             "reports every %d ms; all on one 2-core machine. Time counted from the job's "
             "first shares (its SparkSession start is not included)."
             % (" ".join(sys.argv[1:]), args.quota, args.interval, args.usage_interval_ms), "",
             "| proxies | total before the job | within 10% of Q after | job cycles | settled "
             "total |", "|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append("| %d | %.0f B/s (%.1f Q) | %s | %s | %.0f B/s (%.2f Q) |" % (
            r["proxies"], r["before"], r["before"] / args.quota,
            "%.0f s" % r["converged_s"] if r["converged_s"] is not None else "not within %.0f s"
            % args.max_seconds, "%.1f" % r["cycles"] if r["cycles"] is not None else "-",
            r["settled"] or 0, (r["settled"] or 0) / args.quota))
    text = "\n".join(lines) + "\n"
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "fleet_convergence.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for r in results:
            ax.plot([t for t, _ in r["samples"]], [v / args.quota for _, v in r["samples"]],
                    label="%d proxies" % r["proxies"])
        ax.axhspan(0.9, 1.1, color="grey", alpha=0.2, label="Q +/- 10%")
        ax.set_xlabel("seconds since the job's first shares")
        ax.set_ylabel("fleet total / Q")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.output_dir / "fleet_convergence.png", dpi=110)
    except ImportError:
        print("matplotlib is not installed (the bench extra): no plot")


if __name__ == "__main__":
    main()
