"""Per-topic quotas through a real proxy process, on real clients against a
real Tansu broker.

One scenario runs every client at once (to keep the file short): producers
on a topic held to its producer_byte_rate and on a topic with none,
consumers of topics held to their consumer_byte_rate (aiokafka fetches by
topic name, confluent-kafka by topic id: Fetch v13+ against Tansu), and a
topic quota beside a client quota each way round (the stronger wins). Rates
are what the clients themselves saw between STEADY_FROM and STEADY_TO, after
the burst allowance (1 s of quota, the default token bucket) is spent;
margins are wide enough for a loaded 2-core machine.
"""
import asyncio
import threading
import time
import urllib.request
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit.proxy import ProxyProcess
from test_throttling import RECORD, aiokafka_producer
from test_throttling import aiokafka_consumer as _consumer

pytestmark = pytest.mark.integration

QUOTA = 100_000  # bytes/s
STEADY_FROM, STEADY_TO = 2.0, 9.0
# a response carries under a second of quota (Tansu answers a fetch up to its
# max_bytes, whatever the partition's limit)
FETCH_BYTES = 64 * 1024


def aiokafka_consumer(*args):
    return _consumer(*args, fetch_max_bytes=FETCH_BYTES, max_partition_fetch_bytes=FETCH_BYTES)


def steady(events):
    return sum(n for t, n in events if STEADY_FROM <= t < STEADY_TO) / (STEADY_TO - STEADY_FROM)


def confluent_producer(bootstrap, topic, client_id, start, stop_at, events):
    import confluent_kafka

    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                                         "linger.ms": 5, "acks": 1, "batch.size": 16384})

    def delivered(err, msg):
        if err is None:
            events.append((time.monotonic() - start, len(msg.value())))

    while time.monotonic() < stop_at:
        try:
            producer.produce(topic, RECORD, partition=0, on_delivery=delivered)
        except BufferError:
            producer.poll(0.05)
        producer.poll(0)
    producer.purge()  # what a throttled producer still queues is not waited for
    producer.flush(5)


def confluent_consumer(bootstrap, topic, client_id, start, stop_at, events):
    import confluent_kafka

    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "client.id": client_id, "group.id": client_id,
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "max.partition.fetch.bytes": FETCH_BYTES, "fetch.max.bytes": FETCH_BYTES,
        "message.max.bytes": FETCH_BYTES})
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    try:
        while time.monotonic() < stop_at:
            for m in consumer.consume(100, timeout=0.5):
                if m.error() is None:
                    events.append((time.monotonic() - start, len(m.value())))
    finally:
        consumer.close()


def metric(text, name, topic, key=None):
    for line in text.splitlines():
        if line.startswith(name + "{") and 'topic="%s"' % topic in line and (
                key is None or 'key="%s"' % key in line):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_topics_are_held_to_their_quotas_beside_the_clients_own(broker, tmp_path):
    from aiokafka import AIOKafkaProducer

    run = uuid.uuid4().hex[:6]
    names = ("orders", "clicks", "events", "events-ck", "tight", "shared")
    topics = {name: "%s-%s" % (name, run) for name in names}
    for t in topics.values():
        broker.create_topic(t, partitions=1)
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("\n".join([
        "# a topic held on produce, two on fetch, and two beside client quotas",
        '[topics."%s"]' % topics["orders"], "producer_byte_rate = %d" % QUOTA,
        '[topics."%s"]' % topics["events"], "consumer_byte_rate = %d" % QUOTA,
        '[topics."%s"]' % topics["events-ck"], "consumer_byte_rate = %d" % QUOTA,
        # the topic is the stronger for "roomy", the client for "slow"
        '[topics."%s"]' % topics["tight"], "producer_byte_rate = %d" % (QUOTA // 2),
        '[clients."roomy"]', "producer_byte_rate = %d" % (4 * QUOTA),
        '[topics."%s"]' % topics["shared"], "producer_byte_rate = %d" % (4 * QUOTA),
        '[clients."slow"]', "producer_byte_rate = %d" % (QUOTA // 2),
        ""]))
    admin = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--quota-file", str(quotas), "--admin-listen", "127.0.0.1:%d" % admin])
    proxy.start()
    try:
        async def preload():  # what the consumers read, written to the broker directly
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20)
            await producer.start()
            try:
                for topic in (topics["events"], topics["events-ck"]):
                    await asyncio.gather(*[await producer.send(topic, RECORD, partition=0)
                                           for _ in range(2000)])
            finally:
                await producer.stop()

        asyncio.run(preload())
        events = {name: [] for name in ("orders", "clicks", "events", "events-ck", "tight",
                                        "shared")}
        start = time.monotonic()
        stop_at = start + STEADY_TO + 0.3
        threads = [
            threading.Thread(target=confluent_producer, args=(
                proxy.bootstrap, topics["clicks"], "free", start, stop_at, events["clicks"])),
            threading.Thread(target=confluent_producer, args=(
                proxy.bootstrap, topics["tight"], "roomy", start, stop_at, events["tight"])),
            threading.Thread(target=confluent_consumer, args=(
                proxy.bootstrap, topics["events-ck"], "ck-reader", start, stop_at,
                events["events-ck"])),
        ]
        for t in threads:
            t.start()

        async def clients():
            loop = asyncio.get_running_loop()
            offset = loop.time() - time.monotonic()
            s, e = start + offset, stop_at + offset
            await asyncio.gather(
                aiokafka_producer(proxy.bootstrap, topics["orders"], "writer", s, e,
                                  events["orders"]),
                aiokafka_producer(proxy.bootstrap, topics["shared"], "slow", s, e,
                                  events["shared"]),
                aiokafka_consumer(proxy.bootstrap, topics["events"], "reader", s, e,
                                  events["events"]),
            )

        asyncio.run(clients())
        for t in threads:
            t.join(60)
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin, timeout=5) as r:
            text = r.read().decode()
    finally:
        proxy.stop()

    rates = {name: steady(ev) for name, ev in events.items()}
    print("steady rates:", rates)
    # one topic held to its quota, the other not
    assert rates["orders"] == pytest.approx(QUOTA, rel=0.25)
    assert rates["clicks"] > 4 * QUOTA
    # consumers of a topic with a consumer_byte_rate, by name and by topic id
    assert rates["events"] == pytest.approx(QUOTA, rel=0.25)
    assert rates["events-ck"] == pytest.approx(QUOTA, rel=0.25)
    # the stronger of the topic's quota and the client's
    assert rates["tight"] == pytest.approx(QUOTA / 2, rel=0.25)
    assert rates["shared"] == pytest.approx(QUOTA / 2, rel=0.25)
    # what the metrics say
    assert metric(text, "kthrottle_topic_produce_quota", topics["orders"]) == QUOTA
    assert metric(text, "kthrottle_topic_throttle_seconds_total", topics["orders"],
                  "producer_byte_rate") > 0
    assert metric(text, "kthrottle_topic_throttle_seconds_total", topics["events-ck"],
                  "consumer_byte_rate") > 0
    assert metric(text, "kthrottle_topic_produce_bytes_total", topics["clicks"]) is None
