"""Storage-aware throttling: per-volume usage reports in, one cluster state out.

Three pieces, none of which does I/O or reads a clock (time is passed in, in
seconds since the epoch, since reports cross machines):

- the volume report a broker's agent publishes (``BrokerReport``): the time it
  was taken, a soft and a hard limit, and each volume of the broker with its
  capacity, the bytes consumed and the topic-partitions stored on it. JSON,
  with the field names of the volume-usage message of Strimzi's cluster-wide
  volume usage proposal, plus ``BrokerId``, ``LogDir`` and ``Partitions``;
- the state of a volume between its limits (``volume_state``): OPEN below the
  soft limit; THROTTLE between the limits, with a factor that falls from 1 at
  the soft limit to 0 at the hard one (the share of its produce rate a
  producer keeps); PAUSE at or past the hard limit;
- the cluster-state snapshot the Spark job computes from the latest report of
  every broker and the partition replicas (``cluster_snapshot``), and that
  every proxy reads back (``ClusterState``). Its format is versioned (see
  ``SNAPSHOT_VERSION``); a broker without a fresh report is UNKNOWN, which the
  proxy resolves with its configured fail-safe (``StoragePolicy``).

The strongest state wins wherever states meet: PAUSE over THROTTLE over OPEN,
and between two throttles the smaller factor.
"""
import datetime
import json
import math
import re
import uuid
from typing import NamedTuple

OPEN = "OPEN"
THROTTLE = "THROTTLE"
PAUSE = "PAUSE"
UNKNOWN = "UNKNOWN"  # no fresh report: the reader's fail-safe decides
STATES = (OPEN, THROTTLE, PAUSE, UNKNOWN)

LIMIT_TYPES = ("ConsumedSpace", "MinFreeBytes", "MinFreePercentage")

SNAPSHOT_FORMAT = "kthrottle-cluster-state"
SNAPSHOT_VERSION = 1
# A snapshot larger than this is stored gzip-compressed (a znode holds 1 MiB
# by default, ZooKeeper's jute.maxbuffer); readers tell by gzip's magic bytes.
COMPRESS_ABOVE = 256 * 1024
# How far ahead of the reader's clock a time written on another machine (a
# report's, a snapshot's) may be before it is refused (issue 14): a time ahead
# never ages, so a freshness check would never fire. 30 s is the leeway Kafka
# allows between clocks when it validates a token's times (KIP-768,
# sasl.oauthbearer.clock.skew.seconds) and no more than the shortest freshness
# window by default (spark-sync --usage-freshness 30 s), so a report dated
# ahead stays fresh at most twice as long as it should.
MAX_CLOCK_SKEW = 30.0


# limits ---------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", 1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000 ** _i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024 ** _i


def parse_size(text):
    """Bytes from ``1073741824``, ``10GB`` (10^9) or ``10GiB`` (2^30)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError("not a size in bytes: %r (like 500000000, 500MB or 10GiB)" % text)
        value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not math.isfinite(value) or value < 0:
        raise ValueError("a size must be a finite number of bytes >= 0, got %r" % text)
    return value


class Limit(NamedTuple):
    """A limit on one volume: ConsumedSpace (bytes used), MinFreeBytes
    (bytes that must stay free) or MinFreePercentage (percent of the
    capacity, 0-100, that must stay free)."""

    type: str
    level: float

    def consumed_at(self, capacity):
        """Bytes consumed at which a volume of ``capacity`` reaches it."""
        if self.type == "ConsumedSpace":
            return self.level
        if self.type == "MinFreeBytes":
            return capacity - self.level
        return capacity * (1.0 - self.level / 100.0)

    def to_json(self):
        level = int(self.level) if float(self.level).is_integer() else self.level
        return {"type": self.type, "level": level}

    def __str__(self):
        return "%s:%s" % (self.type, self.to_json()["level"])


def make_limit(type_, level):
    if type_ not in LIMIT_TYPES:
        raise ValueError("limit type must be one of %s, got %r" % (", ".join(LIMIT_TYPES), type_))
    if type_ == "MinFreePercentage":
        try:
            level = float(level)
        except (TypeError, ValueError):
            raise ValueError("MinFreePercentage needs a number 0-100, got %r" % (level,)) from None
        if not 0.0 <= level <= 100.0:
            raise ValueError("MinFreePercentage must be within 0-100, got %r" % (level,))
    else:
        level = parse_size(level)
    return Limit(type_, level)


def parse_limit(text):
    """``TYPE:LEVEL``: ``MinFreeBytes:10GiB``, ``MinFreePercentage:5``,
    ``ConsumedSpace:900GB``."""
    type_, sep, level = str(text).partition(":")
    if not sep:
        raise ValueError("a limit is TYPE:LEVEL with TYPE one of %s, got %r"
                         % (", ".join(LIMIT_TYPES), text))
    return make_limit(type_.strip(), level.strip())


def limit_from_json(data, what):
    if not isinstance(data, dict):
        raise ValueError("%s must be an object with type and level" % what)
    try:
        return make_limit(data.get("type"), data.get("level"))
    except ValueError as exc:
        raise ValueError("%s: %s" % (what, exc)) from None


# states ---------------------------------------------------------------------

class State(NamedTuple):
    state: str
    factor: float  # share of the produce rate a producer keeps: 1 OPEN, 0 PAUSE

    def stronger(self, other):
        """The stronger of two known states."""
        return other if _strength(other) > _strength(self) else self


def _strength(s):
    if s.state == PAUSE:
        return 2.0
    if s.state == THROTTLE:
        return 2.0 - s.factor if s.factor < 1.0 else 1.0
    return 0.0


OPEN_STATE = State(OPEN, 1.0)
PAUSE_STATE = State(PAUSE, 0.0)
UNKNOWN_STATE = State(UNKNOWN, 1.0)


def volume_state(capacity, consumed, soft, hard):
    """OPEN, THROTTLE with the factor, or PAUSE for one volume. The factor
    is the share of the soft-to-hard band still free: 1 at the soft limit,
    falling to 0 at the hard one, so the closer to the hard limit the more a
    producer is slowed."""
    hard_at = hard.consumed_at(capacity)
    if consumed >= hard_at:
        return PAUSE_STATE
    soft_at = soft.consumed_at(capacity)
    if consumed <= soft_at or hard_at <= soft_at:
        return OPEN_STATE
    return State(THROTTLE, round((hard_at - consumed) / (hard_at - soft_at), 6))


def strongest(states):
    out = OPEN_STATE
    for s in states:
        out = out.stronger(s)
    return out


# the agent's report -----------------------------------------------------------

class VolumeReport(NamedTuple):
    name: str  # VolumeName: the device or mount, unique on the broker
    capacity: int
    consumed: int
    log_dir: str = ""
    partitions: tuple = ()  # (topic, partition) stored on this volume
    soft: Limit = None  # per-volume overrides of the broker's limits
    hard: Limit = None


class BrokerReport(NamedTuple):
    broker_id: int
    snapshot_at: float  # epoch seconds
    soft: Limit
    hard: Limit
    volumes: tuple

    def volume_states(self):
        """[(VolumeReport, State)]."""
        return [(v, volume_state(v.capacity, v.consumed, v.soft or self.soft, v.hard or self.hard))
                for v in self.volumes]

    def to_json(self):
        volumes = []
        for v in self.volumes:
            entry = {"VolumeName": v.name, "Capacity": int(v.capacity),
                     "Consumed": int(v.consumed)}
            if v.log_dir:
                entry["LogDir"] = v.log_dir
            entry["Partitions"] = ["%s-%d" % tp for tp in v.partitions]
            if v.soft is not None:
                entry["SoftLimit"] = v.soft.to_json()
            if v.hard is not None:
                entry["HardLimit"] = v.hard.to_json()
            volumes.append(entry)
        return json.dumps({"SnapshotAt": iso_time(self.snapshot_at), "BrokerId": self.broker_id,
                           "SoftLimit": self.soft.to_json(), "HardLimit": self.hard.to_json(),
                           "Volumes": volumes}, separators=(",", ":"))


def check_time(value, what, now=None):
    """``value`` as epoch seconds: a finite number (NaN or infinity would make
    every age comparison false, so nothing would ever be too old), and with
    ``now`` no more than MAX_CLOCK_SKEW ahead of it. ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ValueError("%s must be epoch seconds (a finite number), got %r" % (what, value))
    if now is not None and value - now > MAX_CLOCK_SKEW:
        raise ValueError("%s is %.0f s ahead of this machine's clock (at most %.0f s of clock "
                         "skew is allowed)" % (what, value - now, MAX_CLOCK_SKEW))
    return float(value)


def iso_time(epoch):
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def parse_iso_time(text, what="SnapshotAt"):
    if not isinstance(text, str):
        raise ValueError("%s must be an ISO 8601 date-time" % what)
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("%s is not an ISO 8601 date-time: %r" % (what, text)) from None
    if moment.tzinfo is None:
        raise ValueError("%s has no time zone: %r" % (what, text))
    return moment.timestamp()


def split_partition_dir(name):
    """Kafka's ``<topic>-<partition>`` log directory name; None for anything
    else (the topic itself may contain dashes)."""
    topic, sep, partition = name.rpartition("-")
    if not sep or not topic or not partition.isdigit():
        return None
    return topic, int(partition)


def _int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or not math.isfinite(value):
        raise ValueError("%s must be a number of bytes >= 0, got %r" % (what, value))
    return int(value)


def parse_report(data, now=None):
    """A BrokerReport from the agent's JSON (bytes, str or already parsed);
    ValueError says what is wrong. With ``now``, a SnapshotAt more than
    MAX_CLOCK_SKEW ahead of it is refused too (check_time); without,
    cluster_snapshot counts such a broker UNKNOWN, and says why."""
    data = decode_snapshot(data)
    if not isinstance(data, dict):
        raise ValueError("a volume report is a JSON object")
    broker_id = data.get("BrokerId")
    if isinstance(broker_id, bool) or not isinstance(broker_id, int):
        raise ValueError("BrokerId must be an integer, got %r" % (broker_id,))
    soft = limit_from_json(data.get("SoftLimit"), "SoftLimit")
    hard = limit_from_json(data.get("HardLimit"), "HardLimit")
    volumes = data.get("Volumes")
    if not isinstance(volumes, list):
        raise ValueError("Volumes must be a list")
    out = []
    for i, v in enumerate(volumes):
        what = "Volumes[%d]" % i
        if not isinstance(v, dict) or not isinstance(v.get("VolumeName"), str):
            raise ValueError("%s needs a VolumeName" % what)
        partitions = []
        for name in v.get("Partitions") or ():
            tp = split_partition_dir(name) if isinstance(name, str) else None
            if tp is None:
                raise ValueError("%s.Partitions has %r, not <topic>-<partition>" % (what, name))
            partitions.append(tp)
        out.append(VolumeReport(
            v["VolumeName"], _int(v.get("Capacity"), what + ".Capacity"),
            _int(v.get("Consumed"), what + ".Consumed"), str(v.get("LogDir") or ""),
            tuple(partitions),
            limit_from_json(v["SoftLimit"], what + ".SoftLimit") if "SoftLimit" in v else None,
            limit_from_json(v["HardLimit"], what + ".HardLimit") if "HardLimit" in v else None))
    snapshot_at = check_time(parse_iso_time(data.get("SnapshotAt")), "SnapshotAt", now)
    return BrokerReport(broker_id, snapshot_at, soft, hard, tuple(out))


# the cluster-state snapshot (the Spark job writes it, proxies read it) ------------

def cluster_snapshot(reports, brokers, replicas, now, freshness, generated_by="kthrottle",
                     topic_ids=None):
    """The snapshot for ``reports`` ({broker id: BrokerReport}, the latest of
    each), ``brokers`` (the live broker ids from the cluster's Metadata) and
    ``replicas`` ({(topic, partition): [broker ids]}). A live broker whose
    report is missing, older than ``freshness`` seconds, or dated more than
    MAX_CLOCK_SKEW ahead of ``now`` (its agent's clock is wrong: such a report
    would never grow old) is UNKNOWN, and so is every partition with a replica
    on it (unless another replica's volume already PAUSEs it). A replica a
    report does not list (a partition just created) takes the strongest state
    of its broker's volumes. ``topic_ids`` ({topic: id as text}, from the
    same Metadata): the snapshot then maps the ids of the topics it lists to
    their names, for Produce v13+, which names topics by id alone (KIP-516).
    Returns a JSON-ready dict."""
    broker_entries = {}
    broker_state = {}  # id -> State (UNKNOWN included)
    replica_state = {}  # (broker, topic, partition) -> State
    for broker in sorted(set(brokers) | set(reports)):
        report = reports.get(broker)
        if report is None:
            broker_entries[str(broker)] = {"state": UNKNOWN, "reason": "no report"}
            broker_state[broker] = UNKNOWN_STATE
            continue
        at = report.snapshot_at
        if not math.isfinite(at):
            broker_entries[str(broker)] = {"state": UNKNOWN,
                                           "reason": "report time %r is not a time" % at}
            broker_state[broker] = UNKNOWN_STATE
            continue
        age = now - at
        if age > freshness or -age > MAX_CLOCK_SKEW:
            reason = ("report is %.0f s old (freshness %.0f s)" % (age, freshness)
                      if age > 0 else "report is dated %.0f s ahead of the job's clock (at most "
                      "%.0f s of clock skew is allowed)" % (-age, MAX_CLOCK_SKEW))
            broker_entries[str(broker)] = {"state": UNKNOWN, "reason": reason, "reported_at": at}
            broker_state[broker] = UNKNOWN_STATE
            continue
        volumes = []
        worst = OPEN_STATE
        for v, s in report.volume_states():
            worst = worst.stronger(s)
            volumes.append({"name": v.name, "log_dir": v.log_dir, "capacity": v.capacity,
                            "consumed": v.consumed, "state": s.state, "factor": s.factor})
            for tp in v.partitions:
                key = (broker,) + tp
                replica_state[key] = replica_state.get(key, OPEN_STATE).stronger(s)
        broker_state[broker] = worst
        broker_entries[str(broker)] = {"state": worst.state, "factor": worst.factor,
                                       "reported_at": report.snapshot_at, "volumes": volumes}
    known = [s for s in broker_state.values() if s.state != UNKNOWN]
    cluster = strongest(known)
    unknown = sorted(b for b, s in broker_state.items() if s.state == UNKNOWN)
    partitions = []
    for (topic, partition), holders in sorted(replicas.items()):
        state, missing = OPEN_STATE, False
        for broker in holders:
            s = broker_state.get(broker)
            if s is None or s.state == UNKNOWN:
                missing = True
                continue
            state = state.stronger(replica_state.get((broker, topic, partition), s))
        if missing and state.state != PAUSE:
            partitions.append([topic, partition, UNKNOWN, state.factor])
        elif state.state != OPEN:
            partitions.append([topic, partition, state.state, state.factor])
    snapshot = {
        "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "generated_by": generated_by,
        "generated_at": now, "freshness_s": freshness,
        "cluster": {"state": cluster.state, "factor": cluster.factor, "unknown_brokers": unknown},
        "brokers": broker_entries,
        "partitions": partitions,
    }
    if topic_ids is not None:  # only the topics listed: every other one is OPEN
        listed = {entry[0] for entry in partitions}
        snapshot["topic_ids"] = {t: topic_ids[t] for t in sorted(listed) if t in topic_ids}
    return snapshot


def encode_snapshot(snapshot):
    """The bytes a snapshot is stored as: compact JSON, gzip-compressed when
    larger than COMPRESS_ABOVE (with thousands of brokers the volumes alone
    pass a megabyte; the JSON compresses about tenfold). NaN and infinities
    are refused (ValueError): JSON has no such numbers (RFC 8259 s6)."""
    data = json.dumps(snapshot, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) > COMPRESS_ABOVE:
        import gzip

        data = gzip.compress(data, compresslevel=6, mtime=0)
    return data


def decode_document(data, format_, version, noun):
    """A stored document (see decode_snapshot) of ``format_`` and
    ``version`` -> (dict, its generated_at); ValueError names ``noun``."""
    data = decode_snapshot(data)
    if not isinstance(data, dict) or data.get("format") != format_:
        raise ValueError("not a %s %s" % (format_, noun))
    if data.get("version") != version:
        raise ValueError("%s version %r; this proxy reads version %d"
                         % (noun, data.get("version"), version))
    return data, check_time(data.get("generated_at"), "generated_at")


def _not_json(constant):
    raise ValueError("%s is not a JSON number (RFC 8259 s6)" % constant)


def decode_snapshot(data):
    """JSON text or object from stored bytes (gzip or not). Python's json
    module takes NaN, Infinity and -Infinity by default; they are refused
    here (ValueError), as JSON has no such numbers (RFC 8259 s6). A number
    too large for a float (1e999) still reads as infinity: each time field is
    checked with check_time."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if data[:2] == b"\x1f\x8b":
            import gzip

            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as exc:
                raise ValueError("the compressed snapshot is corrupt: %s" % exc) from None
        data = data.decode("utf-8")
    if isinstance(data, str):
        data = json.loads(data, parse_constant=_not_json)
    return data


class ClusterState:
    """A snapshot as a proxy reads it back: validated, with the per-partition
    states in a dict (only partitions that are not OPEN are listed)."""

    __slots__ = ("generated_at", "cluster", "unknown_brokers", "partitions", "brokers",
                 "topic_names")

    def __init__(self, generated_at, cluster, unknown_brokers=(), partitions=None, brokers=None,
                 topic_names=None):
        self.generated_at = generated_at
        self.cluster = cluster
        self.unknown_brokers = tuple(unknown_brokers)
        self.partitions = partitions or {}
        self.brokers = brokers or {}
        # {uuid.UUID: topic} of the topics listed; None: a job that wrote no ids
        self.topic_names = topic_names

    @classmethod
    def from_json(cls, data):
        """ValueError says what is wrong (the reader keeps its last state),
        also a time that is not finite. Whether it is dated ahead of the
        reader's clock is check_clock's question."""
        data, generated_at = decode_document(data, SNAPSHOT_FORMAT, SNAPSHOT_VERSION, "snapshot")
        cluster = data.get("cluster")
        if not isinstance(cluster, dict):
            raise ValueError("cluster must be an object")
        state = _state(cluster.get("state"), cluster.get("factor"), "cluster")
        if state.state == UNKNOWN:
            raise ValueError("the cluster state is OPEN, THROTTLE or PAUSE")
        unknown = cluster.get("unknown_brokers", [])
        if not isinstance(unknown, list) or not all(isinstance(b, int) for b in unknown):
            raise ValueError("cluster.unknown_brokers must be a list of broker ids")
        partitions = {}
        entries = data.get("partitions", [])
        if not isinstance(entries, list):
            raise ValueError("partitions must be a list")
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                    and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
                raise ValueError("a partition entry is [topic, partition, state, factor], got %r"
                                 % (entry,))
            partitions[entry[0], entry[1]] = _state(entry[2], entry[3], "partition %s-%d"
                                                    % (entry[0], entry[1]))
        topic_names = None
        if "topic_ids" in data:
            ids = data["topic_ids"]
            if not isinstance(ids, dict):
                raise ValueError("topic_ids must be an object of {topic: topic id}")
            topic_names = {}
            for topic, text in ids.items():
                try:
                    topic_names[uuid.UUID(text)] = topic
                except (TypeError, ValueError, AttributeError):
                    raise ValueError("topic_ids.%s is not a topic id: %r" % (topic, text)) from None
        brokers = data.get("brokers", {})
        brokers = brokers if isinstance(brokers, dict) else {}
        for broker, entry in brokers.items():
            if not isinstance(entry, dict) or "reported_at" not in entry:
                continue
            what = "brokers.%s.reported_at" % broker
            at = check_time(entry["reported_at"], what)
            # the job counts a report dated ahead of its clock as UNKNOWN
            if entry.get("state") != UNKNOWN and at - generated_at > MAX_CLOCK_SKEW:
                raise ValueError("%s is %.0f s after generated_at, yet the broker's state is %r"
                                 % (what, at - generated_at, entry.get("state")))
        return cls(generated_at, state, unknown, partitions, brokers, topic_names)

    def check_clock(self, now):
        """ValueError when the snapshot is dated more than MAX_CLOCK_SKEW
        ahead of ``now`` (it would never grow old: issue 14)."""
        check_time(self.generated_at, "generated_at", now)


def _state(name, factor, what):
    if name not in STATES:
        raise ValueError("%s state must be one of %s, got %r" % (what, ", ".join(STATES), name))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not 0.0 <= factor <= 1.0:
        raise ValueError("%s factor must be within 0-1, got %r" % (what, factor))
    if name == OPEN:
        return OPEN_STATE
    if name == PAUSE:
        return PAUSE_STATE
    return State(name, float(factor))


# the proxy's side -----------------------------------------------------------------

class FailSafeReason(NamedTuple):
    """Why the fail-safe applies: ``cause`` stays the same for as long as the
    cause does (a stale snapshot's cause does not change as it ages, so a
    reader logs it once); ``text`` says it in words, with the figures of the
    moment."""
    cause: tuple
    text: str

    def __str__(self):
        return self.text


UNKNOWN_SCOPES = ("cluster", "broker")


class StoragePolicy:
    """What a proxy makes of the cluster state: the state a producer meets,
    given the scope, the snapshot's age and the fail-safe for what is
    unknown.

    Unknown is: no snapshot ``max_age`` seconds after the proxy began
    following the cluster state (``since``: as if one had been read then and
    had gone stale), a snapshot older than ``max_age``, or brokers without a
    fresh volume report. The first two leave every broker unknown, and the
    fail-safe applies to every producer. For brokers without a fresh report
    ``unknown_scope`` says how far it reaches, whatever the scope: ``cluster``
    (the seed's cluster-wide design) every producer, ``broker`` only Produce
    requests writing to a partition with a replica on such a broker."""

    def __init__(self, scope="cluster", fail_safe=PAUSE, max_age=120.0, unknown_scope="cluster"):
        if scope not in ("cluster", "partition"):
            raise ValueError("storage scope must be cluster or partition, got %r" % scope)
        if fail_safe not in (PAUSE, OPEN):
            raise ValueError("storage fail-safe must be PAUSE or OPEN, got %r" % fail_safe)
        if max_age <= 0:
            raise ValueError("the cluster state's maximum age must be positive")
        if unknown_scope not in UNKNOWN_SCOPES:
            raise ValueError("storage unknown scope must be cluster or broker, got %r"
                             % unknown_scope)
        self.scope = scope
        self.fail_safe = fail_safe
        self.max_age = max_age
        self.unknown_scope = unknown_scope
        self.state = None  # the last ClusterState accepted
        self.since = None  # when the proxy began following (epoch seconds)

    def follow_from(self, now):
        """The proxy follows the cluster state from ``now`` on: without a
        snapshot by ``now + max_age`` the state is unknown."""
        if self.since is None:
            self.since = now

    @property
    def fail_safe_state(self):
        return PAUSE_STATE if self.fail_safe == PAUSE else OPEN_STATE

    def update(self, state):
        self.state = state

    def unknown(self, now):
        """Why the fail-safe applies to the whole cluster now (a
        FailSafeReason), or None. A snapshot dated ahead of ``now`` by more
        than MAX_CLOCK_SKEW (this clock was set back after it was read) is as
        good as none."""
        state = self.state
        if state is None:
            if self.since is None:
                return FailSafeReason(("none",), "no cluster state yet")
            waited = now - self.since
            if waited > self.max_age:
                return FailSafeReason(("none",), "no cluster state %.0f s after this proxy "
                                      "began following it (max %.0f s)" % (waited, self.max_age))
            return None
        age = now - state.generated_at
        if not math.isfinite(age):
            return FailSafeReason(("not a time",), "the cluster state's time %r is not a time"
                                  % state.generated_at)
        if -age > MAX_CLOCK_SKEW:
            return FailSafeReason(("ahead",), (
                "the cluster state is dated %.0f s ahead of this proxy's clock (at most "
                "%.0f s of clock skew is allowed)" % (-age, MAX_CLOCK_SKEW)))
        if age > self.max_age:
            return FailSafeReason(("stale",), "the cluster state is %.0f s old (max %.0f s)"
                                  % (age, self.max_age))
        return None

    def cluster(self, now):
        """(State, FailSafeReason the fail-safe applied or None) for the whole
        cluster."""
        reason = self.unknown(now)
        if reason is not None:
            return self.fail_safe_state, reason
        state = self.state
        if state is None:  # not followed for max_age yet
            return OPEN_STATE, None
        if state.unknown_brokers:
            reason = FailSafeReason(
                ("unknown brokers", state.unknown_brokers),
                "no fresh volume report from broker(s) %s" % ", ".join(
                    map(str, state.unknown_brokers)))
            if self.fail_safe == PAUSE and self.unknown_scope == "cluster":
                return PAUSE_STATE, reason
            # broker reach: their partitions are held (partition()); the
            # others meet what the known brokers say
            return state.cluster, reason
        return state.cluster, None

    @property
    def unknown_partitions_held(self):
        """Produce requests must be read for their partitions because of
        brokers without a fresh report (broker reach, PAUSE fail-safe)."""
        state = self.state
        return (state is not None and bool(state.unknown_brokers) and self.fail_safe == PAUSE
                and self.unknown_scope == "broker")

    def partition_by_id(self, topic_id, partition, now):
        """``partition`` for a topic named by its id (Produce v13+, KIP-516):
        by the name the snapshot gives that id; a topic it does not list is
        OPEN as by name. A snapshot without ids (an older job) leaves only
        the cluster's state to go by."""
        state = self.state
        names = state.topic_names if state is not None else None
        if names is None:
            return self.cluster(now)[0]
        return self.partition(names.get(topic_id), partition, now)

    def partition(self, topic, partition, now):
        """The State of one topic-partition (partition scope)."""
        if self.unknown(now) is not None:
            return self.fail_safe_state
        state = self.state
        if state is None:
            return OPEN_STATE
        if state.unknown_brokers and self.unknown_scope == "cluster" and self.fail_safe == PAUSE:
            return PAUSE_STATE  # cluster reach: an unknown broker holds every partition
        s = state.partitions.get((topic, partition), OPEN_STATE)
        if s.state == UNKNOWN:
            return self.fail_safe_state if self.fail_safe == PAUSE else State(
                THROTTLE, s.factor) if s.factor < 1.0 else OPEN_STATE
        return s
