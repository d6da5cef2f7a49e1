"""SASL passthrough with real clients: a passthrough kthrottle in front of a
terminating kthrottle (standing for a SASL broker; Tansu speaks no SASL) in
front of a real Tansu broker. The outer proxy never sees a password it
could check: it binds the user the broker accepted, and its quotas resolve
against that user."""
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit.clients import roundtrip_aiokafka, scram_credentials_file
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

USERS = {"alice": "alice-secret", "bob": "bob-secret"}


@pytest.fixture(scope="module")
def chain(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("passthrough")
    creds = scram_credentials_file(tmp / "credentials.toml", USERS)
    quotas = tmp / "quotas.toml"
    # alice is slow at the outer proxy; bob has no quota there
    quotas.write_text('[users.alice]\nproducer_byte_rate = 20000\n')
    inner = ProxyProcess(broker.bootstrap, tmp / "inner.log",
                         ["--security-protocol", "SASL_PLAINTEXT",
                          "--credentials-file", str(creds)]).start()
    outer = ProxyProcess(inner.bootstrap, tmp / "outer.log",
                         ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "passthrough",
                          "--quota-file", str(quotas)])
    outer.admin = free_port()
    outer.extra_args += ["--admin-listen", "127.0.0.1:%d" % outer.admin]
    outer.start()
    yield inner, outer
    outer.stop()
    inner.stop()


def _topic(broker):
    name = "pass-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(name, partitions=1)
    return name


def _auth(mechanism, user, password):
    return dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                sasl_plain_username=user, sasl_plain_password=password)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_aiokafka_through_passthrough_binds_the_user_and_its_quota(chain, broker, mechanism):
    inner, outer = chain
    view = roundtrip_aiokafka(outer, broker, **_auth(mechanism, "alice", "alice-secret"))
    assert view and {c["principal"] for c in view} == {"alice"}
    entities = {client["produce"].get("entity") for c in view for client in c["clients"]}
    assert entities == {"users/alice"}  # the user's quota, whatever the client-id
    outer.wait_for_log("client authenticated as 'alice' with %s (verified by the broker, "
                       "SaslHandshake v1)" % mechanism)
    assert "alice-secret" not in outer.log() + inner.log()


def test_confluent_kafka_through_passthrough(chain, broker):
    import confluent_kafka

    inner, outer = chain
    topic = _topic(broker)
    producer = confluent_kafka.Producer({
        "bootstrap.servers": outer.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "bob",
        "sasl.password": "bob-secret", "client.id": "ck-pass"})
    delivered = []
    for i in range(10):
        producer.produce(topic, b"v%d" % i, partition=0,
                         on_delivery=lambda err, msg: delivered.append(err))
    assert producer.flush(30) == 0
    assert delivered == [None] * 10
    outer.wait_for_log("client authenticated as 'bob' with SCRAM-SHA-512 (verified by the broker, "
                       "SaslHandshake v1)")


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_kafka_python_with_a_v0_handshake_relays_raw_tokens(chain, broker, mechanism):
    """kafka-python told it talks to Kafka 0.10.1 uses SaslHandshake v0 and
    sends its tokens raw, without a Kafka header."""
    from kafka import KafkaConsumer

    inner, outer = chain
    topic = _topic(broker)
    line = ("client authenticated as 'bob' with %s (verified by the broker, SaslHandshake v0)"
            % mechanism)
    before = outer.log().count(line)
    consumer = KafkaConsumer(bootstrap_servers=outer.bootstrap, api_version=(0, 10, 1),
                             request_timeout_ms=20000,
                             **_auth(mechanism, "bob", "bob-secret"))
    try:
        assert topic in consumer.topics()  # a Metadata request, after authenticating
    finally:
        consumer.close()
    outer.wait_for_log(line)
    assert outer.log().count(line) > before


def test_a_wrong_password_binds_nothing_and_the_client_gets_its_error(chain):
    import confluent_kafka

    inner, outer = chain
    errors = []
    producer = confluent_kafka.Producer({
        "bootstrap.servers": outer.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "mallory",
        "sasl.password": "guess", "error_cb": errors.append})
    deadline = time.monotonic() + 15
    while not errors and time.monotonic() < deadline:
        producer.poll(0.2)
    assert errors and errors[0].code() == confluent_kafka.KafkaError._AUTHENTICATION
    outer.wait_for_log("the broker refused SCRAM-SHA-256 authentication of 'mallory'")
    assert "authenticated as 'mallory'" not in outer.log()
    assert "guess" not in outer.log() + inner.log()
