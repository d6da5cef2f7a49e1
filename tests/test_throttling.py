"""Quotas enforced through a real proxy process on real clients.

One scenario runs every throttled client at once (to keep the suite short):
each has its own client-id and quota, and an unthrottled client runs beside
them. Rates are measured by the clients themselves over 20 s of steady state,
after the burst allowance (1 s of quota, the default token bucket) is spent.
"""
import asyncio
import threading
import time
import urllib.request
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

QUOTA = 100_000  # bytes per second
REQUESTS_PER_SECOND = 20
RECORD = b"x" * 1024
STEADY_FROM, STEADY_TO = 3.0, 23.0


def write_quotas(path, rates):
    lines = []
    for client_id, (key, value) in rates.items():
        lines += ['[clients."%s"]' % client_id, "%s = %s" % (key, value), ""]
    path.write_text("\n".join(lines))


def steady_rate(events):
    """Bytes (or requests) per second between STEADY_FROM and STEADY_TO, from
    (seconds since start, amount) events."""
    return sum(n for t, n in events if STEADY_FROM <= t < STEADY_TO) / (STEADY_TO - STEADY_FROM)


def metrics(proxy_admin):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % proxy_admin, timeout=5) as r:
        return r.read().decode()


def metric_value(text, name, client_id):
    for line in text.splitlines():
        if line.startswith(name + "{") and 'client_id="%s"' % client_id in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def aiokafka_producer(bootstrap, topic, client_id, start, stop_at, events):
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, acks=1,
                                linger_ms=5, max_batch_size=16384)
    await producer.start()
    try:
        loop = asyncio.get_running_loop()
        pending = set()
        while loop.time() < stop_at:
            fut = await producer.send(topic, RECORD, partition=0)
            fut.add_done_callback(lambda f: events.append((loop.time() - start, len(RECORD))))
            pending.add(fut)
            if len(pending) > 200:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await producer.stop()


async def aiokafka_consumer(bootstrap, topic, client_id, start, stop_at, events, **config):
    from aiokafka import AIOKafkaConsumer, TopicPartition

    config = dict({"max_partition_fetch_bytes": 64 * 1024}, **config)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id=client_id,
                                auto_offset_reset="earliest", **config)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            batch = await consumer.getmany(timeout_ms=500)
            n = sum(len(m.value) for messages in batch.values() for m in messages)
            if n:
                events.append((loop.time() - start, n))
    finally:
        await consumer.stop()


async def metadata_requests(bootstrap, client_id, start, stop_at, events):
    from aiokafka import AIOKafkaClient

    client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id=client_id)
    await client.bootstrap()
    try:
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            await client.fetch_all_metadata()
            events.append((loop.time() - start, 1))
    finally:
        await client.close()


def confluent_producer(bootstrap, topic, client_id, start, stop_at, events):
    import confluent_kafka

    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                                         "linger.ms": 5, "acks": 1,
                                         # the Java client's default; librdkafka's 1 MB
                                         # batches would make 10 s steps at this quota
                                         "batch.size": 16384})

    def delivered(err, msg):
        if err is None:
            events.append((time.monotonic() - start, len(msg.value())))

    while time.monotonic() < stop_at:
        try:
            producer.produce(topic, RECORD, partition=0, on_delivery=delivered)
        except BufferError:
            producer.poll(0.05)
        producer.poll(0)
    producer.flush(30)


def test_every_client_is_held_to_its_quota_and_the_unthrottled_one_is_not(broker, tmp_path):
    from aiokafka import AIOKafkaProducer

    run = uuid.uuid4().hex[:6]
    topics = {name: "%s-%s" % (name, run) for name in ("aio", "ck", "fetch", "free")}
    for t in topics.values():
        broker.create_topic(t, partitions=1)

    quotas = tmp_path / "quotas.toml"
    write_quotas(quotas, {
        "aio-producer": ("producer_byte_rate", QUOTA),
        "ck-producer": ("producer_byte_rate", QUOTA),
        "aio-consumer": ("consumer_byte_rate", QUOTA),
        "metadata-poller": ("request_rate", REQUESTS_PER_SECOND),
    })
    admin = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--quota-file", str(quotas), "--admin-listen", "127.0.0.1:%d" % admin])
    proxy.start()
    try:
        async def preload():  # data for the consumer to fetch, written directly
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20)
            await producer.start()
            try:
                await asyncio.gather(*[await producer.send(topics["fetch"], RECORD, partition=0)
                                       for _ in range(5000)])
            finally:
                await producer.stop()

        asyncio.run(preload())

        events = {name: [] for name in ("aio", "ck", "fetch", "requests", "free")}
        start = time.monotonic()
        stop_at = start + STEADY_TO + 0.5

        ck = threading.Thread(target=confluent_producer,
                              args=(proxy.bootstrap, topics["ck"], "ck-producer", start, stop_at,
                                    events["ck"]))
        ck.start()

        async def clients():
            loop = asyncio.get_running_loop()
            offset = loop.time() - time.monotonic()  # loop clock vs monotonic
            s, e = start + offset, stop_at + offset
            await asyncio.gather(
                aiokafka_producer(proxy.bootstrap, topics["aio"], "aio-producer", s, e, events["aio"]),
                aiokafka_consumer(proxy.bootstrap, topics["fetch"], "aio-consumer", s, e, events["fetch"]),
                metadata_requests(proxy.bootstrap, "metadata-poller", s, e, events["requests"]),
                aiokafka_producer(proxy.bootstrap, topics["free"], "unthrottled", s, s + 6, events["free"]),
            )

        asyncio.run(clients())
        ck.join(60)
        text = metrics(admin)
    finally:
        proxy.stop()

    rates = {name: steady_rate(ev) for name, ev in events.items()}
    print("steady rates:", rates)
    assert rates["aio"] == pytest.approx(QUOTA, rel=0.10)
    assert rates["ck"] == pytest.approx(QUOTA, rel=0.10)  # librdkafka ignores throttle_time_ms
    assert rates["fetch"] == pytest.approx(QUOTA, rel=0.10)
    assert rates["requests"] == pytest.approx(REQUESTS_PER_SECOND, rel=0.10)
    # the unthrottled client ran above the quota and was never throttled. How far above
    # depends on the machine: beside three busy clients a loaded 2-core machine gave it
    # 1.5 MB/s (15x) in one CI run and 330 KB/s (3.3x) in another, so the margin is 2x,
    # which a client held to the quota cannot reach.
    free = sum(n for t, n in events["free"] if 1.0 <= t < 6.0) / 5.0
    assert free > 2 * QUOTA
    assert not metric_value(text, "kthrottle_produce_throttle_time_ms_total", "unthrottled")
    assert metric_value(text, "kthrottle_produce_throttle_time_ms_total", "aio-producer") > 0
    assert metric_value(text, "kthrottle_produce_quota", "ck-producer") == QUOTA
