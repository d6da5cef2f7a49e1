"""connection_creation_rate of ip entities (KIP-612), held on the listeners.

Part 1: the decision (limits.ConnectionRate, HeldConnections) as pure logic
with a fake clock. Part 2: a real proxy in front of a real Tansu broker, a
connection flood from 127.0.0.2 (raw sockets) while real clients from
127.0.0.1 produce and consume."""
import asyncio
import selectors
import socket
import threading
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle.policy.entities import CONNECTION_CREATION_RATE, OBSERVE_ONLY
from kthrottle.policy.quotas import WINDOW, QuotaManager, QuotaSettings
from kthrottle.proxy.limits import ConnectionRate, HeldConnections, entity_name
from kthrottle_testkit.clients import admin_get, produce_then_consume, wait_until
from kthrottle_testkit.proxy import ProxyProcess
from test_pipeline import api_versions_req

pytestmark = pytest.mark.integration

RATE = CONNECTION_CREATION_RATE


def _attempts(rate, address, start, seconds, every):
    """Connections from ``address`` every ``every`` s for ``seconds`` s:
    (taken, [throttle ms of each one not taken])."""
    taken, throttles = 0, []
    n = int(round(seconds / every))
    for i in range(n):
        over = rate.admit(address, start + i * every)
        if over is None:
            taken += 1
        else:
            throttles.append(over[0])
    return taken, throttles


# 1. the decision ---------------------------------------------------------------

def test_no_quota_manager_or_no_ip_entity_takes_every_connection_and_makes_no_bucket():
    assert ConnectionRate(None).admit("10.0.0.1", 0.0) is None
    m = QuotaManager({"users/alice": {"producer_byte_rate": 100.0}})
    rate = ConnectionRate(m)
    assert all(rate.admit("10.0.0.1", i * 0.001) is None for i in range(1000))
    assert m.ip_buckets == {}


@pytest.mark.parametrize("mode", ["token-bucket", WINDOW])
def test_a_flood_from_one_address_is_held_to_its_rate_and_throttled_ones_are_not_counted(mode):
    m = QuotaManager({"ips/<default>": {RATE: 5.0}}, QuotaSettings(mode=mode))
    rate = ConnectionRate(m)
    # 100 attempts a second for 10 s against 5/s
    taken, throttles = _attempts(rate, "10.0.0.1", 0.0, 10.0, 0.01)
    # the rate over the run (a burst allowance of about one window at the start)
    assert 5 * 10 <= taken <= 5 * 10 + 10, taken  # plus the burst: 5 at once
    assert len(throttles) == 1000 - taken
    assert all(0 < ms <= 1000 for ms in throttles)  # at most one quota window, as Kafka
    bucket = m.ip_buckets["10.0.0.1"]
    # un-recorded as Kafka does: only the taken ones count, and the measured
    # rate is the rate taken, not the flood's
    assert bucket.total == taken
    assert bucket.measure(10.0) <= 5.0 * 1.3
    assert bucket.throttled == len(throttles)


def test_throttled_attempts_do_not_push_the_next_connection_further_out():
    m = QuotaManager({"ips/<default>": {RATE: 2.0}})  # token bucket: 2 at once, then one per 0.5 s
    rate = ConnectionRate(m)
    assert rate.admit("10.0.0.1", 0.0) is None
    assert rate.admit("10.0.0.1", 0.0) is None
    ms, message = rate.admit("10.0.0.1", 0.0)
    assert ms == 500
    assert "over 2 connections/s (connection_creation_rate of ips/<default>)" in message
    for i in range(1, 100):  # a hundred more before the next token: each turned away
        assert rate.admit("10.0.0.1", 0.004 * i) is not None
    assert rate.admit("10.0.0.1", 0.5) is None  # on time, as if none had been tried


def test_each_address_has_its_own_bucket_and_an_override_beats_the_default():
    m = QuotaManager({"ips/<default>": {RATE: 1.0}, "ips/10.0.0.9": {RATE: 50.0}})
    rate = ConnectionRate(m)
    one, _ = _attempts(rate, "10.0.0.1", 0.0, 2.0, 0.01)
    other, _ = _attempts(rate, "10.0.0.2", 0.0, 2.0, 0.01)
    big, _ = _attempts(rate, "10.0.0.9", 0.0, 2.0, 0.01)
    assert one == other and 1 <= one <= 3
    assert 90 <= big <= 150
    assert m.ip_buckets["10.0.0.9"].entity == "ips/10.0.0.9"
    assert m.ip_buckets["10.0.0.2"].entity == "ips/<default>"


def test_a_quota_changed_live_applies_to_the_next_connection():
    m = QuotaManager({"users/alice": {"producer_byte_rate": 100.0}})
    rate = ConnectionRate(m)
    assert _attempts(rate, "10.0.0.1", 0.0, 1.0, 0.01)[0] == 100  # no ip quota yet
    m.update({"ips/10.0.0.1": {RATE: 2.0}})
    taken, _ = _attempts(rate, "10.0.0.1", 1.0, 1.0, 0.01)
    assert 2 <= taken <= 4
    m.update({"ips/10.0.0.1": {RATE: 1000.0}})
    assert _attempts(rate, "10.0.0.1", 2.0, 1.0, 0.01)[0] == 100
    m.update({})  # gone: every connection taken, the bucket dropped
    assert _attempts(rate, "10.0.0.1", 3.0, 1.0, 0.01)[0] == 100
    assert m.ip_buckets == {}


@pytest.mark.parametrize("whole_source", [False, True])
def test_an_observe_only_quota_takes_every_connection_and_counts_what_it_would_have_done(
        whole_source):
    cfg = {RATE: 2.0} if whole_source else {RATE: 2.0, OBSERVE_ONLY: 1.0}
    m = QuotaManager({"ips/<default>": cfg}, QuotaSettings(observe_only=whole_source))
    rate = ConnectionRate(m)
    assert _attempts(rate, "10.0.0.1", 0.0, 2.0, 0.01) == (200, [])
    bucket = m.ip_buckets["10.0.0.1"]
    assert bucket.observe_only and bucket.throttled == 0
    assert bucket.observed >= 190  # all but the burst and the refills
    assert bucket.total == 200  # nothing un-recorded: the dry run measures the real rate


@pytest.mark.parametrize("mode", ["token-bucket", WINDOW])
def test_a_quota_under_one_a_second_takes_a_first_connection_and_holds_one_window_at_most(mode):
    m = QuotaManager({"ips/<default>": {RATE: 0.1}}, QuotaSettings(mode=mode))  # one per 10 s
    rate = ConnectionRate(m)
    assert rate.admit("10.0.0.1", 0.0) is None
    ms, _ = rate.admit("10.0.0.1", 0.0)
    assert ms == 1000  # Kafka's cap: one quota window
    bucket = m.ip_buckets["10.0.0.1"]
    assert bucket.throttle_ms_total == 1000  # what it was held, not the 10 s it earned
    taken, _ = _attempts(rate, "10.0.0.1", 0.5, 30.0, 0.5)
    assert 2 <= taken <= 4, taken  # about one per 10 s, never none


@pytest.mark.parametrize("address, name", [
    ("10.0.0.1", "10.0.0.1"),
    ("::ffff:10.0.0.1", "10.0.0.1"),  # a dual-stack listener's IPv4 client
    ("0:0::1", "::1"),
    ("?", "?"),  # no address known: only <default> can apply
])
def test_addresses_are_named_as_ip_entities(address, name):
    assert entity_name(address) == name


def test_an_ipv4_client_of_a_dual_stack_listener_gets_its_ipv4_entity():
    m = QuotaManager({"ips/10.0.0.1": {RATE: 1.0}})
    rate = ConnectionRate(m)
    assert rate.admit("::ffff:10.0.0.1", 0.0) is None
    assert rate.admit("10.0.0.1", 0.0) is not None  # the same bucket
    assert rate.admit("::ffff:10.0.0.2", 0.0) is None  # no quota for that one


class FakeTimers:
    def __init__(self):
        self.now = 0.0
        self.timers = []

    def call_later(self, delay, fn, *args):
        timer = FakeTimer(self.now + delay, fn, args)
        self.timers.append(timer)
        return timer

    def advance(self, to):
        self.now = to
        for timer in sorted(self.timers, key=lambda t: t.at):
            if timer.at <= to and not timer.cancelled and not timer.ran:
                timer.ran = True
                timer.fn(*timer.args)


class FakeTimer:
    def __init__(self, at, fn, args):
        self.at, self.fn, self.args = at, fn, args
        self.cancelled = self.ran = False

    def cancel(self):
        self.cancelled = True


def test_held_connections_close_after_their_throttle_time_and_all_at_shutdown():
    timers = FakeTimers()
    held = HeldConnections(timers.call_later)
    closed = []
    held.hold(lambda: closed.append("a"), 200)
    held.hold(lambda: closed.append("b"), 500)
    held.hold(lambda: closed.append("c"), 900)
    timers.advance(0.199)
    assert closed == [] and len(held) == 3
    timers.advance(0.5)
    assert closed == ["a", "b"] and len(held) == 1
    held.close()
    assert closed == ["a", "b", "c"] and len(held) == 0
    assert all(t.cancelled or t.ran for t in timers.timers)


def test_past_max_held_a_throttled_connection_is_closed_at_once():
    timers = FakeTimers()
    held = HeldConnections(timers.call_later)
    closed = []
    for i in range(HeldConnections.MAX_HELD + 3):
        held.hold(lambda i=i: closed.append(i), 1000)
    assert len(held) == HeldConnections.MAX_HELD
    assert closed == [HeldConnections.MAX_HELD, HeldConnections.MAX_HELD + 1,
                      HeldConnections.MAX_HELD + 2]
    timers.advance(1.0)
    assert len(closed) == HeldConnections.MAX_HELD + 3 and len(held) == 0


# 2. a real proxy, a real broker, real clients -------------------------------------

QUOTAS = """\
[ips."<default>"]
connection_creation_rate = 5

[ips."127.0.0.1"]  # the real clients' address: an override of its own
connection_creation_rate = 1000
"""


@pytest.fixture(scope="module")
def rated(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("connection-rate")
    quotas = tmp / "quotas.toml"
    quotas.write_text(QUOTAS)
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", "127.0.0.1:%d" % free_port()])
    p.admin = int(p.extra_args[-1].rpartition(":")[2])
    p.quotas = quotas
    p.start()
    yield p
    p.stop()


def _flood(port, source, count, per_second, header=b""):
    """``count`` connections from ``source`` to ``port``, ``per_second``
    of them a second, each sending an ApiVersions request (after ``header``)
    at once. A connection the proxy takes is answered; one over its rate is
    closed unanswered. Returns (answered, closed unanswered, seconds the
    opening took); every connection must have had one or the other within
    10 s of the last one opened."""
    sel = selectors.DefaultSelector()
    answered = closed = 0

    def settle(timeout):
        nonlocal answered, closed
        for key, _ in sel.select(max(0.0, timeout)):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data:
                answered += 1
            else:
                closed += 1
            sel.unregister(sock)
            sock.close()

    start = time.monotonic()
    try:
        for i in range(count):
            due = start + i / per_second
            while time.monotonic() < due:
                settle(due - time.monotonic())
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=(source, 0))
            sock.sendall(header + api_versions_req(i + 1))
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        span = time.monotonic() - start
        deadline = time.monotonic() + 10.0
        while sel.get_map() and time.monotonic() < deadline:
            settle(0.1)
        assert not sel.get_map(), "%d connections neither answered nor closed" % len(sel.get_map())
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return answered, closed, span


def _series(admin, name, **labels):
    want = ",".join('%s="%s"' % kv for kv in sorted(labels.items()))
    for line in admin_get(admin, "/metrics").splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{"):
            have = ",".join(sorted(head[len(name) + 1:-1].split(",")))
            if all(part in have.split(",") for part in want.split(",")):
                return float(value)
        elif head == name and not labels:
            return float(value)
    return 0.0


def _refused(p):
    return _series(p.admin, "kthrottle_connections_refused_total",
                   reason="connection_creation_rate")


def _rewrite(p, text):
    reloads = p.log().count(" reloaded from ")
    p.quotas.write_text(text)
    assert wait_until(lambda: p.log().count(" reloaded from ") > reloads, 10), p.log()[-2000:]


def _clients_roundtrip(p, broker):
    """aiokafka then confluent-kafka, from 127.0.0.1: produce and consume."""
    import confluent_kafka

    topic = "cr-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    values = [b"a%d" % i for i in range(10)]
    got, _ = asyncio.run(produce_then_consume(p.bootstrap, topic, values))
    assert got == values
    producer = confluent_kafka.Producer({"bootstrap.servers": p.bootstrap, "linger.ms": 5})
    for i in range(10):
        producer.produce(topic, b"c%d" % i, partition=0)
    assert producer.flush(30) == 0
    consumer = confluent_kafka.Consumer({"bootstrap.servers": p.bootstrap, "group.id": topic,
                                         "auto.offset.reset": "earliest",
                                         "enable.auto.commit": False})
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        read = []
        deadline = time.monotonic() + 30
        while len(read) < 20 and time.monotonic() < deadline:
            for message in consumer.consume(20, timeout=1.0):
                assert message.error() is None, message.error()
                read.append(message.value())
    finally:
        consumer.close()
    assert read == values + [b"c%d" % i for i in range(10)]


def test_a_flood_from_one_address_is_held_to_its_rate_while_real_clients_work(rated, broker):
    p = rated
    refused_before = _refused(p)
    outcome = {}

    def flood():
        outcome["flood"] = _flood(p.port, "127.0.0.2", 60, 20.0)

    flooding = threading.Thread(target=flood)
    flooding.start()
    try:
        _clients_roundtrip(p, broker)  # meanwhile, from 127.0.0.1
    finally:
        flooding.join(60)
    answered, closed, span = outcome["flood"]
    # <default>: 5/s after a burst of 5; the proxy may see the connections a
    # little later than they were opened (a loaded machine): a second of slack
    assert 5 <= answered <= 5 + 5 * (span + 1.0) + 2, (answered, span)
    assert answered + closed == 60 and closed >= 20
    # the proxy's own account: every one closed unanswered was refused, and
    # only those answered count as created (Kafka un-records the others)
    assert wait_until(lambda: _refused(p) - refused_before == closed, 5), (_refused(p), closed)
    assert _series(p.admin, "kthrottle_connections_created_total", ip="127.0.0.2") == answered
    assert _series(p.admin, "kthrottle_connection_creation_quota", ip="127.0.0.2",
                   entity="ips/<default>") == 5.0
    # logged, but not once per connection
    lines = [line for line in p.log().splitlines()
             if "refused (connection_creation_rate)" in line]
    assert 1 <= len(lines) <= 5, lines
    assert "127.0.0.2:" in lines[0] and "over 5 connections/s (connection_creation_rate of " \
        "ips/<default>)" in lines[0]
    assert not [line for line in lines if "from 127.0.0.1:" in line]


def test_an_address_with_an_override_of_its_own_is_not_held(rated):
    answered, closed, _ = _flood(rated.port, "127.0.0.1", 40, 40.0)
    assert (answered, closed) == (40, 0)


def test_a_quota_changed_live_applies_to_new_connections(rated):
    p = rated
    try:
        _rewrite(p, QUOTAS + '\n[ips."127.0.0.3"]\nconnection_creation_rate = 1000\n')
        assert _flood(p.port, "127.0.0.3", 30, 30.0)[:2] == (30, 0)
        # lowered: the bucket keeps what it holds, up to the new burst of 2
        _rewrite(p, QUOTAS + '\n[ips."127.0.0.3"]\nconnection_creation_rate = 2\n')
        answered, closed, span = _flood(p.port, "127.0.0.3", 30, 30.0)
        assert 1 <= answered <= 2 + 2 * (span + 1.0) + 1 and closed >= 20, (answered, span)
        assert _series(p.admin, "kthrottle_connection_creation_quota", ip="127.0.0.3",
                       entity="ips/127.0.0.3") == 2.0
    finally:
        _rewrite(p, QUOTAS)


def test_an_observe_only_ip_quota_closes_nothing_and_says_what_it_would_have_done(rated):
    p = rated
    refused_before = _refused(p)
    try:
        _rewrite(p, QUOTAS + '\n[ips."127.0.0.4"]\nconnection_creation_rate = 1\n'
                 'observe_only = true\n')
        assert _flood(p.port, "127.0.0.4", 20, 20.0)[:2] == (20, 0)
        assert _refused(p) == refused_before
        assert _series(p.admin, "kthrottle_connections_created_total", ip="127.0.0.4") == 20
        would = _series(p.admin, "kthrottle_ip_observe_only_throttles_total", ip="127.0.0.4")
        assert 10 <= would <= 19, would  # all but the burst of one and a refill or so
    finally:
        _rewrite(p, QUOTAS)


def test_with_the_proxy_protocol_the_address_in_the_header_is_held(broker, tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[ips."10.9.8.7"]\nconnection_creation_rate = 2\n')
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--proxy-protocol"])
    p.start()
    try:
        def header(source):
            return b"PROXY TCP4 %s 127.0.0.1 40000 %d\r\n" % (source.encode(), p.port)

        answered, closed, span = _flood(p.port, "127.0.0.1", 20, 20.0, header("10.9.8.7"))
        assert 2 <= answered <= 2 + 2 * (span + 1.0) + 1 and closed >= 10, (answered, span)
        # another client behind the same balancer has no quota
        assert _flood(p.port, "127.0.0.1", 20, 20.0, header("10.9.8.6"))[:2] == (20, 0)
        assert "connection from 10.9.8.7:40000 (bootstrap listener) refused " \
               "(connection_creation_rate)" in p.log()
    finally:
        p.stop()
