"""Quota recommendations from the fleet's usage reports, computed by Spark.

The usage topic is compacted (one report per proxy is all the shares need),
so the job keeps the history itself: every cycle, the usage records it reads
that are new are parsed by Spark (``from_json``: nothing of kthrottle runs on
the executors) and appended to ``<state dir>/<usage topic>/history`` as one
small parquet increment (``UsageHistory.append``). Every ``--recommend-every``
the increments and the last compacted version are read back, cut to the
window, deduplicated (a report is (proxy, ReportedAt): a cycle that failed
after its increment was written reads the same records again) and written as
one new version, and the figures are computed from it (``compute``).

The figures. A report's buckets are keyed (key, user tag, client tag), the
sharing key of the fleet: one entity's bucket across every proxy. Time is cut
into slots (``--recommend-slot``, 1 minute). In a slot, a proxy's rate for a
bucket is the mean of the rates of all its reports in the slot, a report not
listing the bucket counting 0 (it lists only buckets used in its interval);
the fleet's rate is the sum over the proxies. The same for the demand (the
rate the clients would have had unthrottled). One fleet rate per slot in
which the bucket was used is one sample; per hour of day (UTC, of the slot's
start) and over the whole window: the exact p50, p95 and p99 (linear
interpolation between the closest ranks, as Spark's ``percentile``) and the
peak, of the rate and of the demand.
"""
import logging
import re
import time

from ..policy.entities import RATE_KEYS
from ..policy.storage import MAX_CLOCK_SKEW, iso_time

log = logging.getLogger("kthrottle.spark_sync")

FORMAT = "kthrottle-quota-recommendations"
VERSION = 1
PERCENTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
MEASURES = ("rate", "demand")
STATISTICS = tuple(name for name, _ in PERCENTILES) + ("peak",)
DEFAULT_ZNODE = "/kthrottle/quota-recommendations"
DEFAULT_WINDOW = 7 * 86400.0
DEFAULT_SLOT = 60.0
DEFAULT_EVERY = 3600.0

# a usage report as proxies publish it (policy.fleet.UsageReport.to_json)
REPORT_SCHEMA = ("ProxyId STRING, ReportedAt STRING, IntervalSeconds DOUBLE, "
                 "Buckets ARRAY<STRUCT<Key: STRING, User: STRING, ClientId: STRING, "
                 "Entity: STRING, Quota: DOUBLE, Rate: DOUBLE, Demand: DOUBLE>>")
# one row per report kept in the history
HISTORY_SCHEMA = ("proxy STRING, reported_at DOUBLE, buckets ARRAY<STRUCT<key: STRING, "
                  "user: STRING, client_id: STRING, entity: STRING, quota: DOUBLE, "
                  "rate: DOUBLE, demand: DOUBLE>>")
_INCREMENT = re.compile(r"^inc-([0-9]{10})$")
_VERSION = re.compile(r"^v-([0-9]{10})$")


def check_slot(seconds):
    """A slot must cut hours evenly, so that each falls in one hour of day."""
    if not 1.0 <= seconds <= 3600.0 or 3600.0 % seconds:
        raise ValueError("a slot must divide an hour evenly (1s to 1h, e.g. 1m, 5m, 15m), "
                         "got %g s" % seconds)
    return float(seconds)


def to_history(records):
    """History rows (HISTORY_SCHEMA) from a DataFrame of usage-topic records
    (a ``value`` column of JSON). Records that are not a usage report
    (tombstones, malformed JSON, no ProxyId or ReportedAt) are dropped; so
    are buckets of an unknown key, without tags, or with a negative or
    missing rate (a missing demand is the rate)."""
    from pyspark.sql import functions as F

    good = ("b.Key IN (%s) AND b.User IS NOT NULL AND b.ClientId IS NOT NULL "
            "AND b.Rate >= 0 AND NOT isnan(b.Rate) "
            "AND (b.Demand IS NULL OR (b.Demand >= 0 AND NOT isnan(b.Demand)))"
            % ", ".join("'%s'" % k for k in RATE_KEYS))
    row = ("named_struct('key', b.Key, 'user', b.User, 'client_id', b.ClientId, "
           "'entity', coalesce(b.Entity, ''), 'quota', b.Quota, 'rate', b.Rate, "
           "'demand', coalesce(b.Demand, b.Rate))")
    return (records.select(F.from_json("value", REPORT_SCHEMA).alias("r"))
            .select(F.col("r.ProxyId").alias("proxy"),
                    (F.unix_micros(F.try_to_timestamp("r.ReportedAt")) / 1e6)
                    .alias("reported_at"),
                    F.expr("transform(filter(coalesce(r.Buckets, array()), b -> %s), b -> %s)"
                           % (good, row)).alias("buckets"))
            .where("proxy IS NOT NULL AND proxy != '' AND reported_at IS NOT NULL"))


def compute(history, now, window=DEFAULT_WINDOW, slot=DEFAULT_SLOT,
            generated_by="kthrottle spark-sync"):
    """The recommendations document (a JSON-ready dict) of ``history`` (a
    DataFrame of HISTORY_SCHEMA) over the ``window`` seconds before ``now``
    (epoch seconds), in slots of ``slot`` seconds. Two small collects: the
    figures per (bucket, hour of day) and per bucket."""
    from pyspark.sql import functions as F

    slot = check_slot(slot)
    start = now - window
    h = (history.where((F.col("reported_at") >= start)
                       & (F.col("reported_at") <= now + MAX_CLOCK_SKEW))
         .dropDuplicates(["proxy", "reported_at"])
         .withColumn("slot", F.floor(F.col("reported_at") / slot).cast("long")))
    reports = h.groupBy("proxy", "slot").agg(F.count(F.lit(1)).alias("reports"))
    used = (h.select("proxy", "slot", "reported_at", F.explode("buckets").alias("b"))
            .select("proxy", "slot", "reported_at", "b.*"))
    last = F.max_by(F.struct("quota", "entity"), "reported_at")
    bucket = ["key", "user", "client_id"]
    per_proxy = (used.groupBy(bucket + ["proxy", "slot"])
                 .agg(F.sum("rate").alias("rate"), F.sum("demand").alias("demand"),
                      last.alias("last"), F.max("reported_at").alias("at"))
                 .join(reports, ["proxy", "slot"])
                 .select(*bucket, "slot", "last", "at",
                         (F.col("rate") / F.col("reports")).alias("rate"),
                         (F.col("demand") / F.col("reports")).alias("demand")))
    fleet = (per_proxy.groupBy(bucket + ["slot"])
             .agg(F.sum("rate").alias("rate"), F.sum("demand").alias("demand"),
                  F.max_by("last", "at").alias("last"), F.max("at").alias("at"))
             .withColumn("hour", F.floor(F.pmod(F.col("slot") * F.lit(slot), F.lit(86400))
                                         / 3600).cast("int")))
    fleet = fleet.persist()
    try:
        stats = [F.count(F.lit(1)).alias("samples")]
        for m in MEASURES:
            stats.append(F.expr("percentile(%s, array(%s))" % (
                m, ", ".join(repr(p) for _, p in PERCENTILES))).alias(m + "_pct"))
            stats.append(F.max(m).alias(m + "_peak"))
        hourly = fleet.groupBy(bucket + ["hour"]).agg(*stats).collect()
        overall = (fleet.groupBy(bucket)
                   .agg(*stats, F.max_by("last", "at").alias("last"),
                        F.min("slot").alias("first_slot"), F.max("slot").alias("last_slot"))
                   .collect())
        totals = reports.agg(F.sum("reports").alias("reports"),
                             F.countDistinct("proxy").alias("proxies")).collect()[0]
    finally:
        fleet.unpersist()
    hours = {}
    for row in hourly:
        hours.setdefault((row["key"], row["user"], row["client_id"]), []).append(row)
    entities = []
    for row in sorted(overall, key=lambda r: (r["user"], r["client_id"], r["key"])):
        sk = (row["key"], row["user"], row["client_id"])
        entities.append({
            "key": sk[0], "user": sk[1], "client_id": sk[2],
            "entity": row["last"]["entity"], "quota": _round(row["last"]["quota"]),
            "first_seen": iso_time(row["first_slot"] * slot),
            "last_seen": iso_time(row["last_slot"] * slot + slot),
            **_figures(row),
            "hours": [dict(hour=r["hour"], **_figures(r))
                      for r in sorted(hours.get(sk, ()), key=lambda r: r["hour"])],
        })
    return {
        "format": FORMAT, "version": VERSION, "generated_at": now,
        "generated_by": generated_by,
        "window": {"seconds": window, "start": iso_time(start), "end": iso_time(now)},
        "slot_seconds": slot, "proxies": totals["proxies"] or 0,
        "reports": totals["reports"] or 0, "entities": entities,
    }


def _figures(row):
    out = {"samples": row["samples"]}
    for m in MEASURES:
        pct = row[m + "_pct"]
        out[m] = dict(zip(STATISTICS, [_round(x) for x in pct] + [_round(row[m + "_peak"])]))
    return out


def _round(x):
    return None if x is None else round(float(x), 3)


class UsageHistory:
    """The usage reports of the window, kept under ``home`` (a directory
    relative to the state directory of ``files``, a job.StateFiles: Hadoop's
    FileSystem API): parquet increments ``inc-N`` (one a cycle) and
    compacted versions ``v-N``."""

    def __init__(self, files, home):
        self.files = files
        self.home = home
        self.number = None  # the greatest N used

    def _names(self):
        names = self.files.list(self.files.join(self.home))
        incs = sorted(n for n in names if _INCREMENT.match(n))
        versions = sorted(n for n in names if _VERSION.match(n))
        if self.number is None:
            self.number = max([int(n.split("-")[1]) for n in incs + versions] or [0])
        return incs, versions

    def _next(self, prefix):
        self._names()
        self.number += 1
        return self.files.join(self.home, "%s-%010d" % (prefix, self.number))

    def append(self, records):
        """Parse ``records`` (new usage-topic records) and write them as one
        increment. An increment whose write did not finish (no _SUCCESS) is
        never read."""
        where = self._next("inc")
        to_history(records).coalesce(1).write.mode("overwrite").parquet(where)
        return where

    def compact(self, spark, now, window):
        """The history of the window as one new version (the increments and
        the previous version removed once it is written); its DataFrame."""
        from pyspark.sql import functions as F

        incs, versions = self._names()
        parts = [self.files.join(self.home, n) for n in incs + versions[-1:]]
        complete = [p for p in parts if self.files.exists(p + "/_SUCCESS")]
        if complete:
            df = spark.read.schema(HISTORY_SCHEMA).parquet(*complete)
        else:
            df = spark.createDataFrame([], HISTORY_SCHEMA)
        df = (df.where((F.col("reported_at") >= now - window)
                       & (F.col("reported_at") <= now + MAX_CLOCK_SKEW))
              .dropDuplicates(["proxy", "reported_at"]))
        where = self._next("v")
        df.coalesce(1).write.mode("overwrite").parquet(where)
        for p in parts + [self.files.join(self.home, n) for n in versions[:-1]]:
            try:
                self.files.delete(p)
            except Exception as exc:  # read again next time: deduplicated
                log.warning("could not remove %s: %s", p, exc)
        return spark.read.schema(HISTORY_SCHEMA).parquet(where)


class Recommender:
    """What spark-sync does for recommendations: append each cycle's new
    usage records, and every ``every`` seconds compact the history and
    write the document (``write(document)``, the job's znode or file
    writer). The first document comes ``every`` after the one already
    written (``written_at()``: its generated_at, None when there is none),
    else after the job's first cycle: a document from the first cycle
    alone would hold one cycle of usage."""

    def __init__(self, files_for, home, write, every=DEFAULT_EVERY, window=DEFAULT_WINDOW,
                 slot=DEFAULT_SLOT, written_at=lambda: None):
        self.files_for = files_for  # spark -> job.StateFiles
        self.home = home
        self.write = write
        self.written_at = written_at
        self.every = float(every)
        self.window = float(window)
        self.slot = check_slot(slot)
        self.history = None
        self.last = None  # when the last document was written (job clock)
        self.appended = 0  # increments written by this process

    def _history(self, spark):
        if self.history is None:
            self.history = UsageHistory(self.files_for(spark), self.home)
        return self.history

    def append(self, spark, records):
        """A cycle's new usage records into the history; never raises (the
        cycle goes on: those records are then missing from the figures)."""
        try:
            self._history(spark).append(records)
            self.appended += 1
        except Exception as exc:
            log.error("usage history: this cycle's usage reports could not be kept, the "
                      "recommendations will lack them: %s: %s", type(exc).__name__,
                      str(exc).splitlines()[0][:300] if str(exc) else "")

    def due(self, now):
        if self.last is None:
            try:
                last = self.written_at()
            except Exception:
                last = None
            self.last = last if isinstance(last, (int, float)) and last <= now else now
        return now - self.last >= self.every

    def run(self, spark, now):
        """Compact, compute and write the document when due; returns it (None
        when not due). Raises on failure, which the job logs: the cycle's
        other writes are already done."""
        if not self.due(now):
            return None
        started = time.monotonic()
        history = self._history(spark).compact(spark, now, self.window)
        document = compute(history, now, self.window, self.slot)
        document["compute_seconds"] = round(time.monotonic() - started, 3)
        self.write(document)
        self.last = now
        return document
