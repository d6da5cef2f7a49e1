#!/usr/bin/env python3
"""How much more than its quota does a hostile tenant get through kthrottle? (issue 43, item 6)

Every technique a tenant might use to get past a quota is run, one at a time, against a
fresh ``python -m kthrottle proxy`` (default token bucket, default ``--max-throttle-ms``,
plus ``--proxy-args``) in front of one Tansu broker (in-memory storage), and what it
achieved is divided by its quota. The quota is set on the technique's own client-id
(``[clients."qe-NAME"]`` in the proxy's quota file): ``consumer_byte_rate`` or
``producer_byte_rate`` = ``--quota`` (102400 B/s), or ``request_rate`` = ``--request-rate``
(10/s) where the technique says so.

Between the proxy and the broker sits a counting relay (a forked process; Tansu advertises
its address, so every byte the proxy exchanges with the broker passes through it): it counts,
per client-id and API key, the requests that reach the broker, their bytes and the bytes of
the broker's responses, in 0.1 s bins. That is the "at the broker" column, and the measure
of the techniques whose requests get no answer a client could count (acks=0, the
broker-only APIs).

Techniques (``--only`` takes these names):

  fetch-reconnect       one Fetch v11 per connection, then reconnect (loop)
  pipelined-reconnect   100 pipelined Fetch v11 per connection, then reconnect
  pipelined-kept        100 Fetch v11 in flight on one connection, kept
  connections-50        50 connections of one client-id, each one Fetch v11 at a time
  ck-consumers-30       30 confluent-kafka consumers of one client-id, each assigned the
                        partition from offset 0 in a group of its own (seeking back to 0 at
                        the end of the partition)
  reconnect-ip-rate     fetch-reconnect with [ips."<default>"] connection_creation_rate = 10
  follower-fetch        Fetch v4 and v11 with replica_id = 1 (a follower's), reconnecting
                        whenever the proxy closes the connection: should get ~0 through
  fetch-v2-50mib        Fetch v2 (no request-wide max_bytes) with a 50 MiB partition max
  fetch-v4-big-batches  Fetch v4 on a topic of 4 MiB record batches (a broker returns at
                        least one whole batch, KIP-74)
  ck-producers-30       30 confluent-kafka producers of one client-id, batch.size 200 KB
  broker-only-apis      API keys 4-7 (LeaderAndIsr, StopReplica, UpdateMetadata,
                        ControlledShutdown), request_rate = 10: requests reaching the broker
  acks0-produce         Produce v7 acks=0 as fast as the socket takes them, request_rate =
                        10: Produce requests reaching the broker per second vs 10
  share-fetch           --share-consumers (4) of Kafka's ConsoleShareConsumer (a
                        KafkaShareConsumer with its defaults: fetch.max.bytes 50 MiB,
                        max.poll.records 500), JVMs of one client-id in one share group
                        (share.auto.offset.reset=earliest), on a topic of their own that
                        stays empty until every one of them is in the group and fetching;
                        then the clock starts and --share-fill-mb (60) MB of --fill-record
                        records go into it, straight to the broker. Counts record value
                        bytes as each record is printed. ShareFetch (key 78, KIP-932)
                        counts on consumer_byte_rate as Fetch does
  share-fetch-pipelined 100 ShareFetch v1 in flight on one connection (raw frames: share
                        session epochs 0, 1, 2, ...; each accepting what the response
                        before it acquired), for a member that FindCoordinator v4 and
                        ShareGroupHeartbeat v1 frames joined to a share group of the
                        fetch topic (and keep in it, on a connection of their own).
                        share-fetch and share-fetch-pipelined need Apache Kafka 4
                        (--broker kafka): Tansu has no share groups
  fetch-reconnect-hurried  (not in the issue's list) fetch-reconnect, but a connection
                        whose answer has not come in --give-up-ms (50) is closed and the
                        loop goes on at once, as a client in a hurry would

Raw frames are built with kafka-python 3's protocol classes and sent over plain asyncio
sockets to the partition leader's address as the proxy's Metadata gives it; responses are
read by their 4-byte length prefix and their bytes counted as they arrive (every fetch asks
from offset 0: the data need not be new). Fetches ask for what a client's defaults ask:
max_bytes 50 MiB, partition max 1 MiB (v2: 50 MiB). Before the fetch techniques the topic is
filled with ``--fill-mb`` (200 MB) of 16000 B records in batches of at most ``--fill-batch``
(16384) bytes, straight to the broker: a broker returns at least one whole batch (KIP-74),
so the batch size is the least a fetch can return, and only fetch-v4-big-batches is about
batches larger than a quota allows. Its 4 MiB batches (``--big-batches`` of them) are
written the same way.

Measures, as the issue's targets are phrased (t = 0 when the technique starts; real clients
are created and connected before that): achieved/quota over [1 s, --seconds] (default 31:
the 30 s after the first second), and over [0, 20 s] including the first second's burst.
Fetches: response bytes received. Producers: record-value bytes acknowledged. Request-rate
techniques: requests reaching the broker per second.

Load is bounded: reconnect loops open at most ``--max-connect-rate`` connections/s, raw
requests go out at most ``--max-request-rate``/s per technique, producers stop after
``--produce-cap-mb`` in all; every technique ends at --seconds. Every process started (the
broker, the relay, each proxy) is stopped by its PID, on Ctrl-C and on errors too.

``--broker kafka`` runs the same techniques through a proxy in front of Apache Kafka: a
node of its own (kthrottle/kafka_kit.py: Kafka 4.4.0, KRaft, one node, on free ports, its
jars fetched into .cache/ by scripts/kafka-jars; stopped by its PID at the end, on Ctrl-C and
errors too), or with ``--bootstrap HOST:PORT`` a broker already running there (topics made
with the admin API). Every proxy gets a port of its own for each node id (--node-ports). The
node started here also listens on [::1] only, where the machine has IPv6 loopback: the
proxies are put in front of that listener and the share consumers' JVMs use IPv4 only, so
that they cannot reach the broker but through the proxy. There is no relay on Kafka: the "at
the broker" columns and the request-rate rows stay empty. Kafka 4 no longer takes Fetch v0-3
(KIP-896), so fetch-v2-50mib only meets closed connections there.

Writes ``quota_escapes.md`` and ``quota_escapes.json`` into a new directory
``benchmarks/runs/<date-time>-quota-escapes/`` (or ``--output-dir``). Examples::

    python benchmarks/quota_escapes.py                       # all, about 7 minutes
    python benchmarks/quota_escapes.py --seconds 5 --only fetch-reconnect,acks0-produce
    python benchmarks/quota_escapes.py --proxy-args='--quota-mode window'
    python benchmarks/quota_escapes.py --broker kafka        # all, on a Kafka 4.4 node
    python benchmarks/quota_escapes.py --broker kafka --only share-fetch,share-fetch-pipelined
    python benchmarks/quota_escapes.py --broker kafka --bootstrap 127.0.0.1:9092
"""
import asyncio
import contextlib
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

with warnings.catch_warnings():  # kafka.protocol warns about its own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.protocol.metadata import MetadataRequest, MetadataResponse
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

from kthrottle_testkit import harness

NAME = "quota_escapes"
MIB = 1024 * 1024
MB = 1_000_000
FETCH_MAX_BYTES = 50 * MIB  # a client's default fetch.max.bytes (52428800)
PARTITION_MAX_BYTES = MIB  # a client's default max.partition.fetch.bytes
FOLLOWER_REPLICA_ID = 1  # any replica_id >= 0 is a follower's fetch
BROKER_ONLY_KEYS = (4, 5, 6, 7)  # LeaderAndIsr, StopReplica, UpdateMetadata, ControlledShutdown
PRODUCE, FETCH = 0, 1
BIN = 0.1  # seconds per bin of the meters and of the relay
SAMPLE_MAX = 8 * MIB  # the first response up to this size is kept and decoded for the notes


# --------------------------------------------------------------------------- the counting relay


class RelaySide(asyncio.Protocol):
    """One side of a relayed connection (as benchmarks/bare_relay.py: what it reads goes to
    the other side, which is not read while this side's write buffer is full), and it feeds
    what it reads to the connection's FrameCounter."""

    def __init__(self, live, counter, requests):
        self.live, self.counter, self.requests = live, counter, requests
        self.transport = self.other = None
        self.early = []

    def connection_made(self, transport):
        self.transport = transport
        self.live.add(self)
        transport.set_write_buffer_limits(4 * MIB, MIB)

    def data_received(self, data):
        if self.requests:
            self.counter.requests(data)
        else:
            self.counter.responses(data)
        if self.other is None or self.other.transport is None:
            self.early.append(data)
        else:
            self.other.transport.write(data)

    def pause_writing(self):
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self):
        if (self.other is not None and self.other.transport is not None
                and not self.other.transport.is_closing()):
            self.other.transport.resume_reading()

    def connection_lost(self, exc):
        self.live.discard(self)
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


class FrameCounter:
    """Cuts the two byte streams of one relayed connection into Kafka frames: each request's
    API key, client-id and size; each response's size, matched to its request by
    correlation id (an acks=0 Produce has no response). Counts go into ``stats``:
    (client_id, api_key, bin) -> [requests, request bytes, response bytes]."""

    def __init__(self, stats):
        self.stats = stats
        self.pending = {}  # correlation id -> (client_id, api_key)
        self.req_head, self.req_skip = bytearray(), 0
        self.resp_head, self.resp_skip = bytearray(), 0

    def _cell(self, client_id, api_key):
        key = (client_id, api_key, int(time.monotonic() / BIN))
        cell = self.stats.get(key)
        if cell is None:
            cell = self.stats[key] = [0, 0, 0]
        return cell

    def requests(self, data):
        i, n, head = 0, len(data), self.req_head
        while i < n:
            if self.req_skip:
                k = min(self.req_skip, n - i)
                self.req_skip -= k
                i += k
                continue
            # size, api key, version, correlation id, client-id length: 14 bytes, then the id
            need = 14
            if len(head) >= 14:
                need += max(0, struct.unpack_from(">h", head, 12)[0])
            if len(head) < need:
                take = min(need - len(head), n - i)
                head += data[i:i + take]
                i += take
                if len(head) < need or (need == 14 and struct.unpack_from(">h", head, 12)[0] > 0):
                    continue
            size, api_key, _version, correlation = struct.unpack_from(">ihhi", head)
            length = struct.unpack_from(">h", head, 12)[0]
            client_id = bytes(head[14:14 + length]).decode("utf-8", "replace") if length > 0 else ""
            cell = self._cell(client_id, api_key)
            cell[0] += 1
            cell[1] += 4 + size
            self.pending[correlation] = (client_id, api_key)
            self.req_skip = max(0, 4 + size - len(head))
            head.clear()

    def responses(self, data):
        i, n, head = 0, len(data), self.resp_head
        while i < n:
            if self.resp_skip:
                k = min(self.resp_skip, n - i)
                self.resp_skip -= k
                i += k
                continue
            take = min(8 - len(head), n - i)
            head += data[i:i + take]
            i += take
            if len(head) < 8:
                continue
            size, correlation = struct.unpack_from(">ii", head)
            client_id, api_key = self.pending.pop(correlation, ("?", -1))
            self._cell(client_id, api_key)[2] += 4 + size
            self.resp_skip = max(0, 4 + size - 8)
            head.clear()


async def _relay(port, upstream, control):
    loop = asyncio.get_running_loop()
    stats, live = {}, set()
    host, uport = upstream.rsplit(":", 1)

    def accepted():
        counter = FrameCounter(stats)
        client = RelaySide(live, counter, requests=True)

        async def connect():
            try:
                _, broker = await loop.create_connection(
                    lambda: RelaySide(live, counter, requests=False), host, int(uport))
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            broker.other, client.other = client, broker
            for data in client.early:
                broker.transport.write(data)
            client.early.clear()
            if client.transport is None or client.transport.is_closing():
                broker.transport.close()

        loop.create_task(connect())
        return client

    server = await loop.create_server(accepted, "127.0.0.1", port)

    def on_control():
        while control.poll():
            try:
                ask, client_id = control.recv()
            except EOFError:
                loop.remove_reader(control.fileno())
                return
            if ask == "bins":
                control.send([(k, b, *cell) for (c, k, b), cell in stats.items()
                              if c == client_id])
            else:
                control.send("pong")

    loop.add_reader(control.fileno(), on_control)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()
    for side in list(live):
        side.transport.abort()


def relay_main(port, upstream, control):
    """The relay's process: forwards 127.0.0.1:``port`` to ``upstream`` until SIGTERM."""
    harness.worker_signals()
    with harness.new_runner() as runner:
        runner.run(_relay(port, upstream, control))


class Relay:
    """The counting relay in a forked process, stopped by its PID with the run."""

    def __init__(self, run, port, upstream):
        self.port = port
        self.control, child = harness.MP.Pipe()
        self.proc = harness.MP.Process(target=relay_main, args=(port, upstream, child),
                                       daemon=True, name="counting-relay")
        self.proc.start()
        self.lock = threading.Lock()
        run.procs.on_stop(self.stop)
        harness.wait_for_port("127.0.0.1", port, timeout=20)
        if self._ask(("ping", None)) != "pong":
            raise RuntimeError("the counting relay does not answer")

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    def _ask(self, message, timeout=30):
        with self.lock:
            self.control.send(message)
            if not self.control.poll(timeout):
                raise RuntimeError("the counting relay did not answer within %d s" % timeout)
            return self.control.recv()

    def bins(self, client_id):
        """[(api_key, bin, requests, request bytes, response bytes)] of ``client_id``."""
        return self._ask(("bins", client_id))

    def stop(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.join(5)
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join(5)


# --------------------------------------------------------------------------- measuring


class Meter:
    """Amounts (bytes or requests) by when they happened, in BIN-second bins from t0;
    amounts outside [t0, t0 + seconds] are not kept. Safe to add to from threads."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.t0 = None
        self.bins = [0] * (int(seconds / BIN) + 1)
        self.outside = 0
        self.lock = threading.Lock()

    def add(self, amount, now=None):
        if self.t0 is None:
            return
        i = int(((time.monotonic() if now is None else now) - self.t0) / BIN)
        with self.lock:
            if 0 <= i < len(self.bins):
                self.bins[i] += amount
            else:
                self.outside += amount

    def total(self, start, end):
        """Sum over [start, end) seconds after t0."""
        lo, hi = int(round(start / BIN)), int(round(end / BIN))
        return sum(self.bins[max(0, lo):max(0, hi)])

    def per_second(self):
        per = int(round(1 / BIN))
        return [sum(self.bins[i:i + per]) for i in range(0, int(self.seconds / BIN), per)]


def windows(seconds):
    """(steady window, burst window): [1 s, seconds] and [0, min(20 s, seconds)]."""
    return (1.0, float(seconds)), (0.0, float(min(20.0, seconds)))


def ratio(meter, window, quota):
    start, end = window
    if end <= start or not quota:
        return None
    return meter.total(start, end) / ((end - start) * quota)


class Pace:
    """At most ``rate`` events per second, shared by every task that waits on it."""

    def __init__(self, rate):
        self.interval = 1.0 / rate
        self.next = 0.0

    async def wait(self):
        now = time.monotonic()
        at = max(self.next, now)
        self.next = at + self.interval
        if at - now > 0.001:
            await asyncio.sleep(at - now)


# --------------------------------------------------------------------------- techniques


@dataclass(frozen=True)
class Technique:
    name: str
    title: str
    quota_key: str  # consumer_byte_rate, producer_byte_rate or request_rate
    measure: str  # what "achieved" counts
    run: Optional[Callable] = None  # async fn(ctx)
    topic: str = "fill"  # fill, big or produce
    ip_rate: bool = False  # the quota file also has [ips."<default>"] connection_creation_rate
    needs: Optional[str] = None  # a broker this needs ("kafka"); skipped on others
    broker_keys: tuple = ()  # API keys counted "at the broker"


class Ctx:
    """What one technique's run shares: its client-id, where to connect, its meter, its
    counters and its clock."""

    def __init__(self, tech, args, leader, topic, bootstrap):
        self.tech, self.args = tech, args
        self.client_id = "qe-%s" % tech.name
        self.leader, self.topic, self.bootstrap = leader, topic, bootstrap
        self.meter = Meter(args.seconds)
        self.written = Meter(args.seconds)  # requests written (acks=0, broker-only APIs)
        self.stats = Counter()
        self.errors = Counter()
        self.largest = 0
        self.sample = None  # (api_version, payload) of the first response, if small enough
        self.first_note = None  # what the first response said, where not a Fetch's sample
        self.run = self.cluster = None  # the run and the broker side (run_technique)
        self.proxy_ports = set()  # the proxy's listeners: bootstrap and node ports
        self.lock = threading.Lock()
        self.connect_pace = Pace(args.max_connect_rate)
        self.request_pace = Pace(args.max_request_rate)
        self.t0 = self.t_end = None
        self.started = asyncio.Event()
        self.correlation = 0

    def start_clock(self):
        self.t0 = time.monotonic()
        self.t_end = self.t0 + self.args.seconds
        self.meter.t0 = self.written.t0 = self.t0
        self.started.set()

    def running(self):
        return self.t_end is None or time.monotonic() < self.t_end

    def count(self, what, n=1):
        with self.lock:
            self.stats[what] += n

    def error(self, text):
        with self.lock:
            self.errors[str(text)[:160]] += 1

    def next_correlation(self):
        self.correlation = (self.correlation + 1) & 0x7FFFFFFF
        return self.correlation

    async def connect(self):
        await self.connect_pace.wait()
        self.count("connections")
        return await asyncio.open_connection(*self.leader)


def with_correlation(template, correlation):
    """A framed request with its correlation id (bytes 8-12) replaced."""
    return template[:8] + correlation.to_bytes(4, "big") + template[12:]


def fetch_template(version, topic, client_id, replica_id=-1, max_bytes=FETCH_MAX_BYTES,
                   partition_max=PARTITION_MAX_BYTES, max_wait_ms=500):
    """A framed Fetch of partition 0 from offset 0, no fetch session (KIP-227)."""
    part = FetchRequest.FetchTopic.FetchPartition(
        partition=0, current_leader_epoch=-1, fetch_offset=0, log_start_offset=-1,
        partition_max_bytes=partition_max)
    request = FetchRequest[version](
        replica_id=replica_id, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=max_bytes,
        isolation_level=0, session_id=0, session_epoch=-1,
        topics=[FetchRequest.FetchTopic(topic=topic, partitions=[part])],
        forgotten_topics_data=[], rack_id="")
    return harness.frame_of(request, 0, client_id)


def produce_template(topic, client_id, acks=0, value_size=100, version=7):
    """A framed Produce of one record to partition 0."""
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
    builder.append(int(time.time() * 1000), None, b"x" * value_size)
    builder.close()
    data = ProduceRequest.TopicProduceData.PartitionProduceData(
        index=0, records=bytes(builder.buffer()))
    request = ProduceRequest[version](
        transactional_id=None, acks=acks, timeout_ms=30000,
        topic_data=[ProduceRequest.TopicProduceData(name=topic, partition_data=[data])])
    return harness.frame_of(request, 0, client_id)


def raw_template(api_key, client_id, version=0, body=b"\x00" * 16):
    """A request of ``api_key`` with a header (v1) and ``body``, framed."""
    cid = client_id.encode()
    frame = struct.pack(">hhih", api_key, version, 0, len(cid)) + cid + body
    return struct.pack(">i", len(frame)) + frame


async def read_counted(reader, ctx, api_version=None, whole=False):
    """One response, its bytes counted by ``ctx.meter`` as they arrive; with ``whole`` its
    payload (correlation id first) is returned."""
    head = await reader.readexactly(4)
    size = int.from_bytes(head, "big")
    ctx.meter.add(4)
    keep = [] if whole or (ctx.sample is None and size <= SAMPLE_MAX) else None
    left = size
    while left:
        chunk = await reader.read(min(left, MIB))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(chunk)
        ctx.meter.add(len(chunk))
        if keep is not None:
            keep.append(chunk)
    ctx.count("responses")
    ctx.largest = max(ctx.largest, 4 + size)
    if whole:
        return b"".join(keep)
    if keep is not None and ctx.sample is None:
        ctx.sample = (api_version, b"".join(keep))


async def close_writer(writer):
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1)
    except (asyncio.TimeoutError, OSError):
        pass


CLOSED = (asyncio.IncompleteReadError, ConnectionError)


@contextlib.asynccontextmanager
async def connection(ctx):
    """A new connection to the proxy, (reader, writer), for a technique's loop to use until
    it ends: closed by the proxy (counted), or another OSError (an error); its writer closed
    then. None when connecting failed (an error, 50 ms waited), for the loop to try again."""
    try:
        reader, writer = await ctx.connect()
    except OSError as exc:
        ctx.error("connect: %s" % exc)
        await asyncio.sleep(0.05)
        yield None
        return
    try:
        yield reader, writer
    except CLOSED:
        ctx.count("closed by the proxy")
    except OSError as exc:
        ctx.error("%s: %s" % (type(exc).__name__, exc))
    finally:
        await close_writer(writer)


async def reconnect_loop(ctx, templates, per_connection=1, answer_timeout=None):
    """Connect, write ``per_connection`` requests (cycling through ``templates``, each
    (api_version, frame)), read their responses, close; again until the end."""
    turn = 0
    while ctx.running():
        async with connection(ctx) as connected:
            if connected is None:
                continue
            reader, writer = connected
            versions = []
            for _ in range(per_connection):
                await ctx.request_pace.wait()
                version, template = templates[turn % len(templates)]
                turn += 1
                writer.write(with_correlation(template, ctx.next_correlation()))
                ctx.written.add(1)
                versions.append(version)
            try:
                for version in versions:
                    if answer_timeout is None:
                        await read_counted(reader, ctx, version)
                    else:
                        await asyncio.wait_for(read_counted(reader, ctx, version),
                                               answer_timeout)
            except asyncio.TimeoutError:
                ctx.count("connections given up (no answer in %g ms)" % (answer_timeout * 1000))


async def kept_loop(ctx, version, template, window):
    """One connection with ``window`` requests in flight: each response read brings the
    next request. A connection the proxy closes is opened again."""
    while ctx.running():
        async with connection(ctx) as connected:
            if connected is None:
                continue
            reader, writer = connected
            for _ in range(window):
                await ctx.request_pace.wait()
                writer.write(with_correlation(template, ctx.next_correlation()))
            while ctx.running():
                await read_counted(reader, ctx, version)
                await ctx.request_pace.wait()
                writer.write(with_correlation(template, ctx.next_correlation()))


def give_up(ctx):
    return ctx.args.give_up_ms / 1000.0 if ctx.args.give_up_ms > 0 else None


async def t_fetch_reconnect(ctx):
    ctx.start_clock()
    await reconnect_loop(ctx, [(11, fetch_template(11, ctx.topic, ctx.client_id))])


async def t_fetch_reconnect_hurried(ctx):
    ctx.start_clock()
    await reconnect_loop(ctx, [(11, fetch_template(11, ctx.topic, ctx.client_id))],
                         answer_timeout=give_up(ctx))


async def t_pipelined_reconnect(ctx):
    ctx.start_clock()
    await reconnect_loop(ctx, [(11, fetch_template(11, ctx.topic, ctx.client_id))], 100)


async def t_pipelined_kept(ctx):
    ctx.start_clock()
    await kept_loop(ctx, 11, fetch_template(11, ctx.topic, ctx.client_id), 100)


async def t_connections_50(ctx):
    ctx.start_clock()
    template = fetch_template(11, ctx.topic, ctx.client_id)
    await asyncio.gather(*(kept_loop(ctx, 11, template, 1) for _ in range(50)))


async def t_follower_fetch(ctx):
    ctx.start_clock()
    await reconnect_loop(ctx, [
        (v, fetch_template(v, ctx.topic, ctx.client_id, replica_id=FOLLOWER_REPLICA_ID))
        for v in (4, 11)], answer_timeout=5)


async def t_fetch_v2(ctx):
    ctx.start_clock()
    # v2 has no request-wide max_bytes: the partition max is all a proxy could cap
    await kept_loop(ctx, 2, fetch_template(2, ctx.topic, ctx.client_id,
                                           partition_max=FETCH_MAX_BYTES), 1)


async def t_fetch_v4_big(ctx):
    ctx.start_clock()
    await kept_loop(ctx, 4, fetch_template(4, ctx.topic, ctx.client_id), 1)


async def t_broker_only(ctx):
    ctx.start_clock()
    await reconnect_loop(ctx, [(0, raw_template(k, ctx.client_id)) for k in BROKER_ONLY_KEYS],
                         answer_timeout=2)


async def t_acks0(ctx):
    """Produce acks=0 on one connection as fast as the socket takes them (at most
    --max-request-rate/s); a closed connection is opened again."""
    ctx.start_clock()
    template = produce_template(ctx.topic, ctx.client_id, acks=0)
    while ctx.running():
        async with connection(ctx) as connected:
            if connected is None:
                continue
            reader, writer = connected
            watcher = asyncio.ensure_future(reader.read(65536))  # EOF: closed by the proxy
            try:
                while ctx.running() and not watcher.done():
                    await ctx.request_pace.wait()
                    writer.write(with_correlation(template, ctx.next_correlation()))
                    ctx.written.add(1)
                    if writer.transport.get_write_buffer_size() > 256 * 1024:
                        await writer.drain()  # the proxy stopped reading: wait here
                if watcher.done():
                    closed = watcher.exception() is not None or not watcher.result()
                    ctx.count("closed by the proxy" if closed else "answered (acks=0!)")
            finally:
                watcher.cancel()


# --- real clients (confluent-kafka): created and connected before the clock starts


def ck_base(ctx, errors):
    return {"bootstrap.servers": ctx.bootstrap, "client.id": ctx.client_id,
            "socket.nagle.disable": True, "log.connection.close": False,
            "error_cb": lambda err: errors.append(str(err))}


class Gate:
    """Threads say they are ready; the technique starts the clock once all are (or the
    setup timeout passes) and lets them go."""

    def __init__(self, n):
        self.n, self.ready, self.go = n, 0, threading.Event()
        self.lock = threading.Lock()

    def arrive(self):
        with self.lock:
            self.ready += 1

    def wait_go(self, stop):
        while not self.go.wait(0.05):
            harness.check_stop(stop)


def ck_consume(ctx, gate, stop):
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    errors = []
    consumer = Consumer({
        **ck_base(ctx, errors), "group.id": "qe-%s" % uuid.uuid4().hex,
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "enable.partition.eof": True,
        # librdkafka's default prefetch is 64 MiB per consumer; 16 MiB keeps 30 of them
        # within a few hundred MB should they get through
        "queued.max.messages.kbytes": 16384,
    })
    try:
        consumer.list_topics(ctx.topic, timeout=20)  # connected, metadata known
        gate.arrive()
        gate.wait_go(stop)
        consumer.assign([TopicPartition(ctx.topic, 0, 0)])
        while ctx.running() and not stop.is_set():
            n = 0
            for msg in consumer.consume(1000, 0.1):
                err = msg.error()
                if err is None:
                    n += len(msg.value() or b"") + len(msg.key() or b"")
                elif err.code() == KafkaError._PARTITION_EOF:
                    ctx.count("consumer reached the end, sought back to 0")
                    try:
                        consumer.seek(TopicPartition(ctx.topic, msg.partition(), 0))
                    except Exception as exc:
                        ctx.error("seek: %s" % exc)
                else:
                    ctx.error(str(err))
            if n:
                ctx.meter.add(n)
    finally:
        for e in errors:
            ctx.error("client: %s" % e)
        consumer.close()


def ck_produce(ctx, gate, cap, stop):
    from confluent_kafka import KafkaError, Producer

    errors = []
    purged = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
    producer = Producer({
        **ck_base(ctx, errors), "acks": 1, "linger.ms": 50,
        "batch.size": ctx.args.producer_batch, "enable.idempotence": False,
        "compression.type": "none", "request.timeout.ms": 30000,
        # librdkafka queues up to 1 GiB per producer by default: 4 MiB keeps 30 of them small
        "queue.buffering.max.kbytes": 4096,
    })
    value = os.urandom(ctx.args.producer_record)

    def delivered(err, msg):
        if err is None:
            ctx.meter.add(len(msg.value()))
        elif err.code() not in purged:
            ctx.error(str(err))

    try:
        producer.list_topics(ctx.topic, timeout=20)
        gate.arrive()
        gate.wait_go(stop)
        sent = 0
        while ctx.running() and not stop.is_set():
            if sent >= cap:
                ctx.count("producers that reached --produce-cap-mb")
                while ctx.running() and not stop.is_set():
                    producer.poll(0.1)
                break
            try:
                producer.produce(ctx.topic, value, on_delivery=delivered)
                sent += len(value)
            except BufferError:
                producer.poll(0.05)
                continue
            producer.poll(0)
    finally:
        for e in errors:
            ctx.error("client: %s" % e)
        producer.purge(in_queue=True, in_flight=True, blocking=False)
        producer.flush(5)


async def threads_with_gate(ctx, n, fn, *args, setup_timeout=120):
    gate = Gate(n)
    tasks = [asyncio.ensure_future(harness.in_thread(fn, ctx, gate, *args)) for _ in range(n)]
    deadline = time.monotonic() + setup_timeout
    while gate.ready < n and time.monotonic() < deadline:
        if any(t.done() for t in tasks):
            break  # one failed while setting up
        await asyncio.sleep(0.05)
    if gate.ready < n:
        ctx.error("%d of %d clients ready in time" % (gate.ready, n))
    ctx.count("clients", gate.ready)
    ctx.start_clock()
    gate.go.set()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            ctx.error("%s: %s" % (type(result).__name__, result))


async def t_ck_consumers(ctx):
    await threads_with_gate(ctx, 30, ck_consume)


async def t_ck_producers(ctx):
    await threads_with_gate(ctx, 30, ck_produce, ctx.args.produce_cap_mb * MB / 30)


# --- share groups (KIP-932): Apache Kafka 4 only

FIND_COORDINATOR, SHARE_GROUP_HEARTBEAT, SHARE_FETCH = 10, 76, 78
FIND_COORDINATOR_VERSION = 4  # flexible, batched keys (KIP-699)
SHARE_HEARTBEAT_VERSION = 1  # 4.1+: v1 only
SHARE_FETCH_VERSION = 1  # v0 was 4.0's early access; v2 adds acquire modes (KIP-1206)
SHARE_MAX_RECORDS = 500  # the Java share consumer's max.poll.records, asked per ShareFetch
ACCEPT = 1  # AcknowledgeType Accept
# errors a share member or session starts over from
UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH = 25, 110
SHARE_SESSION_ERRORS = {122: "SHARE_SESSION_NOT_FOUND", 123: "INVALID_SHARE_SESSION_EPOCH",
                        133: "SHARE_SESSION_LIMIT_REACHED"}
RETRIABLE_COORDINATOR = {14, 15, 16}  # load in progress, not available, not coordinator


def uvarint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def compact_string(text):
    """COMPACT_(NULLABLE_)STRING: length + 1 as an unsigned varint (0: null), UTF-8."""
    if text is None:
        return b"\x00"
    data = text.encode()
    return uvarint(len(data) + 1) + data


def compact_array(items):
    """COMPACT_ARRAY of already encoded ``items`` (None: a null array)."""
    if items is None:
        return b"\x00"
    return uvarint(len(items) + 1) + b"".join(items)


NO_TAGS = b"\x00"


def flexible_frame(api_key, version, correlation, client_id, body):
    """A framed request with header v2 (a flexible version's): the v1 header (client-id an
    INT16-length string) and no tagged fields."""
    cid = client_id.encode()
    frame = struct.pack(">hhih", api_key, version, correlation, len(cid)) + cid + NO_TAGS + body
    return struct.pack(">i", len(frame)) + frame


class Fields:
    """Reads a flexible response's fields in order."""

    def __init__(self, payload, pos=0):
        self.buf, self.pos = payload, pos

    def fixed(self, fmt):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def uvarint(self):
        shift = value = 0
        while True:
            byte = self.buf[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def bytes(self):
        """COMPACT_(NULLABLE_)BYTES or RECORDS: None or the bytes."""
        n = self.uvarint()
        if n == 0:
            return None
        data = self.buf[self.pos:self.pos + n - 1]
        self.pos += n - 1
        return data

    def string(self):
        data = self.bytes()
        return None if data is None else bytes(data).decode("utf-8", "replace")

    def uuid(self):
        data = bytes(self.buf[self.pos:self.pos + 16])
        self.pos += 16
        return data

    def count(self):
        """A COMPACT_ARRAY's length (-1: null)."""
        return self.uvarint() - 1

    def tags(self):
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.pos += self.uvarint()  # size, then skip the field

    @classmethod
    def response(cls, payload):
        """After a flexible response header (v1): correlation id, tagged fields."""
        fields = cls(payload, 4)
        fields.tags()
        return fields


def share_heartbeat_body(group, member_id, epoch, topics):
    """ShareGroupHeartbeat v1: group, member id, epoch (0 joins, -1 leaves), rack (null),
    subscribed topic names (null: unchanged)."""
    return (compact_string(group) + compact_string(member_id) + struct.pack(">i", epoch)
            + compact_string(None)
            + compact_array(None if topics is None else [compact_string(t) for t in topics])
            + NO_TAGS)


def find_coordinator_body(group):
    """FindCoordinator v4 of one group (key type 0: a group's, share groups' too)."""
    return struct.pack(">b", 0) + compact_array([compact_string(group)]) + NO_TAGS


def parse_find_coordinator(payload):
    """(node id, host, port, error code) of the one key asked."""
    f = Fields.response(payload)
    f.fixed(">i")  # throttle
    f.count()
    f.string()  # the key
    node_id, host, port = f.fixed(">i"), f.string(), f.fixed(">i")
    return node_id, host, port, f.fixed(">h")


def parse_share_heartbeat(payload):
    f = Fields.response(payload)
    answer = {"throttle_ms": f.fixed(">i"), "error": f.fixed(">h"), "message": f.string(),
              "member_id": f.string(), "epoch": f.fixed(">i"), "interval_ms": f.fixed(">i"),
              "assignment": None}
    if f.fixed(">b") >= 0:  # a nullable struct: -1 null, 1 present
        assigned = {}
        for _ in range(f.count()):
            topic_id = f.uuid()
            assigned[topic_id] = [f.fixed(">i") for _ in range(f.count())]
            f.tags()
        f.tags()
        answer["assignment"] = assigned
    return answer


def share_fetch_body(group, member_id, epoch, topic_id, acks, max_wait_ms=500,
                     max_bytes=FETCH_MAX_BYTES, max_records=SHARE_MAX_RECORDS):
    """ShareFetch v1 of partition 0 of ``topic_id``, accepting the offset ranges ``acks``
    ([(first, last)]) of it."""
    batches = [struct.pack(">qq", first, last) + compact_array([struct.pack(">b", ACCEPT)])
               + NO_TAGS for first, last in acks]
    partition = struct.pack(">i", 0) + compact_array(batches) + NO_TAGS
    topic = topic_id + compact_array([partition]) + NO_TAGS
    return (compact_string(group) + compact_string(member_id)
            + struct.pack(">iiiiii", epoch, max_wait_ms, 1, max_bytes, max_records, max_records)
            + compact_array([topic]) + compact_array([]) + NO_TAGS)


def parse_share_fetch(payload):
    """What a ShareFetch v1/v2 response says: top-level throttle and error, the partition
    errors, the record bytes and the acquired offset ranges."""
    f = Fields.response(payload)
    out = {"throttle_ms": f.fixed(">i"), "error": f.fixed(">h"), "message": f.string(),
           "partition_errors": [], "record_bytes": 0, "acquired": []}
    f.fixed(">i")  # acquisition lock timeout
    for _ in range(max(0, f.count())):
        f.uuid()
        for _ in range(max(0, f.count())):
            f.fixed(">i")  # partition index
            error, message = f.fixed(">h"), f.string()
            ack_error, ack_message = f.fixed(">h"), f.string()
            f.fixed(">i"), f.fixed(">i")  # current leader: id, epoch
            f.tags()
            records = f.bytes()
            out["record_bytes"] += len(records) if records else 0
            for _ in range(max(0, f.count())):
                first, last = f.fixed(">q"), f.fixed(">q")
                f.fixed(">h")  # delivery count
                f.tags()
                out["acquired"].append((first, last))
            f.tags()
            if error:
                out["partition_errors"].append("error %d %s" % (error, message or ""))
            if ack_error:
                out["partition_errors"].append("acknowledge error %d %s"
                                               % (ack_error, ack_message or ""))
        f.tags()
    return out


async def blocking(fn, *args):
    """``fn(*args)`` in a thread (an admin call), as harness.in_thread runs a phase."""
    return await harness.in_thread(lambda *a: fn(*a[:-1]), *args)


class CoordinatorError(Exception):
    """FindCoordinator answered with an error (the coordinator is not there yet)."""


class ShareMember:
    """One member of a share group over raw frames: FindCoordinator v4, then
    ShareGroupHeartbeat v1 on a connection of its own to the coordinator: joins, waits for
    partition 0 of the technique's topic, heartbeats at the interval the coordinator
    gives, leaves."""

    def __init__(self, ctx, group):
        self.ctx, self.group = ctx, group
        self.member_id = str(uuid.uuid4())  # a client's own, since KIP-1082
        self.epoch = 0
        self.interval = 5.0
        self.topic_id = None
        self.coordinator = None  # (host, port)
        self.reader = self.writer = None

    async def find_coordinator(self):
        """The group's coordinator as the proxy names it (its first FindCoordinator also
        makes the broker create __consumer_offsets, without which no coordinator is)."""
        ctx = self.ctx
        reader, writer = await ctx.connect()
        try:
            writer.write(flexible_frame(FIND_COORDINATOR, FIND_COORDINATOR_VERSION,
                                        ctx.next_correlation(), ctx.client_id,
                                        find_coordinator_body(self.group)))
            node_id, host, port, error = parse_find_coordinator(await asyncio.wait_for(
                harness.read_frame(reader), 30))
        finally:
            await close_writer(writer)
        if error:
            raise CoordinatorError("FindCoordinator: error %d" % error)
        self.coordinator = (host, port)

    async def heartbeat(self, epoch, topics=None):
        ctx = self.ctx
        if self.coordinator is None:
            await self.find_coordinator()
        if self.writer is None:
            await ctx.connect_pace.wait()
            ctx.count("connections")
            self.reader, self.writer = await asyncio.open_connection(*self.coordinator)
        body = share_heartbeat_body(self.group, self.member_id, epoch, topics)
        self.writer.write(flexible_frame(SHARE_GROUP_HEARTBEAT, SHARE_HEARTBEAT_VERSION,
                                         ctx.next_correlation(), ctx.client_id, body))
        try:
            answer = parse_share_heartbeat(await asyncio.wait_for(
                harness.read_frame(self.reader), 40))
        except BaseException:
            await self.close()
            raise
        if answer["interval_ms"] > 0:
            self.interval = answer["interval_ms"] / 1000.0
        return answer

    async def join(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                answer = await self.heartbeat(self.epoch, [self.ctx.topic])
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    CoordinatorError) as exc:
                last = "%s: %s" % (type(exc).__name__, exc)
                await asyncio.sleep(0.5)
                continue
            if answer["error"]:
                last = "error %d %s" % (answer["error"], answer["message"] or "")
                if answer["error"] in (UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH):
                    self.epoch = 0
                elif answer["error"] in RETRIABLE_COORDINATOR:
                    self.coordinator = None
                    await self.close()
                await asyncio.sleep(0.5)
                continue
            self.epoch = answer["epoch"]
            for topic_id, partitions in (answer["assignment"] or {}).items():
                if 0 in partitions:
                    self.topic_id = topic_id
                    return
            await asyncio.sleep(min(self.interval, 0.5))
        raise RuntimeError("the share group member was not given %s-0 in %.0f s (last: %s)"
                           % (self.ctx.topic, timeout, last))

    async def keep_alive(self):
        """Heartbeats until cancelled; a member the coordinator forgot joins again."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                answer = await self.heartbeat(self.epoch, [self.ctx.topic])
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    CoordinatorError) as exc:
                self.ctx.error("heartbeat: %s: %s" % (type(exc).__name__, exc))
                continue
            if answer["error"]:
                self.ctx.error("heartbeat: error %d" % answer["error"])
                if answer["error"] in (UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH):
                    self.epoch = 0
            else:
                self.epoch = answer["epoch"]

    async def leave(self):
        try:
            await asyncio.wait_for(self.heartbeat(-1), 5)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        await self.close()

    async def close(self):
        if self.writer is not None:
            writer, self.writer = self.writer, None
            await close_writer(writer)


async def share_fetch_kept(ctx, member, window):
    """One connection with ``window`` ShareFetch requests in flight (share session epochs
    0, 1, 2, ... in order), each response bringing the next request, which accepts the
    records that response acquired. A session the broker refuses, or a connection the
    proxy closes, starts over on a new connection at epoch 0."""
    epoch = 0

    def request(acks):
        nonlocal epoch
        body = share_fetch_body(member.group, member.member_id, epoch, member.topic_id, acks)
        epoch += 1
        return flexible_frame(SHARE_FETCH, SHARE_FETCH_VERSION, ctx.next_correlation(),
                              ctx.client_id, body)

    while ctx.running():
        async with connection(ctx) as connected:
            if connected is None:
                continue
            reader, writer = connected
            epoch = 0
            for _ in range(window):
                await ctx.request_pace.wait()
                writer.write(request([]))
            while ctx.running():
                answer = parse_share_fetch(await read_counted(reader, ctx, whole=True))
                ctx.count("record bytes in responses", answer["record_bytes"])
                if ctx.first_note is None:
                    ctx.first_note = "error %d, %d record bytes, throttle %d ms" % (
                        answer["error"], answer["record_bytes"], answer["throttle_ms"])
                for text in answer["partition_errors"]:
                    ctx.error(text)
                if answer["error"]:
                    ctx.error("ShareFetch error %d %s" % (
                        answer["error"], SHARE_SESSION_ERRORS.get(answer["error"], "")))
                    if answer["error"] in SHARE_SESSION_ERRORS:
                        ctx.count("share sessions started over")
                        break
                await ctx.request_pace.wait()
                writer.write(request(answer["acquired"]))


async def t_share_fetch_pipelined(ctx):
    group = "qe-%s-%s" % (ctx.tech.name, uuid.uuid4().hex[:6])
    await blocking(ctx.cluster.set_group_config, group, {"share.auto.offset.reset": "earliest"})
    member = ShareMember(ctx, group)
    await member.join()
    heartbeats = asyncio.ensure_future(member.keep_alive())
    ctx.start_clock()
    try:
        await share_fetch_kept(ctx, member, 100)
    finally:
        heartbeats.cancel()
        await asyncio.gather(heartbeats, return_exceptions=True)
        await member.leave()


OFFSET_PRINTED = re.compile(rb"Offset:(\d+)")


class ShareConsoleConsumer:
    """Kafka's ConsoleShareConsumer (kafka-tools; a KafkaShareConsumer with its defaults,
    acknowledging each record it prints) as a process of its own, through the proxy, in
    an IPv4-only JVM. It prints each record's partition and offset, not its value: every
    record of the topic has --fill-record value bytes, counted as it is printed."""

    def __init__(self, ctx, group, lib, index):
        from kthrottle import kafka_kit

        self.ctx = ctx
        log4j = ctx.run.path("tools-log4j2.properties")
        if not log4j.exists():
            log4j.write_text(kafka_kit.TOOL_LOG4J2)
        self.log_path = ctx.run.path("%s-consumer-%d.log" % (ctx.tech.name, index))
        self.command = [
            kafka_kit.java_binary(), "-Xmx256m", "-XX:+UseSerialGC",
            "-Djava.awt.headless=true", "-Dlog4j2.configurationFile=%s" % log4j,
            *kafka_kit.IPV4_ONLY_JVM_ARGS, "-cp", str(Path(lib) / "*"),
            kafka_kit.CONSOLE_SHARE_CONSUMER,
            "--bootstrap-server", ctx.bootstrap, "--topic", ctx.topic, "--group", group,
            "--command-property", "client.id=%s" % ctx.client_id,
            "--formatter-property", "print.value=false",
            "--formatter-property", "print.partition=true",
            "--formatter-property", "print.offset=true"]
        self.value_size = ctx.args.fill_record
        self.proc = self.thread = self._log = None
        self.records = 0
        self.offsets = Counter()

    def start(self):
        """Started from the event loop's thread: the JVM gets SIGTERM should this process
        die (PR_SET_PDEATHSIG follows the thread that forked it)."""
        from kthrottle.embedded import _die_with_parent

        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.ctx.run.procs.on_stop(self.stop)  # on Ctrl-C and errors too
        self.thread = threading.Thread(target=self._read, daemon=True,
                                       name="share-consumer-%d" % self.proc.pid)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            match = OFFSET_PRINTED.search(line)
            if match:
                self.ctx.meter.add(self.value_size)
                self.records += 1
                self.offsets[int(match.group(1))] += 1

    def node_connections(self, ports):
        """Its established TCP connections to ``ports`` (the proxy's node listeners)."""
        try:
            return sum(1 for c in psutil.Process(self.proc.pid).net_connections(kind="tcp")
                       if c.raddr and c.raddr.port in ports and c.status == "ESTABLISHED")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0

    def terminate(self):
        """SIGTERM, by its PID: its shutdown hook closes the share consumer."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, grace=10.0):
        """SIGTERM, SIGKILL ``grace`` seconds later; by its PID."""
        from kthrottle.embedded import stop_process

        if self.proc is None:
            return
        stop_process(self.proc, grace=grace)
        if self.thread is not None:
            self.thread.join(5)
        if self._log is not None:
            self._log.close()

    def log_errors(self):
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if " ERROR " in line or "Exception" in line]


def stop_consumers(consumers, grace=10.0):
    """SIGTERM to every one at once (each closes its share session, which a proxy holding
    the client-id's requests may take a while to let through), SIGKILL to those still
    there ``grace`` seconds later."""
    for c in consumers:
        c.terminate()
    deadline = time.monotonic() + grace
    for c in consumers:
        c.stop(grace=max(0.1, deadline - time.monotonic()))


async def t_share_consumers(ctx):
    """--share-consumers ConsoleShareConsumer processes of one client-id in one share group
    (share.auto.offset.reset=earliest) on a topic of the technique's own, empty until every
    consumer has its connections to the broker's node open (the coordinator's and the
    partition leader's: it is in the group and assigned) or 120 s have passed; then the
    clock starts and --share-fill-mb of records are written to the topic straight to the
    broker, while the consumers read it."""
    args, cluster = ctx.args, ctx.cluster
    group = "qe-%s-%s" % (ctx.tech.name, uuid.uuid4().hex[:6])
    await blocking(cluster.set_group_config, group, {"share.auto.offset.reset": "earliest"})
    lib = await blocking(cluster.kafka_lib)
    consumers = [ShareConsoleConsumer(ctx, group, lib, i) for i in range(args.share_consumers)]
    filler = None
    node_ports = ctx.proxy_ports - {int(ctx.bootstrap.rsplit(":", 1)[1])}
    try:
        for c in consumers:
            c.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = [c.node_connections(node_ports) >= 2 for c in consumers]
            if all(ready) or all(c.proc.poll() is not None for c in consumers):
                break
            await asyncio.sleep(0.2)
        ready = sum(c.node_connections(node_ports) >= 2 for c in consumers)
        if ready < len(consumers):
            ctx.error("%d of %d share consumers ready in time" % (ready, len(consumers)))
        ctx.count("clients", ready)
        await asyncio.sleep(1.0)  # the last one's first ShareFetch
        ctx.start_clock()
        began = time.monotonic()
        filler = asyncio.ensure_future(harness.in_thread(
            fill, cluster.bootstrap, ctx.topic, int(args.share_fill_mb * MB), args.fill_record,
            args.fill_batch, None))
        while ctx.running():
            if filler is not None and filler.done():
                if filler.exception() is not None:
                    ctx.error("filling: %s" % filler.exception())
                else:
                    ctx.count("s to fill the topic", round(time.monotonic() - began))
                filler = None
            if all(c.proc.poll() is not None for c in consumers):
                ctx.error("every share consumer exited")
                break
            await asyncio.sleep(0.1)
    finally:
        if filler is not None:
            filler.cancel()
            await asyncio.gather(filler, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, stop_consumers, consumers)
        offsets = Counter()
        for c in consumers:
            offsets.update(c.offsets)
            for line in c.log_errors()[:3]:
                ctx.error("consumer: %s" % line.strip())
        ctx.count("records", sum(offsets.values()))
        redelivered = sum(n - 1 for n in offsets.values() if n > 1)
        if redelivered:
            ctx.count("records delivered again", redelivered)
        ctx.count("consumers that got records", sum(1 for c in consumers if c.records))


BYTES_IN = "response bytes received"
VALUES_IN = "record bytes consumed"
ACKED = "record bytes acknowledged"
AT_BROKER = "requests reaching the broker"

TECHNIQUES = (
    Technique("fetch-reconnect", "one Fetch v11 per connection, then reconnect",
              "consumer_byte_rate", BYTES_IN, t_fetch_reconnect, broker_keys=(FETCH,)),
    Technique("pipelined-reconnect", "100 pipelined Fetch v11 per connection, then reconnect",
              "consumer_byte_rate", BYTES_IN, t_pipelined_reconnect, broker_keys=(FETCH,)),
    Technique("pipelined-kept", "100 pipelined Fetch v11 on one connection (kept)",
              "consumer_byte_rate", BYTES_IN, t_pipelined_kept, broker_keys=(FETCH,)),
    Technique("connections-50", "50 connections of one client-id, Fetch v11",
              "consumer_byte_rate", BYTES_IN, t_connections_50, broker_keys=(FETCH,)),
    Technique("ck-consumers-30", "30 confluent-kafka consumers of one client-id",
              "consumer_byte_rate", VALUES_IN, t_ck_consumers, broker_keys=(FETCH,)),
    Technique("reconnect-ip-rate", "reconnect loop, [ips.\"<default>\"] "
              "connection_creation_rate = 10", "consumer_byte_rate", BYTES_IN,
              t_fetch_reconnect, ip_rate=True, broker_keys=(FETCH,)),
    Technique("follower-fetch", "Fetch v4 and v11 with replica_id >= 0 (a follower's)",
              "consumer_byte_rate", BYTES_IN, t_follower_fetch, broker_keys=(FETCH,)),
    Technique("fetch-v2-50mib", "Fetch v2 with a 50 MiB partition max",
              "consumer_byte_rate", BYTES_IN, t_fetch_v2, broker_keys=(FETCH,)),
    Technique("fetch-v4-big-batches", "Fetch v4 on a topic of 4 MiB record batches",
              "consumer_byte_rate", BYTES_IN, t_fetch_v4_big, topic="big", broker_keys=(FETCH,)),
    Technique("ck-producers-30", "30 confluent-kafka producers of one client-id, 200 KB "
              "batches", "producer_byte_rate", ACKED, t_ck_producers, topic="produce",
              broker_keys=(PRODUCE,)),
    Technique("broker-only-apis", "API keys 4-7, request_rate = 10", "request_rate",
              AT_BROKER, t_broker_only, broker_keys=BROKER_ONLY_KEYS),
    Technique("acks0-produce", "acks=0 Produce, request_rate = 10", "request_rate",
              AT_BROKER, t_acks0, topic="produce", broker_keys=(PRODUCE,)),
    Technique("share-fetch", "ConsoleShareConsumer processes of one client-id in one share "
              "group (ShareFetch, key 78)", "consumer_byte_rate", VALUES_IN, t_share_consumers,
              topic="share", needs="kafka"),
    Technique("share-fetch-pipelined", "100 pipelined ShareFetch v1 on one connection (kept)",
              "consumer_byte_rate", BYTES_IN, t_share_fetch_pipelined, needs="kafka"),
    Technique("fetch-reconnect-hurried", "(extra) fetch-reconnect, giving up on an answer "
              "after --give-up-ms", "consumer_byte_rate", BYTES_IN, t_fetch_reconnect_hurried,
              broker_keys=(FETCH,)),
)
BY_NAME = {t.name: t for t in TECHNIQUES}


# --------------------------------------------------------------------------- set-up


class Cluster:
    """The broker side: a Tansu broker behind the counting relay; or (--broker kafka) an
    Apache Kafka node, started here with kthrottle/kafka_kit.py unless --bootstrap names one
    already running (no relay then: nothing counted at the broker).

    ``bootstrap`` is where the set-up (topics, fills, group configs) goes, straight to the
    broker; ``upstream`` is what each proxy is put in front of. A Kafka node started here
    has a second listener on [::1] only, where there is IPv6 loopback: the proxies use that
    one and the Java share consumers run with IPv4 sockets only, so that they cannot reach
    the broker but through the proxy (as tests/test_share_groups.py does)."""

    def __init__(self, run, args):
        self.kind = args.broker
        self.relay = self.broker = self.kafka = None
        self.lib = None  # Kafka's jars (--broker kafka): ConsoleShareConsumer
        self.node_ids = []  # Kafka's node ids: each gets a proxy port of its own
        self.log_dir = run.log_dir
        if self.kind == "tansu":
            relay_port = harness.free_port()
            self.broker = run.broker(advertised_port=relay_port)
            self.relay = Relay(run, relay_port, self.broker.bootstrap)
            self.bootstrap = self.upstream = self.relay.address
            self.description = "Tansu (in memory) behind a counting relay"
            print("Tansu broker pid %d on %s behind the counting relay pid %d on %s"
                  % (self.broker.proc.pid, self.broker.bootstrap, self.relay.proc.pid,
                     self.bootstrap), flush=True)
            return
        from kthrottle import kafka_kit

        if args.bootstrap:
            self.bootstrap = self.upstream = args.bootstrap
            self.description = "Apache Kafka at %s (started by someone else; no relay: " \
                "nothing counted at the broker)" % args.bootstrap
            print("broker at %s (--broker kafka --bootstrap: started by someone else)"
                  % self.bootstrap, flush=True)
        else:
            self.lib = kafka_kit.fetch_kafka_lib()
            kafka = kafka_kit.KafkaBroker(
                workdir=run.path("kafka"), lib=self.lib, log_path=run.path("kafka.log"),
                ipv6_listener=kafka_kit.ipv6_loopback(), heap="1g")
            # stopped by its PID with the run (and by start itself if it fails)
            run.procs.on_stop(lambda: kafka.stop(keep=False))
            began = time.monotonic()
            kafka.start()
            self.kafka = kafka
            self.bootstrap = kafka.bootstrap
            self.upstream = kafka.bootstrap_ipv6 or kafka.bootstrap
            self.description = (
                "Apache Kafka %s (KRaft, one node, started by this run; the proxies in front "
                "of its %s listener; no relay: nothing counted at the broker)"
                % (kafka.version, "[::1]-only" if kafka.bootstrap_ipv6 else "127.0.0.1"))
            print("Apache Kafka %s pid %d on %s%s, up in %.1f s (log %s)"
                  % (kafka.version, kafka.proc.pid, kafka.bootstrap,
                     " and %s" % kafka.bootstrap_ipv6 if kafka.bootstrap_ipv6 else "",
                     time.monotonic() - began, kafka.log_path), flush=True)
        host, port = self.bootstrap.rsplit(":", 1)
        brokers, _controller = kafka_kit.metadata_brokers(host, int(port), timeout=10)
        self.node_ids = sorted(b[0] for b in brokers)

    def kafka_lib(self):
        """Kafka's jars (fetched by scripts/kafka-jars if need be)."""
        if self.lib is None:
            from kthrottle import kafka_kit

            self.lib = kafka_kit.fetch_kafka_lib()
        return self.lib

    def proxy_args(self):
        """Flags every proxy gets from the broker side, and the node ports they name: on
        Kafka each node id its own free port (Tansu's node 111 is start_kthrottle's)."""
        if not self.node_ids:
            return [], []
        ports = [harness.free_port() for _ in self.node_ids]
        spec = ",".join("%d=%d" % item for item in zip(self.node_ids, ports))
        return ["--node-ports", spec], ports

    def alive(self):
        if self.broker is not None and self.broker.proc.poll() is not None:
            return "the Tansu broker exited (code %s)" % self.broker.proc.returncode
        if self.relay is not None and not self.relay.proc.is_alive():
            return "the counting relay exited"
        if self.kafka is not None and (self.kafka.proc is None
                                       or self.kafka.proc.poll() is not None):
            return "Apache Kafka exited; the end of its log:\n%s" % self.kafka.log_tail()
        return None

    def admin(self):
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "client.id": "qe-setup"})

    def create_topic(self, name, partitions, config=None):
        if self.kind == "tansu":
            harness.create_topic(self.broker.bootstrap, name, partitions)
            return
        from confluent_kafka.admin import NewTopic

        admin = self.admin()  # kept until answered: a dropped client cancels its futures
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])
        for f in futures.values():
            f.result(30)

    def set_group_config(self, group, settings):
        """Group configs (KIP-848, KIP-932), e.g. share.auto.offset.reset=earliest: a share
        group starts at the latest offset unless told otherwise."""
        from kthrottle import kafka_kit

        kafka_kit.set_group_config(self.admin(), group, settings)

    def delete_topic(self, name):
        try:
            if self.kind == "tansu":
                harness.delete_topic(self.broker.bootstrap, name)
                return
            admin = self.admin()  # alive until answered
            for f in admin.delete_topics([name]).values():
                f.result(30)
        except Exception as exc:
            print("    ! deleting topic %s: %s" % (name, exc), flush=True)


def fill(bootstrap, topic, total_bytes, record_size, batch_size, message_max, stop):
    """``total_bytes`` of ``record_size`` records to partition 0, straight to the broker,
    in batches of at most ``batch_size`` bytes."""
    from confluent_kafka import Producer

    errors = []
    conf = {"bootstrap.servers": bootstrap, "client.id": "qe-fill", "acks": 1,
            "linger.ms": 5, "batch.size": batch_size,
            "compression.type": "none", "enable.idempotence": False,
            "queue.buffering.max.kbytes": 262144, "error_cb": errors.append,
            "log.connection.close": False}
    if message_max:
        conf["message.max.bytes"] = message_max
    producer = Producer(conf)
    acks = harness.Acks()
    value = os.urandom(record_size)
    n = max(1, total_bytes // record_size)
    try:
        for _ in range(n):
            while True:
                try:
                    producer.produce(topic, value, partition=0, on_delivery=acks)
                    break
                except BufferError:
                    harness.check_stop(stop)
                    producer.poll(0.05)
            producer.poll(0)
        harness.ck_flush(producer, stop)
        acks.check(n, errors)
        return n
    finally:
        harness.ck_close(producer)


async def leader_of(bootstrap, topic, client_id="qe-setup"):
    """(host, port) of partition 0's leader as the proxy at ``bootstrap`` names it."""
    host, port = bootstrap.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        request = MetadataRequest[1](topics=[MetadataRequest.MetadataRequestTopic(name=topic)])
        answer = await harness.call(reader, writer, request, 1, MetadataResponse[1], client_id)
    finally:
        await close_writer(writer)
    brokers = {b.node_id: (b.host, b.port) for b in answer.brokers}
    for t in answer.topics:
        for p in t.partitions:
            if t.name == topic and p.partition_index == 0 and p.leader_id in brokers:
                return brokers[p.leader_id]
    raise RuntimeError("no leader of %s-0 in the proxy's Metadata answer" % topic)


def quota_file_text(tech, client_id, args):
    value = args.request_rate if tech.quota_key == "request_rate" else args.quota
    lines = ["# written by benchmarks/quota_escapes.py for %s" % tech.name, "",
             '[clients."%s"]' % client_id, "%s = %s" % (tech.quota_key, value)]
    if tech.ip_rate:
        lines += ["", '[ips."<default>"]', "connection_creation_rate = 10"]
    return "\n".join(lines) + "\n"


def proxy_metrics(proxy, client_id):
    """The proxy's /metrics samples labelled with ``client_id``, and its connection
    creation counters."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    try:
        text = harness.admin_get(proxy.admin_port)
    except Exception as exc:
        return {"error": str(exc)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("client_id") == client_id or s.name.startswith(
                    ("kthrottle_connections_created", "kthrottle_connection_creation",
                     "kthrottle_connections_refused")):
                key = s.name + "".join("{%s=%s}" % kv for kv in sorted(s.labels.items())
                                       if kv[0] != "client_id")
                out[key] = s.value
    return out


# --------------------------------------------------------------------------- one technique


def describe_sample(sample):
    """What the first response said: error codes and record bytes, per partition."""
    if sample is None:
        return None
    version, payload = sample
    if version is None or len(payload) < 4:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            answer = FetchResponse[version].decode(payload[4:])
        parts = []
        for t in answer.responses:
            for p in t.partitions:
                records = p.records
                size = len(records) if isinstance(records, (bytes, bytearray, memoryview)) else (
                    0 if records is None else len(bytes(records)))
                parts.append("error %d, %d record bytes, throttle %d ms" % (
                    p.error_code, size, getattr(answer, "throttle_time_ms", 0) or 0))
        return "; ".join(parts) or "no partitions"
    except Exception as exc:
        return "undecodable (%s)" % exc


async def measure(tech, ctx, args):
    task = asyncio.ensure_future(tech.run(ctx))
    try:
        started = asyncio.ensure_future(ctx.started.wait())
        await asyncio.wait([task, started], timeout=180, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
        if not ctx.started.is_set():
            raise RuntimeError("the technique did not start within 180 s")
        await asyncio.wait([task], timeout=max(0.0, ctx.t_end - time.monotonic()))
    finally:
        if not task.done():
            task.cancel()
        try:
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)
        except asyncio.TimeoutError:
            ctx.error("the technique's clients took over 60 s to stop")
    if task.done() and not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        ctx.error("%s: %s" % (type(exc).__name__, exc))


def broker_counts(cluster, tech, ctx):
    """The relay's counts for this client-id: per-second-bin Meter of what reached the
    broker (requests for request_rate techniques, else Fetch response / Produce request
    bytes) and totals."""
    if cluster.relay is None:
        return None, None
    meter = Meter(ctx.args.seconds)
    meter.t0 = ctx.t0
    totals = Counter()
    for api_key, b, requests, request_bytes, response_bytes in cluster.relay.bins(ctx.client_id):
        totals["requests api %d" % api_key] += requests
        if api_key not in tech.broker_keys:
            continue
        if tech.quota_key == "request_rate":
            amount = requests
        elif api_key == FETCH:
            amount = response_bytes
        else:
            amount = request_bytes
        meter.add(amount, (b + 0.5) * BIN)
    return meter, dict(totals)


def run_technique(runner, run, cluster, topics, tech, args):
    """One technique against a fresh proxy: its result row."""
    row = {"name": tech.name, "title": tech.title, "quota_key": tech.quota_key,
           "quota": args.request_rate if tech.quota_key == "request_rate" else args.quota,
           "measure": tech.measure}
    if tech.needs and tech.needs != cluster.kind:
        row["skipped"] = "needs Apache Kafka 4 (--broker kafka)"
        return row
    if tech.run is None:
        row["skipped"] = "not written yet"
        return row
    client_id = "qe-%s" % tech.name
    quota_file = run.path("quotas-%s.toml" % tech.name)
    quota_file.write_text(quota_file_text(tech, client_id, args))
    topic = topics[tech.topic]
    own_topic = tech.topic in ("produce", "share")
    if own_topic:  # a topic of the technique's own: 3 partitions to produce to, or 1 empty
        topic = "qe-%s-%s-%s" % (tech.topic, tech.name, uuid.uuid4().hex[:6])
        cluster.create_topic(topic, 3 if tech.topic == "produce" else 1)
    try:
        node_args, node_ports = cluster.proxy_args()
        proxy = run.kthrottle(cluster.upstream, ["--quota-file", str(quota_file), *node_args,
                                                 *args.proxy_args],
                              admin=True, name="kthrottle-%s" % tech.name,
                              probe=cluster.kind == "tansu")
        print("  %s: %s (proxy pid %d on %s) ..." % (tech.name, tech.title, proxy.proc.pid,
                                                      proxy.bootstrap), flush=True)
        try:
            leader = runner.run(asyncio.wait_for(leader_of(proxy.bootstrap, topic), 30))
            ctx = Ctx(tech, args, leader, topic, proxy.bootstrap)
            ctx.run, ctx.cluster = run, cluster
            ctx.proxy_ports = {proxy.port, *(node_ports or [proxy.node_port])}
            runner.run(measure(tech, ctx, args))
            row["proxy_metrics"] = proxy_metrics(proxy, client_id)
            row["proxy_alive"] = proxy.proc.poll() is None
        finally:
            run.procs.stop(proxy.proc)
    finally:
        if own_topic:
            cluster.delete_topic(topic)
    steady, burst = windows(args.seconds)
    quota = row["quota"]
    main = ctx.meter
    at_broker, totals = broker_counts(cluster, tech, ctx)
    if tech.measure == AT_BROKER:
        if at_broker is not None:
            main = at_broker
        else:  # no relay (--broker kafka): what the client wrote says nothing of it
            main = None
            row["measure"] = "requests reaching the broker: not counted without the relay"
    row.update({
        "steady": ratio(main, steady, quota) if main else None,
        "burst": ratio(main, burst, quota) if main else None,
        "broker_steady": ratio(at_broker, steady, quota) if at_broker else None,
        "broker_burst": ratio(at_broker, burst, quota) if at_broker else None,
        "client_steady": ratio(ctx.meter, steady, quota),
        "per_second": [round(x / quota, 3) for x in main.per_second()] if main else None,
        "counted_total": sum(main.bins) if main else None,
        "requests_written": sum(ctx.written.bins),
        "broker_totals": totals,
        "stats": dict(ctx.stats), "errors": dict(ctx.errors.most_common(8)),
        "largest_response": ctx.largest or None,
        "first_response": ctx.first_note or (describe_sample(ctx.sample) if tech.quota_key
                                              == "consumer_byte_rate" and tech.measure
                                              == BYTES_IN else None),
    })
    print("    achieved/quota %s (1-%g s), %s (0-%g s); at the broker %s, %s; %s" % (
        fx(row["steady"]), steady[1], fx(row["burst"]), burst[1], fx(row["broker_steady"]),
        fx(row["broker_burst"]), notes(row)), flush=True)
    return row


# --------------------------------------------------------------------------- reporting


def fx(value):
    if value is None:
        return "-"
    return "%.2fx" % value if value < 100 else "%.0fx" % value


def human_bytes(n):
    if n is None:
        return "-"
    for unit, size in (("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return "%.1f %s" % (n / size, unit)
    return "%d B" % n


def notes(row):
    if row.get("skipped"):
        return row["skipped"]
    stats = dict(row.get("stats", {}))
    parts = []
    conns = stats.pop("connections", 0)
    closed = stats.pop("closed by the proxy", 0)
    if conns:
        parts.append("%d connections%s" % (conns, " (%d closed by the proxy)" % closed
                                           if closed else ""))
    responses = stats.pop("responses", 0)
    if responses or row["measure"] == BYTES_IN:
        parts.append("%d responses" % responses)
    if row.get("largest_response"):
        parts.append("largest %s" % human_bytes(row["largest_response"]))
    if row.get("requests_written") and row["quota_key"] == "request_rate":
        parts.append("%d requests written" % row["requests_written"])
    parts += ["%s: %d" % kv for kv in stats.items()]
    if row.get("first_response"):
        parts.append("first response: %s" % row["first_response"])
    if row.get("errors"):
        parts.append("errors: " + "; ".join("%s (x%d)" % kv for kv in list(
            row["errors"].items())[:3]))
    if row.get("proxy_alive") is False:
        parts.append("THE PROXY EXITED")
    return ", ".join(parts)


def markdown_report(rows, facts, args, command, elapsed, stopped, failures):
    steady, burst = windows(args.seconds)
    lines = [
        "# Quota escapes (issue 43, item 6)", "",
        "```", command, "```", "",
        "%s cores (%s), Python %s, kthrottle %s%s, confluent-kafka %s (librdkafka %s). "
        "Broker: %s. A fresh proxy per technique: default token bucket, default "
        "--max-throttle-ms%s. Quotas on the technique's client-id: byte rates %d B/s, "
        "request_rate %g/s. %g s per technique; achieved/quota over [%g s, %g s] and over "
        "[%g s, %g s]. Run time %.0f s%s."
        % (facts["nproc"], facts["cpu_model"], facts["python"], facts["kthrottle_commit"],
           ", " + facts["tansu"] if args.broker == "tansu" else "", facts["confluent_kafka"],
           facts["librdkafka"],
           facts["broker"],
           (", extra flags %s" % shlex.join(args.proxy_args)) if args.proxy_args else "",
           args.quota, args.request_rate, args.seconds, steady[0], steady[1], burst[0],
           burst[1], elapsed, (" (%s)" % stopped) if stopped else ""), "",
    ]
    table = []
    for r in rows:
        quota = "%s %s" % (r["quota_key"], format(r["quota"], "g"))
        table.append([r["name"], r["title"], quota, "-" if r.get("skipped") else r["measure"],
                      fx(r.get("steady")), fx(r.get("burst")), fx(r.get("broker_steady")),
                      fx(r.get("broker_burst")), notes(r)])
    lines += harness.markdown_table(
        ["technique", "what it does", "quota", "achieved counts", "achieved/quota %g-%g s"
         % steady, "achieved/quota %g-%g s" % burst, "at the broker %g-%g s" % steady,
         "at the broker %g-%g s" % burst, "notes"],
        table, align="llllrrrrl")
    lines += [
        "",
        "\"at the broker\" is what the counting relay between the proxy and the broker saw "
        "for the client-id: Fetch response bytes, Produce request bytes, or requests (for the "
        "request_rate techniques, where it is also the achieved figure). It runs ahead of the "
        "client's count when the proxy holds a response it already has. Fetches ask for "
        "max_bytes 50 MiB and 1 MiB per partition (v2: 50 MiB per partition), from offset 0; "
        "real clients use librdkafka's defaults except as noted in the script. The fetched "
        "topic holds %g MB of %d B records in batches of at most %d B (a fetch returns at "
        "least one whole batch). fetch-reconnect-hurried gives up on a connection whose "
        "answer has not come in %g ms; the reconnect loops open at most %g connections/s; "
        "raw requests "
        "go out at most %g/s per technique; the 30 producers stop after %g MB in all."
        % (args.fill_mb, args.fill_record, args.fill_batch, args.give_up_ms,
           args.max_connect_rate, args.max_request_rate, args.produce_cap_mb),
    ]
    if args.broker == "kafka":
        lines[-1] += (
            " share-fetch runs %d ConsoleShareConsumer JVMs (Kafka's own share consumer, its "
            "defaults: fetch.max.bytes 50 MiB, max.poll.records 500), one client-id, one share "
            "group, on a topic of their own that gets %g MB of %d B records once all are in "
            "the group (records counted as printed, %d B each); share-fetch-pipelined keeps "
            "100 ShareFetch v1 (max_bytes 50 MiB, max_records %d) in flight on one connection "
            "for one member, accepting what each response acquired."
            % (args.share_consumers, args.share_fill_mb, args.fill_record, args.fill_record,
               SHARE_MAX_RECORDS))
    if failures:
        lines += ["", "Failures:", ""] + ["- %s" % f for f in failures]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = harness.parser(__doc__.split("\n\n")[0] + " Writes quota_escapes.md and "
                       "quota_escapes.json; see the script's docstring for the techniques.")
    p.add_argument("--seconds", type=float, default=31.0,
                   help="how long each technique runs; achieved/quota is taken over "
                   "[1 s, SECONDS] and [0, min(20 s, SECONDS)]")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="run these techniques only, of: %s" % ", ".join(BY_NAME))
    p.add_argument("--quota", type=int, default=102400,
                   help="consumer_byte_rate / producer_byte_rate of the techniques, B/s")
    p.add_argument("--request-rate", type=float, default=10.0,
                   help="request_rate of the request-rate techniques, requests/s")
    p.add_argument("--proxy-args", default="", metavar="FLAGS",
                   help="extra flags for every proxy, one string (e.g. "
                   "--proxy-args='--quota-mode window')")
    p.add_argument("--broker", choices=("tansu", "kafka"), default="tansu",
                   help="tansu: start one (in memory) behind a counting relay; kafka: start "
                   "an Apache Kafka 4.4 node (KRaft, kthrottle/kafka_kit.py, jars through "
                   "scripts/kafka-jars), or use the broker already running at --bootstrap "
                   "(nothing is counted at the broker then)")
    p.add_argument("--bootstrap", metavar="HOST:PORT",
                   help="--broker kafka: a broker already running there, instead of one "
                   "started here")
    p.add_argument("--share-consumers", type=int, default=4,
                   help="ConsoleShareConsumer processes (JVMs) of the share-fetch technique")
    p.add_argument("--share-fill-mb", type=float, default=60.0,
                   help="MB written to share-fetch's topic once its consumers are ready")
    p.add_argument("--fill-mb", type=float, default=200.0,
                   help="MB written to the fetch techniques' topic first")
    p.add_argument("--fill-record", type=int, default=16000,
                   help="record value size of that topic")
    p.add_argument("--fill-batch", type=int, default=16384,
                   help="batch.size of its producer: a broker returns at least one whole "
                   "batch (KIP-74), so this is the smallest a fetch response can be "
                   "(librdkafka's default, 1000000, makes every fetch ~10 s of a 100 KB/s "
                   "quota)"),
    p.add_argument("--give-up-ms", type=float, default=50.0,
                   help="fetch-reconnect-hurried closes a connection whose answer has not "
                   "come in this long and connects again at once (0: it waits, as "
                   "fetch-reconnect does)")
    p.add_argument("--big-batches", type=int, default=20,
                   help="4 MiB record batches written to the topic of fetch-v4-big-batches")
    p.add_argument("--max-connect-rate", type=float, default=200.0,
                   help="most connections a technique opens per second")
    p.add_argument("--max-request-rate", type=float, default=2000.0,
                   help="most raw requests a technique sends per second")
    p.add_argument("--produce-cap-mb", type=float, default=1000.0,
                   help="the 30 producers stop after this many MB in all")
    p.add_argument("--producer-batch", type=int, default=200_000,
                   help="batch.size of the 30 producers")
    p.add_argument("--producer-record", type=int, default=10_000,
                   help="record value size of the 30 producers")
    harness.add_output_dir(p, help="where quota_escapes.md and quota_escapes.json are written")
    args = p.parse_args(argv)
    if not 2 <= args.seconds <= 600:
        p.error("--seconds must be between 2 and 600")
    if args.only:
        args.only = harness.names(args.only)
        unknown = [n for n in args.only if n not in BY_NAME]
        if unknown or not args.only:
            p.error("--only: unknown %s (choose from %s)" % (", ".join(unknown),
                                                             ", ".join(BY_NAME)))
    else:
        args.only = list(BY_NAME)
    if args.bootstrap and args.broker != "kafka":
        p.error("--bootstrap is for --broker kafka")
    if min(args.quota, args.request_rate, args.max_connect_rate, args.max_request_rate,
           args.produce_cap_mb, args.producer_batch, args.producer_record, args.fill_record,
           args.fill_batch, args.share_consumers, args.share_fill_mb) <= 0 \
            or args.give_up_ms < 0 \
            or args.fill_mb < 1 or args.big_batches < 1:
        p.error("quotas, rates, sizes and counts must be positive (--fill-mb at least 1)")
    try:
        args.proxy_args = shlex.split(args.proxy_args)
    except ValueError as exc:
        p.error("--proxy-args: %s" % exc)
    return args


def output_dir(args):
    """--output-dir, or a new benchmarks/runs/<date-time>-quota-escapes/."""
    given = getattr(args, "output_dir", None)
    if given is not None:
        out = Path(given)
        out.mkdir(parents=True, exist_ok=True)
    else:
        harness.RUNS.mkdir(parents=True, exist_ok=True)
        stem = "%s-quota-escapes" % time.strftime("%Y%m%d-%H%M%S")
        for n in range(1, 1000):
            out = harness.RUNS / (stem if n == 1 else "%s-%d" % (stem, n))
            try:
                out.mkdir()
                break
            except FileExistsError:
                continue
    args.output_dir = out
    print("results will be written in %s" % out, flush=True)
    return out


def prepare_topics(runner, cluster, techniques, args):
    """The fetch topic (filled) and the big-batch topic, as the techniques need them."""
    run_id = uuid.uuid4().hex[:6]
    topics = {"fill": "qe-fill-%s" % run_id, "big": "qe-big-%s" % run_id, "produce": None,
              "share": None}
    techniques = [t for t in techniques if t.run and t.needs in (None, cluster.kind)]
    if any(t.topic == "fill" for t in techniques):
        cluster.create_topic(topics["fill"], 1)
        t = time.monotonic()
        n = runner.run(harness.in_thread(fill, cluster.bootstrap, topics["fill"],
                                         int(args.fill_mb * MB), args.fill_record,
                                         args.fill_batch, None))
        print("filled %s: %d records of %d B in batches of up to %d B (%.0f MB) in %.1f s"
              % (topics["fill"], n, args.fill_record, args.fill_batch,
                 n * args.fill_record / MB, time.monotonic() - t), flush=True)
    if any(t.topic == "big" for t in techniques):
        cluster.create_topic(topics["big"], 1, config={"max.message.bytes": str(16 * MIB)})
        t = time.monotonic()
        # one record per batch: a batch of 4 MiB with its headers
        n = runner.run(harness.in_thread(fill, cluster.bootstrap, topics["big"],
                                         args.big_batches * (4 * MIB - 128), 4 * MIB - 128,
                                         4 * MIB + 1024, 16 * MIB))
        print("filled %s: %d batches of 4 MiB in %.1f s" % (topics["big"], n,
                                                             time.monotonic() - t), flush=True)
    return topics


def main(argv=None):
    args = parse_args(argv)
    output_dir(args)
    command = harness.command_line(NAME, argv)
    facts = harness.machine_facts()
    techniques = [BY_NAME[n] for n in args.only]
    rows, failures = [], []
    with harness.Run(NAME) as run:
        cluster = Cluster(run, args)
        facts["broker"] = cluster.description
        print("logs and quota files in %s" % run.log_dir, flush=True)
        with harness.new_runner() as runner:
            topics = prepare_topics(runner, cluster, techniques, args)
            for tech in techniques:
                try:
                    rows.append(run_technique(runner, run, cluster, topics, tech, args))
                except (KeyboardInterrupt, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    text = "%s: %s: %s" % (tech.name, type(exc).__name__, exc)
                    failures.append(text)
                    print("    ! " + text, flush=True)
                    rows.append({"name": tech.name, "title": tech.title,
                                 "quota_key": tech.quota_key, "quota": args.quota,
                                 "measure": tech.measure, "skipped": "failed: %s" % exc})
                dead = cluster.alive()
                if dead:
                    raise RuntimeError(dead)
    elapsed = run.elapsed
    if run.failure:
        failures.append(run.failure)
    if not rows:
        print("nothing measured", file=sys.stderr)
        return run.finish(failed=True)
    report = markdown_report(rows, facts, args, command, elapsed, run.stopped, failures)
    print()
    print(report)
    harness.write_results(args.output_dir, NAME, markdown=report, data={
        "command": command, "machine": facts,
        "settings": harness.settings_of(args), "elapsed_s": round(elapsed, 1),
        "interrupted": run.interrupted, "failures": failures, "rows": rows})
    return run.finish(failed=bool(failures))


if __name__ == "__main__":
    sys.exit(main())
