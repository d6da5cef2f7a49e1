"""The security options, declared once.

``ClientSecurityOptions``: how a Kafka client of this project (the proxy
towards its brokers, the volume agent, the Spark job) reaches the cluster:
security-protocol, ssl-ca, ssl-cert, ssl-key, sasl-mechanism, sasl-username,
sasl-password-file, each under a prefix ("upstream-" for the proxy), with one
validation and one set of messages; ``resolve`` gives a ``KafkaClientSecurity``
(kafka-python's settings, the data source's). ``LISTENER``: the proxy's
listener side (what its clients speak to it).
"""
import dataclasses
import os

from .options import (
    INTEGER,
    NUMBER,
    NAMES,
    Choice,
    ConfigError,
    Option,
    OptionGroup,
    Parsed,
    parse_zookeeper,
)

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
OAUTHBEARER = "OAUTHBEARER"  # KIP-255/KIP-768: a JWT, checked against a JWKS
LISTENER_SASL_MECHANISMS = SASL_MECHANISMS + (OAUTHBEARER,)
DEFAULT_SASL_MECHANISM = "SCRAM-SHA-512"
TLS_PROTOCOLS = ("SSL", "SASL_SSL")

# ZooKeeper's connect string, as Kafka's zookeeper.connect takes it; each
# command gives its own help (and says whether it is required)
ZOOKEEPER = Option("zookeeper", Parsed(parse_zookeeper), metavar="HOST:PORT[/chroot]")


def read_sasl_password(path, env, flag, protocol, environ=None):
    """A SASL password from the file at ``path`` (its line ending dropped),
    else from the environment variable ``env``; never from a flag.
    ConfigError says what is missing or unreadable, never the password."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError("cannot read %s %s: %s" % (flag, path, exc.strerror or exc)) from None
    else:
        password = (os.environ if environ is None else environ).get(env)
    if not password:
        raise ConfigError("security protocol %s needs the password: %s PATH or the environment "
                          "variable %s" % (protocol, flag, env))
    return password


def upstream_tls_context(ssl_ca, ssl_cert=None, ssl_key=None):
    """TLS towards the brokers: their certificates checked against
    ``ssl_ca`` (None: the system's), host names too (Kafka's
    ssl.endpoint.identification.algorithm=https), and ``ssl_cert`` (with
    ``ssl_key``) for brokers that require a client's. ValueError when they
    cannot be loaded."""
    import ssl

    try:
        context = ssl.create_default_context(cafile=ssl_ca)
        if ssl_cert:
            context.load_cert_chain(ssl_cert, ssl_key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the upstream TLS CA or certificate (%s, %s): %s"
                         % (ssl_ca, ssl_cert, exc)) from None
    return context


def _read_pem(flag, path):
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("cannot read %s %s: %s" % (
            flag, path, getattr(exc, "strerror", None) or exc)) from None


@dataclasses.dataclass(frozen=True)
class KafkaClientSecurity:
    """How a client reaches the cluster, checked. The password and the PEM
    texts are kept out of repr."""

    security_protocol: str = "PLAINTEXT"
    ssl_ca: str = None
    ssl_cert: str = None
    ssl_key: str = None
    sasl_mechanism: str = None  # None unless SASL
    sasl_username: str = None
    sasl_password: str = dataclasses.field(default=None, repr=False)
    # {"ssl_ca_pem": text, ...} of the files given, as read when checked
    pem: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def tls(self):
        return self.security_protocol in TLS_PROTOCOLS

    @property
    def sasl(self):
        return self.security_protocol.startswith("SASL_")

    def kafka_python(self):
        """kafka-python's security settings."""
        config = {"security_protocol": self.security_protocol}
        if self.tls:
            config.update(ssl_cafile=self.ssl_ca, ssl_certfile=self.ssl_cert,
                          ssl_keyfile=self.ssl_key)
        if self.sasl:
            config.update(self.sasl_login())
        return config

    def sasl_login(self):
        """The SASL login with user and password, as kafka-python and
        aiokafka both name its settings."""
        return {"sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password}

    def data_source_options(self):
        """The kthrottle-kafka data source's options: the files' contents,
        not their paths (the executors do not share the driver's files)."""
        out = {"security_protocol": self.security_protocol}
        out.update(self.pem)
        if self.sasl:
            out.update(sasl_mechanism=self.sasl_mechanism, sasl_username=self.sasl_username,
                       sasl_password=self.sasl_password)
        return out


class ClientSecurityOptions:
    """The Kafka-client security options of one command, under ``prefix``.
    ``who`` ("the agent") and ``password_env`` go into the help and the
    messages; ``protocol_default`` is the configuration's default (None: the
    command decides, as the proxy in passthrough mode does)."""

    def __init__(self, prefix="", *, who, password_env, title, description=None,
                 protocol_default="PLAINTEXT", protocol_help="", ca_help="", key_help="",
                 mechanism_default=DEFAULT_SASL_MECHANISM, extra_mechanisms=()):
        self.prefix = prefix
        # mechanisms beyond user and password (OAUTHBEARER: the proxy's own
        # token, whose options its login filter declares)
        self.extra_mechanisms = tuple(extra_mechanisms)
        self.mechanisms = SASL_MECHANISMS + self.extra_mechanisms
        self.password_env = password_env
        self.mechanism_default = mechanism_default
        p = prefix
        self.protocol = Option(
            p + "security-protocol", Choice(SECURITY_PROTOCOLS), default=protocol_default,
            metavar="P", help="what %s speaks to the brokers: PLAINTEXT (default), SSL, "
            "SASL_PLAINTEXT or SASL_SSL%s" % (who, protocol_help))
        self.ssl_ca = Option(
            p + "ssl-ca", metavar="PEM", help="CA bundle the brokers' certificates are checked "
            "against (default: the system's); host names are checked" + ca_help)
        self.ssl_cert = Option(p + "ssl-cert", metavar="PEM", help="%s's client certificate, "
                               "for brokers that require mTLS" % who)
        self.ssl_key = Option(p + "ssl-key", metavar="PEM",
                              help="its private key (unencrypted PEM)" + key_help)
        mechanisms = [m + " (default)" if m == mechanism_default else m
                      for m in self.mechanisms]
        self.sasl_mechanism = Option(
            p + "sasl-mechanism", Choice(self.mechanisms), default=mechanism_default,
            metavar="M", help=", ".join(mechanisms[:-1]) + " or " + mechanisms[-1])
        self.sasl_username = Option(p + "sasl-username", metavar="USER",
                                    help="%s's SASL user" % who)
        self.sasl_password_file = Option(
            p + "sasl-password-file", metavar="PATH",
            help="file holding %s's SASL password, one line (else the environment variable "
            "%s; never a flag)" % (who, password_env))
        self._pem_keys = {self.ssl_ca: "ssl_ca_pem", self.ssl_cert: "ssl_cert_pem",
                          self.ssl_key: "ssl_key_pem"}
        self.group = OptionGroup(title, description, (
            self.protocol, self.ssl_ca, self.ssl_cert, self.ssl_key, self.sasl_mechanism,
            self.sasl_username, self.sasl_password_file))

    def add_to(self, parser):
        return self.group.add_to(parser)

    def password(self, values, environ=None):
        """The SASL password: from the password file, else the environment."""
        protocol = values.get(self.protocol.attr) or "PLAINTEXT"
        return read_sasl_password(values.get(self.sasl_password_file.attr), self.password_env,
                                  self.sasl_password_file.flag, protocol, environ)

    def resolve(self, values, environ=None, own_sasl=True):
        """A KafkaClientSecurity from ``values`` ({attr: value}: a parsed
        namespace's vars, a configuration's); ConfigError says what does not
        fit. ``own_sasl`` False: the SASL identity is not this command's (the
        proxy relaying its clients' exchange), so none is asked for."""
        def get(option):
            return values.get(option.attr)

        protocol = get(self.protocol) or "PLAINTEXT"
        if protocol not in SECURITY_PROTOCOLS:
            raise ConfigError("%s must be one of %s, got %r" % (
                self.protocol.flag, ", ".join(SECURITY_PROTOCOLS), protocol))
        tls, sasl = protocol in TLS_PROTOCOLS, protocol.startswith("SASL_")
        files = [o for o in (self.ssl_ca, self.ssl_cert, self.ssl_key) if get(o)]
        if files and not tls:
            raise ConfigError("%s is for TLS: give %s SSL or SASL_SSL (it is %s)"
                              % (files[0].flag, self.protocol.flag, protocol))
        if bool(get(self.ssl_cert)) != bool(get(self.ssl_key)):
            raise ConfigError("%s and %s go together (the client certificate and its private "
                              "key)" % (self.ssl_cert.flag, self.ssl_key.flag))
        pem = {self._pem_keys[o]: _read_pem(o.flag, get(o)) for o in files}
        mechanism = username = password = None
        if sasl and own_sasl:
            mechanism = get(self.sasl_mechanism) or self.mechanism_default
            if mechanism not in self.mechanisms:
                raise ConfigError("%s must be one of %s, got %r" % (
                    self.sasl_mechanism.flag, ", ".join(self.mechanisms), mechanism))
            if mechanism in self.extra_mechanisms:  # no user name nor password
                return KafkaClientSecurity(protocol, get(self.ssl_ca), get(self.ssl_cert),
                                           get(self.ssl_key), mechanism, None, None, pem)
            username = get(self.sasl_username)
            if not username:
                raise ConfigError("%s %s needs %s" % (self.protocol.flag, protocol,
                                                      self.sasl_username.flag))
            password = self.password(values, environ)
        elif not sasl:
            given = [o.flag for o in (self.sasl_mechanism, self.sasl_username,
                                      self.sasl_password_file)
                     if get(o) not in (None, o.default)]
            if given:
                raise ConfigError("%s %s for SASL: give %s SASL_PLAINTEXT or SASL_SSL (it is "
                                  "%s)" % (", ".join(given), "is" if len(given) == 1 else "are",
                                           self.protocol.flag, protocol))
        return KafkaClientSecurity(protocol, get(self.ssl_ca), get(self.ssl_cert),
                                   get(self.ssl_key), mechanism, username, password, pem)


# the proxy's listener side ----------------------------------------------------------

SSL_CLIENT_AUTH = ("none", "requested", "required")
SASL_MODES = ("terminate", "passthrough")

LISTENER = OptionGroup("client security (Kafka's security.protocol and SASL settings)", None, (
    Option("security-protocol", Choice(SECURITY_PROTOCOLS), default="PLAINTEXT", metavar="P",
           help="what clients speak to the listeners: PLAINTEXT (default), SSL, SASL_PLAINTEXT "
           "or SASL_SSL"),
    Option("sasl-mode", default="terminate", choices=SASL_MODES,
           help="who verifies a SASL client: terminate (default), the proxy itself; the broker "
           "then sees only the proxy's connection, so broker-side per-user quotas and ACLs no "
           "longer apply; or passthrough: the client's SASL exchange goes on to the broker, "
           "which verifies it, and the proxy binds the user name it named once the broker says "
           "yes (the upstream side must then be SASL_PLAINTEXT or SASL_SSL)"),
    Option("sasl-enabled-mechanisms", NAMES, default=list(SASL_MECHANISMS), metavar="LIST",
           help="comma-separated, of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 (default: these "
           "three) and OAUTHBEARER (see --sasl-oauthbearer-jwks-endpoint-url)"),
    Option("credentials-file", metavar="PATH",
           help="TOML file of salted SCRAM credentials (never passwords; write it with "
           "kthrottle quotas alter --credentials-file ... --add-config "
           "'SCRAM-SHA-512=[password=...]'), re-read when it changes; without it, the SCRAM "
           "credentials in --zookeeper are used. PLAIN is checked against them"),
    Option("ssl-cert", metavar="PEM", help="the listeners' certificate (chain)"),
    Option("ssl-key", metavar="PEM", help="its private key"),
    Option("ssl-ca", metavar="PEM",
           help="CA bundle that client certificates are checked against (mTLS)"),
    Option("ssl-client-auth", default="none", choices=SSL_CLIENT_AUTH,
           help="client certificates, as Kafka's ssl.client.auth (default none); with SSL the "
           "principal is the certificate's subject, mapped by --ssl-principal-mapping-rules"),
    Option("ssl-principal-mapping-rules", default="DEFAULT", metavar="RULES",
           help="Kafka's ssl.principal.mapping.rules, e.g. 'RULE:^CN=(.*?),OU=.*$/$1/L,DEFAULT' "
           "(default DEFAULT: the subject as RFC 2253 writes it, CN=alice,OU=team,O=org)"),
    # KIP-306
    Option("failed-authentication-delay-ms", INTEGER, default=100, metavar="MS",
           help="a failed authentication is answered after this delay, then the connection "
           "closes (Kafka's connection.failed.authentication.delay.ms, default 100)"),
    Option("failed-login-rate", NUMBER, default=5.0, metavar="N",
           help="failed logins a second one address may go on with, past a burst of ten "
           "times that; beyond, its new connections are held unread (at most 1 s) and "
           "closed, refused as failed_logins (0: no such backoff)"),
))


def check_listener(config):
    """The listener side's own checks (``config``: its attributes);
    ConfigError says which key and why."""
    protocol = config.security_protocol
    if protocol not in SECURITY_PROTOCOLS:
        raise ConfigError("security-protocol must be one of %s, got %r"
                          % (", ".join(SECURITY_PROTOCOLS), protocol))
    if protocol in TLS_PROTOCOLS:
        if not config.ssl_cert or not config.ssl_key:
            raise ConfigError("security-protocol %s needs --ssl-cert and --ssl-key (PEM)"
                              % protocol)
        if config.ssl_client_auth not in SSL_CLIENT_AUTH:
            raise ConfigError("ssl-client-auth must be none, requested or required, got %r"
                              % config.ssl_client_auth)
        if config.ssl_client_auth != "none" and not config.ssl_ca:
            raise ConfigError("ssl-client-auth %s needs --ssl-ca, the CA bundle client "
                              "certificates are checked against" % config.ssl_client_auth)
        from .policy.principal import parse_rules

        try:
            parse_rules(config.ssl_principal_mapping_rules)
        except ValueError as exc:
            raise ConfigError("ssl-principal-mapping-rules: %s" % exc) from None
    elif config.ssl_cert or config.ssl_key or config.ssl_ca:
        raise ConfigError("ssl-cert, ssl-key and ssl-ca are for TLS listeners: give "
                          "--security-protocol SSL or SASL_SSL")
    if config.sasl_mode not in SASL_MODES:
        raise ConfigError("sasl-mode must be terminate or passthrough, got %r" % config.sasl_mode)
    if protocol.startswith("SASL_"):
        unknown = [m for m in config.sasl_enabled_mechanisms
                   if m not in LISTENER_SASL_MECHANISMS]
        if unknown or not config.sasl_enabled_mechanisms:
            raise ConfigError("sasl-enabled-mechanisms must be among %s, got %s"
                              % (", ".join(LISTENER_SASL_MECHANISMS),
                                 ", ".join(config.sasl_enabled_mechanisms) or "nothing"))
    if config.failed_authentication_delay_ms < 0:
        raise ConfigError("failed-authentication-delay-ms must not be negative")
    if config.failed_login_rate < 0:
        raise ConfigError("failed-login-rate must not be negative (0 turns the backoff off)")
