"""Partition-scope storage throttling when the producer names topics by id: the Java client of
Kafka 4 sends Produce v13 (KIP-516: topic ids alone) to a Kafka 4 broker. The cluster-state
snapshot maps the ids of the topics it lists to their names, so only a producer writing to the
partition on a full volume is held, whichever way it names the topic.

The snapshot is written to the state topic here, as ``kthrottle spark-sync`` writes it (the
job's own output is tested in test_state_topic.py); the proxy follows it there."""
import re
import time
import uuid
import warnings

import pytest

from kthrottle.embedded import free_port
from kthrottle.policy.storage import PAUSE, SNAPSHOT_FORMAT, SNAPSHOT_VERSION, encode_snapshot
from kthrottle.sources.state_topic import STATE_KEY
from kthrottle_testkit.proxy import ProxyProcess
from test_java_clients import metrics

pytestmark = pytest.mark.integration

PERF = "org.apache.kafka.tools.ProducerPerformance"
RECORDS = 3000


def topic_id(kafka, topic):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    return described["topic_id"]


def publish_state(kafka, topic, document):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    try:
        producer.send(topic, key=STATE_KEY.encode(), value=encode_snapshot(document)).get(30)
    finally:
        producer.close()


def deferred(admin):
    found = re.search(r"^kthrottle_storage_deferred_requests_total (\S+)$", metrics(admin), re.M)
    return float(found.group(1))


def produce(kafka, proxy, topic, client_id):
    """ProducerPerformance through the proxy, as fast as it may: records/s it reported."""
    done = kafka.tool(PERF, "--topic", topic, "--num-records", RECORDS, "--record-size", 1000,
                      "--throughput", -1, "--producer-props",
                      "bootstrap.servers=%s" % proxy.bootstrap, "client.id=%s" % client_id,
                      "acks=1", "linger.ms=5", "batch.size=16384", timeout=120)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("%d records sent" % RECORDS), done.stdout + done.stderr
    return float(last.split(",")[1].split()[0])


def test_only_the_producer_to_a_paused_partition_named_by_id_is_held(apache_kafka, tmp_path):
    kafka = apache_kafka
    hot, cold = "hot-%s" % uuid.uuid4().hex[:8], "cold-%s" % uuid.uuid4().hex[:8]
    state_topic = "state-%s" % uuid.uuid4().hex[:8]
    kafka.create_topic(hot)
    kafka.create_topic(cold)
    kafka.create_topic(state_topic, config={"cleanup.policy": "compact"})
    # hot-0 has a replica on a volume past its hard limit; the rest of the cluster is OPEN
    publish_state(kafka, state_topic, {
        "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "generated_by": "test",
        "cycle": 1, "generated_at": time.time(),
        "cluster": {"state": "OPEN", "factor": 1.0, "unknown_brokers": []},
        "brokers": {}, "partitions": [[hot, 0, PAUSE, 0.0]],
        "topic_ids": {hot: topic_id(kafka, hot)}})
    admin = free_port()
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log",
                         ["--cluster-state-topic", state_topic, "--storage-scope", "partition",
                          "--storage-pause-max-ms", "1000",
                          "--admin-listen", "127.0.0.1:%d" % admin],
                         node_id=kafka.node_id).start()
    try:
        proxy.wait_for_log("following it", timeout=30)
        produce(kafka, proxy, cold, "cold-producer")
        assert deferred(admin) == 0, proxy.log()[-3000:]
        produce(kafka, proxy, hot, "hot-producer")
        # each Produce to hot-0 throttled the producer for the pause's cap
        assert deferred(admin) > 0, proxy.log()[-3000:]
        assert "Traceback" not in proxy.log()
    finally:
        proxy.stop()
