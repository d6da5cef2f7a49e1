"""The admin endpoint: /metrics (Prometheus text) and /quotas (JSON).

Metrics are collected when scraped, from the quota buckets themselves, so the
request path pays nothing for them. Names follow Kafka's per-(user, client-id)
quota metrics (byte-rate, throttle-time, request-rate) with Prometheus
spelling; labels are Kafka's metric tags, so a user-level quota shows as
client_id="" (all that user's clients share it), as in Kafka.
"""
import asyncio
import json
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE

log = logging.getLogger("kthrottle.admin")

_KIND = {PRODUCER_BYTE_RATE: "produce", CONSUMER_BYTE_RATE: "fetch", REQUEST_RATE: "request"}
_MAX_REQUEST_LINE = 8192


class ProxyCollector:
    """Reads the proxy's state at scrape time (on the event loop thread)."""

    def __init__(self, server, source=None, cluster_state=None, fleet=None):
        self.server = server
        self.source = source
        self.cluster_state = cluster_state
        self.fleet = fleet

    def collect(self):
        server = self.server
        labels = ["user", "client_id"]
        rate = {k: GaugeMetricFamily(
            "kthrottle_request_rate" if k == REQUEST_RATE else "kthrottle_%s_byte_rate" % _KIND[k],
            "Measured %s rate per quota bucket (Kafka's sampled rate)"
            % ("request" if k == REQUEST_RATE else _KIND[k] + " byte"), labels=labels)
            for k in _KIND}
        quota = {k: GaugeMetricFamily(
            "kthrottle_%s_quota" % _KIND[k],
            "Configured %s quota of the bucket (%s)" % (_KIND[k], k), labels=labels + ["entity"])
            for k in _KIND}
        throttle = {k: CounterMetricFamily(
            "kthrottle_%s_throttle_time_ms" % _KIND[k],
            "Throttle time given to %s in this bucket" % _KIND[k], labels=labels)
            for k in _KIND}
        throttled = {k: CounterMetricFamily(
            "kthrottle_%s_throttled_responses" % _KIND[k],
            "Responses throttled for %s in this bucket" % _KIND[k], labels=labels)
            for k in _KIND}
        manager = server.quotas
        if manager is not None:
            now = server.loop.time()
            for (key, user, client), bucket in manager.buckets.items():
                if bucket.last_used is None:
                    continue
                tags = [user, client]
                rate[key].add_metric(tags, bucket.measure(now))
                if bucket.quota is not None:
                    quota[key].add_metric(tags + [bucket.entity or ""], bucket.quota)
                throttle[key].add_metric(tags, bucket.throttle_ms_total)
                throttled[key].add_metric(tags, bucket.throttled)
        for family in (rate, quota, throttle, throttled):
            yield from family.values()
        yield GaugeMetricFamily("kthrottle_connections", "Open client connections",
                                value=len(server.connections))
        if self.source is not None:
            yield GaugeMetricFamily(
                "kthrottle_quota_source_healthy",
                "1 while the quota source (file or ZooKeeper) is readable and current; "
                "0 while the last known quotas stay in force",
                value=1 if self.source.healthy else 0)
            yield CounterMetricFamily(
                "kthrottle_quota_source_rejected",
                "quota entries or file versions rejected since start",
                value=self.source.rejected)
        storage = getattr(server, "storage", None)
        if storage is not None:
            yield from _storage_metrics(storage, self.cluster_state)
        if self.fleet is not None:
            yield from _fleet_metrics(self.fleet, manager)


def _fleet_metrics(fleet, manager):
    import time

    labels = ["key", "user", "client_id"]
    quota = GaugeMetricFamily(
        "kthrottle_fleet_quota", "Configured (fleet-wide) quota of the bucket", labels=labels)
    share = GaugeMetricFamily(
        "kthrottle_fleet_share", "Limit applied to the bucket on this proxy: its share of the "
        "fleet quota (or what the fail-safe gives it)", labels=labels)
    if manager is not None:
        for (key, user, client), bucket in manager.buckets.items():
            if bucket.last_used is None or bucket.quota is None:
                continue
            quota.add_metric([key, user, client], bucket.quota)
            share.add_metric([key, user, client], bucket.limit)
    yield quota
    yield share
    age = fleet.shares_age(time.time())
    if age is not None:
        yield GaugeMetricFamily("kthrottle_fleet_shares_age_seconds",
                                "Age of the last good quota shares read from ZooKeeper",
                                value=age)
    yield GaugeMetricFamily(
        "kthrottle_fleet_fail_safe", "1 while the fail-safe applies (the quota shares are "
        "older than --share-max-age-ms, or none were read yet)",
        value=1 if fleet.fail_safe_active else 0)
    yield CounterMetricFamily("kthrottle_usage_reports", "Usage reports the cluster acknowledged",
                              value=fleet.reports)
    yield CounterMetricFamily("kthrottle_usage_report_errors",
                              "Usage reports that could not be published", value=fleet.errors)
    yield CounterMetricFamily("kthrottle_fleet_shares_rejected",
                              "Quota shares documents refused (malformed, or for another proxy)",
                              value=fleet.rejected)


_STATE_VALUE = {"OPEN": 0, "THROTTLE": 1, "PAUSE": 2, "UNKNOWN": 3}


def _storage_metrics(storage, source):
    import time

    current = storage.current
    state = GaugeMetricFamily(
        "kthrottle_storage_state", "What producers meet: 0 OPEN, 1 THROTTLE, 2 PAUSE (scope "
        "cluster: the state in force; scope broker/volume: the snapshot's, 3 UNKNOWN)",
        labels=["scope", "broker", "volume"])
    factor = GaugeMetricFamily(
        "kthrottle_storage_factor", "Share of their produce rate producers keep (1: OPEN)",
        labels=["scope", "broker", "volume"])
    state.add_metric(["cluster", "", ""], _STATE_VALUE[current.state])
    factor.add_metric(["cluster", "", ""], current.factor)
    snapshot = storage.policy.state
    if snapshot is not None:
        for broker, entry in sorted(snapshot.brokers.items()):
            if not isinstance(entry, dict):
                continue
            state.add_metric(["broker", str(broker), ""],
                             _STATE_VALUE.get(entry.get("state"), 3))
            for volume in entry.get("volumes") or ():
                # volumes past their soft limit only: a fleet has thousands
                if isinstance(volume, dict) and volume.get("state") != "OPEN":
                    tags = ["volume", str(broker), str(volume.get("name"))]
                    state.add_metric(tags, _STATE_VALUE.get(volume.get("state"), 3))
                    factor.add_metric(tags, float(volume.get("factor", 1.0)))
    yield state
    yield factor
    yield GaugeMetricFamily(
        "kthrottle_storage_fail_safe", "1 while the fail-safe applies (no fresh cluster state, "
        "or brokers without a fresh volume report)", value=1 if storage.reason else 0)
    if snapshot is not None:
        yield GaugeMetricFamily("kthrottle_cluster_state_age_seconds",
                                "Age of the cluster-state snapshot in force",
                                value=max(0.0, time.time() - snapshot.generated_at))
    yield CounterMetricFamily("kthrottle_storage_deferred_requests",
                              "Produce requests held back (PAUSE), counted at each check",
                              value=storage.deferred)
    yield CounterMetricFamily("kthrottle_storage_throttled_requests",
                              "Produce requests throttled for storage (THROTTLE)",
                              value=storage.throttled)
    if source is not None:
        yield CounterMetricFamily("kthrottle_cluster_state_rejected",
                                  "cluster-state snapshots refused (malformed) since start",
                                  value=source.rejected)


def quotas_report(server):
    """Each live connection: principal, client-ids, resolved entities, rates."""
    now = server.loop.time()
    connections = []
    for conn in sorted(server.connections, key=lambda c: c.conn_id):
        clients = []
        for (_principal, client_id), quotas in conn.client_quotas.items():
            quotas = quotas.current()
            entry = {"client_id": client_id}
            for name, bucket in (("produce", quotas.produce), ("fetch", quotas.fetch),
                                 ("request", quotas.request)):
                if bucket is None:  # no quota: nothing is measured
                    entry[name] = {"quota": None}
                    continue
                entry[name] = {
                    "quota": bucket.quota,
                    "limit": bucket.limit,  # applied: the quota, or this proxy's share of it
                    "entity": bucket.entity,
                    "shared_by": {"user": bucket.user_tag, "client_id": bucket.client_tag},
                    "rate": round(bucket.measure(now), 3),
                }
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
    return {"connections": connections}


class AdminServer:
    """A small HTTP/1.0 server on the proxy's event loop."""

    def __init__(self, server, host, port, source=None, cluster_state=None, fleet=None):
        self.proxy = server
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProxyCollector(server, source, cluster_state, fleet))
        self._server = None

    @property
    def address(self):
        return self._server.sockets[0].getsockname()[:2]

    async def start(self):
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        log.info("admin endpoint on http://%s:%d (/metrics, /quotas)", *self.address)

    async def close(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader, writer):
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            while True:  # skip the headers
                header = await asyncio.wait_for(reader.readline(), 10)
                if header in (b"\r\n", b"\n", b""):
                    break
            parts = line.decode("latin-1").split()
            if len(line) > _MAX_REQUEST_LINE or len(parts) < 2:
                status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
            elif parts[0] not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            else:
                path = parts[1].split("?", 1)[0]
                if path == "/metrics":
                    status, ctype = "200 OK", "text/plain; version=0.0.4; charset=utf-8"
                    body = generate_latest(self.registry)
                elif path == "/quotas":
                    status, ctype = "200 OK", "application/json"
                    body = json.dumps(quotas_report(self.proxy), indent=2).encode() + b"\n"
                else:
                    status, ctype, body = "404 Not Found", "text/plain", b"try /metrics or /quotas\n"
            head = "HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
                status, ctype, len(body))
            writer.write(head.encode("latin-1") + (b"" if parts and parts[0] == "HEAD" else body))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("admin request failed")
        finally:
            writer.close()
