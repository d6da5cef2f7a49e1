"""Fixtures that start real components on 127.0.0.1 and free ports, and stop
them (by their own PID) when the tests that use them are done."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kthrottle.embedded import TansuBroker, free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

TANSU_NODE_ID = 111  # every Tansu broker reports this node id


class ProxyProcess:
    """``kthrottle proxy`` as a separate process, as users run it."""

    def __init__(self, bootstrap, log_path, extra_args=(), node_id=TANSU_NODE_ID):
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
        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
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
    """One Apache Kafka 4 node (KRaft, broker and controller in one JVM) for the whole session:
    a kafka_cluster.KafkaBroker, its address in ``.bootstrap`` (127.0.0.1). Where the machine
    has IPv6 loopback it has a second listener on [::1] only (``.bootstrap_ipv6``): a proxy in
    front of that one is the only way a Java client started with IPV4_ONLY_JVM_ARGS can reach
    the broker. Fails (never skips) when Java or the jars are missing: scripts/test fetches
    them."""
    from kafka_cluster import KafkaBroker, KafkaMissing, ipv6_loopback

    kafka = KafkaBroker(tmp_path_factory.mktemp("apache-kafka-data"),
                        ipv6_listener=ipv6_loopback(),
                        log_path=tmp_path_factory.mktemp("apache-kafka") / "kafka.log")
    try:
        kafka.start()
        missing = None
    except KafkaMissing as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    yield kafka
    kafka.stop()


def pytest_collection_modifyitems(config, items):
    # every test on the real Apache Kafka is marked `kafka` (-m "not kafka" leaves them out)
    for item in items:
        if "apache_kafka" in getattr(item, "fixturenames", ()):
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
