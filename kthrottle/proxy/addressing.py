"""How clients are sent to one broker through the proxy: a port per node id
(``--node-ports``, ``--node-port-base``), or one TLS port for the whole
cluster and a host name per node id (``--sni-broker-pattern``). Pure: no I/O.
"""
import re

from .limits import UNMAPPED_NODE

NODE_ID = "$(nodeId)"  # Kroxylicious' placeholder in advertisedBrokerAddressPattern
MAX_NODE_ID = 2**31 - 1  # an INT32 on the wire


class UnmappedNode(ValueError):
    """A node id the proxy cannot give an address: the one connection whose
    response named it is closed (``refused``: its reason in
    kthrottle_connections_refused_total)."""

    refused = UNMAPPED_NODE

    def __init__(self, node_id, why):
        super().__init__("node id %d has no port on the proxy: %s" % (node_id, why))
        self.node_id = node_id


class NodePorts:
    """The port that serves node id N: its own in ``ports`` (--node-ports),
    else ``base`` + N (--node-port-base) when a base is in effect; never a
    port outside 1-65535, one the map gives another node, or the bootstrap
    listener's (``bootstrap_port``)."""

    def __init__(self, ports=None, base=None, bootstrap_port=None):
        self.ports = dict(ports or {})
        self.base = base
        self.bootstrap_port = bootstrap_port
        self._mapped = {port: node for node, port in self.ports.items()}

    def port(self, node_id):
        """The port of ``node_id``; UnmappedNode saying why there is none."""
        port = self.ports.get(node_id)
        if port is not None:
            return port
        if self.base is None:
            raise UnmappedNode(node_id, "it is not in --node-ports, and without "
                               "--node-port-base only the nodes listed there have one")
        port = self.base + node_id
        if not 0 < port < 65536:
            raise UnmappedNode(node_id, "node-port-base %d + %d is %d, outside 1-65535; give "
                               "it a port in --node-ports" % (self.base, node_id, port))
        other = self._mapped.get(port)
        if other is not None:
            raise UnmappedNode(node_id, "node-port-base %d + %d is %d, the port --node-ports "
                               "gives node %d" % (self.base, node_id, port, other))
        if port == self.bootstrap_port:
            raise UnmappedNode(node_id, "node-port-base %d + %d is %d, the bootstrap "
                               "listener's port" % (self.base, node_id, port))
        return port

    def describe(self):
        """For the start-up log line."""
        parts = ["node %d on port %d" % item for item in sorted(self.ports.items())]
        if self.base is not None:
            parts.append("node N on port %d+N" % self.base if not parts
                         else "any other node N on %d+N" % self.base)
        return ", ".join(parts)


class SniPattern:
    """``broker-$(nodeId).kafka.example.com[:PORT]``: the host name (and
    port, by default the listener's) a client is given for node N, and the
    node a TLS server name (SNI) asks for."""

    _HOST_CHARS = re.compile(r"^[A-Za-z0-9.-]*$")

    def __init__(self, text, what="sni-broker-pattern"):
        if not isinstance(text, str) or not text:
            raise ValueError("%s must be a host name pattern such as "
                             "'broker-%s.kafka.example.com'" % (what, NODE_ID))
        self.text = text
        host, port = text, None
        if ":" in text:
            host, _, port_text = text.rpartition(":")
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ValueError("%s %r: the part after ':' must be a port, 1-65535"
                                 % (what, text))
            port = int(port_text)
        if host.count(NODE_ID) != 1:
            raise ValueError("%s %r must contain %s exactly once, where the node id goes"
                             % (what, text, NODE_ID))
        self.prefix, self.suffix = host.split(NODE_ID)
        name = self.prefix + "0" + self.suffix
        if (not self._HOST_CHARS.match(self.prefix + self.suffix) or len(name) > 243
                or any(not label or label[0] == "-" or label[-1] == "-" or len(label) > 63
                       for label in name.split("."))):
            raise ValueError("%s %r is not a host name pattern (letters, digits, '-' and "
                             "'.', in labels of 1-63 characters)" % (what, text))
        self.port = port  # None: the listener's port
        self._match = re.compile(re.escape(self.prefix) + r"(0|[1-9][0-9]{0,9})"
                                 + re.escape(self.suffix) + r"\Z", re.IGNORECASE).match

    def host(self, node_id):
        return "%s%d%s" % (self.prefix, node_id, self.suffix)

    def node_id(self, server_name):
        """The node id a TLS server name asks for, or None (no name, or one
        the pattern does not match: the bootstrap)."""
        if not server_name:
            return None
        m = self._match(server_name)
        if m is None:
            return None
        node_id = int(m.group(1))
        return node_id if node_id <= MAX_NODE_ID else None


class Advertised:
    """The address a client is given for each of the cluster's nodes: the
    advertised host and the node's port, or with SNI routing the node's host
    name on the one listen port (known once the bootstrap listener is bound:
    ``listening_on``)."""

    def __init__(self, config):
        self.host = config.effective_advertised_host
        # the port of each node id (--node-ports, --node-port-base)
        self.node_ports = NodePorts(config.node_ports, config.effective_node_port_base,
                                    config.listen[1])
        # SNI routing: node N is a host name on the one listen port
        self.sni = SniPattern(config.sni_broker_pattern) if config.sni_broker_pattern else None
        self.sni_port = None  # the port given with those names (set at start)

    def listening_on(self, port):
        """The bootstrap listener is bound to ``port``."""
        self.node_ports.bootstrap_port = port
        self.sni_port = self.sni.port if self.sni is not None and self.sni.port else port

    def advertise(self, node_id):
        """The address clients are given for upstream node ``node_id``;
        UnmappedNode (a ValueError: the connection whose response named it
        is closed, counted as refused) when it has no port."""
        if self.sni is not None:
            return self.sni.host(node_id), self.sni_port
        return self.host, self.node_ports.port(node_id)

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

    def describe(self):
        """The layout, for the start's log line."""
        if self.sni is not None:
            return "every node on this port by TLS server name %s" % self.sni.text
        return self.node_ports.describe() or "no node port"
