"""The proxy's listeners: one bootstrap address plus one per upstream node id."""
import asyncio
import itertools
import logging
import socket

from ..codecs import ProtocolError
from ..codecs.frames import MIN_RESPONSE_SIZE
from ..codecs.versions import api_versions_request, parse_api_versions
from ..codecs.wire import INT32
from .connection import ClientConnection
from .filters import standard_filters
from .limits import TLS_HANDSHAKE, ConnectionLimits, RefusalLog
from .pipeline import FilterTable

log = logging.getLogger("kthrottle.proxy")


class ProxyServer:
    """Owns the listeners and the node-id -> broker routing table."""

    def __init__(self, config, quotas=None, authenticator=None, storage=None):
        self.config = config
        self.quotas = quotas  # policy QuotaManager, or None: no quota accounting
        self.loop = None
        self.advertised_host = config.effective_advertised_host
        self.node_port_base = config.effective_node_port_base
        self.nodes = {}  # node id -> (host, port) the broker advertises
        self.listeners = {}  # node id -> asyncio Server (None key: bootstrap)
        self.connections = set()
        # who looks at what, per API key and version: built once
        upstream_protocol = config.upstream_security_protocol or "PLAINTEXT"
        upstream_login = None
        if upstream_protocol.startswith("SASL_") and config.sasl_mode != "passthrough":
            from .auth import UpstreamSaslLogin

            upstream_login = UpstreamSaslLogin(config.upstream_sasl_mechanism,
                                               config.upstream_sasl_username,
                                               config.upstream_sasl_password())
        self.api_versions = ApiVersionsCache(self)
        self._pool = None  # the key-derivation worker, made when first needed
        self.authenticates_clients = hasattr(authenticator, "offload")
        if self.authenticates_clients:
            # a proxy that verifies clients itself: PLAIN passwords are
            # checked in the worker, and ApiVersions before authentication
            # is answered from what a broker said
            authenticator.offload = self.offload
            authenticator.api_versions = self.api_versions
        self.filter_table = FilterTable(
            standard_filters(self.advertise, quotas, authenticator, upstream_login, storage))
        self.limits = ConnectionLimits(config.max_connections, config.max_connections_per_ip)
        self.refusals = None  # a RefusalLog once the loop runs
        self.refused = {}  # reason -> connections refused (kthrottle_connections_refused_total)
        self._sweeper = None
        self.storage = storage  # the StorageThrottle filter, or None
        self.ssl_context = tls_context(config) if config.tls_enabled else None
        self.upstream_ssl_context = (
            upstream_tls_context(config)
            if upstream_protocol in ("SSL", "SASL_SSL") else None)
        self.principal_mapper = None
        if config.security_protocol == "SSL":
            from ..policy.principal import PrincipalMapper

            self.principal_mapper = PrincipalMapper(config.ssl_principal_mapping_rules)
        self._ids = itertools.count(1)
        self._starting = set()

    def next_connection_id(self):
        return next(self._ids)

    @property
    def bootstrap_address(self):
        sock = self.listeners[None].sockets[0]
        return sock.getsockname()[:2]

    def advertise(self, node_id):
        """The address clients are given for upstream node ``node_id``."""
        port = self.node_port_base + node_id
        if not 0 < port < 65536:
            raise ValueError(
                "node id %d maps to port %d, outside 1-65535: choose another --node-port-base"
                % (node_id, port)
            )
        return self.advertised_host, port

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
        self.refused = self.refusals.counts
        self.limits.overrides = await _resolve_overrides(
            loop, self.config.max_connections_per_ip_overrides)
        host, port = self.config.listen
        bootstrap = list(self.config.bootstrap_servers)
        sock = _listening_socket(host, port)
        try:
            server = await self._serve(sock, "bootstrap", lambda: bootstrap)
        except BaseException:
            sock.close()
            raise
        self._sweeper = loop.create_task(self._sweep())
        if self.authenticates_clients:
            self.api_versions.refresh()  # before the first client asks
        self.listeners[None] = server
        log.info(
            "listening on %s:%d for bootstrap, brokers %s; node N gets port %d+N",
            *self.bootstrap_address, ",".join("%s:%d" % a for a in bootstrap), self.node_port_base,
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
            if node.node_id not in self.listeners:
                self._open_node_listener(node.node_id)

    def _open_node_listener(self, node_id):
        host, port = self.config.listen[0], self.node_port_base + node_id
        try:
            sock = _listening_socket(host, port)
        except OSError as exc:
            self.listeners[node_id] = None  # do not retry on every response
            log.error("cannot listen for node %d on %s:%d: %s", node_id, host, port, exc)
            return
        self.listeners[node_id] = sock  # replaced by the Server once it runs
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve_node(node_id, sock))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _serve_node(self, node_id, sock):
        server = await self._serve(sock, "node %d" % node_id, lambda: self._node_route(node_id))
        self.listeners[node_id] = server
        log.info(
            "listening on %s:%d for node %d (broker %s:%d)",
            *sock.getsockname()[:2], node_id, *self.nodes[node_id],
        )

    async def _serve(self, sock, name, route):
        """Serve a listening socket: the loop's server for PLAINTEXT; for
        TLS an acceptor of the proxy's own, so that a failed handshake is
        seen with its client's address (the loop's server drops it
        silently), logged and counted like any refusal."""
        if self.ssl_context is None:
            return await self.loop.create_server(
                lambda: ClientConnection(self, name, route()), sock=sock)
        return _TlsAcceptor(self, sock, name, route)

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

    async def close(self):
        if self._sweeper is not None:
            self._sweeper.cancel()
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
        if self.refusals is not None:
            self.refusals.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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


def _listening_socket(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, "%s:%d: %s" % (host, port, exc.strerror or exc)) from None
    return sock


class _TlsAcceptor(asyncio.AbstractServer):
    """A TLS listener: accepts, applies the connection limits, then runs the
    handshake (bounded by handshake-timeout-ms) before the connection is
    handed to a ClientConnection; a handshake that fails is a refusal."""

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
        over = server.limits.admit(ip)
        if over is not None:
            client.close()
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), *over)
            return
        conn = ClientConnection(server, self.name, self.route())
        conn.counted = True
        try:
            await server.loop.connect_accepted_socket(
                lambda: conn, client, ssl=server.ssl_context,
                ssl_handshake_timeout=server.config.handshake_timeout_ms / 1000.0)
        except asyncio.CancelledError:
            server.limits.release(ip)
            client.close()
            raise
        except Exception as exc:  # ssl.SSLError, a timeout, the client closing
            server.limits.release(ip)
            client.close()
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), TLS_HANDSHAKE,
                                    "TLS handshake failed: %s" % _tls_error(exc))

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
        server = self.server
        config = server.config
        timeout = config.upstream_connect_timeout_ms / 1000.0
        tls = server.upstream_ssl_context
        errors = []
        for host, port in config.bootstrap_servers:
            writer = None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None), timeout)
                writer.write(api_versions_request(1))
                size = INT32.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))[0]
                if not MIN_RESPONSE_SIZE <= size <= self.MAX_ANSWER:
                    raise ProtocolError("an ApiVersions answer of %d bytes" % size)
                body = await asyncio.wait_for(reader.readexactly(size), timeout)
                ranges = parse_api_versions(INT32.pack(size) + body)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    ProtocolError) as exc:
                errors.append("%s:%s %s" % (host, port, exc or type(exc).__name__))
                continue
            finally:
                if writer is not None:
                    writer.close()
            self._ranges, self._at = ranges, server.loop.time()
            return ranges
        log.warning("no broker answered ApiVersions: %s", "; ".join(errors))
        raise ConnectionError("; ".join(errors) or "no broker address")


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
