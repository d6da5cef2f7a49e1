"""Real clients authenticating with SASL to a terminating kthrottle process in
front of a real Tansu broker (which speaks no SASL itself)."""
import asyncio
import socket
import re
import time
import uuid

import pytest

from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import kthrottle_quotas, scram_credentials_file, scram_login
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

USERS = {"alice": "alice-secret", "bob": "bob-secret"}
MECHANISMS = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@pytest.fixture(scope="module")
def sasl_proxy(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sasl")
    creds = scram_credentials_file(tmp / "credentials.toml", USERS)
    text = creds.read_text()
    assert "alice-secret" not in text and "SCRAM-SHA-512" in text
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                     ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file", str(creds)])
    p.start()
    yield p
    p.stop()


def _topic(broker, prefix):
    name = "%s-%s" % (prefix, uuid.uuid4().hex[:8])
    broker.create_topic(name, partitions=1)
    return name


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_aiokafka_authenticates_produces_and_consumes(sasl_proxy, broker, mechanism):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = _topic(broker, "aio-sasl")
    auth = dict(bootstrap_servers=sasl_proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
                sasl_mechanism=mechanism, sasl_plain_username="alice",
                sasl_plain_password="alice-secret")

    async def run():
        producer = AIOKafkaProducer(**auth)
        await producer.start()
        try:
            for i in range(20):
                await producer.send_and_wait(topic, b"v%d" % i, partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(auto_offset_reset="earliest", **auth)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            got = []
            while len(got) < 20:
                batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
                for records in batch.values():
                    got += [r.value for r in records]
            return got
        finally:
            await consumer.stop()

    assert asyncio.run(run()) == [b"v%d" % i for i in range(20)]
    sasl_proxy.wait_for_log("client authenticated as 'alice' with %s" % mechanism)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_confluent_kafka_authenticates_produces_and_consumes(sasl_proxy, broker, mechanism):
    import confluent_kafka

    topic = _topic(broker, "ck-sasl")
    auth = {"bootstrap.servers": sasl_proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanisms": mechanism, "sasl.username": "bob", "sasl.password": "bob-secret"}
    producer = confluent_kafka.Producer(dict(auth, **{"linger.ms": 5}))
    for i in range(20):
        producer.produce(topic, b"v%d" % i, partition=0)
    assert producer.flush(30) == 0
    consumer = confluent_kafka.Consumer(dict(auth, **{"group.id": "g-" + topic,
                                                      "auto.offset.reset": "earliest"}))
    got = []
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        while len(got) < 20 and time.monotonic() < deadline:
            for message in consumer.consume(20, timeout=1.0):
                assert message.error() is None, message.error()
                got.append(message.value())
    finally:
        consumer.close()
    assert got == [b"v%d" % i for i in range(20)]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_kafka_python_authenticates_and_produces(sasl_proxy, broker, mechanism):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = _topic(broker, "kp-sasl")
    auth = dict(bootstrap_servers=sasl_proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
                sasl_mechanism=mechanism, sasl_plain_username="alice",
                sasl_plain_password="alice-secret")
    producer = KafkaProducer(acks=1, **auth)
    try:
        futures = [producer.send(topic, b"v%d" % i, partition=0) for i in range(20)]
        producer.flush(30)
        assert all(f.succeeded() for f in futures)
    finally:
        producer.close()
    consumer = KafkaConsumer(auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=20000, **auth)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        got = [m.value for _, m in zip(range(20), consumer)]
    finally:
        consumer.close()
    assert got == [b"v%d" % i for i in range(20)]


def test_wrong_password_fails_with_the_clients_authentication_error(sasl_proxy):
    import confluent_kafka
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    async def aio():
        producer = AIOKafkaProducer(bootstrap_servers=sasl_proxy.bootstrap,
                                    security_protocol="SASL_PLAINTEXT",
                                    sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                                    sasl_plain_password="not-her-password-42",
                                    request_timeout_ms=5000)
        try:
            await producer.start()
        finally:
            await producer.stop()

    with pytest.raises(KafkaError):
        asyncio.run(aio())

    errors = []
    producer = confluent_kafka.Producer({
        "bootstrap.servers": sasl_proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanisms": "PLAIN", "sasl.username": "mallory", "sasl.password": "x",
        "error_cb": errors.append})
    deadline = time.monotonic() + 15
    while not errors and time.monotonic() < deadline:
        producer.poll(0.2)
    assert errors and errors[0].code() == confluent_kafka.KafkaError._AUTHENTICATION
    sasl_proxy.wait_for_log("PLAIN login for user 'mallory': unknown user")
    sasl_proxy.wait_for_log("SCRAM-SHA-256 login for user 'alice': wrong password")
    assert "alice-secret" not in sasl_proxy.log()
    assert "not-her-password-42" not in sasl_proxy.log()


def test_a_produce_before_authentication_closes_and_reaches_no_broker(sasl_proxy):
    from test_pipeline import produce_req

    s = socket.create_connection(("127.0.0.1", sasl_proxy.port), timeout=10)
    try:
        s.sendall(produce_req(1))
        assert s.recv(100) == b""  # closed, nothing answered
    finally:
        s.close()
    sasl_proxy.wait_for_log("request api key 0 v8 before authentication")
    line = [l for l in sasl_proxy.log().splitlines()
            if "request api key 0 v8 before authentication" in l][-1]
    assert "WARNING" in line and "refused (unauthenticated_request)" in line
    conn_id = re.search(r"\(connection (\d+),", line).group(1)
    # the proxy never connected to a broker for this client
    assert "connection %s opened" % conn_id not in sasl_proxy.log()


@pytest.mark.skipif(not zk_server.available(),
                    reason="scripts/test installs ZooKeeper")
def test_credentials_from_zookeeper_are_followed_live(broker, zookeeper, tmp_path):
    """Terminate mode with the SCRAM credentials Kafka keeps in ZooKeeper:
    a password changed with ``kthrottle quotas alter --zookeeper`` holds for
    the next login, without restarting the proxy."""
    chroot = "/kt-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot

    def set_password(password):
        done = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "users",
                                "--entity-name", "carol", "--add-config",
                                "SCRAM-SHA-512=[password=%s]" % password)
        assert done.returncode == 0, done.stderr

    set_password("first-secret")
    p = ProxyProcess(broker.bootstrap, tmp_path / "zk-proxy.log",
                     ["--security-protocol", "SASL_PLAINTEXT", "--zookeeper", hosts]).start()

    try:
        assert scram_login(p.bootstrap, "carol", "first-secret")
        set_password("second-secret")
        deadline = time.monotonic() + 10
        while scram_login(p.bootstrap, "carol", "first-secret") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert scram_login(p.bootstrap, "carol", "second-secret")
        assert not scram_login(p.bootstrap, "carol", "first-secret")
        assert "first-secret" not in p.log() and "second-secret" not in p.log()
    finally:
        p.stop()
