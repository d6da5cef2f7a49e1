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

OAUTHBEARER (KIP-255, RFC 7628): the client's JWT is checked as Kafka's
built-in validator checks it (KIP-768): signature against the keys of the
JWKS at --sasl-oauthbearer-jwks-endpoint-url (``sources/jwks.py``, kept in
memory), audience, issuer, expiry with a clock skew; the principal is its
sub claim. A refused token gets Kafka's exchange: the error challenge
``{"status":"invalid_token"}``, the client's ^A, then
SASL_AUTHENTICATION_FAILED; the reason goes to the proxy's log only.

KIP-368: with --connections-max-reauth-ms the session lasts that long (for a
token, no longer than the token), the client is told so in SaslAuthenticate
v1+, and the connection is closed at its end unless the client has
re-authenticated, as the same principal with the same mechanism.
"""
import logging
import time
from functools import partial

from ...codecs import apis
from ...codecs.versions import api_versions_answer
from ...options import INTEGER, NAMES, ConfigError, Option
from ...policy import oauthbearer
from ..filter import Answer, Pending, Refuse
from .sasl import DEFAULT_FAILED_AUTHENTICATION_DELAY_MS, FAILED, ILLEGAL_SASL_STATE
from .sasl import OAUTHBEARER
from .sasl import SASL_AUTHENTICATE, SASL_AUTHENTICATION_FAILED, SASL_HANDSHAKE
from .sasl import UNSUPPORTED_SASL_MECHANISM
from .sasl import SaslAuthenticateRequest, SaslAuthenticateResponse
from .sasl import SaslHandshakeRequest, SaslHandshakeResponse
from .sasl import ClientSasl, auth_bytes, before_authentication, decode

log = logging.getLogger("kthrottle.auth")


class _State:
    """One connection's progress through its SASL exchange."""

    __slots__ = ("mechanism", "handshake_version", "scram", "user", "unknown_user",
                 "token_error", "expires_at", "session_ms", "original")

    def __init__(self):
        self.original = None  # the mechanism of the first authentication
        self.restart()

    def restart(self):
        """A new exchange (a KIP-368 re-authentication)."""
        self.mechanism = None
        self.handshake_version = None
        self.scram = None  # scramp's server while a SCRAM exchange runs
        self.user = None
        self.unknown_user = False  # the SCRAM exchange runs on a made-up credential
        self.token_error = None  # why the token was refused, until the client's ^A
        self.expires_at = None  # the token's exp (epoch seconds)
        self.session_ms = 0  # KIP-368: the session lifetime the answer gives


class _AuthenticationFailed(Exception):
    """The text names the user and the reason (the log); ``client_message``
    is what the client is told, when not Kafka's usual words."""

    def __init__(self, reason, client_message=None):
        super().__init__(reason)
        self.client_message = client_message


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
    authenticates_clients = True

    mode = "terminate"

    options_title = ("OAUTHBEARER and re-authentication (terminate mode; Kafka's "
                     "sasl.oauthbearer.* and connections.max.reauth.ms)")
    options = (
        Option("sasl-oauthbearer-jwks-endpoint-url", metavar="URL",
               help="where the keys OAUTHBEARER tokens are signed with are read (a JWKS): an "
               "https:// URL (its certificate checked against the system's CA bundle, or the "
               "file the environment variable SSL_CERT_FILE names) or a file:// URL; needed "
               "when --sasl-enabled-mechanisms has OAUTHBEARER"),
        Option("sasl-oauthbearer-jwks-endpoint-refresh-ms", INTEGER, default=3_600_000,
               metavar="MS", help="how often the JWKS is read again (default 3600000); also "
               "at once when a token names a key id it does not hold"),
        Option("sasl-oauthbearer-expected-audience", NAMES, default=[], metavar="LIST",
               help="comma-separated audiences; a token's aud must name one of them "
               "(default: aud not checked)"),
        Option("sasl-oauthbearer-expected-issuer", metavar="ISS",
               help="a token's iss must be this (default: iss not checked)"),
        Option("sasl-oauthbearer-clock-skew-seconds", INTEGER, default=30, metavar="S",
               help="clock difference allowed with the token issuer's (default 30)"),
        Option("sasl-oauthbearer-sub-claim-name", default="sub", metavar="NAME",
               help="the token claim that names the principal (default sub); also read in "
               "sasl-mode passthrough"),
        Option("sasl-oauthbearer-scope-claim-name", default="scope", metavar="NAME",
               help="the token claim that lists its scopes (default scope), logged"),
        Option("connections-max-reauth-ms", INTEGER, default=0, metavar="MS",
               help="KIP-368: a client's session lasts this long (for OAUTHBEARER no longer "
               "than its token), after which the connection is closed unless the client has "
               "re-authenticated, as the same principal (default 0: sessions do not expire, "
               "and a second SASL exchange closes the connection)"),
    )

    @classmethod
    def arguments(cls, config, services):
        return {"reauth_ms": config.connections_max_reauth_ms,
                "token_settings": token_settings(config), "jwks": services.jwks,
                "credentials": services.credentials, "offload": services.offload,
                "api_versions": services.api_versions}

    @classmethod
    def check(cls, config):
        if config.connections_max_reauth_ms < 0:
            raise ConfigError("connections-max-reauth-ms must not be negative, got %r"
                              % config.connections_max_reauth_ms)
        if config.sasl_oauthbearer_clock_skew_seconds < 0:
            raise ConfigError("sasl-oauthbearer-clock-skew-seconds must not be negative")
        if config.sasl_oauthbearer_jwks_endpoint_refresh_ms <= 0:
            raise ConfigError("sasl-oauthbearer-jwks-endpoint-refresh-ms must be positive")
        if not (config.sasl_enabled and config.sasl_mode == cls.mode
                and OAUTHBEARER in config.sasl_enabled_mechanisms):
            return
        url = config.sasl_oauthbearer_jwks_endpoint_url
        if not url:
            raise ConfigError("sasl-enabled-mechanisms OAUTHBEARER in terminate mode needs "
                              "--sasl-oauthbearer-jwks-endpoint-url (https:// or file://)")
        if not url.startswith(("https://", "file://")):
            raise ConfigError("sasl-oauthbearer-jwks-endpoint-url must be an https:// or "
                              "file:// URL, got %r" % url)

    def __init__(self, mechanisms, credentials,
                 failed_delay_ms=DEFAULT_FAILED_AUTHENTICATION_DELAY_MS, offload=_inline,
                 api_versions=None, reauth_ms=0, token_settings=None, jwks=None,
                 clock=time.time):
        """``credentials()`` returns the current credentials snapshot (an
        object with ``scram(mechanism, user)`` and ``check_plain(user,
        password)``; sources replace it live). ``offload(fn, *args)`` runs a
        key derivation and returns its result or an awaitable of it.
        ``api_versions`` has ``current`` (the broker's version ranges, or
        None while unknown) and ``fetch()`` (an awaitable of them)."""
        super().__init__(mechanisms, failed_delay_ms)
        if OAUTHBEARER in self.mechanisms and jwks is None:
            raise ValueError("OAUTHBEARER needs the JWKS keys "
                             "(--sasl-oauthbearer-jwks-endpoint-url)")
        self.credentials = credentials
        self.offload = offload
        self.api_versions = api_versions
        self.reauth_ms = reauth_ms  # KIP-368's connections.max.reauth.ms; 0: off
        self.token_settings = token_settings or oauthbearer.TokenSettings()
        self.jwks = jwks  # sources.jwks.JwksKeys: get(kid), may_refresh(), refresh_for(kid)
        self.clock = clock  # epoch seconds, for token times

    def new_state(self):
        return _State()

    def on_accept(self, ctx):
        ctx.begin_authentication()

    def on_request(self, ctx, head, inflight):
        api_key = head.api_key
        if not ctx.authenticating:
            if not self.reauth_ms:
                # KIP-368 re-authentication is off: the principal is fixed
                return Refuse("SASL request (api key %d) on an authenticated connection "
                              "(re-authentication is off: --connections-max-reauth-ms)" % api_key)
            if api_key == SASL_HANDSHAKE:
                return self._reauth_handshake(ctx, head)
            return self._authenticate(ctx, head)
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

    def _reauth_handshake(self, ctx, head):
        """KIP-368: a new exchange on an authenticated connection, answered in
        its turn among the broker's answers; v1 only, the same mechanism."""
        state = ctx.state
        if head.api_version == 0:
            return Refuse("SaslHandshake v0 on an authenticated connection (re-authentication "
                          "needs v1)")
        if head.api_version > SaslHandshakeRequest.max_version:
            return Refuse("SaslHandshake v%d is newer than the proxy knows" % head.api_version)
        mechanism = decode(SaslHandshakeRequest, head.buf[4:], version=head.api_version,
                           header=True).mechanism
        if mechanism != state.original:
            answer = self._handshake_answer(head, UNSUPPORTED_SASL_MECHANISM)
            self.failed(ctx, "re-authentication with %r, not the connection's mechanism %s"
                        % (mechanism, state.original))
            return Answer(answer)
        state.restart()
        return self._handshake(ctx, head)

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
        if state.mechanism is None or not state.handshake_version:
            reason = "SaslAuthenticate before SaslHandshake v1"
            self.failed(ctx, reason)
            return Answer(_authenticate_answer(correlation_id, version, ILLEGAL_SASL_STATE,
                                               reason, b""))
        request = decode(SaslAuthenticateRequest, head.buf[4:], version=version, header=True)

        def answer(ctx, reply, exc):
            if exc is None:
                return _authenticate_answer(correlation_id, version, 0, None, reply,
                                            state.session_ms)
            self.failed(ctx, str(exc))
            return _authenticate_answer(correlation_id, version, SASL_AUTHENTICATION_FAILED,
                                        exc.client_message or FAILED % state.mechanism, b"")

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
        mechanism = ctx.state.mechanism
        if mechanism == "PLAIN":
            return self._plain(ctx, token, answer)
        if mechanism == OAUTHBEARER:
            return self._oauthbearer(ctx, token, answer)
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
                try:
                    self._authenticated(ctx, user)
                except _AuthenticationFailed as exc:
                    return answer(ctx, None, exc)
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

    def _oauthbearer(self, ctx, token, answer):
        """RFC 7628's client first message; or, after the error challenge,
        the client's ^A, answered with the failure."""
        state = ctx.state
        if state.token_error is not None:
            reason, state.token_error = state.token_error, None
            return Answer(answer(ctx, None, _AuthenticationFailed(
                reason, oauthbearer.INVALID_TOKEN.decode("ascii"))))
        try:
            authzid, jwt_token, _extensions = oauthbearer.parse_client_first(token)
            kid = oauthbearer.token_kid(jwt_token)
        except oauthbearer.InvalidMessage as exc:
            return Answer(answer(ctx, None, _AuthenticationFailed(str(exc))))
        except oauthbearer.InvalidToken as exc:
            return Answer(self._token_refused(ctx, str(exc), answer))
        if self.jwks.get(kid) is None and self.jwks.may_refresh():
            # a key rotated in: read the JWKS again (off the loop's path) first
            return Pending(partial(self.jwks.refresh_for, kid), lambda ctx, _, __: (
                self._check_token(ctx, authzid, jwt_token, kid, answer)))
        return Answer(self._check_token(ctx, authzid, jwt_token, kid, answer))

    def _check_token(self, ctx, authzid, jwt_token, kid, answer):
        found = self.jwks.get(kid)
        if found is None:
            return self._token_refused(ctx, "unknown kid %r: no such key in the JWKS at %s"
                                       % (kid, self.jwks.url), answer)
        key, algorithms = found
        try:
            token = oauthbearer.validate(jwt_token, key, self.clock(), self.token_settings,
                                         algorithms)
        except oauthbearer.InvalidToken as exc:
            return self._token_refused(ctx, str(exc), answer)
        if authzid and authzid != token.principal:
            return answer(ctx, None, _AuthenticationFailed(
                "OAUTHBEARER login for %r: the authorization id differs from the token's "
                "principal" % token.principal,
                "Authentication failed: Client requested an authorization id that is "
                "different from the token's principal name"))
        state = ctx.state
        state.expires_at = token.expires_at
        try:
            self._authenticated(ctx, token.principal)
        except _AuthenticationFailed as exc:
            return answer(ctx, None, exc)
        if token.scopes:
            log.debug("token of %r: scopes %s", token.principal, " ".join(token.scopes))
        return answer(ctx, b"", None)

    def _token_refused(self, ctx, reason, answer):
        """Kafka's error challenge; the failure itself follows the client's ^A."""
        reason = "OAUTHBEARER token refused: %s" % reason
        log.info("%s", reason)
        ctx.state.token_error = reason
        return answer(ctx, oauthbearer.INVALID_TOKEN, None)

    def _authenticated(self, ctx, user):
        state = ctx.state
        state.scram = None
        lifetime_ms = self.reauth_ms
        if lifetime_ms and state.expires_at is not None:  # no longer than the token
            lifetime_ms = max(0, min(lifetime_ms,
                                     int((state.expires_at - self.clock()) * 1000)))
        if not ctx.authenticating:  # KIP-368 re-authentication
            if user != ctx.principal:
                raise _AuthenticationFailed(
                    "re-authentication as %r on a connection authenticated as %r: a "
                    "connection cannot change principals" % (user, ctx.principal))
            log.debug("client re-authenticated as %r with %s", user, state.mechanism)
        else:
            log.info("client authenticated as %r with %s", user, state.mechanism)
            state.original = state.mechanism
            ctx.authenticated(user)
        self.count_login(state.mechanism, True)
        state.handshake_version = None  # the exchange is over: a new one starts with a handshake
        if lifetime_ms:
            state.session_ms = lifetime_ms
            ctx.set_session_deadline(ctx.now + lifetime_ms / 1000.0)


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


def token_settings(config):
    """The validator's settings from the configuration."""
    return oauthbearer.TokenSettings(
        expected_audience=config.sasl_oauthbearer_expected_audience,
        expected_issuer=config.sasl_oauthbearer_expected_issuer,
        clock_skew_seconds=config.sasl_oauthbearer_clock_skew_seconds,
        sub_claim_name=config.sasl_oauthbearer_sub_claim_name,
        scope_claim_name=config.sasl_oauthbearer_scope_claim_name)


def _authenticate_answer(correlation_id, version, error_code, message, auth_bytes,
                         session_lifetime_ms=0):
    response = SaslAuthenticateResponse[version](
        error_code=error_code, error_message=message, auth_bytes=auth_bytes,
        session_lifetime_ms=session_lifetime_ms)
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))
