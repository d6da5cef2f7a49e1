"""The admin endpoint (/metrics, /quotas): what it binds to, who may read
/quotas (bearer token, client certificates), and the bounds on requests.

Most tests start an AdminServer in this process, on its own event loop in a
thread, in front of a stand-in for the proxy (the few attributes the admin
endpoint reads); real HTTP clients talk to it. The last ones run the real
``kthrottle proxy`` command, one of them with a Tansu broker and a client."""
import asyncio
import collections
import contextlib
import logging
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import psutil
import pytest
import trustme

from kthrottle.config import parse_admin_listen
from kthrottle.embedded import free_port, wait_for_port
from kthrottle.proxy import admin as admin_module
from kthrottle.proxy.admin import AdminServer
from kthrottle_testkit import ROOT
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
PRINCIPAL = "User:alice"


class StandIn:
    """What the admin endpoint reads of a ProxyServer: no quotas, one live
    connection (for /quotas to have a principal to show), refused counts."""

    def __init__(self, refused=None):
        self.loop = None  # set once the loop runs
        self.quotas = None
        self.connections = [types.SimpleNamespace(
            conn_id=1, client_quotas={}, peer="10.0.0.7:50000", listener_name="bootstrap",
            upstream_addr="127.0.0.1:9092", principal=PRINCIPAL, muted_until=0.0)]
        if refused is not None:
            self.refused = refused


def _loops():
    loops = [asyncio.new_event_loop]
    try:
        import uvloop  # the proxy runs on it when installed
        loops.append(uvloop.new_event_loop)
    except ImportError:
        pass
    return loops


@contextlib.contextmanager
def running(proxy=None, host="127.0.0.1", loop_factory=asyncio.new_event_loop, **kwargs):
    """An AdminServer on a free port of ``host``; yields it."""
    loop = loop_factory()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(15)

    proxy = proxy or StandIn()
    proxy.loop = loop

    async def start():
        server = AdminServer(proxy, host, 0, **kwargs)
        await server.start()
        return server

    try:
        server = call(start())
        try:
            yield server
        finally:
            call(server.close())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def request(port, path, method="GET", scheme="http", context=None, data=None, **headers):
    """(status, headers, body) of one request, errors included."""
    req = urllib.request.Request("%s://127.0.0.1:%d%s" % (scheme, port, path), data=data,
                                 method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


def raw(port, data):
    """Send ``data`` as is; what comes back until the server closes."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass
    return got


def status_of(answer):
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    return int(match.group(1)) if match else None


# -- binding ------------------------------------------------------------------

def test_a_bare_port_means_loopback():
    assert parse_admin_listen("9464") == ("127.0.0.1", 9464)
    assert parse_admin_listen(9464) == ("127.0.0.1", 9464)
    assert parse_admin_listen(":9464") == ("127.0.0.1", 9464)
    assert parse_admin_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)


def test_the_command_binds_a_bare_admin_port_to_loopback_only(tmp_path):
    admin = free_port()
    p = ProxyProcess("127.0.0.1:%d" % free_port(), tmp_path / "proxy.log",
                     ["--admin-listen", str(admin)]).start()
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        listening = {c.laddr for c in psutil.Process(p.proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == admin}
        assert listening == {("127.0.0.1", admin)}
        assert request(admin, "/metrics")[0] == 200
        p.wait_for_log("admin endpoint on http://127.0.0.1:%d" % admin)
        assert "WARNING kthrottle.admin" not in p.log()  # loopback: nothing exposed
    finally:
        p.stop()


def test_an_exposed_unprotected_quotas_gets_one_warning(caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.admin")
    with running(host="0.0.0.0"):
        pass
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "principal" in text and "--admin-token-file" in text and "--admin-ssl-ca" in text
    caplog.clear()
    with running(host="0.0.0.0", token=TOKEN), running():  # protected; loopback
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- bearer token -------------------------------------------------------------

def test_quotas_requires_the_bearer_token_and_metrics_does_not():
    with running(token=TOKEN) as server:
        port = server.address[1]
        status, headers, body = request(port, "/quotas")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert PRINCIPAL.encode() not in body
        for wrong in ("Bearer nope", "Bearer " + TOKEN + "x", "Bearer", "Basic " + TOKEN,
                      TOKEN, "Bearer s3cret-tokén"):
            status, headers, body = request(port, "/quotas", Authorization=wrong)
            assert status == 401, wrong
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert PRINCIPAL.encode() not in body
        assert 'error="invalid_token"' in request(
            port, "/quotas", Authorization="Bearer nope")[1]["WWW-Authenticate"]

        for right in ("Bearer " + TOKEN, "bearer " + TOKEN):  # schemes are case-insensitive
            status, headers, body = request(port, "/quotas", Authorization=right)
            assert status == 200 and headers["Content-Type"] == "application/json"
            assert headers["Cache-Control"] == "no-store"
            assert PRINCIPAL.encode() in body
        status, headers, _ = request(port, "/metrics")
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_without_protection_quotas_is_open():
    with running() as server:
        status, headers, body = request(server.address[1], "/quotas")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert PRINCIPAL.encode() in body


# -- client certificates ------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-pki")
    ca = trustme.CA()
    files = {"ca": tmp / "ca.pem", "cert": tmp / "server.pem", "key": tmp / "server.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert("127.0.0.1")
    for i, pem in enumerate(server.cert_chain_pems):
        pem.write_to_path(str(files["cert"]), append=i > 0)
    server.private_key_pem.write_to_path(str(files["key"]))
    files = {k: str(v) for k, v in files.items()}
    files.update(ca_obj=ca, client=ca.issue_cert("prometheus@example.com"),
                 stranger=trustme.CA().issue_cert("stranger@example.com"))
    return files


def _client_context(pki, cert=None):
    context = ssl.create_default_context()
    pki["ca_obj"].configure_trust(context)
    if cert is not None:
        cert.configure_cert(context)
    return context


@pytest.mark.parametrize("loop_factory", _loops(), ids=lambda f: f.__module__.split(".")[0])
def test_quotas_requires_a_client_certificate_and_metrics_does_not(pki, loop_factory):
    with running(loop_factory=loop_factory, ssl_cert=pki["cert"], ssl_key=pki["key"],
                 ssl_ca=pki["ca"]) as server:
        port = server.address[1]
        anonymous = _client_context(pki)
        status, _, body = request(port, "/quotas", scheme="https", context=anonymous)
        assert status == 403 and PRINCIPAL.encode() not in body
        status, _, body = request(port, "/metrics", scheme="https", context=anonymous)
        assert status == 200 and b"kthrottle_connections 1.0" in body

        status, _, body = request(port, "/quotas", scheme="https",
                                  context=_client_context(pki, pki["client"]))
        assert status == 200 and PRINCIPAL.encode() in body

        # a certificate from another CA does not get past the handshake
        with pytest.raises(OSError):
            request(port, "/quotas", scheme="https",
                    context=_client_context(pki, pki["stranger"]))
        # plain HTTP on the HTTPS port: no answer at all
        assert status_of(raw(port, b"GET /quotas HTTP/1.0\r\n\r\n")) is None


def test_certificate_and_token_together(pki):
    with running(token=TOKEN, ssl_cert=pki["cert"], ssl_key=pki["key"],
                 ssl_ca=pki["ca"]) as server:
        port = server.address[1]
        with_cert = _client_context(pki, pki["client"])
        assert request(port, "/quotas", scheme="https", context=_client_context(pki),
                       Authorization="Bearer " + TOKEN)[0] == 403
        assert request(port, "/quotas", scheme="https", context=with_cert)[0] == 401
        assert request(port, "/quotas", scheme="https", context=with_cert,
                       Authorization="Bearer " + TOKEN)[0] == 200


def test_https_without_client_certificates_leaves_quotas_to_the_token(pki):
    with running(token=TOKEN, ssl_cert=pki["cert"], ssl_key=pki["key"]) as server:
        port = server.address[1]
        context = _client_context(pki)
        assert request(port, "/quotas", scheme="https", context=context)[0] == 401
        assert request(port, "/quotas", scheme="https", context=context,
                       Authorization="Bearer " + TOKEN)[0] == 200


def test_tls_files_that_cannot_be_loaded_are_refused(pki, tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    for kwargs in ({"ssl_cert": str(tmp_path / "missing.pem"), "ssl_key": pki["key"]},
                   {"ssl_cert": pki["cert"], "ssl_key": str(empty)},
                   {"ssl_cert": pki["cert"], "ssl_key": pki["key"], "ssl_ca": str(empty)}):
        with pytest.raises(ValueError, match="admin endpoint's TLS"):
            AdminServer(StandIn(), "127.0.0.1", 0, **kwargs)


# -- methods, paths, bounds ---------------------------------------------------

def test_get_and_head_only_and_the_known_paths():
    with running() as server:
        port = server.address[1]
        for method in ("POST", "PUT", "DELETE", "OPTIONS"):
            for path in ("/metrics", "/quotas", "/healthz", "/readyz", "/elsewhere"):
                status, headers, _ = request(port, path, method=method,
                                             data=b"x" if method in ("POST", "PUT") else None)
                assert status == 405, (method, path)
                assert headers["Allow"] == "GET, HEAD"
        status, _, body = request(port, "/elsewhere")
        assert status == 404 and body.startswith(b"try /")
        for path in (b"/metrics", b"/quotas", b"/healthz", b"/readyz"):
            assert path in body
        assert request(port, "/metrics?name=x")[0] == 200
        status, headers, body = request(port, "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_oversized_and_too_many_headers_are_refused_and_the_next_request_served():
    with running() as server:
        port = server.address[1]
        big = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n"
        many = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"X-H%d: 1\r\n" % i for i in range(admin_module.MAX_HEADERS + 10)) + b"\r\n"
        long_line = b"GET /metrics?" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        for bad in (big, many, long_line):
            assert status_of(raw(port, bad)) in (400, 431)
            assert status_of(raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n")) == 200
        # a Prometheus scrape's few headers are well within the bounds
        assert request(port, "/metrics", **{
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4",
            "Accept-Encoding": "gzip", "User-Agent": "Prometheus/3.0.0",
            "X-Prometheus-Scrape-Timeout-Seconds": "10"})[0] == 200


def test_a_client_that_sends_its_request_too_slowly_is_cut_off(monkeypatch):
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT", 0.5)
    with running() as server:
        port = server.address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
            start = time.monotonic()
            assert s.recv(1024) == b""
            assert time.monotonic() - start < 5
        assert request(port, "/metrics")[0] == 200


def test_a_client_that_does_not_read_its_answer_is_cut_off():
    # enough refused reasons for /metrics to overflow the sockets' buffers
    refused = collections.Counter({"reason-%06d-%s" % (i, "x" * 60): i for i in range(150_000)})
    with running(StandIn(refused)) as server:
        server.send_timeout = 0.5
        port = server.address[1]
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(20)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(3)  # the answer takes long to make; then 0.5 s to send it
            got = b""
            try:
                while True:
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        break
                    got += chunk
            except ConnectionResetError:
                pass
        length = int(re.search(rb"Content-Length: (\d+)", got).group(1))
        assert len(got) < length
        assert request(port, "/quotas")[0] == 200


# -- metrics ------------------------------------------------------------------

def test_refused_connections_are_counted_by_reason():
    refused = collections.Counter({"max-connections": 2, "max-connections-per-ip": 5})
    with running(StandIn(refused)) as server:
        text = request(server.address[1], "/metrics")[2].decode()
    assert "# TYPE kthrottle_connections_refused_total counter" in text
    assert 'kthrottle_connections_refused_total{reason="max-connections"} 2.0' in text
    assert 'kthrottle_connections_refused_total{reason="max-connections-per-ip"} 5.0' in text
    with running(StandIn()) as server:  # a proxy that counts nothing yet
        text = request(server.address[1], "/metrics")[2].decode()
    assert "kthrottle_connections_refused_total{" not in text
    assert "kthrottle_connections 1.0" in text


# -- the command --------------------------------------------------------------

def _kthrottle_proxy(*args):
    return subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server",
         "127.0.0.1:%d" % free_port(), "--listen", "127.0.0.1:%d" % free_port(), *args],
        capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_unreadable_token_or_tls_files_stop_the_command(tmp_path, pki):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for args, reason in (
            (["--admin-token-file", str(tmp_path / "missing")], "cannot read admin-token-file"),
            (["--admin-token-file", str(empty)], "is empty"),
            (["--admin-ssl-cert", pki["cert"], "--admin-ssl-key", str(empty)],
             "cannot load the admin endpoint's TLS")):
        out = _kthrottle_proxy("--admin-listen", str(free_port()), *args)
        assert out.returncode == 1, out.stderr
        assert "kthrottle: error: " in out.stderr and reason in out.stderr
        assert "Traceback" not in out.stderr


def test_the_command_protects_quotas_with_the_token_file(broker, tmp_path):
    from aiokafka import AIOKafkaProducer

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."admin-test"]\nproducer_byte_rate = 10000000\n')
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", "0.0.0.0:%d" % admin,
                      "--admin-token-file", str(token_file)]).start()
    topic = "admin-%d" % admin
    broker.create_topic(topic, partitions=1)
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)

        async def produce_and_look():
            producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id="admin-test")
            await producer.start()
            try:
                await producer.send_and_wait(topic, b"v", partition=0)
                loop = asyncio.get_running_loop()
                return (await loop.run_in_executor(None, request, admin, "/quotas"),
                        await loop.run_in_executor(None, lambda: request(
                            admin, "/quotas", Authorization="Bearer " + TOKEN)))
            finally:
                await producer.stop()

        denied, allowed = asyncio.run(produce_and_look())
        assert denied[0] == 401 and b"admin-test" not in denied[2]
        assert allowed[0] == 200 and b'"client_id": "admin-test"' in allowed[2]
        assert request(admin, "/metrics")[0] == 200
        p.wait_for_log("/quotas: bearer token")
        assert "WARNING" not in p.log()  # exposed, but protected
    finally:
        p.stop()
