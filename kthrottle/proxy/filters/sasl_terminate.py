"""SASL authentication of clients by the proxy itself (terminate mode).

A filter: from the moment the client is accepted the connection is held for
authentication, and until the client has authenticated
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
from functools import partial

from ...codecs import apis
from ...codecs.versions import api_versions_answer
from ..filter import Answer, Pending, Refuse
from .sasl import DEFAULT_FAILED_AUTHENTICATION_DELAY_MS, FAILED, ILLEGAL_SASL_STATE
from .sasl import SASL_AUTHENTICATE, SASL_AUTHENTICATION_FAILED, SASL_HANDSHAKE
from .sasl import UNSUPPORTED_SASL_MECHANISM
from .sasl import SaslAuthenticateRequest, SaslAuthenticateResponse
from .sasl import SaslHandshakeRequest, SaslHandshakeResponse
from .sasl import ClientSasl, auth_bytes, before_authentication, decode

log = logging.getLogger("kthrottle.auth")


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


class SaslTerminate(ClientSasl):
    """Verifies clients' SASL credentials in the proxy (terminate mode).

    The client authenticates before any broker connection is opened for it:
    its ApiVersions request is answered by the proxy, from the version
    ranges a broker gave it earlier (``api_versions``), and the broker is
    connected (and the proxy's own login to it made) only once the client
    has authenticated. A PLAIN password is checked by a key derivation run
    outside the event loop (``offload``), as long for an unknown user as for
    a known one."""

    name = "sasl-terminate"

    mode = "terminate"

    @staticmethod
    def services_used(services):
        return {"credentials": services.credentials, "offload": services.offload,
                "api_versions": services.api_versions}

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

    def new_state(self):
        return _State()

    def on_accept(self, ctx):
        ctx.begin_authentication()

    def on_request(self, ctx, head, inflight):
        api_key = head.api_key
        if not ctx.authenticating:
            # KIP-368 re-authentication is not offered: the principal is fixed
            return Refuse("SASL request (api key %d) on an authenticated connection" % api_key)
        if api_key == apis.API_VERSIONS:
            return self._api_versions(head)
        if api_key == SASL_HANDSHAKE:
            return self._handshake(ctx, head)
        if api_key == SASL_AUTHENTICATE:
            return self._authenticate(ctx, head)
        return before_authentication(head)

    # ApiVersions, before any broker connection ---------------------------

    def _api_versions(self, head):
        version = head.api_version
        if version > apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] or self.api_versions is None:
            return None  # too new: VersionGate answers UNSUPPORTED_VERSION
        correlation_id = head.correlation_id
        ranges = self.api_versions.current
        if ranges is not None:
            return Answer(api_versions_answer(correlation_id, version, ranges))

        def answered(ctx, ranges, error):
            if error is not None:
                return Refuse("no broker answered ApiVersions: %s" % error)
            return api_versions_answer(correlation_id, version, ranges)

        return Pending(self.api_versions.fetch, answered)

    # SaslHandshake ------------------------------------------------------

    def _handshake(self, ctx, head):
        state = ctx.state
        version = head.api_version
        if version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % version)
        mechanism = decode(SaslHandshakeRequest, head.buf[4:], version=version,
                           header=True).mechanism
        if state.mechanism is not None:
            answer = self._handshake_answer(head, ILLEGAL_SASL_STATE)
            self.failed(ctx, "a second SaslHandshake")
            return Answer(answer)
        if mechanism not in self.mechanisms:
            answer = self._handshake_answer(head, UNSUPPORTED_SASL_MECHANISM)
            self.failed(ctx, "unsupported SASL mechanism %r (enabled: %s)"
                        % (mechanism, ", ".join(self.mechanisms)))
            return Answer(answer)
        state.mechanism = mechanism
        state.handshake_version = version
        if version == 0:  # the tokens come raw, without a Kafka header
            ctx.expect_raw(self._raw_token)
        return Answer(self._handshake_answer(head, 0))

    def _handshake_answer(self, head, error_code):
        response = SaslHandshakeResponse[head.api_version](
            error_code=error_code, mechanisms=list(self.mechanisms))
        response.with_header(correlation_id=head.correlation_id)
        return bytes(response.encode(header=True, framed=True))

    # SaslAuthenticate (KIP-152) -------------------------------------------

    def _authenticate(self, ctx, head):
        state = ctx.state
        version = head.api_version
        if version > SaslAuthenticateRequest.max_version:
            return Refuse("SaslAuthenticate v%d is newer than the proxy knows" % version)
        correlation_id = head.correlation_id
        if state.mechanism is None or state.handshake_version == 0:
            reason = "SaslAuthenticate before SaslHandshake v1"
            self.failed(ctx, reason)
            return Answer(_authenticate_answer(correlation_id, version, ILLEGAL_SASL_STATE,
                                               reason, b""))
        request = decode(SaslAuthenticateRequest, head.buf[4:], version=version, header=True)

        def answer(ctx, reply, exc):
            if exc is None:
                return _authenticate_answer(correlation_id, version, 0, None, reply)
            self.failed(ctx, str(exc))
            return _authenticate_answer(correlation_id, version, SASL_AUTHENTICATION_FAILED,
                                        FAILED % state.mechanism, b"")

        return self._token(ctx, auth_bytes(request), answer)

    def _raw_token(self, ctx, frame):
        """SaslHandshake v0: a token framed by its length alone; the answer
        likewise. A failure closes the connection (v0 has no error reply)."""
        def answer(ctx, reply, exc):
            if exc is not None:
                self.failed(ctx, str(exc))
                return b""
            if not ctx.authenticating:
                ctx.expect_raw(None)
            return len(reply).to_bytes(4, "big") + reply

        verdict = self._token(ctx, bytes(frame[4:]), answer)
        return verdict.frame if verdict.__class__ is Answer else verdict

    # the mechanisms -------------------------------------------------------

    def _token(self, ctx, token, answer):
        """One client token in; ``answer(ctx, reply, exc)`` makes the frame
        for the server's reply or the failure (``exc``: _AuthenticationFailed,
        whose text names the user and the reason, never a secret). An Answer,
        or Pending while a PLAIN password is checked."""
        if ctx.state.mechanism == "PLAIN":
            return self._plain(ctx, token, answer)
        try:
            reply = self._scram(ctx, token)
        except _AuthenticationFailed as exc:
            return Answer(answer(ctx, None, exc))
        return Answer(answer(ctx, reply, None))

    def _plain(self, ctx, token, answer):
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
            return Answer(answer(ctx, None, exc))
        credentials = self.credentials()

        def checked(ctx, verdict, error):
            if error is not None:
                log.error("checking a PLAIN password failed", exc_info=error)
                verdict = None
            if verdict is True:
                self._authenticated(ctx, user)
                return answer(ctx, b"", None)
            reason = "unknown user" if verdict is False and user not in credentials else (
                "wrong password" if verdict is False else "the check failed")
            return answer(ctx, None, _AuthenticationFailed(
                "PLAIN login for user %r: %s" % (user, reason)))

        verdict = credentials.check_plain_remembered(user, password)
        if verdict is not None:  # no derivation needed: answered at once
            return Answer(checked(ctx, verdict, None))
        return Pending(partial(self.offload, credentials.check_plain, user, password), checked)

    def _scram(self, ctx, token):
        from scramp import ScramException, ScramMechanism

        state = ctx.state
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
        self._authenticated(ctx, state.user)
        return reply

    def _authenticated(self, ctx, user):
        ctx.state.scram = None
        log.info("client authenticated as %r with %s", user, ctx.state.mechanism)
        ctx.authenticated(user)


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
