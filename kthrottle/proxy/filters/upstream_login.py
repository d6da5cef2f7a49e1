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
UPSTREAM_IDENTITIES = ("proxy", "delegation-token")
TOKEN_MECHANISM = "SCRAM-SHA-512"  # a token login's, when the proxy's own is not SCRAM


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
        Option("upstream-identity", default="proxy", choices=UPSTREAM_IDENTITIES,
               help="as whom a client's broker connections log in (terminate mode towards "
               "SASL brokers): proxy (default), the proxy's own principal; or "
               "delegation-token, the client's own principal, with a delegation token the "
               "proxy creates for it (KIP-48, KIP-373: Kafka 3.3 and later, "
               "delegation.token.secret.key set, the proxy's principal allowed CreateTokens "
               "on the users) and makes anew before it expires: the brokers' ACLs, quotas "
               "and logs then see each client"),
    )

    @classmethod
    def check(cls, config):
        protocol = config.upstream_security_protocol or "PLAINTEXT"
        if config.upstream_identity == "delegation-token" and (
                not protocol.startswith("SASL_") or config.sasl_mode == "passthrough"):
            raise ConfigError("upstream-identity delegation-token needs a SASL upstream "
                              "(--upstream-security-protocol SASL_PLAINTEXT or SASL_SSL) in "
                              "sasl-mode terminate: the proxy logs each broker connection in "
                              "with the client's token")
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

    def __init__(self, mechanism, username, password, token=None, tokens=None):
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
        # --upstream-identity delegation-token: sources.delegation_tokens.DelegationTokens
        self.tokens = tokens
        self.token_mechanism = mechanism if mechanism in _HASHES else TOKEN_MECHANISM
        self._keys = {}  # (password, salt, iterations) -> (client key, server key)

    reads = ("upstream_security_protocol", "sasl_mode", "upstream_sasl_mechanism",
             "upstream_sasl_username", "upstream_sasl_password")

    @classmethod
    def build(cls, config, services):
        """Towards brokers that require SASL, in terminate mode (in
        passthrough mode the client's own exchange logs the connection in)."""
        protocol = config.upstream_security_protocol or "PLAINTEXT"
        if not protocol.startswith("SASL_") or config.sasl_mode == "passthrough":
            return None
        tokens = services.tokens if config.upstream_identity == "delegation-token" else None
        if config.upstream_sasl_mechanism == OAUTHBEARER:
            return cls(OAUTHBEARER, config.upstream_sasl_oauthbearer_client_id, None,
                       services.upstream_token, tokens)
        return cls(config.upstream_sasl_mechanism, config.upstream_sasl_username,
                   config.upstream_sasl_password(), tokens=tokens)

    def __repr__(self):  # never the password
        return "UpstreamSaslLogin(%s, %r)" % (self.mechanism, self.username)

    def new_state(self):
        return []  # the SCRAM exchange while it runs: [client, server signature expected]

    def on_upstream(self, ctx):
        if self.tokens is not None:  # as the client: with its delegation token
            token = self.tokens.current(ctx.principal)
            if token is not None:
                self._handshake(ctx, self.token_mechanism, self._token_ready)
                ctx.state[:] = [None, None, token]
            else:
                ctx.run_job(lambda: self.tokens.get(ctx.principal), self._token_made)
            return True
        self._handshake(ctx, self.mechanism, self._handshake_answered)
        return True

    def _handshake(self, ctx, mechanism, answered):
        request = SaslHandshakeRequest[1](mechanism=mechanism)
        request.with_header(correlation_id=0, client_id="kthrottle")
        ctx.send_request(bytes(request.encode(header=True, framed=True)), SASL_HANDSHAKE, 1,
                         answered)

    def _token_made(self, ctx, token, error):
        if error is not None:
            ctx.upstream_ready(False, str(error))
            return
        ctx.state[:] = [None, None, token]
        self._handshake(ctx, self.token_mechanism, self._token_ready)

    def _token_ready(self, ctx, frame):
        """SaslHandshake answered for a token login: SCRAM with the token's
        id and HMAC and the tokenauth extension (KIP-48)."""
        from scramp import ScramClient

        answer = decode(SaslHandshakeResponse[1], frame[8:])
        if answer.error_code:
            ctx.upstream_ready(False, "the broker refused SASL mechanism %s for delegation "
                               "tokens (error %d; it offers %s)" % (
                                   self.token_mechanism, answer.error_code,
                                   ", ".join(answer.mechanisms or ())))
            return
        token = ctx.state[2]
        client = ScramClient([self.token_mechanism], token.token_id, token.password)
        first = client.get_client_first() + ",tokenauth=true"
        ctx.state[:] = [client, None, token, client.client_first_bare + ",tokenauth=true"]
        self._send_token(ctx, first.encode("utf-8"))


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

    def _client_final(self, client, mechanism=None, password=None, first_bare=None):
        """The client-final message and the server signature expected, with
        the salted password derived once per (password, salt, iterations)."""
        from scramp.utils import saslprep

        digest = _HASHES[mechanism or self.mechanism]
        password = self._password if password is None else password
        salt, iterations = bytes(client.salt), int(client.iterations)
        keys = self._keys.get((password, salt, iterations))
        if keys is None:
            salted = hashlib.pbkdf2_hmac(digest().name, saslprep(password).encode("utf-8"),
                                         salt, iterations)
            keys = (hmac.digest(salted, b"Client Key", digest),
                    hmac.digest(salted, b"Server Key", digest))
            if len(self._keys) >= self.KEYS_KEPT:
                self._keys.clear()
            self._keys[password, salt, iterations] = keys
        client_key, server_key = keys
        without_proof = "c=biws,r=%s" % client.nonce  # biws: "n,,", no channel binding
        auth_message = ("%s,%s,%s" % (first_bare or client.client_first_bare,
                                      client.server_first, without_proof)).encode("utf-8")
        stored_key = digest(client_key).digest()
        signature = hmac.digest(stored_key, auth_message, digest)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        final = "%s,p=%s" % (without_proof, base64.b64encode(proof).decode("ascii"))
        return final, hmac.digest(server_key, auth_message, digest)

    def _token_answered(self, ctx, frame):
        from scramp import ScramException

        answer = decode(SaslAuthenticateResponse[1], frame[8:])
        if answer.error_code:
            if len(ctx.state) > 2:
                token = ctx.state[2]
                self.tokens.forget(token)  # expired or deleted: the next connection makes one
                ctx.upstream_ready(False, "the broker refused the delegation token %s of User:%s: "
                                   "%s" % (token.token_id, token.owner, answer.error_message))
                return
            ctx.upstream_ready(False, "the broker refused the proxy's %s login as %r: %s"
                               % (self.mechanism, self.username, answer.error_message))
            return
        if self.mechanism == OAUTHBEARER and answer.auth_bytes:
            # RFC 7628's error challenge: the broker refused the token
            ctx.upstream_ready(False, "the broker refused the proxy's OAUTHBEARER token: %s"
                               % bytes(answer.auth_bytes).decode("utf-8", "replace")[:200])
            return
        # empty for PLAIN (one round), else [client, signature expected], and for a
        # delegation token's login [client, signature, token, client-first bare]
        state = ctx.state
        if state:
            client, expected = state[0], state[1]
            try:
                message = bytes(answer.auth_bytes).decode("utf-8")
                if expected is None:
                    client.set_server_first(message)
                    if len(state) > 2:
                        final, state[1] = self._client_final(
                            client, self.token_mechanism, state[2].password, state[3])
                    else:
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
        if len(state) > 2:
            log.debug("logged in to the broker as User:%s with delegation token %s",
                      state[2].owner, state[2].token_id)
        else:
            log.debug("logged in to the broker as %r with %s", self.username, self.mechanism)
        state.clear()
        ctx.upstream_ready()
