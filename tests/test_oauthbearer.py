"""OAUTHBEARER (KIP-255, KIP-768) and KIP-368 re-authentication, without I/O: the token
checks with a fake clock, and the terminate filter in the pipeline without sockets. End to
end, with real clients: test_oauthbearer_clients.py."""
import json

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from kthrottle.policy import oauthbearer
from kthrottle.policy.oauthbearer import InvalidToken, TokenSettings
from kthrottle.proxy.filters.sasl import SASL_AUTHENTICATION_FAILED
from kthrottle.sources.jwks import parse_jwks
from test_pipeline import produce_req, produce_resp, req_cids, cids
from test_sasl import (
    CREDENTIALS,
    SaslHarness,
    authenticate,
    decode_authenticate,
    handshake,
    plain,
)

pytestmark = pytest.mark.unit

AUDIENCE, ISSUER = "kafka", "https://issuer.test"
NOW = 1_700_000_000  # the fake clock's epoch


def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwk_of(key, kid):
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid=kid, use="sig", alg="RS256")
    return jwk


def jwks_text(*pairs):
    return json.dumps({"keys": [jwk_of(key, kid) for key, kid in pairs]})


def make_token(key, kid, sub="alice", now=NOW, lifetime=300, aud=AUDIENCE, iss=ISSUER, **extra):
    claims = {"sub": sub, "iat": int(now), "exp": int(now + lifetime), "aud": aud, "iss": iss}
    claims.update(extra)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid} if kid else None)


KEY1, KEY2, OTHER = rsa_key(), rsa_key(), rsa_key()
SETTINGS = TokenSettings([AUDIENCE, "other-audience"], ISSUER, clock_skew_seconds=30)


def keyset(*pairs):
    return parse_jwks(jwks_text(*pairs))


# the pure checks, with a fake clock -----------------------------------------

def check(token, now=NOW, settings=SETTINGS, keys=None):
    keys = keys or keyset((KEY1, "k1"))
    key, algorithms = keys[oauthbearer.token_kid(token)]
    return oauthbearer.validate(token, key, now, settings, algorithms)


def test_a_good_token_names_its_principal_expiry_and_scopes():
    token = make_token(KEY1, "k1", scope="produce consume")
    good = check(token)
    assert (good.principal, good.expires_at, good.scopes) == ("alice", NOW + 300,
                                                              ["produce", "consume"])
    # any one of the expected audiences will do (Kafka's comma-separated list)
    assert check(make_token(KEY1, "k1", aud=["x", "other-audience"])).principal == "alice"
    # the sub claim's name is a setting
    named = TokenSettings([AUDIENCE], ISSUER, sub_claim_name="client_id")
    assert check(make_token(KEY1, "k1", client_id="svc-7"), settings=named).principal == "svc-7"


@pytest.mark.parametrize("token, now, reason", [
    (make_token(KEY1, "k1", lifetime=60), NOW + 91, "has expired"),
    (make_token(KEY1, "k1", aud="someone-else"), NOW, "wrong audience"),
    (make_token(KEY1, "k1", iss="https://evil.test"), NOW, "wrong issuer"),
    (make_token(OTHER, "k1"), NOW, "bad signature"),
    (make_token(KEY1, "k1", now=NOW + 120), NOW, "not valid yet"),
    (make_token(KEY1, "k1", exp=None), NOW, "no exp claim"),
    (make_token(KEY1, "k1", sub=None), NOW, "sub claim"),
    (make_token(KEY1, "k1", sub=""), NOW, "sub claim"),
], ids=["expired", "audience", "issuer", "signature", "not-yet", "no-exp", "no-sub",
        "empty-sub"])  # the tokens are signed with a key made per process: no ids from them
def test_refused_tokens_say_why(token, now, reason):
    with pytest.raises(InvalidToken, match=reason):
        check(token, now)


def test_the_clock_skew_is_allowed_either_way():
    token = make_token(KEY1, "k1", lifetime=60)
    assert check(token, NOW + 89).principal == "alice"  # 29 s past exp, skew 30
    with pytest.raises(InvalidToken, match="expired"):
        check(token, NOW + 90)
    assert check(make_token(KEY1, "k1", now=NOW + 25), NOW).principal == "alice"


def test_an_hmac_or_unsigned_token_never_verifies_with_a_public_key():
    forged = jwt.encode({"sub": "admin", "iat": NOW, "exp": NOW + 60, "aud": AUDIENCE,
                         "iss": ISSUER}, "x" * 32, algorithm="HS256", headers={"kid": "k1"})
    with pytest.raises(InvalidToken):
        check(forged)
    unsigned = jwt.encode({"sub": "admin", "iat": NOW, "exp": NOW + 60}, None, algorithm="none",
                          headers={"kid": "k1"})
    with pytest.raises(InvalidToken):
        check(unsigned)


def test_rfc7628_client_first_message():
    assert oauthbearer.parse_client_first(b"n,,\x01auth=Bearer abc.def.ghi\x01\x01") == (
        "", "abc.def.ghi", {})
    assert oauthbearer.parse_client_first(
        b"n,a=alice,\x01auth=Bearer t\x01traceId=42\x01\x01") == ("alice", "t", {"traceId": "42"})
    assert oauthbearer.parse_client_first(oauthbearer.client_first("tok")) == ("", "tok", {})
    for bad in (b"", b"n,,auth=Bearer t", b"p=x,,\x01auth=Bearer t\x01\x01",
                b"n,,\x01auth=Basic t\x01\x01", b"n,,\x01x=1\x01\x01", b"\xff\xfe"):
        with pytest.raises(oauthbearer.InvalidMessage):
            oauthbearer.parse_client_first(bad)


# the terminate filter in the pipeline (no sockets, a fake clock) ------------

class Keys:
    """The JWKS service's face to the filter, over a fixed key set."""

    url = "file:///keys"

    def __init__(self, keys):
        self.keys = keys

    def get(self, kid):
        return self.keys.get(kid)

    def may_refresh(self):
        return False


class OAuthHarness(SaslHarness):
    def __init__(self, reauth_ms=0, mechanisms=("OAUTHBEARER",)):
        super().__init__()
        # the same filter object, rebuilt with the token settings and a clock
        self.auth.__init__(list(mechanisms), lambda: CREDENTIALS, failed_delay_ms=100,
                           api_versions=self.versions, reauth_ms=reauth_ms,
                           token_settings=SETTINGS, jwks=Keys(keyset((KEY1, "k1"))),
                           clock=lambda: NOW + self.now)

    def login(self, token, cid=1, version=1):
        self.client(handshake(cid, "OAUTHBEARER") + authenticate(
            cid + 1, oauthbearer.client_first(token), version))
        frames = [f for f in _frames(self.take_client())]
        return decode_authenticate(frames[-1], version)


def _frames(stream):
    from test_pipeline import frames_of

    return frames_of(stream)


def test_a_good_token_binds_its_subject():
    h = OAuthHarness()
    answer = h.login(make_token(KEY1, "k1", sub="alice"))
    assert answer.error_code == 0 and h.conn.principal == "alice"
    assert answer.session_lifetime_ms == 0  # re-authentication off
    h.client(produce_req(3))
    assert req_cids(h.take_broker()) == [3]


def test_a_refused_token_gets_kafkas_challenge_then_the_failure_after_the_delay():
    h = OAuthHarness()
    answer = h.login(make_token(KEY1, "k1", aud="nope"))
    assert answer.error_code == 0 and bytes(answer.auth_bytes) == b'{"status":"invalid_token"}'
    assert h.conn.authenticating and h.closed is None
    h.client(authenticate(3, b"\x01"))
    assert h.take_client() == b""  # held: KIP-306's delay
    h.at(0.1)
    final = decode_authenticate(h.take_client())
    assert final.error_code == SASL_AUTHENTICATION_FAILED
    assert final.error_message == '{"status":"invalid_token"}'
    assert "wrong audience" in h.closed and h.conn.principal != "nope"


def test_an_authorization_id_other_than_the_subject_fails():
    h = OAuthHarness()
    h.client(handshake(1, "OAUTHBEARER") + authenticate(
        2, oauthbearer.client_first(make_token(KEY1, "k1"), authzid="admin")))
    h.at(0.1)
    answer = decode_authenticate(_frames(h.take_client())[-1])
    assert answer.error_code == SASL_AUTHENTICATION_FAILED and "authorization id" in h.closed


def test_session_lifetime_is_the_shorter_of_the_token_and_max_reauth():
    h = OAuthHarness(reauth_ms=10_000)
    assert h.login(make_token(KEY1, "k1", lifetime=4)).session_lifetime_ms == 4000
    h = OAuthHarness(reauth_ms=2_000)
    assert h.login(make_token(KEY1, "k1", lifetime=300)).session_lifetime_ms == 2000
    assert "SessionDeadline" in h.log


def test_reauthentication_moves_the_deadline_and_is_answered_in_request_order():
    h = OAuthHarness(reauth_ms=1_000)
    assert h.login(make_token(KEY1, "k1")).session_lifetime_ms == 1000
    h.now = 0.6
    h.client(produce_req(3))  # a broker request in flight
    h.client(handshake(4, "OAUTHBEARER") + authenticate(
        5, oauthbearer.client_first(make_token(KEY1, "k1", now=NOW + 0.6))))
    assert h.take_client() == b""  # behind the produce's answer
    h.broker(produce_resp(3))
    out = h.take_client()
    assert cids(out) == [3, 4, 5]
    assert decode_authenticate(_frames(out)[-1]).session_lifetime_ms == 1000
    h.at(1.2)  # the first session's end: re-authenticated, so open
    assert h.closed is None
    h.at(1.7)
    assert h.closed and "session expired" in h.closed


def test_a_connection_that_does_not_reauthenticate_is_closed_at_its_deadline():
    h = OAuthHarness(reauth_ms=1_000)
    h.login(make_token(KEY1, "k1"))
    h.at(0.99)
    assert h.closed is None
    h.at(1.0)
    assert "session expired" in h.closed


def test_reauthentication_as_another_principal_fails_and_closes():
    h = OAuthHarness(reauth_ms=1_000)
    h.login(make_token(KEY1, "k1", sub="alice"))
    h.client(handshake(3, "OAUTHBEARER") + authenticate(
        4, oauthbearer.client_first(make_token(KEY1, "k1", sub="mallory"))))
    h.at(0.2)
    assert decode_authenticate(_frames(h.take_client())[-1]).error_code == (
        SASL_AUTHENTICATION_FAILED)
    assert "cannot change principals" in h.closed and h.conn.principal == "alice"


def test_plain_sessions_last_max_reauth_and_reauthenticate():
    h = OAuthHarness(reauth_ms=500, mechanisms=("PLAIN",))
    h.client(handshake(1, "PLAIN") + authenticate(2, plain("alice", "alice-secret")))
    assert decode_authenticate(_frames(h.take_client())[-1]).session_lifetime_ms == 500
    h.now = 0.4
    h.client(handshake(3, "PLAIN") + authenticate(4, plain("alice", "alice-secret")))
    assert decode_authenticate(_frames(h.take_client())[-1]).error_code == 0
    h.at(0.6)
    assert h.closed is None
    h.at(0.95)
    assert "session expired" in h.closed


def test_without_max_reauth_a_second_exchange_closes_as_before():
    h = OAuthHarness()
    h.login(make_token(KEY1, "k1"))
    h.client(handshake(3, "OAUTHBEARER"))
    assert "re-authentication is off" in h.closed


# passthrough reads the token's principal (the broker verifies it) ----------

def test_passthrough_reads_the_principal_from_the_tokens_claim():
    from kthrottle.proxy.filters.sasl_passthrough import sasl_user

    message = oauthbearer.client_first(make_token(OTHER, "any", sub="alice", client_id="svc"))
    assert sasl_user("OAUTHBEARER", message) == "alice"  # unverified: the broker checks it
    assert sasl_user("OAUTHBEARER", message, "client_id") == "svc"
    for bad in (b"n,,\x01auth=Bearer not-a-jwt\x01\x01", b"junk",
                oauthbearer.client_first(make_token(KEY1, "k1", sub="bob"), authzid="alice")):
        with pytest.raises(ValueError):
            sasl_user("OAUTHBEARER", bad)
