"""The proxy's listeners: one bootstrap address plus one per upstream node id."""
import asyncio
import itertools
import logging
import socket

from .connection import ClientConnection
from .filters import standard_filters
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
        self.filter_table = FilterTable(
            standard_filters(self.advertise, quotas, authenticator, upstream_login, storage))
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

    async def start(self):
        loop = self.loop = asyncio.get_running_loop()
        host, port = self.config.listen
        bootstrap = list(self.config.bootstrap_servers)
        server = await loop.create_server(
            lambda: ClientConnection(self, "bootstrap", bootstrap),
            host, port, reuse_address=True, ssl=self.ssl_context,
        )
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
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self.listeners[node_id] = None  # do not retry on every response
            log.error("cannot listen for node %d on %s:%d: %s", node_id, host, port, exc)
            return
        self.listeners[node_id] = sock  # replaced by the Server once it runs
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve_node(node_id, sock))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _serve_node(self, node_id, sock):
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ClientConnection(self, "node %d" % node_id, self._node_route(node_id)),
            sock=sock, ssl=self.ssl_context,
        )
        self.listeners[node_id] = server
        log.info(
            "listening on %s:%d for node %d (broker %s:%d)",
            *sock.getsockname()[:2], node_id, *self.nodes[node_id],
        )

    def _node_route(self, node_id):
        address = self.nodes.get(node_id)
        return [address] if address else []

    async def close(self):
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
