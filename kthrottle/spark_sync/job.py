"""``kthrottle spark-sync``: the periodic PySpark job writing the cluster state.

Each cycle:

1. reads the volume-report topic with the ``kthrottle-kafka`` Python data
   source (``kafka_source``: one Spark partition per Kafka partition, read on
   the executors), only the records past the offsets the last cycle stopped
   at, and unions them with the latest record of each (key, partition) kept
   from the last cycle; Spark reduces them again (within a partition the
   offset decides, never the sender's clock) and the result is stored under
   --state-dir with the next offsets (``ReportTopic``). Only those rows (one
   per broker) are collected. Each is parsed with ``parse_report``; a
   malformed one, or one dated ahead of the job's clock, is logged and
   skipped (its broker is then UNKNOWN). With --volume-source
   describe-log-dirs (or auto, for the brokers without a fresh agent report)
   the driver asks each broker instead: DescribeLogDirs v4+ carries each log
   dir's TotalBytes and UsableBytes (KIP-827, Kafka 3.3+), made into the
   same reports (``reports_from_log_dirs``);
2. reads the cluster's Metadata on the driver: the live brokers and the
   replicas of every partition;
3. computes the snapshot with ``cluster_snapshot`` (plus ``cycle`` and
   ``cycle_seconds``), and the fleet's quota shares from the usage topic
   (read the same way);
4. writes them: to the compacted state topic (--state-topic; the default
   without --zookeeper), each proxy's shares (key ``shares/<proxy-id>``)
   acknowledged before the snapshot (key ``cluster-state``) is sent; to
   ZooKeeper, the shares and the snapshot in one transaction: readers see all
   of the old cycle or all of the new one. Both when both are given,
   ZooKeeper first;
5. keeps the usage records read in step 3 as history and, every
   --recommend-every, writes the quota recommendations (``recommend``):
   a failure there is logged, the cycle's writes stand.

A cycle that fails changes nothing in ZooKeeper (in the topic, the shares
may be written, never a snapshot after them), and its number is not used
again; the next one tries again. One SparkSession, one ZooKeeper client and
one producer serve every cycle.
"""
import argparse
import functools
import json
import logging
import os
import re
import signal
import sys
import textwrap
import time

from ..options import arg_type, parse_duration, parse_host_port
from ..policy.fleet import (
    DEFAULT_FLOOR_FRACTION,
    encode_shares_document,
    fleet_shares,
    parse_usage_report,
    shares_document,
)
from ..policy.storage import (
    MAX_CLOCK_SKEW,
    OPEN,
    BrokerReport,
    VolumeReport,
    cluster_snapshot,
    decode_snapshot,
    encode_snapshot,
    parse_limit,
    parse_report,
)
from ..security import (  # noqa: F401 (the names kafka_source keeps copies of)
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    ZOOKEEPER,
    ClientSecurityOptions,
)
from ..sources.cluster_state import shares_znode
from ..sources.state_topic import DEFAULT_TOPIC as DEFAULT_STATE_TOPIC
from ..sources.state_topic import STATE_KEY, shares_key
from . import recommend

log = logging.getLogger("kthrottle.spark_sync")

# as in kafka_source, which is not imported before it is needed: it imports
# PySpark (an optional extra), and every kthrottle command builds this parser
SOURCE_FORMAT = "kthrottle-kafka"

DEFAULT_TOPIC = "__kthrottle_volume_usage"
DEFAULT_USAGE_TOPIC = "__kthrottle_proxy_usage"
DEFAULT_ZNODE = "/kthrottle/cluster-state"
DEFAULT_MASTER = "local[2]"
# where each broker's volume usage comes from (--volume-source)
AGENT, DESCRIBE_LOG_DIRS, AUTO = "agent", "describe-log-dirs", "auto"
VOLUME_SOURCES = (AGENT, DESCRIBE_LOG_DIRS, AUTO)
# the records read back at start for the last cycle number: each cycle's last
# record carries its number, and compaction never touches the active segment
LAST_CYCLE_RECORDS = 64
PASSWORD_ENV = "KTHROTTLE_SPARK_SASL_PASSWORD"
ZNODE_MAX_BYTES = 1048575 - 1024  # ZooKeeper's default jute.maxbuffer, less some room
# A transaction (multi) is one request, held to jute.maxbuffer as a whole: the
# shares and the snapshot of a cycle go in one while they fit in this, less
# each operation's own bytes (its header, path and ACL)
TRANSACTION_MAX_BYTES = 1048575 - 16 * 1024
OP_OVERHEAD_BYTES = 64
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


def _duration_or_off(text):
    if str(text).strip().lower() in ("off", "0"):
        return None
    return _long_duration(text)


@arg_type
def _long_duration(text):
    """A duration, days (``7d``) as well."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*d\s*$", str(text), re.I)
    if m:
        seconds = float(m.group(1)) * 86400.0
        if seconds <= 0:
            raise ValueError("a duration must be positive, got %r" % (text,))
        return seconds
    return parse_duration(text)


@arg_type
def _slot(text):
    return recommend.check_slot(parse_duration(text))


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

without ZooKeeper (Kafka 4, KRaft), no agent beside the brokers:
  kthrottle spark-sync --bootstrap-server kafka-0:9092 --volume-source describe-log-dirs \
      --soft-limit MinFreePercentage:20 --hard-limit MinFreeBytes:10GiB

  The cluster state goes to the compacted topic __kthrottle_cluster_state
  (key cluster-state; each fleet proxy's shares under shares/<proxy-id>),
  where every proxy started with --cluster-state-topic reads it; the volumes
  are the brokers' own answers to DescribeLogDirs (KIP-827, Kafka 3.3+).

durations: 30s, 5m, 500ms, 1h or a number of seconds.

Each cycle reads only the records published since the last one: the latest
report of each key and the next offset of each partition are kept in
--state-dir (parquet, written by Spark) and survive a restart.

On a Spark cluster, through spark-submit (its --master then stands). The
driver runs where spark-submit does, in the Python spark.pyspark.driver.python
names, which needs kthrottle[spark]:

  spark-submit --master spark://spark-master:7077 \\
      --conf spark.pyspark.driver.python=/opt/kthrottle/bin/python \\
      --conf spark.pyspark.python=/opt/spark-python/bin/python \\
      --conf spark.driver.host=10.0.0.5 \\
      /opt/kthrottle/lib/python3.11/site-packages/kthrottle/spark_sync/submit.py \\
      --bootstrap-server kafka-0:9092 --zookeeper zk-0:2181/kafka \\
      --state-dir hdfs://namenode/kthrottle/spark-sync

(that file's path: python -c 'import kthrottle.spark_sync.submit as s;
print(s.__file__)'). The Python spark.pyspark.python names runs on every
executor and also on the driver's host (Spark plans a Python data source's
read there): the driver's Python version, with pyarrow and kafka-python; not
kthrottle (the data source is shipped with the job). The executors must reach
the driver (spark.driver.host). With a local master the executors run this
very Python.
"""


def add_parser(sub):
    p = sub.add_parser(
        "spark-sync",
        help="compute the cluster's storage state with PySpark, write it to a compacted topic "
        "or ZooKeeper",
        description="Read the volume reports the brokers' volume agents publish (or the brokers'\n"
        "own log-dir space: --volume-source), combine them with the partition replicas\n"
        "from Kafka's Metadata into one cluster-state snapshot (OPEN, THROTTLE with a\n"
        "factor, PAUSE; UNKNOWN for a broker without a fresh report) and write it as JSON,\n"
        "once or every --interval, to a compacted topic of the cluster (--state-topic) or,\n"
        "with --zookeeper, to a znode. Each cycle reads the report topic with PySpark (one\n"
        "Spark task per Kafka partition, on the executors), only what was published since\n"
        "the last cycle (--state-dir); only the latest report of each broker reaches the\n"
        "driver.\n"
        "The same cycle reads the usage reports of the fleet's proxies (--usage-topic)\n"
        "and writes each proxy its share of every quota bucket shared between proxies, in\n"
        "proportion to demand: key shares/<proxy-id> of the topic, or <znode>/shares/\n"
        "<proxy-id>.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(command="spark-sync")
    p.add_argument("--bootstrap-server", dest="bootstrap", action="append", required=True,
                   type=_bootstrap, metavar="HOST:PORT[,HOST:PORT...]",
                   help="Kafka broker(s) to bootstrap from; repeat for several (required)")
    ZOOKEEPER.replace(help="write to ZooKeeper (--znode) instead of the topic: its connect "
                      "string, as Kafka's zookeeper.connect takes it, e.g. "
                      "zk-0:2181,zk-1:2181/kafka; the chroot is created if missing. With "
                      "--state-topic too, both are written each cycle (ZooKeeper first)").add_to(p)
    p.add_argument("--state-topic", default=None, metavar="NAME",
                   help="the compacted topic of the cluster the snapshot (key %s) and each fleet "
                   "proxy's shares (key shares/<proxy-id>) are written to, where proxies "
                   "started with --cluster-state-topic read them; created if missing "
                   "(compacted, 1 partition). Default %s without --zookeeper; with it, only "
                   "when given" % (STATE_KEY, DEFAULT_STATE_TOPIC))
    p.add_argument("--master", default=None, metavar="URL",
                   help="Spark master: local[N], spark://HOST:7077, yarn, k8s://... (default: "
                   "the one spark-submit was given, else %s)" % DEFAULT_MASTER)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--interval", type=_duration, default=30.0, metavar="DURATION",
                      help="time from the start of one cycle to the start of the next "
                      "(default 30s); a cycle that fails leaves what it writes untouched and the "
                      "next one tries again; SIGTERM or Ctrl-C stop")
    when.add_argument("--once", action="store_true",
                      help="run one cycle and exit: 0 when the snapshot was written, 1 if not")
    p.add_argument("--topic", default=DEFAULT_TOPIC,
                   help="the compacted topic the volume agents publish to, keyed by broker id "
                   "(default %s)" % DEFAULT_TOPIC)
    p.add_argument("--freshness", type=_duration, default=90.0, metavar="DURATION",
                   help="a broker whose latest report was taken longer ago than this is UNKNOWN "
                   "(default 90s: three reports of an agent publishing every 30 s)")
    v = p.add_argument_group(
        "volume usage without agents (brokers of Kafka 3.3 and later)", textwrap.fill(
        "DescribeLogDirs v4+ (KIP-827) gives each log dir's TotalBytes and UsableBytes, the "
        "volume's as the broker sees it: Capacity TotalBytes, Consumed TotalBytes - "
        "UsableBytes, each log dir a volume named by its path, with the partitions the broker "
        "lists in it. The free space MinFreeBytes reads is the agent's (what the broker's "
        "user may still write); percentages are of the whole volume (blocks reserved for "
        "root count as used; the agent leaves them out of the capacity). The agent is still "
        "needed for: several log dirs on one volume (each is then reported as a volume of its "
        "own: right states, volumes counted twice), space Kafka does not report (KRaft's "
        "metadata.log.dir on a volume of its own, a filesystem quota that statvfs does not "
        "show), limits of its own per broker (the job's apply to all), brokers before 3.3.", 78))
    v.add_argument("--volume-source", choices=VOLUME_SOURCES, default=AGENT,
                   help="agent (default): the volume agents' reports (--topic) only, a broker "
                   "without a fresh one is UNKNOWN; describe-log-dirs: each live broker's "
                   "answer to DescribeLogDirs, read by the driver each cycle, no agent needed; "
                   "auto: a broker's fresh agent report where it has one, else its "
                   "DescribeLogDirs answer (agents only where needed)")
    v.add_argument("--soft-limit", type=arg_type(parse_limit), default=None, metavar="TYPE:LEVEL",
                   help="describe-log-dirs and auto: where producers start to be throttled "
                   "(ConsumedSpace, MinFreeBytes or MinFreePercentage, as the agent takes it), "
                   "e.g. MinFreePercentage:20; required with them")
    v.add_argument("--hard-limit", type=arg_type(parse_limit), default=None, metavar="TYPE:LEVEL",
                   help="describe-log-dirs and auto: where producers are paused, e.g. "
                   "MinFreeBytes:10GiB; required with them")
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
    r = p.add_argument_group(
        "quota recommendations (from the same usage reports)",
        "Each cycle's new usage reports are kept under --state-dir; every --recommend-every "
        "the job computes, per quota bucket, the p50, p95, p99 and peak of the fleet's rate "
        "and demand per hour of day (UTC) over --recommend-window, and writes them as JSON "
        "for `kthrottle quotas recommend`.")
    r.add_argument("--recommend-every", type=_duration_or_off, default=recommend.DEFAULT_EVERY,
                   metavar="DURATION|off",
                   help="how often the recommendations are computed and written (default 1h): "
                   "the first time that long after the document already written, else after "
                   "the first cycle; off keeps no history")
    r.add_argument("--recommend-window", type=_long_duration, default=recommend.DEFAULT_WINDOW,
                   metavar="DURATION",
                   help="the usage looked at, up to the cycle's time; older history is "
                   "removed (default 7d; 12h, 30d ...)")
    r.add_argument("--recommend-slot", type=_slot, default=recommend.DEFAULT_SLOT,
                   metavar="DURATION",
                   help="one sample of a bucket's fleet-wide rate per slot in which it was used "
                   "(default 1m; it must divide an hour)")
    r.add_argument("--recommend-znode", type=_znode, default=recommend.DEFAULT_ZNODE,
                   metavar="PATH",
                   help="znode the recommendations are written to, under the chroot if any "
                   "(default %s)" % recommend.DEFAULT_ZNODE)
    r.add_argument("--recommend-file", default=None, metavar="PATH",
                   help="write the recommendations to this local file instead of the znode "
                   "(replaced whole: written aside, then renamed); without --zookeeper the "
                   "only place they go: without either none are computed (said at start)")
    p.add_argument("--state-dir", default=None, metavar="PATH",
                   help="where the job keeps, between cycles and across restarts, the latest "
                   "report of each key and the next offset of each partition, so that a cycle "
                   "reads only what is new (default %s). On a real cluster it must be a path the "
                   "driver and every executor reach, e.g. hdfs://namenode/kthrottle/spark-sync "
                   "or s3a://bucket/kthrottle/spark-sync; one job per state directory"
                   % default_state_dir().replace("%", "%%"))
    p.add_argument("--znode", type=_znode, default=DEFAULT_ZNODE, metavar="PATH",
                   help="with --zookeeper: znode the snapshot is written to, under the chroot "
                   "if any (default %s)" % DEFAULT_ZNODE)
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


def read_metadata(settings, timeout_ms, leaders=None, topic_ids=None):
    """(live broker ids, {(topic, partition): [replica broker ids]}); with a
    ``leaders`` dict, fills it with {(topic, partition): leader id}; with a
    ``topic_ids`` dict, with {topic: topic id} (KIP-516; absent before
    Kafka 2.8), which tells a topic deleted and created again."""
    kafka_source = _source()
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(request_timeout_ms=int(timeout_ms),
                             **kafka_source.kafka_config(settings, timeout_ms))
    try:
        brokers = [b["broker_id"] for b in admin.describe_cluster()["brokers"]
                   if not b.get("is_fenced")]
        replicas = {}
        for topic in admin.describe_topics():
            if topic_ids is not None and _topic_id(topic.get("topic_id")):
                topic_ids[topic["name"]] = _topic_id(topic.get("topic_id"))
            for p in topic.get("partitions") or ():
                replicas[topic["name"], p["partition_index"]] = list(p.get("replica_nodes") or ())
                if leaders is not None and p.get("leader_id", -1) >= 0:
                    leaders[topic["name"], p["partition_index"]] = p["leader_id"]
        return brokers, replicas
    finally:
        admin.close()


def _topic_id(value):
    """A topic id as text; None for none (Kafka before 2.8 sends zeros)."""
    text = str(value) if value is not None else ""
    return None if not text.strip("0-") or text == "AAAAAAAAAAAAAAAAAAAAAA" else text


def latest_reports(spark, settings, topic, offsets, timeout_ms):
    """The latest record of each key, reduced by Spark and collected (one
    row per broker), and the number of records read: the whole topic, with
    no state kept (``ReportTopic`` reads only what is new)."""
    kafka_source = _source()
    df = kafka_source.load(spark, settings["bootstrap"], topic, offsets, timeout_ms,
                           **{k: v for k, v in settings.items() if k != "bootstrap"})
    rows = kafka_source.latest_per_key(df).collect()
    return rows, sum(r["records"] for r in rows)


def parse_reports(rows, now=None):
    """{broker id: BrokerReport} from the latest rows; a malformed report,
    or one dated ahead of ``now`` by more than the allowed clock skew, is
    logged and skipped (that broker is then UNKNOWN until its agent sends a
    good one: the next record of its key replaces it, whatever its time)."""
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
            report = parse_report(row["value"], now)
        except Exception as exc:  # a malformed report is never fatal
            log.error("skipping the malformed report of key %r (broker %s, %s): %s: %s",
                      row["key"], row["key"], where, type(exc).__name__, str(exc)[:300])
            continue
        if str(report.broker_id) != row["key"]:
            log.warning("the report keyed %r (%s) is broker %d's", row["key"], where,
                        report.broker_id)
        previous = reports.get(report.broker_id)
        if previous is None or report.snapshot_at >= previous.snapshot_at:
            reports[report.broker_id] = report
    return reports


# volume usage from the brokers themselves (DescribeLogDirs) ------------------------

def read_log_dirs(settings, timeout_ms, brokers, replicas):
    """{broker id: [log dir dicts] or the exception} of each of ``brokers``,
    asked with DescribeLogDirs (kafka-python negotiates the version: v4+
    carries TotalBytes and UsableBytes, KIP-827) for the partitions
    ``replicas`` places on it: every partition it holds, none the topic
    listing missed. One broker's failure is its own."""
    kafka_source = _source()
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(request_timeout_ms=int(timeout_ms),
                             **kafka_source.kafka_config(settings, timeout_ms))
    answers = {}
    try:
        for broker in brokers:
            held = {}
            for (topic, partition), holders in sorted(replicas.items()):
                if broker in holders:
                    held.setdefault(topic, []).append(partition)
            try:
                # a dict, even empty: kafka-python sends no topics then ([] lists the
                # log dirs alone), where None would make it describe every topic first
                answer = admin.describe_log_dirs(topic_partitions=held, brokers=[broker])
                answers[broker] = [d for a in answer if a.get("broker") == broker
                                   for d in a.get("log_dirs") or ()]
            except Exception as exc:  # this broker's: the others are still asked
                answers[broker] = exc
        return answers
    finally:
        admin.close()


def reports_from_log_dirs(answers, soft, hard, now):
    """({broker id: BrokerReport}, [problems]) from ``read_log_dirs``'s
    answers: each log dir a volume named by its path, Capacity its
    TotalBytes and Consumed TotalBytes - UsableBytes (so free space is
    UsableBytes, what the broker's user may still write, as the agent
    counts it), with its partitions (not the future logs of a move, as the
    agent skips ``*-future`` dirs). A log dir with an error (offline:
    KAFKA_STORAGE_ERROR) is left out; a broker with no usable log dir gets
    no report (it is then UNKNOWN), and ``problems`` says why, one line
    each."""
    from kafka import errors as Errors

    reports, problems = {}, []
    for broker, dirs in sorted(answers.items()):
        if isinstance(dirs, Exception):
            problems.append("broker %d: DescribeLogDirs failed: %s" % (broker, one_line(dirs)))
            continue
        volumes, old = [], False
        for d in sorted(dirs, key=lambda d: str(d.get("log_dir"))):
            path = str(d.get("log_dir") or "")
            if d.get("error_code"):
                problems.append("broker %d: log dir %s left out: %s" % (
                    broker, path, Errors.for_code(d["error_code"]).__name__))
                continue
            total, usable = d.get("total_bytes", -1), d.get("usable_bytes", -1)
            if total is None or usable is None or total < 0 or usable < 0:
                old = True  # DescribeLogDirs before v4: no space in the answer
                continue
            usable = min(usable, total)
            partitions = sorted((t["name"], p["partition_index"]) for t in d.get("topics") or ()
                                for p in t.get("partitions") or () if not p.get("is_future_key"))
            volumes.append(VolumeReport(path, int(total), int(total - usable), path,
                                        tuple(partitions)))
        if volumes:
            reports[broker] = BrokerReport(broker, now, soft, hard, tuple(volumes))
        elif old:
            problems.append("broker %d does not report its log dirs' space (DescribeLogDirs v4, "
                            "KIP-827, Kafka 3.3 and later): run kthrottle volume-agent beside it"
                            % broker)
        elif not dirs:
            # Kafka answers a principal without DESCRIBE on the cluster with
            # CLUSTER_AUTHORIZATION_FAILED and no log dir (the top-level error
            # code kafka-python does not pass on)
            problems.append("broker %d answered DescribeLogDirs with no log dir (may this "
                            "principal DESCRIBE the cluster?)" % broker)
        else:
            problems.append("broker %d: no log dir could be measured" % broker)
    return reports, problems


def merge_reports(agent_reports, broker_reports, now, freshness):
    """--volume-source auto: each broker's agent report while it is fresh
    (taken within ``freshness``, not dated ahead), else its DescribeLogDirs
    report when there is one, else its agent report as it is (stale: the
    snapshot says so). Returns (reports, {broker: "agent" | "broker"})."""
    out, used = {}, {}
    for broker in sorted(set(agent_reports) | set(broker_reports)):
        agent = agent_reports.get(broker)
        fresh = agent is not None and -MAX_CLOCK_SKEW <= now - agent.snapshot_at <= freshness
        if fresh or broker not in broker_reports:
            out[broker], used[broker] = agent, "agent"
        else:
            out[broker], used[broker] = broker_reports[broker], "broker"
    return out, used


def fresh_agent_brokers(agent_reports, now, freshness):
    """The brokers whose agent report is fresh (auto asks the others)."""
    return {b for b, r in agent_reports.items()
            if -MAX_CLOCK_SKEW <= now - r.snapshot_at <= freshness}


# the state between cycles -----------------------------------------------------------

def default_state_dir():
    """Where the job keeps its state unless --state-dir says: the user's
    state directory (XDG_STATE_HOME, else ~/.local/state)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "kthrottle", "spark-sync")


def state_dir_path(text):
    """A local path made absolute (Spark resolves relative ones elsewhere on
    executors); a URI (hdfs://, s3a://, file:) as given."""
    text = str(text).strip()
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text):
        return text.rstrip("/") or text
    return os.path.abspath(os.path.expanduser(text))


class StateFiles:
    """The state directory through Hadoop's FileSystem API (what Spark
    writes with): a local directory, hdfs://, s3a:// alike."""

    def __init__(self, spark, root):
        jvm = spark._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self._io = jvm.org.apache.commons.io.IOUtils
        self.root = root
        self.fs = self._path(root).getFileSystem(spark._jsc.hadoopConfiguration())

    def join(self, *parts):
        return "/".join([self.root.rstrip("/")] + [p.strip("/") for p in parts])

    def list(self, path):
        """The names in directory ``path`` ([] when it does not exist)."""
        p = self._path(path)
        if not self.fs.exists(p):
            return []
        return [st.getPath().getName() for st in self.fs.listStatus(p)]

    def exists(self, path):
        return bool(self.fs.exists(self._path(path)))

    def read_text(self, path):
        """The file's text, None when it does not exist."""
        p = self._path(path)
        if not self.fs.exists(p):
            return None
        stream = self.fs.open(p)
        try:
            return self._io.toString(stream, "UTF-8")
        finally:
            stream.close()

    def write_text(self, path, text):
        """Written under a temporary name, then renamed: a reader sees the
        whole file or none."""
        tmp = self._path(path + ".tmp")
        out = self.fs.create(tmp, True)
        try:
            out.write(bytearray(text.encode("utf-8")))
        finally:
            out.close()
        target = self._path(path)
        if self.fs.exists(target):
            self.fs.delete(target, False)
        if not self.fs.rename(tmp, target):
            raise OSError("could not rename %s to %s" % (tmp, target))

    def delete(self, path):
        self.fs.delete(self._path(path), True)


STATE_COLUMNS = ("key", "partition", "value", "offset", "timestamp")
STATE_SCHEMA = ("key STRING, partition INT, value STRING, offset BIGINT, timestamp TIMESTAMP, "
                "records BIGINT, bytes BIGINT")
STATE_FORMAT = "kthrottle-spark-sync-state"
_VERSION = re.compile(r"^v-([0-9]{10})$")


def plan_read(topic, stored, listed, stored_topic_id, topic_id, high_watermark):
    """Which offsets of ``topic`` to read this cycle. ``stored``: {partition:
    next offset} kept from the last cycle; ``listed``: {partition: (log
    start, end offset)} now; ``high_watermark(partition, near)``: asked only
    when the end offset is below the stored one (Tansu under-reports end
    offsets; a real truncation shows in the high watermark too).
    Returns ({partition: (start, end)}, partitions whose state is dropped,
    [what happened, for the log])."""
    notes, dropped = [], set()
    if stored and stored_topic_id and topic_id and stored_topic_id != topic_id:
        notes.append("topic %s was deleted and created again (topic id %s, was %s): its state "
                     "is dropped, read from the log start" % (topic, topic_id, stored_topic_id))
        dropped, stored = set(stored), {}
    for p in sorted(set(stored) - set(listed)):
        notes.append("%s-%d is gone: its state is dropped" % (topic, p))
        dropped.add(p)
    ranges = {}
    for p, (start, end) in sorted(listed.items()):
        at = stored.get(p)
        if at is None:
            if stored:
                notes.append("%s-%d is new: read from its log start %d" % (topic, p, start))
            ranges[p] = (start, end)
        elif end < at and high_watermark(p, max(start, end - 1)) < at:
            notes.append("%s-%d ends at %d, before the next offset kept (%d): the partition was "
                         "truncated or created again; its state is dropped, read from the log "
                         "start %d" % (topic, p, end, at, start))
            dropped.add(p)
            ranges[p] = (start, end)
        elif start > at:
            notes.append("%s-%d starts at %d, past the next offset kept (%d): records were "
                         "removed (retention, deletion); read from the log start"
                         % (topic, p, start, at))
            ranges[p] = (start, end)
        else:
            ranges[p] = (at, max(end, at))
    return ranges, dropped, notes


class ReportTopic:
    """One report topic read incrementally: the latest record per (key,
    partition) is kept as a Spark DataFrame; each cycle unions it with only
    the records past the next offset kept for each partition, reduces again
    (Spark), and stores the result as parquet under ``<state dir>/<topic>/
    v-<N>/latest`` with ``offsets.json`` (the next offset per partition,
    the topic id), written last: a version without it is incomplete. The
    previous version is removed once the new one is complete; on start the
    newest complete version is loaded. One job per state directory."""

    def __init__(self, topic, state_dir):
        self.topic = topic
        self.state_dir = state_dir
        self.loaded = False
        self.version = 0  # the newest version number seen (complete or not)
        self.current = None  # the directory of the version in use
        self.offsets = {}  # partition -> next offset
        self.topic_id = None
        self.latest = None  # DataFrame of the version in use
        self.last_counts = None  # what the last cycle read: records, bytes, keys

    def _load(self, spark, files):
        home = files.join(self.topic)
        versions = sorted((int(m.group(1)), name) for name in files.list(home)
                          for m in [_VERSION.match(name)] if m)
        self.version = versions[-1][0] if versions else 0
        for number, name in reversed(versions):
            where = files.join(self.topic, name)
            try:
                meta = json.loads(files.read_text(where + "/offsets.json") or "null")
                if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT \
                        or meta.get("topic") != self.topic:
                    continue
                offsets = {int(p): int(n) for p, n in meta["next_offsets"].items()}
                latest = spark.read.schema(STATE_SCHEMA).parquet(where + "/latest")
            except Exception as exc:
                log.warning("state %s is unreadable, an older one is tried: %s", where,
                            one_line(exc))
                continue
            self.current, self.offsets, self.latest = where, offsets, latest
            self.topic_id = meta.get("topic_id")
            log.info("%s: resuming from %s (next offsets %s)", self.topic, where,
                     ", ".join("%d: %d" % kv for kv in sorted(offsets.items())) or "none")
            break
        self.loaded = True

    def read(self, spark, settings, listed, topic_id, timeout_ms, on_new=None):
        """This cycle's rows (one per (key, partition), collected) and
        {"records", "bytes"} read from Kafka this cycle (new ones only).
        ``on_new`` is given the DataFrame of the new records first."""
        kafka_source = _source()
        from pyspark.sql import functions as F

        files = StateFiles(spark, self.state_dir)
        if not self.loaded:
            self._load(spark, files)

        def high_watermark(partition, near):
            return kafka_source.high_watermark(settings, self.topic, partition, near, timeout_ms)

        ranges, dropped, notes = plan_read(self.topic, self.offsets, listed, self.topic_id,
                                           topic_id, high_watermark)
        for note in notes:
            log.warning("%s", note)
        new = kafka_source.load(spark, settings["bootstrap"], self.topic, ranges, timeout_ms,
                                **{k: v for k, v in settings.items() if k != "bootstrap"})
        if on_new is not None:
            on_new(new)
        df = new.select(*STATE_COLUMNS).withColumn("new", F.lit(1))
        if self.latest is not None:
            old = self.latest
            if dropped:
                old = old.filter(~F.col("partition").isin(sorted(dropped)))
            df = old.select(*STATE_COLUMNS).withColumn("new", F.lit(0)).unionByName(df)
        version = self.version + 1
        where = files.join(self.topic, "v-%010d" % version)
        self.version = version
        try:
            (kafka_source.latest_per_key_partition(df, new=False).coalesce(1)
             .write.mode("overwrite").parquet(where + "/latest"))
            latest = spark.read.schema(STATE_SCHEMA).parquet(where + "/latest")
            rows = latest.collect()
            offsets = {p: start for p, (start, _) in ranges.items()}
            for row in rows:
                p = row["partition"]
                if p in offsets:
                    offsets[p] = max(offsets[p], row["offset"] + 1)
            files.write_text(where + "/offsets.json", json.dumps({
                "format": STATE_FORMAT, "version": 1, "topic": self.topic, "topic_id": topic_id,
                "next_offsets": {str(p): n for p, n in sorted(offsets.items())},
                "written_at": time.time()}, sort_keys=True))
        except BaseException:
            try:
                files.delete(where)
            except Exception:
                pass
            self.forget()  # what this job held may be what failed: load it again
            raise
        previous, self.current = self.current, where
        self.latest, self.offsets, self.topic_id = latest, offsets, topic_id
        if previous is not None and previous != where:
            try:
                files.delete(previous)
            except Exception as exc:  # left for the next start to ignore
                log.warning("could not remove the previous state %s: %s", previous,
                            one_line(exc))
        counts = self.last_counts = {"records": sum(r["records"] or 0 for r in rows),
                                     "bytes": sum(r["bytes"] or 0 for r in rows),
                                     "keys": len(rows)}
        return rows, counts

    def forget(self):
        """After a failed cycle: load the newest complete version again on
        the next one (what this job held may be what failed)."""
        self.loaded = False
        self.current = self.latest = self.topic_id = None
        self.offsets = {}


# the ZooKeeper side -----------------------------------------------------------------

def _fits(znode, data):
    # a record of the state topic: Kafka's message.max.bytes is 1 MiB by default too
    if len(data) > ZNODE_MAX_BYTES:
        raise CycleError("%s would be %d bytes, past what one znode (or one record) holds (%d)"
                         % (znode, len(data), ZNODE_MAX_BYTES))


class ZnodeWriter:
    """One kazoo client, kept across cycles (it reconnects by itself), that
    writes the snapshot to one znode."""

    def __init__(self, hosts, znode, timeout):
        self.hosts = hosts
        self.znode = znode
        self.timeout = timeout
        self.zk = None
        self._chunks_said = 1

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
        _fits(znode, data)
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

    def last_cycle(self, znodes):
        """The greatest ``cycle`` among the documents at ``znodes`` (0 when
        none has one): where a restarted job carries on counting."""
        self.ensure_connected()
        values = []
        for znode in znodes:
            try:
                values.append(self.zk.get_async(znode).get(timeout=self.timeout)[0])
            except Exception:
                continue
        return last_cycle_of(values)

    def children(self, znode):
        """The names under ``znode`` ([] when it does not exist)."""
        from kazoo.exceptions import NoNodeError

        self.ensure_connected()
        try:
            return list(self.zk.get_children_async(znode).get(timeout=self.timeout))
        except NoNodeError:
            return []

    def plan(self, writes):
        """The operations of one transaction that writes every (znode, data)
        of ``writes``: ("create" | "set", znode, data), in order, a missing
        znode created empty before anything below it (set later in the same
        transaction when it is itself written: the snapshot znode is the
        parent of the shares)."""
        zk = self.zk
        targets = [z for z, _ in writes]
        parents = {z.rsplit("/", 1)[0] or "/" for z in targets}
        needed = set()
        for z in targets:
            parts = z.strip("/").split("/")
            needed.update("/" + "/".join(parts[:i]) for i in range(1, len(parts)))
        probe = sorted(needed | (set(targets) & parents), key=lambda z: z.count("/"))
        answers = [(z, zk.exists_async(z)) for z in probe]
        existing = {z for z, a in answers if a.get(timeout=self.timeout) is not None}
        listed = [(parent, zk.get_children_async(parent)) for parent in sorted(parents)
                  if parent == "/" or parent in existing]
        for parent, answer in listed:
            existing.update("%s/%s" % (parent.rstrip("/"), c)
                            for c in answer.get(timeout=self.timeout))
        ops = []

        def ensure(path):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                z = "/" + "/".join(parts[:i])
                if z != "/" and z not in existing:
                    ops.append(("create", z, b""))
                    existing.add(z)

        for znode, data in writes:
            ensure(znode.rsplit("/", 1)[0] or "/")
            ops.append(("set" if znode in existing else "create", znode, data))
            existing.add(znode)
        return ops

    def commit(self, writes, limit=None):
        """Write every (znode, data) of ``writes`` in one ZooKeeper
        transaction (a multi): all or none. One transaction is one request,
        which a server refuses past its jute.maxbuffer (1 MiB by default): a
        cycle whose znodes pass ``limit`` bytes in all is written in several,
        in order, each all or none, the last one carrying what ``writes``
        ends with (the snapshot); returns how many transactions it took."""
        from kazoo.exceptions import KazooException, RolledBackError

        limit = TRANSACTION_MAX_BYTES if limit is None else limit
        for znode, data in writes:
            _fits(znode, data)
        self.ensure_connected()
        zk = self.zk
        try:
            ops = self.plan(writes)
            chunks, size = [[]], 0
            for op in ops:
                cost = len(op[2]) + len(op[1]) + OP_OVERHEAD_BYTES
                if chunks[-1] and size + cost > limit:
                    chunks.append([])
                    size = 0
                chunks[-1].append(op)
                size += cost
            if len(chunks) > 1 and len(chunks) != self._chunks_said:
                log.warning("the cycle's %d znodes (%d bytes) pass what one ZooKeeper transaction "
                            "carries (%d bytes, jute.maxbuffer): written in %d transactions, the "
                            "snapshot with the last", len(writes),
                            sum(len(op[2]) for op in ops), limit, len(chunks))
            self._chunks_said = len(chunks)  # said again when that changes
            for n, chunk in enumerate(chunks, 1):
                t = zk.transaction()
                for kind, znode, data in chunk:
                    if kind == "create":
                        t.create(znode, data)
                    else:
                        t.set_data(znode, data)
                results = t.commit_async().get(timeout=self.timeout)
                failed = [(op, r) for op, r in zip(chunk, results)
                          if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
                if failed:
                    (kind, znode, _), error = failed[0]
                    raise CycleError("ZooKeeper %s refused the transaction%s, nothing of it was "
                                     "written: %s %s: %s" % (
                                         self.hosts, " %d of %d (the earlier ones were written)"
                                         % (n, len(chunks)) if n > 1 else "",
                                         "creating" if kind == "create" else "setting", znode,
                                         type(error).__name__))
        except CycleError:
            raise
        except (KazooException, zk.handler.timeout_exception) as exc:
            raise CycleError("writing %d znode(s) on ZooKeeper %s failed: %s" % (
                len(writes), self.hosts,
                type(exc).__name__ + (": %s" % exc if str(exc) else ""))) from None
        return len(chunks)

    def close(self):
        if self.zk is not None:
            try:
                self.zk.stop()
                self.zk.close()
            except Exception:
                pass
            self.zk = None


# the outputs: the znodes, the topic ------------------------------------------------

class ZnodeOutput:
    """The znodes (--zookeeper): a cycle's shares and snapshot in one
    ZooKeeper transaction (``ZnodeWriter.commit``)."""

    def __init__(self, writer):
        self.writer = writer

    @property
    def where(self):
        return self.writer.hosts + self.writer.znode

    def connect(self):
        self.writer.ensure_connected()

    def last_cycle(self):
        znode = self.writer.znode
        return self.writer.last_cycle([znode] + [
            shares_znode(p, znode) for p in self.writer.children(znode + "/shares")[:1]])

    def write(self, shares, snapshot):
        """``shares`` [(proxy id, bytes)], ``snapshot`` bytes or None."""
        znode = self.writer.znode
        writes = [(shares_znode(proxy, znode), data) for proxy, data in shares]
        if snapshot is not None:
            writes.append((znode, snapshot))
        if writes:
            self.writer.commit(writes)

    def close(self):
        self.writer.close()


def state_records(shares, snapshot):
    """The records of one cycle in the state topic: [(key, value)] bytes,
    each proxy's shares (``shares/<proxy-id>``), then the snapshot
    (``cluster-state``) last, as the znodes' transaction ends with it."""
    records = [(shares_key(proxy).encode("utf-8"), data) for proxy, data in shares]
    if snapshot is not None:
        records.append((STATE_KEY.encode("utf-8"), snapshot))
    return records


def last_cycle_of(values):
    """The greatest ``cycle`` among stored documents (bytes; what does not
    decode is skipped), 0 when none has one."""
    last = 0
    for data in values:
        try:
            cycle = decode_snapshot(data).get("cycle") if data else None
        except Exception:
            continue
        if isinstance(cycle, int) and not isinstance(cycle, bool):
            last = max(last, cycle)
    return last


class TopicOutput:
    """The compacted topic (--state-topic) on the cluster the job reads,
    with its security settings: each proxy's shares, acknowledged, then the
    snapshot (``state_records``), with the blocking publisher the volume
    agent uses (``KafkaPublisher``: creates the topic compacted with one
    partition). Per key the last record is what readers keep."""

    def __init__(self, settings, topic, timeout_ms):
        from ..sources.kafka_publisher import KafkaPublisher, describe_connection

        self.settings = settings
        self.topic = topic
        self.timeout_ms = timeout_ms
        config = dict(_source().kafka_config(settings, timeout_ms),
                      client_id="kthrottle-spark-sync", request_timeout_ms=int(timeout_ms))
        self.publisher = KafkaPublisher(
            config, topic, timeout_ms / 1000.0,
            describe_connection(config["bootstrap_servers"],
                                settings.get("security_protocol", "PLAINTEXT"),
                                settings.get("sasl_mechanism"), settings.get("sasl_username")),
            settings.get("sasl_password"), logger=log)

    @property
    def where(self):
        return "topic %s" % self.topic

    def connect(self):
        pass  # each write connects if need be

    def last_cycle(self):
        """The cycle of the last records written (0: no topic yet)."""
        from kafka import TopicPartition

        source = _source()
        try:
            listed = source.list_offsets(self.settings, self.topic, self.timeout_ms)
        except source.TopicMissing:
            return 0
        values = []
        c = source.consumer(self.settings, self.timeout_ms)
        try:
            deadline = time.monotonic() + self.timeout_ms / 1000.0
            for partition, (start, end) in sorted(listed.items()):
                if end <= start:
                    continue
                tp = TopicPartition(self.topic, partition)
                c.assign([tp])
                c.seek(tp, max(start, end - LAST_CYCLE_RECORDS))
                while c.position(tp) < end:
                    values.extend(r.value for r in c.poll(timeout_ms=200).get(tp, ()))
                    if time.monotonic() > deadline:
                        raise CycleError("reading the last records of %s-%d took over %.0f s"
                                         % (self.topic, partition, self.timeout_ms / 1000.0))
        finally:
            c.close()
        return last_cycle_of(values)

    def write(self, shares, snapshot):
        from ..sources.kafka_publisher import PublishError

        records = state_records(shares, snapshot)
        for key, data in records:
            _fits("%s key %s" % (self.topic, key.decode()), data)
        try:
            if len(records) > 1:  # the shares acknowledged before the snapshot is sent
                self.publisher.publish_all(records[:-1])
            if records:
                self.publisher.publish_all(records[-1:])
        except PublishError as exc:
            raise CycleError(str(exc)) from None

    def close(self):
        self.publisher.close()


# Spark ----------------------------------------------------------------------------

def spark_session(master=None, conf=(), app_name="kthrottle-spark-sync"):
    """A SparkSession for the job (local masters bind 127.0.0.1 and run
    executors with this Python). ``master`` None: the one spark-submit was
    given when it started this Python, else DEFAULT_MASTER."""
    kafka_source = _source()
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    # spark-submit starts the Python of a .py application with a gateway to
    # its JVM: what it was given (--master, --name, --conf) stands
    submitted = None
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        SparkContext._ensure_initialized()  # that JVM's settings, for SparkConf to load
        submitted = SparkConf()
    if master is None:
        master = submitted.get("spark.master", DEFAULT_MASTER) if submitted else DEFAULT_MASTER
    local = master.startswith("local")
    defaults = {"spark.app.name": app_name, "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "2"}
    if local:
        defaults.update({"spark.driver.bindAddress": "127.0.0.1",
                         "spark.driver.host": "127.0.0.1"})
    builder = SparkSession.builder.master(master)
    for key, value in defaults.items():
        # spark-submit names the application after its file unless --name says
        if submitted is None or not submitted.contains(key) or (
                key == "spark.app.name" and submitted.get(key) == os.path.basename(sys.argv[0])):
            builder = builder.config(key, value)
    if local:
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


# What a crashed Python worker most often lacks (its own traceback goes to the
# stderr of the process that started it, not into the error)
WORKER_CRASHED = (" (does the Python that spark.pyspark.python or PYSPARK_PYTHON names have "
                  "pyarrow, on the driver's host as well as on the executors? Its error is in "
                  "their stderr)")


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
        # Py4J's "An error occurred while calling ...", then ": <the Java error>"
        java = re.match(r"^: (?:[\w$]+\.)*([\w$]+): (.*)", lines[1])
        if java:
            reason = "%s: %s" % java.groups()
            if "Python worker exited unexpectedly" in reason:
                reason = reason.split(". ", 1)[0] + WORKER_CRASHED
            return reason[:500]
    first = lines[0] if lines else ""
    name = type(exc).__name__
    if first.startswith(name):  # kafka-python's errors name themselves
        return first[:500]
    return ("%s: %s" % (name, first) if first else name)[:500]


# one cycle --------------------------------------------------------------------------

class SparkSync:
    """The job's state across cycles: the settings, the SparkSession (made
    on first use, kept), the outputs (the ZooKeeper writer, the state
    topic's publisher), the cycle counter and, per report topic, what was
    read of it (``ReportTopic``, under ``state_dir``).

    ``zookeeper`` None: the state topic (``state_topic``, by default
    DEFAULT_STATE_TOPIC) is the output; given: the znodes, and the topic too
    when ``state_topic`` is given."""

    def __init__(self, bootstrap, zookeeper, *, topic=DEFAULT_TOPIC, freshness=90.0,
                 znode=DEFAULT_ZNODE, master=None, conf=(), security=None,
                 kafka_timeout=15.0, zookeeper_timeout=10.0, spark=None,
                 usage_topic=DEFAULT_USAGE_TOPIC, usage_freshness=30.0,
                 share_floor=DEFAULT_FLOOR_FRACTION, state_dir=None,
                 recommend_every=recommend.DEFAULT_EVERY, recommend_window=recommend.DEFAULT_WINDOW,
                 recommend_slot=recommend.DEFAULT_SLOT, recommend_znode=recommend.DEFAULT_ZNODE,
                 recommend_file=None, state_topic=None, volume_source=AGENT, soft_limit=None,
                 hard_limit=None):
        self.source = _source()
        self.settings = self.source.client_settings(dict(security or {}, bootstrap=bootstrap))
        self.topic = topic
        self.freshness = float(freshness)
        self.master = master
        self.conf = list(conf)
        self.timeout_ms = int(kafka_timeout * 1000)
        if volume_source not in VOLUME_SOURCES:
            raise ValueError("volume source must be one of %s, got %r"
                             % (", ".join(VOLUME_SOURCES), volume_source))
        if volume_source != AGENT and (soft_limit is None or hard_limit is None):
            raise ValueError("volume source %s needs the soft and the hard limit"
                             % volume_source)
        self.volume_source = volume_source
        self.soft_limit, self.hard_limit = soft_limit, hard_limit
        self.writer = ZnodeWriter(zookeeper, znode, zookeeper_timeout) if zookeeper else None
        if state_topic is None and zookeeper is None:
            state_topic = DEFAULT_STATE_TOPIC
        self.state_topic = state_topic
        self.outputs = ([ZnodeOutput(self.writer)] if self.writer is not None else []) + (
            [TopicOutput(self.settings, state_topic, self.timeout_ms)] if state_topic else [])
        self.spark = spark
        self._own_spark = spark is None
        self.on_session = None  # called with the session once it is made
        self.cycles = None  # the last cycle number used; read from ZooKeeper on the first
        self.ran = 0  # cycles this process ran
        self._warned_no_reports = False
        self.usage_topic = usage_topic
        self.usage_freshness = float(usage_freshness)
        self.share_floor = share_floor
        self.state_dir = state_dir_path(state_dir or default_state_dir())
        self.topics = {}  # name -> ReportTopic
        self.leaders = {}
        self.topic_ids = {}
        self.recommend_znode = recommend_znode
        self.recommend_file = recommend_file
        if recommend_every is not None and self.writer is None and not recommend_file:
            # they are read from a znode or a file (kthrottle quotas recommend)
            log.info("no --zookeeper and no --recommend-file: quota recommendations are not "
                     "computed (give --recommend-file PATH for them)")
            recommend_every = None
        self.recommender = None if recommend_every is None else recommend.Recommender(
            lambda spark: StateFiles(spark, self.state_dir),
            usage_topic + "/history",
            self.write_recommendations, recommend_every, recommend_window, recommend_slot,
            self.recommendations_written_at)

    def session(self):
        if self.spark is None:
            started = time.monotonic()
            self.spark = spark_session(self.master, self.conf)
            log.info("Spark session started (master %s) in %.1f s",
                     self.spark.sparkContext.master, time.monotonic() - started)
            if self.on_session is not None:
                self.on_session(self.spark)
        return self.spark

    def read_topic(self, topic, listed):
        """(rows, counts) of ``topic``: its latest record per (key,
        partition), only what is new read from Kafka (ReportTopic); the new
        usage records also go to the recommendations' history."""
        state = self.topics.get(topic)
        if state is None:
            state = self.topics[topic] = ReportTopic(topic, self.state_dir)
        spark = self.session()
        on_new = None
        if topic == self.usage_topic and self.recommender is not None:
            on_new = functools.partial(self.recommender.append, spark)
        return state.read(spark, self.settings, listed, self.topic_ids.get(topic),
                          self.timeout_ms, on_new)

    def recommend(self, now):
        """Step 5, when due; a failure is logged, never raised."""
        if self.recommender is None or not self.recommender.due(now):
            return None
        try:
            doc = self.recommender.run(self.session(), now)
        except Exception as exc:
            log.error("quota recommendations not written (next try next cycle): %s",
                      one_line(exc))
            return None
        log.info("quota recommendations for %d bucket(s) from %d usage report(s) of %d "
                 "proxies (%s to %s) written to %s in %.1f s", len(doc["entities"]),
                 doc["reports"], doc["proxies"], doc["window"]["start"], doc["window"]["end"],
                 self.recommend_file or self.writer.hosts + self.recommend_znode,
                 doc["compute_seconds"])
        return doc

    def recommendations_written_at(self):
        """The generated_at of the document already written, None if none."""
        if self.recommend_file:
            try:
                with open(os.path.expanduser(self.recommend_file), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return None
        else:
            from kazoo.exceptions import NoNodeError

            self.writer.ensure_connected()
            try:
                data, _ = self.writer.zk.get_async(self.recommend_znode).get(
                    timeout=self.writer.timeout)
            except NoNodeError:
                return None
        document = decode_snapshot(data) if data else None
        return document.get("generated_at") if isinstance(document, dict) else None

    def write_recommendations(self, document):
        data = encode_snapshot(document)
        if self.recommend_file:
            path = os.path.abspath(os.path.expanduser(self.recommend_file))
            tmp = "%s.%d.tmp" % (path, os.getpid())
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            self.writer.write(data, self.recommend_znode)

    def snapshot(self, now=None):
        """Steps 1-3: the snapshot dict (and what was read); (None, None)
        while no volume agent has published (the report topic does not
        exist) and no broker is asked (--volume-source agent): the fleet's
        shares are still computed."""
        self.leaders, self.topic_ids = {}, {}
        now = time.time() if now is None else now
        try:
            brokers, replicas = read_metadata(self.settings, self.timeout_ms, self.leaders,
                                              self.topic_ids)
            offsets = None
            if self.volume_source != DESCRIBE_LOG_DIRS:
                offsets = self.source.list_offsets(self.settings, self.topic, self.timeout_ms)
        except self.source.TopicMissing as exc:
            if self.volume_source == AGENT:
                if not self._warned_no_reports:
                    self._warned_no_reports = True
                    log.warning("%s: no storage state is written until volume agents publish "
                                "(quota shares still are)", exc)
                return None, None
            offsets = None  # auto: the brokers answer for every broker
        except self.source.KafkaReadError as exc:
            raise CycleError(str(exc)) from None
        except Exception as exc:
            raise CycleError("Kafka %s: %s" % (self.settings["bootstrap"], one_line(exc))) from None
        agent_reports, counts, source = {}, {"records": 0, "bytes": 0}, None
        if offsets is not None:
            rows, counts = self.read_topic(self.topic, offsets)
            agent_reports = parse_reports(self.source.latest_of_keys(rows).values(), now)
            counts = dict(counts, keys=len(rows))
            source = "%d new record(s), %d bytes, of %s" % (counts["records"], counts["bytes"],
                                                            self.topic)
        reports = agent_reports
        if self.volume_source != AGENT:
            asked = sorted(set(brokers) - (fresh_agent_brokers(agent_reports, now,
                                                                self.freshness)
                                           if self.volume_source == AUTO else set()))
            broker_reports = self.broker_reports(asked, replicas, now)
            if self.volume_source == DESCRIBE_LOG_DIRS:
                reports, source = broker_reports, "DescribeLogDirs"
            else:
                reports, used = merge_reports(agent_reports, broker_reports, now, self.freshness)
                source = "%s; DescribeLogDirs for broker(s) %s" % (
                    source or "no report topic", ", ".join(
                        str(b) for b, u in sorted(used.items()) if u == "broker") or "none")
        snap = cluster_snapshot(reports, brokers, replicas, now, self.freshness,
                                generated_by="kthrottle spark-sync", topic_ids=self.topic_ids)
        return snap, dict(counts, reports=len(reports), source=source)

    def broker_reports(self, brokers, replicas, now):
        """{broker id: BrokerReport} from the brokers' DescribeLogDirs
        answers; what could not be read is logged (that broker is UNKNOWN)."""
        if not brokers:
            return {}
        try:
            answers = read_log_dirs(self.settings, self.timeout_ms, brokers, replicas)
        except Exception as exc:
            raise CycleError("DescribeLogDirs on %s: %s" % (self.settings["bootstrap"],
                                                            one_line(exc))) from None
        reports, problems = reports_from_log_dirs(answers, self.soft_limit, self.hard_limit, now)
        for problem in problems:
            log.warning("%s", problem)
        return reports

    def cycle(self, now=None):
        """One cycle; returns the snapshot written. CycleError (one line)
        when it failed: then nothing was written, and the cycle's number is
        not used again."""
        started = time.monotonic()
        try:
            for output in self.outputs:
                output.connect()
            if self.cycles is None:  # where a restarted job carries on counting
                self.cycles = max(output.last_cycle() for output in self.outputs)
        except CycleError:
            raise
        except Exception as exc:
            raise CycleError(one_line(exc)) from None
        cycle = self.cycles = self.cycles + 1
        self.ran += 1
        try:
            snap, counts = self.snapshot(now)
            generated_at = snap["generated_at"] if snap else (time.time() if now is None
                                                              else now)
            shares = self.fleet_shares(generated_at)
            documents = [(proxy, encode_shares_document(shares_document(proxy_shares,
                                                                         generated_at, cycle)))
                         for proxy, proxy_shares in sorted(shares.items())]
            data = None
            if snap is not None:
                snap["cycle"] = cycle
                snap["quota_shares"] = {
                    "proxies": sorted(shares), "usage_reports": len(shares),
                    "buckets": len({s[:3] for p in shares.values() for s in p.shares})}
                snap["cycle_seconds"] = round(time.monotonic() - started, 3)
                data = encode_snapshot(snap)
            if documents or data is not None:
                # ZooKeeper: the shares and the snapshot together, or neither;
                # the topic: the shares, then the snapshot
                for output in self.outputs:
                    output.write(documents, data)
            self.recommend(generated_at)
            if snap is None:
                log.info("cycle %d: quota shares for %d proxies written; no volume reports",
                         cycle, len(shares))
                return None
        except CycleError:
            raise
        except Exception as exc:
            raise CycleError(one_line(exc)) from None
        cluster = snap["cluster"]
        state = cluster["state"] + (" %.3f" % cluster["factor"] if cluster["state"] not in (
            OPEN, "PAUSE") else "")
        not_open = snap["partitions"]
        log.info(
            "cycle %d: %d broker(s), %d report(s) read (%s), "
            "cluster %s, unknown brokers: %s, %d partition(s) not OPEN%s; written to %s in "
            "%.2f s",
            cycle, len(snap["brokers"]), counts["reports"], counts["source"], state,
            ", ".join(map(str, cluster["unknown_brokers"])) or "none", len(not_open),
            (" (%s)" % ", ".join("%s-%d %s" % (t, p, s) for t, p, s, _ in not_open[:5])
             + (" ..." if len(not_open) > 5 else "")) if not_open else "",
            self.where, time.monotonic() - started)
        return snap

    @property
    def where(self):
        """Where the cycles are written, for the log."""
        return " and ".join(output.where for output in self.outputs)

    def fleet_shares(self, now):
        """{proxy id: ProxyShares} from the fleet's usage reports (the same
        data source, the latest report per proxy); {} without a usage topic
        (no proxy is a fleet member)."""
        try:
            offsets = self.source.list_offsets(self.settings, self.usage_topic, self.timeout_ms)
        except self.source.KafkaReadError:
            return {}
        rows, counts = self.read_topic(self.usage_topic, offsets)
        reports = {}
        for key, row in sorted(self.source.latest_of_keys(rows).items(),
                               key=lambda kv: (kv[0] is None, kv[0] or "")):
            if key is None or row["value"] is None:
                continue
            try:
                # dated ahead of the job's clock: refused, as it would never age
                report = parse_usage_report(row["value"], now)
            except Exception as exc:  # a malformed report is never fatal
                log.error("skipping the usage report of proxy %r (partition %d, offset %d): "
                          "%s: %s", key, row["partition"], row["offset"], type(exc).__name__,
                          str(exc)[:300])
                continue
            reports[report.proxy_id] = report
        shares = fleet_shares(reports, now, self.usage_freshness, self.share_floor,
                              self.leaders or None)
        log.info("quota shares for %d proxies%s from %d usage report(s) (%d new record(s), "
                 "%d bytes, of %s)", len(shares),
                 " (%s)" % ", ".join(sorted(shares)[:10]) + (" ..." if len(shares) > 10 else "")
                 if shares else "", len(reports), counts["records"], counts["bytes"],
                 self.usage_topic)
        return shares

    def close(self):
        for output in self.outputs:
            output.close()
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


def _stop_with_parent():
    """Under spark-submit, SIGTERM when its JVM (this process's parent) ends:
    else a spark-submit stopped alone would leave the job running, every
    cycle failing without the JVM. Linux only."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before that took effect
        os.kill(os.getpid(), signal.SIGTERM)


def check_volume_flags(args):
    """ValueError when --volume-source, the limits and --state-topic do not
    fit together."""
    source = getattr(args, "volume_source", AGENT) or AGENT
    soft, hard = getattr(args, "soft_limit", None), getattr(args, "hard_limit", None)
    if source == AGENT and (soft is not None or hard is not None):
        raise ValueError("--soft-limit and --hard-limit are for --volume-source describe-log-dirs "
                         "or auto (each agent's report carries its own limits)")
    if source != AGENT:
        if soft is None or hard is None:
            raise ValueError("--volume-source %s needs --soft-limit and --hard-limit" % source)
        from .agent import _limits_in_order

        _limits_in_order(soft, hard)
    topic = getattr(args, "state_topic", None)
    if topic is not None and (not re.match(r"^[A-Za-z0-9._-]{1,249}$", topic)
                              or topic in (".", "..")):
        raise ValueError("--state-topic must be a Kafka topic name ([A-Za-z0-9._-], up to 249 "
                         "characters), got %r" % (topic,))


def run(args):
    try:
        security = security_options(args)
        check_volume_flags(args)
    except ValueError as exc:
        print("kthrottle: error: %s" % exc, file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    try:
        job = SparkSync(",".join(args.bootstrap), args.zookeeper, topic=args.topic,
                        freshness=args.freshness, znode=args.znode, master=args.master,
                        conf=args.conf, security=security, kafka_timeout=args.kafka_timeout,
                        zookeeper_timeout=args.zookeeper_timeout, usage_topic=args.usage_topic,
                        usage_freshness=args.usage_freshness, share_floor=args.share_floor,
                        state_dir=args.state_dir, recommend_every=args.recommend_every,
                        recommend_window=args.recommend_window,
                        recommend_slot=args.recommend_slot,
                        recommend_znode=args.recommend_znode,
                        recommend_file=args.recommend_file, state_topic=args.state_topic,
                        volume_source=args.volume_source, soft_limit=args.soft_limit,
                        hard_limit=args.hard_limit)
    except CycleError as exc:
        log.error("%s", exc)
        return 1
    stopper = _Stopper(job)
    stopper.install()
    job.on_session = stopper.install
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        _stop_with_parent()
    where = job.where
    log.info("spark-sync: %s from %s (freshness %.0f s) -> %s, %s; state in %s", {
        AGENT: args.topic, DESCRIBE_LOG_DIRS: "DescribeLogDirs",
        AUTO: "%s, else DescribeLogDirs," % args.topic}[args.volume_source],
        ",".join(args.bootstrap), args.freshness, where,
        "once" if args.once else "every %g s" % args.interval, job.state_dir)
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
        log.info("stopped after %d cycle(s)", job.ran)
        return 0
    finally:
        job.close()
