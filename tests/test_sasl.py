"""SASL terminate mode in the connection pipeline, without sockets: real
SCRAM (scramp) on both sides, a fake clock, bytes in and actions out."""
import struct

import pytest
from scramp import ScramClient

from kthrottle.codecs import apis
from kthrottle.policy.entities import PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.proxy.filters.sasl import (
    ILLEGAL_SASL_STATE,
    SASL_AUTHENTICATION_FAILED,
    UNSUPPORTED_SASL_MECHANISM,
)
from kthrottle.proxy.filters.sasl_terminate import SaslTerminate
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.pipeline import Connection, FilterTable, Phase
from kthrottle.sources.credentials import Credentials, scram_from_password
from kthrottle_testkit.frames import advertise
from test_pipeline import Harness, api_versions_req, cids, frames_of, produce_req, req_cids

from kthrottle.proxy.filters.sasl import SaslAuthenticateRequest, SaslAuthenticateResponse
from kthrottle.proxy.filters.sasl import SaslHandshakeRequest, SaslHandshakeResponse

pytestmark = pytest.mark.unit

USERS = {"alice": "alice-secret", "bob": "bob-secret"}


def credentials():
    return Credentials({user: {m: scram_from_password(m, pw, iterations=4096)
                               for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")}
                        for user, pw in USERS.items()})


CREDENTIALS = credentials()


class Versions:
    """What ProxyServer's ApiVersionsCache offers the authenticator: the
    broker's version ranges, known or fetched on demand."""

    RANGES = ((0, 0, 11), (1, 0, 99), (3, 0, 12), (17, 0, 1), (18, 0, 4), (36, 0, 2))

    def __init__(self, known=True):
        self.current = self.RANGES if known else None
        self.fetched = 0

    def fetch(self):
        self.fetched += 1
        return self.RANGES


class SaslHarness(Harness):
    def __init__(self, snapshot=None, mechanisms=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
                 versions=None, run_jobs=True, credentials=CREDENTIALS):
        self.versions = versions or Versions()
        self.auth = SaslTerminate(list(mechanisms), lambda: credentials, failed_delay_ms=100,
                                  api_versions=self.versions)
        manager = QuotaManager(snapshot) if snapshot is not None else None
        super().__init__(filters=standard_filters(advertise, manager, self.auth))
        self.run_jobs = run_jobs
        self.conn.quota_manager = self.manager = manager

    def answer(self):
        (frame,) = frames_of(self.take_client())
        return frame


def handshake(cid, mechanism, version=1):
    req = SaslHandshakeRequest[version](mechanism=mechanism)
    req.with_header(correlation_id=cid, client_id="app-1")
    return bytes(req.encode(header=True, framed=True))


def authenticate(cid, token, version=1):
    req = SaslAuthenticateRequest[version](auth_bytes=token)
    req.with_header(correlation_id=cid, client_id="app-1")
    return bytes(req.encode(header=True, framed=True))


def decode_authenticate(frame, version=1):
    skip = 9 if version >= 2 else 8  # v2: flexible response header
    return SaslAuthenticateResponse[version].decode(frame[skip:])


def plain(user, password, authzid=""):
    return ("%s\0%s\0%s" % (authzid, user, password)).encode()


def test_plain_authenticates_and_binds_the_principal():
    h = SaslHarness()
    assert h.conn.phase is Phase.AUTHENTICATING
    h.client(handshake(1, "PLAIN"))
    hs = SaslHandshakeResponse[1].decode(h.answer()[8:])
    assert hs.error_code == 0 and "SCRAM-SHA-512" in hs.mechanisms
    h.client(authenticate(2, plain("alice", "alice-secret")))
    assert decode_authenticate(h.answer()).error_code == 0
    assert h.conn.phase is Phase.READY and h.conn.principal == "alice"
    assert h.take_broker() == b""  # the exchange never reached the broker
    h.client(produce_req(3))
    assert req_cids(h.take_broker()) == [3]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
@pytest.mark.parametrize("version", [0, 1, 2])
def test_scram_exchange_over_sasl_authenticate(mechanism, version):
    h = SaslHarness()
    h.client(handshake(1, mechanism))
    h.answer()
    client = ScramClient([mechanism], "bob", "bob-secret")
    h.client(authenticate(2, client.get_client_first().encode(), version))
    first = decode_authenticate(h.answer(), version)
    assert first.error_code == 0
    client.set_server_first(bytes(first.auth_bytes).decode())
    h.client(authenticate(3, client.get_client_final().encode(), version))
    final = decode_authenticate(h.answer(), version)
    assert final.error_code == 0
    client.set_server_final(bytes(final.auth_bytes).decode())  # the server proved itself too
    assert h.conn.principal == "bob" and h.conn.phase is Phase.READY


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_raw_tokens_after_a_v0_handshake(mechanism):
    h = SaslHarness()
    h.client(handshake(1, mechanism, version=0))
    assert SaslHandshakeResponse[0].decode(h.answer()[8:]).error_code == 0

    def raw(token):
        h.client(len(token).to_bytes(4, "big") + token)
        out = h.take_client()
        n = struct.unpack_from(">i", out)[0]
        assert len(out) == 4 + n
        return out[4:]

    if mechanism == "PLAIN":
        assert raw(plain("alice", "alice-secret")) == b""
    else:
        client = ScramClient([mechanism], "alice", "alice-secret")
        client.set_server_first(raw(client.get_client_first().encode()).decode())
        client.set_server_final(raw(client.get_client_final().encode()).decode())
    assert h.conn.principal == "alice" and h.conn.phase is Phase.READY
    h.client(api_versions_req(9))  # back to Kafka frames
    assert req_cids(h.take_broker()) == [9]


@pytest.mark.parametrize("user,password", [("alice", "wrong"), ("mallory", "x")])
def test_bad_credentials_are_answered_after_the_delay_then_closed(user, password):
    h = SaslHarness()
    h.client(handshake(1, "PLAIN"))
    h.answer()
    h.client(authenticate(2, plain(user, password)) + produce_req(3))
    assert h.to_client == b"" and h.closed is None  # not yet: KIP-306's delay
    h.at(0.05)
    assert h.to_client == b""
    h.at(0.1)
    answer = decode_authenticate(h.answer())
    assert answer.error_code == SASL_AUTHENTICATION_FAILED
    assert password not in (answer.error_message or "")
    assert h.closed and h.take_broker() == b""
    assert h.conn.principal == "ANONYMOUS"


def test_a_wrong_scram_proof_fails():
    h = SaslHarness()
    h.client(handshake(1, "SCRAM-SHA-512"))
    h.answer()
    client = ScramClient(["SCRAM-SHA-512"], "alice", "not-her-password")
    h.client(authenticate(2, client.get_client_first().encode()))
    client.set_server_first(bytes(decode_authenticate(h.answer()).auth_bytes).decode())
    h.client(authenticate(3, client.get_client_final().encode()))
    h.at(1.0)
    assert decode_authenticate(h.answer()).error_code == SASL_AUTHENTICATION_FAILED
    assert h.closed and h.conn.principal == "ANONYMOUS"


def test_an_unsupported_mechanism_is_refused_with_the_list():
    h = SaslHarness(mechanisms=("SCRAM-SHA-512",))
    h.client(handshake(1, "PLAIN"))
    h.at(1.0)
    hs = SaslHandshakeResponse[1].decode(h.answer()[8:])
    assert hs.error_code == UNSUPPORTED_SASL_MECHANISM and hs.mechanisms == ["SCRAM-SHA-512"]
    assert h.closed


def test_plain_cannot_act_as_another_user():
    h = SaslHarness()
    h.client(handshake(1, "PLAIN"))
    h.answer()
    h.client(authenticate(2, plain("alice", "alice-secret", authzid="bob")))
    h.at(1.0)
    assert decode_authenticate(h.answer()).error_code == SASL_AUTHENTICATION_FAILED


def test_authenticate_before_handshake_is_an_illegal_state():
    h = SaslHarness()
    h.client(authenticate(1, plain("alice", "alice-secret")))
    h.at(1.0)
    assert decode_authenticate(h.answer()).error_code == ILLEGAL_SASL_STATE
    assert h.closed and h.conn.principal == "ANONYMOUS"


def test_a_request_before_authentication_closes_and_reaches_no_broker():
    h = SaslHarness()
    h.client(api_versions_req(1))  # allowed: clients ask before SaslHandshake
    assert h.take_broker() == b"" and cids(h.take_client()) == [1]  # the proxy answered
    h.client(produce_req(2))
    assert h.take_broker() == b""
    assert "before authentication" in h.closed and h.refused == "unauthenticated_request"
    assert h.connects == 0  # no broker connection was ever asked for


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_api_versions_before_authentication_is_answered_from_the_brokers_ranges(version):
    from kthrottle.codecs.versions import parse_api_versions

    h = SaslHarness()
    h.client(api_versions_req(5, version=version))
    (frame,) = frames_of(h.take_client())
    ranges = dict((k, (lo, hi)) for k, lo, hi in parse_api_versions(frame, version))
    assert ranges[3] == (0, 12) and ranges[17] == (0, 1)
    # clamped to what the proxy decodes, as a broker's own answer would be
    assert ranges[1] == (0, apis.MAX_DECODABLE_VERSION[apis.FETCH])
    assert h.connects == 0 and h.closed is None


def test_api_versions_waits_for_the_ranges_when_none_are_known_yet():
    h = SaslHarness(versions=Versions(known=False), run_jobs=False)
    h.client(api_versions_req(5) + handshake(6, "PLAIN"))
    assert h.take_client() == b"" and len(h.jobs) == 1
    assert h.client_paused_until == float("inf")  # the handshake waits its turn
    h.finish_jobs()
    assert cids(h.take_client()) == [5, 6] and h.versions.fetched == 1


def test_no_broker_answering_api_versions_closes_that_connection():
    versions = Versions(known=False)
    versions.fetch = lambda: (_ for _ in ()).throw(ConnectionError("127.0.0.1:1 refused"))
    h = SaslHarness(versions=versions)
    h.client(api_versions_req(5))
    assert "no broker answered ApiVersions: 127.0.0.1:1 refused" in h.closed


def test_the_broker_is_connected_only_once_the_client_has_authenticated():
    h = SaslHarness()
    h.client(api_versions_req(1) + handshake(2, "SCRAM-SHA-256"))
    client = ScramClient(["SCRAM-SHA-256"], "alice", "alice-secret")
    h.client(authenticate(3, client.get_client_first().encode()))
    frames = frames_of(h.take_client())
    assert h.connects == 0 and h.take_broker() == b""
    client.set_server_first(decode_authenticate(frames[-1]).auth_bytes.decode())
    # the last token and a produce request in one read: the request waits
    # for the broker connection, then goes on
    h.client(authenticate(4, client.get_client_final().encode()) + produce_req(5))
    assert h.connects == 1 and h.conn.principal == "alice"
    assert req_cids(h.take_broker()) == [5]


def test_a_plain_password_is_checked_in_a_job_and_nothing_is_read_meanwhile():
    fresh = credentials()  # nothing verified yet
    h = SaslHarness(run_jobs=False, credentials=fresh)
    h.client(handshake(1, "PLAIN"))
    h.take_client()
    h.client(authenticate(2, plain("alice", "alice-secret")) + produce_req(3))
    assert len(h.jobs) == 1 and h.take_client() == b"" and h.take_broker() == b""
    assert h.client_paused_until == float("inf")
    h.finish_jobs()
    assert decode_authenticate(h.answer()).error_code == 0
    assert h.connects == 1 and req_cids(h.take_broker()) == [3]
    # the same password again is recognised without a job
    again = SaslHarness(run_jobs=False, credentials=fresh)
    again.client(handshake(1, "PLAIN"))
    again.client(authenticate(2, plain("alice", "alice-secret")))
    assert not again.jobs and again.conn.principal == "alice"


def test_an_unknown_scram_user_gets_a_server_first_message_and_fails_at_the_proof():
    """RFC 5802 section 9: the server need not tell an unknown user apart;
    the log still names the user and the reason."""
    h = SaslHarness()
    h.client(handshake(1, "SCRAM-SHA-256"))
    h.take_client()
    client = ScramClient(["SCRAM-SHA-256"], "nobody", "guess")
    h.client(authenticate(2, client.get_client_first().encode()))
    first = decode_authenticate(h.answer())
    assert first.error_code == 0 and first.auth_bytes.startswith(b"r=")
    client.set_server_first(first.auth_bytes.decode())
    h.client(authenticate(3, client.get_client_final().encode()))
    h.at(h.now + 0.2)
    answer = decode_authenticate(h.answer())
    assert answer.error_code == SASL_AUTHENTICATION_FAILED
    assert "SCRAM-SHA-256 login for user 'nobody': unknown user" in h.closed
    assert h.refused == "authentication"


def test_frames_are_capped_before_authentication_and_not_after():
    h = SaslHarness()
    h.conn.max_receive_before_auth = 4096  # as --sasl-server-max-receive-size
    h.conn.requests_in.max_frame_size = 4096
    big = authenticate(2, b"\0alice\0" + b"x" * 5000)
    h.client(handshake(1, "PLAIN"))
    h.client(big[:600])  # refused from its size, before the rest is sent
    assert "exceeds the maximum of 4096 bytes" in h.closed and h.refused == "malformed_request"
    ok = SaslHarness()
    ok.conn.max_receive_before_auth = ok.conn.requests_in.max_frame_size = 4096
    ok.client(handshake(1, "PLAIN") + authenticate(2, plain("alice", "alice-secret")))
    ok.client(produce_req(3, nbytes=20000))  # the proxy's max frame size again
    assert ok.closed is None and req_cids(ok.take_broker()) == [3]


def test_the_principal_is_fixed_once_authenticated():
    h = SaslHarness()
    h.client(handshake(1, "PLAIN") )
    h.client(authenticate(2, plain("alice", "alice-secret")))
    h.take_client()
    h.client(handshake(3, "PLAIN"))
    assert h.closed and h.conn.principal == "alice"


def test_two_users_with_one_client_id_get_their_own_user_quotas():
    snapshot = {"users/alice": {PRODUCER_BYTE_RATE: 1000.0},
                "users/bob": {PRODUCER_BYTE_RATE: 1e9}}
    seen = {}
    for user in ("alice", "bob"):
        h = SaslHarness(snapshot)
        h.client(handshake(1, "PLAIN"))
        h.client(authenticate(2, plain(user, USERS[user])))
        h.take_client()
        h.client(produce_req(3, nbytes=5000, client_id="shared-app"))
        seen[user] = (h.conn.quotas_for("shared-app").produce.entity, h.client_paused_until)
    assert seen["alice"][0] == "users/alice" and seen["alice"][1] is not None
    assert seen["bob"][0] == "users/bob" and seen["bob"][1] is None


def test_without_an_authenticator_the_table_has_no_authenticating_cost():
    table = FilterTable(standard_filters(advertise))
    conn = Connection(table, 1 << 20)
    conn.broker_connected(0.0)
    assert conn.phase is Phase.READY
    assert table.lookup(apis.PRODUCE, 7).request_filters == ()


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
@pytest.mark.parametrize("password,ok", [("bob-secret", True), ("wrong", False)])
def test_the_proxys_own_login_to_the_broker(mechanism, password, ok):
    """Two pipelines back to back, no sockets: A logs in to B (a terminating
    proxy standing for a SASL broker) before any of its client's bytes go."""
    from kthrottle.proxy.filters.upstream_login import UpstreamSaslLogin

    a = Harness(filters=standard_filters(advertise, None, None,
                                         UpstreamSaslLogin(mechanism, "bob", password)),
                connect=False)
    b = SaslHarness()
    a.client(api_versions_req(1))  # the client speaks at once; it must wait
    a.run(a.conn.broker_connected(0.0))
    assert a.conn.phase is Phase.CONNECTING
    for _ in range(4):  # carry bytes between them until nothing moves
        b.client(a.take_broker())
        b.at(b.now + 1.0)
        out = b.take_client()
        if out:
            a.broker(out)
    if ok:
        assert a.conn.phase is Phase.READY and b.conn.principal == "bob"
        # the client's request went after the login, and on through B
        assert req_cids(b.take_broker()) == [1]
        assert "ResumeClient" in a.log
    else:
        assert a.closed and "refused the proxy's %s login as 'bob'" % mechanism in a.closed
        assert password not in a.closed


def test_requests_before_authentication_count_against_no_quota():
    h = SaslHarness({"users/<default>": {PRODUCER_BYTE_RATE: 1000.0}})
    h.client(api_versions_req(1))
    h.client(handshake(2, "PLAIN"))
    h.client(authenticate(3, plain("alice", "alice-secret")))
    assert h.conn.client_quotas == {}  # no ANONYMOUS bucket was made on the way
    h.client(produce_req(4))
    assert list(h.conn.client_quotas) == [("alice", "app-1")]


def test_the_proxys_scram_login_derives_its_key_once_per_salt(monkeypatch):
    """The broker gives the same salt every time: the proxy's own login
    derives the salted password once, not once per broker connection."""
    import hashlib

    from kthrottle.proxy.filters.upstream_login import UpstreamSaslLogin

    derived = []
    real = hashlib.pbkdf2_hmac
    monkeypatch.setattr(hashlib, "pbkdf2_hmac", lambda *a: derived.append(a[0]) or real(*a))
    login = UpstreamSaslLogin("SCRAM-SHA-512", "bob", "bob-secret")
    for _ in range(3):  # three broker connections
        a = Harness(filters=standard_filters(advertise, None, None, login), connect=False)
        b = SaslHarness()
        a.run(a.conn.broker_connected(0.0))
        for _ in range(4):
            b.client(a.take_broker())
            out = b.take_client()
            if out:
                a.broker(out)
        assert a.conn.phase is Phase.READY and b.conn.principal == "bob"
    assert derived == ["sha512"]
