"""``kthrottle spark-sync``: the periodic PySpark job writing the cluster state.

Each cycle:

1. reads the volume-report topic with the ``kthrottle-kafka`` Python data
   source (``kafka_source``: one Spark partition per Kafka partition, read on
   the executors) and keeps the latest record of each key (broker id) with
   Spark; only that (one row per broker) is collected. Each is parsed with
   ``parse_report``; a malformed one is logged and skipped (its broker is then
   UNKNOWN);
2. reads the cluster's Metadata on the driver: the live brokers and the
   replicas of every partition;
3. computes the snapshot with ``cluster_snapshot`` (plus ``cycle`` and
   ``cycle_seconds``);
4. writes it as JSON to one znode (created if missing, else set: readers see
   the old or the new snapshot, never half of one).

A cycle that fails changes nothing in ZooKeeper; the next one tries again.
One SparkSession and one ZooKeeper client serve every cycle.
"""
import argparse
import logging
import os
import re
import signal
import sys
import time

from ..options import arg_type, parse_duration, parse_host_port
from ..policy.fleet import (
    DEFAULT_FLOOR_FRACTION,
    encode_shares_document,
    fleet_shares,
    parse_usage_report,
    shares_document,
)
from ..policy.storage import OPEN, cluster_snapshot, encode_snapshot, parse_report
from ..security import (  # noqa: F401 (the names kafka_source keeps copies of)
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    ZOOKEEPER,
    ClientSecurityOptions,
)
from ..sources.cluster_state import shares_znode

log = logging.getLogger("kthrottle.spark_sync")

# as in kafka_source, which is not imported before it is needed: it imports
# PySpark (an optional extra), and every kthrottle command builds this parser
SOURCE_FORMAT = "kthrottle-kafka"

DEFAULT_TOPIC = "__kthrottle_volume_usage"
DEFAULT_USAGE_TOPIC = "__kthrottle_proxy_usage"
DEFAULT_ZNODE = "/kthrottle/cluster-state"
DEFAULT_MASTER = "local[2]"
PASSWORD_ENV = "KTHROTTLE_SPARK_SASL_PASSWORD"
ZNODE_MAX_BYTES = 1048575 - 1024  # ZooKeeper's default jute.maxbuffer, less some room
SECURITY = ClientSecurityOptions(
    who="the job", password_env=PASSWORD_ENV,
    title="Kafka client security (for the driver and the executors)",
    ca_help="; the executors get its content, not its path",
    key_help="; the executors get the certificate and the key as text")


class CycleError(Exception):
    """A cycle failed; the text says why, on one line."""


def _source():
    """The kafka_source module (it needs PySpark and pyarrow)."""
    try:
        import pyarrow  # Python data sources need it, on every executor too

        from . import kafka_source

        del pyarrow
    except ImportError as exc:
        raise CycleError("%s: install the spark extra: pip install 'kthrottle[spark]' "
                         "(pyspark and pyarrow)" % exc) from None
    return kafka_source


_duration = arg_type(parse_duration)


@arg_type
def _bootstrap(text):
    for one in text.split(","):
        parse_host_port(one.strip(), "--bootstrap-server")
    return ",".join(one.strip() for one in text.split(","))


def _znode(text):
    if not text.startswith("/") or text == "/" or text.endswith("/") or "//" in text:
        raise argparse.ArgumentTypeError("--znode must be an absolute path like %s, got %r"
                                         % (DEFAULT_ZNODE, text))
    return text


def _conf(text):
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError("--conf takes KEY=VALUE, got %r" % (text,))
    return key.strip(), value


EXAMPLE = """\
example:
  kthrottle spark-sync --bootstrap-server kafka-0:9092 --zookeeper zk-0:2181/kafka \\
      --master spark://spark-master:7077 --interval 30s --freshness 90s

  Every 30 s it reads the latest volume report of every broker from
  __kthrottle_volume_usage, the brokers and partition replicas from Kafka's
  Metadata, and writes the cluster state (JSON) to /kthrottle/cluster-state
  under the /kafka chroot, where every proxy started with --zookeeper reads it.
  --once computes and writes one snapshot and exits: 0 when it was written,
  1 (with the reason) when not.

durations: 30s, 5m, 500ms, 1h or a number of seconds.

On a Spark cluster the executors need Python with kafka-python and pyarrow
(not kthrottle: the data source is shipped with the job); the driver host must
be reachable by them (--conf spark.driver.host=...). With a local master the
executors run this very Python.
"""


def add_parser(sub):
    p = sub.add_parser(
        "spark-sync",
        help="compute the cluster's storage state with PySpark, write it to ZooKeeper",
        description="Read the volume reports the brokers' volume agents publish, combine them\n"
        "with the partition replicas from Kafka's Metadata into one cluster-state snapshot\n"
        "(OPEN, THROTTLE with a factor, PAUSE; UNKNOWN for a broker without a fresh report)\n"
        "and write it as JSON to a ZooKeeper znode, once or every --interval. Each cycle\n"
        "reads the topic with PySpark (one Spark task per Kafka partition, on the\n"
        "executors); only the latest report of each broker reaches the driver.\n"
        "The same cycle reads the usage reports of the fleet's proxies (--usage-topic)\n"
        "and writes each proxy its share of every quota bucket shared between proxies, in\n"
        "proportion to demand, to <znode>/shares/<proxy-id>.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(command="spark-sync")
    p.add_argument("--bootstrap-server", dest="bootstrap", action="append", required=True,
                   type=_bootstrap, metavar="HOST:PORT[,HOST:PORT...]",
                   help="Kafka broker(s) to bootstrap from; repeat for several (required)")
    ZOOKEEPER.replace(required=True, help="ZooKeeper connect string, as Kafka's "
                      "zookeeper.connect takes it, e.g. zk-0:2181,zk-1:2181/kafka (required); "
                      "the chroot is created if missing").add_to(p)
    p.add_argument("--master", default=DEFAULT_MASTER, metavar="URL",
                   help="Spark master: local[N], spark://HOST:7077, yarn, k8s://... "
                   "(default %s)" % DEFAULT_MASTER)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--interval", type=_duration, default=30.0, metavar="DURATION",
                      help="time from the start of one cycle to the start of the next "
                      "(default 30s); a cycle that fails leaves the znode untouched and the "
                      "next one tries again; SIGTERM or Ctrl-C stop")
    when.add_argument("--once", action="store_true",
                      help="run one cycle and exit: 0 when the snapshot was written, 1 if not")
    p.add_argument("--topic", default=DEFAULT_TOPIC,
                   help="the compacted topic the volume agents publish to, keyed by broker id "
                   "(default %s)" % DEFAULT_TOPIC)
    p.add_argument("--freshness", type=_duration, default=90.0, metavar="DURATION",
                   help="a broker whose latest report was taken longer ago than this is UNKNOWN "
                   "(default 90s: three reports of an agent publishing every 30 s)")
    f = p.add_argument_group("fleet-wide quotas (proxies started with --proxy-id)")
    f.add_argument("--usage-topic", default=DEFAULT_USAGE_TOPIC,
                   help="the compacted topic fleet proxies publish their usage reports to, "
                   "keyed by proxy id (default %s); without it no shares are written"
                   % DEFAULT_USAGE_TOPIC)
    f.add_argument("--usage-freshness", type=_duration, default=30.0, metavar="DURATION",
                   help="a proxy whose latest usage report is older than this is not counted "
                   "(default 30s: six reports of a proxy reporting every 5 s)")
    f.add_argument("--share-floor", type=float, default=DEFAULT_FLOOR_FRACTION, metavar="F",
                   help="each proxy of a shared bucket gets at least this fraction of an equal "
                   "share, so that clients just arrived are not starved (default %g)"
                   % DEFAULT_FLOOR_FRACTION)
    p.add_argument("--znode", type=_znode, default=DEFAULT_ZNODE, metavar="PATH",
                   help="znode the snapshot is written to, under the chroot if any "
                   "(default %s)" % DEFAULT_ZNODE)
    p.add_argument("--kafka-timeout", type=_duration, default=15.0, metavar="DURATION",
                   help="how long reaching Kafka may take, and reading one partition "
                   "of the topic, before the cycle fails (default 15s)")
    p.add_argument("--zookeeper-timeout", type=_duration, default=10.0, metavar="DURATION",
                   help="how long connecting to ZooKeeper and one write may take (default 10s)")
    p.add_argument("--conf", action="append", type=_conf, default=[], metavar="KEY=VALUE",
                   help="a Spark setting, e.g. spark.driver.host=10.0.0.5; repeat for several")
    p.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING (default INFO)")
    SECURITY.add_to(p)
    return p


# the Kafka side ---------------------------------------------------------------------

def security_options(args):
    """The data source's security options from the flags (the files'
    contents, not their paths). ConfigError (a ValueError) says what is
    missing."""
    return SECURITY.resolve(vars(args)).data_source_options()


def read_metadata(settings, timeout_ms, leaders=None):
    """(live broker ids, {(topic, partition): [replica broker ids]}); with a
    ``leaders`` dict, fills it with {(topic, partition): leader id}."""
    kafka_source = _source()
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(request_timeout_ms=int(timeout_ms),
                             **kafka_source.kafka_config(settings, timeout_ms))
    try:
        brokers = [b["broker_id"] for b in admin.describe_cluster()["brokers"]
                   if not b.get("is_fenced")]
        replicas = {}
        for topic in admin.describe_topics():
            for p in topic.get("partitions") or ():
                replicas[topic["name"], p["partition_index"]] = list(p.get("replica_nodes") or ())
                if leaders is not None and p.get("leader_id", -1) >= 0:
                    leaders[topic["name"], p["partition_index"]] = p["leader_id"]
        return brokers, replicas
    finally:
        admin.close()


def latest_reports(spark, settings, topic, offsets, timeout_ms):
    """The latest record of each key, reduced by Spark and collected (one
    row per broker), and the number of records read."""
    kafka_source = _source()
    df = kafka_source.load(spark, settings["bootstrap"], topic, offsets, timeout_ms,
                           **{k: v for k, v in settings.items() if k != "bootstrap"})
    rows = kafka_source.latest_per_key(df).collect()
    return rows, sum(r["records"] for r in rows)


def parse_reports(rows):
    """{broker id: BrokerReport} from the latest rows; a malformed report is
    logged and skipped (that broker is then UNKNOWN)."""
    reports = {}
    for row in sorted(rows, key=lambda r: (r["key"] is None, r["key"] or "")):
        where = "partition %d, offset %d" % (row["partition"], row["offset"])
        if row["key"] is None:
            log.warning("skipping the record(s) without a key (latest at %s): reports are keyed "
                        "by broker id", where)
            continue
        if row["value"] is None:
            log.info("broker %s's report was deleted (tombstone at %s)", row["key"], where)
            continue
        try:
            report = parse_report(row["value"])
        except Exception as exc:  # a malformed report is never fatal
            log.error("skipping the malformed report of key %r (%s): %s: %s", row["key"],
                      where, type(exc).__name__, str(exc)[:300])
            continue
        if str(report.broker_id) != row["key"]:
            log.warning("the report keyed %r (%s) is broker %d's", row["key"], where,
                        report.broker_id)
        previous = reports.get(report.broker_id)
        if previous is None or report.snapshot_at >= previous.snapshot_at:
            reports[report.broker_id] = report
    return reports


# the ZooKeeper side -----------------------------------------------------------------

class ZnodeWriter:
    """One kazoo client, kept across cycles (it reconnects by itself), that
    writes the snapshot to one znode."""

    def __init__(self, hosts, znode, timeout):
        self.hosts = hosts
        self.znode = znode
        self.timeout = timeout
        self.zk = None

    def _connect(self):
        import warnings

        from kazoo.client import KazooClient

        warnings.filterwarnings("ignore", message="No chroot path exists")
        servers, slash, chroot = self.hosts.partition("/")
        if slash:
            # kazoo does not create a missing chroot (makepath stops at it)
            self._session(servers, lambda zk: zk.ensure_path("/" + chroot))
        zk = KazooClient(hosts=self.hosts, timeout=self.timeout,
                         connection_retry={"max_tries": -1, "max_delay": 2})
        try:
            zk.start(timeout=self.timeout)
        except Exception:
            zk.close()
            raise CycleError("cannot connect to ZooKeeper %s within %.0f s"
                             % (self.hosts, self.timeout)) from None
        self.zk = zk

    def _session(self, servers, work):
        from kazoo.client import KazooClient

        zk = KazooClient(hosts=servers, timeout=self.timeout)
        try:
            zk.start(timeout=self.timeout)
        except Exception:
            zk.close()
            raise CycleError("cannot connect to ZooKeeper %s within %.0f s"
                             % (servers, self.timeout)) from None
        try:
            work(zk)
        finally:
            zk.stop()
            zk.close()

    def ensure_connected(self):
        if self.zk is None:
            self._connect()
        elif not self.zk.connected:
            raise CycleError("ZooKeeper %s is not connected (kazoo keeps trying)" % self.hosts)

    def write(self, data, znode=None):
        """Set the znode (the snapshot's unless ``znode`` is given) to
        ``data`` (create it, and its parents, if missing)."""
        from kazoo.exceptions import NodeExistsError, NoNodeError
        from kazoo.exceptions import KazooException

        znode = znode or self.znode
        if len(data) > ZNODE_MAX_BYTES:
            raise CycleError("%s would be %d bytes, past what one znode holds (%d)"
                             % (znode, len(data), ZNODE_MAX_BYTES))
        self.ensure_connected()
        zk = self.zk
        try:
            try:
                zk.set_async(znode, data).get(timeout=self.timeout)
            except NoNodeError:
                try:
                    zk.create_async(znode, data, makepath=True).get(timeout=self.timeout)
                except NodeExistsError:  # created meanwhile by another writer
                    zk.set_async(znode, data).get(timeout=self.timeout)
        except (KazooException, zk.handler.timeout_exception) as exc:
            raise CycleError("writing %s on ZooKeeper %s failed: %s" % (
                znode, self.hosts, type(exc).__name__ + (": %s" % exc if str(exc) else "")
            )) from None

    def close(self):
        if self.zk is not None:
            try:
                self.zk.stop()
                self.zk.close()
            except Exception:
                pass
            self.zk = None


# Spark ----------------------------------------------------------------------------

def spark_session(master=DEFAULT_MASTER, conf=(), app_name="kthrottle-spark-sync"):
    """A SparkSession for the job (local masters bind 127.0.0.1 and run
    executors with this Python)."""
    kafka_source = _source()
    from pyspark.sql import SparkSession

    local = master.startswith("local")
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2"))
    if local:
        builder = (builder.config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.driver.host", "127.0.0.1"))
        # the executors, and the driver-side worker that plans a Python data
        # source's read, run this Python (by default they run python3 from PATH)
        if not os.environ.get("PYSPARK_PYTHON"):
            os.environ["PYSPARK_PYTHON"] = sys.executable
        # every address Spark binds (and its warning about the hostname): 127.0.0.1
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    for key, value in conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if not log.isEnabledFor(logging.DEBUG):
        spark.sparkContext.setLogLevel("ERROR")
    kafka_source.register(spark)
    return spark


def one_line(exc):
    """A one-line reason for ``exc``, found inside a Spark error if need be."""
    text = str(exc)
    if isinstance(exc, CycleError):
        return text
    m = re.search(r"%s: [^\n]*" % re.escape(SOURCE_FORMAT), text)
    if m:
        return m.group(0)[:500]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:  # a Python traceback inside a Spark error: its last exception line
        errors = [ln for ln in lines
                  if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout)\w*(: |$)", ln)]
        if errors:
            return errors[-1][:500]
    first = lines[0] if lines else ""
    name = type(exc).__name__
    if first.startswith(name):  # kafka-python's errors name themselves
        return first[:500]
    return ("%s: %s" % (name, first) if first else name)[:500]


# one cycle --------------------------------------------------------------------------

class SparkSync:
    """The job's state across cycles: the settings, the SparkSession (made
    on first use, kept), the ZooKeeper writer and the cycle counter."""

    def __init__(self, bootstrap, zookeeper, *, topic=DEFAULT_TOPIC, freshness=90.0,
                 znode=DEFAULT_ZNODE, master=DEFAULT_MASTER, conf=(), security=None,
                 kafka_timeout=15.0, zookeeper_timeout=10.0, spark=None,
                 usage_topic=DEFAULT_USAGE_TOPIC, usage_freshness=30.0,
                 share_floor=DEFAULT_FLOOR_FRACTION):
        self.source = _source()
        self.settings = self.source.client_settings(dict(security or {}, bootstrap=bootstrap))
        self.topic = topic
        self.freshness = float(freshness)
        self.master = master
        self.conf = list(conf)
        self.timeout_ms = int(kafka_timeout * 1000)
        self.writer = ZnodeWriter(zookeeper, znode, zookeeper_timeout)
        self.spark = spark
        self._own_spark = spark is None
        self.on_session = None  # called with the session once it is made
        self.cycles = 0
        self._warned_no_reports = False
        self.usage_topic = usage_topic
        self.usage_freshness = float(usage_freshness)
        self.share_floor = share_floor

    def session(self):
        if self.spark is None:
            started = time.monotonic()
            self.spark = spark_session(self.master, self.conf)
            log.info("Spark session started (master %s) in %.1f s", self.master,
                     time.monotonic() - started)
            if self.on_session is not None:
                self.on_session(self.spark)
        return self.spark

    def snapshot(self, now=None):
        """Steps 1-3: the snapshot dict (and how many reports were read);
        (None, None) while no volume agent has published (the report topic
        does not exist): the fleet's shares are still computed."""
        self.leaders = {}
        try:
            brokers, replicas = read_metadata(self.settings, self.timeout_ms, self.leaders)
            offsets = self.source.list_offsets(self.settings, self.topic, self.timeout_ms)
        except self.source.TopicMissing as exc:
            if not self._warned_no_reports:
                self._warned_no_reports = True
                log.warning("%s: no storage state is written until volume agents publish "
                            "(quota shares still are)", exc)
            return None, None
        except self.source.KafkaReadError as exc:
            raise CycleError(str(exc)) from None
        except Exception as exc:
            raise CycleError("Kafka %s: %s" % (self.settings["bootstrap"], one_line(exc))) from None
        spark = self.session()
        rows, records = latest_reports(spark, self.settings, self.topic, offsets,
                                       self.timeout_ms)
        reports = parse_reports(rows)
        snap = cluster_snapshot(reports, brokers, replicas,
                                time.time() if now is None else now, self.freshness,
                                generated_by="kthrottle spark-sync")
        return snap, {"records": records, "keys": len(rows), "reports": len(reports)}

    def cycle(self, now=None):
        """One cycle; returns the snapshot written. CycleError (one line)
        when it failed: then nothing was written."""
        started = time.monotonic()
        cycle = self.cycles + 1
        try:
            self.writer.ensure_connected()
            snap, counts = self.snapshot(now)
            generated_at = snap["generated_at"] if snap else (time.time() if now is None
                                                              else now)
            shares = self.fleet_shares(generated_at)
            for proxy, proxy_shares in sorted(shares.items()):
                self.writer.write(encode_shares_document(
                    shares_document(proxy_shares, generated_at, cycle)),
                    znode=shares_znode(proxy, self.writer.znode))
            if snap is None:
                self.cycles = cycle
                log.info("cycle %d: quota shares for %d proxies written; no volume reports",
                         cycle, len(shares))
                return None
            snap["cycle"] = cycle
            snap["quota_shares"] = {
                "proxies": sorted(shares), "usage_reports": len(shares),
                "buckets": len({s[:3] for p in shares.values() for s in p.shares})}
            snap["cycle_seconds"] = round(time.monotonic() - started, 3)
            self.writer.write(encode_snapshot(snap))
        except CycleError:
            raise
        except Exception as exc:
            raise CycleError(one_line(exc)) from None
        self.cycles = cycle
        cluster = snap["cluster"]
        state = cluster["state"] + (" %.3f" % cluster["factor"] if cluster["state"] not in (
            OPEN, "PAUSE") else "")
        not_open = snap["partitions"]
        log.info(
            "cycle %d: %d broker(s), %d report(s) read (%d record(s) in %s), cluster %s, "
            "unknown brokers: %s, %d partition(s) not OPEN%s; written to %s in %.2f s",
            cycle, len(snap["brokers"]), counts["reports"], counts["records"], self.topic, state,
            ", ".join(map(str, cluster["unknown_brokers"])) or "none", len(not_open),
            (" (%s)" % ", ".join("%s-%d %s" % (t, p, s) for t, p, s, _ in not_open[:5])
             + (" ..." if len(not_open) > 5 else "")) if not_open else "",
            self.writer.znode, time.monotonic() - started)
        return snap

    def fleet_shares(self, now):
        """{proxy id: ProxyShares} from the fleet's usage reports (the same
        data source, the latest report per proxy); {} without a usage topic
        (no proxy is a fleet member)."""
        try:
            offsets = self.source.list_offsets(self.settings, self.usage_topic, self.timeout_ms)
        except self.source.KafkaReadError:
            return {}
        rows, _ = latest_reports(self.session(), self.settings, self.usage_topic, offsets,
                                 self.timeout_ms)
        reports = {}
        for row in rows:
            if row["key"] is None or row["value"] is None:
                continue
            try:
                # dated ahead of the job's clock: refused, as it would never age
                report = parse_usage_report(row["value"], now)
            except Exception as exc:  # a malformed report is never fatal
                log.error("skipping the malformed usage report of proxy %r: %s: %s",
                          row["key"], type(exc).__name__, str(exc)[:300])
                continue
            reports[report.proxy_id] = report
        shares = fleet_shares(reports, now, self.usage_freshness, self.share_floor,
                              self.leaders or None)
        if shares:
            log.info("quota shares for %d proxies (%s) from %d usage report(s)", len(shares),
                     ", ".join(sorted(shares)), len(reports))
        return shares

    def close(self):
        self.writer.close()
        if self.spark is not None and self._own_spark:
            try:
                self.spark.stop()
            except Exception:
                pass
            self.spark = None


# the command ------------------------------------------------------------------------

def _setup_logging(level):
    level = getattr(logging, str(level).upper(), None)
    if not isinstance(level, int):
        raise SystemExit("kthrottle: error: --log-level must be DEBUG, INFO or WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        # both libraries log every failed (re)connect; the job logs one line a cycle
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
        logging.getLogger("kazoo").setLevel(logging.CRITICAL)
        logging.getLogger("py4j").setLevel(logging.ERROR)


class _Stop(BaseException):
    pass


class _Stopper:
    """SIGTERM and SIGINT: between cycles, stop at once; during a cycle,
    cancel its Spark jobs (from another thread: the main one may be inside a
    Py4J call) and stop when it ends, its other steps having their own
    timeouts. A second signal stops at once."""

    def __init__(self, job):
        self.job = job
        self.requested = False
        self.sleeping = False

    def install(self, spark=None):
        # Spark installs its own SIGINT handler with the session: take it back
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        if self.requested or self.sleeping:
            self.requested = True
            raise _Stop()
        self.requested = True
        log.info("%s: stopping when this cycle ends", signal.Signals(signum).name)
        spark = self.job.spark
        if spark is not None:
            import threading

            threading.Thread(target=_cancel_jobs, args=(spark,), daemon=True).start()

    def sleep(self, seconds):
        self.sleeping = True
        try:
            if self.requested:
                raise _Stop()
            time.sleep(seconds)
        finally:
            self.sleeping = False


def _cancel_jobs(spark):
    try:
        spark.sparkContext.cancelAllJobs()
    except Exception:
        pass


def run(args):
    try:
        security = security_options(args)
    except ValueError as exc:
        print("kthrottle: error: %s" % exc, file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    try:
        job = SparkSync(",".join(args.bootstrap), args.zookeeper, topic=args.topic,
                        freshness=args.freshness, znode=args.znode, master=args.master,
                        conf=args.conf, security=security, kafka_timeout=args.kafka_timeout,
                        zookeeper_timeout=args.zookeeper_timeout, usage_topic=args.usage_topic,
                        usage_freshness=args.usage_freshness, share_floor=args.share_floor)
    except CycleError as exc:
        log.error("%s", exc)
        return 1
    stopper = _Stopper(job)
    stopper.install()
    job.on_session = stopper.install
    where = "%s%s" % (args.zookeeper, args.znode)
    log.info("spark-sync: %s from %s (freshness %.0f s) -> %s, %s", args.topic,
             ",".join(args.bootstrap), args.freshness, where,
             "once" if args.once else "every %g s" % args.interval)
    try:
        if args.once:
            try:
                job.cycle()
            except CycleError as exc:
                if stopper.requested:
                    raise _Stop() from None
                log.error("cycle failed, %s not written: %s", where, exc)
                return 1
            return 0
        while True:
            started = time.monotonic()
            try:
                job.cycle()
            except CycleError as exc:
                if stopper.requested:
                    raise _Stop() from None
                log.error("cycle failed (the snapshot in %s is left as it was; next try in "
                          "%g s): %s", where, args.interval, exc)
            stopper.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except (_Stop, KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if args.once:
            log.error("stopped before %s was written", where)
            return 1
        log.info("stopped after %d cycle(s)", job.cycles)
        return 0
    finally:
        job.close()
