#!/usr/bin/env python3
"""What does an idle ``kthrottle proxy`` cost, with and without a quota file?

A local Tansu broker and, per cell, a fresh ``kthrottle proxy`` in front of it: without a
quota file, and with one (``--quota-file``, followed live). No client connects; after
``--settle`` seconds the proxy's CPU (its process and threads, from the kernel's per-process
clock) is read over ``--seconds``. What an idle proxy does is its timers: the idle-connection
sweep, the broker contact, and with a quota file the file's polls.

Configurations alternate within each round; ``--src LABEL=DIR`` (repeatable) measures other
source trees in the same rounds. Writes ``idle_cost.md`` into ``--output-dir`` (default: a new
directory under ``benchmarks/runs/``). Every process it starts is on 127.0.0.1, on free ports,
and stopped by its PID.

Example (about 2 minutes)::

    python benchmarks/idle_cost.py --rounds 3 --seconds 15
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

from kthrottle_testkit.harness import (NON_BINDING_QUOTAS, REPO, Run, SourceTree,
                                       tree_cpu_seconds)

CONFIGS = ("no quota file", "quota file")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="measured per cell")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds after start before measuring")
    parser.add_argument("--src", action="append", default=[], metavar="LABEL=DIR",
                        help="a kthrottle source tree to measure too (default: this checkout)")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    trees = [("this checkout", SourceTree(REPO))]
    for spec in args.src:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            parser.error("--src takes LABEL=DIR, DIR a kthrottle source tree: %r" % spec)
        trees.append((label, SourceTree(path)))
    args.trees = trees
    return args


def measure(run, broker, tree, quota_file, args):
    extra = ("--quota-file", str(quota_file)) if quota_file else ()
    endpoint = run.kthrottle(broker, extra, src=tree, probe=False)
    try:
        time.sleep(args.settle)
        before = tree_cpu_seconds(endpoint.proc.pid)
        time.sleep(args.seconds)
        after = tree_cpu_seconds(endpoint.proc.pid)
    finally:
        run.procs.stop(endpoint.proc)
    if before is None or after is None:
        raise RuntimeError("the proxy exited while measured (log in %s)" % run.log_dir)
    return (after - before) * 1000.0 / args.seconds


def main(argv=None):
    args = parse_args(argv)
    results = {}  # (tree label, config) -> [ms of CPU per second]
    with Run("idle-cost") as run:
        quota_file = run.path("non-binding-quotas.toml")
        quota_file.write_text(NON_BINDING_QUOTAS)
        broker = run.broker()
        for r in range(args.rounds):
            print("round %d/%d" % (r + 1, args.rounds), flush=True)
            for label, tree in args.trees:
                for config in CONFIGS:
                    ms = measure(run, broker, tree,
                                 quota_file if config == "quota file" else None, args)
                    results.setdefault((label, config), []).append(ms)
                    print("  %-14s %-14s %.2f ms/s" % (label, config, ms), flush=True)
    lines = ["Idle proxy CPU, %d round(s) of %.0f s per cell (`python benchmarks/idle_cost.py "
             "%s`):" % (args.rounds, args.seconds, " ".join(sys.argv[1:])), "",
             "| tree | configuration | ms of CPU per second, median | range |",
             "|---|---|---:|---:|"]
    for (label, config), values in results.items():
        lines.append("| %s | %s | %.2f | %.2f-%.2f |" % (label, config, statistics.median(values),
                                                      min(values), max(values)))
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if results:
        out = args.output_dir or REPO / "benchmarks" / "runs" / time.strftime(
            "idle_cost-%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        (out / "idle_cost.md").write_text(text)
        print("written to %s" % (out / "idle_cost.md"))
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
