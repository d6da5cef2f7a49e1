"""Nothing lost through the proxy while the cluster behind it loses a leader: Kafka's own
VerifiableProducer (acks=all, enable.idempotence=true) and VerifiableConsumer, the tools of
Kafka's system tests, run through a kthrottle proxy (with a quota that never binds) in front
of the three-node KRaft cluster, on a topic with 3 replicas and min.insync.replicas 2. While
the producer runs, the leader of partition 0 is killed with kill -9, started again on its
data, and given its leadership back by a preferred election (KIP-460).

From both tools' JSON lines: every record the producer saw acknowledged was consumed, at the
partition and offset of its acknowledgement and with its value; and no value is in the log
twice (what idempotence, KIP-98, promises across the retries a leader change causes).

The scenario itself is the kit's (``VerifiableRun``), which benchmarks/nothing_lost_java.py
runs too.
"""
import pytest

from kthrottle.kafka_kit import VerifiableRun
from kthrottle_testkit.proxy import ProxyProcess
from test_java_clients import metric, metrics

pytestmark = pytest.mark.integration

RECORDS = 50_000  # at most: the producer is stopped AFTER seconds after the election
THROUGHPUT = 1_000  # records a second
AFTER = 3.0
KILL_AFTER = 2_000  # records acknowledged before the kill
PARTITIONS = 3
PRODUCER_ID, CONSUMER_ID = "verifiable-producer", "verifiable-consumer"
QUOTA = 10_000_000  # bytes a second: far above what either tool moves (never binds)


def start_proxy(cluster, tmp_path):
    """A proxy in front of all three nodes (node N on node_port_base + N) with a quota file
    that names both tools, and its admin endpoint."""
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."%s"]\nproducer_byte_rate = %d\n'
                      '[clients."%s"]\nconsumer_byte_rate = %d\n'
                      % (PRODUCER_ID, QUOTA, CONSUMER_ID, QUOTA))
    return ProxyProcess.for_cluster(cluster, tmp_path, ["--quota-file", quotas])


def test_nothing_acknowledged_is_lost_or_doubled_through_a_leader_kill(kafka_cluster3,
                                                                      tmp_path):
    cluster = kafka_cluster3
    proxy, admin = start_proxy(cluster, tmp_path)
    try:
        result = VerifiableRun(cluster, proxy.bootstrap, tmp_path, records=RECORDS,
                               throughput=THROUGHPUT, kill_after=KILL_AFTER, after=AFTER,
                               partitions=PARTITIONS, producer_id=PRODUCER_ID,
                               consumer_id=CONSUMER_ID).run()
        text = metrics(admin)
    finally:
        proxy.stop()
    summary = result.summary()
    print(summary)
    assert result.election[0] is None, result.election  # the victim was the preferred replica
    assert result.tool_summary, "VerifiableProducer printed no summary:\n%s" % (
        result.producer.stderr()[-3000:])
    sent = result.sent
    # the kill and the election both came while the producer still sent
    assert result.election_acked < sent, summary
    failed = result.send_errors
    assert not failed, "%d sends failed, e.g. %s\n%s" % (len(failed), failed[:3], summary)
    assert result.acked == sent == len(result.acked_records), (
        result.tool_summary, len(result.acked_records), summary)
    lost = result.lost
    assert not lost, "%d acknowledged records never consumed, e.g. %s\n%s" % (
        len(lost), lost[:10], summary)
    changed = result.changed
    assert not changed, "records whose value is not the one acknowledged: %s" % changed[:10]
    doubled = result.duplicated
    assert not doubled, "values in the log twice (idempotence broken): %s" % (
        list(doubled.items())[:10])
    assert sorted(map(int, result.consumed_records.values())) == list(range(sent))
    # the quota was on for both tools and never held them back
    assert metric(text, "kthrottle_produce_bytes_total", PRODUCER_ID) > 0, text[-3000:]
    assert metric(text, "kthrottle_fetch_bytes_total", CONSUMER_ID) > 0
    assert metric(text, "kthrottle_produce_throttled_responses_total", PRODUCER_ID) == 0
    assert metric(text, "kthrottle_fetch_throttled_responses_total", CONSUMER_ID) == 0
    assert "Traceback" not in proxy.log(), proxy.log()[-5000:]
