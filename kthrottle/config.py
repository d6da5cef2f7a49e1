"""Configuration of ``kthrottle proxy``: command-line flags over a TOML file."""
import re
import tomllib
from dataclasses import dataclass, field

from .codecs import DEFAULT_MAX_FRAME_SIZE

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
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
UPSTREAM_PASSWORD_ENV = "KTHROTTLE_UPSTREAM_SASL_PASSWORD"
DEFAULT_USAGE_TOPIC = "__kthrottle_proxy_usage"
SHARE_FAIL_SAFES = ("last", "equal", "whole")
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_PROXY_ID = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


class ConfigError(Exception):
    """Bad configuration: the message says which key and why."""


def read_sasl_password(path, env, flag, protocol, environ=None):
    """A SASL password from the file at ``path`` (its line ending dropped),
    else from the environment variable ``env``; never from a flag.
    ValueError says what is missing or unreadable, never the password."""
    import os

    if path:
        try:
            with open(path, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ValueError("cannot read %s %s: %s" % (flag, path, exc.strerror or exc)) from None
    else:
        password = (os.environ if environ is None else environ).get(env)
    if not password:
        raise ValueError("security protocol %s needs the password: %s PATH or the environment "
                         "variable %s" % (protocol, flag, env))
    return password


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$", re.I)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text):
    """Seconds from ``30s``, ``5m``, ``500ms``, ``1h`` or plain seconds (``30``,
    ``0.5``); ValueError if it is not a positive duration."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError("not a duration: %r (like 30s, 5m, 500ms or a number of seconds)"
                         % (text,))
    seconds = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if seconds <= 0:
        raise ValueError("a duration must be positive, got %r" % (text,))
    return seconds


def parse_host_port(value, what):
    """Parse ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6)."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError("%s must be HOST:PORT, got %r" % (what, value))
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port)
    except ValueError:
        raise ConfigError("%s has a port that is not a number: %r" % (what, value)) from None
    if not host or not 0 <= port <= 65535:
        raise ConfigError("%s must be HOST:PORT with a port in 0-65535, got %r" % (what, value))
    return host, port


def parse_admin_listen(value):
    """``[HOST:]PORT``: the admin endpoint binds to 127.0.0.1 unless a host
    is given."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.lstrip(":").isdigit():
        value = "127.0.0.1:" + value.lstrip(":")
    return parse_host_port(value, "admin-listen")


def parse_connection_overrides(value):
    """Kafka's max.connections.per.ip.overrides: ``host:N,host:N`` (an
    address or a host name) -> {host: N}; a TOML table works too."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            host, sep, count = item.rpartition(":")
            if not sep or not host:
                raise ConfigError("max-connections-per-ip-overrides: %r is not host:N" % item)
            items.append((host.strip("[]"), count))
    else:
        raise ConfigError("max-connections-per-ip-overrides must be 'host:N,...', got %r"
                          % (value,))
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


def parse_zookeeper(value, what="zookeeper"):
    """Check ``HOST:PORT[,HOST:PORT...][/chroot]`` (ZooKeeper's connect string,
    as Kafka's zookeeper.connect takes it); returns it unchanged."""
    if not isinstance(value, str) or not value:
        raise ConfigError("%s must be HOST:PORT[,HOST:PORT...][/chroot]" % what)
    hosts, slash, chroot = value.partition("/")
    for host in hosts.split(","):
        parse_host_port(host, what)
    if slash and (not chroot or chroot.endswith("/") or "//" in chroot):
        raise ConfigError("%s has a bad chroot %r (like /kafka)" % (what, "/" + chroot))
    return value


@dataclass
class ProxyConfig:
    bootstrap_servers: list = field(default_factory=list)  # [(host, port)]
    listen: tuple = ("127.0.0.1", 9092)
    node_port_base: int | None = None
    advertised_host: str | None = None
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    # how long one broker address may take to accept a connection before the
    # next is tried (Kafka's socket.connection.setup.timeout.ms default)
    upstream_connect_timeout_ms: int = 10_000
    # SIGTERM: how long in-flight requests may take to finish before the
    # connections still waiting are closed
    drain_timeout_ms: int = DEFAULT_DRAIN_TIMEOUT_MS
    # limits of every listener (Kafka's names; None: no limit)
    sasl_server_max_receive_size: int = DEFAULT_SASL_SERVER_MAX_RECEIVE_SIZE
    connections_max_idle_ms: int = DEFAULT_CONNECTIONS_MAX_IDLE_MS
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS
    max_connections: int | None = None
    max_connections_per_ip: int | None = None
    max_connections_per_ip_overrides: dict = field(default_factory=dict)  # host -> N
    quota_file: str | None = None
    zookeeper: str | None = None
    admin_listen: tuple | None = None
    # /quotas (principals, client-ids) behind a bearer token and/or mTLS
    admin_token_file: str | None = None
    admin_ssl_cert: str | None = None
    admin_ssl_key: str | None = None
    admin_ssl_ca: str | None = None
    quota_mode: str = "token-bucket"
    quota_window_num: int = 11
    quota_window_size_seconds: float = 1.0
    max_throttle_ms: int | None = None
    quota_burst_seconds: float = 1.0
    # client side security (Kafka's names)
    security_protocol: str = "PLAINTEXT"
    sasl_mode: str = "terminate"
    sasl_enabled_mechanisms: list = field(
        default_factory=lambda: ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
    credentials_file: str | None = None
    failed_authentication_delay_ms: int = 100  # KIP-306
    ssl_cert: str | None = None
    ssl_key: str | None = None
    ssl_ca: str | None = None
    ssl_client_auth: str = "none"  # Kafka's ssl.client.auth
    ssl_principal_mapping_rules: str = "DEFAULT"
    # storage-aware throttling (the Spark job's cluster state in --zookeeper)
    storage_scope: str = "cluster"
    storage_fail_safe: str = "PAUSE"
    storage_max_age_ms: int = 120_000
    storage_base_rate: float = 1024 * 1024
    storage_pause_max_ms: int = 10_000
    storage_excluded_principals: list = field(default_factory=list)
    cluster_state_znode: str = "/kthrottle/cluster-state"
    # fleet-wide quotas: with a proxy id this proxy publishes its usage and
    # applies its share of each quota (the shares the Spark job writes to
    # <cluster-state-znode>/shares/<proxy-id> in --zookeeper)
    proxy_id: str | None = None
    usage_interval_ms: int = 5000
    usage_topic: str = DEFAULT_USAGE_TOPIC
    share_max_age_ms: int = 60_000
    share_fail_safe: str = "last"
    # towards the brokers
    # default: PLAINTEXT, or in passthrough mode the client side's protocol
    upstream_security_protocol: str | None = None
    upstream_ssl_ca: str | None = None
    upstream_ssl_cert: str | None = None
    upstream_ssl_key: str | None = None
    upstream_sasl_mechanism: str = "SCRAM-SHA-512"
    upstream_sasl_username: str | None = None
    upstream_sasl_password_file: str | None = None

    def upstream_sasl_password(self):
        """From --upstream-sasl-password-file, else the environment variable
        KTHROTTLE_UPSTREAM_SASL_PASSWORD; never from a flag."""
        try:
            return read_sasl_password(self.upstream_sasl_password_file, UPSTREAM_PASSWORD_ENV,
                                      "upstream-sasl-password-file",
                                      self.upstream_security_protocol)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def storage_enabled(self):
        """The cluster state is followed when ZooKeeper is given."""
        return bool(self.zookeeper) and self.storage_scope != "off"

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
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def effective_node_port_base(self):
        if self.node_port_base is not None:
            return self.node_port_base
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
        if self.drain_timeout_ms < 0:
            raise ConfigError("drain-timeout-ms must not be negative, got %r"
                              % self.drain_timeout_ms)
        if self.node_port_base is not None and not 0 < self.node_port_base < 65536:
            raise ConfigError("node-port-base must be a port number")
        if self.quota_file and self.zookeeper:
            raise ConfigError("give quota-file or zookeeper, not both")
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ConfigError("security-protocol must be one of %s, got %r"
                              % (", ".join(SECURITY_PROTOCOLS), self.security_protocol))
        if self.tls_enabled:
            if not self.ssl_cert or not self.ssl_key:
                raise ConfigError("security-protocol %s needs --ssl-cert and --ssl-key (PEM)"
                                  % self.security_protocol)
            if self.ssl_client_auth not in ("none", "requested", "required"):
                raise ConfigError("ssl-client-auth must be none, requested or required, got %r"
                                  % self.ssl_client_auth)
            if self.ssl_client_auth != "none" and not self.ssl_ca:
                raise ConfigError("ssl-client-auth %s needs --ssl-ca, the CA bundle client "
                                  "certificates are checked against" % self.ssl_client_auth)
            from .policy.principal import parse_rules

            try:
                parse_rules(self.ssl_principal_mapping_rules)
            except ValueError as exc:
                raise ConfigError("ssl-principal-mapping-rules: %s" % exc) from None
        elif self.ssl_cert or self.ssl_key or self.ssl_ca:
            raise ConfigError("ssl-cert, ssl-key and ssl-ca are for TLS listeners: give "
                              "--security-protocol SSL or SASL_SSL")
        if self.sasl_mode not in ("terminate", "passthrough"):
            raise ConfigError("sasl-mode must be terminate or passthrough, got %r" % self.sasl_mode)
        passthrough = self.sasl_enabled and self.sasl_mode == "passthrough"
        if self.upstream_security_protocol is None:
            self.upstream_security_protocol = self.security_protocol if passthrough else "PLAINTEXT"
        if self.sasl_enabled:
            unknown = [m for m in self.sasl_enabled_mechanisms if m not in SASL_MECHANISMS]
            if unknown or not self.sasl_enabled_mechanisms:
                raise ConfigError("sasl-enabled-mechanisms must be among %s, got %s"
                                  % (", ".join(SASL_MECHANISMS),
                                     ", ".join(self.sasl_enabled_mechanisms) or "nothing"))
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
            if not self.credentials_file and not self.zookeeper:
                raise ConfigError("security-protocol %s in terminate mode needs credentials: "
                                  "--credentials-file, or --zookeeper for the SCRAM credentials "
                                  "Kafka keeps there" % self.security_protocol)
        elif self.credentials_file:
            raise ConfigError("credentials-file is for SASL listeners: give "
                              "--security-protocol SASL_PLAINTEXT or SASL_SSL")
        if self.upstream_security_protocol not in SECURITY_PROTOCOLS:
            raise ConfigError("upstream-security-protocol must be one of %s, got %r"
                              % (", ".join(SECURITY_PROTOCOLS), self.upstream_security_protocol))
        if self.upstream_security_protocol.startswith("SASL_") and not passthrough:
            if self.upstream_sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError("upstream-sasl-mechanism must be one of %s, got %r"
                                  % (", ".join(SASL_MECHANISMS), self.upstream_sasl_mechanism))
            if not self.upstream_sasl_username:
                raise ConfigError("upstream-security-protocol %s needs --upstream-sasl-username"
                                  % self.upstream_security_protocol)
            self.upstream_sasl_password()
        if bool(self.upstream_ssl_cert) != bool(self.upstream_ssl_key):
            raise ConfigError("upstream-ssl-cert and upstream-ssl-key go together")
        if self.storage_scope not in ("cluster", "partition", "off"):
            raise ConfigError("storage-scope must be cluster, partition or off, got %r"
                              % self.storage_scope)
        if self.storage_fail_safe not in ("PAUSE", "OPEN"):
            raise ConfigError("storage-fail-safe must be PAUSE or OPEN, got %r"
                              % self.storage_fail_safe)
        if self.storage_max_age_ms <= 0 or self.storage_pause_max_ms <= 0:
            raise ConfigError("storage-max-age-ms and storage-pause-max-ms must be positive")
        if not self.storage_base_rate > 0:
            raise ConfigError("storage-base-rate must be a positive number of bytes/s")
        if not self.cluster_state_znode.startswith("/") or self.cluster_state_znode.endswith("/"):
            raise ConfigError("cluster-state-znode must be an absolute znode path, got %r"
                              % self.cluster_state_znode)
        if self.failed_authentication_delay_ms < 0:
            raise ConfigError("failed-authentication-delay-ms must not be negative")
        self._validate_limits()
        self._validate_admin()
        self._validate_fleet(passthrough)
        self.quota_settings()
        return self


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
        if not self.zookeeper:
            raise ConfigError("proxy-id %s makes this proxy a member of a fleet sharing its quotas: "
                              "give --zookeeper HOST:PORT[/chroot] too (the quotas and the shares "
                              "the Spark job computes are kept there)" % self.proxy_id)
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


# TOML keys are the long flag names; each maps to (attribute, parser).
_KEYS = {
    "bootstrap-server": "bootstrap_servers",
    "listen": "listen",
    "node-port-base": "node_port_base",
    "advertised-host": "advertised_host",
    "max-frame-size": "max_frame_size",
    "upstream-connect-timeout-ms": "upstream_connect_timeout_ms",
    "drain-timeout-ms": "drain_timeout_ms",
    "sasl-server-max-receive-size": "sasl_server_max_receive_size",
    "connections-max-idle-ms": "connections_max_idle_ms",
    "handshake-timeout-ms": "handshake_timeout_ms",
    "max-connections": "max_connections",
    "max-connections-per-ip": "max_connections_per_ip",
    "max-connections-per-ip-overrides": "max_connections_per_ip_overrides",
    "admin-token-file": "admin_token_file",
    "admin-ssl-cert": "admin_ssl_cert",
    "admin-ssl-key": "admin_ssl_key",
    "admin-ssl-ca": "admin_ssl_ca",
    "quota-file": "quota_file",
    "zookeeper": "zookeeper",
    "admin-listen": "admin_listen",
    "quota-mode": "quota_mode",
    "quota-window-num": "quota_window_num",
    "quota-window-size-seconds": "quota_window_size_seconds",
    "max-throttle-ms": "max_throttle_ms",
    "quota-burst-seconds": "quota_burst_seconds",
    "security-protocol": "security_protocol",
    "sasl-mode": "sasl_mode",
    "sasl-enabled-mechanisms": "sasl_enabled_mechanisms",
    "credentials-file": "credentials_file",
    "failed-authentication-delay-ms": "failed_authentication_delay_ms",
    "ssl-cert": "ssl_cert",
    "ssl-key": "ssl_key",
    "ssl-ca": "ssl_ca",
    "ssl-client-auth": "ssl_client_auth",
    "ssl-principal-mapping-rules": "ssl_principal_mapping_rules",
    "upstream-security-protocol": "upstream_security_protocol",
    "upstream-ssl-ca": "upstream_ssl_ca",
    "upstream-ssl-cert": "upstream_ssl_cert",
    "upstream-ssl-key": "upstream_ssl_key",
    "upstream-sasl-mechanism": "upstream_sasl_mechanism",
    "upstream-sasl-username": "upstream_sasl_username",
    "upstream-sasl-password-file": "upstream_sasl_password_file",
    "storage-scope": "storage_scope",
    "storage-fail-safe": "storage_fail_safe",
    "storage-max-age-ms": "storage_max_age_ms",
    "storage-base-rate": "storage_base_rate",
    "storage-pause-max-ms": "storage_pause_max_ms",
    "storage-excluded-principals": "storage_excluded_principals",
    "cluster-state-znode": "cluster_state_znode",
    "proxy-id": "proxy_id",
    "usage-interval": "usage_interval_ms",
    "usage-topic": "usage_topic",
    "share-max-age-ms": "share_max_age_ms",
    "share-fail-safe": "share_fail_safe",
}


def _convert(key, value):
    if key == "bootstrap-server":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError("bootstrap-server must be a list of HOST:PORT strings")
        return [parse_host_port(v, "bootstrap-server") for v in value]
    if key == "listen":
        return parse_host_port(value, key)
    if key == "admin-listen":
        return parse_admin_listen(value)
    if key == "max-connections-per-ip-overrides":
        return parse_connection_overrides(value)
    if key in ("quota-window-size-seconds", "quota-burst-seconds", "storage-base-rate"):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError("%s must be a number, got %r" % (key, value))
        return float(value)
    if key == "zookeeper":
        return parse_zookeeper(value)
    if key in ("sasl-enabled-mechanisms", "storage-excluded-principals"):
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError("%s must be a list of names" % key)
        return [v.strip() for v in value if v.strip()]
    if key in ("quota-file", "quota-mode", "security-protocol", "sasl-mode", "credentials-file",
               "ssl-cert", "ssl-key", "ssl-ca", "ssl-client-auth",
               "ssl-principal-mapping-rules", "upstream-security-protocol", "upstream-ssl-ca",
               "upstream-ssl-cert", "upstream-ssl-key", "upstream-sasl-mechanism",
               "upstream-sasl-username", "upstream-sasl-password-file", "storage-scope",
               "storage-fail-safe", "cluster-state-znode", "proxy-id", "usage-topic",
               "share-fail-safe", "admin-token-file", "admin-ssl-cert", "admin-ssl-key",
               "admin-ssl-ca"):
        if not isinstance(value, str) or not value:
            raise ConfigError("%s must be a non-empty string" % key)
        return value
    if key in ("node-port-base", "max-frame-size", "quota-window-num", "max-throttle-ms",
               "upstream-connect-timeout-ms", "drain-timeout-ms",
               "failed-authentication-delay-ms",
               "storage-max-age-ms", "storage-pause-max-ms", "usage-interval",
               "share-max-age-ms", "sasl-server-max-receive-size", "connections-max-idle-ms",
               "handshake-timeout-ms", "max-connections", "max-connections-per-ip"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError("%s must be an integer, got %r" % (key, value))
        return value
    if key == "advertised-host":
        if not isinstance(value, str) or not value:
            raise ConfigError("advertised-host must be a host name or address")
        return value
    raise ConfigError("unknown key %r" % key)


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
    out = {}
    for key, value in section.items():
        if key not in _KEYS:
            if key == "proxy" or isinstance(value, dict):
                continue  # other sections belong to other commands
            raise ConfigError(
                "config file %s: unknown key %r (known: %s)" % (path, key, ", ".join(sorted(_KEYS)))
            )
        try:
            out[_KEYS[key]] = _convert(key, value)
        except ConfigError as exc:
            raise ConfigError("config file %s: %s" % (path, exc)) from None
    return out


def build_config(file_values, flag_values):
    """Flags win over the file; both win over the defaults."""
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    return ProxyConfig(**merged).validate()
