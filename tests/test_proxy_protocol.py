"""The PROXY protocol (HAProxy's v1 and v2): the pure codec (valid, truncated,
garbage and oversize headers, and a hypothesis fuzz test), then a kthrottle
process with --proxy-protocol in front of a real Tansu broker: raw sockets
sending a header written here, a relay of the test's own that prepends one so
that aiokafka produces and consumes through it, the per-ip limit counting the
header's address, connections without a valid header refused, and a TLS
listener with the header before the handshake."""
import asyncio
import ipaddress
import os
import re
import socket
import ssl
import struct
import time
import urllib.request
import uuid

import pytest
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st

from kthrottle.codecs import ProtocolError
from kthrottle.codecs.proxy_protocol import (
    MAX_SIZE,
    V1_MAX_SIZE,
    V2_MAX_LENGTH,
    V2_SIGNATURE,
    ProxyHeader,
    parse_header,
    v1_header,
    v2_header,
)
from kthrottle.embedded import free_port
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

# the "ci" profile (tests/conftest.py): these counts; KTHROTTLE_FUZZ_EXAMPLES=N: N, randomized
LONG_EXAMPLES = int(os.environ.get("KTHROTTLE_FUZZ_EXAMPLES") or 0)


def examples(ci_count):
    return settings(max_examples=LONG_EXAMPLES or ci_count)

SRC4, DST4 = ("198.51.100.7", 51234), ("203.0.113.1", 9092)
SRC6, DST6 = ("2001:db8::7", 40000), ("2001:db8::1", 9092)
KAFKA_BYTES = b"\x00\x00\x00\x15\x00\x12\x00\x00"  # what follows the header: the client's


# the codec -------------------------------------------------------------------

@pytest.mark.parametrize("header, source, destination, version", [
    (v1_header(SRC4, DST4), SRC4, DST4, 1),
    (v1_header(SRC6, DST6), SRC6, DST6, 1),
    (b"PROXY UNKNOWN\r\n", None, None, 1),
    (b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n", None, None, 1),  # the rest is ignored
    (v2_header(SRC4, DST4), SRC4, DST4, 2),
    (v2_header(SRC6, DST6), SRC6, DST6, 2),
    (v2_header(SRC4, DST4, tlvs=b"\x05\x00\x04abcd\x02\x00\x09authority"), SRC4, DST4, 2),
    (v2_header(local=True), None, None, 2),  # a balancer's health check
    (V2_SIGNATURE + b"\x21\x00\x00\x00", None, None, 2),  # PROXY, AF_UNSPEC
    (V2_SIGNATURE + b"\x21\x31\x00\xd8" + b"\x00" * 216, None, None, 2),  # AF_UNIX
])
def test_a_valid_header_gives_the_client_and_its_length_and_not_a_byte_more(
        header, source, destination, version):
    parsed = parse_header(header + KAFKA_BYTES)
    assert parsed == ProxyHeader(version, source, destination, len(header))
    assert parse_header(memoryview(header)) == parsed  # what a socket read gives
    for cut in range(len(header)):  # read a byte at a time: "need more" until whole
        assert parse_header(header[:cut]) is None


def test_v1_header_the_specification_gives_as_example():
    header = b"PROXY TCP4 255.255.255.255 255.255.255.255 65535 65535\r\n"
    assert parse_header(header).source == ("255.255.255.255", 65535)
    six = b"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
    assert parse_header(b"PROXY TCP6 %s %s 65535 65535\r\n" % (six, six)).source == (
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535)
    longest = b"PROXY UNKNOWN %s %s 65535 65535\r\n" % (six, six)  # the specification's worst case
    assert len(longest) == V1_MAX_SIZE == parse_header(longest).length


@pytest.mark.parametrize("data, says", [
    (b"\x00\x00\x00\x15\x00\x12\x00\x03", "not a PROXY protocol header"),  # a Kafka frame
    (b"GET / HTTP/1.1\r\n", "not a PROXY protocol header"),
    (b"\x16\x03\x01\x02\x00", "not a PROXY protocol header"),  # a TLS ClientHello
    (b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n", "TCP4|TCP6"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", "TCP4|TCP6"),
    (b"PROXY TCP4 1.2.3.400 5.6.7.8 1 2\r\n", "1.2.3.400"),
    (b"PROXY TCP4 ::1 ::1 1 2\r\n", "::1"),
    (b"PROXY TCP6 1.2.3.4 5.6.7.8 1 2\r\n", "1.2.3.4"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 2\r\n", "not a port"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 080 2\r\n", "not a port"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 2\r\n", "not a port"),
    (b"PROXY TCP4  1.2.3.4 5.6.7.8 1 2\r\n", "TCP4|TCP6"),
    (b"PROXY TCP4 1.2.3.4\n", "control character"),
    (b"PROXY TCP4 1.2.3.4\r5", "control character"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\xff\r\n", "not ASCII"),
    (b"PROXY " + b"x" * 120, "without CRLF in its first 107 bytes"),
    (b"PROXY TCP6 " + b"1" * 94 + b" 1\r\n", "without CRLF"),  # one byte over 107
    (V2_SIGNATURE + b"\x11\x11\x00\x0c" + b"\x00" * 12, "version 1"),
    (V2_SIGNATURE + b"\x2f\x11\x00\x0c" + b"\x00" * 12, "unknown command 15"),
    (V2_SIGNATURE + b"\x21\x12\x00\x0c" + b"\x00" * 12, "datagram"),
    (V2_SIGNATURE + b"\x21\x41\x00\x0c" + b"\x00" * 12, "unknown address family 4"),
    (V2_SIGNATURE + b"\x21\x11\x00\x08" + b"\x00" * 8, "too short for its IPv4 addresses"),
    (V2_SIGNATURE + b"\x21\x21\x00\x0c" + b"\x00" * 12, "too short for its IPv6 addresses"),
    (V2_SIGNATURE[:5] + b"X", "not a PROXY protocol header"),
])
def test_garbage_is_a_protocol_error_saying_what_is_wrong(data, says):
    with pytest.raises(ProtocolError, match=re.escape(says)):
        parse_header(data)


def test_an_oversize_v2_header_is_refused_from_its_16_byte_head():
    head = V2_SIGNATURE + b"\x21\x11" + struct.pack(">H", V2_MAX_LENGTH + 1)
    with pytest.raises(ProtocolError, match="more than the 4096 accepted"):
        parse_header(head)  # before its body is read
    largest = (V2_SIGNATURE + b"\x21\x11" + struct.pack(">H", V2_MAX_LENGTH)
               + b"\x00" * V2_MAX_LENGTH)
    assert parse_header(largest).length == len(largest) == MAX_SIZE


@st.composite
def headers(draw):
    six = draw(st.booleans())
    ips = st.ip_addresses(v=6 if six else 4).map(str)
    ports = st.integers(0, 65535)
    src, dst = (draw(ips), draw(ports)), (draw(ips), draw(ports))
    if draw(st.booleans()):
        return v1_header(src, dst), src
    return v2_header(src, dst, tlvs=draw(st.binary(max_size=64))), src


@examples(300)
@given(headers(), st.binary(max_size=64), st.data())
def test_fuzz_headers_read_whole_or_cut_give_the_same_answer(made, after, data):
    header, source = made
    parsed = parse_header(header + after)
    assert parsed.source == (str(ipaddress.ip_address(source[0])), source[1])
    assert parsed.length == len(header)
    cut = data.draw(st.integers(0, len(header) - 1))
    assert parse_header(header[:cut]) is None


@examples(500)
@given(st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=200).map(lambda b: b"PROXY " + b),
    st.binary(max_size=200).map(lambda b: V2_SIGNATURE + b),
    headers().flatmap(lambda made: st.tuples(st.just(made[0]), st.integers(0, len(made[0]) - 1),
                                             st.integers(0, 255))).map(
        lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]),  # one byte changed
))
def test_fuzz_any_bytes_give_a_header_need_more_or_a_protocol_error(data):
    try:
        parsed = parse_header(data)
    except ProtocolError:
        return
    if parsed is None:
        assert len(data) < MAX_SIZE  # never waits past the bound
        return
    assert 0 < parsed.length <= min(len(data), MAX_SIZE)
    assert parse_header(data[:parsed.length]) == parsed  # the header is all it needed
    for address in (parsed.source, parsed.destination):
        assert address is None or 0 <= address[1] <= 65535


# against a kthrottle process and a real broker ----------------------------------

def api_versions_request(correlation_id):
    payload = struct.pack(">hhih", 18, 0, correlation_id, 4) + b"test"
    return struct.pack(">i", len(payload)) + payload


def _answers(sock, correlation_id=7):
    """True when the proxy answers an ApiVersions request on ``sock``,
    False when it closes the connection instead."""
    sock.settimeout(10)
    try:
        sock.sendall(api_versions_request(correlation_id))
        head = _read(sock, 8)
    except (ConnectionError, OSError):
        return False
    if head is None:
        return False
    size, cid = struct.unpack(">ii", head)
    assert cid == correlation_id
    assert _read(sock, size - 4) is not None
    return True


def _read(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _closed(sock, within=10.0):
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _refused_total(admin_port, reason):
    body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin_port, timeout=10).read()
    m = re.search(r'^kthrottle_connections_refused_total\{reason="%s"\} (\S+)$' % reason,
                  body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def proxy(broker, tmp_path_factory):
    """--proxy-protocol, advertising 127.0.0.2 (where the test's relay
    listens, on the same port numbers: a balancer in front of the proxy)."""
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path_factory.mktemp("pp") / "proxy.log",
                     ["--proxy-protocol", "--advertised-host", "127.0.0.2",
                      "--admin-listen", "127.0.0.1:%d" % admin, "--handshake-timeout-ms", "1500",
                      "--max-connections-per-ip", "2",
                      # the relay's clients, and the sockets' own address (LOCAL, UNKNOWN)
                      "--max-connections-per-ip-overrides",
                      "192.0.2.20:3,198.51.100.99:50,127.0.0.1:50"])
    p.admin = admin
    p.start()
    yield p
    p.stop()


def _connect(port, header, source="127.0.0.1"):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if header:
        sock.sendall(header)
    return sock


@pytest.mark.parametrize("header, client", [
    (v1_header(("198.51.100.7", 51234), ("127.0.0.1", 9092)), "198.51.100.7:51234"),
    (v2_header(("198.51.100.8", 40001), ("127.0.0.1", 9092)), "198.51.100.8:40001"),
    (v2_header(("2001:db8::9", 40002), ("::1", 9092), tlvs=b"\x04\x00\x02ab"),
     "2001:db8::9:40002"),
])
def test_a_header_then_kafka_the_client_is_the_headers(proxy, header, client):
    with _connect(proxy.port, header) as sock:
        assert _answers(sock)
        proxy.wait_for_log("client %s -> bootstrap listener" % client)


def test_header_and_request_in_one_segment_and_the_header_byte_by_byte(proxy):
    header = v1_header(("198.51.100.10", 1111), ("127.0.0.1", 9092))
    with _connect(proxy.port, header + api_versions_request(3)) as sock:
        sock.settimeout(10)
        size, cid = struct.unpack(">ii", _read(sock, 8))
        assert cid == 3 and _read(sock, size - 4)
    header = v2_header(("198.51.100.11", 2222), ("127.0.0.1", 9092))
    with _connect(proxy.port, b"") as sock:
        for i in range(len(header)):
            sock.sendall(header[i:i + 1])
            time.sleep(0.005)
        assert _answers(sock)
    proxy.wait_for_log("client 198.51.100.11:2222 -> bootstrap listener")


def test_local_and_unknown_headers_keep_the_sockets_address(proxy):
    for header in (v2_header(local=True), b"PROXY UNKNOWN\r\n"):
        with _connect(proxy.port, header) as sock:
            local_port = sock.getsockname()[1]
            assert _answers(sock)
            proxy.wait_for_log("client 127.0.0.1:%d -> bootstrap listener" % local_port)


def test_the_per_ip_limit_counts_the_headers_address(proxy):
    def from_(ip, port):
        return _connect(proxy.port, v2_header((ip, port), ("127.0.0.1", 9092)))

    # every socket comes from 127.0.0.1; max-connections-per-ip 2 holds per header address
    held = [from_("192.0.2.10", 1), from_("192.0.2.10", 2), from_("192.0.2.11", 3),
            from_("192.0.2.12", 4)]
    try:
        assert all(_answers(s) for s in held)
        with from_("192.0.2.10", 5) as third:
            assert not _answers(third)
        proxy.wait_for_log("2 connections from 192.0.2.10 already (max-connections-per-ip)")
        assert "connection from 192.0.2.10:5 (bootstrap listener) refused" in proxy.log()
        # the override names the header's address too
        more = [from_("192.0.2.20", 10 + i) for i in range(3)]
        held += more
        assert all(_answers(s) for s in more)
        with from_("192.0.2.20", 20) as fourth:
            assert not _answers(fourth)
        proxy.wait_for_log("3 connections from 192.0.2.20 already "
                           "(max-connections-per-ip-overrides)")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # released once the proxy has seen them close
        with from_("192.0.2.10", 6) as again:
            if _answers(again):
                break
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("source, first_bytes, says", [
    # each from an address of its own: the refusal log writes a line once per address and reason
    ("127.0.1.1", api_versions_request(1), "not a PROXY protocol header"),  # sent straight here
    ("127.0.1.2", b"PROXY TCP4 198.51.100.7 nonsense 1 2\r\n", "PROXY protocol v1 header"),
    ("127.0.1.3", V2_SIGNATURE + b"\x21\x11\xff\xff", "more than the 4096 accepted"),
    ("127.0.1.4", b"PROXY TCP4 198.51.100.7",
     "no PROXY protocol header within handshake-timeout-ms (1500 ms)"),
    ("127.0.1.5", b"", "no PROXY protocol header within handshake-timeout-ms"),
])
def test_a_connection_without_a_valid_header_is_refused(proxy, source, first_bytes, says):
    before = _refused_total(proxy.admin, "proxy_protocol")
    with _connect(proxy.port, first_bytes, source) as sock:
        socket_peer = "%s:%d" % sock.getsockname()[:2]
        assert _closed(sock)
    said = "connection from %s (bootstrap listener, --proxy-protocol) refused (proxy_protocol): " \
        % socket_peer
    proxy.wait_for_log(said)
    line, = [line for line in proxy.log().splitlines() if said in line]
    assert says in line and line.split(" ")[2] == "WARNING"
    assert _refused_total(proxy.admin, "proxy_protocol") == before + 1
    with _connect(proxy.port, v1_header(("198.51.100.30", 1), ("127.0.0.1", 1))) as sock:
        assert _answers(sock)  # the others carry on


def test_aiokafka_produces_and_consumes_through_a_relay_that_prepends_the_header(proxy, broker):
    from kthrottle_testkit.clients import produce_then_consume

    topic = "pp-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    relayed = []

    async def relay(listen_port):
        async def pump(reader, writer):
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        async def accept(client_reader, client_writer):
            port = client_writer.get_extra_info("peername")[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", listen_port)
            writer.write(v2_header(("198.51.100.99", port), ("127.0.0.2", listen_port)))
            relayed.append(listen_port)
            await asyncio.gather(pump(client_reader, writer), pump(reader, client_writer))

        return await asyncio.start_server(accept, "127.0.0.2", listen_port)

    async def run():
        servers = [await relay(proxy.port), await relay(proxy.node_port)]
        try:
            bootstrap = "127.0.0.2:%d" % proxy.port
            got, _ = await produce_then_consume(bootstrap, topic, [b"m%d" % i for i in range(20)])
            return got
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    assert asyncio.run(run()) == [b"m%d" % i for i in range(20)]
    assert proxy.node_port in relayed  # the node's address the proxy gave was the relay's
    log = proxy.log()
    assert re.search(r"client 198\.51\.100\.99:\d+ -> node 111 listener", log)
    assert re.search(r"client 198\.51\.100\.99:\d+ -> bootstrap listener", log)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-tls")
    ca = trustme.CA()
    pem = tmp / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return str(pem), client


# The refusal shows the first bytes read as Python's repr of them, which quotes
# with " rather than ' when the bytes hold a ' (a ClientHello's random bytes
# may): wait for the fixed part, then match the bytes whatever the quoting.
REFUSED_NO_HEADER = "refused (proxy_protocol): not a PROXY protocol header: it starts with b"
TLS_SHOWN = re.compile(re.escape(REFUSED_NO_HEADER) + r"""(['"])\\x16\\x03""")


@pytest.mark.parametrize("hello_start", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03abcde",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03ab'de",  # repr quotes with "
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03a'\"de",  # both: repr escapes '
])
def test_the_tls_refusal_is_recognised_whatever_the_quoting(hello_start):
    with pytest.raises(ProtocolError) as refused:
        parse_header(hello_start)
    assert TLS_SHOWN.search("refused (proxy_protocol): %s" % refused.value)


def test_a_tls_listener_reads_the_header_before_the_handshake(broker, tmp_path, tls_files):
    pem, client_tls = tls_files
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--proxy-protocol", "--security-protocol", "SSL", "--ssl-cert", pem,
                      "--ssl-key", pem, "--handshake-timeout-ms", "1500"]).start()
    try:
        for header, client in ((v1_header(("198.51.100.40", 4040), ("127.0.0.1", 1)),
                                "198.51.100.40:4040"),
                               (v2_header(("198.51.100.41", 4141), ("127.0.0.1", 1)),
                                "198.51.100.41:4141")):
            raw = _connect(p.port, header)
            with client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                assert _answers(sock)
            p.wait_for_log("client %s -> bootstrap listener" % client)
        # TLS straight away, no header: refused before any handshake
        raw = _connect(p.port, b"")
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.recv(1)
        p.wait_for_log(REFUSED_NO_HEADER)
        assert TLS_SHOWN.search(p.log()), p.log()[-3000:]
        assert p.alive()
    finally:
        p.stop()
