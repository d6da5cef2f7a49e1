"""/healthz (liveness) and /readyz (readiness: "can serve clients"), and
what the proxy says when no bootstrap broker answers: a real ``kthrottle
proxy`` in front of an Apache Kafka node of the test's own, not started yet
(its port chosen), then started and stopped; the proxy's own contact with
the brokers (health.BrokerContact) on an event loop here, against a port
with nothing behind it and then a real broker (Apache Kafka) on it; a quota
file that no longer parses, which leaves the proxy ready (a ``degraded:``
line, not a 503); and every degraded condition on an admin endpoint in this
process."""
import asyncio
import json
import logging
import time
import types
import urllib.error
import urllib.request

import pytest

from kthrottle.kafka_kit import KafkaBroker
from kthrottle.embedded import free_port, wait_for_port
from kthrottle.proxy import health
from kthrottle_testkit import BROKER_NODE_ID
from kthrottle_testkit.proxy import ProxyProcess
from test_admin import StandIn, running

pytestmark = pytest.mark.integration


def get(port, path, **headers):
    """(status, content type, body text) of one GET."""
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def wait_for_status(port, status, timeout):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = get(port, "/readyz")
        if got[0] == status:
            return got
        time.sleep(0.2)
    raise AssertionError("/readyz still answers %r after %g s" % (got, timeout))


def metric(port, name):
    """The value of a family without labels on /metrics (None: absent)."""
    for line in get(port, "/metrics")[2].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _proxy_with_a_quota_file(tmp_path, bootstrap):
    """(the quota file, the admin port, the started ProxyProcess)."""
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."ready-app"]\nproducer_byte_rate = 100000\n')
    admin = free_port()
    p = ProxyProcess(bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", str(admin)]).start()
    return quotas, admin, p


def _kafka(tmp_path):
    """An Apache Kafka node of the test's own, not started: its port is chosen already."""
    return KafkaBroker(node_id=BROKER_NODE_ID, workdir=tmp_path / "kafka",
                       log_path=tmp_path / "kafka.log")


def test_readyz_follows_the_broker(tmp_path):
    broker = _kafka(tmp_path)  # its port, not started yet
    quotas, admin, p = _proxy_with_a_quota_file(tmp_path, broker.bootstrap)
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        # no broker yet: said at once, in the log and by /readyz; the process serves
        p.wait_for_log("WARNING kthrottle.proxy: no bootstrap broker answers (%s"
                       % broker.bootstrap)
        assert get(admin, "/healthz")[:2] == (200, "text/plain")
        status, content_type, body = get(admin, "/readyz")
        assert (status, content_type) == (503, "text/plain")
        assert body.startswith("no bootstrap broker has answered yet (%s" % broker.bootstrap)
        assert body.count("\n") == 1  # one reason, one line; nothing degraded
        status, content_type, body = get(admin, "/readyz", Accept="application/json")
        assert (status, content_type) == (503, "application/json")
        answer = json.loads(body)
        assert answer["ready"] is False and len(answer["reasons"]) == 1
        assert answer["degraded"] == []
        assert "kthrottle_ready 0.0" in get(admin, "/metrics")[2]

        broker.start()  # a JVM: seconds; the proxy asks every 3 s
        status, _, body = wait_for_status(admin, 200, 30)
        assert body == "ready\n"
        p.wait_for_log("INFO kthrottle.proxy: a bootstrap broker answers again (%s)"
                       % broker.bootstrap)
        text = get(admin, "/metrics")[2]
        assert "kthrottle_ready 1.0" in text
        age = float(text.split("\nkthrottle_broker_answer_age_seconds ")[1].split()[0])
        assert 0 <= age < health.READY_WITHIN_SECONDS

        # the broker goes away: not ready once its last answer is 10 s old. Timed from the
        # SIGTERM: Kafka's controlled shutdown takes seconds, and may stop answering at its start
        stopped = time.monotonic()
        broker.stop()
        _, _, body = wait_for_status(admin, 503, health.READY_WITHIN_SECONDS + 10)
        # (the last answer came up to one contact interval before the stop)
        assert time.monotonic() - stopped >= (health.READY_WITHIN_SECONDS
                                              - health.CONTACT_INTERVAL_SECONDS - 1)
        assert body.startswith("no bootstrap broker has answered for ")
        assert "WARNING kthrottle.proxy: no bootstrap broker answers" in p.log()
        assert get(admin, "/healthz")[0] == 200
    finally:
        p.stop()
        broker.stop(keep=False)


def test_no_answer_is_warned_once_a_minute_while_it_lasts_and_its_end_told(tmp_path, caplog):
    """The proxy's own contact on a loop here; its intervals shortened."""
    caplog.set_level(logging.INFO, logger="kthrottle.proxy")
    broker = _kafka(tmp_path)
    port = broker.port  # nothing there until the broker starts

    async def run():
        loop = asyncio.get_running_loop()
        server = types.SimpleNamespace(
            loop=loop, upstream_ssl_context=None, config=types.SimpleNamespace(
                bootstrap_servers=[("127.0.0.1", free_port()), ("127.0.0.1", port)],
                upstream_connect_timeout_ms=2000))
        contact = health.BrokerContact(server, interval=0.1, still_down_every=0.5)
        contact.start()
        try:
            await asyncio.sleep(1.6)
            assert contact.age(loop.time()) is None and contact.down_since is not None
            assert "127.0.0.1:%d" % port in contact.error
            # started from this thread (the broker gets SIGTERM when the thread that started
            # it ends), awaited in another: the contact goes on meanwhile, for seconds
            broker.launch()
            await loop.run_in_executor(None, broker.wait_ready, 90.0)
            deadline = loop.time() + 10
            while contact.age(loop.time()) is None and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert contact.answered_by == "127.0.0.1:%d" % port  # the second address
            assert contact.error is None and contact.down_since is None
        finally:
            await contact.stop()

    try:
        asyncio.run(run())
    finally:
        broker.stop(keep=False)
    records = [r for r in caplog.records if r.name == "kthrottle.proxy"]
    warned = [r for r in records if r.levelno == logging.WARNING]
    warnings = [r.getMessage() for r in warned]
    assert warnings[0].startswith("no bootstrap broker answers (")
    still = [w for w in warnings if w.startswith("still no bootstrap broker answers after")]
    assert len(warnings) == 1 + len(still)
    told = [r for r in records if r.levelno == logging.INFO
            and r.getMessage().startswith("a bootstrap broker answers again")]
    assert len(told) == 1 and "127.0.0.1:%d" % port in told[0].getMessage()
    # one at once, then one per 0.5 s (not one per 0.1 s check) over the 1.6 s and the
    # broker's start (a JVM: seconds, so counted from the log's own times)
    down = told[0].created - warned[0].created
    assert 2 <= len(still) <= down / 0.5 + 1, (down, warnings)
    times = [r.created for r in warned]
    assert all(b - a >= 0.45 for a, b in zip(times, times[1:])), (times, warnings)


def test_the_probes_are_open_when_quotas_requires_a_token(tmp_path, broker):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--admin-listen", str(admin), "--admin-token-file", str(token)]).start()
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        assert get(admin, "/quotas")[0] == 401
        assert get(admin, "/healthz")[0] == 200
        assert wait_for_status(admin, 200, 10)[2] == "ready\n"
    finally:
        p.stop()


def _in_force(port):
    """The producer_byte_rate of clients "ready-app" in force (/quotas)."""
    entities = json.loads(get(port, "/quotas")[2])["entities"]
    return [e["quotas"].get("producer_byte_rate") for e in entities
            if "ready-app" in json.dumps(e["entity"])]


def test_a_quota_file_that_does_not_parse_leaves_the_proxy_ready(tmp_path, broker):
    """Issue 42: one bad edit of a quota file every proxy reads must not take
    them all out of their load balancer. The last good quotas stay in force,
    the source is reported unhealthy (metric, log line, a degraded line on
    /readyz), and /readyz answers 200 throughout."""
    quotas, admin, p = _proxy_with_a_quota_file(tmp_path, broker.bootstrap)
    try:
        assert wait_for_status(admin, 200, 15)[2] == "ready\n"
        assert metric(admin, "kthrottle_quota_source_healthy") == 1
        assert _in_force(admin) == [100000]

        quotas.write_text("[clients.\n")  # a TOML typo
        refused = "kthrottle.quotas: quota file %s is not valid TOML: " % quotas
        deadline = time.monotonic() + 10
        seen = []  # (status, body) of every /readyz while the file is broken
        while metric(admin, "kthrottle_quota_source_healthy") != 0:
            assert time.monotonic() < deadline, "the quota source is still said healthy"
            seen.append(get(admin, "/readyz")[::2])
            time.sleep(0.1)
        p.wait_for_log(refused)
        line = [x for x in p.log().splitlines() if refused in x]
        assert len(line) == 1 and "the last known quotas stay in force" in line[0]
        assert line[0].split(refused)[0].rstrip().endswith(("WARNING", "ERROR")), line[0]
        # ready all along, a few seconds of it: the source is named as degraded
        degraded = ("degraded: quota source: quota file %s is not readable or not current; "
                    "the last known quotas stay in force\n" % quotas)
        until = time.monotonic() + 3
        while time.monotonic() < until:
            seen.append(get(admin, "/readyz")[::2])
            time.sleep(0.25)
        assert all(status == 200 for status, _ in seen), seen
        assert seen[-1] == (200, "ready\n" + degraded)
        status, content_type, body = get(admin, "/readyz", Accept="application/json")
        assert (status, content_type) == (200, "application/json")
        answer = json.loads(body)
        assert answer["ready"] is True and answer["reasons"] == []
        assert len(answer["degraded"]) == 1
        assert answer["degraded"][0].startswith("quota source: quota file %s " % quotas)
        assert metric(admin, "kthrottle_ready") == 1
        assert metric(admin, "kthrottle_quota_source_healthy") == 0
        assert _in_force(admin) == [100000]  # the last good quotas
        assert get(admin, "/healthz")[0] == 200

        # fixed: healthy again, the new quotas in force, nothing degraded
        quotas.write_text('[clients."ready-app"]\nproducer_byte_rate = 200000\n')
        fixed = time.monotonic()
        while metric(admin, "kthrottle_quota_source_healthy") != 1:
            assert time.monotonic() - fixed < 10, "the quota source is still said unhealthy"
            assert get(admin, "/readyz")[0] == 200
            time.sleep(0.1)
        assert get(admin, "/readyz")[::2] == (200, "ready\n")
        assert json.loads(get(admin, "/readyz", Accept="application/json")[2]) == {
            "ready": True, "reasons": [], "degraded": []}
        assert _in_force(admin) == [200000]
        p.wait_for_log("INFO kthrottle.quotas: quota file %s is valid again" % quotas)
    finally:
        p.stop()


class _Source:
    def __init__(self, describe):
        self.describe, self.healthy, self.rejected = describe, True, 0


def test_every_degraded_condition_leaves_readyz_at_200_and_is_named():
    """On an admin endpoint in this process, in front of stand-ins: a quota
    source and a credentials store not current, the cluster-state session
    lost, the storage and fleet-share fail-safes in force. Each gives a
    degraded line, none a 503; only no broker answering does."""
    contact = types.SimpleNamespace(age=lambda now: 1.0, error=None)
    source = _Source("quota file /etc/kthrottle/quotas.toml")
    credentials = _Source("credentials file /etc/kthrottle/credentials.toml")
    cluster_state = types.SimpleNamespace(healthy=True, rejected=0)
    proxy = StandIn()
    from kthrottle.policy.storage import StoragePolicy
    from kthrottle.proxy.filters.storage import StorageThrottle

    storage = StorageThrottle(StoragePolicy("cluster", "PAUSE", 120.0, "cluster"))
    storage.cluster_state = cluster_state  # what its start() takes from the services
    proxy.filters = (storage,)
    fleet = types.SimpleNamespace(
        fail_safe_active=False, follower=types.SimpleNamespace(reason=None),
        shares_age=lambda now: None, reports=0, errors=0, rejected=0)
    with running(proxy, source=source, credentials=credentials, cluster_state=cluster_state,
                 fleet=fleet, contact=contact) as server:
        port = server.address[1]

        def readyz():
            status, content_type, body = get(port, "/readyz")
            assert content_type == "text/plain"
            as_json = json.loads(get(port, "/readyz", Accept="application/json")[2])
            return status, body, as_json

        assert readyz() == (200, "ready\n", {"ready": True, "reasons": [], "degraded": []})
        source.healthy = credentials.healthy = cluster_state.healthy = False
        storage.reason = "no cluster state yet"
        fleet.fail_safe_active = True
        fleet.follower.reason = "no quota shares for proxy p1 yet"
        degraded = [
            "quota source: quota file /etc/kthrottle/quotas.toml is not readable or not "
            "current; the last known quotas stay in force",
            "credentials: credentials file /etc/kthrottle/credentials.toml is not readable "
            "or not current; the last known credentials stay in force",
            "cluster state: the ZooKeeper session following it is not connected",
            "cluster state: no cluster state yet; the storage fail-safe applies",
            "fleet shares: no quota shares for proxy p1 yet; the share fail-safe applies"]
        status, body, as_json = readyz()
        assert status == 200
        assert body == "ready\n" + "".join("degraded: %s\n" % line for line in degraded)
        assert as_json == {"ready": True, "reasons": [], "degraded": degraded}
        text = get(port, "/metrics")[2]
        assert "\nkthrottle_ready 1.0\n" in text
        assert "\nkthrottle_quota_source_healthy 0.0\n" in text
        assert "\nkthrottle_credentials_source_healthy 0.0\n" in text
        assert "\nkthrottle_storage_fail_safe 1.0\n" in text
        assert "\nkthrottle_fleet_fail_safe 1.0\n" in text

        # no broker answers: 503 for that alone; what is degraded still listed
        contact.age = lambda now: None
        contact.error = "127.0.0.1:9092 Connect call failed"
        status, body, as_json = readyz()
        assert status == 503
        assert body == ("no bootstrap broker has answered yet (127.0.0.1:9092 Connect call "
                        "failed)\n" + "".join("degraded: %s\n" % line for line in degraded))
        assert as_json == {"ready": False, "reasons": [
            "no bootstrap broker has answered yet (127.0.0.1:9092 Connect call failed)"],
            "degraded": degraded}
        assert "\nkthrottle_ready 0.0\n" in get(port, "/metrics")[2]
        assert get(port, "/healthz")[:2] == (200, "text/plain")
