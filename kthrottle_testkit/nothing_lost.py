"""The scenario of ``benchmarks/nothing_lost.py`` (its docstring says what it does and
checks), which ``tests/test_nothing_lost.py`` runs at a small size: ``Scenario`` says how big
and which faults, ``run_scenario`` starts everything (a broker, ZooKeeper, one kthrottle proxy,
the clients), runs it and stops everything, and returns an ``Outcome``; ``describe`` turns that
into the lines the benchmark prints and reports.

Every acknowledged record of an idempotent confluent-kafka producer (acks=all), throttled by a
produce quota, held by a storage PAUSE and riding through a broker kill -9 and restart, must be
read back through the same proxy once, in order, where its acknowledgement said.
"""
import asyncio
import logging
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kthrottle_testkit.harness import (
    Run,
    SourceTree,
    metric_sum,
    storage_snapshot,
    write_znode,
    zk_client,
)

CLIENT_ID = "nothing-lost"
CONSUMER_ID = "nothing-lost-reader"
STALL_SECONDS = 0.5  # a gap between acknowledgements (or fetched records) this long is a stall
GIVE_UP_SECONDS = 30.0  # the producer done, nothing more to read for this long: stop reading
NOT_ACKED, NO_OFFSET = -1, -2  # in Producer.ack_offset
STATE_ZNODE = "/kthrottle/cluster-state"
STATE_METRIC = 'kthrottle_storage_state{broker="",scope="cluster",volume=""}'


@dataclass
class Scenario:
    records: int = 1_000_000
    record_size: int = 100
    partitions: int = 3
    quota: int = 1_000_000  # producer_byte_rate, bytes/s
    pause_at: float = 0.3
    pause_seconds: float = 5.0
    restart_during: str = "pause"  # or "flow"
    restart_at: float = 0.6  # "flow": the fraction acknowledged when the broker is killed
    down_seconds: float = 2.0
    direct: bool = False  # no proxy: no quota, no pause, the restart during flow
    timeout: Optional[float] = None  # whole run; None: from the records and the quota
    broker: str = "tansu"  # or "kafka": one Apache Kafka node (KRaft), its data on disk

    def __post_init__(self):
        if self.restart_during not in ("pause", "flow"):
            raise ValueError("restart_during: pause or flow")
        if self.broker not in ("tansu", "kafka"):
            raise ValueError("broker: tansu or kafka")
        if self.direct:
            self.restart_during = "flow"

    def pause_max_ms(self):
        """The proxy's --storage-pause-max-ms: longer than the pause (the broker restart
        included), so that the release is the state's doing, and under librdkafka's
        request.timeout.ms (30 s)."""
        longest = max(self.pause_seconds, self.down_seconds + 2.0)
        return int(min(25.0, longest + 15.0) * 1000)

    def deadline_seconds(self):
        if self.timeout is not None:
            return self.timeout
        # the quota paces the run (wire bytes are about 1.3x the values); plenty on top
        return self.records * (self.record_size + 30) / self.quota * 2 + self.pause_seconds \
            + self.down_seconds + 180


@dataclass
class Outcome:
    scenario: Scenario
    produced: int = 0
    acknowledged: int = 0
    failed: int = 0  # deliveries the producer reported as failed
    consumed: int = 0
    missing: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    misplaced: int = 0  # consumed at another partition/offset than its acknowledgement said
    unreadable: int = 0  # a key or value that is not one of ours
    unacknowledged_consumed: int = 0  # read back although never acknowledged (not a loss)
    acknowledged_without_offset: int = 0  # answered DUPLICATE_SEQUENCE_NUMBER on a retry
    offsets_reused: int = 0  # acknowledged at a partition/offset acknowledged for another one
    # partition -> (end offset the broker gave once the producer was done, one past the
    # highest offset it had acknowledged), where the first is below the second
    stale_end_offsets: dict = field(default_factory=dict)
    complete: bool = False  # the final read got past the last acknowledged offsets
    live: Optional["ReadCheck"] = None  # the consumer that read during the faults
    errors: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # seconds since the producer started
    producer_stalls: list = field(default_factory=list)
    consumer_stalls: list = field(default_factory=list)
    producer_errors: dict = field(default_factory=dict)  # librdkafka error_cb, by name
    queue_full_seconds: float = 0.0  # the producer waited on its full queue this long
    proxy_metrics: dict = field(default_factory=dict)
    proxy_pid: Optional[int] = None
    proxy_alive: bool = False
    broker_pids: list = field(default_factory=list)

    def summary(self):
        return "produced %d acknowledged %d consumed %d missing %d duplicates %d" % (
            self.produced, self.acknowledged, self.consumed, self.missing, self.duplicates)

    def ok(self):
        return (self.complete and not self.errors and self.missing == 0
                and self.live is not None and self.live.clean()
                and self.duplicates == 0 and self.out_of_order == 0 and self.misplaced == 0
                and self.unreadable == 0 and self.failed == 0 and self.offsets_reused == 0
                and self.acknowledged == self.produced == self.scenario.records)

    def longest_stall(self, stalls, start, end):
        """The longest stall overlapping [start, end], in seconds, or None."""
        if start is None or end is None:
            return None
        gaps = [b - a for a, b in stalls if b >= start and a <= end]
        return max(gaps) if gaps else None


# --------------------------------------------------------------------------- the cluster


# --broker kafka: after a kill -9 the controller (in the same JVM) takes the restarted node's
# registration only once the old one's session has expired: 4 s, not the default 9 s
KAFKA_CONFIG = {"broker.session.timeout.ms": "4000", "broker.heartbeat.interval.ms": "500"}
KAFKA_NODE_ID = 111  # the proxy's --node-port-base is set for node 111 (Tansu's)


class Cluster:
    """The broker (Tansu on a local S3 server, or one Apache Kafka node), ZooKeeper and the
    proxy (the last two not with ``scenario.direct``), all started here."""

    def __init__(self, work_dir, scenario):
        self.work = Path(work_dir)
        self.scenario = scenario
        self.run = Run("nothing_lost", log_dir=self.work)
        self.s3 = self.zookeeper = self.broker = self.proxy = self.zk = None
        # Kafka's process gets SIGTERM when the thread that started it ends: it is started,
        # and started again, from this one thread, which lives until stop()
        self.broker_thread = None

    def start(self):
        if self.scenario.broker == "kafka":
            from kthrottle import kafka_kit

            self.broker = kafka_kit.KafkaBroker(
                node_id=KAFKA_NODE_ID, workdir=self.work / "kafka",
                log_path=self.work / "kafka.log", keep=True, config=KAFKA_CONFIG)
            self.broker_thread = ThreadPoolExecutor(1, thread_name_prefix="kafka-broker")
            self.run.procs.on_stop(lambda: self.broker.stop(keep=False))
            self.broker_thread.submit(self.broker.start).result()
        else:
            self.s3 = self.run.s3()
            self.broker = self.run.broker("tansu", storage_url=self.s3.storage_url,
                                          env=self.s3.tansu_env())
        if self.scenario.direct:
            return self
        self.zookeeper = self.run.zookeeper()
        self.zk = zk_client(self.run.procs, self.zookeeper.hosts, timeout=15)
        self.write_state(open_=True)  # the job's first snapshot: every volume well inside
        SourceTree().cli("quotas", "alter", "--zookeeper", self.zookeeper.hosts,
                         "--entity-type", "clients", "--entity-name", CLIENT_ID,
                         "--add-config", "producer_byte_rate=%d" % self.scenario.quota)
        self.proxy = self.run.kthrottle(
            self.broker, ["--zookeeper", self.zookeeper.hosts, "--storage-scope", "cluster",
                          "--storage-pause-max-ms", str(self.scenario.pause_max_ms())],
            admin=True)
        return self

    @property
    def bootstrap(self):
        """Where the clients connect."""
        return self.broker.bootstrap if self.scenario.direct else self.proxy.bootstrap

    def create_topic(self, name):
        self.broker.create_topic(name, partitions=self.scenario.partitions)

    def write_state(self, open_):
        """The cluster-state snapshot as the Spark job writes it: one broker with one volume,
        under its soft limit (OPEN) or past its hard limit (PAUSE)."""
        write_znode(self.zk, STATE_ZNODE, storage_snapshot(10 if open_ else 85))

    def storage_state(self):
        return metric_sum(self.proxy.metrics(), STATE_METRIC)

    def proxy_counters(self):
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.proxy.metrics()):
            for sample in family.samples:
                if sample.labels.get("client_id") == CLIENT_ID or sample.name.startswith(
                        "kthrottle_storage_deferred"):
                    out[sample.name] = sample.value
        return out

    def restart_broker(self, down_seconds):
        """Kill the broker (SIGKILL) and start it again on the same port; returns (killed,
        listening) monotonic times."""
        self.broker.kill()
        killed = time.monotonic()
        time.sleep(down_seconds)
        if self.broker_thread is not None:  # Kafka: on its data, once it answers Metadata
            self.broker_thread.submit(self.broker.launch).result()
            self.broker.wait_ready(90.0)
        else:
            self.broker.start()  # returns once the port accepts connections
        return killed, time.monotonic()

    def describe(self):
        """The broker's processes, for the console."""
        if self.s3 is not None:
            return "S3 (moto) pid %d, Tansu pid %d on %s (s3://%s/)" % (
                self.s3.proc.pid, self.broker.proc.pid, self.broker.bootstrap, self.s3.bucket)
        return "Apache Kafka %s pid %d on %s (data in %s)" % (
            self.broker.version, self.broker.proc.pid, self.broker.bootstrap,
            self.broker.workdir)

    def stop(self):
        try:
            self.run.procs.stop_all()
        finally:
            if self.broker_thread is not None:
                self.broker_thread.shutdown(wait=False)


# --------------------------------------------------------------------------- the clients


class Producer:
    """The idempotent confluent-kafka producer, in a thread of its own."""

    def __init__(self, bootstrap, topic, scenario):
        self.bootstrap = bootstrap
        self.topic = topic
        self.n = scenario.records
        self.size = scenario.record_size
        self.quota = scenario.quota
        self.produced = 0
        self.blocked = 0.0  # seconds produce() found the queue full
        self.acked = 0
        self.acked_without_offset = 0
        self.failed = 0
        self.failures = {}  # error name -> count
        self.error_events = {}  # librdkafka error_cb: error name -> count
        self.fatal = None
        self.ack_partition = array("i", [-1]) * self.n
        self.ack_offset = array("q", [NOT_ACKED]) * self.n
        self.next_offset = {}  # partition -> one past the highest offset acknowledged
        self.started = None
        self.finished = None
        self.last_ack = None
        self.stalls = []  # (start, end) monotonic: no acknowledgement for >= STALL_SECONDS
        self.stop_flag = threading.Event()
        self.done = threading.Event()
        self.exception = None
        self.thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def start(self):
        self.started = time.monotonic()
        self.thread.start()

    def _delivered(self, err, msg):
        try:
            self._record(err, msg)
        except Exception as exc:  # an exception escaping a callback is garbled by the binding
            self.exception = exc
            self.stop_flag.set()

    def _record(self, err, msg):
        now = time.monotonic()
        seq = int(msg.key())
        if err is not None:
            self.failed += 1
            self.failures[err.name()] = self.failures.get(err.name(), 0) + 1
            return
        self.acked += 1
        self.ack_partition[seq] = msg.partition()
        offset = msg.offset()
        if offset is None:
            # a retry the broker answered DUPLICATE_SEQUENCE_NUMBER (it says it has the batch
            # already): librdkafka counts that as delivered, without an offset
            self.ack_offset[seq] = NO_OFFSET
            self.acked_without_offset += 1
        else:
            self.ack_offset[seq] = offset
            p = msg.partition()
            if offset >= self.next_offset.get(p, 0):
                self.next_offset[p] = offset + 1
        last = self.last_ack if self.last_ack is not None else self.started
        if now - last >= STALL_SECONDS:
            self.stalls.append((last, now))
        self.last_ack = now

    def _error(self, err):
        self.error_events[err.name()] = self.error_events.get(err.name(), 0) + 1
        if err.fatal():
            self.fatal = str(err)
            self.stop_flag.set()

    def _run(self):
        try:
            from confluent_kafka import Producer as CKProducer

            rdlog = logging.getLogger("nothing_lost.librdkafka")
            conf = {
                "bootstrap.servers": self.bootstrap, "client.id": CLIENT_ID,
                "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                # about a second of quota queued: the producer cannot run far ahead of what
                # the proxy lets through (a queue full is its offered rate over the quota),
                # and a queued record is acknowledged well within message.timeout.ms (300 s)
                "queue.buffering.max.messages": max(100, self.quota // self.size),
                "error_cb": self._error, "logger": rdlog,
            }
            producer = CKProducer(conf)
            pad = b"."
            for seq in range(self.n):
                if self.stop_flag.is_set():
                    break
                key = b"%d" % seq
                value = (key + b":").ljust(self.size, pad)
                while True:
                    try:
                        producer.produce(self.topic, value, key, on_delivery=self._delivered)
                        break
                    except BufferError:  # queue full: the quota holds it back
                        blocked = time.monotonic()
                        producer.poll(0.05)
                        self.blocked += time.monotonic() - blocked
                        if self.stop_flag.is_set():
                            break
                if self.stop_flag.is_set():
                    break
                self.produced += 1
                producer.poll(0)
            while len(producer) > 0 and not self.stop_flag.is_set():
                producer.flush(0.5)
            if self.stop_flag.is_set():
                producer.purge()
                producer.flush(5)
        except BaseException as exc:
            self.exception = exc
        finally:
            self.finished = time.monotonic()
            self.done.set()


class Reader:
    """What the consumer read, checked against what the producer saw acknowledged."""

    def __init__(self, n):
        self.n = n
        self.count = bytearray(n)  # times each sequence was read (capped at 255)
        self.partition = array("i", [-1]) * n  # where it was read first
        self.offset = array("q", [-1]) * n
        self.last_seq = {}  # partition -> last sequence read there
        self.consumed = 0
        self.duplicates = 0
        self.out_of_order = 0
        self.unreadable = 0
        self.first_disorder = None
        self.last_read = None
        self.stalls = []
        self.end_offsets = {}  # partition -> the end offset the broker gave at the end
        self.offsets_read = {}  # partition -> [first, last] offset of each run read in order

    def see(self, partition, offset, key, value, now):
        self.consumed += 1
        try:
            seq = int(key)
            ok = 0 <= seq < self.n and value.startswith(key + b":")
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self.unreadable += 1
            return
        if self.count[seq]:
            self.duplicates += 1
            if self.count[seq] < 255:
                self.count[seq] += 1
        else:
            self.count[seq] = 1
            self.partition[seq] = partition
            self.offset[seq] = offset
        last = self.last_seq.get(partition)
        if last is not None and seq <= last:
            self.out_of_order += 1
            if self.first_disorder is None:
                self.first_disorder = (partition, offset, last, seq)
        self.last_seq[partition] = seq
        runs = self.offsets_read.setdefault(partition, [])
        if runs and runs[-1][1] == offset - 1:
            runs[-1][1] = offset
        else:
            runs.append([offset, offset])
        if self.last_read is not None and now - self.last_read >= STALL_SECONDS:
            self.stalls.append((self.last_read, now))
        self.last_read = now


async def consume(bootstrap, topic, partitions, reader, producer, deadline):
    """Read from the start until, once the producer is done, every partition is read up to
    its end offset and past its last acknowledged offset, and a last fetch brings nothing more.
    (Tansu on s3:// has answered ListOffsets with end offsets below records it had already
    served, after a restart: the end offset alone would stop the reading short.) Returns True
    when that is reached before ``deadline`` (monotonic)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, client_id=CONSUMER_ID, group_id=None,
        enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=200,
        request_timeout_ms=30000, max_partition_fetch_bytes=1024 * 1024,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        targets = None
        final_look = False
        progress = time.monotonic()
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000 if final_look else 500,
                                           max_records=20000)
            now = time.monotonic()
            for tp, records in batch.items():
                for r in records:
                    reader.see(tp.partition, r.offset, r.key, r.value, now)
            if final_look and not batch:
                return True
            final_look = False
            if batch:
                progress = now
            elif producer.done.is_set() and now - progress > GIVE_UP_SECONDS:
                return False  # what is acknowledged beyond here is not there to read
            if producer.done.is_set():
                if targets is None:
                    ends = await consumer.end_offsets(tps)
                    reader.end_offsets = {tp.partition: ends[tp] for tp in tps}
                    targets = {tp: max(ends[tp], producer.next_offset.get(tp.partition, 0))
                               for tp in tps}
                positions = [await consumer.position(tp) for tp in tps]
                # then one more fetch, for anything past them (a duplicate written late)
                final_look = all(pos >= targets[tp] for pos, tp in zip(positions, tps))
        return False
    finally:
        await consumer.stop()


# --------------------------------------------------------------------------- the scenario


async def _wait_state(cluster, want, timeout=20.0):
    """Until the proxy's /metrics shows the cluster state ``want`` (0 OPEN, 2 PAUSE)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(cluster.storage_state) == want:
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise RuntimeError("the proxy did not apply the cluster state %s within %.0f s"
                       % (want, timeout))


async def _wait_acked(producer, count, what):
    while producer.acked < count:
        if producer.done.is_set():
            raise RuntimeError("the producer stopped (%d of %d acknowledged) before %s"
                               % (producer.acked, producer.n, what))
        await asyncio.sleep(0.02)


async def _refresh_state(cluster, paused):
    """The job's cycle: the snapshot rewritten every 2 s, so that it never goes stale."""
    while True:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(cluster.write_state, not paused[0])


async def _restart(cluster, producer, scenario, timings, out):
    print("  killing the broker (SIGKILL, %d acknowledged)" % producer.acked, flush=True)
    out.broker_pids.append(cluster.broker.proc.pid)
    killed, back = await asyncio.to_thread(cluster.restart_broker, scenario.down_seconds)
    out.broker_pids.append(cluster.broker.proc.pid)
    timings["broker_killed"], timings["broker_listening"] = killed, back
    print("  broker listening again after %.1f s" % (back - killed), flush=True)


async def _drive(cluster, producer, scenario, timings, out):
    """Pause and release once and restart the broker once, at their points of progress."""
    if scenario.direct:
        await _wait_acked(producer, int(scenario.records * scenario.restart_at),
                          "the broker restart")
        await _restart(cluster, producer, scenario, timings, out)
        await asyncio.to_thread(producer.done.wait)
        return
    paused = [False]
    refresher = asyncio.ensure_future(_refresh_state(cluster, paused))
    try:
        await _wait_acked(producer, int(scenario.records * scenario.pause_at), "the pause")
        paused[0] = True
        timings["pause_written"] = time.monotonic()
        await asyncio.to_thread(cluster.write_state, False)
        timings["pause_applied"] = await _wait_state(cluster, 2.0)
        print("  PAUSE in force (%d acknowledged)" % producer.acked, flush=True)
        release_at = timings["pause_applied"] + scenario.pause_seconds
        if scenario.restart_during == "pause":
            # the requests the broker had when the pause began are answered within
            # milliseconds; after that nothing is written there until the release
            await asyncio.sleep(1.0)
            await _restart(cluster, producer, scenario, timings, out)
            release_at = max(release_at, time.monotonic() + 1.0)
        await asyncio.sleep(max(0.0, release_at - time.monotonic()))
        paused[0] = False
        timings["release_written"] = time.monotonic()
        await asyncio.to_thread(cluster.write_state, True)
        timings["release_applied"] = await _wait_state(cluster, 0.0)
        print("  OPEN again", flush=True)
        if scenario.restart_during == "flow":
            await _wait_acked(producer, int(scenario.records * scenario.restart_at),
                              "the broker restart")
            await _restart(cluster, producer, scenario, timings, out)
        while not producer.done.is_set():
            await asyncio.sleep(0.05)
    finally:
        refresher.cancel()
        try:
            await refresher
        except asyncio.CancelledError:
            pass


async def run_scenario(scenario, work_dir):
    """Start everything, run the scenario, stop everything; returns the Outcome."""
    out = Outcome(scenario)
    cluster = Cluster(work_dir, scenario)
    rdlog = logging.getLogger("nothing_lost.librdkafka")
    handler = logging.FileHandler(Path(work_dir) / "clients.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    watched = [rdlog, logging.getLogger("aiokafka"), logging.getLogger("kazoo")]
    saved = [(lg, lg.propagate, lg.level) for lg in watched]
    for lg in watched:  # the clients' reconnect noise goes to a file, not the console
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    producer = None
    try:
        await asyncio.to_thread(cluster.start)
        topic = "nothing-lost"
        await asyncio.to_thread(cluster.create_topic, topic)
        if scenario.direct:
            print("%s, no proxy; logs in %s" % (cluster.describe(), work_dir), flush=True)
        else:
            out.proxy_pid = cluster.proxy.proc.pid
            print("%s, ZooKeeper pid %d, kthrottle pid %d on %s; logs in %s" % (
                cluster.describe(), cluster.zookeeper.proc.pid, cluster.proxy.proc.pid,
                cluster.proxy.bootstrap, work_dir), flush=True)
        deadline = time.monotonic() + scenario.deadline_seconds()
        producer = Producer(cluster.bootstrap, topic, scenario)
        reader = Reader(scenario.records)
        timings = {}
        producer.start()
        consumer = asyncio.ensure_future(consume(cluster.bootstrap, topic, scenario.partitions,
                                                 reader, producer, deadline))
        live_complete = False
        final_reader = final_complete = None
        try:
            await asyncio.wait_for(_drive(cluster, producer, scenario, timings, out),
                                   max(1.0, deadline - time.monotonic()))
            live_complete = await asyncio.wait_for(consumer,
                                                   max(1.0, deadline - time.monotonic() + 5))
            timings["consumed"] = time.monotonic()
            # then everything again from the start with a fresh consumer: what is stored, not
            # only what could be read at some moment
            final_reader = Reader(scenario.records)
            final_complete = await consume(
                cluster.bootstrap, topic, scenario.partitions, final_reader, producer,
                time.monotonic() + 60 + scenario.records / 10_000)
            timings["read_again"] = time.monotonic()
            for what, done in (("live consumer", live_complete),
                               ("final read", final_complete)):
                if not done:
                    out.errors.append(
                        "%s: did not get past the last acknowledged offsets (nothing more to "
                        "read for %.0f s, or out of time)" % (what, GIVE_UP_SECONDS))
        except asyncio.TimeoutError:
            out.errors.append("the run did not finish within %.0f s"
                              % scenario.deadline_seconds())
        except Exception as exc:
            out.errors.append("%s: %s" % (type(exc).__name__, exc))
        finally:
            producer.stop_flag.set()  # a no-op once it is done
            if not consumer.done():
                consumer.cancel()
                try:
                    await consumer
                except BaseException:
                    pass
            await asyncio.to_thread(producer.done.wait, 30)
        if not scenario.direct:
            try:
                out.proxy_metrics = await asyncio.to_thread(cluster.proxy_counters)
            except Exception as exc:
                out.errors.append("reading /metrics: %s" % exc)
            out.proxy_alive = cluster.proxy.proc.poll() is None and \
                cluster.proxy.proc.pid == out.proxy_pid
            if not out.proxy_alive:
                out.errors.append("the proxy exited (code %s)" % cluster.proxy.proc.returncode)
        timings["produced"] = producer.finished
        t0 = producer.started
        out.timings = {k: (v - t0) for k, v in timings.items() if v is not None}
        out.producer_stalls = [(a - t0, b - t0) for a, b in producer.stalls]
        out.consumer_stalls = [(a - t0, b - t0) for a, b in reader.stalls]
        _tally(out, producer, check_reading(producer, reader, live_complete),
               None if final_reader is None else
               check_reading(producer, final_reader, final_complete))
        out.stale_end_offsets = {p: (end, producer.next_offset[p])
                                 for p, end in sorted(reader.end_offsets.items())
                                 if end < producer.next_offset.get(p, 0)}
        if not out.ok():
            _write_details(Path(work_dir) / "details.txt", producer, reader)
            if final_reader is not None:
                _write_details(Path(work_dir) / "details-final-read.txt", producer,
                               final_reader)
    finally:
        if producer is not None:
            producer.stop_flag.set()
        await asyncio.to_thread(cluster.stop)
        for lg, propagate, level in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)
        handler.close()
    return out


@dataclass
class ReadCheck:
    """One consumer's reading, checked against the acknowledgements."""

    consumed: int = 0
    missing: int = 0  # acknowledged, never read
    duplicates: int = 0  # read more than once
    out_of_order: int = 0  # a key not above the one before it in its partition
    misplaced: int = 0  # read at another partition/offset than its acknowledgement said
    unreadable: int = 0  # a key or value that is not one of ours
    unacknowledged: int = 0  # read though never acknowledged (not a loss)
    complete: bool = False  # read past the last acknowledged offsets
    first_disorder: Optional[tuple] = None  # (partition, offset, sequence before, sequence)

    def clean(self):
        return self.complete and not (self.missing or self.duplicates or self.out_of_order
                                      or self.misplaced or self.unreadable)

    def line(self, what):
        return ("%s: consumed %d missing %d duplicates %d, out of order %d, at another "
                "partition/offset than acknowledged %d, unreadable %d, read though not "
                "acknowledged %d, read to the end: %s" % (
                    what, self.consumed, self.missing, self.duplicates, self.out_of_order,
                    self.misplaced, self.unreadable, self.unacknowledged,
                    "yes" if self.complete else "NO"))


def check_reading(producer, reader, complete):
    """What ``reader`` read against what ``producer`` saw acknowledged."""
    out = ReadCheck(consumed=reader.consumed, duplicates=reader.duplicates,
                    out_of_order=reader.out_of_order, unreadable=reader.unreadable,
                    complete=complete, first_disorder=reader.first_disorder)
    count, ack_p, ack_o = reader.count, producer.ack_partition, producer.ack_offset
    read_p, read_o = reader.partition, reader.offset
    for seq in range(producer.n):
        acked = ack_o[seq] != NOT_ACKED
        if acked and not count[seq]:
            out.missing += 1
        elif acked and (read_p[seq] != ack_p[seq] or (
                ack_o[seq] != NO_OFFSET and read_o[seq] != ack_o[seq])):
            out.misplaced += 1
        elif count[seq] and not acked:
            out.unacknowledged += 1
    return out


def _tally(out, producer, live, final):
    """Fill ``out`` from the producer, the live reading and the final one (the summary's)."""
    out.produced, out.acknowledged, out.failed = producer.produced, producer.acked, \
        producer.failed
    out.producer_errors = dict(producer.error_events)
    out.queue_full_seconds = producer.blocked
    out.acknowledged_without_offset = producer.acked_without_offset
    if producer.failures:
        out.errors.append("failed deliveries: %s" % producer.failures)
    if producer.fatal:
        out.errors.append("the producer hit a fatal error: %s" % producer.fatal)
    if producer.exception is not None:
        out.errors.append("producer: %s: %s" % (type(producer.exception).__name__,
                                                producer.exception))
    acked_offsets = {}  # partition -> the offsets acknowledged there
    for seq in range(producer.n):
        if producer.ack_offset[seq] >= 0:
            acked_offsets.setdefault(producer.ack_partition[seq], array("q")).append(
                producer.ack_offset[seq])
    out.offsets_reused = sum(len(offsets) - len(set(offsets))
                             for offsets in acked_offsets.values())
    out.live = live
    if final is not None:
        out.consumed, out.missing, out.duplicates = final.consumed, final.missing, \
            final.duplicates
        out.out_of_order, out.misplaced, out.unreadable = final.out_of_order, \
            final.misplaced, final.unreadable
        out.unacknowledged_consumed, out.complete = final.unacknowledged, final.complete
    for what, check in (("live consumer", live), ("final read", final)):
        if check is not None and check.first_disorder:
            out.errors.append("%s: partition %d offset %d: sequence %d after %d" % (
                what, check.first_disorder[0], check.first_disorder[1],
                check.first_disorder[3], check.first_disorder[2]))


def _write_details(path, producer, reader, limit=2000):
    """For a failed run: what was read where, and the records acknowledged but not read."""
    lines = ["end offsets at the end: %s" % reader.end_offsets]
    for p in sorted(reader.offsets_read):
        runs = reader.offsets_read[p]
        lines.append("partition %d: offsets read (runs in reading order): %s%s" % (
            p, " ".join("%d-%d" % tuple(r) for r in runs[:200]),
            " ..." if len(runs) > 200 else ""))
    lines.append("acknowledged, not read (sequence: partition/offset acknowledged):")
    shown = 0
    for seq in range(producer.n):
        if producer.ack_offset[seq] != NOT_ACKED and not reader.count[seq]:
            lines.append("  %d: %d/%d" % (seq, producer.ack_partition[seq],
                                          producer.ack_offset[seq]))
            shown += 1
            if shown >= limit:
                lines.append("  ...")
                break
    Path(path).write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- report


def _gap(seconds):
    return "%.2f s" % seconds if seconds else "none over %.1f s" % STALL_SECONDS


def describe(out):
    """The lines printed before the summary line (and written to the report)."""
    s, t = out.scenario, out.timings
    lines = []
    if "produced" in t:
        seconds = t["produced"]
        lines.append("produce: %d records of %d B in %.1f s, %.0f records/s, %.2f MB/s of values%s"
                     % (out.acknowledged, s.record_size, seconds, out.acknowledged / seconds,
                        out.acknowledged * s.record_size / seconds / 1e6,
                        " (no proxy)" if s.direct else
                        " (quota %s B/s of Produce requests on client-id %s); its queue was full, "
                        "the producer offering more than it was let through, for %.1f s of it"
                        % (format(s.quota, ","), CLIENT_ID, out.queue_full_seconds)))
    if "consumed" in t:
        lines.append("consume: the live consumer was done %.1f s after the producer started, "
                     "%.1f s after it finished%s" % (
                         t["consumed"], t["consumed"] - t.get("produced", 0),
                         "; everything read again from the start in %.1f s"
                         % (t["read_again"] - t["consumed"]) if "read_again" in t else ""))
    if "pause_applied" in t:
        # the stall the pause made: the one that the release falls into
        held = [(a, b) for a, b in out.producer_stalls if a <= t["release_written"] <= b]
        lines.append(
            "storage pause: PAUSE written at +%.2f s, in force at +%.2f s; OPEN written at "
            "+%.2f s, in force at +%.2f s (paused %.2f s%s); %s" % (
                t["pause_written"], t["pause_applied"], t["release_written"],
                t["release_applied"], t["release_applied"] - t["pause_applied"],
                ", the broker restart inside" if s.restart_during == "pause" else "",
                "no acknowledgement from +%.2f s, the next at +%.2f s" % held[0] if held else
                "! the producer was acknowledged just before the release"))
    if "broker_killed" in t:
        # from the kill to 30 s after the broker is back and the pause over, whichever is later
        window_end = max(t["broker_listening"], t.get("release_applied", 0.0)) + 30
        p_stall = out.longest_stall(out.producer_stalls, t["broker_killed"], window_end)
        c_stall = out.longest_stall(out.consumer_stalls, t["broker_killed"], window_end)
        lines.append(
            "broker restart: SIGKILL at +%.2f s, listening again at +%.2f s (down %.2f s); "
            "longest wait from the kill on, producer for an acknowledgement: %s%s, consumer "
            "for a record: %s" % (
                t["broker_killed"], t["broker_listening"],
                t["broker_listening"] - t["broker_killed"], _gap(p_stall),
                " (the pause included)" if s.restart_during == "pause" else "", _gap(c_stall)))
    m = out.proxy_metrics
    if m:
        lines.append(
            "proxy (pid %s, %s): %d produce responses throttled, %.1f s of throttle time given; "
            "%d Produce request checks deferred for storage" % (
                out.proxy_pid, "never restarted" if out.proxy_alive else "EXITED",
                m.get("kthrottle_produce_throttled_responses_total", 0),
                m.get("kthrottle_produce_throttle_time_ms_total", 0) / 1000,
                m.get("kthrottle_storage_deferred_requests_total", 0)))
    if out.producer_errors:
        lines.append("producer error events (librdkafka error_cb, transient unless fatal): %s"
                     % ", ".join("%s x%d" % kv for kv in sorted(out.producer_errors.items())))
    lines.append("producer: failed deliveries %d, offsets acknowledged for two records %d, "
                 "acknowledged without an offset (DUPLICATE_SEQUENCE_NUMBER on a retry) %d" % (
                     out.failed, out.offsets_reused, out.acknowledged_without_offset))
    if out.live is not None:
        lines.append(out.live.line("live consumer (read during the faults)"))
    if "read_again" in t:
        lines.append(ReadCheck(
            consumed=out.consumed, missing=out.missing, duplicates=out.duplicates,
            out_of_order=out.out_of_order, misplaced=out.misplaced, unreadable=out.unreadable,
            unacknowledged=out.unacknowledged_consumed, complete=out.complete).line(
                "final read (a fresh consumer from the start; the summary's counts)"))
    if out.stale_end_offsets:
        lines.append("note: the broker's end offsets (ListOffsets, latest) once the producer was "
                     "done were below offsets it had acknowledged: %s; read on to the latter" % (
                         ", ".join("partition %d: %d < %d" % (p, a, b)
                                   for p, (a, b) in out.stale_end_offsets.items())))
    for error in out.errors:
        lines.append("! " + error)
    return lines
