"""Real clients through a real proxy process in front of a real Apache Kafka broker."""
import asyncio
import socket
import struct
import time
import uuid

import psutil
import pytest

from kthrottle.codecs import FrameReader

pytestmark = pytest.mark.integration


def topic_name(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


@pytest.fixture(autouse=True)
def _sockets_before():
    """The sockets this process had before the test: the session's broker outlives every
    module, and a client of an earlier test may not have closed its connection to it yet."""
    global _OPEN_BEFORE
    _OPEN_BEFORE = {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.raddr}
    yield


_OPEN_BEFORE = set()


def assert_connections_only_to_proxy(proxy, broker):
    """No socket this test's clients opened reaches the broker's own port."""
    remote = [c.raddr for c in psutil.Process().net_connections(kind="tcp")
              if c.raddr and c.laddr not in _OPEN_BEFORE]
    ports = {r.port for r in remote}
    assert broker.port not in ports, "a client connected around the proxy: %s" % remote
    assert ports & proxy.ports, "no client connection to the proxy at all: %s" % remote
    # after bootstrap, clients talk to the per-node listener
    assert proxy.node_port in ports, remote


def expected_records(partitions, per_partition):
    return {p: [b"p%d-%05d" % (p, i) for i in range(per_partition)] for p in range(partitions)}


def test_aiokafka_group_produce_consume_commit(proxy, broker):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = topic_name("aio")
    broker.create_topic(topic, partitions=3)
    expected = expected_records(3, 200)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            futures = [await producer.send(topic, value, partition=p)
                       for i in range(200) for p, values in expected.items() for value in [values[i]]]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(topic, bootstrap_servers=proxy.bootstrap, group_id="g-" + topic,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        got = {p: [] for p in expected}
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while sum(map(len, got.values())) < 600:
                assert asyncio.get_running_loop().time() < deadline, got
                batches = await consumer.getmany(timeout_ms=1000)
                for tp, messages in batches.items():
                    got[tp.partition] += [m.value for m in messages]
            await consumer.commit()
            assert_connections_only_to_proxy(proxy, broker)
        finally:
            await consumer.stop()

        again = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap, group_id="g-" + topic)
        await again.start()
        try:
            committed = [await again.committed(TopicPartition(topic, p)) for p in expected]
        finally:
            await again.stop()
        return got, committed

    got, committed = asyncio.run(run())
    assert got == expected  # every record, in order per partition
    assert committed == [200, 200, 200]


def test_confluent_kafka_produce_consume(proxy, broker):
    import confluent_kafka

    topic = topic_name("ck")
    broker.create_topic(topic, partitions=3)
    expected = expected_records(3, 300)
    producer = confluent_kafka.Producer({"bootstrap.servers": proxy.bootstrap, "linger.ms": 5})
    for i in range(300):
        for p in expected:
            producer.produce(topic, expected[p][i], partition=p)
        producer.poll(0)
    assert producer.flush(30) == 0

    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": proxy.bootstrap, "group.id": "g-" + topic,
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })
    got = {p: [] for p in expected}
    try:
        consumer.subscribe([topic])
        for _ in range(600):
            if sum(map(len, got.values())) == 900:
                break
            for message in consumer.consume(500, timeout=1.0):
                assert message.error() is None, message.error()
                got[message.partition()].append(message.value())
        assert_connections_only_to_proxy(proxy, broker)
    finally:
        consumer.close()
    assert got == expected


def test_kafka_python_produce_consume(proxy, broker):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = topic_name("kp")
    broker.create_topic(topic, partitions=3)
    expected = expected_records(3, 100)
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, acks=1, linger_ms=5)
    try:
        futures = [producer.send(topic, expected[p][i], partition=p) for i in range(100) for p in expected]
        producer.flush(30)
        assert all(f.succeeded() for f in futures)
    finally:
        producer.close()
    # kafka-python consumer groups stall against Tansu: assign.
    consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=20000)
    got = {p: [] for p in expected}
    try:
        consumer.assign([TopicPartition(topic, p) for p in expected])
        for message in consumer:
            got[message.partition].append(message.value)
            if sum(map(len, got.values())) == 300:
                break
        assert_connections_only_to_proxy(proxy, broker)
    finally:
        consumer.close()
    assert got == expected


def test_admin_creates_topic_through_proxy(proxy, broker):
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = topic_name("admin")

    async def run():
        admin = AIOKafkaAdminClient(bootstrap_servers=proxy.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
            # CreateTopics is answered once the controller has the topic; the broker's
            # Metadata may name it a moment later
            deadline = time.monotonic() + 15
            while True:
                topics = await admin.list_topics()
                if topic in topics or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            described = await admin.describe_topics([topic])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
        await producer.start()
        try:
            partitions = await producer.partitions_for(topic)
            meta = await producer.send_and_wait(topic, b"hello", partition=1)
        finally:
            await producer.stop()
        return topics, described, partitions, meta

    topics, described, partitions, meta = asyncio.run(run())
    assert topic in topics
    assert len(described[0]["partitions"]) == 2
    assert partitions == {0, 1}
    assert meta.partition == 1 and meta.offset == 0


def test_acks_0_produce_keeps_the_connection_in_step(proxy, broker):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = topic_name("acks0")
    broker.create_topic(topic, partitions=1)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap, acks=0, linger_ms=0)
        await producer.start()
        try:
            for i in range(50):
                await producer.send(topic, b"%d" % i, partition=0)
                await producer.flush()
            # later requests on the same connection must still get their own answers
            await producer.client.force_metadata_update()
            assert await producer.partitions_for(topic) == {0}
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        got = []
        try:
            consumer.assign([TopicPartition(topic, 0)])
            while len(got) < 50:
                batch = await asyncio.wait_for(consumer.getone(), 20)
                got.append(batch.value)
        finally:
            await consumer.stop()
        return got

    assert asyncio.run(run()) == [b"%d" % i for i in range(50)]
    assert "correlation id" not in proxy.log()


def test_acks_0_produce_is_held_to_the_request_quota(broker, tmp_path):
    """Kafka exempts acks=0 from request quotas; through the proxy a client
    that sends acks=0 is held to its request_rate: it is not read while it
    owes the time, so its records reach the broker at the quota's pace."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from kthrottle_testkit.proxy import ProxyProcess

    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."acks0"]\nrequest_rate = 5\n')
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas)]).start()
    topic = topic_name("acks0q")
    broker.create_topic(topic, partitions=1)

    async def count(consumer):
        got = 0
        for records in (await consumer.getmany(timeout_ms=500)).values():
            got += len(records)
        return got

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, acks=0, linger_ms=0,
                                    client_id="acks0")
        await producer.start()
        consumer = AIOKafkaConsumer(bootstrap_servers=p.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            for i in range(40):  # one request each
                await producer.send(topic, b"%d" % i, partition=0)
                await producer.flush()
            sent = asyncio.get_running_loop().time()
            consumer.assign([TopicPartition(topic, 0)])
            early = await count(consumer)
            while asyncio.get_running_loop().time() - sent < 1.5:
                early += await count(consumer)
            total = early
            while total < 40 and asyncio.get_running_loop().time() - sent < 30:
                total += await count(consumer)
            return early, total
        finally:
            await consumer.stop()
            await producer.stop()

    try:
        early, total = asyncio.run(run())
        assert early <= 20, early  # 5/s after a 1 s burst: about 9 in 1.5 s (all 40 before)
        assert total == 40
    finally:
        p.stop()


def _raw_connect(proxy):
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    return s


def _read_frame(sock):
    reader = FrameReader()
    while True:
        data = sock.recv(65536)
        if not data:
            return None
        frames = reader.feed(data)
        if frames:
            return bytes(frames[0])


def _api_versions_request(version, correlation_id):
    client_id = b"raw-test"
    header = struct.pack(">hhih", 18, version, correlation_id, len(client_id)) + client_id
    # header tags; client_software_name "raw" and _version "1" (compact strings, which Kafka
    # checks against [a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?); body tags
    body = b"\x00" + b"\x04raw" + b"\x021" + b"\x00"
    payload = header + body
    return struct.pack(">i", len(payload)) + payload


def test_garbage_and_oversized_frames_close_only_their_own_connection(proxy, broker):
    from aiokafka import AIOKafkaProducer

    topic = topic_name("bad")
    broker.create_topic(topic, partitions=1)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"before", partition=0)
            loop = asyncio.get_running_loop()
            for junk in (struct.pack(">i", 200 * 1024 * 1024) + b"xx",  # over the 100 MiB max
                         b"GET / HTTP/1.1\r\n\r\n",                     # not Kafka at all
                         struct.pack(">i", -7)):                         # negative size
                s = _raw_connect(proxy)
                s.sendall(junk)
                assert await loop.run_in_executor(None, s.recv, 100) == b""
                s.close()
            return await producer.send_and_wait(topic, b"after", partition=0)
        finally:
            await producer.stop()

    meta = asyncio.run(run())
    assert meta.offset == 1
    proxy.wait_for_log("exceeds the maximum of 104857600 bytes")
    assert proxy.log().count("malformed request from client") >= 3
    assert proxy.alive()


def test_too_new_api_versions_request_gets_unsupported_version(proxy):
    s = _raw_connect(proxy)
    try:
        s.sendall(_api_versions_request(99, 1234))
        frame = _read_frame(s)
        assert frame is not None
        correlation_id, error_code = struct.unpack_from(">ih", frame, 4)
        assert (correlation_id, error_code) == (1234, 35)
        # the same connection carries on with a version the proxy knows
        s.sendall(_api_versions_request(3, 1235))
        frame = _read_frame(s)
        correlation_id, error_code = struct.unpack_from(">ih", frame, 4)
        assert (correlation_id, error_code) == (1235, 0)
    finally:
        s.close()


def test_unreachable_broker_closes_the_client_with_a_reason(tmp_path):
    from kthrottle_testkit.proxy import ProxyProcess
    from kthrottle.embedded import free_port

    dead = free_port()
    p = ProxyProcess("127.0.0.1:%d" % dead, tmp_path / "proxy.log").start()
    try:
        try:
            s = _raw_connect(p)
        except ConnectionRefusedError:
            pass  # the proxy found no broker first and stopped listening (test_broker_down)
        else:
            s.sendall(_api_versions_request(3, 1))
            assert s.recv(100) == b""
            s.close()
        p.wait_for_log("bootstrap listener: no broker answers (127.0.0.1:%d" % dead)
        assert p.alive()
    finally:
        p.stop()


def test_a_blackholed_bootstrap_address_is_given_up_on_and_the_next_one_serves(broker, tmp_path):
    import time

    from kthrottle_testkit.proxy import ProxyProcess

    # a listener whose accept queue is full: the kernel drops further SYNs,
    # so a connect to it hangs as one to a firewalled host does
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = socket.create_connection(hole.getsockname())
    p = ProxyProcess("127.0.0.1:%d" % hole.getsockname()[1], tmp_path / "proxy.log",
                     ["--bootstrap-server", broker.bootstrap,
                      "--upstream-connect-timeout-ms", "500"]).start()
    try:
        started = time.monotonic()
        s = _raw_connect(p)
        s.sendall(_api_versions_request(3, 77))
        s.settimeout(10)
        frame = _read_frame(s)
        waited = time.monotonic() - started
        s.close()
        assert struct.unpack_from(">ih", frame, 4) == (77, 0)
        assert waited < 8  # not the ~2 minutes of the kernel's SYN retries
        p.wait_for_log("did not answer within 0.5 s")
        p.wait_for_log("-> broker %s" % broker.bootstrap)
    finally:
        p.stop()
        filler.close()
        hole.close()
