"""The cluster state and the fleet's quota shares in a compacted topic of the
cluster itself, followed live (``--cluster-state-topic``).

Kafka 4 has no ZooKeeper (KIP-500): ``kthrottle spark-sync`` without
``--zookeeper`` writes what it would write to the znodes to one compacted
topic instead (``DEFAULT_TOPIC``), one record per document, keyed:

- ``cluster-state`` (``STATE_KEY``): the cluster-state snapshot, the bytes
  the znode would hold (``policy.storage.encode_snapshot``);
- ``shares/<proxy-id>`` (``shares_key``): that fleet member's quota shares
  (``policy.fleet.encode_shares_document``), as ``<znode>/shares/<id>``.

Compaction keeps the latest record of each key (cleanup.policy=compact), so
the topic stays near one record per document. One topic rather than one per
kind: a proxy follows one partition for both, and the job writes one cycle
to one log, the shares first and the snapshot last.

A proxy reads it with one consumer and no consumer group (nothing is
committed; every proxy reads the whole topic): the partitions assigned, read
from the beginning, and followed (``StateTopicReader``). What was in the
topic at start is read to its end first and only the latest record of each
key is applied (older ones would be stale, and the storage fail-safe would
flicker on them); after that each record is applied as it comes. Each
document goes through the checks a znode's does (``ZnodeWatch``): what does
not parse, or is dated more than ``MAX_CLOCK_SKEW`` ahead of this machine's
clock, is refused with a log line (once per content) and counted, and the
last good one stays; a tombstone keeps it too (it ages). A cluster that
cannot be read keeps the last state in force while it ages (the readers'
fail-safes take over once it is too old): said once when the reading stops,
once when it is back; aiokafka reconnects by itself, and a consumer stuck
longer than ``RESTART_AFTER`` is made again, resuming where it was.
"""
import asyncio
import logging
import time

from . import cancelled
from .outage import Outage

log = logging.getLogger("kthrottle.storage")

DEFAULT_TOPIC = "__kthrottle_cluster_state"
STATE_KEY = "cluster-state"
SHARES_PREFIX = "shares/"
# aiokafka's fetch returns within fetch_max_wait_ms (500) when there is
# nothing new: a partition not polled for this long is not being read
STALLED_AFTER = 15.0
RESTART_AFTER = 60.0  # stalled this long: the consumer is made again
START_TIMEOUT = 10.0  # what start() waits for the topic's current content at most
MISSING_RECHECK = 10.0  # a topic not there yet is looked for again this often
PARSE_OFF_LOOP = 64 * 1024  # larger documents (a gzip snapshot) are parsed on a thread


def shares_key(proxy_id):
    """The key of a fleet member's quota shares in the topic."""
    return SHARES_PREFIX + proxy_id


def key_text(key):
    """A record's key as text, None for none or one that is not UTF-8."""
    if key is None:
        return None
    try:
        return bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        return None


def latest_of_keys(records, keys=None):
    """{key: (value, offset)} of the last record of each key among
    ``records`` [(partition, offset, key bytes, value bytes)], in the order
    read (within a partition the offset decides); only ``keys`` if given."""
    out = {}
    for _partition, offset, key, value in records:
        text = key_text(key)
        if text is None or (keys is not None and text not in keys):
            continue
        out[text] = (value, offset)
    return out


def caught_up(positions, ends):
    """Whether every partition's position has reached its end offset as
    listed at start ({partition: offset} both; a partition without a
    position yet has not)."""
    return all(positions.get(p, -1) >= end for p, end in ends.items())


# the documents (the ZnodeWatch counterparts) -----------------------------------------

class TopicWatch:
    """One key of the topic, followed as ``ZnodeWatch`` follows a znode:
    ``start(on_update)`` calls ``on_update(value)`` on the event loop for each
    good version (the one there at start first), ``forward(bytes)`` too when
    set (--workers). ``reader`` is the StateTopicReader it shares with the
    proxy's other watches."""

    what = "the cluster state"
    fail_safe = ("the last snapshot stays in force until it is older than --storage-max-age-ms, "
                 "then --storage-fail-safe applies")

    def __init__(self, reader, key):
        self.reader = reader
        self.key = key
        self.rejected = 0
        self.updates = 0
        self.seen = False
        self.forward = None
        self.offset = None  # of the record last taken
        self._on_update = None
        self._last_bad = None
        self._stopped = False

    @property
    def where(self):
        return "topic %s key %s" % (self.reader.topic, self.key)

    @property
    def connected(self):
        """Whether the topic is being read now (a metric)."""
        return self.reader.connected

    @property
    def healthy(self):
        return self.reader.connected and not self._stopped

    unhealthy = property(lambda self: "%s is not being read (%s)" % (
        self.where, self.reader.reason or "not connected"))

    def parse(self, data):
        raise NotImplementedError

    async def start(self, on_update):
        self._on_update = on_update
        await self.reader.attach(self)

    async def stop(self):
        self._stopped = True
        await self.reader.detach(self)

    def parsed(self, data, offset):
        """(value, None) or (None, why) for the record's value (no clock
        check: ``take`` makes it when it applies the value)."""
        try:
            return self.parse(data), None
        except (ValueError, UnicodeDecodeError, OSError, EOFError) as exc:  # gzip: OSError, EOF
            return None, exc

    def take(self, data, offset, value=None, error=None):
        """On the event loop: the record at ``offset`` (``data`` its value,
        None for a tombstone) and, when the reader parsed it already, its
        ``value`` or ``error``."""
        if self._stopped or offset == self.offset:  # handed already (attach after catch-up)
            return
        self.offset = offset
        if data is None:
            if self.seen:
                log.warning("%s in %s was deleted (a tombstone at offset %d); the last one stays "
                            "until it is too old", self.what, self.where, offset)
            return
        if value is None and error is None:
            value, error = self.parsed(data, offset)
        if error is None:
            try:
                value.check_clock(time.time())
            except ValueError as exc:
                error = exc
        if error is not None:
            if data != self._last_bad:
                self._last_bad = data
                log.error("refused %s in %s (offset %d): %s; the previous one stays", self.what,
                          self.where, offset, error)
            self.rejected += 1  # after the line: whoever sees the count finds it logged
            return
        self._last_bad = None
        self.seen = True
        self.updates += 1
        self._on_update(value)
        if self.forward is not None:
            self.forward(bytes(data))


class ClusterStateWatch:
    """What the cluster state's two watches share (``ClusterStateTopic``,
    and ``cluster_state.ClusterStateSource`` on a znode): the snapshot
    parsed, and a line at start while there is none yet (``state_where``
    says where it is looked for)."""

    def parse(self, data):
        from ..policy.storage import ClusterState

        return ClusterState.from_json(data)

    async def start(self, on_update):
        """``on_update(ClusterState)`` for each good snapshot."""
        await super().start(on_update)
        if not self.seen:
            log.info("no cluster state %s yet: storage throttling starts with the first "
                     "snapshot the Spark job writes", self.state_where)


class ClusterStateTopic(ClusterStateWatch, TopicWatch):
    """The snapshot (``STATE_KEY``), as ClusterStateSource reads the znode."""

    def __init__(self, reader):
        super().__init__(reader, STATE_KEY)

    @property
    def state_where(self):
        return "in %s" % self.where


class SharesTopic(TopicWatch):
    """A fleet member's quota shares (``shares/<proxy-id>``), as SharesWatch
    reads its znode: a document for another proxy id is refused too."""

    what = "the quota shares"
    fail_safe = ("the last shares stay in force until they are older than --share-max-age-ms, "
                 "then --share-fail-safe applies")

    def __init__(self, reader, proxy_id):
        super().__init__(reader, shares_key(proxy_id))
        self.proxy_id = proxy_id

    def parse(self, data):
        from ..policy.fleet import parse_own_shares

        return parse_own_shares(data, self.proxy_id)


# the consumer ----------------------------------------------------------------------

class StateTopicReader:
    """One aiokafka consumer on the event loop, following ``topic`` for the
    watches attached to it (each by its key); started by the first
    ``attach``, stopped by the last ``detach``. ``config`` is aiokafka's
    (``async_kafka.aiokafka_config``); ``describe`` says where and as whom;
    ``secret`` is scrubbed from what is logged."""

    def __init__(self, config, topic, keys=(), describe="", secret=None,
                 start_timeout=START_TIMEOUT):
        self.config = dict(config)
        self.topic = topic
        # the keys whose latest record is kept for a watch attached later
        # (the fleet's starts after the cluster state's has read the topic)
        self.keys = set(keys)
        self.describe = describe or ",".join(self.config.get("bootstrap_servers", ()))
        self.secret = secret
        self.start_timeout = start_timeout
        self.watches = {}  # key -> [TopicWatch]
        self.latest = {}  # key -> (value, offset): the last record of each key watched
        self.positions = {}  # partition -> next offset, kept across new consumers
        self.connected = False  # the partitions are being read now
        self.reason = None  # why not, when not
        self.records = 0  # records read
        self.restarts = 0  # consumers made again after a failure or a stall
        self._consumer = None
        self._task = None
        self._ready = None  # set once the content at start was read (or not there)
        self._outage = Outage()
        self._missing_said = False
        self._waited = False

    # watches

    async def attach(self, watch):
        """Start following ``watch.key`` (the reader too, if it is the
        first); the value there now is handed to the watch before this
        returns, when it could be read within ``start_timeout``."""
        self.watches.setdefault(watch.key, []).append(watch)
        self.keys.add(watch.key)
        if self._task is None:
            from .async_kafka import quiet_aiokafka_logging

            quiet_aiokafka_logging(debug=logging.getLogger("kthrottle").getEffectiveLevel()
                                   <= logging.DEBUG)
            self._ready = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            if not self._waited:  # a second watch does not wait again for what is not there
                await asyncio.wait_for(asyncio.shield(self._ready.wait()), self.start_timeout)
        except asyncio.TimeoutError:
            log.warning("could not read topic %s on %s within %g s (%s): carrying on without "
                        "it; %s is applied once it is read, and meanwhile %s", self.topic,
                        self.describe, self.start_timeout, self.reason or "no answer",
                        watch.what, watch.fail_safe)
        self._waited = True
        held = self.latest.get(watch.key)
        if held is not None:
            await self._hand(watch, *held)

    async def detach(self, watch):
        kept = [w for w in self.watches.get(watch.key, ()) if w is not watch]
        if kept:
            self.watches[watch.key] = kept
        else:
            self.watches.pop(watch.key, None)
        if not self.watches:
            self._task = await cancelled(self._task)
            await self._close()

    async def _hand(self, watch, data, offset):
        value = error = None
        if data is not None and len(data) > PARSE_OFF_LOOP:
            value, error = await asyncio.to_thread(watch.parsed, data, offset)
        watch.take(data, offset, value, error)

    async def _deliver(self, key, data, offset):
        self.latest[key] = (data, offset)
        for watch in list(self.watches.get(key, ())):
            await self._hand(watch, data, offset)

    # the consumer's life

    async def _run(self):
        backoff = 1.0
        while True:
            try:
                await self._follow()
                backoff = 1.0  # a stall ended it: make it again at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # aiokafka's errors, OSError: said, then tried again
                self._failed(self._text(exc))
                await self._close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def _text(self, exc):
        from .async_kafka import connection_error

        return connection_error(exc, self.secret)

    def _failed(self, reason):
        was = self.connected
        self.connected = False
        self.reason = reason
        if self._outage.failed(reason):
            if self._outage.failures == 1 or was:
                log.warning("cannot read topic %s on %s: %s; the last cluster state and shares "
                            "read stay in force while they age (the fail-safes apply once they "
                            "are too old); trying again", self.topic, self.describe, reason)
            else:
                log.warning("topic %s on %s still cannot be read, now: %s", self.topic,
                            self.describe, reason)

    def _recovered(self):
        self.reason = None
        if not self.connected:
            self.connected = True
            failures = self._outage.recovered()
            if failures:
                log.info("reading topic %s on %s again", self.topic, self.describe)

    async def _close(self):
        consumer, self._consumer = self._consumer, None
        self.connected = False
        if consumer is not None:
            try:
                await asyncio.wait_for(consumer.stop(), 5)
            except Exception:
                pass

    async def _consumer_started(self):
        from aiokafka import AIOKafkaConsumer

        from .async_kafka import watch_aiokafka_errors

        watch_aiokafka_errors()
        consumer = AIOKafkaConsumer(group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="earliest", **self.config)
        self._consumer = consumer
        await asyncio.wait_for(consumer.start(), self.start_timeout + 5)
        return consumer

    async def _partitions(self, consumer):
        """The topic's partitions, once it exists (said once while it does
        not: the job creates it on its first cycle)."""
        from aiokafka import TopicPartition

        while True:
            topics = await asyncio.wait_for(consumer.topics(), self.start_timeout + 5)
            if self.topic in topics:
                break
            self._recovered()  # the cluster answers: nothing to read yet
            self.positions.clear()  # a topic created again starts over
            if not self._missing_said:
                self._missing_said = True
                log.info("topic %s does not exist on %s yet (kthrottle spark-sync creates it on "
                         "its first cycle): looked for again every %g s", self.topic,
                         self.describe, MISSING_RECHECK)
            self._ready.set()
            await asyncio.sleep(MISSING_RECHECK)
        # assigning a partition has the consumer's client track the topic's
        # metadata (every topic has a partition 0); then all are known
        consumer.assign([TopicPartition(self.topic, 0)])
        deadline = time.monotonic() + self.start_timeout
        while not consumer.partitions_for_topic(self.topic):
            if time.monotonic() > deadline:
                raise TimeoutError("no metadata for topic %s within %g s"
                                   % (self.topic, self.start_timeout))
            await asyncio.sleep(0.1)
        return sorted(consumer.partitions_for_topic(self.topic))

    async def _follow(self):
        """One consumer, until it fails (raises) or stalls (returns)."""
        from aiokafka import TopicPartition

        if self._consumer is not None:
            await self._close()
            self.restarts += 1
        consumer = await self._consumer_started()
        partitions = await self._partitions(consumer)
        if self._missing_said:
            log.info("topic %s exists now: following it", self.topic)
            self._missing_said = False
        tps = [TopicPartition(self.topic, p) for p in partitions]
        consumer.assign(tps)
        for tp in tps:
            if tp.partition in self.positions:
                consumer.seek(tp, self.positions[tp.partition])  # where the last one stopped
            else:
                await consumer.seek_to_beginning(tp)
        if any(tp.partition not in self.positions for tp in tps):
            # read from the beginning (at start, or a topic created since):
            # the latest of each key only
            await self._catch_up(consumer, tps)
        self._recovered()
        last_read = time.monotonic()
        while True:
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, records in sorted(batches.items(), key=lambda kv: kv[0].partition):
                for record in records:
                    self.positions[tp.partition] = record.offset + 1
                    self.records += 1
                    key = key_text(record.key)
                    if key in self.keys:
                        await self._deliver(key, record.value, record.offset)
            polled = [consumer.last_poll_timestamp(tp) for tp in tps]
            now_ms = time.time() * 1000
            if any(p is not None and now_ms - p < STALLED_AFTER * 1000 for p in polled):
                last_read = time.monotonic()
                self._recovered()
            elif time.monotonic() - last_read > STALLED_AFTER:
                self._failed("no fetch answer for %.0f s" % (time.monotonic() - last_read))
                if time.monotonic() - last_read > RESTART_AFTER:
                    return

    async def _catch_up(self, consumer, tps):
        """Read what the topic holds now to its end; then hand each key's
        latest record only (kept as read: the uncompacted tail may hold
        many). The positions are kept only once it is all read: a consumer
        that fails meanwhile is made again from where this one began."""
        ends = await asyncio.wait_for(consumer.end_offsets(tps), self.start_timeout + 5)
        ends = {tp.partition: int(end) for tp, end in ends.items()}
        positions = {tp.partition: await consumer.position(tp) for tp in tps}
        latest, read = {}, 0
        while not caught_up(positions, ends):
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, records in sorted(batches.items(), key=lambda kv: kv[0].partition):
                read += len(records)
                latest.update(latest_of_keys(
                    ((tp.partition, r.offset, r.key, r.value) for r in records), self.keys))
            for tp in tps:  # past a compacted tail too
                positions[tp.partition] = await consumer.position(tp)
        self.positions.update(positions)
        self.records += read
        log.info("topic %s on %s: %d record(s) read to its end; following it", self.topic,
                 self.describe, read)
        for key, (value, offset) in sorted(latest.items()):
            await self._deliver(key, value, offset)
        self._ready.set()


def reader_for(config, token=None):
    """The StateTopicReader of a proxy: ``--cluster-state-topic`` on the
    upstream brokers, with the proxy's upstream security settings (``token``:
    its OAUTHBEARER token, if it logs in with one)."""
    from .async_kafka import aiokafka_config
    from .kafka_publisher import describe_connection

    security = config.upstream_security()
    client = aiokafka_config(config.bootstrap_servers, "kthrottle-proxy-state%s" % (
        "-" + config.proxy_id if config.proxy_id else ""), security, START_TIMEOUT, token)
    keys = [STATE_KEY] + ([shares_key(config.proxy_id)] if config.proxy_id else [])
    return StateTopicReader(client, config.cluster_state_topic, keys,
                            describe_connection(config.bootstrap_servers,
                                                security.security_protocol,
                                                security.sasl_mechanism, security.sasl_username,
                                                security.ssl_cert),
                            security.sasl_password)
