"""Quota groups, quota callbacks (KIP-257) and a shared produce capacity with
real clients through a real proxy in front of the session's Apache Kafka node:
the rates aiokafka producers are held to, what /quotas and /metrics say of
the buckets they share, and what a callback that fails or cannot be loaded
does to the proxy."""
import asyncio
import subprocess
import sys
import time
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit import ROOT
from kthrottle_testkit.clients import (BackgroundProducer, admin_get, scram_credentials_file,
                                       wait_until)
from kthrottle_testkit.proxy import ProxyProcess
from test_fault_resync import metric

pytestmark = pytest.mark.integration

KIB, MIB = 1024, 1024 * 1024
# the SASL users of these tests (PLAIN, checked against their SCRAM credentials)
USERS = ("a", "b", "c", "d", "e", "t1", "t2")
SECONDS = 5.0  # each rate is measured over this long


def password(user):
    return "%s-secret" % user


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    path = tmp_path_factory.mktemp("callback-credentials") / "credentials.toml"
    return scram_credentials_file(path, {u: password(u) for u in USERS},
                                  mechanisms=("SCRAM-SHA-256",))


class Producer(BackgroundProducer):
    """BackgroundProducer, with SASL/PLAIN as ``user`` when one is given."""

    def __init__(self, bootstrap, topic, client_id, user=None):
        auth = {} if user is None else dict(
            security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
            sasl_plain_username=user, sasl_plain_password=password(user))
        super().__init__(bootstrap, topic, client_id, **auth)

    @property
    def delivered(self):
        return len(self.events)


def _proxy(broker, tmp_path, *args, name="proxy"):
    p = ProxyProcess(broker.bootstrap, tmp_path / ("%s.log" % name), [str(a) for a in args])
    p.admin = free_port()
    p.extra_args += ["--admin-listen", str(p.admin)]
    try:
        return p.start()
    except BaseException:
        p.stop()
        raise


def _sasl_args(credentials):
    return ("--security-protocol", "SASL_PLAINTEXT", "--credentials-file", credentials)


def _topic(broker, prefix):
    name = "%s-%s" % (prefix, uuid.uuid4().hex[:8])
    broker.create_topic(name, partitions=1)
    return name


def _rates(producers, warmup=2.0, seconds=SECONDS):
    """Each producer's delivered bytes/s over ``seconds``, measured once every
    one of them delivered, plus ``warmup`` (the 1-s burst allowance, then 1 s)."""
    assert wait_until(lambda: all(p.delivered or p.error for p in producers), 30), \
        [(p.client_id, p.delivered) for p in producers]
    assert all(p.error is None for p in producers), [p.error for p in producers]
    time.sleep(warmup)
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    assert all(p.error is None for p in producers), [p.error for p in producers]
    return [p.rate(t0, t1) for p in producers]


def _produce_entries(port, principal=None, client_id=None):
    """The produce entries of /quotas of the connections of ``principal``
    (any when None) for ``client_id`` (any when None)."""
    out = []
    for conn in admin_get(port, "/quotas")["connections"]:
        if principal is not None and conn["principal"] not in (principal, "User:" + principal):
            continue
        for client in conn["clients"]:
            if client_id is None or client["client_id"] == client_id:
                if client["produce"]["quota"] is not None:
                    out.append(client["produce"])
    return out


def _within(value, target, margin):
    return abs(value - target) <= margin * target


# -- 1. a quota group ----------------------------------------------------------------------

def test_a_quota_group_of_three_users_shares_one_quota(broker, credentials, tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text(
        '[groups.etl]\nmembers = ["User:a", "User:b", "User:c"]\n'
        'producer_byte_rate = %d\n\n'
        '[users."<default>"]\nproducer_byte_rate = %d\n' % (MIB, 512 * KIB))
    p = _proxy(broker, tmp_path, "--quota-file", quotas, *_sasl_args(credentials))
    topic = _topic(broker, "group")
    try:
        # e is no member; a hostile e sends the client-id a does: it changes nothing
        with Producer(p.bootstrap, topic, "etl-app", user="a") as a, \
                Producer(p.bootstrap, topic, "etl-b", user="b") as b, \
                Producer(p.bootstrap, topic, "etl-c", user="c") as c, \
                Producer(p.bootstrap, topic, "etl-app", user="e") as e:
            ra, rb, rc, re_ = _rates([a, b, c, e])
            members = {u: _produce_entries(p.admin, principal=u) for u in "abc"}
            outsider = _produce_entries(p.admin, principal="e")
            group_rate = metric(p.admin, "kthrottle_produce_byte_rate", user="group=etl")
            series = [line for line in admin_get(p.admin, "/metrics").splitlines()
                      if line.startswith("kthrottle_produce_byte_rate{")]
        group = ra + rb + rc
        print("group etl: a %.0f b %.0f c %.0f sum %.0f B/s (quota %d); e %.0f B/s (quota %d); "
              "metric %s" % (ra, rb, rc, group, MIB, re_, 512 * KIB, group_rate))
        print("\n".join(series))
        assert _within(group, MIB, 0.05), group
        assert min(ra, rb, rc) > 0.1 * MIB, (ra, rb, rc)  # each member gets a part
        # the outsider keeps its own quota, neither slowed by the group nor in it
        assert _within(re_, 512 * KIB, 0.10), re_
        # one bucket, shared by the group's members, and only by them
        for user, entries in members.items():
            assert entries, (user, admin_get(p.admin, "/quotas"))
            for entry in entries:
                assert entry["shared_by"] == {"user": "group=etl", "client_id": ""}, entry
                assert entry["entity"] == "groups/etl" and entry["quota"] == MIB, entry
        assert outsider and all(
            entry["shared_by"] == {"user": "e", "client_id": ""}
            and entry["entity"] == "users/<default>" and entry["quota"] == 512 * KIB
            for entry in outsider), outsider
        # Kafka's windowed rate (over at least 10 s, so below the quota this early)
        assert group_rate is not None and 0.5 * MIB < group_rate < 1.15 * MIB, group_rate
        assert not [line for line in series if 'user="a"' in line or 'user="b"' in line
                    or 'user="c"' in line], series
        entities = admin_get(p.admin, "/quotas")["entities"]
        assert {"entity": "groups/etl", "members": ["User:a", "User:b", "User:c"],
                "quotas": {"producer_byte_rate": MIB}} in entities, entities
    finally:
        p.stop()


# -- 2. a client-id member and a user's quota -----------------------------------------------

def test_a_client_id_member_cannot_escape_its_users_quota(broker, credentials, tmp_path):
    quota = 100 * KIB
    quotas = tmp_path / "quotas.toml"
    quotas.write_text(
        '[groups.etl]\nmembers = ["client-id:etl-*"]\nproducer_byte_rate = %d\n\n'
        '[users.d]\nproducer_byte_rate = %d\n' % (8 * MIB, quota))
    p = _proxy(broker, tmp_path, "--quota-file", quotas, *_sasl_args(credentials))
    topic = _topic(broker, "escape")
    try:
        # d picks a client-id of the group's; e, with no quota of its own, is in the group
        with Producer(p.bootstrap, topic, "etl-1", user="d") as d, \
                Producer(p.bootstrap, topic, "etl-2", user="e") as e:
            rd, re_ = _rates([d, e])
            d_entries = _produce_entries(p.admin, principal="d")
            e_entries = _produce_entries(p.admin, principal="e")
        print("d (users/d %d) as etl-1: %.0f B/s; e as etl-2 (group %d): %.0f B/s"
              % (quota, rd, 8 * MIB, re_))
        assert rd < 1.5 * quota, rd
        assert rd > 0.5 * quota, rd  # it did produce
        assert re_ > 3 * quota, re_  # the group is the big quota: d is not in it
        assert d_entries and all(x["entity"] == "users/d" and x["quota"] == quota
                                 and x["shared_by"]["user"] == "d" for x in d_entries), d_entries
        assert e_entries and all(x["entity"] == "groups/etl" for x in e_entries), e_entries
    finally:
        p.stop()


# -- 3. the README's example callback -------------------------------------------------------

def test_the_readme_example_callback_is_loaded_and_followed(broker, credentials, tmp_path):
    budgets = tmp_path / "teams.toml"
    budgets.write_text('[teams.ingest]\nmembers = ["t1", "t2"]\nproducer_byte_rate = %d\n'
                       % (200 * KIB))
    config = tmp_path / "kthrottle.toml"
    config.write_text('[quota-callback]\nclass = "%s:TeamQuotas"\n\n[quota-callback.config]\n'
                      'budgets = "%s"\n' % (ROOT / "examples" / "quota_callback.py", budgets))
    p = _proxy(broker, tmp_path, "--config", config, *_sasl_args(credentials))
    topic = _topic(broker, "team")
    try:
        p.wait_for_log("quota callback %s:TeamQuotas decides"
                       % (ROOT / "examples" / "quota_callback.py"))
        with Producer(p.bootstrap, topic, "ingest-1", user="t1") as t1, \
                Producer(p.bootstrap, topic, "ingest-2", user="t2") as t2:
            r1, r2 = _rates([t1, t2])
            entries = _produce_entries(p.admin)
            # the team's budget doubled: the file is re-read, the limits follow
            budgets.write_text('[teams.ingest]\nmembers = ["t1", "t2"]\n'
                               'producer_byte_rate = %d\n' % (400 * KIB))
            assert wait_until(lambda: {x["quota"] for x in _produce_entries(p.admin)}
                              == {400 * KIB}, 15), _produce_entries(p.admin)
            s1, s2 = _rates([t1, t2], warmup=3.0)
        print("team ingest at 200 KiB/s: %.0f + %.0f = %.0f B/s; at 400 KiB/s: %.0f + %.0f = "
              "%.0f B/s" % (r1, r2, r1 + r2, s1, s2, s1 + s2))
        assert entries and all(x["shared_by"] == {"user": "team=ingest", "client_id": ""}
                               and x["quota"] == 200 * KIB for x in entries), entries
        assert _within(r1 + r2, 200 * KIB, 0.05), r1 + r2
        assert _within(s1 + s2, 400 * KIB, 0.10), s1 + s2
    finally:
        p.stop()


# -- 4. a callback that fails ---------------------------------------------------------------

FRAGILE = '''
class Fragile:
    """Tags every client by its client-id, a 4 MiB/s produce quota each;
    fails for the client-id "boom"."""

    def configure(self, config):
        self.limit = float(config.get("limit", 4194304))

    def quota_metric_tags(self, quota_type, principal, client_id):
        if client_id == "boom":
            raise RuntimeError("no tags for boom")
        return {"client-id": client_id}

    def quota_limit(self, quota_type, metric_tags):
        return self.limit if quota_type == "PRODUCE" else None

    def update_quota(self, quota_type, entity, new_value):
        pass

    def remove_quota(self, quota_type, entity):
        pass

    def quota_reset_required(self, quota_type):
        return False

    def update_cluster_metadata(self, cluster):
        return False

    def close(self):
        pass
'''


def _read_frame(sock):
    """One length-prefixed Kafka frame from ``sock``; b"" once it is closed."""
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data


def test_a_callback_that_fails_closes_only_the_connection_that_asked(broker, tmp_path):
    import socket

    from test_pipeline import metadata_req

    callback = tmp_path / "fragile.py"
    callback.write_text(FRAGILE)
    p = _proxy(broker, tmp_path, "--quota-callback", "%s:Fragile" % callback)
    topic = _topic(broker, "fragile")
    try:
        with Producer(p.bootstrap, topic, "steady") as steady:
            assert wait_until(lambda: steady.delivered or steady.error, 30)

            # a producer that is "boom" from its first request cannot even bootstrap
            async def boom():
                from aiokafka import AIOKafkaProducer

                producer = AIOKafkaProducer(bootstrap_servers=p.bootstrap, client_id="boom",
                                            request_timeout_ms=5000)
                try:
                    await producer.start()
                    await asyncio.wait_for(producer.send_and_wait(topic, b"x", partition=0), 10)
                finally:
                    await producer.stop()

            with pytest.raises(Exception) as failed:
                asyncio.run(asyncio.wait_for(boom(), 30))
            # a connection serving "fine" is closed when it sends a request as "boom"
            s = socket.create_connection(("127.0.0.1", p.port), timeout=10)
            try:
                s.sendall(metadata_req(1, client_id="fine"))
                assert _read_frame(s), "no answer for the client-id fine"
                s.sendall(metadata_req(2, client_id="boom"))
                assert _read_frame(s) == b"", "answered the client-id boom"
            finally:
                s.close()
            p.wait_for_log("quota callback failed: ")
            # the other client is served all along
            before = steady.delivered
            assert wait_until(lambda: steady.delivered > before + 100, 15), \
                (before, steady.delivered)
            assert steady.error is None, steady.error
            assert _produce_entries(p.admin, client_id="steady")
            assert p.alive()
        log = p.log()
        warnings = [line for line in log.splitlines()
                    if " WARNING " in line and "quota_metric_tags failed" in line]
        closed = [line for line in log.splitlines()
                  if " closed: " in line and "quota_metric_tags failed" in line]
        print("boom producer: %r" % failed.value)
        print("\n".join(warnings + closed))
        assert warnings and all(
            "Fragile.quota_metric_tags failed: RuntimeError: no tags for boom" in line
            and "the connection is closed" in line for line in warnings), warnings
        assert len(closed) >= 2, closed  # the producer's connection(s) and the raw one
        # a request that arrives before the proxy's connection to the broker is up (the
        # producer's first ApiVersions) meets the failure there: the same WARNING, no ERROR
        assert len(warnings) == len(closed), (warnings, closed)
        assert "internal error" not in log and " ERROR " not in log, \
            [line for line in log.splitlines() if " ERROR " in line or "internal error" in line]
    finally:
        p.stop()


# -- 5. a callback that cannot be loaded ----------------------------------------------------

HALF = '''
class Half:
    def configure(self, config):
        pass

    def quota_metric_tags(self, quota_type, principal, client_id):
        return None
'''


def _start_with_callback(spec):
    """kthrottle proxy with --quota-callback ``spec``: (exit code, output, seconds taken)."""
    listen = free_port()
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", "127.0.0.1:9",
             "--listen", "127.0.0.1:%d" % listen, "--node-port-base", str(free_port()),
             "--quota-callback", spec],
            capture_output=True, text=True, cwd=ROOT, timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:  # run() killed it
        pytest.fail("kthrottle proxy --quota-callback %s still ran after 30 s" % spec)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def test_a_callback_that_cannot_be_loaded_stops_the_start(tmp_path):
    code, out, took = _start_with_callback("nosuch.module:X")
    print("nosuch.module:X -> %d in %.1f s: %s" % (code, took, out.strip()))
    assert code != 0 and took < 20, (code, took, out)
    assert "nosuch.module" in out and "cannot import" in out, out

    half = tmp_path / "half.py"
    half.write_text(HALF)
    code, out, took = _start_with_callback("%s:Half" % half)
    print("Half -> %d in %.1f s: %s" % (code, took, out.strip()))
    assert code != 0 and took < 20, (code, took, out)
    lacking = ("quota_limit", "update_quota", "remove_quota", "quota_reset_required",
               "update_cluster_metadata", "close")
    assert all(m in out for m in lacking), out
    assert "lacks" in out and "configure" not in out.partition("lacks")[2], out

    code, out, _ = _start_with_callback("%s:Missing" % half)
    assert code != 0 and "has no Missing" in out, out


# -- 6. a shared produce capacity -----------------------------------------------------------

def test_shared_capacity_is_split_among_busy_producers(broker, tmp_path):
    # PLAINTEXT clients are all User:ANONYMOUS: clients/<default> gives each
    # client-id a bucket of its own (users/<default> would give them one)
    quota, capacity = MIB, 3 * MIB
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('[clients."<default>"]\nproducer_byte_rate = %d\n' % quota)
    p = _proxy(broker, tmp_path, "--quota-file", quotas,
               "--shared-produce-capacity", capacity)
    topic = _topic(broker, "capacity")
    try:
        with Producer(p.bootstrap, topic, "cap-1") as p1, \
                Producer(p.bootstrap, topic, "cap-2") as p2:
            with Producer(p.bootstrap, topic, "cap-3") as p3:
                three = _rates([p1, p2, p3])
            assert p3.error is None, p3.error
            time.sleep(3.0)  # p3's part goes to the busy ones
            two = _rates([p1, p2], warmup=0)
        print("capacity %d: three producers %s B/s; two of them then %s B/s"
              % (capacity, ["%.0f" % r for r in three], ["%.0f" % r for r in two]))
        assert all(_within(r, capacity / 3, 0.05) for r in three), three
        assert all(_within(r, capacity / 2, 0.05) for r in two), two
    finally:
        p.stop()
