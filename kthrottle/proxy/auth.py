"""SASL authentication of clients by the proxy itself (terminate mode).

A filter of the connection pipeline: from the moment the broker connection is
up the connection is AUTHENTICATING, and until the client has authenticated
only ApiVersions, SaslHandshake and SaslAuthenticate are accepted (anything
else closes the connection, as a Kafka broker does, and reaches no broker).
The SASL exchange is answered by the proxy; the broker never sees it. On
success the connection's principal is the authenticated user name, fixed for
the connection's life, and the quotas resolve against it (KIP-55).

Mechanisms: PLAIN (RFC 4616), SCRAM-SHA-256 and SCRAM-SHA-512 (RFC 5802,
RFC 7677; the server side is the ``scramp`` library). Credentials are Kafka's
salted SCRAM credentials; PLAIN is checked against them, so no clear
password is ever stored. Both SaslHandshake v1 (tokens in SaslAuthenticate,
KIP-152) and v0 (raw tokens after the handshake) are served.
"""
import logging
import warnings

from ..codecs import apis
from ..codecs.frames import response_body_offset
from .pipeline import GATHER, HEAD, NOTHING, Answer, Filter, ForwardRaw, Phase, Refuse

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )

log = logging.getLogger("kthrottle.auth")

SASL_HANDSHAKE = 17
SASL_AUTHENTICATE = 36
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

# Kafka's error codes
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
SASL_AUTHENTICATION_FAILED = 58

# KIP-306: connection.failed.authentication.delay.ms
DEFAULT_FAILED_AUTHENTICATION_DELAY_MS = 100

FAILED = "Authentication failed during authentication due to invalid credentials with SASL mechanism %s"


class _State:
    """One connection's progress through its SASL exchange."""

    __slots__ = ("mechanism", "handshake_version", "scram", "user")

    def __init__(self):
        self.mechanism = None
        self.handshake_version = None
        self.scram = None  # scramp's server while a SCRAM exchange runs
        self.user = None


class _AuthenticationFailed(Exception):
    pass


class _ClientSasl(Filter):
    """What both modes share: the enabled mechanisms, the SASL APIs gathered
    whole, every request seen (HEAD) while the connection authenticates."""

    def __init__(self, mechanisms, failed_delay_ms):
        unknown = [m for m in mechanisms if m not in MECHANISMS]
        if unknown or not mechanisms:
            raise ValueError("SASL mechanisms must be among %s, got %s"
                             % (", ".join(MECHANISMS), ", ".join(mechanisms) or "none"))
        self.mechanisms = tuple(mechanisms)
        self.failed_delay_ms = failed_delay_ms

    def request_need(self, api_key, api_version):
        # after authentication: only a second exchange concerns this filter
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else NOTHING

    def authenticating_need(self, api_key, api_version):
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else HEAD

    def on_connect(self, conn):
        conn.phase = Phase.AUTHENTICATING
        conn.auth = self._state()


class SaslTerminate(_ClientSasl):
    """Verifies clients' SASL credentials in the proxy (terminate mode)."""

    name = "sasl-terminate"
    _state = _State

    def __init__(self, mechanisms, credentials,
                 failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS):
        """``credentials()`` returns the current credentials snapshot (an
        object with ``scram(mechanism, user)`` and ``check_plain(user,
        password)``; sources replace it live)."""
        super().__init__(mechanisms, failed_delay_ms)
        self.credentials = credentials

    def on_request(self, conn, head, inflight):
        api_key = head.api_key
        if conn.phase is not Phase.AUTHENTICATING:
            # KIP-368 re-authentication is not offered: the principal is fixed
            return Refuse("SASL request (api key %d) on an authenticated connection" % api_key)
        if api_key == apis.API_VERSIONS:
            return None
        if api_key == SASL_HANDSHAKE:
            return self._handshake(conn, head)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(conn, head)
        return Refuse("request api key %d v%d before authentication" % (api_key, head.api_version))

    # SaslHandshake ------------------------------------------------------

    def _handshake(self, conn, head):
        state = conn.auth
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        request = SaslHandshakeRequest.decode(bytes(head.buf[4:]), version=version, header=True)
        mechanism = request.mechanism
        if state.mechanism is not None:
            answer = self._handshake_answer(head, ILLEGAL_SASL_STATE)
            conn.fail_authentication("a second SaslHandshake", self.failed_delay_ms)
            return Answer(answer)
        if mechanism not in self.mechanisms:
            log.info("client asked for SASL mechanism %r; enabled: %s", mechanism,
                     ", ".join(self.mechanisms))
            answer = self._handshake_answer(head, UNSUPPORTED_SASL_MECHANISM)
            conn.fail_authentication("unsupported SASL mechanism %r" % mechanism,
                                     self.failed_delay_ms)
            return Answer(answer)
        state.mechanism = mechanism
        state.handshake_version = version
        if version == 0:  # the tokens come raw, without a Kafka header
            conn.expect_raw(self._raw_token)
        return Answer(self._handshake_answer(head, 0))

    def _handshake_answer(self, head, error_code):
        response = SaslHandshakeResponse[head.api_version](
            error_code=error_code, mechanisms=list(self.mechanisms))
        response.with_header(correlation_id=head.correlation_id)
        return bytes(response.encode(header=True, framed=True))

    # SaslAuthenticate (KIP-152) -------------------------------------------

    def _authenticate(self, conn, head):
        state = conn.auth
        version = head.api_version
        if version > SaslAuthenticateRequest.max_version:
            return Refuse("SaslAuthenticate v%d is newer than the proxy knows" % version)
        if state.mechanism is None or state.handshake_version == 0:
            answer = self._authenticate_answer(head, ILLEGAL_SASL_STATE,
                                               "SaslAuthenticate before SaslHandshake v1", b"")
            conn.fail_authentication("SaslAuthenticate before SaslHandshake v1",
                                     self.failed_delay_ms)
            return Answer(answer)
        request = SaslAuthenticateRequest.decode(bytes(head.buf[4:]), version=version, header=True)
        try:
            reply = self._token(conn, bytes(request.auth_bytes))
        except _AuthenticationFailed as exc:
            message = FAILED % state.mechanism
            answer = self._authenticate_answer(head, SASL_AUTHENTICATION_FAILED, message, b"")
            conn.fail_authentication(str(exc), self.failed_delay_ms)
            return Answer(answer)
        return Answer(self._authenticate_answer(head, 0, None, reply))

    def _authenticate_answer(self, head, error_code, message, auth_bytes):
        response = SaslAuthenticateResponse[head.api_version](
            error_code=error_code, error_message=message, auth_bytes=auth_bytes,
            session_lifetime_ms=0)
        response.with_header(correlation_id=head.correlation_id)
        return bytes(response.encode(header=True, framed=True))

    def _raw_token(self, conn, frame):
        """SaslHandshake v0: a token framed by its length alone; the answer
        likewise. A failure closes the connection (v0 has no error reply)."""
        try:
            reply = self._token(conn, bytes(frame[4:]))
        except _AuthenticationFailed as exc:
            conn.fail_authentication(str(exc), self.failed_delay_ms)
            return None
        if conn.phase is Phase.READY:
            conn.expect_raw(None)
        return len(reply).to_bytes(4, "big") + reply

    # the mechanisms -------------------------------------------------------

    def _token(self, conn, token):
        """One client token in, the server's token out; raises
        _AuthenticationFailed (with a reason for the log, never a secret)."""
        state = conn.auth
        if state.mechanism == "PLAIN":
            return self._plain(conn, token)
        return self._scram(conn, token)

    def _plain(self, conn, token):
        parts = token.split(b"\x00")
        if len(parts) != 3:
            raise _AuthenticationFailed("malformed PLAIN token")
        try:
            authzid, user, password = (p.decode("utf-8") for p in parts)
        except UnicodeDecodeError:
            raise _AuthenticationFailed("PLAIN token is not UTF-8") from None
        if authzid and authzid != user:  # as Kafka: no acting as another user
            raise _AuthenticationFailed("PLAIN authorization id differs from user %r" % user)
        if not user or not self.credentials().check_plain(user, password):
            raise _AuthenticationFailed("PLAIN credentials rejected for user %r" % user)
        self._authenticated(conn, user)
        return b""

    def _scram(self, conn, token):
        from scramp import ScramException, ScramMechanism

        state = conn.auth
        try:
            if state.scram is None:  # client-first
                credentials = self.credentials()
                mechanism = state.mechanism

                def lookup(user):
                    cred = credentials.scram(mechanism, user)
                    if cred is None:
                        raise _AuthenticationFailed("unknown user %r for %s" % (user, mechanism))
                    state.user = user
                    return cred.salt, cred.stored_key, cred.server_key, cred.iterations

                server = ScramMechanism(mechanism).make_server(lookup)
                server.set_client_first(token.decode("utf-8"))
                state.scram = server
                return server.get_server_first().encode("utf-8")
            server = state.scram
            server.set_client_final(token.decode("utf-8"))
            reply = server.get_server_final().encode("utf-8")
        except ScramException as exc:
            raise _AuthenticationFailed("%s exchange failed for user %r: %s"
                                        % (state.mechanism, state.user, exc)) from None
        except UnicodeDecodeError:
            raise _AuthenticationFailed("SCRAM message is not UTF-8") from None
        self._authenticated(conn, state.user)
        return reply

    def _authenticated(self, conn, user):
        conn.principal = user
        conn.phase = Phase.READY
        conn.auth.scram = None
        log.info("client authenticated as %r with %s", user, conn.auth.mechanism)


def sasl_user(mechanism, token):
    """The user a client's first SASL token names: PLAIN's authentication
    id (RFC 4616), or the ``n=`` of SCRAM's client-first message (RFC 5802,
    with ``=2C`` and ``=3D`` decoded). Raises ValueError when the token is
    malformed or asks to act as another user, as Kafka refuses it."""
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
        if any(part == "tokenauth=true" for part in parts[4:]):
            # a delegation token: the principal is the token's owner, which
            # only the broker knows
            raise ValueError("%s logins with a delegation token cannot be attributed "
                             "to a user in passthrough mode" % mechanism)
        authzid = _saslname(parts[1][2:]) if parts[1].startswith("a=") else ""
        user = _saslname(parts[2][2:])
        if not user:
            raise ValueError("%s client-first message without a user name" % mechanism)
    if authzid and authzid != user:
        raise ValueError("%s authorization id differs from user %r" % (mechanism, user))
    return user


def _saslname(value):
    """RFC 5802's saslname: ``=2C`` is a comma, ``=3D`` an equals sign."""
    decoded = value.replace("=2C", ",").replace("=3D", "=")
    if "=" in value.replace("=2C", "").replace("=3D", ""):
        raise ValueError("malformed SCRAM user name %r" % value)
    return decoded


class _Relayed:
    """One connection's SASL exchange as relayed to the broker."""

    __slots__ = ("mechanism", "handshake_version", "user", "tokens", "failed")

    def __init__(self):
        self.mechanism = None
        self.handshake_version = None
        self.user = None  # read from the first token
        self.tokens = 0  # client tokens of this exchange relayed so far
        self.failed = False


class SaslPassthrough(_ClientSasl):
    """Relays clients' SASL exchanges to the broker untouched (passthrough
    mode): the broker verifies the client. The proxy reads the user name
    from the first token and binds it as the connection's principal only
    when the broker answers the last step with success; a failed or
    abandoned exchange binds nothing, and until the principal is bound only
    ApiVersions, SaslHandshake and SaslAuthenticate are accepted.

    Both SaslHandshake v1 (tokens in SaslAuthenticate, KIP-152) and v0 (raw
    tokens after the handshake, and raw answers matched by order) are
    relayed. A re-authentication (KIP-368) is relayed too, for the same user
    only: the principal is fixed for the connection's life."""

    name = "sasl-passthrough"
    _state = _Relayed

    def __init__(self, mechanisms, failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS):
        super().__init__(mechanisms, failed_delay_ms)

    def response_need(self, api_key, api_version):
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else NOTHING

    def on_request(self, conn, head, inflight):
        api_key = head.api_key
        state = conn.auth
        if state.failed:
            return Refuse("request api key %d after the broker refused the authentication"
                          % api_key)
        if api_key == SASL_HANDSHAKE:
            return self._handshake(conn, head)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(conn, head)
        if api_key == apis.API_VERSIONS:
            return None
        return Refuse("request api key %d v%d before authentication" % (api_key, head.api_version))

    def _handshake(self, conn, head):
        state = conn.auth
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        if conn.phase is Phase.READY and version == 0:
            return Refuse("SaslHandshake v0 on an authenticated connection")
        mechanism = SaslHandshakeRequest.decode(bytes(head.buf[4:]), version=version,
                                                header=True).mechanism
        if mechanism not in self.mechanisms:
            # the proxy could not tell whom the broker authenticated
            log.info("client asked for SASL mechanism %r; relayed: %s", mechanism,
                     ", ".join(self.mechanisms))
            response = SaslHandshakeResponse[version](
                error_code=UNSUPPORTED_SASL_MECHANISM, mechanisms=list(self.mechanisms))
            response.with_header(correlation_id=head.correlation_id)
            conn.fail_authentication("unsupported SASL mechanism %r" % mechanism,
                                     self.failed_delay_ms)
            return Answer(bytes(response.encode(header=True, framed=True)))
        state.mechanism = mechanism
        state.handshake_version = version
        state.user = None
        state.tokens = 0
        return None

    def _authenticate(self, conn, head):
        state = conn.auth
        version = head.api_version
        if version > SaslAuthenticateRequest.max_version:
            return Refuse("SaslAuthenticate v%d is newer than the proxy knows" % version)
        if state.mechanism is None or state.handshake_version == 0:
            return None  # the broker answers ILLEGAL_SASL_STATE; nothing is bound
        request = SaslAuthenticateRequest.decode(bytes(head.buf[4:]), version=version, header=True)
        return self._client_token(conn, bytes(request.auth_bytes))

    def _client_token(self, conn, token):
        """None to relay the token, or Refuse."""
        state = conn.auth
        state.tokens += 1
        if state.tokens == 1:
            try:
                state.user = sasl_user(state.mechanism, token)
            except ValueError as exc:
                return Refuse(str(exc))
            if conn.phase is Phase.READY and state.user != conn.principal:
                return Refuse("re-authentication as %r on a connection authenticated as %r"
                              % (state.user, conn.principal))
        return None

    def _last_step(self, state):
        return state.tokens >= (1 if state.mechanism == "PLAIN" else 2)

    def on_response(self, conn, inflight, frame):
        state = conn.auth
        if state is None or state.mechanism is None:
            return frame
        version = inflight.api_version
        if inflight.api_key == SASL_HANDSHAKE:
            if frame[8:10] != b"\0\0":  # error_code: the broker closes next
                state.failed = True
            elif version == 0:
                conn.expect_raw(self._raw_token)
            return frame
        body = response_body_offset(frame, version >= 2)
        answer = SaslAuthenticateResponse[version].decode(bytes(frame[body:]))
        if answer.error_code:
            log.info("the broker refused %s authentication of %r: %s", state.mechanism,
                     state.user, answer.error_message)
            state.failed = True
        elif self._last_step(state):
            self._bind(conn, state)
        return frame

    def _raw_token(self, conn, frame):
        """A raw token after SaslHandshake v0: relayed; the broker's raw
        answer comes back to _raw_answer."""
        verdict = self._client_token(conn, frame[4:])
        if verdict is not None:
            conn.fail_authentication(verdict.reason, 0)
            return None
        return ForwardRaw(self._raw_answer)

    def _raw_answer(self, conn, frame):
        # with v0 a broker answers a failure by closing the connection, so an
        # answer to the last step is the success
        state = conn.auth
        if self._last_step(state):
            conn.expect_raw(None)
            self._bind(conn, state)
        return frame

    def _bind(self, conn, state):
        if conn.phase is Phase.READY:
            log.debug("client re-authenticated as %r with %s", state.user, state.mechanism)
        else:
            conn.principal = state.user
            conn.phase = Phase.READY
            log.info("client authenticated as %r with %s (verified by the broker, "
                     "SaslHandshake v%d)", state.user, state.mechanism, state.handshake_version)
        state.mechanism = None


class UpstreamSaslLogin(Filter):
    """The proxy's own SASL login on each broker connection (terminate mode
    towards brokers that require SASL): SaslHandshake v1 and SaslAuthenticate
    (KIP-152) sent as the proxy's own requests before any client byte."""

    name = "upstream-sasl"

    def __init__(self, mechanism, username, password):
        if mechanism not in MECHANISMS:
            raise ValueError("upstream SASL mechanism must be one of %s, got %r"
                             % (", ".join(MECHANISMS), mechanism))
        self.mechanism = mechanism
        self.username = username
        self._password = password

    def __repr__(self):  # never the password
        return "UpstreamSaslLogin(%s, %r)" % (self.mechanism, self.username)

    def on_upstream(self, conn):
        request = SaslHandshakeRequest[1](mechanism=self.mechanism)
        request.with_header(correlation_id=0, client_id="kthrottle")
        conn.send_request(bytes(request.encode(header=True, framed=True)), SASL_HANDSHAKE, 1,
                          self._handshake_answered)
        return True

    def _send_token(self, conn, token):
        request = SaslAuthenticateRequest[1](auth_bytes=token)
        request.with_header(correlation_id=0, client_id="kthrottle")
        conn.send_request(bytes(request.encode(header=True, framed=True)), SASL_AUTHENTICATE, 1,
                          self._token_answered)

    def _handshake_answered(self, conn, frame):
        answer = SaslHandshakeResponse[1].decode(bytes(frame[8:]))
        if answer.error_code:
            conn.upstream_ready(False, "the broker refused SASL mechanism %s (error %d; it offers "
                                "%s)" % (self.mechanism, answer.error_code,
                                         ", ".join(answer.mechanisms)))
            return
        if self.mechanism == "PLAIN":
            conn.auth_upstream = None
            self._send_token(conn, ("\0%s\0%s" % (self.username, self._password)).encode("utf-8"))
            return
        from scramp import ScramClient

        client = ScramClient([self.mechanism], self.username, self._password)
        conn.auth_upstream = [client, False]
        self._send_token(conn, client.get_client_first().encode("utf-8"))

    def _token_answered(self, conn, frame):
        from scramp import ScramException

        answer = SaslAuthenticateResponse[1].decode(bytes(frame[8:]))
        if answer.error_code:
            conn.upstream_ready(False, "the broker refused the proxy's %s login as %r: %s"
                                % (self.mechanism, self.username, answer.error_message))
            return
        state = conn.auth_upstream  # None for PLAIN (one round), else [client, sent final?]
        if state is not None:
            client, sent_final = state
            try:
                if not sent_final:
                    client.set_server_first(bytes(answer.auth_bytes).decode("utf-8"))
                    state[1] = True
                    self._send_token(conn, client.get_client_final().encode("utf-8"))
                    return
                client.set_server_final(bytes(answer.auth_bytes).decode("utf-8"))
            except (ScramException, UnicodeDecodeError) as exc:
                conn.upstream_ready(False, "the broker's %s answer did not verify: %s"
                                    % (self.mechanism, exc))
                return
        conn.auth_upstream = None
        log.debug("logged in to the broker as %r with %s", self.username, self.mechanism)
        conn.upstream_ready()
