"""``kthrottle proxy --workers N``: N processes serve one machine's clients.

One Python process uses one core. With ``--workers N`` (N > 1) the
``kthrottle proxy`` process becomes a supervisor that serves no client: it
starts N workers (its own command line again, with a hidden ``--worker
INDEX:FD``), each a whole proxy listening on every port with SO_REUSEPORT,
so that the kernel spreads the connections over them. The supervisor:

- passes SIGTERM and SIGINT (drain; a second one cuts the drain) and SIGHUP
  (re-read the files) on to every worker, as messages on the hub: under
  systemd (KillMode=control-group) or a terminal's Ctrl-C the workers get the
  signal themselves too, and one stop must not count as two;
- starts a worker that exits unexpectedly again, after a delay doubling from
  RESTART_DELAY to MAX_RESTART_DELAY (back to the first after a worker ran
  for STABLE_SECONDS); a worker that fails before every worker has served
  once stops the whole command, with its status, as one process would;
- waits for the workers once they stop, and exits with their status;
- is the hub: one socket pair per worker, over which each message is a type
  byte, a length and a payload (``HEADER``). What one worker sends is passed
  on to the others as it came (the supervisor parses none of it).

What crosses the hub:

- usage (every EXCHANGE_INTERVAL, less often where building the message
  would take more than EXCHANGE_CPU_SHARE of a worker's time): each worker
  sends what its own quota buckets counted since its last message
  (``UsageOutbox``), per bucket
  identity (kind, key, tags) with the entity that set its quota; each
  other worker adds it to its bucket of the same identity
  (``Bucket.add_others``: in the rate and the token bucket, no throttle of
  its own). So a client-id with connections on several workers is held to
  its quota as one, with at most one interval and a hop of delay. The
  outbox diffs the counters of the buckets used since its last message,
  which note their first use after each (one test per request).
- what is followed once per machine: worker 0, the primary, follows the
  cluster state (``--zookeeper``, storage throttling) and the fleet shares
  (``--proxy-id``), publishes the usage reports and serves ``--admin-listen``;
  it passes each cluster-state snapshot and shares document on as it read
  them, and the others parse and apply them as if they had read them. The
  supervisor keeps the last of each, for a worker (re)started later.
- control: ready (a worker serves), stop, cut, reload.

A worker whose supervisor is gone (the hub socket closes: killed, even with
SIGKILL) drains and exits, so no worker outlives it for long.
"""
import asyncio
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

from ..policy.quotas import CLIENT_BUCKETS, IP_BUCKETS, TOPIC_BUCKETS

log = logging.getLogger("kthrottle.workers")

PRIMARY = 0  # the worker that follows the cluster state and the shares, and serves admin
# How often a worker sends its buckets' usage: a client on another worker is
# seen at most this late (plus a hop through the supervisor), a few percent
# of a token bucket's default 1 s burst
EXCHANGE_INTERVAL = 0.05
# ... and at most this share of its time building them: a worker with
# thousands of busy buckets (some 2.5 ms per exchange for 2,000) exchanges
# less often rather than spend its core on it
EXCHANGE_CPU_SHARE = 0.025
# A usage message is skipped (its usage goes in the next) while more than
# this is waiting to be written to the hub: a worker that does not read
RECEIVER_BACKLOG = 4 << 20
RESTART_DELAY = 0.5
MAX_RESTART_DELAY = 30.0
STABLE_SECONDS = 60.0  # a worker that ran this long restarts after RESTART_DELAY again

HEADER = struct.Struct(">cI")  # type, payload length
MAX_MESSAGE = 256 << 20  # a cluster-state snapshot of thousands of brokers is megabytes
USAGE = b"U"  # any worker -> the others: JSON rows (UsageOutbox.rows)
CLUSTER_STATE = b"C"  # primary -> the others: the snapshot's bytes as read
SHARES = b"S"  # primary -> the others: the shares document's bytes as read
LEADERS = b"L"  # primary -> the others: the partition leaders (a quota callback's)
PRIMARY_STARTED = b"P"  # primary -> the others: what it follows now was passed on
READY = b"R"  # worker -> supervisor: serving
STOP = b"T"  # supervisor -> worker: drain (payload: why)
CUT = b"X"  # supervisor -> worker: close what is left now
RELOAD = b"H"  # supervisor -> worker: as SIGHUP
FROM_PRIMARY = (CLUSTER_STATE, SHARES, LEADERS, PRIMARY_STARTED)  # kept for a worker started later
_WHAT = {CLUSTER_STATE: "the cluster state", SHARES: "the quota shares",
         LEADERS: "the partition leaders"}

KINDS = (CLIENT_BUCKETS, TOPIC_BUCKETS, IP_BUCKETS)
PRUNE_EVERY = 1200  # exchanges (a minute): forget buckets the manager dropped


def message(kind, payload=b""):
    return HEADER.pack(kind, len(payload)) + payload


async def read_message(reader):
    """(type, payload); IncompleteReadError at the end of the stream."""
    kind, size = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_MESSAGE:
        raise ConnectionError("a hub message of %d bytes" % size)
    return kind, (await reader.readexactly(size) if size else b"")


# the usage exchange (pure: the manager and the time passed in) ----------------------

class UsageOutbox:
    """What this worker's buckets counted since the last message: per
    bucket, the growth of its own counters (total, throttle ms, throttles,
    observe-only throttles and their ms), never what other workers added.
    Only the buckets used since the last message are read
    (QuotaManager.track_touched): a worker with many idle clients spends
    nothing on theirs."""

    def __init__(self, manager):
        self.manager = manager
        self._touched = manager.track_touched()
        self._sent = {}  # Bucket -> its counters at the last message
        self._count = 0

    def rows(self, now):
        """[[kind, key, user tag, client tag, entity, total, throttle ms,
        throttles, observed, observed ms], ...] since the last call; zero
        counters at the end are left off."""
        self.manager.settle_leases(now)  # what the connections' leases took, counted
        touched = self._touched
        used = touched[:]
        touched.clear()
        sent = self._sent
        rows = []
        for bucket in used:
            bucket.touched = touched  # its next use is noted again
            counts = (bucket.total, bucket.throttle_ms_total, bucket.throttled,
                      bucket.observed, bucket.observed_ms_total)
            before = sent.get(bucket)
            if before is None:  # new, or made again since (its counters start at 0)
                delta = list(counts)
            elif before == counts:
                continue
            else:
                delta = [a - b for a, b in zip(counts, before)]
            sent[bucket] = counts
            while len(delta) > 1 and not delta[-1]:
                delta.pop()
            if any(delta):
                rows.append([bucket.kind, bucket.key, bucket.user_tag, bucket.client_tag,
                             bucket.exchanged_entity] + delta)
        self._count += 1
        if self._count % PRUNE_EVERY == 0:
            self._prune()
        return rows

    def _prune(self):
        """Forget the buckets the manager dropped (expired, or their entity gone)."""
        manager = self.manager
        live = {id(b) for kind in KINDS for b in manager.buckets_of(kind).values()}
        for bucket in [b for b in self._sent if id(b) not in live]:
            del self._sent[bucket]


def add_usage(manager, rows, now):
    """Another worker's rows (UsageOutbox.rows) into this worker's buckets;
    how many found a bucket (none is made for an entity this worker's
    quotas do not have)."""
    applied = 0
    for row in rows:
        kind, key, user_tag, client_tag, entity = row[:5]
        bucket = manager.bucket_for_others(kind, key, user_tag, client_tag, entity)
        if bucket is not None:
            bucket.add_others(row[5], now, *row[6:])
            applied += 1
    return applied


# the worker's end ---------------------------------------------------------------

class WorkerHub:
    """A worker's end of the hub (the socket whose descriptor the supervisor
    passed it). ``serve()`` sets the handlers: ``on_stop(why)``,
    ``on_cut(why)``, ``on_reload()``; ``follow(kind, parse, apply)`` for what
    the primary passes on."""

    def __init__(self, index, fd):
        self.index = index
        self.fd = fd
        self.primary = index == PRIMARY
        self.on_stop = None
        self.on_cut = None
        self.on_reload = None
        self.stop_requested = None  # why, when a stop came before on_stop was set
        self.manager = None  # the QuotaManager usage is exchanged for
        self._reader = self._writer = None
        self._tasks = []
        self._followers = {}  # kind -> (parse, apply)
        self._pending = {}  # kind -> payload that came before its follower
        self._primary_started = None
        self._outbox = None
        self._bad_usage = None

    async def start(self):
        loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=self.fd)
        sock.set_inheritable(False)
        self._reader, self._writer = await asyncio.open_connection(sock=sock)
        self._primary_started = loop.create_future()
        self._tasks.append(loop.create_task(self._read()))

    async def close(self):
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()

    def send(self, kind, payload=b""):
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(message(kind, payload))

    def forwarder(self, kind):
        """A ZnodeWatch's ``forward``: each good version's bytes, to the others."""
        return lambda data: self.send(kind, data)

    # what the primary follows, applied by the others

    def follow(self, kind, parse, apply):
        """Apply what the primary passes on of ``kind``: ``parse(bytes)``,
        its clock checked as a watch does, then ``apply(value)``."""
        self._followers[kind] = (parse, apply)
        payload = self._pending.pop(kind, None)
        if payload is not None:
            self._follow(kind, payload)

    def _follow(self, kind, payload):
        parse, apply = self._followers[kind]
        try:
            value = parse(payload)
            value.check_clock(time.time())
        except (ValueError, UnicodeDecodeError, OSError, EOFError) as exc:
            log.error("what worker %d passed on (%s) does not read here: %s; the previous "
                      "one stays", PRIMARY, _WHAT.get(kind, kind), exc)
            return
        apply(value)

    async def primary_started(self):
        """Once the primary has passed on what it follows (at once when it
        did before this worker started); SystemExit if stopped meanwhile."""
        if not self._primary_started.done():
            log.info("waiting for worker %d to pass on the cluster state and the quota shares "
                     "it follows", PRIMARY)
        await self._primary_started
        if self.stop_requested is not None:
            log.info("stopped before serving (%s)", self.stop_requested)
            raise SystemExit(0)

    # serving

    def serving(self, manager):
        """The listeners are up: say so, and exchange ``manager``'s usage
        (None: no quotas, nothing to exchange)."""
        self.manager = manager
        self.send(READY)
        if manager is not None:
            self._outbox = UsageOutbox(manager)
            self._tasks.append(asyncio.get_running_loop().create_task(self._exchange()))

    async def _exchange(self):
        loop = asyncio.get_running_loop()
        outbox = self._outbox
        interval = EXCHANGE_INTERVAL
        while True:
            await asyncio.sleep(interval)
            writer = self._writer
            if writer.is_closing():
                return
            if writer.transport.get_write_buffer_size() > RECEIVER_BACKLOG:
                continue  # the counters keep growing: the next message carries it
            started = time.perf_counter()
            try:
                rows = outbox.rows(loop.time())
            except Exception:  # a bug: said, and the exchange goes on
                log.exception("cannot collect the quota usage for the other workers")
                continue
            if rows:
                self.send(USAGE, json.dumps(rows, separators=(",", ":")).encode())
            interval = max(EXCHANGE_INTERVAL,
                           (time.perf_counter() - started) / EXCHANGE_CPU_SHARE)

    # from the hub

    async def _read(self):
        why = "its hub socket closed"
        try:
            while True:
                kind, payload = await read_message(self._reader)
                try:
                    self._dispatch(kind, payload)
                except Exception:  # a bug: said, and the worker goes on
                    log.exception("cannot handle a hub message %r", kind)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, ConnectionError) and str(exc):
                why = str(exc)
        log.warning("the supervisor is gone (%s): stopping", why)
        self._writer.close()  # nothing more to send: the exchange ends
        self._stop("the supervisor is gone")

    def _dispatch(self, kind, payload):
        if kind == USAGE:
            if self.manager is not None:
                self._add_usage(payload)
        elif kind in (CLUSTER_STATE, SHARES):
            if kind in self._followers:
                self._follow(kind, payload)
            else:
                self._pending[kind] = payload
        elif kind == PRIMARY_STARTED:
            if not self._primary_started.done():
                self._primary_started.set_result(None)
        elif kind == STOP:
            self._stop(payload.decode("utf-8", "replace") or "stop")
        elif kind == CUT:
            why = payload.decode("utf-8", "replace") or "stop"
            if self.on_cut is not None:
                self.on_cut(why)
            else:
                self._stop(why)
        elif kind == RELOAD:
            if self.on_reload is not None:
                self.on_reload()

    def _add_usage(self, payload):
        try:
            add_usage(self.manager, json.loads(payload), asyncio.get_running_loop().time())
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            if str(exc) != self._bad_usage:  # once per reason
                self._bad_usage = str(exc)
                log.error("a usage message from another worker does not read: %s", exc)

    def _stop(self, why):
        if self.on_stop is not None:
            self.on_stop(why)
            return
        if self.stop_requested is None:
            self.stop_requested = why
        if self._primary_started is not None and not self._primary_started.done():
            self._primary_started.set_result(None)


class ForwardedShares:
    """A worker other than the primary, in a fleet (--proxy-id): the shares
    the primary read, followed as FleetMember follows them (their age, the
    fail-safe), with no report of its own (the primary's covers the
    machine)."""

    def __init__(self, config, manager, hub):
        from ..policy.fleet import parse_shares_document
        from ..sources.cluster_state import shares_znode
        from ..sources.state_topic import shares_key
        from .fleet import SharesFollower

        where = ("topic %s key %s" % (config.cluster_state_topic, shares_key(config.proxy_id))
                 if config.cluster_state_topic
                 else shares_znode(config.proxy_id, config.cluster_state_znode))
        self.follower = SharesFollower(
            manager, config.proxy_id, config.share_max_age_ms / 1000.0, config.share_fail_safe,
            where)
        hub.follow(SHARES, parse_shares_document,
                   lambda document: self.follower.update(document, time.time()))

    @property
    def fail_safe_active(self):
        return bool(self.follower.fail_safe_active)

    def tick(self, wall_now=None):
        self.follower.check(time.time() if wall_now is None else wall_now)

    def start_reports(self, server):
        pass


# the supervisor ---------------------------------------------------------------------

class _Worker:
    def __init__(self, index):
        self.index = index
        self.proc = None
        self.writer = None
        self.started_at = None
        self.ready = False  # served since its last start
        self.delay = RESTART_DELAY  # before its next restart
        self.restart = None  # the pending restart (a TimerHandle)
        self.tasks = []

    @property
    def running(self):
        return self.proc is not None and self.proc.returncode is None

    def send(self, kind, payload=b""):
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(message(kind, payload))


class Supervisor:
    """Starts ``count`` workers running ``argv`` (the command line after the
    program name) and keeps them running until a signal stops them."""

    def __init__(self, argv, count, executable=None):
        self.argv = list(argv)
        self.count = count
        self.executable = executable or sys.executable
        self.workers = [_Worker(i) for i in range(count)]
        self.kept = {}  # what the primary passed on last, by type, for workers started later
        self.stopping = None  # why
        self.serving = False  # every worker served once
        self.status = 0
        self._done = None

    async def run(self):
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        log.info("starting %d workers (pid %d supervises: it serves no client, passes "
                 "SIGTERM, SIGINT and SIGHUP on, and starts a worker that exits again)",
                 self.count, os.getpid())
        for worker in self.workers:
            await self._start(worker)
            if self.stopping:
                break
        self._check_done()
        await self._done
        return self.status

    async def _start(self, worker):
        worker.restart = None
        if self.stopping:
            return
        worker.proc = None
        ours, theirs = socket.socketpair()
        try:
            reader, worker.writer = await asyncio.open_connection(sock=ours)
            worker.proc = await asyncio.create_subprocess_exec(
                self.executable, "-m", "kthrottle", *self.argv,
                "--worker", "%d:%d" % (worker.index, theirs.fileno()),
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            log.error("cannot start worker %d: %s", worker.index, exc)
            if worker.writer is None:
                ours.close()
            self._exited(worker, None)
            return
        finally:
            theirs.close()  # the worker's now, or no one's
        worker.started_at = asyncio.get_running_loop().time()
        worker.ready = False
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)
        for kind in FROM_PRIMARY:  # what it would have been sent, had it run
            if kind in self.kept and worker.index != PRIMARY:
                worker.send(kind, self.kept[kind])
        loop = asyncio.get_running_loop()
        worker.tasks = [loop.create_task(self._hub(worker, reader)),
                        loop.create_task(self._wait(worker, worker.proc))]

    async def _hub(self, worker, reader):
        try:
            while True:
                kind, payload = await read_message(reader)
                if kind == READY:
                    self._ready(worker)
                    continue
                if kind in FROM_PRIMARY:
                    if worker.index != PRIMARY:
                        continue
                    self.kept[kind] = payload
                elif kind != USAGE:
                    continue
                data = message(kind, payload)
                for other in self.workers:
                    if other is worker or other.writer is None or other.writer.is_closing():
                        continue
                    if kind == USAGE and (other.writer.transport.get_write_buffer_size()
                                          > RECEIVER_BACKLOG):
                        continue  # a worker that does not read loses usage, not the hub
                    other.writer.write(data)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    def _ready(self, worker):
        worker.ready = True
        if not self.serving and all(w.ready for w in self.workers):
            self.serving = True
            log.info("%d workers serving: pids %s", self.count,
                     ", ".join(str(w.proc.pid) for w in self.workers))
        elif self.serving:
            log.info("worker %d (pid %d) serves again", worker.index, worker.proc.pid)

    async def _wait(self, worker, proc):
        await proc.wait()
        self._exited(worker, proc.returncode)

    def _exited(self, worker, returncode):
        loop = asyncio.get_running_loop()
        if worker.writer is not None:
            worker.writer.close()
            worker.writer = None
        status = 1 if returncode is None else returncode if returncode >= 0 else 128 - returncode
        how = ("exited with status %d" % returncode if returncode is not None and returncode >= 0
               else "was killed by %s" % signal.Signals(-returncode).name
               if returncode is not None else "did not start")
        pid = worker.proc.pid if worker.proc is not None else 0
        if self.stopping:
            if status and not self.status:
                self.status = status
            (log.info if not status else log.warning)("worker %d (pid %d) %s", worker.index,
                                                      pid, how)
            self._check_done()
            return
        if not self.serving and not worker.ready:
            log.error("worker %d (pid %d) %s before serving: stopping the other workers",
                      worker.index, pid, how)
            self.status = status or 1
            self._stop("worker %d failed to start" % worker.index)
            return
        ran = loop.time() - (worker.started_at or loop.time())
        if ran >= STABLE_SECONDS:
            worker.delay = RESTART_DELAY
        delay = worker.delay
        worker.delay = min(MAX_RESTART_DELAY, delay * 2)
        log.warning("worker %d (pid %d) %s after %.1f s; starting it again in %g s",
                    worker.index, pid, how, ran, delay)
        worker.restart = loop.call_later(delay, lambda: loop.create_task(self._start(worker)))

    def _stop(self, why):
        if self.stopping:
            return
        self.stopping = why
        for worker in self.workers:
            if worker.restart is not None:
                worker.restart.cancel()
                worker.restart = None
            worker.send(STOP, why.encode())
        self._check_done()

    def _check_done(self):
        if self.stopping and not any(w.running for w in self.workers):
            if not self._done.done():
                log.info("every worker has stopped")
                self._done.set_result(None)

    def _signal(self, sig):
        if self.stopping:
            log.info("%s again: the workers close their remaining connections now", sig.name)
            for worker in self.workers:
                worker.send(CUT, sig.name.encode())
            return
        log.info("%s: stopping the %d workers (each drains its connections)", sig.name,
                 self.count)
        self._stop(sig.name)

    def _reload(self):
        log.info("SIGHUP: passed on to the %d workers", self.count)
        for worker in self.workers:
            worker.send(RELOAD)


def supervise(argv, config):
    """``kthrottle proxy --workers N`` (N > 1): the supervisor's run; its
    exit status."""
    busy = ports_in_use(config)
    if busy:
        print("kthrottle: error: cannot listen: %s" % busy, file=sys.stderr)
        return 1
    return asyncio.run(Supervisor(argv, config.workers).run())


def ports_in_use(config):
    """Why the ports known now cannot be the workers' (None: free). Every
    worker binds with SO_REUSEPORT, which would let them join the workers of
    another kthrottle run by the same user on the same port, each holding
    the quotas alone: a port in use is refused here, as one process's bind
    refuses it."""
    from .health import bound_socket

    host = config.listen[0]
    for port in [config.listen[1]] + sorted(set(config.node_ports.values())):
        try:
            bound_socket(host, port, listening=False).close()
        except OSError as exc:
            return "%s (in use: another kthrottle on this port?)" % exc
    return None
