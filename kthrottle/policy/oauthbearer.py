"""OAUTHBEARER tokens, checked as Kafka's built-in validator checks them
(KIP-255, KIP-768): no I/O, the time passed in.

The client's first message is RFC 7628's: a GS2 header then kvpairs
separated by ^A (``n,,\\x01auth=Bearer <jwt>\\x01\\x01``). The JWT's
signature, audience, issuer and times are checked by PyJWT, never here by
hand; this module picks the key, passes the settings and names the reason a
token is refused.
"""
import json


class _Jwt:
    """PyJWT, imported when a token is first looked at (a proxy without
    OAUTHBEARER does not carry it)."""

    def __getattr__(self, name):
        import jwt as module

        globals()["jwt"] = module
        return getattr(module, name)


jwt = _Jwt()

# Kafka's error challenge for a refused token (RFC 7628 section 3.2.2)
INVALID_TOKEN = json.dumps({"status": "invalid_token"}, separators=(",", ":")).encode("ascii")

# the client's answer to the error challenge (RFC 7628: a lone ^A)
CONTROL_A = b"\x01"

# signature algorithms per JWK key type when the key names none; never "none"
# nor a shared-secret (HS*) one: a JWKS holds public keys
_ALGORITHMS = {
    "RSA": ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512"],
    "EC": ["ES256", "ES384", "ES512", "ES256K"],
    "OKP": ["EdDSA"],
}

_JWT = []  # a PyJWT, whose time checks take the time as an argument


def _pyjwt():
    if not _JWT:
        _JWT.append(jwt.PyJWT())
    return _JWT[0]


class InvalidToken(Exception):
    """A token refused; the message says why, plainly (for the proxy's log,
    never the client: the client gets Kafka's invalid_token)."""


class InvalidMessage(Exception):
    """The client's first message is not RFC 7628's."""


def parse_client_first(message):
    """(authzid, token, extensions) from the client's first message;
    InvalidMessage when it is malformed."""
    try:
        text = bytes(message).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidMessage("the OAUTHBEARER message is not UTF-8") from None
    header, sep, rest = text.partition("\x01")
    parts = header.split(",")
    if not sep or len(parts) != 3 or parts[0] not in ("n", "y") or parts[2]:
        raise InvalidMessage("malformed OAUTHBEARER client first message (GS2 header)")
    authzid = ""
    if parts[1]:
        if not parts[1].startswith("a="):
            raise InvalidMessage("malformed OAUTHBEARER client first message (authzid)")
        authzid = parts[1][2:].replace("=2C", ",").replace("=3D", "=")
    if not rest.endswith("\x01"):
        raise InvalidMessage("malformed OAUTHBEARER client first message (not ended by ^A^A)")
    token, extensions = None, {}
    for kvpair in rest[:-1].split("\x01"):
        if not kvpair:
            continue
        key, eq, value = kvpair.partition("=")
        if not eq or not key.isalpha():
            raise InvalidMessage("malformed OAUTHBEARER client first message (key %r)" % key[:20])
        if key == "auth":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise InvalidMessage("the OAUTHBEARER auth value is not 'Bearer <token>'")
            token = token.strip()
        else:
            extensions[key] = value
    if token is None:
        raise InvalidMessage("the OAUTHBEARER client first message has no auth=Bearer token")
    return authzid, token, extensions


def client_first(token, authzid=""):
    """The client's first message for ``token`` (the proxy's own login)."""
    header = "n,a=%s," % authzid if authzid else "n,,"
    return ("%s\x01auth=Bearer %s\x01\x01" % (header, token)).encode("utf-8")


class Validated:
    """What a good token says: the principal, its expiry (epoch seconds)
    and its scopes."""

    __slots__ = ("principal", "expires_at", "scopes")

    def __init__(self, principal, expires_at, scopes):
        self.principal = principal
        self.expires_at = expires_at
        self.scopes = scopes

    def __repr__(self):
        return "Validated(%r, expires_at=%r, scopes=%r)" % (
            self.principal, self.expires_at, self.scopes)


class TokenSettings:
    """Kafka's sasl.oauthbearer.* settings of the validator."""

    def __init__(self, expected_audience=(), expected_issuer=None, clock_skew_seconds=30,
                 sub_claim_name="sub", scope_claim_name="scope"):
        self.expected_audience = list(expected_audience or ())
        self.expected_issuer = expected_issuer or None
        self.clock_skew_seconds = clock_skew_seconds
        self.sub_claim_name = sub_claim_name
        self.scope_claim_name = scope_claim_name


def token_kid(token):
    """The key id the token's header names (None: none); InvalidToken when
    the header cannot be read."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise InvalidToken("malformed token: %s" % exc) from None
    kid = header.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise InvalidToken("malformed token: the kid is not a string")
    return kid


def algorithms_for(jwk):
    """The algorithms a JWKS key (its JSON object) may sign with: the one it
    names, else those of its key type."""
    named = jwk.get("alg")
    if named:
        return [named]
    return _ALGORITHMS.get(jwk.get("kty"), [])


def validate(token, key, now, settings, algorithms=None):
    """The token checked with ``key`` (a PyJWK) at ``now`` (epoch seconds):
    a Validated, or InvalidToken saying why. As Kafka's validator: exp and
    iat required, the clock skew allowed either way, the audience (any of
    the expected ones) and the issuer when configured, the principal from
    the sub claim (named by the settings), never empty. ``algorithms``: those
    the key may sign with (algorithms_for its JWK; default its own)."""
    sub = settings.sub_claim_name
    audience = settings.expected_audience or None
    options = {
        "verify_exp": False, "verify_iat": False, "verify_nbf": False,  # at ``now`` below
        "verify_aud": audience is not None,
        "verify_sub": False,  # a sub claim of another name is checked below
        "require": ["exp", "iat"],
    }
    claims = {}
    try:
        claims = jwt.decode(token, key.key, algorithms=algorithms or [key.algorithm_name],
                            audience=audience, issuer=settings.expected_issuer, options=options)
        skew = settings.clock_skew_seconds
        checks = _pyjwt()
        checks._validate_iat(claims, now, skew)
        if "nbf" in claims:
            checks._validate_nbf(claims, now, skew)
        checks._validate_exp(claims, now, skew)
    except jwt.ExpiredSignatureError:
        raise InvalidToken("the token has expired (exp %s, now %d, clock skew %ss)"
                           % (claims.get("exp"), now, settings.clock_skew_seconds)) from None
    except jwt.ImmatureSignatureError as exc:
        raise InvalidToken("the token is not valid yet: %s" % exc) from None
    except jwt.InvalidAudienceError:
        raise InvalidToken("wrong audience: the token's aud %r is none of the expected %s"
                           % (_unverified(token).get("aud"),
                              ", ".join(settings.expected_audience))) from None
    except jwt.InvalidIssuerError:
        raise InvalidToken("wrong issuer: the token's iss %r is not the expected %r"
                           % (_unverified(token).get("iss"), settings.expected_issuer)) from None
    except jwt.InvalidSignatureError:
        raise InvalidToken("bad signature: the token does not verify with key %r"
                           % getattr(key, "key_id", None)) from None
    except jwt.MissingRequiredClaimError as exc:
        raise InvalidToken("the token has no %s claim" % exc.claim) from None
    except jwt.InvalidAlgorithmError as exc:
        raise InvalidToken("the token's algorithm is not allowed for key %r: %s"
                           % (getattr(key, "key_id", None), exc)) from None
    except jwt.PyJWTError as exc:
        raise InvalidToken("the token is invalid: %s" % exc) from None
    principal = claims.get(sub)
    if not isinstance(principal, str) or not principal.strip():
        raise InvalidToken("the token's %s claim (--sasl-oauthbearer-sub-claim-name) is "
                           "missing or empty" % sub)
    scopes = claims.get(settings.scope_claim_name)
    if isinstance(scopes, str):
        scopes = scopes.split()
    elif not isinstance(scopes, list):
        scopes = []
    return Validated(principal, int(claims["exp"]), [str(s) for s in scopes])


def unverified_principal(token, sub_claim_name="sub"):
    """The principal a token names, its signature not checked (passthrough:
    the broker verifies it). ValueError when none can be read."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise ValueError("malformed OAUTHBEARER token: %s" % exc) from None
    principal = claims.get(sub_claim_name)
    if not isinstance(principal, str) or not principal.strip():
        raise ValueError("the OAUTHBEARER token has no %s claim" % sub_claim_name)
    return principal


def unverified_expiry(token):
    """The exp of a token (epoch seconds) unverified, or None (the proxy's
    own token, from its token endpoint)."""
    try:
        exp = jwt.decode(token, options={"verify_signature": False}).get("exp")
    except jwt.PyJWTError:
        return None
    return exp if isinstance(exp, (int, float)) else None


def _unverified(token):
    try:
        return jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return {}
