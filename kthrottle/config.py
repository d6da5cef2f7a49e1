"""Configuration of ``kthrottle proxy``: command-line flags over a TOML file.

Every setting is declared once, as an ``Option`` of one of the groups below
or of a component in ``COMPONENTS``: that gives its flag (``--NAME``), its
TOML key (``NAME``), its ProxyConfig attribute and its default.
"""
import os
import re
import tomllib

from .codecs import DEFAULT_MAX_FRAME_SIZE
from .options import (
    HOST_PORT,
    ClassWithConfig,
    INTEGER,
    NUMBER,
    SWITCH,
    ConfigError,
    HostPorts,
    Option,
    OptionGroup,
    Parsed,
    Text,
    parse_duration,
    parse_host_port,
)
from .security import LISTENER, ZOOKEEPER, ClientSecurityOptions, check_listener

DEFAULT_LISTEN = "127.0.0.1:9092"
# Kafka's sasl.server.max.receive.size: the largest frame accepted before a
# client has authenticated
DEFAULT_SASL_SERVER_MAX_RECEIVE_SIZE = 524288
# Kafka's connections.max.idle.ms
DEFAULT_CONNECTIONS_MAX_IDLE_MS = 600_000
# how long a TLS handshake plus SASL exchange may take from accept
DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000
# how long in-flight requests may take to finish on SIGTERM (Kafka Streams'
# and Kubernetes' 30 s grace period)
DEFAULT_DRAIN_TIMEOUT_MS = 30_000
UPSTREAM_PASSWORD_ENV = "KTHROTTLE_UPSTREAM_SASL_PASSWORD"
DEFAULT_USAGE_TOPIC = "__kthrottle_proxy_usage"
SHARE_FAIL_SAFES = ("last", "equal", "whole")
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_PROXY_ID = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


def parse_admin_listen(value):
    """``[HOST:]PORT``: the admin endpoint binds to 127.0.0.1 unless a host
    is given."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.lstrip(":").isdigit():
        value = "127.0.0.1:" + value.lstrip(":")
    return parse_host_port(value, "admin-listen")


def _listed_pairs(value, split, wrong):
    """A TOML table's items, or ``a,b,...`` split into pairs by ``split``
    (its ConfigError for a bad item); ConfigError(``wrong``) for any other
    value."""
    if isinstance(value, dict):
        return list(value.items())
    if not isinstance(value, str):
        raise ConfigError(wrong)
    return [split(item.strip()) for item in value.split(",") if item.strip()]


def parse_connection_overrides(value):
    """Kafka's max.connections.per.ip.overrides: ``host:N,host:N`` (an
    address or a host name) -> {host: N}; a TOML table works too."""
    def split(item):
        host, sep, count = item.rpartition(":")
        if not sep or not host:
            raise ConfigError("max-connections-per-ip-overrides: %r is not host:N" % item)
        return host.strip("[]"), count

    items = _listed_pairs(value, split, "max-connections-per-ip-overrides must be 'host:N,...', "
                          "got %r" % (value,))
    overrides = {}
    for host, count in items:
        try:
            number = int(count)
        except (TypeError, ValueError):
            number = -1
        if number < 0 or not host:
            raise ConfigError("max-connections-per-ip-overrides: %s needs a connection count "
                              "of 0 or more, got %r" % (host or "a host", count))
        overrides[host] = number
    return overrides


def parse_node_ports(value, what="node-ports"):
    """``ID=PORT,ID=PORT`` (a TOML table {"ID" = PORT} too) -> {node id:
    port}: every port in 1-65535, no port given twice."""
    def split(item):
        node, sep, port = item.partition("=")
        if not sep:
            raise ConfigError("%s: %r is not NODE_ID=PORT" % (what, item))
        return node.strip(), port.strip()

    items = _listed_pairs(value, split, "%s must be 'ID=PORT,...' or a table of node id = port, "
                          "got %r" % (what, value))
    ports = {}
    for node, port in items:
        node_id, number = _whole(node), _whole(port)
        if node_id is None or node_id > 2**31 - 1:
            raise ConfigError("%s: %r is not a node id (0 or more)" % (what, node))
        if number is None or not 0 < number < 65536:
            raise ConfigError("%s: node %d needs a port in 1-65535, got %r" % (what, node_id, port))
        if node_id in ports:
            raise ConfigError("%s: node %d is given twice" % (what, node_id))
        ports[node_id] = number
    taken = {}
    for node_id, port in ports.items():
        if port in taken:
            raise ConfigError("%s: port %d is given to both node %d and node %d"
                              % (what, port, taken[port], node_id))
        taken[port] = node_id
    return ports


def _whole(value):
    """A non-negative int from an int or a string of digits, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def parse_workers(value, what="workers"):
    """``N`` (1 or more) or ``auto``: as many as the CPUs this process may
    run on (its affinity mask, which taskset and cgroup cpusets narrow)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            try:
                return len(os.sched_getaffinity(0))
            except AttributeError:  # not Linux
                return os.cpu_count() or 1
        value = int(text) if text.isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("%s must be a number of processes (1 or more) or \"auto\", got %r"
                          % (what, value))
    return value


def parse_sni_pattern(value, what="sni-broker-pattern"):
    """Checked now (a ConfigError at start); the proxy reads it again."""
    from .proxy.addressing import SniPattern

    try:
        SniPattern(value, what)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return value


QUOTA_SOURCE_KINDS = ("file", "zookeeper", "kafka")
DEFAULT_QUOTA_REFRESH = 10.0  # seconds


def _parse_refresh(value, what):
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError("%s: %s" % (what, exc)) from None


# the proxy's options, in --help's order -------------------------------------------

BOOTSTRAP = Option("bootstrap-server", HostPorts(), attr="bootstrap_servers", default=[],
                   repeat=True, metavar="HOST:PORT",
                   help="an upstream broker to bootstrap from; repeat for several.")
WORKERS = Option("workers", Parsed(parse_workers), default=1, metavar="N|auto",
                 help="processes serving clients (default 1; auto: one per CPU this process "
                 "may use). With more than one, every worker listens on every port "
                 "(SO_REUSEPORT) and the kernel spreads the connections over them; the quotas "
                 "hold across the workers as one, and one worker follows the cluster state "
                 "and the fleet shares and serves --admin-listen for the machine")
MAIN = OptionGroup(None, None, (
    BOOTSTRAP,
    Option("listen", HOST_PORT, default=("127.0.0.1", 9092), metavar="HOST:PORT",
           help="bootstrap address clients connect to (default %s)" % DEFAULT_LISTEN),
    Option("node-port-base", INTEGER, metavar="PORT",
           help="upstream node id N is served on port PORT+N (default: the listen port + 1, "
           "unless --node-ports is given)"),
    Option("node-ports", Parsed(parse_node_ports), default={}, metavar="ID=PORT,...",
           help="a port of its own for each upstream node id listed, e.g. '1=9093,2=9094' "
           "(KRaft node ids can be large and sparse; in TOML a table, [node-ports] \"1\" = "
           "9093); nodes not listed get --node-port-base + id, or, without --node-port-base, "
           "none: a response naming such a node closes its connection"),
    Option("advertised-host", Text("a host name or address"), metavar="HOST",
           help="host written into the broker addresses clients receive (default: the listen "
           "host)"),
    Option("sni-broker-pattern", Parsed(parse_sni_pattern), metavar="PATTERN",
           help="TLS listeners (SSL, SASL_SSL): one port for the whole cluster. Clients are "
           "given node N as this host name with $(nodeId) replaced by N, e.g. "
           "'broker-$(nodeId).kafka.example.com' (optionally ':PORT', default the listen "
           "port), and each connection goes to the node its TLS server name (SNI) names; "
           "any other name goes to the bootstrap brokers. No per-node ports are opened"),
    Option("proxy-protocol", SWITCH, default=False,
           help="the listeners expect a PROXY protocol header (v1 or v2, as HAProxy and cloud "
           "load balancers send it) as each connection's first bytes, before TLS, and take the "
           "client's address from it (max-connections-per-ip, the logs); a connection without "
           "a valid one within handshake-timeout-ms is refused"),
    Option("max-frame-size", INTEGER, default=DEFAULT_MAX_FRAME_SIZE, metavar="BYTES",
           help="largest request accepted; a larger one closes that connection "
           "(default 104857600, Kafka's socket.request.max.bytes)"),
    # Kafka's socket.connection.setup.timeout.ms
    Option("upstream-connect-timeout-ms", INTEGER, default=10_000, metavar="MS",
           help="how long one broker address may take to accept a connection before the next "
           "is tried (default 10000, Kafka's socket.connection.setup.timeout.ms)"),
    WORKERS,
    Option("zero-copy", SWITCH, default=False,
           help="Linux, plaintext connections: the rest of a large request or response that "
           "nothing needs to read (64 KiB or more, the connection not throttled) goes from "
           "socket to socket with splice(2) instead of through the proxy's memory; "
           "kthrottle_zero_copy_bytes_total counts it (default off)"),
))

QUOTAS = OptionGroup("quotas (KIP-55 <user, client-id> byte-rate and request-rate quotas)", None, (
    Option("quota-file", metavar="PATH",
           help="TOML file of quotas, re-read when it changes (see kthrottle quotas --help)"),
    ZOOKEEPER.replace(help="read quotas from ZooKeeper in Kafka's layout (/config/users, "
                      "/config/clients) and follow its change notifications"),
    Option("quota-source", choices=QUOTA_SOURCE_KINDS, metavar="SOURCE",
           help="where the quotas are kept: file (--quota-file), zookeeper (--zookeeper) or "
           "kafka: the cluster itself, read with DescribeClientQuotas (KIP-546) from "
           "--bootstrap-server with the upstream security settings below, every "
           "--quota-refresh; AlterClientQuotas sent to the proxy goes on to the cluster "
           "(default: file with --quota-file, zookeeper with --zookeeper)"),
    Option("quota-refresh", Parsed(_parse_refresh), default=DEFAULT_QUOTA_REFRESH,
           metavar="DURATION",
           help="quota-source kafka: how often the cluster's quotas are read again, e.g. 10s, "
           "500ms (default 10s); while the cluster cannot be read the last quotas stay in force"),
    Option("cluster-state-znode", default="/kthrottle/cluster-state", metavar="PATH",
           help="where the Spark job's cluster state and quota shares are (default "
           "/kthrottle/cluster-state, under the --zookeeper chroot)"),
    Option("cluster-state-topic", metavar="NAME",
           help="follow the cluster state and the quota shares in this compacted topic of the "
           "upstream cluster instead (kthrottle spark-sync without --zookeeper writes "
           "__kthrottle_cluster_state): keys cluster-state and shares/<proxy-id>, read from "
           "--bootstrap-server with the upstream security settings below, from the beginning "
           "and then live, no consumer group. For --storage-scope and --proxy-id without "
           "ZooKeeper (Kafka 4); --zookeeper may still hold the quotas. Off unless given"),
    Option("admin-listen", Parsed(lambda value, what: parse_admin_listen(value)),
           metavar="[HOST:]PORT",
           help="serve the admin endpoint here: /metrics (Prometheus), /healthz and /readyz "
           "(probes), /quotas (JSON) and the status page at /; on 127.0.0.1 unless a host is "
           "given; off unless given"),
    # /quotas (principals, client-ids) behind a bearer token and/or mTLS
    Option("admin-token-file", metavar="PATH",
           help="file holding a bearer token that /quotas requires (Authorization: Bearer ...); "
           "/quotas names every connected principal and client-id"),
    Option("admin-ssl-cert", metavar="PEM",
           help="serve the admin endpoint over HTTPS with this certificate (chain)"),
    Option("admin-ssl-key", metavar="PEM", help="its private key"),
    Option("admin-ssl-ca", metavar="PEM",
           help="CA bundle of the client certificates that /quotas then requires (mTLS); "
           "/metrics stays readable without one"),
    # a bound on /metrics' label cardinality (proxy/admin.py DEFAULT_MAX_ENTITIES)
    Option("metrics-max-entities", INTEGER, default=1000, metavar="N",
           help="quota entities (user, client-id pairs) given series in /metrics, the first "
           "met; the others are counted in kthrottle_metrics_omitted_entities (default 1000)"),
    Option("quota-callback", ClassWithConfig(), metavar="MODULE:CLASS",
           help="a quota callback with KIP-257's shape (ClientQuotaCallback) deciding which "
           "bucket each client counts in and its limit, in place of the KIP-55 levels and "
           "quota groups: module:Class on the import path, or path/to/file.py:Class; in TOML "
           "a [quota-callback] table with class = \"module:Class\" and a [quota-callback.config] "
           "table given to its configure(). Built in: kthrottle.policy.quota_callback:"
           "LeaderProportional (a quota split among brokers by the partitions they lead). A "
           "callback that cannot be loaded stops the start; one that fails while serving closes "
           "the connection that asked (default: none)"),
    Option("shared-produce-capacity", NUMBER, metavar="BYTES",
           help="a produce capacity in bytes/s shared by the producers in use, by weighted "
           "max-min fairness: every second each producer_byte_rate bucket used in the last 2 s "
           "gets its part, weighted by its quota (the quotas then split the capacity rather "
           "than cap each client); a bucket using less than its part leaves the rest to the "
           "others, and an idle one's part goes to the busy ones. Only clients with a quota "
           "share it (users/<default> gives every user one); in a fleet (--proxy-id) the "
           "capacity is reported as one more bucket and this proxy shares the part the fleet "
           "gives it; off unless given"),
    Option("shared-fetch-capacity", NUMBER, metavar="BYTES",
           help="the same for consumer_byte_rate: a fetch capacity in bytes/s shared by the "
           "consumers in use; off unless given"),
    Option("quota-mode", default="token-bucket", choices=("token-bucket", "window"),
           help="token-bucket (default): burst allowance of --quota-burst-seconds, then held to "
           "the quota; window: exactly Kafka's sampled windows and X = (O - T) / T x W"),
    Option("quota-window-num", INTEGER, default=11, metavar="N",
           help="samples in the rate window, Kafka's quota.window.num (default 11)"),
    Option("quota-window-size-seconds", NUMBER, default=1.0, metavar="S",
           help="length of one sample, Kafka's quota.window.size.seconds (default 1)"),
    Option("max-throttle-ms", INTEGER, metavar="MS",
           help="longest byte-rate delay for one response (default: the measured window W, "
           "10-11 s; Kafka leaves byte-rate throttles uncapped). Request-rate delays are capped "
           "at one quota window, as in Kafka"),
    Option("quota-burst-seconds", NUMBER, default=1.0, metavar="S",
           help="token-bucket mode: burst allowance in seconds of quota (default 1)"),
    Option("quota-observe-only", SWITCH, default=False,
           help="a dry run of the whole quota source: every quota is measured and what it would "
           "have done is reported (kthrottle_observe_only_throttles_total, /quotas), but no "
           "client is delayed; one entity at a time: its observe_only=1 quota key "
           "(kthrottle quotas alter --observe-only)"),
))

# fleet-wide quotas: with a proxy id this proxy publishes its usage and
# applies its share of each quota (the shares the Spark job writes to
# <cluster-state-znode>/shares/<proxy-id> in --zookeeper)
FLEET = OptionGroup(
    "fleet-wide quotas (several proxies in front of one cluster share each quota; "
    "kthrottle spark-sync computes the shares)", None, (
        Option("proxy-id", metavar="ID",
               help="make this proxy a member of a fleet: each quota holds for the whole fleet, "
               "this proxy applying its share of it. It publishes its "
               "usage (per quota bucket: quota, rate, demand) every --usage-interval, keyed by "
               "ID, and applies the shares the Spark job writes, live: key shares/ID of "
               "--cluster-state-topic, or <cluster-state-znode>/shares/ID in --zookeeper (one "
               "of them needed); a bucket without a share yet gets the document's prior "
               "fraction of its quota. [A-Za-z0-9._-], unique in the fleet. Without it the "
               "configured quotas apply as they are"),
        Option("usage-interval", INTEGER, attr="usage_interval_ms", default=5000, metavar="MS",
               help="how often the usage report is published (default 5000)"),
        Option("usage-topic", default=DEFAULT_USAGE_TOPIC, metavar="NAME",
               help="compacted topic of the usage reports (default __kthrottle_proxy_usage; "
               "created if missing, with the upstream security settings below)"),
        Option("share-max-age-ms", INTEGER, default=60_000, metavar="MS",
               help="shares older than this (or none yet) are unknown and the fail-safe "
               "applies (default 60000)"),
        Option("share-fail-safe", default="last", choices=SHARE_FAIL_SAFES,
               help="what applies while the shares are unknown: last (default) keeps the last "
               "shares (the configured quotas if there were none); equal gives each bucket its "
               "quota / the number of proxies last seen; whole the configured quota"),
    ))

# towards the brokers; the protocol's default: PLAINTEXT, or in passthrough
# mode the client side's (validate() fills it in)
UPSTREAM = ClientSecurityOptions(
    "upstream-", who="the proxy", password_env=UPSTREAM_PASSWORD_ENV,
    title="towards the brokers", protocol_default=None,
    protocol_help=" (with the proxy's own SASL identity below in terminate mode; in "
    "passthrough mode SASL_PLAINTEXT or SASL_SSL, by default the client side's)",
    extra_mechanisms=("OAUTHBEARER",))  # its options: the upstream login filter's

# limits of every listener (Kafka's names; None: no limit)
LIMITS = OptionGroup(
    "limits of every listener (Kafka's names and defaults; a connection over a limit is "
    "closed at once, with a log line and kthrottle_connections_refused_total)", None, (
        Option("sasl-server-max-receive-size", INTEGER,
               default=DEFAULT_SASL_SERVER_MAX_RECEIVE_SIZE, metavar="BYTES",
               help="largest frame accepted before the client has authenticated (default "
               "524288, Kafka's sasl.server.max.receive.size); --max-frame-size applies after"),
        Option("connections-max-idle-ms", INTEGER, default=DEFAULT_CONNECTIONS_MAX_IDLE_MS,
               metavar="MS", help="close a connection on which nothing has moved for this long "
               "(default 600000, Kafka's connections.max.idle.ms)"),
        Option("handshake-timeout-ms", INTEGER, default=DEFAULT_HANDSHAKE_TIMEOUT_MS,
               metavar="MS", help="close a connection whose TLS handshake and SASL "
               "authentication have not both finished this long after it was accepted "
               "(default 10000)"),
        Option("max-connections", INTEGER, metavar="N",
               help="open client connections allowed at once, all listeners together (Kafka's "
               "max.connections; default: no limit)"),
        Option("max-connections-per-ip", INTEGER, metavar="N",
               help="open client connections allowed from one source address (Kafka's "
               "max.connections.per.ip; default: no limit)"),
        Option("max-connections-per-ip-overrides", default={}, metavar="HOST:N,...",
               kind=Parsed(lambda value, what: parse_connection_overrides(value)),
               help="per-address exceptions to --max-connections-per-ip, e.g. "
               "'10.0.0.5:200,batch.example.com:50' (Kafka's max.connections.per.ip.overrides; "
               "host names are resolved at start)"),
    ))

LIFECYCLE = OptionGroup(
    "stopping and reloading",
    "SIGTERM (or SIGINT) stops gracefully: every listener stops accepting, so new "
    "connections are refused; no connection reads a request after the one it is reading "
    "(as a Kafka broker shutting down stops reading requests: a client sends what was not "
    "read again, elsewhere); each connection is closed as soon as its client has every "
    "response it is owed, one owed none at once; then the process exits 0. A second "
    "SIGTERM closes what is left at once. SIGHUP re-reads --quota-file, --credentials-file "
    "and the TLS certificate, key and CA of the listeners and of the admin endpoint, each "
    "also re-read when its file changes: live connections stay up, new ones use the new "
    "material; a file that does not load is logged and the material in force stays.", (
        # SIGTERM: how long in-flight requests may take to finish before the
        # connections still waiting are closed
        Option("drain-timeout-ms", INTEGER, default=DEFAULT_DRAIN_TIMEOUT_MS, metavar="MS",
               help="how long a graceful stop waits for the responses still owed before it "
               "closes the connections waiting for them (default 30000; 0 closes them at "
               "once)"),
    ))

CORE_GROUPS = (MAIN, QUOTAS, LISTENER, FLEET, UPSTREAM.group, LIMITS, LIFECYCLE)

# Components that read options of their own: classes with an ``options``
# attribute (a tuple of Option) and an ``options_title`` (their --help group's
# title; ``options_description`` too if they have one). None: the filters
# registered in proxy/filters (a test may name others).
COMPONENTS = None


def components():
    if COMPONENTS is not None:
        return COMPONENTS
    from .proxy.filters import REGISTERED

    return REGISTERED


def component_option_groups():
    """The option groups of the components."""
    return [OptionGroup(cls.options_title, getattr(cls, "options_description", None),
                        cls.options) for cls in components() if getattr(cls, "options", ())]


def option_groups():
    """Every group of ``kthrottle proxy`` / ``local``: the core's, then the
    components'."""
    return list(CORE_GROUPS) + component_option_groups()


def _declared():
    """{attr: Option} of every option."""
    return {o.attr: o for g in option_groups() for o in g.options}


class ProxyConfig:
    """The proxy's settings: one attribute per declared option (core and
    components), given as keywords or defaulted."""

    def __init__(self, **values):
        declared = _declared()
        unknown = sorted(set(values) - set(declared))
        if unknown:
            raise TypeError("ProxyConfig has no setting %s" % ", ".join(unknown))
        for attr, option in declared.items():
            setattr(self, attr, values[attr] if attr in values else option.default_value())

    def __repr__(self):
        return "ProxyConfig(%s)" % ", ".join("%s=%r" % item for item in vars(self).items())

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)

    def upstream_security(self):
        """The proxy's security towards the brokers (KafkaClientSecurity),
        checked; in sasl-mode passthrough without a SASL identity of its own
        (the client's exchange authenticates the broker connection)."""
        return UPSTREAM.resolve(vars(self), own_sasl=not self.passthrough)

    def upstream_sasl_password(self):
        """From --upstream-sasl-password-file, else the environment variable
        KTHROTTLE_UPSTREAM_SASL_PASSWORD; never from a flag."""
        return UPSTREAM.password(vars(self))

    @property
    def passthrough(self):
        return self.sasl_enabled and self.sasl_mode == "passthrough"

    @property
    def fleet_enabled(self):
        """A fleet member: publishes its usage, applies its quota shares."""
        return bool(self.proxy_id)

    @property
    def tls_enabled(self):
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def sasl_enabled(self):
        return self.security_protocol.startswith("SASL_")

    def quota_settings(self):
        from .policy.quotas import QuotaSettings

        try:
            return QuotaSettings(
                samples=self.quota_window_num,
                window=self.quota_window_size_seconds,
                max_throttle=None if self.max_throttle_ms is None else self.max_throttle_ms / 1000.0,
                mode=self.quota_mode,
                burst_seconds=self.quota_burst_seconds,
                observe_only=bool(self.quota_observe_only),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def effective_node_port_base(self):
        """node-port-base, or by default the listen port + 1; None with
        --node-ports alone (only the nodes listed there have a port) or with
        --sni-broker-pattern (no per-node ports)."""
        if self.node_port_base is not None:
            return self.node_port_base
        if self.node_ports or self.sni_broker_pattern:
            return None
        return self.listen[1] + 1

    @property
    def effective_advertised_host(self):
        return self.advertised_host or self.listen[0]

    def validate(self):
        if not self.bootstrap_servers:
            raise ConfigError("no upstream cluster: give --bootstrap-server HOST:PORT")
        if self.advertised_host is None and self.listen[0] in ("0.0.0.0", "::", ""):
            raise ConfigError(
                "--advertised-host is required when listening on a wildcard address (%s)"
                % self.listen[0]
            )
        if self.max_frame_size <= 0:
            raise ConfigError("max-frame-size must be a positive number of bytes")
        if self.upstream_connect_timeout_ms <= 0:
            raise ConfigError("upstream-connect-timeout-ms must be a positive number of ms")
        for name in ("shared_produce_capacity", "shared_fetch_capacity"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError("%s must be a positive byte rate, got %r"
                                  % (name.replace("_", "-"), value))
        if (self.shared_produce_capacity or self.shared_fetch_capacity) \
                and not (self.quota_file or self.zookeeper or self.quota_source
                         or self.quota_callback):
            raise ConfigError("a shared capacity is split by the clients' quotas (their weights): "
                              "give a quota source (--quota-file, --zookeeper or "
                              "--quota-source kafka) or --quota-callback")
        if self.drain_timeout_ms < 0:
            raise ConfigError("drain-timeout-ms must not be negative, got %r"
                              % self.drain_timeout_ms)
        if self.node_port_base is not None and not 0 < self.node_port_base < 65536:
            raise ConfigError("node-port-base must be a port number")
        if self.workers > 1 and self.listen[1] == 0:
            raise ConfigError("workers %d: every worker listens on the same ports; give --listen "
                              "a port other than 0" % self.workers)
        self._validate_addressing()
        self._validate_quota_source()
        check_listener(self)
        passthrough = self.passthrough
        if passthrough and self.quota_source == "kafka":
            raise ConfigError("quota-source kafka: the proxy reads the quotas from the cluster as "
                              "itself, and in sasl-mode passthrough it has no SASL identity of "
                              "its own; use sasl-mode terminate with --upstream-sasl-username")
        if self.upstream_security_protocol is None:
            self.upstream_security_protocol = self.security_protocol if passthrough else "PLAINTEXT"
        if passthrough:
            if self.upstream_security_protocol not in ("SASL_PLAINTEXT", "SASL_SSL"):
                raise ConfigError("sasl-mode passthrough relays the client's SASL exchange to the "
                                  "brokers: upstream-security-protocol must be SASL_PLAINTEXT or "
                                  "SASL_SSL, got %r" % self.upstream_security_protocol)
            if self.credentials_file:
                raise ConfigError("credentials-file is for sasl-mode terminate; in passthrough "
                                  "mode the brokers verify the clients")
            if self.upstream_sasl_username or self.upstream_sasl_password_file:
                raise ConfigError("upstream-sasl-username and upstream-sasl-password-file are for "
                                  "sasl-mode terminate; in passthrough mode the client's own "
                                  "SASL exchange authenticates the broker connection")
        elif self.sasl_enabled:
            # OAUTHBEARER alone needs no credentials: the JWKS checks the tokens
            if (not self.credentials_file and not self.zookeeper
                    and self.sasl_enabled_mechanisms != ["OAUTHBEARER"]):
                raise ConfigError("security-protocol %s in terminate mode needs credentials: "
                                  "--credentials-file, or --zookeeper for the SCRAM credentials "
                                  "Kafka keeps there" % self.security_protocol)
        elif self.credentials_file and not getattr(self, "admin_principals", None):
            # with --admin-principals a proxy without SASL may manage the users others verify
            raise ConfigError("credentials-file is for SASL listeners (or, with "
                              "--admin-principals, for the users this proxy manages): give "
                              "--security-protocol SASL_PLAINTEXT or SASL_SSL")
        self.upstream_security()
        for component in components():
            check = getattr(component, "check", None)
            if check is not None:
                check(self)
        if not self.cluster_state_znode.startswith("/") or self.cluster_state_znode.endswith("/"):
            raise ConfigError("cluster-state-znode must be an absolute znode path, got %r"
                              % self.cluster_state_znode)
        self._validate_cluster_state_topic(passthrough)
        self._validate_limits()
        self._validate_admin()
        self._validate_fleet(passthrough)
        self.quota_settings()
        return self

    def _validate_cluster_state_topic(self, passthrough):
        topic = self.cluster_state_topic
        if topic is None:
            return
        if not _TOPIC_NAME.match(topic) or topic in (".", ".."):
            raise ConfigError("cluster-state-topic must be a Kafka topic name ([A-Za-z0-9._-], up "
                              "to 249 characters), got %r" % topic)
        if getattr(self, "storage_scope", None) not in ("cluster", "partition") \
                and not self.proxy_id:
            # a setting that would do nothing is a mistake to say, not to ignore
            raise ConfigError("cluster-state-topic is followed for storage-aware throttling "
                              "(--storage-scope cluster or partition) and fleet shares "
                              "(--proxy-id): give one of them too")
        if passthrough:
            raise ConfigError("cluster-state-topic: the proxy reads the topic as itself, and in "
                              "sasl-mode passthrough it has no SASL identity of its own; use "
                              "sasl-mode terminate with --upstream-sasl-username")

    def _validate_quota_source(self):
        """The quota source named, or inferred as before --quota-source
        existed: --quota-file gives file, --zookeeper zookeeper."""
        source = self.quota_source
        if source is None:
            if self.quota_file and self.zookeeper:
                raise ConfigError("give quota-file or zookeeper, not both")
            source = "file" if self.quota_file else "zookeeper" if self.zookeeper else None
        elif source not in QUOTA_SOURCE_KINDS:
            raise ConfigError("quota-source must be one of %s, got %r"
                              % (", ".join(QUOTA_SOURCE_KINDS), source))
        elif source == "file" and not self.quota_file:
            raise ConfigError("quota-source file needs --quota-file PATH")
        elif source == "zookeeper" and not self.zookeeper:
            raise ConfigError("quota-source zookeeper needs --zookeeper HOST:PORT[/chroot]")
        elif source == "zookeeper" and self.quota_file:
            raise ConfigError("quota-source zookeeper reads the quotas from --zookeeper: "
                              "--quota-file is not read then; give one of them")
        elif source == "kafka" and self.quota_file:
            raise ConfigError("quota-source kafka reads the quotas kept in the cluster "
                              "(DescribeClientQuotas): --quota-file is not read then; give one "
                              "of them")
        elif source == "file" and self.zookeeper:
            raise ConfigError("give quota-file or zookeeper, not both")
        if not (isinstance(self.quota_refresh, (int, float)) and self.quota_refresh > 0):
            raise ConfigError("quota-refresh must be a positive duration, got %r"
                              % (self.quota_refresh,))
        self.quota_source = source

    def _validate_addressing(self):
        """The node ports (and SNI routing) as far as they can be checked
        before a broker names its nodes: the proxy checks the nodes it
        learns at start, and refuses to start if one has no port."""
        listen_port = self.listen[1]
        for node_id, port in self.node_ports.items():
            if port == listen_port:
                raise ConfigError("node-ports: node %d is given port %d, the bootstrap "
                                  "listener's (--listen)" % (node_id, port))
        if self.sni_broker_pattern is None:
            return
        if not self.tls_enabled:
            raise ConfigError("sni-broker-pattern routes by the TLS server name: it needs a TLS "
                              "listener, --security-protocol SSL or SASL_SSL (got %s)"
                              % self.security_protocol)
        if self.node_ports or self.node_port_base is not None:
            raise ConfigError("sni-broker-pattern serves every node on the one listen port: "
                              "node-ports and node-port-base do not apply with it")

    def _validate_limits(self):
        if not 0 < self.sasl_server_max_receive_size <= self.max_frame_size:
            raise ConfigError("sasl-server-max-receive-size must be a positive number of bytes, "
                              "at most max-frame-size (%d), got %r"
                              % (self.max_frame_size, self.sasl_server_max_receive_size))
        for name in ("connections_max_idle_ms", "handshake_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError("%s must be a positive number of ms, got %r"
                                  % (name.replace("_", "-"), getattr(self, name)))
        for name in ("max_connections", "max_connections_per_ip"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError("%s must not be negative, got %r"
                                  % (name.replace("_", "-"), value))

    def _validate_admin(self):
        tls = (self.admin_ssl_cert, self.admin_ssl_key)
        if any(tls) and not all(tls):
            raise ConfigError("admin-ssl-cert and admin-ssl-key go together")
        if self.admin_ssl_ca and not self.admin_ssl_cert:
            raise ConfigError("admin-ssl-ca (client certificates for the admin endpoint) needs "
                              "--admin-ssl-cert and --admin-ssl-key")
        if (self.admin_token_file or self.admin_ssl_cert) and not self.admin_listen:
            raise ConfigError("admin-token-file and admin-ssl-* protect the admin endpoint: "
                              "give --admin-listen too")
        if self.metrics_max_entities < 0:
            raise ConfigError("metrics-max-entities must be 0 or more, got %d"
                              % self.metrics_max_entities)

    def admin_token(self):
        """The bearer token /quotas requires, from --admin-token-file (its
        line ending dropped), or None."""
        if not self.admin_token_file:
            return None
        try:
            with open(self.admin_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError("cannot read admin-token-file %s: %s"
                              % (self.admin_token_file, exc.strerror or exc)) from None
        if not token:
            raise ConfigError("admin-token-file %s is empty" % self.admin_token_file)
        return token

    def _validate_fleet(self, passthrough):
        if self.proxy_id is None:
            return
        if not _PROXY_ID.match(self.proxy_id) or self.proxy_id in (".", ".."):
            raise ConfigError("proxy-id must be 1-255 characters of [A-Za-z0-9._-] (it names a "
                              "znode and keys a Kafka record), got %r" % self.proxy_id)
        if not (self.zookeeper or self.cluster_state_topic):
            raise ConfigError("proxy-id %s makes this proxy a member of a fleet sharing its quotas: "
                              "give --zookeeper HOST:PORT[/chroot] or --cluster-state-topic NAME "
                              "too (where the Spark job writes the shares it computes)"
                              % self.proxy_id)
        if self.quota_source is None:
            raise ConfigError("proxy-id %s: a fleet shares the quotas it enforces, and there are "
                              "none: give --quota-file, --quota-source kafka or --zookeeper"
                              % self.proxy_id)
        if passthrough:
            raise ConfigError("proxy-id: a fleet member publishes its usage reports to the cluster "
                              "as itself, and in sasl-mode passthrough the proxy has no SASL "
                              "identity of its own; use sasl-mode terminate with "
                              "--upstream-sasl-username")
        if self.usage_interval_ms <= 0:
            raise ConfigError("usage-interval must be a positive number of ms, got %r"
                              % self.usage_interval_ms)
        if not _TOPIC_NAME.match(self.usage_topic) or self.usage_topic in (".", ".."):
            raise ConfigError("usage-topic must be a Kafka topic name ([A-Za-z0-9._-], up to 249 "
                              "characters), got %r" % self.usage_topic)
        if self.share_max_age_ms <= 0:
            raise ConfigError("share-max-age-ms must be a positive number of ms, got %r"
                              % self.share_max_age_ms)
        if self.share_fail_safe not in SHARE_FAIL_SAFES:
            raise ConfigError("share-fail-safe must be one of %s, got %r"
                              % (", ".join(SHARE_FAIL_SAFES), self.share_fail_safe))


def load_toml(path):
    """Read a TOML config file into a dict of ProxyConfig attributes."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("cannot read config file %s: %s" % (path, exc.strerror)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config file %s is not valid TOML: %s" % (path, exc)) from None
    section = data.get("proxy", data)
    groups = option_groups()
    known = {o.name for g in groups for o in g.options}
    for key, value in section.items():
        if key not in known and key != "proxy" and not isinstance(value, dict):
            # (a table is another command's section)
            raise ConfigError("config file %s: unknown key %r (known: %s)"
                              % (path, key, ", ".join(sorted(known))))
    out = {}
    try:
        for group in groups:
            out.update(group.from_toml(section))
    except ConfigError as exc:
        raise ConfigError("config file %s: %s" % (path, exc)) from None
    return out


def build_config(file_values, flag_values):
    """Flags win over the file; both win over the defaults."""
    merged = dict(file_values)
    callback = flag_values.get("quota_callback")
    if callback is not None and callback["config"] is None:
        # --quota-callback names the class; a file's [quota-callback.config] still configures it
        callback["config"] = (file_values.get("quota_callback") or {}).get("config") or {}
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    return ProxyConfig(**merged).validate()
