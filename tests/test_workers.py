"""``kthrottle proxy --workers 2``: two worker processes share the listeners
(SO_REUSEPORT), hold a quota together, and follow what the primary follows;
the supervisor passes signals on and starts a killed worker again. Real
broker, real ZooKeeper, real aiokafka clients; the exchange of bucket usage
alone with a fake clock."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle.policy.quotas import QuotaManager, QuotaSettings
from kthrottle.proxy.workers import UsageOutbox, add_usage
from kthrottle_testkit import ROOT, TANSU_NODE_ID
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import admin_get, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

QUOTA = 100_000  # bytes/s, the shared client-id's producer_byte_rate
RECORD = b"x" * 1024
NODE_OPENED = re.compile(r"\[worker (\d+)\] kthrottle\.proxy: connection \d+ opened: client "
                         r"\S+ -> node %d listener" % TANSU_NODE_ID)
STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")
PAUSED = "[worker %d] kthrottle.storage: storage: producers now meet PAUSE"


# the exchange, without I/O -----------------------------------------------------------

SNAPSHOT = {"clients/app": {"producer_byte_rate": 1000},
            "topics/events": {"producer_byte_rate": 5000}}


def _exchange(managers, outboxes, now):
    rows = [outbox.rows(now) for outbox in outboxes]
    for i, manager in enumerate(managers):
        for j, sent in enumerate(rows):
            if i != j:
                add_usage(manager, json.loads(json.dumps(sent)), now)  # as on the hub
    return rows


def test_usage_recorded_on_one_worker_counts_in_the_other_workers_bucket():
    a, b = QuotaManager(SNAPSHOT), QuotaManager(SNAPSHOT)
    outboxes = [UsageOutbox(a), UsageOutbox(b)]
    ca, cb = a.client("ANONYMOUS", "app"), b.client("ANONYMOUS", "app")
    assert ca.record_produce(600, 0.0) == 0  # within the 1 s burst of 1000
    assert cb.record_produce(300, 0.01) == 0
    _exchange([a, b], outboxes, 0.05)
    bucket_a, bucket_b = ca.produce, cb.produce
    # each measures both: 900 bytes over the padded 10 s window
    assert bucket_a.measure(0.05) == pytest.approx(bucket_b.measure(0.05), rel=0.01)
    assert bucket_a.measure(0.05) == pytest.approx(900 / 10.0, rel=0.01)
    assert (bucket_a.total, bucket_a.others_total) == (600, 300)
    assert (bucket_b.total, bucket_b.others_total) == (300, 600)
    # the next 200 bytes on b would pass alone (300 + 200 < 1000), not with a's 600
    assert cb.record_produce(200, 0.06) > 0
    # what came from the other worker is never sent back; nothing new, no row
    rows = _exchange([a, b], outboxes, 0.10)
    assert rows[0] == []
    assert [r[:5] + [r[5]] for r in rows[1]] == [["c", "producer_byte_rate", "", "app",
                                                   "clients/app", 200]]
    assert _exchange([a, b], outboxes, 0.15) == [[], []]
    assert bucket_a.others_throttled == 1 and bucket_a.others_throttle_ms > 0


def test_a_bucket_is_made_for_usage_of_a_client_this_worker_has_not_seen():
    a, b = QuotaManager(SNAPSHOT), QuotaManager(SNAPSHOT)
    outboxes = [UsageOutbox(a), UsageOutbox(b)]
    a.client("ANONYMOUS", "app").record_produce(400, 0.0)
    a.topic_bucket("producer_byte_rate", "events").record(700, 0.0)
    _exchange([a, b], outboxes, 0.05)
    client = b.buckets[("producer_byte_rate", "", "app")]
    topic = b.topic_buckets[("producer_byte_rate", "events")]
    assert (client.total, client.others_total, client.limit) == (0, 400, 1000)
    assert (topic.others_total, topic.limit) == (700, 5000)
    # b's first client of that id starts where the machine is, not with a full burst
    assert b.client("ANONYMOUS", "app").record_produce(700, 0.06) > 0
    # an entity b's quotas do not have (its source behind) counts nowhere
    other = QuotaManager({})
    assert add_usage(other, outboxes[0].rows(0.1) or [
        ["c", "producer_byte_rate", "", "app", "clients/app", 5]], 0.1) == 0
    assert other.buckets == {}


def test_the_exchange_reads_only_the_buckets_used_since_its_last_look():
    snapshot = {"clients/<default>": {"producer_byte_rate": 1000, "request_percentage": 50}}
    a = QuotaManager(snapshot)
    idle = [a.client("ANONYMOUS", "idle-%d" % i) for i in range(1000)]
    for i, client in enumerate(idle):  # each used once, before the exchange began
        client.record_produce(10, 0.001 * i)
    outbox = UsageOutbox(a)
    first = outbox.rows(1.0)  # what they counted before is sent once
    assert len(first) == 1000 and {r[3] for r in first} == {"idle-%d" % i for i in range(1000)}
    assert a.touched == [] and outbox.rows(1.05) == []  # idle since: nothing read, nothing sent
    busy = a.client("ANONYMOUS", "busy")  # a client-id seen only now
    busy.record_produce(300, 1.06)
    busy.record_produce(200, 1.07)
    idle[7].record_produce(40, 1.08)
    # the two buckets used, each once in touched however often it was used
    assert [b.client_tag for b in a.touched] == ["busy", "idle-7"]
    rows = outbox.rows(1.10)
    assert sorted((r[3], r[5]) for r in rows) == [("busy", 500), ("idle-7", 40)]
    # used again right after a look: noted again, only the growth sent
    busy.record_produce(50, 1.11)
    assert [(r[3], r[5]) for r in outbox.rows(1.15)] == [("busy", 50)]
    assert outbox.rows(1.20) == []


def test_a_bucket_used_once_per_look_of_every_kind_is_sent_each_time():
    """A client that spends a little just after each look is never left out
    (a worker that read only the buckets used "recently" by its clock could
    miss it), and topic and address buckets carry their kind."""
    snapshot = dict(SNAPSHOT, **{"ips/<default>": {"connection_creation_rate": 10}})
    a, b = QuotaManager(snapshot), QuotaManager(snapshot)
    outboxes = [UsageOutbox(a), UsageOutbox(b)]
    client = a.client("ANONYMOUS", "app")
    topic = a.topic_bucket("producer_byte_rate", "events")
    address = a.connection_bucket("10.0.0.1")
    now = 0.0
    for step in range(20):
        client.record_produce(10, now + 0.001)
        topic.record(20, now + 0.001)
        address.record(1, now + 0.001)
        now += 0.05
        rows = _exchange([a, b], outboxes, now)
        assert sorted((r[0], r[5]) for r in rows[0]) == [("c", 10), ("i", 1), ("t", 20)]
        assert rows[1] == []
    assert b.buckets[("producer_byte_rate", "", "app")].others_total == 200
    assert b.topic_buckets[("producer_byte_rate", "events")].others_total == 400
    assert b.ip_buckets["10.0.0.1"].others_total == 20


def test_without_an_exchange_no_bucket_notes_its_use():
    a = QuotaManager(SNAPSHOT)  # one worker: nothing is collected per request
    client = a.client("ANONYMOUS", "app")
    client.record_produce(10, 0.0)
    assert a.touched is None and client.produce.touched is None


@pytest.mark.parametrize("mode", ["token-bucket", "window"])
def test_clients_on_two_workers_are_held_to_one_quota(mode):
    """Three clients of one id as fast as they are let, two on one worker
    and one on the other, usage exchanged every 50 ms: together they get
    the quota; with no exchange, twice it."""
    def run(exchange):
        settings = QuotaSettings(mode=mode)
        snapshot = {"clients/app": {"producer_byte_rate": 100_000}}
        managers = [QuotaManager(snapshot, settings) for _ in range(2)]
        outboxes = [UsageOutbox(m) for m in managers]
        clients = [managers[w].client("ANONYMOUS", "app") for w in (0, 0, 1)]
        next_at = [0.0, 0.0005, 0.001]
        sent, now, exchange_at = 0, 0.0, 0.05
        while now < 40.0:  # from one event to the next
            for i, client in enumerate(clients):
                if now >= next_at[i]:
                    delay = client.record_produce(16384, now)
                    sent += 16384 if now >= 5.0 else 0
                    next_at[i] = now + delay / 1000.0 + 0.002  # a round trip
            if now >= exchange_at:
                if exchange:
                    _exchange(managers, outboxes, now)
                exchange_at += 0.05
            now = min(min(next_at), exchange_at)
        return sent / 35.0 / 100_000

    shared = run(True)
    assert 0.9 <= shared <= 1.05, shared
    assert run(False) > 1.8


# a real proxy of two workers -----------------------------------------------------

def _start(broker, tmp_path, args):
    p = ProxyProcess(broker.bootstrap, tmp_path / ("proxy-%s.log" % uuid.uuid4().hex[:6]),
                     ["--workers", "2", *args])
    p.start()
    p.wait_for_log("2 workers serving", timeout=30)
    return p


def worker_pids(p):
    """{worker index: pid} of the last start of each."""
    return {int(i): int(pid) for i, pid in STARTED.findall(p.log())}


def running(pid):
    """A process that is neither gone nor a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _stop_all(p, pids):
    p.stop()
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def workers_proxy(broker, tmp_path_factory):
    directory = tmp_path_factory.mktemp("workers")
    quotas = directory / "quotas.toml"
    quotas.write_text('[clients.shared]\nproducer_byte_rate = %d\n' % QUOTA)
    admin = free_port()
    p = _start(broker, directory, ["--quota-file", str(quotas),
                                   "--admin-listen", "127.0.0.1:%d" % admin])
    p.admin = admin
    yield p
    _stop_all(p, worker_pids(p).values())


async def _producers_on_both_workers(p, client_id, topic, most=12):
    """Producers of ``client_id``, started one at a time until the node
    connections of both workers carry one: [(worker, producer)]."""
    from aiokafka import AIOKafkaProducer

    producers = []
    try:
        while len({w for w, _ in producers}) < 2:
            assert len(producers) < most, "the kernel gave every connection to one worker"
            before = len(NODE_OPENED.findall(p.log()))
            producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id=client_id,
                                        acks=1, linger_ms=5, max_batch_size=16384)
            await producer.start()
            producers.append((None, producer))
            await producer.send_and_wait(topic, RECORD, partition=0)
            opened = NODE_OPENED.findall(p.log())[before:]
            assert opened, "no node connection opened for the new producer"
            producers[-1] = (int(opened[-1]), producer)
    except BaseException:
        for _, producer in producers:
            await producer.stop()
        raise
    return producers


def test_connections_land_on_both_workers(workers_proxy, broker):
    topic = "w-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)

    async def run():
        producers = await _producers_on_both_workers(workers_proxy, "spread", topic)
        for _, producer in producers:
            await producer.stop()
        return producers

    producers = asyncio.run(run())
    assert {w for w, _ in producers} == {0, 1}
    log = workers_proxy.log()
    assert "[worker 1] kthrottle.proxy: listening on %s for bootstrap" % workers_proxy.bootstrap \
        in log
    # the admin endpoint is the primary's alone
    assert "[worker 0] kthrottle.admin: admin endpoint on" in log
    assert "[worker 1] kthrottle.admin" not in log


def test_one_client_id_on_both_workers_is_held_to_its_quota(workers_proxy, broker):
    p = workers_proxy
    topic = "wq-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    steady_from, stop_after = 4.0, 12.0

    async def produce(producer, events, start, stop_at):
        loop = asyncio.get_running_loop()
        pending = set()
        while loop.time() < stop_at:
            fut = await producer.send(topic, RECORD, partition=0)
            fut.add_done_callback(lambda f: events.append(loop.time() - start))
            pending.add(fut)
            if len(pending) > 100:
                _, pending = await asyncio.wait(pending, timeout=0.2,
                                                return_when=asyncio.FIRST_COMPLETED)

    async def run():
        producers = await _producers_on_both_workers(p, "shared", topic)
        loop = asyncio.get_running_loop()
        start = loop.time()
        events = [[] for _ in producers]
        try:
            await asyncio.gather(*(produce(producer, events[i], start, start + stop_after)
                                   for i, (_, producer) in enumerate(producers)))
        finally:
            for _, producer in producers:
                try:  # what a throttled producer still holds may take long to flush
                    await asyncio.wait_for(producer.stop(), 10)
                except asyncio.TimeoutError:
                    pass
        return [w for w, _ in producers], events

    workers, events = asyncio.run(run())
    per_worker = {0: 0, 1: 0}
    for w, times in zip(workers, events):
        per_worker[w] += sum(1 for t in times if steady_from <= t < stop_after)
    rate = (per_worker[0] + per_worker[1]) * len(RECORD) / (stop_after - steady_from)
    assert per_worker[0] and per_worker[1], per_worker  # both workers carried the client-id
    # one bucket per worker would let each worker's producers have the quota: 2x
    assert 0.6 * QUOTA <= rate <= 1.3 * QUOTA, (rate / QUOTA, per_worker)
    # the primary's /metrics counts what both workers' connections sent
    delivered = sum(len(times) for times in events) * len(RECORD)
    counted = wait_until(lambda: _metric(p.admin, "kthrottle_produce_bytes_total", "shared"), 5)
    assert counted >= delivered, (counted, delivered)


def _metric(admin, name, client_id):
    for line in admin_get(admin, "/metrics").splitlines():
        if line.startswith(name + "{") and 'client_id="%s"' % client_id in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_killed_worker_is_started_again_and_serves(workers_proxy, broker):
    """The primary, killed outright: started again, it serves clients and
    the admin endpoint again."""
    p = workers_proxy
    old = worker_pids(p)
    os.kill(old[0], signal.SIGKILL)
    p.wait_for_log("worker 0 (pid %d) was killed by SIGKILL" % old[0])
    new = wait_until(lambda: worker_pids(p)[0] != old[0] and worker_pids(p), 10)
    assert new[1] == old[1] and running(new[0])
    p.wait_for_log("worker 0 (pid %d) serves again" % new[0], timeout=20)
    assert "kthrottle_ready 1.0" in wait_until(lambda: _admin(p.admin), 10)
    topic = "wr-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)

    async def run():
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap)
        await producer.start()
        try:
            for i in range(5):
                await producer.send_and_wait(topic, b"after %d" % i, partition=0)
        finally:
            await producer.stop()

    asyncio.run(run())
    assert p.alive()


def _admin(port):
    try:
        return admin_get(port, "/metrics")
    except OSError:
        return None


def test_sigterm_to_the_supervisor_stops_every_worker(broker, tmp_path):
    p = _start(broker, tmp_path, [])
    pids = worker_pids(p)
    try:
        os.kill(p.proc.pid, signal.SIGHUP)  # passed on
        for index in (0, 1):
            p.wait_for_log("[worker %d] kthrottle: SIGHUP: nothing to re-read" % index)
        # a second run on the same port is refused, not let in among the workers
        second = subprocess.run(
            [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", broker.bootstrap,
             "--listen", p.bootstrap, "--workers", "2"], capture_output=True, text=True,
            timeout=30, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert second.returncode == 1
        assert "in use: another kthrottle on this port?" in second.stderr
        assert "started" not in second.stderr  # no worker
        os.kill(p.proc.pid, signal.SIGTERM)
        assert p.proc.wait(20) == 0
        assert not any(running(pid) for pid in pids.values())
        log = p.log()
        for index in (0, 1):
            assert "[worker %d] kthrottle.proxy: SIGTERM: draining" % index in log
            assert "worker %d (pid %d) exited with status 0" % (index, pids[index]) in log
    finally:
        _stop_all(p, pids.values())


def test_a_worker_whose_supervisor_is_killed_stops(broker, tmp_path):
    p = _start(broker, tmp_path, [])
    pids = worker_pids(p)
    try:
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(5)
        assert wait_until(lambda: not any(running(pid) for pid in pids.values()), 10)
        for index in (0, 1):
            assert "[worker %d] kthrottle.workers: the supervisor is gone" % index in p.log()
    finally:
        _stop_all(p, pids.values())


# what the primary follows reaches the other worker --------------------------------

@pytest.mark.skipif(not zk_server.available(), reason="scripts/test installs ZooKeeper")
def test_the_cluster_state_and_shares_the_primary_follows_reach_the_other_worker(
        broker, zookeeper, tmp_path):
    from kazoo.client import KazooClient

    from kthrottle.sources.cluster_state import shares_znode
    from test_fleet_proxy import shares
    from test_storage_proxy import snapshot

    chroot = "/wk-%s" % uuid.uuid4().hex[:8]
    zk = KazooClient(hosts=zookeeper.hosts + chroot)
    zk.start(timeout=10)
    zk.ensure_path("/")
    p = _start(broker, tmp_path, ["--zookeeper", zookeeper.hosts + chroot,
                                  "--storage-scope", "cluster", "--storage-base-rate", "200000",
                                  "--storage-pause-max-ms", "20000", "--proxy-id", "p1"])
    pids = worker_pids(p)
    topic = "ws-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)

    async def run():
        producers = await _producers_on_both_workers(p, "writer", topic)
        try:
            on_1 = next(producer for w, producer in producers if w == 1)
            zk.create("/kthrottle/cluster-state", snapshot(85), makepath=True)  # PAUSE
            await asyncio.to_thread(p.wait_for_log, PAUSED % 1)
            pending = asyncio.ensure_future(on_1.send_and_wait(topic, b"held", partition=0))
            await asyncio.sleep(2.0)
            held = not pending.done()
            zk.set("/kthrottle/cluster-state", snapshot(10))  # OPEN again
            await asyncio.wait_for(pending, 15)
            return held
        finally:
            for _, producer in producers:
                await producer.stop()

    try:
        assert asyncio.run(run())  # held on worker 1 while the cluster was paused
        p.wait_for_log("[worker 1] kthrottle.storage: storage: producers now meet OPEN")
        zk.create(shares_znode("p1"), shares(time.time(), 5000, proxy="p1", cycle=4),
                  makepath=True)
        for index in (0, 1):
            p.wait_for_log("[worker %d] kthrottle.fleet: fleet: quota shares of cycle 4 for "
                           "proxy p1" % index)
        log = p.log()
        assert PAUSED % 0 in log
        # one ZooKeeper watch of each, one usage publisher: the primary's
        assert "[worker 0] kthrottle.storage: no cluster state at" in log
        assert "[worker 1] kthrottle.storage: no cluster state at" not in log
        assert "[worker 0] kthrottle.fleet: fleet: proxy p1 publishes its usage" in log
        assert "[worker 1] kthrottle.fleet: fleet: proxy p1 publishes" not in log
    finally:
        _stop_all(p, pids.values())
        zk.stop()
        zk.close()


def test_hostile_clients_meet_every_worker_as_one_process(broker, tmp_path):
    """SASL terminated by two workers: frames before authentication and wrong
    passwords are refused on whichever worker the kernel picks, no password
    reaches the log, and a good client then produces."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError
    from kthrottle_testkit.clients import scram_credentials_file
    from test_pipeline import produce_req

    creds = scram_credentials_file(tmp_path / "credentials.toml", {"alice": "alice-secret"})
    p = _start(broker, tmp_path, ["--security-protocol", "SASL_PLAINTEXT",
                                  "--credentials-file", str(creds)])
    try:
        for _ in range(12):  # both workers get some (each lands on one: 2 in 2**12)
            with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
                s.sendall(produce_req(1))
                assert s.recv(100) == b""  # closed, nothing answered
        # each worker says its first refusal for the address (the rest are summed up)
        assert wait_until(lambda: set(re.findall(
            r"\[worker (\d)\] .*refused \(unauthenticated_request\): request api key 0 v8 "
            r"before authentication", p.log())) == {"0", "1"}, 10)

        async def login(password):
            producer = AIOKafkaProducer(
                bootstrap_servers=p.bootstrap, security_protocol="SASL_PLAINTEXT",
                sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                sasl_plain_password=password, request_timeout_ms=5000)
            try:
                await producer.start()
                await producer.send_and_wait(topic, b"v", partition=0)
            finally:
                await producer.stop()

        topic = "wh-%s" % uuid.uuid4().hex[:8]
        broker.create_topic(topic)
        for _ in range(6):
            with pytest.raises(KafkaError):
                asyncio.run(login("not-her-password-%d" % _))
        asyncio.run(login("alice-secret"))
        p.wait_for_log("SCRAM-SHA-256 login for user 'alice': wrong password")
        log = p.log()
        assert "alice-secret" not in log and "not-her-password" not in log
    finally:
        _stop_all(p, worker_pids(p).values())
