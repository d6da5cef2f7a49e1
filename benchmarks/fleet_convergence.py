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

``--late-join SECONDS``: two proxies and the job first, one producer through the first proxy,
a second through the other proxy that many seconds later (issue 17: equal demand, the second
joining late). Every second the rate of each producer and the shares in force (each proxy's
shares znode) are read; per job cycle after the join: the joiner's share (its limit / Q, the
prior while the bucket is not listed yet) and its part of what the fleet delivered. Writes
``fleet_convergence_late_join.{md,json,png}``; without ``--proxies`` only this run is made.

    python benchmarks/fleet_convergence.py --late-join 15 --quota 200000 \
        --usage-interval-ms 5000 --max-seconds 60

``--src TREE`` runs the proxies and the job from another source tree (a worktree of an
earlier commit): the same measurement before and after a change.
"""
import statistics
import sys
import time
import uuid

from kthrottle_testkit import harness
from kthrottle_testkit.clients import BackgroundProducer

KEY = ("producer_byte_rate", "", "fleet-app")  # the bucket's sharing key


def stop_all(run, job, producers, proxies):
    """The job, then the producers, then the proxies, each by its own PID."""
    if job is not None:
        run.procs.stop(job, timeout=30)
    for p in producers:
        p.__exit__(None, None, None)
    for proxy in proxies:
        run.procs.stop(proxy.proc, timeout=10)


def job_state(args, run, name):
    """``--state-dir`` in the run's log directory, for a job of a tree that
    has it (the job's state must not land in the user's own directory)."""
    job = args.tree.src / "kthrottle" / "spark_sync" / "job.py"
    return ["--state-dir", str(run.path("job-state-%s" % name))] \
        if "--state-dir" in job.read_text() else []


def run_fleet(n, args, run, broker, zk_hosts, zk):
    """One fleet of ``n`` proxies under their own ZooKeeper chroot; stops it at the end."""
    chroot = "/conv-%d-%s" % (n, uuid.uuid4().hex[:6])
    zk.ensure_path(chroot)
    hosts = zk_hosts + chroot
    args.tree.cli("quotas", "alter", "--zookeeper", hosts, "--entity-type",
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
                         "--usage-interval", str(args.usage_interval_ms),
                         "--storage-scope", "off"],  # a fleet without volume agents
                name="proxy-%d-%d" % (n, i), probe=False, src=args.tree))
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
            "--usage-freshness", "%gs" % (4 * args.interval + 5), *job_state(args, run, n),
            src=args.tree)
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
        stop_all(run, job, producers, proxies)


def run_late_join(args, run, broker, zk_hosts, zk):
    """Two proxies and the job; a producer through p0, another through p1 ``args.late_join``
    seconds later; sampled every second for ``args.max_seconds`` after the join."""
    from kthrottle.policy.fleet import parse_shares_document

    chroot = "/late-%s" % uuid.uuid4().hex[:6]
    zk.ensure_path(chroot)
    hosts = zk_hosts + chroot
    args.tree.cli("quotas", "alter", "--zookeeper", hosts, "--entity-type", "clients",
                  "--entity-name", "fleet-app", "--add-config",
                  "producer_byte_rate=%d" % args.quota)
    topic = "late-%s" % uuid.uuid4().hex[:6]
    broker.create_topic(topic, partitions=1)
    znode = chroot + "/kthrottle/cluster-state/shares/"
    proxies, producers, job = [], [], None

    def limits():
        """(cycle of p1's shares, {proxy: its limit for the bucket}) in force now."""
        out, cycle = {}, None
        for i in range(2):
            try:
                doc = parse_shares_document(zk.get(znode + "p%d" % i)[0])
            except Exception:  # not written yet
                return None, {}
            out["p%d" % i] = doc.limit(*KEY, args.quota)
            cycle = doc.cycle
        return cycle, out

    try:
        for i in range(2):
            proxies.append(run.kthrottle(
                broker, ["--zookeeper", hosts, "--proxy-id", "p%d" % i,
                         "--usage-interval", str(args.usage_interval_ms),
                         "--storage-scope", "off"],  # a fleet without volume agents
                name="late-proxy-%d" % i, probe=False, src=args.tree))
        job = harness.spawn_kthrottle(
            run.procs, "late-job", "spark-sync", "--bootstrap-server", broker.bootstrap,
            "--zookeeper", hosts, "--master", "local[2]", "--interval", "%gs" % args.interval,
            "--usage-freshness", "%gs" % (4 * args.interval + 5),
            *job_state(args, run, "late"), src=args.tree)
        deadline = time.monotonic() + 180
        while limits()[0] is None:
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError("no shares from the job (see %s)" % run.path("late-job.log"))
            time.sleep(0.25)
        producers.append(BackgroundProducer(proxies[0].bootstrap, topic, "fleet-app").__enter__())
        time.sleep(args.late_join)
        producers.append(BackgroundProducer(proxies[1].bootstrap, topic, "fleet-app").__enter__())
        joined = time.monotonic()
        samples = []  # (s since the join, rate p0, rate p1, cycle, limit p0, limit p1)
        tick = joined
        while time.monotonic() - joined < args.max_seconds:
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))
            cycle, lim = limits()
            samples.append((round(tick - joined, 1), producers[0].rate(tick - 1.0, tick),
                            producers[1].rate(tick - 1.0, tick), cycle, lim.get("p0"),
                            lim.get("p1")))
        for p in producers:
            if p.error is not None:
                raise RuntimeError("a producer failed: %r" % (p.error,))
        return samples
    finally:
        stop_all(run, job, producers, proxies)


def late_join_cycles(samples, quota):
    """Per cycle of shares in force after the join: (cycle, first second it was seen,
    seconds, joiner's limit / Q, joiner's part of what was delivered, fleet total / Q)."""
    rows, current = [], None
    for t, a, b, cycle, la, lb in samples:
        if current is None or current[0] != cycle:
            current = [cycle, t, 0, lb, 0.0, 0.0]
            rows.append(current)
        current[2] += 1
        current[4] += b
        current[5] += a + b
    return [(c, t, n, (lb or 0.0) / quota, b / total if total else 0.0, total / n / quota)
            for c, t, n, lb, b, total in rows]


def late_join_report(samples, args, stopped):
    cycles = late_join_cycles(samples, args.quota)
    first_bytes = next((t for t, a, b, *_ in samples if b > 0), None)
    fair = next((t for c, t, n, share, part, total in cycles if abs(part - 0.5) <= 0.05
                 and n >= 2), None)
    tail = [s for s in samples if s[0] > samples[-1][0] - 20] if samples else []
    tail_total = sum(a + b for _, a, b, *_ in tail)
    tail_part = sum(b for _, a, b, *_ in tail) / tail_total if tail_total else 0.0
    lines = ["# Fleet-wide quota: a producer joining late", "",
             "`%s`: Q = %d B/s for one client-id, two proxies, one producer through each writing "
             "as fast as it is let, the second starting %g s after the first; job interval %g s, "
             "usage reports every %d ms; all on one 2-core machine. Time is counted from the "
             "second producer's start; the joiner's share is its limit in force (the prior "
             "while its bucket is not listed yet) and its part is of what both producers "
             "delivered while those shares were in force."
             % (args.command, args.quota, args.late_join, args.interval, args.usage_interval_ms),
             "",
             "- the joiner's first bytes acknowledged: %s after it started"
             % ("%.0f s" % first_bytes if first_bytes is not None else "never"),
             "- the first cycle whose shares gave the joiner 45-55%% of what was delivered: %s"
             % ("%.0f s after it started" % fair if fair is not None else "none"),
             "- the last 20 s: the joiner %.0f%%, the first producer %.0f%%, total %.2f Q"
             % (100 * tail_part, 100 * (1 - tail_part), tail_total / max(1, len(tail))
                / args.quota), ""]
    lines += harness.markdown_table(
        ["cycle", "from (s)", "seconds", "joiner's share / Q", "joiner's part delivered",
         "fleet total / Q"],
        [("-" if c is None else c, "%.0f" % t, n, "%.2f" % share, "%.0f%%" % (100 * part),
          "%.2f" % total) for c, t, n, share, part, total in cycles], align="r" * 6)
    if stopped:
        lines += ["", "Stopped early (%s)." % stopped]
    return "\n".join(lines) + "\n"


FLAGS = (
    ("--proxies", harness.int_list, None,
     "fleet sizes (default 2,3,10; none with --late-join unless given)"),
    ("--late-join", float, 0.0, "also the late-joiner run, the second producer this many "
     "seconds after the first (0: not run)"),
    ("--src", None, None, "the kthrottle source tree to run the proxies and the job from "
     "(default: this checkout)"),
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
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True)
    args = p.parse_args(argv)
    args.command = harness.command_line("fleet_convergence", argv)
    if args.proxies is None:
        args.proxies = [] if args.late_join else [2, 3, 10]
    args.tree = harness.SourceTree(harness.check_src(p, "--src", args.src) if args.src
                                   else harness.REPO)
    harness.output_dir(args, "fleet_convergence")
    results, late = [], None
    with harness.Run("fleet_convergence") as run:
        zk_server = run.zookeeper()
        broker = run.broker()
        zk = harness.zk_client(run.procs, zk_server.hosts)
        if args.late_join:
            late = run_late_join(args, run, broker, zk_server.hosts, zk)
            for c, t, n, share, part, total in late_join_cycles(late, args.quota):
                print("  cycle %s from %3.0f s (%d s): joiner's share %.2f Q, its part %3.0f%%, "
                      "total %.2f Q" % (c, t, n, share, 100 * part, total), flush=True)
        for n in args.proxies:
            r = run_fleet(n, args, run, broker, zk_server.hosts, zk)
            results.append(r)
            print("  %2d proxies: before %.0f B/s (%.1f Q); within 10%% of Q after %s; settled "
                  "%.0f B/s" % (n, r["before"], r["before"] / args.quota,
                                "%.0f s (%.1f cycles)" % (r["converged_s"], r["cycles"])
                                if r["converged_s"] is not None else "never (%.0f s)"
                                % args.max_seconds, r["settled"] or 0), flush=True)
    if late:
        text = late_join_report(late, args, run.stopped)
        print(text)
        draw = harness.line_chart(
            [("the joiner's share (job)", [s[0] for s in late],
              [(s[5] or 0.0) / args.quota for s in late]),
             ("the joiner's part delivered", [s[0] for s in late],
              [s[2] / (s[1] + s[2]) if s[1] + s[2] else 0.0 for s in late])],
            "seconds since the second producer started", "fraction",
            band=(0.45, 0.55, "half +/- 5 points"))
        harness.write_results(args.output_dir, "fleet_convergence_late_join", markdown=text,
                              data={"command": args.command, "quota": args.quota,
                                    "columns": ["s", "rate_p0", "rate_p1", "cycle", "limit_p0",
                                                "limit_p1"], "samples": late}, draw=draw)
    if not results:
        return run.finish(failed=not late)
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
