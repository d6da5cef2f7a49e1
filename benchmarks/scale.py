#!/usr/bin/env python3
"""How does kthrottle's cost grow with the size of what it fronts?

Scale curves (issue 48), each measured at a few sizes, one table and one plot per curve:

* ``connections`` - ``--connections`` idle client connections (100, 1,000, 10,000) to one
  fresh ``kthrottle proxy`` (a quota file that never binds, so every request takes the quota
  path), each opened with a raw socket that sent one ApiVersions request and read the answer,
  then left idle; with ``--idle-client-ids`` shared (one client-id for all: the cost of a
  connection) and distinct (each its own: a connection and a new client-id's quota buckets);
  plus ``--active-clients`` aiokafka producers (100)
  producing ``--active-rate`` records/s each meanwhile. Measured: the proxy's RSS per idle
  connection ((RSS with N idle - RSS with none) / N, medians of five readings), the idle
  proxy's CPU (CPU seconds per second over ``--idle-seconds`` with only the idle connections;
  also with none, for reference), how many broker connections the proxy holds for them, and
  the active producers' p99 produce latency (send to acknowledgement). The file-descriptor
  limit is raised for this process and what it starts (each client connection costs the proxy
  two: the client's and its broker connection); where the hard limit cannot hold a count, the
  most that fits is measured and the report says so. ``--connections-workers 2`` runs the
  proxy with ``--workers 2``, two processes with a limit each (10,000 fit where one process's
  20,000 descriptors hold 9,672), and sums RSS, CPU and descriptors over them.
* ``quotas`` - ``--entities`` quota entities (10, 1,000, 100,000; the mix of
  ``benchmarks/policy_cost.py``: users, users/clients, clients, defaults) in each of
  ``--quota-sources``: the quota file (``--quota-file``, TOML) and ZooKeeper (``--zookeeper``,
  Kafka's /config/users and /config/clients znodes, written with pipelined async creates).
  Measured: the cost of one quota decision in process (a Produce's ``ClientQuotas.debt`` and
  ``on_request`` on a QuotaManager holding that snapshot, thread CPU time, rounds interleaved
  over the entity counts), ``manager.update`` and (file) parsing the file in process; end to
  end: the time to load (the proxy process's start until its log says the quotas are in force)
  and the time to apply one change (one entity, ``clients/scale-probe``, edited in the file or
  in ZooKeeper, until the proxy's /metrics shows the new ``kthrottle_request_quota`` of a
  connection of that client-id that sends a Metadata request every 20 ms).
* ``partitions`` - ``benchmarks/scale_partitions.py`` (its own module, same interface), skipped
  with a message while that file is not there.
* ``workers`` - ``--workers-list`` (1, 2, auto): produce throughput through the proxy of
  ``--tput-producers`` aiokafka producers (each in its own process) with no quota, and one
  quota held across the workers: ``benchmarks/workers_accuracy.py``'s measurement (producers
  of client-id ``shared`` spread over every worker, delivered rate / ``--shared-quota``).

A curve is an object with ``add_arguments(parser)`` and ``measure(args, run)`` returning
``{"rows": [dict], "columns": [keys], "targets": [(text, met or None)], "plot": draw(ax) or
None, "notes": [lines]}``. Output, in ``--output-dir`` (default a new
``benchmarks/runs/scale-<date>-<time>/``): ``scale.json`` (raw figures), ``scale.md`` (a table
per curve with the command that produced it and a line per target) and ``scale-<curve>.png``.
Every server is on 127.0.0.1 and free ports, started through the run's processes and stopped
by its PID. ``--max-minutes`` bounds the whole run: a size not started by then is skipped (and
said so).

Example (the issue's sizes, about 15 minutes on the 2-core project VM)::

    python benchmarks/scale.py --curves connections,quotas,workers

A small run (about a minute)::

    python benchmarks/scale.py --connections 10 --entities 10,100 --quota-sources file \\
        --workers-list 1 --curves connections,quotas,workers
"""
import argparse
import asyncio
import json
import os
import random
import re
import resource
import socket
import statistics
import struct
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import psutil

from kthrottle.embedded import free_port, wait_for_port
from kthrottle_testkit import BENCHMARKS, load_benchmark
from kthrottle_testkit import harness
from kthrottle_testkit.harness import (
    NON_BINDING_QUOTAS,
    REPO,
    TANSU_NODE_ID,
    Endpoint,
    Run,
    SourceTree,
    admin_get,
    markdown_table,
    metadata_probe,
    percentile,
    tree_cpu_seconds,
    tree_rss,
)

CURVES = ("connections", "quotas", "partitions", "workers")
KIB = 1024
MB = 1_000_000
PROBE_CLIENT = "scale-probe"
# users/<default>/clients/<c>: the snapshots (policy_cost's mix) hold users/<default> and
# users/<default>/clients/<default>, which come before any clients/<c> (KIP-55's order)
PROBE_ENTITY = "users/<default>/clients/" + PROBE_CLIENT
PROBE_RATES = (1_000_000, 2_000_000)  # request_rate of the probe's entity: never binds
# where the decision loop's live clients resolve, with quotas that never bind
DEFAULT_CLIENTS = "users/<default>/clients/<default>"
LIVE_QUOTAS = {"producer_byte_rate": 1e10, "consumer_byte_rate": 1e10, "request_rate": 1e9}


# --------------------------------------------------------------------------- shared


def raise_nofile(needed):
    """Raise this process's RLIMIT_NOFILE (inherited by what it starts from now on): the
    soft limit to the hard one and, when that is below ``needed`` and we may (root), both to
    ``needed``. Returns the (soft, hard) in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, needed)
    if hard != resource.RLIM_INFINITY and want > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want, want
        except (ValueError, OSError):
            want = hard
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def out_of_time(args):
    return time.monotonic() > args.deadline


def proxy_tree():
    return SourceTree(REPO)


def spawn_proxy(run, broker, extra, name, log_level="WARNING", timeout=180.0, probe=True):
    """``python -m kthrottle proxy`` from this checkout in front of ``broker``, with an admin
    endpoint, started through the run's processes. Unlike the harness's start_kthrottle it
    waits up to ``timeout`` for the listener (a proxy loading 100,000 quota entities from
    ZooKeeper takes longer than 20 s) and tries once."""
    while True:
        listen, node_port, admin_port = free_port(), free_port(), free_port()
        if len({listen, node_port, admin_port}) == 3 and node_port - TANSU_NODE_ID >= 1024:
            break
    argv = [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", broker.bootstrap,
            "--listen", "127.0.0.1:%d" % listen,
            "--node-port-base", str(node_port - TANSU_NODE_ID), "--log-level", log_level,
            "--admin-listen", "127.0.0.1:%d" % admin_port, *extra]
    tree = proxy_tree()
    proc = run.procs.spawn(name, argv, env=tree.env, cwd=tree.src, proxy=True)
    started = time.time()
    try:
        wait_for_port("127.0.0.1", listen, timeout=timeout, proc=proc)
        if probe:
            metadata_probe("127.0.0.1", listen)  # opens node 111's listener
            wait_for_port("127.0.0.1", node_port, timeout=10, proc=proc)
        wait_for_port("127.0.0.1", admin_port, timeout=10, proc=proc)
    except Exception as exc:
        run.procs.stop(proc)
        said = harness.last_log_line(run.path(name + ".log"))
        raise RuntimeError("%s did not start: %s%s" % (name, exc, "; its log ends with: %s"
                                                        % said if said else "")) from None
    endpoint = Endpoint(name, "127.0.0.1:%d" % listen, proc, admin_port, node_port)
    endpoint.spawned_at = started
    endpoint.log = run.path(name + ".log")
    return endpoint


def settled_rss(pid, samples=5, seconds=1.0):
    """Median RSS of a process over ``seconds`` (one reading can catch a passing spike)."""
    values = []
    for _ in range(samples):
        values.append(tree_rss(pid))
        time.sleep(seconds / samples)
    values = [v for v in values if v is not None]
    if not values:
        raise RuntimeError("process %d is gone" % pid)
    return statistics.median(values)


def cpu_per_second(pid, seconds):
    """CPU seconds per second of a process tree over ``seconds``."""
    before, t0 = tree_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    after, t1 = tree_cpu_seconds(pid), time.monotonic()
    if before is None or after is None:
        raise RuntimeError("process %d exited while measured" % pid)
    return (after - before) / (t1 - t0)


def api_versions_frame(correlation_id, client_id):
    """ApiVersions v0 (request header v1): no body."""
    cid = client_id.encode()
    body = struct.pack(">hhih", 18, 0, correlation_id, len(cid)) + cid
    return struct.pack(">i", len(body)) + body


def metadata_frame(correlation_id, client_id):
    """Metadata v1 asking for no topic (request header v1)."""
    cid = client_id.encode()
    body = struct.pack(">hhih", 3, 1, correlation_id, len(cid)) + cid + struct.pack(">i", 0)
    return struct.pack(">i", len(body)) + body


def fmt_value(value):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return format(value, ",")
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return format(value, ",.0f")
        if abs(value) >= 100:
            return "%.0f" % value
        if abs(value) >= 10:
            return "%.1f" % value
        if abs(value) >= 0.1:
            return "%.2f" % value
        return "%.3g" % value
    return str(value)


def log_time(line):
    """The time (epoch seconds) of a kthrottle log line's asctime, or None."""
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1e3


def wait_log(path, pattern, timeout, proc=None, start=0):
    """(epoch time of the first line matching ``pattern`` after byte ``start``, match)."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            m = regex.search(line)
            if m:
                return log_time(line), m
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("the proxy exited (log %s)" % path)
        if time.monotonic() > deadline:
            raise TimeoutError("no line matching %r in %s within %.0f s" % (pattern, path, timeout))
        time.sleep(0.02)


# --------------------------------------------------------------------------- connections


async def _open_idle(port, count, concurrency, prefix, distinct=True):
    """``count`` raw sockets to the proxy, each after one ApiVersions exchange (client-id
    PREFIX-i with ``distinct``, else PREFIX). Returns (sockets, errors)."""
    loop = asyncio.get_running_loop()
    socks, errors = [], []
    gate = asyncio.Semaphore(concurrency)

    async def recv_exactly(sock, n):
        data = b""
        while len(data) < n:
            chunk = await loop.sock_recv(sock, n - len(data))
            if not chunk:
                raise ConnectionError("closed by the proxy")
            data += chunk
        return data

    async def one(i):
        async with gate:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, api_versions_frame(
                    1, "%s-%d" % (prefix, i) if distinct else prefix))
                size = struct.unpack(">i", await recv_exactly(sock, 4))[0]
                answer = await recv_exactly(sock, size)
                if struct.unpack(">i", answer[:4])[0] != 1:
                    raise ConnectionError("correlation id out of order")
                socks.append(sock)
            except OSError as exc:
                sock.close()
                errors.append("%s: %s" % (type(exc).__name__, exc))

    await asyncio.gather(*(one(i) for i in range(count)))
    return socks, errors


def open_idle(port, count, concurrency=200, prefix="idle", distinct=True):
    return asyncio.run(_open_idle(port, count, concurrency, prefix, distinct))


def _active_clients(bootstrap, topic, producers, rate, seconds, record_size, go, results):
    """A forked process: ``producers`` aiokafka producers, each sending ``rate`` records/s
    for ``seconds`` (linger 0, acks 1). Puts "ready", waits for go, puts
    {"latencies": sorted ms, "sent": n, "failed": n} or {"error": text}."""
    harness.worker_signals()

    async def main():
        from aiokafka import AIOKafkaProducer

        value = os.urandom(record_size)
        ps = []
        try:
            for i in range(producers):
                p = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="active-%d" % i,
                                     acks=1, linger_ms=0, request_timeout_ms=30000)
                await p.start()
                ps.append(p)
            await asyncio.gather(*(p.send_and_wait(topic, value) for p in ps))  # warm
            results.put("ready")
            await asyncio.get_running_loop().run_in_executor(None, go.get)
            loop = asyncio.get_running_loop()
            latencies, failed = [], [0]

            def done(sent_at, fut):
                if fut.cancelled() or fut.exception() is not None:
                    failed[0] += 1
                else:
                    latencies.append((time.perf_counter() - sent_at) * 1000.0)

            async def produce(k, p):
                t0 = loop.time() + k / (producers * rate)  # staggered
                futures = []
                for i in range(int(rate * seconds)):
                    delay = t0 + i / rate - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    sent_at = time.perf_counter()
                    fut = await p.send(topic, value)
                    fut.add_done_callback(lambda f, t=sent_at: done(t, f))
                    futures.append(fut)
                await asyncio.gather(*futures, return_exceptions=True)

            await asyncio.gather(*(produce(k, p) for k, p in enumerate(ps)))
            await asyncio.sleep(0)
            return {"latencies": sorted(latencies), "sent": producers * int(rate * seconds),
                    "failed": failed[0]}
        finally:
            for p in ps:
                try:
                    await asyncio.wait_for(p.stop(), 10)
                except Exception:
                    pass

    try:
        with harness.new_runner() as runner:
            results.put(runner.run(main()))
    except BaseException as exc:
        results.put({"error": "%s: %s" % (type(exc).__name__, exc)})


def tree_connections(proxy_pid):
    """The TCP connections of the proxy process and its workers (--workers), None if it is
    gone."""
    try:
        top = psutil.Process(proxy_pid)
        conns = []
        for proc in [top] + top.children(recursive=True):
            conns += proc.net_connections(kind="tcp")
    except psutil.Error:
        return None
    return conns


def broker_connections(proxy_pid, broker_port):
    """TCP connections the proxy process and its workers hold to the broker's port."""
    conns = tree_connections(proxy_pid)
    if conns is None:
        return None
    return sum(1 for c in conns if c.raddr and c.raddr[1] == broker_port)


def client_connections(proxy_pid, ports):
    """Client connections the proxy process and its workers have open on ``ports``."""
    conns = tree_connections(proxy_pid)
    if conns is None:
        return None
    return sum(1 for c in conns if c.raddr and c.laddr and c.laddr[1] in ports
               and c.status == psutil.CONN_ESTABLISHED)


def tree_fds(pid):
    """Open descriptors of a process and its descendants."""
    top = psutil.Process(pid)
    return sum(p.num_fds() for p in [top] + top.children(recursive=True))


def connections_fit(soft_limit, active_clients, workers):
    """How many idle client connections the proxy can hold within ``soft_limit`` open files
    per process: two descriptors each (the client's and its broker connection), the active
    producers' two connections each, 256 of the proxy's own; with several workers, each its
    own process and limit, less a twentieth for the kernel's uneven spread (SO_REUSEPORT
    hashes each connection to a worker)."""
    per_worker = (soft_limit - 4 * active_clients // workers - 256) // 2
    if workers == 1:
        return per_worker
    return workers * per_worker * 19 // 20


class Connections:
    name = "connections"
    title = "Connections: idle client connections to one proxy, with 100 active clients"

    @staticmethod
    def add_arguments(p):
        g = p.add_argument_group("connections curve")
        g.add_argument("--connections", type=harness.int_list, default="100,1000,10000",
                       help="idle connection counts")
        g.add_argument("--active-clients", type=int, default=100,
                       help="aiokafka producers active meanwhile")
        g.add_argument("--active-rate", type=float, default=5.0,
                       help="records/s of each active producer")
        g.add_argument("--active-seconds", type=float, default=10.0,
                       help="how long the active producers produce")
        g.add_argument("--idle-seconds", type=float, default=10.0,
                       help="CPU window of the idle proxy")
        g.add_argument("--record-size", type=int, default=1024)
        g.add_argument("--connections-workers", type=int, default=1,
                       help="the proxy's --workers in this curve. Each worker is a process of "
                       "its own with its own open-files limit: where one process's hard limit "
                       "cannot hold the largest count (two descriptors per client connection), "
                       "2 workers hold twice as many. RSS, CPU, descriptors and connections "
                       "are then the supervisor's and its workers' together")
        g.add_argument("--idle-client-ids", type=harness.names, default="shared,distinct",
                       help="shared: every idle connection sends one client-id (the cost of a "
                       "connection); distinct: each its own (a connection and a new client-id, "
                       "whose quota buckets the <default> client entity makes); a row per "
                       "count for each")

    @staticmethod
    def measure(args, run):
        broker = scale_broker(run)
        quota_file = run.path("non-binding-quotas.toml")
        quota_file.write_text(NON_BINDING_QUOTAS)
        topic = "scale-active-%s" % uuid.uuid4().hex[:8]
        broker.create_topic(topic)
        rows, notes = [], []
        for n, ids in [(n, ids) for n in args.connections for ids in args.idle_client_ids]:
            if out_of_time(args):
                notes.append("%s idle connections, %s client-ids: skipped (--max-minutes "
                             "reached)" % (format(n, ","), ids))
                continue
            # the proxy holds two descriptors per client connection (its broker
            # connection), the active producers' included (two connections each)
            fit = connections_fit(resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                                  args.active_clients, args.connections_workers)
            measured = min(n, fit)
            if measured < n and not any(r["asked"] == n for r in rows):
                notes.append(
                    "%s idle connections asked, %s measured: the proxy holds two descriptors "
                    "per client connection (the client's and its broker connection), and this "
                    "machine's hard RLIMIT_NOFILE is %d, which this process cannot raise (no "
                    "CAP_SYS_RESOURCE); %s more would be the active producers' and the "
                    "proxy's own%s." % (format(n, ","), format(measured, ","),
                                        resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                                        format(4 * args.active_clients + 256, ","),
                                        "" if args.connections_workers > 1 else
                                        " (--connections-workers 2: two processes, each "
                                        "with that limit)"))
            print("connections: %s idle, %s client-ids" % (format(measured, ","), ids),
                  flush=True)
            row = {"asked": n, "client-ids": ids, "workers": args.connections_workers}
            row.update(Connections.level(run, broker, quota_file, topic, measured, args,
                                         ids == "distinct"))
            rows.append(row)
            print("  %s" % json.dumps(rows[-1]), flush=True)
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)
        notes.append("RLIMIT_NOFILE of this benchmark and the processes it starts: %d (soft) / "
                     "%d (hard); kthrottle raises its soft limit to the hard one at start." % limit)
        if rows:
            held = [r for r in rows if r["broker connections held"] is not None]
            if held:
                r = held[-1]
                notes.append(
                    "Broker connections: with %s idle client connections that sent only "
                    "ApiVersions the proxy held %s connections to the broker: every accepted "
                    "client connection opens its broker connection at once "
                    "(pipeline.Connection.client_accepted returns ConnectUpstream), whatever "
                    "it then sends." % (format(r["idle connections"], ","),
                                        format(r["broker connections held"], ",")))
        shared = [r for r in rows if r["client-ids"] == "shared"]
        big = max(shared, key=lambda r: r["idle connections"]) if shared else None
        targets = []
        if big is not None:
            kib = big["RSS per idle connection (KiB)"]
            targets.append(("an idle connection costs at most 12 KiB of RSS at 10,000 "
                            "connections (one client-id shared by the idle connections): "
                            "%.1f KiB at %s" % (kib, format(big["idle connections"], ",")),
                            kib <= 12.0 if big["asked"] >= 10000
                            and big["idle connections"] >= 9000 else None))
        if args.connections_workers > 1:
            notes.append("The proxy ran with --workers %d: each worker is a process of its own, "
                         "with its own open-files limit; RSS, CPU, descriptors and connections "
                         "are the supervisor's and its workers' together."
                         % args.connections_workers)

        def plot(ax):
            right = ax.twinx()
            for k, ids in enumerate(args.idle_client_ids):
                rs = [r for r in rows if r["client-ids"] == ids]
                if not rs:
                    continue
                xs = [r["idle connections"] for r in rs]
                ax.plot(xs, [r["RSS per idle connection (KiB)"] for r in rs], "o-",
                        color="C%d" % k, label="RSS per idle connection, %s client-ids (KiB)"
                        % ids)
                right.plot(xs, [r["active p99 (ms)"] for r in rs], "s--", color="C%d" % (k + 2),
                           label="active producers' p99, %s (ms)" % ids)
                right.plot(xs, [r["idle proxy CPU (ms/s)"] for r in rs], "^:",
                           color="C%d" % (k + 4), label="idle proxy CPU, %s (ms/s)" % ids)
            ax.axhline(12, color="grey", linestyle=":", label="target 12 KiB")
            ax.set_xscale("log")
            ax.set_ylim(0, None)
            ax.set_xlabel("idle client connections")
            ax.set_ylabel("KiB per idle connection")
            right.set_ylabel("ms (p99) / ms of CPU per s")
            right.set_ylim(0, None)
            lines = ax.get_legend_handles_labels()
            more = right.get_legend_handles_labels()
            ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=6, loc="upper left")
        return {"rows": rows, "targets": targets, "plot": plot if rows else None, "notes": notes,
                "columns": ["asked", "idle connections", "client-ids", "workers", "open after",
                            "RSS none (MiB)", "RSS idle (MiB)", "RSS per idle connection (KiB)",
                            "broker connections held", "proxy fds",
                            "broker RSS per connection (KiB)", "idle proxy CPU, none (ms/s)",
                            "idle proxy CPU (ms/s)", "open seconds", "active p50 (ms)",
                            "active p99 (ms)", "active records", "active failed"]}

    @staticmethod
    def level(run, broker, quota_file, topic, n, args, distinct):
        workers_arg = (["--workers", str(args.connections_workers)]
                       if args.connections_workers > 1 else [])
        proxy = spawn_proxy(run, broker, ["--quota-file", str(quota_file), *workers_arg],
                            "kthrottle-connections-%d" % n)
        pid = proxy.proc.pid
        socks = []
        workers = None
        try:
            time.sleep(1.0)
            rss_none = settled_rss(pid)
            broker_rss_none = settled_rss(broker.proc.pid)
            cpu_none = cpu_per_second(pid, args.idle_seconds)
            t0 = time.monotonic()
            socks, errors = open_idle(proxy.port, n, distinct=distinct)
            open_seconds = time.monotonic() - t0
            if errors:
                print("  %d connections failed, first: %s" % (len(errors), errors[0]), flush=True)
            time.sleep(1.0)
            rss_idle = settled_rss(pid)
            broker_rss_idle = settled_rss(broker.proc.pid)
            fds = tree_fds(pid)
            held = broker_connections(pid, broker.port)
            cpu_idle = cpu_per_second(pid, args.idle_seconds)
            # the active producers, in a process of their own
            workers = harness.Workers()
            workers.add(_active_clients, proxy.bootstrap, topic, args.active_clients,
                        args.active_rate, args.active_seconds, args.record_size)
            workers.wait_ready(timeout=120)
            workers.start()
            result = workers.collect(timeout=args.active_seconds + 120)[0]
            if "error" in result:
                raise RuntimeError("the active producers failed: %s" % result["error"])
            # the client connections open at the end, every worker's: idle + the producers'
            # (2 each)
            open_after = client_connections(pid, {proxy.port, proxy.node_port})
            lat = result["latencies"]
            opened = len(socks)
            return {
                "idle connections": n, "opened": opened,
                # connections the proxy has open at the end: idle + the producers' (2 each)
                "open after": None if open_after is None else int(open_after),
                "RSS none (MiB)": rss_none / harness.MIB, "RSS idle (MiB)": rss_idle / harness.MIB,
                "RSS per idle connection (KiB)": (rss_idle - rss_none) / max(opened, 1) / KIB,
                "broker connections held": held, "proxy fds": fds,
                "broker RSS per connection (KiB)":
                    (broker_rss_idle - broker_rss_none) / max(opened, 1) / KIB,
                "idle proxy CPU, none (ms/s)": cpu_none * 1000,
                "idle proxy CPU (ms/s)": cpu_idle * 1000,
                "open seconds": open_seconds,
                "active p50 (ms)": percentile(lat, 50), "active p99 (ms)": percentile(lat, 99),
                "active records": len(lat), "active failed": result["failed"],
                "open errors": len(errors),
            }
        finally:
            if workers is not None:
                workers.stop()
            for s in socks:
                s.close()
            run.procs.stop(proxy.proc)


_BROKER = {}


def scale_broker(run):
    """The run's Tansu broker, started on first use."""
    broker = _BROKER.get(id(run))
    if broker is None:
        broker = _BROKER[id(run)] = run.broker()
    return broker


# --------------------------------------------------------------------------- quotas


def quota_snapshot(n, seed):
    """``n`` entities in policy_cost's mix, one of them the probe's clients/scale-probe
    (request_rate PROBE_RATES[0])."""
    pc = load_benchmark("policy_cost")
    snapshot, users, clients = pc.build_snapshot(max(n - 1, 3), random.Random(seed + n))
    snapshot[PROBE_ENTITY] = {"request_rate": float(PROBE_RATES[0])}
    # the live clients of the decision loop resolve here (names configured nowhere), at
    # every entity count alike: one bucket each per quota key, never binding
    snapshot[DEFAULT_CLIENTS] = dict(LIVE_QUOTAS)
    return snapshot, users, clients


def quota_file_text(snapshot, probe_rate):
    """The quota file of ``snapshot`` with the probe's table last (the one line a change
    edits)."""
    from kthrottle.policy.quota_file import document_text

    rest = {k: v for k, v in snapshot.items() if k != PROBE_ENTITY}
    return document_text(rest) + ('\n[users."<default>".clients."%s"]\nrequest_rate = %d\n'
                                  % (PROBE_CLIENT, probe_rate))


def write_atomically(path, text):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def decision_costs(counts, args):
    """Per entity count: CPU ns of one Produce decision (ClientQuotas.debt + on_request, the
    proxy's calls) on ``--live`` live clients, median of ``--decision-rounds`` interleaved
    rounds; ms of manager.update(snapshot); ms to parse the quota file."""
    import tomllib

    from kthrottle.policy.quota_file import snapshot_from_document
    from kthrottle.policy.quotas import QuotaManager

    pc = load_benchmark("policy_cost")
    produce, nbytes = 0, pc.PRODUCE_BYTES
    cells = {}
    for n in counts:
        snapshot, users, clients = quota_snapshot(n, args.seed)
        manager = QuotaManager(snapshot)
        rng = random.Random(args.seed + n + 1)
        # names beyond the snapshot's pools: every live client resolves to DEFAULT_CLIENTS
        pairs = pc.live_pairs(args.live, users, clients, rng, offset=10_000_000)
        live = [manager.client(u, c) for u, c in pairs]
        assert all(q.produce.entity == DEFAULT_CLIENTS for q in live)
        cells[n] = {"snapshot": snapshot, "manager": manager, "live": live, "ns": [],
                    "update_ms": [], "parse_ms": [], "text": quota_file_text(snapshot,
                                                                              PROBE_RATES[0])}
    clock = pc.Clock()
    calls = args.decision_calls

    def loop(live):
        n_live = len(live)
        tick = clock.tick
        for i in range(calls):
            q = live[i % n_live]
            now = tick()
            q.debt(produce, 1, now)
            q.on_request(produce, nbytes, 1, now)

    for rnd in range(args.decision_rounds):
        for n, cell in cells.items():
            loop(cell["live"])  # warm
            with harness.gc_paused():
                t = time.thread_time_ns()
                loop(cell["live"])
                cell["ns"].append((time.thread_time_ns() - t) / calls)
            if rnd < 3:
                changed = dict(cell["snapshot"])
                changed[PROBE_ENTITY] = {"request_rate": float(PROBE_RATES[rnd % 2])}
                t = time.thread_time_ns()
                cell["manager"].update(changed)
                cell["update_ms"].append((time.thread_time_ns() - t) / 1e6)
            if rnd < 2:
                t = time.thread_time_ns()
                snapshot_from_document(tomllib.loads(cell["text"]))
                cell["parse_ms"].append((time.thread_time_ns() - t) / 1e6)
    return {n: {"decision_ns": statistics.median(c["ns"]), "decision_ns_all": c["ns"],
                "update_ms": statistics.median(c["update_ms"]),
                "parse_ms": statistics.median(c["parse_ms"]),
                "file_bytes": len(c["text"].encode())} for n, c in cells.items()}


class Probe:
    """One connection of client-id scale-probe sending Metadata (no topic) every
    ``interval`` s from a thread, so that its quotas re-resolve right after a change."""

    def __init__(self, port, interval=0.02):
        self.port = port
        self.interval = interval
        self.stop_event = threading.Event()
        self.error = None
        self.longest = 0.0  # the longest round trip (s) since reset()
        self.thread = threading.Thread(target=self._run, name="scale-probe", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join(10)
        return False

    def _run(self):
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                cid = 0
                while not self.stop_event.is_set():
                    cid += 1
                    t = time.perf_counter()
                    sock.sendall(metadata_frame(cid, PROBE_CLIENT))
                    size = struct.unpack(">i", harness._recv_exact(sock, 4))[0]
                    harness._recv_exact(sock, size)
                    self.longest = max(self.longest, time.perf_counter() - t)
                    self.stop_event.wait(self.interval)
        except Exception as exc:
            self.error = "%s: %s" % (type(exc).__name__, exc)


def probe_quota(endpoint):
    """The probe's request_rate quota on /metrics, or None."""
    try:
        text = admin_get(endpoint.admin_port, timeout=10)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("kthrottle_request_quota{") and 'client_id="%s"' % PROBE_CLIENT in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_probe_quota(endpoint, value, timeout, probe):
    """Seconds (time.time()) when /metrics first shows the probe's quota at ``value``."""
    deadline = time.monotonic() + timeout
    while True:
        if probe_quota(endpoint) == value:
            return time.time()
        if probe.error:
            raise RuntimeError("the probe connection failed: %s" % probe.error)
        if endpoint.proc.poll() is not None:
            raise RuntimeError("the proxy exited")
        if time.monotonic() > deadline:
            raise TimeoutError("the probe's quota did not become %g within %.0f s"
                               % (value, timeout))
        time.sleep(0.02)


def zk_write(hosts, chroot, snapshot, batch=2000):
    """Every entity of ``snapshot`` as Kafka keeps it (/config/users/<u>[/clients/<c>],
    /config/clients/<c>) under ``chroot``, with pipelined async creates. Returns seconds."""
    from kazoo.client import KazooClient

    from kthrottle.policy.quota_file import format_value

    def data(config):
        return json.dumps({"version": 1, "config": {k: format_value(v, k)
                                                    for k, v in config.items()}}).encode()

    root = KazooClient(hosts=hosts, timeout=30)
    root.start(timeout=30)
    try:
        root.ensure_path(chroot)
    finally:
        root.stop()
        root.close()
    zk = KazooClient(hosts=hosts + chroot, timeout=30)
    zk.start(timeout=30)
    t0 = time.monotonic()
    try:
        for path in ("/config/users", "/config/clients", "/config/changes"):
            zk.ensure_path(path)
        empty = data({})
        users, user_clients, leaves = {}, set(), []
        for path, config in snapshot.items():
            parts = path.split("/")
            if parts[0] == "users":
                users.setdefault(parts[1], empty)
                if len(parts) == 2:
                    users[parts[1]] = data(config)
                else:
                    user_clients.add(parts[1])
                    leaves.append(("/config/" + path, data(config)))
            elif parts[0] == "clients":
                leaves.append(("/config/" + path, data(config)))
        levels = [[("/config/users/" + u, d) for u, d in users.items()],
                  [("/config/users/%s/clients" % u, b"") for u in user_clients], leaves]
        for level in levels:
            for i in range(0, len(level), batch):
                pending = [zk.create_async(path, value) for path, value in level[i:i + batch]]
                for result in pending:
                    result.get(timeout=60)
        return time.monotonic() - t0
    finally:
        zk.stop()
        zk.close()


def zk_alter(hosts, path, rate):
    """As kafka-configs --zookeeper --alter: the entity znode, then a change notification
    (kthrottle's own ZooKeeperQuotaStore does exactly that)."""
    from kthrottle.sources.zookeeper import ZooKeeperQuotaStore

    store = ZooKeeperQuotaStore(hosts).connect()
    try:
        t = time.time()
        store.alter(path, {"request_rate": rate})
        return t
    finally:
        store.close()


_ZK = {}


def scale_zookeeper(run):
    """One ZooKeeper for the run (Debian's), with a heap for 150,000 znodes."""
    zk = _ZK.get(id(run))
    if zk is None:
        from kthrottle_testkit.zookeeper import ZooKeeperServer, available

        if not available():
            raise RuntimeError("ZooKeeper is not installed (scripts/test installs Debian's "
                               "zookeeper package)")
        server = ZooKeeperServer(run.path("zookeeper"), heap="1g")
        run.procs.on_stop(server.stop)
        zk = _ZK[id(run)] = server.start()
    return zk


class Quotas:
    name = "quotas"
    title = "Quota entities: decisions, loading and applying one change"

    @staticmethod
    def add_arguments(p):
        g = p.add_argument_group("quotas curve")
        g.add_argument("--entities", type=harness.int_list, default="10,1000,100000",
                       help="quota entity counts")
        g.add_argument("--quota-sources", type=harness.names, default="file,zookeeper",
                       help="file and/or zookeeper")
        g.add_argument("--changes", type=int, default=3,
                       help="changes applied (and timed) per cell; the median is shown")
        g.add_argument("--live", type=int, default=100,
                       help="live (user, client-id) pairs deciding in process")
        g.add_argument("--decision-calls", type=int, default=20000,
                       help="decisions per timed loop")
        g.add_argument("--decision-rounds", type=int, default=7,
                       help="timed loops per entity count, interleaved")
        g.add_argument("--seed", type=int, default=48)

    @staticmethod
    def measure(args, run):
        counts = sorted(set(args.entities))
        print("quotas: decisions in process at %s entities" % counts, flush=True)
        costs = decision_costs(counts, args)
        rows, notes = [], []
        for source in args.quota_sources:
            for n in counts:
                row = {"source": source, "entities": n,
                       "decision CPU (ns)": costs[n]["decision_ns"],
                       "decision vs smallest": costs[n]["decision_ns"]
                       / costs[counts[0]]["decision_ns"],
                       "update in process (ms)": costs[n]["update_ms"],
                       "parse file in process (ms)": costs[n]["parse_ms"]
                       if source == "file" else None}
                if out_of_time(args):
                    notes.append("%s, %s entities: end to end skipped (--max-minutes reached)"
                                 % (source, format(n, ",")))
                    rows.append(row)
                    continue
                print("quotas: %s, %s entities" % (source, format(n, ",")), flush=True)
                try:
                    row.update(Quotas.end_to_end(run, source, n, args))
                except Exception as exc:
                    notes.append("%s, %s entities: end to end failed: %s: %s"
                                 % (source, format(n, ","), type(exc).__name__, exc))
                    print("  failed: %s" % notes[-1], flush=True)
                rows.append(row)
                print("  %s" % json.dumps(row), flush=True)
        lo, hi = counts[0], counts[-1]
        ratio = costs[hi]["decision_ns"] / costs[lo]["decision_ns"]
        spread_lo = costs[lo]["decision_ns_all"]
        targets = [("a quota decision costs the same (within 10%%) with %s entities as with %s: "
                    "%.0f ns vs %.0f ns, %.2fx" % (format(hi, ","), format(lo, ","),
                                                  costs[hi]["decision_ns"],
                                                  costs[lo]["decision_ns"], ratio),
                    ratio <= 1.10 if hi >= 100000 and lo <= 10 else None)]
        notes.append("Decision: CPU time (thread clock) of a Produce's ClientQuotas.debt + "
                     "on_request, as the proxy calls them, on %d live (user, client-id) pairs "
                     "named by no entity (each resolves to users/<default>/clients/<default>, "
                     "three quota keys that never bind, at every entity count alike), "
                     "%s calls per loop, median of %d loops interleaved over the entity counts "
                     "(loops at %s entities: %s ns)."
                     % (args.live, format(args.decision_calls, ","), args.decision_rounds,
                        format(lo, ","), ", ".join("%.0f" % v for v in sorted(spread_lo))))
        notes.append("Load: the proxy process's start until its log says the quotas are in "
                     "force (interpreter start and imports included: see the smallest count). "
                     "Apply: the edit written (file: the whole file rewritten by a rename, as "
                     "a config tool does; ZooKeeper: the znode and its change notification) "
                     "until /metrics shows the new quota of a client of that entity; median of "
                     "%d changes. The file is polled every 0.25 s and a new version is applied "
                     "once two polls read the same content. Probe: the probe connection's "
                     "longest Metadata round trip over 2 s without a change and over the "
                     "changes (how long the proxy's event loop was held up)." % args.changes)

        def plot(ax):
            for source, style in (("file", "o-"), ("zookeeper", "s-")):
                rs = [r for r in rows if r["source"] == source and r.get("load (s)") is not None]
                if rs:
                    ax.plot([r["entities"] for r in rs], [r["load (s)"] for r in rs], style,
                            label="%s: load (s)" % source)
                rs = [r for r in rows if r["source"] == source and r.get("apply (s)") is not None]
                if rs:
                    ax.plot([r["entities"] for r in rs], [r["apply (s)"] for r in rs],
                            style.replace("-", "--"), label="%s: apply one change (s)" % source)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("quota entities")
            ax.set_ylabel("seconds")
            right = ax.twinx()
            right.plot(counts, [costs[n]["decision_ns"] for n in counts], "^:", color="k",
                       label="decision CPU (ns)")
            right.set_ylabel("ns per decision")
            right.set_ylim(0, max(costs[n]["decision_ns"] for n in counts) * 1.5)
            a, b = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
            ax.legend(a[0] + b[0], a[1] + b[1], fontsize=7, loc="upper left")
        return {"rows": rows, "targets": targets, "plot": plot, "notes": notes,
                "columns": ["source", "entities", "decision CPU (ns)", "decision vs smallest",
                            "update in process (ms)", "parse file in process (ms)",
                            "write to ZooKeeper (s)", "load (s)", "apply (s)",
                            "apply min-max (s)", "probe longest round trip, no change (ms)",
                            "probe longest round trip, changes (ms)", "proxy RSS (MiB)"],
                "decisions": {str(n): c for n, c in costs.items()}}

    @staticmethod
    def end_to_end(run, source, n, args):
        broker = scale_broker(run)
        snapshot, _, _ = quota_snapshot(n, args.seed)
        out = {}
        name = "kthrottle-quotas-%s-%d" % (source, n)
        if source == "file":
            path = run.path("quotas-%d.toml" % n)
            write_atomically(path, quota_file_text(snapshot, PROBE_RATES[0]))
            extra = ["--quota-file", str(path)]

            def change(rate):
                t = time.time()
                write_atomically(path, quota_file_text(snapshot, rate))
                return t
        elif source == "zookeeper":
            zk = scale_zookeeper(run)
            chroot = "/scale-%d-%s" % (n, uuid.uuid4().hex[:6])
            out["write to ZooKeeper (s)"] = zk_write(zk.hosts, chroot, snapshot)
            hosts = zk.hosts + chroot
            extra = ["--zookeeper", hosts]

            def change(rate):
                return zk_alter(hosts, PROBE_ENTITY, rate)
        else:
            raise ValueError("unknown quota source %r (file, zookeeper)" % source)
        proxy = spawn_proxy(run, broker, extra, name, log_level="INFO", timeout=600)
        try:
            created = psutil.Process(proxy.proc.pid).create_time()
            at, m = wait_log(proxy.log, r"quotas from .*: (\d+) entities", 60, proxy.proc)
            out["load (s)"] = at - created
            out["loaded entities"] = int(m.group(1))
            applied = []
            with Probe(proxy.port) as probe:
                wait_probe_quota(proxy, float(PROBE_RATES[0]), 60, probe)
                time.sleep(0.5)
                probe.longest = 0.0
                time.sleep(2.0)
                out["probe longest round trip, no change (ms)"] = probe.longest * 1000
                probe.longest = 0.0
                for k in range(args.changes):
                    rate = PROBE_RATES[(k + 1) % 2]
                    t = change(rate)
                    applied.append(wait_probe_quota(proxy, float(rate), 120, probe) - t)
            out["probe longest round trip, changes (ms)"] = probe.longest * 1000
            out["apply (s)"] = statistics.median(applied)
            out["apply min-max (s)"] = "%.2f-%.2f" % (min(applied), max(applied))
            out["apply all (s)"] = applied
            out["proxy RSS (MiB)"] = tree_rss(proxy.proc.pid) / harness.MIB
        finally:
            run.procs.stop(proxy.proc)
        return out


# --------------------------------------------------------------------------- workers


def _tput_producer(bootstrap, topic, records, record_size, index, go, results):
    """A forked process: one aiokafka producer (client-id tput-INDEX, no quota) sending
    ``records`` records as fast as it can. Puts "ready", waits for go, puts
    (start, end) epoch times."""
    harness.worker_signals()

    async def main():
        from aiokafka import AIOKafkaProducer

        value = os.urandom(record_size)
        p = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="tput-%d" % index, acks=1,
                             linger_ms=5, max_batch_size=65536, request_timeout_ms=30000)
        await p.start()
        try:
            await p.send_and_wait(topic, value)
            results.put("ready")
            await asyncio.get_running_loop().run_in_executor(None, go.get)
            pending = []
            t0 = time.time()
            for _ in range(records):
                pending.append(await p.send(topic, value))
                if len(pending) >= 2000:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
            return (t0, time.time())
        finally:
            await p.stop()

    try:
        with harness.new_runner() as runner:
            results.put(runner.run(main()))
    except BaseException as exc:
        results.put({"error": "%s: %s" % (type(exc).__name__, exc)})


def worker_count(spec):
    return len(os.sched_getaffinity(0)) if spec == "auto" else int(spec)


class Workers:
    name = "workers"
    title = "Workers: throughput and one quota held across them"

    @staticmethod
    def add_arguments(p):
        g = p.add_argument_group("workers curve")
        g.add_argument("--workers-list", type=harness.names, default="1,2,auto",
                       help="--workers values")
        g.add_argument("--tput-producers", type=int, default=4,
                       help="producers measuring throughput (a process each, no quota)")
        g.add_argument("--tput-records", type=int, default=20000,
                       help="records per throughput producer")
        g.add_argument("--tput-record-size", type=int, default=1024)
        g.add_argument("--shared-quota", type=int, default=1_000_000,
                       help="producer_byte_rate of client-id shared, B/s")
        g.add_argument("--shared-producers", type=int, default=4,
                       help="producers of client-id shared (spread over every worker)")
        g.add_argument("--shared-seconds", type=float, default=20.0)
        g.add_argument("--shared-steady-from", type=float, default=5.0)

    @staticmethod
    def measure(args, run):
        wa = load_benchmark("workers_accuracy")
        broker = scale_broker(run)
        rows, notes = [], []
        for spec in args.workers_list:
            if out_of_time(args):
                notes.append("--workers %s: skipped (--max-minutes reached)" % spec)
                continue
            print("workers: --workers %s" % spec, flush=True)
            rows.append(Workers.cell(run, broker, wa, spec, args))
            print("  %s" % json.dumps(rows[-1]), flush=True)
        notes.append("auto is %d worker(s) on this machine (the CPUs this process may use)."
                     % worker_count("auto"))
        notes.append("Throughput: %d aiokafka producers, a process each, %s records of %d B, "
                     "linger 5 ms, no quota; MB = 10^6 record bytes. Quota: "
                     "benchmarks/workers_accuracy.py's measurement: %d producers of client-id "
                     "shared (opened until every worker carries one), record bytes delivered "
                     "from %g s to %g s over its producer_byte_rate of %s B/s (the proxy counts "
                     "whole frames, a few %% more than the record bytes; N workers each holding "
                     "it alone would give about N)."
                     % (args.tput_producers, format(args.tput_records, ","),
                        args.tput_record_size, args.shared_producers, args.shared_steady_from,
                        args.shared_seconds, format(args.shared_quota, ",")))
        targets = []
        multi = [r for r in rows if r["workers"] > 1]
        if multi:
            worst = max(multi, key=lambda r: abs(r["delivered / quota"] - 1))
            targets.append(("one quota held across the workers (delivered within 15%% of it): "
                            "%.3f of the quota at --workers %s"
                            % (worst["delivered / quota"], worst["--workers"]),
                            abs(worst["delivered / quota"] - 1) <= 0.15))

        def plot(ax):
            labels = [r["--workers"] for r in rows]
            x = range(len(rows))
            bars = ax.bar([i - 0.2 for i in x], [r["throughput (MB/s)"] for r in rows], 0.4,
                          label="throughput (MB/s)")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            ax.set_xticks(list(x), ["--workers %s" % w for w in labels])
            ax.set_ylabel("MB/s")
            right = ax.twinx()
            bars = right.bar([i + 0.2 for i in x], [r["delivered / quota"] for r in rows], 0.4,
                             color="C1", label="one quota: delivered / quota")
            right.bar_label(bars, fmt="%.2f", fontsize=7)
            right.axhline(1.0, color="grey", linestyle=":")
            right.set_ylim(0, max([1.5] + [r["delivered / quota"] * 1.2 for r in rows]))
            right.set_ylabel("delivered / quota")
            a, b = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
            ax.legend(a[0] + b[0], a[1] + b[1], fontsize=7, loc="upper left")
        return {"rows": rows, "targets": targets, "plot": plot if rows else None, "notes": notes,
                "columns": ["--workers", "workers", "throughput (MB/s)", "proxy CPU (ms per MB)",
                            "delivered / quota", "shared producers per worker"]}

    @staticmethod
    def cell(run, broker, wa, spec, args):
        count = worker_count(spec)
        quotas = run.path("workers-quota-%s.toml" % spec)
        quotas.write_text("[clients.shared]\nproducer_byte_rate = %d\n" % args.shared_quota)
        proxy = spawn_proxy(run, broker, ["--workers", spec, "--quota-file", str(quotas)],
                            "kthrottle-workers-%s" % spec, log_level="INFO")
        workers = None
        try:
            if count > 1:
                wait_log(proxy.log, r"workers serving", 60, proxy.proc)
            topic = "scale-workers-%s" % uuid.uuid4().hex[:8]
            broker.create_topic(topic)
            workers = harness.Workers()
            for i in range(args.tput_producers):
                workers.add(_tput_producer, proxy.bootstrap, topic, args.tput_records,
                            args.tput_record_size, i)
            workers.wait_ready(timeout=120)
            cpu0 = tree_cpu_seconds(proxy.proc.pid)
            workers.start()
            spans = workers.collect(timeout=600)
            cpu1 = tree_cpu_seconds(proxy.proc.pid)
            errors = [s["error"] for s in spans if isinstance(s, dict)]
            if errors:
                raise RuntimeError("a throughput producer failed: %s" % errors[0])
            seconds = max(e for _, e in spans) - min(s for s, _ in spans)
            mb = args.tput_producers * args.tput_records * args.tput_record_size / MB
            workers.stop()
            workers = None
            shared = argparse.Namespace(producers=args.shared_producers,
                                        seconds=args.shared_seconds,
                                        steady_from=args.shared_steady_from)
            topic2 = "scale-shared-%s" % uuid.uuid4().hex[:8]
            broker.create_topic(topic2)
            rate, placed = asyncio.run(wa.measure(proxy.bootstrap, proxy.log, topic2, shared,
                                                  count))
            return {"--workers": spec, "workers": count, "throughput (MB/s)": mb / seconds,
                    "proxy CPU (ms per MB)": (cpu1 - cpu0) * 1000 / mb if cpu0 and cpu1
                    else None,
                    "delivered / quota": rate / args.shared_quota,
                    "shared producers per worker": " ".join(
                        "w%d: %d" % (w, placed.count(w)) for w in sorted(set(placed)))}
        finally:
            if workers is not None:
                workers.stop()
            run.procs.stop(proxy.proc, timeout=20)


# --------------------------------------------------------------------------- partitions


class Partitions:
    """benchmarks/scale_partitions.py, loaded when there."""

    name = "partitions"
    title = "Partitions: Metadata, Fetch and Produce naming many partitions"
    path = BENCHMARKS / "scale_partitions.py"

    @classmethod
    def module(cls):
        if not cls.path.exists():
            return None
        return load_benchmark("scale_partitions")

    @classmethod
    def add_arguments(cls, p):
        try:
            module = cls.module()
        except Exception as exc:  # a module being written: say so, run the other curves
            print("benchmarks/scale_partitions.py cannot be loaded (%s: %s): the partitions "
                  "curve is skipped" % (type(exc).__name__, exc), file=sys.stderr)
            return
        if module is not None:
            module.add_arguments(p)

    @classmethod
    def measure(cls, args, run):
        module = None
        try:
            module = cls.module()
        except Exception:
            pass
        if module is None:
            print("partitions: benchmarks/scale_partitions.py is not there (yet): skipped",
                  flush=True)
            return None
        result = module.measure(args, run)
        result.setdefault("targets", [])
        return result


CURVE_CLASSES = {"connections": Connections, "quotas": Quotas, "partitions": Partitions,
                 "workers": Workers}


# --------------------------------------------------------------------------- report


def columns_of(result):
    columns = result.get("columns")
    if columns:
        return [c if isinstance(c, str) else c[0] for c in columns], \
            [c if isinstance(c, str) else c[1] for c in columns]
    keys = []
    for row in result["rows"]:
        for k in row:
            if k not in keys:
                keys.append(k)
    return keys, keys


def curve_section(name, result, command):
    cls = CURVE_CLASSES[name]
    lines = ["## %s" % getattr(cls, "title", name), "", "Command: `%s`" % command, ""]
    if result is None:
        return lines + ["Not measured: benchmarks/scale_partitions.py is not there.", ""]
    if result.get("error"):
        lines += ["Failed: %s" % result["error"], ""]
    rows = result.get("rows") or []
    if rows:
        keys, headers = columns_of(result)
        lines += markdown_table(headers, [[fmt_value(r.get(k)) for k in keys] for r in rows])
        lines.append("")
    for text, met in result.get("targets") or []:
        verdict = "not judged at these sizes" if met is None else ("met" if met else "NOT met")
        lines.append("- Target: %s - **%s**" % (text, verdict))
    if result.get("targets"):
        lines.append("")
    for note in result.get("notes") or []:
        lines += [note, ""]
    if result.get("plot_file"):
        lines += ["![%s](%s)" % (name, result["plot_file"]), ""]
    return lines


def draw_curve(result, title):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        result["plot"](ax)
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        return fig
    return draw


def parse_args(argv=None):
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--curves", type=harness.names, default=",".join(CURVES),
                   help="comma-separated, of %s" % ", ".join(CURVES))
    p.add_argument("--broker", choices=["tansu"], default="tansu",
                   help="the broker behind the proxy: a local Tansu broker (in memory)")
    p.add_argument("--max-minutes", type=float, default=30.0,
                   help="bound on the whole run: sizes not started by then are skipped")
    harness.add_output_dir(p)
    for cls in CURVE_CLASSES.values():
        cls.add_arguments(p)
    args = p.parse_args(argv)
    unknown = set(args.curves) - set(CURVES)
    if unknown or not args.curves:
        p.error("--curves: choose from %s" % ", ".join(CURVES))
    if set(args.quota_sources) - {"file", "zookeeper"}:
        p.error("--quota-sources: file and/or zookeeper")
    for spec in args.workers_list:
        if spec != "auto" and not spec.isdigit():
            p.error("--workers-list: numbers or auto")
    if min(args.connections + args.entities) < 1:
        p.error("counts must be >= 1")
    args.curves = [c for c in CURVES if c in args.curves]
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.output_dir(args, "scale")
    command = harness.command_line("scale", argv)
    started = time.monotonic()
    args.deadline = started + args.max_minutes * 60
    # each idle connection is two descriptors in the proxy (client and broker side), one
    # here and one in the broker
    needed = 2 * max(args.connections) + 1024 if "connections" in args.curves else 0
    nofile = raise_nofile(needed)
    print("RLIMIT_NOFILE %d/%d" % nofile, flush=True)
    results = {}
    with Run("scale") as run:
        for name in args.curves:
            if out_of_time(args):
                results[name] = {"rows": [], "targets": [], "plot": None,
                                 "notes": ["skipped: --max-minutes reached"]}
                continue
            t = time.monotonic()
            try:
                results[name] = CURVE_CLASSES[name].measure(args, run)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                import traceback

                traceback.print_exc()
                results[name] = {"rows": [], "targets": [], "plot": None,
                                 "error": "%s: %s" % (type(exc).__name__, exc)}
            if results[name] is not None:
                results[name]["seconds"] = time.monotonic() - t
    elapsed = time.monotonic() - started
    out = args.output_dir
    for name, result in results.items():
        if result and result.get("plot") and result.get("rows"):
            png = "scale-%s.png" % name
            try:
                if harness.plot(out / png, draw_curve(result, CURVE_CLASSES[name].title)):
                    result["plot_file"] = png
            except Exception as exc:
                print("plot of %s failed: %s: %s" % (name, type(exc).__name__, exc))
    facts = harness.machine_facts()
    lines = ["# kthrottle at scale (issue 48)", "",
             "Machine: %s CPUs, %s; Python %s; kthrottle at %s; Tansu %s. Run took %.0f s%s."
             % (facts["nproc"], facts["cpu_model"], facts["python"], facts["kthrottle_commit"],
                facts["tansu"], elapsed, " (%s)" % run.stopped if run.stopped else ""), ""]
    for name, result in results.items():
        lines += curve_section(name, result, command)
    report = "\n".join(lines) + "\n"
    data = {"command": command, "machine": facts, "seconds": elapsed,
            "settings": harness.settings_of(args, drop=("deadline",)),
            "curves": {name: None if r is None else {k: v for k, v in r.items() if k != "plot"}
                       for name, r in results.items()}}
    harness.write_results(out, "scale", markdown=report, data=data)
    print()
    print(report)
    failed = any(r is not None and r.get("error") for r in results.values())
    return run.finish(failed)


if __name__ == "__main__":
    sys.exit(main())
