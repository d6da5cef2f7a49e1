"""Where quotas come from: ZooKeeper in Kafka's layout and the TOML file, both
followed live, through a real proxy, real ZooKeeper, real Tansu and aiokafka."""
import json
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import (
    BackgroundProducer,
    kthrottle_quotas,
    metric,
    produce_quotas,
    wait_until,
)
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper")]

SLOW = 50_000  # bytes/s
FAST = 20_000_000


def alter(zk_hosts, client_id, rate):
    out = kthrottle_quotas("alter", "--zookeeper", zk_hosts, "--entity-type", "clients",
                           "--entity-name", client_id, "--add-config", "producer_byte_rate=%d" % rate)
    assert out.returncode == 0, out.stderr
    return time.monotonic()


def test_zookeeper_quotas_follow_changes_and_outlive_zookeeper(zookeeper, broker, tmp_path):
    chroot = "/kafka-%s" % uuid.uuid4().hex[:6]
    hosts = zookeeper.hosts + chroot
    client_id = "zk-producer"
    topic = "zk-%s" % uuid.uuid4().hex[:6]
    broker.create_topic(topic)
    alter(hosts, client_id, SLOW)

    admin = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--zookeeper", hosts, "--admin-listen", "127.0.0.1:%d" % admin])
    proxy.start()
    try:
        proxy.wait_for_log("quotas from ZooKeeper %s: 1 entities" % hosts)
        with BackgroundProducer(proxy.bootstrap, topic, client_id) as producer:
            time.sleep(4)
            conns = produce_quotas(admin, client_id)
            assert set(conns.values()) == {(SLOW, "clients/zk-producer")}
            t = time.monotonic()
            assert producer.rate(t - 2, t) < 2 * SLOW

            # raised in ZooKeeper: the live connection runs free within a second
            changed = alter(hosts, client_id, FAST)
            seen = wait_until(lambda: set(produce_quotas(admin, client_id).values())
                              == {(FAST, "clients/zk-producer")}, timeout=5, interval=0.02)
            assert seen and time.monotonic() - changed < 1.0
            time.sleep(2.0)
            assert producer.rate(changed + 1.0, changed + 2.0) > 20 * SLOW
            assert set(produce_quotas(admin, client_id)) == set(conns)  # same connections

            # lowered again, then ZooKeeper goes away: the last quotas stay in force
            alter(hosts, client_id, SLOW)
            time.sleep(1.5)
            zookeeper.stop()
            assert wait_until(lambda: metric(admin, "kthrottle_quota_source_healthy") == 0,
                              timeout=10)
            proxy.wait_for_log("the last known quotas stay in force")
            down = time.monotonic()
            time.sleep(3)
            assert producer.rate(down, down + 3) < 2 * SLOW
            assert set(produce_quotas(admin, client_id).values()) == {(SLOW, "clients/zk-producer")}

            # back: resynced, and changes flow again
            zookeeper.start()
            assert wait_until(lambda: metric(admin, "kthrottle_quota_source_healthy") == 1,
                              timeout=20)
            proxy.wait_for_log("ZooKeeper is back")
            changed = alter(hosts, client_id, FAST)
            assert wait_until(lambda: set(produce_quotas(admin, client_id).values())
                              == {(FAST, "clients/zk-producer")}, timeout=5, interval=0.02)
            assert time.monotonic() - changed < 1.0
            time.sleep(2.0)
            assert producer.rate(changed + 1.0, changed + 2.0) > 20 * SLOW
        assert producer.error is None
        assert proxy.alive()
    finally:
        proxy.stop()
        if zookeeper.proc is None:
            zookeeper.start()


def test_quotas_written_as_kafka_writes_them_are_enforced(zookeeper, broker, tmp_path):
    """Znodes and notifications in the JSON kafka-configs.sh --zookeeper writes
    (here by hand, no kthrottle code), SCRAM credentials beside the quotas."""
    from kazoo.client import KazooClient

    chroot = "/kafka-%s" % uuid.uuid4().hex[:6]
    zk = KazooClient(hosts=zookeeper.hosts + chroot)
    zk.start(timeout=10)
    try:
        zk.create("/config/users/CN%3Dalice%2COU%3Dteam/clients/app",
                  b'{"version":1,"config":{"producer_byte_rate":"1024"}}', makepath=True)
        zk.set("/config/users/CN%3Dalice%2COU%3Dteam",
               b'{"version":1,"config":{"SCRAM-SHA-256":"salt=c2FsdA==,stored_key=a2V5,'
               b'server_key=c2Vy,iterations=4096","consumer_byte_rate":"2048"}}')
        zk.create("/config/clients/<default>", b'{"version":1,"config":{"request_rate":"50.5"}}',
                  makepath=True)
        zk.create("/config/changes", makepath=True)

        out = kthrottle_quotas("describe", "--zookeeper", zookeeper.hosts + chroot)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [
            "Quotas for the default client-id are request_rate=50.5",
            "Quotas for user-principal 'CN=alice,OU=team' are consumer_byte_rate=2048",
            "Quotas for user-principal 'CN=alice,OU=team', client-id 'app' are "
            "producer_byte_rate=1024",
        ]

        # kthrottle's own alter keeps the SCRAM credentials in the user znode
        out = kthrottle_quotas("alter", "--zookeeper", zookeeper.hosts + chroot,
                               "--entity-type", "users", "--entity-name", "CN=alice,OU=team",
                               "--add-config", "producer_byte_rate=4096",
                               "--delete-config", "consumer_byte_rate")
        assert out.returncode == 0, out.stderr
        config = json.loads(zk.get("/config/users/CN%3Dalice%2COU%3Dteam")[0])
        assert config == {"version": 1, "config": {
            "SCRAM-SHA-256": "salt=c2FsdA==,stored_key=a2V5,server_key=c2Vy,iterations=4096",
            "producer_byte_rate": "4096"}}
        change = zk.get_children("/config/changes")
        assert len(change) == 1 and change[0].startswith("config_change_")
        assert json.loads(zk.get("/config/changes/" + change[0])[0]) == {
            "version": 2, "entity_path": "users/CN%3Dalice%2COU%3Dteam"}

        # a znode that is not Kafka's JSON is skipped and counted, the rest applies
        zk.create("/config/clients/junk", b"producer_byte_rate=1")

        # a proxy picks up a later change announced the way Kafka announces it
        admin = free_port()
        proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                             ["--zookeeper", zookeeper.hosts + chroot,
                              "--admin-listen", "127.0.0.1:%d" % admin])
        proxy.start()
        try:
            proxy.wait_for_log("3 entities")
            proxy.wait_for_log("znode /config/clients/junk does not hold Kafka's config JSON")
            assert metric(admin, "kthrottle_quota_source_rejected_total") == 1
            assert metric(admin, "kthrottle_quota_source_healthy") == 1
            zk.create("/config/clients/reports", b'{"version":1,"config":{"producer_byte_rate":"777000"}}')
            zk.create("/config/changes/config_change_", b'{"version":2,"entity_path":"clients/reports"}',
                      sequence=True)
            proxy.wait_for_log("quota change for clients/reports")
            topic = "kz-%s" % uuid.uuid4().hex[:6]
            broker.create_topic(topic)
            with BackgroundProducer(proxy.bootstrap, topic, "reports"):
                assert wait_until(lambda: set(produce_quotas(admin, "reports").values())
                                  == {(777000, "clients/reports")}, timeout=10)
        finally:
            proxy.stop()
    finally:
        zk.stop()
        zk.close()


def test_unreachable_zookeeper_is_a_clear_error(tmp_path):
    port = free_port()
    out = kthrottle_quotas("describe", "--zookeeper", "127.0.0.1:%d" % port)
    assert out.returncode == 1
    assert "cannot reach ZooKeeper at 127.0.0.1:%d" % port in out.stderr
    assert "Traceback" not in out.stderr


def test_quota_file_is_followed_and_a_broken_edit_keeps_the_last_quotas(broker, tmp_path):
    client_id = "file-producer"
    topic = "qf-%s" % uuid.uuid4().hex[:6]
    broker.create_topic(topic)
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text('[clients."%s"]\nproducer_byte_rate = %d\n' % (client_id, SLOW))
    admin = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--quota-file", str(quota_file), "--admin-listen", "127.0.0.1:%d" % admin])
    proxy.start()
    try:
        with BackgroundProducer(proxy.bootstrap, topic, client_id) as producer:
            time.sleep(3)
            conns = produce_quotas(admin, client_id)
            assert set(conns.values()) == {(SLOW, "clients/file-producer")}
            assert metric(admin, "kthrottle_quota_source_healthy") == 1
            assert metric(admin, "kthrottle_quota_source_rejected_total") == 0

            out = kthrottle_quotas("alter", "--quota-file", str(quota_file), "--entity-type",
                                   "clients", "--entity-name", client_id,
                                   "--add-config", "producer_byte_rate=%d" % FAST)
            assert out.returncode == 0, out.stderr
            changed = time.monotonic()
            assert wait_until(lambda: set(produce_quotas(admin, client_id).values())
                              == {(FAST, "clients/file-producer")}, timeout=5, interval=0.02)
            assert time.monotonic() - changed < 1.0
            time.sleep(2.0)
            assert producer.rate(changed + 1.0, changed + 2.0) > 20 * SLOW
            assert set(produce_quotas(admin, client_id)) == set(conns)

            quota_file.write_text('[clients."%s"]\nproducer_byte_rate = "fast"\n' % client_id)
            assert wait_until(lambda: metric(admin, "kthrottle_quota_source_healthy") == 0,
                              timeout=5)
            proxy.wait_for_log("producer_byte_rate must be a number, got 'fast'; "
                               "the last known quotas stay in force")
            assert set(produce_quotas(admin, client_id).values()) == {(FAST, "clients/file-producer")}
            assert metric(admin, "kthrottle_quota_source_rejected_total") == 1

            quota_file.write_text('[clients."%s"]\nproducer_byte_rate = %d\n' % (client_id, SLOW))
            assert wait_until(lambda: metric(admin, "kthrottle_quota_source_healthy") == 1,
                              timeout=5)
            assert set(produce_quotas(admin, client_id).values()) == {(SLOW, "clients/file-producer")}
        assert producer.error is None
    finally:
        proxy.stop()


@pytest.mark.parametrize("text,message", [
    ('[clients.a]\nproducer_byte_rate = -5\n', "[clients.\"a\"]: producer_byte_rate must be a "
                                               "positive finite number"),
    ('[clients.a]\nbyte_rate = 5\n', "unknown quota key 'byte_rate'"),
    ('[teams.a]\nx = 1\n', "unknown section 'teams'"),
    ('[groups.a]\nmembers = ["a"]\nproducer_byte_rate = 1\n',
     "a group member is User:<principal> or client-id:<client-id>"),
    ('[topics.a]\nrequest_rate = 1\n', "request_rate is not a quota of topic entities"),
    ('[clients.a\n', "is not valid TOML"),
    ('\n  \n', "is empty; to remove all quotas, write a file holding only a comment"),
])
def test_a_bad_quota_file_stops_the_proxy_with_a_clear_error(tmp_path, text, message):
    import subprocess
    import sys

    from kthrottle_testkit import ROOT

    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", "127.0.0.1:1",
         "--listen", "127.0.0.1:%d" % free_port(), "--quota-file", str(quota_file)],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1
    assert "kthrottle: error: quota file %s" % quota_file in out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr
