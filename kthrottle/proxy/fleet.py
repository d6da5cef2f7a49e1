"""The proxy as a member of a fleet sharing its quotas (``--proxy-id``).

Several proxies in front of one cluster each hold their clients to a share of
the quotas set once, in ZooKeeper, for the whole cluster. A member:

- publishes a usage report (``policy.fleet.UsageReport``) every
  ``--usage-interval``, keyed by its proxy id, to the compacted
  ``--usage-topic``: for every quota bucket used within the interval, its
  configured quota, its measured rate and its demand (``estimate_demand``,
  from the throttle time its clients were given during the interval), and
  the broker node ids the proxy forwards to. The report is built and sent
  on the event loop (where the buckets live) by
  ``sources.async_kafka.AsyncKafkaPublisher`` (aiokafka), with the proxy's
  upstream security settings; a publication still running when the next
  report is due makes that report wait for the one after. A
  cluster that cannot be reached fails the reports: the error is logged
  once (and once per new reason), and once more when they go through again.
- follows its shares, ``<cluster-state-znode>/shares/<proxy-id>`` in
  ZooKeeper (``sources.cluster_state.shares_znode``), which ``kthrottle
  spark-sync`` writes each cycle, with a kazoo data watch (or the key
  ``shares/<proxy-id>`` of ``--cluster-state-topic``: ``sources.state_topic``),
  and applies them
  live (``QuotaManager.apply_shares``: the buckets' limits change, no
  connection is touched). A malformed document (or one for another proxy)
  is refused with a log line, the last good shares stay.
- checks the shares' age every second: older than ``--share-max-age-ms``
  (or none read yet), the fail-safe applies (``--share-fail-safe``):
  ``last`` keeps the last shares (the configured quotas if there never were
  any), ``equal`` gives each bucket quota / the number of proxies last seen,
  ``whole`` the configured quota. Each change is logged and shows in
  ``kthrottle_fleet_fail_safe``.

The parts with no I/O take the time as arguments: ``UsageTracker`` (what a
report holds) and ``SharesFollower`` (which limits apply).
"""
import asyncio
import logging
import time

from ..policy.fleet import BucketUsage, UsageReport, estimate_demand, parse_own_shares
from ..policy.quotas import CAPACITY_ENTITY, CAPACITY_USER
from ..sources import cancelled
from ..sources.cluster_state import ZnodeWatch
from ..sources.outage import Outage

log = logging.getLogger("kthrottle.fleet")

PUBLISH_TIMEOUT = 10.0  # one publication in all at most: connecting, the topic, the ack
MIN_PUBLISH_TIMEOUT = 3.0
LAST, EQUAL, WHOLE = "last", "equal", "whole"


# the usage report (pure: the buckets and the time passed in) -----------------------

class UsageTracker:
    """Builds the usage reports of one proxy from its QuotaManager's buckets.

    ``report`` is called on the event loop at each interval; it lists the
    buckets used since the previous report, the demand of each from the
    growth of its ``throttle_ms_total`` since then."""

    def __init__(self, manager, proxy_id, interval, now):
        self.manager = manager
        self.proxy_id = proxy_id
        self.interval = interval  # seconds, as configured
        self.since = now  # loop time of the previous report
        self._throttle = {}  # sharing key -> (Bucket, throttle_ms_total at the last report)

    def report(self, now, wall_now, brokers=()):
        """The UsageReport for the interval ending at ``now`` (loop time;
        ``wall_now`` epoch seconds for ReportedAt); ``brokers`` the node ids
        the proxy forwards to."""
        elapsed = now - self.since
        if elapsed <= 0:
            elapsed = self.interval
        seen = self._throttle
        totals = {}
        buckets = []
        self.manager.settle_leases(now)  # what the connections' leases took, counted
        capacity = {key: [0.0, 0] for key in self.manager.capacity}  # key -> [rate, throttled]
        for sk, bucket in self.manager.buckets.items():
            # with --workers, the other workers' throttles too: a report covers the machine
            total = bucket.throttle_ms_total + bucket.others_throttle_ms
            totals[sk] = (bucket, total)
            used = bucket.last_used
            if used is None or used < self.since or bucket.quota is None:
                continue
            before = seen.get(sk)
            throttled = total - before[1] if before is not None and before[0] is bucket else total
            rate = bucket.measure(now)
            buckets.append(BucketUsage(
                bucket.key, bucket.user_tag, bucket.client_tag, bucket.entity or "",
                float(bucket.quota), rate,
                estimate_demand(rate, max(0, throttled), elapsed)))
            if bucket.key in capacity:
                summed = capacity[bucket.key]
                summed[0] += rate
                summed[1] += max(0, throttled)
        for key, (rate, throttled) in capacity.items():
            if rate > 0.0 or throttled:
                # the shared capacity, as one bucket: the fleet splits it among the proxies
                # by the demand of the buckets sharing it here
                buckets.append(BucketUsage(
                    key, CAPACITY_USER, "", CAPACITY_ENTITY,
                    float(self.manager.capacity[key].capacity), rate,
                    estimate_demand(rate, throttled, elapsed)))
        self._throttle = totals
        self.since = now
        buckets.sort(key=lambda b: b.sharing_key)
        return UsageReport(self.proxy_id, wall_now, float(self.interval),
                           tuple(sorted(brokers)), tuple(buckets))


# the shares in force (pure: the documents and the time passed in) --------------------

class SharesFollower:
    """Which limits a fleet member's buckets get: its last good shares while
    they are fresh, else the fail-safe. ``update`` takes a new (parsed)
    document, ``check`` the time; both apply what is due to the manager and
    return it (a short description)."""

    def __init__(self, manager, proxy_id, max_age, fail_safe=LAST, znode=""):
        if fail_safe not in (LAST, EQUAL, WHOLE):
            raise ValueError("share fail-safe must be last, equal or whole, got %r" % fail_safe)
        self.manager = manager
        self.proxy_id = proxy_id
        self.max_age = max_age  # seconds
        self.fail_safe = fail_safe
        self.znode = znode
        self.document = None  # the last good SharesDocument
        self.fail_safe_active = None  # None: not checked yet
        self.reason = None  # why the fail-safe applies, when it does
        self.changes = 0  # fail-safe transitions (on or off)
        self._applied = None  # (what, document) last applied to the manager
        self._first_check = None  # wall time of the first check
        self._none_warned = False  # "still no quota shares" said

    def age(self, wall_now):
        return None if self.document is None else max(0.0, wall_now - self.document.generated_at)

    def update(self, document, wall_now):
        previous = self.document
        self.document = document
        if previous is None or previous.fleet_size != document.fleet_size:
            log.info("fleet: quota shares of cycle %d for proxy %s: %d bucket(s), prior %.3f, "
                     "%d proxies in the fleet", document.cycle, self.proxy_id,
                     len(document.shares), document.prior, document.fleet_size)
        else:
            log.debug("fleet: quota shares of cycle %d: %d bucket(s)", document.cycle,
                      len(document.shares))
        return self.check(wall_now)

    def _stale(self, wall_now):
        doc = self.document
        if doc is None:
            return "no quota shares for proxy %s in %s yet" % (self.proxy_id, self.znode or "ZooKeeper")
        age = wall_now - doc.generated_at
        if age > self.max_age:
            return ("the quota shares (cycle %d) are %.0f s old, more than --share-max-age-ms %d"
                    % (doc.cycle, age, round(self.max_age * 1000)))
        return None

    def _what_fail_safe(self):
        doc = self.document
        if self.fail_safe == LAST:
            if doc is None:
                return (WHOLE, None), "last: the configured quotas until shares are read"
            return (LAST, doc), "last: the shares of cycle %d stay" % doc.cycle
        if self.fail_safe == EQUAL:
            n = doc.fleet_size if doc is not None else 1
            return (EQUAL, doc), "equal: each quota / %d proxies" % n
        return (WHOLE, None), "whole: the configured quotas"

    def check(self, wall_now):
        reason = self._stale(wall_now)
        doc = self.document
        if reason is None:
            what, said = (LAST, doc), "the shares of cycle %d" % doc.cycle
        else:
            what, said = self._what_fail_safe()
        if what != self._applied:
            kind, d = what
            m = self.manager
            if kind == LAST:
                m.apply_shares({sk: s.share for sk, s in d.shares.items()}, d.prior, d.fleet_size,
                               {sk: s.quota for sk, s in d.shares.items()})
            elif kind == EQUAL:
                m.apply_equal(d.fleet_size if d is not None else 0)
            else:
                m.apply_whole()
            self._applied = what
        active = reason is not None
        if self._first_check is None:
            self._first_check = wall_now
        elif (active and doc is None and not self._none_warned
              and wall_now - self._first_check > self.max_age):
            # none read since start is said at INFO (a proxy starting before its
            # first shares is usual); none within --share-max-age-ms, at WARNING
            log.warning("fleet: still no quota shares for proxy %s after %.0f s (more than "
                        "--share-max-age-ms %d); the fail-safe still applies (%s)", self.proxy_id,
                        wall_now - self._first_check, round(self.max_age * 1000), said)
            self._none_warned = True
        if active != self.fail_safe_active:
            if active:
                (log.info if self.fail_safe_active is None else log.warning)(
                    "fleet: %s; the fail-safe applies (%s)", reason, said)
            else:
                log.info("fleet: fresh quota shares (cycle %d, %d proxies): the fail-safe is "
                         "over", doc.cycle, doc.fleet_size)
            if self.fail_safe_active is not None or active:
                self.changes += 1
            self.fail_safe_active = active
        self.reason = reason
        return said


# ZooKeeper: the shares document, followed live ------------------------------------

class SharesWatch(ZnodeWatch):
    """This proxy's shares znode, followed live (``sources.cluster_state.
    ZnodeWatch``): a document for another proxy id is refused too."""

    what = "the quota shares"
    fail_safe = ("the last shares stay in force until they are older than --share-max-age-ms, "
                 "then --share-fail-safe applies")

    def __init__(self, hosts, znode, proxy_id, timeout=10.0):
        super().__init__(hosts, znode, timeout)
        self.proxy_id = proxy_id

    def parse(self, data):
        return parse_own_shares(data, self.proxy_id)


# publishing on the event loop ------------------------------------------------------

class _Publications:
    """Runs the publisher's publications as tasks on the event loop, one at
    a time: ``submit`` starts one unless one is still being sent (False
    then); ``done(ok, result)`` is called after each."""

    def __init__(self, publisher, done):
        self.publisher = publisher
        self.done = done
        self._task = None

    @property
    def busy(self):
        return self._task is not None

    def submit(self, key, value):
        if self._task is not None:
            return False
        self._task = asyncio.get_running_loop().create_task(self._publish(key, value))
        return True

    async def _publish(self, key, value):
        try:
            result = (True, await self.publisher.publish(key, value))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # PublishError, and anything unforeseen
            result = (False, exc)
        self._task = None
        self.done(*result)

    async def stop(self):
        """Cancel a publication in flight and close the publisher."""
        task, self._task = self._task, None
        await cancelled(task)
        try:
            await self.publisher.close()
        except Exception:
            pass


def publish_timeout(interval):
    """How long one publication may take: two report intervals, within
    MIN_PUBLISH_TIMEOUT-PUBLISH_TIMEOUT. Reports are skipped while one is
    being sent, and a report older than two intervals is superseded anyway;
    a cluster that went away is then seen as failing within that time."""
    return min(PUBLISH_TIMEOUT, max(MIN_PUBLISH_TIMEOUT, 2 * interval))


def publisher_for(config, timeout=None, token=None):
    """The AsyncKafkaPublisher of a proxy's usage reports: the upstream
    brokers and the proxy's upstream security settings (``token``: its
    OAUTHBEARER token, if it logs in with one)."""
    from ..sources.async_kafka import AsyncKafkaPublisher, aiokafka_config
    from ..sources.kafka_publisher import describe_connection

    if timeout is None:
        timeout = publish_timeout(config.usage_interval_ms / 1000.0)
    security = config.upstream_security()
    client = aiokafka_config(config.bootstrap_servers, "kthrottle-proxy-%s" % config.proxy_id,
                             security, timeout, token)
    return AsyncKafkaPublisher(client, config.usage_topic, timeout,
                               describe_connection(config.bootstrap_servers,
                                                   security.security_protocol,
                                                   security.sasl_mechanism,
                                                   security.sasl_username, security.ssl_cert),
                               security.sasl_password, logger=log)


# the member ----------------------------------------------------------------------

class FleetMember:
    """Wires the pieces for ``serve()``: ``start`` (before the listeners: the
    shares are in force before the first client), ``start_reports(server)``
    once the proxy runs, ``tick`` every second, ``stop``."""

    def __init__(self, config, manager, publisher=None, watch=None, token=None):
        from ..sources.cluster_state import shares_znode

        self.config = config
        self.manager = manager
        self.proxy_id = config.proxy_id
        self.interval = config.usage_interval_ms / 1000.0
        self.znode = shares_znode(config.proxy_id, config.cluster_state_znode)
        self.watch = watch if watch is not None else SharesWatch(config.zookeeper, self.znode,
                                                                 config.proxy_id)
        # where the shares are followed, for the log: the znode, or a topic's key
        self.where = getattr(self.watch, "where", self.znode)
        self.follower = SharesFollower(manager, config.proxy_id, config.share_max_age_ms / 1000.0,
                                       config.share_fail_safe, self.where)
        # made now: the password file is read before anything is started
        self._publisher = (publisher if publisher is not None
                           else publisher_for(config, token=token))
        self.tracker = None
        self.server = None
        self.reports = 0  # acknowledged by the cluster
        self.errors = 0  # publications that failed
        self.skipped = 0  # reports not sent: the previous one was still being sent
        self._publications = None
        self._task = None
        self._outage = Outage()  # failed publications: logged once per reason, and the end

    # shares

    @property
    def rejected(self):
        return self.watch.rejected

    @property
    def fail_safe_active(self):
        return bool(self.follower.fail_safe_active)

    def shares_age(self, wall_now=None):
        return self.follower.age(time.time() if wall_now is None else wall_now)

    async def start(self):
        """Follow the shares (QuotaStoreError if ZooKeeper cannot be watched)
        and apply what is due now."""
        await self.watch.start(self._new_document)
        # the watch delivered the current document (if any) through the loop
        await asyncio.sleep(0)
        self.tick()

    def _new_document(self, document):
        self.follower.update(document, time.time())

    def tick(self, wall_now=None):
        """Every second: the shares age."""
        self.follower.check(time.time() if wall_now is None else wall_now)

    # usage reports

    def start_reports(self, server):
        from ..sources.async_kafka import quiet_aiokafka_logging

        self.server = server
        loop = asyncio.get_running_loop()
        quiet_aiokafka_logging(debug=logging.getLogger("kthrottle").getEffectiveLevel()
                               <= logging.DEBUG)
        self._publications = _Publications(self._publisher, self._published)
        self.tracker = UsageTracker(self.manager, self.proxy_id, self.interval, loop.time())
        self._task = loop.create_task(self._report_loop())
        log.info("fleet: proxy %s publishes its usage to topic %s every %g s and follows its "
                 "quota shares in %s (fail-safe %s after %g s)", self.proxy_id,
                 self.config.usage_topic, self.interval, self.where, self.config.share_fail_safe,
                 self.config.share_max_age_ms / 1000.0)

    def report_now(self):
        """Build the report of the interval ending now and start its
        publication (on the event loop)."""
        loop = asyncio.get_running_loop()
        nodes = self.server.nodes if self.server is not None else {}
        report = self.tracker.report(loop.time(), time.time(), nodes)
        if not self._publications.submit(self.proxy_id.encode("utf-8"),
                                         report.to_json().encode("utf-8")):
            self.skipped += 1
            log.debug("fleet: the previous usage report is still being sent; this one is skipped")
            return None
        return report

    async def _report_loop(self):
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            now = loop.time()
            next_at += self.interval
            if next_at <= now:  # the loop was held up: skip the slots it missed
                next_at = now + self.interval
            try:
                self.report_now()
            except Exception:  # never let the loop die silently
                log.exception("fleet: cannot build the usage report")

    def _published(self, ok, result):
        """On the event loop, after each publication. A cluster that stays
        unreachable fails every report: one line when that starts (why),
        one per new reason, one when a report is published again."""
        if ok:
            self.reports += 1
            failed = self._outage.recovered()
            if failed:
                log.info("fleet: usage reports reach the cluster again (%s-%d at offset %d), "
                         "after %d failed publication(s)", result.topic, result.partition,
                         result.offset, failed)
            elif self.reports == 1:
                log.info("fleet: published the first usage report of proxy %s to %s-%d at "
                         "offset %d", self.proxy_id, result.topic, result.partition, result.offset)
            return
        self.errors += 1
        reason = str(result) or type(result).__name__
        if self._outage.failed(reason):
            if self._outage.failures == 1:
                log.error("fleet: usage report not published: %s; the next reports are tried "
                          "in turn, logged again when the reason changes and once they are "
                          "published", reason)
            else:
                log.error("fleet: usage reports still not published (%d failed so far), now: %s",
                          self._outage.failures, reason)

    async def stop(self):
        self._task = await cancelled(self._task)
        if self._publications is not None:
            await self._publications.stop()
            self._publications = None
        elif self._publisher is not None:
            await self._publisher.close()
        await self.watch.stop()
