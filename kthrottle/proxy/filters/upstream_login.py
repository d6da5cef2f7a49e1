"""The proxy's own SASL login on each broker connection."""
import base64
import hashlib
import hmac
import logging

from ...options import ConfigError, Option
from ...policy import oauthbearer
from ..filter import Filter
from .sasl import (
    MECHANISMS,
    OAUTHBEARER,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
    decode,
)

log = logging.getLogger("kthrottle.auth")


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

    options_title = ("the proxy's own OAUTHBEARER login to the brokers "
                     "(--upstream-sasl-mechanism OAUTHBEARER; KIP-768's client credentials)")
    options = (
        Option("upstream-sasl-oauthbearer-token-endpoint-url", metavar="URL",
               help="the OAuth 2 token endpoint the proxy gets its token from (client "
               "credentials grant), refreshed at 80%% of its lifetime"),
        Option("upstream-sasl-oauthbearer-client-id", metavar="ID",
               help="the proxy's client id at the token endpoint"),
        Option("upstream-sasl-oauthbearer-client-secret-file", metavar="PATH",
               help="file holding its client secret, one line (else the environment variable "
               "KTHROTTLE_UPSTREAM_CLIENT_SECRET; never a flag)"),
        Option("upstream-sasl-oauthbearer-scope", metavar="SCOPE",
               help="the scope asked for (default: none)"),
    )

    @classmethod
    def check(cls, config):
        protocol = config.upstream_security_protocol or "PLAINTEXT"
        if (not protocol.startswith("SASL_") or config.sasl_mode == "passthrough"
                or config.upstream_sasl_mechanism != OAUTHBEARER):
            return
        if not config.upstream_sasl_oauthbearer_token_endpoint_url:
            raise ConfigError("upstream-sasl-mechanism OAUTHBEARER needs "
                              "--upstream-sasl-oauthbearer-token-endpoint-url")
        if not config.upstream_sasl_oauthbearer_token_endpoint_url.startswith(
                ("https://", "http://")):
            raise ConfigError("upstream-sasl-oauthbearer-token-endpoint-url must be an https:// "
                              "(or http://) URL")
        if not config.upstream_sasl_oauthbearer_client_id:
            raise ConfigError("upstream-sasl-mechanism OAUTHBEARER needs "
                              "--upstream-sasl-oauthbearer-client-id")

    def __init__(self, mechanism, username, password, token=None):
        if mechanism == OAUTHBEARER:
            if token is None:
                raise ValueError("an upstream OAUTHBEARER login needs its token source")
        elif mechanism not in MECHANISMS:
            raise ValueError("upstream SASL mechanism must be one of %s, got %r"
                             % (", ".join(MECHANISMS), mechanism))
        self.mechanism = mechanism
        self.username = username
        self._password = password
        self.token = token  # OAUTHBEARER: sources.oauth_token's, ``current``
        self._keys = {}  # (salt, iterations) -> (client key, server key)

    reads = ("upstream_security_protocol", "sasl_mode", "upstream_sasl_mechanism",
             "upstream_sasl_username", "upstream_sasl_password")

    @classmethod
    def build(cls, config, services):
        """Towards brokers that require SASL, in terminate mode (in
        passthrough mode the client's own exchange logs the connection in)."""
        protocol = config.upstream_security_protocol or "PLAINTEXT"
        if not protocol.startswith("SASL_") or config.sasl_mode == "passthrough":
            return None
        if config.upstream_sasl_mechanism == OAUTHBEARER:
            return cls(OAUTHBEARER, config.upstream_sasl_oauthbearer_client_id, None,
                       services.upstream_token)
        return cls(config.upstream_sasl_mechanism, config.upstream_sasl_username,
                   config.upstream_sasl_password())

    def __repr__(self):  # never the password
        return "UpstreamSaslLogin(%s, %r)" % (self.mechanism, self.username)

    def new_state(self):
        return []  # the SCRAM exchange while it runs: [client, server signature expected]

    def on_upstream(self, ctx):
        request = SaslHandshakeRequest[1](mechanism=self.mechanism)
        request.with_header(correlation_id=0, client_id="kthrottle")
        ctx.send_request(bytes(request.encode(header=True, framed=True)), SASL_HANDSHAKE, 1,
                         self._handshake_answered)
        return True

    def _send_token(self, ctx, token):
        request = SaslAuthenticateRequest[1](auth_bytes=token)
        request.with_header(correlation_id=0, client_id="kthrottle")
        ctx.send_request(bytes(request.encode(header=True, framed=True)), SASL_AUTHENTICATE, 1,
                         self._token_answered)

    def _handshake_answered(self, ctx, frame):
        answer = decode(SaslHandshakeResponse[1], frame[8:])
        if answer.error_code:
            ctx.upstream_ready(False, "the broker refused SASL mechanism %s (error %d; it offers "
                               "%s)" % (self.mechanism, answer.error_code,
                                        ", ".join(answer.mechanisms or ())))
            return
        if self.mechanism == "PLAIN":
            ctx.state[:] = ()
            self._send_token(ctx, ("\0%s\0%s" % (self.username, self._password)).encode("utf-8"))
            return
        if self.mechanism == OAUTHBEARER:
            token = self.token.current
            if token is None:
                ctx.upstream_ready(False, "the proxy has no valid OAUTHBEARER token (from %s) to "
                                   "log in to the broker with" % self.token.url)
                return
            ctx.state[:] = ()
            self._send_token(ctx, oauthbearer.client_first(token))
            return
        from scramp import ScramClient

        client = ScramClient([self.mechanism], self.username, self._password)
        ctx.state[:] = [client, None]  # then the server signature expected
        self._send_token(ctx, client.get_client_first().encode("utf-8"))

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

    def _token_answered(self, ctx, frame):
        from scramp import ScramException

        answer = decode(SaslAuthenticateResponse[1], frame[8:])
        if answer.error_code:
            ctx.upstream_ready(False, "the broker refused the proxy's %s login as %r: %s"
                               % (self.mechanism, self.username, answer.error_message))
            return
        if self.mechanism == OAUTHBEARER and answer.auth_bytes:
            # RFC 7628's error challenge: the broker refused the token
            ctx.upstream_ready(False, "the broker refused the proxy's OAUTHBEARER token: %s"
                               % bytes(answer.auth_bytes).decode("utf-8", "replace")[:200])
            return
        state = ctx.state  # empty for PLAIN (one round), else [client, signature]
        if state:
            client, expected = state
            try:
                message = bytes(answer.auth_bytes).decode("utf-8")
                if expected is None:
                    client.set_server_first(message)
                    final, state[1] = self._client_final(client)
                    self._send_token(ctx, final.encode("utf-8"))
                    return
                if not message.startswith("v="):
                    raise ValueError("the broker's final message is %r" % message[:40])
                if not hmac.compare_digest(base64.b64decode(message[2:].split(",")[0]),
                                           expected):
                    raise ValueError("the broker's signature is wrong")
            except (ScramException, UnicodeDecodeError, ValueError) as exc:
                ctx.upstream_ready(False, "the broker's %s answer did not verify: %s"
                                   % (self.mechanism, exc))
                return
        state.clear()
        log.debug("logged in to the broker as %r with %s", self.username, self.mechanism)
        ctx.upstream_ready()
