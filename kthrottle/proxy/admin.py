"""The admin endpoint: /metrics (Prometheus text) and /quotas (JSON).

Metrics are collected when scraped, from the quota buckets themselves, so the
request path pays nothing for them. Names follow Kafka's per-(user, client-id)
quota metrics (byte-rate, throttle-time, request-rate) with Prometheus
spelling; labels are Kafka's metric tags, so a user-level quota shows as
client_id="" (all that user's clients share it), as in Kafka.

Served with aiohttp on the proxy's own event loop. Exposure:

- It binds to 127.0.0.1 unless --admin-listen names a host.
- /quotas names every connected principal and client-id. It can require a
  bearer token (RFC 6750, ``Authorization: Bearer <token>``; 401 without it)
  and/or a client certificate signed by --admin-ssl-ca (403 without one).
  Exposed beyond loopback with neither, a WARNING is logged at start.
- /metrics stays open, so that Prometheus scrapes it without credentials.
  Its labels are Kafka's metric tags, so they too name users and client-ids
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

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE

log = logging.getLogger("kthrottle.admin")

_KIND = {PRODUCER_BYTE_RATE: "produce", CONSUMER_BYTE_RATE: "fetch", REQUEST_RATE: "request"}

# Bounds on what a client may send. Apache httpd's defaults are the precedent
# for sizes (LimitRequestLine and LimitRequestFieldSize 8190 bytes, which are
# also aiohttp's); its LimitRequestFields is 100 for a general web server.
# Prometheus, curl and browsers send fewer than 20 headers, and this endpoint
# serves two fixed paths, so 32 is plenty: at most 32 x 8 KiB of headers per
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

_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METHODS = ("GET", "HEAD")


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
        refused = CounterMetricFamily(
            "kthrottle_connections_refused",
            "Client connections the listeners refused or closed, by reason", labels=["reason"])
        for reason, count in sorted(getattr(server, "refused", {}).items()):
            refused.add_metric([str(reason)], count)
        yield refused
        reachable = GaugeMetricFamily(
            "kthrottle_broker_reachable",
            "1 while a broker behind the listener answers; 0 while the listener refuses "
            "connections because none does", labels=["listener"])
        for listener in list(getattr(server, "listeners", {}).values()):
            if hasattr(listener, "reachable"):
                reachable.add_metric([listener.name], 1 if listener.reachable else 0)
        yield reachable
        if self.source is not None:
            yield GaugeMetricFamily(
                "kthrottle_quota_source_healthy",
                "1 while the quota source (file, ZooKeeper or the cluster) is readable and "
                "current; 0 while the last known quotas stay in force",
                value=1 if self.source.healthy else 0)
            yield CounterMetricFamily(
                "kthrottle_quota_source_rejected",
                "quota entries or file versions rejected since start",
                value=self.source.rejected)
        yield from _zookeeper_metrics((
            ("quotas", self.source), ("cluster_state", self.cluster_state),
            ("quota_shares", getattr(self.fleet, "watch", None))))
        storage = getattr(server, "storage", None)
        if storage is not None:
            yield from _storage_metrics(storage, self.cluster_state)
        if self.fleet is not None:
            yield from _fleet_metrics(self.fleet, manager)


def _zookeeper_metrics(followers):
    """Each ZooKeeper session the proxy holds (one per thing it follows):
    connected now, and how often it was lost (Kafka's SessionState and
    ZooKeeperDisconnectsPerSec, as a gauge and a counter)."""
    followers = [(name, f) for name, f in followers if hasattr(f, "disconnects")]
    if not followers:
        return
    connected = GaugeMetricFamily(
        "kthrottle_zookeeper_connected", "1 while the ZooKeeper session that follows this "
        "source is connected; 0 while what was last read stays in force", labels=["source"])
    disconnects = CounterMetricFamily(
        "kthrottle_zookeeper_disconnects", "Times the ZooKeeper connection following this "
        "source was lost (suspended or expired)", labels=["source"])
    for name, follower in followers:
        connected.add_metric([name], 1 if follower.connected else 0)
        disconnects.add_metric([name], follower.disconnects)
    yield connected
    yield disconnects


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
    """/metrics and /quotas over HTTP(S), on the proxy's event loop.

    ``token`` (from --admin-token-file) and ``ssl_ca`` (client certificates)
    protect /quotas only; /metrics stays open for Prometheus (see the module
    docstring for what its labels show). Raises ValueError when the TLS files
    cannot be loaded."""

    def __init__(self, server, host, port, source=None, cluster_state=None, fleet=None, *,
                 token=None, ssl_cert=None, ssl_key=None, ssl_ca=None):
        self.proxy = server
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProxyCollector(server, source, cluster_state, fleet))
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
        log.info("admin endpoint on %s://%s:%d (/metrics; /quotas: %s)",
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
        certificate, key or CA reloaded: server.TlsFiles); live ones keep
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
                response = _text(404, "try /metrics or /quotas\n")
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

    async def _quotas(self, request):
        denied = self._deny(request)
        if denied is not None:
            return denied
        body = json.dumps(quotas_report(self.proxy), indent=2).encode() + b"\n"
        # principals and client-ids: not for shared caches (RFC 9111 section 5.2.2.5)
        return web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def _deny(self, request):
        """The answer refusing /quotas to this request, or None."""
        if self._client_certs:
            ssl_object = (request.transport.get_extra_info("ssl_object")
                          if request.transport is not None else None)
            # CERT_OPTIONAL: a certificate that is there was verified against the CA
            if ssl_object is None or not ssl_object.getpeercert():
                return _text(403, "/quotas requires a client certificate signed by the "
                             "admin endpoint's CA\n")
        if self._token is not None:
            scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
            challenge = 'Bearer realm="kthrottle"'
            if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
                return _text(401, "/quotas requires a bearer token\n",
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
