"""Stopping and reloading a kthrottle process in front of a real Tansu broker:
SIGTERM drains (what is in flight is answered, nothing new is accepted or
read, the process exits 0), SIGHUP re-reads the quota file, the credentials
file and the TLS certificates and keys while live connections stay up."""
import os
import signal
import socket
import ssl
import struct
import time
import uuid
import warnings

import pytest
import trustme

from kthrottle.config import ConfigError, build_config, load_toml
from kthrottle.embedded import free_port
from kthrottle_testkit.clients import (produce_quotas, scram_credentials_file, scram_login,
                                       wait_until)
from kthrottle_testkit.proxy import ProxyProcess
from test_pipeline import (
    Harness,
    api_versions_req,
    cids,
    metadata_req,
    produce_req,
    produce_resp,
    req_cids,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest

pytestmark = pytest.mark.integration


def fetch_req(topic, correlation_id, max_wait_ms):
    """A Fetch of an empty partition: the broker holds it for about max_wait_ms."""
    F = FetchRequest
    part = F.FetchTopic.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=1 << 20)
    req = F[4](replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=1 << 20,
               isolation_level=0, topics=[F.FetchTopic(topic=topic, partitions=[part])])
    req.with_header(correlation_id=correlation_id, client_id="lifecycle")
    return req.encode(header=True, framed=True)


def read_frame(sock, timeout=20.0):
    """One response frame, or None when the connection closes first (a
    socket closed with unread input, a request the proxy did not read, is
    reset rather than shut down: what was delivered before is read first)."""
    sock.settimeout(timeout)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack_from(">i", data)[0]:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            assert not data, "the connection closed in the middle of a frame"
            return None
        data += chunk
    assert len(data) == 4 + struct.unpack_from(">i", data)[0], "more than one frame"
    return data


def correlation_ids_until_closed(sock, timeout=20.0):
    ids = []
    while (frame := read_frame(sock, timeout)) is not None:
        ids.append(struct.unpack_from(">i", frame, 4)[0])
    return ids


def refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def topic(broker):
    name = "life-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(name, partitions=1)
    return name


# SIGTERM ----------------------------------------------------------------------

def test_sigterm_answers_what_is_in_flight_reads_nothing_new_and_exits_0(broker, tmp_path, topic):
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log").start()
    try:
        idle = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        busy = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        # one write, one read by the proxy: once the first answer is back, the
        # bytes behind it have been read (and a whole request sent on)
        busy.sendall(metadata_req(1) + fetch_req(topic, 2, 2000))
        assert struct.unpack_from(">i", read_frame(busy), 4)[0] == 1
        halfway = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        split = fetch_req(topic, 4, 1500)
        halfway.sendall(api_versions_req(3) + split[:20])  # a request part-way in
        assert struct.unpack_from(">i", read_frame(halfway), 4)[0] == 3
        p.wait_for_log("for node 111")  # the Metadata answer opened the node's listener

        os.kill(p.proc.pid, signal.SIGTERM)
        p.wait_for_log("SIGTERM: draining")
        busy.sendall(fetch_req(topic, 5, 100))  # sent during the drain: never read
        halfway.sendall(split[20:] + fetch_req(topic, 6, 100))  # read to its end, no further
        assert refused(p.port) and refused(p.node_port)
        assert idle.recv(1) == b""  # nothing owed: closed at once
        assert correlation_ids_until_closed(busy) == [2]
        assert correlation_ids_until_closed(halfway) == [4]
        assert p.proc.wait(20) == 0
        log = p.log()
        assert "SIGTERM: draining 3 connections with 1 requests in flight" in log
        assert "drained in" in log and "2 requests finished, 0 cut at drain-timeout-ms" in log
        assert log.count("proxy stopping (SIGTERM), no response owed") == 3
    finally:
        p.stop()


def test_clients_carry_on_across_a_proxy_restart(broker, tmp_path, topic):
    """The proxy is stopped (SIGTERM) and started again on the same ports
    under a running producer and consumer: neither is restarted, every
    record acknowledged is read back once, in order."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log").start()

    async def send(producer, value, deadline):
        while True:  # what a client does when its broker goes away: retry
            try:
                return await asyncio.wait_for(producer.send_and_wait(topic, value), 10)
            except Exception:
                assert time.monotonic() < deadline, p.log()[-2000:]
                await asyncio.sleep(0.1)

    async def run():
        loop = asyncio.get_running_loop()
        producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, acks="all",
                                    request_timeout_ms=5000, retry_backoff_ms=100)
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=p.bootstrap,
                                    auto_offset_reset="earliest")
        await producer.start()
        await consumer.start()
        got = []
        try:
            deadline = time.monotonic() + 60
            for i in range(20):
                await send(producer, b"%03d" % i, deadline)
            await loop.run_in_executor(None, p.stop)
            assert p.proc.returncode == 0
            await loop.run_in_executor(None, p.start)
            for i in range(20, 40):
                await send(producer, b"%03d" % i, deadline)
            while len(got) < 40:
                assert time.monotonic() < deadline, got
                for messages in (await consumer.getmany(timeout_ms=500)).values():
                    got += [m.value for m in messages]
        finally:
            await producer.stop()
            await consumer.stop()
        return got

    try:
        assert asyncio.run(run()) == [b"%03d" % i for i in range(40)]
    finally:
        p.stop()


def test_drain_timeout_ms_comes_from_the_flag_or_the_config_file(tmp_path):
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["k1:9092"]\ndrain-timeout-ms = 5000\n')
    assert build_config(load_toml(path), {}).drain_timeout_ms == 5000
    assert build_config(load_toml(path), {"drain_timeout_ms": 0}).drain_timeout_ms == 0
    assert build_config({"bootstrap_servers": [("k1", 9092)]}, {}).drain_timeout_ms == 30000
    with pytest.raises(ConfigError, match="drain-timeout-ms must not be negative"):
        build_config(load_toml(path), {"drain_timeout_ms": -1})


@pytest.mark.parametrize("cut_by", ["drain-timeout-ms", "SIGTERM"])
def test_a_drain_cut_short_closes_what_is_left_and_exits_0(broker, tmp_path, topic, cut_by):
    flags = ["--drain-timeout-ms", "300"] if cut_by == "drain-timeout-ms" else []
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log", flags).start()
    try:
        s = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        s.sendall(api_versions_req(1) + fetch_req(topic, 2, 20000))
        assert struct.unpack_from(">i", read_frame(s), 4)[0] == 1
        os.kill(p.proc.pid, signal.SIGTERM)
        if cut_by == "SIGTERM":  # a second one ends the drain at once
            p.wait_for_log("SIGTERM: draining")
            os.kill(p.proc.pid, signal.SIGTERM)
        assert correlation_ids_until_closed(s) == []  # cut, never half a frame
        assert p.proc.wait(15) == 0
        log = p.log()
        assert "SIGTERM: draining 1 connections with 1 requests in flight" in log
        assert "0 requests finished, 1 cut at %s" % cut_by in log
        assert "1 responses still owed at %s" % cut_by in log
    finally:
        p.stop()


def test_a_draining_connection_reads_to_the_end_of_its_request_and_no_further():
    """The pipeline: a request part-way in is read whole and sent on; the
    one after it stays unread (no I/O here)."""
    h = Harness()
    assert h.conn.stop_reading() is True  # between requests: stop at once
    h = Harness()
    first, second = produce_req(1, nbytes=4000), produce_req(2)
    h.client(first[:100])
    assert h.conn.stop_reading() is False
    h.client(first[100:] + second)
    assert req_cids(h.take_broker()) == [1]
    assert h.client_paused_until == float("inf")  # until the connection closes
    assert h.conn.requests_in.at_boundary
    assert h.conn.in_flight == 1
    answer = produce_resp(1)
    h.broker(answer[:10])
    assert h.conn.in_flight == 1  # part of its response's head
    h.broker(answer[10:-3])
    assert h.conn.in_flight == 1  # all but the end of its response
    h.broker(answer[-3:])
    assert cids(h.take_client()) == [1]
    assert h.conn.in_flight == 0


# SIGHUP -----------------------------------------------------------------------

def test_free_port_never_hands_out_a_port_twice():
    # a test picks an admin port, then ProxyProcess picks its own: the kernel
    # may return one free port to consecutive binds, and the proxy would then
    # fail to bind its second listener
    ports = [free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:  # and each is free to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_sighup_rereads_the_quota_file_and_keeps_live_connections(broker, tmp_path, topic):
    import confluent_kafka

    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."reload-app"]\nproducer_byte_rate = 1000000\n')
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", "127.0.0.1:%d" % admin])
    p.start()
    producer = confluent_kafka.Producer({"bootstrap.servers": p.bootstrap,
                                         "client.id": "reload-app"})
    try:
        producer.produce(topic, b"before", partition=0)
        assert producer.flush(30) == 0
        before = wait_until(lambda: produce_quotas(admin, "reload-app"), timeout=10)
        assert set(before.values()) == {(1000000, "clients/reload-app")}

        # a bad version: refused when it settles, refused and said again on SIGHUP
        quotas.write_text('[clients."reload-app"\n')
        refusal = "is not valid TOML"
        p.wait_for_log(refusal)
        os.kill(p.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: p.log().count(refusal) == 2, timeout=10), p.log()
        assert set(produce_quotas(admin, "reload-app").values()) == {
            (1000000, "clients/reload-app")}

        quotas.write_text('[clients."reload-app"]\nproducer_byte_rate = 2000000\n')
        os.kill(p.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: set(produce_quotas(admin, "reload-app").values())
                          == {(2000000, "clients/reload-app")}, timeout=10)
        assert produce_quotas(admin, "reload-app").keys() == before.keys()  # same connections
        p.wait_for_log("SIGHUP: re-reading quota file %s" % quotas)
        producer.produce(topic, b"after", partition=0)
        assert producer.flush(30) == 0
    finally:
        producer.flush(5)
        p.stop()


def test_sighup_rereads_the_credentials_file_and_keeps_live_logins(broker, tmp_path, topic):
    import confluent_kafka

    credentials = scram_credentials_file(tmp_path / "credentials.toml",
                                         {"alice": "alice-secret"}, ("SCRAM-SHA-512",))
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file",
                      str(credentials)]).start()
    alice = confluent_kafka.Producer({
        "bootstrap.servers": p.bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice",
        "sasl.password": "alice-secret"})
    try:
        alice.produce(topic, b"before", partition=0)
        assert alice.flush(30) == 0
        assert not scram_login(p.bootstrap, "bob", "bob-secret")

        scram_credentials_file(credentials, {"bob": "bob-secret"}, ("SCRAM-SHA-512",))
        os.kill(p.proc.pid, signal.SIGHUP)
        p.wait_for_log("SIGHUP: re-reading credentials file %s" % credentials)
        p.wait_for_log("credentials reloaded from credentials file %s: 2 users" % credentials)
        assert scram_login(p.bootstrap, "bob", "bob-secret")

        logins = p.log().count("client authenticated as 'alice'")
        alice.produce(topic, b"after", partition=0)
        assert alice.flush(30) == 0
        assert p.log().count("client authenticated as 'alice'") == logins  # same connections
        assert "bob-secret" not in p.log()
    finally:
        alice.flush(5)
        p.stop()


def _write_atomically(path, data):
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _der(leaf):
    return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())


def _tls(port, ca):
    context = ssl.create_default_context()
    ca.configure_trust(context)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        return context.wrap_socket(sock, server_hostname="127.0.0.1")
    except BaseException:
        sock.close()
        raise


def _answered(sock, correlation_id):
    sock.sendall(api_versions_req(correlation_id))
    return struct.unpack_from(">i", read_frame(sock), 4)[0] == correlation_id


def test_sighup_and_file_changes_reload_the_tls_certificates(broker, tmp_path):
    old_ca, new_ca = trustme.CA(), trustme.CA()
    old, new = old_ca.issue_cert("127.0.0.1"), new_ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"

    def install(certificate, private_key):
        _write_atomically(cert, certificate.cert_chain_pems[0].bytes())
        _write_atomically(key, private_key.private_key_pem.bytes())

    install(old, old)
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--security-protocol", "SSL", "--ssl-cert", str(cert), "--ssl-key", str(key),
                      "--admin-listen", "127.0.0.1:%d" % admin, "--admin-ssl-cert", str(cert),
                      "--admin-ssl-key", str(key)]).start()
    listeners = "TLS certificate and key reloaded from the listeners' TLS ("
    admin_endpoint = "TLS certificate and key reloaded from the admin endpoint's TLS ("
    kept = "the last known TLS certificate and key stay in force"
    try:
        live = _tls(p.port, old_ca)
        assert _answered(live, 1)

        install(new, new)
        os.kill(p.proc.pid, signal.SIGHUP)
        p.wait_for_log(listeners)
        p.wait_for_log(admin_endpoint)
        assert _answered(live, 2)  # the live connection carries on
        fresh = _tls(p.port, new_ca)
        assert fresh.getpeercert(binary_form=True) == _der(new) and _answered(fresh, 3)
        with pytest.raises(ssl.SSLCertVerificationError):
            _tls(p.port, old_ca)
        served = ssl.get_server_certificate(("127.0.0.1", admin), timeout=10)
        assert ssl.PEM_cert_to_DER_cert(served) == _der(new)

        # a key that does not match the certificate, then a certificate file
        # that holds none: each logged, the certificate in force stays
        install(old, new)
        os.kill(p.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: p.log().count(kept) >= 2, timeout=10), p.log()[-3000:]
        assert "KEY_VALUES_MISMATCH" in p.log()
        _write_atomically(cert, b"not a certificate\n")
        os.kill(p.proc.pid, signal.SIGHUP)
        p.wait_for_log("%s holds no PEM certificate" % cert)
        assert _tls(p.port, new_ca).getpeercert(binary_form=True) == _der(new)
        served = ssl.get_server_certificate(("127.0.0.1", admin), timeout=10)
        assert ssl.PEM_cert_to_DER_cert(served) == _der(new)

        # valid files again, no signal: taken once the change settles
        install(old, old)
        assert wait_until(lambda: p.log().count(listeners) == 2, timeout=15), p.log()[-3000:]
        assert _tls(p.port, old_ca).getpeercert(binary_form=True) == _der(old)
        assert _answered(live, 4) and _answered(fresh, 5)
        assert p.alive()
    finally:
        p.stop()
