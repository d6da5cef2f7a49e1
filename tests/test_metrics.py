"""/metrics: what it exports, against ``admin.METRICS`` and the README.

The quota buckets' counters and their let-through rate are checked on the
policy with a fake clock, then through a real proxy with real clients
(aiokafka, and confluent-kafka with librdkafka's default 1 MB batches); the
last test runs a proxy with everything configured (quotas and storage and
fleet shares in a real ZooKeeper, SASL_SSL with a credentials file) and holds
what /metrics carries equal to METRICS."""
import asyncio
import json
import socket
import threading
import time
import types
import urllib.error
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kthrottle.embedded import free_port, wait_for_port
from kthrottle.policy.quotas import QuotaManager, QuotaSettings
from kthrottle.proxy.admin import METRICS, ProxyCollector, metrics_reference
from kthrottle_testkit import ROOT
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import kthrottle_quotas, scram_credentials_file, wait_until
from kthrottle_testkit.proxy import ProxyProcess
from test_admin import pki  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

P = "producer_byte_rate"
QUOTA = 204_800.0  # 200 KiB/s
MB = 1_000_000


def get(port, path, **headers):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def families(text):
    """{name as exposed: (type, help, label names, [(labels, value)])}."""
    out = {}
    for f in text_string_to_metric_families(text):
        name = f.name + "_total" if f.type == "counter" else f.name
        samples = [(s.labels, s.value) for s in f.samples
                   if not s.name.endswith("_created")]
        labels = set()
        for sample_labels, _ in samples:
            labels |= set(sample_labels)
        out[name] = (f.type, f.documentation, labels, samples)
    return out


def value(fams, name, **labels):
    for sample_labels, v in fams[name][3]:
        if all(sample_labels.get(k) == w for k, w in labels.items()):
            return v
    return None


# -- the policy: counters and the rate let through (fake clock) ---------------------

def _batches(manager, client_id, size, until, step=0.05):
    """A client sending ``size`` as soon as its last delay is over, as a
    muted librdkafka producer does; yields (now, bucket) every ``step``."""
    quotas = manager.client("User:app", client_id)
    now, due = 0.0, 0.0
    while now < until:
        if now >= due:
            due = now + quotas.record_produce(size, now) / 1000.0
        yield now, quotas.produce
        now = round(now + step, 6)


def test_the_rate_let_through_reads_the_quota_where_kafkas_windowed_rate_reads_over():
    manager = QuotaManager({"clients/ck": {P: QUOTA}}, QuotaSettings())
    windowed, released = [], []
    for now, bucket in _batches(manager, "ck", MB, 120):
        if now >= 20:  # past the first burst
            windowed.append(bucket.measure(now) / QUOTA)
            released.append(bucket.released(now) / QUOTA)
    assert max(windowed) > 1.4  # each 1 MB counted whole on arrival
    assert 0.98 < min(released) and max(released) < 1.02
    assert len(bucket.held) <= 4  # only the delays of the last window or so are kept


def test_a_bucket_counts_what_it_records_and_the_throttle_it_gives():
    manager = QuotaManager({"clients/c": {P: 1000.0, "request_rate": 5.0}}, QuotaSettings())
    quotas = manager.client("User:app", "c")
    given = sum(quotas.record_produce(400, t * 0.1) for t in range(10))
    requests = sum(quotas.record_request(t * 0.1) for t in range(10))
    assert quotas.produce.total == 4000 and quotas.request.total == 10
    assert quotas.produce.throttle_ms_total == given > 0
    assert quotas.request.throttle_ms_total == requests > 0
    # a client that was never throttled: both rates are the same
    free = QuotaManager({"clients/f": {P: 1e9}}).client("User:app", "f")
    for t in range(50):
        free.record_produce(1000, t * 0.1)
    assert free.produce.held is None
    # 50 kB over 5 s, divided by Kafka's window padded to 10 s
    assert free.produce.released(5.0) == free.produce.measure(5.0) == pytest.approx(5000.0)


def test_held_requests_are_let_through_over_their_delay_and_then_forgotten():
    settings = QuotaSettings(mode="window")
    manager = QuotaManager({"clients/w": {P: 1000.0}}, settings)
    bucket = manager.client("User:app", "w").produce
    assert bucket.record(20_000, 0.0) > 0  # 20 s of quota at once: throttled (capped at W)
    t0, t1, held = bucket.held[0]
    assert (t0, held) == (0.0, 20_000) and t1 > t0
    # at once, nothing of it was let through; half-way, half of it
    assert bucket.released(0.0) == 0.0
    middle = (t0 + t1) / 2
    total, w = bucket.rate.scan(middle)
    assert bucket.released(middle) == pytest.approx((total - 10_000) / w)
    # long after, it no longer counts, and is forgotten at the next throttle
    assert bucket.released(60.0) == 0.0
    bucket.record(20_000, 61.0)
    assert [h[0] for h in bucket.held] == [61.0]


# -- the collector on its own -------------------------------------------------------

class StandIn:
    """What the collector reads of a ProxyServer."""

    def __init__(self, manager):
        self.quotas = manager
        self.loop = types.SimpleNamespace(time=lambda: 100.0)
        self.connections = set()
        self.refused = {"max-connections": 1}
        self.listeners = {}


def _collect(collector):
    return {(f.name + "_total" if f.type == "counter" else f.name): f
            for f in collector.collect()}


def test_collected_families_are_as_metrics_says_and_entities_are_bounded():
    manager = QuotaManager({"clients/<default>": {P: 1000.0, "request_rate": 5.0}})
    for i in range(5):
        quotas = manager.client("User:app", "c%d" % i)
        quotas.record_produce(100, 99.0)
        quotas.record_request(99.0)
    server = StandIn(manager)
    by_name = {m.name: m for m in METRICS}
    for max_entities, shown in ((1000, 5), (2, 2), (0, 0)):
        got = _collect(ProxyCollector(server, max_entities=max_entities))
        for name, f in got.items():
            m = by_name[name]
            assert (f.type, f.documentation) == (m.type, m.help), name
            for sample in f.samples:
                assert set(sample.labels) == set(m.labels), name
        clients = {s.labels["client_id"] for s in got["kthrottle_produce_bytes_total"].samples}
        assert len(clients) == shown
        assert clients == {"c%d" % i for i in range(shown)}  # the first met
        assert len(got["kthrottle_requests_total"].samples) == shown
        assert got["kthrottle_metrics_omitted_entities"].samples[0].value == 5 - shown


# -- the README ------------------------------------------------------------------------

def test_the_readme_carries_the_metrics_reference_as_generated():
    readme = (ROOT / "docs" / "reference" / "metrics.md").read_text()  # the site's page
    for m in METRICS:
        assert "`%s`" % m.name in readme, m.name
    section = readme.split("# Metrics reference\n", 1)[1]
    generated = metrics_reference()
    assert generated in section, (
        "docs/reference/metrics.md is not what METRICS makes: run "
        "scripts/config-reference --write")


# -- a real proxy, real clients ----------------------------------------------------

def test_counters_entities_and_the_process_with_real_clients(broker, tmp_path):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = "meter-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text(
        '[clients."meter-p"]\nproducer_byte_rate = 10000000\n\n'
        '[clients."meter-c"]\nconsumer_byte_rate = 10000000\n\n'
        '[users."<default>"]\nrequest_rate = 1000\n')
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", str(admin),
                      "--metrics-max-entities", "2"]).start()
    records = [b"r%04d" % i + b"x" * 995 for i in range(200)]
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)

        async def clients():
            producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id="meter-p",
                                        acks=1, linger_ms=20)
            await producer.start()
            try:
                await asyncio.gather(*[await producer.send(topic, r, partition=0)
                                       for r in records])
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(bootstrap_servers=p.bootstrap, client_id="meter-c",
                                        auto_offset_reset="earliest")
            await consumer.start()
            got = []
            try:
                consumer.assign([TopicPartition(topic, 0)])
                deadline = asyncio.get_running_loop().time() + 20
                while len(got) < len(records) and asyncio.get_running_loop().time() < deadline:
                    for messages in (await consumer.getmany(timeout_ms=500)).values():
                        got += [m.value for m in messages]
            finally:
                await consumer.stop()
            return got

        assert asyncio.run(clients()) == records
        fams = families(get(admin, "/metrics")[1])
        status, body = get(admin, "/quotas")
    finally:
        p.stop()

    payload = sum(map(len, records))
    produced = value(fams, "kthrottle_produce_bytes_total", user="", client_id="meter-p")
    # whole request frames: the records, their batch headers, the request's own
    assert payload < produced < payload * 1.5
    # users/<default> comes before clients/meter-p (KIP-55): both clients' requests
    # count in the user's bucket (PLAINTEXT: ANONYMOUS), one for all its clients
    requests = value(fams, "kthrottle_requests_total", user="ANONYMOUS", client_id="")
    assert requests >= 4  # metadata, produce, fetch, ...
    # two entities get series: the first two met...
    entities = {(s[0]["user"], s[0]["client_id"])
                for name in ("kthrottle_requests_total", "kthrottle_produce_bytes_total",
                             "kthrottle_fetch_bytes_total") for s in fams[name][3]}
    assert entities == {("", "meter-p"), ("ANONYMOUS", "")}
    # ... and the third (the consumer's fetch bucket) is counted, not shown
    assert value(fams, "kthrottle_metrics_omitted_entities") == 1
    assert fams["kthrottle_fetch_bytes_total"][3] == []
    assert value(fams, "kthrottle_throttle_seconds_total", client_id="meter-p",
                 key=P) == 0.0
    # the process's own series
    assert value(fams, "process_cpu_seconds_total") > 0
    assert value(fams, "process_resident_memory_bytes") > 10 * MB
    assert value(fams, "process_open_fds") > 3
    assert fams["python_info"][3][0][0]["implementation"] == "CPython"
    # /quotas lists what is configured, beside the connections
    assert status == 200
    report = json.loads(body)
    assert report["entities"] == [
        {"entity": "clients/meter-c", "quotas": {"consumer_byte_rate": 10000000.0}},
        {"entity": "clients/meter-p", "quotas": {P: 10000000.0}},
        {"entity": "users/<default>", "quotas": {"request_rate": 1000.0}}]
    assert report["quota_source"] == {"describe": "quota file %s" % quotas, "healthy": True}


def test_the_rate_let_through_with_librdkafkas_default_1mb_batches(broker, tmp_path):
    """confluent-kafka with its defaults (batch.size 1000000) against a
    200 KiB/s produce quota: the windowed gauge counts each batch whole when
    it arrives, the released one as its client is held back for it."""
    import confluent_kafka

    topic = "batches-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."ck-batches"]\nproducer_byte_rate = %d\n' % QUOTA)
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", str(admin)]).start()
    stop = threading.Event()
    delivered = []

    def produce():
        # librdkafka's defaults (batch.size 1000000), but a queue of 10 MB, not 1 GB
        producer = confluent_kafka.Producer({"bootstrap.servers": p.bootstrap,
                                             "client.id": "ck-batches", "acks": 1,
                                             "queue.buffering.max.messages": 1000})
        record = b"x" * 10_000
        while not stop.is_set():
            try:
                producer.produce(topic, record, partition=0,
                                 on_delivery=lambda err, msg: err or delivered.append(
                                     (time.monotonic(), len(msg.value()))))
            except BufferError:
                producer.poll(0.05)
            producer.poll(0)
        producer.purge()  # what is still queued: minutes at the quota
        producer.flush(10)

    thread = threading.Thread(target=produce, daemon=True)
    samples = []
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        start = time.monotonic()
        thread.start()
        while time.monotonic() < start + 26:
            time.sleep(0.25)
            if time.monotonic() < start + 12:  # the burst, and the window filling
                continue
            fams = families(get(admin, "/metrics")[1])
            tags = {"user": "", "client_id": "ck-batches"}
            samples.append((value(fams, "kthrottle_produce_byte_rate", **tags),
                            value(fams, "kthrottle_produce_released_byte_rate", **tags)))
    finally:
        stop.set()
        thread.join(30)
        p.stop()
    windowed = [w / QUOTA for w, _ in samples]
    released = [r / QUOTA for _, r in samples]
    steady = [(t, n) for t, n in delivered if start + 12 <= t < start + 26]
    print("windowed %.2f-%.2f, released %.2f-%.2f (x quota), %d delivered" % (
        min(windowed), max(windowed), min(released), max(released), len(delivered)))
    assert len(steady) > 100
    # the rate let through stays by the quota; the windowed one reads over it
    # for a while after each batch (the batch that earned the throttle in it)
    assert all(0.75 < r < 1.15 for r in released), released
    assert max(windowed) > 1.25 > max(released)


# -- logins -------------------------------------------------------------------------

def _login(bootstrap, **settings):
    """True once a confluent-kafka client authenticates, False when refused."""
    import confluent_kafka

    errors = []
    producer = confluent_kafka.Producer(dict({
        "bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "error_cb": errors.append}, **settings))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        producer.poll(0.1)
        if any(e.code() == confluent_kafka.KafkaError._AUTHENTICATION for e in errors):
            return False
        try:
            return bool(producer.list_topics(timeout=1.0).brokers)
        except confluent_kafka.KafkaException:
            pass
    raise AssertionError("neither authenticated nor refused: %s" % errors)


def test_logins_are_counted_by_mechanism_where_verified_and_where_relayed(broker, tmp_path):
    """A passthrough kthrottle in front of a terminating one (standing for a
    SASL broker) in front of Tansu: each counts the logins it sees."""
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"bob": "bob-secret"},
                                   mechanisms=("SCRAM-SHA-512",))
    inner = ProxyProcess(broker.bootstrap, tmp_path / "inner.log",
                         ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file",
                          str(creds), "--admin-listen", str(free_port())])
    inner.admin = int(inner.extra_args[-1])
    outer = ProxyProcess(inner.bootstrap, tmp_path / "outer.log",
                         ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "passthrough",
                          "--admin-listen", str(free_port())])
    outer.admin = int(outer.extra_args[-1])
    scram = {"sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "bob"}
    try:
        inner.start()
        outer.start()
        assert _login(outer.bootstrap, **scram, **{"sasl.password": "bob-secret"})
        assert not _login(outer.bootstrap, **scram, **{"sasl.password": "wrong"})
        # a mechanism neither proxy enables: refused before one is agreed
        assert not _login(outer.bootstrap, **{"sasl.mechanism": "OAUTHBEARER",
                                              "enable.sasl.oauthbearer.unsecure.jwt": True,
                                              "sasl.oauthbearer.config": "principal=bob"})
        counts = {}
        for name, p in (("inner", inner), ("outer", outer)):
            wait_for_port("127.0.0.1", p.admin, proc=p.proc)
            fams = families(get(p.admin, "/metrics")[1])
            counts[name] = {
                kind: {labels["mechanism"]: v for labels, v in
                       fams["kthrottle_%s_authentication_total" % kind][3]}
                for kind in ("successful", "failed")}
    finally:
        outer.stop()
        inner.stop()
    for name in ("inner", "outer"):
        successful, failed = counts[name]["successful"], counts[name]["failed"]
        assert successful["SCRAM-SHA-512"] >= 1 and failed["SCRAM-SHA-512"] >= 1, counts
        assert successful["PLAIN"] == failed["PLAIN"] == 0, counts
    # the outer proxy refuses OAUTHBEARER itself: the inner one never sees it
    assert counts["outer"]["failed"]["none"] >= 1 and counts["inner"]["failed"]["none"] == 0


# -- everything configured ---------------------------------------------------------

# the server certificate: test_admin.py's `pki` fixture

def _sasl_ssl(bootstrap, pki, password, **extra):
    return dict({"bootstrap.servers": bootstrap, "security.protocol": "SASL_SSL",
                 "ssl.ca.location": pki["ca"], "sasl.mechanism": "SCRAM-SHA-256",
                 "sasl.username": "alice", "sasl.password": password,
                 "client.id": "full-app"}, **extra)


@pytest.mark.skipif(not zk_server.available(), reason="scripts/test installs ZooKeeper")
def test_a_fully_configured_proxy_exports_what_metrics_lists(broker, zookeeper, tmp_path, pki):
    import confluent_kafka
    from kazoo.client import KazooClient

    from kthrottle.policy.fleet import ProxyShares, encode_shares_document, shares_document
    from kthrottle.policy.storage import (
        BrokerReport,
        VolumeReport,
        cluster_snapshot,
        parse_limit,
    )

    chroot = "/full-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    out = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "clients",
                           "--entity-name", "full-app", "--add-config",
                           "producer_byte_rate=%d,consumer_byte_rate=%d,request_rate=500"
                           % (QUOTA, 10 * QUOTA))
    assert out.returncode == 0, out.stderr
    topic = "full-%s" % uuid.uuid4().hex[:8]
    # every other kind of quota, each observe-only, so that every family has a
    # series: alice's controller mutations, the topic's bytes, the address's
    # connections
    for entity, config in ((("users", "--entity-name", "alice"), "controller_mutation_rate=100"),
                           (("topics", "--entity-name", topic),
                            "producer_byte_rate=%d,consumer_byte_rate=%d" % (QUOTA, QUOTA)),
                           (("ips", "--entity-default"), "connection_creation_rate=1000")):
        out = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", *entity,
                               "--add-config", config, "--observe-only")
        assert out.returncode == 0, out.stderr
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"alice": "alice-secret"},
                                   mechanisms=("SCRAM-SHA-256",))
    broker.create_topic(topic, partitions=1)
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log", [
        "--zookeeper", hosts, "--proxy-id", "full", "--usage-interval", "1000",
        "--usage-topic", "usage-%s" % uuid.uuid4().hex[:8],
        "--storage-scope", "cluster", "--storage-max-age-ms", "2000",
        "--storage-fail-safe", "OPEN",
        "--security-protocol", "SASL_SSL", "--ssl-cert", pki["cert"], "--ssl-key", pki["key"],
        "--credentials-file", str(creds), "--admin-listen", str(admin),
        "--zero-copy"]).start()  # off for TLS clients, its counter shown at 0
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        # neither shares nor a cluster state yet: both fail-safes in force, which
        # leaves the proxy ready (it serves with them) and names them as degraded
        degraded = wait_until(lambda: (lambda r: r if len(r["degraded"]) == 2 else None)(
            json.loads(get(admin, "/readyz", Accept="application/json")[1])), 15)
        assert degraded["ready"] is True and degraded["reasons"] == []
        degraded = degraded["degraded"]
        assert degraded[0].startswith("cluster state: ") and "storage fail-safe" in degraded[0]
        assert degraded[1].startswith("fleet shares: no quota shares for proxy full")
        assert get(admin, "/readyz")[0] == 200

        now = time.time()
        report = BrokerReport(111, now, parse_limit("MinFreePercentage:40"),
                              parse_limit("MinFreePercentage:20"),
                              (VolumeReport("sda1", 100 * 10 ** 9, 70 * 10 ** 9),))
        zk.create("/kthrottle/cluster-state", json.dumps(
            cluster_snapshot({111: report}, [111], {}, now, 3600)).encode(), makepath=True)
        zk.create("/kthrottle/cluster-state/shares/full", encode_shares_document(
            shares_document(ProxyShares("full", ("full",), 1.0,
                                        [(P, "", "full-app", QUOTA, QUOTA)]), now, 1)),
            makepath=True)
        assert wait_until(lambda: json.loads(get(admin, "/readyz", Accept="application/json")[1])
                          == {"ready": True, "reasons": [], "degraded": []}, 15)

        # a login refused, a TLS handshake refused, then a client that produces and
        # consumes over SASL_SSL (every quota of the entity gets a bucket)
        errors = []
        wrong = confluent_kafka.Producer(_sasl_ssl(p.bootstrap, pki, "wrong",
                                                   error_cb=errors.append))
        assert wait_until(lambda: wrong.poll(0.1) >= 0 and errors, 15)
        wrong = None  # closed
        with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            s.recv(1024)
        producer = confluent_kafka.Producer(_sasl_ssl(p.bootstrap, pki, "alice-secret"))
        for i in range(20):
            producer.produce(topic, b"v%d" % i, partition=0)
        assert producer.flush(30) == 0
        consumer = confluent_kafka.Consumer(_sasl_ssl(
            p.bootstrap, pki, "alice-secret", **{"group.id": "full-%s" % topic,
                                                  "auto.offset.reset": "earliest"}))
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 20 and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and not message.error():
                got.append(message.value())
        consumer.close()
        assert len(got) == 20
        from confluent_kafka.admin import AdminClient, NewTopic

        admin_client = AdminClient(_sasl_ssl(p.bootstrap, pki, "alice-secret"))
        admin_client.create_topics([NewTopic(topic + "-new", 2, 1)])[topic + "-new"].result(30)
        admin_client = None
        assert wait_until(lambda: "kthrottle_usage_reports_total 0.0" not in
                          get(admin, "/metrics")[1], 10)
        fams = families(get(admin, "/metrics")[1])
    finally:
        p.stop()
        zk.stop()
        zk.close()

    expected = {m.name: m for m in METRICS}
    assert set(fams) == set(expected), (set(fams) ^ set(expected))
    for name, (kind, help_text, labels, samples) in fams.items():
        m = expected[name]
        assert (kind, help_text) == (m.type, m.help), name
        assert samples, name  # every family carries a series here...
        assert labels == set(m.labels), name  # ... with the labels METRICS gives
    tags = {"user": "", "client_id": "full-app"}
    assert value(fams, "kthrottle_produce_bytes_total", **tags) > 0
    assert value(fams, "kthrottle_fetch_bytes_total", **tags) > 0
    assert value(fams, "kthrottle_requests_total", **tags) > 0
    assert value(fams, "kthrottle_controller_mutations_total", user="alice", client_id="") == 2
    assert value(fams, "kthrottle_topic_produce_bytes_total", topic=topic) > 0
    assert value(fams, "kthrottle_topic_fetch_bytes_total", topic=topic) > 0
    assert value(fams, "kthrottle_connections_created_total", ip="127.0.0.1") >= 3
    assert value(fams, "kthrottle_ip_observe_only_throttles_total", ip="127.0.0.1") == 0
    assert value(fams, "kthrottle_failed_authentication_total", mechanism="SCRAM-SHA-256") >= 1
    assert value(fams, "kthrottle_successful_authentication_total",
                 mechanism="SCRAM-SHA-256") >= 2
    assert value(fams, "kthrottle_tls_handshakes_total", result="failed") >= 1
    assert value(fams, "kthrottle_tls_handshakes_total", result="completed") >= 3
    assert value(fams, "kthrottle_ready") == 1
    assert value(fams, "kthrottle_fleet_share", key=P, **tags) == QUOTA
