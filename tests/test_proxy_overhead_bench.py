"""What benchmarks/proxy_overhead.py measures kthrottle against, on real components: the peer
proxies started exactly as the benchmark starts them (kthrottle_testkit/peers.py) in front of
the session's Apache Kafka node, and Kafka's own performance tools as its Java client.

* Kroxylicious (pass-through, port per node): a confluent-kafka produce and consume round trip
  through it, and Metadata through it naming the proxy's addresses only. Its jars come from
  ``scripts/peer-proxies kroxylicious``, which scripts/test runs: missing, the test fails.
* grepplabs/kafka-proxy: the same. The Go module proxy refuses to serve it (403) where this
  project is built, so on a machine without it the test is skipped, saying why, unless
  KAFKA_PROXY_SRC names a source tree to build it from: then the binary should be there and
  its absence fails the test.
* ProducerPerformance and ConsumerPerformance run once each against the broker, and their real
  output goes through the benchmark's parsers.
"""
import os
import subprocess
import time
import uuid

import pytest

from kthrottle.kafka_kit import kafka_lib, metadata_brokers
from kthrottle_testkit import peers
from kthrottle_testkit.harness import Processes

pytestmark = pytest.mark.integration

RECORDS = 300


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """The processes this module starts (each stopped by its PID at the end); their logs."""
    started = Processes(tmp_path_factory.mktemp("peers"))
    yield started
    started.stop_all()


def kafka_proxy_binary():
    try:
        return peers.install("kafka-proxy")
    except peers.PeerMissing as exc:
        if os.environ.get("KAFKA_PROXY_SRC"):
            pytest.fail("KAFKA_PROXY_SRC is set, so kafka-proxy should have been built: %s"
                        % exc, pytrace=False)
        pytest.skip("kafka-proxy cannot be installed on this machine (set KAFKA_PROXY_SRC to a "
                    "source tree of %s to build it): %s" % (peers.KAFKA_PROXY_VERSION, exc))


def kroxylicious_home():
    try:
        return peers.install("kroxylicious")
    except peers.PeerMissing as exc:  # scripts/test installs it: missing is a failure
        pytest.fail(str(exc), pytrace=False)


def round_trip(bootstrap, broker, partitions=3):
    """RECORDS records produced through ``bootstrap`` with confluent-kafka and read back
    through it from every partition: the values read."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    topic = "peer-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=partitions)
    admin = broker.admin()
    peers.wait_for_leaders(admin, topic, partitions)  # see why there
    sent = [b"record-%d" % i for i in range(RECORDS)]
    errors = []
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "1", "linger.ms": 5})
    for value in sent:
        producer.produce(topic, value,
                         on_delivery=lambda err, msg: err and errors.append(str(err)))
    assert producer.flush(30) == 0, "records left unsent through %s" % bootstrap
    assert not errors, errors
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "g-" + topic,
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        got, deadline = [], time.monotonic() + 30
        while len(got) < RECORDS and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got.append(message.value())
    finally:
        consumer.close()
    return sent, got


def assert_behind(bootstrap, broker):
    """Metadata through the proxy names the broker's node, at 127.0.0.1 and on a port of the
    proxy's, never the broker's own address."""
    host, _, port = bootstrap.rpartition(":")
    brokers, _ = metadata_brokers(host, int(port), timeout=10)
    assert [b[0] for b in brokers] == [broker.node_id]
    for node_id, node_host, node_port in brokers:
        assert (node_host, node_port) != (broker.host, broker.port)
        assert node_host == "127.0.0.1"
    return brokers


def test_kroxylicious_pass_through(apache_kafka, procs):
    home = kroxylicious_home()
    bootstrap, proc = peers.start_kroxylicious(apache_kafka, procs, home=home)
    try:
        (_, node_host, node_port), = assert_behind(bootstrap, apache_kafka)
        # port per node: the node has a port of its own beside the bootstrap port
        assert node_port != int(bootstrap.rpartition(":")[2])
        sent, got = round_trip(bootstrap, apache_kafka)
        assert sorted(got) == sorted(sent)
        # why the benchmark leaves aiokafka out of this cell: version ranges with min > max,
        # which the broker itself never advertises
        invalid = peers.invalid_api_ranges("127.0.0.1", int(bootstrap.rpartition(":")[2]))
        assert not peers.invalid_api_ranges(apache_kafka.host, apache_kafka.port)
        assert {key for key, _ in invalid} <= {76, 77, 78, 79}  # share groups (KIP-932)
        assert proc.poll() is None
    finally:
        procs.stop(proc)
    assert proc.returncode is not None


def test_kafka_proxy_pass_through(apache_kafka, procs):
    binary = kafka_proxy_binary()
    bootstrap, proc = peers.start_kafka_proxy(apache_kafka, procs, binary=binary)
    try:
        (_, _, node_port), = assert_behind(bootstrap, apache_kafka)
        assert node_port == int(bootstrap.rpartition(":")[2])  # its listener for the node
        sent, got = round_trip(bootstrap, apache_kafka)
        assert sorted(got) == sorted(sent)
        assert proc.poll() is None
    finally:
        procs.stop(proc)


def run_tool(main_class, *args):
    done = subprocess.run(peers.java_tool_command(kafka_lib(), main_class, *args),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_java_tools_output_parsed(apache_kafka):
    topic = "perf-%s" % uuid.uuid4().hex[:8]
    apache_kafka.create_topic(topic, partitions=3)
    text = run_tool(peers.PRODUCER_PERFORMANCE, *peers.producer_performance_args(
        apache_kafka.bootstrap, topic, RECORDS, 512, 2000,
        {"acks": "1", "enable.idempotence": "false", "linger.ms": 0}, warm_up=3))
    out = peers.parse_producer_performance(text)
    assert out["steady_state"] and out["records"] == RECORDS
    assert out["records_per_sec"] > 0 and out["mib_per_sec"] > 0
    assert 0 <= out["p50_ms"] <= out["p95_ms"] <= out["p99_ms"] <= out["p999_ms"]
    assert out["p999_ms"] <= out["max_ms"] + 1
    # the whole run's line (warm-up included) is not the one taken
    whole = peers.PRODUCER_SUMMARY_RE.findall(text)
    assert [int(line[0]) for line in whole] == [RECORDS + 3, RECORDS]

    text = run_tool(peers.CONSUMER_PERFORMANCE, *peers.consumer_performance_args(
        apache_kafka.bootstrap, topic, RECORDS + 3, "g-" + topic, timeout_ms=30_000))
    out = peers.parse_consumer_performance(text)
    assert out["data.consumed.in.nMsg"] == RECORDS + 3
    assert out["fetch.time.ms"] >= 0 and isinstance(out["start.time"], str)

    # no summary: the error quotes the end of the output
    with pytest.raises(ValueError, match="no ProducerPerformance summary.*ends with: .*[|] oops$"):
        peers.parse_producer_performance(text + "\noops")
    with pytest.raises(ValueError, match="no ConsumerPerformance result"):
        peers.parse_consumer_performance("start.time, end.time\n")


def overhead_module():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "proxy_overhead.py")
    spec = importlib.util.spec_from_file_location("proxy_overhead_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peers_are_warmed_up_and_kafka_3_9_is_a_broker_to_choose():
    bench = overhead_module()
    parse = bench.parse_args
    # a JVM compiles its hot code as it serves: with a peer, every endpoint is warmed up
    assert parse(["--records", "1000", "--configs", "direct,kroxylicious"]).warm_up_records == 200
    assert parse(["--records", "1000", "--configs", "direct,kthrottle"]).warm_up_records == 0
    assert parse(["--records", "1000", "--configs", "kafka-proxy",
                  "--warm-up-records", "7"]).warm_up_records == 7
    with pytest.raises(SystemExit):
        parse(["--warm-up-records", "-1"])
    args = parse(["--broker", "kafka-3.9", "--configs", "direct,tansu-proxy"])
    assert args.broker == "kafka-3.9"
    assert "tansu-proxy" not in args.configs and "tansu-proxy" in args.left_out


def test_the_java_latency_phase_leaves_its_first_seconds_out():
    bench = overhead_module()
    args = bench.parse_args(["--rate", "2000", "--partitions", "3"])
    # 4 s at the rate: ProducerPerformance's JVM compiles its hot code meanwhile
    assert bench.java_latency_warm_up(args) == 8000
    args = bench.parse_args(["--rate", "1", "--partitions", "12"])
    assert bench.java_latency_warm_up(args) == 12  # still one record per partition at least


def test_a_target_verdict_shows_the_rounds_range_and_whether_it_lies_across_the_limit():
    verdict = overhead_module().verdict
    assert verdict([-0.4, 1.3, 2.1], 0.0, True, "+.2f", " ms") == (
        "+1.30 ms (not met; rounds -0.40 ms to +2.10 ms, across the limit)")
    assert verdict([0.5, 1.3, 2.1], 0.0, True, "+.2f", " ms") == (
        "+1.30 ms (not met; rounds +0.50 ms to +2.10 ms)")
    assert verdict([0.2, 0.3], 1.0, True, ".2f", "x") == "0.25x (met; rounds 0.20x to 0.30x)"
    assert verdict([0.95], 0.9, False, ".2f", "x") == "0.95x (met)"
    assert verdict([0.8, 0.95], 0.9, False, ".2f", "x") == (
        "0.88x (not met; rounds 0.80x to 0.95x, across the limit)")
