"""Socket options of the proxy's connections, read back from the sockets
themselves: TCP_NODELAY on every accepted client socket and every broker
socket, on the bootstrap and node listeners, PLAINTEXT and SSL, on uvloop
and on asyncio's own loop (which sets it only on sockets created with proto
IPPROTO_TCP, and the proxy's listening sockets are not). Without it a frame
can wait for the peer's delayed ACK. In-process proxy, real Tansu broker."""
import asyncio
import socket
import ssl

import pytest
import trustme
import uvloop

from kthrottle.config import ProxyConfig
from kthrottle.embedded import free_port
from kthrottle.proxy.server import ProxyServer
from test_pipeline import api_versions_req, metadata_req

pytestmark = pytest.mark.integration

TANSU_NODE_ID = 111
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    pem = tmp / "server.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return str(pem), client


def _no_delay(transport):
    sock = transport.get_extra_info("socket")
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def _roundtrip(reader, writer, request):
    writer.write(request)
    size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 10), "big")
    await asyncio.wait_for(reader.readexactly(size), 10)


async def _connect(port, client_tls, timeout=10.0):
    """The node listener opens in a task once Metadata named the node."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await asyncio.open_connection("127.0.0.1", port, ssl=client_tls)
        except ConnectionRefusedError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _options(broker, protocol, tls):
    host, port = broker.bootstrap.split(":")
    node_port = free_port()
    extra = {}
    client_tls = None
    if protocol == "SSL":
        pem, client_tls = tls
        extra = {"security_protocol": "SSL", "ssl_cert": pem, "ssl_key": pem}
    config = ProxyConfig(bootstrap_servers=[(host, int(port))], listen=("127.0.0.1", free_port()),
                         node_port_base=node_port - TANSU_NODE_ID, **extra).validate()
    server = ProxyServer(config)
    await server.start()
    writers = []
    try:
        reader, writer = await _connect(server.bootstrap_address[1], client_tls)
        writers.append(writer)
        await _roundtrip(reader, writer, api_versions_req(1))
        await _roundtrip(reader, writer, metadata_req(2))  # opens node 111's listener
        reader, writer = await _connect(node_port, client_tls)
        writers.append(writer)
        await _roundtrip(reader, writer, api_versions_req(1))
        found = {}
        for conn in server.connections:
            found[conn.listener_name] = (_no_delay(conn.client.transport),
                                         _no_delay(conn.upstream.transport))
        return found
    finally:
        for writer in writers:
            writer.close()
        await server.close()


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
def test_every_client_and_broker_socket_has_tcp_nodelay(broker, tls, protocol, loop_name):
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        found = runner.run(_options(broker, protocol, tls))
    assert set(found) == {"bootstrap", "node %d" % TANSU_NODE_ID}
    for listener, (client_side, broker_side) in found.items():
        assert client_side, "%s listener: accepted socket without TCP_NODELAY" % listener
        assert broker_side, "%s listener: broker socket without TCP_NODELAY" % listener
