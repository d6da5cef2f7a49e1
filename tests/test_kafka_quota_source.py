"""``--quota-source kafka``: the quotas kept in the cluster, read with
DescribeClientQuotas on the proxy's event loop.

No KRaft cluster runs here and Tansu does not answer DescribeClientQuotas,
so the cluster that keeps the quotas is a kthrottle answering the admin API
from a quota file (``--admin-principals``), in front of a real Tansu broker;
the front proxy reads its quotas from it with ``--quota-source kafka``."""
import socket
import struct
import subprocess
import sys
import time
import warnings

import pytest

from kthrottle.config import build_config
from kthrottle.embedded import free_port
from kthrottle.options import ConfigError
from kthrottle.sources.kafka_quotas import snapshot_from_entries
from kthrottle_testkit import ROOT
from kthrottle_testkit.clients import BackgroundProducer, metric, produce_quotas, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

REFRESH = "0.5s"
CLIENT = "kq-app"


# what the cluster answers, as the proxy's snapshot (pure) ----------------------------

def test_entries_become_the_snapshot_and_what_is_not_enforced_is_left_out_with_why():
    snapshot, skipped = snapshot_from_entries([
        ([("user", "alice")], [("producer_byte_rate", 1024.0), ("request_percentage", 50.0)]),
        ([("user", None)], [("consumer_byte_rate", 2048.0)]),
        ([("user", "bob"), ("client-id", None)], [("producer_byte_rate", 10.0)]),
        ([("client-id", "a b")], [("request_rate", 5.0)]),
        ([("ip", "10.0.0.1")], [("connection_creation_rate", 3.0), ("observe_only", 1.0)]),
        ([("ip", None)], [("connection_creation_rate", 30.0), ("producer_byte_rate", 1.0)]),
        ([("ip", "not-an-address")], [("connection_creation_rate", 3.0)]),
        ([("user", "carol")], [("controller_mutation_rate", 1.5)]),
        # no Kafka cluster has topic entities; a kthrottle answering the admin API does
        ([("topic", "orders")], [("producer_byte_rate", 4096.0)]),
        ([("group", "g")], [("producer_byte_rate", 1.0)]),
        ([("ip", "10.0.0.2"), ("user", "u")], [("connection_creation_rate", 1.0)]),
    ])
    assert snapshot == {
        "users/alice": {"producer_byte_rate": 1024.0},
        "users/<default>": {"consumer_byte_rate": 2048.0},
        "users/bob/clients/<default>": {"producer_byte_rate": 10.0},
        "clients/a%20b": {"request_rate": 5.0},
        "ips/10.0.0.1": {"connection_creation_rate": 3.0, "observe_only": 1.0},
        "ips/<default>": {"connection_creation_rate": 30.0},
        "users/carol": {"controller_mutation_rate": 1.5},
        "topics/orders": {"producer_byte_rate": 4096.0},
    }
    assert skipped == {
        ("user 'alice'", "request_percentage", 50.0):
            "kthrottle does not enforce request_percentage (its request quota is request_rate, "
            "in requests per second)",
        ("default ip", "producer_byte_rate", 1.0):
            "producer_byte_rate is not a quota of ip entities",
        ("ip 'not-an-address'", "connection_creation_rate", 3.0):
            "not an ip address: 'not-an-address' (an IPv4 or IPv6 address, or <default>)",
        ("group 'g'", "producer_byte_rate", 1.0):
            "kthrottle enforces quotas of user, client-id, ip, topic entities, not of group",
        ("ip '10.0.0.2', user 'u'", "connection_creation_rate", 1.0):
            "no quota entity is ip + user: user and client-id go alone or together, "
            "ip and topic alone",
    }


# the options ------------------------------------------------------------------------

def config(**values):
    return build_config({}, dict(bootstrap_servers=[("127.0.0.1", 9092)], **values))


def test_the_quota_source_is_named_or_inferred_as_before():
    assert config(quota_file="q.toml").quota_source == "file"
    assert config(zookeeper="127.0.0.1:2181").quota_source == "zookeeper"
    assert config().quota_source is None
    kafka = config(quota_source="kafka", zookeeper="127.0.0.1:2181")
    assert (kafka.quota_source, kafka.quota_refresh) == ("kafka", 10.0)


@pytest.mark.parametrize("values, message", [
    (dict(quota_source="kafka", quota_file="q.toml"),
     "quota-source kafka reads the quotas kept in the cluster (DescribeClientQuotas): "
     "--quota-file is not read then; give one of them"),
    (dict(quota_source="file"), "quota-source file needs --quota-file PATH"),
    (dict(quota_source="zookeeper"), "quota-source zookeeper needs --zookeeper"),
    (dict(quota_source="cluster"), "quota-source must be one of file, zookeeper, kafka"),
    (dict(quota_source="kafka", quota_refresh=0), "quota-refresh must be a positive duration"),
    (dict(quota_source="kafka", security_protocol="SASL_PLAINTEXT", sasl_mode="passthrough"),
     "quota-source kafka: the proxy reads the quotas from the cluster as itself"),
])
def test_a_quota_source_that_cannot_work_is_a_configuration_error(values, message):
    with pytest.raises(ConfigError) as refused:
        config(**values)
    assert str(refused.value).startswith(message), refused.value


def test_quota_refresh_takes_a_duration_from_a_flag_and_from_toml(tmp_path):
    from kthrottle.cli import main

    toml = tmp_path / "proxy.toml"
    toml.write_text('[proxy]\nbootstrap-server = "127.0.0.1:9092"\nquota-source = "kafka"\n'
                    'quota-refresh = "250ms"\n')
    from kthrottle.config import load_toml

    assert load_toml(str(toml))["quota_refresh"] == 0.25
    with pytest.raises(SystemExit) as bad:
        main(["proxy", "--bootstrap-server", "127.0.0.1:9092", "--quota-refresh", "soon"])
    assert bad.value.code == 2


# against real processes ---------------------------------------------------------------

def front(broker_bootstrap, tmp_path, name, *extra):
    p = ProxyProcess(broker_bootstrap, tmp_path / ("%s.log" % name),
                     ["--quota-source", "kafka", "--quota-refresh", REFRESH, *extra])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
    return p


def test_a_cluster_without_describe_client_quotas_is_an_error_at_start(tansu_broker, tmp_path):
    broker = tansu_broker  # Tansu has no DescribeClientQuotas
    done = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", broker.bootstrap,
         "--listen", "127.0.0.1:%d" % free_port(), "--quota-source", "kafka"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0
    assert ("kthrottle: error: the cluster at %s over PLAINTEXT does not answer "
            "DescribeClientQuotas (KIP-546, Kafka 2.6 and later)" % broker.bootstrap
            in done.stderr), done.stderr


def upstream(broker, tmp_path, quota_file, port=None, node_port=None):
    """The stand-in for a KRaft cluster: a kthrottle answering the admin API
    from ``quota_file`` in front of Tansu (on ``port`` if given: again)."""
    p = ProxyProcess(broker.bootstrap, tmp_path / "upstream.log",
                     ["--quota-file", str(quota_file), "--admin-principals", "User:ANONYMOUS"])
    if port is not None:  # the same addresses as before (node N on node_port_base + N)
        offset = p.node_port - p.node_port_base
        p.port, p.node_port, p.node_port_base = port, node_port, node_port - offset
    return p


def admin_request(bootstrap, request, version):
    """Send one request built with kafka-python's codecs on a connection of
    its own; its decoded response."""
    host, port = bootstrap.rsplit(":", 1)
    request.with_header(correlation_id=7, client_id="kq-admin")
    data = bytes(request.encode(version=version, header=True, framed=True))
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        size = struct.unpack(">i", _read(s, 4))[0]
        body = _read(s, size)
    response = type(request).__name__.replace("Request", "Response")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import kafka.protocol.admin as admin
    return getattr(admin, response).decode(body, version=version, header=True)


def _read(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the connection closed"
        out += chunk
    return out


def quota_of(p, client_id):
    """The produce quota the front proxy holds the producer's connections to."""
    quotas = set(q for q, _ in produce_quotas(p.admin, client_id).values())
    return quotas.pop() if len(quotas) == 1 else None


def test_quotas_follow_the_cluster_and_stay_while_it_is_away(broker, tmp_path):
    """Start with the cluster down: no quotas, a WARNING; then its quotas
    within a refresh of it answering, and each change made there; while it
    is away the last stay in force, then it is read again."""
    topic = "kq-%d" % time.time_ns()
    broker.create_topic(topic, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."%s"]\nproducer_byte_rate = 200000\n' % CLIENT)
    up = upstream(broker, tmp_path, quotas)
    p = front(up.bootstrap, tmp_path, "front")
    try:
        p.start()
        p.wait_for_log("the proxy starts with no quotas and takes them on as soon as the "
                       "cluster answers")
        assert metric(p.admin, "kthrottle_quota_source_healthy") == 0
        up.start()
        p.wait_for_log("quotas read from the cluster at %s over PLAINTEXT again after"
                       % up.bootstrap, timeout=15)
        assert metric(p.admin, "kthrottle_quota_source_healthy") == 1
        with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
            assert wait_until(lambda: quota_of(p, CLIENT) == 200000, timeout=15)
            # a change made in the cluster: in force within a refresh or two
            quotas.write_text('[clients."%s"]\nproducer_byte_rate = 100000\n' % CLIENT)
            assert wait_until(lambda: quota_of(p, CLIENT) == 100000, timeout=5)
        assert producer.error is None

        # the cluster goes away: the last quotas stay, said once, and the metric shows it
        port, node_port = up.port, up.node_port
        up.stop()
        p.wait_for_log("the last known quotas stay in force, read again every 0.5s", timeout=15)
        assert metric(p.admin, "kthrottle_quota_source_healthy") == 0
        assert p.log().count("the last known quotas stay in force") == 1
        quotas.write_text('[clients."%s"]\nproducer_byte_rate = 50000\n' % CLIENT)
        up = upstream(broker, tmp_path, quotas, port, node_port)
        up.start()
        assert wait_until(lambda: metric(p.admin, "kthrottle_quota_source_healthy") == 1,
                          timeout=15)
        with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
            assert wait_until(lambda: quota_of(p, CLIENT) == 50000, timeout=15)
        assert p.alive()
    finally:
        p.stop()
        up.stop()


def test_an_alteration_sent_to_the_proxy_goes_to_the_cluster_and_is_in_force_at_once(
        broker, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka.protocol.admin import AlterClientQuotasRequest

    topic = "kq-%d" % time.time_ns()
    broker.create_topic(topic, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."%s"]\nproducer_byte_rate = 200000\n' % CLIENT)
    up = upstream(broker, tmp_path, quotas)
    # a refresh far away: only the proxy's own re-read can make the change show at once
    p = front(up.bootstrap, tmp_path, "front", "--admin-principals", "User:ANONYMOUS")
    p.extra_args[p.extra_args.index(REFRESH)] = "1h"
    try:
        up.start()
        p.start()
        with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
            assert wait_until(lambda: quota_of(p, CLIENT) == 200000, timeout=15)
            request = AlterClientQuotasRequest(
                entries=[AlterClientQuotasRequest.EntryData(
                    entity=[AlterClientQuotasRequest.EntryData.EntityData(
                        entity_type="client-id", entity_name=CLIENT)],
                    ops=[AlterClientQuotasRequest.EntryData.OpData(
                        key="producer_byte_rate", value=80000.0, remove=False)])],
                validate_only=False)
            response = admin_request(p.bootstrap, request, version=1)
            assert [e.error_code for e in response.entries] == [0]
            assert wait_until(lambda: quota_of(p, CLIENT) == 80000, timeout=3)
        assert producer.error is None
        assert "80000" in quotas.read_text()  # kept in the cluster, not in the front proxy
    finally:
        p.stop()
        up.stop()
