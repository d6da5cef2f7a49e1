"""The admin endpoint: /metrics (Prometheus text), /quotas (JSON), /healthz
and /readyz (probes).

Metrics are collected when scraped, from the quota buckets themselves, so the
request path pays nothing for them but a counter increment on the bucket.
Names follow Kafka's per-(user, client-id) quota metrics (byte-rate,
throttle-time, request-rate) with Prometheus spelling; labels are Kafka's
metric tags, so a user-level quota shows as client_id="" (all that user's
clients share it), as in Kafka. ``METRICS`` lists every family the proxy can
export; the collector makes its families from it.

The probes: /healthz is liveness (200 while the process's event loop runs);
/readyz is readiness, "can serve clients" (200 while a bootstrap broker has
answered recently, 503 otherwise). A source the proxy cannot read, or a
fail-safe in force, leaves it serving with the last known state: /readyz
names it on a ``degraded:`` line but still answers 200, so that one bad edit
of a file every proxy reads does not take them all out of their load
balancer. Its own metric (kthrottle_quota_source_healthy, ...) and alert
report it.

Served with aiohttp on the proxy's own event loop. Exposure:

- It binds to 127.0.0.1 unless --admin-listen names a host.
- /quotas names every connected principal and client-id, and every configured
  quota entity. It can require a bearer token (RFC 6750, ``Authorization:
  Bearer <token>``; 401 without it) and/or a client certificate signed by
  --admin-ssl-ca (403 without one). Exposed beyond loopback with neither, a
  WARNING is logged at start.
- /metrics, /healthz and /readyz stay open, so that Prometheus, load
  balancers and Kubernetes probes read them without credentials. The metrics'
  labels are Kafka's metric tags, so they too name users and client-ids
  (never connections, peers or rates per connection): where those names are
  sensitive, keep the endpoint on loopback or behind a firewall.
- Requests are bounded (header count and sizes, time to send a request and
  to read the answer): see the constants below.
"""
import asyncio
import hmac
import ipaddress
import json
import logging
import ssl
import time
from typing import NamedTuple

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..policy.entities import (
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
)
from .health import READY_WITHIN_SECONDS

log = logging.getLogger("kthrottle.admin")

_KIND = {PRODUCER_BYTE_RATE: "produce", CONSUMER_BYTE_RATE: "fetch", REQUEST_RATE: "request"}
# the families of a client bucket's quota key (the first three keys also
# have the older per-kind ms counters and released rates)
_FAMILIES = {k: {"rate": "kthrottle_request_rate" if k == REQUEST_RATE
                 else "kthrottle_%s_byte_rate" % kind,
                 "released": "kthrottle_released_request_rate" if k == REQUEST_RATE
                 else "kthrottle_%s_released_byte_rate" % kind,
                 "quota": "kthrottle_%s_quota" % kind,
                 "counted": {PRODUCER_BYTE_RATE: "kthrottle_produce_bytes_total",
                             CONSUMER_BYTE_RATE: "kthrottle_fetch_bytes_total",
                             REQUEST_RATE: "kthrottle_requests_total"}[k],
                 "throttle_ms": "kthrottle_%s_throttle_time_ms_total" % kind,
                 "throttled": "kthrottle_%s_throttled_responses_total" % kind}
             for k, kind in _KIND.items()}
_FAMILIES[CONTROLLER_MUTATION_RATE] = {"rate": "kthrottle_controller_mutation_rate",
                                       "quota": "kthrottle_controller_mutation_quota",
                                       "counted": "kthrottle_controller_mutations_total"}
_TOPIC_KIND = {PRODUCER_BYTE_RATE: "produce", CONSUMER_BYTE_RATE: "fetch"}

# Bounds on what a client may send. Apache httpd's defaults are the precedent
# for sizes (LimitRequestLine and LimitRequestFieldSize 8190 bytes, which are
# also aiohttp's); its LimitRequestFields is 100 for a general web server.
# Prometheus, curl and browsers send fewer than 20 headers, and this endpoint
# serves a few fixed paths, so 32 is plenty: at most 32 x 8 KiB of headers per
# request. Beyond a bound the answer is 400 and the connection is closed.
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 32
# Slow clients: a connection must deliver a complete request head within
# REQUEST_TIMEOUT of opening (or of the previous answer, for keep-alive), and
# take an answer (a large /metrics) within SEND_TIMEOUT, or it is closed.
# (The TLS handshake has asyncio's own 60 s ssl_handshake_timeout.)
REQUEST_TIMEOUT = 10.0
SEND_TIMEOUT = 30.0
# A request body (none is expected) is drained for at most this long before
# the connection is closed, so that the client still reads the answer.
LINGER_TIME = 2.0
# Quota entities (user, client-id pairs) given series by default: each has up
# to a dozen series per quota key, so 1000 is some 30,000 series at most, as
# much as one Prometheus target should carry. --metrics-max-entities.
DEFAULT_MAX_ENTITIES = 1000

_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METHODS = ("GET", "HEAD")


# -- what /metrics can carry ------------------------------------------------------

class Metric(NamedTuple):
    """One metric family: its name as exposed (a counter's with ``_total``),
    type, help text and labels; ``group`` says when it is there."""

    name: str
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple = ()
    group: str = "The proxy (always)"


_BUCKET = ("user", "client_id")
Q = ("Quota buckets (with quotas: one series per bucket in use; entities beyond "
     "--metrics-max-entities are counted, not shown)")
TOPICS = ("Per-topic quotas (topics entities: one series per topic bucket in use, at most "
          "--metrics-max-entities topics)")
IPS = ("Connection creation quotas (ips entities, KIP-612: one series per address in use, at "
       "most --metrics-max-entities addresses)")
OBSERVED = ("Observe-only quotas (a dry run: series only for buckets whose quota is "
            "observe-only)")
SASL = "SASL listeners (SASL_PLAINTEXT, SASL_SSL)"
TLS = "TLS listeners (SSL, SASL_SSL)"
SOURCES = "Quota sources"
CREDENTIALS = "Credential stores (--credentials-file, or ZooKeeper)"
ZK = "ZooKeeper sessions (quotas, credentials, cluster state or shares followed there)"
STORAGE = "Storage-aware throttling (--storage-scope cluster or partition, with --zookeeper)"
ZERO_COPY = "Zero-copy pass-through (--zero-copy)"
FLEET = "Fleet members (--proxy-id)"
PROCESS = "The process (prometheus_client's process and platform collectors)"


def _rate_help(what, counted="request"):
    return ("Measured %s per quota bucket: Kafka's windowed rate (quota.window.num samples of "
            "quota.window.size.seconds, the time padded to at least num - 1 of them), each %s "
            "counted whole when it arrives, the one that earned a throttle included"
            % (what, counted))


def _released_help(what):
    return ("%s let through per quota bucket over the same window as the measured rate: a "
            "throttled request counts as released over the delay it earned, as its client "
            "is held back" % what)


METRICS = [
    # the quota buckets (labels: Kafka's metric tags)
    Metric("kthrottle_produce_byte_rate", "gauge", _rate_help("produce bytes/s"), _BUCKET, Q),
    Metric("kthrottle_fetch_byte_rate", "gauge", _rate_help("fetch bytes/s", "response"),
           _BUCKET, Q),
    Metric("kthrottle_request_rate", "gauge", _rate_help("requests/s"), _BUCKET, Q),
    Metric("kthrottle_produce_released_byte_rate", "gauge", _released_help("Produce bytes/s"),
           _BUCKET, Q),
    Metric("kthrottle_fetch_released_byte_rate", "gauge", _released_help("Fetch bytes/s"),
           _BUCKET, Q),
    Metric("kthrottle_released_request_rate", "gauge", _released_help("Requests/s"), _BUCKET, Q),
    Metric("kthrottle_produce_quota", "gauge", "Configured produce quota of the bucket, bytes/s "
           "(producer_byte_rate), and the entity that set it", _BUCKET + ("entity",), Q),
    Metric("kthrottle_fetch_quota", "gauge", "Configured fetch quota of the bucket, bytes/s "
           "(consumer_byte_rate), and the entity that set it", _BUCKET + ("entity",), Q),
    Metric("kthrottle_request_quota", "gauge", "Configured request quota of the bucket, "
           "requests/s (request_rate), and the entity that set it", _BUCKET + ("entity",), Q),
    Metric("kthrottle_produce_bytes_total", "counter", "Bytes of Produce requests counted "
           "against the bucket's produce quota (whole request frames)", _BUCKET, Q),
    Metric("kthrottle_fetch_bytes_total", "counter", "Bytes of Fetch responses counted against "
           "the bucket's fetch quota (whole response frames)", _BUCKET, Q),
    Metric("kthrottle_requests_total", "counter", "Requests counted against the bucket's "
           "request quota (all but the exempt ones, KIP-124)", _BUCKET, Q),
    Metric("kthrottle_throttle_seconds_total", "counter", "Throttle time given by the bucket "
           "(key: the quota that set it, producer_byte_rate, consumer_byte_rate, request_rate "
           "or controller_mutation_rate)", _BUCKET + ("key",), Q),
    Metric("kthrottle_controller_mutation_rate", "gauge", _rate_help(
        "partitions created, added or deleted per second (KIP-599)", "mutation"), _BUCKET, Q),
    Metric("kthrottle_controller_mutation_quota", "gauge", "Configured controller mutation "
           "quota of the bucket, partitions/s (controller_mutation_rate), and the entity that "
           "set it", _BUCKET + ("entity",), Q),
    Metric("kthrottle_controller_mutations_total", "counter", "Partitions created, added or "
           "deleted counted against the bucket's controller mutation quota", _BUCKET, Q),
    Metric("kthrottle_produce_throttle_time_ms_total", "counter", "Throttle time given to "
           "produce in this bucket, ms (kthrottle_throttle_seconds_total in seconds)", _BUCKET, Q),
    Metric("kthrottle_fetch_throttle_time_ms_total", "counter", "Throttle time given to fetch "
           "in this bucket, ms (kthrottle_throttle_seconds_total in seconds)", _BUCKET, Q),
    Metric("kthrottle_request_throttle_time_ms_total", "counter", "Throttle time given to "
           "request in this bucket, ms (kthrottle_throttle_seconds_total in seconds)", _BUCKET, Q),
    Metric("kthrottle_produce_throttled_responses_total", "counter",
           "Responses throttled for produce in this bucket", _BUCKET, Q),
    Metric("kthrottle_fetch_throttled_responses_total", "counter",
           "Responses throttled for fetch in this bucket", _BUCKET, Q),
    Metric("kthrottle_request_throttled_responses_total", "counter",
           "Responses throttled for request in this bucket", _BUCKET, Q),
    Metric("kthrottle_metrics_omitted_entities", "gauge", "Quota entities (user, client-id "
           "pairs, topics, addresses) in use but given no series, over --metrics-max-entities",
           (), Q),
    # per-topic quotas
    Metric("kthrottle_topic_produce_byte_rate", "gauge", _rate_help(
        "bytes/s written to the topic (record batches)"), ("topic",), TOPICS),
    Metric("kthrottle_topic_fetch_byte_rate", "gauge", _rate_help(
        "bytes/s read from the topic (record batches)", "response"), ("topic",), TOPICS),
    Metric("kthrottle_topic_produce_quota", "gauge", "Configured produce quota of the topic, "
           "bytes/s (producer_byte_rate), and the entity that set it", ("topic", "entity"),
           TOPICS),
    Metric("kthrottle_topic_fetch_quota", "gauge", "Configured fetch quota of the topic, "
           "bytes/s (consumer_byte_rate), and the entity that set it", ("topic", "entity"),
           TOPICS),
    Metric("kthrottle_topic_produce_bytes_total", "counter", "Bytes written to the topic "
           "counted against its produce quota", ("topic",), TOPICS),
    Metric("kthrottle_topic_fetch_bytes_total", "counter", "Bytes read from the topic counted "
           "against its fetch quota", ("topic",), TOPICS),
    Metric("kthrottle_topic_throttle_seconds_total", "counter", "Throttle time the topic's "
           "quota set (key: producer_byte_rate or consumer_byte_rate); a request throttled "
           "by several quotas counts in each", ("topic", "key"), TOPICS),
    # connection creation quotas
    Metric("kthrottle_connection_creation_rate", "gauge", _rate_help(
        "connections/s opened from the address", "connection"), ("ip",), IPS),
    Metric("kthrottle_connection_creation_quota", "gauge", "Configured connection creation "
           "quota of the address, connections/s (connection_creation_rate), and the entity "
           "that set it", ("ip", "entity"), IPS),
    Metric("kthrottle_connections_created_total", "counter", "Connections from the address "
           "counted against its connection creation quota", ("ip",), IPS),
    Metric("kthrottle_connection_creation_throttle_seconds_total", "counter", "Throttle time "
           "the address's connection creation quota set (connections closed after it)",
           ("ip",), IPS),
    # observe-only quotas: what they would have done
    Metric("kthrottle_observe_only_throttles_total", "counter", "Throttles an observe-only "
           "client quota would have given (key: the quota)", _BUCKET + ("key",), OBSERVED),
    Metric("kthrottle_observe_only_throttle_seconds_total", "counter", "Throttle time an "
           "observe-only client quota would have given", _BUCKET + ("key",), OBSERVED),
    Metric("kthrottle_topic_observe_only_throttles_total", "counter", "Throttles an "
           "observe-only topic quota would have given", ("topic", "key"), OBSERVED),
    Metric("kthrottle_topic_observe_only_throttle_seconds_total", "counter", "Throttle time "
           "an observe-only topic quota would have given", ("topic", "key"), OBSERVED),
    Metric("kthrottle_ip_observe_only_throttles_total", "counter", "Connections an "
           "observe-only connection creation quota would have throttled", ("ip",), OBSERVED),
    Metric("kthrottle_ip_observe_only_throttle_seconds_total", "counter", "Throttle time an "
           "observe-only connection creation quota would have given", ("ip",), OBSERVED),
    # the proxy
    Metric("kthrottle_ready", "gauge", "1 while /readyz answers 200: a bootstrap broker "
           "answered within the last %g s, so the proxy can serve clients (a source or "
           "fail-safe it goes on without does not change it: see its own metric)"
           % READY_WITHIN_SECONDS),
    Metric("kthrottle_broker_answer_age_seconds", "gauge", "Seconds since a bootstrap broker "
           "last answered the proxy's own ApiVersions (asked every few seconds; absent until "
           "one has)"),
    Metric("kthrottle_broker_reachable", "gauge", "1 while a broker behind the listener "
           "answers; 0 while the listener refuses connections because none does",
           ("listener",)),
    Metric("kthrottle_connections", "gauge", "Open client connections"),
    Metric("kthrottle_connections_refused_total", "counter", "Client connections the listeners "
           "refused or closed, by reason", ("reason",)),
    Metric("kthrottle_tls_handshakes_total", "counter", "TLS handshakes with clients, by "
           "result (completed, failed)", ("result",), TLS),
    Metric("kthrottle_successful_authentication_total", "counter", "SASL authentications "
           "that succeeded, by mechanism (Kafka's successful-authentication-total)",
           ("mechanism",), SASL),
    Metric("kthrottle_failed_authentication_total", "counter", "SASL authentications that "
           "failed, by mechanism (\"none\": before one was agreed; Kafka's "
           "failed-authentication-total)", ("mechanism",), SASL),
    # the sources
    Metric("kthrottle_quota_source_healthy", "gauge", "1 while the quota source (file, "
           "ZooKeeper or the cluster) is readable and current; 0 while the last known quotas "
           "stay in force", (), SOURCES),
    Metric("kthrottle_quota_source_rejected_total", "counter", "quota entries or file "
           "versions rejected since start", (), SOURCES),
    Metric("kthrottle_credentials_source_healthy", "gauge", "1 while the credentials store "
           "(file or ZooKeeper) is readable and current; 0 while the last known credentials "
           "stay in force", (), CREDENTIALS),
    Metric("kthrottle_zookeeper_connected", "gauge", "1 while the ZooKeeper session that "
           "follows this source is connected; 0 while what was last read stays in force",
           ("source",), ZK),
    Metric("kthrottle_zookeeper_disconnects_total", "counter", "Times the ZooKeeper connection "
           "following this source was lost (suspended or expired)", ("source",), ZK),
    # storage-aware throttling
    Metric("kthrottle_storage_state", "gauge", "What producers meet: 0 OPEN, 1 THROTTLE, "
           "2 PAUSE (scope cluster: the state in force; scope broker/volume: the snapshot's, "
           "3 UNKNOWN)", ("scope", "broker", "volume"), STORAGE),
    Metric("kthrottle_storage_factor", "gauge", "Share of their produce rate producers keep "
           "(1: OPEN)", ("scope", "broker", "volume"), STORAGE),
    Metric("kthrottle_storage_fail_safe", "gauge", "1 while the fail-safe applies (no fresh "
           "cluster state, or brokers without a fresh volume report)", (), STORAGE),
    Metric("kthrottle_cluster_state_age_seconds", "gauge", "Age of the cluster-state snapshot "
           "in force", (), STORAGE),
    Metric("kthrottle_storage_deferred_requests_total", "counter", "Produce requests held back "
           "(PAUSE), counted at each check", (), STORAGE),
    Metric("kthrottle_storage_throttled_requests_total", "counter", "Produce requests "
           "throttled for storage (THROTTLE)", (), STORAGE),
    Metric("kthrottle_cluster_state_rejected_total", "counter", "cluster-state snapshots "
           "refused (malformed) since start", (), STORAGE),
    # fleet-wide quotas
    Metric("kthrottle_fleet_quota", "gauge", "Configured (fleet-wide) quota of the bucket",
           ("key",) + _BUCKET, FLEET),
    Metric("kthrottle_fleet_share", "gauge", "Limit applied to the bucket on this proxy: its "
           "share of the fleet quota (or what the fail-safe gives it)", ("key",) + _BUCKET,
           FLEET),
    Metric("kthrottle_fleet_shares_age_seconds", "gauge", "Age of the last good quota shares "
           "read from ZooKeeper", (), FLEET),
    Metric("kthrottle_fleet_fail_safe", "gauge", "1 while the fail-safe applies (the quota "
           "shares are older than --share-max-age-ms, or none were read yet)", (), FLEET),
    Metric("kthrottle_usage_reports_total", "counter", "Usage reports the cluster "
           "acknowledged", (), FLEET),
    Metric("kthrottle_usage_report_errors_total", "counter", "Usage reports that could not be "
           "published", (), FLEET),
    Metric("kthrottle_fleet_shares_rejected_total", "counter", "Quota shares documents refused "
           "(malformed, or for another proxy)", (), FLEET),
    Metric("kthrottle_zero_copy_bytes_total", "counter", "Bytes of requests (to_broker) and "
           "responses (to_client) moved from socket to socket with splice(2), never read by "
           "the proxy", ("direction",), ZERO_COPY),
    # the process (as prometheus_client names and describes them)
    Metric("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", (),
           PROCESS),
    Metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", (),
           PROCESS),
    Metric("process_start_time_seconds", "gauge",
           "Start time of the process since unix epoch in seconds.", (), PROCESS),
    Metric("process_cpu_seconds_total", "counter",
           "Total user and system CPU time spent in seconds.", (), PROCESS),
    Metric("process_open_fds", "gauge", "Number of open file descriptors.", (), PROCESS),
    Metric("process_max_fds", "gauge", "Maximum number of open file descriptors.", (), PROCESS),
    Metric("python_info", "gauge", "Python platform information",
           ("implementation", "major", "minor", "patchlevel", "version"), PROCESS),
]
_BY_NAME = {m.name: m for m in METRICS}
assert len(_BY_NAME) == len(METRICS)


def family(name, value=None):
    """The empty family for METRICS entry ``name`` (with ``value``: its one
    sample, for a family without labels)."""
    m = _BY_NAME[name]
    if m.type == "counter":
        return CounterMetricFamily(name[:-len("_total")], m.help, value=value,
                                   labels=None if value is not None else list(m.labels))
    return GaugeMetricFamily(name, m.help, value=value,
                             labels=None if value is not None else list(m.labels))


def metrics_reference():
    """The README's "Metrics reference", made from METRICS."""
    lines = []
    groups = []
    for m in METRICS:
        if m.group not in groups:
            groups.append(m.group)
    for group in groups:
        lines += ["", "%s:" % group, "", "| metric | type | labels | meaning |",
                  "|---|---|---|---|"]
        for m in METRICS:
            if m.group == group:
                lines.append("| `%s` | %s | %s | %s |" % (
                    m.name, m.type, ", ".join("`%s`" % label for label in m.labels) or "",
                    m.help.replace("|", "\\|")))
    return "\n".join(lines[1:]) + "\n"


# -- the collector ----------------------------------------------------------------



class ProxyCollector:
    """Reads the proxy's state at scrape time (on the event loop thread).

    ``source``, ``credentials``, ``cluster_state`` and ``fleet`` are what the
    proxy follows (None: not configured); ``contact`` the health.BrokerContact
    asking a bootstrap broker now and then; at most ``max_entities`` quota
    entities get series."""

    def __init__(self, server, source=None, cluster_state=None, fleet=None, *, credentials=None,
                 contact=None, max_entities=DEFAULT_MAX_ENTITIES):
        self.server = server
        self.source = source
        self.cluster_state = cluster_state
        self.fleet = fleet
        self.credentials = credentials
        self.contact = contact
        self.max_entities = max_entities

    def collect(self):
        server = self.server
        manager = server.quotas
        now = server.loop.time()
        if manager is not None:
            manager.settle_leases(now)  # what the connections' leases took, counted
        shown, omitted = self._shown_buckets(manager)
        topics, ips = [], []
        if manager is not None:
            topics, omitted_topics = _first_in_use(manager.topic_buckets, self.max_entities,
                                                   lambda bucket_key: bucket_key[1])
            ips, omitted_ips = _first_in_use(manager.ip_buckets, self.max_entities,
                                             lambda ip: ip)
            omitted += omitted_topics + omitted_ips
        yield from _bucket_metrics(shown, omitted, now)
        if manager is not None and manager.config.has_topic_quotas:
            yield from _topic_metrics(topics, now)
        if manager is not None and manager.config.has_ip_quotas:
            yield from _ip_metrics(ips, now)
        yield from _observed_metrics(shown, topics, ips)
        yield family("kthrottle_ready", 0 if self.not_ready(now) else 1)
        age = self.contact.age(now) if self.contact is not None else None
        if age is not None:
            yield family("kthrottle_broker_answer_age_seconds", age)
        reachable = family("kthrottle_broker_reachable")
        for listener in list(getattr(server, "listeners", {}).values()):
            if hasattr(listener, "reachable"):
                reachable.add_metric([listener.name], 1 if listener.reachable else 0)
        yield reachable
        yield family("kthrottle_connections", len(server.connections))
        refused = family("kthrottle_connections_refused_total")
        for reason, count in sorted(getattr(server, "refused", {}).items()):
            refused.add_metric([str(reason)], count)
        yield refused
        handshakes = getattr(server, "tls_handshakes", None)
        if handshakes is not None and getattr(server, "ssl_context", None) is not None:
            tls = family("kthrottle_tls_handshakes_total")
            for result in ("completed", "failed"):
                tls.add_metric([result], handshakes.get(result, 0))
            yield tls
        if self.source is not None:
            yield family("kthrottle_quota_source_healthy", 1 if self.source.healthy else 0)
            yield family("kthrottle_quota_source_rejected_total", self.source.rejected)
        if self.credentials is not None:
            yield family("kthrottle_credentials_source_healthy",
                         1 if self.credentials.healthy else 0)
        yield from _zookeeper_metrics((
            ("quotas", self.source), ("credentials", self.credentials),
            ("cluster_state", self.cluster_state),
            ("quota_shares", getattr(self.fleet, "watch", None))))
        yield from filter_metrics(getattr(server, "filters", ()))
        if self.fleet is not None:
            yield from _fleet_metrics(self.fleet, shown)
        zero_copy = getattr(server, "zero_copy", None)
        if zero_copy is not None:
            moved = family("kthrottle_zero_copy_bytes_total")
            for direction, count in sorted(zero_copy.bytes.items()):
                moved.add_metric([direction], count)
            yield moved

    def _shown_buckets(self, manager):
        """The buckets in use that get series: those of the first
        ``max_entities`` (user, client-id) entities met (the oldest buckets:
        a series, once shown, stays while its bucket lives), and how many
        entities are left out."""
        if manager is None:
            return [], 0
        shown = []
        entities = set()
        omitted = set()
        limit = self.max_entities
        for bucket_key, bucket in list(manager.buckets.items()):
            if bucket.last_used is None:
                continue
            entity = bucket_key[1:]  # (tags, and a group's or callback's scope)
            if entity not in entities:
                if len(entities) >= limit:
                    omitted.add(entity)
                    continue
                entities.add(entity)
            shown.append((bucket_key, bucket))
        return shown, len(omitted)

    def not_ready(self, now=None):
        """Why /readyz answers 503: one line per reason; none when ready.

        Ready means "can serve clients": a bootstrap broker answered within
        READY_WITHIN_SECONDS. Nothing else is looked at here: a source or
        fail-safe the proxy goes on without (``degraded``) must not take every
        proxy of a fleet out of its load balancer at once."""
        server = self.server
        if now is None:
            now = server.loop.time()
        reasons = []
        contact = self.contact
        if contact is not None:
            age = contact.age(now)
            if age is None:
                reasons.append("no bootstrap broker has answered yet%s"
                               % (" (%s)" % contact.error if contact.error else ""))
            elif age > READY_WITHIN_SECONDS:
                reasons.append("no bootstrap broker has answered for %.0f s%s"
                               % (age, " (%s)" % contact.error if contact.error else ""))
        return reasons

    def degraded(self):
        """What the proxy serves without for now, one line each (none: all
        is current): a source it cannot read (the last known state stays in
        force), a ZooKeeper session lost, a fail-safe in force. /readyz shows
        these without answering 503; each has its own metric (and alert) and
        was logged at WARNING or ERROR when it began."""
        lines = []
        source = self.source
        if source is not None and not source.healthy:
            lines.append("quota source: %s is not readable or not current; the last known "
                         "quotas stay in force" % source.describe)
        credentials = self.credentials
        if credentials is not None and not credentials.healthy:
            lines.append("credentials: %s is not readable or not current; the last known "
                         "credentials stay in force" % credentials.describe)
        for f in getattr(self.server, "filters", ()):
            lines.extend(f.degraded())
        fleet = self.fleet
        if fleet is not None and fleet.fail_safe_active:
            lines.append("fleet shares: %s; the share fail-safe applies"
                         % (fleet.follower.reason or "no fresh quota shares",))
        return lines


def _bucket_metrics(shown, omitted, now):
    made = {}  # family name -> family, in _FAMILIES' order

    def get(key, role):
        name = _FAMILIES[key].get(role)
        if name is None:
            return None
        if name not in made:
            made[name] = family(name)
        return made[name]

    for key in _FAMILIES:  # every family is there, empty without buckets
        for role in ("rate", "released", "quota", "counted"):
            get(key, role)
    throttle = family("kthrottle_throttle_seconds_total")
    for key in _KIND:
        for role in ("throttle_ms", "throttled"):
            get(key, role)
    for bucket_key, bucket in shown:
        key, user, client = bucket_key[:3]
        tags = [user, client]
        get(key, "rate").add_metric(tags, bucket.measure(now))
        released = get(key, "released")
        if released is not None:
            released.add_metric(tags, bucket.released(now))
        if bucket.quota is not None:
            get(key, "quota").add_metric(tags + [bucket.entity or ""], bucket.quota)
        get(key, "counted").add_metric(tags, bucket.total + bucket.others_total)
        throttle_ms_total = bucket.throttle_ms_total + bucket.others_throttle_ms
        throttle.add_metric(tags + [key], throttle_ms_total / 1000.0)
        throttle_ms = get(key, "throttle_ms")
        if throttle_ms is not None:
            throttle_ms.add_metric(tags, throttle_ms_total)
            get(key, "throttled").add_metric(tags, bucket.throttled + bucket.others_throttled)
    yield from made.values()
    yield throttle
    yield family("kthrottle_metrics_omitted_entities", omitted)


def _first_in_use(buckets, limit, name_of):
    """The buckets in use of the first ``limit`` names met (a topic's two
    buckets count once), and how many names are left out."""
    shown, names, omitted = [], set(), set()
    for bucket_key, bucket in list(buckets.items()):
        if bucket.last_used is None:
            continue
        name = name_of(bucket_key)
        if name not in names:
            if len(names) >= limit:
                omitted.add(name)
                continue
            names.add(name)
        shown.append((bucket_key, bucket))
    return shown, len(omitted)


def _topic_metrics(shown, now):
    rate = {k: family("kthrottle_topic_%s_byte_rate" % kind) for k, kind in _TOPIC_KIND.items()}
    quota = {k: family("kthrottle_topic_%s_quota" % kind) for k, kind in _TOPIC_KIND.items()}
    counted = {k: family("kthrottle_topic_%s_bytes_total" % kind)
               for k, kind in _TOPIC_KIND.items()}
    throttle = family("kthrottle_topic_throttle_seconds_total")
    for (key, topic), bucket in shown:
        rate[key].add_metric([topic], bucket.measure(now))
        quota[key].add_metric([topic, bucket.entity or ""], bucket.quota)
        counted[key].add_metric([topic], bucket.total + bucket.others_total)
        throttle.add_metric([topic, key],
                            (bucket.throttle_ms_total + bucket.others_throttle_ms) / 1000.0)
    for families in (rate, quota, counted):
        yield from families.values()
    yield throttle


def _ip_metrics(shown, now):
    rate = family("kthrottle_connection_creation_rate")
    quota = family("kthrottle_connection_creation_quota")
    counted = family("kthrottle_connections_created_total")
    throttle = family("kthrottle_connection_creation_throttle_seconds_total")
    for ip, bucket in shown:
        rate.add_metric([ip], bucket.measure(now))
        quota.add_metric([ip, bucket.entity or ""], bucket.quota)
        counted.add_metric([ip], bucket.total + bucket.others_total)
        throttle.add_metric([ip], (bucket.throttle_ms_total + bucket.others_throttle_ms) / 1000.0)
    yield from (rate, quota, counted, throttle)


def _observed_metrics(shown, topics, ips):
    """What observe-only buckets would have done (series for those only)."""
    clients = [(tags, b) for tags, b in shown if b.observe_only]
    topics = [(tags, b) for tags, b in topics if b.observe_only]
    ips = [(ip, b) for ip, b in ips if b.observe_only]
    if clients:
        count = family("kthrottle_observe_only_throttles_total")
        seconds = family("kthrottle_observe_only_throttle_seconds_total")
        for bucket_key, bucket in clients:
            key, user, client = bucket_key[:3]
            count.add_metric([user, client, key], bucket.observed + bucket.others_observed)
            seconds.add_metric([user, client, key], _observed_seconds(bucket))
        yield from (count, seconds)
    if topics:
        count = family("kthrottle_topic_observe_only_throttles_total")
        seconds = family("kthrottle_topic_observe_only_throttle_seconds_total")
        for (key, topic), bucket in topics:
            count.add_metric([topic, key], bucket.observed + bucket.others_observed)
            seconds.add_metric([topic, key], _observed_seconds(bucket))
        yield from (count, seconds)
    if ips:
        count = family("kthrottle_ip_observe_only_throttles_total")
        seconds = family("kthrottle_ip_observe_only_throttle_seconds_total")
        for ip, bucket in ips:
            count.add_metric([ip], bucket.observed + bucket.others_observed)
            seconds.add_metric([ip], _observed_seconds(bucket))
        yield from (count, seconds)


def _observed_seconds(bucket):
    return (bucket.observed_ms_total + bucket.others_observed_ms) / 1000.0


def filter_metrics(filters):
    """The filters' own families (Filter.metrics), those of one name from
    several filters merged into one."""
    merged = {}
    for f in filters:
        for fam in f.metrics(family):
            seen = merged.get(fam.name)
            if seen is None:
                merged[fam.name] = fam
            else:
                seen.samples.extend(fam.samples)
    return merged.values()


def _zookeeper_metrics(followers):
    """Each ZooKeeper session the proxy holds (one per thing it follows):
    connected now, and how often it was lost (Kafka's SessionState and
    ZooKeeperDisconnectsPerSec, as a gauge and a counter)."""
    followers = [(name, f) for name, f in followers if hasattr(f, "disconnects")]
    if not followers:
        return
    connected = family("kthrottle_zookeeper_connected")
    disconnects = family("kthrottle_zookeeper_disconnects_total")
    for name, follower in followers:
        connected.add_metric([name], 1 if follower.connected else 0)
        disconnects.add_metric([name], follower.disconnects)
    yield connected
    yield disconnects


def _fleet_metrics(fleet, shown):
    quota = family("kthrottle_fleet_quota")
    share = family("kthrottle_fleet_share")
    for bucket_key, bucket in shown:
        key, user, client = bucket_key[:3]
        if bucket.quota is None:
            continue
        quota.add_metric([key, user, client], bucket.quota)
        share.add_metric([key, user, client], bucket.limit)
    yield quota
    yield share
    age = fleet.shares_age(time.time())
    if age is not None:
        yield family("kthrottle_fleet_shares_age_seconds", age)
    yield family("kthrottle_fleet_fail_safe", 1 if fleet.fail_safe_active else 0)
    yield family("kthrottle_usage_reports_total", fleet.reports)
    yield family("kthrottle_usage_report_errors_total", fleet.errors)
    yield family("kthrottle_fleet_shares_rejected_total", fleet.rejected)


def quotas_report(server, source=None):
    """The configured quota entities and their values (the snapshot in
    force), and each live connection: principal, client-ids, resolved
    entities, rates."""
    now = server.loop.time()
    manager = server.quotas
    entities = None
    if manager is not None:
        manager.settle_leases(now)
    if manager is not None:
        snapshot = manager.config.snapshot
        # "static": the file's static defaults (Kafka's quota.*.default)
        entities = [{"entity": path, "quotas": dict(snapshot[path])}
                    for path in sorted(snapshot, key=lambda p: (p == "static", p))
                    if path != "groups"]
        # quota groups: every member shares one bucket (its shared_by user: group=NAME)
        for name, config in (snapshot.get("groups") or {}).items():
            entities.append({"entity": "groups/%s" % name,
                             "members": list(config.get("members", ())),
                             "quotas": {k: v for k, v in config.items() if k != "members"}})
        if manager.callback is not None:
            entities.append({"entity": "callback", "class": manager.callback_name})
    connections = []
    for conn in sorted(server.connections, key=lambda c: c.conn_id):
        clients = []
        for (_principal, client_id), quotas in conn.client_quotas.items():
            quotas = quotas.current()
            entry = {"client_id": client_id}
            for name, bucket in (("produce", quotas.produce), ("fetch", quotas.fetch),
                                 ("request", quotas.request),
                                 ("controller_mutation", quotas.mutation)):
                if bucket is None:  # no quota: nothing is measured
                    entry[name] = {"quota": None}
                    continue
                entry[name] = _bucket_report(bucket, now)
                entry[name]["shared_by"] = {"user": bucket.user_tag,
                                            "client_id": bucket.client_tag}
            clients.append(entry)
        connections.append({
            "connection": conn.conn_id,
            "client": conn.peer,
            "listener": conn.listener_name,
            "broker": conn.upstream_addr,
            "principal": conn.principal,
            "clients": clients,
            "throttled_for_ms": max(0, round((conn.muted_until - now) * 1000)),
        })
    topics, ips = [], []
    if manager is not None:
        for (key, topic), bucket in sorted(manager.topic_buckets.items()):
            topics.append(dict(topic=topic, key=key, **_bucket_report(bucket, now)))
        for ip, bucket in sorted(manager.ip_buckets.items()):
            ips.append(dict(ip=ip, key=bucket.key, **_bucket_report(bucket, now)))
    report = {"quota_source": None, "entities": entities, "connections": connections,
              "topics": topics, "ips": ips}
    if source is not None:
        report["quota_source"] = {"describe": source.describe, "healthy": bool(source.healthy)}
    return report


def _bucket_report(bucket, now):
    report = {
        "quota": bucket.quota,
        "limit": bucket.limit,  # applied: the quota, or this proxy's share of it
        "entity": bucket.entity,
        "rate": round(bucket.measure(now), 3),
        "released_rate": round(bucket.released(now), 3),
        # every worker's (--workers), as the rate
        "throttled": bucket.throttled + bucket.others_throttled,
        "throttle_ms_total": bucket.throttle_ms_total + bucket.others_throttle_ms,
        "observe_only": bucket.observe_only,
    }
    if bucket.observe_only:  # what it would have done
        report["observed"] = {"throttles": bucket.observed + bucket.others_observed,
                              "throttle_ms_total": (bucket.observed_ms_total
                                                    + bucket.others_observed_ms),
                              "last_throttle_ms": bucket.observed_last_ms}
    return report


def admin_tls_context(cert, key, ca=None):
    """HTTPS for the admin endpoint. With ``ca``, a client certificate is
    asked for (CERT_OPTIONAL): one that is sent must verify against ``ca``
    or the handshake fails; none at all still reaches /metrics, and /quotas
    then answers 403."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # no system CAs
    try:
        context.load_cert_chain(cert, key)
        if ca:
            context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the admin endpoint's TLS certificate, key or CA "
                         "(%s, %s, %s): %s" % (cert, key, ca, exc)) from None
    context.verify_mode = ssl.CERT_OPTIONAL if ca else ssl.CERT_NONE
    return context


class _RequestLog(logging.LoggerAdapter):
    """aiohttp's per-request logger. A malformed or oversized request, or a
    client gone mid-answer, is the client's doing: one DEBUG line, no
    traceback (an exposed port meets scanners). Anything else is ours."""

    def exception(self, msg, *args, exc_info=True, **kwargs):
        if isinstance(exc_info, (HttpProcessingError, ConnectionError)):
            self.debug(msg + ": %s", *args, exc_info)
        else:
            self.error(msg, *args, exc_info=exc_info, **kwargs)


def _text(status, text, **headers):
    return web.Response(status=status, body=text.encode(),
                        headers={"Content-Type": "text/plain", **headers})


def _loopback_only(addresses):
    for address in addresses:
        try:
            if not ipaddress.ip_address(address[0].split("%", 1)[0]).is_loopback:
                return False
        except ValueError:
            return False
    return True


class AdminServer:
    """/metrics, /quotas, /healthz and /readyz over HTTP(S), on the proxy's
    event loop.

    ``token`` (from --admin-token-file) and ``ssl_ca`` (client certificates)
    protect /quotas only; /metrics and the probes stay open (see the module
    docstring for what the metrics' labels show). /healthz is liveness (the
    process and its loop run); /readyz is readiness (``contact``: a bootstrap
    broker answers), and lists as degraded what of ``source``,
    ``credentials``, ``cluster_state`` and ``fleet`` is not current
    (ProxyCollector). Raises ValueError when the TLS files cannot be
    loaded."""

    def __init__(self, server, host, port, source=None, cluster_state=None, fleet=None, *,
                 credentials=None, contact=None, max_entities=DEFAULT_MAX_ENTITIES,
                 token=None, ssl_cert=None, ssl_key=None, ssl_ca=None):
        self.proxy = server
        self.host = host
        self.port = port
        self.source = source
        self.cluster_state = cluster_state
        self.fleet = fleet
        self.collector = ProxyCollector(server, source, cluster_state, fleet,
                                        credentials=credentials, contact=contact,
                                        max_entities=max_entities)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        # the process's own series: CPU, memory, descriptors (Linux /proc), Python
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        if token is not None and not token:
            raise ValueError("the admin bearer token is empty")
        self._token = token.encode() if token else None
        if ssl_ca and not ssl_cert:
            raise ValueError("client certificates for the admin endpoint need its own "
                             "certificate and key (HTTPS)")
        self._ssl = admin_tls_context(ssl_cert, ssl_key, ssl_ca) if ssl_cert else None
        self._client_certs = bool(ssl_ca)
        self.send_timeout = SEND_TIMEOUT
        self._runner = None
        self._paths = ()

    @property
    def address(self):
        return self._runner.addresses[0][:2]

    async def start(self):
        @web.middleware
        async def guard(request, handler):
            return await self._guard(request, handler)

        app = web.Application(middlewares=[guard])
        app.router.add_get("/metrics", self._metrics)  # and HEAD
        app.router.add_get("/quotas", self._quotas)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # more routes (the status page) are added here, before the app starts
        from . import status

        status.add_routes(app, self)  # /, /status.json; its sampler runs with the app
        # what a 404 suggests: the pages, not the files they load
        self._paths = sorted({r.canonical for r in app.router.resources()
                              if "." not in r.canonical})
        runner = web.AppRunner(
            app, access_log=None, logger=_RequestLog(log, {}), shutdown_timeout=1.0,
            max_line_size=MAX_LINE_SIZE, max_field_size=MAX_FIELD_SIZE, max_headers=MAX_HEADERS,
            # from connection (or last answer) to a whole request head; also
            # how long an idle keep-alive connection stays open
            keepalive_timeout=REQUEST_TIMEOUT, lingering_time=LINGER_TIME)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port, ssl_context=self._ssl).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        protected = [what for what, on in (("bearer token", self._token),
                                           ("client certificate", self._client_certs)) if on]
        log.info("admin endpoint on %s://%s:%d (/metrics, /healthz, /readyz; /quotas: %s)",
                 "https" if self._ssl else "http", *self.address,
                 " and ".join(protected) or "open")
        if not protected and not _loopback_only(runner.addresses):
            log.warning(
                "the admin endpoint on %s:%d is reachable from other hosts and its /quotas "
                "lists every connected principal and client-id to anyone: require a token "
                "(--admin-token-file) and/or client certificates (--admin-ssl-cert, "
                "--admin-ssl-key, --admin-ssl-ca), or listen on 127.0.0.1 "
                "(--admin-listen PORT)", *self.address)

    def use_tls(self, loaded):
        """New admin connections are served with ``loaded.context`` (a
        certificate, key or CA reloaded: tls.TlsFiles); live ones keep
        theirs. The listening socket keeps the context it started with, whose
        SNI callback (OpenSSL calls it in every handshake, whether or not the
        client names a server) hands the handshake to the current one."""
        if self._ssl is None:
            return
        self._tls_now = loaded.context
        if self._ssl.sni_callback is None:
            self._ssl.sni_callback = self._current_tls

    def _current_tls(self, ssl_object, server_name, context):
        current = self._tls_now
        if current is not context:
            ssl_object.context = current

    async def close(self):
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _guard(self, request, handler):
        if request.method not in _METHODS:
            # RFC 9110 section 15.5.6: a 405 lists the methods the target allows
            response = _text(405, "GET only\n", Allow=", ".join(_METHODS))
        else:
            try:
                response = await handler(request)
            except web.HTTPNotFound:
                paths = self._paths
                response = _text(404, "try %s\n" % (
                    " or ".join((", ".join(paths[:-1]), paths[-1])) if len(paths) > 1
                    else "".join(paths)))
        response.headers["Server"] = "kthrottle"
        # Sent here, under a deadline, rather than by aiohttp afterwards: a
        # client that stops reading a large answer must not hold it forever.
        try:
            async with asyncio.timeout(self.send_timeout):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            log.debug("admin client %s too slow to read its answer", request.remote)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _metrics(self, request):
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": _METRICS_TYPE})

    async def _healthz(self, request):
        # the process serves (this loop runs); nothing else is looked at
        return _text(200, "ok\n", **{"Cache-Control": "no-store"})

    async def _readyz(self, request):
        """200 ``ready`` while the proxy can serve clients; 503 and why (a
        line per reason) while it cannot. Either way, a ``degraded: `` line
        per source or fail-safe it goes on without (JSON if asked: ``ready``,
        ``reasons``, ``degraded``)."""
        reasons = self.collector.not_ready()
        degraded = self.collector.degraded()
        status = 503 if reasons else 200
        if "application/json" in request.headers.get("Accept", ""):
            body = json.dumps({"ready": not reasons, "reasons": reasons,
                               "degraded": degraded}).encode() + b"\n"
            return web.Response(status=status, body=body, content_type="application/json",
                                headers={"Cache-Control": "no-store"})
        lines = (reasons or ["ready"]) + ["degraded: " + line for line in degraded]
        return _text(status, "".join(line + "\n" for line in lines),
                     **{"Cache-Control": "no-store"})

    async def _quotas(self, request):
        denied = self._deny(request)
        if denied is not None:
            return denied
        body = json.dumps(quotas_report(self.proxy, self.source), indent=2).encode() + b"\n"
        # principals and client-ids: not for shared caches (RFC 9111 section 5.2.2.5)
        return web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def _deny(self, request):
        """The answer refusing /quotas (or the status page's data) to this
        request, or None."""
        if self._client_certs:
            ssl_object = (request.transport.get_extra_info("ssl_object")
                          if request.transport is not None else None)
            # CERT_OPTIONAL: a certificate that is there was verified against the CA
            if ssl_object is None or not ssl_object.getpeercert():
                return _text(403, "%s requires a client certificate signed by the "
                             "admin endpoint's CA\n" % request.path)
        if self._token is not None:
            scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
            challenge = 'Bearer realm="kthrottle"'
            if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
                return _text(401, "%s requires a bearer token\n" % request.path,
                             **{"WWW-Authenticate": challenge})
            try:
                given = credentials.strip().encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                given = b""
            if not hmac.compare_digest(given, self._token):
                # RFC 6750 section 3.1
                return _text(401, "invalid bearer token\n", **{
                    "WWW-Authenticate": challenge + ', error="invalid_token"'})
        return None
