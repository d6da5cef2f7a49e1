"""Node ids to ports: --node-ports beside --node-port-base. The options and
their checks at start; KRaft's large, sparse node ids rewritten in realistic
multi-broker frames (Metadata, FindCoordinator, DescribeCluster, KIP-951
NodeEndpoints streamed in Fetch v16) with the proxy's own advertise; a node id
that cannot be mapped closing only the connection whose response named it;
and real processes in front of a real Tansu broker (which always reports node
id 111): aiokafka through a map, a layout refused at start, and a node first
named in a client's Metadata that has no port."""
import asyncio
import os
import re
import socket
import struct
import subprocess
import sys
import urllib.request
import uuid

import pytest

from kthrottle.codecs import apis, rewrite_response
from kthrottle.config import ConfigError, ProxyConfig, build_config, load_toml, parse_node_ports
from kthrottle.embedded import free_port, wait_for_port
from kthrottle.proxy.addressing import NodePorts, UnmappedNode
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.server import ProxyServer
from kthrottle_testkit import ROOT, TANSU_NODE_ID
from kthrottle_testkit.clients import produce_then_consume, scram_credentials_file
from kthrottle_testkit.frames import (describe_cluster, fetch, find_coordinator, frame_response,
                                      metadata)
from kthrottle_testkit.proxy import ProxyProcess
from test_pipeline import Harness, api_versions_req, fetch_req, metadata_req

pytestmark = pytest.mark.integration

# a KRaft cluster's node ids: large and sparse
KRAFT = [(1001, "kafka-a.internal.example", 9092, "rack-a"),
         (2001, "kafka-b.internal.example", 9092, "rack-b"),
         (3000001, "kafka-c.internal.example", 9092, None)]
MAP = {1001: 19093, 2001: 19094, 3000001: 19095}


def _config(**kw):
    return ProxyConfig(bootstrap_servers=[("kafka-a.internal.example", 9092)],
                       listen=("127.0.0.1", 9092), **kw).validate()


# the options ----------------------------------------------------------------------

def test_the_flag_and_both_toml_forms_give_one_map(tmp_path):
    from kthrottle import cli

    args = cli.make_parser().parse_args(
        ["proxy", "--bootstrap-server", "k:9092", "--node-ports", "1001=19093, 2001=19094"])
    flags = cli._flag_values(args)
    assert flags["node_ports"] == {1001: 19093, 2001: 19094}
    path = tmp_path / "proxy.toml"
    path.write_text('bootstrap-server = "k:9092"\n[node-ports]\n"1001" = 19093\n2001 = 19094\n')
    assert load_toml(path)["node_ports"] == {1001: 19093, 2001: 19094}
    path.write_text('[proxy]\nbootstrap-server = "k:9092"\nnode-ports = "1001=19093,2001=19094"\n')
    config = build_config(load_toml(path), {})
    assert config.node_ports == {1001: 19093, 2001: 19094}
    assert config.effective_node_port_base is None  # a map alone: only its nodes have a port
    config = build_config(load_toml(path), {"node_port_base": 20000})
    assert config.effective_node_port_base == 20000
    assert build_config({"bootstrap_servers": [("k", 9092)]}, {}).effective_node_port_base == 9093


@pytest.mark.parametrize("value, says", [
    ("1=0", "node 1 needs a port in 1-65535, got '0'"),
    ("1=65536", "node 1 needs a port in 1-65535, got '65536'"),
    ("1=9093,2=9093", "port 9093 is given to both node 1 and node 2"),
    ("1=9093,1=9094", "node 1 is given twice"),
    ("1:9093", "'1:9093' is not NODE_ID=PORT"),
    ("-1=9093", "'-1' is not a node id"),
    ("x=9093", "'x' is not a node id"),
    ("1=http", "needs a port in 1-65535, got 'http'"),
    ("1=9092", "node 1 is given port 9092, the bootstrap listener's (--listen)"),
])
def test_a_map_that_cannot_work_is_refused_before_start(value, says, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(says)):
        build_config({}, {"bootstrap_servers": [("k", 9092)], "listen": ("127.0.0.1", 9092),
                          "node_ports": parse_node_ports(value)})
    path = tmp_path / "proxy.toml"
    path.write_text('bootstrap-server = "k:9092"\n[node-ports]\n"7" = 9092\n"8" = 9092\n')
    with pytest.raises(ConfigError, match="port 9092 is given to both node 7 and node 8"):
        load_toml(path)
    path.write_text('bootstrap-server = "k:9092"\n[node-ports]\n"7" = "ninety"\n')
    with pytest.raises(ConfigError, match="node 7 needs a port"):
        load_toml(path)


def test_the_command_says_what_is_wrong_and_exits_2():
    out = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", "127.0.0.1:1",
         "--node-ports", "1=70000"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "node-ports: node 1 needs a port in 1-65535, got '70000'" in out.stderr


# which port a node gets ------------------------------------------------------------

def test_a_mapped_node_gets_its_port_the_others_the_base_plus_their_id():
    ports = NodePorts({1001: 19093, 5: 30007}, base=30000, bootstrap_port=30003)
    assert ports.port(1001) == 19093 and ports.port(6) == 30006
    with pytest.raises(UnmappedNode, match=r"node id 7 .*30000 \+ 7 is 30007, the port "
                                           r"--node-ports gives node 5"):
        ports.port(7)
    with pytest.raises(UnmappedNode, match=r"node id 3 .*the bootstrap listener's port"):
        ports.port(3)
    with pytest.raises(UnmappedNode, match=r"node id 40000 .*30000 \+ 40000 is 70000, outside "
                                           r"1-65535; give it a port in --node-ports"):
        ports.port(40000)
    alone = NodePorts({1001: 19093})
    assert alone.port(1001) == 19093
    with pytest.raises(UnmappedNode, match=r"node id 1002 .*not in --node-ports") as caught:
        alone.port(1002)
    assert caught.value.node_id == 1002 and caught.value.refused == "unmapped_node"
    assert isinstance(caught.value, ValueError)  # what the pipeline closes a connection on


@pytest.fixture
def server():
    """The proxy's own advertise (constructed, not started: no I/O)."""
    return ProxyServer(_config(node_ports=MAP, advertised_host="proxy.example"))


@pytest.mark.parametrize("api_key, version, body", [
    *[(apis.METADATA, v, metadata(v, KRAFT)) for v in (1, 9, 12)],
    (apis.FIND_COORDINATOR, 2, find_coordinator(2, KRAFT)),
    (apis.FIND_COORDINATOR, 4, find_coordinator(4, KRAFT)),
    (apis.DESCRIBE_CLUSTER, 1, describe_cluster(1, KRAFT)),
])
def test_large_sparse_node_ids_get_their_mapped_ports(server, api_key, version, body):
    frame = frame_response(api_key, version, body)
    new, nodes = rewrite_response(frame, api_key, version, server.advertise)
    assert sorted(n.node_id for n in nodes) == sorted(
        [KRAFT[1][0]] if api_key == apis.FIND_COORDINATOR and version < 4 else MAP)
    for node_id, port in MAP.items():
        if any(n.node_id == node_id for n in nodes):
            assert b"proxy.example" + struct.pack(">i", port) in new
    assert b"internal.example" not in new


def test_fetch_v16_node_endpoints_of_large_ids_stream_with_their_ports(server):
    h = Harness(filters=standard_filters(server.advertise), whole_response_max=0)
    h.client(fetch_req(1, version=16))
    response = frame_response(apis.FETCH, 16, fetch(16, KRAFT, records=b"r" * 5000), 1)
    h.broker(response, chunk=700)
    out = h.take_client()
    assert len(out) == len(response) and h.closed is None
    assert b"internal.example" not in out
    assert all(struct.pack(">i", port) in out for port in MAP.values())
    assert sorted(n.node_id for n in h.nodes[0][0]) == sorted(MAP)


# a node id without a port: that connection only -----------------------------------

UNMAPPED = KRAFT + [(4001, "kafka-d.internal.example", 9092, None)]


@pytest.mark.parametrize("response", ["metadata", "fetch"])
def test_a_node_without_a_port_closes_only_the_connection_its_response_is_on(server, response):
    h = Harness(filters=standard_filters(server.advertise), whole_response_max=0)
    other = Harness(filters=standard_filters(server.advertise))
    if response == "metadata":
        h.client(metadata_req(1, version=12))
        h.broker(frame_response(apis.METADATA, 12, metadata(12, UNMAPPED), 1), chunk=64)
    else:
        h.client(fetch_req(1, version=16))
        h.broker(frame_response(apis.FETCH, 16, fetch(16, UNMAPPED, records=b"r" * 3000), 1),
                 chunk=500)
    assert h.refused == "unmapped_node"
    assert h.closed.startswith("node id 4001 has no port on the proxy: it is not in --node-ports")
    assert h.nodes == []  # no listener is opened for any node of that response
    assert b"kafka-d.internal.example" not in h.take_client()
    other.client(metadata_req(1, version=12))  # another connection carries on
    other.broker(frame_response(apis.METADATA, 12, metadata(12, KRAFT), 1))
    assert other.closed is None and b"proxy.example" in other.take_client()


# real processes ----------------------------------------------------------------------

class MappedProxy(ProxyProcess):
    """A proxy given --node-ports for Tansu's node 111, and no --node-port-base."""

    def start(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", "proxy",
                 "--bootstrap-server", self.bootstrap_upstream, "--listen", self.bootstrap,
                 *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        wait_for_port("127.0.0.1", self.port, proc=self.proc)
        return self


def test_aiokafka_produces_and_consumes_through_a_node_map(broker, tmp_path):

    node_port = free_port()
    p = MappedProxy(broker.bootstrap, tmp_path / "proxy.log",
                    ["--node-ports", "%d=%d" % (TANSU_NODE_ID, node_port)]).start()
    topic = "np-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)

    try:
        got, brokers = asyncio.run(produce_then_consume(
            p.bootstrap, topic, [b"n%d" % i for i in range(20)]))
        assert got == [b"n%d" % i for i in range(20)]
        assert [(b.nodeId, b.host, b.port) for b in brokers] == [
            (TANSU_NODE_ID, "127.0.0.1", node_port)]
        p.wait_for_log("listening on 127.0.0.1:%d for node %d" % (node_port, TANSU_NODE_ID))
        assert "node %d on port %d" % (TANSU_NODE_ID, node_port) in p.log()  # the start line
    finally:
        p.stop()


@pytest.mark.parametrize("args, says", [
    (["--node-ports", "5=%d" % free_port()],
     "kthrottle: error: the cluster names node 111: node id 111 has no port on the proxy: it is "
     "not in --node-ports"),
    (["--node-port-base", "65500"],
     "node id 111 has no port on the proxy: node-port-base 65500 + 111 is 65611, outside "
     "1-65535; give it a port in --node-ports"),
])
def test_a_layout_that_cannot_serve_the_clusters_nodes_is_refused_at_start(broker, args, says):
    out = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", broker.bootstrap,
         "--listen", "127.0.0.1:%d" % free_port(), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode != 0
    assert says in out.stderr


def _ask(port, request):
    """One request on a new connection: its answer's correlation id, or None
    when the proxy closes the connection instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        return _answer(sock, request)


def _answer(sock, request):
    sock.sendall(request)
    data = b""
    while len(data) < 8 or len(data) < 4 + struct.unpack_from(">i", data)[0]:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    return struct.unpack_from(">i", data, 4)[0]


def test_a_node_first_named_to_a_client_without_a_port_closes_that_connection(broker, tmp_path):
    """Towards brokers that require SASL the proxy cannot ask for the nodes
    itself: they are first seen in a client's Metadata. A terminating
    kthrottle stands for such a broker (Tansu speaks no SASL); the proxy under
    test logs in to it with its own identity."""
    password = "np-%s" % uuid.uuid4().hex[:8]
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"np-proxy": password},
                                   mechanisms=("SCRAM-SHA-512",))
    sasl = ProxyProcess(broker.bootstrap, tmp_path / "sasl.log",
                        ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file",
                         str(creds)]).start()
    pw_file = tmp_path / "password"
    pw_file.write_text(password + "\n")
    admin = free_port()
    p = MappedProxy(sasl.bootstrap, tmp_path / "proxy.log",
                    ["--node-ports", "5=%d" % free_port(),
                     "--upstream-security-protocol", "SASL_PLAINTEXT",
                     "--upstream-sasl-mechanism", "SCRAM-SHA-512",
                     "--upstream-sasl-username", "np-proxy",
                     "--upstream-sasl-password-file", str(pw_file),
                     "--admin-listen", "127.0.0.1:%d" % admin])
    try:
        p.start()
        with socket.create_connection(("127.0.0.1", p.port), timeout=10) as held:
            assert _answer(held, api_versions_req(1)) == 1
            assert _ask(p.port, metadata_req(2)) is None  # names node 111: closed
            p.wait_for_log("refused (unmapped_node): node id %d has no port on the proxy"
                           % TANSU_NODE_ID)
            line, = [x for x in p.log().splitlines() if "unmapped_node" in x]
            assert " WARNING " in line
            assert _answer(held, api_versions_req(3)) == 3  # the other connection carries on
        assert _ask(p.port, api_versions_req(4)) == 4  # and new ones are served
        metrics = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin,
                                         timeout=10).read().decode()
        assert 'kthrottle_connections_refused_total{reason="unmapped_node"} 1.0' in metrics
        assert p.alive()
    finally:
        p.stop()
        sasl.stop()
