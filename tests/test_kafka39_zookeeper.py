"""Kafka 3.x on ZooKeeper, as its users run it, through a kthrottle proxy process: the real
Apache Kafka 3.9.1 broker of the ``kafka_zookeeper`` fixture (chroot /kafka39) and its
ZooKeeper. Quotas set with Kafka's own kafka-configs, SCRAM credentials Kafka wrote, logins the
proxy verifies itself (terminate) or hands to the broker (passthrough).

Kafka docs, "Quotas" and "Authentication using SASL/SCRAM"; KIP-55 (quotas), KIP-546
(AlterClientQuotas), KIP-84 (SCRAM)."""
import time
import uuid

import pytest

from kthrottle.kafka_kit import CONFIG_COMMAND
from kthrottle.embedded import free_port
from kthrottle_testkit.clients import BackgroundProducer, admin_get, produce_quotas, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

NODE_ID = 1  # the fixture's broker.id: the proxy serves it on node_port_base + 1
QUOTA = 100_000  # bytes/s
RAISED = 400_000


def zk_hosts(kafka):
    return kafka.zookeeper_server.hosts + "/kafka39"


def start_proxy(kafka, tmp_path, upstream, *args):
    """A ``kthrottle proxy`` with an admin endpoint (``.admin``), in front of ``upstream``."""
    p = ProxyProcess(upstream, tmp_path / ("proxy-%s.log" % uuid.uuid4().hex[:6]),
                     list(args), node_id=NODE_ID)
    p.admin = free_port()
    p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
    return p.start()


def kafka_configs(kafka, *args):
    """bin/kafka-configs.sh --bootstrap-server: in ZooKeeper mode the broker writes the
    quota to /config/{users,clients} and a change notification (KIP-546); returns when the
    broker has answered, i.e. when ZooKeeper holds it."""
    done = kafka.tool(CONFIG_COMMAND, "--bootstrap-server", kafka.bootstrap, *args,
                      check=False, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic()


def entity_quotas(admin, path):
    """The quotas the proxy holds for entity ``path`` (/quotas ``entities``), {} if none."""
    for entry in admin_get(admin, "/quotas")["entities"] or ():
        if entry["entity"] == path:
            return entry["quotas"]
    return {}


def series(admin, name, **labels):
    """The sum of the /metrics samples of ``name`` whose labels include ``labels``."""
    total, wanted = 0.0, ['%s="%s"' % item for item in labels.items()]
    for line in admin_get(admin, "/metrics").splitlines():
        if line.startswith(name + "{") and all(w in line for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def login(conf, timeout=15.0):
    """None once librdkafka settings ``conf`` log in and read Metadata, else the client's
    authentication error. (The kit's try_login waits its whole timeout on "Unsupported SASL
    mechanism", which its LOGIN_REFUSED does not match: here any _AUTHENTICATION ends it.)"""
    import confluent_kafka

    errors = []
    producer = confluent_kafka.Producer(dict(conf, error_cb=errors.append))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        producer.poll(0.1)  # serves error_cb
        refused = [e for e in errors if e.code() == confluent_kafka.KafkaError._AUTHENTICATION]
        if refused:
            return refused[0].str()
        try:
            if producer.list_topics(timeout=1.0).brokers:
                return None
        except confluent_kafka.KafkaException:
            pass
    raise AssertionError("neither logged in nor refused within %.0f s: %s" % (timeout, errors))


def roundtrip(conf, topic):
    """One record produced with confluent-kafka settings ``conf`` and read back: its value."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    value = uuid.uuid4().hex.encode()
    offsets = []
    producer = Producer(dict(conf, **{"message.timeout.ms": 30000}))
    producer.produce(topic, value, partition=0,
                     on_delivery=lambda err, msg: offsets.append(err or msg.offset()))
    producer.flush(40)
    assert offsets and isinstance(offsets[0], int), offsets
    consumer = Consumer(dict(conf, **{"group.id": "kz-" + uuid.uuid4().hex[:6],
                                      "enable.auto.commit": False}))
    try:
        consumer.assign([TopicPartition(topic, 0, offsets[0])])
        msg = consumer.poll(30)
        assert msg is not None and msg.error() is None, msg and msg.error()
        return msg.value() == value
    finally:
        consumer.close()




def new_topic(kafka, prefix):
    name = "%s-%s" % (prefix, uuid.uuid4().hex[:8])
    kafka.create_topic(name)
    return name


# 1. quotas set with kafka-configs ---------------------------------------------------------

def test_client_quotas_set_with_kafka_configs_are_enforced_and_followed_live(
        kafka_zookeeper, tmp_path):
    """A client quota set with kafka-configs (the broker writes /config/clients/<id> and a
    change notification) holds a producer through a proxy started with --zookeeper, and its
    raise and deletion are followed live."""
    kafka = kafka_zookeeper
    # 3.9's ConfigCommand takes --zookeeper for users and brokers only (SCRAM credentials,
    # bootstrapping), so a client quota goes through the broker (KIP-555, KIP-546)
    refused = kafka.tool(CONFIG_COMMAND, "--zookeeper", zk_hosts(kafka), "--alter",
                         "--add-config", "producer_byte_rate=1000", "--entity-type", "clients",
                         "--entity-name", "kz-refused", check=False)
    assert refused.returncode != 0
    assert "must be one of users, brokers" in refused.stdout + refused.stderr

    slow, free = "kz-slow-%s" % uuid.uuid4().hex[:6], "kz-free-%s" % uuid.uuid4().hex[:6]
    topic = new_topic(kafka, "kz-quota")
    kafka_configs(kafka, "--alter", "--add-config", "producer_byte_rate=%d" % QUOTA,
                  "--entity-type", "clients", "--entity-name", slow)
    p = start_proxy(kafka, tmp_path, kafka.bootstrap, "--zookeeper", zk_hosts(kafka))
    try:
        p.wait_for_log("quotas from ZooKeeper %s" % zk_hosts(kafka))
        assert entity_quotas(p.admin, "clients/" + slow) == {"producer_byte_rate": QUOTA}

        with BackgroundProducer(p.bootstrap, topic, slow) as limited, \
                BackgroundProducer(p.bootstrap, topic, free) as unlimited:
            began = time.monotonic()
            time.sleep(9)
            # from 2 s on: the first second of quota is the bucket's burst
            held = limited.rate(began + 2, began + 9)
            ran = unlimited.rate(began + 2, began + 9)
            assert 0.3 * QUOTA < held < 1.5 * QUOTA, held
            assert ran > 3 * held, (ran, held)
            assert set(produce_quotas(p.admin, slow).values()) == {(QUOTA, "clients/" + slow)}
            assert set(produce_quotas(p.admin, free).values()) == {(None, None)}
            # the broker enforces the same client quota (it sees the client-id) and answers
            # with a throttle time of its own (KIP-219); the proxy's part shows in its metrics
            assert series(p.admin, "kthrottle_throttle_seconds_total", client_id=slow,
                          key="producer_byte_rate") > 0
            assert series(p.admin, "kthrottle_produce_throttled_responses_total",
                          client_id=slow) > 0
            assert series(p.admin, "kthrottle_throttle_seconds_total", client_id=free) == 0

            # raised with kafka-configs: the broker's change notification reaches the proxy
            changed = kafka_configs(kafka, "--alter", "--add-config",
                                    "producer_byte_rate=%d" % RAISED, "--entity-type",
                                    "clients", "--entity-name", slow)
            assert wait_until(lambda: entity_quotas(p.admin, "clients/" + slow)
                              == {"producer_byte_rate": RAISED}, timeout=5, interval=0.05)
            followed = time.monotonic() - changed
            assert followed < 5, followed
            assert wait_until(lambda: set(produce_quotas(p.admin, slow).values())
                              == {(RAISED, "clients/" + slow)}, timeout=5)
            time.sleep(4)
            raised = limited.rate(changed + 1, changed + 4)
            assert 2 * QUOTA < raised < 1.5 * RAISED, raised

            # deleted: no quota at the proxy for that client any more
            kafka_configs(kafka, "--alter", "--delete-config", "producer_byte_rate",
                          "--entity-type", "clients", "--entity-name", slow)
            assert wait_until(lambda: set(produce_quotas(p.admin, slow).values())
                              == {(None, None)}, timeout=5)
            assert entity_quotas(p.admin, "clients/" + slow) == {}
        assert limited.error is None and unlimited.error is None

        # --zookeeper alone means quotas: no storage-aware throttling, so no fail-safe that
        # would hold producers for want of a cluster state (test_storage_proxy has the rest)
        assert "kthrottle_storage_state{" not in admin_get(p.admin, "/metrics")
        assert "storage:" not in p.log() and p.alive()
    finally:
        p.stop()


# 2. SCRAM credentials kept in ZooKeeper ---------------------------------------------------

def sasl_conf(kafka, proxy, mechanism, user, password=None):
    """librdkafka settings for ``user`` on the proxy's SASL_PLAINTEXT listener."""
    return kafka.client_config("SASL_PLAINTEXT", mechanism, user, password,
                               bootstrap=proxy.bootstrap)


def test_terminate_checks_logins_against_the_scram_credentials_kafka_keeps_in_zookeeper(
        kafka_zookeeper, tmp_path):
    """No --credentials-file: the proxy reads the SCRAM credentials ConfigCommand --zookeeper
    wrote in /config/users (beside the users' quotas) and follows them; it talks PLAINTEXT
    to the broker's PLAINTEXT listener (the broker sees the proxy, not the user)."""
    kafka = kafka_zookeeper
    topic = new_topic(kafka, "kz-scram")
    p = start_proxy(kafka, tmp_path, kafka.bootstrap, "--zookeeper", zk_hosts(kafka),
                    "--security-protocol", "SASL_PLAINTEXT",
                    "--sasl-enabled-mechanisms", "SCRAM-SHA-256,SCRAM-SHA-512")
    try:
        # alice: written by ConfigCommand --zookeeper when the fixture started
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            assert roundtrip(sasl_conf(kafka, p, mechanism, "alice"), topic), mechanism
        p.wait_for_log("client authenticated as 'alice' with SCRAM-SHA-512")
        error = login(sasl_conf(kafka, p, "SCRAM-SHA-256", "alice", "not-her-password"))
        assert error is not None and "Authentication failed" in error, error
        p.wait_for_log("SCRAM-SHA-256 login for user 'alice': wrong password")
        # PLAIN is not enabled on this listener, though the credentials could check it
        error = login(sasl_conf(kafka, p, "PLAIN", "alice"))
        assert error is not None and "Unsupported SASL mechanism" in error, error

        # a user created now, as a Kafka 3.x operator does (kafka-configs --zookeeper): the
        # proxy follows the change notification without a restart
        user = "kz-user-%s" % uuid.uuid4().hex[:6]
        kafka.add_scram_user(user, "kz-secret", ["SCRAM-SHA-512"])
        conf = sasl_conf(kafka, p, "SCRAM-SHA-512", user)
        assert wait_until(lambda: login(conf) is None, timeout=15, interval=0.2)
        # its quota set through the broker lands in the same znode as its credentials: both
        # hold (the broker keeps the SCRAM keys; the proxy reads each part)
        kafka_configs(kafka, "--alter", "--add-config", "producer_byte_rate=%d" % QUOTA,
                      "--entity-type", "users", "--entity-name", user)
        assert wait_until(lambda: entity_quotas(p.admin, "users/" + user)
                          == {"producer_byte_rate": QUOTA}, timeout=5)
        with BackgroundProducer(p.bootstrap, topic, "kz-any", security_protocol="SASL_PLAINTEXT",
                          sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=user,
                          sasl_plain_password="kz-secret") as producer:
            assert wait_until(lambda: set(produce_quotas(p.admin, "kz-any").values())
                              == {(QUOTA, "users/" + user)}, timeout=15)
            view = [c for c in admin_get(p.admin, "/quotas")["connections"]
                    if any(cl["client_id"] == "kz-any" for cl in c["clients"])]
            assert {c["principal"] for c in view} == {user}
            # towards the broker: its PLAINTEXT listener (node 1's address, from Metadata)
            assert {c["broker"] for c in view} == {kafka.bootstrap}
            began = time.monotonic()
            time.sleep(5)
            # the broker sees only the proxy's connection (ANONYMOUS), so this user quota
            # is the proxy's alone
            rate = producer.rate(began + 1, began + 5)
            assert 0.3 * QUOTA < rate < 1.5 * QUOTA, rate
        assert producer.error is None
        assert series(p.admin, "kthrottle_throttle_seconds_total", user=user,
                      key="producer_byte_rate") > 0
        assert roundtrip(conf, topic)
        assert "kz-secret" not in p.log() and "alice-secret" not in p.log()
    finally:
        p.stop()


def test_passthrough_hands_scram_logins_to_the_kafka_39_broker(kafka_zookeeper, tmp_path):
    """--sasl-mode passthrough in front of the broker's SASL_PLAINTEXT listener: the broker
    checks alice's SCRAM exchange against its ZooKeeper credentials; the proxy binds the user
    it said yes to (and resolves that user's quotas from ZooKeeper), and passes a refusal on."""
    kafka = kafka_zookeeper
    topic = new_topic(kafka, "kz-pass")
    client = "kz-pass-%s" % uuid.uuid4().hex[:6]
    # <user, client-id> (KIP-55): only this client of alice's, so the shared fixture's other
    # users of alice are not slowed
    kafka_configs(kafka, "--alter", "--add-config", "producer_byte_rate=%d" % QUOTA,
                  "--entity-type", "users", "--entity-name", "alice",
                  "--entity-type", "clients", "--entity-name", client)
    p = start_proxy(kafka, tmp_path, kafka.listener("SASL_PLAINTEXT"),
                    "--zookeeper", zk_hosts(kafka), "--security-protocol", "SASL_PLAINTEXT",
                    "--sasl-mode", "passthrough")
    try:
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            assert roundtrip(sasl_conf(kafka, p, mechanism, "alice"), topic), mechanism
            p.wait_for_log("client authenticated as 'alice' with %s (verified by the broker"
                           % mechanism)
        error = login(sasl_conf(kafka, p, "SCRAM-SHA-512", "alice", "not-her-password"))
        assert error is not None and "Authentication failed" in error, error
        p.wait_for_log("the broker refused SCRAM-SHA-512 authentication of 'alice'")
        with BackgroundProducer(p.bootstrap, topic, client, security_protocol="SASL_PLAINTEXT",
                          sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                          sasl_plain_password=kafka.users["alice"]) as producer:
            entity = "users/alice/clients/" + client
            assert wait_until(lambda: set(produce_quotas(p.admin, client).values())
                              == {(QUOTA, entity)}, timeout=15)
            view = [c for c in admin_get(p.admin, "/quotas")["connections"]
                    if any(cl["client_id"] == client for cl in c["clients"])]
            assert {c["principal"] for c in view} == {"alice"}
            assert {c["broker"] for c in view} == {kafka.listener("SASL_PLAINTEXT")}
        assert producer.error is None
        # the proxy checked no password itself: it loaded no credentials
        assert "credentials from ZooKeeper" not in p.log()
        assert kafka.users["alice"] not in p.log()
    finally:
        p.stop()
