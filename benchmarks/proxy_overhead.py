#!/usr/bin/env python3
"""What does putting a proxy in the path cost?

Compares three ways for a Kafka client to reach the same broker:

* ``direct``      - aiokafka talks straight to a local Tansu broker;
* ``kthrottle``   - through ``python -m kthrottle proxy`` (this project);
* ``tansu-proxy`` - through ``tansu proxy``, a pass-through proxy written in Rust.

One fresh Tansu broker (in-memory storage) serves the whole run. Every round runs each
configuration once, in rotated order, with a fresh proxy process and fresh topics, and
measures produce throughput, consume throughput, proxy CPU per MB moved and produce
latency at a fixed rate. The table shows medians over rounds; raw numbers go to JSON,
a Markdown copy of the table and a PNG plot go next to it (``benchmarks/results/``).

MB means 10^6 bytes of record values throughout.

Example::

    python benchmarks/proxy_overhead.py --rounds 1 --records 20000 --latency-seconds 3
"""
import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kthrottle.embedded import TansuBroker, free_port, tansu_binary, wait_for_port

CONFIGS = ("direct", "kthrottle", "tansu-proxy")
MB = 1_000_000
TANSU_NODE_ID = 111  # every Tansu broker reports this node id (KAFKA-NOTES section 6)
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- results


@dataclass
class CellResult:
    """One configuration measured once (one round)."""

    config: str
    round: int
    position: int  # 0-based position of this configuration within its round
    ok: bool = True
    errors: list = field(default_factory=list)
    profiled: bool = False
    # a. produce throughput
    produce_records: int = 0
    produce_seconds: Optional[float] = None
    produce_mb_s: Optional[float] = None
    produce_rec_s: Optional[float] = None
    # b. consume throughput
    consume_records: int = 0
    consume_bytes: int = 0
    consume_seconds: Optional[float] = None
    consume_mb_s: Optional[float] = None
    consume_rec_s: Optional[float] = None
    # d. CPU over the two throughput phases
    proxy_cpu_seconds: Optional[float] = None
    proxy_cpu_ms_per_mb: Optional[float] = None
    broker_cpu_ms_per_mb: Optional[float] = None
    proxy_rss_mb: Optional[float] = None
    # c. produce latency at a fixed rate
    latency_samples: int = 0
    latency_rate_achieved: Optional[float] = None
    latency_late_sends: int = 0  # sends issued more than 5 ms behind schedule
    latency_p50_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    latency_p999_ms: Optional[float] = None

    def fail(self, phase, exc):
        self.ok = False
        text = "%s: %s: %s" % (phase, type(exc).__name__, exc)
        self.errors.append(text)
        print("    ! %s" % text, flush=True)


# --------------------------------------------------------------------------- processes


class Processes:
    """Every child process this script starts, so that all of them can be stopped by PID."""

    def __init__(self, log_dir):
        self.log_dir = Path(log_dir)
        self._procs = []

    def spawn(self, name, argv, env=None):
        log = open(self.log_dir / ("%s.log" % name), "ab")
        try:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,  # Ctrl-C reaches only us; we stop them
            )
        finally:
            log.close()
        self._procs.append(proc)
        return proc

    def stop(self, proc, timeout=5.0, sig=signal.SIGTERM):
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self):
        for proc in list(self._procs):
            try:
                self.stop(proc)
            except Exception as exc:  # keep going: the others must be stopped too
                print("could not stop pid %d: %s" % (proc.pid, exc), file=sys.stderr)


@dataclass
class Endpoint:
    """Where the client connects for one configuration, and the proxy process if any."""

    config: str
    bootstrap: str
    proc: Optional[subprocess.Popen] = None
    admin_port: Optional[int] = None  # kthrottle's /metrics and /quotas, when asked for


def metadata_probe(host, port, timeout=10.0):
    """Send one Metadata v1 request (all topics) and read the response.

    kthrottle opens its per-node listener only once a Metadata response has passed through
    it; this makes that happen before the client under test connects.
    """
    client_id = b"proxy-overhead-probe"
    body = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", -1)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv_exact(sock, 4))[0]
        _recv_exact(sock, size)


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return buf


def start_kthrottle(broker, procs, extra_args=(), admin=False, name="kthrottle", attempts=3):
    """``python -m kthrottle proxy`` in front of ``broker`` on free ports (with an
    admin endpoint if asked), ready once its node listener is open."""
    last_error = None
    for attempt in range(attempts):
        listen, node_port = free_port(), free_port()
        admin_port = free_port() if admin else None
        if len({listen, node_port, admin_port}) < 3 or node_port - TANSU_NODE_ID < 1024:
            continue
        argv = [
            sys.executable, "-m", "kthrottle", "proxy",
            "--bootstrap-server", broker.bootstrap,
            "--listen", "127.0.0.1:%d" % listen,
            "--node-port-base", str(node_port - TANSU_NODE_ID),  # Tansu is node 111
            "--log-level", "WARNING", *extra_args,
        ]
        if admin_port:
            argv += ["--admin-listen", "127.0.0.1:%d" % admin_port]
        proc = procs.spawn(name, argv)
        try:
            wait_for_port("127.0.0.1", listen, timeout=20, proc=proc)
            metadata_probe("127.0.0.1", listen)  # opens the node 111 listener
            wait_for_port("127.0.0.1", node_port, timeout=5, proc=proc)
            if admin_port:
                wait_for_port("127.0.0.1", admin_port, timeout=5, proc=proc)
            return Endpoint(name, "127.0.0.1:%d" % listen, proc, admin_port)
        except Exception as exc:  # most likely a port taken in between: try other ports
            last_error = exc
            procs.stop(proc)
            print("    %s start attempt %d failed: %s" % (name, attempt + 1, exc), flush=True)
    raise RuntimeError("kthrottle did not start: %s" % last_error)


def start_tansu_proxy(broker, procs):
    port = free_port()
    url = "tcp://127.0.0.1:%d" % port
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    proc = procs.spawn("tansu-proxy", [
        tansu_binary(), "proxy", "--listener-url", url, "--advertised-listener-url", url,
        "--origin-url", "tcp://%s" % broker.bootstrap,
    ], env=env)
    wait_for_port("127.0.0.1", port, timeout=20, proc=proc)
    metadata_probe("127.0.0.1", port)
    return Endpoint("tansu-proxy", "127.0.0.1:%d" % port, proc)


def start_endpoint(config, broker, procs):
    if config == "direct":
        return Endpoint("direct", broker.bootstrap)
    if config == "kthrottle":
        return start_kthrottle(broker, procs)
    if config == "tansu-proxy":
        return start_tansu_proxy(broker, procs)
    raise ValueError(config)


def start_py_spy(pid, procs, raw_path):
    if shutil.which("py-spy") is None:
        raise RuntimeError("py-spy is not installed")
    proc = procs.spawn("py-spy", [
        "py-spy", "record", "--pid", str(pid), "--format", "raw", "--output", str(raw_path),
        "--rate", "200", "--nonblocking",
    ])
    time.sleep(0.5)  # let it attach before the measured phase starts
    if proc.poll() is not None:
        raise RuntimeError("py-spy exited with code %s (see its log)" % proc.returncode)
    return proc


def cpu_seconds(ps_proc):
    times = ps_proc.cpu_times()
    return times.user + times.system


# --------------------------------------------------------------------------- phases


def percentile(sorted_values, q):
    """Linear-interpolated percentile, q in [0, 100], of an already sorted list."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def producer_for(bootstrap, args, linger_ms):
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=linger_ms,
        max_batch_size=args.batch_size, request_timeout_ms=30000,
    )


async def warm_up(producer, topic, value, partitions):
    """One acknowledged record per partition: connections and metadata are in place."""
    futures = [await producer.send(topic, value, partition=p) for p in range(partitions)]
    await asyncio.gather(*futures)


async def produce_throughput(bootstrap, topic, args):
    """Phase a: send ``args.records`` records as fast as possible. Returns seconds."""
    value = os.urandom(args.record_size)
    producer = producer_for(bootstrap, args, args.linger_ms)
    await producer.start()
    try:
        await warm_up(producer, topic, value, args.partitions)
        in_flight = deque()
        start = time.perf_counter()
        for _ in range(args.records):
            in_flight.append(await producer.send(topic, value))
            if len(in_flight) >= args.max_in_flight:
                await in_flight.popleft()
        await asyncio.gather(*in_flight)
        return time.perf_counter() - start
    finally:
        await producer.stop()


async def consume_throughput(bootstrap, topic, args, expected):
    """Phase b: read ``expected`` records from the beginning. Returns (records, bytes, s)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", fetch_max_wait_ms=100,
        fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=8 * 1024 * 1024,
        request_timeout_ms=30000,
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(args.partitions)]
        start = time.perf_counter()
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        records = nbytes = 0
        while records < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=50_000)
            for batch in batches.values():
                records += len(batch)
                nbytes += sum(len(r.value) for r in batch)
        return records, nbytes, time.perf_counter() - start
    finally:
        await consumer.stop()


async def produce_latency(bootstrap, topic, args):
    """Phase c: ``args.rate`` records/s for ``args.latency_seconds``, linger 0.

    Returns (sorted latencies in ms, achieved send rate, sends more than 5 ms late).
    """
    value = os.urandom(args.record_size)
    producer = producer_for(bootstrap, args, linger_ms=0)
    await producer.start()
    latencies = []

    def on_ack(sent_at, fut):
        if not fut.cancelled() and fut.exception() is None:
            latencies.append((time.perf_counter() - sent_at) * 1000.0)

    try:
        await warm_up(producer, topic, value, args.partitions)
        loop = asyncio.get_running_loop()
        total = int(args.rate * args.latency_seconds)
        interval = 1.0 / args.rate
        futures = []
        late = 0
        t0 = loop.time()
        for i in range(total):
            delay = t0 + i * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1
            sent_at = time.perf_counter()
            fut = await producer.send(topic, value)
            fut.add_done_callback(lambda f, t=sent_at: on_ack(t, f))
            futures.append(fut)
        send_seconds = loop.time() - t0
        await asyncio.gather(*futures)
        await asyncio.sleep(0)  # let the last done-callbacks run
        return sorted(latencies), total / send_seconds, late
    finally:
        await producer.stop()


async def measure(endpoint, broker, topics, args, result, profile_path, procs):
    """Run phases a-d against one endpoint, filling ``result``."""
    proxy_ps = psutil.Process(endpoint.proc.pid) if endpoint.proc else None
    broker_ps = psutil.Process(broker.proc.pid)
    throughput_topic, latency_topic = topics

    proxy_cpu0 = cpu_seconds(proxy_ps) if proxy_ps else None
    broker_cpu0 = cpu_seconds(broker_ps)

    spy = None
    if profile_path is not None:
        try:
            spy = start_py_spy(endpoint.proc.pid, procs, profile_path)
            result.profiled = True
        except Exception as exc:
            result.errors.append("py-spy: %s" % exc)
            print("    ! py-spy: %s" % exc, flush=True)
    try:
        seconds = await asyncio.wait_for(
            produce_throughput(endpoint.bootstrap, throughput_topic, args), args.phase_timeout)
        result.produce_records = args.records
        result.produce_seconds = seconds
        result.produce_mb_s = args.records * args.record_size / MB / seconds
        result.produce_rec_s = args.records / seconds
    except Exception as exc:
        result.fail("produce", exc)
        return
    finally:
        if spy is not None:
            procs.stop(spy, timeout=30, sig=signal.SIGINT)  # py-spy writes its file on SIGINT

    expected = args.records + args.partitions  # plus the warm-up records
    try:
        records, nbytes, seconds = await asyncio.wait_for(
            consume_throughput(endpoint.bootstrap, throughput_topic, args, expected),
            args.phase_timeout)
        result.consume_records = records
        result.consume_bytes = nbytes
        result.consume_seconds = seconds
        result.consume_mb_s = nbytes / MB / seconds
        result.consume_rec_s = records / seconds
    except Exception as exc:
        result.fail("consume", exc)

    moved_mb = (args.records * args.record_size + result.consume_bytes) / MB
    if proxy_ps is not None:
        result.proxy_cpu_seconds = cpu_seconds(proxy_ps) - proxy_cpu0
        result.proxy_cpu_ms_per_mb = result.proxy_cpu_seconds * 1000.0 / moved_mb
        result.proxy_rss_mb = proxy_ps.memory_info().rss / (1024 * 1024)
    result.broker_cpu_ms_per_mb = (cpu_seconds(broker_ps) - broker_cpu0) * 1000.0 / moved_mb

    try:
        latencies, rate, late = await asyncio.wait_for(
            produce_latency(endpoint.bootstrap, latency_topic, args),
            args.latency_seconds + args.phase_timeout)
        result.latency_samples = len(latencies)
        result.latency_rate_achieved = rate
        result.latency_late_sends = late
        result.latency_p50_ms = percentile(latencies, 50)
        result.latency_p99_ms = percentile(latencies, 99)
        result.latency_p999_ms = percentile(latencies, 99.9)
    except Exception as exc:
        result.fail("latency", exc)


def delete_topic(broker, name):
    subprocess.run(
        [tansu_binary(), "topic", "delete", "--broker", "tcp://%s" % broker.bootstrap, name],
        capture_output=True, timeout=10,
    )


def run_cell(runner, config, rnd, position, broker, procs, args, profile_raw):
    result = CellResult(config=config, round=rnd, position=position)
    topics = ("tput-%s-r%d" % (config, rnd), "lat-%s-r%d" % (config, rnd))
    print("round %d/%d  %-11s" % (rnd + 1, args.rounds, config), flush=True)
    endpoint = None
    try:
        for topic in topics:
            broker.create_topic(topic, args.partitions)
        endpoint = start_endpoint(config, broker, procs)
        profile_path = profile_raw if (profile_raw and config == "kthrottle") else None
        runner.run(measure(endpoint, broker, topics, args, result, profile_path, procs))
    except Exception as exc:
        result.fail("setup", exc)
    finally:
        if endpoint is not None and endpoint.proc is not None:
            if endpoint.proc.poll() is not None:
                result.fail("proxy", RuntimeError(
                    "proxy exited early with code %s" % endpoint.proc.returncode))
            procs.stop(endpoint.proc)
        for topic in topics:
            delete_topic(broker, topic)  # keep the in-memory broker small between cells
    print("    " + describe(result), flush=True)
    return result


def describe(r):
    parts = []
    if r.produce_mb_s is not None:
        parts.append("produce %.1f MB/s" % r.produce_mb_s)
    if r.consume_mb_s is not None:
        parts.append("consume %.1f MB/s" % r.consume_mb_s)
    if r.proxy_cpu_ms_per_mb is not None:
        parts.append("proxy CPU %.1f ms/MB" % r.proxy_cpu_ms_per_mb)
    if r.latency_p99_ms is not None:
        parts.append("latency p50 %.2f / p99 %.2f / p99.9 %.2f ms"
                     % (r.latency_p50_ms, r.latency_p99_ms, r.latency_p999_ms))
    return ", ".join(parts) or "no results"


# --------------------------------------------------------------------------- reporting


METRICS = (
    "produce_mb_s", "produce_rec_s", "consume_mb_s", "consume_rec_s",
    "latency_p50_ms", "latency_p99_ms", "latency_p999_ms",
    "proxy_cpu_ms_per_mb", "broker_cpu_ms_per_mb",
)


def summarize(results, configs):
    """Median of every metric over the rounds where it was measured, per configuration."""
    summary = {}
    for config in configs:
        cells = [r for r in results if r.config == config]
        row = {"rounds_measured": 0}
        for metric in METRICS:
            values = [getattr(r, metric) for r in cells if getattr(r, metric) is not None]
            row[metric] = statistics.median(values) if values else None
            row[metric + "_all"] = values
        row["rounds_measured"] = sum(1 for r in cells if r.ok)
        summary[config] = row
    return summary


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_facts():
    model = cpu_model()
    try:
        tansu = subprocess.run([tansu_binary(), "--version"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except Exception:
        tansu = "unknown"
    try:
        import uvloop
        loop_name = "uvloop " + uvloop.__version__
    except ImportError:
        loop_name = "asyncio default loop"
    import aiokafka
    return {
        "kthrottle_commit": git_describe(),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "aiokafka": aiokafka.__version__,
        "client_loop": loop_name,
        "tansu": tansu,
    }


def git_describe():
    """HEAD of the checkout holding this script, with "-dirty" if kthrottle/ has local edits."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kthrottle"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def ratio(value, base):
    if value is None or not base:
        return "-"
    return "%.2fx" % (value / base)


def delta(value, base):
    if value is None or base is None:
        return "-"
    return "%+.2f" % (value - base)


def paired_ratios(results, config, metric):
    """config / direct for every round where both were measured: rounds share
    the machine's state, so their ratio is steadier than a ratio of medians."""
    by_round = {}
    for r in results:
        by_round.setdefault(r.round, {})[r.config] = getattr(r, metric)
    return sorted(cells[config] / cells["direct"] for cells in by_round.values()
                  if cells.get(config) and cells.get("direct"))


def paired_lines(results, configs):
    lines = []
    for config in configs:
        if config == "direct":
            continue
        parts = []
        for metric, label in (("produce_mb_s", "produce"), ("consume_mb_s", "consume")):
            values = paired_ratios(results, config, metric)
            if values:
                parts.append("%s %.2fx (%.2f-%.2f)" % (label, statistics.median(values),
                                                       values[0], values[-1]))
        if parts:
            lines.append("- %s: %s" % (config, ", ".join(parts)))
    if lines:
        lines.insert(0, "Throughput relative to direct within the same round, median (min-max):")
    return lines


def markdown_report(summary, configs, facts, args, elapsed, results=()):
    direct = summary.get("direct", {})
    lines = [
        "Machine: %s CPUs, %s; Python %s; aiokafka %s; client on %s; %s; kthrottle at %s."
        % (facts["nproc"], facts["cpu_model"], facts["python"], facts["aiokafka"],
           facts["client_loop"], facts["tansu"], facts["kthrottle_commit"]),
        "",
        "Settings: %d round(s), %d x %d B records, acks=1, linger_ms=%d, batch %d B, "
        "%d partitions; latency at %d records/s for %g s with linger_ms=0. "
        "Medians over rounds; MB = 10^6 bytes; run took %.0f s."
        % (args.rounds, args.records, args.record_size, args.linger_ms, args.batch_size,
           args.partitions, args.rate, args.latency_seconds, elapsed),
        "",
        "| configuration | produce MB/s | produce rec/s | vs direct | consume MB/s "
        "| consume rec/s | vs direct | p50 ms | p99 ms | p99.9 ms | p99 added vs direct (ms) "
        "| proxy CPU ms/MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in configs:
        row = summary[config]
        cpu = "-" if config == "direct" else fmt(row["proxy_cpu_ms_per_mb"], ".1f")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            config if row["rounds_measured"] == args.rounds
            else "%s (%d/%d rounds ok)" % (config, row["rounds_measured"], args.rounds),
            fmt(row["produce_mb_s"], ".1f"), fmt(row["produce_rec_s"], ",.0f"),
            ratio(row["produce_mb_s"], direct.get("produce_mb_s")),
            fmt(row["consume_mb_s"], ".1f"), fmt(row["consume_rec_s"], ",.0f"),
            ratio(row["consume_mb_s"], direct.get("consume_mb_s")),
            fmt(row["latency_p50_ms"], ".2f"), fmt(row["latency_p99_ms"], ".2f"),
            fmt(row["latency_p999_ms"], ".2f"),
            "-" if config == "direct" else delta(row["latency_p99_ms"],
                                                 direct.get("latency_p99_ms")),
            cpu,
        ))
    extra = paired_lines(results, configs)
    if extra:
        lines += [""] + extra
    return "\n".join(lines) + "\n"


def plot(summary, configs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(configs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))

    def bars(ax, metrics, labels, ylabel, title):
        width = 0.8 / len(metrics)
        for i, (metric, label) in enumerate(zip(metrics, labels)):
            offsets = [xi + (i - (len(metrics) - 1) / 2) * width for xi in x]
            heights = [summary[c][metric] or 0 for c in configs]
            drawn = ax.bar(offsets, heights, width, label=label)
            ax.bar_label(drawn, fmt="%.1f" if "mb_s" in metric else "%.2f", fontsize=7)
            for off, c in zip(offsets, configs):  # every round as a dot
                values = summary[c][metric + "_all"]
                ax.plot([off] * len(values), values, "k.", markersize=3)
        ax.set_xticks(list(x), configs)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)

    bars(left, ("produce_mb_s", "consume_mb_s"), ("produce", "consume"), "MB/s",
         "Throughput (median; dots = rounds)")
    bars(right, ("latency_p50_ms", "latency_p99_ms", "latency_p999_ms"),
         ("p50", "p99", "p99.9"), "ms", "Produce latency at fixed rate (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize_profile(raw_path, out_path, top=30):
    """Turn py-spy's collapsed stacks into a readable text file: the hottest functions
    by self time and by inclusive time, followed by the raw stacks."""
    self_counts, incl_counts, total = {}, {}, 0
    raw = Path(raw_path).read_text().splitlines()
    for line in raw:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + n
        for frame in set(frames):
            incl_counts[frame] = incl_counts.get(frame, 0) + n
    out = ["py-spy samples of the kthrottle proxy during the kthrottle produce phase "
           "(round 1): %d samples" % total, ""]
    for title, counts in (("self time", self_counts), ("inclusive time", incl_counts)):
        out.append("Top %d by %s:" % (top, title))
        for frame, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
            out.append("  %5.1f%%  %s" % (100.0 * n / max(total, 1), frame))
        out.append("")
    out.append("Raw collapsed stacks (py-spy --format raw; flamegraph.pl input):")
    out.extend(raw)
    Path(out_path).write_text("\n".join(out) + "\n")


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Measure the cost of a Kafka proxy: aiokafka against a local Tansu "
        "broker directly, through kthrottle and through `tansu proxy`. Prints a table of "
        "medians over rounds and writes proxy_overhead.json/.md/.png into --output-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3,
                   help="how many times every configuration is measured; each round runs "
                   "all configurations once, in rotated order")
    p.add_argument("--records", type=int, default=100_000,
                   help="records produced and then consumed in the throughput phases")
    p.add_argument("--record-size", type=int, default=1024, help="record value size in bytes")
    p.add_argument("--rate", type=int, default=2000,
                   help="records per second sent in the latency phase")
    p.add_argument("--latency-seconds", type=float, default=10.0,
                   help="duration of the fixed-rate latency phase")
    p.add_argument("--partitions", type=int, default=3, help="partitions per topic")
    p.add_argument("--linger-ms", type=int, default=5,
                   help="producer linger_ms in the throughput phase (latency uses 0)")
    p.add_argument("--batch-size", type=int, default=64 * 1024,
                   help="producer max_batch_size in bytes")
    p.add_argument("--max-in-flight", type=int, default=10_000,
                   help="most unacknowledged send() futures in the produce throughput phase")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--phase-timeout", type=float, default=120.0,
                   help="seconds after which a phase is abandoned and recorded as failed "
                   "(the latency phase gets --latency-seconds on top)")
    p.add_argument("--profile", action="store_true",
                   help="run py-spy on the kthrottle proxy during its first-round produce "
                   "phase and write kthrottle_profile.txt (that round's numbers are then "
                   "perturbed by the sampler)")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT,
                   help="where the JSON, Markdown, PNG (and profile) are written")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown or not args.configs:
        p.error("--configs: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(CONFIGS)))
    if min(args.rounds, args.records, args.rate, args.partitions, args.record_size) < 1:
        p.error("--rounds, --records, --rate, --partitions and --record-size must be >= 1")
    return args


def new_runner():
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _sigterm_to_interrupt(signum, frame):
    """Treat SIGTERM like Ctrl-C: while an asyncio.Runner runs, its SIGINT handler cancels
    the running phase cleanly; otherwise this raises KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def main(argv=None):
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)  # same cleanup path as Ctrl-C

    facts = machine_facts()
    log_dir = Path(tempfile.mkdtemp(prefix="proxy_overhead-"))
    procs = Processes(log_dir)
    broker = TansuBroker(log_path=str(log_dir / "tansu-broker.log"))
    profile_raw = log_dir / "kthrottle_profile.raw" if args.profile else None
    results = []
    started = time.monotonic()
    interrupted = False
    try:
        broker.start()
        print("Tansu broker pid %d on %s; logs in %s"
              % (broker.proc.pid, broker.bootstrap, log_dir), flush=True)
        with new_runner() as runner:
            for rnd in range(args.rounds):
                shift = rnd % len(args.configs)
                order = args.configs[shift:] + args.configs[:shift]
                for position, config in enumerate(order):
                    results.append(run_cell(runner, config, rnd, position, broker, procs,
                                            args, profile_raw if rnd == 0 else None))
                    if broker.proc.poll() is not None:
                        raise RuntimeError("the Tansu broker exited (code %s)"
                                           % broker.proc.returncode)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted; stopping processes and writing what was measured",
              file=sys.stderr)
    finally:
        procs.stop_all()
        broker.stop()
    elapsed = time.monotonic() - started

    if not results:
        return 1
    summary = summarize(results, args.configs)
    report = markdown_report(summary, args.configs, facts, args, elapsed, results)
    print()
    print(report)

    out = args.output_dir
    (out / "proxy_overhead.md").write_text(report)
    (out / "proxy_overhead.json").write_text(json.dumps({
        "machine": facts,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - elapsed)),
        "duration_seconds": round(elapsed, 1),
        "interrupted": interrupted,
        "summary": summary,
        "results": [asdict(r) for r in results],
    }, indent=2) + "\n")
    plot(summary, args.configs, out / "proxy_overhead.png")
    written = ["proxy_overhead.json", "proxy_overhead.md", "proxy_overhead.png"]
    if profile_raw is not None and profile_raw.exists():
        summarize_profile(profile_raw, out / "kthrottle_profile.txt")
        written.append("kthrottle_profile.txt")
    print("wrote %s in %s" % (", ".join(written), out))

    failed = interrupted or not all(r.ok for r in results)
    if failed:
        print("some measurements failed; process logs kept in %s" % log_dir, file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
