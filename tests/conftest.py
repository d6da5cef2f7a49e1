"""Fixtures that start real components on 127.0.0.1 and free ports, and stop
them (by their own PID) when the tests that use them are done. What they start comes from the
test kit (kthrottle_testkit), which the benchmarks import too.

Every test module says which kind it is with ``pytestmark``: ``pytest.mark.unit`` (no I/O:
no sockets, no subprocesses, no servers; seconds in all), ``pytest.mark.fuzz`` (no I/O either,
but long: hypothesis property runs, tests/test_fuzz_*.py) or ``pytest.mark.integration``
(servers, brokers, processes, sockets); collection fails for a module with none or more than
one, and a unit or fuzz test that opens a network socket fails (pytest-socket).
``scripts/test -m unit`` runs the unit ones, ``-m "unit or fuzz"`` every test without I/O."""
import collections
import os

import pytest
import pytest_socket

from kthrottle.embedded import TansuBroker
from kthrottle_testkit.brokers import KAFKA_USERS, start_kafka, started_kafka
from kthrottle_testkit.proxy import ProxyProcess

KINDS = ("unit", "fuzz", "integration")
NO_IO = ("unit", "fuzz")  # the kinds run with network sockets blocked


class _KindCheckedModule(pytest.Module):
    """A test module whose ``pytestmark`` names exactly one of KINDS, or a collection error."""

    def collect(self):
        marks = getattr(self.obj, "pytestmark", [])
        marks = marks if isinstance(marks, (list, tuple)) else [marks]
        kinds = sorted({m.name for m in marks if getattr(m, "name", None) in KINDS})
        if len(kinds) != 1:
            raise self.CollectError(
                "%s: %s; every test module says which kind it is with exactly one of "
                "pytestmark = pytest.mark.unit (no I/O: no sockets, no subprocesses, no servers), "
                "pytest.mark.fuzz (no I/O either, long hypothesis property runs) or "
                "pytest.mark.integration (starts servers, brokers or processes, or opens "
                "sockets), beside any other marks (pytestmark = [pytest.mark.integration, "
                "pytest.mark.kafka])" % (
                    self.path.name, "marked %s" % " and ".join(kinds) if kinds
                    else "marked none of unit, fuzz, integration"))
        return super().collect()


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name != "__init__.py":
        return _KindCheckedModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # a unit or fuzz test (its fixtures included) opens no network socket: AF_UNIX stays
    # allowed for the socketpair an asyncio event loop wakes itself with. pytest-socket's own
    # teardown puts the socket module back after each test.
    if any(item.get_closest_marker(kind) for kind in NO_IO):
        pytest_socket.disable_socket(allow_unix_socket=True)
    else:
        pytest_socket.enable_socket()


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


@pytest.fixture(scope="session")
def apache_kafka(tmp_path_factory):
    """One Apache Kafka 4 node (KRaft, broker and controller in one JVM) for the whole session,
    node id 111 (BROKER_NODE_ID): a kafka_kit.KafkaBroker, its address in ``.bootstrap``
    (127.0.0.1). Where the machine has IPv6 loopback it has a second listener on [::1] only
    (``.bootstrap_ipv6``): a proxy in front of that one is the only way a Java client started
    with IPV4_ONLY_JVM_ARGS can reach the broker. Fails (never skips) when Java or the jars are
    missing: scripts/test fetches them."""
    from kthrottle.kafka_kit import ipv6_loopback

    kafka = started_kafka(tmp_path_factory, "apache-kafka", ipv6_listener=ipv6_loopback())
    yield kafka
    kafka.stop()


@pytest.fixture(scope="module")
def own_kafka(tmp_path_factory):
    """An Apache Kafka node of the module's own (node id 111), for modules whose tests read
    the whole cluster (the Spark job reads every partition's leader, the report topics of every
    earlier test) or depend on the report topics' default names."""
    kafka = started_kafka(tmp_path_factory, "own-kafka")
    yield kafka
    kafka.stop()


# The order of the modules, so that two pytest-xdist workers (scripts/test: --dist loadfile,
# whole modules) end together: the longest first, the short ones filling in at the end. By
# default xdist hands out the modules with the most tests first, which left the few-but-long
# ones (Spark, the state topic, the fleet) to one worker for the last minutes. Measured with
# `scripts/test --durations=0` on 2 cores (per module: its tests' setup, call and teardown
# summed; the worker time of the whole suite was ~2,800 s). The unit modules come last (they
# fill in), among them too the longest first; a module not listed comes after the listed ones
# of its kind, the one with the most tests first.
# SHARED: modules that start the same session-wide Kafka clusters (conftest's kafka_cluster3,
# kafka_secure, kafka_zookeeper) go to one worker together, so that each cluster starts once.
SHARED = {name: "kafka-clusters" for name in (
    "test_kafka_kit.py", "test_leader_proportional.py", "test_verifiable.py",
    "test_kafka39_zookeeper.py")}
LONGEST_FIRST = [  # seconds per module in one run (2 cores, loaded): 248 ... 24
    "test_state_topic.py", "test_spark_sync.py", "kafka-clusters", "test_storage_end_to_end.py",
    "test_fleet_end_to_end.py", "test_recommendations.py", "test_java_clients.py",
    "test_kafka_tools.py", "test_fuzz_pipeline.py", "test_quota_callback_clients.py",
    "test_fault_resync.py", "test_volume_agent.py", "test_fleet_proxy.py",
    "test_quota_sources.py", "test_throttling.py", "test_authorization.py",
    "test_nothing_lost.py", "test_status_page.py", "test_share_groups.py",
    "test_fresh_install.py", "test_security.py", "test_quota_escapes.py", "test_metrics.py",
    "test_fuzz_codecs.py", "test_oauthbearer_clients.py", "test_delegation_identity.py",
    "test_broker_down.py", "test_workers.py", "test_readyz.py", "test_admin_api.py",
    "test_cli.py", "test_api_sweep.py", "test_quota_entity_types.py",
    "test_share_offsets_authorization.py",
    # unit (-m unit: ~45 s of tests in all, these the longest)
    "test_stream_rewrite.py", "test_topic_quotas.py", "test_bucket_debt.py", "test_fleet_policy.py",
    "test_pipeline.py", "test_module_imports.py", "test_policy.py",
]


def _unit_of_work(path_name):
    return SHARED.get(path_name, path_name)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, whole modules to a worker, in the order collected (the longest first,
    pytest_collection_modifyitems below) and with the modules of one SHARED group together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid):
            module = super()._split_scope(nodeid)  # tests/test_x.py
            return SHARED.get(module.rpartition("/")[2], module)

    config.option.loadscopereorder = False  # our order, not xdist's most-tests-first
    return LongestFirst(config, log)


def pytest_collection_modifyitems(config, items):
    # every test on the real Apache Kafka is marked `kafka` (-m "not kafka" leaves them out)
    kafka_fixtures = {"apache_kafka", "own_kafka", "kafka_cluster3", "kafka_secure",
                      "kafka_zookeeper"}
    for item in items:
        if kafka_fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)
    # the longest modules first (LONGEST_FIRST); each module's tests keep their order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    count = collections.Counter(_unit_of_work(item.path.name) for item in items)

    def order(numbered):
        position, item = numbered
        unit = _unit_of_work(item.path.name)
        kind = next((i for i, k in enumerate(("integration", "fuzz", "unit"))
                     if item.get_closest_marker(k)), 0)
        return (kind == 2, rank.get(unit, len(rank)), kind, -count[unit], unit, position)

    items[:] = [item for _, item in sorted(enumerate(items), key=order)]


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory):
    from kthrottle_testkit.zookeeper import ZooKeeperServer

    z = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    z.start()
    yield z
    z.stop()


# Hypothesis profiles for the fuzz tests (tests/test_fuzz_*.py, marked fuzz). "ci", the
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


# Apache Kafka beyond one plain node (kthrottle/kafka_kit.py), each for the whole session and
# stopped by its own PIDs: a three-node KRaft cluster, one node with SASL and TLS listeners
# (its users: KAFKA_USERS), and Kafka 3.9 in ZooKeeper mode. Like apache_kafka they fail (never
# skip) without Java or the jars.


@pytest.fixture(scope="session")
def kafka_cluster3(tmp_path_factory):
    """Three Apache Kafka 4 nodes (ids 1, 2, 3), each broker and controller, a static quorum
    of three voters; internal topics with 3 replicas and min ISR 2. A kafka_kit.KafkaCluster:
    ``.bootstrap`` (all three), ``.nodes``, ``kill``/``restart``, ``leaders``. A test that kills
    a node restarts it before it ends."""
    from kthrottle.kafka_kit import KafkaCluster

    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster3"), n=3,
                           log_dir=tmp_path_factory.mktemp("kafka-cluster3-logs"))
    start_kafka(cluster)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def kafka_secure(tmp_path_factory):
    """One Apache Kafka 4 node with, beside PLAINTEXT: SASL_PLAINTEXT and SASL_SSL (PLAIN,
    SCRAM-SHA-256, SCRAM-SHA-512; users KAFKA_USERS, SCRAM ones written at format time),
    OAUTHBEARER (unsecured tokens) and OAUTH_JWKS (tokens of a local OAuth server checked
    against its JWKS). ``kafka.listener(NAME)`` is an address, ``kafka.tls.ca`` the CA file,
    ``kafka.client_config(NAME, MECHANISM, USER)`` confluent-kafka settings, and
    ``kafka.oidc`` the settings with which librdkafka gets OAUTH_JWKS tokens."""
    from kthrottle.kafka_kit import SECURE_LISTENERS, KafkaBroker, Listener
    from kthrottle_testkit.oauth_server import OAuthServer

    tmp = tmp_path_factory.mktemp("kafka-secure")
    oauth = OAuthServer(tmp).start()
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
        start_kafka(kafka)
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
    from kthrottle.kafka_kit import SCRAM, KafkaBroker, Listener
    from kthrottle_testkit import zookeeper

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
        start_kafka(kafka)
        yield kafka
    finally:
        kafka.stop()
        zk.stop()
