"""A broker that is down looks down through the proxy: its listener refuses
connections as the broker's own port would, says so once, and listens again
when the broker is back; clients recover on their own (no proxy restart).
The broker is an Apache Kafka node of each test's own (node id 111), started,
killed and started again by the test on the same port."""
import asyncio
import re
import socket
import struct
import time
import urllib.request

import pytest

from kthrottle.kafka_kit import KafkaBroker
from kthrottle_testkit import BROKER_NODE_ID
from kthrottle_testkit.proxy import ProxyProcess

from kthrottle.embedded import free_port

pytestmark = pytest.mark.integration


# After a kill -9 the controller (in the same JVM) takes the restarted node's registration only
# once the old one's session has expired (DUPLICATE_BROKER_REGISTRATION until then): 4 s, not
# the default 9 s, as kthrottle/kafka_kit.py's cluster_settings have it.
QUICK_REREGISTRATION = {"broker.session.timeout.ms": "4000", "broker.heartbeat.interval.ms": "500"}


def _kafka(tmp_path):
    """An Apache Kafka node of the test's own, not started: its port is chosen already. Its
    data is kept across a stop or kill and the start after it (removed by ``stop(keep=False)``
    at the end)."""
    return KafkaBroker(node_id=BROKER_NODE_ID, workdir=tmp_path / "kafka",
                       log_path=tmp_path / "kafka.log", keep=True, config=QUICK_REREGISTRATION)


def _api_versions(correlation_id):
    body = struct.pack(">hhih", 18, 0, correlation_id, -1)
    return struct.pack(">i", len(body)) + body


def _connect(port, timeout=5.0):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _answers_api_versions(port):
    try:
        with _connect(port) as s:
            s.sendall(_api_versions(7))
            head = s.recv(10)
            return len(head) >= 8 and struct.unpack_from(">i", head, 4)[0] == 7
    except OSError:
        return False


def _refused(port):
    """True when a connection to ``port`` is refused outright."""
    try:
        with _connect(port, timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # accepted as the listener closed: not refused yet
        return False


def _wait(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError("not within %g s: %s" % (timeout, what))


def _metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        return r.read().decode()


def _metric(text, name, labels):
    m = re.search(r"^%s\{%s\} ([0-9.e+]+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else None


def test_the_bootstrap_listener_refuses_while_no_broker_answers_and_says_so_once(tmp_path):
    broker = _kafka(tmp_path)
    port = broker.port  # where the broker will be: nothing there yet
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--admin-listen", "127.0.0.1:%d" % admin]).start()
    try:
        # the first client is accepted before anything is known, and turned away
        with _connect(p.port) as s:
            s.sendall(_api_versions(1))
            assert s.recv(100) == b""
        p.wait_for_log("bootstrap listener: no broker answers")
        # from then on the proxy's port refuses, as the broker's does
        started = time.monotonic()
        assert all(_refused(p.port) for _ in range(50))
        assert _refused(port)  # the broker's own, for comparison
        assert time.monotonic() - started < 5  # refused outright, not timed out
        text = _metrics(admin)
        assert _metric(text, "kthrottle_broker_reachable", 'listener="bootstrap"') == 0
        assert _metric(text, "kthrottle_connections_refused_total",
                       'reason="broker_unreachable"') == 1
        # the broker starts (a JVM: seconds): the proxy listens again on its own
        broker.start()
        _wait(lambda: _answers_api_versions(p.port), 30, "the proxy listens again")
        p.wait_for_log("bootstrap listener: a broker answers again")
        log = p.log()
        assert log.count("no broker answers") == 1, log
        assert "1 client connection(s) were turned away meanwhile" in log
        # per connection: nothing above DEBUG
        assert "closed: no broker reachable" not in log
        assert _metric(_metrics(admin), "kthrottle_broker_reachable", 'listener="bootstrap"') == 1
        assert p.alive()
    finally:
        p.stop()
        broker.stop(keep=False)


def test_a_broker_restart_through_the_node_listener(tmp_path):
    """The broker dies under a running producer and starts again on the same
    port: the node listener refuses meanwhile, then serves again, and the
    same producer (not restarted, nor is the proxy) gets its records through.
    Kafka keeps its data across the kill: the topic and the record sent before
    it are there after the restart."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    broker = _kafka(tmp_path)
    p = None
    topic = "restart-%d" % broker.port
    try:
        broker.start()
        p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log").start()
        broker.create_topic(topic)

        async def run():
            producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, acks="all",
                                        request_timeout_ms=3000, retry_backoff_ms=100)
            await producer.start()
            try:
                await producer.send_and_wait(topic, b"before")
                loop = asyncio.get_running_loop()
                broker.kill()  # SIGKILL: no goodbye to anyone
                # the node listener stops listening once the loss is seen
                deadline = loop.time() + 5
                while not await loop.run_in_executor(None, _refused, p.node_port):
                    assert loop.time() < deadline, p.log()[-2000:]
                    await asyncio.sleep(0.02)
                # started again on its data (the topic is still there), from this thread
                # (the broker gets SIGTERM when the thread that started it ends), and
                # awaited elsewhere: the producer's loop runs on meanwhile
                broker.launch()
                await loop.run_in_executor(None, broker.wait_ready, 90.0)
                sent = loop.time()
                while True:  # the producer's own retries, until its buffer times out
                    try:
                        await asyncio.wait_for(producer.send_and_wait(topic, b"after"), 30)
                        break
                    except Exception:
                        assert loop.time() - sent < 60, p.log()[-2000:]
                        await asyncio.sleep(0.1)
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(topic, bootstrap_servers=p.bootstrap,
                                        auto_offset_reset="earliest")
            await consumer.start()
            got = []
            try:
                while len(got) < 2:
                    got.append((await asyncio.wait_for(consumer.getone(), 30)).value)
            finally:
                await consumer.stop()
            return got

        # the restarted broker kept the record sent before the kill
        assert asyncio.run(run()) == [b"before", b"after"]
        log = p.log()
        assert "node %d listener: no broker answers" % BROKER_NODE_ID in log, log
        assert "node %d listener: a broker answers again" % BROKER_NODE_ID in log, log
        assert p.alive()
    finally:
        if p is not None:
            p.stop()
        broker.stop(keep=False)
