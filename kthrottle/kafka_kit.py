"""Apache Kafka itself as a test component: a single KRaft node (broker and controller in one
process) on 127.0.0.1 and free ports, with its data in a directory of its own; a three-node
KRaft cluster of such nodes (``KafkaCluster``); Kafka 3.9 in ZooKeeper mode; client listeners
with SASL (PLAIN, SCRAM, OAUTHBEARER) and TLS; and Kafka's own command-line tools
(kafka-tools) run from the same jars (``JavaTool``), among them the nothing-lost scenario of
VerifiableProducer and VerifiableConsumer through a leader's kill -9 (``VerifiableRun``). For
tests, benchmarks and ``kthrottle local --broker kafka`` alike.

The jars come from Maven Central through ``scripts/kafka-jars`` (pinned in pom.xml), which
``scripts/test`` and ``scripts/run-local --broker kafka`` run first; ``KTHROTTLE_KAFKA_LIB``
names another folder of them. Nothing here downloads anything: a missing JDK or missing
jars raise ``KafkaMissing`` with the command that fixes it.

    with KafkaBroker(workdir) as kafka:
        kafka.bootstrap                    # "127.0.0.1:PORT"
        kafka.create_topic("orders", partitions=3)
        kafka.tool("org.apache.kafka.tools.consumer.ConsoleShareConsumer", "--help")

    with KafkaBroker(workdir, listeners=SECURE_LISTENERS, users={"alice": "pw"}) as kafka:
        kafka.listener("SASL_SSL")         # "127.0.0.1:PORT"
        kafka.client_config("SASL_SSL", "SCRAM-SHA-512", "alice")  # confluent-kafka settings

    with KafkaCluster(workdir, n=3) as cluster:
        cluster.bootstrap                  # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        cluster.create_topic("orders", partitions=3)   # replication factor 3, min ISR 2
        cluster.kill(cluster.leaders("orders")[0])     # kill -9
        # VerifiableProducer/Consumer through a bootstrap address (a proxy's, or the
        # cluster's) while partition 0's leader is killed, restarted and elected again
        result = VerifiableRun(cluster, cluster.bootstrap, workdir / "verifiable").run()
        result.lost, result.duplicated, result.timeline
"""
import functools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections import namedtuple
from pathlib import Path

from .processes import _PORTS_GIVEN, _die_with_parent, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent  # the checkout: .cache/ and scripts/ are there
KAFKA_VERSION = "4.4.0"  # the default of pom.xml
KAFKA_JARS_COMMAND = "scripts/kafka-jars"
# the class behind bin/kafka-storage.sh: still the Scala object in core (kafka_2.13) in 4.4
STORAGE_TOOL = "kafka.tools.StorageTool"
BROKER_MAIN = "kafka.Kafka"
CONSOLE_SHARE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleShareConsumer"  # KIP-932
# bin/kafka-leader-election.sh (KafkaCluster.elect_leaders does the same with the AdminClient)
LEADER_ELECTION = "org.apache.kafka.tools.LeaderElectionCommand"
REASSIGN_PARTITIONS = "org.apache.kafka.tools.reassign.ReassignPartitionsCommand"
VERIFIABLE_PRODUCER = "org.apache.kafka.tools.VerifiableProducer"
VERIFIABLE_CONSUMER = "org.apache.kafka.tools.VerifiableConsumer"
# 3.9's bin/kafka-configs.sh; its --zookeeper still writes SCRAM credentials (gone in 4.0)
CONFIG_COMMAND = "kafka.admin.ConfigCommand"

# Settings that make a one-node cluster quick to start and to use: every internal topic with
# one replica (a default of 3 could never be met) and few partitions, and no wait before the
# first rebalance of a classic group.
ONE_NODE_SETTINGS = {
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    # KIP-932: the share-group state topic (__share_group_state)
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "share.coordinator.state.topic.num.partitions": "1",
    "group.initial.rebalance.delay.ms": "0",
}
# Share groups need no setting of their own from 4.2 on (KIP-932 production-ready): the storage
# tool's default release version (4.4-IV2 for 4.4.0) finalizes share.version=2. For an older
# release version pass feature={"share.version": "1"}.


def cluster_settings(nodes):
    """``ONE_NODE_SETTINGS`` for a cluster of ``nodes``: internal topics with replication
    factor 3 (fewer nodes: all of them) and a min ISR of 2, so that they outlive one node's
    death; and a 4 s broker session (default 9 s) so that the controller fences a killed node,
    and moves its leaderships, soon (KIP-631)."""
    rf = min(3, nodes)
    isr = max(1, rf - 1)
    return {
        "num.partitions": "1",
        "default.replication.factor": str(rf),
        "offsets.topic.replication.factor": str(rf),
        "offsets.topic.num.partitions": "3",
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(isr),
        "transaction.state.log.num.partitions": "3",
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(isr),
        "share.coordinator.state.topic.num.partitions": "3",
        "group.initial.rebalance.delay.ms": "0",
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "500",
    }


class Listener(namedtuple("Listener", "name protocol mechanisms jwks")):
    """A client listener beside PLAINTEXT: its name (listeners=NAME://...), its security
    protocol (SASL_PLAINTEXT, SASL_SSL, SSL), its SASL mechanisms (PLAIN, SCRAM-SHA-256,
    SCRAM-SHA-512, OAUTHBEARER) and, for OAUTHBEARER, whether tokens are checked against the
    broker's ``oauth`` JWKS (KIP-768) instead of Kafka's unsecured validator (KIP-255: a JWS
    with alg "none", as librdkafka's enable.sasl.oauthbearer.unsecure.jwt makes)."""

    def __new__(cls, name, protocol, mechanisms=(), jwks=False):
        return super().__new__(cls, name, protocol, tuple(mechanisms), jwks)

    @property
    def tls(self):
        return self.protocol.endswith("SSL")


SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-512")
# what the kafka_secure fixture has: every SASL mechanism in plain text and over TLS, and
# OAUTHBEARER (unsecured tokens) on a listener of its own
SECURE_LISTENERS = (
    Listener("SASL_PLAINTEXT", "SASL_PLAINTEXT", ("PLAIN",) + SCRAM),
    Listener("SASL_SSL", "SASL_SSL", ("PLAIN",) + SCRAM),
    Listener("OAUTHBEARER", "SASL_PLAINTEXT", ("OAUTHBEARER",)),
)


# A JVM started with this cannot open IPv6 sockets: a Java client so started cannot reach the
# broker's IPv6-only listener (``ipv6_listener``), only a proxy on 127.0.0.1 in front of it.
IPV4_ONLY_JVM_ARGS = ["-Djava.net.preferIPv4Stack=true"]


def ipv6_loopback():
    """Can this machine listen on [::1]? (Not every container has IPv6 loopback.)"""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port6():
    """``free_port`` for [::1]."""
    while True:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def free_ports_in_a_row(count, host="127.0.0.1"):
    """The first of ``count`` consecutive free ports, none handed out before (``free_port``):
    a proxy's --node-port-base B serves node N on B + N, so nodes 1..count of a cluster need
    B + 1..B + count free."""
    while True:
        first = free_port(host)
        ports = range(first + 1, first + count)
        if first + count > 65536 or any(port in _PORTS_GIVEN for port in ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        _PORTS_GIVEN.update(ports)
        return first


class KafkaMissing(RuntimeError):
    """No JDK or no jars: the message says how to get them."""


def java_binary():
    """The ``java`` that runs Kafka (``JAVA_HOME`` first, as kafka-run-class.sh does)."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    found = shutil.which("java")
    if not found:
        raise KafkaMissing("Apache Kafka needs a Java runtime (17 or newer) and none is on PATH: "
                           "apt-get install -y --no-install-recommends openjdk-17-jre-headless")
    return found


def compile_java(source, folder, lib):
    """Compile one ``.java`` file against the ``kafka-clients`` jar in ``lib`` into ``folder``
    (a class folder to put before Kafka's jars); KafkaMissing where only a JRE is found."""
    javac = os.path.join(os.path.dirname(os.path.realpath(java_binary())), "javac")
    javac = javac if os.access(javac, os.X_OK) else shutil.which("javac")
    if not javac:
        raise KafkaMissing("no javac next to %s nor on PATH (a JRE only): apt-get install -y "
                           "--no-install-recommends openjdk-17-jdk-headless" % java_binary())
    clients = next(Path(lib).glob("kafka-clients-*.jar"))
    done = subprocess.run([javac, "-cp", str(clients), "-d", str(folder), str(source)],
                          capture_output=True, text=True, timeout=180)
    if done.returncode:
        raise RuntimeError("javac %s failed:\n%s%s" % (source, done.stdout, done.stderr))
    return Path(folder)


def java_program_output(source, main_class, folder, lib=None, timeout=180):
    """Compile the ``.java`` file ``source`` against Kafka's jars (``lib``, Kafka's own by
    default) into ``folder``, run ``main_class`` once, and return what it printed;
    KafkaMissing where Kafka or a JDK is missing, RuntimeError when it fails."""
    lib = kafka_lib() if lib is None else lib
    classes = compile_java(source, folder, lib)
    done = subprocess.run([java_binary(), "-Xmx128m", "-XX:+UseSerialGC", "-cp",
                           "%s:%s" % (classes, Path(lib) / "*"), main_class],
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode:
        raise RuntimeError("%s failed:\n%s" % (main_class, (done.stdout + done.stderr).decode(
            errors="replace")))
    return done.stdout.decode("utf-8")


def kafka_lib(version=KAFKA_VERSION):
    """The folder of Kafka ``version``'s jars (``KTHROTTLE_KAFKA_LIB`` overrides), as
    ``scripts/kafka-jars`` leaves it; KafkaMissing if it is not there (complete)."""
    explicit = os.environ.get("KTHROTTLE_KAFKA_LIB")
    lib = Path(explicit) if explicit else ROOT / ".cache" / ("kafka-%s" % version) / "lib"
    complete = explicit or any(lib.glob(".complete-*"))
    if not complete or not any(lib.glob("kafka_2.13-*.jar")):
        if explicit:
            raise KafkaMissing("KTHROTTLE_KAFKA_LIB=%s has no Kafka jars (kafka_2.13-*.jar)"
                               % explicit)
        arg = "" if version == KAFKA_VERSION else " " + version.rpartition(".")[0]
        raise KafkaMissing("Apache Kafka %s's jars are not in %s: run %s%s (Maven fetches them "
                           "from Maven Central; scripts/test does it before pytest)"
                           % (version, lib, KAFKA_JARS_COMMAND, arg))
    return lib


def fetch_kafka_lib(version=KAFKA_VERSION):
    """Run ``scripts/kafka-jars`` (quick once done) and return the lib folder: for
    benchmarks and scripts that may fetch; tests only look (``kafka_lib``)."""
    arg = [] if version == KAFKA_VERSION else [version]
    out = subprocess.run([str(ROOT / KAFKA_JARS_COMMAND), *arg], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def metadata_brokers(host, port, timeout=2.0):
    """Ask ``host:port`` for Metadata (v1, no topics): [(node_id, host, port)] of the brokers
    it names, and the controller id. Raises OSError if it does not answer."""
    client_id = b"kthrottle-tests"
    body = struct.pack(">hhih", 3, 1, 7, len(client_id)) + client_id + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _read_exactly(sock, 4))[0]
        data = _read_exactly(sock, size)
    pos = 4  # correlation id
    count = struct.unpack_from(">i", data, pos)[0]
    pos += 4
    brokers = []
    for _ in range(count):
        node_id = struct.unpack_from(">i", data, pos)[0]
        n = struct.unpack_from(">h", data, pos + 4)[0]
        name = data[pos + 6:pos + 6 + n].decode()
        pos += 6 + n
        broker_port = struct.unpack_from(">i", data, pos)[0]
        rack = struct.unpack_from(">h", data, pos + 4)[0]
        pos += 6 + max(rack, 0)
        brokers.append((node_id, name, broker_port))
    controller = struct.unpack_from(">i", data, pos)[0]
    return brokers, controller


def _read_exactly(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return buf


Tls = namedtuple("Tls", "ca chain_pem key_pem")
Tls.__doc__ = """A broker's TLS material: ``ca`` the CA certificate's file (what a client trusts:
librdkafka's ssl.ca.location, a Java client's ssl.truststore.location with type PEM), and the
broker's certificate chain and unencrypted PKCS#8 key as PEM text."""


def make_tls(directory, hosts=("127.0.0.1", "localhost")):
    """A new self-signed CA and a broker certificate it signs for ``hosts`` (IP addresses and
    DNS names in subjectAltName: clients check the host name), in ``directory``: ca.pem,
    broker.pem (chain), broker.key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, issuer, key, signer, ca, alt_names=()):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names),
                                            critical=False)
        return builder.sign(signer, hashes.SHA256())

    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("kthrottle test CA", "kthrottle test CA", ca_key, ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certificate("kafka", "kthrottle test CA", key, ca_key, False, names)
    pem = serialization.Encoding.PEM
    ca_pem = ca.public_bytes(pem).decode()
    chain = cert.public_bytes(pem).decode() + ca_pem
    # Kafka's PEM key store reads PKCS#8 only (KIP-651)
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    (directory / "ca.pem").write_text(ca_pem)
    (directory / "broker.pem").write_text(chain)
    (directory / "broker.key").write_text(key_pem)
    return Tls(directory / "ca.pem", chain, key_pem)


def _properties_value(value):
    """A value as java.util.Properties reads it back: backslashes and line breaks escaped."""
    return (str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r"))


class KafkaBroker:
    """One Apache Kafka node in KRaft combined mode (process.roles=broker,controller) on
    ``host`` and free ports. ``advertised_host``: the host the broker gives clients for itself
    (its listener stays on ``host``). ``ipv6_listener``: a second client listener on [::1]
    only, which advertises [::1] (``bootstrap_ipv6``); a client that bootstraps there learns no
    other address of the broker. ``config``: more server.properties (they win over the
    defaults); ``feature``: {name: level} for the storage tool's ``--feature``. Its data is in
    ``workdir`` (a new temporary directory if None), removed by ``stop`` unless ``keep``.

    Security: ``listeners`` (``Listener``s, e.g. ``SECURE_LISTENERS``) are client listeners
    beside PLAINTEXT, which stays the inter-broker (and controller) listener; each on a free
    port, ``listener(name)`` its address. ``users`` ({name: password}, simple passwords: no
    quotes, commas or brackets) may log in with PLAIN (listener.name.X.plain.sasl.jaas.config
    user_NAME="pw") and SCRAM (written by the storage tool's ``--add-scram`` at format time,
    KIP-900; in ZooKeeper mode by ConfigCommand once the broker runs). A TLS listener gets a
    certificate from a new CA (``tls``, made by ``make_tls`` unless given); ``tls.ca`` is what
    clients trust. ``oauth`` ({"jwks_url", "audience", "issuer"}) for ``Listener(jwks=True)``.
    ``authorizer``: StandardAuthorizer (KRaft; AclAuthorizer in ZooKeeper mode) with
    ``super_users`` and ANONYMOUS (the PLAINTEXT listeners: inter-broker, controller) as super
    users.

    ``zookeeper`` ("HOST:PORT/chroot", Kafka 3.x only): ZooKeeper mode, broker.id instead of
    node.id and no storage format. ``voters`` (controller.quorum.voters) and ``settings``
    (instead of ``ONE_NODE_SETTINGS``): a node of a ``KafkaCluster``."""

    def __init__(self, workdir=None, version=KAFKA_VERSION, lib=None, host="127.0.0.1",
                 advertised_host=None, ipv6_listener=False, node_id=1, heap="512m",
                 config=None, feature=None, log_path=None, keep=False, listeners=(),
                 users=None, tls=None, oauth=None, authorizer=False, super_users=("admin",),
                 zookeeper=None, voters=None, settings=None, jvm_args=()):
        self.version = version
        self.lib = Path(lib) if lib else None
        self.host = host
        self.advertised_host = advertised_host or host
        self.node_id = node_id
        self.heap = heap
        self.config = dict(config or {})
        self.feature = dict(feature or {})
        self.workdir = Path(workdir) if workdir else None
        self.log_path = Path(log_path) if log_path else None
        self.keep = keep
        self.listeners = tuple(listeners)
        self.users = dict(users or {})
        self.tls = tls
        self.oauth = dict(oauth or {})
        self.authorizer = authorizer
        self.super_users = tuple(super_users)
        self.zookeeper = zookeeper
        if zookeeper and not version.startswith("3."):
            raise ValueError("ZooKeeper mode needs Kafka 3.x (4.0 removed it, KIP-500); "
                             "got version %s" % version)
        self.voters = voters
        self.settings = dict(ONE_NODE_SETTINGS if settings is None else settings)
        self.jvm_args = list(jvm_args)
        self.port = free_port(host)
        self.controller_port = None if zookeeper else free_port(host)
        self.listener_ports = {spec.name: free_port(host) for spec in self.listeners}
        self.ipv6_port = free_port6() if ipv6_listener else None
        self.cluster_id = None
        self.proc = None
        self.started_in = None  # seconds from format to the first Metadata answer

    # addresses -----------------------------------------------------------------------------

    @property
    def bootstrap(self):
        """The listener's address: what a client (or the proxy) bootstraps from."""
        return "%s:%d" % (self.host, self.port)

    @property
    def advertised(self):
        return "%s:%d" % (self.advertised_host, self.port)

    @property
    def bootstrap_ipv6(self):
        """The [::1] listener's address (``ipv6_listener``), or None."""
        return "[::1]:%d" % self.ipv6_port if self.ipv6_port else None

    def listener(self, name):
        """The address ("HOST:PORT") of the client listener ``name`` (PLAINTEXT or one of
        ``listeners``)."""
        if name == "PLAINTEXT":
            return self.bootstrap
        if name not in self.listener_ports:
            raise KeyError("no listener %r: this broker has PLAINTEXT and %s"
                           % (name, ", ".join(self.listener_ports) or "no other"))
        return "%s:%d" % (self.host, self.listener_ports[name])

    def listener_spec(self, name):
        for spec in self.listeners:
            if spec.name == name:
                return spec
        if name == "PLAINTEXT":
            return Listener("PLAINTEXT", "PLAINTEXT")
        raise KeyError("no listener %r" % name)

    def client_config(self, listener="PLAINTEXT", mechanism=None, user=None, password=None,
                      bootstrap=None, **settings):
        """confluent-kafka (librdkafka) settings that log in on ``listener`` as ``user`` with
        ``mechanism`` (default the listener's first); ``password`` defaults to the user's.
        OAUTHBEARER on an unsecured listener: an unsecured token for principal ``user``; on a
        JWKS one the caller adds how to get a token (sasl.oauthbearer.method=oidc, ...)."""
        spec = self.listener_spec(listener)
        conf = {"bootstrap.servers": bootstrap or self.listener(listener),
                "security.protocol": spec.protocol}
        if spec.tls:
            conf["ssl.ca.location"] = str(self.tls.ca)
        mechanism = mechanism or (spec.mechanisms[0] if spec.mechanisms else None)
        if mechanism == "OAUTHBEARER":
            conf["sasl.mechanism"] = mechanism
            if not spec.jwks:
                conf.update({"enable.sasl.oauthbearer.unsecure.jwt": True,
                             "sasl.oauthbearer.config": "principal=%s" % (user or "admin")})
        elif mechanism:
            user = user or next(iter(self.users))
            conf.update({"sasl.mechanism": mechanism, "sasl.username": user,
                         "sasl.password": self.users.get(user) if password is None
                         else password})
        conf.update(settings)
        return conf

    def java_client_config(self, listener="PLAINTEXT", mechanism=None, user=None,
                           password=None, bootstrap=None):
        """The same for a Java client (a --command-config file's properties)."""
        spec = self.listener_spec(listener)
        conf = {"bootstrap.servers": bootstrap or self.listener(listener),
                "security.protocol": spec.protocol}
        if spec.tls:
            conf.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.tls.ca)})
        mechanism = mechanism or (spec.mechanisms[0] if spec.mechanisms else None)
        if mechanism == "OAUTHBEARER":
            conf["sasl.mechanism"] = mechanism
            conf["sasl.jaas.config"] = (
                "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
                'unsecuredLoginStringClaim_sub="%s";' % (user or "admin"))
        elif mechanism:
            user = user or next(iter(self.users))
            module = ("org.apache.kafka.common.security.plain.PlainLoginModule"
                      if mechanism == "PLAIN" else
                      "org.apache.kafka.common.security.scram.ScramLoginModule")
            conf["sasl.mechanism"] = mechanism
            conf["sasl.jaas.config"] = '%s required username="%s" password="%s";' % (
                module, user, self.users.get(user) if password is None else password)
        return conf

    def try_login(self, listener, mechanism=None, user=None, password=None, timeout=15.0,
                  bootstrap=None, **settings):
        """Log in once with confluent-kafka and ask for Metadata: None if that worked, else
        what went wrong (the client's errors, e.g. "SASL authentication error: ...")."""
        return _try_login(self.client_config(listener, mechanism, user, password, bootstrap,
                                             **settings), timeout)

    # running Java --------------------------------------------------------------------------

    def classpath(self):
        return str(self.lib / "*")

    def java_command(self, main_class, *args, heap="256m", jvm_args=()):
        """The command line that runs ``main_class`` from Kafka's jars, as
        ``bin/kafka-run-class.sh`` would."""
        if self.lib is None:
            self.lib = kafka_lib(self.version)
        return [java_binary(), "-Xmx%s" % heap, "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                *self._log_settings(tool=True), *jvm_args, "-cp", self.classpath(), main_class,
                *map(str, args)]

    def tool(self, main_class, *args, timeout=60, check=True, jvm_args=()):
        """Run one of Kafka's command-line tools to its end: the CompletedProcess (text)."""
        return subprocess.run(self.java_command(main_class, *args, jvm_args=jvm_args),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def _log_settings(self, tool=False):
        """The broker logs at INFO to its stdout (the log file); a tool warnings only, to its
        stderr, as bin/*.sh do with config/tools-log4j2.yaml."""
        if self.workdir is None:
            return []
        name = "tools-log4j" if tool else "log4j"
        if self.version.startswith("3."):  # reload4j (log4j 1 syntax)
            return ["-Dlog4j.configuration=file:%s" % (self.workdir / (name + ".properties"))]
        return ["-Dlog4j2.configurationFile=%s" % (self.workdir / (name + "2.properties"))]

    # lifecycle -----------------------------------------------------------------------------

    def server_properties(self):
        listeners = ["PLAINTEXT://%s:%d" % (self.host, self.port)]
        advertised = ["PLAINTEXT://%s" % self.advertised]
        protocols = ["PLAINTEXT:PLAINTEXT"]
        if not self.zookeeper:
            listeners.append("CONTROLLER://%s:%d" % (self.host, self.controller_port))
            protocols.append("CONTROLLER:PLAINTEXT")
        for spec in self.listeners:
            port = self.listener_ports[spec.name]
            listeners.append("%s://%s:%d" % (spec.name, self.host, port))
            advertised.append("%s://%s:%d" % (spec.name, self.advertised_host, port))
            protocols.append("%s:%s" % (spec.name, spec.protocol))
        if self.ipv6_port:
            listeners.append("LOOPBACK6://%s" % self.bootstrap_ipv6)
            advertised.append("LOOPBACK6://%s" % self.bootstrap_ipv6)
            protocols.append("LOOPBACK6:PLAINTEXT")
        if self.zookeeper:
            props = {
                "broker.id": str(self.node_id),
                "zookeeper.connect": self.zookeeper,
                "zookeeper.connection.timeout.ms": "30000",
            }
        else:
            props = {
                "process.roles": "broker,controller",
                "node.id": str(self.node_id),
                # a static quorum (one voter, or a KafkaCluster's): the same on 3.9 and 4.x,
                # no --standalone or --initial-controllers needed
                "controller.quorum.voters": self.voters or "%d@%s:%d" % (
                    self.node_id, self.host, self.controller_port),
                "controller.listener.names": "CONTROLLER",
            }
        props.update({
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": ",".join(protocols),
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
        })
        settings = self.settings
        if self.version.startswith("3."):  # KIP-932's settings are unknown there
            settings = {k: v for k, v in settings.items() if not k.startswith("share.")}
        props.update(settings)
        props.update(self._security_properties())
        props.update({k: str(v) for k, v in self.config.items()})
        return props

    def _security_properties(self):
        props = {}
        for spec in self.listeners:
            prefix = "listener.name.%s." % spec.name.lower()
            if spec.mechanisms:
                props[prefix + "sasl.enabled.mechanisms"] = ",".join(spec.mechanisms)
            for mechanism in spec.mechanisms:
                key = prefix + mechanism.lower() + ".sasl.jaas.config"
                if mechanism == "PLAIN":
                    props[key] = "org.apache.kafka.common.security.plain.PlainLoginModule " \
                        "required%s;" % "".join(' user_%s="%s"' % u for u in self.users.items())
                elif mechanism in SCRAM:
                    props[key] = "org.apache.kafka.common.security.scram.ScramLoginModule " \
                        "required;"
                elif mechanism == "OAUTHBEARER":
                    # the broker's own login (it makes an unsecured token at start) needs a sub
                    props[key] = ("org.apache.kafka.common.security.oauthbearer."
                                  'OAuthBearerLoginModule required unsecuredLoginStringClaim_sub'
                                  '="admin";')
                    if spec.jwks:  # KIP-768; the default is the unsecured validator (KIP-255)
                        props[prefix + "oauthbearer.sasl.server.callback.handler.class"] = (
                            "org.apache.kafka.common.security.oauthbearer."
                            "OAuthBearerValidatorCallbackHandler")
                else:
                    raise ValueError("no broker setup for SASL mechanism %r" % mechanism)
        if any(spec.jwks for spec in self.listeners):
            props["sasl.oauthbearer.jwks.endpoint.url"] = self.oauth["jwks_url"]
            if self.oauth.get("audience"):
                props["sasl.oauthbearer.expected.audience"] = self.oauth["audience"]
            if self.oauth.get("issuer"):
                props["sasl.oauthbearer.expected.issuer"] = self.oauth["issuer"]
        if any(spec.tls for spec in self.listeners):
            # KIP-651: a PEM key store inline (an unencrypted PKCS#8 key: no ssl.key.password)
            props.update({"ssl.keystore.type": "PEM",
                          "ssl.keystore.certificate.chain": self.tls.chain_pem,
                          "ssl.keystore.key": self.tls.key_pem})
        if self.authorizer:
            props["authorizer.class.name"] = (
                "kafka.security.authorizer.AclAuthorizer" if self.zookeeper else
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer")
            props["super.users"] = ";".join("User:%s" % u
                                            for u in ("ANONYMOUS",) + self.super_users)
        return props

    def _scram_mechanisms(self):
        return [m for m in SCRAM if any(m in spec.mechanisms for spec in self.listeners)]

    def _write_files(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls is None and any(spec.tls for spec in self.listeners):
            self.tls = make_tls(self.workdir / "tls")
        with open(self.workdir / "server.properties", "w") as f:
            f.writelines("%s=%s\n" % (k, _properties_value(v))
                         for k, v in self.server_properties().items())
        # Kafka's distribution ships these in config/; the Maven artifacts do not
        for name, level, target in (("log4j", "info", "SYSTEM_OUT"),
                                    ("tools-log4j", "warn", "SYSTEM_ERR")):
            (self.workdir / (name + "2.properties")).write_text(
                "status = warn\n"
                "appender.out.type = Console\nappender.out.name = OUT\n"
                "appender.out.target = %s\n"
                "appender.out.layout.type = PatternLayout\n"
                "appender.out.layout.pattern = [%%d] %%p %%m (%%c)%%n\n"
                "rootLogger.level = %s\nrootLogger.appenderRef.out.ref = OUT\n" % (target, level))
            (self.workdir / (name + ".properties")).write_text(
                "log4j.rootLogger=%s, out\n"
                "log4j.appender.out=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.out.Target=%s\n"
                "log4j.appender.out.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.out.layout.ConversionPattern=[%%d] %%p %%m (%%c)%%n\n"
                "log4j.logger.org.apache.zookeeper=WARN\n"
                % (level.upper(), "System.err" if target == "SYSTEM_ERR" else "System.out"))

    def start(self, timeout=90.0):
        """Format (first start only) and start the node; return once it answers Metadata
        naming itself. A second ``start`` after ``stop(keep=True)`` or ``kill`` keeps the
        data."""
        began = time.monotonic()
        self.launch()
        try:
            self.wait_ready(timeout)
            if self.zookeeper and self.users and self._scram_mechanisms() and not self._zk_users:
                for user, password in self.users.items():
                    self.add_scram_user(user, password)
                self._zk_users = True
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    _zk_users = False

    def launch(self):
        """``start`` without the wait: write the files, format if new, start the process."""
        self.prepare()
        return self.spawn()

    def prepare(self):
        """Write the files and format the storage if new (safe in another thread)."""
        if self.lib is None:
            self.lib = kafka_lib(self.version)
        if java_version() < 17:
            raise KafkaMissing("Apache Kafka %s needs Java 17 or newer; %s is %s" % (
                self.version, java_binary(), java_version()))
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kafka-"))
        if self.log_path is None:
            self.log_path = self.workdir / "kafka.log"
        self._write_files()
        if not self.zookeeper and not (self.workdir / "data" / "meta.properties").exists():
            self.format()

    def spawn(self):
        """Start the broker's process. In the thread that lives as long as the broker: the
        process gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
        jvm_args = list(self.jvm_args)
        if any(spec.jwks for spec in self.listeners):
            # Kafka 4.0 allows no JWKS or token URL unless listed here (3.9.1: all allowed)
            jvm_args.append("-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls=%s"
                            % self.oauth["jwks_url"])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [java_binary(), "-Xmx%s" % self.heap, "-XX:+UseG1GC",
                 "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                 *self._log_settings(), *jvm_args, "-cp", self.classpath(), BROKER_MAIN,
                 str(self.workdir / "server.properties")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, preexec_fn=_die_with_parent)
        return self

    def format(self):
        """The storage tool's ``format``, as bin/kafka-storage.sh does before a first start;
        with ``--add-scram`` for the users (KRaft has no ZooKeeper to keep them, KIP-900)."""
        self.cluster_id = self.cluster_id or _random_cluster_id()
        args = ["format", "--config", self.workdir / "server.properties",
                "--cluster-id", self.cluster_id]
        for name, level in self.feature.items():
            args += ["--feature", "%s=%s" % (name, level)]
        for mechanism in self._scram_mechanisms():
            for user, password in self.users.items():
                args += ["--add-scram", "%s=[name=%s,password=%s]" % (mechanism, user, password)]
        done = self.tool(STORAGE_TOOL, *args, check=False)
        if done.returncode != 0:
            raise RuntimeError("kafka-storage format failed (%d): %s%s"
                               % (done.returncode, done.stdout, done.stderr))

    def add_scram_user(self, user, password, mechanisms=None):
        """SCRAM credentials for ``user`` once the broker runs: in ZooKeeper mode with
        ConfigCommand --zookeeper (as bin/kafka-configs.sh does in 3.x), in KRaft with the
        AlterUserScramCredentials API (KIP-554). Then waits until a login works."""
        mechanisms = list(mechanisms or self._scram_mechanisms() or SCRAM)
        self.users[user] = password
        if self.zookeeper:
            self.tool(CONFIG_COMMAND, "--zookeeper", self.zookeeper, "--alter",
                      "--add-config", ",".join("%s=[password=%s]" % (m, password)
                                               for m in mechanisms),
                      "--entity-type", "users", "--entity-name", user)
        else:
            from confluent_kafka.admin import (ScramCredentialInfo, ScramMechanism,
                                               UserScramCredentialUpsertion)

            admin = self.admin()
            futures = admin.alter_user_scram_credentials([
                UserScramCredentialUpsertion(
                    user, ScramCredentialInfo(getattr(ScramMechanism, m.replace("-", "_")),
                                              4096), password.encode())
                for m in mechanisms])
            for future in futures.values():
                future.result(30)
        # a broker learns of them a moment later (a ZooKeeper watch, or the metadata log)
        listener = next((s.name for s in self.listeners
                         if any(m in s.mechanisms for m in mechanisms)), None)
        if listener is not None and self.proc is not None:
            deadline = time.monotonic() + 30
            while True:
                error = self.try_login(listener, mechanisms[0], user, password, timeout=5)
                if error is None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("%s cannot log in with %s on %s: %s"
                                       % (user, mechanisms[0], listener, error))
                time.sleep(0.2)

    def wait_ready(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("Apache Kafka exited with code %s before it answered; the "
                                   "end of its log (%s):\n%s" % (self.proc.returncode,
                                                                 self.log_path, self.log_tail()))
            try:
                brokers, controller = metadata_brokers(self.host, self.port)
                if any(b[0] == self.node_id for b in brokers):
                    if self.ipv6_port:
                        metadata_brokers("::1", self.ipv6_port)
                    for port in self.listener_ports.values():
                        socket.create_connection((self.host, port), timeout=2).close()
                    return
                last = "Metadata names brokers %s, controller %s" % (brokers, controller)
            except (OSError, struct.error) as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError("Apache Kafka did not answer Metadata on %s within %.0f s (%s); the "
                           "end of its log (%s):\n%s" % (self.bootstrap, timeout, last,
                                                         self.log_path, self.log_tail()))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        """kill -9 by its own PID: no controlled shutdown, the data stays for ``start``."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, grace=20.0, keep=None):
        """SIGTERM (a controlled shutdown), SIGKILL after ``grace`` seconds; then its files go,
        unless ``keep`` (or the constructor's)."""
        stop_process(self.proc, grace=grace)
        self.proc = None
        keep = self.keep if keep is None else keep
        if not keep and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # conveniences for tests ----------------------------------------------------------------

    def admin(self, **settings):
        """A confluent-kafka AdminClient on the broker itself (not through any proxy)."""
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, **settings})

    def create_topic(self, name, partitions=1, config=None, timeout=30.0, replication_factor=1):
        _create_topic(self.admin(), name, partitions, replication_factor, config, timeout)

    def set_group_config(self, group, **settings):
        """Group configs (KIP-848/KIP-932), e.g. share_auto_offset_reset="earliest" for
        ``share.auto.offset.reset`` (a share group starts at the latest offset by default)."""
        set_group_config(self.admin(), group,
                         {k.replace("_", "."): v for k, v in settings.items()})


def set_group_config(admin, group, settings, timeout=30.0):
    """Set the group configs ``settings`` ({name: value}, e.g. {"share.auto.offset.reset":
    "earliest"}) of ``group`` through ``admin`` (a confluent-kafka AdminClient)."""
    from confluent_kafka.admin import (AlterConfigOpType, ConfigEntry, ConfigResource,
                                       ResourceType)

    entries = [ConfigEntry(k, str(v), incremental_operation=AlterConfigOpType.SET)
               for k, v in settings.items()]
    # admin kept until the answer: a dropped client cancels its futures
    futures = admin.incremental_alter_configs(
        [ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)])
    for future in futures.values():
        future.result(timeout)


def _create_topic(admin, name, partitions, replication_factor, config, timeout):
    from confluent_kafka.admin import NewTopic

    # admin kept until the answer: a dropped client cancels its futures
    futures = admin.create_topics(
        [NewTopic(name, partitions, replication_factor, config=dict(config or {}))],
        operation_timeout=timeout, request_timeout=timeout)
    futures[name].result(timeout)


# what librdkafka reports when a login can never work (no retry will help)
LOGIN_REFUSED = re.compile(r"[Aa]uthentication|SSL handshake failed|certificate verify failed|"
                           r"OAUTHBEARER token")


def _try_login(conf, timeout):
    import confluent_kafka

    errors = []
    producer = confluent_kafka.Producer(dict(conf, error_cb=lambda e: errors.append(str(e))))
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            producer.list_topics(timeout=1.0)
            return None
        except confluent_kafka.KafkaException as exc:
            last = str(exc)  # not the exception: its traceback would keep the client alive
        producer.poll(0)  # serves error_cb
        if any(LOGIN_REFUSED.search(e) for e in errors) or time.monotonic() > deadline:
            return "; ".join(errors) or last


class KafkaCluster:
    """``n`` Apache Kafka nodes (``node_ids``, default 1..n), each broker and controller in
    one JVM (``KafkaBroker``), with a static quorum of all of them as voters
    (controller.quorum.voters), on 127.0.0.1 and free ports; internal topics replicated 3 times
    with a min ISR of 2 (``cluster_settings``). Every node's data is under ``workdir`` (a new
    temporary directory if None), node-N/, removed by ``stop`` unless ``keep``; node N logs
    to ``log_dir``/kafka-N.log if given (else node-N/kafka.log). ``listeners``,
    ``users``, ``oauth``, ``authorizer``, ``config`` and ``feature`` as for ``KafkaBroker``,
    on every node (one CA for all TLS listeners).

    ``nodes``: {node id: KafkaBroker}. ``kill(id)`` is kill -9, ``restart(id)`` starts it
    again on its data; ``leaders(topic)``, ``elect_leaders``, ``move_leader`` to look at and
    move leaderships."""

    def __init__(self, workdir=None, n=3, node_ids=None, version=KAFKA_VERSION, lib=None,
                 host="127.0.0.1", heap="448m", config=None, feature=None, listeners=(),
                 users=None, oauth=None, authorizer=False, super_users=("admin",),
                 log_dir=None, keep=False):
        node_ids = list(node_ids) if node_ids else list(range(1, n + 1))
        if len(set(node_ids)) != len(node_ids):
            raise ValueError("node ids repeat: %s" % node_ids)
        self.workdir = Path(workdir) if workdir else None
        self.log_dir = Path(log_dir) if log_dir else None
        self.version = version
        self.host = host
        self.keep = keep
        self.listeners = tuple(listeners)
        self.tls = None
        self.nodes = {}
        for node_id in node_ids:
            self.nodes[node_id] = KafkaBroker(
                version=version, lib=lib, host=host, node_id=node_id, heap=heap, config=config,
                feature=feature, keep=True, listeners=listeners, users=users, oauth=oauth,
                authorizer=authorizer, super_users=super_users,
                settings=cluster_settings(len(node_ids)))
        voters = ",".join("%d@%s:%d" % (node.node_id, host, node.controller_port)
                          for node in self.nodes.values())
        for node in self.nodes.values():
            node.voters = voters
        self.started_in = None

    # addresses -----------------------------------------------------------------------------

    @property
    def node_ids(self):
        return list(self.nodes)

    @property
    def bootstrap(self):
        """Every node's PLAINTEXT listener, comma-separated."""
        return self.listener("PLAINTEXT")

    def listener(self, name):
        """Every node's address of the client listener ``name``, comma-separated."""
        return ",".join(node.listener(name) for node in self.nodes.values())

    def alive_bootstrap(self):
        return ",".join(node.bootstrap for node in self.nodes.values() if node.alive())

    def client_config(self, listener="PLAINTEXT", mechanism=None, user=None, password=None,
                      **settings):
        first = next(iter(self.nodes.values()))
        return first.client_config(listener, mechanism, user, password,
                                   bootstrap=self.listener(listener), **settings)

    def java_client_config(self, listener="PLAINTEXT", mechanism=None, user=None,
                           password=None):
        first = next(iter(self.nodes.values()))
        return first.java_client_config(listener, mechanism, user, password,
                                        bootstrap=self.listener(listener))

    def try_login(self, listener, mechanism=None, user=None, password=None, timeout=15.0,
                  **settings):
        return _try_login(self.client_config(listener, mechanism, user, password, **settings),
                          timeout)

    def tool(self, main_class, *args, **kwargs):
        """One of Kafka's tools (``KafkaBroker.tool``); give it ``bootstrap`` yourself."""
        return next(iter(self.nodes.values())).tool(main_class, *args, **kwargs)

    def java_command(self, main_class, *args, **kwargs):
        return next(iter(self.nodes.values())).java_command(main_class, *args, **kwargs)

    # lifecycle -----------------------------------------------------------------------------

    def start(self, timeout=120.0):
        """Format and start every node at once, then wait for each: a quorum needs a majority
        of the voters up before any node can answer. Returns once every node answers
        Metadata naming all of them."""
        began = time.monotonic()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kafka-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        if any(spec.tls for spec in self.listeners):
            self.tls = make_tls(self.workdir / "tls")
        cluster_id = _random_cluster_id()
        failures = []

        def prepare(node):  # the storage tool is a JVM start of its own: all at once
            try:
                node.prepare()
            except BaseException as exc:  # noqa: B902 (raised below, in the caller)
                failures.append(exc)

        threads = []
        for node_id, node in self.nodes.items():
            node.workdir = self.workdir / ("node-%d" % node_id)
            if self.log_dir is not None:
                node.log_path = self.log_dir / ("kafka-%d.log" % node_id)
            node.cluster_id = cluster_id
            node.tls = self.tls
            threads.append(threading.Thread(target=prepare, args=(node,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        try:
            if failures:
                raise failures[0]
            for node in self.nodes.values():
                node.spawn()
            deadline = time.monotonic() + timeout
            for node in self.nodes.values():
                node.wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_brokers(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def wait_brokers(self, node_ids=None, timeout=60.0):
        """Until every running node's Metadata names every node of ``node_ids`` (default the
        running ones): registered with the controller and unfenced."""
        deadline = time.monotonic() + timeout
        while True:
            running = [node for node in self.nodes.values() if node.alive()]
            wanted = set(node_ids or [node.node_id for node in running])
            seen = {}
            for node in running:
                try:
                    seen[node.node_id] = {b[0] for b in metadata_brokers(node.host, node.port)[0]}
                except (OSError, struct.error) as exc:
                    seen[node.node_id] = exc
            if all(isinstance(ids, set) and wanted <= ids for ids in seen.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("nodes %s not all seen within %.0f s: %s"
                                   % (sorted(wanted), timeout, seen))
            time.sleep(0.2)

    def kill(self, node_id):
        """kill -9 of node ``node_id`` by its own PID; its data stays for ``restart``."""
        self.nodes[node_id].kill()

    def restart(self, node_id, timeout=90.0):
        """Start node ``node_id`` again on its data (after ``kill``, or a stop that kept it);
        returns once every running node names it again."""
        node = self.nodes[node_id]
        if node.alive():
            node.stop(keep=True)
        began = time.monotonic()
        node.launch()
        node.wait_ready(timeout)
        self.wait_brokers(timeout=max(1.0, timeout - (time.monotonic() - began)))
        return node

    def stop(self, grace=15.0, keep=None):
        """SIGTERM to every node at once (by its own PID), SIGKILL to any still there after
        ``grace`` seconds; then the files go unless ``keep`` (or the constructor's)."""
        running = [node.proc for node in self.nodes.values() if node.alive()]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for node in self.nodes.values():
            node.proc = None
        keep = self.keep if keep is None else keep
        if not keep and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # topics and leaders --------------------------------------------------------------------

    def admin(self, **settings):
        """A confluent-kafka AdminClient on the running nodes (PLAINTEXT)."""
        from confluent_kafka.admin import AdminClient

        # log_level 0: no "Connect failed" lines for a node just killed (errors still raise)
        return AdminClient({"bootstrap.servers": self.alive_bootstrap(), "log_level": 0,
                            **settings})

    def create_topic(self, name, partitions=1, replication_factor=3, config=None,
                     timeout=30.0):
        """A topic; with more than one replica min.insync.replicas is 2 unless ``config``
        says otherwise. Returns once Metadata names a leader for every partition."""
        config = dict(config or {})
        if replication_factor > 1:
            config.setdefault("min.insync.replicas", "2")
        _create_topic(self.admin(), name, partitions, replication_factor, config, timeout)
        deadline = time.monotonic() + timeout
        while True:
            leaders = self.leaders(name)
            if len(leaders) == partitions and all(n >= 0 for n in leaders.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("topic %s has leaders %s" % (name, leaders))
            time.sleep(0.1)

    def partitions(self, topic):
        """{partition: (leader, replicas, isr)} as a Metadata request sees them now."""
        from confluent_kafka import KafkaException

        try:
            meta = self.admin().list_topics(topic, timeout=10)
        except KafkaException:
            return {}
        found = meta.topics.get(topic)
        if found is None or found.error is not None:
            return {}
        return {p.id: (p.leader, list(p.replicas), list(p.isrs))
                for p in found.partitions.values()}

    def leaders(self, topic):
        """{partition: leader node id} (-1: none now)."""
        return {p: leader for p, (leader, _, _) in self.partitions(topic).items()}

    def wait_leader(self, topic, partition, not_on=None, on=None, timeout=60.0):
        """Until ``partition`` has a leader, other than ``not_on`` (and node ``on`` if given),
        as Metadata says: that leader."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leaders(topic).get(partition, -1)
            if leader >= 0 and leader != not_on and on in (None, leader):
                return leader
            if time.monotonic() > deadline:
                raise TimeoutError("%s-%d has leader %s after %.0f s (wanted %s, not %s)"
                                   % (topic, partition, leader, timeout, on, not_on))
            time.sleep(0.2)

    def wait_in_sync(self, topic, timeout=60.0):
        """Until every replica of every partition of ``topic`` is in its ISR."""
        deadline = time.monotonic() + timeout
        while True:
            parts = self.partitions(topic)
            if parts and all(sorted(r) == sorted(i) for _, r, i in parts.values()):
                return parts
            if time.monotonic() > deadline:
                raise TimeoutError("%s not in sync after %.0f s: %s" % (topic, timeout, parts))
            time.sleep(0.2)

    def elect_leaders(self, topic, partitions=None, unclean=False, timeout=30.0):
        """A preferred (or unclean) leader election (KIP-460) for ``partitions`` of ``topic``
        (default all): {partition: None, or the error, e.g. ELECTION_NOT_NEEDED when the
        preferred replica leads already}."""
        from confluent_kafka import ElectionType, TopicPartition

        partitions = sorted(self.leaders(topic)) if partitions is None else partitions
        admin = self.admin()
        # (confluent-kafka 2.16 fails on this method's timeout arguments: its defaults)
        future = admin.elect_leaders(ElectionType.UNCLEAN if unclean else ElectionType.PREFERRED,
                                     [TopicPartition(topic, p) for p in partitions])
        return {tp.partition: error for tp, error in future.result(timeout).items()}

    def move_leader(self, topic, partition, node_id, timeout=60.0):
        """Make ``node_id`` (a replica in the ISR) lead ``partition``: reorder the replicas
        so that it is the preferred one (kafka-reassign-partitions; no data moves), then a
        preferred election. Returns once Metadata names it leader."""
        import json

        leader, replicas, _ = self.partitions(topic)[partition]
        if node_id not in replicas:
            raise ValueError("node %d is no replica of %s-%d (%s)" % (node_id, topic, partition,
                                                                     replicas))
        order = [node_id] + [r for r in replicas if r != node_id]
        plan = self.workdir / ("reassign-%s.json" % uuid.uuid4().hex[:8])
        plan.write_text(json.dumps({"version": 1, "partitions": [
            {"topic": topic, "partition": partition, "replicas": order}]}))
        done = self.tool(REASSIGN_PARTITIONS, "--bootstrap-server", self.alive_bootstrap(),
                         "--reassignment-json-file", plan, "--execute", check=False,
                         timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError("reassignment failed: %s%s" % (done.stdout, done.stderr))
        deadline = time.monotonic() + timeout
        while True:
            if self.partitions(topic).get(partition, (None, []))[1] == order:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("replicas of %s-%d not reordered" % (topic, partition))
            time.sleep(0.2)
        while True:
            if self.leaders(topic).get(partition) == node_id:
                return node_id
            self.elect_leaders(topic, [partition], timeout=max(1.0, deadline - time.monotonic()))
            if self.leaders(topic).get(partition) == node_id:
                return node_id
            if time.monotonic() > deadline:
                raise TimeoutError("node %d does not lead %s-%d" % (node_id, topic, partition))
            time.sleep(0.5)


def _random_cluster_id():
    """What ``kafka-storage random-uuid`` prints: a random UUID, base64url, no padding, and
    never starting with '-' (Kafka's Uuid.randomUuid draws again then: a command line would
    read it as an option)."""
    import base64

    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


@functools.lru_cache(maxsize=None)
def java_version():
    """The major version of ``java_binary()`` (17, 21, ...)."""
    out = subprocess.run([java_binary(), "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        return 0
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 else major


# Kafka's tools as processes ---------------------------------------------------------------

# A tool's log4j2 settings: warnings to stderr, and the Java client's NetworkClient at INFO (the
# tools log at WARN), so that a request timeout ("Disconnecting from node 1 due to request
# timeout") and a dropped connection ("Cancelled in-flight PRODUCE request ... due to node 1
# being disconnected") show in its stderr
TOOL_LOG4J2 = """status = warn
appender.err.type = Console
appender.err.name = ERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = ERR
logger.net.name = org.apache.kafka.clients.NetworkClient
logger.net.level = info
"""


class JavaTool:
    """One of Kafka's tools as a process: each stdout line with the time it came, stderr in a
    file. ``watch_for``: a regex; when a stdout line first matches it, ``on_match`` runs (in
    the reader thread) before the next line is read. ``kafka``: a KafkaBroker or KafkaCluster
    (its jars); give the tool its bootstrap address in ``args``."""

    def __init__(self, kafka, main_class, args, stderr_path, log_config):
        self.command = kafka.java_command(
            main_class, *args, jvm_args=["-Dlog4j2.configurationFile=%s" % log_config])
        self.stderr_path = stderr_path
        self.lines = []  # (monotonic time, text)
        self.proc = None
        self.watch_for = None
        self.on_match = None

    def start(self):
        self._err = open(self.stderr_path, "wb")
        # a session of its own: Ctrl-C reaches only the Python process, which stops the tool
        # by its PID (a tool's SIGINT would race that stop)
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._err,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     start_new_session=True, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if self.watch_for is not None and self.watch_for.search(line):
                self.watch_for = None
                self.on_match()

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self, grace=10.0):
        """SIGTERM (a tool's shutdown hook closes its clients and prints its summary), SIGKILL
        after ``grace`` seconds. Safe to call twice, or before ``start``."""
        if self.proc is None:
            return
        stop_process(self.proc, grace=grace)
        self._reader.join(5)
        self._err.close()

    def stdout(self):
        return "\n".join(text for _, text in self.lines)

    def stderr(self):
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return "(no stderr)"


def tool_events(tool, name, start=0):
    """The JSON lines of a VerifiableProducer/VerifiableConsumer (``tool``, a JavaTool) named
    ``name`` ("producer_send_success", "record_data", ...), from line ``start`` on."""
    import json

    marker = '"name":"%s"' % name
    return [json.loads(text) for _, text in tool.lines[start:]
            if text.startswith("{") and marker in text]


class VerifiableResult:
    """What a ``VerifiableRun`` saw, from both tools' JSON lines. ``acked_records`` and
    ``consumed_records``: {(partition, offset): value} (a record consumed twice, after a
    rebalance, has one place in the log). ``sent``/``acked`` are the producer's own summary
    (tool_data; None if it printed none). ``lost``: places acknowledged and never consumed;
    ``changed``: [(place, value acknowledged, value consumed)]; ``duplicated``: {value:
    places} for values in the log more than once; ``send_errors``: the producer_send_error
    events. ``timeline``: [(seconds since the producer started, event, acked so far)];
    ``failover``: seconds from the kill -9 (the process gone) to Metadata naming another
    leader; ``elapsed``: seconds from the producer's start to the consumer's catching up."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    @property
    def consumed(self):
        return len(self.consumed_records)

    @property
    def election_acked(self):
        """Records acknowledged when the preferred election was over (None: it never was)."""
        return next((acked for _, what, acked in self.timeline if "election" in what), None)

    @property
    def ok(self):
        """Nothing lost, changed, doubled or failed, every record sent acknowledged and read,
        and the kill and the election both while the producer still sent."""
        return (self.sent is not None and not self.lost and not self.changed
                and not self.duplicated and not self.send_errors
                and self.sent == self.acked == len(self.acked_records)
                and sorted(map(int, self.consumed_records.values())) == list(range(self.sent))
                and self.election_acked is not None and self.election_acked < self.sent)

    def summary(self):
        return "timeline (s, event, acked so far):\n  %s" % "\n  ".join(map(str, self.timeline))


class VerifiableRun:
    """Kafka's VerifiableProducer (acks=all, enable.idempotence=true) and VerifiableConsumer,
    the tools of Kafka's system tests, through ``bootstrap`` (a proxy's, or the cluster's own)
    on a new topic of ``cluster`` (a KafkaCluster) with 3 replicas and min.insync.replicas 2,
    while the leader of partition 0 is killed (kill -9), started again on its data and given
    its leadership back by a preferred election (KIP-460). The producer sends at most
    ``records`` at ``throughput`` a second and is stopped ``after`` seconds after the
    election; the consumer then reads until it has every acknowledged record (at most
    ``catch_up`` seconds). Its files (configs, the tools' stderr) go in ``workdir``.

    ``run()`` returns a ``VerifiableResult``; it raises if the scenario cannot go on (no
    acknowledgements, a tool exits, no new leader). A node it killed is started again before
    it returns or raises, unless on Ctrl-C (then everything is about to stop)."""

    ACKED_MARK = '"name":"producer_send_success"'

    def __init__(self, cluster, bootstrap, workdir, topic=None, records=50_000,
                 throughput=1_000, kill_after=2_000, after=3.0, partitions=3, catch_up=45.0,
                 producer_id="verifiable-producer", consumer_id="verifiable-consumer",
                 first_acks_timeout=60.0, producer_grace=30.0, log=None):
        self.cluster = cluster
        self.bootstrap = bootstrap
        self.workdir = Path(workdir)
        self.topic = topic or "verifiable-%s" % uuid.uuid4().hex[:8]
        self.records, self.throughput = records, throughput
        self.kill_after, self.after = kill_after, after
        self.partitions, self.catch_up = partitions, catch_up
        self.producer_id, self.consumer_id = producer_id, consumer_id
        self.first_acks_timeout = first_acks_timeout
        # a throttled producer's close waits for every record it still holds
        self.producer_grace = producer_grace
        self.log = log or (lambda text: None)  # progress lines (a benchmark prints them)
        self.producer = self.consumer = None
        self._seen = self._acked = 0

    def _acked_so_far(self):
        lines = self.producer.lines
        end = len(lines)
        self._acked += sum(1 for _, text in lines[self._seen:end] if self.ACKED_MARK in text)
        self._seen = end
        return self._acked

    def _tools(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_config = self.workdir / "tools-log4j2.properties"
        log_config.write_text(TOOL_LOG4J2)
        producer_config = self.workdir / "producer.properties"
        # (the tool sets retries=0 of its own: idempotence needs them, KIP-98)
        producer_config.write_text("client.id=%s\nenable.idempotence=true\nacks=all\n"
                                   "retries=2147483647\nlinger.ms=5\n" % self.producer_id)
        consumer_config = self.workdir / "consumer.properties"
        consumer_config.write_text("client.id=%s\n" % self.consumer_id)
        self.consumer = JavaTool(self.cluster, VERIFIABLE_CONSUMER, [
            "--topic", self.topic, "--group-id", "verifiable-%s" % self.topic, "--verbose",
            "--reset-policy", "earliest", "--bootstrap-server", self.bootstrap,
            "--command-config", consumer_config], self.workdir / "consumer.err", log_config)
        self.producer = JavaTool(self.cluster, VERIFIABLE_PRODUCER, [
            "--topic", self.topic, "--max-messages", self.records,
            "--throughput", self.throughput, "--acks", "-1",
            "--bootstrap-server", self.bootstrap, "--command-config", producer_config],
            self.workdir / "producer.err", log_config)

    def run(self):
        cluster, topic = self.cluster, self.topic
        cluster.create_topic(topic, partitions=self.partitions, replication_factor=3,
                             config={"min.insync.replicas": "2"})
        self._tools()
        producer, consumer = self.producer, self.consumer
        timeline = []
        victim = moved_to = election = failover = None
        began = caught_up = None
        restart = True

        def mark(what):
            timeline.append((round(time.monotonic() - began, 1), what, self._acked_so_far()))
            self.log("    %5.1f s  %s (%d acked)" % timeline[-1])

        try:
            consumer.start()
            producer.start()
            began = time.monotonic()
            while self._acked_so_far() < self.kill_after:
                if producer.proc.poll() is not None:
                    raise RuntimeError("VerifiableProducer exited (%s) before %d acks:\n%s" % (
                        producer.proc.returncode, self.kill_after, producer.stderr()[-3000:]))
                if time.monotonic() - began > self.first_acks_timeout:
                    raise TimeoutError("%d of %d acks in %.0f s:\n%s" % (
                        self._acked, self.kill_after, self.first_acks_timeout,
                        producer.stderr()[-3000:]))
                time.sleep(0.1)
            leader, replicas, _ = cluster.partitions(topic)[0]
            if leader != replicas[0]:
                raise RuntimeError("a new topic is led by its preferred replica: %s-0 has "
                                   "leader %s, replicas %s" % (topic, leader, replicas))
            victim = leader
            cluster.kill(victim)
            killed = time.monotonic()
            mark("killed node %d, leader of partition 0" % victim)
            moved_to = cluster.wait_leader(topic, 0, not_on=victim, timeout=30)
            failover = time.monotonic() - killed
            mark("node %d leads partition 0" % moved_to)
            cluster.restart(victim)
            mark("node %d restarted" % victim)
            cluster.wait_in_sync(topic, timeout=60)
            mark("every replica in sync")
            # the victim was the preferred (first) replica: None here, unless Kafka's own
            # rebalance (auto.leader.rebalance.enable) was quicker (ELECTION_NOT_NEEDED)
            election = cluster.elect_leaders(topic, [0])
            back = cluster.wait_leader(topic, 0, on=victim, timeout=30)
            mark("preferred election: node %d leads partition 0 again" % back)
            try:  # a few seconds' more records to the leader elected; then SIGTERM: the tool
                # closes its producer (every send answered) and prints its summary (tool_data)
                producer.proc.wait(self.after)
            except subprocess.TimeoutExpired:
                pass
            producer.stop(self.producer_grace)
            mark("producer stopped (exit code %s)" % producer.proc.returncode)
            acked = {(e["partition"], e["offset"])
                     for e in tool_events(producer, "producer_send_success")}
            # the consumer reads until it has every acknowledged record, or gives up
            deadline = time.monotonic() + self.catch_up
            got, seen = set(), 0
            while True:
                end = len(consumer.lines)
                got.update((r["partition"], r["offset"])
                           for r in tool_events(consumer, "record_data", seen))
                seen = end
                caught_up = acked <= got
                if caught_up or time.monotonic() > deadline:
                    break
                if consumer.proc.poll() is not None:
                    raise RuntimeError("VerifiableConsumer exited (%s):\n%s" % (
                        consumer.proc.returncode, consumer.stderr()[-3000:]))
                time.sleep(0.5)
            mark("consumer caught up" if caught_up else
                 "consumer gave up after %.0f s, %d of %d read" % (
                     self.catch_up, len(acked & got), len(acked)))
            elapsed = time.monotonic() - began
        except KeyboardInterrupt:
            restart = False
            raise
        finally:
            producer.stop(self.producer_grace)
            consumer.stop()
            if restart and victim is not None and not cluster.nodes[victim].alive():
                cluster.restart(victim)
        return self._result(timeline, victim, moved_to, election, failover, elapsed,
                            caught_up)

    def _result(self, timeline, victim, moved_to, election, failover, elapsed, caught_up):
        producer, consumer = self.producer, self.consumer
        acked = {(e["partition"], e["offset"]): e["value"]
                 for e in tool_events(producer, "producer_send_success")}
        consumed = {}
        for r in tool_events(consumer, "record_data"):
            consumed.setdefault((r["partition"], r["offset"]), r["value"])
        places = {}
        for place, value in consumed.items():
            places.setdefault(value, []).append(place)
        summary = tool_events(producer, "tool_data")
        summary = summary[-1] if summary else None
        return VerifiableResult(
            topic=self.topic, bootstrap=self.bootstrap,
            sent=summary["sent"] if summary else None,
            acked=summary["acked"] if summary else None,
            tool_summary=summary,
            acked_records=acked, consumed_records=consumed,
            lost=sorted(place for place in acked if place not in consumed),
            changed=[(place, acked[place], consumed[place]) for place in acked
                     if place in consumed and consumed[place] != acked[place]],
            duplicated={value: spots for value, spots in places.items() if len(spots) > 1},
            send_errors=tool_events(producer, "producer_send_error"),
            timeline=timeline, victim=victim, new_leader=moved_to, election=election,
            failover=failover, elapsed=elapsed, caught_up=caught_up,
            producer=producer, consumer=consumer)
