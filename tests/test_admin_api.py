"""The proxy answers Kafka's quota and SCRAM admin APIs for what it owns
(--admin-principals): requests built with kafka-python's codecs over real
connections to real proxies in front of a real Tansu broker, real clients
held to what was set, the ZooKeeper-backed variant with two proxies."""
import asyncio
import hashlib
import os
import socket
import struct
import time
import uuid
import warnings

import pytest

from kthrottle_testkit.clients import (BackgroundProducer, scram_credentials_file, scram_login,
                                       wait_until)
from kthrottle_testkit.proxy import ProxyProcess

from kthrottle.proxy.filters.admin_api import AdminApi
from kthrottle.proxy.filters import standard_filters
from kthrottle.policy.quotas import QuotaManager
from kthrottle.sources.file import FileQuotaSource
from test_pipeline import Harness, advertise, cids, metadata_req, metadata_resp, req_cids

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import (
        AlterClientQuotasRequest,
        AlterClientQuotasResponse,
        AlterUserScramCredentialsRequest,
        AlterUserScramCredentialsResponse,
        DescribeClientQuotasRequest,
        DescribeClientQuotasResponse,
        DescribeUserScramCredentialsRequest,
        DescribeUserScramCredentialsResponse,
    )
    from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse
    from kafka.protocol.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )

pytestmark = pytest.mark.integration

ADMIN_APIS = {48: (0, 1), 49: (0, 1), 50: (0, 0), 51: (0, 0)}


# a raw Kafka connection -----------------------------------------------------------

class Kafka:
    """One connection; ``call`` sends a kafka-python request, returns the answer."""

    def __init__(self, bootstrap, user=None, password=None):
        host, port = bootstrap.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=15)
        self.cid = 0
        if user is not None:
            shake = self.call(SaslHandshakeRequest[1](mechanism="PLAIN"), SaslHandshakeResponse[1])
            assert shake.error_code == 0
            token = b"\0" + user.encode() + b"\0" + password.encode()
            auth = self.call(SaslAuthenticateRequest[2](auth_bytes=token),
                             SaslAuthenticateResponse[2])
            assert auth.error_code == 0, auth.error_message

    def call(self, request, response_cls):
        self.cid += 1
        request.with_header(correlation_id=self.cid, client_id="admin-test")
        self.sock.sendall(bytes(request.encode(header=True, framed=True)))
        size = struct.unpack(">i", self._read(4))[0]
        answer = response_cls.decode(self._read(size), header=True)
        assert answer.header.correlation_id == self.cid
        return answer

    def _read(self, n):
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed by the proxy")
            out += chunk
        return out

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def describe(conn, version, components=(), strict=False):
    cls = DescribeClientQuotasRequest[version]
    request = cls(components=[cls.ComponentData(entity_type=t, match_type=m, match=n)
                              for t, m, n in components], strict=strict)
    answer = conn.call(request, DescribeClientQuotasResponse[version])
    if answer.error_code:
        return answer.error_code, answer.error_message
    return {tuple((e.entity_type, e.entity_name) for e in entry.entity):
            {v.key: v.value for v in entry.values} for entry in answer.entries}


def alter(conn, version, entries, validate_only=False):
    """``entries``: [(entity ((type, name), ...), {key: value or None to remove})]."""
    cls = AlterClientQuotasRequest[version]
    data = cls.EntryData
    request = cls(entries=[data(entity=[data.EntityData(entity_type=t, entity_name=n)
                                        for t, n in entity],
                                ops=[data.OpData(key=k, value=v or 0.0, remove=v is None)
                                     for k, v in ops.items()])
                           for entity, ops in entries], validate_only=validate_only)
    answer = conn.call(request, AlterClientQuotasResponse[version])
    return [(tuple((e.entity_type, e.entity_name) for e in entry.entity), entry.error_code,
             entry.error_message) for entry in answer.entries]


def salted_password(password, salt, iterations, mechanism="SCRAM-SHA-256"):
    name = "sha256" if mechanism == "SCRAM-SHA-256" else "sha512"
    return hashlib.pbkdf2_hmac(name, password.encode(), salt, iterations)


def alter_scram(conn, upsertions=(), deletions=()):
    """upsertions: (user, mechanism type, password, iterations); the salted
    password is computed here, as a client does (KIP-554)."""
    cls = AlterUserScramCredentialsRequest[0]
    ups = []
    for user, mechanism, password, iterations in upsertions:
        salt = os.urandom(24)
        name = "SCRAM-SHA-256" if mechanism == 1 else "SCRAM-SHA-512"
        ups.append(cls.ScramCredentialUpsertion(
            name=user, mechanism=mechanism, iterations=iterations, salt=salt,
            salted_password=salted_password(password, salt, iterations, name)))
    dels = [cls.ScramCredentialDeletion(name=u, mechanism=m) for u, m in deletions]
    answer = conn.call(cls(deletions=dels, upsertions=ups), AlterUserScramCredentialsResponse[0])
    return {r.user: (r.error_code, r.error_message) for r in answer.results}


def describe_scram(conn, users=None):
    cls = DescribeUserScramCredentialsRequest[0]
    request = cls(users=None if users is None else [cls.UserName(name=u) for u in users])
    answer = conn.call(request, DescribeUserScramCredentialsResponse[0])
    return answer.error_code, {r.user: (r.error_code, sorted((c.mechanism, c.iterations)
                                                             for c in r.credential_infos))
                               for r in answer.results}


def api_ranges(bootstrap, version=3):
    with Kafka(bootstrap) as conn:
        fields = {"client_software_name": "t", "client_software_version": "1"} if version >= 3 else {}
        answer = conn.call(ApiVersionsRequest[version](**fields), ApiVersionsResponse[version])
    return {a.api_key: (a.min_version, a.max_version) for a in answer.api_keys}


# the pipeline: a store write after authentication ----------------------------------

def _alter_frame(cid, user, rate):
    cls = AlterClientQuotasRequest[1]
    data = cls.EntryData
    request = cls(entries=[data(entity=[data.EntityData(entity_type="user", entity_name=user)],
                                ops=[data.OpData(key="producer_byte_rate", value=rate,
                                                 remove=False)])], validate_only=False)
    request.with_header(correlation_id=cid, client_id="t")
    return bytes(request.encode(header=True, framed=True))


@pytest.mark.parametrize("job_first", [False, True])
def test_a_write_after_authentication_is_answered_in_request_order(tmp_path, job_first):
    """Pending after authentication: nothing after the request is read until
    the write is done, and its answer goes out in its turn, behind the
    broker's answer to what came before."""
    path = tmp_path / "q.toml"
    path.write_text("# none\n")
    manager = QuotaManager({})
    source = FileQuotaSource(str(path))
    asyncio.run(source.start(manager.update))
    admin = AdminApi({"ANONYMOUS"}, quota_source=source, quotas=manager,
                     run_blocking=lambda fn, *args: fn(*args))
    h = Harness(filters=standard_filters(advertise) + [admin])
    h.run_jobs = False
    h.client(metadata_req(1) + _alter_frame(2, "alice", 4096.0) + metadata_req(3))
    assert req_cids(h.take_broker()) == [1]  # 2 is the proxy's; 3 is not read yet
    assert len(h.jobs) == 1 and h.client_paused_until == float("inf")
    if job_first:
        h.finish_jobs()
        assert h.take_client() == b""  # behind the answer to 1
        assert req_cids(h.take_broker()) == [3]
        h.broker(metadata_resp(1) + metadata_resp(3))
        assert cids(h.take_client()) == [1, 2, 3]
    else:
        h.broker(metadata_resp(1))
        assert cids(h.take_client()) == [1]
        h.finish_jobs()
        assert cids(h.take_client()) == [2]
        assert req_cids(h.take_broker()) == [3]
        h.broker(metadata_resp(3))
        assert cids(h.take_client()) == [3]
    assert h.closed is None
    # in force at once, and in the file
    assert manager.config.snapshot == {"users/alice": {"producer_byte_rate": 4096.0}}
    assert "producer_byte_rate = 4096" in path.read_text()


# a proxy with a quota file -------------------------------------------------------

@pytest.fixture(scope="module")
def file_proxy(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-file")
    quotas = tmp / "quotas.toml"
    quotas.write_text("[users.alice]\nproducer_byte_rate = 1000\n")
    proxy = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                         ["--quota-file", str(quotas), "--admin-principals", "User:ANONYMOUS"])
    proxy.quota_file = quotas
    proxy.start()
    yield proxy
    proxy.stop()


def test_api_versions_lists_the_admin_apis_though_tansu_lacks_them(tansu_broker, tmp_path):
    direct = api_ranges(tansu_broker.bootstrap)
    assert 48 not in direct and 49 not in direct  # Tansu lists the SCRAM APIs, not these
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[users.alice]\nproducer_byte_rate = 1000\n")
    tansu_proxy = ProxyProcess(tansu_broker.bootstrap, tmp_path / "proxy.log",
                               ["--quota-file", str(quotas), "--admin-principals",
                                "User:ANONYMOUS"]).start()
    try:
        all_ranges = [api_ranges(tansu_proxy.bootstrap, version) for version in range(4)]
    finally:
        tansu_proxy.stop()
    for version, ranges in enumerate(all_ranges):
        assert ranges[48] == (0, 1) and ranges[49] == (0, 1), version
        # no credential store on this proxy: the broker's SCRAM range, as it lists it
        assert ranges.get(50) == direct.get(50) and ranges.get(51) == direct.get(51)
        assert ranges[0] == direct[0] or ranges[0][1] <= direct[0][1]


@pytest.mark.parametrize("version", [0, 1])
def test_quotas_are_described_and_altered_as_kafka_does(file_proxy, version):
    user = "u%d-%s" % (version, uuid.uuid4().hex[:6])
    app = "app-" + user
    with Kafka(file_proxy.bootstrap) as conn:
        results = alter(conn, version, [
            (((("user", user),)), {"producer_byte_rate": 2048.0, "request_rate": 10.0}),
            ((("user", user), ("client-id", app)), {"consumer_byte_rate": 4096.0}),
            ((("client-id", app),), {"producer_byte_rate": 8192.0}),
            ((("client-id", None),), {"consumer_byte_rate": 1048576.0}),
            ((("user", user),), {"request_rate": 1.0}),  # the same entity twice: refused
            ((("user", "x" + user),), {"nonsense": 1.0}),
            ((("user", "y" + user),), {"request_percentage": 50.0}),
            ((("ip", "10.0.0.300"),), {"connection_creation_rate": 5.0}),
        ])
        codes = [(code, message) for _, code, message in results]
        assert [c for c, _ in codes] == [0, 0, 0, 0, 42, 42, 42, 42]
        assert codes[4][1].startswith("Ignoring duplicate entity")
        assert codes[5][1] == "Invalid configuration key nonsense"
        assert "request_rate" in codes[6][1] and "request_percentage" in codes[6][1]
        assert codes[7][1].startswith("not an ip address: '10.0.0.300'")
        # in force at once: described right after, on another connection too
        with Kafka(file_proxy.bootstrap) as other:
            assert describe(other, version, [("user", 0, user)], strict=True) == {
                (("user", user),): {"producer_byte_rate": 2048.0, "request_rate": 10.0}}
        assert describe(conn, version, [("user", 0, user)]) == {
            (("user", user),): {"producer_byte_rate": 2048.0, "request_rate": 10.0},
            (("user", user), ("client-id", app)): {"consumer_byte_rate": 4096.0}}
        assert describe(conn, version, [("client-id", 0, app)], strict=True) == {
            (("client-id", app),): {"producer_byte_rate": 8192.0}}
        assert describe(conn, version, [("client-id", 1, None)], strict=True) == {
            (("client-id", None),): {"consumer_byte_rate": 1048576.0}}
        anyone = describe(conn, version, [("user", 2, None)], strict=True)
        assert (("user", user),) in anyone and (("user", "alice"),) in anyone
        assert all(len(entity) == 1 for entity in anyone)
        assert describe(conn, version, [("user", 2, None), ("ip", 2, None)]) == (
            42, "Invalid entity filter component combination, IP filter component should not "
                "be used with user or clientId filter component.")
        # validate_only writes nothing
        before = file_proxy.quota_file.read_text()
        assert alter(conn, version, [((("user", user),), {"producer_byte_rate": 1.0})],
                     validate_only=True)[0][1] == 0
        assert file_proxy.quota_file.read_text() == before
        assert describe(conn, version, [("user", 0, user)], strict=True)[
            (("user", user),)]["producer_byte_rate"] == 2048.0
        # removing keys; an entity left with none is gone
        assert alter(conn, version, [
            ((("user", user),), {"producer_byte_rate": None, "request_rate": None}),
            ((("client-id", None),), {"consumer_byte_rate": None})])[0][1] == 0
        assert describe(conn, version, [("user", 0, user)], strict=True) == {}
        assert describe(conn, version, [("client-id", 1, None)], strict=True) == {}
    text = file_proxy.quota_file.read_text()
    assert "[users.%s.clients.%s]" % (user, app) in text and "request_percentage" not in text


def test_a_producer_is_held_to_a_quota_set_through_the_proxy(broker, file_proxy):
    topic = "adm-%s" % uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)
    client_id = "held-" + uuid.uuid4().hex[:6]
    with Kafka(file_proxy.bootstrap) as conn:
        assert alter(conn, 1, [((("client-id", client_id),), {"producer_byte_rate": 65536.0})]
                     )[0][1] == 0
    with BackgroundProducer(file_proxy.bootstrap, topic, client_id) as producer:
        time.sleep(2.0)
        t0 = time.monotonic()
        time.sleep(4.0)
        rate = producer.rate(t0, time.monotonic())
    assert producer.error is None
    # 64 KiB/s set; unthrottled this runs at megabytes a second
    assert 0 < rate < 65536 * 2, rate


# SCRAM users through a terminate-mode proxy ---------------------------------------

@pytest.fixture(scope="module")
def sasl_proxy(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-sasl")
    creds = scram_credentials_file(tmp / "credentials.toml", {"admin": "admin-pw",
                                                               "bob": "bob-pw"},
                                   mechanisms=("SCRAM-SHA-256",))
    quotas = tmp / "quotas.toml"
    quotas.write_text("# none\n")
    proxy = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                         ["--security-protocol", "SASL_PLAINTEXT",
                          "--sasl-enabled-mechanisms", "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512",
                          "--credentials-file", str(creds), "--quota-file", str(quotas),
                          "--admin-principals", "User:admin"])
    proxy.credentials_file, proxy.quota_file = creds, quotas
    proxy.start()
    yield proxy
    proxy.stop()


def test_before_authentication_api_versions_lists_the_four(sasl_proxy):
    ranges = api_ranges(sasl_proxy.bootstrap)
    assert {k: ranges[k] for k in ADMIN_APIS} == ADMIN_APIS


def test_a_scram_user_created_through_the_proxy_logs_in_then_is_deleted(sasl_proxy):
    user = "carol-" + uuid.uuid4().hex[:6]
    with Kafka(sasl_proxy.bootstrap, "admin", "admin-pw") as conn:
        assert describe_scram(conn, [user])[1] == {user: (
            91, [])}
        assert alter_scram(conn, upsertions=[(user, 2, "carol-pw", 8192),
                                             (user, 1, "carol-pw", 4096)]) == {user: (0, None)}
        assert describe_scram(conn, [user]) == (0, {user: (0, [(1, 4096), (2, 8192)])})
        text = sasl_proxy.credentials_file.read_text()
        assert "carol-pw" not in text and "stored_key=" in text
        assert alter_scram(conn, upsertions=[("weak-" + user, 1, "pw", 1000)]) == {
            "weak-" + user: (93, "Too few iterations")}
        assert alter_scram(conn, upsertions=[(user, 1, "a", 4096), (user, 1, "b", 4096)]) == {
            user: (92, "A user credential cannot be altered twice in the same request")}
        assert alter_scram(conn, upsertions=[(user, 7, "a", 4096)]) == {
            user: (33, "Unknown SCRAM mechanism")}
        everyone = describe_scram(conn)[1]
        assert {"admin", "bob", user} <= set(everyone)
    assert scram_login(sasl_proxy.bootstrap, user, "carol-pw")
    assert not scram_login(sasl_proxy.bootstrap, user, "wrong")
    with Kafka(sasl_proxy.bootstrap, "admin", "admin-pw") as conn:
        assert alter_scram(conn, deletions=[(user, 2)]) == {user: (0, None)}
        assert alter_scram(conn, deletions=[(user, 2)]) == {
            user: (91, "Attempt to delete a user credential that does not exist")}
    assert not scram_login(sasl_proxy.bootstrap, user, "carol-pw")  # SHA-512 is gone


def test_a_non_admin_principal_is_refused_and_nothing_changes(sasl_proxy):
    quotas = sasl_proxy.quota_file.read_text()
    creds = sasl_proxy.credentials_file.read_text()
    with Kafka(sasl_proxy.bootstrap, "bob", "bob-pw") as conn:
        for version in (0, 1):
            assert describe(conn, version) == (31, "Cluster authorization failed.")
            assert [code for _, code, _ in alter(conn, version, [
                ((("user", "bob"),), {"producer_byte_rate": 1e9}),
                ((("client-id", "x"),), {"request_rate": 1e9})])] == [31, 31]
        assert describe_scram(conn)[0] == 31
        assert alter_scram(conn, upsertions=[("bob", 1, "new", 4096)],
                           deletions=[("admin", 1)]) == {"bob": (31, "Cluster authorization "
                                                                 "failed."),
                                                         "admin": (31, "Cluster authorization "
                                                                   "failed.")}
    assert sasl_proxy.quota_file.read_text() == quotas
    assert sasl_proxy.credentials_file.read_text() == creds
    assert scram_login(sasl_proxy.bootstrap, "bob", "bob-pw") is not None
    sasl_proxy.wait_for_log("principal bob may not use api key 49")


# ZooKeeper: two proxies share the quotas and the users -------------------------------

def test_zookeeper_quotas_and_users_reach_the_other_proxies(broker, zookeeper, tmp_path):
    from kazoo.client import KazooClient

    hosts = zookeeper.hosts + "/admin-" + uuid.uuid4().hex[:6]
    first = ProxyProcess(broker.bootstrap, tmp_path / "first.log",
                         ["--zookeeper", hosts, "--admin-principals", "User:ANONYMOUS"])
    second = ProxyProcess(broker.bootstrap, tmp_path / "second.log",
                          ["--zookeeper", hosts, "--admin-principals", "User:ANONYMOUS"])
    verifier = ProxyProcess(broker.bootstrap, tmp_path / "verifier.log",
                            ["--zookeeper", hosts, "--security-protocol", "SASL_PLAINTEXT",
                             "--sasl-enabled-mechanisms", "SCRAM-SHA-512"])
    started = []
    try:
        for proxy in (first, second, verifier):
            started.append(proxy.start())
        # a PLAINTEXT proxy manages the users: it names the store without SASL of its own
        assert {k: v for k, v in api_ranges(first.bootstrap).items() if k in ADMIN_APIS} == \
            ADMIN_APIS
        with Kafka(first.bootstrap) as conn:
            assert alter(conn, 1, [((("user", "dave"), ("client-id", None)),
                                    {"producer_byte_rate": 4096.0})])[0][1] == 0
            assert describe(conn, 1, [("user", 0, "dave")]) == {
                (("user", "dave"), ("client-id", None)): {"producer_byte_rate": 4096.0}}
            assert alter_scram(conn, upsertions=[("dave", 2, "dave-pw", 4096)]) == {
                "dave": (0, None)}
            assert describe_scram(conn, ["dave"]) == (0, {"dave": (0, [(2, 4096)])})
        with Kafka(second.bootstrap) as conn:
            assert wait_until(lambda: describe(conn, 0, [("user", 0, "dave")]), 10) == {
                (("user", "dave"), ("client-id", None)): {"producer_byte_rate": 4096.0}}
            assert wait_until(lambda: describe_scram(conn, ["dave"])[1]["dave"][0] == 0, 10)
        # the verifying proxy lets dave in with the password whose salted form was sent
        assert wait_until(lambda: scram_login(verifier.bootstrap, "dave", "dave-pw"), 15)
        zk = KazooClient(hosts=hosts)
        zk.start(timeout=10)
        try:
            data = zk.get("/config/users/dave")[0].decode()
            assert '"SCRAM-SHA-512":"salt=' in data and "dave-pw" not in data
            assert '"producer_byte_rate":"4096"' in zk.get(
                "/config/users/dave/clients/<default>")[0].decode()
        finally:
            zk.stop()
            zk.close()
        with Kafka(first.bootstrap) as conn:
            assert alter_scram(conn, deletions=[("dave", 2)]) == {"dave": (0, None)}
        assert wait_until(lambda: not scram_login(verifier.bootstrap, "dave", "dave-pw"), 15)
    finally:
        for proxy in started:
            proxy.stop()


def test_a_plaintext_proxy_manages_the_users_of_a_credentials_file(broker, tmp_path):
    """--credentials-file with --admin-principals on a proxy without SASL: the
    users it creates log in through the proxy that verifies with that file."""
    creds = scram_credentials_file(tmp_path / "credentials.toml", {"admin": "admin-pw"},
                                   mechanisms=("SCRAM-SHA-256",))
    manager = ProxyProcess(broker.bootstrap, tmp_path / "manager.log",
                           ["--credentials-file", str(creds),
                            "--admin-principals", "User:ANONYMOUS"])
    verifier = ProxyProcess(broker.bootstrap, tmp_path / "verifier.log",
                            ["--credentials-file", str(creds), "--security-protocol",
                             "SASL_PLAINTEXT", "--sasl-enabled-mechanisms", "SCRAM-SHA-512"])
    started = []
    try:
        for proxy in (manager, verifier):
            started.append(proxy.start())
        user = "erin-" + uuid.uuid4().hex[:6]
        with Kafka(manager.bootstrap) as conn:
            assert alter_scram(conn, upsertions=[(user, 2, "erin-pw", 4096)]) == {
                user: (0, None)}
        assert "erin-pw" not in creds.read_text()
        assert wait_until(lambda: scram_login(verifier.bootstrap, user, "erin-pw"), 15)
    finally:
        for proxy in started:
            proxy.stop()
