"""The cluster's ACLs enforced at a terminating proxy for each client's own
principal (--authorization acls): Apache Kafka with StandardAuthorizer, ACLs
for alice and bob, clients that log in to the proxy as themselves while the
proxy logs in to the broker as its super user."""
import time
import uuid

import pytest

from kthrottle.kafka_kit import Listener
from kthrottle_testkit.brokers import started_kafka
from kthrottle_testkit.clients import scram_credentials_file, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

SASL = "SASL_PLAINTEXT"
USERS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret"}
RUN = uuid.uuid4().hex[:6]
ALICE_TOPIC, BOB_TOPIC = "alice-orders-%s" % RUN, "bob-orders-%s" % RUN
ALICE_GROUP, BOB_GROUP = "alice-app-%s" % RUN, "bob-app-%s" % RUN


def acl(resource_type, name, principal, operation, pattern="PREFIXED", allow=True):
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType,
                                       ResourcePatternType, ResourceType)

    return AclBinding(getattr(ResourceType, resource_type), name,
                      getattr(ResourcePatternType, pattern), principal, "*",
                      getattr(AclOperation, operation),
                      AclPermissionType.ALLOW if allow else AclPermissionType.DENY)


@pytest.fixture(scope="module")
def kafka_acl(tmp_path_factory):
    kafka = started_kafka(tmp_path_factory, "kafka-authz", users=USERS, authorizer=True,
                           listeners=[Listener(SASL, SASL, ("PLAIN", "SCRAM-SHA-512"))])
    admin = kafka.admin(**kafka.client_config(SASL, "PLAIN", "admin"))
    for topic in (ALICE_TOPIC, BOB_TOPIC):
        kafka.create_topic(topic)
    bindings = []
    for user in ("alice", "bob"):
        for op in ("WRITE", "READ", "DESCRIBE"):
            bindings.append(acl("TOPIC", "%s-" % user, "User:%s" % user, op))
        bindings.append(acl("GROUP", "%s-" % user, "User:%s" % user, "READ"))
    for future in admin.create_acls(bindings).values():
        future.result(30)
    kafka.acl_admin = admin
    yield kafka
    kafka.stop()


def authorizing_proxy(kafka, tmp):
    """A started proxy in front of ``kafka``'s SASL listener: alice and bob log in to it with
    SCRAM, it logs in to the broker as admin (the super user) and enforces the cluster's ACLs
    for them, read every 500 ms."""
    creds = scram_credentials_file(tmp / "credentials.toml",
                                   {"alice": USERS["alice"], "bob": USERS["bob"]},
                                   mechanisms=("SCRAM-SHA-512",))
    password = tmp / "upstream-password"
    password.write_text(USERS["admin"] + "\n")
    return ProxyProcess(kafka.listener(SASL), tmp / "proxy.log", [
        "--security-protocol", SASL, "--sasl-enabled-mechanisms", "SCRAM-SHA-512",
        "--credentials-file", str(creds),
        "--upstream-security-protocol", SASL, "--upstream-sasl-mechanism", "PLAIN",
        "--upstream-sasl-username", "admin", "--upstream-sasl-password-file", str(password),
        "--super-users", "User:admin", "--acl-refresh", "500ms"],
        node_id=kafka.node_id).start()


@pytest.fixture(scope="module")
def proxy(kafka_acl, tmp_path_factory):
    p = authorizing_proxy(kafka_acl, tmp_path_factory.mktemp("authz-proxy"))
    yield p
    p.stop()


def conf(kafka, proxy, user, **settings):
    return kafka.client_config(SASL, "SCRAM-SHA-512", user, bootstrap=proxy.bootstrap,
                               **settings)


def produce(kafka, proxy, user, topic, value=b"v"):
    """One record: None when acknowledged, else the delivery error's name."""
    import confluent_kafka

    results = []
    producer = confluent_kafka.Producer(conf(kafka, proxy, user, **{
        "message.timeout.ms": 10000, "enable.idempotence": False}))
    producer.produce(topic, value, on_delivery=lambda err, msg: results.append(err))
    producer.flush(20)
    assert results, "no delivery report"
    return None if results[0] is None else results[0].name()


def consume(kafka, proxy, user, topic, group, timeout=20):
    """(values read, error names seen) from the start of ``topic``."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer(conf(kafka, proxy, user, **{
        "group.id": group, "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    values, errors = [], []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not values and not errors:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                errors.append(msg.error().name())
            else:
                values.append(msg.value())
                consumer.commit(msg, asynchronous=False)
    finally:
        consumer.close()
    return values, errors


def topics_seen(kafka, proxy, user):
    from confluent_kafka.admin import AdminClient

    return set(AdminClient(conf(kafka, proxy, user)).list_topics(timeout=15).topics)


def test_alice_works_on_her_topics_and_is_refused_bobs_as_the_broker_would(kafka_acl, proxy):
    kafka = kafka_acl
    assert produce(kafka, proxy, "alice", ALICE_TOPIC, b"from alice") is None, proxy.log()[-3000:]
    values, errors = consume(kafka, proxy, "alice", ALICE_TOPIC, ALICE_GROUP)
    assert values == [b"from alice"] and not errors, errors
    # bob's topic: Kafka's own error, from the proxy (the broker would let the
    # proxy's principal, a super user, do it)
    assert produce(kafka, proxy, "alice", BOB_TOPIC) == "TOPIC_AUTHORIZATION_FAILED"
    values, errors = consume(kafka, proxy, "alice", BOB_TOPIC, ALICE_GROUP, timeout=15)
    assert values == [] and "TOPIC_AUTHORIZATION_FAILED" in errors, errors
    # bob's group, on her own topic
    values, errors = consume(kafka, proxy, "alice", ALICE_TOPIC, BOB_GROUP, timeout=15)
    assert values == [] and "GROUP_AUTHORIZATION_FAILED" in errors, errors
    # Metadata: she does not see bob's topic at all; bob sees his, not hers
    seen = topics_seen(kafka, proxy, "alice")
    assert ALICE_TOPIC in seen and BOB_TOPIC not in seen, seen
    seen = topics_seen(kafka, proxy, "bob")
    assert BOB_TOPIC in seen and ALICE_TOPIC not in seen, seen
    # nothing of alice's reached bob's topic
    values, errors = consume(kafka, proxy, "bob", BOB_TOPIC, BOB_GROUP, timeout=8)
    assert values == [] and not errors, (values, errors)
    assert "Traceback" not in proxy.log()


def test_a_change_of_acls_takes_effect_within_seconds(kafka_acl, proxy):
    kafka = kafka_acl
    topic = "shared-%s" % RUN
    kafka.create_topic(topic)
    assert produce(kafka, proxy, "alice", topic) == "TOPIC_AUTHORIZATION_FAILED"
    grant = [acl("TOPIC", topic, "User:alice", op, pattern="LITERAL")
             for op in ("WRITE", "DESCRIBE")]
    for future in kafka.acl_admin.create_acls(grant).values():
        future.result(30)
    granted = time.monotonic()
    assert wait_until(lambda: topic in topics_seen(kafka, proxy, "alice"), 20)
    assert produce(kafka, proxy, "alice", topic) is None
    print("an ACL granted took effect at the proxy within %.1f s" % (time.monotonic() - granted))
    # a DENY beats her ALLOW
    deny = [acl("TOPIC", topic, "User:alice", "WRITE", pattern="LITERAL", allow=False)]
    for future in kafka.acl_admin.create_acls(deny).values():
        future.result(30)
    assert wait_until(lambda: produce(kafka, proxy, "alice", topic) == "TOPIC_AUTHORIZATION_FAILED",
               30)


def java_tool(kafka, proxy, tmp_path, user, main_class, *args, stdin=""):
    """One of Kafka's tools as ``user`` through the proxy: (exit code, stdout + stderr)."""
    import subprocess

    from kthrottle.kafka_kit import IPV4_ONLY_JVM_ARGS

    config = tmp_path / ("%s.properties" % user)
    config.write_text("".join("%s=%s\n" % kv for kv in kafka.java_client_config(
        SASL, "SCRAM-SHA-512", user, bootstrap=proxy.bootstrap).items()))
    command = kafka.java_command(main_class, "--bootstrap-server", proxy.bootstrap, *[
        a.replace("{config}", str(config)) for a in args], jvm_args=IPV4_ONLY_JVM_ARGS)
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_the_java_client_gets_kafkas_own_authorization_errors(kafka_acl, proxy, tmp_path):
    """Kafka's own tools as alice: kafka-topics --list shows her topics only;
    kafka-console-producer to bob's topic fails with TopicAuthorizationException,
    and to hers succeeds."""
    kafka = kafka_acl
    code, out = java_tool(kafka, proxy, tmp_path, "alice", "org.apache.kafka.tools.TopicCommand",
                          "--command-config", "{config}", "--list")
    assert code == 0, out
    assert ALICE_TOPIC in out.split() and BOB_TOPIC not in out, out
    producer = "org.apache.kafka.tools.ConsoleProducer"
    code, out = java_tool(kafka, proxy, tmp_path, "alice", producer, "--topic", BOB_TOPIC,
                          "--command-config", "{config}", "--property", "max.block.ms=15000",
                          stdin="refused\n")
    assert "TopicAuthorizationException" in out or "Not authorized to access topics" in out, out
    assert BOB_TOPIC in out, out
    code, out = java_tool(kafka, proxy, tmp_path, "alice", producer, "--topic", ALICE_TOPIC,
                          "--command-config", "{config}", stdin="from java\n")
    assert code == 0 and "Exception" not in out, out


def test_authorization_none_is_said_at_start_with_the_principal_every_client_acts_as(
        kafka_acl, tmp_path):
    password = tmp_path / "upstream-password"
    password.write_text(USERS["admin"] + "\n")
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"alice": USERS["alice"]},
                                   mechanisms=("SCRAM-SHA-512",))
    p = ProxyProcess(kafka_acl.listener(SASL), tmp_path / "proxy.log", [
        "--security-protocol", SASL, "--credentials-file", str(creds),
        "--upstream-security-protocol", SASL, "--upstream-sasl-mechanism", "PLAIN",
        "--upstream-sasl-username", "admin", "--upstream-sasl-password-file", str(password),
        "--authorization", "none"], node_id=kafka_acl.node_id).start()
    try:
        warning = [line for line in p.log().splitlines() if "--authorization none" in line]
        assert warning and "WARNING" in warning[0] and "User:admin" in warning[0], p.log()
        # and it is so: alice writes to bob's topic with the proxy's rights
        assert produce(kafka_acl, p, "alice", BOB_TOPIC, b"as the proxy") is None
    finally:
        p.stop()


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_the_java_consumer_gets_kafkas_own_errors_on_bobs_group_and_topic(
        kafka_acl, proxy, tmp_path, protocol):
    """kafka-console-consumer as alice: her topic with bob's group, and bob's topic
    with her group, end in GroupAuthorizationException and TopicAuthorizationException;
    her topic with her group reads her record. With both group protocols: KIP-848's
    (ConsumerGroupHeartbeat, which kafka-python has no schema of) is answered in Kafka's
    own layout."""
    kafka = kafka_acl
    consumer = "org.apache.kafka.tools.consumer.ConsoleConsumer"

    def consume_as_alice(topic, group):
        return java_tool(kafka, proxy, tmp_path, "alice", consumer, "--topic", topic,
                         "--group", "%s-%s" % (group, protocol), "--from-beginning",
                         "--max-messages", "1", "--timeout-ms", "20000",
                         "--consumer.config", "{config}",
                         "--consumer-property", "group.protocol=%s" % protocol)

    code, out = consume_as_alice(ALICE_TOPIC, BOB_GROUP)
    assert "GroupAuthorizationException" in out or "Not authorized to access group" in out, out
    code, out = consume_as_alice(BOB_TOPIC, ALICE_GROUP + "-java")
    assert "TopicAuthorizationException" in out or "Not authorized to access topics" in out, out
    assert produce(kafka, proxy, "alice", ALICE_TOPIC, b"for java") is None
    code, out = consume_as_alice(ALICE_TOPIC, ALICE_GROUP + "-java2")
    assert code == 0 and "Exception" not in out, out
    assert "Processed a total of 1 messages" in out, out  # one of the records on her topic


def test_a_read_revoked_ends_a_fetch_session_that_already_held_the_topic(kafka_acl, proxy):
    """kafka-python fetches in incremental fetch sessions (KIP-227), whose later
    requests name only what changed: once bob's topic is no longer hers, her
    session is opened again (FETCH_SESSION_ID_NOT_FOUND) and its full request
    refused, rather than the broker serving the old session on."""
    import confluent_kafka
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import TopicAuthorizationFailedError

    kafka = kafka_acl
    topic = "revoked-%s" % RUN
    kafka.create_topic(topic)
    grant = [acl("TOPIC", topic, "User:alice", op, pattern="LITERAL")
             for op in ("READ", "DESCRIBE")]
    for future in kafka.acl_admin.create_acls(grant).values():
        future.result(30)
    producer = confluent_kafka.Producer(kafka.client_config(SASL, "PLAIN", "admin"))

    def produce_as_admin(value):
        producer.produce(topic, value)
        assert producer.flush(20) == 0

    produce_as_admin(b"before")
    consumer = KafkaConsumer(
        bootstrap_servers=proxy.bootstrap, security_protocol=SASL,
        sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="alice",
        sasl_plain_password=USERS["alice"], enable_auto_commit=False,
        auto_offset_reset="earliest", fetch_max_wait_ms=200)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        seen = []
        deadline = time.monotonic() + 30
        while b"before" not in seen and time.monotonic() < deadline:
            for records in consumer.poll(500).values():
                seen += [r.value for r in records]
        assert seen == [b"before"], seen
        for _ in range(3):  # a few incremental fetches of the session
            consumer.poll(300)
        from confluent_kafka.admin import AclBindingFilter

        b = acl("TOPIC", topic, "User:alice", "READ", pattern="LITERAL")
        revoke = AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal,
                                  b.host, b.operation, b.permission_type)
        for future in kafka.acl_admin.delete_acls([revoke]).values():
            future.result(30)
        time.sleep(2)  # read again at the proxy (--acl-refresh 500ms); the consumer idle
        produce_as_admin(b"after")  # in her session, which names it no more: unchanged
        with pytest.raises(TopicAuthorizationFailedError):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                for records in consumer.poll(500).values():
                    seen += [r.value for r in records]
        assert seen == [b"before"], seen
    finally:
        consumer.close()
