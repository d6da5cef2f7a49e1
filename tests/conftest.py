"""Fixtures that start real components on 127.0.0.1 and free ports, and stop
them (by their own PID) when the tests that use them are done."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kthrottle.embedded import TansuBroker, free_port, stop_process, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The node id of the test broker: Tansu always reports 111, and the session's Apache Kafka node
# is given the same one, so that a proxy's node port is node_port_base + 111 on either.
BROKER_NODE_ID = 111
TANSU_NODE_ID = BROKER_NODE_ID


class ProxyProcess:
    """``kthrottle proxy`` as a separate process, as users run it."""

    def __init__(self, bootstrap, log_path, extra_args=(), node_id=BROKER_NODE_ID):
        self.port = free_port()
        # the broker's node (Tansu's 111; Apache Kafka's node.id) is served on
        # node_port_base + node_id: make that a free port
        self.node_port = free_port()
        self.node_port_base = self.node_port - node_id
        self.bootstrap_upstream = bootstrap
        self.log_path = Path(log_path)
        self.extra_args = list(extra_args)
        self.proc = None

    @property
    def bootstrap(self):
        return "127.0.0.1:%d" % self.port

    @property
    def ports(self):
        return {self.port, self.node_port}

    def start(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", "proxy",
                 "--bootstrap-server", self.bootstrap_upstream,
                 "--listen", self.bootstrap,
                 "--node-port-base", str(self.node_port_base), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )
        # the bootstrap port listens (connections queue in the kernel) before
        # the admin endpoint is up: a test that reads /metrics waits for both
        for port in (self.port, self._admin_port()):
            if port is not None:
                wait_for_port("127.0.0.1", port, proc=self.proc)
        return self

    def _admin_port(self):
        args = self.extra_args
        for i, arg in enumerate(args):
            if arg == "--admin-listen" and i + 1 < len(args):
                return int(str(args[i + 1]).rpartition(":")[2])
            if str(arg).startswith("--admin-listen="):
                return int(str(arg).rpartition(":")[2].rpartition("=")[2])
        return None

    def log(self):
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            time.sleep(0.05)
        raise AssertionError("%r not in proxy log:\n%s" % (text, self.log()[-3000:]))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        stop_process(self.proc, grace=10)

    @classmethod
    def for_cluster(cls, cluster, tmp_path, args):
        """A proxy in front of every node of a kafka_cluster.KafkaCluster (node N on
        node_port_base + N, free ports in a row), ``args`` given, and an admin endpoint:
        (the proxy started, the admin port)."""
        from kafka_cluster import free_ports_in_a_row

        admin = free_port()
        nodes = list(cluster.nodes.values())
        extra = []
        for node in nodes[1:]:
            extra += ["--bootstrap-server", node.bootstrap]
        proxy = cls(nodes[0].bootstrap, tmp_path / "proxy.log", node_id=nodes[0].node_id,
                    extra_args=extra + [str(a) for a in args]
                    + ["--admin-listen", "127.0.0.1:%d" % admin])
        low, high = min(cluster.nodes), max(cluster.nodes)
        first = free_ports_in_a_row(high - low + 1)
        proxy.node_port_base = first - low
        proxy.node_port = first
        return proxy.start(), admin


@pytest.fixture(scope="module")
def broker(apache_kafka):
    """The broker a module's tests talk to: the session's Apache Kafka node (node id 111).
    Every test names its own topics, so modules share it; a module that stops, restarts or
    reconfigures its broker starts one of its own (``tansu_broker`` where it is about Tansu)."""
    return apache_kafka


@pytest.fixture(scope="module")
def tansu_broker(tmp_path_factory):
    """A Tansu broker of the module's own: for tests about Tansu (the quick local demo)."""
    b = TansuBroker(log_path=tmp_path_factory.mktemp("tansu") / "tansu.log")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def proxy(broker, tmp_path_factory):
    p = ProxyProcess(broker.bootstrap, tmp_path_factory.mktemp("proxy") / "proxy.log")
    p.start()
    yield p
    p.stop()


def _started_kafka(tmp_path_factory, name, **settings):
    """A kafka_cluster.KafkaBroker (node id 111) started with its data and log in new
    temporary folders."""
    from kafka_cluster import KafkaBroker

    return _start_kafka(KafkaBroker(tmp_path_factory.mktemp(name + "-data"),
                                    node_id=BROKER_NODE_ID,
                                    log_path=tmp_path_factory.mktemp(name) / "kafka.log",
                                    **settings))


def _start_kafka(kit):
    """Start a KafkaBroker or KafkaCluster; pytest.fail (never a skip) when Java or the jars
    are missing: scripts/test fetches them."""
    from kafka_cluster import KafkaMissing

    try:
        kit.start()
        missing = None
    except KafkaMissing as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    return kit


@pytest.fixture(scope="session")
def apache_kafka(tmp_path_factory):
    """One Apache Kafka 4 node (KRaft, broker and controller in one JVM) for the whole session,
    node id 111 (BROKER_NODE_ID): a kafka_cluster.KafkaBroker, its address in ``.bootstrap``
    (127.0.0.1). Where the machine has IPv6 loopback it has a second listener on [::1] only
    (``.bootstrap_ipv6``): a proxy in front of that one is the only way a Java client started
    with IPV4_ONLY_JVM_ARGS can reach the broker. Fails (never skips) when Java or the jars are
    missing: scripts/test fetches them."""
    from kafka_cluster import ipv6_loopback

    kafka = _started_kafka(tmp_path_factory, "apache-kafka", ipv6_listener=ipv6_loopback())
    yield kafka
    kafka.stop()


@pytest.fixture(scope="module")
def own_kafka(tmp_path_factory):
    """An Apache Kafka node of the module's own (node id 111), for modules whose tests read
    the whole cluster (the Spark job reads every partition's leader, the report topics of every
    earlier test) or depend on the report topics' default names."""
    kafka = _started_kafka(tmp_path_factory, "own-kafka")
    yield kafka
    kafka.stop()


def pytest_collection_modifyitems(config, items):
    # every test on the real Apache Kafka is marked `kafka` (-m "not kafka" leaves them out)
    kafka_fixtures = {"apache_kafka", "own_kafka", "kafka_cluster3", "kafka_secure",
                      "kafka_zookeeper"}
    for item in items:
        if kafka_fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory):
    from zookeeper import ZooKeeperServer

    z = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    z.start()
    yield z
    z.stop()


# Hypothesis profiles for the fuzz tests (tests/test_fuzz_*.py). "ci", the
# default: a fixed example count per test (set by each test), derandomized and
# without an example database, so that every run tries the same examples.
# KTHROTTLE_FUZZ_EXAMPLES=N selects "long": N examples per test, randomized.
from hypothesis import HealthCheck, settings  # noqa: E402

_FUZZ_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=_FUZZ_HEALTH, print_blob=True)
settings.register_profile("long", derandomize=False, database=None, deadline=None,
                          suppress_health_check=_FUZZ_HEALTH, print_blob=True,
                          max_examples=int(os.environ.get("KTHROTTLE_FUZZ_EXAMPLES") or 100))
settings.load_profile("long" if os.environ.get("KTHROTTLE_FUZZ_EXAMPLES") else "ci")


# Apache Kafka beyond one plain node (tests/kafka_cluster.py), each for the whole session and
# stopped by its own PIDs: a three-node KRaft cluster, one node with SASL and TLS listeners,
# and Kafka 3.9 in ZooKeeper mode. Like apache_kafka they fail (never skip) without Java or
# the jars.
KAFKA_USERS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret"}


@pytest.fixture(scope="session")
def kafka_cluster3(tmp_path_factory):
    """Three Apache Kafka 4 nodes (ids 1, 2, 3), each broker and controller, a static quorum
    of three voters; internal topics with 3 replicas and min ISR 2. A kafka_cluster.KafkaCluster:
    ``.bootstrap`` (all three), ``.nodes``, ``kill``/``restart``, ``leaders``. A test that kills
    a node restarts it before it ends."""
    from kafka_cluster import KafkaCluster

    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster3"), n=3,
                           log_dir=tmp_path_factory.mktemp("kafka-cluster3-logs"))
    _start_kafka(cluster)
    yield cluster
    cluster.stop()


class _OAuthServer:
    """tests/oauth_server.py on 127.0.0.1: a JWKS and client-credentials tokens (RS256)."""

    CLIENT_ID, CLIENT_SECRET = "kafka-client", "kafka-client-secret"
    AUDIENCE, ISSUER = "kafka", "https://issuer.test"

    def __init__(self, tmp):
        import json

        import jwt
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        jwk.update(kid="k1", use="sig", alg="RS256")
        (tmp / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
        (tmp / "signing.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        self.port = free_port()
        self.args = [sys.executable, str(ROOT / "tests" / "oauth_server.py"),
                     "--port", str(self.port), "--jwks", str(tmp / "jwks.json"),
                     "--signing-key", str(tmp / "signing.pem"), "--kid", "k1",
                     "--client-id", self.CLIENT_ID, "--client-secret", self.CLIENT_SECRET,
                     "--audience", self.AUDIENCE, "--issuer", self.ISSUER, "--lifetime", "600"]
        self.log = tmp / "oauth.log"
        self.proc = None

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def start(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def stop(self):
        stop_process(self.proc, grace=10)


@pytest.fixture(scope="session")
def kafka_secure(tmp_path_factory):
    """One Apache Kafka 4 node with, beside PLAINTEXT: SASL_PLAINTEXT and SASL_SSL (PLAIN,
    SCRAM-SHA-256, SCRAM-SHA-512; users KAFKA_USERS, SCRAM ones written at format time),
    OAUTHBEARER (unsecured tokens) and OAUTH_JWKS (tokens of a local OAuth server checked
    against its JWKS). ``kafka.listener(NAME)`` is an address, ``kafka.tls.ca`` the CA file,
    ``kafka.client_config(NAME, MECHANISM, USER)`` confluent-kafka settings, and
    ``kafka.oidc`` the settings with which librdkafka gets OAUTH_JWKS tokens."""
    from kafka_cluster import SECURE_LISTENERS, KafkaBroker, Listener

    tmp = tmp_path_factory.mktemp("kafka-secure")
    oauth = _OAuthServer(tmp).start()
    kafka = KafkaBroker(
        tmp / "data", log_path=tmp / "kafka.log", users=KAFKA_USERS,
        listeners=SECURE_LISTENERS + (
            Listener("OAUTH_JWKS", "SASL_PLAINTEXT", ("OAUTHBEARER",), jwks=True),),
        oauth={"jwks_url": oauth.url("/jwks"), "audience": oauth.AUDIENCE,
               "issuer": oauth.ISSUER})
    kafka.oidc = {"sasl.oauthbearer.method": "oidc",
                  "sasl.oauthbearer.token.endpoint.url": oauth.url("/token"),
                  "sasl.oauthbearer.client.id": oauth.CLIENT_ID,
                  "sasl.oauthbearer.client.secret": oauth.CLIENT_SECRET}
    try:
        _start_kafka(kafka)
        yield kafka
    finally:
        kafka.stop()
        oauth.stop()


@pytest.fixture(scope="session")
def kafka_zookeeper(tmp_path_factory):
    """Apache Kafka 3.9.1 in ZooKeeper mode (broker.id 1, chroot /kafka39) on Debian's
    ZooKeeper, with SASL_PLAINTEXT (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) beside PLAINTEXT; the
    users' SCRAM credentials were written into ZooKeeper by ConfigCommand --zookeeper
    (``add_scram_user`` writes more). ``kafka.zookeeper_server`` is the ZooKeeperServer."""
    import zookeeper
    from kafka_cluster import SCRAM, KafkaBroker, Listener

    if not zookeeper.available():
        pytest.fail("Debian's ZooKeeper is missing (%s): apt-get install -y zookeeper"
                    % ", ".join(zookeeper.JARS), pytrace=False)
    tmp = tmp_path_factory.mktemp("kafka-zookeeper")
    zk = zookeeper.ZooKeeperServer(tmp / "zookeeper").start()
    kafka = KafkaBroker(tmp / "data", log_path=tmp / "kafka.log", version="3.9.1",
                        zookeeper=zk.hosts + "/kafka39", heap="384m",
                        users={"alice": KAFKA_USERS["alice"]},
                        listeners=[Listener("SASL_PLAINTEXT", "SASL_PLAINTEXT",
                                            ("PLAIN",) + SCRAM)])
    kafka.zookeeper_server = zk
    try:
        _start_kafka(kafka)
        yield kafka
    finally:
        kafka.stop()
        zk.stop()
