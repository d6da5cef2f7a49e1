"""TLS listeners (SSL, SASL_SSL) with certificates made here (trustme), real
clients, a kthrottle process and a real Tansu broker behind it."""
import datetime
import ssl
import uuid

import pytest
import trustme

from kthrottle.embedded import free_port
from kthrottle_testkit.clients import kthrottle_quotas, principals_of_roundtrip
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    ca = trustme.CA(organization_name="kthrottle tests")
    files = {"ca": tmp / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert("127.0.0.1", "localhost")
    files["server"] = tmp / "server.pem"
    files["server_key"] = tmp / "server.key"
    server.cert_chain_pems[0].write_to_path(str(files["server"]))
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(str(files["server"]), append=True)
    server.private_key_pem.write_to_path(str(files["server_key"]))

    def client(name, issuer=ca, **kw):
        leaf = issuer.issue_cert("%s@example.com" % name.lower(), common_name=name,
                                 organization_unit_name="team", organization_name="org", **kw)
        cert, key = tmp / ("%s.pem" % name), tmp / ("%s.key" % name)
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)

    files["alice"] = client("Alice")
    files["expired"] = client("Old", not_before=datetime.datetime(2020, 1, 1),
                              not_after=datetime.datetime(2021, 1, 1))
    files["stranger"] = client("Stranger", issuer=trustme.CA())
    return {k: (v if isinstance(v, tuple) else str(v)) for k, v in files.items()}


def _proxy(broker, tmp, pki, protocol, *extra):
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp / ("%s.log" % protocol),
                     ["--security-protocol", protocol, "--ssl-cert", pki["server"],
                      "--ssl-key", pki["server_key"], "--admin-listen", "127.0.0.1:%d" % admin,
                      *extra])
    p.admin = admin
    return p


def test_mtls_principal_is_the_mapped_subject_and_all_clients_connect(broker, tmp_path, pki):
    from aiokafka.helpers import create_ssl_context

    rules = "RULE:^CN=([^,]*),OU=team,O=org$/$1/L,DEFAULT"
    p = _proxy(broker, tmp_path, pki, "SSL", "--ssl-ca", pki["ca"], "--ssl-client-auth",
               "required", "--ssl-principal-mapping-rules", rules).start()
    try:
        cert, key = pki["alice"]
        context = create_ssl_context(cafile=pki["ca"], certfile=cert, keyfile=key)
        principals = principals_of_roundtrip(p, broker, security_protocol="SSL", ssl_context=context)
        assert principals and set(principals) == {"alice"}

        import confluent_kafka

        producer = confluent_kafka.Producer({
            "bootstrap.servers": p.bootstrap, "security.protocol": "SSL",
            "ssl.ca.location": pki["ca"], "ssl.certificate.location": cert,
            "ssl.key.location": key})
        topic = "tls-ck-%s" % uuid.uuid4().hex[:8]
        broker.create_topic(topic, partitions=1)
        for i in range(10):
            producer.produce(topic, b"x%d" % i, partition=0)
        assert producer.flush(30) == 0

        from kafka import KafkaProducer

        kp = KafkaProducer(bootstrap_servers=p.bootstrap, security_protocol="SSL",
                           ssl_cafile=pki["ca"], ssl_certfile=cert, ssl_keyfile=key)
        try:
            assert kp.send(topic, b"kp", partition=0).get(30).offset == 10
        finally:
            kp.close()
    finally:
        p.stop()


def _email_subject_certificate(tmp):
    """A CA of its own and a client certificate whose subject carries an
    emailAddress attribute, as many corporate CAs issue them (trustme writes
    no such subjects); returns (ca, cert, key) file names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(*attributes):
        return x509.Name([x509.NameAttribute(oid, value) for oid, value in attributes])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = name((NameOID.COMMON_NAME, "email test ca"))
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(name((NameOID.ORGANIZATION_NAME, "org"),
                               (NameOID.ORGANIZATIONAL_UNIT_NAME, "team"),
                               (NameOID.COMMON_NAME, "Carol"),
                               (NameOID.EMAIL_ADDRESS, "carol@example.com")))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    files = tmp / "email-ca.pem", tmp / "carol.pem", tmp / "carol.key"
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tuple(str(f) for f in files)


def test_a_kafka_rule_maps_a_subject_with_an_email_address(broker, tmp_path, pki):
    """Kafka's principal is Java's X500Principal.getName(): emailAddress has no
    RFC 2253 keyword, so it is written as its OID and the hex of its DER value,
    and a rule written for a broker must match that form here too."""
    from aiokafka.helpers import create_ssl_context

    ca, cert, key = _email_subject_certificate(tmp_path)
    rules = r"RULE:^1\.2\.840\.113549\.1\.9\.1=#16[0-9a-f]+,CN=([^,]+),OU=team,O=org$/$1/L"
    p = _proxy(broker, tmp_path, pki, "SSL", "--ssl-ca", ca, "--ssl-client-auth", "required",
               "--ssl-principal-mapping-rules", rules).start()
    try:
        context = create_ssl_context(cafile=pki["ca"], certfile=cert, keyfile=key)
        principals = principals_of_roundtrip(p, broker, security_protocol="SSL",
                                             ssl_context=context)
        assert principals and set(principals) == {"carol"}
    finally:
        p.stop()


@pytest.mark.parametrize("who", [None, "expired", "stranger"])
def test_a_client_without_a_valid_certificate_is_refused_when_one_is_required(
        broker, tmp_path, pki, who):
    p = _proxy(broker, tmp_path, pki, "SSL", "--ssl-ca", pki["ca"],
               "--ssl-client-auth", "required").start()
    try:
        context = ssl.create_default_context(cafile=pki["ca"])
        if who is not None:
            context.load_cert_chain(*pki[who])
        import socket

        raw = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"\x00\x00\x00\x0a" + b"\x00" * 10)  # TLS 1.3 reports it on read
                if s.recv(10) == b"":
                    raise ConnectionError("closed")
        assert p.alive()
        assert "connection 1 opened" not in p.log()  # no broker connection was made for it
    finally:
        p.stop()


def test_sasl_over_tls_binds_the_sasl_user(broker, tmp_path, pki):
    from aiokafka.helpers import create_ssl_context

    creds = tmp_path / "creds.toml"
    done = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "users",
                            "--entity-name", "bob", "--add-config",
                            "SCRAM-SHA-256=[password=bob-secret]")
    assert done.returncode == 0, done.stderr
    p = _proxy(broker, tmp_path, pki, "SASL_SSL", "--credentials-file", str(creds)).start()
    try:
        principals = principals_of_roundtrip(
            p, broker, security_protocol="SASL_SSL",
            ssl_context=create_ssl_context(cafile=pki["ca"]), sasl_mechanism="SCRAM-SHA-256",
            sasl_plain_username="bob", sasl_plain_password="bob-secret")
        assert set(principals) == {"bob"}
    finally:
        p.stop()


def test_a_bad_certificate_file_is_a_clear_error(tmp_path, pki):
    import subprocess
    import sys

    from kthrottle_testkit import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", "127.0.0.1:1",
         "--listen", "127.0.0.1:%d" % free_port(), "--security-protocol", "SSL",
         "--ssl-cert", str(tmp_path / "missing.pem"), "--ssl-key", pki["server_key"]],
        capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode != 0
    assert "cannot load the listeners' TLS certificate" in out.stderr
    assert "Traceback" not in out.stderr



def test_upstream_sasl_ssl_with_the_proxys_own_credentials(broker, tmp_path, pki, request):
    """A plaintext proxy whose upstream is SASL_SSL with its own identity, in
    front of a terminating SASL_SSL proxy, in front of Tansu."""
    creds = tmp_path / "creds.toml"
    done = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "users",
                            "--entity-name", "edge-proxy", "--add-config",
                            "SCRAM-SHA-512=[password=edge-secret]")
    assert done.returncode == 0, done.stderr
    inner = _proxy(broker, tmp_path, pki, "SASL_SSL", "--credentials-file", str(creds)).start()
    request.addfinalizer(inner.stop)  # however the test ends
    password = tmp_path / "password"
    password.write_text("edge-secret\n")
    upstream = ["--upstream-security-protocol", "SASL_SSL", "--upstream-ssl-ca", pki["ca"],
                "--upstream-sasl-mechanism", "SCRAM-SHA-512",
                "--upstream-sasl-username", "edge-proxy"]
    outer = ProxyProcess(inner.bootstrap, tmp_path / "outer.log",
                         upstream + ["--upstream-sasl-password-file", str(password)])
    outer.admin = free_port()
    outer.extra_args += ["--admin-listen", "127.0.0.1:%d" % outer.admin]
    outer.start()
    try:
        principals_of_roundtrip(outer, broker)
        inner.wait_for_log("client authenticated as 'edge-proxy' with SCRAM-SHA-512")
        assert "edge-secret" not in outer.log() + inner.log()
    finally:
        outer.stop()
    # a wrong password: the outer proxy's connections close with the reason
    password.write_text("not-it\n")
    bad = ProxyProcess(inner.bootstrap, tmp_path / "bad.log",
                       upstream + ["--upstream-sasl-password-file", str(password)]).start()
    try:
        import socket
        import struct

        s = socket.create_connection(("127.0.0.1", bad.port), timeout=10)
        s.sendall(struct.pack(">ihhih", 10, 18, 0, 1, 0))  # ApiVersions v0
        assert s.recv(100) == b""
        s.close()
        bad.wait_for_log("refused the proxy's SCRAM-SHA-512 login as 'edge-proxy'")
        assert "not-it" not in bad.log()
    finally:
        bad.stop()


def test_requested_client_certificates_are_optional(broker, tmp_path, pki):
    """ssl.client.auth=requested: a client with a certificate gets its subject
    as principal, one without is ANONYMOUS, and both are served."""
    from aiokafka.helpers import create_ssl_context

    p = _proxy(broker, tmp_path, pki, "SSL", "--ssl-ca", pki["ca"],
               "--ssl-client-auth", "requested").start()
    try:
        cert, key = pki["alice"]
        with_cert = principals_of_roundtrip(p, broker, security_protocol="SSL", ssl_context=
                                        create_ssl_context(cafile=pki["ca"], certfile=cert,
                                                           keyfile=key))
        assert set(with_cert) == {"CN=Alice,OU=team,O=org"}
        without = principals_of_roundtrip(p, broker, security_protocol="SSL",
                                      ssl_context=create_ssl_context(cafile=pki["ca"]))
        assert set(without) == {"ANONYMOUS"}
    finally:
        p.stop()


class _Recorded:
    """A transport's write calls, as a TLS transport receives them."""

    def __init__(self):
        self.calls = []

    def write(self, data):
        self.calls.append(("write", bytes(data)))

    def writelines(self, chunks):
        self.calls.append(("writelines", [bytes(c) for c in chunks]))


def test_small_pieces_of_a_frame_go_to_tls_as_one_write():
    from kthrottle.proxy.connection import TLS_JOIN_MAX, tls_writes

    t = _Recorded()
    head, tail = b"\x00\x00\x00\x10" + b"h" * 8, memoryview(b"t" * 8)
    tls_writes(t, [head, tail])  # one record instead of two
    tls_writes(t, [head])
    big = [b"x" * TLS_JOIN_MAX, b"y"]  # large: no copy, records of their own anyway
    tls_writes(t, big)
    assert t.calls == [("write", head + b"t" * 8), ("writelines", [head]),
                       ("writelines", big)]
