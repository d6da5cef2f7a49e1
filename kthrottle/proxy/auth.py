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
import base64
import hashlib
import hmac
import logging
import struct
import warnings
from functools import partial

from ..codecs import ProtocolError, apis
from ..codecs.frames import response_body_offset
from ..codecs.versions import api_versions_answer
from .pipeline import (
    GATHER,
    HEAD,
    NOTHING,
    REFUSED_AUTHENTICATION,
    REFUSED_UNAUTHENTICATED_REQUEST,
    Answer,
    Filter,
    ForwardRaw,
    Pending,
    Phase,
    Refuse,
)

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

    __slots__ = ("mechanism", "handshake_version", "scram", "user", "unknown_user")

    def __init__(self):
        self.mechanism = None
        self.handshake_version = None
        self.scram = None  # scramp's server while a SCRAM exchange runs
        self.user = None
        self.unknown_user = False  # the SCRAM exchange runs on a made-up credential


class _AuthenticationFailed(Exception):
    pass


def _inline(fn, *args):
    """The default way to run a key derivation: at once (tests, tools)."""
    return fn(*args)


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

    def _failed(self, conn, reason):
        conn.fail_authentication("authentication failed: %s" % reason, self.failed_delay_ms)


def _before_authentication(head):
    return Refuse("request api key %d v%d before authentication"
                  % (head.api_key, head.api_version), REFUSED_UNAUTHENTICATED_REQUEST)


class SaslTerminate(_ClientSasl):
    """Verifies clients' SASL credentials in the proxy (terminate mode).

    The client authenticates before any broker connection is opened for it:
    its ApiVersions request is answered by the proxy, from the version
    ranges a broker gave it earlier (``api_versions``), and the broker is
    connected (and the proxy's own login to it made) only once the client
    has authenticated. A PLAIN password is checked by a key derivation run
    outside the event loop (``offload``), as long for an unknown user as for
    a known one."""

    name = "sasl-terminate"

    def __init__(self, mechanisms, credentials,
                 failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS, offload=_inline,
                 api_versions=None):
        """``credentials()`` returns the current credentials snapshot (an
        object with ``scram(mechanism, user)`` and ``check_plain(user,
        password)``; sources replace it live). ``offload(fn, *args)`` runs a
        key derivation and returns its result or an awaitable of it.
        ``api_versions`` has ``current`` (the broker's version ranges, or
        None while unknown) and ``fetch()`` (an awaitable of them)."""
        super().__init__(mechanisms, failed_delay_ms)
        self.credentials = credentials
        self.offload = offload
        self.api_versions = api_versions

    def on_accept(self, conn):
        conn.begin_authentication(_State())

    def on_request(self, conn, head, inflight):
        api_key = head.api_key
        if conn.phase is not Phase.AUTHENTICATING:
            # KIP-368 re-authentication is not offered: the principal is fixed
            return Refuse("SASL request (api key %d) on an authenticated connection" % api_key)
        if api_key == apis.API_VERSIONS:
            return self._api_versions(head)
        if api_key == SASL_HANDSHAKE:
            return self._handshake(conn, head)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(conn, head)
        return _before_authentication(head)

    # ApiVersions, before any broker connection ---------------------------

    def _api_versions(self, head):
        version = head.api_version
        if version > apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] or self.api_versions is None:
            return None  # too new: VersionGate answers UNSUPPORTED_VERSION
        correlation_id = head.correlation_id
        ranges = self.api_versions.current
        if ranges is not None:
            return Answer(api_versions_answer(correlation_id, version, ranges))

        def answered(conn, ranges, error):
            if error is not None:
                return Refuse("no broker answered ApiVersions: %s" % error)
            return api_versions_answer(correlation_id, version, ranges)

        return Pending(self.api_versions.fetch, answered)

    # SaslHandshake ------------------------------------------------------

    def _handshake(self, conn, head):
        state = conn.auth
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        mechanism = _decode(SaslHandshakeRequest, head.buf[4:], version=version,
                            header=True).mechanism
        if state.mechanism is not None:
            answer = self._handshake_answer(head, ILLEGAL_SASL_STATE)
            self._failed(conn, "a second SaslHandshake")
            return Answer(answer)
        if mechanism not in self.mechanisms:
            answer = self._handshake_answer(head, UNSUPPORTED_SASL_MECHANISM)
            self._failed(conn, "unsupported SASL mechanism %r (enabled: %s)"
                         % (mechanism, ", ".join(self.mechanisms)))
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
        correlation_id = head.correlation_id
        if state.mechanism is None or state.handshake_version == 0:
            reason = "SaslAuthenticate before SaslHandshake v1"
            self._failed(conn, reason)
            return Answer(_authenticate_answer(correlation_id, version, ILLEGAL_SASL_STATE,
                                               reason, b""))
        request = _decode(SaslAuthenticateRequest, head.buf[4:], version=version, header=True)

        def answer(conn, reply, exc):
            if exc is None:
                return _authenticate_answer(correlation_id, version, 0, None, reply)
            self._failed(conn, str(exc))
            return _authenticate_answer(correlation_id, version, SASL_AUTHENTICATION_FAILED,
                                        FAILED % state.mechanism, b"")

        return self._token(conn, _auth_bytes(request), answer)

    def _raw_token(self, conn, frame):
        """SaslHandshake v0: a token framed by its length alone; the answer
        likewise. A failure closes the connection (v0 has no error reply)."""
        def answer(conn, reply, exc):
            if exc is not None:
                self._failed(conn, str(exc))
                return b""
            if conn.phase is not Phase.AUTHENTICATING:
                conn.expect_raw(None)
            return len(reply).to_bytes(4, "big") + reply

        verdict = self._token(conn, bytes(frame[4:]), answer)
        return verdict.frame if verdict.__class__ is Answer else verdict

    # the mechanisms -------------------------------------------------------

    def _token(self, conn, token, answer):
        """One client token in; ``answer(conn, reply, exc)`` makes the frame
        for the server's reply or the failure (``exc``: _AuthenticationFailed,
        whose text names the user and the reason, never a secret). An Answer,
        or Pending while a PLAIN password is checked."""
        if conn.auth.mechanism == "PLAIN":
            return self._plain(conn, token, answer)
        try:
            reply = self._scram(conn, token)
        except _AuthenticationFailed as exc:
            return Answer(answer(conn, None, exc))
        return Answer(answer(conn, reply, None))

    def _plain(self, conn, token, answer):
        parts = token.split(b"\x00")
        try:
            if len(parts) != 3:
                raise _AuthenticationFailed("malformed PLAIN token")
            try:
                authzid, user, password = (p.decode("utf-8") for p in parts)
            except UnicodeDecodeError:
                raise _AuthenticationFailed("PLAIN token is not UTF-8") from None
            if not user:
                raise _AuthenticationFailed("PLAIN token without a user name")
            if authzid and authzid != user:  # as Kafka: no acting as another user
                raise _AuthenticationFailed(
                    # named by neither field: a client that puts the
                    # password one field early would have it logged
                    "PLAIN login whose authorization id differs from its user name")
        except _AuthenticationFailed as exc:
            return Answer(answer(conn, None, exc))
        credentials = self.credentials()

        def checked(conn, verdict, error):
            if error is not None:
                log.error("checking a PLAIN password failed", exc_info=error)
                verdict = None
            if verdict is True:
                self._authenticated(conn, user)
                return answer(conn, b"", None)
            reason = "unknown user" if verdict is False and user not in credentials else (
                "wrong password" if verdict is False else "the check failed")
            return answer(conn, None, _AuthenticationFailed(
                "PLAIN login for user %r: %s" % (user, reason)))

        verdict = credentials.check_plain_remembered(user, password)
        if verdict is not None:  # no derivation needed: answered at once
            return Answer(checked(conn, verdict, None))
        return Pending(partial(self.offload, credentials.check_plain, user, password), checked)

    def _scram(self, conn, token):
        from scramp import ScramException, ScramMechanism

        state = conn.auth
        mechanism = state.mechanism
        try:
            if state.scram is None:  # client-first
                credentials = self.credentials()

                def lookup(user):
                    state.user = user
                    cred = credentials.scram(mechanism, user)
                    if cred is None:
                        # Go on with a made-up credential, failing at the
                        # proof, as for a wrong password: an unknown user is
                        # not told apart (RFC 5802 section 9 allows this).
                        state.unknown_user = True
                        cred = credentials.decoy(mechanism, user)
                    return cred.salt, cred.stored_key, cred.server_key, cred.iterations

                server = ScramMechanism(mechanism).make_server(lookup)
                server.set_client_first(token.decode("utf-8"))
                state.scram = server
                return server.get_server_first().encode("utf-8")
            server = state.scram
            server.set_client_final(token.decode("utf-8"))
            reply = server.get_server_final().encode("utf-8")
        except ScramException as exc:
            raise _AuthenticationFailed("%s login for user %r: %s" % (
                mechanism, state.user, _scram_reason(state, exc))) from None
        except UnicodeDecodeError:
            raise _AuthenticationFailed("%s message is not UTF-8" % mechanism) from None
        if state.unknown_user:  # cannot happen: a made-up credential never verifies
            raise _AuthenticationFailed("%s login for user %r: unknown user"
                                        % (mechanism, state.user))
        self._authenticated(conn, state.user)
        return reply

    def _authenticated(self, conn, user):
        conn.auth.scram = None
        log.info("client authenticated as %r with %s", user, conn.auth.mechanism)
        conn.authenticated(user)


# what kafka-python's decoders raise on malformed bytes (a null field then
# makes a TypeError of what reads it)
_DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError)


def _decode(cls, buf, **kwargs):
    """A SASL request or answer decoded; malformed bytes are the codec's
    ProtocolError (the connection closes with the reason), never another
    exception."""
    try:
        message = cls.decode(bytes(buf), **kwargs)
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed %s: %s" % (cls.__name__, exc)) from None
    if getattr(message, "mechanism", "") is None:
        raise ProtocolError("malformed %s: a null mechanism" % cls.__name__)
    return message


def _auth_bytes(request):
    token = request.auth_bytes
    if token is None:  # a null BYTES field: no token at all
        raise ProtocolError("malformed SaslAuthenticate request: null auth_bytes")
    return bytes(token)


def _scram_reason(state, exc):
    """What went wrong in a SCRAM exchange, in words."""
    if state.unknown_user:
        return "unknown user"
    code = getattr(exc, "server_error", None)
    code = getattr(code, "value", code)  # scramp's ServerError, an enum of RFC 5802's names
    if code == "invalid-proof":
        return "wrong password (the client's proof did not verify)"
    if code:
        return "the client's message was refused (%s: %s)" % (code, exc)
    return "the exchange failed (%s)" % exc


def _authenticate_answer(correlation_id, version, error_code, message, auth_bytes):
    response = SaslAuthenticateResponse[version](
        error_code=error_code, error_message=message, auth_bytes=auth_bytes,
        session_lifetime_ms=0)
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


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
        return 1 if self.mechanism == "PLAIN" else 2


class _Relayed:
    """One connection's SASL exchanges as relayed to the broker."""

    __slots__ = ("exchange", "failed")

    def __init__(self):
        self.exchange = None  # the latest exchange
        self.failed = False


class SaslPassthrough(_ClientSasl):
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

    def __init__(self, mechanisms, failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS):
        super().__init__(mechanisms, failed_delay_ms)

    def on_connect(self, conn):
        conn.begin_authentication(_Relayed())

    def response_need(self, api_key, api_version):
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else NOTHING

    def on_request(self, conn, head, inflight):
        api_key = head.api_key
        state = conn.auth
        if state.failed:
            return Refuse("request api key %d after the broker refused the authentication"
                          % api_key, REFUSED_AUTHENTICATION)
        if api_key == SASL_HANDSHAKE:
            return self._handshake(conn, head, inflight)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(conn, head, inflight)
        if api_key == apis.API_VERSIONS:
            return None
        return _before_authentication(head)

    def _handshake(self, conn, head, inflight):
        state = conn.auth
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        if conn.phase is Phase.READY and version == 0:
            return Refuse("SaslHandshake v0 on an authenticated connection")
        if state.exchange is not None and not state.exchange.done:
            return Refuse("a second SaslHandshake while a SASL exchange is unfinished",
                          REFUSED_AUTHENTICATION)
        mechanism = _decode(SaslHandshakeRequest, head.buf[4:], version=version,
                            header=True).mechanism
        if mechanism not in self.mechanisms:
            # the proxy could not tell whom the broker authenticated
            response = SaslHandshakeResponse[version](
                error_code=UNSUPPORTED_SASL_MECHANISM, mechanisms=list(self.mechanisms))
            response.with_header(correlation_id=head.correlation_id)
            self._failed(conn, "unsupported SASL mechanism %r (relayed: %s)"
                         % (mechanism, ", ".join(self.mechanisms)))
            return Answer(bytes(response.encode(header=True, framed=True)))
        state.exchange = inflight.note = _Exchange(mechanism, version)
        return None

    def _authenticate(self, conn, head, inflight):
        version = head.api_version
        if version > SaslAuthenticateRequest.max_version:
            return Refuse("SaslAuthenticate v%d is newer than the proxy knows" % version)
        exchange = conn.auth.exchange
        if exchange is None or exchange.handshake_version == 0 or exchange.done:
            return None  # the broker answers ILLEGAL_SASL_STATE; nothing is bound
        request = _decode(SaslAuthenticateRequest, head.buf[4:], version=version, header=True)
        verdict = self._client_token(conn, exchange, _auth_bytes(request))
        if verdict is None:
            inflight.note = (exchange, exchange.tokens)
        return verdict

    def _client_token(self, conn, exchange, token):
        """None to relay the token, or Refuse."""
        exchange.tokens += 1
        if exchange.tokens == 1:
            try:
                exchange.user = sasl_user(exchange.mechanism, token)
            except ValueError as exc:
                return Refuse(str(exc), REFUSED_AUTHENTICATION)
            if conn.phase is Phase.READY and exchange.user != conn.principal:
                return Refuse("re-authentication as %r on a connection authenticated as %r"
                              % (exchange.user, conn.principal), REFUSED_AUTHENTICATION)
        return None

    def on_response(self, conn, inflight, frame):
        note = inflight.note
        if note is None:
            return frame
        state = conn.auth
        version = inflight.api_version
        if inflight.api_key == SASL_HANDSHAKE:
            if frame[8:10] != b"\0\0":  # error_code: the broker closes next
                state.failed = True
            elif version == 0:
                conn.expect_raw(partial(self._raw_token, note))
            return frame
        exchange, step = note
        body = response_body_offset(frame, version >= 2)
        answer = _decode(SaslAuthenticateResponse[version], frame[body:])
        if answer.error_code:
            log.info("the broker refused %s authentication of %r: %s", exchange.mechanism,
                     exchange.user, answer.error_message)
            state.failed = True
        elif step == exchange.last_step:
            self._bind(conn, exchange)
        return frame

    def _raw_token(self, exchange, conn, frame):
        """A raw token after SaslHandshake v0: relayed; the broker's raw
        answer comes back to _raw_answer."""
        verdict = self._client_token(conn, exchange, frame[4:])
        if verdict is not None:
            conn.fail_authentication(verdict.reason, 0)
            return None
        return ForwardRaw(partial(self._raw_answer, exchange, exchange.tokens))

    def _raw_answer(self, exchange, step, conn, frame):
        # with v0 a broker answers a failure by closing the connection, so an
        # answer to the last step is the success
        if step == exchange.last_step:
            conn.expect_raw(None)
            self._bind(conn, exchange)
        return frame

    def _bind(self, conn, exchange):
        exchange.done = True
        if conn.phase is Phase.READY:
            log.debug("client re-authenticated as %r with %s", exchange.user, exchange.mechanism)
            return
        log.info("client authenticated as %r with %s (verified by the broker, "
                 "SaslHandshake v%d)", exchange.user, exchange.mechanism,
                 exchange.handshake_version)
        conn.authenticated(exchange.user)


_HASHES = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}


class UpstreamSaslLogin(Filter):
    """The proxy's own SASL login on each broker connection (terminate mode
    towards brokers that require SASL): SaslHandshake v1 and SaslAuthenticate
    (KIP-152) sent as the proxy's own requests before any client byte.

    SCRAM's salted password depends only on the password, the salt and the
    iteration count, and a broker gives the same salt every time: it is
    derived once per (salt, iterations) and kept, so a login costs a few
    HMACs rather than a PBKDF2 (RFC 5802 section 3)."""

    name = "upstream-sasl"
    KEYS_KEPT = 16  # (salt, iterations) pairs: one per broker-side credential

    def __init__(self, mechanism, username, password):
        if mechanism not in MECHANISMS:
            raise ValueError("upstream SASL mechanism must be one of %s, got %r"
                             % (", ".join(MECHANISMS), mechanism))
        self.mechanism = mechanism
        self.username = username
        self._password = password
        self._keys = {}  # (salt, iterations) -> (client key, server key)

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
        answer = _decode(SaslHandshakeResponse[1], frame[8:])
        if answer.error_code:
            conn.upstream_ready(False, "the broker refused SASL mechanism %s (error %d; it offers "
                                "%s)" % (self.mechanism, answer.error_code,
                                         ", ".join(answer.mechanisms or ())))
            return
        if self.mechanism == "PLAIN":
            conn.auth_upstream = None
            self._send_token(conn, ("\0%s\0%s" % (self.username, self._password)).encode("utf-8"))
            return
        from scramp import ScramClient

        client = ScramClient([self.mechanism], self.username, self._password)
        conn.auth_upstream = [client, None]  # then the server signature expected
        self._send_token(conn, client.get_client_first().encode("utf-8"))

    def _client_final(self, client):
        """The client-final message and the server signature expected, with
        the salted password derived once per (salt, iterations)."""
        from scramp.utils import saslprep

        digest = _HASHES[self.mechanism]
        salt, iterations = bytes(client.salt), int(client.iterations)
        keys = self._keys.get((salt, iterations))
        if keys is None:
            salted = hashlib.pbkdf2_hmac(digest().name, saslprep(self._password).encode("utf-8"),
                                         salt, iterations)
            keys = (hmac.digest(salted, b"Client Key", digest),
                    hmac.digest(salted, b"Server Key", digest))
            if len(self._keys) >= self.KEYS_KEPT:
                self._keys.clear()
            self._keys[salt, iterations] = keys
        client_key, server_key = keys
        without_proof = "c=biws,r=%s" % client.nonce  # biws: "n,,", no channel binding
        auth_message = ("%s,%s,%s" % (client.client_first_bare, client.server_first,
                                      without_proof)).encode("utf-8")
        stored_key = digest(client_key).digest()
        signature = hmac.digest(stored_key, auth_message, digest)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        final = "%s,p=%s" % (without_proof, base64.b64encode(proof).decode("ascii"))
        return final, hmac.digest(server_key, auth_message, digest)

    def _token_answered(self, conn, frame):
        from scramp import ScramException

        answer = _decode(SaslAuthenticateResponse[1], frame[8:])
        if answer.error_code:
            conn.upstream_ready(False, "the broker refused the proxy's %s login as %r: %s"
                                % (self.mechanism, self.username, answer.error_message))
            return
        state = conn.auth_upstream  # None for PLAIN (one round), else [client, signature]
        if state is not None:
            client, expected = state
            try:
                message = bytes(answer.auth_bytes).decode("utf-8")
                if expected is None:
                    client.set_server_first(message)
                    final, state[1] = self._client_final(client)
                    self._send_token(conn, final.encode("utf-8"))
                    return
                if not message.startswith("v="):
                    raise ValueError("the broker's final message is %r" % message[:40])
                if not hmac.compare_digest(base64.b64decode(message[2:].split(",")[0]),
                                           expected):
                    raise ValueError("the broker's signature is wrong")
            except (ScramException, UnicodeDecodeError, ValueError) as exc:
                conn.upstream_ready(False, "the broker's %s answer did not verify: %s"
                                    % (self.mechanism, exc))
                return
        conn.auth_upstream = None
        log.debug("logged in to the broker as %r with %s", self.username, self.mechanism)
        conn.upstream_ready()
