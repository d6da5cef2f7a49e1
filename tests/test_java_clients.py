"""The Java client, well-behaved, through the proxy with quotas on, against Apache Kafka 4.4:
Kafka's own perf tools (kafka-tools' ProducerPerformance and ConsumerPerformance, the classes
behind bin/kafka-producer-perf-test.sh and bin/kafka-consumer-perf-test.sh) get their quota
within the margins a loaded 2-core machine keeps (0.8x-1.2x over ~17 s of steady traffic, the
first second's burst left out; the target is 0.95x-1.05x), with no request timed out, no
record expired and no connection closed or opened again while they run.

How each is held: the producer by throttle_time_ms, which the Java client honours on Produce
v6+ (it logs "Connection to node 1 is throttled for N ms" and its produce-throttle-time-avg is
above zero). The consumer of batches the Java producer's size by its fetches alone: each asks
for part of what its bucket holds (the proxy caps max_bytes), so its bucket never falls into
debt and no response needs a throttle (fetch-throttle-time-avg stays 0). A consumer of batches
larger than the bucket's burst (a broker sends a first batch whole, KIP-74) is answered empty
with throttle_time_ms until the bucket has paid for the batch, and backs off on Fetch v8+.

The rate is measured where the proxy cannot colour it: the producer's at the broker (log end
offsets, records x record size), the consumer's from the records the tool itself counted (its
--show-detailed-stats lines, by its own clock). Connections are read from the proxy's log
("connection N opened/closed"); the tools' NetworkClient logs at INFO, so that a request
timeout or a dropped connection shows in their stderr.
"""
import datetime
import re
import time
import urllib.request
import uuid

import pytest

from kthrottle_testkit.proxy import ProxyProcess
# (in the kit, so that benchmarks run Kafka's tools the same way; other test modules
# import them from here)
from kthrottle.kafka_kit import TOOL_LOG4J2, JavaTool
from kthrottle.embedded import free_port

pytestmark = pytest.mark.integration

PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_PERFORMANCE = "org.apache.kafka.tools.ConsumerPerformance"

QUOTA = 200_000  # producer_byte_rate / consumer_byte_rate, bytes per second
RECORD_SIZE = 1000
PARTITIONS = 3
BURST = 1.5  # seconds after the first record left out of the measurement (the bucket's burst)
WINDOW = 17.0  # seconds of steady traffic measured against the quota
LOW, HIGH = 0.8, 1.2  # the bounds a loaded 2-core machine keeps (the target is 0.95-1.05)

# what a Java client writes when a request times out, a batch expires or a connection breaks
CLIENT_TROUBLE = re.compile(r"TimeoutException|Expiring \d+ record|NetworkException|"
                            r"Disconnecting from node|due to request timeout|"
                            r"Cancelled in-flight|DisconnectException|\bdisconnected\b")
# what the Java client logs (WARN) when a response's throttle_time_ms makes it back off: it
# sends that node nothing more until then (NetworkClient, KIP-219)
BACKED_OFF = re.compile(r"Connection to node -?\d+ is throttled for \d+ ms")
OPENED = re.compile(r"connection (\d+) opened: client (\S+) -> (.+?) listener")
CLOSED = re.compile(r"connection (\d+) closed: (.*)")


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        return r.read().decode()


def metric(text, name, client_id):
    """The value of ``name`` for the bucket of ``client_id`` (0 if it has no series)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and 'client_id="%s"' % client_id in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def java_metric(output, group, name):
    """A metric of ``--print-metrics`` (``group:name:{tags} : value``); None if absent."""
    match = re.search(r"^%s:%s:\{[^}]*\}\s*:\s*(\S+)\s*$" % (re.escape(group), re.escape(name)),
                      output, re.M)
    return float(match.group(1)) if match else None


def connections(log_text):
    """The client connections the proxy's log shows: [(conn id, listener)] opened, and
    [(conn id, reason)] closed."""
    opened = [(int(m.group(1)), m.group(3)) for m in OPENED.finditer(log_text)]
    closed = [(int(m.group(1)), m.group(2)) for m in CLOSED.finditer(log_text)]
    return opened, closed


def start_proxy(kafka, tmp_path, quotas):
    """A proxy in front of the broker with ``quotas`` ({client_id: {key: value}}) in a quota
    file, and its admin endpoint: (proxy, admin port)."""
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text("".join(
        '[clients."%s"]\n%s\n' % (cid, "".join("%s = %d\n" % kv for kv in q.items()))
        for cid, q in quotas.items()))
    admin = free_port()
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log", node_id=kafka.node_id,
                         extra_args=["--quota-file", str(quota_file),
                                     "--admin-listen", "127.0.0.1:%d" % admin]).start()
    return proxy, admin


def end_offsets(consumer, topic):
    from confluent_kafka import TopicPartition

    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1]
               for p in range(PARTITIONS))


# how late the test's reader may see a line the tool printed on a loaded machine: the
# producer closes its connections right after its summary, and by the time the summary is
# read that close may be in the proxy's log already
READER_LAG = 2.0


def log_before_end(proxy):
    """The proxy's log as it was when the tool printed the line just read: as it is now,
    less the lines of the last READER_LAG seconds."""
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=READER_LAG)
    kept = []
    for line in proxy.log().splitlines(keepends=True):
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            stamp = None  # a line that goes on the one before
        if stamp is not None and stamp > cutoff:
            break
        kept.append(line)
    return "".join(kept)


def check_connections(proxy_log, before_end, most):
    """No client connection closed before the tool's end, and no more opened than ``most``
    ({listener: count}) over the whole run: a request timeout or a broken connection would
    show as one closed and another opened."""
    opened, closed = connections(before_end)
    # (one never opened to the broker, or that sent nothing, is the test kit's probe of the
    # port: a Java client's connection starts with ApiVersions)
    closed = [(conn, why) for conn, why in closed
              if conn in {c for c, _ in opened} and ", 0 requests, 0 bytes in," not in why]
    all_opened, all_closed = connections(proxy_log)
    probes = {conn for conn, why in all_closed if ", 0 requests, 0 bytes in," in why}
    by_listener = {}
    for conn, listener in all_opened:
        if conn not in probes:  # the kit's probe of the port is not the tool's
            by_listener[listener] = by_listener.get(listener, 0) + 1
    assert not closed, "connections closed while the tool ran: %s\nproxy log:\n%s" % (
        closed, before_end[-4000:])
    assert all(n <= most.get(listener, 0) for listener, n in by_listener.items()), (
        "connections opened per listener: %s (at most %s); proxy log:\n%s"
        % (by_listener, most, proxy_log[-4000:]))
    return by_listener


def test_the_java_producer_gets_its_quota_through_the_proxy(apache_kafka, tmp_path):
    from confluent_kafka import Consumer

    kafka = apache_kafka
    client_id = "java-prod"
    topic = "java-prod-%s" % uuid.uuid4().hex[:8]
    kafka.create_topic(topic, partitions=PARTITIONS)
    log_config = tmp_path / "tools-log4j2.properties"
    log_config.write_text(TOOL_LOG4J2)
    proxy, admin = start_proxy(kafka, tmp_path, {client_id: {"producer_byte_rate": QUOTA}})
    # enough records for the burst, the window and a few seconds more: the tool ends by
    # itself (and prints its metrics) soon after the window. (With --throughput -1 it queues
    # records in its 32 MiB buffer.memory far faster than its quota drains them: their latency
    # grows by a second a second, and a run of more than delivery.timeout.ms, 120 s, would
    # expire records in the client's own buffer, against Kafka's own quotas as here.)
    records = int(QUOTA * (BURST + WINDOW + 3) / RECORD_SIZE)
    tool = JavaTool(kafka, PRODUCER_PERFORMANCE, [
        "--topic", topic, "--num-records", records, "--record-size", RECORD_SIZE,
        "--throughput", -1, "--reporting-interval", 1000, "--print-metrics",
        "--command-property", "bootstrap.servers=%s" % proxy.bootstrap,
        "client.id=%s" % client_id, "acks=1"], tmp_path / "producer.err", log_config)
    # the proxy's log as it was when the tool printed its summary (before it closed anything)
    at_end = {}
    tool.watch_for = re.compile(r"records sent, .* 99\.9th")  # the summary
    tool.on_match = lambda: at_end.setdefault("log", log_before_end(proxy))
    watcher = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "java-prod-watch"})
    try:
        began = time.monotonic()
        tool.start()
        deadline = began + 45
        while end_offsets(watcher, topic) == 0 and time.monotonic() < deadline:
            assert tool.proc.poll() is None, tool.stderr()[-3000:]
            time.sleep(0.05)
        first = time.monotonic()
        assert first < deadline, "nothing reached the broker:\n%s\n%s" % (
            tool.stderr()[-3000:], proxy.log()[-3000:])
        time.sleep(max(0.0, first + BURST - time.monotonic()))
        t0, n0, m0 = time.monotonic(), end_offsets(watcher, topic), metrics(admin)
        time.sleep(max(0.0, t0 + WINDOW - time.monotonic()))
        t1, n1, m1 = time.monotonic(), end_offsets(watcher, topic), metrics(admin)
        code = tool.wait(max(5.0, began + 55 - time.monotonic()))
        written = end_offsets(watcher, topic)
    finally:
        watcher.close()
        tool.stop()
        proxy.stop()
    took = time.monotonic() - began
    rate = (n1 - n0) * RECORD_SIZE / (t1 - t0)
    counted = (metric(m1, "kthrottle_produce_bytes_total", client_id)
               - metric(m0, "kthrottle_produce_bytes_total", client_id)) / (t1 - t0)
    throttled = metric(m1, "kthrottle_produce_throttled_responses_total", client_id)
    out, err = tool.stdout(), tool.stderr()
    throttle_avg = java_metric(out, "producer-metrics", "produce-throttle-time-avg")
    print("java producer: %d records in %.1f s of window = %.0f B/s at the broker, %.2fx its "
          "quota %d (the proxy counted %.0f B/s of Produce frames); %d throttled responses; "
          "produce-throttle-time-avg %s ms; %.1f s in all"
          % (n1 - n0, t1 - t0, rate, rate / QUOTA, QUOTA, counted, throttled, throttle_avg,
             took))
    print("\n".join(text for _, text in tool.lines if "records sent" in text))
    assert code == 0, "ProducerPerformance exited with %s:\n%s\n%s" % (code, out[-2000:],
                                                                       err[-3000:])
    assert n1 < records, (
        "all %d records were at the broker %.1f s after the first: the producer was not held "
        "to its quota\n%s" % (records, t1 - first, out[-2000:]))
    # every record written, once (ProducerPerformance exits 0 even when sends failed)
    assert written == records, "%d records at the broker, %d sent:\n%s" % (written, records,
                                                                          err[-3000:])
    assert re.search(r"^%d records sent, .* 99\.9th" % records, out, re.M), out[-2000:]
    assert LOW * QUOTA <= rate <= HIGH * QUOTA, (
        "the Java producer got %.0f B/s, %.2fx its producer_byte_rate %d (bounds %gx-%gx); "
        "tool output:\n%s" % (rate, rate / QUOTA, QUOTA, LOW, HIGH, out[-2000:]))
    trouble = [line for line in err.splitlines() if CLIENT_TROUBLE.search(line)]
    assert not trouble, "the Java producer had trouble:\n%s" % "\n".join(trouble[:20])
    assert "log" in at_end, "no summary line in the tool's output:\n%s" % out[-2000:]
    # bootstrap once, the node once (and never a second time)
    check_connections(proxy.log(), at_end["log"], {"bootstrap": 1, "node %d" % kafka.node_id: 1})
    # the proxy throttled it and the client honoured what it was told
    assert throttled > 0
    assert throttle_avg is not None and throttle_avg > 0, (
        "produce-throttle-time-avg: %s\n%s" % (throttle_avg, out[-3000:]))
    assert BACKED_OFF.search(err), err[-3000:]


def fill(bootstrap, topic, nbytes, batch_size):
    """``nbytes`` of RECORD_SIZE records written straight to the broker (not through the
    proxy), in batches of about ``batch_size`` bytes."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": "java-cons-fill",
                         "linger.ms": 50, "acks": "1", "batch.size": batch_size,
                         "batch.num.messages": 1 + batch_size // RECORD_SIZE})
    value = b"c" * RECORD_SIZE
    for i in range(nbytes // RECORD_SIZE):
        while True:
            try:
                producer.produce(topic, value, partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def detailed_stats(lines):
    """ConsumerPerformance's --show-detailed-stats lines: [(seconds, records so far)] by the
    tool's own clock (its ``time`` column, in ms), from the header's columns."""
    from datetime import datetime

    columns, stats = None, []
    for _, text in lines:
        fields = [f.strip() for f in text.split(",")]
        if "data.consumed.in.nMsg" in fields:
            columns = fields
        elif columns and len(fields) == len(columns):
            row = dict(zip(columns, fields))
            try:
                at = datetime.strptime(row["time"], "%Y-%m-%d %H:%M:%S:%f").timestamp()
                stats.append((at, int(row["data.consumed.in.nMsg"])))
            except ValueError:
                continue
    return stats


class ConsumerRun:
    """ConsumerPerformance through a proxy with consumer_byte_rate QUOTA on its client-id, on
    a topic filled at the broker with 10 MB (far more than it reads: it is never starved) in
    batches of ``batch_size``; it reads ``seconds`` of its quota and ends."""

    def __init__(self, kafka, tmp_path, batch_size, seconds, client_id="java-cons"):
        self.client_id = client_id
        topic = "%s-%s" % (client_id, uuid.uuid4().hex[:8])
        kafka.create_topic(topic, partitions=PARTITIONS)
        began = time.monotonic()
        fill(kafka.bootstrap, topic, 10 << 20, batch_size)
        self.filled_in = time.monotonic() - began
        log_config = tmp_path / "tools-log4j2.properties"
        log_config.write_text(TOOL_LOG4J2)
        proxy, admin = start_proxy(kafka, tmp_path, {client_id: {"consumer_byte_rate": QUOTA}})
        tool = JavaTool(kafka, CONSUMER_PERFORMANCE, [
            "--bootstrap-server", proxy.bootstrap, "--topic", topic,
            "--num-records", int(QUOTA * seconds / RECORD_SIZE),
            "--group", "%s-%s" % (client_id, uuid.uuid4().hex[:8]), "--show-detailed-stats",
            "--reporting-interval", 1000, "--print-metrics", "--timeout", 20000,
            "--command-property", "client.id=%s" % client_id], tmp_path / "consumer.err",
            log_config)
        # the proxy's log as it was when the tool began printing its metrics (it closes the
        # consumer after)
        self.at_end = {}
        tool.watch_for = re.compile(r"^\s*Metric Name\s+Value")
        tool.on_match = lambda: self.at_end.setdefault("log", log_before_end(proxy))
        try:
            began = time.monotonic()
            tool.start()
            self.code = tool.wait(55)
            self.metrics = metrics(admin)
        finally:
            tool.stop()
            proxy.stop()
        self.took = time.monotonic() - began
        self.proxy, self.tool = proxy, tool
        self.out, self.err = tool.stdout(), tool.stderr()
        self.stats = detailed_stats(tool.lines)
        assert self.code == 0, "ConsumerPerformance exited with %s:\n%s\n%s" % (
            self.code, self.out[-2000:], self.err[-3000:])
        assert self.stats and self.stats[-1][1] > 0, "no detailed stats:\n%s" % self.out[-3000:]
        self.throttled = metric(self.metrics, "kthrottle_fetch_throttled_responses_total",
                                client_id)
        self.throttle_avg = java_metric(self.out, "consumer-fetch-manager-metrics",
                                        "fetch-throttle-time-avg")

    def rate(self, skip, window):
        """Bytes/s of records the tool counted from ``skip`` s after the first (the burst
        behind) over about ``window`` s: (rate, seconds measured)."""
        stats = self.stats
        first = next(at for at, n in stats if n > 0)
        # (none so late: it read everything at once)
        a = next((row for row in stats if row[0] >= first + skip - 0.5), stats[-1])
        b = [row for row in stats if row[0] <= a[0] + window + 0.5][-1]
        rate = (b[1] - a[1]) * RECORD_SIZE / (b[0] - a[0]) if b[0] > a[0] else 0.0
        print("java consumer (%s): %d records in %.1f s of window = %.0f B/s, %.2fx its quota "
              "%d; the proxy counted %.0f bytes of Fetch responses in all, %d throttled; "
              "fetch-throttle-time-avg %s ms; %.1f s in all (the 10 MB filled in %.1f s)"
              % (self.client_id, b[1] - a[1], b[0] - a[0], rate, rate / QUOTA, QUOTA,
                 metric(self.metrics, "kthrottle_fetch_bytes_total", self.client_id),
                 self.throttled, self.throttle_avg, self.took, self.filled_in))
        print("records by second:", [n2 - n1 for (_, n1), (_, n2) in zip(stats, stats[1:])])
        return rate, b[0] - a[0]

    def check_rate(self, shortest):
        rate, measured = self.rate(BURST, WINDOW)
        stats = self.stats
        first = next(at for at, n in stats if n > 0)
        # a consumer not held to its quota reads the records asked for before the window ends
        assert measured >= shortest, (
            "the Java consumer read %d records (%.0f B/s, %.2fx its consumer_byte_rate %d) in "
            "%.1f s after its first: no window of %.0f s to measure; detailed stats: %s"
            % (stats[-1][1], stats[-1][1] * RECORD_SIZE / max(stats[-1][0] - first, 1.0),
               stats[-1][1] * RECORD_SIZE / max(stats[-1][0] - first, 1.0) / QUOTA, QUOTA,
               stats[-1][0] - first, shortest, stats))
        assert LOW * QUOTA <= rate <= HIGH * QUOTA, (
            "the Java consumer got %.0f B/s, %.2fx its consumer_byte_rate %d (bounds "
            "%gx-%gx); tool output:\n%s" % (rate, rate / QUOTA, QUOTA, LOW, HIGH,
                                           self.out[-3000:]))

    def check_well_behaved(self, kafka):
        trouble = [line for line in self.err.splitlines() if CLIENT_TROUBLE.search(line)]
        assert not trouble, "the Java consumer had trouble:\n%s" % "\n".join(trouble[:20])
        assert "log" in self.at_end, "no metrics in the tool's output:\n%s" % self.out[-2000:]
        # bootstrap once; the node twice: for fetches, and as the group coordinator
        check_connections(self.proxy.log(), self.at_end["log"],
                          {"bootstrap": 1, "node %d" % kafka.node_id: 2})


def test_the_java_consumer_gets_its_quota_through_the_proxy(apache_kafka, tmp_path):
    # batches the size of the Java producer's (16 KiB): a fetch gets several of them
    run = ConsumerRun(apache_kafka, tmp_path, batch_size=16384, seconds=BURST + WINDOW + 2.5)
    run.check_rate(shortest=WINDOW - 2)
    run.check_well_behaved(apache_kafka)


def test_a_java_consumer_told_to_back_off_does(apache_kafka, tmp_path):
    """Batches larger than the bucket's burst (a broker sends a first batch whole, KIP-74):
    the proxy answers such a fetch empty with throttle_time_ms until the bucket has paid for
    it, and the Java consumer backs off itself (its fetch-throttle-time-avg > 0)."""
    run = ConsumerRun(apache_kafka, tmp_path, batch_size=3 * QUOTA // 2,
                      seconds=BURST + WINDOW + 2.5, client_id="java-cons-big")
    # its records come a batch (1.5 s of quota) at a time: a window of whole batches
    run.check_rate(shortest=WINDOW - 3)
    run.check_well_behaved(apache_kafka)
    assert run.throttled > 0
    assert run.throttle_avg is not None and run.throttle_avg > 0, (
        "fetch-throttle-time-avg: %s\n%s" % (run.throttle_avg, run.out[-3000:]))
    assert BACKED_OFF.search(run.err), run.err[-3000:]
