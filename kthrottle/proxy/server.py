"""The proxy's listeners: one bootstrap address plus one per upstream node id
(or, with SNI routing, one TLS port for the whole cluster).

What a client connection uses of the server is handed to it as a
ConnectionEnv (connection.py), made once when the loop runs; the filters are
built by the composition root (app.py) and given to the server."""
import asyncio
import itertools
import logging
import socket
import sys

from .acceptor import Acceptor
from .addressing import Advertised, UnmappedNode
from .connection import ClientConnection, ConnectionEnv, RoutedConnection
from .discovery import ApiVersionsCache, NodeDiscovery
from .health import Listener, bound_socket
from .limits import (
    CONNECTION_CREATION_RATE,
    FAILED_LOGINS,
    ConnectionLimits,
    ConnectionRate,
    FailedLogins,
    HeldConnections,
    RefusalLog,
)
from .offload import KeyDerivation
from .pipeline import FilterTable
from .tls import TlsFiles, tls_context, upstream_tls_context, with_sni
from .zero_copy import ZeroCopy

log = logging.getLogger("kthrottle.proxy")


def upstream_tls(config):
    """The SSLContext towards the brokers, or None (PLAINTEXT, SASL_PLAINTEXT)."""
    protocol = config.upstream_security_protocol or "PLAINTEXT"
    return upstream_tls_context(config) if protocol in ("SSL", "SASL_SSL") else None


class ServerParts:
    """What the listeners own that filters use, made from the configuration
    before either (a ValueError for TLS files that do not load): the address
    each node is advertised at, the key-derivation worker, the broker's
    ApiVersions ranges, and TLS towards the brokers. ``provide`` puts them
    in the filters' Services."""

    def __init__(self, config):
        self.upstream_tls = upstream_tls(config)
        self.addresses = Advertised(config)
        self.offload = KeyDerivation()
        self.api_versions = ApiVersionsCache(config, self.upstream_tls)

    def provide(self, services):
        services.advertise = self.addresses.advertise
        services.offload = self.offload
        services.api_versions = self.api_versions
        return services


class ProxyServer:
    """Owns the listeners and the node-id -> broker routing table."""

    def __init__(self, config, filters=None, quotas=None, parts=None):
        """``filters``: the chain the composition root built (from the
        registry, with ``parts.provide``'s services); None: the registry's,
        built here (tests, embedding). ``quotas``: the policy QuotaManager,
        or None (no quota accounting)."""
        self.config = config
        self.parts = parts = parts or ServerParts(config)
        if filters is None:
            from .filter import Services
            from .filters import build_filters

            filters = build_filters(config, parts.provide(Services(quotas)))
        self.quotas = quotas
        self.loop = None
        self.addresses = parts.addresses
        self.proxy_protocol = bool(config.proxy_protocol)
        # what the proxy's own acceptor makes of a connection (the loop's
        # server makes plain ClientConnections)
        self.connection_class = (RoutedConnection if self.sni is not None or self.proxy_protocol
                                 else ClientConnection)
        self.nodes = {}  # node id -> (host, port) the broker advertises
        self.listeners = {}  # node id -> asyncio Server (None key: bootstrap)
        self.connections = set()
        self.upstream_ssl_context = parts.upstream_tls
        self.api_versions = parts.api_versions
        # who looks at what, per API key and version: built once
        self.filter_table = FilterTable(filters)
        self.filters = tuple(self.filter_table.filters)
        self.api_versions.filters = self.filters
        # brokers that take Metadata before any SASL exchange: node listeners open at start
        sasl_upstream = (config.upstream_security_protocol or "").startswith("SASL_")
        self.discovery = None if sasl_upstream else NodeDiscovery(
            config, parts.upstream_tls, self.unmapped, self.learn_nodes)
        # a proxy that verifies clients itself answers ApiVersions before
        # authentication from what a broker said
        self.authenticates_clients = any(f.authenticates_clients for f in self.filters)
        self.limits = ConnectionLimits(config.max_connections, config.max_connections_per_ip)
        self.connection_rate = ConnectionRate(quotas)  # KIP-612, ip entities
        self.failed_logins = FailedLogins(getattr(config, "failed_login_rate",
                                                  FailedLogins.RATE))
        self.held = None  # HeldConnections once the loop runs: those over their rate
        self.refusals = None  # a RefusalLog once the loop runs
        self.refused = {}  # reason -> connections refused (kthrottle_connections_refused_total)
        self.tls_handshakes = {"completed": 0, "failed": 0}  # kthrottle_tls_handshakes_total
        self.env = None  # the connections' ConnectionEnv, once the loop runs
        self._sweeper = None
        self.zero_copy = ZeroCopy.configured(config)  # --zero-copy, or None
        self.ssl_context = (with_sni(tls_context(config), self.sni) if config.tls_enabled
                            else None)
        self.principal_mapper = None
        if config.security_protocol == "SSL":
            from ..policy.principal import PrincipalMapper

            self.principal_mapper = PrincipalMapper(config.ssl_principal_mapping_rules)
        self._ids = itertools.count(1)
        self._starting = set()
        # --workers: every worker binds every port (SO_REUSEPORT), the kernel
        # spreading the connections over them
        self.reuse_port = getattr(config, "workers", 1) > 1

    @property
    def sni(self):
        """SNI routing: the addressing.SniPattern, or None."""
        return self.addresses.sni

    def connection_env(self):
        """What the connections use of the server (ConnectionEnv), once the
        loop runs."""
        config = self.config
        return ConnectionEnv(
            loop=self.loop, filter_table=self.filter_table, quotas=self.quotas,
            max_frame_size=config.max_frame_size,
            sasl_max_receive_size=config.sasl_server_max_receive_size,
            upstream_connect_timeout=config.upstream_connect_timeout_ms / 1000.0,
            upstream_tls=self.upstream_ssl_context, zero_copy=self.zero_copy,
            principal_mapper=self.principal_mapper, sni=self.sni, nodes=self.nodes,
            connections=self.connections, limits=self.limits,
            failed_logins=self.failed_logins, held=self.held, refusals=self.refusals,
            next_id=self.next_connection_id, over_connection_rate=self.over_connection_rate,
            over_failed_logins=self.over_failed_logins, learn_nodes=self.learn_nodes,
            listener_named=self.listener_named)

    def next_connection_id(self):
        return next(self._ids)

    def over_connection_rate(self, ip, peer, listener, close):
        """KIP-612: is this new connection from ``ip`` over its address's
        connection_creation_rate? If so it is held unread for the throttle
        time it earned, then closed (``close()``), as Kafka's acceptor does;
        logged (rate-limited) and counted as refused."""
        over = self.connection_rate.admit(ip, self.loop.time())
        if over is None:
            return False
        ms, message = over
        self.held.hold(close, ms)
        self.refusals.refused(ip, "%s (%s listener)" % (peer, listener),
                              CONNECTION_CREATION_RATE, message)
        return True

    def over_failed_logins(self, ip, peer, listener, close):
        """Is ``ip`` past its failed-login allowance (FailedLogins)? If so the
        new connection is held unread, then closed; logged (rate-limited) and
        counted as refused."""
        over = self.failed_logins.admit(ip, self.loop.time())
        if over is None:
            return False
        ms, message = over
        self.held.hold(close, ms)
        self.refusals.refused(ip, "%s (%s listener)" % (peer, listener), FAILED_LOGINS, message)
        return True

    @property
    def bootstrap_address(self):
        sock = self.listeners[None].sockets[0]
        return sock.getsockname()[:2]

    def advertise(self, node_id):
        """The address clients are given for upstream node ``node_id``
        (addressing.Advertised)."""
        return self.addresses.advertise(node_id)

    def unmapped(self, nodes):
        """The UnmappedNode errors of ``nodes`` (none with SNI routing)."""
        return self.addresses.unmapped(nodes)

    async def start(self):
        loop = self.loop = asyncio.get_running_loop()
        self.refusals = RefusalLog(loop.call_later)
        self.held = HeldConnections(loop.call_later)
        self.refused = self.refusals.counts
        self.env = self.connection_env()
        self.limits.overrides = await _resolve_overrides(
            loop, self.config.max_connections_per_ip_overrides)
        host, port = self.config.listen
        bootstrap = list(self.config.bootstrap_servers)
        # bound (and listening: connections wait in the kernel's queue) now;
        # served once the layout is known to serve the cluster's nodes
        listener = Listener(self, "bootstrap", bound_socket(host, port, reuse_port=self.reuse_port),
                            lambda: bootstrap)
        try:
            self.addresses.listening_on(listener.address[1])
            if self.authenticates_clients:
                self.api_versions.refresh()  # before the first client asks
            if self.discovery is not None:
                await self._discover()
            await listener.start()
        except BaseException:
            listener.close()
            raise
        self.listeners[None] = listener
        self._sweeper = loop.create_task(self._sweep())
        log.info(
            "listening on %s:%d for bootstrap, brokers %s; %s%s",
            *self.bootstrap_address, ",".join("%s:%d" % a for a in bootstrap),
            self.addresses.describe(),
            "; PROXY protocol headers expected" if self.proxy_protocol else "",
        )

    async def _discover(self):
        """The cluster's nodes, asked of a bootstrap broker: each must have
        a port. A layout that cannot serve them is refused here (ValueError),
        not client by client."""
        self.discovery.start()
        nodes = await self.discovery.first_answer(
            self.config.upstream_connect_timeout_ms / 1000.0)
        unmapped = self.unmapped(nodes or ())
        if unmapped:
            raise ValueError("the cluster names %s: %s" % (
                ", ".join("node %d" % e.node_id for e in unmapped),
                "; ".join(str(e) for e in unmapped)))

    def learn_nodes(self, nodes):
        """Route node ids to brokers and open a listener for each new node.

        The listening socket is bound synchronously, before the response that
        named the node reaches the client, so the client's first connection to
        it is never refused.
        """
        for node in nodes:
            address = (node.host, node.port)
            if self.nodes.get(node.node_id) != address:
                if node.node_id in self.nodes:
                    log.info("node %d moved to %s:%d", node.node_id, *address)
                self.nodes[node.node_id] = address
            if node.node_id not in self.listeners and self.sni is None:
                self._open_node_listener(node.node_id)

    def _open_node_listener(self, node_id):
        if self.draining:  # stopping: a new node's port stays closed
            return
        try:
            port = self.addresses.node_ports.port(node_id)
        except UnmappedNode as exc:  # named by the proxy's own Metadata request
            self.listeners[node_id] = None  # said once
            log.error("%s; connections given this node are closed", exc)
            return
        host = self.config.listen[0]
        try:
            sock = bound_socket(host, port, reuse_port=self.reuse_port)
        except OSError as exc:
            self.listeners[node_id] = None  # do not retry on every response
            log.error("cannot listen for node %d on %s:%d: %s", node_id, host, port, exc)
            return
        listener = Listener(self, "node %d" % node_id, sock, lambda: self._node_route(node_id))
        self.listeners[node_id] = listener
        task = self.loop.create_task(self._serve_node(node_id, listener))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _serve_node(self, node_id, listener):
        await listener.start()
        log.info("listening on %s:%d for node %d (broker %s:%d)",
                 *listener.address, node_id, *self.nodes[node_id])

    def listener_named(self, name):
        """The Listener a connection was accepted on (by its name)."""
        if name == "bootstrap":
            return self.listeners.get(None)
        return self.listeners.get(int(name[5:]))  # "node N"

    async def _serve(self, sock, name, route):
        """Serve a listening socket: the loop's server for PLAINTEXT; for
        TLS or the PROXY protocol an acceptor of the proxy's own, so that a
        failed handshake is seen with its client's address (the loop's
        server drops it silently), logged and counted like any refusal, and
        the PROXY protocol header is read before anything else."""
        if self.ssl_context is None and not self.proxy_protocol:
            return await self.loop.create_server(
                lambda: ClientConnection(self.env, name, route()), sock=sock)
        return Acceptor(self, sock, name, route)

    def _node_route(self, node_id):
        address = self.nodes.get(node_id)
        return [address] if address else []

    async def _sweep(self):
        """Close connections idle for connections-max-idle-ms (Kafka's
        connections.max.idle.ms: no byte either way), and those whose TLS
        handshake and authentication have not finished within
        handshake-timeout-ms. A sweep, not a timer per connection: nothing
        is added to the per-read path."""
        config = self.config
        idle = config.connections_max_idle_ms / 1000.0
        handshake = config.handshake_timeout_ms / 1000.0
        interval = max(0.05, min(idle / 4, handshake / 4, 5.0))
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.sweep(now, idle, handshake)

    # graceful stop (SIGTERM) and reload (SIGHUP) ----------------------------

    DRAIN_POLL_SECONDS = 0.01  # how often a drain looks at its connections
    draining = False  # set by drain: no listener is opened any more
    _drain_cut = None  # why a drain is to end now (a second signal)

    async def drain(self, timeout, why="SIGTERM"):
        """Stop gracefully, as a broker shutting down stops reading requests:
        every listener stops accepting (new connections are refused), no
        connection reads a request after the one it is reading, and each
        closes as soon as its client has every response it is owed (one
        owed nothing closes at once). Those still owed responses after
        ``timeout`` seconds, or at ``cut_drain()``, are closed then. Requests
        a client sent after that point were never read, so never reached a
        broker: its client sends them again elsewhere, as when a broker
        stops. A look every DRAIN_POLL_SECONDS, not a hook on the request
        path. One log line as it starts, one as it ends."""
        loop = self.loop
        started = loop.time()
        self.draining = True
        await asyncio.gather(*self._starting, return_exceptions=True)  # node listeners opening
        for listener in list(self.listeners.values()):
            if isinstance(listener, asyncio.AbstractServer):
                listener.close()
        seen = {}  # connection -> (responses owed, requests read) when first seen
        reading = set()  # connections reading to the end of a request

        def look(conn):
            p = conn.pipeline
            if conn not in seen:
                seen[conn] = (p.in_flight, p.requests)
                if p.stop_reading():
                    conn.client.pause("draining")
                else:
                    reading.add(conn)
            if conn in reading:
                if not p.requests_in.at_boundary:
                    return
                conn.client.pause("draining")  # what the client sends next stays unread
                reading.discard(conn)
            transport = conn.client.transport
            if (not p.in_flight and not transport.get_write_buffer_size()
                    and not _unacknowledged(transport)):
                conn.close("proxy stopping (%s), no response owed" % why)

        connections = list(self.connections)
        log.info("%s: draining %d connections with %d requests in flight: listeners closed, no "
                 "new request read; each connection closes once its responses are delivered, "
                 "the rest in %d ms (drain-timeout-ms)", why, len(connections),
                 sum(conn.pipeline.in_flight for conn in connections), round(timeout * 1000))
        for conn in connections:
            look(conn)
        deadline = started + timeout
        while self.connections and self._drain_cut is None and loop.time() < deadline:
            await asyncio.sleep(self.DRAIN_POLL_SECONDS)
            for conn in list(self.connections):
                look(conn)
        cut_by = self._drain_cut or "drain-timeout-ms"
        finished = cut = lost = 0
        for conn, (owed, requests) in seen.items():
            p = conn.pipeline
            left = p.in_flight
            if not conn.closed:
                cut += left
                conn.close("proxy stopping (%s), %d responses still owed at %s"
                           % (why, left, cut_by))
            else:
                lost += left  # its client, or its broker, closed it first
            finished += max(0, owed + p.requests - requests - left)
        log.info("drained in %d ms: %d requests finished, %d cut at %s%s",
                 round((loop.time() - started) * 1000), finished, cut, cut_by,
                 "; %d lost with connections closed by their client or broker" % lost
                 if lost else "")

    def cut_drain(self, why):
        """End the drain now, or as soon as it starts (a second SIGTERM):
        what is still in flight is cut."""
        if self._drain_cut is None:
            self._drain_cut = why
            log.info("%s again: closing the remaining connections now", why)

    def tls_files(self):
        """The listeners' certificate, key and CA followed live (start it
        with use_tls), or None: PLAINTEXT and SASL_PLAINTEXT listeners have
        no TLS to reload (``_serve`` gave them the loop's plain server)."""
        if self.ssl_context is None:
            return None
        config = self.config
        paths = [p for p in (config.ssl_cert, config.ssl_key, config.ssl_ca) if p]
        return TlsFiles("the listeners' TLS", paths, lambda: tls_context(config))

    def use_tls(self, loaded):
        """New TLS connections, on every listener, present this certificate
        (each takes ``ssl_context`` as it is when accepted:
        Acceptor._handshake); live ones keep the one they began with."""
        self.ssl_context = with_sni(loaded.context, self.sni)

    async def close(self):
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.discovery is not None:
            self.discovery.close()
        for task in list(self._starting):
            await task
        servers = [s for s in self.listeners.values() if isinstance(s, asyncio.AbstractServer)]
        for s in servers:
            s.close()
        connecting = [c._connect_task for c in self.connections
                      if c._connect_task is not None and not c._connect_task.done()]
        for conn in list(self.connections):
            conn.close("proxy shutting down")
        await asyncio.gather(*connecting, return_exceptions=True)
        for s in servers:
            await s.wait_closed()
        self.listeners.clear()
        self.api_versions.close()
        if self.held is not None:
            self.held.close()
        if self.refusals is not None:
            self.refusals.close()
        self.parts.offload.close()


def _unacknowledged(transport):
    """Bytes handed to the kernel that the client's TCP has not acknowledged
    yet (Linux's SIOCOUTQ; 0 where it cannot be asked). A socket closed with
    unread input is reset, and a reset drops what the kernel still holds:
    a draining connection closes only once its client has it all."""
    import fcntl
    import termios

    sock = transport.get_extra_info("socket")
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)),
                              sys.byteorder, signed=True)
    except (AttributeError, OSError, ValueError):
        return 0


async def _resolve_overrides(loop, overrides):
    """max-connections-per-ip-overrides: host names resolved to addresses."""
    resolved = {}
    for host, limit in overrides.items():
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError("max-connections-per-ip-overrides: cannot resolve %s: %s"
                             % (host, exc)) from None
        for info in infos:
            resolved[info[4][0]] = limit
    return resolved
