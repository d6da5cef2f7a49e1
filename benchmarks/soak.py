#!/usr/bin/env python3
"""Does one kthrottle process hold 1,000 clients for minutes, and how many can it hold? (issue 15)

One Tansu broker (in-memory storage) and one ``python -m kthrottle proxy --quota-file FILE``
process in front of it, both started here on free 127.0.0.1 ports and stopped by PID. The load
is ``--connections`` raw Kafka clients (asyncio sockets; every frame built and read with
kafka-python's schema classes), spread over ``--workers`` load-generator processes so that the
generator is not the bottleneck. Each client opens one connection to the proxy's listener for
node 111 (the node Tansu's metadata names, rewritten to the proxy), sends ApiVersions v3 and
Metadata v9 (checking that node 111 is the proxy's listener and leads its partition), then:

* half of them, producers: Produce v9, acks=1, one record batch of ``--batch-records`` records
  of ``--record-size`` bytes to a partition of their own (topics of ``--partitions-per-topic``
  partitions, so that every Metadata answer has the same size whatever the number of
  clients), ``--produce-rate`` requests per second (one request in flight; a late request
  goes at once, missed ones are not made up);
* the other half, consumers: Fetch v12 of the partition of producer i (one consumer per
  partition, from offset 0), a long poll of ``--max-wait-ms``, the next fetch at once.

A quarter of all connections is throttled (clients/<client-id> quotas in the quota file, one
bucket per client): the producers of every fourth partition (``producer_byte_rate``) and the
consumers of every fourth other partition (``consumer_byte_rate``), at ``--throttle-fraction``
of what they offer. Every client is well behaved (KIP-219): after a response with
``throttle_time_ms`` > 0 it sends nothing on that connection before the delay is over. A
throttle is not an error. An error is anything else: a refused or failed connect, a
disconnect, a request unanswered within ``--request-timeout-ms``, a correlation id out of
order, a non-zero error code in a response. A client whose connection fails counts the error,
waits 1 s and connects again.

A probe process measures how late the proxy's event loop is: ApiVersions v3 round trips every
``--probe-interval-ms`` on one connection through the proxy and, in the same run, one direct to
the broker. The proxy's own lag is the difference.

The run: broker and proxy start; the proxy's RSS and open file descriptors are read (psutil)
with no client connected; the clients connect and stay idle ``--idle-seconds`` (memory per
connection = (RSS with N idle connections - RSS with none) / N); the load runs ``--warmup``
seconds, then the measured ``--seconds``; RSS and descriptors are read at the start and at the
end of the measured interval and again once every client has closed. Throughput is record-batch
bytes acknowledged (produce) or received (consume) in the interval, in MB/s (10^6 bytes).

Checks (the script exits 1 if one fails): every connection connected; no client error; the
proxy's descriptors at the end within ``--max-fd-growth`` of the start, and after every client
closed within it of before any connected; RSS growth over the measured interval within
``--max-rss-growth-mib``.

``--find-limit``: how many connections and MB/s one proxy process holds before its event loop
falls behind. A step is a whole run as above (fresh broker and proxy, ``--step-seconds``). First
the number of connections goes up (``--limit-connections``) at ``--produce-rate``; then, at
``--connections`` (or the most that held), the offered rate per producer goes up
(``--limit-rates``, multiples of ``--produce-rate``). A step holds when no client error
happened, every connection connected, the probe's p99 through the proxy stayed within
``--lag-limit-ms`` (100) and the unthrottled producers got at least 90% of the rate they
offered; each phase stops at the first step that does not hold. On a 2-core machine the load
generators, the broker and the proxy share the cores: every step reports each one's CPU and the
load generators' own loop lag, so that a step failed by the machine can be told apart.

Results go to ``--output`` (default: ``soak.md`` in a new directory under
``benchmarks/runs/``, which git ignores): a soak run rewrites the soak section, ``--find-limit``
the capacity section, each keeping the other (``--output benchmarks/results/soak.md``
updates the committed results).

Examples::

    python benchmarks/soak.py --connections 100 --seconds 20 --warmup 5        # smoke, ~45 s
    python benchmarks/soak.py                           # 1,000 connections, 10 minutes
    python benchmarks/soak.py --find-limit              # capacity steps, ~6 minutes
"""
import argparse
import asyncio
import json
import math
import os
import queue
import random
import re
import resource
import struct
import subprocess
import sys
import time
import uuid
import warnings
from collections import Counter
from pathlib import Path

from kthrottle_testkit.harness import (
    MB,
    MIB,
    MP,
    TANSU_NODE_ID,
    CpuSampler,
    Run,
    add_flags,
    admin_get,
    busy_percent,
    command_line,
    fresh_run_dir,
    handle_signals,
    machine_cpu,
    machine_facts,
    metric_sum,
    new_runner,
    node_address,
    parser,
    worker_signals,
)

with warnings.catch_warnings():  # kafka.protocol warns about its own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.metadata import (ApiVersionsRequest, ApiVersionsResponse,
                                         MetadataRequest, MetadataResponse)
    from kafka.protocol.producer import ProduceRequest, ProduceResponse
    from kafka.record.default_records import DefaultRecordBatchBuilder

PRODUCE, FETCH, METADATA, API_VERSIONS = 0, 1, 3, 18
# Produce v9 and Fetch v12: flexible versions past KIP-219's (Produce v6, Fetch v8), so the
# client itself waits out throttle_time_ms; Fetch v12 is the last that names topics.
VERSIONS = {API_VERSIONS: 3, METADATA: 9, PRODUCE: 9, FETCH: 12}
API_NAMES = {PRODUCE: "Produce", FETCH: "Fetch", METADATA: "Metadata", API_VERSIONS: "ApiVersions"}
GROUPS = ("producer", "producer-throttled", "consumer", "consumer-throttled")
RECONNECT_DELAY = 1.0
CLOSE_AFTER = 1.0  # seconds after the measured interval that clients close
SETUP_ATTEMPTS = 3
HELD_FRACTION = 0.9  # a step holds while unthrottled producers get this share of their offer


# --------------------------------------------------------------------------- Kafka frames


class ClientError(Exception):
    """A response that breaks the protocol or carries an error code."""


def api_versions_request():
    return ApiVersionsRequest[3](client_software_name="kthrottle-soak",
                                client_software_version="1")


def metadata_request(topic):
    req = MetadataRequest[9]
    return req(topics=[req.MetadataRequestTopic(name=topic)], allow_auto_topic_creation=False,
               include_cluster_authorized_operations=False,
               include_topic_authorized_operations=False)


def produce_request(topic, partition, batch, timeout_ms):
    req = ProduceRequest[9]
    data = req.TopicProduceData
    return req(transactional_id=None, acks=1, timeout_ms=timeout_ms,
               topic_data=[data(name=topic, partition_data=[
                   data.PartitionProduceData(index=partition, records=batch)])])


def fetch_request(topic, partition, offset, max_wait_ms, max_bytes):
    req = FetchRequest[12]
    t = req.FetchTopic
    return req(replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=max_bytes,
               isolation_level=0, session_id=0, session_epoch=-1,
               topics=[t(topic=topic, partitions=[t.FetchPartition(
                   partition=partition, current_leader_epoch=-1, fetch_offset=offset,
                   last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=max_bytes)])],
               forgotten_topics_data=[], rack_id="")


def topic_name(prefix, k):
    return "soak-%s-%03d" % (prefix, k)


def record_batch(records, record_size):
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                        batch_size=1 << 30)
    value = os.urandom(record_size)
    for i in range(records):
        builder.append(i, timestamp=None, key=None, value=value, headers=[])
    return bytes(builder.build())


def whole_batches(records):
    """(bytes of the whole record batches in ``records``, the offset after the last one or
    None). Batch layout (v2): baseOffset int64, batchLength int32, ..., lastOffsetDelta int32
    at byte 23; a batch cut short at the end of a fetch response is left out."""
    pos, end, next_offset = 0, len(records), None
    while pos + 27 <= end:
        base, length = struct.unpack_from(">qi", records, pos)
        if length < 49:  # shorter than a batch header (v2): a broken response
            raise ClientError("record batch length %d at byte %d" % (length, pos))
        if pos + 12 + length > end:
            break
        next_offset = base + struct.unpack_from(">i", records, pos + 23)[0] + 1
        pos += 12 + length
    return pos, next_offset


class Connection:
    """One raw Kafka connection with one request in flight at a time."""

    def __init__(self, reader, writer, client_id):
        self.reader, self.writer, self.client_id = reader, writer, client_id
        self.correlation_id = 0

    @classmethod
    async def open(cls, host, port, client_id):
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, client_id)

    async def call(self, request, response_type, timeout):
        """(response, request frame bytes, response frame bytes)."""
        self.correlation_id += 1
        request.with_header(correlation_id=self.correlation_id, client_id=self.client_id)
        frame = bytes(request.encode(header=True, framed=True))
        self.writer.write(frame)
        async with asyncio.timeout(timeout):
            size = int.from_bytes(await self.reader.readexactly(4), "big")
            body = await self.reader.readexactly(size)
        response = response_type.decode(body, header=True)
        if response.header.correlation_id != self.correlation_id:
            raise ClientError("correlation id %d, expected %d"
                              % (response.header.correlation_id, self.correlation_id))
        return response, len(frame), size + 4

    async def setup(self, topic, partition, node_address, timeout):
        """ApiVersions, then Metadata: the versions used here must be offered, and the node
        leading ``partition`` must be the proxy's listener we are on."""
        versions, _, _ = await self.call(api_versions_request(), ApiVersionsResponse[3], timeout)
        if versions.error_code:
            raise ClientError("ApiVersions error_code %d" % versions.error_code)
        offered = {k.api_key: (k.min_version, k.max_version) for k in versions.api_keys}
        for key, version in VERSIONS.items():
            low, high = offered.get(key, (0, -1))
            if not low <= version <= high:
                raise ClientError("%s v%d not offered (%s)" % (API_NAMES[key], version,
                                                               offered.get(key)))
        metadata, _, _ = await self.call(metadata_request(topic), MetadataResponse[9], timeout)
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        if brokers.get(TANSU_NODE_ID) != node_address:
            raise ClientError("Metadata names node %d at %s, not the proxy's %s"
                              % (TANSU_NODE_ID, brokers.get(TANSU_NODE_ID), node_address))
        topics = [t for t in metadata.topics if t.name == topic]
        if not topics or topics[0].error_code:
            raise ClientError("Metadata: topic %s error_code %s"
                              % (topic, topics[0].error_code if topics else "missing"))
        leaders = {p.partition_index: p.leader_id for p in topics[0].partitions}
        if leaders.get(partition) != TANSU_NODE_ID:
            raise ClientError("Metadata: partition %d leader %s" % (partition,
                                                                    leaders.get(partition)))

    def close(self):
        """Drop a connection that failed: nothing more is read or sent on it."""
        self.writer.transport.abort()


# --------------------------------------------------------------------------- statistics


class Histogram:
    """Latencies in logarithmic buckets 2% wide from 10 us: percentiles within 1%, and
    cheap to merge across processes."""

    BASE, STEP = 1e-5, math.log(1.02)

    def __init__(self, counts=None, count=0, maximum=0.0):
        self.counts = Counter(counts or {})
        self.count, self.maximum = count, maximum

    def add(self, seconds):
        self.counts[int(math.log(seconds / self.BASE) / self.STEP) if seconds > self.BASE
                    else 0] += 1
        self.count += 1
        if seconds > self.maximum:
            self.maximum = seconds

    def merge(self, other):
        self.counts.update(other.counts)
        self.count += other.count
        self.maximum = max(self.maximum, other.maximum)
        return self

    def quantile(self, q):
        """Seconds (bucket middle), or None without samples."""
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return min(self.BASE * math.exp((bucket + 0.5) * self.STEP), self.maximum)
        return self.maximum

    def ms(self, q):
        value = self.quantile(q)
        return None if value is None else value * 1000

    def dump(self):
        return {"counts": dict(self.counts), "count": self.count, "maximum": self.maximum}

    @classmethod
    def load(cls, d):
        return cls(d["counts"], d["count"], d["maximum"])


class WorkerStats:
    """A load generator's counters: ``totals[(group, metric)]`` and, per connection,
    [record-batch bytes, frame bytes] moved."""

    def __init__(self):
        self.totals = Counter()
        self.per_conn = {}
        self.errors = Counter()
        self.latency = {g: Histogram() for g in GROUPS}
        self.window = (math.inf, math.inf)

    def error(self, phase, what):
        self.errors["%s: %s" % (phase, what[:160])] += 1

    def snapshot(self):
        return {"totals": dict(self.totals),
                "per_conn": {i: list(v) for i, v in self.per_conn.items()}}


def error_text(exc):
    if isinstance(exc, asyncio.IncompleteReadError):
        return "disconnect (connection closed by the proxy)"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "disconnect (%s)" % type(exc).__name__
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "%s: %s" % (type(exc).__name__, exc)


# --------------------------------------------------------------------------- load generator


class Client:
    """One producer or consumer connection, reconnecting after a failure."""

    def __init__(self, spec, worker):
        self.index, self.role, self.throttled, self.partition, self.client_id = spec
        self.group = self.role + ("-throttled" if self.throttled else "")
        self.w = worker
        per_topic = worker.settings["partitions_per_topic"]
        self.topic = topic_name(worker.settings["topic_prefix"], self.partition // per_topic)
        self.topic_partition = self.partition % per_topic
        self.conn = None
        self.moved = worker.stats.per_conn.setdefault(self.index, [0, 0])

    async def connect(self, phase):
        s = self.w.settings
        async with self.w.connect_gate:
            try:
                conn = await asyncio.wait_for(
                    Connection.open(*self.w.node_address, self.client_id), s["timeout"])
                try:
                    await conn.setup(self.topic, self.topic_partition, self.w.node_address,
                                     s["timeout"])
                except BaseException:
                    conn.close()
                    raise
            except Exception as exc:
                self.w.stats.error(phase, ("connect/setup " + error_text(exc)))
                return None
        return conn

    async def run(self):
        w, s = self.w, self.w.settings
        for attempt in range(SETUP_ATTEMPTS):
            self.conn = await self.connect("setup")
            if self.conn is not None:
                break
            await asyncio.sleep(RECONNECT_DELAY)
        w.client_ready(self.conn is not None)
        await w.go.wait()
        t_start, _, t_end = w.times
        loop_fn = self.produce if self.role == "producer" else self.consume
        try:
            while time.monotonic() < t_end:
                if self.conn is None:
                    await asyncio.sleep(RECONNECT_DELAY)
                    if time.monotonic() >= t_end:
                        break
                    w.stats.totals[(self.group, "reconnects")] += 1
                    self.conn = await self.connect("load")
                    continue
                try:
                    await loop_fn(t_start, t_end)
                    break  # it returns when no request is left before t_end
                except Exception as exc:  # a disconnect, a timeout, a bad answer
                    w.stats.error("load", "%s %s" % (self.role, error_text(exc)))
                    self.conn.close()
                    self.conn = None
        finally:
            if self.conn is not None:
                # open until the parent has read the proxy's descriptors at the end
                await asyncio.sleep(max(0.0, t_end + CLOSE_AFTER - time.monotonic()))
                self.conn.writer.close()
                try:
                    await asyncio.wait_for(self.conn.writer.wait_closed(), s["timeout"])
                except (OSError, TimeoutError) as exc:
                    w.stats.error("close", error_text(exc))

    async def produce(self, t_start, t_end):
        w, s = self.w, self.w.settings
        stats, totals, group = w.stats, w.stats.totals, self.group
        batch = record_batch(s["batch_records"], s["record_size"])
        interval = 1.0 / s["produce_rate"]
        due = max(time.monotonic(), t_start + random.random() * interval)
        not_before = 0.0
        while True:
            now = time.monotonic()
            wait = max(due, not_before) - now
            if now + max(wait, 0.0) >= t_end:
                return
            if wait > 0:
                await asyncio.sleep(wait)
            sent = time.monotonic()
            answer, out, _ = await self.conn.call(
                produce_request(self.topic, self.topic_partition, batch, s["timeout_ms"]),
                ProduceResponse[9], s["timeout"] + s["max_throttle"])
            done = time.monotonic()
            if stats.window[0] <= sent < stats.window[1]:
                stats.latency[group].add(done - sent)
            part = answer.responses[0].partition_responses[0]
            if part.error_code:
                stats.error("load", "Produce error_code %d" % part.error_code)
            else:
                totals[(group, "record_bytes")] += len(batch)
                self.moved[0] += len(batch)
            totals[(group, "requests")] += 1
            totals[(group, "frame_bytes")] += out
            self.moved[1] += out
            if answer.throttle_time_ms > 0:  # KIP-219: wait it out before the next request
                totals[(group, "throttled_responses")] += 1
                totals[(group, "throttle_ms")] += answer.throttle_time_ms
                not_before = done + answer.throttle_time_ms / 1000.0
            due += interval
            if due < done:
                due = done  # late: the next goes now, missed ones are not made up

    async def consume(self, t_start, t_end):
        w, s = self.w, self.w.settings
        stats, totals, group = w.stats, w.stats.totals, self.group
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        offset = self.offset = getattr(self, "offset", 0)
        not_before = 0.0
        while True:
            now = time.monotonic()
            wait = not_before - now
            if now + max(wait, 0.0) >= t_end:
                return
            if wait > 0:
                await asyncio.sleep(wait)
            answer, _, size = await self.conn.call(
                fetch_request(self.topic, self.topic_partition, offset, s["max_wait_ms"],
                              s["fetch_max_bytes"]),
                FetchResponse[12], s["timeout"] + s["max_wait_ms"] / 1000.0 + s["max_throttle"])
            done = time.monotonic()
            if answer.error_code:
                stats.error("load", "Fetch error_code %d" % answer.error_code)
            else:
                part = answer.responses[0].partitions[0]
                if part.error_code:
                    stats.error("load", "Fetch partition error_code %d" % part.error_code)
                else:
                    got, next_offset = whole_batches(part.records or b"")
                    if next_offset is not None:
                        offset = self.offset = next_offset
                        totals[(group, "record_bytes")] += got
                        self.moved[0] += got
                    else:
                        totals[(group, "empty_fetches")] += 1
            totals[(group, "requests")] += 1
            totals[(group, "frame_bytes")] += size
            self.moved[1] += size
            if answer.throttle_time_ms > 0:
                totals[(group, "throttled_responses")] += 1
                totals[(group, "throttle_ms")] += answer.throttle_time_ms
                not_before = done + answer.throttle_time_ms / 1000.0


class Worker:
    """One load-generator process's event loop and its clients."""

    def __init__(self, worker_id, specs, node_address, settings):
        self.worker_id, self.specs = worker_id, specs
        self.node_address, self.settings = node_address, settings
        self.stats = WorkerStats()
        self.connect_gate = asyncio.Semaphore(settings["connect_concurrency"])
        self.go = asyncio.Event()
        self.times = None
        self._pending, self.connected = len(specs), 0
        self._all_ready = asyncio.Event()
        if not specs:
            self._all_ready.set()

    def client_ready(self, connected):
        self.connected += connected
        self._pending -= 1
        if self._pending == 0:
            self._all_ready.set()

    async def run(self, go_q, out_q):
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(Client(spec, self).run()) for spec in self.specs]
        await self._all_ready.wait()
        out_q.put(("ready", self.worker_id, {"connected": self.connected,
                                             "errors": dict(self.stats.errors)}))
        self.times = await loop.run_in_executor(None, go_q.get, True, 3600)
        t_start, t_measure, t_end = self.times
        self.stats.window = (t_measure, t_end)
        self.go.set()
        snaps = {}
        lag = Histogram()

        async def at(t, name):
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            snaps[name] = self.stats.snapshot()

        async def ticker():  # progress for the parent, and this loop's own lateness
            next_tick = time.monotonic()
            while time.monotonic() < t_end:
                due = time.monotonic() + 0.05
                await asyncio.sleep(0.05)
                now = time.monotonic()
                if t_measure <= now < t_end:
                    lag.add(max(1e-6, now - due))
                if now >= next_tick:
                    out_q.put(("tick", self.worker_id, (now, dict(self.stats.totals),
                                                        sum(self.stats.errors.values()))))
                    next_tick += 1.0

        helpers = [asyncio.create_task(at(t_measure, "start")),
                   asyncio.create_task(at(t_end, "end")), asyncio.create_task(ticker())]
        await asyncio.gather(*tasks, *helpers)
        return {"connected": self.connected, "start": snaps["start"], "end": snaps["end"],
                "latency": {g: h.dump() for g, h in self.stats.latency.items()},
                "loop_lag": lag.dump(), "errors": dict(self.stats.errors),
                "totals": dict(self.stats.totals)}


def raise_fd_limit():
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by the processes started after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            print("cannot raise the open-file limit: %s" % exc, file=sys.stderr)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def worker_main(worker_id, specs, node_address, settings, go_q, out_q):
    worker_signals()
    try:
        with new_runner() as runner:
            result = runner.run(Worker(worker_id, specs, node_address, settings).run(go_q, out_q))
        out_q.put(("done", worker_id, result))
    except BaseException as exc:
        out_q.put(("failed", worker_id, "%s: %s" % (type(exc).__name__, exc)))


# --------------------------------------------------------------------------- probe


async def _probe(proxy_address, broker_address, interval, timeout, go_q, out_q):
    hists = {"proxy": Histogram(), "direct": Histogram()}
    errors = Counter()
    conns = {}
    for name, address in (("proxy", proxy_address), ("direct", broker_address)):
        conns[name] = await Connection.open(*address, "kthrottle-soak-probe")
        await conns[name].call(api_versions_request(), ApiVersionsResponse[3], timeout)
    out_q.put(("ready", "probe", {}))
    loop = asyncio.get_running_loop()
    t_start, t_measure, t_end = await loop.run_in_executor(None, go_q.get, True, 3600)
    slot = time.monotonic()
    while time.monotonic() < t_end:
        for name, conn in conns.items():
            if conn is None:
                continue
            sent = time.monotonic()
            try:
                await conn.call(api_versions_request(), ApiVersionsResponse[3], timeout)
            except Exception as exc:
                errors["%s: %s" % (name, error_text(exc))] += 1
                conn.close()
                conns[name] = None
                continue
            if t_measure <= sent < t_end:
                hists[name].add(time.monotonic() - sent)
        slot += interval
        delay = slot - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            slot = time.monotonic()
    await asyncio.sleep(max(0.0, t_end + CLOSE_AFTER - time.monotonic()))
    for conn in conns.values():
        if conn is not None:
            conn.writer.close()
    return {"proxy": hists["proxy"].dump(), "direct": hists["direct"].dump(),
            "errors": dict(errors)}


def probe_main(proxy_address, broker_address, interval, timeout, go_q, out_q):
    worker_signals()
    try:
        with new_runner() as runner:
            result = runner.run(_probe(proxy_address, broker_address, interval, timeout,
                                       go_q, out_q))
        out_q.put(("done", "probe", result))
    except BaseException as exc:
        out_q.put(("failed", "probe", "%s: %s" % (type(exc).__name__, exc)))


# --------------------------------------------------------------------------- one run


def plan(connections, produce_rate, args):
    """Client specs (index, role, throttled, partition, client_id), the quota file's text
    and the offered rates. Producer p writes partition p, consumer p reads it; producers of
    partitions p % 4 == 0 and consumers of partitions p % 4 == 2 are throttled."""
    producers = (connections + 1) // 2
    consumers = connections // 2
    batch = record_batch(args.batch_records, args.record_size)
    request = produce_request(topic_name("0" * 12, 0), 0, batch, 30000)  # a name's length
    request.with_header(correlation_id=1, client_id="soak-producer-%d" % producers)
    frame = len(bytes(request.encode(header=True, framed=True)))
    produce_quota = int(args.throttle_fraction * frame * produce_rate)
    fetch_quota = int(args.throttle_fraction * len(batch) * produce_rate)
    specs, quota_lines = [], ["# written by benchmarks/soak.py: the throttled quarter"]
    for role, count, mark, quota in (("producer", producers, 0, "producer_byte_rate = %d"
                                      % produce_quota),
                                     ("consumer", consumers, 2, "consumer_byte_rate = %d"
                                      % fetch_quota)):
        for p in range(count):
            throttled = p % 4 == mark
            client_id = "soak-%s-%d" % (role, p)
            specs.append((len(specs), role, throttled, p, client_id))
            if throttled:
                quota_lines += ['[clients."%s"]' % client_id, quota]
    return {"specs": specs, "quota_file": "\n".join(quota_lines) + "\n", "producers": producers,
            "consumers": consumers, "partitions": producers, "batch_bytes": len(batch),
            "produce_frame_bytes": frame, "produce_quota": produce_quota,
            "fetch_quota": fetch_quota, "produce_rate": produce_rate,
            "throttled": sum(1 for s in specs if s[2]),
            "offered_mb_s": producers * len(batch) * produce_rate / MB}


def settle_memory(sampler, seconds=1.0, samples=5):
    """Median RSS and descriptors over a second: one reading can catch a passing spike."""
    rss, fds = [], []
    for _ in range(samples):
        r, f = sampler.memory()
        rss.append(r)
        fds.append(f)
        time.sleep(seconds / samples)
    return sorted(rss)[len(rss) // 2], sorted(fds)[len(fds) // 2]


def admin_metric_sum(port, name):
    """Sum of every sample of one metric on the proxy's /metrics (None if unreadable)."""
    try:
        return metric_sum(admin_get(port, timeout=10), name)
    except OSError:
        return None


class Inbox:
    """Messages from the load generators and the probe: the latest progress tick of each,
    and their other messages (ready, done) kept until asked for."""

    def __init__(self, out_q):
        self.out_q = out_q
        self.ticks, self.kept = {}, {}

    def poll(self, until):
        """Read messages until ``until`` (time.monotonic()); raise if one failed."""
        while True:
            left = until - time.monotonic()
            try:
                kind, who, payload = self.out_q.get(timeout=max(0.001, left))
            except queue.Empty:
                return
            if kind == "failed":
                raise RuntimeError("%s failed: %s" % (
                    "the probe" if who == "probe" else "load generator %s" % who, payload))
            if kind == "tick":
                self.ticks[who] = payload
            else:
                self.kept[(kind, who)] = payload

    def wait(self, kind, names, timeout):
        """{name: payload} of one message ``kind`` from each of ``names``."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [n for n in names if (kind, n) not in self.kept]
            if not missing:
                return {n: self.kept.pop((kind, n)) for n in names}
            if time.monotonic() >= deadline:
                raise TimeoutError("no %s from %s within %.0f s" % (kind, missing, timeout))
            self.poll(min(deadline, time.monotonic() + 0.5))


def run_load(args, connections, produce_rate, seconds, warmup, label, verbose=True):
    """One whole run (broker, proxy, probe, load generators): its figures."""
    say = print if verbose else (lambda *a, **k: None)
    p = plan(connections, produce_rate, args)
    run = Run("soak", catch=False)
    log_dir = run.log_dir
    workers, result = [], {"label": label, "connections": connections, "plan": p,
                           "log_dir": str(log_dir), "seconds": seconds, "warmup": warmup}
    started = time.monotonic()
    finished = False  # every load generator reported: they are exiting on their own
    try:
        broker = run.broker()
        prefix = uuid.uuid4().hex[:12]
        per_topic = args.partitions_per_topic
        for k in range(0, p["partitions"], per_topic):
            broker.create_topic(topic_name(prefix, k // per_topic),
                                min(per_topic, p["partitions"] - k))
        quota_path = log_dir / "quotas.toml"
        quota_path.write_text(p["quota_file"])
        proxy = run.kthrottle(broker, ["--quota-file", str(quota_path)], admin=True,
                              name="kthrottle-%s" % label)
        node = node_address("127.0.0.1", proxy.port)
        sampler = CpuSampler({"proxy": proxy.proc.pid, "broker": broker.proc.pid})
        time.sleep(1.0)
        result["rss_none"], result["fds_none"] = settle_memory(sampler)

        settings = {"topic_prefix": prefix, "partitions_per_topic": per_topic,
                    "timeout": args.request_timeout_ms / 1000.0,
                    "timeout_ms": args.request_timeout_ms, "max_wait_ms": args.max_wait_ms,
                    "fetch_max_bytes": args.fetch_max_bytes, "record_size": args.record_size,
                    "batch_records": args.batch_records, "produce_rate": produce_rate,
                    "connect_concurrency": args.connect_concurrency,
                    "max_throttle": args.max_throttle_s}
        go_q, out_q = MP.Queue(), MP.Queue()
        inbox = Inbox(out_q)
        for w in range(args.workers):
            specs = [s for s in p["specs"] if s[0] % args.workers == w]
            proc = MP.Process(target=worker_main, daemon=True,
                              args=(w, specs, node, settings, go_q, out_q))
            proc.start()
            workers.append(proc)
        t0 = time.monotonic()
        ready = inbox.wait("ready", list(range(args.workers)), timeout=60 + connections / 20)
        result["connect_seconds"] = time.monotonic() - t0
        result["connected"] = sum(r["connected"] for r in ready.values())
        say("  %d/%d connections open in %.1f s (ApiVersions and Metadata done); idle %g s"
            % (result["connected"], connections, result["connect_seconds"], args.idle_seconds),
            flush=True)
        time.sleep(args.idle_seconds)
        result["rss_idle"], result["fds_idle"] = settle_memory(sampler)
        result["proxy_connections_idle"] = admin_metric_sum(proxy.admin_port,
                                                            "kthrottle_connections")

        probe_proc = MP.Process(target=probe_main, daemon=True,
                                args=(node, (broker.host, broker.port),
                                      args.probe_interval_ms / 1000.0, settings["timeout"],
                                      go_q, out_q))
        probe_proc.start()
        workers.append(probe_proc)
        inbox.wait("ready", ["probe"], timeout=30)
        pids = {"proxy": proxy.proc.pid, "broker": broker.proc.pid, "probe": probe_proc.pid}
        pids.update({"loadgen-%d" % i: w.pid for i, w in enumerate(workers[:-1])})
        sampler = CpuSampler(pids)

        t_start = time.monotonic() + 0.5
        t_measure = t_start + warmup
        t_end = t_measure + seconds
        for _ in workers:
            go_q.put((t_start, t_measure, t_end))
        series, cpu_window, last_print = [], {}, 0.0
        prev_totals, prev_t = None, None
        measuring = False
        load_averages = [os.getloadavg()]
        while time.monotonic() < t_end:
            until = min(time.monotonic() + 1.0, t_end)
            if not measuring and time.monotonic() < t_measure:
                until = min(until, t_measure)  # the start readings at the start itself
            inbox.poll(until)
            now = time.monotonic()
            if not measuring and now >= t_measure:
                measuring = True
                result["rss_start"], result["fds_start"] = sampler.memory()
                cpu_window["start"] = (sampler.cpu_seconds(), now)
                machine_cpu0 = machine_cpu()
            if proxy.proc.poll() is not None:
                raise RuntimeError("the proxy exited (code %s); log in %s"
                                   % (proxy.proc.returncode, log_dir))
            cpu = sampler.cpu_percent()
            rss, fds = sampler.memory()
            totals = Counter()
            errors = 0
            for _, t_totals, n_errors in inbox.ticks.values():
                totals.update(t_totals)
                errors += n_errors
            row = {"t": now - t_start, "proxy_cpu": cpu.get("proxy"), "rss": rss, "fds": fds,
                   "errors": errors}
            if prev_totals is not None and now > prev_t:
                for role in ("producer", "consumer"):
                    moved = sum(totals[(g, "record_bytes")] - prev_totals[(g, "record_bytes")]
                                for g in GROUPS if g.startswith(role))
                    row[role + "_mb_s"] = moved / MB / (now - prev_t)
            prev_totals, prev_t = totals, now
            series.append(row)
            if now - last_print >= args.print_every:
                last_print = now
                say("  t=%5.0f s  proxy CPU %5.1f%%  RSS %6.1f MiB  fds %5d  produce %s MB/s"
                    "  consume %s MB/s  errors %d%s"
                    % (row["t"], row["proxy_cpu"] or 0, rss / MIB, fds,
                       fmt(row.get("producer_mb_s"), ".2f"), fmt(row.get("consumer_mb_s"), ".2f"),
                       errors, "" if measuring else "  (warm-up)"), flush=True)
        result["rss_end"], result["fds_end"] = sampler.memory()
        result["broker_rss_end"] = sampler.memory("broker")[0]
        if "start" not in cpu_window:  # a measured interval shorter than one sample
            result["rss_start"], result["fds_start"] = result["rss_end"], result["fds_end"]
            cpu_window["start"] = (sampler.cpu_seconds(), time.monotonic())
            machine_cpu0 = machine_cpu()
        cpu_window["end"] = (sampler.cpu_seconds(), time.monotonic())
        result["machine_busy_percent"] = busy_percent(machine_cpu0, machine_cpu())
        load_averages.append(os.getloadavg())
        done = inbox.wait("done", list(range(args.workers)) + ["probe"],
                          timeout=args.request_timeout_ms / 1000.0 + args.max_wait_ms / 1000.0
                          + args.max_throttle_s + 60)
        finished = True
        result["throttled_responses_proxy"] = sum(
            admin_metric_sum(proxy.admin_port, "kthrottle_%s_throttled_responses_total" % k) or 0
            for k in ("produce", "fetch"))
        time.sleep(2.0)  # the proxy closes its side of every connection
        result["rss_closed"], result["fds_closed"] = settle_memory(sampler)
        result["proxy_connections_closed"] = admin_metric_sum(proxy.admin_port,
                                                              "kthrottle_connections")
        result["proxy_alive"] = proxy.proc.poll() is None
        result["series"] = series
        result["load_averages"] = load_averages
        (c0, w0), (c1, w1) = cpu_window["start"], cpu_window["end"]
        result["cpu_percent"] = {name: (c1[name] - c0[name]) / (w1 - w0) * 100
                                 for name in c0 if c0[name] is not None and c1[name] is not None}
        result["measured_seconds"] = w1 - w0
        result.update(summarize_run(done, p, seconds, args))
    except Exception as exc:
        raise RuntimeError("%s: %s (logs in %s)" % (type(exc).__name__, exc, log_dir)) from exc
    finally:
        for proc in workers:
            if finished:
                proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        run.procs.stop_all()
    result["proxy_log"] = proxy_log_lines(log_dir)
    result["wall_seconds"] = time.monotonic() - started
    return result


def proxy_log_lines(log_dir):
    """Counts of WARNING/ERROR/Traceback lines in the proxy logs, and the first few."""
    counts, first = Counter(), []
    for path in Path(log_dir).glob("kthrottle-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            for level in ("CRITICAL", "ERROR", "WARNING", "Traceback"):
                if level in line:
                    counts[level] += 1
                    if len(first) < 5:
                        first.append(line[:200])
                    break
    return {"counts": dict(counts), "first": first}


def summarize_run(done, p, seconds, args):
    """Window figures from the load generators' and the probe's results."""
    probe = done.pop("probe")
    start, end, totals = Counter(), Counter(), Counter()
    latency = {g: Histogram() for g in GROUPS}
    loop_lag, errors = [], Counter()
    per_conn = {}
    for w in done.values():
        start.update(w["start"]["totals"])
        end.update(w["end"]["totals"])
        totals.update(w["totals"])
        for g, h in w["latency"].items():
            latency[g].merge(Histogram.load(h))
        loop_lag.append(Histogram.load(w["loop_lag"]))
        errors.update(w["errors"])
        for i, moved in w["end"]["per_conn"].items():
            before = w["start"]["per_conn"].get(i, [0, 0])
            per_conn[int(i)] = (moved[0] - before[0], moved[1] - before[1])
    errors.update({"probe " + k: v for k, v in probe["errors"].items()})

    def window(group, metric):
        return end[(group, metric)] - start[(group, metric)]

    out = {"groups": {}}
    for g in GROUPS:
        out["groups"][g] = {m: window(g, m) for m in ("requests", "record_bytes", "frame_bytes",
                                                      "throttled_responses", "throttle_ms",
                                                      "empty_fetches")}
        out["groups"][g]["reconnects"] = totals[(g, "reconnects")]
        out["groups"][g]["throttled_responses_all"] = totals[(g, "throttled_responses")]
    out["latency"] = {g: h.dump() for g, h in latency.items()}
    out["probe"] = {k: probe[k] for k in ("proxy", "direct")}
    out["loop_lag"] = [h.dump() for h in loop_lag]
    out["errors"] = dict(errors)
    # per-connection rates over the window, as a share of the quota or of the offer
    specs = {s[0]: s for s in p["specs"]}
    shares = {g: [] for g in GROUPS}
    for i, (record_bytes, frame_bytes) in per_conn.items():
        _, role, throttled, _, _ = specs[i]
        g = role + ("-throttled" if throttled else "")
        if role == "producer":
            share = (frame_bytes / seconds / p["produce_quota"] if throttled
                     else record_bytes / seconds / (p["batch_bytes"] * p["produce_rate"]))
        else:
            share = frame_bytes / seconds / p["fetch_quota"] if throttled else None
        if share is not None:
            shares[g].append(share)
    out["shares"] = {g: sorted(v) for g, v in shares.items() if v}
    return out


# --------------------------------------------------------------------------- figures


def fmt(value, spec=".1f", missing="-"):
    return missing if value is None else format(value, spec)


def mb_s(r, role, throttled=None):
    groups = [g for g in GROUPS if g.startswith(role)
              and (throttled is None or g.endswith("-throttled") == throttled)]
    return sum(r["groups"][g]["record_bytes"] for g in groups) / MB / r["seconds"]


def requests_s(r, role):
    return sum(r["groups"][g]["requests"] for g in GROUPS if g.startswith(role)) / r["seconds"]


def latency(r, group):
    return Histogram.load(r["latency"][group])


def probe(r, name):
    return Histogram.load(r["probe"][name])


def worst_loop_lag_ms(r, q=0.99):
    values = [Histogram.load(h).ms(q) for h in r["loop_lag"]]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def share_text(values):
    if not values:
        return "-"
    mid = values[len(values) // 2]
    return "%.2f (%.2f-%.2f, %d clients)" % (mid, values[0], values[-1], len(values))


def memory_per_connection(r):
    if not r.get("connected"):
        return None
    return (r["rss_idle"] - r["rss_none"]) / r["connected"]


def loadgen_cpu(r):
    return [v for k, v in sorted(r["cpu_percent"].items()) if k.startswith("loadgen-")]


def busiest(r):
    """(name, CPU %) of the busiest process of the run, and the CPU % of all of them."""
    cpu = r["cpu_percent"]
    name = max(cpu, key=cpu.get)
    return name, cpu[name], sum(cpu.values())


def outside_cpu(r, facts):
    """CPU % (of one core) that processes other than this run's took in its interval."""
    busy = r.get("machine_busy_percent")
    if busy is None:
        return None
    return max(0.0, busy * (facts["nproc"] or 1) - sum(r["cpu_percent"].values()))


def error_count(r):
    return sum(r["errors"].values())


def soak_checks(r, args):
    """[(check, held, detail)]."""
    fd_growth = r["fds_end"] - r["fds_start"]
    fd_left = r["fds_closed"] - r["fds_none"]
    rss_growth = (r["rss_end"] - r["rss_start"]) / MIB
    return [
        ("every connection connected", r["connected"] == r["connections"],
         "%d of %d" % (r["connected"], r["connections"])),
        ("no client errors", error_count(r) == 0, "%d" % error_count(r)),
        ("descriptors end - start <= %d" % args.max_fd_growth, fd_growth <= args.max_fd_growth,
         "%+d" % fd_growth),
        ("descriptors after close - before connect <= %d" % args.max_fd_growth,
         fd_left <= args.max_fd_growth, "%+d" % fd_left),
        ("RSS end - start <= %g MiB" % args.max_rss_growth_mib,
         rss_growth <= args.max_rss_growth_mib, "%+.1f MiB" % rss_growth),
        ("proxy alive at the end", r["proxy_alive"], ""),
    ]


def step_verdict(r, args):
    """(held, reason) of a --find-limit step."""
    offered = r["plan"]["produce_rate"] * r["plan"]["batch_bytes"] * (
        r["plan"]["producers"] - sum(1 for s in r["plan"]["specs"]
                                     if s[1] == "producer" and s[2])) / MB
    got = mb_s(r, "producer", throttled=False)
    p99 = probe(r, "proxy").ms(0.99)
    reasons = []
    if r["connected"] < r["connections"]:
        reasons.append("%d of %d connected" % (r["connected"], r["connections"]))
    if error_count(r):
        reasons.append("%d client errors" % error_count(r))
    if p99 is None or p99 > args.lag_limit_ms:
        reasons.append("probe p99 %s ms > %g" % (fmt(p99), args.lag_limit_ms))
    if got < HELD_FRACTION * offered:
        reasons.append("unthrottled producers got %.0f%% of their offer" % (100 * got / offered))
    return not reasons, "; ".join(reasons) or "held"


def soak_report(r, args, facts, command, checks):
    p = r["plan"]
    ms = lambda h, q: fmt(h.ms(q), ".2f")  # noqa: E731
    pu, pt = latency(r, "producer"), latency(r, "producer-throttled")
    px, dx = probe(r, "proxy"), probe(r, "direct")
    per_conn = memory_per_connection(r)
    lag = worst_loop_lag_ms(r)
    rows = [
        ("connections (producers / consumers; throttled)", "%d (%d / %d; %d)" % (
            r["connections"], p["producers"], p["consumers"], p["throttled"])),
        ("connected; time to open all (ApiVersions + Metadata)", "%d; %.1f s" % (
            r["connected"], r["connect_seconds"])),
        ("reconnects during the load", "%d" % sum(g["reconnects"] for g in r["groups"].values())),
        ("offered produce (all producers at --produce-rate)", "%.2f MB/s" % p["offered_mb_s"]),
        ("produced MB/s (unthrottled + throttled)", "%.2f (%.2f + %.2f)" % (
            mb_s(r, "producer"), mb_s(r, "producer", False), mb_s(r, "producer", True))),
        ("consumed MB/s (unthrottled + throttled)", "%.2f (%.2f + %.2f)" % (
            mb_s(r, "consumer"), mb_s(r, "consumer", False), mb_s(r, "consumer", True))),
        ("Produce / Fetch requests per second", "%.0f / %.0f" % (
            requests_s(r, "producer"), requests_s(r, "consumer"))),
        ("produce latency p50 / p99 / max ms, unthrottled", "%s / %s / %s" % (
            ms(pu, 0.5), ms(pu, 0.99), fmt(pu.maximum * 1000, ".1f"))),
        ("produce latency p50 / p99 / max ms, throttled", "%s / %s / %s" % (
            ms(pt, 0.5), ms(pt, 0.99), fmt(pt.maximum * 1000, ".1f"))),
        ("unthrottled producers: achieved / offered, median (min-max)",
         share_text(r["shares"].get("producer"))),
        ("throttled producers: achieved / producer_byte_rate (%d B/s)" % p["produce_quota"],
         share_text(r["shares"].get("producer-throttled"))),
        ("throttled consumers: achieved / consumer_byte_rate (%d B/s)" % p["fetch_quota"],
         share_text(r["shares"].get("consumer-throttled"))),
        ("responses with throttle_time_ms > 0: throttled clients / others", "%d / %d" % (
            sum(r["groups"][g]["throttled_responses"] for g in GROUPS if "throttled" in g),
            sum(r["groups"][g]["throttled_responses"] for g in GROUPS if "throttled" not in g))),
        ("whole run: responses the clients saw throttled / the proxy counted "
         "(kthrottle_*_throttled_responses_total)", "%d / %s" % (
             sum(g["throttled_responses_all"] for g in r["groups"].values()),
             fmt(r.get("throttled_responses_proxy"), ".0f"))),
        ("probe ApiVersions p50 / p99 / max ms, through the proxy", "%s / %s / %s" % (
            ms(px, 0.5), ms(px, 0.99), fmt(px.maximum * 1000, ".1f"))),
        ("probe ApiVersions p50 / p99 / max ms, direct to the broker", "%s / %s / %s" % (
            ms(dx, 0.5), ms(dx, 0.99), fmt(dx.maximum * 1000, ".1f"))),
        ("CPU %: proxy / broker / load generators", "%s / %s / %s" % (
            fmt(r["cpu_percent"].get("proxy")), fmt(r["cpu_percent"].get("broker")),
            ", ".join(fmt(v) for v in loadgen_cpu(r)))),
        ("load generators' own loop lag p99 (worst) ms", fmt(lag, ".1f")),
        ("machine CPU busy, all cores (every process, ours or not)",
         fmt(r.get("machine_busy_percent"), ".0f") + "%"),
        ("CPU %% taken by processes outside this run (of %d00%%)" % (facts["nproc"] or 1),
         fmt(outside_cpu(r, facts))),
        ("proxy RSS MiB: none / N idle / start / end / after close", " / ".join(
            "%.1f" % (r[k] / MIB) for k in ("rss_none", "rss_idle", "rss_start", "rss_end",
                                             "rss_closed"))),
        ("memory per idle connection (RSS N idle - none) / N", fmt(
            per_conn / 1024 if per_conn is not None else None, ".1f") + " KiB"),
        ("broker RSS at the end MiB (in-memory storage keeps every record)",
         "%.0f" % (r["broker_rss_end"] / MIB)),
        ("proxy descriptors: none / N idle / start / end / after close", " / ".join(
            "%d" % r[k] for k in ("fds_none", "fds_idle", "fds_start", "fds_end", "fds_closed"))),
        ("proxy's kthrottle_connections: N idle / after close", "%s / %s" % (
            fmt(r.get("proxy_connections_idle"), ".0f"),
            fmt(r.get("proxy_connections_closed"), ".0f"))),
        ("client errors (all phases)", "%d%s" % (error_count(r), "".join(
            "; %s x%d" % kv for kv in Counter(r["errors"]).most_common(5)))),
        ("proxy log WARNING / ERROR lines", "%d / %d" % (
            r["proxy_log"]["counts"].get("WARNING", 0),
            r["proxy_log"]["counts"].get("ERROR", 0)
            + r["proxy_log"]["counts"].get("CRITICAL", 0)
            + r["proxy_log"]["counts"].get("Traceback", 0))),
    ]
    lines = ["<!-- soak -->", "## Soak", "", "```", command, "```", "",
             machine_text(facts, r), "",
             "Each producer: %d records of %d B per batch (%d B batch, %d B Produce frame), "
             "%g requests/s; consumers long-poll %d ms. Throttled quarter at %g of its offer. "
             "Warm-up %g s, measured %.0f s. MB = 10^6 bytes of record batches."
             % (args.batch_records, args.record_size, p["batch_bytes"],
                p["produce_frame_bytes"], p["produce_rate"], args.max_wait_ms,
                args.throttle_fraction, r["warmup"], r["measured_seconds"]), "",
             "| figure | value |", "|---|---|"]
    lines += ["| %s | %s |" % row for row in rows]
    lines += ["", "| check | held | measured |", "|---|---|---|"]
    lines += ["| %s | %s | %s |" % (name, "yes" if ok else "**NO**", detail)
              for name, ok, detail in checks]
    requests = sum(g["requests"] for g in r["groups"].values())
    lines += ["", "Start and end are read as the measured interval (after the warm-up) begins "
              "and ends, every client connected. A connection holds two descriptors (client "
              "and broker side); the bound leaves room for the probe's and /metrics' own. The "
              "RSS bound is %s bytes per request of this run (%d requests): a leak of that much "
              "per request would break it." % (
                  fmt(args.max_rss_growth_mib * MIB / requests if requests else None, ".0f"),
                  requests)]
    lines += ["", "Over time (one row per tenth of the run):", "",
              "| t s | proxy CPU % | RSS MiB | fds | produce MB/s | consume MB/s | errors |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    series = r["series"]
    for row in series[::max(1, len(series) // 10)] + series[-1:]:
        lines.append("| %.0f | %s | %.1f | %d | %s | %s | %d |" % (
            row["t"], fmt(row["proxy_cpu"]), row["rss"] / MIB, row["fds"],
            fmt(row.get("producer_mb_s"), ".2f"), fmt(row.get("consumer_mb_s"), ".2f"),
            row["errors"]))
    if r["proxy_log"]["first"]:
        lines += ["", "First proxy log lines at WARNING or above:", "", "```"]
        lines += r["proxy_log"]["first"] + ["```"]
    lines += ["<!-- /soak -->"]
    return "\n".join(lines) + "\n"


def machine_text(facts, r):
    loads = r.get("load_averages") or []
    others = outside_cpu(r, facts)
    text = ("Machine: %s cores (%s), Python %s, kthrottle %s, %s. Load average (1 min) at the "
            "start / end of the load: %s. Everything (broker, proxy, %s load generators, "
            "probe) on this one machine."
            % (facts["nproc"], facts["cpu_model"], facts["python"], facts["kthrottle_commit"],
               facts["tansu"], " / ".join("%.2f" % la[0] for la in loads) or "-",
               len(loadgen_cpu(r))))
    if others is not None and others >= 25:
        text += (" **The machine was loaded:** processes outside this run took %.0f%% of a core "
                 "on average, so throughput and latency here are partly the machine's."
                 % others)
    return text


def limit_report(steps, args, facts, command, summary):
    lines = ["<!-- limit -->", "## Capacity (--find-limit)", "", "```", command, "```", "",
             machine_text(facts, steps[-1][1]) if steps else "", "",
             "A step holds while: every connection connects, no client error, the probe's "
             "ApiVersions p99 through the proxy <= %g ms, and the unthrottled producers get "
             ">= %d%% of what they offer. Each step: fresh broker and proxy, %g s warm-up, "
             "%g s measured." % (args.lag_limit_ms, HELD_FRACTION * 100, args.step_warmup,
                                 args.step_seconds), "",
             "| phase | connections | req/s per producer | offered MB/s | produced MB/s | "
             "consumed MB/s | Produce+Fetch req/s | produce p99 ms | probe p99 ms proxy / "
             "direct | proxy CPU % | broker CPU % | load gen CPU % | load gen lag p99 ms | "
             "KiB per idle conn | errors | busiest process; all ours (of " + str(
                 100 * (facts["nproc"] or 1)) + "%) | machine cores busy % | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---|---:"
             "|---|"]
    for phase, r, held, reason in steps:
        per_conn = memory_per_connection(r)
        lines.append("| %s | %d | %g | %.2f | %.2f | %.2f | %.0f | %s | %s / %s | %s | %s | "
                     "%s | %s | %s | %d | %s %.0f%%; %.0f%% | %s | %s |" % (
                         phase, r["connections"], r["plan"]["produce_rate"],
                         r["plan"]["offered_mb_s"], mb_s(r, "producer"), mb_s(r, "consumer"),
                         requests_s(r, "producer") + requests_s(r, "consumer"),
                         fmt(latency(r, "producer").ms(0.99), ".1f"),
                         fmt(probe(r, "proxy").ms(0.99), ".1f"),
                         fmt(probe(r, "direct").ms(0.99), ".1f"),
                         fmt(r["cpu_percent"].get("proxy")), fmt(r["cpu_percent"].get("broker")),
                         ", ".join(fmt(v) for v in loadgen_cpu(r)),
                         fmt(worst_loop_lag_ms(r), ".1f"),
                         fmt(per_conn / 1024 if per_conn is not None else None, ".1f"),
                         error_count(r), *busiest(r), fmt(r.get("machine_busy_percent"), ".0f"),
                         "held" if held else "**" + reason + "**"))
    lines += ["", summary, "<!-- /limit -->"]
    return "\n".join(lines) + "\n"


def write_section(path, section, text):
    """Replace ``<!-- section -->...<!-- /section -->`` in ``path`` (or add it), keeping the
    other mode's section."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    if not old.strip():
        old = ("# Soak and capacity of one kthrottle process (issue 15)\n\n"
               "Written by `benchmarks/soak.py`; see its docstring for what is measured.\n")
    pattern = re.compile(r"<!-- %s -->.*?<!-- /%s -->\n?" % (section, section), re.S)
    new = pattern.sub(lambda m: text, old) if pattern.search(old) else (
        old.rstrip("\n") + "\n\n" + text)
    path.write_text(new)


# --------------------------------------------------------------------------- modes


def run_soak(args, facts, command):
    print("soak: %d connections, %g s warm-up + %g s measured" % (
        args.connections, args.warmup, args.seconds), flush=True)
    r = run_load(args, args.connections, args.produce_rate, args.seconds, args.warmup, "soak")
    # the raw figures first: a report that fails to format loses nothing
    Path(r["log_dir"], "result.json").write_text(json.dumps(r, default=str))
    checks = soak_checks(r, args)
    report = soak_report(r, args, facts, command, checks)
    print()
    print(report)
    write_section(args.output, "soak", report)
    print("wrote %s" % args.output)
    failed = [name for name, ok, _ in checks if not ok]
    if failed:
        print("FAILED: %s (logs kept in %s)" % ("; ".join(failed), r["log_dir"]),
              file=sys.stderr)
        return 1
    subprocess.run(["rm", "-rf", r["log_dir"]], check=False)
    return 0


def run_find_limit(args, facts, command):
    steps = []

    def step(phase, connections, rate):
        label = "%s-%d-%g" % (phase, connections, rate)
        print("step %s: %d connections, %g Produce/s per producer" % (phase, connections, rate),
              flush=True)
        try:
            r = run_load(args, connections, rate, args.step_seconds, args.step_warmup, label,
                         verbose=args.verbose)
        except Exception as exc:  # this step failed outright: the limit is below it
            print("  failed: %s: %s" % (type(exc).__name__, exc), flush=True)
            return False, None
        held, reason = step_verdict(r, args)
        steps.append((phase, r, held, reason))
        print("  produced %.2f MB/s, consumed %.2f MB/s, probe p99 %s ms (direct %s), proxy "
              "CPU %s%%: %s" % (mb_s(r, "producer"), mb_s(r, "consumer"),
                                fmt(probe(r, "proxy").ms(0.99)), fmt(probe(r, "direct").ms(0.99)),
                                fmt(r["cpu_percent"].get("proxy")), reason), flush=True)
        if held:
            subprocess.run(["rm", "-rf", r["log_dir"]], check=False)
        return held, r

    most_connections, failed_at = None, None
    for n in args.limit_connections:
        held, r = step("connections", n, args.produce_rate)
        if not held:
            failed_at = n
            break
        most_connections = r
    # the rate phase at --connections, or at the most connections that held if fewer
    base = (min(args.connections, most_connections["connections"]) if most_connections
            else None)
    best_rate, rate_failed = None, None
    if base:
        for multiple in args.limit_rates:
            held, r = step("rate", base, args.produce_rate * multiple)
            if not held:
                rate_failed = args.produce_rate * multiple
                break
            best_rate = r
    parts = []
    if most_connections:
        parts.append("One proxy process held %d connections at %g Produce/s per producer "
                     "(%.2f MB/s produced, %.2f MB/s consumed, proxy CPU %s%%)%s."
                     % (most_connections["connections"], args.produce_rate,
                        mb_s(most_connections, "producer"), mb_s(most_connections, "consumer"),
                        fmt(most_connections["cpu_percent"].get("proxy")),
                        "; the next step (%d) did not hold" % failed_at if failed_at
                        else "; every step held"))
    else:
        parts.append("No connection step held.")
    if best_rate:
        parts.append("At %d connections it held up to %g Produce/s per producer: %.2f MB/s "
                     "produced + %.2f MB/s consumed (proxy CPU %s%%)%s."
                     % (base, best_rate["plan"]["produce_rate"], mb_s(best_rate, "producer"),
                        mb_s(best_rate, "consumer"),
                        fmt(best_rate["cpu_percent"].get("proxy")),
                        "; %g did not hold" % rate_failed if rate_failed
                        else "; every step held"))
    failed = [r for _, r, held, _ in steps if not held]
    if failed:
        name, top, ours = busiest(failed[0])
        parts.append("In the first step that did not hold the busiest process of the run was %s "
                     "at %.0f%% of a core (the run's processes %.0f%% of %d00%%; the machine's "
                     "cores %s%% busy)%s."
                     % (name, top, ours, facts["nproc"] or 1,
                        fmt(failed[0].get("machine_busy_percent"), ".0f"),
                        "" if name == "proxy" else
                        ": the proxy was not what ran out first"))
    summary = " ".join(parts)
    report = limit_report(steps, args, facts, command, summary)
    print()
    print(report)
    write_section(args.output, "limit", report)
    print("wrote %s" % args.output)
    kept = [r["log_dir"] for _, r, held, _ in steps if not held]
    if kept:
        print("logs of the steps that did not hold: %s" % ", ".join(kept))
    return 0 if steps else 1


FLAGS = (
    ("--connections", int, 1000, None),
    ("--seconds", float, 600.0, "measured soak length"),
    ("--warmup", float, 10.0, "seconds of load before the measured interval"),
    ("--idle-seconds", float, 2.0, "clients connected and idle before the proxy's RSS is read"),
    ("--workers", int, 2, "load-generator processes"),
    ("--record-size", int, 100, None),
    ("--batch-records", int, 10, "records per Produce"),
    ("--produce-rate", float, 2.0, "Produce requests per second per producer (2: about 1,000 "
     "Produce and 1,000 Fetch requests/s at 1,000 connections, well inside what a 2-core "
     "machine running broker, proxy and load generators holds; --find-limit looks for the "
     "ceiling)"),
    ("--throttle-fraction", float, 0.5, "a throttled client's quota as a share of what it offers"),
    ("--max-wait-ms", int, 500, "Fetch long poll"),
    ("--fetch-max-bytes", int, 1 << 20, None),
    ("--partitions-per-topic", int, 50, "producer p writes partition p %% N of topic p // N: "
     "every client's Metadata answer is the same size whatever --connections is"),
    ("--request-timeout-ms", int, 30000, None),
    ("--max-throttle-s", float, 12.0, "added to a request's timeout: the longest throttle a "
     "response may hold (the proxy caps byte-rate delays at ~11 s)"),
    ("--probe-interval-ms", float, 20.0, None),
    ("--connect-concurrency", int, 64, "connects in flight per load generator"),
    ("--max-fd-growth", int, 8, None),
    ("--max-rss-growth-mib", float, 32.0, None),
    ("--print-every", float, 10.0, None),
    ("--limit-connections", None, "250,500,1000,1500,2000,3000", None),
    ("--limit-rates", None, "2,4,8,16,32", "multiples of --produce-rate, at --connections"),
    ("--step-seconds", float, 20.0, None),
    ("--step-warmup", float, 5.0, None),
    ("--lag-limit-ms", float, 100.0, None),
)


def parse_args(argv=None):
    p = parser(
        "A bounded soak of one kthrottle proxy process with many raw Kafka "
        "clients (half producing, half consuming, a quarter throttled), or, with "
        "--find-limit, the connections and MB/s one process holds (issue 15).")
    add_flags(p, FLAGS)
    p.add_argument("--find-limit", action="store_true")
    p.add_argument("--verbose", action="store_true", help="progress lines inside each step")
    p.add_argument("--output", type=Path, default=argparse.SUPPRESS,  # no "(default: None)"
                   help="the Markdown file whose section this run rewrites (default: soak.md "
                   "in a new directory benchmarks/runs/soak-DATE-TIME, which git ignores)")
    args = p.parse_args(argv)
    try:
        args.limit_connections = [int(x) for x in args.limit_connections.split(",") if x.strip()]
        args.limit_rates = [float(x) for x in args.limit_rates.split(",") if x.strip()]
    except ValueError:
        p.error("--limit-connections and --limit-rates: comma-separated numbers")
    if (args.connections < 2 or args.seconds <= 0 or args.workers < 1 or args.produce_rate <= 0
            or not 0 < args.throttle_fraction < 1 or args.record_size < 1
            or args.batch_records < 1 or args.partitions_per_topic < 1):
        p.error("--connections >= 2; --seconds, --workers, --produce-rate, --record-size, "
                "--batch-records, --partitions-per-topic positive; 0 < --throttle-fraction < 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if getattr(args, "output", None) is None:
        args.output = fresh_run_dir("soak") / "soak.md"
    print("results will be written in %s" % args.output, flush=True)
    command = command_line("soak", argv)
    handle_signals()
    soft, hard = raise_fd_limit()
    needed = 2 * max([args.connections] + (args.limit_connections if args.find_limit else []))
    if soft < needed + 100:
        print("warning: open-file limit %d; the proxy needs about %d" % (soft, needed + 100),
              file=sys.stderr)
    facts = machine_facts()
    try:
        return run_find_limit(args, facts, command) if args.find_limit else run_soak(
            args, facts, command)
    except KeyboardInterrupt:
        print("\ninterrupted; every process this run started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
