"""The test kit that the tests (``tests/``) and the benchmarks (``benchmarks/``) both import:
what starts the servers and drives the clients they share, so that neither reaches into the
other's directory.

* ``proxy``: ``ProxyProcess``, ``kthrottle proxy`` as a separate process, as users run it;
* ``brokers``: Apache Kafka nodes for tests (``started_kafka``, ``start_kafka``; the kit
  itself is ``kthrottle.kafka_kit``, which ``kthrottle local --broker kafka`` uses too) and
  the users of the secure ones (``KAFKA_USERS``);
* ``zookeeper``: a real standalone ZooKeeper (Debian's package);
* ``oauth_server``: a small OAuth 2 server (JWKS, client-credentials tokens), run as a
  subprocess, and ``OAuthServer`` that starts it;
* ``clients``: producers and consumers (aiokafka, confluent-kafka), the proxy's admin
  endpoint, ``kthrottle quotas``, SCRAM credentials;
* ``frames``: realistic multi-broker Kafka frames for codec tests (no network);
* ``harness``: what every benchmark shares (a run's processes, brokers, proxies, client
  runners, CPU, statistics, reports);
* ``nothing_lost``: the scenario of ``benchmarks/nothing_lost.py``, which
  ``tests/test_nothing_lost.py`` runs at a small size.

Everything here is on 127.0.0.1 and free ports, and stops what it started by its own PID.
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
BENCHMARKS = ROOT / "benchmarks"

# The node id of the test broker: Tansu always reports 111, and the tests' Apache Kafka node
# is given the same one, so that a proxy's node port is node_port_base + 111 on either.
BROKER_NODE_ID = 111
TANSU_NODE_ID = BROKER_NODE_ID


def load_benchmark(name):
    """``benchmarks/NAME.py`` imported as the module ``NAME`` (once; later calls return it),
    for a test of that benchmark itself (its flags, its tables, a smoke run), without putting
    ``benchmarks/`` on sys.path."""
    path = BENCHMARKS / (name + ".py")
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
