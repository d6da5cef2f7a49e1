"""SNI routing: one TLS port for the whole cluster, each connection sent to the
broker its TLS server name names (--sni-broker-pattern
'broker-$(nodeId).kafka.example.com'). Real clients, aiokafka and
confluent-kafka (librdkafka), produce and consume through a kthrottle process
in front of a real Apache Kafka broker (node id 111), resolving
broker-111.kafka.example.com and the bootstrap name kafka.example.com to
127.0.0.1: each client runs in a mount namespace of its own (unshare -m) whose
/etc/hosts is a file of the test's, since librdkafka resolves with
getaddrinfo. Certificates from trustme: SAN *.kafka.example.com and
kafka.example.com."""
import json
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import urllib.request
import uuid

import pytest
import trustme

from kthrottle.codecs.proxy_protocol import v1_header, v2_header
from kthrottle.config import ConfigError, ProxyConfig
from kthrottle.embedded import free_port
from kthrottle.proxy.addressing import SniPattern
from kthrottle_testkit import BROKER_NODE_ID
from test_node_ports import MappedProxy

pytestmark = pytest.mark.integration

PATTERN = "broker-$(nodeId).kafka.example.com"
BOOTSTRAP_NAME = "kafka.example.com"
NAMES = [BOOTSTRAP_NAME, "broker-%d.kafka.example.com" % BROKER_NODE_ID,
         "broker-7.kafka.example.com"]


# the pattern -------------------------------------------------------------------------

def test_the_pattern_gives_each_node_a_name_and_reads_the_node_back_from_one():
    sni = SniPattern(PATTERN)
    assert sni.host(111) == "broker-111.kafka.example.com" and sni.port is None
    assert sni.host(2147483647) == "broker-2147483647.kafka.example.com"
    assert sni.node_id("broker-111.kafka.example.com") == 111
    assert sni.node_id("BROKER-111.Kafka.Example.COM") == 111  # host names ignore case
    assert sni.node_id("broker-0.kafka.example.com") == 0
    for other in ("kafka.example.com", "broker-0111.kafka.example.com", "broker-.kafka.example.com",
                  "broker-1x.kafka.example.com", "broker-111.kafka.example.com.evil",
                  "xbroker-111.kafka.example.com", "broker-99999999999.kafka.example.com",
                  "broker-111-kafka.example.com", "", None):
        assert sni.node_id(other) is None, other  # the bootstrap's
    assert SniPattern("$(nodeId).brokers.example.com:443").port == 443
    assert SniPattern("$(nodeId).brokers.example.com:443").host(5) == "5.brokers.example.com"


@pytest.mark.parametrize("pattern, says", [
    ("broker.kafka.example.com", "must contain $(nodeId) exactly once"),
    ("b-$(nodeId)-$(nodeId).example.com", "must contain $(nodeId) exactly once"),
    ("broker-$(nodeId).kafka_example.com", "is not a host name pattern"),
    ("broker-$(nodeId)..example.com", "is not a host name pattern"),
    ("-$(nodeId).example.com", "is not a host name pattern"),
    ("broker-$(nodeId).example.com:0", "must be a port, 1-65535"),
    ("broker-$(nodeId).example.com:https", "must be a port, 1-65535"),
    ("", "must be a host name pattern"),
])
def test_a_pattern_that_cannot_name_brokers_is_refused(pattern, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        ProxyConfig(bootstrap_servers=[("k", 9092)], security_protocol="SSL", ssl_cert="c",
                    ssl_key="k", sni_broker_pattern=_checked(pattern)).validate()


def _checked(pattern):
    from kthrottle.config import parse_sni_pattern

    return parse_sni_pattern(pattern)


@pytest.mark.parametrize("settings, says", [
    ({}, "it needs a TLS listener, --security-protocol SSL or SASL_SSL (got PLAINTEXT)"),
    ({"security_protocol": "SASL_PLAINTEXT", "credentials_file": "c"}, "(got SASL_PLAINTEXT)"),
    ({"security_protocol": "SSL", "ssl_cert": "c", "ssl_key": "k", "node_port_base": 30000},
     "node-ports and node-port-base do not apply with it"),
    ({"security_protocol": "SSL", "ssl_cert": "c", "ssl_key": "k", "node_ports": {1: 30001}},
     "node-ports and node-port-base do not apply with it"),
])
def test_sni_routing_needs_a_tls_listener_and_no_node_ports(settings, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        ProxyConfig(bootstrap_servers=[("k", 9092)], sni_broker_pattern=PATTERN,
                    **settings).validate()
    for protocol in ("SSL", "SASL_SSL"):  # both TLS listeners take it
        config = ProxyConfig(bootstrap_servers=[("k", 9092)], sni_broker_pattern=PATTERN,
                             security_protocol=protocol, ssl_cert="c", ssl_key="k",
                             credentials_file="c" if protocol == "SASL_SSL" else None).validate()
        assert config.effective_node_port_base is None


# a kthrottle process, and clients that resolve the names ---------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sni-pki")
    ca = trustme.CA()
    ca_file, pem = tmp / "ca.pem", tmp / "server.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ca.issue_cert("*.kafka.example.com", BOOTSTRAP_NAME).private_key_and_cert_chain_pem \
        .write_to_path(str(pem))
    hosts = tmp / "hosts"
    with open("/etc/hosts") as f:
        hosts.write_text(f.read() + "\n127.0.0.1 %s\n" % " ".join(NAMES))
    return {"ca": str(ca_file), "pem": str(pem), "hosts": str(hosts), "tmp": tmp}


@pytest.fixture(scope="module")
def sni_proxy(broker, pki):
    admin = free_port()
    p = MappedProxy(broker.bootstrap, pki["tmp"] / "proxy.log",
                    ["--security-protocol", "SSL", "--ssl-cert", pki["pem"], "--ssl-key",
                     pki["pem"], "--sni-broker-pattern", PATTERN,
                     "--admin-listen", "127.0.0.1:%d" % admin]).start()
    p.admin = admin
    yield p
    p.stop()


def _isolated(pki, *argv, timeout=120):
    """Run ``argv`` with /etc/hosts replaced by the test's, in a mount
    namespace of its own (nothing outside it sees the change)."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to give the clients a hosts file of their "
                    "own: librdkafka resolves broker-111.kafka.example.com with getaddrinfo")
    command = "mount --bind %s /etc/hosts || exit 97; exec %s" % (
        pki["hosts"], " ".join("'%s'" % a for a in argv))
    out = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode == 97 or out.stderr.startswith("unshare:"):
        pytest.fail("cannot give a client its own /etc/hosts with 'unshare -m' and a bind mount "
                    "(needs root, or 'unshare -rm' with user namespaces): %s" % out.stderr.strip())
    return out


def test_the_clients_resolve_the_names_to_127_0_0_1(pki):
    out = _isolated(pki, "getent", "hosts", "broker-%d.kafka.example.com" % BROKER_NODE_ID)
    assert out.returncode == 0 and out.stdout.split()[0] == "127.0.0.1", (
        "cannot give a client its own /etc/hosts with 'unshare -m' (needs root or user "
        "namespaces, and a mount of /etc/hosts): %s %s" % (out.stdout, out.stderr))


CLIENT = textwrap.dedent('''
    import asyncio, json, sys, time
    library, bootstrap, ca, topic = sys.argv[1:5]
    N = 20
    if library == "aiokafka":
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.helpers import create_ssl_context

        async def main():
            tls = dict(security_protocol="SSL", ssl_context=create_ssl_context(cafile=ca))
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **tls)
            await producer.start()
            try:
                for i in range(N):
                    await producer.send_and_wait(topic, b"s%d" % i, partition=0)
                brokers = [(b.nodeId, b.host, b.port) for b in producer.client.cluster.brokers()]
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id="g-" + topic,
                                        auto_offset_reset="earliest", enable_auto_commit=False,
                                        **tls)
            await consumer.start()
            got = []
            try:
                deadline = time.monotonic() + 60
                while len(got) < N and time.monotonic() < deadline:
                    batch = await consumer.getmany(timeout_ms=1000)
                    got += [r.value.decode() for records in batch.values() for r in records]
            finally:
                await consumer.stop()
            return got, brokers

        got, brokers = asyncio.run(main())
    else:
        import confluent_kafka

        conf = {"bootstrap.servers": bootstrap, "security.protocol": "SSL",
                "ssl.ca.location": ca}
        producer = confluent_kafka.Producer(conf)
        for i in range(N):
            producer.produce(topic, b"s%d" % i, partition=0)
        assert producer.flush(30) == 0
        brokers = [(b.id, b.host, b.port)
                   for b in producer.list_topics(timeout=10).brokers.values()]
        consumer = confluent_kafka.Consumer(dict(conf, **{
            "group.id": "g-" + topic, "enable.auto.commit": False}))
        # assigned (aiokafka above joins a group): librdkafka's first join takes seconds
        consumer.assign([confluent_kafka.TopicPartition(topic, 0,
                                                        confluent_kafka.OFFSET_BEGINNING)])
        got = []
        deadline = time.monotonic() + 60
        while len(got) < N and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and not message.error():
                got.append(message.value().decode())
        consumer.close()
    print(json.dumps({"got": got, "brokers": brokers}))
''')


@pytest.mark.parametrize("library", ["aiokafka", "confluent-kafka"])
def test_real_clients_produce_and_consume_through_one_port(broker, pki, sni_proxy, library):
    topic = "sni-%s-%s" % (library.split("-")[0], uuid.uuid4().hex[:8])
    broker.create_topic(topic, partitions=1)
    script = pki["tmp"] / "client.py"
    script.write_text(CLIENT)
    out = _isolated(pki, sys.executable, str(script), library,
                    "%s:%d" % (BOOTSTRAP_NAME, sni_proxy.port), pki["ca"], topic)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["got"] == ["s%d" % i for i in range(20)]
    # the node's address is its name, on the one port
    assert [tuple(b) for b in result["brokers"]] == [
        (BROKER_NODE_ID, "broker-%d.kafka.example.com" % BROKER_NODE_ID, sni_proxy.port)]
    log = sni_proxy.log()
    assert re.search(r"connection \d+ opened: client 127\.0\.0\.1:\d+ -> node %d listener"
                     % BROKER_NODE_ID, log)
    assert re.search(r"connection \d+ opened: client 127\.0\.0\.1:\d+ -> bootstrap listener", log)
    assert "for node %d" % BROKER_NODE_ID not in log  # no port of its own was opened
    assert "every node on this port by TLS server name %s" % PATTERN in log


def _tls_roundtrip(pki, port, server_name, header=b""):
    """Connect with ``server_name`` as SNI (None: none), send ApiVersions:
    the answer's correlation id, or None when the proxy closes at once."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if server_name is None:
        context.check_hostname = False
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    raw.sendall(header)  # a PROXY protocol header goes before the handshake
    with context.wrap_socket(raw, server_hostname=server_name) as sock:
        payload = struct.pack(">hhih", 18, 0, 5, 4) + b"test"
        try:
            sock.sendall(struct.pack(">i", len(payload)) + payload)
            head = sock.recv(8)
        except (ConnectionError, ssl.SSLError):
            return None
        return struct.unpack(">ii", head)[1] if len(head) == 8 else None


def test_names_route_to_their_node_the_rest_to_the_bootstrap(pki, sni_proxy):
    assert _tls_roundtrip(pki, sni_proxy.port, "broker-%d.kafka.example.com" % BROKER_NODE_ID) == 5
    assert _tls_roundtrip(pki, sni_proxy.port, BOOTSTRAP_NAME) == 5
    assert _tls_roundtrip(pki, sni_proxy.port, None) == 5  # by IP address: no name sent
    assert _tls_roundtrip(pki, sni_proxy.port, "other.kafka.example.com") == 5


def test_a_name_of_a_node_the_cluster_never_named_is_refused(pki, sni_proxy):
    assert _tls_roundtrip(pki, sni_proxy.port, "broker-7.kafka.example.com") is None
    sni_proxy.wait_for_log("refused (unknown_node): TLS server name broker-7.kafka.example.com "
                           "names node 7, which the cluster has not named (nodes known: %d)"
                           % BROKER_NODE_ID)
    metrics = urllib.request.urlopen(
        "http://127.0.0.1:%d/metrics" % sni_proxy.admin, timeout=10).read().decode()
    assert 'kthrottle_connections_refused_total{reason="unknown_node"} 1.0' in metrics
    assert _tls_roundtrip(pki, sni_proxy.port, BOOTSTRAP_NAME) == 5  # the rest carry on
    assert sni_proxy.alive()


def test_behind_a_balancer_sending_the_proxy_protocol(broker, pki, tmp_path):
    """SNI routing and the PROXY protocol together, as behind a TCP load
    balancer passing TLS through: the header first, then the handshake."""
    p = MappedProxy(broker.bootstrap, tmp_path / "proxy.log",
                    ["--security-protocol", "SSL", "--ssl-cert", pki["pem"], "--ssl-key",
                     pki["pem"], "--sni-broker-pattern", PATTERN, "--proxy-protocol"]).start()
    try:
        node = "broker-%d.kafka.example.com" % BROKER_NODE_ID
        assert _tls_roundtrip(pki, p.port, node,
                              v1_header(("198.51.100.50", 5050), ("127.0.0.1", p.port))) == 5
        p.wait_for_log("client 198.51.100.50:5050 -> node %d listener" % BROKER_NODE_ID)
        assert _tls_roundtrip(pki, p.port, BOOTSTRAP_NAME,
                              v2_header(("198.51.100.51", 5151), ("127.0.0.1", p.port))) == 5
        p.wait_for_log("client 198.51.100.51:5151 -> bootstrap listener")
        assert _tls_roundtrip(pki, p.port, "broker-7.kafka.example.com",
                              v1_header(("198.51.100.52", 5252), ("127.0.0.1", p.port))) is None
        p.wait_for_log("connection from 198.51.100.52:5252 (connection")
        assert "refused (unknown_node): TLS server name broker-7" in p.log()
    finally:
        p.stop()


def test_a_node_whose_broker_is_down_closes_its_connections_with_a_line(pki, tmp_path):
    """No port of its own to stop listening on (the bootstrap's is shared):
    each connection routed to that node is refused, said and counted. The
    broker: an Apache Kafka node of the test's own, stopped and started again
    on its data and on the same port."""
    from kthrottle.kafka_kit import KafkaBroker

    own = KafkaBroker(node_id=BROKER_NODE_ID, workdir=tmp_path / "kafka",
                      log_path=tmp_path / "kafka.log", keep=True)
    p = None
    node = "broker-%d.kafka.example.com" % BROKER_NODE_ID
    try:
        own.start()
        p = MappedProxy(own.bootstrap, tmp_path / "proxy.log",
                        ["--security-protocol", "SSL", "--ssl-cert", pki["pem"], "--ssl-key",
                         pki["pem"], "--sni-broker-pattern", PATTERN,
                         "--upstream-connect-timeout-ms", "1000"]).start()
        assert _tls_roundtrip(pki, p.port, node) == 5
        own.stop()  # a controlled shutdown, over once the process has exited
        assert _tls_roundtrip(pki, p.port, node) is None
        p.wait_for_log("refused (broker_unreachable): no broker reachable for node %d (%s"
                       % (BROKER_NODE_ID, own.bootstrap))
        own.start()
        assert _tls_roundtrip(pki, p.port, node) == 5
        assert p.alive()
    finally:
        if p is not None:
            p.stop()
        own.stop(keep=False)
