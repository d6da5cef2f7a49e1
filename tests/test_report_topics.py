"""The report topics (the volume agent's, a fleet proxy's usage topic) are
created by KafkaPublisher (the proxy's AsyncKafkaPublisher alike) with 1
partition and an explicit replication factor on every CreateTopics version
(below v4, Kafka < 2.4, -1 is not allowed); and what the log says about how the factor was
chosen and about a cluster that does not create the topic as asked. Apache Kafka reports its
default.replication.factor, which the publisher then uses; the fallback is tested against Tansu,
which does not report it.

Tansu (measured here): it answers DescribeConfigs for a BROKER resource with
no configs at all, so default.replication.factor is never read from it and
the fallback, min(3, live brokers), is what a publisher uses against it; it
accepts any topic spec and config, so a refused creation is covered by the
pure ``refusal_warning`` below."""
import asyncio
import logging
import time
import uuid
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # kafka-python's import-time deprecations
    from kafka import KafkaAdminClient
    from kafka import errors as Errors
    from kafka.admin import ConfigResource, ConfigResourceType
    from kafka.protocol.admin import CreateTopicsRequest, DescribeConfigsRequest
    from kafka.protocol.broker_version_data import BrokerVersionData

from kthrottle.embedded import free_port
from kthrottle.security import KafkaClientSecurity
from kthrottle.sources.async_kafka import AsyncKafkaPublisher, aiokafka_config
from kthrottle.sources.kafka_publisher import (
    FALLBACK_REPLICATION_FACTOR,
    KafkaPublisher,
    PublishError,
    choose_replication_factor,
    client_config,
    refusal_warning,
)

pytestmark = pytest.mark.integration

LOGGER = "kthrottle.publisher"


def topic_name():
    return "reports-%s" % uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def broker(tansu_broker):
    """The fallback tests need a broker that does not report default.replication.factor."""
    return tansu_broker


def admin_of(broker):
    return KafkaAdminClient(bootstrap_servers=[broker.bootstrap], request_timeout_ms=5000)


def cluster_of(broker):
    """(the broker ids, the node the publisher asks for its configs): the
    controller, as the publisher does."""
    admin = admin_of(broker)
    try:
        cluster = admin.describe_cluster()
    finally:
        admin.close()
    ids = sorted(b["broker_id"] for b in cluster["brokers"])
    node = cluster["controller_id"] if cluster["controller_id"] in ids else ids[0]
    return ids, node


CONFIGS = "cleanup.policy=compact,min.cleanable.dirty.ratio=0.1,segment.ms=3600000"


def layout_of(broker, topic):
    """(replica counts per partition, cleanup.policy) of ``topic``; its
    segment.ms and min.cleanable.dirty.ratio are the publisher's (Tansu
    keeps the configs a CreateTopics carries and describes them back)."""
    admin = admin_of(broker)
    try:
        (described,) = admin.describe_topics([topic])
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)],
                                         config_filter="all")
    finally:
        admin.close()
    assert described["error_code"] == 0, described
    described_configs = configs["topic"][topic]
    policy = described_configs.get("cleanup.policy", {}).get("value")
    assert {k: described_configs.get(k, {}).get("value")
            for k in ("segment.ms", "min.cleanable.dirty.ratio")} == {
        "segment.ms": "3600000", "min.cleanable.dirty.ratio": "0.1"}, described_configs
    return [len(p["replica_nodes"]) for p in described["partitions"]], policy


def publisher_for(broker, topic, **settings):
    config = client_config([broker.bootstrap], "kthrottle-test-report-topics", timeout=10.0)
    config.update(settings)
    return KafkaPublisher(config, topic, timeout=10.0)


def publish_once(kind, broker, topic, key, value):
    """One record published by a publisher of its own: the blocking one (the
    volume agent's) or the asyncio one (the proxy's, on its event loop)."""
    if kind == "blocking":
        publisher = publisher_for(broker, topic)
        try:
            return publisher.publish(key, value)
        finally:
            publisher.close()

    async def run():
        publisher = AsyncKafkaPublisher(
            aiokafka_config([broker.bootstrap], "kthrottle-test-report-topics",
                            KafkaClientSecurity(), 10.0), topic, timeout=10.0)
        try:
            return await publisher.publish(key, value)
        finally:
            await publisher.close()

    return asyncio.run(run())


def lines(caplog, level=None):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and (level is None or r.levelno == level)]


@pytest.fixture
def tansu_reports_no_broker_configs(broker):
    """What the fallback tests rely on, checked rather than assumed: a
    Tansu that starts reporting default.replication.factor makes this fail
    here, with the reason, not in the assertions on the log."""
    _, node = cluster_of(broker)
    admin = admin_of(broker)
    try:
        answer = admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, str(node))],
                                        config_filter="all")
    finally:
        admin.close()
    assert "default.replication.factor" not in answer["broker"][str(node)], answer
    return node


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_topic_gets_one_partition_and_the_computed_replication_factor(
        kind, broker, caplog, tansu_reports_no_broker_configs):
    caplog.set_level(logging.INFO, logger=LOGGER)
    node = tansu_reports_no_broker_configs
    live = len(cluster_of(broker)[0])
    expected = min(FALLBACK_REPLICATION_FACTOR, live)
    topic = topic_name()
    sent = publish_once(kind, broker, topic, b"7", b"report")
    assert (sent.topic, sent.partition, sent.offset) == (topic, 0, 0)
    assert layout_of(broker, topic) == ([expected], "compact")
    why = "min(%d, %d live broker%s)" % (FALLBACK_REPLICATION_FACTOR, live,
                                         "" if live == 1 else "s")
    assert lines(caplog, logging.WARNING) == [
        "could not read default.replication.factor: broker %s answered DescribeConfigs without "
        "it (the broker does not report it, or this principal may not describe the cluster's "
        "configs); creating topic %s with replication factor %d = %s"
        % (node, topic, expected, why)]
    assert lines(caplog, logging.INFO) == [
        "created topic %s (%s) with 1 partition, replication factor %d = %s"
        % (topic, CONFIGS, expected, why)]

    # a second publisher finds the topic: nothing to choose, nothing said
    caplog.clear()
    assert publish_once(kind, broker, topic, b"7", b"next").offset == 1
    assert lines(caplog) == []


def test_the_asyncio_publisher_says_why_a_cluster_out_of_reach_fails_and_connects_afresh(
        broker):
    """A publication to an address where nothing listens fails within its
    timeout with the connection error; the same publisher then reaches a
    cluster that answers (the address list is the only thing changed)."""
    port = free_port()

    async def run():
        config = aiokafka_config([("127.0.0.1", port)], "kthrottle-test", KafkaClientSecurity(),
                                 3.0)
        publisher = AsyncKafkaPublisher(config, topic_name(), timeout=3.0, secret="s3cret")
        try:
            with pytest.raises(PublishError) as failed:
                await publisher.publish(b"k", b"v")
            assert publisher.producer is None and not publisher.topic_ready
            publisher.config["bootstrap_servers"] = [broker.bootstrap]
            sent = await publisher.publish(b"k", b"v")
        finally:
            await publisher.close()
        return str(failed.value), sent

    message, sent = asyncio.run(run())
    assert message.startswith("publication failed (127.0.0.1:%d over PLAINTEXT): no bootstrap "
                              "server answered (last connection error: " % port), message
    assert "Connect call failed" in message, message
    assert sent.offset == 0


def test_create_topics_below_v4_still_creates_the_topic(broker, caplog,
                                                        tansu_reports_no_broker_configs):
    """kafka-python's api_version=(2, 2) makes the publisher's clients speak
    as to a Kafka 2.2 broker: CreateTopics v3, where -1 is refused."""
    old = BrokerVersionData((2, 2))
    assert old.api_version(CreateTopicsRequest) == 3
    caplog.set_level(logging.INFO, logger=LOGGER)
    topic = topic_name()
    publisher = publisher_for(broker, topic, api_version=(2, 2))
    try:
        sent = publisher.publish(b"7", b"report")
    finally:
        publisher.close()
    assert (sent.topic, sent.offset) == (topic, 0)
    expected = min(FALLBACK_REPLICATION_FACTOR, len(cluster_of(broker)[0]))
    assert layout_of(broker, topic) == ([expected], "compact")
    (created,) = lines(caplog, logging.INFO)
    assert created.startswith("created topic %s (%s) with 1 partition, "
                              "replication factor %d = " % (topic, CONFIGS, expected))
    assert not [line for line in lines(caplog) if "Incompatible" in line or "refused" in line]


def test_a_broker_without_describe_configs_gets_the_fallback_said(broker, caplog):
    """api_version=(0, 10, 2): a Kafka 0.10.2, which has CreateTopics (v1)
    but no DescribeConfigs (Kafka 0.11, KIP-133). Only the topic creation is
    run: Tansu drops the produce format of that version (magic 1)."""
    old = BrokerVersionData((0, 10, 2))
    assert old.api_version(CreateTopicsRequest) < 4
    with pytest.raises(Errors.IncompatibleBrokerVersion):
        old.api_version(DescribeConfigsRequest)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ids, node = cluster_of(broker)
    expected = min(FALLBACK_REPLICATION_FACTOR, len(ids))
    topic = topic_name()
    publisher = publisher_for(broker, topic, api_version=(0, 10, 2))
    try:
        publisher._ensure_topic(time.monotonic() + 10)
        assert publisher.topic_ready
    finally:
        publisher.close()
    assert layout_of(broker, topic) == ([expected], "compact")
    (warning,) = lines(caplog, logging.WARNING)
    assert warning.startswith("could not read default.replication.factor: broker %s did not "
                              "answer DescribeConfigs: IncompatibleBrokerVersion: " % node)
    assert "DescribeConfigsRequest" in warning  # kafka-python's words for what is missing
    assert warning.endswith("; creating topic %s with replication factor %d = min(%d, %d live "
                            "broker%s)" % (topic, expected, FALLBACK_REPLICATION_FACTOR,
                                           len(ids), "" if len(ids) == 1 else "s"))
    assert any(line.startswith("created topic %s (%s)" % (topic, CONFIGS))
               for line in lines(caplog, logging.INFO))


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_on_apache_kafka_the_topic_gets_the_clusters_default_replication_factor(
        kind, apache_kafka, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    topic = topic_name()
    sent = publish_once(kind, apache_kafka, topic, b"7", b"report")
    assert (sent.topic, sent.partition, sent.offset) == (topic, 0, 0)
    # the session's node: default.replication.factor 1, one live broker
    assert layout_of(apache_kafka, topic) == ([1], "compact")
    assert lines(caplog, logging.WARNING) == []
    assert lines(caplog, logging.INFO) == [
        "created topic %s (%s) with 1 partition, replication factor 1 = the cluster's "
        "default.replication.factor" % (topic, CONFIGS)]


# pure logic: no broker

def test_replication_factor_is_the_default_capped_to_the_live_brokers():
    default = "the cluster's default.replication.factor"
    assert choose_replication_factor(3, 5) == (3, default)
    assert choose_replication_factor(1, 3) == (1, default)
    assert choose_replication_factor(3, 3) == (3, default)
    assert choose_replication_factor(3, 2) == (
        2, "default.replication.factor 3 capped to the 2 live brokers")
    assert choose_replication_factor(2, 1) == (
        1, "default.replication.factor 2 capped to the 1 live broker")
    # unreadable: min(3, live brokers)
    assert choose_replication_factor(None, 5) == (3, "min(3, 5 live brokers)")
    assert choose_replication_factor(None, 2) == (2, "min(3, 2 live brokers)")
    assert choose_replication_factor(None, 0) == (1, "min(3, 1 live broker)")


SPEC = "1 partition, replication factor 3 = the cluster's default.replication.factor, " \
       "cleanup.policy=compact"
CREATE = ("kafka-topics --bootstrap-server b1:9092 --create --topic reports --partitions 1 "
          "--replication-factor 3 --config cleanup.policy=compact "
          "--config min.cleanable.dirty.ratio=0.1 --config segment.ms=3600000")


def warning_for(first, second=None):
    return refusal_warning("reports", SPEC, "cleanup.policy=compact", first, second, CREATE,
                           "b1:9092")


def test_the_create_command_is_the_publishers_spec():
    config = client_config(["b1:9092", "b2:9092"], "c")
    assert KafkaPublisher(config, "reports").create_command(3) == CREATE
    assert KafkaPublisher(config, "reports", topic_configs={}).create_command(2) == (
        "kafka-topics --bootstrap-server b1:9092 --create --topic reports --partitions 1 "
        "--replication-factor 2")
    secured = client_config(["b1:9093"], "c", "SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                            sasl_username="u", sasl_password="p")
    assert KafkaPublisher(secured, "reports").create_command(1).endswith(
        "--replication-factor 1 --config cleanup.policy=compact "
        "--config min.cleanable.dirty.ratio=0.1 --config segment.ms=3600000 "
        "--command-config CLIENT.properties")


def test_a_created_topic_gets_no_warning():
    assert warning_for(None) is None
    assert warning_for((Errors.TopicAlreadyExistsError, "TopicAlreadyExistsError: exists")) is None


def test_a_creation_denied_by_acls_says_the_error_the_spec_and_the_command():
    denied = (Errors.TopicAuthorizationFailedError,
              "TopicAuthorizationFailedError: Authorization failed.")
    assert warning_for(denied) == (
        "not allowed to create topic reports with %s (%s): publishing anyway; a principal "
        "allowed to create it can run: %s" % (SPEC, denied[1], CREATE))


def test_a_refused_config_gets_the_topic_without_it_and_the_kafka_configs_command():
    refused = (Errors.InvalidConfigurationError, "InvalidConfigurationError: not allowed here")
    warning = warning_for(refused, None)
    assert warning.startswith("the cluster refused topic reports with cleanup.policy=compact "
                              "(InvalidConfigurationError: not allowed here): created it without")
    assert warning.endswith("kafka-configs --bootstrap-server b1:9092 --alter --entity-type "
                            "topics --entity-name reports --add-config cleanup.policy=compact")


def test_a_creation_that_still_fails_says_both_errors_and_never_blames_the_config():
    first = (Errors.InvalidReplicationFactorError,
             "InvalidReplicationFactorError: Replication factor: 3 larger than available "
             "brokers: 2")
    warning = warning_for(first, (first[0], first[1]))
    assert warning == (
        "could not create topic reports with %s (%s; without cleanup.policy=compact: %s): "
        "publishing anyway; once what the broker names is fixed, create it with: %s"
        % (SPEC, first[1], first[1], CREATE))
    assert "kafka-configs" not in warning
    # no configs asked: tried once, said once
    alone = refusal_warning("reports", "1 partition, replication factor 3 = x", "", first, first,
                            "CMD", "b1:9092")
    assert alone == ("could not create topic reports with 1 partition, replication factor 3 = x "
                     "(%s): publishing anyway; once what the broker names is fixed, create it "
                     "with: CMD" % first[1])
