#!/usr/bin/env python3
"""What does the proxy's Python cost per request, with no sockets?

In-process: the connection pipeline (``proxy.pipeline.Connection``, a fake clock, the standard
chain of filters) fed ``--requests`` requests with their responses, each in 64 KiB reads, for
the versions the benchmarked clients speak:

* Produce v7 (aiokafka) and v10 (confluent-kafka; KIP-951: its response ends in broker
  addresses the proxy rewrites), ``--partitions`` x ``--record-bytes`` per request;
* Fetch v11 (aiokafka) and v16 (confluent-kafka: the same), the same records per response;

each with no quota and with a client quota that never binds (every request counted, none
delayed), its rates first run over all their windows (12 s of the fake clock, untimed), as in
a proxy that has run for a while. With ``--baseline-src DIR`` the same is measured with the kthrottle imported from DIR
(a git worktree of another commit), in a process of its own, the trees taking turns; median of
``--repeats`` runs of each. This is the per-frame work that ``proxy_overhead.py``'s "CPU vs
relay" ratio pays beyond a relay that parses nothing.

With ``--callgrind N`` each exchange is instead run under ``valgrind --tool=callgrind``
and counted in user-space instructions per exchange: repeatable to a few instructions from
run to run, where time on a shared machine is not, so a small change shows; written to
``frame_cost_instructions.md``.

With ``--cold N`` each exchange is run under ``valgrind --tool=cachegrind`` with 4 MiB
copied between exchanges, and counted in the first-level cache lines its code and data
miss. That is what an exchange pays in a running proxy, where the kernel's copies of each
64 KiB read and write, and the client's and broker's turns on the same cores, leave the
caches cold: there each costs about four times its in-process time. Also repeatable from run
to run; written to ``frame_cost_cold.md``.

Writes ``frame_cost.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``).

Example (about a minute)::

    git worktree add --detach /tmp/kthrottle-before HEAD~3
    python benchmarks/frame_cost.py --baseline-src /tmp/kthrottle-before
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FRAMES = str(REPO / "kthrottle_testkit" / "pipeline_frames.py")

# Run in a child process whose kthrottle comes from the tree measured (PYTHONPATH).
CHILD = r'''
import gc, importlib.util, inspect, json, sys, time
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.pipeline import Connection, FilterTable

# this checkout's frames, whichever tree's kthrottle is measured
spec = importlib.util.spec_from_file_location("pipeline_frames", %(frames)r)
frames = importlib.util.module_from_spec(spec)
spec.loader.exec_module(frames)

BATCH = 512  # correlation ids per connection

# a tree from before the short way has none; one from before its quick
# filters takes no time
pass_request = getattr(Connection, "pass_request", lambda conn, data, now: False)
if "now" not in inspect.signature(pass_request).parameters:
    pass_request = (lambda short: lambda conn, data, now: short(conn, data))(pass_request)
pass_response = getattr(Connection, "pass_response", lambda conn, data: False)

WARM_EXCHANGES = 120

def cost(api, version, quota, n, parts, size):
    manager = None
    if quota:
        manager = QuotaManager({"clients/<default>": {
            PRODUCER_BYTE_RATE: 1e15, CONSUMER_BYTE_RATE: 1e15, REQUEST_RATE: 1e12}})
    table = FilterTable(standard_filters(frames.advertise, manager))
    if api == "Produce":
        pairs = [(frames.reads(frames.produce_request(i, version, parts, size), READ),
                  frames.reads(frames.produce_response(i, version, parts), READ))
                 for i in range(BATCH)]
    else:
        pairs = [(frames.reads(frames.fetch_request(i, version, parts), READ),
                  frames.reads(frames.fetch_response(i, version, parts, size), READ))
                 for i in range(BATCH)]
    conn, now = frames.connection(table, manager), 0.0
    # first, a quota's rate over every one of its windows, as in a proxy that
    # has run for a while (Kafka's 11 windows of 1 s): one exchange each
    # tenth of a second, untimed
    for k in range(WARM_EXCHANGES):
        now += 0.1
        requests, responses = pairs[k %% BATCH]
        for data in requests:
            if not pass_request(conn, data, now):
                conn.client_data(data, now)
        for data in responses:
            if not pass_response(conn, data):
                conn.broker_data(data, now)
    conn = frames.connection(table, manager)
    gc.collect()
    gc.freeze()  # what was made so far is never collected: no full collection's cost in the loop
    start = time.perf_counter_ns()
    for k in range(n):
        j = k %% BATCH
        if j == 0 and k:
            conn = frames.connection(table, manager)
        now += 0.0001
        if FLUSH:  # --cold: the caches emptied between exchanges
            FLUSH_TO[:] = FLUSH_FROM
            if FLUSH_ONLY:
                continue
        requests, responses = pairs[j]
        for data in requests:  # as the adapter: the short way first
            if not pass_request(conn, data, now):
                conn.client_data(data, now)
        for data in responses:
            if not pass_response(conn, data):
                conn.broker_data(data, now)
    elapsed = time.perf_counter_ns() - start
    assert conn.muted_until == 0.0, "a request was delayed"
    assert conn.phase.name != "CLOSED", "the connection closed"
    return elapsed / n

args = json.loads(sys.argv[1])
READ = args["read_bytes"]
FLUSH = args.get("flush", 0)
FLUSH_ONLY = args.get("flush_only", False)
FLUSH_FROM, FLUSH_TO = bytearray(FLUSH), bytearray(FLUSH)
if args.get("only"):  # one exchange, under callgrind: its instructions are what counts
    api, v, q = args["only"]
    cost(api, v, q == "quota", args["requests"], args["partitions"], args["record_bytes"])
    sys.exit(0)
print(json.dumps({"%%s %%d %%s" %% (api, v, q): cost(api, v, q == "quota", args["requests"],
                  args["partitions"], args["record_bytes"])
                  for api, v in (("Produce", 7), ("Produce", 10), ("Fetch", 11), ("Fetch", 16))
                  for q in ("none", "quota")}))
'''

EXCHANGES = [("Produce", 7, "aiokafka"), ("Produce", 10, "confluent-kafka"),
             ("Fetch", 11, "aiokafka"), ("Fetch", 16, "confluent-kafka")]


def measure(tree, args):
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = CHILD % {"frames": FRAMES}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(vars(args), default=str)],
                         env=env, cwd=str(tree), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit("frame_cost.py: the child for %s failed:\n%s" % (tree, out.stderr[-2000:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


# --cold: caches as cachegrind simulates them (32 KiB L1s, a 2 MiB last level), and what is
# copied between exchanges to empty them, as the kernel's copies of each 64 KiB read and
# write, the client's and the broker's turns on the same cores empty them in a running proxy
COLD_CACHES = ["--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", "--LL=2097152,16,64"]
COLD_FLUSH = 4 << 20


def counted(tree, args, api, version, quota, n, cold=False, flush_only=False):
    """valgrind's counts for the child run of ``n`` exchanges: callgrind's instructions
    ({"Ir": ...}), or with ``cold`` cachegrind's instructions and simulated cache misses
    (Ir, I1mr, D1mr, D1mw, ...), a cache flush between exchanges (``flush_only``: the
    flushes alone, the exchanges left out)."""
    with tempfile.TemporaryDirectory(prefix="frame_cost-") as tmp:
        out = os.path.join(tmp, "valgrind.out")
        child = dict(vars(args), requests=n, only=[api, version, quota],
                     flush=COLD_FLUSH if cold else 0, flush_only=flush_only)
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
        tool = (["--tool=cachegrind", "--cachegrind-out-file=" + out] + COLD_CACHES if cold
                else ["--tool=callgrind", "--callgrind-out-file=" + out])
        run = subprocess.run(["valgrind"] + tool + [sys.executable, "-c",
                              CHILD % {"frames": FRAMES}, json.dumps(child, default=str)],
                             env=env, cwd=str(tree), capture_output=True, text=True,
                             timeout=1800)
        if run.returncode != 0:
            sys.exit("frame_cost.py: valgrind on %s failed:\n%s" % (tree, run.stderr[-2000:]))
        with open(out) as f:
            lines = f.read().splitlines()
    events = next(line for line in lines if line.startswith("events:")).split()[1:]
    summary = next(line for line in lines if line.startswith("summary:")).split()[1:]
    return dict(zip(events, map(int, summary)))


def per_exchange(tree, args, api, version, quota, n, cold=False, flush_only=False):
    """valgrind's counts per exchange: the child run with N and with 3N exchanges, the
    difference over 2N, so that start-up and building the frames drop out. The same on
    every run, whatever the machine's load."""
    few, more = (counted(tree, args, api, version, quota, k, cold, flush_only)
                 for k in (n, 3 * n))
    return {event: (more[event] - few[event]) / (2 * n) for event in few}


def instructions(tree, args, api, version, quota):
    """User-space instructions per exchange (valgrind --tool=callgrind)."""
    return per_exchange(tree, args, api, version, quota, args.callgrind)["Ir"]


def cold_lines(tree, args, api, version, quota, flushes):
    """--cold: per exchange, the cache lines its code and data miss in the first-level
    caches when they start empty (cachegrind's I1mr + D1mr + D1mw), less those of the
    flushes alone (``flushes``), and its instructions: (lines, instruction lines, Ir)."""
    counts = per_exchange(tree, args, api, version, quota, args.cold, cold=True)
    net = {event: counts[event] - flushes[event] for event in counts}
    return net["I1mr"] + net["D1mr"] + net["D1mw"], net["I1mr"], net["Ir"]


def valgrind_table(trees, args, cold=False):
    """The table of --callgrind (instructions per exchange) or of --cold (cache lines missed
    per exchange, and its instructions), each tree, two valgrinds at a time."""
    jobs = [(label, tree, api, version, quota) for api, version, _ in EXCHANGES
            for quota in ("none", "quota") for label, tree in trees]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        if cold:  # (lines, code lines, instructions)
            flushes = dict(zip([label for label, _ in trees], pool.map(
                lambda t: per_exchange(t[1], args, "Produce", 7, "none", args.cold, cold=True,
                                       flush_only=True), trees)))
            counts = dict(zip(jobs, pool.map(
                lambda j: cold_lines(j[1], args, *j[2:], flushes[j[0]]), jobs)))
        else:  # (instructions,)
            counts = dict(zip(jobs, pool.map(
                lambda j: (instructions(j[1], args, *j[2:]),), jobs)))
    rows = []
    for api, version, client in EXCHANGES:
        for quota in ("none", "quota"):
            cells = ["%s v%d (%s)%s" % (api, version, client,
                                        ", client quota" if quota == "quota" else "")]
            values = [counts[(label, tree, api, version, quota)] for label, tree in trees]
            if cold:
                cells += ["%.0f (%.0f)" % value[:2] for value in values]
            cells += ["%.1f" % (value[-1] / 1000) for value in values]
            if len(values) == 2:
                cells.append("%.2fx" % (values[1][0] / values[0][0]))
            rows.append(cells)
    header = ["exchange, %d x %d bytes" % (args.partitions, args.record_bytes)]
    if cold:
        header += ["%s: lines missed (code)" % label for label, _ in trees]
    header += ["%s: thousand instructions" % label for label, _ in trees]
    if len(trees) == 2:
        header.append("lines, ratio" if cold else "ratio")
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="exchanges per run")
    p.add_argument("--partitions", type=int, default=4, help="partitions per request")
    p.add_argument("--record-bytes", type=int, default=16384, help="record bytes per partition")
    p.add_argument("--read-bytes", type=int, default=65536,
                   help="bytes per read (the default cuts a request of the default size in two;"
                   " 262144 gives each frame one read, as aiokafka's 64 KiB requests arrive)")
    p.add_argument("--repeats", type=int, default=5, help="runs per tree (median)")
    p.add_argument("--baseline-src", type=Path, metavar="DIR",
                   help="also measure the kthrottle in DIR (a git worktree), in turns")
    p.add_argument("--callgrind", type=int, metavar="N", default=0,
                   help="count instructions instead of timing: each exchange run under "
                   "valgrind --tool=callgrind N and 3N times (N=1024 takes some minutes), "
                   "user-space instructions per exchange, repeatable from run to run")
    p.add_argument("--cold", type=int, metavar="N", default=0,
                   help="count cache misses instead of timing: each exchange run under "
                   "valgrind --tool=cachegrind N and 3N times with %d MiB copied between "
                   "exchanges, the first-level cache lines each misses (N=300 takes some "
                   "minutes)" % (COLD_FLUSH >> 20))
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where frame_cost.md goes (default: a new benchmarks/runs/ directory)")
    args = p.parse_args(argv)
    trees = [("this checkout", REPO)]
    if args.baseline_src:
        trees.insert(0, ("baseline", args.baseline_src.resolve()))
    out_dir = args.output_dir or REPO / "benchmarks" / "runs" / time.strftime(
        "frame_cost-%Y%m%d-%H%M%S")
    command = "python benchmarks/frame_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.callgrind or args.cold:
        if not shutil.which("valgrind"):
            p.error("--callgrind/--cold: valgrind is not installed")
        if args.cold:
            name, title = "frame_cost_cold.md", "from cold caches"
            table = valgrind_table(trees, args, cold=True)
            what = ("per request and its response, in process, under valgrind's cachegrind with "
                    "%d MiB copied between exchanges (the copies' own misses taken out): the "
                    "first-level cache lines its code and data miss (I1mr + D1mr + D1mw; of "
                    "them code, I1mr) and its instructions. In a running proxy most of these "
                    "are fetched from the last-level cache, tens of nanoseconds each"
                    % (COLD_FLUSH >> 20))
        else:
            name, title, table = ("frame_cost_instructions.md", "in instructions",
                                  valgrind_table(trees, args))
            what = ("user-space instructions per request and its response, in process, counted "
                    "by valgrind's callgrind (the interpreter's, the pipeline's, malloc's)")
        print(table)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text("# Per-request pipeline cost, %s\n\n`%s`: %s.\n\n%s\n"
                                    % (title, command, what, table))
        print("wrote %s in %s" % (name, out_dir))
        return
    runs = {label: [] for label, _ in trees}
    for r in range(args.repeats):
        for label, tree in trees:
            runs[label].append(measure(tree, args))
            print("run %d/%d %s done" % (r + 1, args.repeats, label), flush=True)
    rows = []
    for api, version, client in EXCHANGES:
        for quota in ("none", "quota"):
            key = "%s %d %s" % (api, version, quota)
            cells = ["%s v%d (%s)%s" % (api, version, client,
                                        ", client quota" if quota == "quota" else "")]
            for label, _ in trees:
                cells.append("%.1f" % (statistics.median(run[key] for run in runs[label]) / 1000))
            rows.append(cells)
    header = ["exchange, %d x %d bytes" % (args.partitions, args.record_bytes)] + [
        "%s (us)" % label for label, _ in trees]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(trees) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "frame_cost.md").write_text(
        "# Per-request pipeline cost\n\n`%s`, median of %d runs; microseconds per request and "
        "its response, in process.\n\n%s\n" % (command, args.repeats, table))
    print("wrote frame_cost.md in %s" % out_dir)


if __name__ == "__main__":
    main()
