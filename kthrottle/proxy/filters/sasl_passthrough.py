"""SASL passthrough: the client's SASL exchange is relayed to the broker,
which verifies it; the proxy binds the user the exchange named once the
broker has said yes to it."""
import logging
from functools import partial

from ...codecs import apis
from ...codecs.frames import response_body_offset
from ...policy import oauthbearer
from ..filter import GATHER, NOTHING, REFUSED_AUTHENTICATION, Answer, ForwardRaw, Refuse
from .sasl import DEFAULT_FAILED_AUTHENTICATION_DELAY_MS, OAUTHBEARER, SASL_AUTHENTICATE
from .sasl import SASL_HANDSHAKE, UNSUPPORTED_SASL_MECHANISM
from .sasl import SaslAuthenticateRequest, SaslAuthenticateResponse
from .sasl import SaslHandshakeRequest, SaslHandshakeResponse
from .sasl import ClientSasl, auth_bytes, before_authentication, decode

log = logging.getLogger("kthrottle.auth")


def sasl_user(mechanism, token, sub_claim_name="sub"):
    """The user a client's first SASL token names: PLAIN's authentication
    id (RFC 4616), the ``n=`` of SCRAM's client-first message (RFC 5802,
    with ``=2C`` and ``=3D`` decoded), or OAUTHBEARER's JWT claim
    ``sub_claim_name``, read unverified (the broker verifies the token).
    Raises ValueError when the token is malformed or asks to act as another
    user, as Kafka refuses it."""
    if mechanism == OAUTHBEARER:
        try:
            authzid, token, _ = oauthbearer.parse_client_first(token)
        except oauthbearer.InvalidMessage as exc:
            raise ValueError(str(exc)) from None
        user = oauthbearer.unverified_principal(token, sub_claim_name)
        if authzid and authzid != user:
            raise ValueError("OAUTHBEARER login whose authorization id differs from its token's "
                             "principal")
        return user
    try:
        text = bytes(token).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the %s token is not UTF-8" % mechanism) from None
    if mechanism == "PLAIN":
        parts = text.split("\0")
        if len(parts) != 3 or not parts[1]:
            raise ValueError("malformed PLAIN token")
        authzid, user = parts[0], parts[1]
    else:
        parts = text.split(",")
        if len(parts) < 4 or parts[0] not in ("n", "y") or not parts[2].startswith("n="):
            raise ValueError("malformed %s client-first message" % mechanism)
        if any(_is_token_auth(part) for part in parts[4:]):
            # a delegation token: the principal is the token's owner, which
            # only the broker knows
            raise ValueError("%s logins with a delegation token cannot be attributed "
                             "to a user in passthrough mode" % mechanism)
        authzid = _saslname(parts[1][2:]) if parts[1].startswith("a=") else ""
        user = _saslname(parts[2][2:])
        if not user:
            raise ValueError("%s client-first message without a user name" % mechanism)
    if authzid and authzid != user:
        # neither field named: a password one field early would be logged
        raise ValueError("%s login whose authorization id differs from its user name" % mechanism)
    return user


def _is_token_auth(extension):
    """``tokenauth=true`` in any case: Kafka reads the SCRAM extension as a
    boolean (Java's Boolean.parseBoolean ignores case)."""
    name, _, value = extension.partition("=")
    return name == "tokenauth" and value.lower() == "true"


def _saslname(value):
    """RFC 5802's saslname: ``=2C`` is a comma, ``=3D`` an equals sign."""
    decoded = value.replace("=2C", ",").replace("=3D", "=")
    if "=" in value.replace("=2C", "").replace("=3D", ""):
        raise ValueError("malformed SCRAM user name %r" % value)
    return decoded


class _Exchange:
    """One SASL exchange relayed to the broker: the user read from its first
    token is bound only by the broker's success for this exchange's own last
    step, whatever the client sends meanwhile."""

    __slots__ = ("mechanism", "handshake_version", "user", "tokens", "done")

    def __init__(self, mechanism, handshake_version):
        self.mechanism = mechanism
        self.handshake_version = handshake_version
        self.user = None  # read from the first token
        self.tokens = 0  # client tokens relayed so far
        self.done = False  # the broker has accepted the last step

    @property
    def last_step(self):
        return 1 if self.mechanism in ("PLAIN", OAUTHBEARER) else 2


class _Relayed:
    """One connection's SASL exchanges as relayed to the broker."""

    __slots__ = ("exchange", "failed")

    def __init__(self):
        self.exchange = None  # the latest exchange
        self.failed = False


class SaslPassthrough(ClientSasl):
    """Relays clients' SASL exchanges to the broker untouched (passthrough
    mode): the broker verifies the client. The proxy reads the user name
    from an exchange's first token and binds it as the connection's
    principal only when the broker answers that exchange's last step with
    success; a failed or abandoned exchange binds nothing, and until the
    principal is bound only ApiVersions, SaslHandshake and SaslAuthenticate
    are accepted. A SaslHandshake while an exchange is unfinished closes the
    connection, as a broker refuses it.

    Both SaslHandshake v1 (tokens in SaslAuthenticate, KIP-152) and v0 (raw
    tokens after the handshake, and raw answers matched by order) are
    relayed. A re-authentication (KIP-368) is relayed too, for the same user
    only: the principal is fixed for the connection's life."""

    name = "sasl-passthrough"

    mode = "passthrough"
    reads = ClientSasl.reads + ("sasl_oauthbearer_sub_claim_name",)

    @classmethod
    def arguments(cls, config, services):
        return {"sub_claim_name": config.sasl_oauthbearer_sub_claim_name}

    def __init__(self, mechanisms, failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS,
                 sub_claim_name="sub"):
        super().__init__(mechanisms, failed_delay_ms)
        self.sub_claim_name = sub_claim_name  # OAUTHBEARER: the claim naming the principal

    def new_state(self):
        return _Relayed()

    def on_connect(self, ctx):
        ctx.begin_authentication()

    def mechanism_of(self, state):
        exchange = state.exchange
        return exchange.mechanism if exchange is not None and not exchange.done else None

    def response_need(self, api_key, api_version):
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else NOTHING

    def on_request(self, ctx, head, inflight):
        api_key = head.api_key
        state = ctx.state
        if state.failed:
            return Refuse("request api key %d after the broker refused the authentication"
                          % api_key, REFUSED_AUTHENTICATION)
        if api_key == SASL_HANDSHAKE:
            return self._handshake(ctx, head, inflight)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(ctx, head, inflight)
        if api_key == apis.API_VERSIONS:
            return None
        return before_authentication(head)

    def _handshake(self, ctx, head, inflight):
        state = ctx.state
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        if not ctx.authenticating and version == 0:
            return Refuse("SaslHandshake v0 on an authenticated connection")
        if state.exchange is not None and not state.exchange.done:
            self.count_login(state.exchange.mechanism, False)
            return Refuse("a second SaslHandshake while a SASL exchange is unfinished",
                          REFUSED_AUTHENTICATION)
        mechanism = decode(SaslHandshakeRequest, head.buf[4:], version=version,
                           header=True).mechanism
        if mechanism not in self.mechanisms:
            # the proxy could not tell whom the broker authenticated
            response = SaslHandshakeResponse[version](
                error_code=UNSUPPORTED_SASL_MECHANISM, mechanisms=list(self.mechanisms))
            response.with_header(correlation_id=head.correlation_id)
            self.failed(ctx, "unsupported SASL mechanism %r (relayed: %s)"
                        % (mechanism, ", ".join(self.mechanisms)))
            return Answer(bytes(response.encode(header=True, framed=True)))
        state.exchange = exchange = _Exchange(mechanism, version)
        ctx.note(inflight, exchange)
        return None

    def _authenticate(self, ctx, head, inflight):
        version = head.api_version
        if version > SaslAuthenticateRequest.max_version:
            return Refuse("SaslAuthenticate v%d is newer than the proxy knows" % version)
        exchange = ctx.state.exchange
        if exchange is None or exchange.handshake_version == 0 or exchange.done:
            return None  # the broker answers ILLEGAL_SASL_STATE; nothing is bound
        request = decode(SaslAuthenticateRequest, head.buf[4:], version=version, header=True)
        verdict = self._client_token(ctx, exchange, auth_bytes(request))
        if verdict is None:
            ctx.note(inflight, (exchange, exchange.tokens))
        return verdict

    def _client_token(self, ctx, exchange, token):
        """None to relay the token, or Refuse."""
        exchange.tokens += 1
        if exchange.tokens == 1:
            try:
                exchange.user = sasl_user(exchange.mechanism, token, self.sub_claim_name)
            except ValueError as exc:
                self.count_login(exchange.mechanism, False)
                return Refuse(str(exc), REFUSED_AUTHENTICATION)
            if not ctx.authenticating and exchange.user != ctx.principal:
                self.count_login(exchange.mechanism, False)
                return Refuse("re-authentication as %r on a connection authenticated as %r"
                              % (exchange.user, ctx.principal), REFUSED_AUTHENTICATION)
        return None

    def on_response(self, ctx, inflight, frame):
        note = ctx.noted(inflight)
        if note is None:
            return frame
        state = ctx.state
        version = inflight.api_version
        if inflight.api_key == SASL_HANDSHAKE:
            if frame[8:10] != b"\0\0":  # error_code: the broker closes next
                self.count_login(note.mechanism, False)
                state.failed = True
            elif version == 0:
                ctx.expect_raw(partial(self._raw_token, note))
            return frame
        exchange, step = note
        body = response_body_offset(frame, version >= 2)
        answer = decode(SaslAuthenticateResponse[version], frame[body:])
        if answer.error_code:
            log.info("the broker refused %s authentication of %r: %s", exchange.mechanism,
                     exchange.user, answer.error_message)
            self.count_login(exchange.mechanism, False)
            state.failed = True
        elif step == exchange.last_step and not (exchange.mechanism == OAUTHBEARER
                                                 and answer.auth_bytes):
            # (an OAUTHBEARER answer with bytes is the error challenge, RFC 7628)
            self._bind(ctx, exchange)
        return frame

    def _raw_token(self, exchange, ctx, frame):
        """A raw token after SaslHandshake v0: relayed; the broker's raw
        answer comes back to _raw_answer."""
        verdict = self._client_token(ctx, exchange, frame[4:])
        if verdict is not None:
            ctx.fail_authentication(verdict.reason, 0)
            return None
        return ForwardRaw(partial(self._raw_answer, exchange, exchange.tokens))

    def _raw_answer(self, exchange, step, ctx, frame):
        # with v0 a broker answers a failure by closing the connection, so an
        # answer to the last step is the success
        if step == exchange.last_step and not (exchange.mechanism == OAUTHBEARER
                                               and len(frame) > 4):
            ctx.expect_raw(None)
            self._bind(ctx, exchange)
        return frame

    def _bind(self, ctx, exchange):
        exchange.done = True
        self.count_login(exchange.mechanism, True)
        if not ctx.authenticating:
            log.debug("client re-authenticated as %r with %s", exchange.user, exchange.mechanism)
            return
        log.info("client authenticated as %r with %s (verified by the broker, "
                 "SaslHandshake v%d)", exchange.user, exchange.mechanism,
                 exchange.handshake_version)
        ctx.authenticated(exchange.user)
