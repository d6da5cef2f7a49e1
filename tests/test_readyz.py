"""/healthz and /readyz, and what the proxy says when no bootstrap broker
answers: a real ``kthrottle proxy`` in front of a Tansu broker that the test
stops and starts again on the same port; and the proxy's own contact with
the brokers (health.BrokerContact) on an event loop here, against a port with
nothing behind it and then a real broker on it."""
import asyncio
import json
import logging
import time
import types
import urllib.error
import urllib.request

from conftest import ProxyProcess
from kthrottle.embedded import TansuBroker, free_port, wait_for_port
from kthrottle.proxy import health


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


def test_readyz_follows_the_broker_and_the_quota_file(tmp_path):
    broker = TansuBroker(log_path=tmp_path / "tansu.log")  # its port, not started yet
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."ready-app"]\nproducer_byte_rate = 100000\n')
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", str(admin)]).start()
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        # no broker yet: said at once, in the log and by /readyz; the process serves
        p.wait_for_log("WARNING kthrottle.proxy: no bootstrap broker answers (%s"
                       % broker.bootstrap)
        assert get(admin, "/healthz")[:2] == (200, "text/plain")
        status, content_type, body = get(admin, "/readyz")
        assert (status, content_type) == (503, "text/plain")
        assert body.startswith("no bootstrap broker has answered yet (%s" % broker.bootstrap)
        assert body.count("\n") == 1  # one reason, one line
        status, content_type, body = get(admin, "/readyz", Accept="application/json")
        assert (status, content_type) == (503, "application/json")
        answer = json.loads(body)
        assert answer["ready"] is False and len(answer["reasons"]) == 1
        assert "kthrottle_ready 0.0" in get(admin, "/metrics")[2]

        broker.start()
        status, _, body = wait_for_status(admin, 200, 15)
        assert body == "ready\n"
        p.wait_for_log("INFO kthrottle.proxy: a bootstrap broker answers again (%s)"
                       % broker.bootstrap)
        text = get(admin, "/metrics")[2]
        assert "kthrottle_ready 1.0" in text
        age = float(text.split("\nkthrottle_broker_answer_age_seconds ")[1].split()[0])
        assert 0 <= age < health.READY_WITHIN_SECONDS

        # a quota file that no longer parses: the last quotas stay, the proxy is not ready
        quotas.write_text("[clients.\n")
        _, _, body = wait_for_status(admin, 503, 10)
        assert body.startswith("quota source: quota file %s" % quotas)
        quotas.write_text('[clients."ready-app"]\nproducer_byte_rate = 200000\n')
        wait_for_status(admin, 200, 10)

        # the broker goes away: not ready once its last answer is 10 s old
        broker.stop()
        stopped = time.monotonic()
        _, _, body = wait_for_status(admin, 503, health.READY_WITHIN_SECONDS + 10)
        # (the last answer came up to one contact interval before the stop)
        assert time.monotonic() - stopped >= (health.READY_WITHIN_SECONDS
                                              - health.CONTACT_INTERVAL_SECONDS - 1)
        assert body.startswith("no bootstrap broker has answered for ")
        assert "WARNING kthrottle.proxy: no bootstrap broker answers" in p.log()
        assert get(admin, "/healthz")[0] == 200
    finally:
        p.stop()
        broker.stop()


def test_no_answer_is_warned_once_a_minute_while_it_lasts_and_its_end_told(tmp_path, caplog):
    """The proxy's own contact on a loop here; its intervals shortened."""
    caplog.set_level(logging.INFO, logger="kthrottle.proxy")
    port = free_port()
    broker = TansuBroker(port=port, log_path=tmp_path / "tansu.log")

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
            await loop.run_in_executor(None, broker.start)
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
        broker.stop()
    records = [r for r in caplog.records if r.name == "kthrottle.proxy"]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings[0].startswith("no bootstrap broker answers (")
    still = [w for w in warnings if w.startswith("still no bootstrap broker answers after")]
    # one at once, then one per 0.5 s over the 1.6 s (and the broker's start)
    assert 2 <= len(still) <= 6, warnings
    assert len(warnings) == 1 + len(still)
    told = [r.getMessage() for r in records if r.levelno == logging.INFO
            and r.getMessage().startswith("a bootstrap broker answers again")]
    assert len(told) == 1 and "127.0.0.1:%d" % port in told[0]


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
