"""OAUTHBEARER (KIP-255, KIP-768) and KIP-368 re-authentication end to end: keys and tokens
made here (RSA, PyJWT; test_oauthbearer.py's, which tests the checks and the filter without
I/O), a JWKS served from a file and by a local HTTP server (kthrottle_testkit/oauth_server.py),
real clients (confluent-kafka with an oauth_cb, aiokafka with a token provider) through
kthrottle processes in front of a real broker."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from cryptography.hazmat.primitives import serialization

from kthrottle.embedded import free_port, wait_for_port
from kthrottle.policy import oauthbearer
from kthrottle.proxy.filters.sasl import SASL_AUTHENTICATION_FAILED
from kthrottle_testkit import oauth_server
from kthrottle_testkit.clients import admin_get
from kthrottle_testkit.proxy import ProxyProcess
from test_oauthbearer import (
    AUDIENCE,
    ISSUER,
    KEY1,
    KEY2,
    OTHER,
    _frames,
    jwks_text,
    make_token,
)
from test_sasl import authenticate, decode_authenticate, handshake

pytestmark = pytest.mark.integration


# end to end -------------------------------------------------------------------

class OAuthServer:
    """kthrottle_testkit/oauth_server.py as a subprocess on 127.0.0.1, stopped by its PID."""

    def __init__(self, tmp, jwks_file, signing_key=None, lifetime=60, cert=None):
        self.port = free_port()
        self.args = [sys.executable, str(oauth_server.SCRIPT), "--port", str(self.port),
                     "--jwks", str(jwks_file), "--lifetime", str(lifetime)]
        if signing_key is not None:
            pem = tmp / ("signing-%d.pem" % self.port)
            pem.write_bytes(signing_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
            self.args += ["--signing-key", str(pem)]
        if cert is not None:
            self.args += ["--cert", cert[0], "--key", cert[1]]
        self.scheme = "https" if cert else "http"
        self.log = tmp / ("oauth-%d.log" % self.port)
        self.proc = None

    def url(self, path):
        return "%s://127.0.0.1:%d%s" % (self.scheme, self.port, path)

    def start(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def call(self, method, path):
        import http.client
        import ssl

        if self.scheme == "https":
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=5,
                                               context=ssl._create_unverified_context())
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request(method, path)
        body = conn.getresponse().read()
        conn.close()
        return body

    def stats(self):
        return json.loads(self.call("GET", "/stats"))

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def oauth(broker, tmp_path_factory):
    """A terminating kthrottle with OAUTHBEARER, its JWKS a file:// URL; alice
    has a produce quota."""
    tmp = tmp_path_factory.mktemp("oauth")
    jwks = tmp / "jwks.json"
    jwks.write_text(jwks_text((KEY1, "k1")))
    quotas = tmp / "quotas.toml"
    quotas.write_text('[users.alice]\nproducer_byte_rate = 40000\n')
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log", [
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-enabled-mechanisms", "OAUTHBEARER",
        "--sasl-oauthbearer-jwks-endpoint-url", jwks.as_uri(),
        "--sasl-oauthbearer-expected-audience", "other," + AUDIENCE,
        "--sasl-oauthbearer-expected-issuer", ISSUER, "--quota-file", str(quotas),
        # the front proxy of the upstream tests reads the quotas as 'proxy'
        "--admin-principals", "User:proxy"])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", "127.0.0.1:%d" % p.admin]
    p.jwks = jwks
    p.start()
    yield p
    p.stop()


def _topic(broker, prefix="oauth"):
    name = "%s-%s" % (prefix, uuid.uuid4().hex[:8])
    broker.create_topic(name, partitions=1)
    return name


class Provider:
    """aiokafka's token provider."""

    def __init__(self, token):
        from aiokafka.abc import AbstractTokenProvider

        self.__class__ = type("Provider", (Provider, AbstractTokenProvider), {})
        self._token = token

    async def token(self):
        return self._token


def _aio_auth(token):
    return dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                sasl_oauth_token_provider=Provider(token))


def test_confluent_kafka_with_oauth_cb_produces(oauth, broker):
    import confluent_kafka

    topic = _topic(broker)
    calls = []

    def oauth_cb(config):
        calls.append(config)
        return make_token(KEY1, "k1", sub="carol", now=time.time()), time.time() + 300

    producer = confluent_kafka.Producer({
        "bootstrap.servers": oauth.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanisms": "OAUTHBEARER", "oauth_cb": oauth_cb, "linger.ms": 5})
    for i in range(20):
        producer.produce(topic, b"v%d" % i, partition=0)
    assert producer.flush(30) == 0
    assert calls
    oauth.wait_for_log("client authenticated as 'carol' with OAUTHBEARER")


def test_aiokafka_with_a_token_provider_produces_and_alices_quota_holds(oauth, broker):
    from aiokafka import AIOKafkaProducer

    topic = _topic(broker)
    token = make_token(KEY1, "k1", sub="alice", now=time.time())

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=oauth.bootstrap, client_id="app",
                                    max_request_size=20000, **_aio_auth(token))
        await producer.start()
        try:
            start = time.monotonic()
            for _ in range(12):  # 120 KB at 40 KB/s, 1 s of burst: 2 s at least
                await producer.send_and_wait(topic, b"x" * 10_000, partition=0)
            view = admin_get(oauth.admin, "/quotas")["connections"]
            return time.monotonic() - start, view
        finally:
            await producer.stop()

    elapsed, view = asyncio.run(run())
    assert {c["principal"] for c in view} == {"alice"}
    assert {client["produce"].get("entity") for c in view for client in c["clients"]} == {
        "users/alice"}
    assert elapsed >= 1.0, elapsed  # held to the quota (loose: 2 s expected)


def _refused(oauth, token):
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=oauth.bootstrap, request_timeout_ms=5000,
                                    metadata_max_age_ms=5000, **_aio_auth(token))
        try:
            await asyncio.wait_for(producer.start(), 15)
        except (KafkaError, asyncio.TimeoutError, OSError):
            return True
        finally:
            await producer.stop()
        return False

    return asyncio.run(run())


@pytest.mark.parametrize("case, reason", [
    ("expired", "the token has expired"),
    ("audience", "wrong audience"),
    ("issuer", "wrong issuer"),
    ("signature", "bad signature"),
    ("kid", "unknown kid 'nobody'"),
])
def test_bad_tokens_are_refused_with_the_reason_in_the_log(oauth, case, reason):
    now = time.time()
    token = {
        "expired": make_token(KEY1, "k1", sub="eve", now=now - 400),
        "audience": make_token(KEY1, "k1", sub="eve", now=now, aud="elsewhere"),
        "issuer": make_token(KEY1, "k1", sub="eve", now=now, iss="https://evil.test"),
        "signature": make_token(OTHER, "k1", sub="eve", now=now),
        "kid": make_token(OTHER, "nobody", sub="eve", now=now),
    }[case]
    assert _refused(oauth, token)
    oauth.wait_for_log("OAUTHBEARER token refused: " + reason)
    assert "client authenticated as 'eve'" not in oauth.log()
    # a bearer token is a secret: neither it nor its signature is ever logged
    assert token not in oauth.log() and token.rsplit(".", 1)[1] not in oauth.log()


def test_kafkas_failure_exchange_on_the_wire(oauth):
    """The error challenge, the client's ^A, then SASL_AUTHENTICATION_FAILED
    (kafka-python's codecs over a real socket)."""
    token = make_token(OTHER, "k1", sub="eve", now=time.time())
    with socket.create_connection(("127.0.0.1", oauth.port), timeout=10) as sock:
        def call(frame):
            sock.sendall(frame)
            size = int.from_bytes(_recv(sock, 4), "big")
            return size.to_bytes(4, "big") + _recv(sock, size)

        call(handshake(1, "OAUTHBEARER"))
        challenge = decode_authenticate(call(authenticate(2, oauthbearer.client_first(token))))
        assert challenge.error_code == 0
        assert bytes(challenge.auth_bytes) == b'{"status":"invalid_token"}'
        final = decode_authenticate(call(authenticate(3, b"\x01")))
        assert final.error_code == SASL_AUTHENTICATION_FAILED
        assert sock.recv(1) == b""  # then closed


def _recv(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def test_a_key_rotated_into_the_jwks_is_fetched_on_its_unknown_kid(oauth):
    time.sleep(2.1)  # the unknown-kid fetches of the previous tests are rate-limited
    oauth.jwks.write_text(jwks_text((KEY1, "k1"), (KEY2, "k2")))
    from aiokafka import AIOKafkaProducer

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=oauth.bootstrap, **_aio_auth(
            make_token(KEY2, "k2", sub="dave", now=time.time())))
        await producer.start()
        await producer.stop()

    asyncio.run(run())
    oauth.wait_for_log("client authenticated as 'dave' with OAUTHBEARER")
    assert "names key id 'k2'" in oauth.log()


# KIP-368 with real clients ----------------------------------------------------

@pytest.fixture(scope="module")
def reauth(broker, tmp_path_factory):
    """OAUTHBEARER with sessions of 2.5 s, the JWKS over https (trustme's CA,
    given to the proxy as SSL_CERT_FILE)."""
    import trustme

    tmp = tmp_path_factory.mktemp("reauth")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    jwks = tmp / "jwks.json"
    jwks.write_text(jwks_text((KEY1, "k1")))
    server = OAuthServer(tmp, jwks, cert=(str(tmp / "cert.pem"), str(tmp / "key.pem"))).start()
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log", [
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-enabled-mechanisms", "OAUTHBEARER",
        "--sasl-oauthbearer-jwks-endpoint-url", server.url("/jwks"),
        "--connections-max-reauth-ms", "2500"])
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(tmp / "ca.pem")
    try:
        p.start()
    finally:
        if saved is None:
            os.environ.pop("SSL_CERT_FILE")
        else:
            os.environ["SSL_CERT_FILE"] = saved
    p.server = server
    yield p
    p.stop()
    server.stop()


def test_confluent_kafka_reauthenticates_across_session_lifetimes(reauth, broker):
    import confluent_kafka

    topic = _topic(broker, "reauth")
    tokens = []

    def oauth_cb(config):
        tokens.append(time.time())
        return make_token(KEY1, "k1", sub="erin", now=time.time()), time.time() + 300

    producer = confluent_kafka.Producer({
        "bootstrap.servers": reauth.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanisms": "OAUTHBEARER", "oauth_cb": oauth_cb, "linger.ms": 0})
    delivered = []
    deadline = time.monotonic() + 7.5  # three sessions
    while time.monotonic() < deadline:
        producer.produce(topic, b"v", partition=0,
                         on_delivery=lambda err, msg: delivered.append(err))
        producer.flush(10)
        time.sleep(0.1)
    assert producer.flush(10) == 0
    assert delivered and all(err is None for err in delivered), delivered[:3]
    assert reauth.server.stats()["jwks"] >= 1  # the keys came over https
    log = reauth.log()
    assert "client authenticated as 'erin'" in log
    assert "session expired" not in log.split("client authenticated as 'erin'")[1]


def test_aiokafka_which_does_not_reauthenticate_is_closed_at_the_deadline(reauth, broker):
    from aiokafka import AIOKafkaProducer

    topic = _topic(broker, "reauth-aio")

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=reauth.bootstrap, **_aio_auth(
            make_token(KEY1, "k1", sub="frank", now=time.time())))
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"before", partition=0)
            await asyncio.sleep(3.0)  # past the session's end: closed by the proxy
            await asyncio.wait_for(producer.send_and_wait(topic, b"after", partition=0), 20)
        finally:
            await producer.stop()

    asyncio.run(run())
    reauth.wait_for_log("session expired")  # then aiokafka logged in again, and went on
    # a connection left idle after its login: closed by the proxy at 2.5 s
    token = make_token(KEY1, "k1", sub="frank", now=time.time())
    with socket.create_connection(("127.0.0.1", reauth.port), timeout=10) as sock:
        sock.sendall(handshake(1, "OAUTHBEARER")
                     + authenticate(2, oauthbearer.client_first(token)))
        start = time.monotonic()
        frames = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            frames += chunk
        closed_after = time.monotonic() - start
    assert decode_authenticate(_frames(frames)[-1]).session_lifetime_ms == 2500
    assert 2.0 <= closed_after < 8, closed_after
    reauth.wait_for_log("session expired")


# passthrough: the broker verifies, the proxy binds the token's principal ----

@pytest.fixture(scope="module")
def passthrough(oauth, tmp_path_factory):
    """A passthrough kthrottle in front of the OAUTHBEARER one (the broker)."""
    tmp = tmp_path_factory.mktemp("oauth-pass")
    outer = ProxyProcess(oauth.bootstrap, tmp / "outer.log", [
        "--security-protocol", "SASL_PLAINTEXT", "--sasl-mode", "passthrough",
        "--sasl-enabled-mechanisms", "OAUTHBEARER"])
    outer.admin = free_port()
    outer.extra_args += ["--admin-listen", "127.0.0.1:%d" % outer.admin]
    outer.start()
    yield outer
    outer.stop()


def test_passthrough_binds_the_principal_the_broker_accepted(passthrough, oauth, broker):
    from kthrottle_testkit.clients import roundtrip_aiokafka

    view = roundtrip_aiokafka(passthrough, broker, **_aio_auth(
        make_token(KEY1, "k1", sub="grace", now=time.time())))
    assert view and {c["principal"] for c in view} == {"grace"}
    passthrough.wait_for_log("client authenticated as 'grace' with OAUTHBEARER (verified by "
                             "the broker")
    # a forged token naming grace: the broker refuses it, nothing is bound
    assert _refused(passthrough, make_token(OTHER, "k1", sub="heidi", now=time.time()))
    oauth.wait_for_log("OAUTHBEARER token refused: bad signature")
    time.sleep(0.3)
    assert "authenticated as 'heidi'" not in passthrough.log()


# the proxy's own OAUTHBEARER login to the brokers ----------------------------

def oauth_front(oauth, tmp, server, *extra):
    """A kthrottle in front of ``oauth`` that logs in to it as 'proxy' with a
    client credentials token from ``server``."""
    secret = tmp / "secret"
    secret.write_text("proxy-secret\n")
    return ProxyProcess(oauth.bootstrap, tmp / "front.log", [
        "--upstream-security-protocol", "SASL_PLAINTEXT",
        "--upstream-sasl-mechanism", "OAUTHBEARER",
        "--upstream-sasl-oauthbearer-token-endpoint-url", server.url("/token"),
        "--upstream-sasl-oauthbearer-client-id", "proxy",
        "--upstream-sasl-oauthbearer-client-secret-file", str(secret), *extra])


def test_the_proxy_logs_in_upstream_with_a_client_credentials_token(oauth, broker,
                                                                      tmp_path_factory):
    """A second kthrottle whose login to the OAUTHBEARER kthrottle (the
    "broker") uses a token from a local token endpoint, refreshed before it
    expires, the last one kept while the endpoint is down."""
    from aiokafka import AIOKafkaProducer

    tmp = tmp_path_factory.mktemp("oauth-upstream")
    server = OAuthServer(tmp, oauth.jwks, signing_key=KEY1, lifetime=4).start()
    front = oauth_front(oauth, tmp, server, "--upstream-sasl-oauthbearer-scope", "kafka")
    try:
        front.start()
        topic = _topic(broker, "upstream")

        async def produce(n):
            producer = AIOKafkaProducer(bootstrap_servers=front.bootstrap)
            await producer.start()
            try:
                for i in range(n):
                    await producer.send_and_wait(topic, b"v%d" % i, partition=0)
            finally:
                await producer.stop()

        asyncio.run(produce(5))
        oauth.wait_for_log("client authenticated as 'proxy' with OAUTHBEARER")
        # refreshed at 80% of its 4 s lifetime, before it expires
        deadline = time.monotonic() + 10
        while server.stats()["token"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.stats()["token"] >= 2 and server.stats()["refused"] == 0
        server.call("POST", "/down")
        asyncio.run(produce(2))  # the endpoint down: the last token, still valid, logs in
        front.wait_for_log("cannot refresh the token", timeout=10)  # a WARNING, retried
        server.call("POST", "/up")
        assert "proxy-secret" not in front.log() + oauth.log()
    finally:
        front.stop()
        server.stop()


def test_the_proxys_own_cluster_client_logs_in_with_its_token(oauth, tmp_path_factory):
    """--quota-source kafka behind an OAUTHBEARER login: the proxy's aiokafka
    client reads the quotas with the token from the token endpoint, as the
    admin principal 'proxy'."""
    tmp = tmp_path_factory.mktemp("oauth-quota-source")
    server = OAuthServer(tmp, oauth.jwks, signing_key=KEY1, lifetime=60).start()
    front = oauth_front(oauth, tmp, server, "--quota-source", "kafka", "--quota-refresh", "0.5s")
    try:
        front.start()
        front.wait_for_log("quotas from the cluster at %s over SASL_PLAINTEXT" % oauth.bootstrap)
        assert "1 entit" in front.log(), front.log()
        assert "proxy-secret" not in front.log() + oauth.log()
    finally:
        front.stop()
        server.stop()
