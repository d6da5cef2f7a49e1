"""ip and topic entities, controller_mutation_rate, connection_creation_rate and
observe_only in every quota source and writer: the quota file, ZooKeeper,
``kthrottle quotas`` and the proxy's admin API."""
import asyncio
import tomllib

import pytest

from kthrottle.policy.entities import (
    CONNECTION_CREATION_RATE,
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    DEFAULT,
    OBSERVE_ONLY,
    PRODUCER_BYTE_RATE,
)
from kthrottle.policy.quota_file import (
    QuotaFileError,
    altered,
    document_text,
    snapshot_from_document,
)
from kthrottle.policy.quotas import QuotaConfig
from kthrottle.sources.file import FileQuotaSource, FileQuotaStore

pytestmark = pytest.mark.integration

FILE = """
[users.alice]
controller_mutation_rate = 2.5
observe_only = true
[ips."<default>"]
connection_creation_rate = 10
[ips."10.0.0.1"]
connection_creation_rate = 100
[ips."0:0::1"]
connection_creation_rate = 7
[topics.orders]
producer_byte_rate = 1048576
observe_only = true
[topics."<default>"]
consumer_byte_rate = 2048
"""

SNAPSHOT = {
    "users/alice": {CONTROLLER_MUTATION_RATE: 2.5, OBSERVE_ONLY: 1.0},
    "ips/<default>": {CONNECTION_CREATION_RATE: 10.0},
    "ips/10.0.0.1": {CONNECTION_CREATION_RATE: 100.0},
    "ips/::1": {CONNECTION_CREATION_RATE: 7.0},
    "topics/orders": {PRODUCER_BYTE_RATE: 1048576.0, OBSERVE_ONLY: 1.0},
    "topics/<default>": {CONSUMER_BYTE_RATE: 2048.0},
}


# the quota file ----------------------------------------------------------------

def test_ip_and_topic_tables_and_observe_only_become_their_entities():
    snapshot = snapshot_from_document(tomllib.loads(FILE))
    assert snapshot == SNAPSHOT
    config = QuotaConfig(snapshot)
    assert config.has_ip_quotas and config.has_topic_quotas
    assert config.resolve_ip("10.0.0.1").limit == 100.0
    assert config.resolve_ip("10.0.0.2").entity == "ips/<default>"
    assert config.resolve_ip("::1").limit == 7.0
    orders = config.resolve_topic("orders", PRODUCER_BYTE_RATE)
    assert orders.limit == 1048576.0 and orders.observe_only
    assert not config.resolve_topic("payments", CONSUMER_BYTE_RATE).observe_only
    mutation = config.resolve("alice", "app", CONTROLLER_MUTATION_RATE)
    assert mutation.limit == 2.5 and mutation.observe_only


def test_the_new_entities_are_written_and_read_back_alike():
    text = document_text(SNAPSHOT)
    assert snapshot_from_document(tomllib.loads(text)) == SNAPSHOT
    assert '[topics.orders]\nproducer_byte_rate = 1048576\nobserve_only = true\n' in text
    # users, then ips, then topics; <default> after the named ones
    assert (text.index("[users.alice]") < text.index('[ips."10.0.0.1"]')
            < text.index('[ips."<default>"]') < text.index("[topics.orders]")
            < text.index('[topics."<default>"]'))


@pytest.mark.parametrize("text,message", [
    ('[ips."10.0.0.1"]\nproducer_byte_rate = 1\n',
     '[ips."10.0.0.1"]: producer_byte_rate is not a quota of ip entities'),
    ("[topics.orders]\nconnection_creation_rate = 1\n",
     "connection_creation_rate is not a quota of topic entities"),
    ("[topics.orders]\nrequest_rate = 1\n", "request_rate is not a quota of topic entities"),
    ("[users.a]\nconnection_creation_rate = 1\n",
     "connection_creation_rate is not a quota of client entities"),
    ('[ips."host.example"]\nconnection_creation_rate = 1\n', "not an ip address"),
    ('[topics."a/b"]\nproducer_byte_rate = 1\n', "not a topic name"),
    ('[ips."::1"]\nconnection_creation_rate = 1\n[ips."0::1"]\nconnection_creation_rate = 2\n',
     "the same entity as another table (ips/::1)"),
    ("[topics.orders]\nobserve_only = \"maybe\"\n", "observe_only must be true or false"),
    ("[topics.orders.clients.x]\nproducer_byte_rate = 1\n", "unexpected table 'clients'"),
    ("ips = 1\n", "[ips] must be a table"),
])
def test_bad_entity_tables_name_the_place_and_the_reason(text, message):
    with pytest.raises(QuotaFileError) as err:
        snapshot_from_document(tomllib.loads(text))
    assert message in str(err.value)


def test_altered_checks_keys_per_kind_and_false_observe_only_clears_it():
    config = {PRODUCER_BYTE_RATE: 10.0, OBSERVE_ONLY: 1.0}
    assert altered(config, {OBSERVE_ONLY: "false"}, path="topics/t") == {PRODUCER_BYTE_RATE: 10.0}
    assert altered(config, {}, [OBSERVE_ONLY], path="topics/t") == {PRODUCER_BYTE_RATE: 10.0}
    assert altered({}, {OBSERVE_ONLY: "true"}, path="ips/<default>") == {OBSERVE_ONLY: 1.0}
    with pytest.raises(ValueError, match="not a quota of ip entities"):
        altered({}, {CONSUMER_BYTE_RATE: 1}, path="ips/<default>")
    with pytest.raises(ValueError, match="not a quota of client entities"):
        altered({}, {CONNECTION_CREATION_RATE: 1}, path="clients/x")


def test_a_file_alteration_of_ips_and_topics_keeps_the_rest(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text('# ops\n[users.alice] # the team\nproducer_byte_rate = 5\n\n'
                    '# addresses\n[ips."<default>"]\nconnection_creation_rate = 10\n')
    store = FileQuotaStore(path)
    assert store.alter("ips/10.0.0.1", {CONNECTION_CREATION_RATE: "3"}) == {
        CONNECTION_CREATION_RATE: 3.0}
    store.alter("topics/orders", {PRODUCER_BYTE_RATE: 100, OBSERVE_ONLY: "true"})
    store.alter("users/alice", {OBSERVE_ONLY: True})
    text = path.read_text()
    assert text.startswith('# ops\n[users.alice] # the team\nproducer_byte_rate = 5\n'
                           'observe_only = true\n\n# addresses\n[ips."<default>"]\n')
    assert '[ips."10.0.0.1"]\nconnection_creation_rate = 3\n' in text
    assert "[topics.orders]\nproducer_byte_rate = 100\nobserve_only = true\n" in text
    store.alter("topics/orders", {}, [OBSERVE_ONLY])
    store.alter("ips/<default>", {}, [CONNECTION_CREATION_RATE])
    assert store.read() == {"users/alice": {PRODUCER_BYTE_RATE: 5.0, OBSERVE_ONLY: 1.0},
                            "ips/10.0.0.1": {CONNECTION_CREATION_RATE: 3.0},
                            "topics/orders": {PRODUCER_BYTE_RATE: 100.0}}
    assert "# addresses" in path.read_text()  # its table is gone, the comment stays
    before = path.read_text()
    with pytest.raises(ValueError, match="not a quota of topic entities"):
        store.alter("topics/orders", {CONNECTION_CREATION_RATE: 1})
    assert path.read_text() == before


def test_the_followed_file_hands_over_ip_and_topic_changes(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text(FILE)

    async def main():
        source = FileQuotaSource(path, poll_interval=0.02)
        seen = []
        await source.start(seen.append)
        try:
            assert seen[-1] == SNAPSHOT
            path.write_text(FILE.replace("connection_creation_rate = 10", "observe_only = 1\n"
                                         "connection_creation_rate = 20"))
            for _ in range(200):
                if len(seen) > 1:
                    break
                await asyncio.sleep(0.02)
            assert seen[-1]["ips/<default>"] == {OBSERVE_ONLY: 1.0, CONNECTION_CREATION_RATE: 20.0}
            path.write_text(FILE + '[ips."10.0.0.1".x]\n')  # refused: the last one stays
            for _ in range(200):
                if source.rejected:
                    break
                await asyncio.sleep(0.02)
            assert source.rejected == 1 and not source.healthy and len(seen) == 2
        finally:
            await source.stop()

    asyncio.run(main())


# ZooKeeper -----------------------------------------------------------------------

import json  # noqa: E402
import logging  # noqa: E402
import uuid  # noqa: E402

from kthrottle_testkit import zookeeper as zk_server  # noqa: E402
from test_sources import Updates, until  # noqa: E402

from kthrottle.sources.zookeeper import ZooKeeperQuotaSource, ZooKeeperQuotaStore  # noqa: E402

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="scripts/test installs ZooKeeper")


def _znode(config):
    return json.dumps({"version": 1, "config": config}).encode()


def _notify(zk, path, changes="/config/changes"):
    zk.create(changes + "/config_change_", json.dumps(
        {"version": 2, "entity_path": path}).encode(), sequence=True, makepath=True)


@pytest.fixture
def zk_chroot(zookeeper):
    """(hosts with a chroot of the test's own, a kazoo client on it)."""
    from kazoo.client import KazooClient

    hosts = zookeeper.hosts + "/kthrottle-%s" % uuid.uuid4().hex[:8]
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    zk.ensure_path("/")
    yield hosts, zk
    zk.stop()
    zk.close()


@needs_zookeeper
def test_zookeeper_ips_as_kafka_keeps_them_and_topics_in_kthrottles_own_znodes(
        zk_chroot, caplog):
    hosts, zk = zk_chroot
    caplog.set_level(logging.INFO, logger="kthrottle.quotas")
    # as kafka-configs --zookeeper writes them: the address as given
    zk.create("/config/ips/<default>", _znode({"connection_creation_rate": "10"}), makepath=True)
    zk.create("/config/ips/0:0::1", _znode({"connection_creation_rate": "7",
                                             "observe_only": "true"}))
    zk.create("/config/ips/not-an-ip", _znode({"connection_creation_rate": "1"}))
    zk.create("/config/users/alice", _znode({"controller_mutation_rate": "2.5",
                                             "connection_creation_rate": "3"}), makepath=True)
    zk.create("/kthrottle/config/topics/orders", _znode({"producer_byte_rate": "1048576"}),
              makepath=True)
    # a ZooKeeper-mode broker's topic config: not a quota
    zk.create("/config/topics/orders", _znode({"retention.ms": "1000"}), makepath=True)
    expected = {"ips/<default>": {CONNECTION_CREATION_RATE: 10.0},
                "ips/::1": {CONNECTION_CREATION_RATE: 7.0, OBSERVE_ONLY: 1.0},
                "users/alice": {CONTROLLER_MUTATION_RATE: 2.5},
                "topics/orders": {PRODUCER_BYTE_RATE: 1048576.0}}

    store = ZooKeeperQuotaStore(hosts).connect()
    try:
        assert store.read() == expected
    finally:
        store.close()

    async def scenario():
        updates = Updates()
        source = ZooKeeperQuotaSource(hosts)
        await source.start(updates)
        try:
            assert updates.last == expected
            # the ip that is no address and the byte rate a user cannot hold: skipped, counted
            assert source.rejected == 2 and source.healthy
            messages = [r.getMessage() for r in caplog.records]
            assert any("ignoring /config/ips/not-an-ip: not an ip address" in m for m in messages)
            assert any("ignoring connection_creation_rate in /config/users/alice: "
                       "connection_creation_rate is not a quota of client entities" in m
                       for m in messages)

            # a Kafka change notification for an ip, as kafka-configs writes it
            zk.create("/config/ips/10.0.0.1", _znode({"connection_creation_rate": "100"}))
            _notify(zk, "ips/10.0.0.1")
            await until(lambda: "ips/10.0.0.1" in updates.last, what="the ip change")
            # a topic config change in Kafka's notifications is not a quota change
            n = len(updates.snapshots)
            zk.set("/kthrottle/config/topics/orders", _znode({"producer_byte_rate": "5"}))
            _notify(zk, "topics/orders")
            # kthrottle's own notification is
            zk.create("/kthrottle/config/topics/<default>", _znode({"consumer_byte_rate": "9"}))
            _notify(zk, "topics/<default>", "/kthrottle/config/changes")
            await until(lambda: "topics/<default>" in updates.last, what="the topic change")
            assert updates.last["topics/orders"] == {PRODUCER_BYTE_RATE: 1048576.0}
            assert len(updates.snapshots) == n + 1
            _notify(zk, "topics/orders", "/kthrottle/config/changes")
            await until(lambda: updates.last["topics/orders"] == {PRODUCER_BYTE_RATE: 5.0},
                        what="the orders change")
        finally:
            await source.stop()

    asyncio.run(scenario())


@needs_zookeeper
def test_the_zookeeper_store_writes_ips_for_kafka_and_topics_apart(zk_chroot):
    hosts, zk = zk_chroot
    store = ZooKeeperQuotaStore(hosts).connect()
    try:
        assert store.alter("ips/0:0::1", {CONNECTION_CREATION_RATE: "5", OBSERVE_ONLY: "1"}) == {
            CONNECTION_CREATION_RATE: 5.0, OBSERVE_ONLY: 1.0}
        assert store.alter("topics/orders", {CONSUMER_BYTE_RATE: 2048}) == {
            CONSUMER_BYTE_RATE: 2048.0}
        with pytest.raises(ValueError, match="not a quota of topic entities"):
            store.alter("topics/orders", {CONTROLLER_MUTATION_RATE: 1})
        with pytest.raises(ValueError, match="not an ip address"):
            store.alter("ips/nowhere", {CONNECTION_CREATION_RATE: 1})
        assert store.read() == {"ips/::1": {CONNECTION_CREATION_RATE: 5.0, OBSERVE_ONLY: 1.0},
                                "topics/orders": {CONSUMER_BYTE_RATE: 2048.0}}
        store.alter("ips/::1", {OBSERVE_ONLY: "false"})
    finally:
        store.close()
    # Kafka's layout for the ip (canonical address), its values as strings
    assert json.loads(zk.get("/config/ips/::1")[0]) == {
        "version": 1, "config": {"connection_creation_rate": "5"}}
    assert json.loads(zk.get("/kthrottle/config/topics/orders")[0]) == {
        "version": 1, "config": {"consumer_byte_rate": "2048"}}
    assert not zk.exists("/config/topics")
    kafka = [json.loads(zk.get("/config/changes/" + c)[0])["entity_path"]
             for c in sorted(zk.get_children("/config/changes"))]
    own = [json.loads(zk.get("/kthrottle/config/changes/" + c)[0])["entity_path"]
           for c in sorted(zk.get_children("/kthrottle/config/changes"))]
    assert kafka == ["ips/::1", "ips/::1"] and own == ["topics/orders"]


# kthrottle quotas: every entity type, against ZooKeeper and the admin API -----------

from kthrottle_testkit.clients import kthrottle_quotas  # noqa: E402
from kthrottle_testkit.proxy import ProxyProcess  # noqa: E402


def _ok(*args):
    out = kthrottle_quotas(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_zookeeper
def test_the_quotas_command_sets_ips_and_topics_in_zookeeper(zk_chroot):
    hosts, zk = zk_chroot
    where = ("--zookeeper", hosts)
    assert _ok("alter", *where, "--entity-type", "ips", "--entity-default", "--add-config",
               "connection_creation_rate=10") == (
        "Completed updating quotas for the default ip: connection_creation_rate=10.\n")
    _ok("alter", *where, "--entity-type", "topics", "--entity-name", "orders",
        "--add-config", "producer_byte_rate=1048576", "--observe-only")
    _ok("alter", *where, "--entity-type", "users", "--entity-name", "alice",
        "--entity-type", "clients", "--entity-default", "--add-config",
        "controller_mutation_rate=2")
    assert json.loads(zk.get("/config/ips/<default>")[0])["config"] == {
        "connection_creation_rate": "10"}
    assert json.loads(zk.get("/kthrottle/config/topics/orders")[0])["config"] == {
        "producer_byte_rate": "1048576", "observe_only": "true"}
    assert _ok("describe", *where) == (
        "Quotas for user-principal 'alice', the default client-id are "
        "controller_mutation_rate=2\n"
        "Quotas for the default ip are connection_creation_rate=10\n"
        "Quotas for topic 'orders' are producer_byte_rate=1048576,observe_only=true\n")
    assert _ok("describe", *where, "--entity-type", "topics") == (
        "Quotas for topic 'orders' are producer_byte_rate=1048576,observe_only=true\n")
    _ok("alter", *where, "--entity-type", "topics", "--entity-name", "orders", "--enforce")
    _ok("delete", *where, "--entity-type", "ips", "--entity-default")
    assert _ok("describe", *where, "--entity-type", "ips") == (
        "No quotas configured for that entity.\n")
    assert json.loads(zk.get("/kthrottle/config/topics/orders")[0])["config"] == {
        "producer_byte_rate": "1048576"}
    for args, message in (
            (["--entity-type", "ips", "--entity-name", "10.0.0.1", "--add-config",
              "producer_byte_rate=1"], "producer_byte_rate is not a quota of ip entities"),
            (["--entity-type", "ips", "--entity-name", "host", "--add-config",
              "connection_creation_rate=1"], "not an ip address: 'host'"),
            (["--entity-type", "ips", "--entity-name", "10.0.0.1", "--entity-type", "users",
              "--entity-name", "u", "--add-config", "connection_creation_rate=1"],
             "or ips or topics alone"),
            (["--entity-type", "topics", "--entity-name", "t", "--observe-only",
              "--add-config", "observe_only=false"], "--observe-only and --enforce set"),
            (["--entity-type", "topics", "--entity-name", "t", "--observe-only", "--enforce"],
             "not allowed with argument")):
        out = kthrottle_quotas("alter", *where, *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


@pytest.fixture
def admin_proxy(broker, tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("# the operators' file\n[users.alice]\nproducer_byte_rate = 1000\n")
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--quota-file", str(quotas), "--admin-principals", "User:ANONYMOUS"])
    proxy.quota_file = quotas
    proxy.start()
    yield proxy
    proxy.stop()


def test_the_quotas_command_sets_every_entity_type_through_a_proxys_admin_api(admin_proxy):
    where = ("--bootstrap-server", admin_proxy.bootstrap)
    assert _ok("alter", *where, "--entity-type", "ips", "--entity-name", "10.0.0.1",
               "--add-config", "connection_creation_rate=5", "--observe-only") == (
        "Completed updating quotas for ip '10.0.0.1': "
        "connection_creation_rate=5,observe_only=true.\n")
    _ok("alter", *where, "--entity-type", "ips", "--entity-default", "--add-config",
        "connection_creation_rate=20")
    assert _ok("alter", *where, "--entity-type", "topics", "--entity-name", "orders",
               "--add-config", "producer_byte_rate=1048576,consumer_byte_rate=2097152") == (
        "Completed updating quotas for topic 'orders': "
        "producer_byte_rate=1048576,consumer_byte_rate=2097152.\n")
    _ok("alter", *where, "--entity-type", "users", "--entity-name", "alice",
        "--add-config", "controller_mutation_rate=2.5", "--observe-only")
    # what the proxy holds now, as the proxy describes it
    assert _ok("describe", *where) == (
        "Quotas for user-principal 'alice' are "
        "producer_byte_rate=1000,controller_mutation_rate=2.5,observe_only=true\n"
        "Quotas for ip '10.0.0.1' are connection_creation_rate=5,observe_only=true\n"
        "Quotas for the default ip are connection_creation_rate=20\n"
        "Quotas for topic 'orders' are producer_byte_rate=1048576,consumer_byte_rate=2097152\n")
    assert _ok("describe", *where, "--entity-type", "ips", "--entity-default") == (
        "Quotas for the default ip are connection_creation_rate=20\n")
    _ok("alter", *where, "--entity-type", "users", "--entity-name", "alice", "--enforce")
    _ok("delete", *where, "--entity-type", "ips", "--entity-name", "10.0.0.1")
    # kept in the proxy's quota file, the operators' comment with them
    with open(admin_proxy.quota_file, "rb") as f:
        assert snapshot_from_document(tomllib.load(f)) == {
            "users/alice": {PRODUCER_BYTE_RATE: 1000.0, CONTROLLER_MUTATION_RATE: 2.5},
            "ips/<default>": {CONNECTION_CREATION_RATE: 20.0},
            "topics/orders": {PRODUCER_BYTE_RATE: 1048576.0, CONSUMER_BYTE_RATE: 2097152.0}}
    assert admin_proxy.quota_file.read_text().startswith("# the operators' file\n")
    # a cluster the command cannot reach: a clear error, nothing else
    from kthrottle.embedded import free_port

    out = kthrottle_quotas("describe", "--bootstrap-server", "127.0.0.1:%d" % free_port())
    assert out.returncode == 1 and "cannot reach the admin API at 127.0.0.1:" in out.stderr


def test_one_bad_admin_api_entry_gets_its_own_error_and_the_others_apply(admin_proxy):
    from test_admin_api import Kafka, alter, describe

    with Kafka(admin_proxy.bootstrap) as conn:
        results = alter(conn, 1, [
            ((("ip", None),), {"connection_creation_rate": 7.0}),
            ((("ip", "10.0.0.999"),), {"connection_creation_rate": 7.0}),
            ((("topic", "orders"),), {"producer_byte_rate": 4096.0, "observe_only": 1.0}),
            ((("topic", "orders!"),), {"producer_byte_rate": 1.0}),
            ((("ip", "10.0.0.2"),), {"producer_byte_rate": 1.0}),
            ((("ip", "10.0.0.3"),), {"connection_creation_rate": 1.5}),
            ((("user", "bob"),), {"controller_mutation_rate": 0.5, "observe_only": 2.0}),
            ((("user", "carol"),), {"controller_mutation_rate": 0.5}),
        ])
        assert [(code, (message or "").split(" (")[0]) for _, code, message in results] == [
            (0, ""),
            (42, "not an ip address: '10.0.0.999'"),
            (0, ""),
            (42, "not a topic name: 'orders!'"),
            (42, "producer_byte_rate is not a quota of ip entities"),
            (42, "Configuration connection_creation_rate must be a Integer value"),
            (42, "observe_only must be 1"),
            (0, ""),
        ]
        assert describe(conn, 1, [("ip", 2, None)]) == {
            (("ip", None),): {"connection_creation_rate": 7.0}}
        assert describe(conn, 1, [("topic", 0, "orders")], strict=True) == {
            (("topic", "orders"),): {"producer_byte_rate": 4096.0, "observe_only": 1.0}}
        assert describe(conn, 1, [("user", 2, None)], strict=True) == {
            (("user", "alice"),): {"producer_byte_rate": 1000.0},
            (("user", "carol"),): {"controller_mutation_rate": 0.5}}
        # observe_only 0 clears it
        assert alter(conn, 1, [((("topic", "orders"),), {"observe_only": 0.0})])[0][1] == 0
        assert describe(conn, 1, [("topic", 0, "orders")], strict=True) == {
            (("topic", "orders"),): {"producer_byte_rate": 4096.0}}


@needs_zookeeper
def test_a_zookeeper_proxys_admin_api_writes_ips_for_kafka_and_topics_apart(
        broker, zk_chroot, tmp_path):
    hosts, zk = zk_chroot
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--zookeeper", hosts, "--admin-principals", "User:ANONYMOUS"])
    proxy.start()
    try:
        where = ("--bootstrap-server", proxy.bootstrap)
        _ok("alter", *where, "--entity-type", "ips", "--entity-name", "0:0::1",
            "--add-config", "connection_creation_rate=3")
        _ok("alter", *where, "--entity-type", "topics", "--entity-default",
            "--add-config", "consumer_byte_rate=4096", "--observe-only")
        # in force on the proxy at once (described from its quotas in force)
        assert _ok("describe", *where) == (
            "Quotas for ip '::1' are connection_creation_rate=3\n"
            "Quotas for the default topic are consumer_byte_rate=4096,observe_only=true\n")
    finally:
        proxy.stop()
    assert json.loads(zk.get("/config/ips/::1")[0])["config"] == {
        "connection_creation_rate": "3"}
    assert json.loads(zk.get("/kthrottle/config/topics/<default>")[0])["config"] == {
        "consumer_byte_rate": "4096", "observe_only": "true"}
    kafka = [json.loads(zk.get("/config/changes/" + c)[0])["entity_path"]
             for c in zk.get_children("/config/changes")]
    assert kafka == ["ips/::1"]
