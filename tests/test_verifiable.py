"""Nothing lost through the proxy while the cluster behind it loses a leader: Kafka's own
VerifiableProducer (acks=all, enable.idempotence=true) and VerifiableConsumer, the tools of
Kafka's system tests, run through a kthrottle proxy (with a quota that never binds) in front
of the three-node KRaft cluster, on a topic with 3 replicas and min.insync.replicas 2. While
the producer runs, the leader of partition 0 is killed with kill -9, started again on its
data, and given its leadership back by a preferred election (KIP-460).

From both tools' JSON lines: every record the producer saw acknowledged was consumed, at the
partition and offset of its acknowledgement and with its value; and no value is in the log
twice (what idempotence, KIP-98, promises across the retries a leader change causes).
"""
import json
import re
import subprocess
import time
import uuid

from conftest import ProxyProcess
from kafka_cluster import VERIFIABLE_CONSUMER, VERIFIABLE_PRODUCER, free_ports_in_a_row
from kthrottle.embedded import free_port
from test_java_clients import TOOL_LOG4J2, JavaTool, metric, metrics

RECORDS = 50_000  # at most: the producer is stopped AFTER seconds after the election
THROUGHPUT = 1_000  # records a second
AFTER = 3.0
KILL_AFTER = 2_000  # records acknowledged before the kill
PARTITIONS = 3
PRODUCER_ID, CONSUMER_ID = "verifiable-producer", "verifiable-consumer"
QUOTA = 10_000_000  # bytes a second: far above what either tool moves (never binds)
ACKED = re.compile(r'"name":"producer_send_success"')


def events(tool, name):
    """The JSON lines of ``tool`` named ``name``."""
    out = []
    for _, text in list(tool.lines):
        if text.startswith("{") and '"name":"%s"' % name in text:
            out.append(json.loads(text))
    return out


def start_proxy(cluster, tmp_path):
    """A proxy in front of all three nodes (node N on node_port_base + N) with a quota file
    that names both tools, and its admin endpoint."""
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."%s"]\nproducer_byte_rate = %d\n'
                      '[clients."%s"]\nconsumer_byte_rate = %d\n'
                      % (PRODUCER_ID, QUOTA, CONSUMER_ID, QUOTA))
    admin = free_port()
    nodes = list(cluster.nodes.values())
    extra = []
    for node in nodes[1:]:
        extra += ["--bootstrap-server", node.bootstrap]
    proxy = ProxyProcess(nodes[0].bootstrap, tmp_path / "proxy.log", node_id=nodes[0].node_id,
                         extra_args=extra + ["--quota-file", str(quotas),
                                             "--admin-listen", "127.0.0.1:%d" % admin])
    low, high = min(cluster.nodes), max(cluster.nodes)
    first = free_ports_in_a_row(high - low + 1)
    proxy.node_port_base = first - low
    proxy.node_port = first
    return proxy.start(), admin


def test_nothing_acknowledged_is_lost_or_doubled_through_a_leader_kill(kafka_cluster3,
                                                                      tmp_path):
    cluster = kafka_cluster3
    topic = "verifiable-%s" % uuid.uuid4().hex[:8]
    cluster.create_topic(topic, partitions=PARTITIONS, replication_factor=3,
                         config={"min.insync.replicas": "2"})
    log_config = tmp_path / "tools-log4j2.properties"
    log_config.write_text(TOOL_LOG4J2)
    producer_config = tmp_path / "producer.properties"
    # (the tool sets retries=0 of its own: idempotence needs them, KIP-98)
    producer_config.write_text("client.id=%s\nenable.idempotence=true\nacks=all\n"
                               "retries=2147483647\nlinger.ms=5\n" % PRODUCER_ID)
    consumer_config = tmp_path / "consumer.properties"
    consumer_config.write_text("client.id=%s\n" % CONSUMER_ID)
    proxy, admin = start_proxy(cluster, tmp_path)
    consumer = JavaTool(cluster, VERIFIABLE_CONSUMER, [
        "--topic", topic, "--group-id", "verifiable-%s" % topic, "--verbose",
        "--reset-policy", "earliest", "--bootstrap-server", proxy.bootstrap,
        "--command-config", consumer_config], tmp_path / "consumer.err", log_config)
    producer = JavaTool(cluster, VERIFIABLE_PRODUCER, [
        "--topic", topic, "--max-messages", RECORDS, "--throughput", THROUGHPUT,
        "--acks", "-1", "--bootstrap-server", proxy.bootstrap,
        "--command-config", producer_config], tmp_path / "producer.err", log_config)
    timeline = []  # (seconds since the producer started, what happened, acked so far)
    victim = None
    try:
        consumer.start()
        producer.start()
        began = time.monotonic()

        def mark(what):
            acked = sum(1 for _, text in list(producer.lines) if ACKED.search(text))
            timeline.append((round(time.monotonic() - began, 1), what, acked))

        while sum(1 for _, t in list(producer.lines) if ACKED.search(t)) < KILL_AFTER:
            assert producer.proc.poll() is None, producer.stderr()[-3000:]
            assert time.monotonic() - began < 60, "no acks:\n%s" % producer.stderr()[-3000:]
            time.sleep(0.1)
        leader, replicas, _ = cluster.partitions(topic)[0]
        assert leader == replicas[0], "a new topic led by its preferred replica: %s" % replicas
        victim = leader
        cluster.kill(victim)
        mark("killed node %d, leader of partition 0" % victim)
        moved_to = cluster.wait_leader(topic, 0, not_on=victim, timeout=30)
        mark("node %d leads partition 0" % moved_to)
        cluster.restart(victim)
        mark("node %d restarted" % victim)
        cluster.wait_in_sync(topic, timeout=60)
        mark("every replica in sync")
        elected = cluster.elect_leaders(topic, [0])
        assert elected[0] is None, elected  # the victim was the preferred (first) replica
        back = cluster.wait_leader(topic, 0, on=victim, timeout=30)
        mark("preferred election: node %d leads partition 0 again" % back)
        try:  # a few seconds' more records to the leader elected; then SIGTERM: the tool
            # closes its producer (every send answered) and prints its summary (tool_data)
            producer.proc.wait(AFTER)
        except subprocess.TimeoutExpired:
            pass
        producer.stop()
        mark("producer stopped (exit code %s)" % producer.proc.returncode)
        acked = {(e["partition"], e["offset"]): e["value"]
                 for e in events(producer, "producer_send_success")}
        # the consumer reads until it has every acknowledged record, or gives up
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            got = {(r["partition"], r["offset"]) for r in events(consumer, "record_data")}
            if set(acked) <= got:
                break
            assert consumer.proc.poll() is None, consumer.stderr()[-3000:]
            time.sleep(0.5)
        mark("consumer caught up")
        text = metrics(admin)
    finally:
        if victim is not None and not cluster.nodes[victim].alive():
            cluster.restart(victim)
        producer.stop()
        consumer.stop()
        proxy.stop()
    summary = "timeline (s, event, acked so far):\n  %s" % "\n  ".join(map(str, timeline))
    print(summary)
    failed = events(producer, "producer_send_error")
    records = events(consumer, "record_data")
    consumed = {}
    for r in records:  # a record consumed twice (a rebalance) has one place in the log
        consumed.setdefault((r["partition"], r["offset"]), r["value"])
    places = {}
    for place, value in consumed.items():
        places.setdefault(value, []).append(place)
    summary_data = events(producer, "tool_data")
    assert summary_data, "VerifiableProducer printed no summary:\n%s" % producer.stderr()[-3000:]
    sent = summary_data[-1]["sent"]
    # the kill and the election both came while the producer still sent
    election = next(acked_then for _, what, acked_then in timeline if "election" in what)
    assert election < sent, summary
    assert not failed, "%d sends failed, e.g. %s\n%s" % (len(failed), failed[:3], summary)
    assert summary_data[-1]["acked"] == sent == len(acked), (summary_data, len(acked), summary)
    lost = sorted(place for place in acked if place not in consumed)
    assert not lost, "%d acknowledged records never consumed, e.g. %s\n%s" % (
        len(lost), lost[:10], summary)
    changed = [(place, acked[place], consumed[place]) for place in acked
               if consumed[place] != acked[place]]
    assert not changed, "records whose value is not the one acknowledged: %s" % changed[:10]
    doubled = {value: spots for value, spots in places.items() if len(spots) > 1}
    assert not doubled, "values in the log twice (idempotence broken): %s" % (
        list(doubled.items())[:10])
    assert sorted(map(int, consumed.values())) == list(range(sent))
    # the quota was on for both tools and never held them back
    assert metric(text, "kthrottle_produce_bytes_total", PRODUCER_ID) > 0, text[-3000:]
    assert metric(text, "kthrottle_fetch_bytes_total", CONSUMER_ID) > 0
    assert metric(text, "kthrottle_produce_throttled_responses_total", PRODUCER_ID) == 0
    assert metric(text, "kthrottle_fetch_throttled_responses_total", CONSUMER_ID) == 0
    assert "Traceback" not in proxy.log(), proxy.log()[-5000:]
