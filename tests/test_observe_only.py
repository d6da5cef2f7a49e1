"""Observe-only quotas (a dry run) with real clients through a real proxy: a
quota marked observe_only, or every quota with --quota-observe-only, is
measured and reports the throttles it would have given (metrics, /quotas),
while its clients keep their unthrottled rate; an enforced quota beside it
still holds its clients."""
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit.clients import BackgroundProducer, admin_get, wait_until
from kthrottle_testkit.proxy import ProxyProcess
from test_fault_resync import metric

pytestmark = pytest.mark.integration

QUOTA = 100 * 1024  # bytes/s
SECONDS = 4.0


def _proxy(broker, tmp_path, quota_file, *extra):
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quota_file), *extra])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", str(p.admin)]
    return p.start()


def _two_producers(p, broker, topic, dry, real):
    broker.create_topic(topic)
    with BackgroundProducer(p.bootstrap, topic, dry) as d, \
            BackgroundProducer(p.bootstrap, topic, real) as r:
        time.sleep(1.0)  # past the burst allowance
        t0 = time.monotonic()
        time.sleep(SECONDS)
        t1 = time.monotonic()
    assert d.error is None and r.error is None, (d.error, r.error)
    return d.rate(t0, t1), r.rate(t0, t1)


def _client_entry(report, client_id):
    for conn in report["connections"]:
        for client in conn["clients"]:
            if client["client_id"] == client_id and client["produce"]["quota"]:
                return client["produce"]
    return None


def test_an_observe_only_quota_reports_throttles_while_its_client_runs_free(broker, tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[clients.dry-app]\nproducer_byte_rate = %d\nobserve_only = true\n\n"
                      "[clients.held-app]\nproducer_byte_rate = %d\n" % (QUOTA, QUOTA))
    p = _proxy(broker, tmp_path, quotas)
    try:
        dry, held = _two_producers(p, broker, "dry-%s" % uuid.uuid4().hex[:8],
                                   "dry-app", "held-app")
        # the enforced quota holds its client; the observe-only one does not
        assert held < 1.5 * QUOTA, held
        assert dry > 3 * QUOTA, dry
        a = p.admin
        assert metric(a, "kthrottle_observe_only_throttles_total", client_id="dry-app",
                      key="producer_byte_rate") > 0
        assert metric(a, "kthrottle_observe_only_throttle_seconds_total", client_id="dry-app",
                      key="producer_byte_rate") > 0
        assert metric(a, "kthrottle_throttle_seconds_total", client_id="dry-app",
                      key="producer_byte_rate") == 0
        assert metric(a, "kthrottle_throttle_seconds_total", client_id="held-app",
                      key="producer_byte_rate") > 0
        # an enforced bucket has no observe-only series
        assert metric(a, "kthrottle_observe_only_throttles_total", client_id="held-app") is None
        # and the measured rate says how far over its quota the dry run is
        assert metric(a, "kthrottle_produce_byte_rate", client_id="dry-app") > 2 * QUOTA
    finally:
        p.stop()


def test_observe_only_is_set_and_cleared_while_the_proxy_runs(broker, tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[clients.app]\nproducer_byte_rate = %d\nobserve_only = true\n" % QUOTA)
    p = _proxy(broker, tmp_path, quotas)
    topic = "dry-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    try:
        with BackgroundProducer(p.bootstrap, topic, "app") as producer:
            time.sleep(1.0)
            t0 = time.monotonic()
            time.sleep(2.0)
            t1 = time.monotonic()
            free = producer.rate(t0, t1)
            report = admin_get(p.admin, "/quotas")
            entry = _client_entry(report, "app")
            assert entry["observe_only"] is True and entry["observed"]["throttles"] > 0
            assert entry["throttled"] == 0
            # enforced from now on: the same client is held
            quotas.write_text("[clients.app]\nproducer_byte_rate = %d\n" % QUOTA)
            assert wait_until(lambda: _client_entry(admin_get(p.admin, "/quotas"), "app")
                              ["observe_only"] is False, 15)
            time.sleep(2.0)  # the debt of the dry run's last burst is paid
            t2 = time.monotonic()
            time.sleep(SECONDS)
            t3 = time.monotonic()
            held = producer.rate(t2, t3)
        assert producer.error is None, producer.error
        assert free > 3 * QUOTA, free
        assert held < 1.5 * QUOTA, held
    finally:
        p.stop()


def test_a_whole_source_observe_only_caps_no_fetch_and_counts_what_it_would_do(broker,
                                                                                tmp_path):
    import confluent_kafka

    topic = "dry-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    values = [b"%06d" % i + b"x" * 1018 for i in range(1500)]  # 1.5 MB
    producer = confluent_kafka.Producer({"bootstrap.servers": broker.bootstrap})
    for v in values:
        producer.produce(topic, v, partition=0)
    assert producer.flush(30) == 0
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[clients.reader]\nconsumer_byte_rate = %d\n" % QUOTA)
    p = _proxy(broker, tmp_path, quotas, "--quota-observe-only")
    try:
        consumer = confluent_kafka.Consumer({
            "bootstrap.servers": p.bootstrap, "client.id": "reader",
            "group.id": "dry-%s" % topic, "auto.offset.reset": "earliest"})
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        got = 0
        t0 = time.monotonic()
        deadline = t0 + 30
        while got < len(values) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and not message.error():
                got += 1
        elapsed = time.monotonic() - t0
        consumer.close()
        assert got == len(values)
        # held to 100 KB/s (a 1 s burst) 1.5 MB would take some 14 s
        assert elapsed < 7, elapsed
        a = p.admin
        assert metric(a, "kthrottle_observe_only_throttles_total", client_id="reader",
                      key="consumer_byte_rate") > 0
        assert metric(a, "kthrottle_throttle_seconds_total", client_id="reader",
                      key="consumer_byte_rate") == 0
        assert metric(a, "kthrottle_fetch_bytes_total", client_id="reader") >= 1_500_000
    finally:
        p.stop()
