"""The proxy's listeners: one bootstrap address plus one per upstream node id
(or, with SNI routing, one TLS port for the whole cluster)."""
import asyncio
import itertools
import logging
import socket
import sys
from typing import NamedTuple

from ..codecs import ProtocolError
from ..codecs.frames import MIN_RESPONSE_SIZE
from ..codecs.proxy_protocol import MAX_SIZE as PROXY_HEADER_MAX_SIZE
from ..codecs.proxy_protocol import parse_header as parse_proxy_header
from ..codecs.versions import (
    api_versions_request,
    metadata_request,
    parse_api_versions,
    parse_metadata_brokers,
)
from ..codecs.wire import INT32
from ..sources import QuotaStoreError
from ..sources.file import FollowedFile, read_file_bytes, stat_signature
from .addressing import NodePorts, SniPattern, UnmappedNode
from .connection import ClientConnection, RoutedConnection
from .filter import Services
from .filters import build_filters
from .health import Listener, bound_socket
from .limits import (
    CONNECTION_CREATION_RATE,
    FAILED_LOGINS,
    PROXY_PROTOCOL,
    TLS_HANDSHAKE,
    ConnectionLimits,
    ConnectionRate,
    FailedLogins,
    HeldConnections,
    RefusalLog,
)
from .pipeline import FilterTable
from .zero_copy import ZeroCopy

log = logging.getLogger("kthrottle.proxy")


class ProxyServer:
    """Owns the listeners and the node-id -> broker routing table."""

    def __init__(self, config, services=None):
        """``services``: what the composition root made for the filters
        (quotas, credentials; filter.Services); the filters themselves are
        built here, from the registry, once the server's own services are in."""
        self.config = config
        services = services or Services()
        self.quotas = services.quotas  # policy QuotaManager, or None: no quota accounting
        self.loop = None
        self.advertised_host = config.effective_advertised_host
        self.node_port_base = config.effective_node_port_base
        # the port of each node id (--node-ports, --node-port-base)
        self.node_ports = NodePorts(config.node_ports, self.node_port_base, config.listen[1])
        # SNI routing: node N is a host name on the one listen port
        self.sni = SniPattern(config.sni_broker_pattern) if config.sni_broker_pattern else None
        self.sni_port = None  # the port given with those names (set at start)
        self.proxy_protocol = bool(config.proxy_protocol)
        # what the proxy's own acceptor makes of a connection (the loop's
        # server makes plain ClientConnections)
        self.connection_class = (RoutedConnection if self.sni is not None or self.proxy_protocol
                                 else ClientConnection)
        self.nodes = {}  # node id -> (host, port) the broker advertises
        self.listeners = {}  # node id -> asyncio Server (None key: bootstrap)
        self.connections = set()
        upstream_protocol = config.upstream_security_protocol or "PLAINTEXT"
        self.api_versions = ApiVersionsCache(self)
        # brokers that take Metadata before any SASL exchange: node listeners open at start
        self.discovery = None if upstream_protocol.startswith("SASL_") else NodeDiscovery(self)
        self._pool = None  # the key-derivation worker, made when first needed
        services.advertise = self.advertise if self.sni is None else self.advertise_by_name
        services.offload = self.offload
        services.api_versions = self.api_versions
        # who looks at what, per API key and version: built once
        self.filter_table = FilterTable(build_filters(config, services))
        self.filters = {f.name: f for f in self.filter_table.filters}
        # a proxy that verifies clients itself answers ApiVersions before
        # authentication from what a broker said
        self.authenticates_clients = "sasl-terminate" in self.filters
        self.limits = ConnectionLimits(config.max_connections, config.max_connections_per_ip)
        self.connection_rate = ConnectionRate(self.quotas)  # KIP-612, ip entities
        self.failed_logins = FailedLogins(getattr(config, "failed_login_rate",
                                                  FailedLogins.RATE))
        self.held = None  # HeldConnections once the loop runs: those over their rate
        self.refusals = None  # a RefusalLog once the loop runs
        self.refused = {}  # reason -> connections refused (kthrottle_connections_refused_total)
        self.tls_handshakes = {"completed": 0, "failed": 0}  # kthrottle_tls_handshakes_total
        self._sweeper = None
        self.storage = self.filters.get("storage")  # the StorageThrottle filter, or None
        self.zero_copy = ZeroCopy.configured(config)  # --zero-copy, or None
        self.ssl_context = self._with_sni(tls_context(config)) if config.tls_enabled else None
        self.upstream_ssl_context = (
            upstream_tls_context(config)
            if upstream_protocol in ("SSL", "SASL_SSL") else None)
        self.principal_mapper = None
        if config.security_protocol == "SSL":
            from ..policy.principal import PrincipalMapper

            self.principal_mapper = PrincipalMapper(config.ssl_principal_mapping_rules)
        self._ids = itertools.count(1)
        self._starting = set()
        # --workers: every worker binds every port (SO_REUSEPORT), the kernel
        # spreading the connections over them
        self.reuse_port = getattr(config, "workers", 1) > 1

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
        """The address clients are given for upstream node ``node_id``;
        UnmappedNode (a ValueError: the connection whose response named it
        is closed, counted as refused) when it has no port."""
        return self.advertised_host, self.node_ports.port(node_id)

    def advertise_by_name(self, node_id):
        """SNI routing: node N's host name from the pattern, on the one port."""
        return self.sni.host(node_id), self.sni_port

    def unmapped(self, nodes):
        """The UnmappedNode errors of ``nodes`` (none with SNI routing)."""
        if self.sni is not None:
            return []
        errors = []
        for node in nodes:
            try:
                self.node_ports.port(node.node_id)
            except UnmappedNode as exc:
                errors.append(exc)
        return errors

    def _with_sni(self, context):
        """SNI routing: the context notes the server name each client asks
        for (read once the handshake is done: RoutedConnection)."""
        if self.sni is not None:
            context.sni_callback = _note_server_name
        return context

    def offload(self, fn, *args):
        """Run a key derivation (a PBKDF2: ms of CPU, the GIL released) in
        the one worker thread, off the event loop; an awaitable of its
        result. One thread bounds what failed logins can take to one core,
        and a connection waits for its turn at no cost."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kthrottle-kdf",
                                            initializer=_lowest_priority)
        return self.loop.run_in_executor(self._pool, fn, *args)

    async def start(self):
        loop = self.loop = asyncio.get_running_loop()
        self.refusals = RefusalLog(loop.call_later)
        self.held = HeldConnections(loop.call_later)
        self.refused = self.refusals.counts
        self.limits.overrides = await _resolve_overrides(
            loop, self.config.max_connections_per_ip_overrides)
        host, port = self.config.listen
        bootstrap = list(self.config.bootstrap_servers)
        # bound (and listening: connections wait in the kernel's queue) now;
        # served once the layout is known to serve the cluster's nodes
        listener = Listener(self, "bootstrap", bound_socket(host, port, reuse_port=self.reuse_port),
                            lambda: bootstrap)
        try:
            listen_port = listener.address[1]
            self.node_ports.bootstrap_port = listen_port
            self.sni_port = self.sni.port if self.sni is not None and self.sni.port else listen_port
            if self.authenticates_clients:
                self.api_versions.refresh()  # before the first client asks
            if self.discovery is not None:
                self.discovery.start()
                # the nodes the cluster names now must each have a port: a
                # layout that cannot serve them is refused here, not client by
                # client
                nodes = await self.discovery.first_answer(
                    self.config.upstream_connect_timeout_ms / 1000.0)
                unmapped = self.unmapped(nodes or ())
                if unmapped:
                    raise ValueError("the cluster names %s: %s" % (
                        ", ".join("node %d" % e.node_id for e in unmapped),
                        "; ".join(str(e) for e in unmapped)))
            await listener.start()
        except BaseException:
            listener.close()
            raise
        self.listeners[None] = listener
        self._sweeper = loop.create_task(self._sweep())
        if self.sni is not None:
            layout = "every node on this port by TLS server name %s" % self.sni.text
        else:
            layout = self.node_ports.describe() or "no node port"
        log.info(
            "listening on %s:%d for bootstrap, brokers %s; %s%s",
            *self.bootstrap_address, ",".join("%s:%d" % a for a in bootstrap), layout,
            "; PROXY protocol headers expected" if self.proxy_protocol else "",
        )

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
            port = self.node_ports.port(node_id)
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
                lambda: ClientConnection(self, name, route()), sock=sock)
        return _Acceptor(self, sock, name, route)

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
        _Acceptor._handshake); live ones keep the one they began with."""
        self.ssl_context = self._with_sni(loaded.context)

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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


def _lowest_priority():
    """The key-derivation worker yields the CPU to everything else (Linux
    takes a thread id for a process id here): logins that fail by the
    thousand then slow down each other, not the traffic."""
    import os
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as exc:
        log.debug("key-derivation worker keeps its priority: %s", exc)


class _Acceptor(asyncio.AbstractServer):
    """A listener of the proxy's own (TLS, or the PROXY protocol): accepts;
    with the PROXY protocol reads the header first (bounded by
    handshake-timeout-ms) and takes the client's address from it; applies
    the address's connection_creation_rate and the connection limits; runs
    the TLS handshake (bounded by handshake-timeout-ms) before the
    connection is handed to a ClientConnection. A missing or invalid
    header, or a handshake that fails, is a refusal."""

    def __init__(self, server, sock, name, route):
        self.server = server
        self.sockets = [sock]
        self.name = name
        self.route = route
        self._handshakes = set()
        self._task = server.loop.create_task(self._accept())

    async def _accept(self):
        loop = self.server.loop
        sock = self.sockets[0]
        while True:
            try:
                client, address = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, say: wait, as a listener does
                log.error("%s listener cannot accept: %s", self.name, exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handshake(client, address))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, client, address):
        server = self.server
        ip = address[0]
        peer = "%s:%s" % address[:2]
        if server.proxy_protocol:
            introduced = await self._introduction(client, address, peer)
            if introduced is None:
                return
            ip, peer = introduced
        # before the TLS handshake, as a broker checks it on accept
        if (server.over_connection_rate(ip, peer, self.name, client.close)
                or server.over_failed_logins(ip, peer, self.name, client.close)):
            if server.proxy_protocol:
                server.limits.unreserve()
            return
        if server.proxy_protocol:
            over = server.limits.admit_reserved(ip)
        else:
            over = server.limits.admit(ip)
        if over is not None:
            client.close()
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), *over)
            return
        conn = server.connection_class(server, self.name, self.route())
        conn.counted = True
        if server.proxy_protocol:
            conn.peer, conn.address = peer, ip
        tls = server.ssl_context
        try:
            if tls is None:
                await server.loop.connect_accepted_socket(lambda: conn, client)
            else:
                await server.loop.connect_accepted_socket(
                    lambda: conn, client, ssl=tls,
                    ssl_handshake_timeout=server.config.handshake_timeout_ms / 1000.0)
        except asyncio.CancelledError:
            server.limits.release(ip)
            client.close()
            raise
        except Exception as exc:  # ssl.SSLError, a timeout, the client closing
            server.limits.release(ip)
            client.close()
            if tls is None:
                log.info("connection from %s (%s listener) lost at once: %s", peer, self.name, exc)
                return
            server.tls_handshakes["failed"] += 1
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), TLS_HANDSHAKE,
                                    "TLS handshake failed: %s" % _tls_error(exc))
            return
        if tls is not None:
            server.tls_handshakes["completed"] += 1

    async def _introduction(self, client, address, peer):
        """The PROXY protocol header: (client address, peer shown in logs),
        the socket's own when the header names no client (a balancer's
        health check: v2 LOCAL, v1 UNKNOWN); None when the connection was
        refused (no valid header in time). Counted against max-connections
        meanwhile, and against max-connections-per-ip once the client is
        known."""
        server = self.server
        over = server.limits.reserve()
        if over is not None:
            client.close()
            server.refusals.refused(address[0], "%s (%s listener)" % (peer, self.name), *over)
            return None
        timeout = server.config.handshake_timeout_ms / 1000.0
        try:
            header = await asyncio.wait_for(_read_proxy_header(server.loop, client), timeout)
        except asyncio.CancelledError:
            server.limits.unreserve()
            client.close()
            raise
        except (asyncio.TimeoutError, ProtocolError, OSError) as exc:
            server.limits.unreserve()
            client.close()
            if isinstance(exc, asyncio.TimeoutError):
                why = ("no PROXY protocol header within handshake-timeout-ms (%d ms)"
                       % round(timeout * 1000))
            elif isinstance(exc, ProtocolError):
                why = str(exc)
            else:
                why = "the connection failed before its PROXY protocol header: %s" % exc
            server.refusals.refused(address[0], "%s (%s listener, --proxy-protocol)"
                                    % (peer, self.name), PROXY_PROTOCOL, why)
            return None
        if header.source is None:
            return address[0], peer
        return header.source[0], "%s:%d" % header.source

    def close(self):
        self._task.cancel()
        for task in self._handshakes:
            task.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self):
        await asyncio.gather(self._task, *self._handshakes, return_exceptions=True)

    def get_loop(self):
        return self.server.loop

    def is_serving(self):
        return not self._task.done()

    async def start_serving(self):
        pass

    async def serve_forever(self):
        await self._task


async def _read_proxy_header(loop, sock):
    """Read a PROXY protocol header off an accepted socket, and not one
    byte more: what follows is the client's (a TLS ClientHello, say), for
    the transport made next. The bytes are peeked at; those of an
    unfinished header are taken off the socket, and of a finished one
    exactly its length."""
    sock.setblocking(False)
    taken = b""
    while True:
        await _readable(loop, sock)
        try:
            data = sock.recv(max(1, PROXY_HEADER_MAX_SIZE - len(taken)), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        if not data:
            raise ProtocolError("the client closed the connection before sending a PROXY "
                                "protocol header%s" % (" (%d bytes of one)" % len(taken)
                                                       if taken else ""))
        header = parse_proxy_header(taken + data)
        if header is None:  # every byte so far is header
            taken += sock.recv(len(data))
            continue
        rest = header.length - len(taken)
        if rest:
            sock.recv(rest)  # there already (peeked): the call takes exactly that
        return header


async def _readable(loop, sock):
    ready = loop.create_future()

    def wake():
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _note_server_name(ssl_object, server_name, context):
    """sni_callback: the TLS server name the client asked for, kept on the
    connection's SSLObject for RoutedConnection (None: none sent, as when a
    client connects by IP address)."""
    ssl_object.kthrottle_server_name = server_name


def _tls_error(exc):
    if isinstance(exc, asyncio.TimeoutError) or "timed out" in str(exc):
        return "not finished within handshake-timeout-ms"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)) or not str(exc):
        return "the client closed the connection (%s; a client that does not trust the " \
               "proxy's certificate, or that does not speak TLS)" % type(exc).__name__
    return str(exc)


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


class ApiVersionsCache:
    """The API version ranges a broker offers, for a proxy that answers
    ApiVersions itself before a client has authenticated (and so before it
    has a broker connection). Asked of a bootstrap broker with ApiVersions,
    which a broker answers before any SASL exchange (KIP-511), over the
    upstream TLS settings; asked again when older than REFRESH_SECONDS."""

    REFRESH_SECONDS = 300.0
    MAX_ANSWER = 1 << 20  # an ApiVersions answer is a few hundred bytes

    def __init__(self, server):
        self.server = server
        self._ranges = None
        self._at = None
        self._fetching = None

    @property
    def current(self):
        """The ranges (None while unknown); an old answer is refreshed in the
        background while it goes on being used."""
        if self._at is not None and self.server.loop.time() - self._at > self.REFRESH_SECONDS:
            self.refresh()
        return self._ranges

    def refresh(self):
        if self._fetching is None or self._fetching.done():
            self._fetching = self.server.loop.create_task(self._ask())
            self._fetching.add_done_callback(_retrieved)
        return self._fetching

    def fetch(self):
        """An awaitable of the ranges, asked for now if none are known."""
        return asyncio.shield(self.refresh())

    def close(self):
        if self._fetching is not None:
            self._fetching.cancel()

    async def _ask(self):
        try:
            ranges = await ask_bootstrap(self.server, api_versions_request(1),
                                         parse_api_versions, "ApiVersions")
        except ConnectionError as exc:
            log.warning("no broker answered ApiVersions: %s", exc)
            raise
        ranges = self.advertised(ranges)
        self._ranges, self._at = ranges, self.server.loop.time()
        return ranges

    def advertised(self, ranges):
        """The broker's ranges as the proxy's filters advertise them (the
        admin API lists what it answers itself, ``api_ranges``)."""
        for f in self.server.filter_table.filters:
            api_ranges = getattr(f, "api_ranges", None)
            if api_ranges is not None:
                ranges = api_ranges(ranges)
        return ranges


async def ask_bootstrap(server, request, parse, what):
    """Send one request to the first bootstrap broker that takes a
    connection (over the upstream TLS settings), and return ``parse`` of its
    answer; ConnectionError, saying why, when none answers."""
    config = server.config
    timeout = config.upstream_connect_timeout_ms / 1000.0
    tls = server.upstream_ssl_context
    errors = []
    for host, port in config.bootstrap_servers:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls else None), timeout)
            writer.write(request)
            size = INT32.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))[0]
            if not MIN_RESPONSE_SIZE <= size <= ApiVersionsCache.MAX_ANSWER:
                raise ProtocolError("a %s answer of %d bytes" % (what, size))
            body = await asyncio.wait_for(reader.readexactly(size), timeout)
            return parse(INT32.pack(size) + body)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                ProtocolError) as exc:
            errors.append("%s:%s %s" % (host, port, exc or type(exc).__name__))
        finally:
            if writer is not None:
                writer.close()
    raise ConnectionError("; ".join(errors) or "no broker address")


class NodeDiscovery:
    """Opens the node listeners at start, from a Metadata request of the
    proxy's own to a bootstrap broker, and again every REFRESH_SECONDS: a
    proxy restarted under running clients has their node listeners before
    any of them asks for metadata again (a client with the cluster's
    metadata cached reconnects to the node ports it knows, and some, such as
    aiokafka, never fall back to the bootstrap address). Not possible
    towards brokers that require SASL (Metadata needs authentication there):
    then the listeners open with the first Metadata a client gets."""

    REFRESH_SECONDS = 300.0
    RETRY_SECONDS = 2.0

    def __init__(self, server):
        self.server = server
        self._task = None
        self._first = None  # the first ask's nodes (None if it failed), while start waits

    def start(self):
        self._first = self.server.loop.create_future()
        self._task = self.server.loop.create_task(self._run())

    async def first_answer(self, timeout):
        """The nodes the first ask named (None when it failed or took longer
        than ``timeout``: the listeners then open as the answers come). With
        nodes that have no port it does not go on: the caller refuses to
        start."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._first), timeout)
        except asyncio.TimeoutError:
            self._first.cancel()  # an answer from now on is learned as any later one
            return None

    async def _run(self):
        server = self.server
        failing = None  # why the last ask failed: logged once, not at every retry
        while True:
            try:
                nodes = await ask_bootstrap(server, metadata_request(1), parse_metadata_brokers,
                                            "Metadata")
            except ConnectionError as exc:
                if not self._first.done():
                    self._first.set_result(None)
                if failing is None:
                    log.warning("cannot ask a bootstrap broker for its nodes (%s): their "
                                "listeners open with the first Metadata a client gets; "
                                "asking again every %g s", exc, self.RETRY_SECONDS)
                failing = exc
                await asyncio.sleep(self.RETRY_SECONDS)
                continue
            if failing is not None:
                log.info("a bootstrap broker named its nodes: %s",
                         ", ".join("%d" % n.node_id for n in nodes) or "none")
                failing = None
            if not self._first.done():
                self._first.set_result(nodes)
                if server.unmapped(nodes):
                    return  # the proxy does not start
            server.learn_nodes(nodes)
            await asyncio.sleep(self.REFRESH_SECONDS)

    def close(self):
        if self._task is not None:
            self._task.cancel()


def _retrieved(task):
    if not task.cancelled():
        task.exception()  # seen: a failed refresh is logged, not an unretrieved error


def tls_context(config):
    """The listeners' TLS: certificate and key, and client certificates
    checked against ``ssl_ca`` as Kafka's ssl.client.auth says."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.ssl_cert, config.ssl_key)
        if config.ssl_ca:
            context.load_verify_locations(config.ssl_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the listeners' TLS certificate, key or CA (%s, %s, %s): %s"
                         % (config.ssl_cert, config.ssl_key, config.ssl_ca, exc)) from None
    context.verify_mode = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL,
                           "required": ssl.CERT_REQUIRED}[config.ssl_client_auth]
    return context


def certificate_subject(der):
    """A certificate's subject as Kafka writes it: Java's
    X500Principal.getName() (RFC 2253, most specific first:
    CN=alice,OU=team,O=org; emailAddress and other types without an RFC 2253
    keyword as OID=#hex), what ssl.principal.mapping.rules match (KIP-371)."""
    from cryptography import x509

    from ..policy.principal import x500_principal_name

    return x500_principal_name(x509.load_der_x509_certificate(der).subject)


def upstream_tls_context(config):
    """TLS towards the brokers: their certificates checked (host names too,
    as Kafka's ssl.endpoint.identification.algorithm=https), and the proxy's
    own certificate for brokers that require one."""
    import ssl

    try:
        context = ssl.create_default_context(cafile=config.upstream_ssl_ca)
        if config.upstream_ssl_cert:
            context.load_cert_chain(config.upstream_ssl_cert, config.upstream_ssl_key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the upstream TLS CA or certificate (%s, %s): %s"
                         % (config.upstream_ssl_ca, config.upstream_ssl_cert, exc)) from None
    return context


# TLS material followed live --------------------------------------------------

class LoadedTls(NamedTuple):
    context: object  # an ssl.SSLContext
    certificate: str  # its certificate's subject and expiry, for log lines


class TlsFiles(FollowedFile):
    """A certificate (chain), its key and a CA bundle, PEM files followed
    live as the quota file is (FollowedFile: by content, a version taken
    once two reads agree). A version whose files load together is handed
    on (``on_update(LoadedTls)``) for new connections to use; one that does
    not (a file unreadable or not PEM, a key that does not match the
    certificate) is logged once and the last good one stays in force.
    ``reload()`` (SIGHUP) looks at once."""

    noun = "TLS certificate and key"

    def __init__(self, what, paths, build, logger=log, poll_interval=1.0):
        super().__init__(_PemFiles(paths, build), "%s (%s)" % (what, ", ".join(paths)),
                         poll_interval)
        self.log = logger

    def summary(self, loaded):
        return loaded.certificate


class _PemFiles:
    """TlsFiles' store: the files' content tells a version; ``build()``
    loads them from their paths (Python's ssl reads a key only from a
    file), so a change between the two is a new version, loaded next."""

    kind = "TLS file"

    def __init__(self, paths, build):
        self.paths = list(paths)
        self.build = build

    def read_bytes(self):
        parts = [read_file_bytes(path, self.kind) for path in self.paths]
        return b"".join(len(part).to_bytes(8, "big") + part for part in parts)

    def signature(self):
        return tuple(stat_signature(path) for path in self.paths)

    def parse(self, data):
        from cryptography import x509

        from ..policy.principal import x500_principal_name

        pem = data[8:8 + int.from_bytes(data[:8], "big")]  # the certificate file
        try:
            cert = x509.load_pem_x509_certificates(pem)[0]
        except ValueError:
            raise QuotaStoreError("%s holds no PEM certificate" % self.paths[0]) from None
        try:
            context = self.build()
        except ValueError as exc:
            raise QuotaStoreError(str(exc)) from None
        return LoadedTls(context, "%s, valid until %s" % (
            x500_principal_name(cert.subject) or "no subject",
            cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%S UTC")))
