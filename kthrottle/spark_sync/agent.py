"""``kthrottle volume-agent``: publishes a broker's per-volume usage.

Runs next to each Kafka broker. Every interval (and once at start) it measures
the volumes that hold the broker's log directories, lists the partitions
stored on each, and publishes the result (``policy.storage.BrokerReport`` as
JSON) as one record keyed by the broker id to a compacted topic, where the
Spark job (``kthrottle spark-sync``) reads the latest report of every broker.

Pure parts (no I/O, unit-testable): ``settings_from_args``,
``mounts_from_partitions``, ``volume_bytes``, ``collect_report`` (the file
system calls and the clock are passed in). The I/O: psutil (disk usage and
the mount table), ``Publisher`` (kafka-python, with the KafkaPublisher of
``sources/kafka_publisher`` the proxy shares), ``AgentMetrics``
(prometheus_client on a private registry) and ``run``.
"""
import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import time

import psutil

from ..options import arg_type, parse_duration, parse_host_port
from ..policy.storage import BrokerReport, VolumeReport, parse_limit, split_partition_dir
from ..sources.kafka_publisher import (
    KafkaPublisher,
    PublishError,
    client_config,
    describe_connection,
    quiet_kafka_logging,
)
from ..security import ClientSecurityOptions, KafkaClientSecurity
from ..sources.outage import Outage

log = logging.getLogger("kthrottle.volume_agent")

DEFAULT_TOPIC = "__kthrottle_volume_usage"
DEFAULT_INTERVAL = 30.0
DEFAULT_TIMEOUT = 10.0
PASSWORD_ENV = "KTHROTTLE_AGENT_SASL_PASSWORD"

EXAMPLE = """\
example (a broker with id 3 and two log dirs, through a SASL_SSL listener):
  KTHROTTLE_AGENT_SASL_PASSWORD=... kthrottle volume-agent \\
      --bootstrap-server kafka-3.internal:9094 --broker-id 3 \\
      --log-dir /var/lib/kafka/data-0 --log-dir /var/lib/kafka/data-1 \\
      --soft-limit MinFreePercentage:20 --hard-limit MinFreeBytes:10GiB \\
      --interval 30s --metrics-listen 0.0.0.0:9309 \\
      --security-protocol SASL_SSL --ssl-ca /etc/kafka/ca.pem \\
      --sasl-mechanism SCRAM-SHA-512 --sasl-username volume-agent

Each record: key = the broker id ("3"), value = JSON like
  {"SnapshotAt":"2024-05-01T12:00:00.000Z","BrokerId":3,
   "SoftLimit":{"type":"MinFreePercentage","level":20},
   "HardLimit":{"type":"MinFreeBytes","level":10737418240},
   "Volumes":[{"VolumeName":"/dev/nvme1n1","Capacity":...,"Consumed":...,
               "LogDir":"/var/lib/kafka/data-0","Partitions":["orders-0","orders-3"]}]}
--once publishes one report and exits: 0 if it reached the cluster, 1 if not.
"""


# durations, flags, settings (pure) -----------------------------------------------

def _fill(text, indent=""):
    import shutil
    import textwrap

    width = max(min(shutil.get_terminal_size().columns, 100) - 2, 40)
    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent)


SECURITY = ClientSecurityOptions(
    who="the agent", password_env=PASSWORD_ENV, title="security (towards the cluster)",
    description=_fill("The password is never a flag: --sasl-password-file, else the environment "
                      "variable %s. It does not appear in the logs." % PASSWORD_ENV))


def _broker_id(text):
    try:
        value = int(text)
    except ValueError:
        raise ValueError("a broker id is an integer >= 0, got %r" % (text,)) from None
    if value < 0:
        raise ValueError("a broker id is an integer >= 0, got %r" % (text,))
    return value


def _host_port(text):
    return parse_host_port(text, "HOST:PORT")


def _bootstrap(text):
    host, port = _host_port(text)
    if port == 0:
        raise ValueError("a bootstrap server needs a port, got %r" % (text,))
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the agent runs with, checked. The password is kept out of repr."""

    bootstrap_servers: tuple
    broker_id: int
    log_dirs: tuple
    soft: object  # policy.storage.Limit
    hard: object
    interval: float = DEFAULT_INTERVAL
    once: bool = False
    topic: str = DEFAULT_TOPIC
    metrics_listen: tuple = None  # (host, port) or None
    timeout: float = DEFAULT_TIMEOUT
    security: KafkaClientSecurity = KafkaClientSecurity()
    log_level: str = "INFO"

    # what the agent's code and log lines read of the security settings
    security_protocol = property(lambda self: self.security.security_protocol)
    sasl_mechanism = property(lambda self: self.security.sasl_mechanism)
    sasl_password = property(lambda self: self.security.sasl_password)

    def client_config(self):
        """kafka-python's connection and security settings (admin and producer)."""
        return client_config(self.bootstrap_servers, "kthrottle-volume-agent-%d" % self.broker_id,
                             timeout=self.timeout, security=self.security)

    def describe(self):
        """One line for the log: where and as whom, never the password."""
        sec = self.security
        return describe_connection(self.bootstrap_servers, sec.security_protocol,
                                   sec.sasl_mechanism, sec.sasl_username, sec.ssl_cert)


def _limits_in_order(soft, hard):
    """ValueError when both limits are of one type and the hard one comes
    before the soft one (a volume would pause before it is ever throttled)."""
    if soft.type != hard.type:
        return
    inverted = hard.level < soft.level if soft.type == "ConsumedSpace" else hard.level > soft.level
    if inverted:
        raise ValueError("--hard-limit %s is stricter than --soft-limit %s: producers would "
                         "be paused before they are throttled" % (hard, soft))


def settings_from_args(args, environ=None):
    """Settings from the parsed flags; ValueError with the message for the
    user when they do not fit together. The SASL password comes from
    --sasl-password-file or the KTHROTTLE_AGENT_SASL_PASSWORD variable."""
    environ = os.environ if environ is None else environ
    if not args.bootstrap_servers:
        raise ValueError("--bootstrap-server is required")
    if not args.log_dirs:
        raise ValueError("--log-dir is required (repeat it for each of the broker's log.dirs)")
    _limits_in_order(args.soft_limit, args.hard_limit)
    log_dirs = []
    for d in args.log_dirs:
        d = os.path.abspath(d)
        if d not in log_dirs:
            log_dirs.append(d)
    if not args.topic or len(args.topic) > 249 or not re.match(r"^[A-Za-z0-9._-]+$", args.topic) \
            or args.topic in (".", ".."):
        raise ValueError("--topic must be a Kafka topic name ([A-Za-z0-9._-], up to 249 "
                         "characters), got %r" % (args.topic,))
    security = SECURITY.resolve(vars(args), environ)
    return Settings(
        bootstrap_servers=tuple(args.bootstrap_servers), broker_id=args.broker_id,
        log_dirs=tuple(log_dirs), soft=args.soft_limit, hard=args.hard_limit,
        interval=args.interval if args.interval is not None else DEFAULT_INTERVAL,
        once=bool(args.once), topic=args.topic, metrics_listen=args.metrics_listen,
        timeout=args.timeout, security=security, log_level=args.log_level)


# volumes and partitions (pure, the file system passed in) ------------------------

def mounts_from_partitions(partitions):
    """{mount point: device} from ``psutil.disk_partitions(all=True)``; where
    several mounts are stacked on one point the last (the visible one) wins.
    psutil reads the mount table (/proc/self/mounts on Linux), octal escapes
    undone; entries without a mount point are skipped."""
    mounts = {}
    for part in partitions:
        if part.mountpoint:
            mounts[part.mountpoint] = part.device
    return mounts


def mount_point(path, ismount=os.path.ismount):
    """The mount point of the file system ``path`` lives on."""
    path = os.path.realpath(path)
    while not ismount(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def volume_name(path, mounts, ismount=os.path.ismount):
    """VolumeName of the file system ``path`` is on: its device (``/dev/sda1``,
    as in the Strimzi proposal) when it is mounted from one, else its mount
    point (tmpfs, overlay, NFS, ZFS datasets...), unique on the host."""
    point = mount_point(path, ismount)
    source = (mounts or {}).get(point, "")
    return source if source.startswith("/dev/") else point


def read_mounts():
    """{mount point: device} of this host's mounts, {} if they cannot be
    read (then mount points name the volumes)."""
    try:
        return mounts_from_partitions(psutil.disk_partitions(all=True))
    except (OSError, psutil.Error):
        return {}


class LocalVolumes:
    """Names the volume a path lives on, the same name for every path with
    the same st_dev (bind mounts included). ``volume_of(path) -> name``."""

    def __init__(self, mounts=None, stat=os.stat, ismount=os.path.ismount):
        self.mounts = read_mounts() if mounts is None else mounts
        self.stat, self.ismount = stat, ismount
        self._by_dev = {}

    def __call__(self, path):
        dev = self.stat(path).st_dev
        name = self._by_dev.get(dev)
        if name is None:
            name = self._by_dev[dev] = volume_name(path, self.mounts, self.ismount)
        return name


def list_partitions(log_dir):
    """(topic, partition) of the sub-directories of ``log_dir`` named
    ``<topic>-<partition>``; anything else (files, ``*-delete``, ``*-future``,
    ``*-stray``) is skipped. OSError if the directory cannot be read."""
    out = []
    with os.scandir(log_dir) as entries:
        for entry in entries:
            tp = split_partition_dir(entry.name)
            if tp is None:
                continue
            try:
                if entry.is_dir():
                    out.append(tp)
            except OSError:
                continue
    return out


def _why(exc):
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def volume_bytes(usage):
    """(Capacity, Consumed) of a volume from ``psutil.disk_usage``'s result:
    Consumed is ``used`` (every block in use, f_blocks - f_bfree) and
    Capacity is ``used + free``, ``free`` being what an unprivileged user may
    still write (f_bavail). Blocks reserved for root (ext4's 5% by default)
    are thus left out: free space, as MinFreeBytes and MinFreePercentage
    see it, is 0 when the broker's user gets ENOSPC, and Consumed/Capacity is
    the Use% ``df`` shows."""
    return usage.used + usage.free, usage.used


def collect_report(broker_id, log_dirs, soft, hard, now, usage=psutil.disk_usage,
                   volume_of=None, partitions_of=list_partitions):
    """(BrokerReport, problems) for the broker's ``log_dirs`` at ``now``
    (epoch seconds). Each volume's Capacity and Consumed are ``volume_bytes``
    of ``usage(log_dir)``; log dirs on one volume are one volume, their
    partitions merged. A log dir whose volume cannot be measured is left out;
    one whose entries cannot be listed still reports its volume (without its
    partitions). ``problems`` says, one line each, what was left out and why."""
    volume_of = LocalVolumes() if volume_of is None else volume_of
    volumes = {}  # name -> {"bytes": (capacity, consumed), "dirs": [...], "partitions": set()}
    problems = []
    for log_dir in log_dirs:
        try:
            measured = volume_bytes(usage(log_dir))
            name = volume_of(log_dir)
        except OSError as exc:
            problems.append("log dir %s: cannot measure its volume: %s" % (log_dir, _why(exc)))
            continue
        volume = volumes.setdefault(name, {"bytes": measured, "dirs": [], "partitions": set()})
        volume["dirs"].append(log_dir)
        try:
            volume["partitions"].update(partitions_of(log_dir))
        except OSError as exc:
            problems.append("log dir %s: cannot list its partitions: %s" % (log_dir, _why(exc)))
    reports = []
    for name in sorted(volumes):
        v = volumes[name]
        capacity, consumed = v["bytes"]
        reports.append(VolumeReport(
            name=name, capacity=capacity, consumed=consumed,
            log_dir=",".join(v["dirs"]), partitions=tuple(sorted(v["partitions"]))))
    return BrokerReport(broker_id, now, soft, hard, tuple(reports)), problems


def summary(report):
    parts = []
    for v in report.volumes:
        used = 100.0 * v.consumed / v.capacity if v.capacity else 0.0
        parts.append("%s %.1f%% used of %d bytes, %d partition(s)"
                     % (v.name, used, v.capacity, len(v.partitions)))
    return "; ".join(parts)


# metrics ---------------------------------------------------------------------

class AgentMetrics:
    """The agent's Prometheus metrics, on a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connected = Gauge("kthrottle_volume_agent_connected",
                               "1 if the last publication reached the cluster, else 0",
                               registry=r)
        self.errors = Counter("kthrottle_volume_agent_publication_errors",
                              "Publications that failed (cluster unreachable, refused, "
                              "or nothing could be measured)", registry=r)
        self.publications = Counter("kthrottle_volume_agent_publications",
                                    "Reports the cluster acknowledged", registry=r)
        self.last = Gauge("kthrottle_volume_agent_last_publication_timestamp_seconds",
                          "When the last acknowledged report was taken (epoch seconds)",
                          registry=r)
        self.log_dir_errors = Counter("kthrottle_volume_agent_log_dir_errors",
                                      "Log dirs that could not be measured or listed",
                                      registry=r)
        self.capacity = Gauge("kthrottle_volume_capacity_bytes",
                              "Bytes used on the volume plus bytes an unprivileged user "
                              "may still write (blocks reserved for root left out)",
                              ["volume"], registry=r)
        self.consumed = Gauge("kthrottle_volume_consumed_bytes", "Bytes used on the volume",
                              ["volume"], registry=r)
        self._volumes = set()

    def observe(self, report, problems):
        self.log_dir_errors.inc(len(problems))
        names = set()
        for v in report.volumes:
            names.add(v.name)
            self.capacity.labels(v.name).set(v.capacity)
            self.consumed.labels(v.name).set(v.consumed)
        for gone in self._volumes - names:
            self.capacity.remove(gone)
            self.consumed.remove(gone)
        self._volumes = names

    def published(self, snapshot_at):
        self.connected.set(1)
        self.publications.inc()
        self.last.set(snapshot_at)

    def failed(self, unreachable=True):
        """A publication that did not happen; ``unreachable`` when it was
        the cluster that failed (not the measurement)."""
        self.errors.inc()
        if unreachable:
            self.connected.set(0)

    def serve(self, host, port):
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


# publishing (kafka-python, shared with the proxy: sources/kafka_publisher.py) -------

class Publisher:
    """Sends reports, keyed by the broker id, with the shared KafkaPublisher
    (the topic created compacted on first contact, a failed publication
    dropping the producer so that the next one connects afresh). Each
    publication is bounded by ``settings.timeout`` in all."""

    def __init__(self, settings):
        self.settings = settings
        self.kafka = KafkaPublisher(settings.client_config(), settings.topic, settings.timeout,
                                    settings.describe(), settings.sasl_password, logger=log)

    def publish(self, report):
        """Send ``report``; the RecordMetadata once acknowledged, else PublishError."""
        return self.kafka.publish(str(self.settings.broker_id).encode("utf-8"),
                                  report.to_json().encode("utf-8"))

    def reset(self):
        self.kafka.reset()

    close = reset


# the agent -----------------------------------------------------------------------

class Agent:
    """One publication per ``cycle()``: measure, publish, count.

    Logged once per change, not per cycle: a log dir problem when it appears
    and when it is gone; publications that fail (the cluster unreachable, or
    nothing measurable) when they start failing, for each new reason, and on
    the first success after, with how many failed; the first report published
    (later ones at DEBUG: the metrics count them)."""

    def __init__(self, settings, metrics=None, publisher=None, clock=time.time):
        self.settings = settings
        self.metrics = metrics or AgentMetrics()
        self.publisher = publisher or Publisher(settings)
        self.clock = clock
        self.volumes = LocalVolumes()
        self.outage = Outage()
        self.published = 0
        self.last_error = None
        self._problems = set()  # the log dir problems logged, until they are gone

    def cycle(self):
        """True if a report reached the cluster."""
        s = self.settings
        self.volumes.mounts = read_mounts()
        report, problems = collect_report(s.broker_id, s.log_dirs, s.soft, s.hard,
                                          self.clock(), volume_of=self.volumes)
        self._log_problems(problems)
        self.metrics.observe(report, problems)
        if not report.volumes:
            self.metrics.failed(unreachable=False)
            self.last_error = "none of the log dirs could be measured"
            self._failed("nothing to publish: none of the log dirs (%s) could be measured"
                         % ", ".join(s.log_dirs))
            return False
        try:
            meta = self.publisher.publish(report)
        except PublishError as exc:
            self.metrics.failed()
            self.last_error = str(exc)
            self._failed(self.last_error)
            return False
        failed = self.outage.recovered()
        self.published += 1
        self.metrics.published(report.snapshot_at)
        if failed:
            log.info("published again, after %d failed publication(s): the report of broker %d "
                     "to %s-%d at offset %d: %s", failed, s.broker_id, meta.topic,
                     meta.partition, meta.offset, summary(report))
        else:
            (log.info if self.published == 1 else log.debug)(
                "published the report of broker %d to %s-%d at offset %d: %s",
                s.broker_id, meta.topic, meta.partition, meta.offset, summary(report))
        return True

    def _failed(self, reason):
        if not self.outage.failed(reason):
            return  # counted (the metrics), said already
        if self.outage.failures == 1:
            log.error("%s%s", reason, "" if self.settings.once else
                      "; retried every %gs, logged again when the reason changes and once a "
                      "report is published" % self.settings.interval)
        else:
            log.error("still not published (%d failed so far), now: %s", self.outage.failures,
                      reason)

    def _log_problems(self, problems):
        current = set(problems)
        for problem in problems:
            if problem not in self._problems:
                log.error("%s", problem)
        for problem in sorted(self._problems - current):
            log.info("resolved: %s", problem)
        self._problems = current

    def close(self):
        self.publisher.close()


class _Stopped(BaseException):
    """Raised by the SIGTERM/SIGINT handler, to leave even a blocking send."""


def _configure_logging(level):
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # kafka-python logs every refused reconnection at ERROR: the agent says
    # once per publication what went wrong instead; DEBUG shows them all
    quiet_kafka_logging(debug=str(level).upper() == "DEBUG")


def run(args):
    parser = getattr(args, "volume_agent_parser", None)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        if parser is None:
            print("kthrottle volume-agent: error: %s" % exc, file=sys.stderr)
            return 2
        parser.error(str(exc))
    _configure_logging(settings.log_level)
    if settings.security_protocol == "SASL_PLAINTEXT" and settings.sasl_mechanism == "PLAIN":
        log.warning("SASL PLAIN over SASL_PLAINTEXT sends the password in the clear")
    metrics = AgentMetrics()
    agent = Agent(settings, metrics)

    stopping = []

    def on_signal(signum, _frame):
        if stopping:
            return
        stopping.append(signum)
        raise _Stopped()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    try:
        if settings.metrics_listen:
            host, port = settings.metrics_listen
            try:
                server = metrics.serve(host, port)
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", host, port, _why(exc))
                return 1
            log.info("metrics on http://%s:%d/metrics", host, server.server_port)
        log.info("broker %d: publishing the usage of %s to topic %s on %s, %s",
                 settings.broker_id, ", ".join(settings.log_dirs), settings.topic,
                 settings.describe(),
                 "once" if settings.once else "every %gs" % settings.interval)
        if settings.once:
            if agent.cycle():
                return 0
            print("kthrottle volume-agent: error: %s" % agent.last_error, file=sys.stderr)
            return 1
        start = time.monotonic()
        slot = 0
        while True:
            agent.cycle()
            slot += 1
            now = time.monotonic()
            next_at = start + slot * settings.interval
            if next_at <= now:  # the cycle overran: skip the slots it missed
                slot = int((now - start) // settings.interval) + 1
                next_at = start + slot * settings.interval
            time.sleep(next_at - now)
    except _Stopped:
        log.info("stopping (%s)", signal.Signals(stopping[0]).name)
        return 1 if settings.once else 0
    finally:
        try:
            agent.close()
            if server is not None:
                server.shutdown()
                server.server_close()
        except _Stopped:
            pass
        for sig, handler in old.items():
            signal.signal(sig, handler)


# the command line -----------------------------------------------------------------

def parse_settings(argv, environ=None):
    """Settings from ``volume-agent``'s arguments (without the command name);
    exits 2 with argparse's message when they are wrong."""
    parser = argparse.ArgumentParser(prog="kthrottle")
    p = add_parser(parser.add_subparsers())
    args = p.parse_args(argv)
    try:
        return settings_from_args(args, environ)
    except ValueError as exc:
        p.error(str(exc))


def add_parser(sub):
    p = sub.add_parser(
        "volume-agent", help="publish this broker's volume usage (run next to each broker)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fill("Run next to a Kafka broker: measure the volumes holding its log dirs "
        "(bytes consumed, and capacity as consumed plus what an unprivileged user may still "
        "write: blocks reserved for root are not free to the broker) and the partitions stored "
        "on each, and "
        "publish them as one JSON record keyed by the broker id to a compacted topic, at "
        "start and every --interval. kthrottle spark-sync turns the latest report of every "
        "broker into the cluster state the proxies throttle by (OPEN below the soft limit, "
        "THROTTLE between the limits, PAUSE at the hard limit)."),
        epilog=EXAMPLE)
    p.set_defaults(command="volume-agent", volume_agent_parser=p)
    what = p.add_argument_group("what to report")
    what.add_argument("--broker-id", type=arg_type(_broker_id), required=True, metavar="N",
                      help="this broker's node.id / broker.id (the record's key)")
    what.add_argument("--log-dir", dest="log_dirs", action="append", required=True,
                      metavar="PATH",
                      help="one of the broker's log.dirs; repeat for each. Log dirs on one "
                      "volume are reported as one volume; a log dir that cannot be read is "
                      "logged and left out of that report")
    limit_help = ("TYPE:LEVEL, TYPE one of ConsumedSpace (bytes used), MinFreeBytes (bytes that "
                  "must stay free) or MinFreePercentage (percent 0-100 that must stay free); "
                  "bytes take KB/MB/GB (powers of 1000) or KiB/MiB/GiB (powers of 1024)")
    what.add_argument("--soft-limit", type=arg_type(parse_limit), required=True,
                      metavar="TYPE:LEVEL",
                      help="where producers start to be throttled: " + limit_help
                      + ", e.g. MinFreePercentage:20")
    what.add_argument("--hard-limit", type=arg_type(parse_limit), required=True,
                      metavar="TYPE:LEVEL",
                      help="where producers are paused, e.g. MinFreeBytes:10GiB")

    where = p.add_argument_group("where to publish")
    where.add_argument("--bootstrap-server", dest="bootstrap_servers", action="append",
                       required=True, type=arg_type(_bootstrap), metavar="HOST:PORT",
                       help="a broker of the cluster to publish to; repeat for several "
                       "(a listener the agent can reach, e.g. the control-plane one)")
    where.add_argument("--topic", default=DEFAULT_TOPIC, metavar="NAME",
                       help="topic of the reports (default %(default)s); created if missing, "
                       "with cleanup.policy=compact, 1 partition and the cluster's "
                       "default.replication.factor (capped to the live brokers; min(3, live "
                       "brokers) if the brokers do not tell it)")
    where.add_argument("--timeout", type=arg_type(parse_duration), default=DEFAULT_TIMEOUT,
                       metavar="DURATION",
                       help="how long one publication may take in all: connecting, creating "
                       "the topic, the acknowledgement (default 10s)")

    when = p.add_argument_group("schedule and metrics")
    once = when.add_mutually_exclusive_group()
    once.add_argument("--interval", type=arg_type(parse_duration), metavar="DURATION",
                      help="publish at start and then every DURATION: 30s (default), 5m, "
                      "500ms or plain seconds. An unreachable cluster is counted, logged and "
                      "retried at the next one; SIGTERM or Ctrl-C stop the agent")
    once.add_argument("--once", action="store_true",
                      help="publish one report and exit: 0 if the cluster acknowledged it, "
                      "1 (with the reason) if not")
    when.add_argument("--metrics-listen", type=arg_type(_host_port), metavar="HOST:PORT",
                      help="serve Prometheus metrics on http://HOST:PORT/metrics: "
                      "kthrottle_volume_agent_connected, _publications_total, "
                      "_publication_errors_total, _last_publication_timestamp_seconds, "
                      "kthrottle_volume_capacity_bytes{volume}, "
                      "kthrottle_volume_consumed_bytes{volume}")
    when.add_argument("--log-level", default="INFO", metavar="LEVEL",
                      help="DEBUG, INFO (default), WARNING")

    SECURITY.add_to(p)
    return p
