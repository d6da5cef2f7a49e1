#!/usr/bin/env python3
"""What does the quota policy cost per request?

A pure in-process microbenchmark of ``kthrottle.policy.quotas.QuotaManager``: no sockets, no
broker, no event loop; time is a fake monotonic clock that advances a little on every call (as
the proxy passes ``loop.time()`` in). The manager holds a quota snapshot of ``--entities``
configured KIP-55 entities, a mix of ``users/<u>``, ``users/<u>/clients/<c>``, ``clients/<c>``
and ``<default>`` entries (some principals are mTLS-style distinguished names that need
sanitizing), and ``--live`` (user, client-id) pairs are live, as connections would be.

Measured, for ``--quota-mode token-bucket`` and ``window`` (QuotaSettings(mode=...)), and
with ``--modes token-bucket+callback`` for the same resolution through the quota-callback
path (``QuotaManager(callback=DefaultQuotaCallback())``, as ``--quota-callback`` runs one):

* produce request - ``record_request`` + ``record_produce`` on a live client;
* fetch request   - ``record_request`` + ``record_fetch`` on a live client;
* new client      - ``manager.client(user, client_id)``: the first resolution of a
  (user, client-id) never seen before (three quota keys resolved, buckets created or found);
* after update    - the first produce request of a live client after ``manager.update()``
  installed a new snapshot: the client re-resolves its three buckets on that request;
* update itself   - ``manager.update(snapshot)``, once per configuration change (it indexes the
  snapshot, so it grows with the entity count; requests do not).

Means are total time / calls over a timed loop (``time.perf_counter_ns``, garbage collector
off), median of ``--repeats`` runs; p99 comes from timing single calls, which adds the timer's
own cost (shown in the table as "timer"). The per-request cost is measured again at every
``--scaling`` entity count to show it does not grow with the number of configured entities.

Writes ``policy_cost.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``).

Example (about 30 s on the 2-core project VM)::

    python benchmarks/policy_cost.py
"""
import os
import platform
import random
import statistics
import sys
import time

from kthrottle.policy.entities import (
    CONSUMER_BYTE_RATE,
    DEFAULT,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
    entity_path,
)
from kthrottle.policy.quota_callback import DefaultQuotaCallback
from kthrottle.policy.quotas import ClientQuotas, QuotaManager, QuotaSettings
from kthrottle_testkit import harness
from kthrottle_testkit.harness import gc_paused, rank_percentile

MODES = ("token-bucket", "window", "token-bucket+callback", "window+callback")
DEFAULT_MODES = ("token-bucket", "window")
PRODUCE_BYTES = 16_384 + 120  # one 16 KiB batch plus the request's own header
FETCH_BYTES = 65_536 + 80
STEP = 10e-6  # fake clock advance per request: 100,000 requests/s through the proxy


# --------------------------------------------------------------------------- workload


def user_name(i):
    # every fourth principal is an mTLS distinguished name: sanitizing it is real work
    return "CN=svc-%d,OU=streams,O=Example Corp" % i if i % 4 == 0 else "user-%d" % i


def client_name(i):
    return "app-%d" % i


def quota_values(rng):
    """One to three quota keys with plausible values."""
    keys = rng.sample((PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE), rng.randint(1, 3))
    out = {}
    for key in keys:
        if key == REQUEST_RATE:
            out[key] = float(rng.choice((50, 200, 1000)))
        else:
            out[key] = float(rng.choice((100_000, 1_048_576, 10_485_760)))
    return out


def build_snapshot(entities, rng):
    """``entities`` configured entities: about 40% users/<u>/clients/<c>, 25% users/<u>,
    30% clients/<c>, the rest users/<u>/clients/<default> and users/<default>/clients/<c>,
    plus the three <default> entries. Returns (snapshot, users, clients) with the pools the
    names were drawn from."""
    users = max(10, entities // 4)
    clients = max(10, entities // 3)
    snapshot = {
        entity_path(user=DEFAULT): quota_values(rng),
        entity_path(user=DEFAULT, client_id=DEFAULT): quota_values(rng),
        entity_path(client_id=DEFAULT): quota_values(rng),
    }
    while len(snapshot) < entities:
        r = rng.random()
        u, c = user_name(rng.randrange(users)), client_name(rng.randrange(clients))
        if r < 0.40:
            path = entity_path(user=u, client_id=c)
        elif r < 0.65:
            path = entity_path(user=u)
        elif r < 0.95:
            path = entity_path(client_id=c)
        elif r < 0.975:
            path = entity_path(user=u, client_id=DEFAULT)
        else:
            path = entity_path(user=DEFAULT, client_id=c)
        snapshot[path] = quota_values(rng)
    return snapshot, users, clients


def live_pairs(count, users, clients, rng, offset=0):
    """(user, client-id) pairs; about a quarter of the users and a third of the client-ids
    are not configured anywhere (they resolve through the defaults)."""
    if count > 0.9 * int(users * 1.33) * int(clients * 1.5):
        raise ValueError("%d pairs asked of a pool of %d users x %d clients: use more entities "
                         "or fewer --live" % (count, int(users * 1.33), int(clients * 1.5)))
    pairs = set()
    while len(pairs) < count:
        u = rng.randrange(int(users * 1.33)) + offset
        c = rng.randrange(int(clients * 1.5)) + offset
        pairs.add((user_name(u), client_name(c)))
    return sorted(pairs)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def tick(self):
        self.now += STEP
        return self.now


# --------------------------------------------------------------------------- timing


def timed(fn, repeats):
    """(ns spent in fn) / (calls fn reports), for each of ``repeats`` loops."""
    per_call = []
    for _ in range(repeats):
        with gc_paused():
            t = time.perf_counter_ns()
            calls = fn()
            elapsed = time.perf_counter_ns() - t
        per_call.append(elapsed / calls)
    return per_call


def p99_single(fn_one, calls):
    """99th percentile of single calls timed one by one (includes the timer)."""
    samples = []
    clock = time.perf_counter_ns
    with gc_paused():
        for i in range(calls):
            t = clock()
            fn_one(i)
            samples.append(clock() - t)
    return rank_percentile(sorted(samples), 99)


def timer_cost(calls=200_000):
    clock = time.perf_counter_ns
    samples = []
    for _ in range(calls):
        t = clock()
        samples.append(clock() - t)
    return rank_percentile(sorted(samples), 50)


def measure(mode, entities, workload, args, with_extras):
    """Every operation for one (mode, entity count), on a fresh manager. Returns
    {operation: ([ns per operation, one per timed loop], p99 ns or None)}."""
    snapshot, users, clients = workload
    rng = random.Random(args.seed + entities)
    base, _, callback = mode.partition("+")
    manager = QuotaManager(snapshot, QuotaSettings(mode=base),
                           DefaultQuotaCallback() if callback else None)
    clock = Clock()
    live = [manager.client(u, c) for u, c in live_pairs(args.live, users, clients, rng)]
    n_live = len(live)
    calls = args.calls
    out = {}

    # warm up: every live client's buckets have seen traffic, windows are rolling
    for i in range(calls):
        q = live[i % n_live]
        now = clock.tick()
        q.record_request(now)
        q.record_produce(PRODUCE_BYTES, now)

    def request(record, nbytes):
        """(a timed loop of ``calls`` requests, one request) recording ``nbytes`` with
        ``record`` (ClientQuotas.record_produce or record_fetch)."""
        def loop():
            tick = clock.tick
            for i in range(calls):
                q = live[i % n_live]
                now = tick()
                q.record_request(now)
                record(q, nbytes, now)
            return calls

        def one(i):
            q = live[i % n_live]
            now = clock.tick()
            q.record_request(now)
            record(q, nbytes, now)
        return loop, one

    for op, record, nbytes in (("produce request", ClientQuotas.record_produce, PRODUCE_BYTES),
                               ("fetch request", ClientQuotas.record_fetch, FETCH_BYTES)):
        loop, one = request(record, nbytes)
        out[op] = (timed(loop, args.repeats), p99_single(one, calls) if with_extras else None)

    # first resolution of never-seen (user, client-id) pairs: a fresh batch every loop,
    # half of them with a configured user name, half with names configured nowhere
    pair_rng = random.Random(args.seed + 1)
    new_ns = []
    for k in range(args.repeats):
        base = (k + 1) * 10_000_000  # client-ids never seen before
        pairs = [(user_name(pair_rng.randrange(users)) if j % 2 else user_name(base + j),
                  client_name(base + j)) for j in range(args.new_clients)]
        client = manager.client
        with gc_paused():
            t0 = time.perf_counter_ns()
            for u, c in pairs:
                client(u, c)
            new_ns.append((time.perf_counter_ns() - t0) / len(pairs))
    out["new client (first resolution)"] = (new_ns, None)

    # the first request of each live client after a configuration update
    snapshots = []
    for k in range(args.repeats):
        changed = dict(snapshot)
        changed[entity_path(client_id=DEFAULT)] = {PRODUCER_BYTE_RATE: 2_000_000.0 + k}
        snapshots.append(changed)
    after, update_ns = [], []
    for changed in snapshots:
        with gc_paused():
            t0 = time.perf_counter_ns()
            manager.update(changed)
            t1 = time.perf_counter_ns()
            for q in live:
                now = clock.tick()
                q.record_request(now)
                q.record_produce(PRODUCE_BYTES, now)
            t2 = time.perf_counter_ns()
        update_ns.append(t1 - t0)
        after.append((t2 - t1) / n_live)
    out["first request after update"] = (after, None)
    out["manager.update"] = (update_ns, None)
    out["_buckets"] = len(manager.buckets)
    return out


# --------------------------------------------------------------------------- main


PER_REQUEST = ("produce request", "fetch request", "new client (first resolution)",
               "first request after update")


UPDATE = "manager.update"


def python_build():
    """Whether this CPython was built with PGO/LTO: without, pure Python runs slower."""
    import sysconfig

    args = sysconfig.get_config_var("CONFIG_ARGS") or ""
    if platform.python_implementation() != "CPython" or not args:
        return ""
    return (", PGO build" if "--enable-optimizations" in args
            else ", built without --enable-optimizations (no PGO/LTO)")


def us(ns):
    return "-" if ns is None else "%.2f" % (ns / 1000.0)


def ms(ns):
    return "-" if ns is None else "%.2f" % (ns / 1e6)


def growth_line(results, args):
    """How far, over the per-request operations, the figure at the largest entity count is
    from the one at the smallest."""
    lo, hi = args.scaling[0], args.scaling[-1]
    if lo == hi:
        return ""
    ratios = sorted((results[(m, hi)][op][0] / results[(m, lo)][op][0], op, m)
                    for op in PER_REQUEST for m in args.modes)
    return ("Measured: the per-request figures at %s entities are %.2fx (%s, %s) to %.2fx "
            "(%s, %s) of those at %s; loop-to-loop spread on this machine is shown as min-max "
            "above." % (format(hi, ","), ratios[0][0], ratios[0][1], ratios[0][2],
                        ratios[-1][0], ratios[-1][1], ratios[-1][2], format(lo, ",")))


def markdown_report(results, args, elapsed, command, timer_ns):
    main = args.entities
    lines = [
        "# Policy cost: QuotaManager per request, in process",
        "",
        "Machine: %s CPUs, %s; Python %s (%s%s); kthrottle at %s."
        % (os.cpu_count(), harness.cpu_model(), platform.python_version(),
           platform.python_implementation(), python_build(), harness.git_describe()),
        "",
        "Command: `%s`" % command,
        "",
        "Settings: %s configured entities (users/<u>, users/<u>/clients/<c>, clients/<c> and "
        "<default> entries; every fourth principal an mTLS distinguished name), %d live "
        "(user, client-id) pairs, round-robin; fake clock advancing %g us per request; "
        "produce %d B, fetch %d B; %s calls per timed loop, %d loops per operation in each of "
        "%d interleaved rounds over every (entity count, mode), a fresh QuotaManager each time; "
        "figures are medians over the %d loops; new clients in batches of %s; garbage "
        "collector off while timing. Run took %.0f s."
        % (format(main, ","), args.live, STEP * 1e6, PRODUCE_BYTES, FETCH_BYTES,
           format(args.calls, ","), args.repeats, args.rounds, args.repeats * args.rounds,
           format(args.new_clients, ","), elapsed),
        "",
        "## At %s entities" % format(main, ","),
        "",
        "| operation | mode | mean us | min-max over loops | p99 us (single-call timing) |",
        "|---|---|---:|---:|---:|",
    ]
    for op in PER_REQUEST:
        for mode in args.modes:
            mean, lo, hi, p99 = results[(mode, main)][op]
            lines.append("| %s | %s | %s | %s-%s | %s |"
                         % (op, mode, us(mean), us(lo), us(hi), us(p99)))
    lines += [
        "",
        "Once per configuration change, not per request: manager.update(snapshot) takes %s."
        % ", ".join("%s ms (%s)" % (ms(results[(mode, main)][UPDATE][0]), mode)
                    for mode in args.modes),
    ]
    per_mb = ", ".join(
        "%.2f ms (%s)" % (results[(mode, main)]["produce request"][0] / 1e6 * 1e6 / PRODUCE_BYTES,
                          mode) for mode in args.modes)
    lines += [
        "",
        "Per MB produced in 16 KiB requests (%d requests per MB) the produce path costs %s of "
        "CPU; compare the proxy's own CPU per MB in proxy_overhead.md."
        % (round(1e6 / PRODUCE_BYTES), per_mb),
        "",
        "Single-call timing includes the timer itself: two perf_counter_ns calls cost about "
        "%.2f us here (median)." % (timer_ns / 1000.0),
        "",
        "## Does it grow with the number of configured entities?",
        "",
        "Mean us per operation (median of loops); manager.update in ms:",
        "",
        "| operation | mode | %s |" % " | ".join("%s entities" % format(n, ",")
                                               for n in args.scaling),
        "|---|---|%s" % ("---:|" * len(args.scaling)),
    ]
    for op in PER_REQUEST + (UPDATE,):
        for mode in args.modes:
            fmt = ms if op == UPDATE else us
            cells = [fmt(results[(mode, n)][op][0]) for n in args.scaling]
            label = op + ", ms (once per config change)" if op == UPDATE else op
            lines.append("| %s | %s | %s |" % (label, mode, " | ".join(cells)))
    lines += [
        "",
        "Live buckets at the end (per entity count, %s): %s."
        % (args.modes[0], ", ".join("%s: %d" % (format(n, ","),
                                                 results[(args.modes[0], n)]["_buckets"])
                                    for n in args.scaling)),
        "",
        "Per request the manager does a dict lookup per quota key at most: resolution walks "
        "Kafka's eight KIP-55 levels with one dict lookup each and happens once per "
        "(user, client-id) per configuration generation, so no per-request operation does work "
        "proportional to the number of configured entities. Only manager.update() indexes the "
        "whole snapshot, once per configuration change. %s"
        % growth_line(results, args),
    ]
    return "\n".join(lines) + "\n"


FLAGS = (
    ("--entities", int, 10_000, "configured quota entities for the main table"),
    ("--scaling", harness.int_list, "100,10000,100000", "comma-separated entity counts for "
     "the scaling table"),
    ("--live", int, 1000, "live (user, client-id) pairs"),
    ("--calls", int, 10_000, "calls per timed loop"),
    ("--repeats", int, 3, "timed loops per operation in each round"),
    ("--rounds", int, 3, "rounds over every (entity count, mode), interleaved; each "
     "operation's figure is the median of rounds x repeats loops"),
    ("--new-clients", int, 2000, "never-seen (user, client-id) pairs resolved per timed loop"),
    ("--modes", None, ",".join(DEFAULT_MODES), "comma-separated quota modes: %s (+callback: "
     "through a quota callback, KIP-257)" % ", ".join(MODES)),
    ("--seed", int, 55, "random seed of the workload"),
)


def parse_args(argv=None):
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS,
                            output_help="where policy_cost.md is written")
    args = p.parse_args(argv)
    args.scaling = sorted(set(args.scaling))
    args.modes = harness.names(args.modes)
    if set(args.modes) - set(MODES) or not args.modes:
        p.error("--modes: choose from %s" % ", ".join(MODES))
    if min([args.entities, args.live, args.calls, args.repeats, args.rounds, args.new_clients]
           + args.scaling) < 1:
        p.error("counts must be >= 1")
    if min([args.entities] + args.scaling) < 3:
        p.error("at least 3 entities (the <default> entries)")
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.output_dir(args, "policy_cost")
    command = harness.command_line("policy_cost", argv)
    started = time.monotonic()
    timer_ns = timer_cost()
    counts = sorted(set(args.scaling) | {args.entities})
    workloads = {n: build_snapshot(n, random.Random(args.seed + n)) for n in counts}
    raw_results = {}
    # rounds interleave every (entity count, mode), so that slow drifts of a shared machine
    # fall on all columns alike rather than on one
    for rnd in range(args.rounds):
        for n in counts:
            for mode in args.modes:
                t = time.monotonic()
                r = measure(mode, n, workloads[n], args,
                            with_extras=(n == args.entities and rnd == 0))
                cell = raw_results.setdefault((mode, n), {})
                for op, value in r.items():
                    if op == "_buckets":
                        cell[op] = value
                        continue
                    values, p99 = value
                    old = cell.get(op, ([], None))
                    cell[op] = (old[0] + values, old[1] if p99 is None else p99)
                print("round %d  %-12s %8s entities: produce %s us, fetch %s us, new client "
                      "%s us, after update %s us, update %.1f ms  (%.1f s)"
                      % (rnd + 1, mode, format(n, ","),
                         us(statistics.median(r["produce request"][0])),
                         us(statistics.median(r["fetch request"][0])),
                         us(statistics.median(r["new client (first resolution)"][0])),
                         us(statistics.median(r["first request after update"][0])),
                         statistics.median(r[UPDATE][0]) / 1e6, time.monotonic() - t),
                      flush=True)
    results = {}
    for key, cell in raw_results.items():
        results[key] = {op: (v if op == "_buckets" else
                             (statistics.median(v[0]), min(v[0]), max(v[0]), v[1]))
                        for op, v in cell.items()}
    if args.entities not in args.scaling:
        args.scaling = sorted(args.scaling + [args.entities])
    report = markdown_report(results, args, time.monotonic() - started, command, timer_ns)
    print()
    print(report)
    harness.write_results(args.output_dir, "policy_cost", markdown=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
