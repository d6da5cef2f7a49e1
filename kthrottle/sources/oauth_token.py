"""The proxy's own OAUTHBEARER token towards the brokers: OAuth 2's client
credentials grant (RFC 6749 section 4.4) against a token endpoint, as Kafka's
login callback handler does it (KIP-768: sasl.oauthbearer.token.endpoint.url,
the client id and secret sent with HTTP Basic, an optional scope).

Fetched on the event loop (aiohttp) at start and again at 80% of the token's
lifetime (Kafka's sasl.login.refresh.window.factor); a failed fetch is tried
again with a growing backoff and a WARNING, and the last token stays in use
until it expires. ``current`` is read synchronously by the login filter.
"""
import asyncio
import base64
import logging
import ssl
import time
from urllib.parse import quote

from . import HttpFollower

log = logging.getLogger("kthrottle.auth")

REFRESH_WINDOW_FACTOR = 0.8  # Kafka's sasl.login.refresh.window.factor
RETRY_BACKOFF_MIN = 0.1  # seconds: Kafka's sasl.login.retry.backoff.ms
RETRY_BACKOFF_MAX = 10.0  # sasl.login.retry.backoff.max.ms
DEFAULT_LIFETIME = 3600.0  # a grant that names no expiry


class TokenError(Exception):
    pass


class ClientCredentialsToken(HttpFollower):
    def __init__(self, url, client_id, client_secret, scope=None, clock=time.time):
        self.url = url
        self.client_id = client_id
        self._secret = client_secret
        self.scope = scope
        self._clock = clock
        self.token = None
        self.expires_at = 0.0  # epoch seconds
        self.fetches = 0
        self.failures = 0
        self._task = None
        self._session = None  # aiohttp's (_http)

    def __repr__(self):  # never the secret nor the token
        return "ClientCredentialsToken(%r, %r)" % (self.url, self.client_id)

    @classmethod
    def from_config(cls, config):
        from .. import security

        secret = security.read_sasl_password(
            config.upstream_sasl_oauthbearer_client_secret_file, "KTHROTTLE_UPSTREAM_CLIENT_SECRET",
            "--upstream-sasl-oauthbearer-client-secret-file", "OAUTHBEARER")
        return cls(config.upstream_sasl_oauthbearer_token_endpoint_url,
                   config.upstream_sasl_oauthbearer_client_id, secret,
                   config.upstream_sasl_oauthbearer_scope)

    @property
    def current(self):
        """The token while it is valid, else None."""
        if self.token is None or self._clock() >= self.expires_at:
            return None
        return self.token

    async def start(self):
        """The first token, then refreshed; the proxy starts even when the
        endpoint is down (a WARNING, retried), its broker logins failing
        with the reason until a token comes."""
        try:
            await self._fetch()
        except TokenError as exc:
            log.warning("OAUTHBEARER: no token from %s yet (%s); retrying", self.url, exc)
        self._task = asyncio.get_running_loop().create_task(self._follow())

    def _refresh_in(self):
        now = self._clock()
        if self.token is None:
            return 0.0
        issued = getattr(self, "_issued_at", now)
        return max(0.0, issued + (self.expires_at - issued) * REFRESH_WINDOW_FACTOR - now)

    async def _follow(self):
        backoff = RETRY_BACKOFF_MIN
        delay = self._refresh_in() if self.token is not None else backoff
        while True:
            await asyncio.sleep(delay)
            try:
                await self._fetch()
                backoff = RETRY_BACKOFF_MIN
                delay = self._refresh_in()
            except TokenError as exc:
                left = self.expires_at - self._clock()
                if self.token is not None and left > 0:
                    log.warning("OAUTHBEARER: cannot refresh the token from %s (%s); the "
                                "current one is used until it expires in %.0f s",
                                self.url, exc, left)
                else:
                    log.warning("OAUTHBEARER: cannot get a token from %s (%s); the proxy "
                                "cannot log in to the brokers", self.url, exc)
                delay = backoff
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)

    async def _fetch(self):
        from ..policy.oauthbearer import unverified_expiry

        self.fetches += 1
        session = self._http()
        basic = base64.b64encode(("%s:%s" % (quote(self.client_id, safe=""),
                                             quote(self._secret, safe=""))).encode("utf-8"))
        form = {"grant_type": "client_credentials"}
        if self.scope:
            form["scope"] = self.scope
        try:
            async with session.post(
                    self.url, data=form, ssl=ssl.create_default_context()
                    if self.url.startswith("https://") else None,
                    headers={"Authorization": "Basic " + basic.decode("ascii"),
                             "Accept": "application/json"}) as response:
                if response.status != 200:
                    raise TokenError("HTTP %d" % response.status)
                body = await response.json(content_type=None)
        except TokenError:
            self.failures += 1
            raise
        except Exception as exc:  # aiohttp's and JSON's errors
            self.failures += 1
            raise TokenError(str(exc) or exc.__class__.__name__) from None
        token = body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            self.failures += 1
            raise TokenError("the answer has no access_token")
        now = self._clock()
        expires_at = unverified_expiry(token)
        if expires_at is None:
            lifetime = body.get("expires_in")
            expires_at = now + (float(lifetime) if isinstance(lifetime, (int, float))
                                else DEFAULT_LIFETIME)
        if expires_at <= now:
            self.failures += 1
            raise TokenError("the token granted has already expired")
        first = self.token is None
        self.token, self.expires_at, self._issued_at = token, float(expires_at), now
        (log.info if first else log.debug)(
            "OAUTHBEARER: token for %r from %s, valid for %.0f s", self.client_id, self.url,
            expires_at - now)
