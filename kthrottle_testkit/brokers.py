"""Apache Kafka nodes for the tests. The Apache Kafka kit itself (KRaft nodes and clusters,
Kafka 3.9 on ZooKeeper, the Java tools, SCRAM users) is ``kthrottle.kafka_kit``: it lives in
the package because ``kthrottle local --broker kafka`` starts a node with it too. Here: how a
test starts one (a missing Java or jar fails the test, never skips it: ``scripts/test`` fetches
them) and the users of the secure nodes."""
from kthrottle_testkit import BROKER_NODE_ID

# the SASL users of the secure test nodes (tests/conftest.py's kafka_secure, kafka_zookeeper)
KAFKA_USERS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret"}


def start_kafka(kit):
    """Start a kafka_kit.KafkaBroker or KafkaCluster; pytest.fail (never a skip) when Java or
    the jars are missing: scripts/test fetches them."""
    import pytest

    from kthrottle.kafka_kit import KafkaMissing

    try:
        kit.start()
        missing = None
    except KafkaMissing as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    return kit


def started_kafka(tmp_path_factory, name, **settings):
    """A kafka_kit.KafkaBroker (node id 111, BROKER_NODE_ID) started with its data and log in
    new temporary folders of pytest's ``tmp_path_factory``; ``settings`` go to KafkaBroker."""
    from kthrottle.kafka_kit import KafkaBroker

    return start_kafka(KafkaBroker(tmp_path_factory.mktemp(name + "-data"),
                                   node_id=BROKER_NODE_ID,
                                   log_path=tmp_path_factory.mktemp(name) / "kafka.log",
                                   **settings))
