"""The Apache Kafka test kit itself (kthrottle/kafka_kit.py), on real brokers: the three-node
KRaft cluster (replication, kill -9 of a leader, restart, leader elections), the SASL and TLS
listeners (PLAIN, SCRAM, OAUTHBEARER unsecured and JWKS-checked, SASL_SSL), the authorizer
switch, and Kafka 3.9 in ZooKeeper mode with SCRAM credentials kept in ZooKeeper."""
import time
import uuid

import pytest

from kthrottle.kafka_kit import (SCRAM, KafkaBroker, Listener, VERIFIABLE_PRODUCER,
                                 metadata_brokers)
from kthrottle_testkit.brokers import KAFKA_USERS

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

QUIET = {"log_level": 0}  # librdkafka: no "Connect failed" lines for a node killed on purpose


def _topic(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


def produce(conf, topic, values, partition=None):
    """Produce ``values`` with acks=all and idempotence; every delivery must succeed."""
    import confluent_kafka

    failed = []

    def report(err, msg):
        if err is not None:
            failed.append(err)

    producer = confluent_kafka.Producer(dict(conf, **{"acks": "all", "enable.idempotence": True,
                                                      "linger.ms": 5}))
    for value in values:
        kwargs = {} if partition is None else {"partition": partition}
        producer.produce(topic, value, on_delivery=report, **kwargs)
        producer.poll(0)
    left = producer.flush(60)
    assert left == 0 and not failed, "%d undelivered, errors %s" % (left, failed[:5])


def consume(conf, topic, count, timeout=60.0):
    """``count`` values of ``topic`` from the start (a new group)."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer(dict(conf, **{
        "group.id": "kit-%s" % uuid.uuid4().hex[:8], "auto.offset.reset": "earliest",
        "enable.auto.commit": False}))
    consumer.subscribe([topic])
    got = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
    finally:
        consumer.close()
    return got


def roundtrip(conf, admin_kafka, prefix, n=20):
    topic = _topic(prefix)
    admin_kafka.create_topic(topic)
    values = [b"%s-%d" % (prefix.encode(), i) for i in range(n)]
    produce(conf, topic, values)
    assert sorted(consume(conf, topic, n)) == sorted(values)


# the three-node cluster -------------------------------------------------------------------

def test_three_nodes_start_as_one_cluster_with_a_three_voter_quorum(kafka_cluster3):
    cluster = kafka_cluster3
    assert sorted(cluster.nodes) == [1, 2, 3]
    addresses = cluster.bootstrap.split(",")
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for node in cluster.nodes.values():
        brokers, controller = metadata_brokers(node.host, node.port)
        assert sorted(b[0] for b in brokers) == [1, 2, 3]
        props = (node.workdir / "server.properties").read_text()
        assert "controller.quorum.voters=%s\n" % node.voters in props
        assert node.voters.count("@127.0.0.1:") == 3
        assert "offsets.topic.replication.factor=3\n" in props
    assert cluster.started_in is not None


def test_a_topic_with_three_replicas_outlives_its_leader_killed(kafka_cluster3):
    """kill -9 of partition 0's leader: another replica leads, acks=all produce goes on (ISR 2
    of min 2); the node restarted on its data catches up, a preferred election gives it its
    leadership back, and every record is there once."""
    cluster = kafka_cluster3
    topic = _topic("kit-rf3")
    cluster.create_topic(topic, partitions=3, replication_factor=3)
    parts = cluster.partitions(topic)
    assert all(sorted(replicas) == [1, 2, 3] for _, replicas, _ in parts.values())
    conf = dict(cluster.client_config(), **QUIET)
    produce(conf, topic, [b"a%d" % i for i in range(300)])
    victim = cluster.leaders(topic)[0]
    try:
        cluster.kill(victim)
        assert not cluster.nodes[victim].alive()
        new_leader = cluster.wait_leader(topic, 0, not_on=victim, timeout=30)
        assert new_leader != victim
        produce(conf, topic, [b"b%d" % i for i in range(300)])
    finally:
        cluster.restart(victim)
    cluster.wait_in_sync(topic, timeout=60)
    elected = cluster.elect_leaders(topic, [0])
    assert elected[0] is None or "ELECTION_NOT_NEEDED" in str(elected[0]), elected
    assert cluster.partitions(topic)[0][1][0] == victim  # the preferred (first) replica
    assert cluster.wait_leader(topic, 0, on=victim, timeout=30) == victim
    produce(conf, topic, [b"c%d" % i for i in range(300)])
    got = consume(conf, topic, 900)
    assert sorted(got) == sorted(b"%s%d" % (p, i) for p in (b"a", b"b", b"c")
                                 for i in range(300))


def test_move_leader_reorders_the_replicas_and_elects(kafka_cluster3):
    cluster = kafka_cluster3
    topic = _topic("kit-move")
    cluster.create_topic(topic, partitions=1)
    leader, replicas, _ = cluster.partitions(topic)[0]
    target = next(r for r in replicas if r != leader)
    assert cluster.move_leader(topic, 0, target) == target
    leader, replicas, isr = cluster.partitions(topic)[0]
    assert leader == target and replicas[0] == target and sorted(isr) == [1, 2, 3]


# SASL and TLS listeners -------------------------------------------------------------------

@pytest.mark.parametrize("listener", ["SASL_PLAINTEXT", "SASL_SSL"])
@pytest.mark.parametrize("mechanism", ["PLAIN"] + list(SCRAM))
def test_sasl_users_produce_and_consume(kafka_secure, listener, mechanism):
    conf = kafka_secure.client_config(listener, mechanism, "alice")
    assert conf["sasl.password"] == KAFKA_USERS["alice"]
    if listener == "SASL_SSL":
        assert conf["ssl.ca.location"] == str(kafka_secure.tls.ca)
    roundtrip(conf, kafka_secure, "kit-%s-%s" % (listener.lower(), mechanism.lower()))


@pytest.mark.parametrize("listener", ["SASL_PLAINTEXT", "SASL_SSL"])
@pytest.mark.parametrize("mechanism", ["PLAIN"] + list(SCRAM))
def test_a_wrong_password_or_an_unknown_user_is_refused(kafka_secure, listener, mechanism):
    assert kafka_secure.try_login(listener, mechanism, "alice") is None
    error = kafka_secure.try_login(listener, mechanism, "alice", "not-her-password")
    assert error is not None and "Authentication failed" in error, error
    error = kafka_secure.try_login(listener, mechanism, "mallory", "guess")
    assert error is not None and "Authentication failed" in error, error


def test_sasl_ssl_needs_the_kits_ca(kafka_secure):
    assert kafka_secure.tls.ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
    conf = kafka_secure.client_config("SASL_SSL", "SCRAM-SHA-512", "bob")
    del conf["ssl.ca.location"]  # the system's CAs do not know the kit's
    error = _login(conf, timeout=10)
    assert error is not None and "certificate verify failed" in error, error


def test_oauthbearer_unsecured_tokens(kafka_secure):
    conf = kafka_secure.client_config("OAUTHBEARER", user="carol")
    assert conf["enable.sasl.oauthbearer.unsecure.jwt"] is True
    roundtrip(conf, kafka_secure, "kit-oauth")


def test_oauthbearer_tokens_checked_against_the_jwks(kafka_secure):
    conf = kafka_secure.client_config("OAUTH_JWKS", **kafka_secure.oidc)
    roundtrip(conf, kafka_secure, "kit-jwks")
    # an unsecured token (alg "none") is no token to the JWKS validator
    unsecured = kafka_secure.client_config("OAUTH_JWKS")
    unsecured.update({"enable.sasl.oauthbearer.unsecure.jwt": True,
                      "sasl.oauthbearer.config": "principal=carol"})
    error = _login(unsecured, timeout=10)
    assert error is not None and "uthentication" in error, error
    # and a token of the right server but for the wrong secret is never issued
    wrong = dict(conf, **{"sasl.oauthbearer.client.secret": "wrong"})
    assert _login(wrong, timeout=5) is not None


def test_a_java_client_logs_in_with_the_kits_java_settings(kafka_secure, tmp_path):
    """kafka_kit.java_client_config for Kafka's own tools (VerifiableProducer here)."""
    topic = _topic("kit-java")
    kafka_secure.create_topic(topic)
    props = tmp_path / "client.properties"
    props.write_text("".join("%s=%s\n" % kv for kv in kafka_secure.java_client_config(
        "SASL_SSL", "SCRAM-SHA-256", "bob").items()))
    done = kafka_secure.tool(VERIFIABLE_PRODUCER, "--topic", topic, "--max-messages", "5",
                             "--bootstrap-server", kafka_secure.listener("SASL_SSL"),
                             "--command-config", props, timeout=90)
    assert done.stdout.count('"name":"producer_send_success"') == 5, done.stdout + done.stderr
    assert len(consume(kafka_secure.client_config(), topic, 5)) == 5


def test_the_authorizer_switch(tmp_path):
    """authorizer=True: StandardAuthorizer, admin a super user; alice needs ACLs."""
    import confluent_kafka
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType,
                                       ResourcePatternType, ResourceType)

    listener = Listener("SASL_PLAINTEXT", "SASL_PLAINTEXT", ("PLAIN", "SCRAM-SHA-512"))
    kafka = KafkaBroker(tmp_path / "data", users=KAFKA_USERS, listeners=[listener],
                        authorizer=True, heap="384m")
    with kafka:
        topic = _topic("kit-acl")
        kafka.create_topic(topic)  # on PLAINTEXT: ANONYMOUS, a super user like the brokers
        conf = kafka.client_config("SASL_PLAINTEXT", "PLAIN", "alice")
        refused = []
        producer = confluent_kafka.Producer(dict(conf, **{"message.timeout.ms": 10000}))
        producer.produce(topic, b"x", on_delivery=lambda err, msg: refused.append(err))
        producer.flush(20)
        assert refused and refused[0] is not None, refused
        assert refused[0].name() == "TOPIC_AUTHORIZATION_FAILED", refused
        admin = kafka.admin(**kafka.client_config("SASL_PLAINTEXT", "SCRAM-SHA-512", "admin"))
        acls = [AclBinding(ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, "User:alice",
                           "*", op, AclPermissionType.ALLOW)
                for op in (AclOperation.WRITE, AclOperation.DESCRIBE)]
        for future in admin.create_acls(acls).values():
            future.result(30)
        deadline = time.monotonic() + 20
        while True:  # an ACL reaches the authorizer through the metadata log
            try:
                produce(dict(conf, **{"message.timeout.ms": 5000}), topic, [b"allowed"])
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _login(conf, timeout):
    from kthrottle.kafka_kit import _try_login

    return _try_login(conf, timeout)


# Kafka 3.9 in ZooKeeper mode --------------------------------------------------------------

def test_kafka_39_in_zookeeper_mode(kafka_zookeeper):
    from kazoo.client import KazooClient

    kafka = kafka_zookeeper
    assert kafka.version == "3.9.1" and kafka.controller_port is None
    props = (kafka.workdir / "server.properties").read_text()
    assert "zookeeper.connect=%s/kafka39\n" % kafka.zookeeper_server.hosts in props
    assert "broker.id=1\n" in props and "node.id" not in props
    brokers, _ = metadata_brokers(kafka.host, kafka.port)
    assert [b[0] for b in brokers] == [1]
    roundtrip(kafka.client_config(), kafka, "kit-zk")
    # alice's SCRAM credentials, written by ConfigCommand --zookeeper at start
    for mechanism in ("PLAIN",) + SCRAM:
        assert kafka.try_login("SASL_PLAINTEXT", mechanism, "alice") is None, mechanism
    error = kafka.try_login("SASL_PLAINTEXT", "SCRAM-SHA-256", "alice", "wrong")
    assert error is not None and "Authentication failed" in error
    # a user created now lives in ZooKeeper and logs in at once
    kafka.add_scram_user("carol", "carol-secret", ["SCRAM-SHA-512"])
    zk = KazooClient(hosts=kafka.zookeeper_server.hosts, timeout=10)
    zk.start(timeout=10)
    try:
        data, _ = zk.get("/kafka39/config/users/carol")
    finally:
        zk.stop()
        zk.close()
    assert b"SCRAM-SHA-512" in data and b"carol-secret" not in data
    conf = kafka.client_config("SASL_PLAINTEXT", "SCRAM-SHA-512", "carol")
    roundtrip(conf, kafka, "kit-zk-scram")
