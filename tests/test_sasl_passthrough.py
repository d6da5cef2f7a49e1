"""SASL passthrough mode in the connection pipeline, without sockets: two
pipelines back to back. A relays its client's SASL exchange; B, a
terminating proxy, stands for a SASL broker. Real SCRAM (scramp) on both
ends, a fake clock, bytes in and actions out."""
import struct

import pytest
from scramp import ScramClient

from kthrottle.policy.entities import PRODUCER_BYTE_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.proxy.filters.sasl import UNSUPPORTED_SASL_MECHANISM
from kthrottle.proxy.filters.sasl_passthrough import SaslPassthrough, sasl_user
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.pipeline import ANONYMOUS, Phase
from kthrottle_testkit.frames import advertise
from test_pipeline import Harness, api_versions_req, frames_of, produce_req, req_cids
from test_sasl import (
    SaslHandshakeResponse,
    SaslHarness,
    authenticate,
    decode_authenticate,
    handshake,
    plain,
)

pytestmark = pytest.mark.unit

MECHANISMS = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class Chain:
    """client -> A (passthrough) -> B (terminating, the 'broker')."""

    def __init__(self, snapshot=None):
        manager = QuotaManager(snapshot) if snapshot is not None else None
        self.a = Harness(filters=standard_filters(advertise, manager, SaslPassthrough(MECHANISMS)))
        self.a.conn.quota_manager = manager
        self.b = SaslHarness()

    def send(self, frame):
        """A client frame through A, and whatever moves between A and B
        until nothing does (B's delays run out on the way); returns what
        A's client got."""
        self.a.client(frame)
        for _ in range(4):
            to_b = self.a.take_broker()
            if to_b:
                self.b.client(to_b)
            self.b.at(self.b.now + 1.0)
            to_a = self.b.take_client()
            if to_a:
                self.a.broker(to_a)
            if self.b.closed and not self.a.closed:
                self.a.run(self.a.conn.close("the broker closed the connection"))
        return self.a.take_client()


def raw_token(token):
    return len(token).to_bytes(4, "big") + token


def raw_answer(out):
    """A raw answer (SaslHandshake v0): a length, then the token."""
    if not out:
        return None
    n = struct.unpack_from(">i", out)[0]
    assert len(out) == 4 + n
    return out[4:]


def login(chain, mechanism, user, password, handshake_version, authenticate_version=1):
    """The client's side of the exchange; True when the last answer said
    success."""
    hs = chain.send(handshake(1, mechanism, handshake_version))
    (frame,) = frames_of(hs)
    assert SaslHandshakeResponse[handshake_version].decode(frame[8:]).error_code == 0
    cid = iter(range(2, 10))

    def token(data):
        if handshake_version == 0:
            return raw_answer(chain.send(raw_token(data)))
        out = chain.send(authenticate(next(cid), data, authenticate_version))
        if not out:
            return None
        answer = decode_authenticate(out, authenticate_version)
        return None if answer.error_code else bytes(answer.auth_bytes)

    if mechanism == "PLAIN":
        return token(plain(user, password)) is not None
    client = ScramClient([mechanism], user, password)
    first = token(client.get_client_first().encode())
    if first is None:
        return False
    client.set_server_first(first.decode())
    final = token(client.get_client_final().encode())
    if final is None:
        return False
    client.set_server_final(final.decode())
    return True


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("handshake_version,authenticate_version", [(0, None), (1, 0), (1, 1), (1, 2)])
def test_the_broker_verifies_and_the_proxy_binds_the_user_it_named(
        mechanism, handshake_version, authenticate_version):
    chain = Chain()
    assert chain.a.conn.phase is Phase.AUTHENTICATING
    assert login(chain, mechanism, "bob", "bob-secret", handshake_version, authenticate_version)
    assert chain.b.conn.principal == "bob"  # the 'broker' verified it ...
    assert chain.a.conn.principal == "bob" and chain.a.conn.phase is Phase.READY  # ... and A bound it
    assert chain.a.closed is None
    chain.send(produce_req(20))
    assert req_cids(chain.b.take_broker()) == [20]  # on through both


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("handshake_version", [0, 1])
@pytest.mark.parametrize("user,password", [("bob", "wrong"), ("mallory", "x")])
def test_a_refused_exchange_binds_nothing(mechanism, handshake_version, user, password):
    chain = Chain()
    assert not login(chain, mechanism, user, password, handshake_version)
    assert chain.a.conn.principal == ANONYMOUS and chain.a.conn.phase is not Phase.READY
    assert chain.a.closed  # the broker closed, and so did A
    assert password not in chain.a.closed


def test_after_a_refusal_nothing_more_is_relayed():
    chain = Chain()
    chain.send(handshake(1, "PLAIN"))
    a, b = chain.a, chain.b
    a.client(authenticate(2, plain("bob", "wrong")))
    b.client(a.take_broker())
    b.at(b.now + 1.0)
    a.broker(b.take_client())  # the error; A does not wait for the broker to close
    assert decode_authenticate(a.take_client()).error_code != 0
    a.client(produce_req(3))
    assert "after the broker refused the authentication" in chain.a.closed
    assert chain.a.take_broker() == b""


@pytest.mark.parametrize("handshake_version", [0, 1])
def test_an_abandoned_exchange_binds_nothing_and_lets_nothing_through(handshake_version):
    chain = Chain()
    chain.send(handshake(1, "SCRAM-SHA-256", handshake_version))
    first = ScramClient(["SCRAM-SHA-256"], "alice", "alice-secret").get_client_first().encode()
    if handshake_version == 0:
        assert raw_answer(chain.send(raw_token(first))).startswith(b"r=")
    else:
        assert decode_authenticate(chain.send(authenticate(2, first))).error_code == 0
    # the client gives up half-way and tries its luck with a Produce
    chain.a.client(produce_req(3) if handshake_version else raw_token(b"x" * 10))
    assert chain.a.conn.principal == ANONYMOUS
    if handshake_version:
        assert "request api key 0 v8 before authentication" in chain.a.closed
        assert chain.a.take_broker() == b""


def test_a_request_before_authentication_closes_and_reaches_no_broker():
    chain = Chain()
    chain.a.client(produce_req(1))
    assert "before authentication" in chain.a.closed
    assert chain.a.take_broker() == b""


def test_api_versions_goes_to_the_broker_before_authentication():
    chain = Chain()
    chain.a.client(api_versions_req(1))
    assert req_cids(chain.a.take_broker()) == [1]
    assert chain.a.closed is None


def test_a_mechanism_the_proxy_cannot_read_is_refused_before_the_broker():
    chain = Chain()
    out = chain.send(handshake(1, "GSSAPI"))
    assert chain.b.conn.requests == 0  # never relayed
    chain.a.at(1.0)
    (frame,) = frames_of(out + chain.a.take_client())
    answer = SaslHandshakeResponse[1].decode(frame[8:])
    assert answer.error_code == UNSUPPORTED_SASL_MECHANISM and "PLAIN" in answer.mechanisms
    assert "unsupported SASL mechanism 'GSSAPI'" in chain.a.closed


def test_re_authentication_is_relayed_for_the_same_user_only():
    chain = Chain()
    assert login(chain, "PLAIN", "alice", "alice-secret", 1)
    # B (terminate mode) offers no re-authentication; A's rule is what is tested
    a = chain.a
    a.client(handshake(5, "PLAIN"))
    a.client(authenticate(6, plain("alice", "alice-secret")))
    assert req_cids(a.take_broker()) == [5, 6] and a.closed is None
    other = Chain()
    assert login(other, "PLAIN", "alice", "alice-secret", 1)
    other.a.client(handshake(7, "PLAIN"))
    other.a.client(authenticate(8, plain("bob", "bob-secret")))
    assert "re-authentication as 'bob' on a connection authenticated as 'alice'" in other.a.closed
    assert req_cids(other.a.take_broker()) == [7]  # bob's token never reached the broker
    assert other.a.conn.principal == "alice"


def scram_tokens(mechanism, user, password):
    """A SCRAM client's first token, and a function of the server's first
    answer giving its final token."""
    client = ScramClient([mechanism], user, password)

    def final(server_first):
        client.set_server_first(server_first.decode())
        return client.get_client_final().encode()

    return client.get_client_first().encode(), final


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_pipelined_second_exchange_cannot_take_another_principal(mechanism):
    """Handshake, the attacker's own good login, then a second handshake and
    a login as someone else with a wrong password, all sent before any
    answer: the proxy must not end with the second user's name (it once
    reset the user on the second handshake and bound it on the first
    success)."""
    chain = Chain()
    a = chain.a
    if mechanism == "PLAIN":
        a.client(handshake(1, mechanism) + authenticate(2, plain("alice", "alice-secret"))
                 + handshake(3, mechanism) + authenticate(4, plain("bob", "wrong")))
    else:
        first, _ = scram_tokens(mechanism, "alice", "alice-secret")
        second, _ = scram_tokens(mechanism, "bob", "wrong")
        a.client(handshake(1, mechanism) + authenticate(2, first)
                 + handshake(3, mechanism) + authenticate(4, second))
    assert "a second SaslHandshake while a SASL exchange is unfinished" in a.closed
    assert a.refused == "authentication"
    assert not {3, 4} & set(req_cids(a.take_broker()))  # the second exchange reached no broker
    assert a.conn.principal == ANONYMOUS


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_success_binds_the_user_of_its_own_exchange_only(mechanism):
    """Whatever the client sends after its last token (here a re-handshake
    and another user's first token, before the broker has answered), the
    broker's success binds the user the exchange began with."""
    chain = Chain()
    a = chain.a
    if mechanism == "PLAIN":
        out = chain.send(handshake(1, mechanism))
        a.client(authenticate(2, plain("alice", "alice-secret")))
    else:
        first, final = scram_tokens(mechanism, "alice", "alice-secret")
        chain.send(handshake(1, mechanism))
        out = chain.send(authenticate(2, first))
        (frame,) = frames_of(out)
        a.client(authenticate(3, final(decode_authenticate(frame).auth_bytes)))
    # the last token is out; before its answer, the client starts over as bob
    a.client(handshake(8, mechanism))
    assert "a second SaslHandshake" in a.closed and a.conn.principal == ANONYMOUS


@pytest.mark.parametrize("extension", ["tokenauth=TRUE", "tokenauth=True", "tokenauth=tRuE"])
def test_token_auth_is_read_as_kafka_reads_a_boolean(extension):
    first = "n,,n=alice,r=abcdef,%s" % extension
    with pytest.raises(ValueError, match="delegation token"):
        sasl_user("SCRAM-SHA-256", first.encode())
    assert sasl_user("SCRAM-SHA-256", b"n,,n=alice,r=abcdef,tokenauth=false") == "alice"


def test_the_bound_principal_is_what_the_quotas_resolve_against():
    snapshot = {"users/alice": {PRODUCER_BYTE_RATE: 1000.0}}
    chain = Chain(snapshot)
    assert login(chain, "SCRAM-SHA-512", "alice", "alice-secret", 1)
    chain.send(produce_req(9, nbytes=5000, client_id="shared-app"))
    assert chain.a.conn.quotas_for("shared-app").produce.entity == "users/alice"
    assert chain.a.client_paused_until is not None  # throttled as alice


@pytest.mark.parametrize("mechanism,token,user", [
    ("PLAIN", b"\0alice\0pw", "alice"),
    ("PLAIN", b"alice\0alice\0pw", "alice"),
    ("SCRAM-SHA-256", b"n,,n=alice,r=abc", "alice"),
    ("SCRAM-SHA-512", b"n,,n=a=2Cb=3Dc,r=abc", "a,b=c"),
    ("SCRAM-SHA-512", b"n,a=bob,n=bob,r=abc", "bob"),
])
def test_the_user_name_is_read_from_the_first_token(mechanism, token, user):
    assert sasl_user(mechanism, token) == user


@pytest.mark.parametrize("mechanism,token,message", [
    ("PLAIN", b"\0alice", "malformed PLAIN token"),
    ("PLAIN", b"\0\0pw", "malformed PLAIN token"),
    ("PLAIN", b"bob\0alice\0pw", "authorization id differs"),
    ("PLAIN", b"\0\xff\0pw", "not UTF-8"),
    ("SCRAM-SHA-256", b"n,,r=abc", "malformed SCRAM-SHA-256 client-first"),
    ("SCRAM-SHA-256", b"n,,n=a=2Xb,r=abc", "malformed SCRAM user name"),
    ("SCRAM-SHA-256", b"n,,n=tok1,r=abc,tokenauth=true", "delegation token"),
    ("SCRAM-SHA-512", b"n,a=bob,n=alice,r=abc", "authorization id differs"),
])
def test_a_token_the_proxy_cannot_attribute_is_refused(mechanism, token, message):
    with pytest.raises(ValueError, match=message):
        sasl_user(mechanism, token)


def test_a_malformed_first_token_closes_before_the_broker_sees_it():
    chain = Chain()
    chain.send(handshake(1, "PLAIN"))
    chain.a.client(authenticate(2, b"garbage"))
    assert "malformed PLAIN token" in chain.a.closed
    assert chain.a.take_broker() == b""


def test_the_attack_against_a_broker_that_keeps_the_connection_open():
    """The spoof as a Kafka broker answers it: OK, OK, then ILLEGAL_SASL_STATE
    for the second handshake and an error for the second login, the
    connection left open. The proxy must never end with 'admin'."""
    from test_sasl import SaslAuthenticateResponse

    a = Harness(filters=standard_filters(advertise, None, SaslPassthrough(MECHANISMS)))
    a.client(handshake(1, "PLAIN") + authenticate(2, plain("mallory", "mallory-secret"))
             + handshake(3, "PLAIN") + authenticate(4, plain("admin", "wrong")))

    def answer(cid, response):
        response.with_header(correlation_id=cid)
        return bytes(response.encode(header=True, framed=True))

    ok_handshake = SaslHandshakeResponse[1](error_code=0, mechanisms=["PLAIN"])
    a.broker(answer(1, ok_handshake) + answer(2, SaslAuthenticateResponse[1](
        error_code=0, error_message=None, auth_bytes=b"", session_lifetime_ms=0)))
    a.broker(answer(3, SaslHandshakeResponse[1](error_code=34, mechanisms=["PLAIN"]))
             + answer(4, SaslAuthenticateResponse[1](
                 error_code=58, error_message="Authentication failed", auth_bytes=b"",
                 session_lifetime_ms=0)))
    assert a.conn.principal != "admin"
    assert a.closed and "a second SaslHandshake" in a.closed
