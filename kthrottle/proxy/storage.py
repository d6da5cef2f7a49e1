"""Storage-aware throttling of producers, as a pipeline filter.

The cluster state (``policy/storage.py``: OPEN, THROTTLE with a factor, PAUSE)
comes from the Spark job's snapshot in ZooKeeper. The filter reads the state in
force from an attribute that ``refresh`` sets, on each new snapshot and every
second (the snapshot ages), so a Produce request costs one attribute read
while the cluster is OPEN. Only Produce requests are touched: fetches,
consumers and every other API carry on. Principals in ``excluded`` (the volume
agents, canaries) are never touched.

- THROTTLE: a producer keeps ``factor`` of its produce rate: of its
  producer_byte_rate quota, or of ``base_rate`` when it has none. Its rate is
  measured per <user, client-id> as Kafka measures quotas, and it is delayed
  as Kafka delays it (X = (O - T) / T x W).
- PAUSE: a Produce request is not read (nor anything after it on that
  connection) until the state clears, checked every ``recheck_ms``; after
  ``pause_max_ms`` it goes on anyway (a client's request.timeout.ms, 30 s by
  default, must not expire first), and the next one is held again. Nothing of
  a held request reaches the broker.

With ``scope="partition"`` only Produce requests that write to a partition
in THROTTLE or PAUSE are touched, by the strongest state among their
partitions. The partitions are read as the request streams on
(``codecs/produce.py``), records skipped, never gathered, and only while the
snapshot lists such partitions; the decision is made when the request has
gone, so a PAUSE there throttles the producer for ``pause_max_ms`` after the
request (as a broker's quota does) instead of holding it back.
"""
import functools
import logging

from ..codecs import apis
from ..codecs.produce import ProducePartitions
from ..policy.rate import SampledRate, throttle_seconds, to_ms
from ..policy.storage import OPEN, OPEN_STATE, PAUSE
from .pipeline import HEAD, NOTHING, Defer, Filter, Observe, Throttle

log = logging.getLogger("kthrottle.storage")

DEFAULT_BASE_RATE = 1024 * 1024  # bytes/s kept at factor 1 by producers without a quota
DEFAULT_PAUSE_MAX_MS = 10_000
DEFAULT_RECHECK_MS = 250
RATE_IDLE_SECONDS = 3600.0
FACTOR_LOG_STEP = 0.1  # a THROTTLE factor moved this much is logged at INFO again


class StorageThrottle(Filter):
    name = "storage"

    def __init__(self, policy, excluded=(), base_rate=DEFAULT_BASE_RATE,
                 pause_max_ms=DEFAULT_PAUSE_MAX_MS, recheck_ms=DEFAULT_RECHECK_MS,
                 samples=11, window=1.0, max_throttle_ms=None):
        self.policy = policy  # policy.storage.StoragePolicy
        self.excluded = frozenset(excluded)
        self.base_rate = float(base_rate)
        self.pause_max = pause_max_ms / 1000.0
        self.recheck_ms = recheck_ms
        self.samples = samples
        self.window = window
        self.max_throttle_ms = max_throttle_ms if max_throttle_ms is not None else int(
            samples * window * 1000)
        self.current = OPEN_STATE  # what a Produce request meets (see refresh)
        self.watch_partitions = False  # partition scope: some partition is not OPEN
        self.wall_offset = 0.0  # epoch seconds minus the pipeline's clock
        self.reason = None  # why the fail-safe applies, when it does (FailSafeReason)
        self._cause = None  # the cause last logged (None: the state is known)
        self._logged_state = OPEN_STATE  # the state last logged at INFO
        self.rates = {}  # (principal, client-id) -> [SampledRate, last used]
        self.deferred = 0  # Produce requests held back (each check counts)
        self.released_at_cap = 0
        self.throttled = 0

    # the state in force -------------------------------------------------------

    def refresh(self, wall_now, now=None):
        """Work out the state in force at ``wall_now`` (epoch seconds: the
        snapshot's age); log each change once (a snapshot growing older is
        not a change: its reason's cause stays). Returns (State, fail-safe
        reason or None). Until a first snapshot has been read the state is
        OPEN: a cluster without the Spark job is not held (a snapshot that
        later goes missing or stale is unknown, and the fail-safe applies)."""
        if self.policy.state is None:
            state, reason = OPEN_STATE, None
        else:
            state, reason = self.policy.cluster(wall_now)
        cause = reason.cause if reason is not None else None
        if cause != self._cause:
            if reason is not None:
                log.warning("storage: %s; the fail-safe (%s) applies where the state is "
                            "unknown", reason, self.policy.fail_safe)
            else:
                log.info("storage: the cluster state is known again")
            self._cause = cause
        if state != self.current:
            logged = self._logged_state
            # a factor drifting with every snapshot of a filling volume is
            # one line per FACTOR_LOG_STEP, not one per job cycle
            news = state.state != logged.state or abs(state.factor - logged.factor) >= \
                FACTOR_LOG_STEP
            (log.info if news else log.debug)(
                "storage: producers now meet %s%s", state.state,
                " (factor %.3f)" % state.factor if state.state not in (OPEN, PAUSE) else "")
            if news:
                self._logged_state = state
        self.current, self.reason = state, reason
        snapshot = self.policy.state
        self.watch_partitions = snapshot is not None and bool(
            snapshot.partitions or (reason is not None and self.policy.fail_safe == PAUSE))
        if now is not None:
            self.wall_offset = wall_now - now
        if now is not None and self.rates:
            idle = [k for k, (_, used) in self.rates.items() if now - used > RATE_IDLE_SECONDS]
            for k in idle:
                del self.rates[k]
        return state, reason

    # the filter -----------------------------------------------------------------

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.PRODUCE else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING

    def on_request(self, conn, head, inflight):
        if self.policy.scope == "partition":
            if not self.watch_partitions or conn.principal in self.excluded:
                return None
            return Observe(ProducePartitions(head.api_version), functools.partial(
                self._partitions_read, head.client_id or "", head.frame_len))
        state = self.current
        if state is OPEN_STATE or state.state == OPEN:
            conn.deferred_since = None
            return None
        if conn.principal in self.excluded:
            return None
        now = conn.now
        if state.state == PAUSE:
            since = conn.deferred_since
            left = self.pause_max if since is None else since + self.pause_max - now
            if left > 0:
                self.deferred += 1
                return Defer(max(1, min(self.recheck_ms, to_ms(left))),
                             "storage PAUSE (%s)" % (self.reason or "a volume is past its "
                                                     "hard limit",))
            conn.deferred_since = None
            self.released_at_cap += 1
            return None
        conn.deferred_since = None
        return self._throttle(conn, head.client_id or "", head.frame_len, state)

    def _partitions_read(self, client_id, nbytes, conn, reader):
        wall = conn.now + self.wall_offset
        worst = OPEN_STATE
        for topic, partition in reader.partitions:
            if isinstance(topic, str):
                state = self.policy.partition(topic, partition, wall)
            else:  # a topic id (Produce v13+): the snapshot names topics
                state = self.policy.cluster(wall)[0]
            worst = worst.stronger(state)
        if worst.state == OPEN:
            return None
        if worst.state == PAUSE:
            self.deferred += 1
            return Throttle(to_ms(self.pause_max), "storage PAUSE of a partition written to")
        return self._throttle(conn, client_id, nbytes, worst)

    def _throttle(self, conn, client_id, nbytes, state):
        now = conn.now
        key = (conn.principal, client_id)
        entry = self.rates.get(key)
        if entry is None:
            entry = self.rates[key] = [SampledRate(self.samples, self.window), now]
        rate = entry[0]
        entry[1] = now
        rate.record(nbytes, now)
        base = self.base_rate
        quotas = conn.quotas_for(client_id)
        if quotas is not None:
            bucket = quotas.produce
            if bucket is not None and bucket.limit:
                base = bucket.limit
        limit = base * state.factor
        total, window = rate.scan(now)
        delay = to_ms(throttle_seconds(total / window, limit, window))
        if delay <= 0:
            return None
        self.throttled += 1
        return Throttle(min(delay, self.max_throttle_ms),
                        "storage THROTTLE: %.0f B/s of %.0f kept (factor %.3f)"
                        % (limit, base, state.factor))
