"""Apache Kafka's own command-line tools and the Java client through a kthrottle proxy in front of
Apache Kafka 4.4, checked as a user checks them:

- kafka-configs.sh --bootstrap-server <proxy> sets a client quota in the cluster (KIP-546), and
  the proxy, which reads its quotas from the cluster (--quota-source kafka), holds a producer to
  it; the same tool manages SCRAM users through the proxy (KIP-554).
- kafka-consumer-groups.sh --list, --describe and --reset-offsets on a group that consumed
  through the proxy.
- A consumer of the KIP-848 protocol (group.protocol=consumer) reads every record.
- A transactional producer's committed records are read with isolation.level=read_committed,
  and its aborted ones are not (KIP-98).

The proxy is put in front of the broker's [::1]-only listener, and every JVM here runs with
IPv4 sockets only, as in test_share_groups.py: a tool that got an unrewritten broker address
(Metadata, FindCoordinator) could not reach the broker at all. Each tool's TCP peers are
watched too (psutil) and must all be the proxy's ports.

ProducerPerformance and ConsumerPerformance held to byte-rate quotas are in
test_java_clients.py (there the quotas come from a file); not repeated here.
"""
import re
import subprocess
import tempfile
import time
import urllib.request
import uuid

import psutil
import pytest

from kthrottle.kafka_kit import IPV4_ONLY_JVM_ARGS, KafkaMissing, compile_java
from kthrottle.embedded import _die_with_parent, free_port
from kthrottle_testkit.clients import admin_get, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

CONFIG_COMMAND = "org.apache.kafka.tools.ConfigCommand"  # bin/kafka-configs.sh
GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
TRANSACTIONS_COMMAND = "org.apache.kafka.tools.TransactionsCommand"  # kafka-transactions.sh

REFRESH = "1s"  # --quota-refresh: how soon the proxy sees a quota altered in the cluster
QUOTA = 100_000  # producer_byte_rate, bytes per second
RECORD_SIZE = 1000
# ~7 s at QUOTA once the proxy's burst (1 s of quota) is spent: long enough to show the rate
THROTTLED_RECORDS = 800
FREE_RECORDS = 3000
SUMMARY = re.compile(r"^(\d+) records sent, ([\d.]+) records/sec .* 99\.9th", re.M)


class Ran:
    """A Java tool run to its end: exit code, output, and every TCP peer it was seen with."""

    def __init__(self, command, code, out, err, peers):
        self.command, self.code, self.out, self.err, self.peers = command, code, out, err, peers

    def __repr__(self):
        return "%s exited %s\n--- stdout:\n%s\n--- stderr:\n%s" % (
            " ".join(self.command[-12:]), self.code, self.out[-3000:], self.err[-3000:])


def java(kafka, proxy, main_class, *args, timeout=90, classpath=None):
    """Run ``main_class`` (IPv4 sockets only) to its end, watching its connections; fail if it
    was seen connected anywhere but the proxy's ports."""
    command = kafka.java_command(main_class, *args, jvm_args=IPV4_ONLY_JVM_ARGS)
    if classpath:
        at = command.index("-cp") + 1
        command[at] = "%s:%s" % (classpath, command[at])
    peers = set()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    for c in psutil.Process(proc.pid).net_connections(kind="tcp"):
                        if c.raddr:
                            peers.add((c.raddr.ip, c.raddr.port))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        out.seek(0)
        err.seek(0)
        ran = Ran(command, proc.returncode, out.read().decode(errors="replace"),
                  err.read().decode(errors="replace"), peers)
    assert time.monotonic() < deadline, "no end within %d s: %r" % (timeout, ran)
    ours = {("127.0.0.1", port) for port in proxy.ports}
    assert peers <= ours, "%s connected to %s; the proxy is %s, the broker %s" % (
        main_class, sorted(peers - ours), sorted(ours), kafka.bootstrap_ipv6 or kafka.bootstrap)
    return ran


def tool(kafka, proxy, main_class, *args, timeout=90):
    """A tool that must succeed."""
    ran = java(kafka, proxy, main_class, "--bootstrap-server", proxy.bootstrap, *args,
               timeout=timeout)
    assert ran.code == 0, "%r\n--- proxy log:\n%s" % (ran, proxy.log()[-2000:])
    return ran


def console_consumer(kafka, proxy, topic, max_messages, group=None, isolation=None,
                     **properties):
    """ConsoleConsumer from the start of ``topic`` until ``max_messages``: the values."""
    args = ["--topic", topic, "--from-beginning", "--max-messages", max_messages,
            "--timeout-ms", 30000]
    if group:
        args += ["--group", group]
    if isolation:
        args += ["--isolation-level", isolation]
    for name, value in properties.items():
        args += ["--command-property", "%s=%s" % (name.replace("_", "."), value)]
    ran = tool(kafka, proxy, CONSOLE_CONSUMER, *args)
    return ran.out.splitlines()


def offsets_table(text, group):
    """kafka-consumer-groups --describe (or --reset-offsets) rows of ``group``:
    {partition: [the columns after PARTITION]}."""
    rows = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0] == group and cols[2].isdigit():
            rows[int(cols[2])] = cols[3:]
    return rows


def produce(bootstrap, topic, values):
    """``values`` (keyed, spread over the partitions) written through ``bootstrap``."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": "tools-fill",
                         "linger.ms": 5, "acks": "all"})
    for i, value in enumerate(values):
        producer.produce(topic, value, key=b"%d" % i)
    assert producer.flush(60) == 0


def end_offsets(kafka, topic, partitions):
    """Read at the broker itself, not through the proxy."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "tools-watch"})
    try:
        return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)]
    finally:
        consumer.close()


def metric(port, name, **labels):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    want = ['%s="%s"' % kv for kv in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rpartition(" ")[2])
    return 0.0


def quotas_of(proxy, entity):
    """The quotas the proxy holds for ``entity`` (its /quotas), None if it has none."""
    for e in admin_get(proxy.admin, "/quotas")["entities"]:
        if e["entity"] == entity:
            return e["quotas"]
    return None


@pytest.fixture(scope="module")
def kafka_proxy(apache_kafka, tmp_path_factory):
    """One proxy for the module, its quotas read from the cluster (DescribeClientQuotas,
    KIP-546) every REFRESH, in front of the broker's [::1]-only listener where there is one."""
    kafka = apache_kafka
    admin = free_port()
    proxy = ProxyProcess(kafka.bootstrap_ipv6 or kafka.bootstrap,
                         tmp_path_factory.mktemp("tools-proxy") / "proxy.log",
                         node_id=kafka.node_id,
                         extra_args=["--quota-source", "kafka", "--quota-refresh", REFRESH,
                                     "--admin-listen", "127.0.0.1:%d" % admin])
    proxy.admin = admin
    proxy.start()
    yield proxy
    proxy.stop()


# 1. kafka-configs.sh ------------------------------------------------------------------------

def producer_performance(kafka, proxy, topic, client_id, records):
    """ProducerPerformance as fast as it is let: (its own records/s x RECORD_SIZE, the run)."""
    ran = tool(kafka, proxy, PRODUCER_PERFORMANCE,
               "--topic", topic, "--num-records", records, "--record-size", RECORD_SIZE,
               "--throughput", -1, "--command-property", "client.id=%s" % client_id, "acks=1")
    summary = SUMMARY.search(ran.out)
    assert summary and int(summary.group(1)) == records, ran
    return float(summary.group(2)) * RECORD_SIZE, ran


def test_kafka_configs_sets_a_quota_through_the_proxy_that_the_proxy_then_enforces(
        apache_kafka, kafka_proxy):
    kafka, proxy = apache_kafka, kafka_proxy
    run = uuid.uuid4().hex[:8]
    topic, client, free = "tools-quota-%s" % run, "tools-quota-%s" % run, "tools-free-%s" % run
    kafka.create_topic(topic)
    entity = ["--entity-type", "clients", "--entity-name", client]
    # the same tool, unthrottled, for comparison
    free_rate, _ = producer_performance(kafka, proxy, topic, free, FREE_RECORDS)
    deleted = False
    try:
        # KIP-546: AlterClientQuotas passes the proxy to the cluster, which keeps the quota
        altered = tool(kafka, proxy, CONFIG_COMMAND, "--alter",
                       "--add-config", "producer_byte_rate=%d" % QUOTA, *entity)
        assert "Completed updating config for client %s." % client in altered.out, altered
        described = tool(kafka, proxy, CONFIG_COMMAND, "--describe", *entity)
        assert ("Quota configs for client-id '%s' are producer_byte_rate=%.1f" % (client, QUOTA)
                in described.out), described
        # the proxy reads the cluster's quotas again every --quota-refresh
        assert wait_until(lambda: quotas_of(proxy, "clients/" + client), timeout=20) == {
            "producer_byte_rate": QUOTA}, proxy.log()[-3000:]
        assert admin_get(proxy.admin, "/quotas")["quota_source"]["healthy"]

        rate, ran = producer_performance(kafka, proxy, topic, client, THROTTLED_RECORDS)
        throttled = metric(proxy.admin, "kthrottle_produce_throttled_responses_total",
                           client_id=client)
        print("ProducerPerformance through the proxy: %.0f B/s unthrottled, %.0f B/s (%.2fx) "
              "with producer_byte_rate=%d from the cluster; the proxy throttled %d responses"
              % (free_rate, rate, rate / QUOTA, QUOTA, throttled))
        # the tool's own rate counts the burst in: under 1.5x on a loaded machine
        assert 0.5 * QUOTA <= rate <= 1.5 * QUOTA, ran
        assert free_rate >= 3 * QUOTA, "unthrottled, the producer got only %.0f B/s" % free_rate
        # the proxy held it (the broker enforces the same quota on the proxy's connection;
        # these say the proxy did), and the Java client honoured its throttle_time_ms
        assert throttled > 0
        assert metric(proxy.admin, "kthrottle_produce_quota", client_id=client,
                      entity="clients/" + client) == QUOTA
        assert metric(proxy.admin, "kthrottle_produce_throttled_responses_total",
                      client_id=free) == 0
        assert re.search(r"Connection to node -?\d+ is throttled for \d+ ms", ran.err), ran
        assert ("127.0.0.1", proxy.node_port) in ran.peers  # the watch sees connections
        assert sum(end_offsets(kafka, topic, 1)) == FREE_RECORDS + THROTTLED_RECORDS

        # removed in the cluster through the proxy: the proxy drops it too
        tool(kafka, proxy, CONFIG_COMMAND, "--alter", "--delete-config", "producer_byte_rate",
             *entity)
        deleted = True
        assert wait_until(lambda: quotas_of(proxy, "clients/" + client) is None, timeout=20), (
            proxy.log()[-3000:])
    finally:
        if not deleted:  # the broker is the session's: leave no quota on it
            java(kafka, proxy, CONFIG_COMMAND, "--bootstrap-server", proxy.bootstrap, "--alter",
                 "--delete-config", "producer_byte_rate", *entity)


def test_kafka_configs_manages_scram_users_through_the_proxy(apache_kafka, kafka_proxy):
    """KIP-554's AlterUserScramCredentials and DescribeUserScramCredentials pass the proxy
    (it has no credential store of its own here) to the cluster's controller, which keeps
    the salted credential; the broker needs no SASL listener for that."""
    kafka, proxy = apache_kafka, kafka_proxy
    user = "tools-bob-%s" % uuid.uuid4().hex[:8]
    entity = ["--entity-type", "users", "--entity-name", user]
    # one mechanism per call: KRaft refuses two changes for one user in one request
    # (DuplicateResourceException "A user credential cannot be altered twice")
    altered = tool(kafka, proxy, CONFIG_COMMAND, "--alter", "--add-config",
                   "SCRAM-SHA-256=[iterations=8192,password=bob-secret]", *entity)
    assert "Completed updating config for user %s." % user in altered.out, altered
    try:
        described = tool(kafka, proxy, CONFIG_COMMAND, "--describe", *entity)
        assert ("SCRAM credential configs for user-principal '%s' are "
                "SCRAM-SHA-256=iterations=8192" % user in described.out), described
        assert "bob-secret" not in described.out
    finally:
        tool(kafka, proxy, CONFIG_COMMAND, "--alter", "--delete-config", "SCRAM-SHA-256",
             *entity)
    gone = tool(kafka, proxy, CONFIG_COMMAND, "--describe", *entity)
    assert "SCRAM" not in gone.out, gone


# 2. kafka-consumer-groups.sh -----------------------------------------------------------------

def test_kafka_consumer_groups_shows_and_resets_a_group_that_consumed_through_the_proxy(
        apache_kafka, kafka_proxy):
    kafka, proxy = apache_kafka, kafka_proxy
    run = uuid.uuid4().hex[:8]
    topic, group = "tools-groups-%s" % run, "tools-classic-%s" % run
    kafka.create_topic(topic, partitions=3)
    values = ["record-%04d" % i for i in range(300)]
    produce(proxy.bootstrap, topic, [v.encode() for v in values])
    ends = end_offsets(kafka, topic, 3)
    # a classic group (the Java consumer's default group.protocol): JoinGroup, SyncGroup,
    # OffsetCommit at the coordinator the proxy named
    got = console_consumer(kafka, proxy, topic, len(values), group=group)
    assert sorted(got) == values

    listed = tool(kafka, proxy, GROUP_COMMAND, "--list")
    assert group in listed.out.split(), listed
    described = tool(kafka, proxy, GROUP_COMMAND, "--describe", "--group", group)
    # CURRENT-OFFSET, LOG-END-OFFSET, LAG of each partition: all read, none behind
    assert {p: cols[:3] for p, cols in offsets_table(described.out, group).items()} == {
        p: [str(end), str(end), "0"] for p, end in enumerate(ends)}, described

    reset = tool(kafka, proxy, GROUP_COMMAND, "--reset-offsets", "--group", group,
                 "--topic", topic, "--to-earliest", "--execute")
    assert offsets_table(reset.out, group) == {p: ["0"] for p in range(3)}, reset
    described = tool(kafka, proxy, GROUP_COMMAND, "--describe", "--group", group)
    assert {p: cols[:3] for p, cols in offsets_table(described.out, group).items()} == {
        p: ["0", str(end), str(end)] for p, end in enumerate(ends)}, described
    # and the group reads everything again from there
    again = console_consumer(kafka, proxy, topic, len(values), group=group)
    assert sorted(again) == values


# 3. KIP-848 ------------------------------------------------------------------------------

def test_a_kip_848_consumer_reads_every_record_through_the_proxy(apache_kafka, kafka_proxy):
    """group.protocol=consumer: ConsumerGroupHeartbeat to the coordinator the proxy named,
    the broker assigning the partitions (KIP-848, Kafka 4.0)."""
    kafka, proxy = apache_kafka, kafka_proxy
    run = uuid.uuid4().hex[:8]
    topic, group = "tools-848-%s" % run, "tools-848-%s" % run
    kafka.create_topic(topic, partitions=3)
    values = ["record-%04d" % i for i in range(300)]
    produce(proxy.bootstrap, topic, [v.encode() for v in values])
    got = console_consumer(kafka, proxy, topic, len(values), group=group,
                           group_protocol="consumer", client_id="tools-848")
    assert sorted(got) == values

    # a group of the new protocol ("Consumer"; "Classic" had the tool fallen back)
    listed = tool(kafka, proxy, GROUP_COMMAND, "--list", "--type")
    assert [group, "Consumer"] in [line.split() for line in listed.out.splitlines()], listed
    # ConsumerGroupDescribe: the coordinator is named as the proxy's node port
    state = tool(kafka, proxy, GROUP_COMMAND, "--describe", "--group", group, "--state")
    row = next((line for line in state.out.splitlines() if line.startswith(group + " ")), "")
    assert "127.0.0.1:%d" % proxy.node_port in row and "Empty" in row, state


# 4. transactions ---------------------------------------------------------------------------

TXN_PRODUCER = r"""
import java.util.Map;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerGroupMetadata;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.StringSerializer;

/** Commits n records, aborts n (and an offset commit), commits n more (and an offset). */
public class TxnProducer {
    @SuppressWarnings("removal")  // ConsumerGroupMetadata(String): no consumer here
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], topic = args[1], txnId = args[2], group = args[3];
        int n = Integer.parseInt(args[4]);
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("transactional.id", txnId);
        props.put("client.id", txnId);
        props.put("key.serializer", StringSerializer.class.getName());
        props.put("value.serializer", StringSerializer.class.getName());
        TopicPartition tp = new TopicPartition(topic, 0);
        ConsumerGroupMetadata meta = new ConsumerGroupMetadata(group);
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(props)) {
            producer.initTransactions();
            producer.beginTransaction();
            for (int i = 0; i < n; i++)
                producer.send(new ProducerRecord<>(topic, 0, null, "committed-" + i));
            producer.commitTransaction();
            producer.beginTransaction();
            for (int i = 0; i < n; i++)
                producer.send(new ProducerRecord<>(topic, 0, null, "aborted-" + i));
            producer.sendOffsetsToTransaction(Map.of(tp, new OffsetAndMetadata(99)), meta);
            producer.flush();  // in the log before the abort
            producer.abortTransaction();
            producer.beginTransaction();
            for (int i = n; i < 2 * n; i++)
                producer.send(new ProducerRecord<>(topic, 0, null, "committed-" + i));
            producer.sendOffsetsToTransaction(Map.of(tp, new OffsetAndMetadata(7)), meta);
            producer.commitTransaction();
        }
        System.out.println("committed " + (2 * n) + " aborted " + n);
    }
}
"""


@pytest.fixture(scope="module")
def txn_producer(apache_kafka, tmp_path_factory):
    """TxnProducer compiled against the broker's kafka-clients jar: its class folder."""
    folder = tmp_path_factory.mktemp("txn-producer")
    (folder / "TxnProducer.java").write_text(TXN_PRODUCER)
    try:
        compile_java(folder / "TxnProducer.java", folder, apache_kafka.lib)
    except KafkaMissing as e:  # as the kit does for a missing JDK: fail, saying how to get one
        pytest.fail(str(e), pytrace=False)
    return folder


def test_a_java_transactional_producer_through_the_proxy_commits_and_aborts(
        apache_kafka, kafka_proxy, txn_producer):
    """KIP-98 through the proxy: FindCoordinator (the transaction coordinator, rewritten),
    InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn; then
    read_committed fetches (the aborted transactions list) leave the aborted records out."""
    kafka, proxy = apache_kafka, kafka_proxy
    run = uuid.uuid4().hex[:8]
    topic, txn_id, group = "tools-txn-%s" % run, "tools-txn-%s" % run, "tools-txn-%s" % run
    kafka.create_topic(topic)  # one partition: the log's order is the records' order
    n = 50
    ran = java(kafka, proxy, "TxnProducer", proxy.bootstrap, topic, txn_id, group, n,
               classpath=txn_producer)
    assert ran.code == 0 and "committed %d aborted %d" % (2 * n, n) in ran.out, ran

    committed = ["committed-%d" % i for i in range(2 * n)]
    read = console_consumer(kafka, proxy, topic, 2 * n, isolation="read_committed")
    assert read == committed
    # the aborted records are in the log (between the two transactions): read_uncommitted
    # sees them, so read_committed above did leave them out
    everything = console_consumer(kafka, proxy, topic, 3 * n, isolation="read_uncommitted")
    assert everything == committed[:n] + ["aborted-%d" % i for i in range(n)] + committed[n:]

    # the committed transaction's offset stands, the aborted one's does not
    described = tool(kafka, proxy, GROUP_COMMAND, "--describe", "--group", group)
    assert offsets_table(described.out, group)[0][0] == "7", described
    # kafka-transactions.sh (DescribeTransactions, KIP-664) at the coordinator
    state = tool(kafka, proxy, TRANSACTIONS_COMMAND, "describe", "--transactional-id", txn_id)
    assert "CompleteCommit" in state.out, state
