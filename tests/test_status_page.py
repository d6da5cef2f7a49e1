"""The status page at / of the admin endpoint, and its data at /status.json.

The history is unit-tested on a QuotaManager with a fake clock. The rest runs
the real ``kthrottle proxy`` in front of a Tansu broker with a quota file and
a real producer held to its quota, and reads the page in a real browser:
Playwright driving Debian's chromium (scripts/test installs it; without it the
browser tests fail, they are not skipped). The last test adds a real
ZooKeeper holding a cluster-state snapshot and fleet shares, so that storage
and the fleet show real values."""
import json
import os
import re
import time
import types
import urllib.error
import urllib.request
import uuid

import pytest

from kthrottle.embedded import free_port, wait_for_port
from kthrottle.policy.entities import PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager, QuotaSettings
from kthrottle.proxy.status import History
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import BackgroundProducer, kthrottle_quotas, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
TOKEN = "status-page-token"
CLIENT = "status-throttled"
QUOTA = 10240.0  # bytes/s: far below what the producer asks for
PRODUCE = 0  # Kafka's API key


# -- the history, without I/O -----------------------------------------------

def _manager(clients):
    return QuotaManager({"clients/%s" % c: {PRODUCER_BYTE_RATE: q} for c, q in clients.items()},
                        QuotaSettings())


def test_the_history_keeps_each_bucket_rate_and_limit_over_the_span():
    manager = _manager({"a": 1000.0})
    client = manager.client("User:x", "a")
    history = History(span=60, interval=5, max_entities=10)
    bucket = None
    given_before = 0
    for step in range(20):  # 100 s: longer than the span
        now = 1000.0 + step * 5
        client.on_request(PRODUCE, 4000 if step % 2 else 100, 1, now)
        bucket = manager.buckets[(PRODUCER_BYTE_RATE, "", "a")]
        history.sample(manager, now, 1_700_000_000.0 + step * 5)
        points = history.series[(PRODUCER_BYTE_RATE, "", "a")].points
        t, rate, limit, given, released = points[-1]
        assert rate == round(bucket.measure(now), 3)
        assert released == round(bucket.released(now), 3)
        assert limit == bucket.limit == 1000.0
        assert given == bucket.throttle_ms_total - given_before
        given_before = bucket.throttle_ms_total
    assert bucket.throttle_ms_total > 0  # the test did throttle
    doc = history.to_json()
    (entity,) = doc["entities"]
    assert (entity["entity"], entity["kind"], entity["quota"]) == ("clients/a", "produce", 1000.0)
    assert len(entity["points"]) == history.length == 13  # 60 s / 5 s, both ends
    assert entity["points"][0][0] == 1_700_000_000.0 + 7 * 5  # the oldest dropped
    json.dumps(doc, allow_nan=False)


def test_entities_beyond_the_bound_are_counted_and_an_idle_one_makes_room():
    manager = _manager({"a": 1000.0, "b": 1000.0, "c": 1000.0})
    clients = {c: manager.client("User:x", c) for c in "abc"}
    history = History(span=20, interval=5, max_entities=2)
    for step in range(8):
        now = 100.0 + step * 5
        clients["a"].on_request(PRODUCE, 500, 1, now)
        if step == 0:
            clients["b"].on_request(PRODUCE, 500, 1, now)  # then idle
        if step >= 1:
            clients["c"].on_request(PRODUCE, 500, 1, now)
        history.sample(manager, now, now)
        charted = {k[2] for k in history.series}
        # b's rate falls to 0 once its request leaves the 11 s window (step
        # 3); its history holds 5 points: all 0 from step 7 on
        if step < 7:
            assert charted == {"a", "b"} and history.not_charted == (1 if step else 0), step
    # b measured nothing for its whole history: c took its place
    assert charted == {"a", "c"} and history.not_charted == 0


def test_a_bucket_that_is_gone_keeps_its_points_until_they_are_older_than_the_span():
    manager = _manager({"a": 1000.0})
    manager.client("User:x", "a").on_request(PRODUCE, 500, 1, 10.0)
    history = History(span=20, interval=5)
    history.sample(manager, 10.0, 10.0)
    manager.update({})  # the quota removed: its bucket is dropped
    history.sample(manager, 15.0, 15.0)
    assert len(history.series[(PRODUCER_BYTE_RATE, "", "a")].points) == 1
    history.sample(manager, 35.0, 35.0)
    assert history.series == {}


def test_a_connection_with_nothing_left_to_wait_is_not_throttled():
    """A mute or hold within TIMER_SLACK of its end is over (the pipeline
    reads the client then): not a row reading "Throttled for 0.00 s"."""
    from kthrottle.proxy.pipeline import TIMER_SLACK
    from kthrottle.proxy.status import throttled_report

    now = 500.0

    def conn(principal, muted=0.0, held=0.0):
        return types.SimpleNamespace(
            principal=principal, muted_until=now + muted, client_quotas={(principal, "app"): None},
            pipeline=types.SimpleNamespace(hold_until=now + held))

    server = types.SimpleNamespace(quotas=None, connections=[
        conn("User:done", muted=0.0004), conn("User:due", muted=TIMER_SLACK * 0.9),
        conn("User:released", held=TIMER_SLACK / 2), conn("User:past", muted=-1.0, held=-1.0),
        conn("User:muted", muted=0.25), conn("User:held", muted=0.001, held=1.5)])
    report = throttled_report(server, now)
    assert [(r["principal"], r["remaining_ms"], r["muted_ms"], r["held_ms"])
            for r in report["clients"]] == [("User:held", 1500, 1, 1500),
                                            ("User:muted", 250, 250, 0)]
    assert report["total"] == 2


def test_the_entity_says_whether_its_bucket_is_every_users_or_every_client_ids():
    manager = QuotaManager({"clients/app": {PRODUCER_BYTE_RATE: 1000.0},
                            "users/alice": {PRODUCER_BYTE_RATE: 1000.0},
                            "users/bob/clients/<default>": {PRODUCER_BYTE_RATE: 1000.0}},
                           QuotaSettings())
    for user, client_id in (("carol", "app"), ("alice", "x"), ("bob", "")):
        manager.client(user, client_id).on_request(PRODUCE, 100, 1, 10.0)
    history = History(span=20, interval=5)
    history.sample(manager, 10.0, 10.0)
    shared = {e["entity"]: (e["user"], e["client_id"], e["all_users"], e["all_client_ids"])
              for e in history.to_json()["entities"]}
    assert shared == {
        "clients/app": ("", "app", True, False),  # every user's connections as client-id app
        "users/alice": ("alice", "", False, True),  # every client-id of alice's
        # bob's connections with no client-id: their own bucket, not all client-ids
        "users/bob/clients/<default>": ("bob", "", False, False)}


# -- a live proxy --------------------------------------------------------------

def get(port, path, token=None):
    """(status, headers, body) of one GET."""
    headers = {"Authorization": "Bearer " + token} if token else {}
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


def status_json(port, token=TOKEN, query=""):
    code, _, body = get(port, "/status.json" + query, token)
    assert code == 200, body
    return json.loads(body)


def entity_of(doc, entity):
    for e in doc["quotas"]["entities"]:
        if e["entity"] == entity:
            return e
    return None


def throttled_row(doc, client_id):
    for row in doc["throttled"]["clients"]:
        if row["client_id"] == client_id:
            return row
    return None


@pytest.fixture(scope="module")
def throttled(broker, tmp_path_factory):
    """A proxy with a quota file and a bearer token on its admin endpoint,
    and a producer held to its quota for as long as the module runs."""
    tmp = tmp_path_factory.mktemp("status")
    quotas = tmp / "quotas.toml"
    quotas.write_text('[clients."%s"]\nproducer_byte_rate = %d\n' % (CLIENT, QUOTA))
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    admin = free_port()
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                     ["--quota-file", str(quotas), "--admin-listen", str(admin),
                      "--admin-token-file", str(token_file)]).start()
    topic = "status-%s" % uuid.uuid4().hex[:8]
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        broker.create_topic(topic)
        with BackgroundProducer(p.bootstrap, topic, CLIENT) as producer:
            # two samples of the bucket (5 s apart), and the producer throttled now
            def ready():
                doc = status_json(admin)
                e = entity_of(doc, "clients/" + CLIENT)
                return doc if e and len(e["points"]) >= 2 and throttled_row(doc, CLIENT) else None

            assert wait_until(ready, timeout=30, interval=0.2), status_json(admin)
            yield types.SimpleNamespace(proxy=p, admin=admin, producer=producer)
        assert producer.error is None
    finally:
        p.stop()


def test_status_json_has_the_history_who_is_throttled_and_what_is_not_configured(throttled):
    doc = status_json(throttled.admin)
    assert doc["quotas"]["configured"] is True
    assert doc["quotas"]["interval_s"] == 5.0 and doc["quotas"]["span_s"] == 900
    e = entity_of(doc, "clients/" + CLIENT)
    assert (e["kind"], e["user"], e["client_id"], e["quota"], e["limit"], e["unit"]) == (
        "produce", "", CLIENT, QUOTA, QUOTA, "B/s")
    # a client-id quota: one bucket for every user's connections with that client-id
    assert (e["all_users"], e["all_client_ids"]) == (True, False)
    points = e["points"]
    assert len(points) >= 2
    times = [p[0] for p in points]
    assert times == sorted(times) and doc["generated_at"] - 30 < times[-1] <= doc["generated_at"]
    assert all(p[2] == QUOTA for p in points)
    assert any(p[1] > QUOTA / 4 for p in points)  # it was measured producing
    # the producer asks for more than its quota: throttle time was given
    assert sum(p[3] for p in points) > 0
    # the rate let through is sampled beside the windowed one
    assert all(len(p) == 5 and p[4] >= 0 for p in points)
    assert any(p[4] > 0 for p in points)
    # throttled now, for a time still to serve (a mute lasts ~1.6 s per 16 KiB batch)
    row = wait_until(lambda: throttled_row(status_json(throttled.admin), CLIENT), 10, 0.02)
    assert row and row["principal"] == "ANONYMOUS" and row["connections"] >= 1
    assert 0 < row["remaining_ms"] <= 10_000
    assert doc["storage"] == {"configured": False}
    assert doc["fleet"] == {"configured": False}
    # what a page that holds the history asks for: the points taken since
    # (here: since the one before last it was given)
    since = points[-2][0]
    later = status_json(throttled.admin, query="?since=%r" % since)
    assert later["quotas"]["points_since"] == since
    assert later["quotas"]["history_started_at"] == doc["quotas"]["history_started_at"]
    newer = entity_of(later, "clients/" + CLIENT)["points"]
    assert newer[:2] == points[-2:] and all(p[0] >= since for p in newer)
    assert get(throttled.admin, "/status.json?since=yesterday", TOKEN)[0] == 400


def test_the_json_needs_the_token_that_quotas_needs_and_the_page_holds_no_data(throttled):
    port = throttled.admin
    for token in (None, "wrong"):
        for path in ("/status.json", "/quotas"):
            code, headers, body = get(port, path, token)
            assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer"), path
            assert CLIENT.encode() not in body
    code, headers, body = get(port, "/status.json", TOKEN)
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store" and CLIENT.encode() in body
    # the page and its script: served to all, names nothing
    for path, kind in (("/", "text/html"), ("/status.js", "text/javascript"),
                       ("/status.css", "text/css")):
        code, headers, body = get(port, path)
        assert code == 200 and headers["Content-Type"].startswith(kind), path
        assert CLIENT.encode() not in body and b"ANONYMOUS" not in body
        assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b"status.js" in get(port, "/")[2]


def test_with_client_certificates_the_json_needs_one_as_quotas_does(tmp_path):
    import ssl

    import trustme

    ca = trustme.CA()
    files = {name: str(tmp_path / name) for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(files["ca.pem"])
    server = ca.issue_cert("127.0.0.1")
    for i, pem in enumerate(server.cert_chain_pems):
        pem.write_to_path(files["server.pem"], append=i > 0)
    server.private_key_pem.write_to_path(files["server.key"])
    admin = free_port()
    # no broker behind it: the admin endpoint serves all the same
    p = ProxyProcess("127.0.0.1:%d" % free_port(), tmp_path / "proxy.log",
                     ["--admin-listen", str(admin), "--admin-ssl-cert", files["server.pem"],
                      "--admin-ssl-key", files["server.key"], "--admin-ssl-ca", files["ca.pem"]])
    p.start()
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)

        def fetch(path, cert=None):
            context = ssl.create_default_context()
            ca.configure_trust(context)
            if cert is not None:
                cert.configure_cert(context)
            req = urllib.request.Request("https://127.0.0.1:%d%s" % (admin, path))
            try:
                with urllib.request.urlopen(req, timeout=10, context=context) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                with exc:
                    return exc.code, exc.read()

        assert fetch("/status.json")[0] == fetch("/quotas")[0] == 403
        code, body = fetch("/status.json", ca.issue_cert("operator@example.com"))
        assert code == 200
        doc = json.loads(body)
        assert (doc["quotas"]["configured"], doc["quotas"]["entities"]) == (False, [])
        assert doc["throttled"] == {"clients": [], "total": 0}
        assert fetch("/")[0] == 200  # the page itself holds no data
    finally:
        p.stop()


@pytest.fixture(scope="module")
def chromium():
    if not os.path.exists(CHROMIUM):
        pytest.fail("%s is missing: the status page is tested in Debian's chromium, which "
                    "scripts/test installs (apt-get install -y --no-install-recommends "
                    "chromium)" % CHROMIUM)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: scripts/setup test installs it")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, port, fragment=""):
    """(page, the URLs it requested, console errors)."""
    page = browser.new_page()
    requested, errors = [], []
    page.on("request", lambda r: requested.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto("http://127.0.0.1:%d/%s" % (port, fragment))
    return page, requested, errors


def test_the_page_shows_the_chart_the_throttled_client_and_not_configured(throttled, chromium):
    base = "http://127.0.0.1:%d/" % throttled.admin
    page, requested, errors = open_page(chromium, throttled.admin, "#token=" + TOKEN)
    try:
        row = page.wait_for_selector('#entities tr[data-entity="clients/%s"]' % CLIENT,
                                     timeout=15000)
        assert row.get_attribute("data-kind") == "produce"
        assert row.get_attribute("data-quota") == "%d" % QUOTA
        assert row.query_selector("td.quota").text_content() == "10240 B/s (10.0 KiB/s)"
        # [clients."status-throttled"] names no user: every user's, not a blank
        cells = [td.text_content() for td in row.query_selector_all("td")]
        assert cells[1:4] == ["produce", "(all users)", CLIENT], cells
        chart = row.query_selector("svg.chart")
        shown = int(chart.get_attribute("data-points"))
        assert shown >= 2
        rate_line = chart.query_selector("polyline.rate").get_attribute("points").split()
        assert len(rate_line) == shown
        xs = [float(xy.split(",")[0]) for xy in rate_line]
        assert xs == sorted(xs) and 0 <= xs[0] and xs[-1] <= 300  # within the chart
        assert chart.query_selector("polyline.limit") is not None
        released = chart.query_selector("polyline.released").get_attribute("points").split()
        assert len(released) == shown
        assert chart.query_selector_all("circle.throttled")  # throttle time was given

        # the throttled client: the page refreshes until it catches it throttled
        client = page.wait_for_selector(
            '#throttled-clients tr[data-client-id="%s"]' % CLIENT, timeout=20000)
        cells = [td.text_content() for td in client.query_selector_all("td")]
        assert cells[0] == "ANONYMOUS" and cells[1] == CLIENT
        assert re.fullmatch(r"\d+\.\d{1,3} s( \(responses held\))?", cells[3]), cells
        assert int(client.get_attribute("data-remaining-ms")) > 0

        assert page.text_content("#storage-summary") == "not configured"
        assert page.text_content("#fleet-summary") == "not configured"
        assert not page.is_visible("#storage-volumes") and not page.is_visible("#fleet-shares")
        assert page.is_hidden("#problem")

        # it refreshes by itself, and the chart grows as samples are taken
        first = page.get_attribute("body", "data-generated-at")
        page.wait_for_function("(first) => document.body.dataset.generatedAt !== first", arg=first,
                               timeout=15000)
        page.wait_for_function(
            "(n) => Number(document.querySelector('#entities tr[data-entity=\"clients/%s\"] "
            "svg').dataset.points) > n" % CLIENT, arg=shown, timeout=15000)
    finally:
        page.close()
    assert requested and all(url.startswith(base) for url in requested), requested
    # after the first answer, the page asked only for the points since the last
    assert any("status.json?since=" in url for url in requested), requested
    assert not errors, errors


def test_the_page_without_the_token_says_how_to_give_it_and_shows_nothing(throttled, chromium):
    page, requested, errors = open_page(chromium, throttled.admin)
    try:
        page.wait_for_selector("#problem:not([hidden])", timeout=15000)
        assert "#token=" in page.text_content("#problem")
        assert "bearer token" in page.text_content("#problem")
        assert CLIENT not in page.content()
        assert not page.is_visible("#entities")
    finally:
        page.close()


def test_the_page_names_every_user_or_client_id_and_drops_a_wait_that_is_over(chromium,
                                                                              tmp_path):
    """What the page makes of /status.json (given here): who shares a bucket
    whose entity names no user or no client-id, and a connection with no
    time left to serve, which is not throttled."""
    admin = free_port()
    p = ProxyProcess("127.0.0.1:%d" % free_port(), tmp_path / "proxy.log",
                     ["--admin-listen", str(admin)]).start()  # the page's files; no broker
    now = round(time.time(), 3)

    def entity(entity, user, client_id, all_users, all_client_ids):
        return {"key": PRODUCER_BYTE_RATE, "kind": "produce", "unit": "B/s", "user": user,
                "client_id": client_id, "entity": entity, "quota": 1024.0, "limit": 1024.0,
                "rate": 10.0, "points": [[now - 5, 10.0, 1024.0, 0, 10.0]],
                "observe_only": False, "all_users": all_users, "all_client_ids": all_client_ids}

    def client(principal, remaining_ms):
        return {"principal": principal, "client_id": principal.lower(), "connections": 1,
                "remaining_ms": remaining_ms, "muted_ms": remaining_ms, "held_ms": 0,
                "over": ["produce"]}

    doc = {"generated_at": now,
           "quotas": {"configured": True, "interval_s": 5.0, "span_s": 900,
                      "history_started_at": now - 60, "points_since": None, "not_charted": 0,
                      "entities": [entity("clients/app", "", "app", True, False),
                                   entity("users/alice", "alice", "", False, True),
                                   entity("users/bob/clients/<default>", "bob", "", False,
                                          False)]},
           "throttled": {"clients": [client("Short", 3), client("Done", 0)], "total": 2},
           "storage": {"configured": False}, "fleet": {"configured": False}}
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        page = chromium.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.route("**/status.json*", lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps(doc)))
        try:
            page.goto("http://127.0.0.1:%d/" % admin)
            page.wait_for_selector('#entities tr[data-entity="users/alice"]', timeout=15000)

            def who(entity):
                row = page.query_selector('#entities tr[data-entity="%s"]' % entity)
                cells = row.query_selector_all("td")
                return [(td.text_content(), "all" in (td.get_attribute("class") or ""))
                        for td in cells[2:4]]

            assert who("clients/app") == [("(all users)", True), ("app", False)]
            assert who("users/alice") == [("alice", False), ("(all client-ids)", True)]
            assert who("users/bob/clients/<default>") == [("bob", False), ("", False)]

            rows = page.query_selector_all("#throttled-clients tbody tr")
            assert [r.get_attribute("data-principal") for r in rows] == ["Short"]
            assert rows[0].query_selector("td.remaining").text_content() == "0.003 s"
            assert "0.00 s" not in page.text_content("#throttled")

            doc["throttled"] = {"clients": [client("Done", 0)], "total": 1}
            page.wait_for_function(
                "() => document.getElementById('throttled-note').textContent === "
                "'no client is throttled now'", timeout=15000)
            assert not page.is_visible("#throttled-clients")
        finally:
            page.close()
        assert not errors, errors
    finally:
        p.stop()


# -- storage and the fleet, with real values ------------------------------------

def produce_one(bootstrap, topic, client_id):
    # kafka-python: Playwright's sync API holds this thread's event loop
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id)
    try:
        producer.send(topic, b"v", partition=0).get(timeout=20)
    finally:
        producer.close(5)


@pytest.mark.skipif(not zk_server.available(), reason="scripts/test installs ZooKeeper")
def test_storage_per_broker_and_volume_and_the_fleet_shares(broker, zookeeper, chromium,
                                                            tmp_path):
    from kazoo.client import KazooClient

    from kthrottle.policy.fleet import ProxyShares, encode_shares_document, shares_document
    from kthrottle.policy.storage import (
        BrokerReport,
        VolumeReport,
        cluster_snapshot,
        encode_snapshot,
        parse_limit,
    )
    from kthrottle.sources.cluster_state import shares_znode

    gb = 10 ** 9
    chroot = "/status-%s" % uuid.uuid4().hex[:8]
    hosts = zookeeper.hosts + chroot
    client = "status-fleet"
    quota = 500_000.0
    out = kthrottle_quotas("alter", "--zookeeper", hosts, "--entity-type", "clients",
                           "--entity-name", client, "--add-config",
                           "producer_byte_rate=%d" % quota)
    assert out.returncode == 0, out.stderr
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    now = time.time()
    # broker 111: one volume between its limits (THROTTLE), one under (OPEN)
    report = BrokerReport(111, now, parse_limit("MinFreePercentage:40"),
                          parse_limit("MinFreePercentage:20"),
                          (VolumeReport("sda1", 100 * gb, 70 * gb, "/var/kafka/a"),
                           VolumeReport("sdb1", 100 * gb, 10 * gb, "/var/kafka/b")))
    zk.create("/kthrottle/cluster-state", encode_snapshot(
        cluster_snapshot({111: report}, [111], {}, now, 60)), makepath=True)
    zk.create(shares_znode("a"), encode_shares_document(shares_document(
        ProxyShares("a", ("a", "b"), 0.5, [(PRODUCER_BYTE_RATE, "", client, quota / 4, quota)]),
        now, 7)), makepath=True)
    admin = free_port()
    usage_topic = "usage-%s" % uuid.uuid4().hex[:8]
    p = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                     ["--zookeeper", hosts, "--storage-scope", "cluster", "--proxy-id", "a",
                      "--usage-topic", usage_topic, "--admin-listen", str(admin)]).start()
    topic = "status-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic)
    try:
        wait_for_port("127.0.0.1", admin, proc=p.proc)
        produce_one(p.bootstrap, topic, client)  # the bucket is in use

        def shown():
            doc = status_json(admin, token=None)  # no token configured: open
            return doc if doc["fleet"]["buckets"] else None

        doc = wait_until(shown, timeout=20, interval=0.2)
        assert doc, status_json(admin, token=None)
        storage = doc["storage"]
        assert storage["configured"] and storage["scope"] == "cluster"
        assert storage["state"] == "THROTTLE" and 0 < storage["factor"] < 1
        assert storage["fail_safe_reason"] is None and storage["source"]["connected"]
        assert 0 <= storage["snapshot_age_s"] < 60
        (b111,) = storage["brokers"]
        assert (b111["broker"], b111["state"], b111["volumes_total"]) == ("111", "THROTTLE", 2)
        assert [(v["name"], v["state"], v["used"]) for v in b111["volumes"]] == [
            ("sda1", "THROTTLE", 0.7), ("sdb1", "OPEN", 0.1)]  # not OPEN first
        fleet = doc["fleet"]
        assert (fleet["configured"], fleet["proxy_id"], fleet["cycle"], fleet["fleet_size"],
                fleet["fail_safe_active"], fleet["sharing"]) == (True, "a", 7, 2, False, "shares")
        assert fleet["buckets"] == [{
            "key": PRODUCER_BYTE_RATE, "kind": "produce", "unit": "B/s", "user": "",
            "client_id": client, "quota": quota, "share": quota / 4, "fraction": 0.25,
            "all_users": True, "all_client_ids": False}]

        page, requested, errors = open_page(chromium, admin)
        try:
            volume = page.wait_for_selector('#storage-volumes tr[data-volume="sda1"]',
                                            timeout=15000)
            cells = [td.text_content() for td in volume.query_selector_all("td")]
            assert cells[:5] == ["111", "THROTTLE (factor %s)" % b111["factor"], "sda1",
                                 "/var/kafka/a", "70.0 %"]
            assert cells[6].startswith("THROTTLE")
            assert page.query_selector('#storage-volumes tr[data-volume="sdb1"]')
            summary = page.text_content("#storage-summary")
            assert summary.startswith("producers meet THROTTLE")
            assert "ZooKeeper connected" in summary
            share = page.wait_for_selector('#fleet-shares tr[data-client-id="%s"]' % client)
            assert [td.text_content() for td in share.query_selector_all("td")] == [
                "produce", "(all users)", client, "500000 B/s (488.3 KiB/s)",
                "125000 B/s (122.1 KiB/s)", "25.0 %"]
            assert page.text_content("#fleet-summary").startswith(
                "proxy a; shares of cycle 7 for 2 proxies")
            page.wait_for_selector('#entities tr[data-entity="clients/%s"]' % client)
        finally:
            page.close()
        assert not errors, errors
    finally:
        p.stop()
        zk.stop()
        zk.close()
