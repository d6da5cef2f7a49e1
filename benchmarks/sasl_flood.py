#!/usr/bin/env python3
"""What do hostile, unauthenticated clients cost a good client of a SASL proxy? (issue 14)

The set-up of the issue: a fresh Tansu broker (in-memory storage); a *back* kthrottle in
front of it that terminates SASL (SASL_PLAINTEXT, its own credentials file with user
``proxy``: it plays a SASL broker); in front of that the *proxy under test*, SASL_PLAINTEXT
in terminate mode, credentials file with users ``good`` and ``alice`` (SCRAM-SHA-256 and
SCRAM-SHA-512 credentials, ``--iterations`` 4096), logging in upstream to the back proxy as
``proxy`` with SCRAM-SHA-512. Both proxies run ``python -m kthrottle`` from the same source
tree (``--src``), with ``--failed-authentication-delay-ms`` (100 by default) passed to both.
Every measurement gets a fresh pair of proxies (the broker is shared by the whole run), so
that a memory or CPU hog of one case cannot leak into the next.

Throughput cases (``alone``, ``flood-PLAIN``, ``flood-PLAIN-same``, ``flood-SCRAM-SHA-512``):

* the good producer: aiokafka, SCRAM-SHA-512 as ``good``, acks=1, ``--linger-ms`` 5,
  ``--batch-size`` 64 KiB (as proxy_overhead.py), ``--record-size`` records spread over a
  topic of ``--partitions`` partitions, as fast as it can (up to 10 000 sends in flight)
  for ``--seconds``; MB/s = acknowledged record-value bytes (10^6) per second over the
  measured interval. Its own process.
* the latency probe: a second aiokafka producer (same user, linger 0) in another process,
  one record every ``--probe-interval-ms`` with ``send_and_wait`` (the next send waits for
  the previous acknowledgement, so a slow answer lowers the probe's sample count rather than
  piling up); p50/p99 of those round trips. The probe shares the proxy with the producer,
  so "alone" is already a loaded proxy.
* the flood (flood cases only): ``--flood-connections`` asyncio clients in one more process
  (uvloop), each looping: connect, ApiVersions v0 (unless ``--no-api-versions``), SaslHandshake
  v1, SaslAuthenticate v1 as user ``alice`` with a wrong password, read the answer, close.
  PLAIN sends the wrong password at once: a new one every attempt (``flood-PLAIN``, so that
  no memory of refused passwords in the proxy helps) or the same one every time
  (``flood-PLAIN-same``, the issue's looper). SCRAM-SHA-512 runs scramp's ScramClient with
  one wrong password, so its client-final proof is really computed from it (the PBKDF2 of
  the wrong password is cached per salt, as a hostile client would, unless
  ``--no-flood-cache``: then the flood's own CPU competes for the machine's cores).
  Reported: failed logins answered per second, and the time from writing the failing
  SaslAuthenticate (the last one for SCRAM) to its answer - an error frame, or a bare close
  of the connection - p50 and min; the target of KIP-306 is that no failure is answered
  sooner than the configured delay (counted with 1 ms of slack: event-loop timers have
  millisecond granularity). The flood starts ``--warmup`` s before the interval.

Memory cases (``memory-1``, ``memory-20``; ``--memory-connections``): N raw clients connect
to the proxy under test and, without authenticating, send the head of a SaslHandshake v1
request whose size prefix claims ``--memory-claim`` bytes (104857000, ~100 MiB) and then
stream filler as fast as the proxy takes it, for ``--memory-seconds``. Reported: the proxy
process's RSS growth (peak over 20 ms samples minus before) per connection, the bytes each
connection got written before the proxy closed it (written into the socket: the kernel's
socket buffers, a few MB on loopback, are included), and after how long it closed. Kafka's
pre-authentication cap (sasl.server.max.receive.size) is 524288 bytes.

Every measurement is run ``--rounds`` times; a table cell is the median over rounds (JSON
has every run). With ``--baseline-src DIR`` every measurement is run for the baseline tree
and for ``--src``, interleaved (baseline first in odd rounds, second in even ones), and the
table shows both with the ratio src/baseline. ``--proxy-arg`` flags go to the ``--src``
tree's proxy under test only (flags that exist only in the new tree); the baseline gets the
flags both trees know. Results: ``sasl_flood.md`` (command line at the top) and
``sasl_flood.json`` in ``--output-dir``. About 3 minutes with the defaults for one tree,
twice that with ``--baseline-src``. Examples::

    git -C . worktree add /tmp/kthrottle-base 5b86a9c
    python benchmarks/sasl_flood.py --src /tmp/kthrottle-base          # one tree
    python benchmarks/sasl_flood.py --baseline-src /tmp/kthrottle-base # before/after
"""
import asyncio
import os
import statistics
import struct
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
from scramp import ScramClient

from kthrottle_testkit.harness import (
    MB,
    MIB,
    REPO,
    Run,
    SourceTree,
    Workers,
    add_output_dir,
    add_rounds,
    aio_warm_up,
    cache_client_pbkdf2,
    call,
    check_src,
    command_line,
    cpu_seconds,
    frame_of,
    machine_facts,
    names,
    new_runner,
    output_dir,
    parser,
    rank_percentile,
    read_frame,
    sasl_login,
    sasl_types,
    settings_of,
    start_kthrottle,
    wait_for_port,
    worker_signals,
    write_results,
)

SaslHandshakeRequest, SaslHandshakeResponse, SaslAuthenticateRequest, \
    SaslAuthenticateResponse = sasl_types()

GOOD, GOOD_PASSWORD = "good", "good-secret"
ALICE, ALICE_PASSWORD = "alice", "alice-secret"
WRONG_PASSWORD = "not-alice-secret"
PROXY_USER, PROXY_PASSWORD = "proxy", "proxy-secret"
# PLAIN: a new wrong password every attempt (nothing a server could remember helps);
# PLAIN-same: one wrong password over and over (the looper); SCRAM-SHA-512: one
# wrong password (the server's work does not depend on it)
FLOOD_MECHANISMS = ("PLAIN", "PLAIN-same", "SCRAM-SHA-512")
PRE_AUTH_CAP = 524288  # Kafka's sasl.server.max.receive.size
LOGIN_TIMEOUT = 10.0  # seconds; a slower failed login counts as a timeout
CLIENT_ID = "sasl-flood"


# --------------------------------------------------------------------------- proxies


class Stack:
    """The back proxy and the proxy under test of one tree, ready for clients."""

    def __init__(self, tree, broker, procs, files, args, name):
        self.tree, self.procs = tree, procs
        self.log_level = args.log_level
        self.back = self.front = None
        back_args = ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "terminate",
                     "--sasl-enabled-mechanisms", "SCRAM-SHA-512",
                     "--credentials-file", str(files["back_credentials"]),
                     "--failed-authentication-delay-ms", str(args.failed_delay_ms)]
        front_args = ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "terminate",
                      "--sasl-enabled-mechanisms", "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512",
                      "--credentials-file", str(files["front_credentials"]),
                      "--failed-authentication-delay-ms", str(args.failed_delay_ms),
                      "--upstream-security-protocol", "SASL_PLAINTEXT",
                      "--upstream-sasl-mechanism", "SCRAM-SHA-512",
                      "--upstream-sasl-username", PROXY_USER,
                      "--upstream-sasl-password-file", str(files["proxy_password"]),
                      *tree.extra_front_args]
        try:
            self.back, self.back_port, self.back_node = self._start(
                "%s-back" % name, broker.bootstrap, back_args)
            self.front, self.port, self.front_node = self._start(
                "%s-front" % name, "127.0.0.1:%d" % self.back_port, front_args)
            # a Metadata response through both opens their node-111 listeners
            try:
                asyncio.run(ready_probe(self.port))
            except Exception as exc:
                raise RuntimeError("the good user's SCRAM login and Metadata through both "
                                   "proxies failed (%s: %s); logs in %s"
                                   % (type(exc).__name__, exc, procs.log_dir)) from None
            wait_for_port("127.0.0.1", self.front_node, timeout=5, proc=self.front)
            wait_for_port("127.0.0.1", self.back_node, timeout=5, proc=self.back)
        except BaseException:
            self.stop()
            raise
        self.bootstrap = "127.0.0.1:%d" % self.port

    def _start(self, name, upstream, extra):
        """A proxy of this tree; ready once it listens (its node listener opens with the
        first Metadata, which needs a login)."""
        proxy = start_kthrottle(upstream, self.procs, extra, name=name, src=self.tree,
                                probe=False, log_level=self.log_level)
        return proxy.proc, proxy.port, proxy.node_port

    def alive(self):
        return all(p is not None and p.poll() is None for p in (self.back, self.front))

    def stop(self):
        for proc in (self.front, self.back):
            if proc is not None:
                self.procs.stop(proc)


# --------------------------------------------------------------------------- raw Kafka I/O


def api_versions_v0(correlation_id, client_id=b"sasl-flood"):
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    return struct.pack(">i", len(body)) + body


def metadata_v1(correlation_id, client_id=b"sasl-flood-ready"):
    body = struct.pack(">hhih", 3, 1, correlation_id, len(client_id)) + client_id
    body += struct.pack(">i", -1)  # all topics
    return struct.pack(">i", len(body)) + body


async def ready_probe(port, timeout=20.0):
    """Log in as the good user and ask for Metadata: the response passing through both
    proxies makes them open their node listeners."""
    async def probe():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await sasl_login(reader, writer, "SCRAM-SHA-512", GOOD, GOOD_PASSWORD,
                             client_id=CLIENT_ID)
            writer.write(metadata_v1(10))
            await read_frame(reader)
        finally:
            writer.close()
    await asyncio.wait_for(probe(), timeout)


# --------------------------------------------------------------------------- the flood


async def failed_login(port, mechanism, api_versions, password=WRONG_PASSWORD):
    """One login with a wrong password on a fresh connection.

    Returns (seconds from writing the failing SaslAuthenticate to its answer, kind): kind is
    ``error-frame`` (a SaslAuthenticate response with an error code), ``close`` (the
    connection closed without an answer), ``reset`` (closed with a reset), ``accepted`` (the
    wrong password was taken: a bug) or ``early-<what>`` (refused before the password was
    sent). Raises on a timeout or another error."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        correlation = 1
        if api_versions:
            writer.write(api_versions_v0(correlation))
            await read_frame(reader)
            correlation += 1
        try:
            answer = await call(reader, writer, SaslHandshakeRequest[1](mechanism=mechanism),
                                correlation, SaslHandshakeResponse[1], CLIENT_ID)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None, "early-close"
        if answer.error_code:
            return None, "early-handshake-error"
        correlation += 1
        if mechanism == "PLAIN":
            token = b"\0%s\0%s" % (ALICE.encode(), password.encode())
        else:
            scram = ScramClient([mechanism], ALICE, password)
            try:
                first = await call(reader, writer, SaslAuthenticateRequest[1](
                    auth_bytes=scram.get_client_first().encode()), correlation,
                    SaslAuthenticateResponse[1], CLIENT_ID)
            except (asyncio.IncompleteReadError, ConnectionResetError):
                return None, "early-close"
            if first.error_code:
                return None, "early-error-frame"
            correlation += 1
            scram.set_server_first(bytes(first.auth_bytes).decode())
            token = scram.get_client_final().encode()  # the proof of the wrong password
        data = frame_of(SaslAuthenticateRequest[1](auth_bytes=token), correlation, CLIENT_ID)
        sent = time.monotonic()
        writer.write(data)
        try:
            frame = await read_frame(reader)
        except asyncio.IncompleteReadError:
            return time.monotonic() - sent, "close"
        except ConnectionResetError:
            return time.monotonic() - sent, "reset"
        answered = time.monotonic() - sent
        answer = SaslAuthenticateResponse[1].decode(frame[4:])
        return answered, ("error-frame" if answer.error_code else "accepted")
    finally:
        writer.close()


async def _flood(port, mechanism, connections, api_versions, t_start, t_measure, t_end):
    answer_times, kinds, errors = [], Counter(), Counter()
    distinct = mechanism == "PLAIN"
    mechanism = mechanism.split("-same")[0]
    attempts = iter(range(1 << 62))
    prefix = os.urandom(4).hex()

    async def looper():
        while time.monotonic() < t_end:
            password = ("%s-%s-%d" % (WRONG_PASSWORD, prefix, next(attempts)) if distinct
                        else WRONG_PASSWORD)
            try:
                seconds, kind = await asyncio.wait_for(
                    failed_login(port, mechanism, api_versions, password), LOGIN_TIMEOUT)
            except Exception as exc:  # timed out, refused to connect, ...
                seconds, kind = None, None
                error = "%s: %s" % (type(exc).__name__, exc)
                if t_measure <= time.monotonic() < t_end:
                    errors[error[:120]] += 1
                await asyncio.sleep(0.01)  # never spin on a refused connect
            done = time.monotonic()
            if kind and t_measure <= done < t_end:
                kinds[kind] += 1
                if seconds is not None:
                    answer_times.append(seconds)

    await asyncio.sleep(max(0.0, t_start - time.monotonic()))
    tasks = [asyncio.create_task(looper()) for _ in range(connections)]
    await asyncio.sleep(max(0.0, t_end - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"answer_times": answer_times, "kinds": dict(kinds), "errors": dict(errors)}


def flood_main(port, mechanism, connections, api_versions, cache_pbkdf2, go, results):
    worker_signals()
    if cache_pbkdf2:
        cache_client_pbkdf2()
    results.put("ready")
    t_start, t_measure, t_end = go.get()
    with new_runner() as runner:
        results.put(("flood", runner.run(_flood(port, mechanism, connections, api_versions,
                                                t_start, t_measure, t_end))))


# --------------------------------------------------------------------------- good clients


def _producer(bootstrap, linger_ms, batch_size=16384):
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=linger_ms, max_batch_size=batch_size,
        request_timeout_ms=30000, security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=GOOD,
        sasl_plain_password=GOOD_PASSWORD)


async def _ready(producer, topic, record_size, partitions, go, results):
    """Warm ``producer`` up, say "ready", wait for the start: (value, t_start, t_measure,
    t_end)."""
    value = os.urandom(record_size)
    await producer.start()
    await aio_warm_up(producer, topic, value, partitions)
    results.put("ready")
    times = await asyncio.get_running_loop().run_in_executor(None, go.get)
    return (value, *times)


async def _good(bootstrap, topic, record_size, partitions, batching, go, results,
                max_in_flight=10_000):
    producer = _producer(bootstrap, *batching)
    try:
        value, t_start, t_measure, t_end = await _ready(producer, topic, record_size,
                                                        partitions, go, results)
        acked = [0, 0]  # ok, failed

        def on_ack(fut):
            acked[0 if not fut.cancelled() and fut.exception() is None else 1] += 1

        in_flight = []
        await asyncio.sleep(max(0.0, t_measure - time.monotonic()))
        count0, t0 = acked[0], time.monotonic()
        while time.monotonic() < t_end:
            fut = await producer.send(topic, value)
            fut.add_done_callback(on_ack)
            in_flight.append(fut)
            if len(in_flight) >= max_in_flight:
                in_flight = [f for f in in_flight if not f.done()]
                if len(in_flight) >= max_in_flight:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        count1, t1 = acked[0], time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), 30)
        except asyncio.TimeoutError:
            pass
        records = count1 - count0
        return {"records": records, "seconds": t1 - t0, "failed": acked[1],
                "mb_s": records * record_size / MB / (t1 - t0)}
    finally:
        await producer.stop()


async def _probe(bootstrap, topic, record_size, partitions, interval, go, results):
    producer = _producer(bootstrap, linger_ms=0)
    try:
        value, t_start, t_measure, t_end = await _ready(producer, topic, record_size,
                                                        partitions, go, results)
        await asyncio.sleep(max(0.0, t_measure - time.monotonic()))
        latencies, errors, slot = [], Counter(), time.monotonic()
        while time.monotonic() < t_end:
            sent = time.monotonic()
            try:
                await asyncio.wait_for(producer.send_and_wait(topic, value),
                                       max(0.5, t_end + 10 - sent))
                latencies.append(time.monotonic() - sent)
            except Exception as exc:
                errors["%s: %s" % (type(exc).__name__, exc)] += 1
            slot += interval
            delay = slot - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                slot = time.monotonic()  # late: the next send goes now
        return {"latencies": latencies, "errors": dict(errors)}
    finally:
        await producer.stop()


def good_main(kind, bootstrap, topic, record_size, partitions, interval, batching, go,
              results):
    worker_signals()
    try:
        with new_runner() as runner:
            if kind == "good":
                stats = runner.run(_good(bootstrap, topic, record_size, partitions, batching,
                                         go, results))
            else:
                stats = runner.run(_probe(bootstrap, topic, record_size, partitions, interval,
                                          go, results))
        results.put((kind, stats))
    except Exception as exc:
        results.put((kind, {"error": "%s: %s" % (type(exc).__name__, exc)}))


# --------------------------------------------------------------------------- memory hogs


def handshake_head(claim, client_id=b"sasl-flood-hog"):
    """The first bytes of a SaslHandshake v1 request whose size prefix says ``claim``:
    a valid request header, then the start of the mechanism string."""
    head = struct.pack(">hhih", 17, 1, 1, len(client_id)) + client_id
    head += struct.pack(">h", 13) + b"SCRAM-SHA-512"
    return struct.pack(">i", claim) + head, len(head)


async def _hog(port, claim, t_end, chunk):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    head, counted = handshake_head(claim)
    writer.write(head)
    filler = b"\x00" * chunk
    state = {"closed_at": None, "sent_at_close": None, "answer_bytes": 0,
             "claim_sent_at": None}
    sent = [counted]

    async def watch():  # EOF or reset from the proxy's side
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                state["answer_bytes"] += len(data)
        except (ConnectionError, OSError):
            pass
        if state["closed_at"] is None:
            state["closed_at"] = time.monotonic() - start
            state["sent_at_close"] = sent[0]

    watcher = asyncio.create_task(watch())
    try:
        while time.monotonic() < t_end and state["closed_at"] is None and sent[0] < claim:
            n = min(chunk, claim - sent[0])
            writer.write(filler[:n] if n < chunk else filler)
            try:
                await asyncio.wait_for(writer.drain(), max(0.01, t_end - time.monotonic()))
            except asyncio.TimeoutError:  # the proxy stopped reading: not closed, stuck
                break
            except (ConnectionError, OSError):
                break
            sent[0] += n
            if sent[0] >= claim:
                state["claim_sent_at"] = time.monotonic() - start
        await asyncio.wait_for(asyncio.shield(watcher), max(0.0, t_end - time.monotonic()))
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
    finally:
        watcher.cancel()
        writer.transport.abort()
    return {"sent": sent[0], "closed": state["closed_at"] is not None,
            "closed_after_s": state["closed_at"], "sent_at_close": state["sent_at_close"],
            "answer_bytes": state["answer_bytes"], "whole_claim_sent": sent[0] >= claim,
            "claim_sent_after_s": state["claim_sent_at"]}


def hog_main(port, claim, connections, chunk, go, results):
    worker_signals()
    results.put("ready")
    t_start, t_measure, t_end = go.get()

    async def run():
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        return await asyncio.gather(*(_hog(port, claim, t_end, chunk)
                                      for _ in range(connections)), return_exceptions=True)

    with new_runner() as runner:
        out = runner.run(run())
    results.put(("hog", [o if isinstance(o, dict) else {"error": repr(o)} for o in out]))


# --------------------------------------------------------------------------- measurements


def _pct_ms(values, q):
    value = rank_percentile(sorted(values or ()), q)
    return None if value is None else value * 1000


def measure_throughput(case, stack, broker, args):
    """The good producer and the probe, alone or under one flood mechanism."""
    mechanism = case[len("flood-"):] if case.startswith("flood-") else None
    topic = "sasl-flood-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, args.partitions)
    workers = Workers()
    try:
        batching = (args.linger_ms, args.batch_size)
        workers.add(good_main, "good", stack.bootstrap, topic, args.record_size, args.partitions,
                    args.probe_interval_ms / 1000.0, batching)
        workers.add(good_main, "probe", stack.bootstrap, topic, args.record_size,
                    args.partitions, args.probe_interval_ms / 1000.0, batching)
        if mechanism:
            workers.add(flood_main, stack.port, mechanism, args.flood_connections,
                        not args.no_api_versions, not args.no_flood_cache)
        workers.wait_ready()
        t_start = time.monotonic() + 0.2
        t_measure = t_start + (args.warmup if mechanism else 0.0)
        t_end = t_measure + args.seconds
        workers.start(t_start, t_measure, t_end)
        watched = {"front": stack.front.pid, "back": stack.back.pid, "broker": broker.proc.pid}
        watched.update({"good": workers.procs[0].pid, "probe": workers.procs[1].pid})
        if mechanism:
            watched["flood"] = workers.procs[2].pid
        ps = [psutil.Process(pid) for pid in watched.values()]
        time.sleep(max(0.0, t_measure - time.monotonic()))
        cpu0, w0 = [cpu_seconds(p) or 0.0 for p in ps], time.monotonic()
        time.sleep(max(0.0, t_end - time.monotonic()))
        cpu1, w1 = [cpu_seconds(p) or 0.0 for p in ps], time.monotonic()
        stats = dict(workers.collect(timeout=LOGIN_TIMEOUT + 60))
    finally:
        workers.stop()
    cpu = {name: round((b - a) / (w1 - w0) * 100, 1)
           for name, a, b in zip(watched, cpu0, cpu1)}
    good, probe = stats["good"], stats["probe"]
    row = {"case": case, "cpu_percent": cpu,
           "good_mb_s": round(good["mb_s"], 2) if "mb_s" in good else None,
           "good_records": good.get("records"), "good_failed": good.get("failed"),
           "good_error": good.get("error"),
           "probe_samples": len(probe.get("latencies", ())),
           "probe_p50_ms": _round(_pct_ms(probe.get("latencies"), 50)),
           "probe_p99_ms": _round(_pct_ms(probe.get("latencies"), 99)),
           "probe_max_ms": _round(max(probe["latencies"]) * 1000
                                  if probe.get("latencies") else None),
           "probe_errors": probe.get("errors") or probe.get("error")}
    if mechanism:
        flood = stats["flood"]
        times = flood["answer_times"]
        row.update({
            "flood_mechanism": mechanism,
            # the wrong password answered (an error frame or a close) ...
            "failed_logins_s": round(sum(n for k, n in flood["kinds"].items()
                                         if k in ("error-frame", "close", "reset"))
                                     / args.seconds, 1),
            # ... or the attempt refused before the password was sent
            "refused_early_s": round(sum(n for k, n in flood["kinds"].items()
                                         if k.startswith("early-")) / args.seconds, 1),
            "flood_error_count": sum(flood["errors"].values()),
            "answer_p50_ms": _round(_pct_ms(times, 50)),
            "answer_min_ms": _round(min(times) * 1000 if times else None),
            "answer_max_ms": _round(max(times) * 1000 if times else None),
            # 1 ms of slack: the proxies' event-loop timers have millisecond granularity
            "answers_sooner_than_delay": sum(1 for t in times
                                             if t * 1000 < args.failed_delay_ms - 1),
            "answer_kinds": flood["kinds"], "flood_errors": flood["errors"]})
    return row


def measure_memory(connections, stack, args):
    """N unauthenticated clients claiming a huge SaslHandshake; the front proxy's RSS."""
    front = psutil.Process(stack.front.pid)
    workers = Workers()
    try:
        workers.add(hog_main, stack.port, args.memory_claim, connections, 256 * 1024)
        workers.wait_ready()
        time.sleep(0.2)
        rss0 = front.memory_info().rss
        t_start = time.monotonic() + 0.1
        t_end = t_start + args.memory_seconds
        workers.start(t_start, t_start, t_end)
        peak, samples = rss0, []
        while time.monotonic() < t_end + 0.3:
            try:
                rss = front.memory_info().rss
            except psutil.Error:
                break
            peak = max(peak, rss)
            samples.append((round(time.monotonic() - t_start, 3), rss))
            time.sleep(0.02)
        hogs = dict(workers.collect(timeout=30))["hog"]
    finally:
        workers.stop()
    time.sleep(0.5)
    try:
        rss_after = front.memory_info().rss
    except psutil.Error:
        rss_after = None
    ok = [h for h in hogs if "error" not in h]
    closed = [h for h in ok if h["closed"]]
    return {
        "case": "memory-%d" % connections, "connections": connections,
        "rss_before_mib": round(rss0 / MIB, 1), "rss_peak_mib": round(peak / MIB, 1),
        "rss_after_mib": round(rss_after / MIB, 1) if rss_after else None,
        "rss_growth_per_conn_mib": round((peak - rss0) / MIB / connections, 2),
        "closed": len(closed),
        "sent_at_close_median_bytes": (int(statistics.median(h["sent_at_close"] for h in closed))
                                       if closed else None),
        "closed_after_median_s": (round(statistics.median(h["closed_after_s"] for h in closed), 3)
                                  if closed else None),
        "sent_median_bytes": int(statistics.median(h["sent"] for h in ok)) if ok else None,
        "whole_claim_sent": sum(1 for h in ok if h["whole_claim_sent"]),
        "answered": sum(1 for h in ok if h["answer_bytes"]),
        "claim_sent_after_median_s": (
            round(statistics.median(h["claim_sent_after_s"] for h in whole), 3)
            if (whole := [h for h in ok if h["claim_sent_after_s"] is not None]) else None),
        "hog_errors": [h["error"] for h in hogs if "error" in h][:3],
        "proxy_alive": stack.front.poll() is None,
        "rss_samples_mib": [(t, round(r / MIB, 1)) for t, r in samples[::5]],
    }


def measure_case(case, tree, broker, procs, args, name):
    """One measurement of one case with a fresh pair of proxies of ``tree``."""
    stack = Stack(tree, broker, procs, tree.files, args, name)
    try:
        if case.startswith("memory-"):
            row = measure_memory(int(case.split("-")[1]), stack, args)
            print("RSS +%.1f MiB/conn, %d/%d closed" % (
                row["rss_growth_per_conn_mib"], row["closed"], row["connections"]), flush=True)
        else:
            row = measure_throughput(case, stack, broker, args)
            print("%s MB/s, probe p99 %s ms%s" % (
                _fmt(row["good_mb_s"]), _fmt(row["probe_p99_ms"]),
                ", %s failed logins/s, answer p50 %s ms" % (
                    _fmt(row["failed_logins_s"]), _fmt(row["answer_p50_ms"]))
                if "failed_logins_s" in row else ""), flush=True)
        row["proxies_alive"] = stack.alive()
        return row
    finally:
        stack.stop()


def _round(x, digits=1):
    return None if x is None else round(x, digits)


# --------------------------------------------------------------------------- report


def _median(rows, key):
    values = [r.get(key) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(x, key=""):
    if x is None:
        return "-"
    if key.endswith("_bytes"):
        return "%d (%.2f MiB)" % (x, x / MIB)
    if isinstance(x, float) and x.is_integer() and abs(x) >= 10:
        return "%d" % x
    if isinstance(x, float):
        return "%.3g" % x if abs(x) < 10 else "%.1f" % x
    return str(x)


def _ratio(a, b):
    if a is None or b is None or not b:
        return "-"
    return "%.2fx" % (a / b)


def _kinds(rows):
    total = Counter()
    for r in rows:
        total.update(r.get("answer_kinds") or {})
    return ", ".join("%s %d" % kv for kv in total.most_common()) or "-"


def summarise(results, trees, cases):
    """{case: {tree: {metric: value}}}, medians over rounds."""
    summary = {}
    for case in cases:
        summary[case] = {}
        for tree in trees:
            runs = [r for r in results if r["tree"] == tree.label and r["case"] == case]
            alone = {r["round"]: r.get("good_mb_s") for r in results
                     if r["tree"] == tree.label and r["case"] == "alone"}
            failed = [r["error"] for r in runs if "error" in r]
            s = {"runs": len(runs), "failed_runs": len(failed),
                 "failure": failed[0][:200] if failed else None}
            if case.startswith("memory-"):
                for key in ("rss_growth_per_conn_mib", "rss_peak_mib", "closed",
                            "sent_at_close_median_bytes", "closed_after_median_s",
                            "sent_median_bytes", "whole_claim_sent",
                            "claim_sent_after_median_s", "answered"):
                    s[key] = _median(runs, key)
                s["connections"] = runs[0].get("connections") if runs else None
            else:
                for key in ("good_mb_s", "probe_p50_ms", "probe_p99_ms", "probe_samples",
                            "failed_logins_s", "refused_early_s", "flood_error_count",
                            "answer_p50_ms", "answer_min_ms", "answers_sooner_than_delay"):
                    s[key] = _median(runs, key)
                ratios = [r["good_mb_s"] / alone[r["round"]] for r in runs
                          if r.get("good_mb_s") is not None and alone.get(r["round"])]
                s["vs_alone"] = statistics.median(ratios) if ratios else None
                s["good_mb_s_all"] = [r.get("good_mb_s") for r in runs]
                s["front_cpu"] = _median([r.get("cpu_percent", {}) for r in runs], "front")
                s["back_cpu"] = _median([r.get("cpu_percent", {}) for r in runs], "back")
                s["kinds"] = _kinds(runs)
            summary[case][tree.label] = s
    return summary


THROUGHPUT_METRICS = (
    ("measurements that failed (first error)", "failed_runs"),
    ("good producer MB/s (median)", "good_mb_s"),
    ("good producer MB/s, every round", "good_mb_s_all"),
    ("ratio to alone (same tree, same round)", "vs_alone"),
    ("probe send_and_wait p50 ms", "probe_p50_ms"),
    ("probe send_and_wait p99 ms", "probe_p99_ms"),
    ("probe samples", "probe_samples"),
    ("failed logins/s (wrong password answered)", "failed_logins_s"),
    ("attempts/s refused before the password was sent", "refused_early_s"),
    ("flood errors (timeouts, refused connects; count)", "flood_error_count"),
    ("failed-login answer p50 ms", "answer_p50_ms"),
    ("failed-login answer min ms", "answer_min_ms"),
    ("answers sooner than the delay - 1 ms", "answers_sooner_than_delay"),
    ("answer kind (counts)", "kinds"),
    ("proxy under test CPU %", "front_cpu"),
    ("back proxy CPU %", "back_cpu"),
)
FLOOD_ONLY = {"failed_logins_s", "refused_early_s", "flood_error_count", "answer_p50_ms",
              "answer_min_ms", "answers_sooner_than_delay", "kinds"}
NO_RATIO = {"failed_runs", "flood_error_count", "probe_samples", "answers_sooner_than_delay",
            "closed", "whole_claim_sent", "answered"}
MEMORY_METRICS = (
    ("measurements that failed (first error)", "failed_runs"),
    ("RSS growth per connection MiB (peak - before) / N", "rss_growth_per_conn_mib"),
    ("proxy RSS peak MiB", "rss_peak_mib"),
    ("connections closed by the proxy", "closed"),
    ("bytes written before the close (median)", "sent_at_close_median_bytes"),
    ("closed after s (median)", "closed_after_median_s"),
    ("bytes written per connection (median)", "sent_median_bytes"),
    ("connections that wrote the whole claim", "whole_claim_sent"),
    ("whole claim written after s (median)", "claim_sent_after_median_s"),
    ("connections that got any answer bytes", "answered"),
)


def markdown_report(summary, trees, cases, facts, args, command, stopped=None):
    lines = [
        "# What unauthenticated clients cost a good client (issue 14)", "",
        "```", command, "```", "",
        "%s cores (%s); Python %s; trees: %s. Tansu <- back kthrottle (SASL terminate) <- "
        "kthrottle under test (SASL_PLAINTEXT terminate, upstream SCRAM-SHA-512 login); "
        "fresh proxies per measurement; %d round(s), medians over rounds. Good producer: "
        "aiokafka SCRAM-SHA-512, acks=1, %d B records, %d partitions, %g s; probe: "
        "send_and_wait every %g ms in its own process. Flood: %d connections, user alice, "
        "wrong password, %s, %g s before the interval; --failed-authentication-delay-ms %d. "
        "Memory: SaslHandshake claiming %d bytes, %g s of filler."
        % (facts["nproc"], facts["cpu_model"], facts["python"],
           "; ".join("%s = %s (%s)" % (t.label, t.src, t.commit) for t in trees),
           args.rounds, args.record_size, args.partitions, args.seconds,
           args.probe_interval_ms, args.flood_connections,
           "no ApiVersions" if args.no_api_versions else "ApiVersions first",
           args.warmup, args.failed_delay_ms, args.memory_claim, args.memory_seconds), "",
    ]
    two = len(trees) == 2
    header = ["case", "metric"] + [t.label for t in trees] + (
        ["%s / %s" % (trees[1].label, trees[0].label)] if two else [])

    def table(case_list, metrics):
        out = ["| %s |" % " | ".join(header), "|%s" % ("---|" * len(header))]
        for case in case_list:
            for title, key in metrics:
                values = [summary[case][t.label].get(key) for t in trees]
                if key in FLOOD_ONLY and not case.startswith("flood-"):
                    continue
                if key == "vs_alone" and case == "alone":
                    continue
                if key == "failed_runs":
                    if not any(values):
                        continue
                    values = ["%d: %s" % (v, summary[case][t.label]["failure"]) if v else 0
                              for v, t in zip(values, trees)]
                cells = [", ".join(_fmt(v) for v in x) if isinstance(x, list)
                         else _fmt(x, key) for x in values]
                if two:
                    ok = key not in NO_RATIO and all(isinstance(v, (int, float))
                                                     for v in values)
                    cells.append(_ratio(values[1], values[0]) if ok else "")
                out.append("| %s | %s | %s |" % (case, title, " | ".join(cells)))
        return out

    lines += ["## Good producer, alone and under a flood of wrong passwords", ""]
    lines += table([c for c in cases if not c.startswith("memory-")], THROUGHPUT_METRICS)
    memory = [c for c in cases if c.startswith("memory-")]
    if memory:
        lines += ["", "## Unauthenticated connections claiming a %d-byte SaslHandshake"
                  % args.memory_claim, "",
                  "Target: bounded by the pre-authentication cap (%d bytes, Kafka's "
                  "sasl.server.max.receive.size). Bytes written include what the kernel's "
                  "socket buffers absorbed." % PRE_AUTH_CAP, ""]
        lines += table(memory, MEMORY_METRICS)
    if stopped:
        lines += ["", "Partial run: %s." % stopped]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = parser(
        "Measure what floods of wrong-password logins and unauthenticated "
        "memory hogs cost a good SCRAM producer through a kthrottle proxy (issue 14). "
        "Writes sasl_flood.md/.json into --output-dir.")
    p.add_argument("--src", type=Path, default=REPO,
                   help="source tree both proxies run from (PYTHONPATH=DIR)")
    p.add_argument("--baseline-src", type=Path,
                   help="another checkout measured in the same run, interleaved")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for the --src tree's proxy under test only (repeat; "
                   "e.g. --proxy-arg=--sasl-server-max-receive-size=524288)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per case")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="seconds of flood before the measured interval")
    add_rounds(p, 3, "times every case is measured")
    p.add_argument("--flood-connections", type=int, default=50)
    p.add_argument("--flood-mechanisms", default=",".join(FLOOD_MECHANISMS),
                   help="comma-separated, of %s" % ", ".join(FLOOD_MECHANISMS))
    p.add_argument("--no-api-versions", action="store_true",
                   help="flood clients skip ApiVersions before SaslHandshake")
    p.add_argument("--no-flood-cache", action="store_true",
                   help="flood SCRAM clients run their PBKDF2 on every login")
    p.add_argument("--failed-delay-ms", type=int, default=100,
                   help="--failed-authentication-delay-ms of both proxies")
    p.add_argument("--iterations", type=int, default=4096,
                   help="PBKDF2 iterations of the stored SCRAM credentials")
    p.add_argument("--record-size", type=int, default=1024)
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--linger-ms", type=int, default=5,
                   help="the good producer's linger_ms (as in proxy_overhead.py)")
    p.add_argument("--batch-size", type=int, default=64 * 1024,
                   help="the good producer's max_batch_size (as in proxy_overhead.py)")
    p.add_argument("--probe-interval-ms", type=float, default=10.0)
    p.add_argument("--memory-connections", default="1,20",
                   help="comma-separated numbers of unauthenticated hogs (empty: none)")
    p.add_argument("--memory-claim", type=int, default=104857000,
                   help="size prefix of the hogs' SaslHandshake frame")
    p.add_argument("--memory-seconds", type=float, default=3.0)
    p.add_argument("--log-level", default="WARNING", help="of the proxies (logs in a temp dir)")
    add_output_dir(p)
    args = p.parse_args(argv)
    args.flood_mechanisms = names(args.flood_mechanisms)
    if any(m not in FLOOD_MECHANISMS for m in args.flood_mechanisms):
        p.error("--flood-mechanisms: of %s" % ", ".join(FLOOD_MECHANISMS))
    try:
        args.memory_connections = [int(n) for n in names(args.memory_connections)]
    except ValueError:
        p.error("--memory-connections: comma-separated integers")
    if (args.seconds <= 0 or args.rounds < 1 or args.flood_connections < 1
            or any(n < 1 for n in args.memory_connections) or args.memory_seconds <= 0):
        p.error("--seconds, --rounds, --flood-connections, --memory-* must be positive")
    args.src = check_src(p, "--src", args.src)
    if args.baseline_src is not None:
        args.baseline_src = check_src(p, "--baseline-src", args.baseline_src)
    return args


def source_tree(label, src, extra_front_args=()):
    """A tree to run both proxies from, checked to be the one imported."""
    tree = SourceTree(src)
    tree.imported_from()
    tree.label = "%s %s" % (label, tree.commit)
    tree.extra_front_args = list(extra_front_args)
    return tree


def main(argv=None):
    args = parse_args(argv)
    output_dir(args, "sasl_flood")
    command = command_line("sasl_flood", argv)
    trees = []
    if args.baseline_src:
        trees.append(source_tree("baseline", args.baseline_src))
    trees.append(source_tree("src" if args.baseline_src else "tree", args.src, args.proxy_arg))
    cases = (["alone"] + ["flood-%s" % m for m in args.flood_mechanisms]
             + ["memory-%d" % n for n in args.memory_connections])
    facts = machine_facts()
    results = []
    with Run("sasl_flood") as run:
        broker = run.broker()
        for i, tree in enumerate(trees):  # each tree writes its own credentials files
            d = run.path("tree%d" % i)
            d.mkdir()
            tree.files = {"front_credentials": d / "front-credentials.toml",
                          "back_credentials": d / "back-credentials.toml",
                          "proxy_password": d / "proxy-password"}
            tree.files["proxy_password"].write_text(PROXY_PASSWORD + "\n")
            tree.write_credentials(tree.files["front_credentials"],
                                   {GOOD: GOOD_PASSWORD, ALICE: ALICE_PASSWORD}, args.iterations)
            tree.write_credentials(tree.files["back_credentials"], {PROXY_USER: PROXY_PASSWORD},
                                   args.iterations, mechanisms=("SCRAM-SHA-512",))
        print("broker pid %d on %s; logs in %s" % (broker.proc.pid, broker.bootstrap,
                                                   run.log_dir), flush=True)
        for rnd in range(1, args.rounds + 1):
            for case in cases:
                order = trees if rnd % 2 else trees[::-1]
                for tree in order:
                    name = "r%d-%s-%s" % (rnd, case, tree.label.split()[0])
                    print("round %d, %s, %s ..." % (rnd, case, tree.label), end=" ", flush=True)
                    try:
                        row = measure_case(case, tree, broker, run.procs, args, name)
                    except Exception as exc:  # this cell failed: say so, measure the rest
                        row = {"case": case, "error": "%s: %s" % (type(exc).__name__, exc)}
                        print("failed: %s" % row["error"], flush=True)
                    row.update(tree=tree.label, round=rnd)
                    results.append(row)
                    if broker.proc.poll() is not None:
                        raise RuntimeError("the broker exited (code %s)"
                                           % broker.proc.returncode)
    if not results:
        return run.finish(failed=True)
    summary = summarise(results, trees, cases)
    report = markdown_report(summary, trees, cases, facts, args, command, stopped=run.stopped)
    report += "\nWall time of the run: %.0f s.\n" % run.elapsed
    print()
    print(report)
    write_results(args.output_dir, "sasl_flood", report, {
        "command": command, "machine": facts, "settings": settings_of(args),
        "trees": [{"label": t.label, "src": str(t.src), "commit": t.commit,
                   "extra_front_args": t.extra_front_args} for t in trees],
        "interrupted": run.interrupted, "failure": run.failure,
        "elapsed_s": round(run.elapsed, 1), "summary": summary, "results": results})
    return run.finish(any("error" in r for r in results))


if __name__ == "__main__":
    sys.exit(main())
