"""``kthrottle quotas recommend``: quotas from what tenants actually used.

Reads the recommendations document ``kthrottle spark-sync`` writes (JSON,
``spark_sync.recommend``) from ZooKeeper or a file and prints, for each
entity, the ``kafka-configs`` command that sets its quotas, and a table of the
figures they come from. A recommended quota is the chosen statistic
(``--percentile``, p99) of the chosen measure (``--measure``, demand: the
rate the clients would have had unthrottled) in the entity's busiest hour of
day, times ``--headroom`` (1.2): a quota that would have held the tenant back
in that hour only as often as the percentile says. No I/O here but reading
the document.
"""
import argparse
import math
import shlex
import sys
from typing import NamedTuple

from .policy.entities import (
    CLIENT_QUOTA_KEYS,
    CONNECTION_CREATION_RATE,
    CONSUMER_BYTE_RATE,
    PRODUCER_BYTE_RATE,
    RATE_KEYS,
)
from .policy.quota_file import format_value
from .policy.storage import decode_document
from .security import ZOOKEEPER

FORMAT = "kthrottle-quota-recommendations"  # = spark_sync.recommend.FORMAT (no PySpark here)
VERSION = 1
DEFAULT_ZNODE = "/kthrottle/quota-recommendations"
STATISTICS = ("p50", "p95", "p99", "peak")
MEASURES = ("demand", "rate")
BYTE_KEYS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE)
DEFAULT_PERCENTILE = "p99"
DEFAULT_HEADROOM = 1.2
DEFAULT_MEASURE = "demand"
DEFAULT_BOOTSTRAP = "localhost:9092"


class Recommendation(NamedTuple):
    entity: tuple  # ((entity type, name), ...) as kafka-configs names them
    key: str
    value: float  # the quota to set
    basis: float  # the figure it comes from (before headroom)
    hour: int  # the busiest hour of day (UTC) the basis is of
    figures: dict  # the entity's document entry


def parse_document(data):
    """The document (dict) from stored bytes (gzip or not) or text; ValueError
    says what is wrong."""
    doc, _ = decode_document(data, FORMAT, VERSION, "recommendations document")
    entities = doc.get("entities")
    if not isinstance(entities, list):
        raise ValueError("entities must be a list")
    for i, e in enumerate(entities):
        if not (isinstance(e, dict) and e.get("key") in RATE_KEYS
                and isinstance(e.get("user"), str) and isinstance(e.get("client_id"), str)
                and isinstance(e.get("hours"), list)):
            raise ValueError("entities[%d] is not a bucket's figures (key, user, client_id, "
                             "hours ...)" % i)
    return doc


def entity_of(key, user, client_id, path=""):
    """The entity a bucket's tags name, as (entity type, name) pairs; a quota
    group's bucket (its entity path groups/NAME) is ("groups", NAME), a quota
    callback's ("callback", its tags)."""
    if path.startswith("groups/"):
        return (("groups", path[len("groups/"):]),)
    if path == "capacity":  # a shared capacity, reported as one bucket
        return (("capacity", key),)
    if path == "callback":
        return (("callback", user + (" client-id=%s" % client_id if client_id else "")),)
    if key == CONNECTION_CREATION_RATE:
        return (("ips", client_id),)
    if user and client_id:
        return (("users", user), ("clients", client_id))
    if user:
        return (("users", user),)
    return (("clients", client_id),)


def quota_value(key, figure, headroom):
    """``figure * headroom`` rounded up: bytes/s to a whole number, other
    rates to hundredths; never 0 (a quota of 0 lets nothing through)."""
    # a hair under, so that float noise (11890 x 1.2 = 14268.000000000002)
    # does not round up a whole unit
    value = figure * headroom * (1.0 - 1e-12)
    if key in BYTE_KEYS:
        return float(max(1, math.ceil(value)))
    return max(0.01, math.ceil(value * 100) / 100)


def recommend(doc, percentile=DEFAULT_PERCENTILE, headroom=DEFAULT_HEADROOM,
              measure=DEFAULT_MEASURE):
    """[Recommendation] for every bucket of ``doc``, in the document's order."""
    if percentile not in STATISTICS:
        raise ValueError("percentile must be one of %s" % ", ".join(STATISTICS))
    if measure not in MEASURES:
        raise ValueError("measure must be one of %s" % ", ".join(MEASURES))
    if not (isinstance(headroom, (int, float)) and math.isfinite(headroom) and headroom > 0):
        raise ValueError("headroom must be a number > 0")
    out = []
    for e in doc["entities"]:
        hours = [(h[measure][percentile], h["hour"]) for h in e["hours"]
                 if h.get(measure, {}).get(percentile) is not None]
        if not hours:
            continue
        basis, hour = max(hours, key=lambda bh: (bh[0], -bh[1]))
        out.append(Recommendation(entity_of(e["key"], e["user"], e["client_id"],
                                            e.get("entity") or ""), e["key"],
                                  quota_value(e["key"], basis, headroom), basis, hour, e))
    return out


def commands(recommendations, bootstrap=DEFAULT_BOOTSTRAP, program="kafka-configs"):
    """One ``kafka-configs --alter`` line per entity, its keys together."""
    by_entity = {}
    for r in recommendations:
        by_entity.setdefault(r.entity, []).append(r)
    order = {k: i for i, k in enumerate(CLIENT_QUOTA_KEYS + (CONNECTION_CREATION_RATE,))}
    lines = []
    for entity, recs in by_entity.items():
        config = ",".join("%s=%s" % (r.key, format_value(r.value))
                          for r in sorted(recs, key=lambda r: order.get(r.key, 99)))
        where = _NOT_KAFKAS.get(entity[0][0])
        if where is not None:  # no Kafka entity: said, not a command
            lines.append("# %s: %s (%s)" % (_entity_text(entity), config, where))
            continue
        parts = [program, "--bootstrap-server", bootstrap, "--alter"]
        for kind, name in entity:
            parts += ["--entity-type", kind, "--entity-name", name]
        parts += ["--add-config", config]
        lines.append(" ".join(shlex.quote(p) for p in parts))
    return lines


# what sets the quotas of buckets that are no Kafka entity
_NOT_KAFKAS = {"groups": "the quota file's [groups] table",
               "callback": "the quota callback's limits",
               "capacity": "--shared-produce-capacity or --shared-fetch-capacity"}


def _entity_text(entity):
    return " ".join("%s=%s" % ({"users": "user", "clients": "client-id", "ips": "ip",
                                "groups": "quota group", "callback": "callback",
                                "capacity": "shared capacity of"}[k],
                               n if n else "''") for k, n in entity)


def _num(x):
    if x is None:
        return "-"
    return format_value(round(x)) if abs(x) >= 100 else "%.3g" % x


def table(recommendations, measure=DEFAULT_MEASURE, percentile=DEFAULT_PERCENTILE,
          by_hour=False):
    """The figures as aligned text lines: one row per bucket (the whole
    window), and with ``by_hour`` one more per hour of day."""
    head = ["ENTITY", "KEY", "HOUR", "SAMPLES"] + [s.upper() for s in STATISTICS] + [
        "BUSIEST", "CURRENT", "RECOMMENDED"]
    rows = [head]
    for r in recommendations:
        e = r.figures
        figures = e.get(measure, {})
        quota = e.get("quota")
        rows.append([_entity_text(r.entity), r.key, "all", str(e.get("samples", "-"))]
                    + [_num(figures.get(s)) for s in STATISTICS]
                    + ["%02d:00 %s" % (r.hour, _num(r.basis)),
                       format_value(quota) if quota is not None else "-",
                       format_value(r.value)])
        if by_hour:
            for h in e["hours"]:
                rows.append(["", "", "%02d:00" % h["hour"], str(h.get("samples", "-"))]
                            + [_num(h.get(measure, {}).get(s)) for s in STATISTICS]
                            + ["", "", ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


# reading the document -----------------------------------------------------------------

def read_zookeeper(hosts, znode, timeout=10.0):
    """The document's bytes at ``znode``; LookupError / ConnectionError say why not."""
    import warnings

    from kazoo.client import KazooClient
    from kazoo.exceptions import NoNodeError

    warnings.filterwarnings("ignore", message="No chroot path exists")
    zk = KazooClient(hosts=hosts, timeout=timeout)
    try:
        try:
            zk.start(timeout=timeout)
        except Exception:
            raise ConnectionError("cannot connect to ZooKeeper %s within %.0f s"
                                  % (hosts, timeout)) from None
        try:
            data, _ = zk.get(znode)
        except NoNodeError:
            raise LookupError("no recommendations at %s on ZooKeeper %s: kthrottle spark-sync "
                              "writes them there (--recommend-znode) every --recommend-every"
                              % (znode, hosts)) from None
        return data
    finally:
        zk.stop()
        zk.close()


# the command ---------------------------------------------------------------------------

def _headroom(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError("--headroom takes a number > 0, e.g. 1.2, got %r"
                                         % (text,))
    return value


def add_parser(actions):
    """The ``recommend`` action of ``kthrottle quotas``."""
    text = ("print kafka-configs commands that set quotas from observed usage (the "
            "recommendations kthrottle spark-sync writes), and the figures")
    p = actions.add_parser(
        "recommend", help=text, description=text + ". A quota is the --percentile of the "
        "--measure in the bucket's busiest hour of day (UTC), times --headroom.",
        epilog="examples:\n"
        "  kthrottle quotas recommend --zookeeper zk-0:2181/kafka\n"
        "  kthrottle quotas recommend --file recommendations.json --percentile p95 "
        "--headroom 1.5 --bootstrap-server kafka-0:9092\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    ZOOKEEPER.replace(help="ZooKeeper the job writes to (its --zookeeper)").add_to(where)
    where.add_argument("--file", metavar="PATH",
                       help="a recommendations file (spark-sync --recommend-file)")
    p.add_argument("--znode", default=DEFAULT_ZNODE, metavar="PATH",
                   help="the job's --recommend-znode (default %s)" % DEFAULT_ZNODE)
    p.add_argument("--percentile", choices=STATISTICS, default=DEFAULT_PERCENTILE,
                   help="the statistic of the busiest hour a quota is set from (default %s)"
                   % DEFAULT_PERCENTILE)
    p.add_argument("--headroom", type=_headroom, default=DEFAULT_HEADROOM, metavar="FACTOR",
                   help="the statistic is multiplied by this (default %g)" % DEFAULT_HEADROOM)
    p.add_argument("--measure", choices=MEASURES, default=DEFAULT_MEASURE,
                   help="demand (default: the rate the clients would have had unthrottled) "
                   "or rate (what they were let through)")
    p.add_argument("--bootstrap-server", dest="command_bootstrap", default=DEFAULT_BOOTSTRAP,
                   metavar="HOST:PORT", help="put in the printed commands (default %s)"
                   % DEFAULT_BOOTSTRAP)
    p.add_argument("--by-hour", action="store_true",
                   help="also print the figures of each hour of day")
    return p


def run(args, parser):
    try:
        if args.file:
            with open(args.file, "rb") as f:
                data = f.read()
            where = args.file
        else:
            data = read_zookeeper(args.zookeeper, args.znode)
            where = "%s%s" % (args.zookeeper, args.znode)
        doc = parse_document(data)
    except (OSError, LookupError, ValueError) as exc:
        print("kthrottle quotas recommend: error: %s" % exc, file=sys.stderr)
        return 1
    recs = recommend(doc, args.percentile, args.headroom, args.measure)
    window = doc.get("window") or {}
    print("# quota recommendations from %s: %d usage report(s) of %d proxies, %s to %s (UTC), "
          "%g s slots" % (where, doc.get("reports", 0), doc.get("proxies", 0),
                          window.get("start", "?"), window.get("end", "?"),
                          doc.get("slot_seconds", 0)))
    if not recs:
        print("# no quota bucket was used in the window: nothing to recommend")
        return 0
    print("# each quota: %s of the %s in the bucket's busiest hour x %g"
          % (args.percentile, args.measure, args.headroom))
    for line in commands(recs, args.command_bootstrap):
        print(line)
    print()
    print("# %s, bytes/s (byte rates), requests/s or partitions/s; BUSIEST: the busiest hour "
          "of day (UTC) and its %s" % (args.measure, args.percentile))
    for line in table(recs, args.measure, args.percentile, args.by_hour):
        print("# " + line)  # the output stays a shell script: only the commands run
    return 0
