"""``kthrottle-kafka``: a PySpark 4 Python data source reading one Kafka topic.

One Spark input partition per Kafka partition. The driver lists the topic's
partitions and their offsets (``list_offsets``) and hands them in as the
``offsets`` option (without it, the reader lists them itself when Spark plans
the read); each input partition carries all its reader needs in its fields
(topic, partition, the offset range, the bootstrap servers and the client
security settings, the CA certificate as PEM text, never a path), so it runs
unchanged on executors of a real cluster. ``read`` runs on an executor: it
assigns the partition to a kafka-python consumer (no consumer group), seeks to
the start offset and polls until it has reached the end offset and the
partition's high watermark, then yields one row per record::

    topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP,
    key STRING, value STRING

(key and value decoded as UTF-8, a tombstone's value null).

Why "and the high watermark": the end offset ListOffsets reports is taken as
a lower bound. Kafka reports the high watermark there, but Tansu (the test
broker) reports the base offset of the last record batch, so records of the
last batch would be missed; the high watermark Fetch responses carry is right
on both. Records produced after the listing may then be read too (newer
reports: harmless here).

This module imports only the standard library, kafka-python and PySpark, and
``register`` ships it to the executors by value (cloudpickle), so executors
need kafka-python but not kthrottle itself.

Options of ``spark.read.format("kthrottle-kafka")``:
``bootstrap`` (required, ``HOST:PORT[,HOST:PORT...]``), ``topic`` (required),
``offsets`` (JSON ``{"PARTITION": [start, end], ...}``), ``timeout_ms``
(connection and per-partition read deadline, default 30000),
``security_protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL),
``ssl_ca_pem`` (the CA certificate(s) as PEM text; default: the system's),
``ssl_cert_pem`` and ``ssl_key_pem`` (a client certificate and its key, PEM text),
``sasl_mechanism`` (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), ``sasl_username``,
``sasl_password``, ``client_id``.
"""
import datetime
import json
import time

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

FORMAT = "kthrottle-kafka"
SCHEMA = ("topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
          "key STRING, value STRING")
DEFAULT_TIMEOUT_MS = 30000
CLIENT_KEYS = ("bootstrap", "security_protocol", "ssl_ca_pem", "ssl_cert_pem", "ssl_key_pem",
               "sasl_mechanism", "sasl_username", "sasl_password", "client_id")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaReadError(Exception):
    """What went wrong reading the topic; its text starts with the format name
    so that it can be found again in the Spark error that wraps it."""

    def __init__(self, message):
        super().__init__("%s: %s" % (FORMAT, message))


class TopicMissing(KafkaReadError):
    """The topic does not exist (no one has published to it yet)."""


def client_settings(options):
    """The client settings (plain strings, picklable) among ``options``."""
    out = {}
    for key in CLIENT_KEYS:
        value = options.get(key)
        if value not in (None, ""):
            out[key] = str(value)
    if "bootstrap" not in out:
        raise KafkaReadError("the bootstrap option (HOST:PORT[,HOST:PORT...]) is required")
    protocol = out.get("security_protocol", "PLAINTEXT").upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise KafkaReadError("security_protocol must be one of %s, got %r"
                             % (", ".join(SECURITY_PROTOCOLS), protocol))
    out["security_protocol"] = protocol
    if "sasl_mechanism" in out:
        out["sasl_mechanism"] = out["sasl_mechanism"].upper()
        if out["sasl_mechanism"] not in SASL_MECHANISMS:
            raise KafkaReadError("sasl_mechanism must be one of %s, got %r"
                                 % (", ".join(SASL_MECHANISMS), out["sasl_mechanism"]))
    if protocol.startswith("SASL_") and not ("sasl_username" in out and "sasl_password" in out):
        raise KafkaReadError("%s needs sasl_username and sasl_password" % protocol)
    return out


def kafka_config(settings, timeout_ms=DEFAULT_TIMEOUT_MS):
    """kafka-python keyword arguments for ``settings`` (``client_settings``)."""
    config = {
        "bootstrap_servers": settings["bootstrap"].split(","),
        "client_id": settings.get("client_id", "kthrottle-spark-sync"),
        "security_protocol": settings.get("security_protocol", "PLAINTEXT"),
        "bootstrap_timeout_ms": int(timeout_ms),
    }
    if config["security_protocol"] in ("SSL", "SASL_SSL"):
        import ssl

        context = ssl.create_default_context(cadata=settings.get("ssl_ca_pem") or None)
        if settings.get("ssl_cert_pem"):
            _load_cert_chain(context, settings["ssl_cert_pem"], settings.get("ssl_key_pem"))
        config["ssl_context"] = context
    if config["security_protocol"].startswith("SASL_"):
        config["sasl_mechanism"] = settings.get("sasl_mechanism", "PLAIN")
        config["sasl_plain_username"] = settings["sasl_username"]
        config["sasl_plain_password"] = settings["sasl_password"]
    return config


def _load_cert_chain(context, cert_pem, key_pem):
    """ssl loads a certificate only from files: write them (owner-only) to a
    private temporary directory for the moment it takes."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kthrottle-tls-") as tmp:
        paths = []
        for name, text in (("cert.pem", cert_pem), ("key.pem", key_pem or "")):
            path = os.path.join(tmp, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(text)
            paths.append(path)
        context.load_cert_chain(paths[0], paths[1] if key_pem else None)


def consumer(settings, timeout_ms=DEFAULT_TIMEOUT_MS, **extra):
    """A kafka-python consumer without a consumer group (Tansu's groups stall;
    nothing is committed anyway)."""
    from kafka import KafkaConsumer

    return KafkaConsumer(group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
                         fetch_max_wait_ms=100, **kafka_config(settings, timeout_ms), **extra)


def list_offsets(settings, topic, timeout_ms=DEFAULT_TIMEOUT_MS, client=None):
    """{partition: (start, end)} of ``topic``: its log start offsets and end
    offsets (ListOffsets). KafkaReadError if the topic does not exist."""
    from kafka import TopicPartition

    own = client is None
    c = consumer(settings, timeout_ms) if own else client
    try:
        partitions = c.partitions_for_topic(topic)
        if not partitions:
            raise TopicMissing("topic %r does not exist on %s" % (topic, settings["bootstrap"]))
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        start = c.beginning_offsets(tps, timeout_ms=timeout_ms)
        end = c.end_offsets(tps, timeout_ms=timeout_ms)
        return {tp.partition: (int(start[tp]), int(end[tp])) for tp in tps}
    finally:
        if own:
            c.close()


def high_watermark(settings, topic, partition, near, timeout_ms=DEFAULT_TIMEOUT_MS):
    """The high watermark of one partition, as a Fetch from offset ``near``
    answers it. The end offset ListOffsets reports may be lower (see the
    module's docstring), so only this tells a truncated or recreated
    partition from one that is not."""
    from kafka import TopicPartition

    tp = TopicPartition(topic, partition)
    deadline = time.monotonic() + timeout_ms / 1000.0
    c = consumer(settings, timeout_ms, max_partition_fetch_bytes=1)
    try:
        c.assign([tp])
        c.seek(tp, max(0, int(near)))
        while True:
            c.poll(timeout_ms=200, max_records=1)
            highwater = c.highwater(tp)
            if highwater is not None:
                return int(highwater)
            if time.monotonic() > deadline:
                raise KafkaReadError("no high watermark for %s-%d within %.0f s"
                                     % (topic, partition, timeout_ms / 1000.0))
    finally:
        c.close()


class KafkaRange(InputPartition):
    """One Kafka partition's offsets [start, end) and how to reach it."""

    def __init__(self, topic, partition, start, end, settings, timeout_ms):
        super().__init__(partition)
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end
        self.settings = settings  # plain strings: picklable, no file paths
        self.timeout_ms = timeout_ms

    def __repr__(self):  # never the settings: they may hold a password
        return "KafkaRange(%s-%d [%d, %d))" % (self.topic, self.partition, self.start, self.end)


def read_range(part):
    """Yield the rows of one KafkaRange (see the module's docstring)."""
    from kafka import TopicPartition

    tp = TopicPartition(part.topic, part.partition)
    deadline = time.monotonic() + part.timeout_ms / 1000.0
    c = consumer(part.settings, part.timeout_ms)
    try:
        c.assign([tp])
        c.seek(tp, part.start)
        while True:
            for record in c.poll(timeout_ms=200).get(tp, ()):
                if record.offset < part.start:
                    continue
                yield (record.topic, record.partition, record.offset, _timestamp(record.timestamp),
                       _text(record.key), _text(record.value))
            position = c.position(tp)
            highwater = c.highwater(tp)
            if highwater is not None and position >= max(part.end, highwater):
                return
            if time.monotonic() > deadline:
                raise KafkaReadError(
                    "reading %s-%d stopped at offset %d (end %d, high watermark %s) after %.0f s"
                    % (part.topic, part.partition, position, part.end, highwater,
                       part.timeout_ms / 1000.0))
    finally:
        c.close()


def _text(data):
    return None if data is None else bytes(data).decode("utf-8", errors="replace")


def _timestamp(ms):
    if ms is None or ms < 0:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000.0, datetime.timezone.utc)


class KafkaTopicReader(DataSourceReader):
    def __init__(self, options):
        self.settings = client_settings(options)
        self.topic = options.get("topic")
        if not self.topic:
            raise KafkaReadError("the topic option is required")
        self.timeout_ms = int(options.get("timeout_ms") or DEFAULT_TIMEOUT_MS)
        self.offsets = options.get("offsets")

    def partitions(self):
        if self.offsets:
            offsets = {int(p): tuple(r) for p, r in json.loads(self.offsets).items()}
        else:
            offsets = list_offsets(self.settings, self.topic, self.timeout_ms)
        # an "empty" range is read too: the end offset may be under-reported
        return [KafkaRange(self.topic, p, int(start), int(end), self.settings, self.timeout_ms)
                for p, (start, end) in sorted(offsets.items())]

    def read(self, partition):
        return read_range(partition)


class KafkaTopicDataSource(DataSource):
    """``spark.read.format("kthrottle-kafka").option("bootstrap", ...)
    .option("topic", ...).load()``: every record of a topic, as of now."""

    @classmethod
    def name(cls):
        return FORMAT

    def schema(self):
        return SCHEMA

    def reader(self, schema):
        return KafkaTopicReader(self.options)


def register(spark):
    """Register the data source with ``spark``, shipping this module to the
    executors by value (they need kafka-python, not kthrottle)."""
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark.dataSource.register(KafkaTopicDataSource)


def load(spark, bootstrap, topic, offsets=None, timeout_ms=DEFAULT_TIMEOUT_MS, **security):
    """The DataFrame of every record of ``topic`` (``offsets``:
    {partition: (start, end)}, listed by the reader when None)."""
    reader = (spark.read.format(FORMAT).option("bootstrap", bootstrap).option("topic", topic)
              .option("timeout_ms", str(int(timeout_ms))))
    if offsets is not None:
        reader = reader.option("offsets", json.dumps(
            {str(p): [int(s), int(e)] for p, (s, e) in offsets.items()}))
    for key, value in security.items():
        if value not in (None, ""):
            reader = reader.option(key, str(value))
    return reader.load()


def latest_per_key_partition(df, new=True):
    """One row per (key, partition): its record of the greatest offset (the
    order Kafka gives a key's records in its partition, whatever the clocks
    of their senders said), with ``records`` and ``bytes`` (of keys and
    values), the records and bytes among them marked new (all, with
    ``new=True``; else the ``new`` column, 0 or 1, says). Computed by Spark."""
    from pyspark.sql import functions as F

    if new is True:
        df = df.withColumn("new", F.lit(1))
    size = F.coalesce(F.length("key"), F.lit(0)) + F.coalesce(F.length("value"), F.lit(0))
    latest = F.max_by(F.struct("value", "offset", "timestamp"), "offset")
    return (df.groupBy("key", "partition")
            .agg(latest.alias("latest"), F.sum("new").cast("long").alias("records"),
                 F.sum(F.col("new") * size).cast("long").alias("bytes"))
            .select("key", "partition", "latest.value", "latest.offset", "latest.timestamp",
                    "records", "bytes"))


def latest_per_key(df):
    """One row per key: its latest record, with ``records``, how many
    records the key had. Within a partition the offset decides; between
    partitions (a key that moved when the partition count changed) the
    record timestamp, then the offset. Computed by Spark: the records
    themselves never reach the driver."""
    from pyspark.sql import functions as F

    latest = F.max_by(F.struct("value", "partition", "offset", "timestamp"),
                      F.struct("timestamp", "offset"))
    return (latest_per_key_partition(df).groupBy("key")
            .agg(latest.alias("latest"), F.sum("records").alias("records"))
            .select("key", "latest.value", "latest.partition", "latest.offset",
                    "latest.timestamp", "records"))


def latest_of_keys(rows):
    """``latest_per_key`` on the driver, over rows that are already one per
    (key, partition) (a few per key at most): {key: row}."""
    out = {}
    for row in rows:
        key = row["key"]
        held = out.get(key)
        if held is None or _order(row) > _order(held):
            out[key] = row
    return out


def _order(row):
    at = row["timestamp"]
    return (at is not None, at.timestamp() if at is not None else 0.0, row["offset"])
