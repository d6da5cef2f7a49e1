#!/usr/bin/env python3
"""How many SASL authentications per second does one kthrottle proxy process sustain?

A fresh Tansu broker (in-memory storage) and one ``python -m kthrottle proxy`` in front of
it, SASL_PLAINTEXT in terminate mode: the proxy verifies clients against a credentials file
holding user ``alice`` with a SCRAM-SHA-256 and a SCRAM-SHA-512 credential
(``--iterations``, 4096 by default). For each of ``--mechanisms``, ``--workers`` processes,
each an asyncio loop with ``--concurrency`` clients, log in over and over: a warm-up
second, then ``--seconds`` measured. One login is a fresh TCP connection (for which the
proxy opens its own connection to the broker), SaslHandshake v1 and SaslAuthenticate v1:
two rounds for SCRAM (the server's signature is checked), one for PLAIN.

Reported per mechanism, over the measured interval: successful authentications/s; errors
(a refused login, a broken connection, a timeout; any error makes the exit status 1);
p50/p99 time per login from connect to the last answer; proxy CPU ms per authentication
(user + system over the interval / logins) and the ceiling it implies on one core,
1000 / (CPU ms per login); proxy, broker and load-generator CPU use, to show who was the
bottleneck.

The proxy checks SCRAM with a few HMACs (the salted key is stored), but PLAIN with a whole
PBKDF2 of the password (``--iterations`` rounds, against the user's strongest SCRAM
credential first) on its event loop. A SCRAM client runs that PBKDF2 too; the clients here
run it once and reuse it (the server sends the same salt every time, so the proxy's work is
unchanged) unless ``--no-client-cache``. Results go to ``sasl_auth_rate.json`` and
``sasl_auth_rate.md`` in ``--output-dir``. Example::

    python benchmarks/sasl_auth_rate.py --seconds 8
"""
import asyncio
import sys
import time
from collections import Counter

import psutil

from kthrottle_testkit.harness import (
    Run,
    SourceTree,
    Workers,
    add_flags,
    add_output_dir,
    cache_client_pbkdf2,
    machine_facts,
    markdown_table,
    names,
    new_runner,
    output_dir,
    parser,
    rank_percentile,
    sasl_login,
    settings_of,
    worker_signals,
    write_results,
)

MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
USER, PASSWORD = "alice", "alice-secret"
LOGIN_TIMEOUT = 10.0  # seconds; a slower login counts as an error


def start_proxy(run, broker, credentials):
    """The proxy on a free port, SASL_PLAINTEXT, terminate mode; ready once it listens (no
    Metadata is asked, so its node listener stays closed)."""
    return run.kthrottle(broker, [
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "terminate",
        "--sasl-enabled-mechanisms", ",".join(MECHANISMS),
        "--credentials-file", str(credentials)], probe=False)


async def login(port, mechanism, password):
    """One authentication on a fresh connection; raises if it does not succeed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await sasl_login(reader, writer, mechanism, USER, password, client_id="sasl-auth-rate")
    finally:
        writer.close()


# --------------------------------------------------------------------------- load generator


async def _drive(port, mechanism, password, concurrency, t_measure, t_end):
    """``concurrency`` clients logging in until t_end; logins that end in
    [t_measure, t_end) are counted (time.monotonic is one clock for all processes)."""
    latencies, errors = [], Counter()

    async def client():
        while time.monotonic() < t_end:
            start, error = time.monotonic(), None
            try:
                await asyncio.wait_for(login(port, mechanism, password), LOGIN_TIMEOUT)
            except Exception as exc:  # refused, connection broken, timed out
                error = "%s: %s" % (type(exc).__name__, exc)
            done = time.monotonic()
            if t_measure <= done < t_end:
                if error:
                    errors[error] += 1
                else:
                    latencies.append(done - start)

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, t_end - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"latencies": latencies, "errors": dict(errors)}


def worker_main(port, mechanism, password, concurrency, cache_pbkdf2, go, results):
    worker_signals()
    if cache_pbkdf2:
        cache_client_pbkdf2()
    results.put("ready")
    t_measure, t_end = go.get()
    with new_runner() as runner:
        stats = runner.run(_drive(port, mechanism, password, concurrency, t_measure, t_end))
    results.put(stats)


def _percentile_ms(sorted_seconds, q):
    value = rank_percentile(sorted_seconds, q)
    return None if value is None else round(value * 1000, 2)


def measure(mechanism, port, proxy, broker, args):
    """One mechanism: warm-up, then the measured interval; one row of figures."""
    workers = Workers()
    try:
        for _ in range(args.workers):
            workers.add(worker_main, port, mechanism, args.password, args.concurrency,
                        not args.no_client_cache)
        workers.wait_ready(30)
        t_measure = time.monotonic() + args.warmup
        t_end = t_measure + args.seconds
        workers.start(t_measure, t_end)
        watched = [psutil.Process(proxy.pid), psutil.Process(broker.pid)]
        watched += [psutil.Process(w.pid) for w in workers.procs]
        time.sleep(max(0.0, t_measure - time.monotonic()))
        cpu0, wall0 = [sum(p.cpu_times()[:2]) for p in watched], time.monotonic()
        time.sleep(max(0.0, t_end - time.monotonic()))
        cpu1, wall1 = [sum(p.cpu_times()[:2]) for p in watched], time.monotonic()  # user+sys
        stats = workers.collect(LOGIN_TIMEOUT + 30)
    finally:
        workers.stop()
    used = [b - a for a, b in zip(cpu0, cpu1)]
    wall = wall1 - wall0
    latencies = sorted(x for s in stats for x in s["latencies"])
    errors = Counter()
    for s in stats:
        errors.update(s["errors"])
    ok = len(latencies)
    proxy_ms = used[0] * 1000 / ok if ok else None
    return {
        "mechanism": mechanism, "seconds": args.seconds, "authentications": ok,
        "errors": sum(errors.values()), "auth_per_s": round(ok / args.seconds, 1),
        "p50_ms": _percentile_ms(latencies, 50), "p99_ms": _percentile_ms(latencies, 99),
        "proxy_cpu_ms_per_auth": round(proxy_ms, 3) if proxy_ms else None,
        "proxy_ceiling_auth_per_s": round(1000 / proxy_ms, 1) if proxy_ms else None,
        "proxy_cpu_percent": round(used[0] / wall * 100, 1),
        "broker_cpu_ms_per_auth": round(used[1] * 1000 / ok, 3) if ok else None,
        "clients_cpu_percent": round(sum(used[2:]) / wall * 100, 1),
        "error_samples": dict(errors.most_common(5)),
    }


# --------------------------------------------------------------------------- report


COLUMNS = (("mechanism", "mechanism"), ("auth/s", "auth_per_s"), ("errors", "errors"),
           ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"),
           ("proxy CPU ms/auth", "proxy_cpu_ms_per_auth"),
           ("ceiling auth/s (1 core)", "proxy_ceiling_auth_per_s"),
           ("proxy CPU %", "proxy_cpu_percent"), ("broker CPU ms/auth", "broker_cpu_ms_per_auth"),
           ("clients CPU %", "clients_cpu_percent"))


def markdown_report(rows, facts, args, stopped=None):
    lines = [
        "# SASL authentications per second, one kthrottle proxy (terminate mode)", "",
        "kthrottle %s; %s cores (%s); Python %s; %g warm-up + %g measured s per mechanism; "
        "%d worker processes x %d concurrent clients; SCRAM iterations %d; client PBKDF2 %s."
        % (facts["kthrottle_commit"], facts["nproc"], facts["cpu_model"], facts["python"],
           args.warmup, args.seconds, args.workers, args.concurrency, args.iterations,
           "every login" if args.no_client_cache else "cached"), "",
    ] + markdown_table([title for title, _ in COLUMNS],
                       [[row[key] for _, key in COLUMNS] for row in rows], align="l" * len(COLUMNS))
    if stopped:
        lines += ["", "Partial run: %s." % stopped]
    samples = [(row["mechanism"], count, message) for row in rows
               for message, count in row["error_samples"].items()]
    if samples:
        lines += ["", "Most frequent errors:", ""]
        lines += ["* %s, %d times: %s" % sample for sample in samples]
    return "\n".join(lines) + "\n"


FLAGS = (
    ("--mechanisms", None, ",".join(MECHANISMS), "comma-separated, of %s" % ", ".join(MECHANISMS)),
    ("--seconds", float, 10.0, "measured seconds per mechanism"),
    ("--warmup", float, 1.0, "seconds of logins before the measured interval"),
    ("--workers", int, 2, "load-generator processes"),
    ("--concurrency", int, 16, "clients logging in at once in each worker process"),
    ("--iterations", int, 4096, "PBKDF2 iterations of the stored SCRAM credentials"),
)


def parse_args(argv=None):
    p = parser(
        "Measure SASL authentications per second through one kthrottle proxy "
        "(SASL_PLAINTEXT, terminate mode) in front of a local Tansu broker, and the proxy's "
        "CPU ms per authentication. Prints a Markdown table and writes "
        "sasl_auth_rate.json/.md into --output-dir.")
    add_flags(p, FLAGS)
    p.add_argument("--no-client-cache", action="store_true",
                   help="let every SCRAM login run the client's own PBKDF2 (a client "
                   "keeping no salted password); on a small machine the clients then "
                   "compete with the proxy for CPU")
    p.add_argument("--password", default=PASSWORD,
                   help="password the clients log in with; another one than the stored "
                   "one checks that refused logins are counted as errors")
    add_output_dir(p)
    args = p.parse_args(argv)
    args.mechanisms = names(args.mechanisms)
    unknown = [m for m in args.mechanisms if m not in MECHANISMS]
    if unknown or not args.mechanisms:
        p.error("--mechanisms: unknown %s" % ", ".join(unknown or ["(none given)"]))
    if args.seconds <= 0 or args.warmup < 0 or args.workers < 1 or args.concurrency < 1:
        p.error("--seconds, --workers and --concurrency must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    output_dir(args, "sasl_auth_rate")
    facts = machine_facts()
    rows = []
    with Run("sasl_auth_rate") as run:
        broker = run.broker()
        credentials = run.path("credentials.toml")
        SourceTree().write_credentials(credentials, {USER: PASSWORD}, args.iterations)
        proxy = start_proxy(run, broker, credentials)
        print("broker pid %d, proxy pid %d on %s; logs in %s"
              % (broker.proc.pid, proxy.proc.pid, proxy.bootstrap, run.log_dir), flush=True)
        for mechanism in args.mechanisms:
            print("%s: %g s warm-up, %g s measured ..." % (mechanism, args.warmup,
                                                        args.seconds), flush=True)
            rows.append(measure(mechanism, proxy.port, proxy.proc, broker.proc, args))
            for name, proc in (("proxy", proxy.proc), ("broker", broker.proc)):
                if proc.poll() is not None:
                    raise RuntimeError("the %s exited (code %s)" % (name, proc.returncode))
            time.sleep(1.0)  # let the closed connections drain before the next mechanism
    if not rows:
        return run.finish(failed=True)

    report = markdown_report(rows, facts, args, stopped=run.stopped)
    print()
    print(report)
    settings = settings_of(args, drop=("password",))
    settings["password_is_stored_one"] = args.password == PASSWORD
    write_results(args.output_dir, "sasl_auth_rate", report, {
        "machine": facts, "settings": settings, "interrupted": run.interrupted,
        "failure": run.failure, "results": rows})
    return run.finish(any(row["errors"] or not row["authentications"] for row in rows))


if __name__ == "__main__":
    sys.exit(main())
