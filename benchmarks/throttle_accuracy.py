#!/usr/bin/env python3
"""How close to its quota does kthrottle hold a client that sends or fetches as fast as it can?

One local Tansu broker (in-memory storage) and, per quota mode, one fresh
``python -m kthrottle proxy --quota-file FILE --quota-mode MODE`` in front of it. For every
quota size three clients run at once against that proxy, each with its own client-id, its own
1-partition topic and its own quota (KIP-55 ``clients/<client-id>`` entities):

* ``aio-producer``  - aiokafka, 1 KiB records, acks=1, as fast as it can with at most
  ``--max-in-flight`` unacknowledged records (producer_byte_rate);
* ``ck-producer``   - confluent-kafka (librdkafka), 1 KiB records, acks=1,
  ``batch.size=--ck-batch-size`` (16384, the Java client's default), otherwise librdkafka's
  defaults: it ignores throttle_time_ms and keeps up to a million requests in flight, so only the
  proxy holds it back (producer_byte_rate);
* ``aio-consumer``  - aiokafka, reading a topic preloaded directly against the broker, with
  ``max_partition_fetch_bytes=--fetch-bytes`` (consumer_byte_rate).

Every client records when its bytes arrive: a producer when a record is acknowledged (delivery
callback / future done), the consumer when ``getmany`` returns records. Achieved rate / quota is
reported for the first seconds (burst) and for the steady state, with a per-second series per
client for the plot. Rates count record-value bytes; the proxy counts whole request/response
frames, a few percent more (see the report). At the end of each quota size the proxy's own
``/metrics`` (admin endpoint) is read for its throttle counters and measured rate.

Writes ``throttle_accuracy.md`` and ``throttle_accuracy.png`` into ``--output-dir``
(default: a new directory under ``benchmarks/runs/``). Every process this script starts
binds 127.0.0.1 on a free port and is stopped by PID at the end, on Ctrl-C and on errors
too.

Example (smoke run, about 25 s)::

    python benchmarks/throttle_accuracy.py --seconds 8 --quotas 100000

Full run (about 5 minutes: 30 s per quota size and mode, 65 s for 200 KB/s, the quota of
Kafka's reference measurement, so that its windows can be compared)::

    python benchmarks/throttle_accuracy.py
"""
import asyncio
import logging
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import harness
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

MODES = ("token-bucket", "window")
CLIENTS = ("aio-producer", "ck-producer", "aio-consumer")
QUOTA_KEY = {"aio-producer": "producer_byte_rate", "ck-producer": "producer_byte_rate",
             "aio-consumer": "consumer_byte_rate"}
METRIC_KIND = {"producer_byte_rate": "produce", "consumer_byte_rate": "fetch"}

# Measured by the team on this machine against Apache Kafka 2.2 broker quotas (client default
# producer_byte_rate = 200 KB/s; aiokafka and confluent-kafka writing 1 KiB records as fast as
# they can). Not measured by this script: shown for comparison only.
KAFKA_REFERENCE = {"quota": 200_000, "windows": (((12, 27), 1.43), ((25, 65), 0.83))}


# --------------------------------------------------------------------------- results


@dataclass
class ClientRun:
    """One client for one (quota mode, quota size)."""

    mode: str
    quota: int
    kind: str
    client_id: str
    topic: str
    events: list = field(default_factory=list)  # (monotonic time, value bytes)
    errors: int = 0
    first_error: Optional[str] = None
    ran_out: bool = False  # consumer: reached the end of the preloaded data
    proxy: dict = field(default_factory=dict)  # read from the proxy's /metrics
    t0: Optional[float] = None
    seconds: float = 0.0  # length of the measured period

    def error(self, text):
        self.errors += 1
        if self.first_error is None:
            self.first_error = text

    def rate(self, start, end):
        """Value bytes per second delivered in [start, end) seconds after t0."""
        if self.t0 is None or end <= start:
            return None
        t0 = self.t0
        return sum(n for t, n in self.events if start <= t - t0 < end) / (end - start)

    def series(self):
        bins = [0.0] * int(self.seconds)
        for t, n in self.events:
            i = int(t - self.t0)
            if 0 <= i < len(bins):
                bins[i] += n
        return bins


def run_seconds(quota, args):
    """The measured period for one quota size: Kafka's reference quota runs long enough to
    cover the reference's windows (up to 65 s)."""
    if quota == KAFKA_REFERENCE["quota"] and args.reference_seconds:
        return max(args.seconds, args.reference_seconds)
    return args.seconds


def quota_label(quota):
    return ("%gM" % (quota / 1e6)) if quota >= 1_000_000 else ("%gk" % (quota / 1e3))


# --------------------------------------------------------------------------- processes


def start_proxy(run, broker, quota_file, mode, args):
    """A kthrottle proxy in front of ``broker`` with the quota file and an admin endpoint."""
    extra = ["--quota-file", str(quota_file), "--quota-mode", mode]
    if args.burst_seconds is not None:
        extra += ["--quota-burst-seconds", str(args.burst_seconds)]
    return run.kthrottle(broker, extra, admin=True, name="kthrottle-%s" % mode)


def write_quota_file(path, quotas):
    lines = ["# written by benchmarks/throttle_accuracy.py"]
    for quota in quotas:
        for kind in CLIENTS:
            lines += ["", '[clients."%s-%s"]' % (kind, quota_label(quota)),
                      "%s = %d" % (QUOTA_KEY[kind], quota)]
    Path(path).write_text("\n".join(lines) + "\n")


def read_proxy_metrics(admin_port, client_ids):
    """Per client-id: the proxy's measured rate (Kafka's sampled rate, wire bytes), its
    throttle time total and throttled responses, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {cid: {} for cid in client_ids}
    for family in text_string_to_metric_families(harness.admin_get(admin_port)):
        for sample in family.samples:
            cid = sample.labels.get("client_id")
            if cid in out:
                out[cid][sample.name] = sample.value
    return out


# --------------------------------------------------------------------------- clients


async def preload(bootstrap, topic, records, value):
    """Write ``records`` records straight to the broker for a consumer to fetch, in 16 KiB
    batches: a fetch returns at least one whole batch, so the batch size bounds how small a
    fetch response can be."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=10,
                                max_batch_size=16384, client_id="throttle-accuracy-preload")
    await producer.start()
    try:
        in_flight = deque()
        for _ in range(records):
            in_flight.append(await producer.send(topic, value, partition=0))
            if len(in_flight) >= 5000:
                await in_flight.popleft()
        await asyncio.gather(*in_flight)
    finally:
        await producer.stop()


class Clock:
    """When the measured period starts and ends (monotonic seconds); set once every client
    is connected, read by the clients after ``go``."""

    t0 = None
    end = None


async def aio_produce(run, bootstrap, value, clock, args, ready, go):
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, client_id=run.client_id, acks=1, linger_ms=args.linger_ms,
        max_batch_size=16384, request_timeout_ms=60000,
    )

    closing = []

    def delivered(fut):
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            run.events.append((time.monotonic(), len(value)))
        elif not closing:  # failures of what is abandoned at the end do not count
            run.error("%s: %s" % (type(exc).__name__, exc))

    try:
        await producer.start()
        await producer.partitions_for(run.topic)  # metadata before the clock starts
        ready.set()
        await go.wait()
        in_flight = deque()
        while time.monotonic() < clock.end:
            fut = await producer.send(run.topic, value, partition=0)
            fut.add_done_callback(delivered)
            in_flight.append(fut)
            while in_flight and in_flight[0].done():
                in_flight.popleft()
            if len(in_flight) >= args.max_in_flight:
                remaining = clock.end - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait([in_flight[0]], timeout=remaining)
    finally:
        closing.append(True)
        await close_producer(producer)


async def close_producer(producer, timeout=15.0):
    """Stop without flushing: what is still queued is not part of the measurement, and
    flushing it could take many seconds at a small quota. The queued batches are failed
    first, so that aiokafka's stop() only waits for the one request in flight."""
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        batches = [b for queue in accumulator._batches.values() for b in queue]
        batches += list(accumulator._pending_batches)
        accumulator.fail_all(RuntimeError("benchmark period over"))
        for batch in batches:  # retrieved, so that asyncio does not report them
            for fut in (batch.future, getattr(batch, "_drain_waiter", None)):
                if fut is not None and fut.done() and not fut.cancelled():
                    fut.exception()
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # errors of the abandoned requests, not of the run
    try:
        await asyncio.wait_for(producer.stop(), timeout)
    except asyncio.CancelledError:
        # aiokafka's stop() re-raises the cancellation of its own sender task
        if asyncio.current_task().cancelling():
            raise  # we are being cancelled (Ctrl-C)
    except Exception as exc:
        print("    ! aiokafka producer stop: %s" % (exc or type(exc).__name__), flush=True)
    finally:
        quiet.setLevel(level)
    try:
        await asyncio.wait_for(producer.client.close(), 5)  # in case stop() did not get there
    except Exception:
        pass


async def aio_consume(run, bootstrap, clock, args, ready, go):
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, client_id=run.client_id, group_id=None,
        enable_auto_commit=False, auto_offset_reset="earliest",
        max_partition_fetch_bytes=args.fetch_bytes, fetch_max_bytes=args.fetch_max_bytes,
        request_timeout_ms=60000,
    )
    try:
        await consumer.start()
        tp = TopicPartition(run.topic, 0)
        ready.set()
        await go.wait()
        consumer.assign([tp])  # fetching starts here, not before the clock
        await consumer.seek_to_beginning(tp)
        while True:
            remaining = clock.end - time.monotonic()
            if remaining <= 0:
                break
            batches = await consumer.getmany(tp, timeout_ms=max(1, int(min(remaining, 0.2) * 1000)))
            n = sum(len(r.value) for records in batches.values() for r in records)
            if n:
                run.events.append((time.monotonic(), n))
        highwater = consumer.highwater(tp)
        position = await consumer.position(tp)
        run.ran_out = highwater is not None and position >= highwater
    finally:
        try:
            await asyncio.wait_for(consumer.stop(), 10)
        except asyncio.CancelledError:
            # aiokafka's stop() can re-raise the cancellation of its own fetch task
            if asyncio.current_task().cancelling():
                raise  # we are being cancelled (Ctrl-C)
        except Exception as exc:
            print("    ! aiokafka consumer stop: %s" % (exc or type(exc).__name__), flush=True)


def ck_produce(run, bootstrap, value, clock, args, ready, go, stop):
    """confluent-kafka in a thread of its own: librdkafka does its I/O on its own threads
    and runs delivery callbacks from poll()."""
    import confluent_kafka

    producer = None
    try:
        producer = confluent_kafka.Producer({
            "bootstrap.servers": bootstrap, "client.id": run.client_id, "acks": 1,
            "linger.ms": args.linger_ms,
            # librdkafka's default batch.size is 1,000,000 bytes: at these quotas one
            # request would be seconds of quota and the rate would move in whole requests.
            "batch.size": args.ck_batch_size,
        })

        def delivered(err, msg):
            if err is None:
                run.events.append((time.monotonic(), len(msg.value())))
            elif err.code() not in (confluent_kafka.KafkaError._PURGE_QUEUE,
                                    confluent_kafka.KafkaError._PURGE_INFLIGHT):
                run.error(str(err))

        producer.list_topics(run.topic, timeout=10)  # connected, leader known
        ready.set()
        while not go.wait(0.05):
            if stop.is_set():
                return
        while not stop.is_set() and time.monotonic() < clock.end:
            try:
                producer.produce(run.topic, value, partition=0, on_delivery=delivered)
            except BufferError:  # librdkafka's queue is full (100,000 messages by default)
                producer.poll(0.02)
                continue
            producer.poll(0)
    except Exception as exc:
        run.error("%s: %s" % (type(exc).__name__, exc))
    finally:
        ready.set()
        if producer is not None:
            try:  # drop what is queued or in flight: not part of the measurement
                producer.purge(in_queue=True, in_flight=True, blocking=False)
                producer.flush(5)
            except Exception:
                pass


async def run_quota(proxy, quota, topics, args):
    """All clients of one quota size at once against one proxy; returns their ClientRuns."""
    label = quota_label(quota)
    mode = proxy.config[len("kthrottle-"):]
    runs = {kind: ClientRun(mode, quota, kind, "%s-%s" % (kind, label), topics[kind])
            for kind in CLIENTS}
    value = b"x" * args.record_size
    clock = Clock()
    go = asyncio.Event()
    aio_ready = {kind: asyncio.Event() for kind in ("aio-producer", "aio-consumer")}
    ck_ready, ck_go, ck_stop = threading.Event(), threading.Event(), threading.Event()
    phase_start = time.monotonic()
    ck = threading.Thread(target=ck_produce, daemon=True, name="ck-producer",
                          args=(runs["ck-producer"], proxy.bootstrap, value, clock, args,
                                ck_ready, ck_go, ck_stop))
    measured = None
    tasks = [
        asyncio.ensure_future(aio_produce(runs["aio-producer"], proxy.bootstrap, value, clock,
                                          args, aio_ready["aio-producer"], go)),
        asyncio.ensure_future(aio_consume(runs["aio-consumer"], proxy.bootstrap, clock, args,
                                          aio_ready["aio-consumer"], go)),
    ]
    ck.start()
    try:
        # every client connected (and the producers' metadata known) before the clock starts
        waiting = [asyncio.ensure_future(e.wait()) for e in aio_ready.values()]
        waiting.append(asyncio.ensure_future(asyncio.to_thread(ck_ready.wait, 30)))
        connect_by = time.monotonic() + 30
        not_ready = set(waiting)
        while not_ready:
            done, _ = await asyncio.wait(not_ready | set(tasks),
                                         timeout=max(0.0, connect_by - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError("clients did not connect within 30 s")
            for task in tasks:
                if task.done():
                    task.result()  # a client that failed to start: raise its error
                    raise RuntimeError("a client ended before the measurement started")
            not_ready -= done
        if not ck_ready.is_set():
            raise TimeoutError("the confluent-kafka producer did not connect")
        for run in runs.values():
            if run.errors:
                raise RuntimeError("%s: %s" % (run.kind, run.first_error))
        connected = time.monotonic()
        clock.t0 = time.monotonic() + 0.05
        clock.end = clock.t0 + run_seconds(quota, args)
        for run in runs.values():
            run.t0 = clock.t0
            run.seconds = run_seconds(quota, args)
        await asyncio.sleep(max(0.0, clock.t0 - time.monotonic()))
        go.set()
        ck_go.set()
        await asyncio.sleep(max(0.0, clock.end - time.monotonic()))
        try:  # the proxy's view at the end of the period, before the clients disconnect
            metrics = await asyncio.to_thread(
                read_proxy_metrics, proxy.admin_port, [r.client_id for r in runs.values()])
            for run in runs.values():
                run.proxy = metrics.get(run.client_id, {})
        except Exception as exc:
            print("    ! could not read the proxy's /metrics: %s" % exc, flush=True)
        measured = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        ck_stop.set()
        ck_go.set()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=15)
        await asyncio.to_thread(ck.join, 20)
    if measured is not None:
        print("    (clients connected in %.1f s, stopped in %.1f s)"
              % (connected - phase_start, time.monotonic() - measured), flush=True)
    return list(runs.values())


# --------------------------------------------------------------------------- reporting


def windows(args):
    """(early, steady) windows in seconds after t0, clipped to the run's length."""
    s = args.seconds
    early = (0.0, min(args.early_seconds, s))
    steady_from = args.steady_from if args.steady_from < s else s / 2
    return early, (steady_from, float(s))


def summarize(run, args):
    q = float(run.quota)
    (e0, e1), (s0, s1) = windows(args)
    series = run.series()
    kind = METRIC_KIND[QUOTA_KEY[run.kind]]
    p = run.proxy

    def x(v):
        return None if v is None else v / q

    return {
        "early": x(run.rate(e0, e1)),
        "steady": x(run.rate(s0, s1)),
        "whole": x(run.rate(0, args.seconds)),
        "peak": x(max(series)) if series else None,
        "series": series,
        "proxy_rate": x(p.get("kthrottle_%s_byte_rate" % kind)),
        "throttled": p.get("kthrottle_%s_throttled_responses_total" % kind),
        "throttle_s": (p["kthrottle_%s_throttle_time_ms_total" % kind] / 1000.0
                       if "kthrottle_%s_throttle_time_ms_total" % kind in p else None),
        "proxy_quota": p.get("kthrottle_%s_quota" % kind),
    }


def fx(value, missing="-"):
    return missing if value is None else "%.2fx" % value


def notes_of(run, s):
    notes = []
    if run.errors:
        notes.append("%d delivery errors (first: %s)" % (run.errors, run.first_error))
    if run.ran_out:
        notes.append("reached the end of the preloaded data")
    if s["proxy_quota"] is not None and s["proxy_quota"] != run.quota:
        notes.append("proxy reports quota %g" % s["proxy_quota"])
    if not run.proxy:
        notes.append("no proxy metrics for this client-id")
    return "; ".join(notes)


def table_lines(runs, args):
    (e0, e1), (s0, s1) = windows(args)
    rows = []
    for run in runs:
        s = summarize(run, args)
        rows.append((run.mode, "%s B/s" % format(run.quota, ","), run.kind, fx(s["early"]),
                     fx(s["steady"]), fx(s["whole"]), fx(s["peak"]), fx(s["proxy_rate"]),
                     harness.fmt(s["throttled"], ".0f"), harness.fmt(s["throttle_s"], ".1f"),
                     notes_of(run, s)))
    return harness.markdown_table(
        ["mode", "quota", "client", "%g-%g s" % (e0, e1), "%g-%g s" % (s0, s1),
         "0-%g s" % args.seconds, "peak 1 s", "proxy's rate at end", "throttled responses",
         "throttle time s", "notes"], rows, align="lrlrrrrrrrl")


def reference_lines(runs, args):
    q = KAFKA_REFERENCE["quota"]
    spans = [span for span, _ in KAFKA_REFERENCE["windows"]]
    rows = [("**reference: Apache Kafka 2.2 broker quotas** (measured by the team on this "
             "machine, not by this script; aiokafka and confluent-kafka producers)",
             "%s B/s" % format(q, ","), *("%.2fx" % v for _, v in KAFKA_REFERENCE["windows"]))]
    for run in runs:
        if run.quota != q or not run.kind.endswith("producer"):
            continue  # the reference is of producers
        rows.append(("kthrottle %s, %s (this run)" % (run.mode, run.kind),
                     "%s B/s" % format(q, ","),
                     *(fx(run.rate(a, b) / q) if run.seconds >= b
                       else "- (run %g s)" % run.seconds for a, b in spans)))
    return harness.markdown_table(["what", "quota", *("%g-%g s" % span for span in spans)],
                                  rows)


def markdown_report(runs, facts, args, elapsed, command, interrupted):
    (e0, e1), (s0, s1) = windows(args)
    lines = [
        "# Throttle accuracy: achieved rate / quota through kthrottle",
        "",
        "Machine: %s CPUs, %s; Python %s; aiokafka %s; confluent-kafka %s (librdkafka %s); "
        "client on %s; %s; kthrottle at %s."
        % (facts["nproc"], facts["cpu_model"], facts["python"], facts["aiokafka"],
           facts["confluent_kafka"], facts["librdkafka"], facts["client_loop"],
           facts["tansu"], facts["kthrottle_commit"]),
        "",
        "Command: `%s`%s" % (command, " (interrupted)" if interrupted else ""),
        "",
        "Settings: quota modes %s (a fresh proxy per mode%s); quotas %s B/s; %g s per quota "
        "size with the three clients running at once%s; %d B records, acks=1, linger %d ms; "
        "aiokafka producer max_batch_size 16384 and at most %d records unacknowledged; "
        "confluent-kafka batch.size %d, otherwise librdkafka's defaults; aiokafka consumer "
        "max_partition_fetch_bytes %d and fetch_max_bytes %d on a topic preloaded directly "
        "against the broker in 16 KiB batches. "
        "Each client has its own client-id (`<client>-<quota>`), topic (1 partition) and quota "
        "(`clients/<client-id>` entity in the quota file). Run took %.0f s."
        % (", ".join(args.modes),
           "" if args.burst_seconds is None else ", --quota-burst-seconds %g" % args.burst_seconds,
           ", ".join(format(q, ",") for q in args.quotas), args.seconds,
           "".join(" (%s B/s: %g s, to cover the Kafka reference's windows; the table's columns "
                   "are the same windows for every size)" % (format(q, ","), run_seconds(q, args))
                   for q in args.quotas if run_seconds(q, args) != args.seconds),
           args.record_size,
           args.linger_ms, args.max_in_flight, args.ck_batch_size, args.fetch_bytes,
           args.fetch_max_bytes, elapsed),
        "",
        "How to read it: each cell is the record-value bytes a client got through per second "
        "in that window, divided by its quota (producers: acknowledged records, timed at the "
        "delivery callback / future; consumer: bytes returned by getmany). %g-%g s is the "
        "start (burst allowance), %g-%g s the steady state, both counted from the moment all "
        "three clients start. The proxy charges whole request and response frames (record "
        "batch headers, per-record overhead and the request header come on top of the 1 KiB "
        "values, about 2%% for 16 KiB batches), so a client held exactly at its quota reads "
        "slightly under 1.00x here. \"proxy's rate at end\" is the proxy's own measure of the "
        "bucket (Kafka's sampled rate over the last ~11 s, wire bytes) from its /metrics at the "
        "end of the period; throttled responses and throttle time are its counters."
        % (e0, e1, s0, s1),
        "",
    ]
    lines += table_lines(runs, args)
    lines += [
        "",
        "## Against Kafka's own quotas",
        "",
    ]
    lines += reference_lines(runs, args)
    lines += [
        "",
        "The reference row is the team's measurement of Apache Kafka 2.2's broker-side quotas "
        "(client default producer_byte_rate = 200 KB/s, aiokafka and confluent-kafka producers "
        "writing 1 KiB records as fast as they can): Kafka's sampled window lets a new client "
        "run at well over its quota for its first ten-odd seconds (it counts as having 10 s of "
        "silence behind it) and then holds it under the quota while that burst is repaid. The "
        "rows under it are this run's producers at the same quota over the same windows (the "
        "200 KB/s size runs for --reference-seconds so that they are covered).",
        "",
        "Why confluent-kafka runs with batch.size=%d: librdkafka's default batch.size is "
        "1,000,000 bytes, and a producer that is held back fills its batches to the brim, so "
        "every produce request would carry about 1 MB: 5 s of a 200 KB/s quota, 20 s of a "
        "50 KB/s one. The proxy charges a request whole when it arrives and mutes the client "
        "for the debt, so deliveries would come in 1 MB steps several seconds apart and any "
        "window shorter than a few requests would read as 0x or as a multiple of the quota. "
        "16384 is the Java client's default batch.size; with it every request is a small "
        "fraction of a second of quota and the per-second series is smooth. librdkafka also "
        "ignores throttle_time_ms (KIP-219) and keeps up to a million requests in flight, so "
        "it is held only by the proxy not reading from its socket." % args.ck_batch_size,
        "",
        "What to expect from each mode. token-bucket: a client starts with --quota-burst-seconds "
        "(1 s) of quota in hand, so the first second shows about 2x and 0-5 s about "
        "(5 + 1) / 5 = 1.2x; after that it is held to the quota. window: Kafka's sampled rate "
        "counts a new client as having 10 s of silence behind it, so the first second carries "
        "about 10 s of quota; then every response is delayed X = (O - T) / T x W, which allows "
        "about one request per second while the burst is in the window; when the sample holding "
        "the burst expires (about 11 s later) the client bursts again, about 10 s of quota in a "
        "second or two. Averaged over many cycles that is a little over the quota, but a window "
        "of one to four cycles reads high or low depending on how many bursts fall inside it: "
        "12-27 s holds one or two, 25-65 s three or four. The Kafka reference's two figures "
        "swing the same way; whether its bursts fell where kthrottle's do cannot be told from "
        "two numbers.",
        "",
        "The consumer in window mode runs further over its quota than the producers at small "
        "quotas: a fetch response is forwarded whole and the client is throttled afterwards "
        "(the proxy cannot answer an over-quota fetch empty as Kafka does without dropping "
        "records the broker counted as sent to an incremental fetch session, KIP-227), so the "
        "response that crosses the quota is delivered; at 50 KB/s one 64 KiB response is "
        "1.3 s of quota. Fetch responses are also why the consumer's per-second series "
        "alternates: each response is a whole 64 KiB. Tansu ignores a fetch's per-partition "
        "limit (max_partition_fetch_bytes) and honours only the request's max_bytes, so the "
        "consumer sets both: with aiokafka's default fetch_max_bytes (50 MiB) every response "
        "is as large as the proxy's fetch cap: quota x 10 s in window mode (Kafka's cap), "
        "the burst allowance (--quota-burst-seconds of quota) in token-bucket mode "
        "(`--fetch-max-bytes 52428800` shows it).",
        "",
        "![throttle accuracy](throttle_accuracy.png)",
    ]
    return "\n".join(lines) + "\n"


def draw(plt, runs, args):
    """One panel per (mode, quota size) measured: each client's per-second rate."""
    modes = [m for m in args.modes if any(r.mode == m for r in runs)]
    quotas = [q for q in args.quotas if any(r.quota == q for r in runs)]
    (e0, e1), (s0, s1) = windows(args)
    fig, axes = plt.subplots(len(modes), len(quotas), squeeze=False,
                             figsize=(4.6 * len(quotas), 3.4 * len(modes)))
    style = {"aio-producer": ("tab:blue", "-", "o"), "ck-producer": ("tab:orange", "--", "s"),
             "aio-consumer": ("tab:green", "-", "^")}
    for i, mode in enumerate(modes):
        for j, quota in enumerate(quotas):
            ax = axes[i][j]
            q_kb = quota / 1000.0
            top = 4.0 * q_kb
            for run in runs:
                if run.mode != mode or run.quota != quota:
                    continue
                series = [b / 1000.0 for b in run.series()]
                xs = [k + 0.5 for k in range(len(series))]
                label = run.kind
                clipped = [(k, y) for k, y in enumerate(series) if y > top]
                if clipped:  # say how high the clipped seconds went
                    label += " (%s)" % ", ".join("%gx at %d s" % (round(y / q_kb, 1), k)
                                                 for k, y in clipped[:2])
                color, line, marker = style[run.kind]
                ax.plot(xs, series, marker=marker, markersize=2.5, linewidth=1, color=color,
                        linestyle=line, label=label, alpha=0.85)
            ax.axhline(q_kb, color="k", linestyle="--", linewidth=1, label="quota")
            ax.axvspan(e0, e1, color="tab:red", alpha=0.06)
            ax.axvspan(s0, s1, color="tab:gray", alpha=0.08)
            ax.set_ylim(0, top * 1.02)
            ax.set_xlim(0, run_seconds(quota, args))
            ax.set_title("%s, quota %g KB/s" % (mode, q_kb), fontsize=9)
            ax.set_xlabel("seconds since start", fontsize=8)
            ax.set_ylabel("KB/s delivered (per second)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper right")
    fig.suptitle("Achieved rate per second through kthrottle\n(shaded: start and steady "
                 "windows; above 4x quota clipped, peaks in the legend)", fontsize=9)
    fig.tight_layout()
    return fig


def print_runs(runs, args):
    for run in runs:
        s = summarize(run, args)
        print("    %-13s %-12s start %s  steady %s  whole %s  peak %s  proxy %s%s" % (
            run.kind, run.client_id, fx(s["early"]), fx(s["steady"]), fx(s["whole"]),
            fx(s["peak"]), fx(s["proxy_rate"]),
            ("  [%s]" % notes_of(run, s)) if notes_of(run, s) else ""), flush=True)


# --------------------------------------------------------------------------- main


FLAGS = (
    ("--seconds", float, 30.0, "measured period per quota size (all clients of one size run "
     "at once)"),
    ("--quotas", None, "50000,200000,1000000", "comma-separated quota sizes in bytes per "
     "second; each client gets this as its producer_byte_rate or consumer_byte_rate"),
    ("--modes", None, ",".join(MODES), "comma-separated kthrottle --quota-mode values; a "
     "fresh proxy per mode"),
    ("--reference-seconds", float, 65.0, "the quota size of Kafka's reference measurement "
     "(200000 B/s), when in --quotas, runs this long (if longer than --seconds) so that the "
     "reference's windows (12-27 s, 25-65 s) can be compared; 0: no longer"),
    ("--early-seconds", float, 5.0, "the start window is 0 to this many seconds"),
    ("--steady-from", float, 10.0, "the steady window runs from here to --seconds (from "
     "--seconds/2 when the run is shorter than this)"),
    ("--burst-seconds", float, None, "pass --quota-burst-seconds to the proxy (token-bucket "
     "mode; default: the proxy's own default, 1 s)"),
    ("--record-size", int, 1024, "record value size in bytes"),
    ("--linger-ms", int, 5, "linger for both producers"),
    ("--max-in-flight", int, 256, "most unacknowledged records of the aiokafka producer"),
    ("--ck-batch-size", int, 16384, "confluent-kafka batch.size (librdkafka's default: 1000000)"),
    ("--fetch-bytes", int, 64 * 1024, "aiokafka consumer max_partition_fetch_bytes"),
    ("--fetch-max-bytes", int, None, "aiokafka consumer fetch_max_bytes, the whole response's "
     "limit (default: --fetch-bytes). Tansu ignores the per-partition limit and honours only "
     "this one, so with aiokafka's default (52428800) every fetch is as large as the proxy's "
     "cap (window mode: quota x 10 s; token-bucket: the burst allowance)"),
)


def parse_args(argv=None):
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, output_help="where "
                            "throttle_accuracy.md and throttle_accuracy.png are written")
    args = p.parse_args(argv)
    try:
        args.quotas = [int(float(q)) for q in args.quotas.split(",") if q.strip()]
    except ValueError:
        p.error("--quotas: comma-separated numbers, e.g. 50000,200000")
    args.modes = harness.names(args.modes)
    if not args.quotas or min(args.quotas) < 1:
        p.error("--quotas: at least one positive quota")
    if len(set(quota_label(q) for q in args.quotas)) != len(args.quotas):
        p.error("--quotas: give distinct quota sizes")
    unknown = set(args.modes) - set(MODES)
    if unknown or not args.modes:
        p.error("--modes: unknown %s (choose from %s)" % (sorted(unknown), ", ".join(MODES)))
    if args.seconds < 2 or args.seconds > 600:
        p.error("--seconds must be between 2 and 600")
    if not 0 <= args.reference_seconds <= 600:
        p.error("--reference-seconds must be between 0 and 600")
    if args.fetch_max_bytes is None:
        args.fetch_max_bytes = args.fetch_bytes
    if min(args.record_size, args.max_in_flight, args.ck_batch_size, args.fetch_bytes,
           args.fetch_max_bytes) < 1:
        p.error("sizes must be >= 1")
    return args


def preload_records(quota, args):
    """Enough data that the consumer never runs dry: the window mode's initial burst is
    about 10 s of quota, its steady state about 10% over; 1.5x on top of that."""
    seconds = run_seconds(quota, args) + 15
    return int(quota * seconds * 1.5 / args.record_size) + 1


def measure_quota(runner, broker, proxy, mode, quota, topics, args, failures):
    """All clients of one quota size through ``proxy``: their ClientRuns, or none if the
    measurement failed (said, and added to ``failures``)."""
    for kind in ("aio-producer", "ck-producer"):
        broker.create_topic(topics[kind], partitions=1)
    print("  %s, quota %s B/s, %g s ..." % (mode, format(quota, ","), run_seconds(quota, args)),
          flush=True)
    try:
        got = runner.run(asyncio.wait_for(run_quota(proxy, quota, topics, args),
                                          run_seconds(quota, args) + 120))
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise
    except Exception as exc:
        text = "%s, %s: %s: %s" % (mode, quota, type(exc).__name__, exc)
        failures.append(text)
        print("    ! " + text, flush=True)
        return []
    print_runs(got, args)
    for name, proc in (("the proxy", proxy.proc), ("the Tansu broker", broker.proc)):
        if proc.poll() is not None:
            raise RuntimeError("%s exited (code %s)" % (name, proc.returncode))
    return got


def measure_all(run, args, runs, failures):
    """Every (mode, quota size): one broker, one proxy per mode; adds to ``runs``."""
    broker = run.broker()
    quota_file = run.path("quotas.toml")
    write_quota_file(quota_file, args.quotas)
    print("Tansu broker pid %d on %s; logs and quota file in %s"
          % (broker.proc.pid, broker.bootstrap, run.log_dir), flush=True)
    run_id = uuid.uuid4().hex[:6]
    consumer_topics = {}
    for quota in args.quotas:
        consumer_topics[quota] = "ta-%s-%s-aio-consumer" % (run_id, quota_label(quota))
        broker.create_topic(consumer_topics[quota], partitions=1)
    with harness.new_runner() as runner:
        value = b"x" * args.record_size
        for quota, topic in consumer_topics.items():
            n = preload_records(quota, args)
            t = time.monotonic()
            runner.run(asyncio.wait_for(preload(broker.bootstrap, topic, n, value), 300))
            print("preloaded %s: %d records (%.0f MB) in %.1f s"
                  % (topic, n, n * args.record_size / 1e6, time.monotonic() - t), flush=True)
        for mode in args.modes:
            proxy = start_proxy(run, broker, quota_file, mode, args)
            print("kthrottle --quota-mode %s: pid %d on %s, admin on 127.0.0.1:%d"
                  % (mode, proxy.proc.pid, proxy.bootstrap, proxy.admin_port), flush=True)
            try:
                for quota in args.quotas:
                    topics = {kind: "ta-%s-%s-%s-%s" % (run_id, mode, quota_label(quota), kind)
                              for kind in ("aio-producer", "ck-producer")}
                    topics["aio-consumer"] = consumer_topics[quota]
                    runs += measure_quota(runner, broker, proxy, mode, quota, topics, args,
                                          failures)
            finally:
                run.procs.stop(proxy.proc)


def main(argv=None):
    args = parse_args(argv)
    harness.output_dir(args, "throttle_accuracy")
    command = harness.command_line("throttle_accuracy", argv)
    facts = harness.machine_facts()
    runs, failures = [], []
    with harness.Run("throttle_accuracy") as run:
        measure_all(run, args, runs, failures)
    elapsed = run.elapsed
    failures += [run.failure] if run.failure else []
    if not runs:
        print("nothing measured", file=sys.stderr)
        return run.finish(failed=True)
    report = markdown_report(runs, facts, args, elapsed, command, run.interrupted)
    if failures:
        report += "\nFailures:\n\n" + "\n".join("- " + f for f in failures) + "\n"
    print()
    print(report)
    harness.write_results(args.output_dir, "throttle_accuracy", markdown=report,
                          draw=lambda plt: draw(plt, runs, args))
    return run.finish(failed=bool(failures))


if __name__ == "__main__":
    sys.exit(main())
