"""Fleet-wide quotas end to end, every part real: two kthrottle proxies in
front of one Tansu broker, a client-id quota Q in ZooKeeper, a producer with
that client-id writing as fast as it is let through each proxy, and
``kthrottle spark-sync`` (PySpark, local mode) computing the proxies' shares
from their usage reports."""
import time
import uuid

import pytest

from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import BackgroundProducer, kthrottle_quotas
from kthrottle_testkit.proxy import ProxyProcess
from test_storage_end_to_end import Process

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper")]
pytest.importorskip("pyspark", reason="scripts/test installs PySpark")

@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: the Spark job reads the usage reports of every earlier test."""
    return own_kafka


Q = 200_000  # bytes/s for the client-id, fleet-wide
CYCLE = 3.0  # the job's interval, seconds


def total_rate(producers, seconds):
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    return [p.rate(t0, t1) for p in producers]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError("%s did not happen within %.0f s" % (what, timeout))


def test_two_proxies_hold_one_quota_together_and_follow_demand(broker, zookeeper, tmp_path):
    from kazoo.client import KazooClient

    chroot = "/fleet-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    zk = KazooClient(hosts=zookeeper.hosts)
    zk.start(timeout=10)
    zk.ensure_path(chroot)
    done = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "clients",
                            "--entity-name", "fleet-app", "--add-config",
                            "producer_byte_rate=%d" % Q)
    assert done.returncode == 0, done.stderr
    topic = "fleet-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    usage = "__kthrottle_proxy_usage"
    proxies = [ProxyProcess(broker.bootstrap, tmp_path / ("proxy-%s.log" % name),
                            ["--zookeeper", hosts, "--proxy-id", name, "--usage-interval", "1000",
                             "--share-max-age-ms", "8000"]).start() for name in ("a", "b")]
    job = None
    try:
        with BackgroundProducer(proxies[0].bootstrap, topic, "fleet-app") as pa, \
                BackgroundProducer(proxies[1].bootstrap, topic, "fleet-app") as pb:
            time.sleep(4)
            alone = total_rate([pa, pb], 6)
            # each proxy enforces Q by itself: about 2Q in all
            assert sum(alone) > 1.5 * Q, alone

            job = Process(["spark-sync", "--bootstrap-server", broker.bootstrap, "--zookeeper",
                           hosts, "--master", "local[2]", "--interval", "%gs" % CYCLE,
                           "--usage-topic", usage, "--usage-freshness", "10s",
                           "--state-dir", str(tmp_path / "job-state")],
                          tmp_path / "job.log")

            def shares_written():
                return all(zk.exists(chroot + "/kthrottle/cluster-state/shares/" + p)
                           for p in ("a", "b"))

            wait_for(shares_written, 120, "the first shares")
            first = time.monotonic()
            time.sleep(3 * CYCLE)  # three cycles
            shared = total_rate([pa, pb], 6)
            settled_after = time.monotonic() - first
            assert 0.9 * Q < sum(shared) < 1.1 * Q, (shared, Q)  # within 10% of Q
            # one producer stops: within three cycles the other gets close to all of Q
            pb.__exit__(None, None, None)
            time.sleep(3 * CYCLE + 2)
            (alone_now,) = total_rate([pa], 6)
            assert alone_now > 0.75 * Q, (alone_now, Q)
            # the job stops: the shares age and the fail-safe (the last shares) applies
            said = [p.log().count("the fail-safe applies") for p in proxies]
            job.stop()
            for p, before in zip(proxies, said):
                wait_for(lambda: p.log().count("the fail-safe applies") > before, 30,
                         "the fail-safe on proxy %s" % p.log_path.name)
            print("fleet: alone %s, shared %s (settled within %.0f s), one left %.0f"
                  % ([round(r) for r in alone], [round(r) for r in shared], settled_after,
                     alone_now))
        for p in proxies:
            assert p.alive()
    finally:
        if job is not None:
            job.stop()
        for p in proxies:
            p.stop()
        zk.stop()
        zk.close()
