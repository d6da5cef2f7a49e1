"""A kthrottle process as a member of a fleet (--proxy-id), with real
components: a Tansu broker, a ZooKeeper holding the quota (set with
``kthrottle quotas``) and the shares, and a producer through the proxy. The
test plays the Spark job: it reads the usage reports from the topic and
writes the proxy's shares znode by hand, so that each case is reached on cue."""
import json
import time
import uuid

import pytest

from kthrottle.embedded import free_port, wait_for_port
from kthrottle.policy.fleet import (
    ProxyShares,
    encode_shares_document,
    parse_usage_report,
    shares_document,
)
from kthrottle.policy.quotas import CAPACITY_USER
from kthrottle.sources.cluster_state import shares_znode
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import (
    BackgroundProducer,
    admin_get,
    kthrottle_quotas,
    metric,
    scram_credentials_file,
    wait_until,
)
from kthrottle_testkit.proxy import ProxyProcess
from test_fleet_policy import shares_doc

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper")]

@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: its tests read the usage topic by its default name."""
    return own_kafka


QUOTA = 200_000.0  # bytes/s
CLIENT = "fleet-app"
P = "producer_byte_rate"


def read_usage(bootstrap, topic, timeout=5.0, **security):
    """[(key, UsageReport)] of the topic, from the beginning."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             request_timeout_ms=10000, **security)
    try:
        partitions = wait_until(lambda: consumer.partitions_for_topic(topic), 10, 0.2)
        if not partitions:
            return []
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(consumer.position(tp) < end[tp] for tp in tps):
            for records in consumer.poll(timeout_ms=500).values():
                out += [(r.key, parse_usage_report(r.value)) for r in records]
        return out
    finally:
        consumer.close()


def bucket_of(report):
    for b in report.buckets:
        if b.sharing_key == (P, "", CLIENT):
            return b
    return None


def shares(generated_at, share, proxies=("a", "b"), proxy="a", cycle=1, extra=()):
    entries = [(P, "", CLIENT, share, QUOTA)] + list(extra)
    return encode_shares_document(shares_document(
        ProxyShares(proxy, tuple(proxies), 1.0 / len(proxies), sorted(entries)), generated_at,
        cycle))


def fleet_metric(port, name, client=CLIENT):
    for line in admin_get(port, "/metrics").splitlines():
        if line.startswith(name + "{") and 'client_id="%s"' % client in line \
                and 'key="%s"' % P in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def fleet(broker, zookeeper, tmp_path):
    """(start(*extra flags) -> ProxyProcess, kazoo client, usage topic, topic to produce to):
    a ZooKeeper chroot with a producer_byte_rate quota for CLIENT."""
    from kazoo.client import KazooClient

    chroot = "/fleet-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    out = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "clients",
                           "--entity-name", CLIENT, "--add-config", "producer_byte_rate=%d" % QUOTA)
    assert out.returncode == 0, out.stderr
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    usage_topic = "usage-%s" % uuid.uuid4().hex[:8]
    topic = "fleet-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    started = []

    def start(*extra, upstream=None):
        p = ProxyProcess(upstream or broker.bootstrap, tmp_path / ("proxy-%d.log" % len(started)),
                         ["--zookeeper", hosts, "--usage-topic", usage_topic, *extra])
        p.admin = free_port()
        p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
        started.append(p)
        p.start()
        wait_for_port("127.0.0.1", p.admin, proc=p.proc)  # bound just after the listeners
        return p

    yield start, zk, usage_topic, topic
    for p in started:
        p.stop()
    zk.stop()
    zk.close()


def set_znode(zk, path, data):
    if zk.exists(path):
        zk.set(path, data)
    else:
        zk.create(path, data, makepath=True)


def test_usage_reports_are_published_and_a_share_holds_the_producer_to_it(fleet, broker):
    start, zk, usage_topic, topic = fleet
    p = start("--proxy-id", "a", "--usage-interval", "1000")
    p.wait_for_log("fleet: no quota shares for proxy a")  # none yet: the configured quota
    with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
        # the reports: once the rate window is full (10 s), a rate near the quota
        # and a demand above it (the producer is throttled most of the time)
        def settled():
            reports = [r for key, r in read_usage(broker.bootstrap, usage_topic) if key == b"a"]
            last = bucket_of(reports[-1]) if reports else None
            return (reports, last) if last and last.rate > 0.85 * QUOTA else None

        found = wait_until(settled, timeout=40, interval=1.0)
        assert found, read_usage(broker.bootstrap, usage_topic)[-3:]
        reports, usage = found
        assert all(r.proxy_id == "a" and r.interval_s == 1.0 for r in reports)
        assert reports[-1].fronted_brokers == (111,)
        assert (usage.entity, usage.quota) == ("clients/%s" % CLIENT, QUOTA)
        assert 0.85 * QUOTA < usage.rate < 1.3 * QUOTA
        assert usage.demand > 1.2 * QUOTA
        assert 0 < reports[0].reported_at <= time.time()
        assert metric(p.admin, "kthrottle_usage_reports_total") >= len(reports)
        assert metric(p.admin, "kthrottle_usage_report_errors_total") == 0
        t = time.monotonic()
        before = producer.rate(t - 5, t)
        assert 0.75 * QUOTA < before < 1.3 * QUOTA

        # the job's share for this proxy: half the quota, applied live
        set_znode(zk, shares_znode("a"), shares(time.time(), QUOTA / 2))
        assert wait_until(lambda: fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA / 2,
                          timeout=5, interval=0.1)
        applied = time.monotonic()
        p.wait_for_log("fresh quota shares (cycle 1, 2 proxies): the fail-safe is over")
        assert fleet_metric(p.admin, "kthrottle_fleet_quota") == QUOTA
        assert metric(p.admin, "kthrottle_fleet_fail_safe") == 0
        assert metric(p.admin, "kthrottle_fleet_shares_age_seconds") < 10
        time.sleep(8)
        after = producer.rate(applied + 2, applied + 8)  # 6 s, once settled
        assert 0.3 * QUOTA < after < 0.7 * QUOTA, (before, after)
        # the same connection: nothing was reconnected
        view = admin_get(p.admin, "/quotas")["connections"]
        produce = [c["produce"] for conn in view for c in conn["clients"]
                   if c["client_id"] == CLIENT]
        assert produce and all((x["quota"], x["limit"]) == (QUOTA, QUOTA / 2) for x in produce)
        # later reports still say the fleet quota, and the rate of the share
        time.sleep(3)
        last = bucket_of([r for key, r in read_usage(broker.bootstrap, usage_topic)
                          if key == b"a"][-1])
        assert last.quota == QUOTA and last.rate < 0.85 * QUOTA
    assert producer.error is None
    assert p.alive()
    # the shares znode's parent, made before any cluster state: no snapshot yet, not a bad one
    assert "refused the cluster state" not in p.log()


def test_old_shares_take_the_fail_safe_and_a_malformed_document_is_refused(fleet):
    start, zk, usage_topic, topic = fleet
    p = start("--proxy-id", "a", "--usage-interval", "1000", "--share-fail-safe", "equal",
              "--share-max-age-ms", "20000")
    znode = shares_znode("a")
    with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
        assert wait_until(lambda: fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA, 10)
        assert metric(p.admin, "kthrottle_fleet_fail_safe") == 1  # none read yet
        set_znode(zk, znode, shares(time.time(), QUOTA / 2))
        p.wait_for_log("the fail-safe is over")
        assert wait_until(lambda: fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA / 2, 5)

        # written ten minutes ago, four proxies then: equal applies, quota / 4
        set_znode(zk, znode, shares(time.time() - 600, QUOTA / 2, ("a", "b", "c", "d"), cycle=2))
        p.wait_for_log("the quota shares (cycle 2) are 600 s old, more than "
                       "--share-max-age-ms 20000; the fail-safe applies (equal: each quota / 4 "
                       "proxies)")
        assert wait_until(lambda: metric(p.admin, "kthrottle_fleet_fail_safe") == 1, 5)
        assert fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA / 4
        assert metric(p.admin, "kthrottle_fleet_shares_age_seconds") >= 600

        # malformed, or for another proxy: refused, what is in force stays
        set_znode(zk, znode, b'{"format": "kthrottle-quota-shares", "version": 99}')
        p.wait_for_log("refused the quota shares in %s" % znode)
        set_znode(zk, znode, shares(time.time(), QUOTA / 3, proxy="b"))
        p.wait_for_log("the document is for proxy 'b', this is 'a'")
        assert wait_until(lambda: metric(p.admin, "kthrottle_fleet_shares_rejected_total") == 2,
                          5)
        assert fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA / 4
        assert metric(p.admin, "kthrottle_fleet_fail_safe") == 1

        # fresh again, gzip-compressed as the job stores a large document
        extra = [(P, "", "other-%05d" % i, 1000.0, 2000.0) for i in range(8000)]
        data = shares(time.time(), QUOTA / 5, cycle=3, extra=extra)
        assert data[:2] == b"\x1f\x8b"
        set_znode(zk, znode, data)
        assert wait_until(lambda: metric(p.admin, "kthrottle_fleet_fail_safe") == 0, 5)
        assert fleet_metric(p.admin, "kthrottle_fleet_share") == QUOTA / 5
        assert p.log().count("the fail-safe is over") == 2
    assert producer.error is None
    assert p.alive()


def test_usage_reports_go_with_the_proxys_upstream_security_settings(fleet, broker, tmp_path):
    """The fleet member in front of a SASL-terminating kthrottle (in front of
    Tansu): its reports authenticate with --upstream-sasl-*; a bad password
    is counted and said, and the proxy carries on."""
    start, zk, usage_topic, topic = fleet
    password = "fleet-pw-%s" % uuid.uuid4().hex[:8]
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"fleet-proxy": password})
    sasl = ProxyProcess(broker.bootstrap, tmp_path / "sasl-proxy.log",
                        ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file",
                         str(creds)]).start()
    try:
        pw_file = tmp_path / "password"
        pw_file.write_text(password + "\n")
        p = start("--proxy-id", "b", "--usage-interval", "1000",
                  "--upstream-security-protocol", "SASL_PLAINTEXT",
                  "--upstream-sasl-mechanism", "SCRAM-SHA-512",
                  "--upstream-sasl-username", "fleet-proxy",
                  "--upstream-sasl-password-file", str(pw_file), upstream=sasl.bootstrap)
        p.wait_for_log("fleet: published the first usage report of proxy b", timeout=20)
        sasl.wait_for_log("client authenticated as 'fleet-proxy' with SCRAM-SHA-512")
        reports = read_usage(broker.bootstrap, usage_topic)
        assert reports and {k for k, _ in reports} == {b"b"}
        assert reports[0][1].buckets == ()  # no client yet: nothing used
        assert password not in p.log()

        bad = tmp_path / "bad-password"
        bad.write_text("wrong\n")
        q = start("--proxy-id", "c", "--usage-interval", "1000",
                  "--upstream-security-protocol", "SASL_PLAINTEXT",
                  "--upstream-sasl-username", "fleet-proxy",
                  "--upstream-sasl-password-file", str(bad), upstream=sasl.bootstrap)
        q.wait_for_log("fleet: usage report not published", timeout=30)
        assert wait_until(lambda: metric(q.admin, "kthrottle_usage_report_errors_total") >= 1, 10)
        assert metric(q.admin, "kthrottle_usage_reports_total") == 0
        assert "(%s over SASL_PLAINTEXT as 'fleet-proxy' with SCRAM-SHA-512)" % sasl.bootstrap \
            in q.log()
        sasl.wait_for_log("SCRAM-SHA-512 login for user 'fleet-proxy': wrong password")
        assert q.alive()
    finally:
        sasl.stop()


def test_a_proxy_id_without_zookeeper_is_a_clear_error(broker, tmp_path):
    import subprocess
    import sys

    from kthrottle_testkit import ROOT

    out = subprocess.run([sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server",
                          broker.bootstrap, "--listen", "127.0.0.1:%d" % free_port(),
                          "--proxy-id", "a"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert out.returncode == 2
    assert "kthrottle proxy: error: proxy-id a makes this proxy a member of a fleet sharing its " \
           "quotas: give --zookeeper" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_shared_capacity_is_reported_as_one_bucket_and_the_fleets_share_of_it_holds(
        fleet, broker):
    """--shared-produce-capacity in a fleet: the proxy reports the capacity as a bucket of
    its own (the sum of its buckets' rates and demands), and the share of it the job gives
    this proxy is what its buckets split (here one producer, so all of it)."""
    capacity = 2 * QUOTA  # alone, the producer's part is all of it: twice its quota
    start, zk, usage_topic, topic = fleet
    p = start("--proxy-id", "a", "--usage-interval", "1000",
              "--shared-produce-capacity", str(int(capacity)))
    with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
        def reported():
            reports = [r for key, r in read_usage(broker.bootstrap, usage_topic) if key == b"a"]
            found = [b for b in reports[-1].buckets if b.user == CAPACITY_USER] if reports else []
            return found[0] if found and found[0].rate > 0.5 * capacity else None

        usage = wait_until(reported, timeout=40, interval=1.0)
        assert usage, read_usage(broker.bootstrap, usage_topic)[-3:]
        assert (usage.key, usage.client_id, usage.entity, usage.quota) == (
            P, "", "capacity", capacity)
        t = time.monotonic()
        before = producer.rate(t - 5, t)
        assert 0.75 * capacity < before < 1.3 * capacity, before
        # the job gives this proxy a quarter of the capacity (the other proxies are busier)
        set_znode(zk, shares_znode("a"), shares(time.time(), QUOTA, extra=[
            (P, CAPACITY_USER, "", capacity / 4, capacity)]))
        p.wait_for_log("fresh quota shares (cycle 1, 2 proxies): the fail-safe is over")
        applied = time.monotonic()
        time.sleep(8)
        after = producer.rate(applied + 2, applied + 8)
        assert 0.6 * capacity / 4 < after < 1.4 * capacity / 4, (before, after)
    assert producer.error is None


# the proxy's watch alone, with a real ZooKeeper (the shares documents of test_fleet_policy.py):
# a shares document dated ahead is refused as a malformed one is (a log line, the rejected
# counter), and the last good one stays

def test_a_shares_document_dated_ahead_is_refused_and_the_last_good_one_stays(zookeeper, caplog):
    import asyncio
    import logging
    import uuid

    from kazoo.client import KazooClient

    from kthrottle.proxy.fleet import SharesWatch

    caplog.set_level(logging.INFO, logger="kthrottle.storage")
    path = "/fleet-policy-%s/shares/a" % uuid.uuid4().hex[:8]

    async def until(predicate, what):
        for _ in range(250):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out waiting for %s" % what)

    async def scenario(writer):
        seen = []
        writer.create(path, json.dumps(shares_doc(generated_at=time.time(), cycle=1)).encode(),
                      makepath=True)
        watch = SharesWatch(zookeeper.hosts, path, "a")
        await watch.start(seen.append)
        try:
            await until(lambda: len(seen) == 1, "the first document")
            writer.set(path, json.dumps(shares_doc(generated_at=time.time() + 3600,
                                                   cycle=2)).encode())
            await until(lambda: watch.rejected == 1, "the document dated ahead refused")
            assert any("refused the quota shares in %s" % path in r.getMessage()
                       and "generated_at is 3600 s ahead of this machine's clock" in r.getMessage()
                       for r in caplog.records)
            await asyncio.sleep(0.05)
            assert [d.cycle for d in seen] == [1]  # the last good shares stay
            writer.set(path, json.dumps(shares_doc(generated_at=time.time(), cycle=3)).encode())
            await until(lambda: len(seen) == 2, "the next good document")
            assert [d.cycle for d in seen] == [1, 3] and watch.rejected == 1
        finally:
            await watch.stop()

    writer = KazooClient(hosts=zookeeper.hosts)
    writer.start(timeout=10)
    try:
        asyncio.run(scenario(writer))
    finally:
        writer.stop()
        writer.close()
