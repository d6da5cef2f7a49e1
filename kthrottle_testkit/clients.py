"""Clients for tests and benchmarks: a producer running on its own thread, round trips
through a proxy (aiokafka), SCRAM logins (confluent-kafka), the proxy's admin endpoint, and
the ``kthrottle quotas`` command."""
import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request

from kthrottle_testkit import ROOT

RECORD = b"x" * 1024


async def produce_rate(bootstrap, topic, seconds, size=10_000, client_id="e2e-writer"):
    """Bytes/s an aiokafka producer achieves in ``seconds``, sending one record of ``size``
    bytes at a time to partition 0 as fast as it is let."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id=client_id,
                                linger_ms=5, request_timeout_ms=40000)
    await producer.start()
    sent = 0
    value = b"x" * size
    try:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            await producer.send_and_wait(topic, value, partition=0)
            sent += size
        return sent / (time.monotonic() - start)
    finally:
        await producer.stop()


class BackgroundProducer:
    """An aiokafka producer writing 1 KiB records as fast as it is let, on a
    thread of its own; ``rate(t0, t1)`` is what was delivered per second
    between two time.monotonic() instants."""

    def __init__(self, bootstrap, topic, client_id, **auth):
        self.bootstrap, self.topic, self.client_id = bootstrap, topic, client_id
        self.auth = auth  # aiokafka's security settings (a SASL login), if any
        self.events = []  # (time.monotonic(), bytes delivered)
        self.error = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def _main(self):
        try:
            asyncio.run(self._produce())
        except Exception as exc:  # reported by the test
            self.error = exc

    async def _produce(self):
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, client_id=self.client_id,
                                    acks=1, linger_ms=5, max_batch_size=16384, **self.auth)
        await producer.start()
        try:
            pending = set()
            while not self._stop.is_set():
                fut = await producer.send(self.topic, RECORD, partition=0)
                fut.add_done_callback(lambda f: self.events.append((time.monotonic(), len(RECORD))))
                pending.add(fut)
                if len(pending) > 100:
                    _, pending = await asyncio.wait(pending, timeout=0.2,
                                                    return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:  # what a throttled producer still holds may take long to flush
                await asyncio.wait_for(producer.stop(), 10)
            except asyncio.TimeoutError:
                pass

    def rate(self, t0, t1):
        return sum(n for t, n in list(self.events) if t0 <= t < t1) / (t1 - t0)


def admin_get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
        body = r.read().decode()
    return json.loads(body) if path == "/quotas" else body


def produce_quotas(port, client_id):
    """{connection id: (quota, entity)} for the connections carrying client_id."""
    out = {}
    for conn in admin_get(port, "/quotas")["connections"]:
        for client in conn["clients"]:
            if client["client_id"] == client_id:
                out[conn["connection"]] = (client["produce"]["quota"], client["produce"].get("entity"))
    return out


def metric(port, name):
    for line in admin_get(port, "/metrics").splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def kthrottle_quotas(*args):
    return subprocess.run([sys.executable, "-m", "kthrottle", "quotas", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def wait_until(predicate, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def roundtrip_aiokafka(proxy, broker, **auth):
    """Ten records produced (client-id shared-app) and read back through
    ``proxy`` (which has an admin endpoint) with aiokafka; returns the
    proxy's /quotas connections as seen while the producer was connected."""
    import uuid

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = "rt-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="shared-app",
                                    **auth)
        await producer.start()
        try:
            for i in range(10):
                await producer.send_and_wait(topic, b"v%d" % i, partition=0)
            view = admin_get(proxy.admin, "/quotas")["connections"]
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap,
                                    auto_offset_reset="earliest", **auth)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            got = []
            while len(got) < 10:
                batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
                for records in batch.values():
                    got += [r.value for r in records]
        finally:
            await consumer.stop()
        return got, view

    got, view = asyncio.run(run())
    assert got == [b"v%d" % i for i in range(10)]
    return view


def principals_of_roundtrip(proxy, broker, **auth):
    return [c["principal"] for c in roundtrip_aiokafka(proxy, broker, **auth)]


def scram_credentials_file(path, users, mechanisms=("SCRAM-SHA-256", "SCRAM-SHA-512")):
    """Write ``users`` ({user: password}) to a credentials file with
    ``kthrottle quotas alter``, salted; returns the path."""
    for user, password in users.items():
        for mechanism in mechanisms:
            done = kthrottle_quotas("alter", "--credentials-file", str(path),
                                    "--entity-type", "users", "--entity-name", user,
                                    "--add-config", "%s=[password=%s]" % (mechanism, password))
            assert done.returncode == 0, done.stderr
    return path


def scram_login(bootstrap, user, password):
    """True once ``user`` authenticates (SCRAM-SHA-512), False when refused."""
    import confluent_kafka

    errors = []
    producer = confluent_kafka.Producer({
        "bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": user, "sasl.password": password,
        "error_cb": errors.append})
    deadline, last = time.monotonic() + 15, None
    while time.monotonic() < deadline:
        producer.poll(0.1)  # serves error_cb
        if any(e.code() == confluent_kafka.KafkaError._AUTHENTICATION for e in errors):
            return False
        try:
            return bool(producer.list_topics(timeout=1.0).brokers)
        except confluent_kafka.KafkaException as exc:
            last = exc
    raise AssertionError("neither authenticated nor refused: %s %s" % (errors, last))


async def produce_then_consume(bootstrap, topic, values, **config):
    """aiokafka: ``values`` produced to partition 0 of ``topic`` through
    ``bootstrap``, then read back from the start; (what was read, the brokers
    the producer was given)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **config)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, partition=0)
        brokers = producer.client.cluster.brokers()
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                **config)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        got = []
        while len(got) < len(values):
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
            got += [r.value for records in batch.values() for r in records]
    finally:
        await consumer.stop()
    return got, brokers
