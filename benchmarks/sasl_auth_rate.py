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
import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path

import psutil
from scramp import ScramClient

from kthrottle.embedded import TansuBroker, free_port, wait_for_port

with warnings.catch_warnings():  # kafka.protocol warns about its own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.sasl import (SaslAuthenticateRequest, SaslAuthenticateResponse,
                                     SaslHandshakeRequest, SaslHandshakeResponse)

MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
USER, PASSWORD = "alice", "alice-secret"
TANSU_NODE_ID = 111  # every Tansu broker reports this node id
LOGIN_TIMEOUT = 10.0  # seconds; a slower login counts as an error
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- processes


class Processes:
    """Every server process this script starts, so that each is stopped by its own PID."""

    def __init__(self, log_dir):
        self.log_dir = Path(log_dir)
        self._procs = []

    def spawn(self, name, argv):
        with open(self.log_dir / ("%s.log" % name), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO,
                                    start_new_session=True)  # Ctrl-C reaches only us
        self._procs.append(proc)
        return proc

    def stop_all(self, timeout=5.0):
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
        self._procs.clear()


def write_credentials(path, iterations):
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        subprocess.run([sys.executable, "-m", "kthrottle", "quotas", "alter",
                        "--credentials-file", str(path), "--entity-type", "users",
                        "--entity-name", USER, "--add-config",
                        "%s=[iterations=%d,password=%s]" % (mechanism, iterations, PASSWORD)],
                       cwd=REPO, check=True, capture_output=True, timeout=60)


def start_proxy(broker, procs, credentials):
    """The proxy on a free port, SASL_PLAINTEXT, terminate mode; ready once it listens."""
    listen, node_port = free_port(), free_port()
    proc = procs.spawn("kthrottle", [
        sys.executable, "-m", "kthrottle", "proxy",
        "--bootstrap-server", broker.bootstrap,
        "--listen", "127.0.0.1:%d" % listen,
        "--node-port-base", str(node_port - TANSU_NODE_ID),  # unused: no Metadata is asked
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "terminate",
        "--sasl-enabled-mechanisms", ",".join(MECHANISMS),
        "--credentials-file", str(credentials), "--log-level", "WARNING",
    ])
    wait_for_port("127.0.0.1", listen, timeout=20, proc=proc)
    return proc, listen


# --------------------------------------------------------------------------- one login


class LoginFailed(Exception):
    pass


async def _call(reader, writer, request, correlation_id, response_type):
    request.with_header(correlation_id=correlation_id, client_id="sasl-auth-rate")
    writer.write(bytes(request.encode(header=True, framed=True)))
    frame = await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))
    got = int.from_bytes(frame[:4], "big")
    if got != correlation_id:
        raise LoginFailed("correlation id %d, expected %d" % (got, correlation_id))
    return response_type.decode(frame[4:])  # response header v0: the correlation id alone


async def _authenticate(reader, writer, token, correlation_id):
    answer = await _call(reader, writer, SaslAuthenticateRequest[1](auth_bytes=token),
                         correlation_id, SaslAuthenticateResponse[1])
    if answer.error_code:
        raise LoginFailed("SaslAuthenticate error %d: %s"
                          % (answer.error_code, answer.error_message))
    return bytes(answer.auth_bytes)


async def login(port, mechanism, password):
    """One authentication on a fresh connection; raises if it does not succeed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answer = await _call(reader, writer, SaslHandshakeRequest[1](mechanism=mechanism), 1,
                             SaslHandshakeResponse[1])
        if answer.error_code:
            raise LoginFailed("SaslHandshake error %d" % answer.error_code)
        if mechanism == "PLAIN":
            await _authenticate(reader, writer, b"\0%s\0%s" % (USER.encode(),
                                                               password.encode()), 2)
            return
        scram = ScramClient([mechanism], USER, password)
        server_first = await _authenticate(reader, writer, scram.get_client_first().encode(), 2)
        scram.set_server_first(server_first.decode())
        server_final = await _authenticate(reader, writer, scram.get_client_final().encode(), 3)
        scram.set_server_final(server_final.decode())  # checks the server's signature
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cache_pbkdf2:  # the client's PBKDF2 once per (password, salt, iterations)
        import scramp.core
        pbkdf2 = lru_cache(maxsize=16)(scramp.core.hi)
        scramp.core.hi = lambda hf, password, salt, i: pbkdf2(hf, password, salt, int(i))
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    results.put("ready")
    t_measure, t_end = go.get()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        stats = runner.run(_drive(port, mechanism, password, concurrency, t_measure, t_end))
    results.put(stats)


def _percentile_ms(sorted_seconds, q):
    if not sorted_seconds:
        return None
    return round(sorted_seconds[min(len(sorted_seconds) - 1,
                                    int(q * len(sorted_seconds)))] * 1000, 2)


def measure(mechanism, port, proxy, broker, args):
    """One mechanism: warm-up, then the measured interval; one row of figures."""
    ctx = multiprocessing.get_context("fork")
    go, results = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=worker_main, daemon=True, args=(
        port, mechanism, args.password, args.concurrency, not args.no_client_cache, go,
        results)) for _ in range(args.workers)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            results.get(timeout=30)  # "ready"
        t_measure = time.monotonic() + args.warmup
        t_end = t_measure + args.seconds
        for _ in workers:
            go.put((t_measure, t_end))
        watched = [psutil.Process(proxy.pid), psutil.Process(broker.pid)]
        watched += [psutil.Process(w.pid) for w in workers]
        time.sleep(max(0.0, t_measure - time.monotonic()))
        cpu0, wall0 = [sum(p.cpu_times()[:2]) for p in watched], time.monotonic()
        time.sleep(max(0.0, t_end - time.monotonic()))
        cpu1, wall1 = [sum(p.cpu_times()[:2]) for p in watched], time.monotonic()  # user+sys
        stats = [results.get(timeout=LOGIN_TIMEOUT + 30) for _ in workers]
        for worker in workers:
            worker.join(10)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(5)
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
        "p50_ms": _percentile_ms(latencies, 0.50), "p99_ms": _percentile_ms(latencies, 0.99),
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
        "| %s |" % " | ".join(title for title, _ in COLUMNS),
        "|%s" % ("---|" * len(COLUMNS)),
    ]
    for row in rows:
        lines.append("| %s |" % " | ".join("-" if row[key] is None else str(row[key])
                                           for _, key in COLUMNS))
    if stopped:
        lines += ["", "Partial run: %s." % stopped]
    samples = [(row["mechanism"], count, message) for row in rows
               for message, count in row["error_samples"].items()]
    if samples:
        lines += ["", "Most frequent errors:", ""]
        lines += ["* %s, %d times: %s" % sample for sample in samples]
    return "\n".join(lines) + "\n"


def machine_facts():
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                      if line.startswith("model name")), "unknown")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return {"kthrottle_commit": commit, "nproc": os.cpu_count(), "cpu_model": model,
            "python": platform.python_version(), "platform": platform.platform()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Measure SASL authentications per second through one kthrottle proxy "
        "(SASL_PLAINTEXT, terminate mode) in front of a local Tansu broker, and the proxy's "
        "CPU ms per authentication. Prints a Markdown table and writes "
        "sasl_auth_rate.json/.md into --output-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mechanisms", default=",".join(MECHANISMS),
                   help="comma-separated, of %s" % ", ".join(MECHANISMS))
    p.add_argument("--seconds", type=float, default=10.0,
                   help="measured seconds per mechanism")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="seconds of logins before the measured interval")
    p.add_argument("--workers", type=int, default=2, help="load-generator processes")
    p.add_argument("--concurrency", type=int, default=16,
                   help="clients logging in at once in each worker process")
    p.add_argument("--iterations", type=int, default=4096,
                   help="PBKDF2 iterations of the stored SCRAM credentials")
    p.add_argument("--no-client-cache", action="store_true",
                   help="let every SCRAM login run the client's own PBKDF2 (a client "
                   "keeping no salted password); on a small machine the clients then "
                   "compete with the proxy for CPU")
    p.add_argument("--password", default=PASSWORD,
                   help="password the clients log in with; another one than the stored "
                   "one checks that refused logins are counted as errors")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    args.mechanisms = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    unknown = [m for m in args.mechanisms if m not in MECHANISMS]
    if unknown or not args.mechanisms:
        p.error("--mechanisms: unknown %s" % ", ".join(unknown or ["(none given)"]))
    if args.seconds <= 0 or args.warmup < 0 or args.workers < 1 or args.concurrency < 1:
        p.error("--seconds, --workers and --concurrency must be positive")
    return args


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)  # same cleanup path as Ctrl-C
    facts = machine_facts()
    log_dir = Path(tempfile.mkdtemp(prefix="sasl_auth_rate-"))
    procs = Processes(log_dir)
    broker = TansuBroker(log_path=str(log_dir / "tansu-broker.log"))
    rows, interrupted, failure = [], False, None
    try:
        broker.start()
        credentials = log_dir / "credentials.toml"
        write_credentials(credentials, args.iterations)
        proxy, port = start_proxy(broker, procs, credentials)
        print("broker pid %d, proxy pid %d on 127.0.0.1:%d; logs in %s"
              % (broker.proc.pid, proxy.pid, port, log_dir), flush=True)
        for mechanism in args.mechanisms:
            print("%s: %g s warm-up, %g s measured ..." % (mechanism, args.warmup,
                                                        args.seconds), flush=True)
            rows.append(measure(mechanism, port, proxy, broker.proc, args))
            for name, proc in (("proxy", proxy), ("broker", broker.proc)):
                if proc.poll() is not None:
                    raise RuntimeError("the %s exited (code %s)" % (name, proc.returncode))
            time.sleep(1.0)  # let the closed connections drain before the next mechanism
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted; stopping processes and writing what was measured",
              file=sys.stderr)
    except Exception as exc:  # report it, and what was measured before it
        failure = "%s: %s" % (type(exc).__name__, exc)
        print("failed: %s" % failure, file=sys.stderr)
    finally:
        procs.stop_all()
        broker.stop()
    if not rows:
        return 1

    report = markdown_report(rows, facts, args,
                             stopped="interrupted" if interrupted else failure)
    print()
    print(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "sasl_auth_rate.md").write_text(report)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "password"}
    settings["password_is_stored_one"] = args.password == PASSWORD
    (args.output_dir / "sasl_auth_rate.json").write_text(json.dumps({
        "machine": facts, "settings": settings, "interrupted": interrupted,
        "failure": failure, "results": rows}, indent=2) + "\n")
    print("wrote sasl_auth_rate.json and sasl_auth_rate.md in %s" % args.output_dir)
    failed = interrupted or failure or any(row["errors"] or not row["authentications"]
                                           for row in rows)
    if failed:
        print("errors, failure or interruption; process logs kept in %s" % log_dir,
              file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
