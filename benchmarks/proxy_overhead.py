#!/usr/bin/env python3
"""What does putting a proxy in the path cost?

Compares ways for a Kafka client to reach the same broker:

* ``direct``             - the client talks straight to a local Tansu broker;
* ``kthrottle``          - through ``python -m kthrottle proxy`` from this checkout;
* ``kthrottle-ssl``      - the same, with the clients speaking TLS to it
  (``--security-protocol SSL``, a certificate made for the run; the broker side stays
  plaintext): what encryption between clients and proxy costs;
* ``tansu-proxy``        - through ``tansu proxy``, a pass-through proxy written in Rust;
* ``kthrottle-baseline`` - only with ``--baseline-src DIR``: ``python -m kthrottle proxy``
  imported from DIR (e.g. a git worktree of an older commit), so that a change is compared
  with the code before it in the same run, on the same broker, in the same rounds.

Every configuration is measured with each client library of ``--clients``: aiokafka
(asyncio) and confluent-kafka (librdkafka; its blocking API runs in a thread of this
process). Both use acks=1, the same linger, batch size, record size and partitions.
confluent-kafka's consumer has a fresh group and auto.offset.reset=earliest, with the
partitions given by assign(): subscribe() would wait ~20 s for Tansu's group rebalance.

One fresh Tansu broker (in-memory storage) serves the whole run. Every round measures each
(client, configuration) once - configurations in rotated order, clients alternating - with
a fresh proxy process and fresh topics: produce throughput, consume throughput, proxy CPU
per MB moved and produce latency at a fixed rate. "vs direct" compares with direct for the
same client in the same round (median over rounds). The table shows medians over rounds;
raw numbers go to JSON, a Markdown copy of the table and a PNG plot go next to it
(``benchmarks/results/``).

In the first round every cell starts with a short probe: a few records produced and
consumed with the client's protocol debug log on (librdkafka ``debug=protocol,feature``; the
``aiokafka.conn`` logger), from which the Produce and Fetch versions the client really sent
on that path are read. The report header lists them.

MB means 10^6 bytes of record values throughout.

Examples::

    python benchmarks/proxy_overhead.py --rounds 1 --records 20000 --latency-seconds 3

    # before/after of the working tree against the last commit, in one run
    git worktree add --detach /tmp/kthrottle-baseline HEAD
    python benchmarks/proxy_overhead.py --rounds 5 --records 200000 \\
        --configs direct,kthrottle --baseline-src /tmp/kthrottle-baseline
    git worktree remove /tmp/kthrottle-baseline
"""
import argparse
import asyncio
import functools
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kthrottle.embedded import TansuBroker, free_port, tansu_binary, wait_for_port

CONFIGS = ("direct", "kthrottle", "kthrottle-ssl", "tansu-proxy")
SSL_CONFIG = "kthrottle-ssl"
# bootstrap address -> CA file, for the endpoints clients reach over TLS
CLIENT_TLS = {}
BASELINE = "kthrottle-baseline"
CLIENT_NAMES = ("aiokafka", "confluent-kafka")
MB = 1_000_000
TANSU_NODE_ID = 111  # every Tansu broker reports this node id
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- results


@dataclass
class CellResult:
    """One (client, configuration) measured once (one round)."""

    client: str
    config: str
    round: int
    position: int  # 0-based position of this cell within its round
    ok: bool = True
    errors: list = field(default_factory=list)
    profiled: bool = False
    # Produce/Fetch versions the client sent on this path (first-round probe only)
    negotiated: Optional[dict] = None
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

    def spawn(self, name, argv, env=None, cwd=None):
        log = open(self.log_dir / ("%s.log" % name), "ab")
        try:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=cwd, start_new_session=True,  # Ctrl-C reaches only us
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


def metadata_probe(host, port, timeout=10.0, cafile=None):
    """Send one Metadata v1 request (all topics) and read the response.

    kthrottle opens its per-node listener only once a Metadata response has passed through
    it; this makes that happen before the client under test connects.
    """
    client_id = b"proxy-overhead-probe"
    body = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", -1)
    with socket.create_connection((host, port), timeout=timeout) as plain:
        sock = plain
        if cafile is not None:
            import ssl

            sock = ssl.create_default_context(cafile=cafile).wrap_socket(
                plain, server_hostname=host)
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


def kthrottle_env(src):
    """Environment and cwd under which ``python -m kthrottle`` imports the package in
    ``src``: cwd and PYTHONPATH both come before the venv's editable install."""
    src = str(src)
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=src + (os.pathsep + path if path else "")), src


def kthrottle_imported_from(src):
    """``kthrottle.__file__`` as a spawned interpreter sees it with ``src``'s
    environment; raises if that is not the package inside ``src``."""
    env, cwd = kthrottle_env(src)
    out = subprocess.run([sys.executable, "-c", "import kthrottle; print(kthrottle.__file__)"],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError("cannot import kthrottle from %s: %s" % (src, out.stderr.strip()))
    path = Path(out.stdout.strip()).resolve()
    if Path(src).resolve() / "kthrottle" not in path.parents:
        raise RuntimeError("with %s first on the path kthrottle is imported from %s"
                           % (src, path))
    return str(path)


def start_kthrottle(broker, procs, extra_args=(), admin=False, name="kthrottle", attempts=3,
                    src=REPO, cafile=None):
    """``python -m kthrottle proxy`` from source tree ``src`` in front of ``broker`` on free
    ports (with an admin endpoint if asked), ready once its node listener is open."""
    env, cwd = kthrottle_env(src)
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
        proc = procs.spawn(name, argv, env=env, cwd=cwd)
        try:
            wait_for_port("127.0.0.1", listen, timeout=20, proc=proc)
            metadata_probe("127.0.0.1", listen, cafile=cafile)  # opens the node 111 listener
            wait_for_port("127.0.0.1", node_port, timeout=5, proc=proc)
            if admin_port:
                wait_for_port("127.0.0.1", admin_port, timeout=5, proc=proc)
            bootstrap = "127.0.0.1:%d" % listen
            if cafile is not None:
                CLIENT_TLS[bootstrap] = cafile
            return Endpoint(name, bootstrap, proc, admin_port)
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


def start_endpoint(config, broker, procs, args):
    if config == "direct":
        return Endpoint("direct", broker.bootstrap)
    if config == "kthrottle":
        return start_kthrottle(broker, procs)
    if config == SSL_CONFIG:
        files = tls_files(procs.log_dir)
        return start_kthrottle(broker, procs, name=SSL_CONFIG, cafile=files["ca"], extra_args=(
            "--security-protocol", "SSL", "--ssl-cert", files["cert"], "--ssl-key", files["key"]))
    if config == BASELINE:
        return start_kthrottle(broker, procs, name=BASELINE, src=args.baseline_src)
    if config == "tansu-proxy":
        return start_tansu_proxy(broker, procs)
    raise ValueError(config)


def tls_files(directory):
    """A CA and a certificate for 127.0.0.1 signed by it (PEM files in ``directory``),
    made once per run."""
    directory = Path(directory)
    files = {"ca": str(directory / "ca.pem"), "cert": str(directory / "server.pem"),
             "key": str(directory / "server-key.pem")}
    if not Path(files["ca"]).exists():
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1")
        ca.cert_pem.write_to_path(files["ca"])
        server.private_key_pem.write_to_path(files["key"])
        server.cert_chain_pems[0].write_to_path(files["cert"])
        for pem in server.cert_chain_pems[1:]:
            pem.write_to_path(files["cert"], append=True)
    return files


def aiokafka_security(bootstrap):
    cafile = CLIENT_TLS.get(bootstrap)
    if cafile is None:
        return {}
    from aiokafka.helpers import create_ssl_context

    return {"security_protocol": "SSL", "ssl_context": create_ssl_context(cafile=cafile)}


def ck_security(bootstrap):
    cafile = CLIENT_TLS.get(bootstrap)
    if cafile is None:
        return {}
    return {"security.protocol": "SSL", "ssl.ca.location": cafile}


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


# ---- aiokafka


def producer_for(bootstrap, args, linger_ms):
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=linger_ms,
        max_batch_size=args.batch_size, request_timeout_ms=30000,
        **aiokafka_security(bootstrap),
    )


def consumer_for(bootstrap):
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", fetch_max_wait_ms=100,
        fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=8 * 1024 * 1024,
        request_timeout_ms=30000, **aiokafka_security(bootstrap),
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


async def read_from_start(consumer, topic, partitions, expected):
    """Read ``expected`` records of ``topic`` from offset 0. Returns (records, bytes)."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    records = nbytes = 0
    while records < expected:
        batches = await consumer.getmany(timeout_ms=1000, max_records=50_000)
        for batch in batches.values():
            records += len(batch)
            nbytes += sum(len(r.value) for r in batch)
    return records, nbytes


async def consume_throughput(bootstrap, topic, args, expected):
    """Phase b: read ``expected`` records from the beginning. Returns (records, bytes, s)."""
    consumer = consumer_for(bootstrap)
    await consumer.start()
    try:
        start = time.perf_counter()
        records, nbytes = await read_from_start(consumer, topic, args.partitions, expected)
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


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


async def aiokafka_probe(bootstrap, topic, args):
    """Produce and read back one record per partition while capturing ``aiokafka.conn``'s
    debug log, which names the request class (``ProduceRequest_v8``) of every request."""
    conn_log = logging.getLogger("aiokafka.conn")
    capture = _Capture()
    saved = conn_log.level, conn_log.propagate
    conn_log.addHandler(capture)
    conn_log.setLevel(logging.DEBUG)
    conn_log.propagate = False
    try:
        value = os.urandom(args.record_size)
        producer = producer_for(bootstrap, args, linger_ms=0)
        await producer.start()
        try:
            await warm_up(producer, topic, value, args.partitions)
        finally:
            await producer.stop()
        consumer = consumer_for(bootstrap)
        await consumer.start()
        try:
            await read_from_start(consumer, topic, args.partitions, args.partitions)
        finally:
            await consumer.stop()
    finally:
        conn_log.removeHandler(capture)
        conn_log.setLevel(saved[0])
        conn_log.propagate = saved[1]
    sent = {"Produce": set(), "Fetch": set()}
    for record in capture.records:
        if record.msg.startswith("Request to") and record.args:
            m = re.match(r"(Produce|Fetch)Request_v(\d+)$", type(record.args[-1]).__name__)
            if m:
                sent[m.group(1)].add(int(m.group(2)))
    return {"produce": sorted(sent["Produce"]), "fetch": sorted(sent["Fetch"])}


# ---- confluent-kafka (blocking; every function runs in a thread via in_thread)


class Abandoned(Exception):
    """The phase's thread was told to stop (timeout or Ctrl-C)."""


_THREADS = {}  # thread -> its stop event, while a phase runs in it


async def in_thread(fn, *args):
    """Run blocking ``fn(*args, stop)`` in a thread. If this is cancelled (phase timeout,
    Ctrl-C), ``stop`` is set and the thread is waited for, so no load outlives its phase."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    stop = threading.Event()
    box = {}

    def target():
        try:
            box["value"] = fn(*args, stop)
        except BaseException as exc:
            # the traceback's frames would keep the librdkafka client (and its threads) alive
            traceback.clear_frames(exc.__traceback__)
            box["error"] = exc
        finally:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:  # loop already closed
                pass

    thread = threading.Thread(target=target, name=fn.__name__, daemon=True)
    _THREADS[thread] = stop
    thread.start()
    try:
        await done.wait()
    except BaseException:
        stop_threads()
        raise
    finally:
        _THREADS.pop(thread, None)
    if "error" in box:
        raise box["error"]
    return box["value"]


def stop_threads(timeout=15.0):
    """Tell every phase thread still running to stop, and wait for them."""
    for stop in list(_THREADS.values()):
        stop.set()
    for thread in list(_THREADS):
        thread.join(timeout)


def _check(stop):
    if stop.is_set():
        raise Abandoned("stopped")


def ck_common(bootstrap, errors, debug_logger=None):
    conf = {
        "bootstrap.servers": bootstrap,
        "socket.nagle.disable": True,  # asyncio (aiokafka) sets TCP_NODELAY too
        "log.connection.close": False,  # idle connections closed by Tansu are not news
        "error_cb": errors.append,
        **ck_security(bootstrap),
    }
    if debug_logger is not None:
        conf.update({"debug": "protocol,feature", "logger": debug_logger})
    return conf


def ck_producer(bootstrap, args, linger_ms, errors, debug_logger=None):
    from confluent_kafka import Producer
    return Producer({
        **ck_common(bootstrap, errors, debug_logger),
        "acks": 1, "linger.ms": linger_ms, "batch.size": args.batch_size,
        "queue.buffering.max.messages": args.max_in_flight,  # BufferError beyond that
        "enable.idempotence": False, "compression.type": "none",
        "request.timeout.ms": 30000,
    })


def ck_consumer(bootstrap, errors, debug_logger=None):
    from confluent_kafka import Consumer
    return Consumer({
        **ck_common(bootstrap, errors, debug_logger),
        "group.id": "proxy-overhead-%s" % uuid.uuid4().hex,  # fresh: nothing committed
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "fetch.wait.max.ms": 100, "fetch.max.bytes": 64 * 1024 * 1024,
        "max.partition.fetch.bytes": 8 * 1024 * 1024,
    })


class Acks:
    """Delivery callback counting acknowledgements and failures."""

    def __init__(self):
        self.ok = 0
        self.failed = []

    def __call__(self, err, msg):
        if err is None:
            self.ok += 1
        else:
            self.failed.append(err)

    def check(self, expected, errors):
        if self.failed or self.ok != expected:
            raise RuntimeError("%d of %d records acknowledged; failures %s; client errors %s"
                               % (self.ok, expected, self.failed[:3], errors[:3]))


def ck_flush(producer, stop):
    """Wait until every message is acknowledged and its delivery callback has run."""
    while len(producer):
        _check(stop)
        producer.flush(0.2)


def ck_close(producer):
    if len(producer):  # abandoned: drop what is left, wait only for requests in transit
        producer.purge()
        producer.flush(2)


def ck_warm_up(producer, topic, value, partitions, stop, errors):
    acks = Acks()
    for p in range(partitions):
        producer.produce(topic, value, partition=p, on_delivery=acks)
    ck_flush(producer, stop)
    acks.check(partitions, errors)


def ck_read_from_start(consumer, topic, partitions, expected, stop):
    from confluent_kafka import KafkaException
    from confluent_kafka import TopicPartition as CkTopicPartition
    consumer.assign([CkTopicPartition(topic, p) for p in range(partitions)])
    records = nbytes = 0
    while records < expected:
        _check(stop)
        # asks for exactly what is missing, so the last call returns as soon as it is there
        for msg in consumer.consume(min(expected - records, 10_000), 0.5):
            if msg.error() is not None:
                raise KafkaException(msg.error())
            records += 1
            nbytes += len(msg.value())
    return records, nbytes


def ck_produce_throughput(bootstrap, topic, args, stop):
    errors = []
    value = os.urandom(args.record_size)
    producer = ck_producer(bootstrap, args, args.linger_ms, errors)
    try:
        ck_warm_up(producer, topic, value, args.partitions, stop, errors)
        acks = Acks()
        start = time.perf_counter()
        for i in range(args.records):
            while True:
                try:
                    producer.produce(topic, value, on_delivery=acks)
                    break
                except BufferError:  # --max-in-flight unacknowledged: serve callbacks
                    _check(stop)
                    producer.poll(0.05)
            if i % 1000 == 999:
                producer.poll(0)
        ck_flush(producer, stop)
        seconds = time.perf_counter() - start
        acks.check(args.records, errors)
        return seconds
    finally:
        ck_close(producer)


def ck_consume_throughput(bootstrap, topic, args, expected, stop):
    errors = []
    consumer = ck_consumer(bootstrap, errors)
    try:
        start = time.perf_counter()
        records, nbytes = ck_read_from_start(consumer, topic, args.partitions, expected, stop)
        return records, nbytes, time.perf_counter() - start
    finally:
        consumer.close()


def ck_produce_latency(bootstrap, topic, args, stop):
    """Fixed-rate sends from this thread; a second thread polls so that delivery
    callbacks run as soon as librdkafka has the acknowledgement."""
    errors = []
    value = os.urandom(args.record_size)
    producer = ck_producer(bootstrap, args, 0, errors)
    latencies, failed = [], []
    polling = threading.Event()

    def on_ack(sent_at):
        def callback(err, msg):
            if err is None:
                latencies.append((time.perf_counter() - sent_at) * 1000.0)
            else:
                failed.append(err)
        return callback

    def poller():
        while polling.is_set():
            producer.poll(0.05)

    poll_thread = threading.Thread(target=poller, name="ck-poller", daemon=True)
    try:
        ck_warm_up(producer, topic, value, args.partitions, stop, errors)
        total = int(args.rate * args.latency_seconds)
        interval = 1.0 / args.rate
        late = 0
        polling.set()
        poll_thread.start()
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -0.005:
                late += 1
            if i % 100 == 0:
                _check(stop)
            sent_at = time.perf_counter()
            producer.produce(topic, value, on_delivery=on_ack(sent_at))
        send_seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while len(producer) and time.monotonic() < deadline:  # the poller drains it
            _check(stop)
            time.sleep(0.01)
        polling.clear()
        poll_thread.join(5)
        ck_flush(producer, stop)
        if failed:
            raise RuntimeError("%d records failed, first %s" % (len(failed), failed[0]))
        return sorted(latencies), total / send_seconds, late
    finally:
        polling.clear()
        if poll_thread.is_alive():
            poll_thread.join(5)
        ck_close(producer)


SENT_RE = re.compile(r"Sent (Produce|Fetch)Request \(v(\d+),")
ADVERTISED_RE = re.compile(r"ApiKey (Produce|Fetch) \(\d+\) Versions (\d+)\.\.(\d+)")


def ck_probe(bootstrap, topic, args, stop):
    """Produce and read back one record per partition with librdkafka's ``protocol`` and
    ``feature`` debug logs on: "Sent ProduceRequest (v10, ...)" names the version used,
    "ApiKey Produce (0) Versions 0..11" what the other side advertised."""
    capture = _Capture()
    debug_logger = logging.Logger("proxy-overhead-librdkafka")  # not in the logger tree
    debug_logger.addHandler(capture)
    errors = []
    value = os.urandom(args.record_size)
    producer = ck_producer(bootstrap, args, 0, errors, debug_logger)
    try:
        ck_warm_up(producer, topic, value, args.partitions, stop, errors)
    finally:
        ck_close(producer)
    consumer = ck_consumer(bootstrap, errors, debug_logger)
    try:
        ck_read_from_start(consumer, topic, args.partitions, args.partitions, stop)
    finally:
        consumer.close()
    sent = {"Produce": set(), "Fetch": set()}
    advertised = {}
    for record in capture.records:
        line = record.getMessage()
        for api, version in SENT_RE.findall(line):
            sent[api].add(int(version))
        for api, _, high in ADVERTISED_RE.findall(line):
            advertised[api] = max(advertised.get(api, 0), int(high))
    return {"produce": sorted(sent["Produce"]), "fetch": sorted(sent["Fetch"]),
            "advertised_produce_max": advertised.get("Produce"),
            "advertised_fetch_max": advertised.get("Fetch")}


@dataclass(frozen=True)
class Client:
    """One client library's phases; all are coroutines with the aiokafka signatures."""

    name: str
    probe: Callable
    produce_throughput: Callable
    consume_throughput: Callable
    produce_latency: Callable


CLIENTS = {
    "aiokafka": Client("aiokafka", aiokafka_probe, produce_throughput, consume_throughput,
                       produce_latency),
    "confluent-kafka": Client(
        "confluent-kafka", functools.partial(in_thread, ck_probe),
        functools.partial(in_thread, ck_produce_throughput),
        functools.partial(in_thread, ck_consume_throughput),
        functools.partial(in_thread, ck_produce_latency)),
}


async def measure(client, endpoint, broker, topics, args, result, profile_path, procs):
    """Run phases a-d with ``client`` against one endpoint, filling ``result``."""
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
            client.produce_throughput(endpoint.bootstrap, throughput_topic, args),
            args.phase_timeout)
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
            client.consume_throughput(endpoint.bootstrap, throughput_topic, args, expected),
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
            client.produce_latency(endpoint.bootstrap, latency_topic, args),
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


def run_cell(runner, client, config, rnd, position, broker, procs, args, profile_raw):
    result = CellResult(client=client.name, config=config, round=rnd, position=position)
    tag = "%s-%s-r%d" % (client.name, config, rnd)
    topics = ("tput-" + tag, "lat-" + tag)
    probe_topic = "probe-" + tag if rnd == 0 else None
    print("round %d/%d  %-15s %s" % (rnd + 1, args.rounds, client.name, config), flush=True)
    endpoint = None
    try:
        for topic in topics + ((probe_topic,) if probe_topic else ()):
            broker.create_topic(topic, args.partitions)
        endpoint = start_endpoint(config, broker, procs, args)
        if probe_topic:
            try:
                result.negotiated = runner.run(asyncio.wait_for(
                    client.probe(endpoint.bootstrap, probe_topic, args),
                    min(args.phase_timeout, 60.0)))
                print("    negotiated %s" % versions_text(result.negotiated), flush=True)
            except Exception as exc:
                result.fail("probe", exc)
        runner.run(measure(client, endpoint, broker, topics, args, result, profile_raw, procs))
    except Exception as exc:
        result.fail("setup", exc)
    finally:
        stop_threads()  # none left unless interrupted (KeyboardInterrupt skips cancelling)
        if endpoint is not None and endpoint.proc is not None:
            if endpoint.proc.poll() is not None:
                result.fail("proxy", RuntimeError(
                    "proxy exited early with code %s" % endpoint.proc.returncode))
            procs.stop(endpoint.proc)
        for topic in topics + ((probe_topic,) if probe_topic else ()):
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


def versions_text(negotiated):
    """'Produce v10, Fetch v17' (with what the other side advertised, when known)."""
    def one(api):
        used = negotiated.get(api.lower()) or []
        text = "%s %s" % (api, "/".join("v%d" % v for v in used) if used else "v?")
        top = negotiated.get("advertised_%s_max" % api.lower())
        return text + (" (advertised up to v%d)" % top if top is not None else "")
    return "%s, %s" % (one("Produce"), one("Fetch"))


# --------------------------------------------------------------------------- reporting


METRICS = (
    "produce_mb_s", "produce_rec_s", "consume_mb_s", "consume_rec_s",
    "latency_p50_ms", "latency_p99_ms", "latency_p999_ms",
    "proxy_cpu_ms_per_mb", "broker_cpu_ms_per_mb",
)


def _ratio(a, b):
    return a / b


def _minus(a, b):
    return a - b


def paired(results, client, config, metric, base="direct", op=_ratio):
    """op(config, base) for every round where both were measured with ``client``: a round's
    cells share the machine's state, so this is steadier than comparing medians."""
    by_round = {}
    for r in results:
        if r.client == client:
            by_round.setdefault(r.round, {})[r.config] = getattr(r, metric)
    return sorted(op(cells[config], cells[base]) for cells in by_round.values()
                  if cells.get(config) is not None and cells.get(base) is not None
                  and (op is not _ratio or cells[base]))


def summarize(results, clients, configs):
    """Per client and configuration: the median of every metric over the rounds where it
    was measured, and the median of the paired (same round) comparisons with direct."""
    summary = {}
    for client in clients:
        for config in configs:
            cells = [r for r in results if r.client == client and r.config == config]
            row = {"rounds_measured": sum(1 for r in cells if r.ok)}
            for metric in METRICS:
                values = [getattr(r, metric) for r in cells if getattr(r, metric) is not None]
                row[metric] = statistics.median(values) if values else None
                row[metric + "_all"] = values
            for key, metric, op in (("produce_vs_direct", "produce_mb_s", _ratio),
                                    ("consume_vs_direct", "consume_mb_s", _ratio),
                                    ("p99_added_vs_direct_ms", "latency_p99_ms", _minus)):
                values = paired(results, client, config, metric, op=op)
                row[key] = statistics.median(values) if values else None
            row["negotiated"] = next((r.negotiated for r in cells if r.negotiated), None)
            summary.setdefault(client, {})[config] = row
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
    try:
        import confluent_kafka
        ck_version, librdkafka = confluent_kafka.__version__, confluent_kafka.libversion()[0]
    except ImportError:
        ck_version = librdkafka = None
    return {
        "kthrottle_commit": git_describe(),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "aiokafka": aiokafka.__version__,
        "confluent_kafka": ck_version,
        "librdkafka": librdkafka,
        "client_loop": loop_name,
        "tansu": tansu,
    }


def git_describe(repo=REPO):
    """HEAD of the checkout ``repo`` (by default the one holding this script), with
    "-dirty" if its kthrottle/ has local edits."""
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


def spread(values, spec, unit=""):
    """'0.97x (0.95x to 1.01x)': median and range of paired values."""
    if not values:
        return None
    text = format(statistics.median(values), spec) + unit
    if len(values) > 1:
        text += " (%s%s to %s%s)" % (format(values[0], spec), unit, format(values[-1], spec), unit)
    return text


def paired_lines(results, clients, configs):
    lines = []
    for client in clients:
        for config in configs:
            if config == "direct":
                continue
            parts = []
            for metric, label in (("produce_mb_s", "produce"), ("consume_mb_s", "consume")):
                text = spread(paired(results, client, config, metric), ".2f", "x")
                if text:
                    parts.append("%s %s" % (label, text))
            if parts:
                lines.append("- %s, %s: %s" % (client, config, ", ".join(parts)))
    if lines:
        lines.insert(0, "Throughput relative to direct with the same client in the same round, "
                        "median (min to max):")
    for config, base, title in (
            ("kthrottle", BASELINE, "kthrottle (this checkout) relative to %s" % BASELINE),
            (SSL_CONFIG, "kthrottle", "TLS between clients and kthrottle (%s) relative to "
                                      "plaintext (kthrottle)" % SSL_CONFIG)):
        if config not in configs or base not in configs:
            continue
        ab = []
        for client in clients:
            parts = []
            for metric, label, op, spec, unit in (
                    ("produce_mb_s", "produce", _ratio, ".3f", "x"),
                    ("consume_mb_s", "consume", _ratio, ".3f", "x"),
                    ("proxy_cpu_ms_per_mb", "proxy CPU/MB", _ratio, ".3f", "x"),
                    ("latency_p99_ms", "p99", _minus, "+.2f", " ms")):
                text = spread(paired(results, client, config, metric, base=base, op=op),
                              spec, unit)
                if text:
                    parts.append("%s %s" % (label, text))
            if parts:
                ab.append("- %s: %s" % (client, ", ".join(parts)))
        if ab:
            lines += ([""] if lines else []) + [
                "%s, same client, same round, median (min to max):" % title] + ab
    return lines


def negotiated_lines(summary, clients, configs):
    lines = []
    for client in clients:
        by_text = {}
        for config in configs:
            neg = summary[client][config]["negotiated"]
            if neg:
                by_text.setdefault(versions_text(neg), []).append(config)
        if len(by_text) == 1:
            text, paths = next(iter(by_text.items()))
            lines.append("- %s negotiated %s on %s" % (
                client, text, "every path" if len(paths) == len(configs)
                else "; ".join(paths)))
        elif by_text:
            lines.append("- %s negotiated: %s" % (client, "; ".join(
                "%s on %s" % (text, ", ".join(paths)) for text, paths in by_text.items())))
    if lines:
        lines.insert(0, "Protocol versions the clients sent (first-round probe, read from "
                        "their debug logs):")
    return lines


def markdown_report(summary, clients, configs, facts, args, elapsed, results=()):
    sources = "kthrottle from %s (%s)" % (facts.get("kthrottle_source", "?"),
                                          facts["kthrottle_commit"])
    if facts.get("baseline_source"):
        sources += "; %s from %s (%s)" % (BASELINE, facts["baseline_source"],
                                          facts["baseline_commit"])
    lines = [
        "Machine: %s CPUs, %s; Python %s; aiokafka %s on %s; confluent-kafka %s "
        "(librdkafka %s); %s."
        % (facts["nproc"], facts["cpu_model"], facts["python"], facts["aiokafka"],
           facts["client_loop"], facts["confluent_kafka"], facts["librdkafka"],
           facts["tansu"]),
        "",
        "Code: %s." % sources,
        "",
        "Settings: %d round(s), %d x %d B records, acks=1, linger %d ms, batch %d B, "
        "%d partitions, at most %d records unacknowledged; latency at %d records/s for %g s "
        "with linger 0. confluent-kafka: no idempotence, Nagle off, consumer assign()ed with "
        "a fresh group and auto.offset.reset=earliest. Medians over rounds; MB = 10^6 "
        "bytes; run took %.0f s."
        % (args.rounds, args.records, args.record_size, args.linger_ms, args.batch_size,
           args.partitions, args.max_in_flight, args.rate, args.latency_seconds, elapsed),
    ]
    negotiated = negotiated_lines(summary, clients, configs)
    if negotiated:
        lines += [""] + negotiated
    lines += [
        "",
        "| client | configuration | produce MB/s | produce rec/s | vs direct | consume MB/s "
        "| consume rec/s | vs direct | p50 ms | p99 ms | p99.9 ms | p99 added vs direct (ms) "
        "| proxy CPU ms/MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for client in clients:
        for config in configs:
            row = summary[client][config]
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                client,
                config if row["rounds_measured"] == args.rounds
                else "%s (%d/%d rounds ok)" % (config, row["rounds_measured"], args.rounds),
                fmt(row["produce_mb_s"], ".1f"), fmt(row["produce_rec_s"], ",.0f"),
                fmt(row["produce_vs_direct"], ".2f") + ("x" if row["produce_vs_direct"] else ""),
                fmt(row["consume_mb_s"], ".1f"), fmt(row["consume_rec_s"], ",.0f"),
                fmt(row["consume_vs_direct"], ".2f") + ("x" if row["consume_vs_direct"] else ""),
                fmt(row["latency_p50_ms"], ".2f"), fmt(row["latency_p99_ms"], ".2f"),
                fmt(row["latency_p999_ms"], ".2f"),
                "-" if config == "direct" else fmt(row["p99_added_vs_direct_ms"], "+.2f"),
                "-" if config == "direct" else fmt(row["proxy_cpu_ms_per_mb"], ".1f"),
            ))
    extra = paired_lines(results, clients, configs)
    if extra:
        lines += [""] + extra
    return "\n".join(lines) + "\n"


def plot(summary, clients, configs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(configs))
    fig, axes = plt.subplots(len(clients), 2, figsize=(max(12, 3.2 * len(configs)),
                                                       4.5 * len(clients)), squeeze=False)

    def bars(ax, rows, metrics, labels, ylabel, title):
        width = 0.8 / len(metrics)
        for i, (metric, label) in enumerate(zip(metrics, labels)):
            offsets = [xi + (i - (len(metrics) - 1) / 2) * width for xi in x]
            heights = [rows[c][metric] or 0 for c in configs]
            drawn = ax.bar(offsets, heights, width, label=label)
            ax.bar_label(drawn, fmt="%.1f" if "mb_s" in metric else "%.2f", fontsize=7)
            for off, c in zip(offsets, configs):  # every round as a dot
                values = rows[c][metric + "_all"]
                ax.plot([off] * len(values), values, "k.", markersize=3)
        ax.set_xticks(list(x), configs)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)

    for (left, right), client in zip(axes, clients):
        rows = summary[client]
        bars(left, rows, ("produce_mb_s", "consume_mb_s"), ("produce", "consume"), "MB/s",
             "%s: throughput (median; dots = rounds)" % client)
        bars(right, rows, ("latency_p50_ms", "latency_p99_ms", "latency_p999_ms"),
             ("p50", "p99", "p99.9"), "ms", "%s: produce latency at fixed rate (median)"
             % client)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize_profile(raw_path, out_path, client, top=30):
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
           "(round 1, %s client): %d samples" % (client, total), ""]
    for title, counts in (("self time", self_counts), ("inclusive time", incl_counts)):
        out.append("Top %d by %s:" % (top, title))
        for frame, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
            out.append("  %5.1f%%  %s" % (100.0 * n / max(total, 1), frame))
        out.append("")
    out.append("Raw collapsed stacks (py-spy --format raw; flamegraph.pl input):")
    out.extend(raw)
    Path(out_path).write_text("\n".join(out) + "\n")


# --------------------------------------------------------------------------- main


def _names(text):
    return [c.strip() for c in text.split(",") if c.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Measure the cost of a Kafka proxy: each client library against a local "
        "Tansu broker directly, through kthrottle, through `tansu proxy` and (with "
        "--baseline-src) through kthrottle from another source tree. Prints a table of "
        "medians over rounds per (client, configuration) and writes "
        "proxy_overhead.json/.md/.png into --output-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3,
                   help="how many times every (client, configuration) is measured; each "
                   "round runs all of them once, configurations in rotated order")
    p.add_argument("--records", type=int, default=100_000,
                   help="records produced and then consumed in the throughput phases")
    p.add_argument("--record-size", type=int, default=1024, help="record value size in bytes")
    p.add_argument("--rate", type=int, default=2000,
                   help="records per second sent in the latency phase")
    p.add_argument("--latency-seconds", type=float, default=10.0,
                   help="duration of the fixed-rate latency phase")
    p.add_argument("--partitions", type=int, default=3, help="partitions per topic")
    p.add_argument("--linger-ms", type=int, default=5,
                   help="producer linger (aiokafka linger_ms, librdkafka linger.ms) in the "
                   "throughput phase; the latency phase uses 0")
    p.add_argument("--batch-size", type=int, default=64 * 1024,
                   help="producer batch size in bytes (aiokafka max_batch_size, librdkafka "
                   "batch.size)")
    p.add_argument("--max-in-flight", type=int, default=10_000,
                   help="most unacknowledged records in the produce throughput phase "
                   "(aiokafka send() futures, librdkafka queue.buffering.max.messages)")
    p.add_argument("--clients", default=",".join(CLIENT_NAMES),
                   help="comma-separated client libraries to measure every configuration "
                   "with: " + ", ".join(CLIENT_NAMES))
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: %s (%s is added by --baseline-src)"
                   % (", ".join(CONFIGS), BASELINE))
    p.add_argument("--baseline-src", type=Path, metavar="DIR",
                   help="also measure configuration %s: `python -m kthrottle proxy` run with "
                   "cwd and PYTHONPATH set to DIR, a kthrottle source tree such as `git "
                   "worktree add DIR HEAD~1`; the script checks that the package in DIR is "
                   "the one imported" % BASELINE)
    p.add_argument("--phase-timeout", type=float, default=120.0,
                   help="seconds after which a phase is abandoned and recorded as failed "
                   "(the latency phase gets --latency-seconds on top)")
    p.add_argument("--profile", action="store_true",
                   help="run py-spy on the kthrottle proxy during its first-round produce "
                   "phase with the first client and write kthrottle_profile.txt (that "
                   "cell's numbers are then perturbed by the sampler)")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT,
                   help="where the JSON, Markdown, PNG (and profile) are written")
    args = p.parse_args(argv)
    args.clients = _names(args.clients)
    unknown = set(args.clients) - set(CLIENT_NAMES)
    if unknown or not args.clients:
        p.error("--clients: unknown %s (choose from %s)"
                % (sorted(unknown), ", ".join(CLIENT_NAMES)))
    if "confluent-kafka" in args.clients:
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            p.error("--clients confluent-kafka needs confluent-kafka (scripts/setup test), "
                    "or pass --clients aiokafka")
    args.configs = _names(args.configs)
    if args.baseline_src is not None:
        args.baseline_src = args.baseline_src.resolve()
        if not (args.baseline_src / "kthrottle" / "__init__.py").is_file():
            p.error("--baseline-src: %s has no kthrottle/ package" % args.baseline_src)
        if BASELINE not in args.configs:
            args.configs.append(BASELINE)
    elif BASELINE in args.configs:
        p.error("--configs %s needs --baseline-src" % BASELINE)
    unknown = set(args.configs) - set(CONFIGS) - {BASELINE}
    if unknown or not args.configs:
        p.error("--configs: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(CONFIGS)))
    if min(args.rounds, args.records, args.rate, args.partitions, args.record_size,
           args.max_in_flight) < 1:
        p.error("--rounds, --records, --rate, --partitions, --record-size and "
                "--max-in-flight must be >= 1")
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
    facts["kthrottle_source"] = kthrottle_imported_from(REPO)
    print("kthrottle imported from %s (%s)" % (facts["kthrottle_source"],
                                                facts["kthrottle_commit"]), flush=True)
    if args.baseline_src is not None:
        facts["baseline_source"] = kthrottle_imported_from(args.baseline_src)
        facts["baseline_commit"] = git_describe(args.baseline_src)
        print("%s imported from %s (%s)" % (BASELINE, facts["baseline_source"],
                                             facts["baseline_commit"]), flush=True)
    clients = [CLIENTS[name] for name in args.clients]
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
                c_shift, k_shift = rnd % len(clients), rnd % len(args.configs)
                order = [(client, config)
                         for client in clients[c_shift:] + clients[:c_shift]
                         for config in args.configs[k_shift:] + args.configs[:k_shift]]
                for position, (client, config) in enumerate(order):
                    profile = (profile_raw if rnd == 0 and config == "kthrottle"
                               and client is clients[0] else None)
                    results.append(run_cell(runner, client, config, rnd, position, broker,
                                            procs, args, profile))
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
    summary = summarize(results, args.clients, args.configs)
    report = markdown_report(summary, args.clients, args.configs, facts, args, elapsed,
                             results)
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
    plot(summary, args.clients, args.configs, out / "proxy_overhead.png")
    written = ["proxy_overhead.json", "proxy_overhead.md", "proxy_overhead.png"]
    if profile_raw is not None and profile_raw.exists():
        summarize_profile(profile_raw, out / "kthrottle_profile.txt", args.clients[0])
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
