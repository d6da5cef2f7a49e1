"""Storage-aware throttling of producers, as a pipeline filter.

The cluster state (``policy/storage.py``: OPEN, THROTTLE with a factor, PAUSE)
comes from the Spark job's snapshot, in ZooKeeper or in a compacted topic of
the cluster (``--cluster-state-topic``). The filter reads the state in
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
  ``pause_max_ms`` it goes on anyway, and so do the requests the client had
  sent behind it (read within ``BEHIND_RELEASE_SECONDS`` of its release): a
  client's request.timeout.ms (30 s by default) runs from when it sent each
  request, and a pipelining client (the Java producer keeps 5 in flight) whose
  requests were held one after another would see the last ones expire. The
  next request after those is held again. Nothing of a request reaches the
  broker while it is held.

With ``scope="partition"`` only Produce requests that write to a partition
in THROTTLE or PAUSE are touched, by the strongest state among their
partitions. The partitions are read as the request streams on
(``codecs/produce.py``), records skipped, never gathered, and only while the
snapshot lists such partitions; the decision is made when the request has
gone, so a PAUSE there throttles the producer for ``pause_max_ms`` after the
request (as a broker's quota does) instead of holding it back.
"""
import asyncio
import functools
import logging
import time

from ...codecs import apis
from ...codecs.produce import ProducePartitions
from ...policy.rate import SampledRate, throttle_seconds, to_ms
from ...policy.storage import OPEN, OPEN_STATE, PAUSE, UNKNOWN_SCOPES
from ...sources import ended
from ...options import INTEGER, NAMES, NUMBER, ConfigError, Option
from ..filter import HEAD, NOTHING, Defer, Filter, Observe, Throttle, json_number

log = logging.getLogger("kthrottle.storage")

SCOPES = ("cluster", "partition", "off")

DEFAULT_BASE_RATE = 1024 * 1024  # bytes/s kept at factor 1 by producers without a quota
DEFAULT_PAUSE_MAX_MS = 10_000
DEFAULT_RECHECK_MS = 250
# Requests read this soon after a held one went on at the cap were sent while
# it was held (they sat in the socket behind it): they go on too, so that none
# waits twice. A client that keeps writing gets this much unheld per cap.
BEHIND_RELEASE_SECONDS = 0.5
# The Java client's request.timeout.ms: a hold as long may expire requests
REQUEST_TIMEOUT_MS = 30_000
RATE_IDLE_SECONDS = 3600.0
FACTOR_LOG_STEP = 0.1  # a THROTTLE factor moved this much is logged at INFO again
REFRESH_SECONDS = 1.0  # the state in force worked out again (the snapshot ages)
MAX_BROKERS = 200  # status page rows: the brokers not OPEN first
MAX_VOLUMES = 32  # per broker: the fullest first
_STATE_VALUE = {"OPEN": 0, "THROTTLE": 1, "PAUSE": 2, "UNKNOWN": 3}  # kthrottle_storage_state


class _Held:
    """A connection's Produce request held back (PAUSE): since when, and when
    the last one went on at the cap (or, throttled for a partition's PAUSE,
    when its client is read again)."""

    __slots__ = ("since", "released")

    def __init__(self):
        self.since = None
        self.released = None


class StorageThrottle(Filter):
    name = "storage"
    follows_cluster_state = True
    status_absent = {"configured": False}
    options_title = ("storage-aware throttling (off unless --storage-scope is given; the cluster "
                     "state kthrottle spark-sync writes to --cluster-state-topic or --zookeeper)")
    options = (
        Option("storage-scope", choices=SCOPES,
               help="turns storage-aware throttling on (it is off unless given; --zookeeper "
               "alone means quotas only). cluster: when a broker volume passes its soft limit "
               "every producer is slowed by the state's factor, and past its hard limit its "
               "Produce requests are held; partition: only Produce requests writing to a "
               "partition with a replica on such a volume are slowed, or throttled for "
               "--storage-pause-max-ms; off: the same as not given. Follows the cluster state "
               "in --cluster-state-topic, else in --zookeeper, from the first snapshot the job "
               "writes"),
        Option("storage-fail-safe", default="PAUSE", choices=("PAUSE", "OPEN"),
               help="what an unknown state means (a snapshot older than --storage-max-age-ms, "
               "brokers without a fresh volume report): PAUSE (default) or OPEN"),
        Option("storage-max-age-ms", INTEGER, default=120_000, metavar="MS",
               help="a cluster state older than this is unknown (default 120000)"),
        Option("storage-base-rate", NUMBER, default=1024 * 1024, metavar="BYTES/S",
               help="the produce rate a producer without a producer_byte_rate quota keeps at "
               "factor 1 when throttled for storage (default 1048576)"),
        Option("storage-unknown-scope", default="cluster", choices=UNKNOWN_SCOPES,
               help="how far the fail-safe reaches when brokers have no fresh volume report: "
               "cluster (default) every producer; broker only Produce requests writing to a "
               "partition with a replica on such a broker (read as they stream, in either "
               "scope). Without any fresh snapshot (none --storage-max-age-ms after start, or a "
               "stale one) every broker is unknown and the fail-safe reaches every producer"),
        Option("storage-pause-max-ms", INTEGER, default=10_000, metavar="MS",
               help="longest a Produce request is held while paused, before it goes on with "
               "the requests the client sent behind it (default 10000; keep it well under the "
               "clients' request.timeout.ms, 30000 in the Java client)"),
        Option("storage-excluded-principals", NAMES, default=[], metavar="LIST",
               help="comma-separated principals never throttled for storage (the volume "
               "agents, canaries)"),
    )

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
        self.cluster_state = None  # the source followed (connected, healthy, rejected)
        self._refreshing = None  # the task refreshing the state in force

    # the quota window is the storage rate's
    reads = ("zookeeper", "cluster_state_topic", "quota_settings")

    @classmethod
    def check(cls, config):
        scope = config.storage_scope
        if scope is not None and scope not in SCOPES:
            raise ConfigError("storage-scope must be cluster, partition or off, got %r" % scope)
        if scope is None:
            # storage-aware throttling is off unless asked for: a setting of
            # it given alone is a mistake to say, not to ignore
            given = [o.name for o in cls.options if o.name != "storage-scope"
                     and getattr(config, o.attr) != o.default_value()]
            if given:
                raise ConfigError("%s: storage-aware throttling is off unless storage-scope is "
                                  "given (cluster or partition, with --cluster-state-topic or "
                                  "--zookeeper)" % ", ".join(given))
        elif scope != "off" and not (config.zookeeper or config.cluster_state_topic):
            raise ConfigError("storage-scope %s follows the cluster state kthrottle spark-sync "
                              "writes to ZooKeeper: give --zookeeper HOST:PORT[/chroot] too, or "
                              "--cluster-state-topic NAME where it writes to a compacted topic "
                              "of the cluster" % scope)
        if config.storage_unknown_scope not in UNKNOWN_SCOPES:
            raise ConfigError("storage-unknown-scope must be cluster or broker, got %r"
                              % config.storage_unknown_scope)
        if config.storage_fail_safe not in ("PAUSE", "OPEN"):
            raise ConfigError("storage-fail-safe must be PAUSE or OPEN, got %r"
                              % config.storage_fail_safe)
        if config.storage_max_age_ms <= 0 or config.storage_pause_max_ms <= 0:
            raise ConfigError("storage-max-age-ms and storage-pause-max-ms must be positive")
        if not config.storage_base_rate > 0:
            raise ConfigError("storage-base-rate must be a positive number of bytes/s")

    @classmethod
    def enabled(cls, config):
        """Only when asked for: storage-scope cluster or partition (with the
        cluster state in --cluster-state-topic or --zookeeper)."""
        followed = (config.cluster_state_topic, config.zookeeper)
        return any(followed) and config.storage_scope in ("cluster", "partition")

    @classmethod
    def build(cls, config, services):
        """The cluster state is fed in by the composition root
        (``policy.update``, then ``refresh``)."""
        if not cls.enabled(config):
            return None
        from ...policy.storage import StoragePolicy

        if config.storage_pause_max_ms >= REQUEST_TIMEOUT_MS:
            log.warning("storage-pause-max-ms %d: a Produce request held that long meets the "
                        "Java client's request.timeout.ms (%d) first; keep it well under the "
                        "clients' timeout", config.storage_pause_max_ms, REQUEST_TIMEOUT_MS)
        settings = config.quota_settings()
        return cls(StoragePolicy(config.storage_scope, config.storage_fail_safe,
                                 config.storage_max_age_ms / 1000.0,
                                 config.storage_unknown_scope),
                   config.storage_excluded_principals, config.storage_base_rate,
                   config.storage_pause_max_ms, samples=settings.samples,
                   window=settings.window)

    def new_state(self):
        return _Held()

    # lifecycle ------------------------------------------------------------------

    async def start(self, services):
        """From now on the first snapshot is awaited (none in
        storage-max-age-ms is unknown), and the state in force is worked out
        again every REFRESH_SECONDS."""
        self.cluster_state = services.cluster_state
        loop = asyncio.get_running_loop()
        self.refresh(time.time(), loop.time())
        self._refreshing = loop.create_task(self._refresh_every_second())

    async def _refresh_every_second(self):
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            self.refresh(time.time(), loop.time())

    async def stop(self):
        self._refreshing = await ended(self._refreshing)

    def on_cluster_state(self, state):
        self.policy.update(state)
        self.refresh(time.time(), asyncio.get_running_loop().time())

    def degraded(self):
        lines = []
        cluster_state = self.cluster_state
        if cluster_state is not None and not cluster_state.healthy:
            lines.append("cluster state: %s" % getattr(
                cluster_state, "unhealthy", "the ZooKeeper session following it is not connected"))
        if self.reason is not None:
            lines.append("cluster state: %s; the storage fail-safe applies" % (self.reason,))
        return lines

    def metrics(self, family):
        current = self.current
        state = family("kthrottle_storage_state")
        factor = family("kthrottle_storage_factor")
        state.add_metric(["cluster", "", ""], _STATE_VALUE[current.state])
        factor.add_metric(["cluster", "", ""], current.factor)
        snapshot = self.policy.state
        if snapshot is not None:
            for broker, entry in sorted(snapshot.brokers.items()):
                if not isinstance(entry, dict):
                    continue
                state.add_metric(["broker", str(broker), ""],
                                 _STATE_VALUE.get(entry.get("state"), 3))
                for volume in entry.get("volumes") or ():
                    # volumes past their soft limit only: a fleet has thousands
                    if isinstance(volume, dict) and volume.get("state") != "OPEN":
                        tags = ["volume", str(broker), str(volume.get("name"))]
                        state.add_metric(tags, _STATE_VALUE.get(volume.get("state"), 3))
                        factor.add_metric(tags, float(volume.get("factor", 1.0)))
        yield state
        yield factor
        yield family("kthrottle_storage_fail_safe", 1 if self.reason else 0)
        if snapshot is not None:
            yield family("kthrottle_cluster_state_age_seconds",
                         max(0.0, time.time() - snapshot.generated_at))
        yield family("kthrottle_storage_deferred_requests_total", self.deferred)
        yield family("kthrottle_storage_throttled_requests_total", self.throttled)
        if self.cluster_state is not None:
            yield family("kthrottle_cluster_state_rejected_total", self.cluster_state.rejected)

    def status(self):
        """The state in force, and the snapshot's brokers and volumes."""
        wall = time.time()
        policy = self.policy
        snapshot = policy.state
        current = self.current
        out = {
            "configured": True,
            "scope": policy.scope,
            "fail_safe": policy.fail_safe,
            "state": current.state,
            "factor": json_number(current.factor),
            "fail_safe_reason": str(self.reason) if self.reason is not None else None,
            "max_age_s": json_number(policy.max_age),
            "snapshot_age_s": None,
            "unknown_brokers": [],
            "brokers": [],
            "brokers_total": 0,
            "source": None,
        }
        cluster_state = self.cluster_state
        if cluster_state is not None:
            out["source"] = {"connected": bool(getattr(cluster_state, "connected", False)),
                             "rejected": getattr(cluster_state, "rejected", 0)}
        if snapshot is None:
            return out
        out["snapshot_age_s"] = json_number(max(0.0, wall - snapshot.generated_at), 1)
        out["unknown_brokers"] = list(snapshot.unknown_brokers)
        brokers = [_broker_status(broker, entry, wall)
                   for broker, entry in snapshot.brokers.items() if isinstance(entry, dict)]
        brokers.sort(key=lambda b: (b["state"] == "OPEN", _broker_order(b["broker"])))
        out["brokers"] = brokers[:MAX_BROKERS]
        out["brokers_total"] = len(brokers)
        return out

    # the state in force -------------------------------------------------------

    def refresh(self, wall_now, now=None):
        """Work out the state in force at ``wall_now`` (epoch seconds: the
        snapshot's age); log each change once (a snapshot growing older is
        not a change: its reason's cause stays). Returns (State, fail-safe
        reason or None). The first call starts the clock of the first
        snapshot: without one --storage-max-age-ms later the state is unknown,
        as a stale one is."""
        self.policy.follow_from(wall_now)
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
        held = reason is not None and self.policy.fail_safe == PAUSE
        # partition scope: read a Produce request's partitions while some is
        # not OPEN; cluster scope: only for brokers without a fresh report
        # under broker reach (their partitions are held, the rest go on)
        self.watch_partitions = (bool(snapshot.partitions) if snapshot is not None else False) \
            or held if self.policy.scope == "partition" else self.policy.unknown_partitions_held
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

    def on_request(self, ctx, head, inflight):
        if self.policy.scope == "partition":
            if not self.watch_partitions or ctx.principal in self.excluded:
                return None
            return Observe(ProducePartitions(head.api_version), functools.partial(
                self._partitions_read, head.client_id or "", head.frame_len))
        state = self.current
        if self.watch_partitions and state.state != PAUSE:  # broker reach (cluster scope)
            if ctx.principal in self.excluded:
                return None
            return Observe(ProducePartitions(head.api_version), functools.partial(
                self._partitions_read, head.client_id or "", head.frame_len))
        if state is OPEN_STATE or state.state == OPEN:
            ctx.state.since = None
            return None
        if ctx.principal in self.excluded:
            return None
        now = ctx.now
        if state.state == PAUSE:
            held = ctx.state
            since = held.since
            if since is None:
                released = held.released
                if released is not None and now - released < BEHIND_RELEASE_SECONDS:
                    self.released_at_cap += 1  # it waited behind the one released
                    return None
                held.since = since = now
            left = since + self.pause_max - now
            if left > 0:
                self.deferred += 1
                return Defer(max(1, min(self.recheck_ms, to_ms(left))),
                             "storage PAUSE (%s)" % (self.reason or "a volume is past its "
                                                     "hard limit",))
            held.since = None
            held.released = now
            self.released_at_cap += 1
            return None
        ctx.state.since = None
        return self._throttle(ctx, head.client_id or "", head.frame_len, state)

    def _partitions_read(self, client_id, nbytes, ctx, reader):
        wall = ctx.now + self.wall_offset
        # cluster scope (broker reach): what the known brokers say, and the
        # fail-safe of the partitions on brokers without a fresh report
        worst = OPEN_STATE if self.policy.scope == "partition" else self.current
        for topic, partition in reader.partitions:
            if isinstance(topic, str):
                state = self.policy.partition(topic, partition, wall)
            else:  # a topic id (Produce v13+): the snapshot maps ids to names
                state = self.policy.partition_by_id(topic, partition, wall)
            worst = worst.stronger(state)
        if worst.state == OPEN:
            return None
        if worst.state == PAUSE:
            held = ctx.state
            now = ctx.now
            until = held.released
            if until is not None and now < until + BEHIND_RELEASE_SECONDS:
                return None  # sent behind the one throttled, while its client was not read
            held.released = now + self.pause_max
            self.deferred += 1
            return Throttle(to_ms(self.pause_max), "storage PAUSE of a partition written to")
        return self._throttle(ctx, client_id, nbytes, worst)

    def _throttle(self, ctx, client_id, nbytes, state):
        now = ctx.now
        key = (ctx.principal, client_id)
        entry = self.rates.get(key)
        if entry is None:
            entry = self.rates[key] = [SampledRate(self.samples, self.window), now]
        rate = entry[0]
        entry[1] = now
        rate.record(nbytes, now)
        base = self.base_rate
        quotas = ctx.quotas_for(client_id)
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


# the status page's rows ----------------------------------------------------------

def _broker_status(broker, entry, wall):
    volumes = [v for v in entry.get("volumes") or () if isinstance(v, dict)]
    rows = []
    for v in volumes:
        capacity, consumed = json_number(v.get("capacity"), 0), json_number(v.get("consumed"), 0)
        rows.append({
            "name": str(v.get("name")), "log_dir": str(v.get("log_dir") or ""),
            "capacity": capacity, "consumed": consumed,
            "used": json_number(consumed / capacity, 4) if capacity and consumed is not None
            else None,
            "state": str(v.get("state")), "factor": json_number(v.get("factor"))})
    rows.sort(key=lambda r: (r["state"] == "OPEN", -(r["used"] or 0.0), r["name"]))
    reported = entry.get("reported_at")
    return {
        "broker": str(broker), "state": str(entry.get("state")),
        "factor": json_number(entry.get("factor")), "reason": entry.get("reason"),
        "report_age_s": json_number(max(0.0, wall - reported), 1)
        if isinstance(reported, (int, float)) else None,
        "volumes": rows[:MAX_VOLUMES], "volumes_total": len(rows)}


def _broker_order(broker):
    return (0, int(broker), "") if broker.isdigit() else (1, 0, broker)
