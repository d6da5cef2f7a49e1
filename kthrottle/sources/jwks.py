"""The keys OAUTHBEARER tokens are checked against: a JWKS (RFC 7517) read
from Kafka's sasl.oauthbearer.jwks.endpoint.url, an ``https://`` or a
``file://`` URL, and kept in memory so a token is checked at once.

Fetched on the event loop (https: aiohttp; file: read in a worker thread),
again every ``refresh_ms`` (Kafka's sasl.oauthbearer.jwks.endpoint.refresh.ms)
and as soon as a token names a key id the set does not hold (a rotation),
but not more often than every UNKNOWN_KID_REFRESH_INTERVAL seconds: a flood
of made-up key ids costs the endpoint one fetch per interval, and every
token waiting for that fetch shares it. A fetch that fails keeps the keys
already known, with a WARNING.
"""
import asyncio
import json
import logging
import ssl
import time
from urllib.parse import unquote, urlparse

from . import HttpFollower, QuotaStoreError

log = logging.getLogger("kthrottle.auth")

DEFAULT_REFRESH_MS = 3_600_000  # Kafka's sasl.oauthbearer.jwks.endpoint.refresh.ms
UNKNOWN_KID_REFRESH_INTERVAL = 2.0  # seconds between fetches asked for by unknown kids
MAX_JWKS_SIZE = 1 << 20  # a key set is a few KiB
RETRY_AFTER_FAILURE = 30.0  # seconds: a failed periodic fetch is tried again this soon


class JwksError(Exception):
    pass


def parse_jwks(text):
    """{kid: (PyJWK, algorithms)} from a JWKS document. Keys PyJWT cannot
    use (unknown types, private-only fields missing) are left out with a
    WARNING; a document with no usable key is a JwksError."""
    import jwt

    from ..policy.oauthbearer import algorithms_for

    try:
        document = json.loads(text)
    except ValueError as exc:
        raise JwksError("not JSON: %s" % exc) from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise JwksError("no \"keys\" list")
    keys = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key
        try:
            key = jwt.PyJWK(entry)
        except jwt.PyJWTError as exc:
            log.warning("JWKS: key %r left out: %s", entry.get("kid"), exc)
            continue
        keys[entry.get("kid")] = (key, algorithms_for(entry))
    if not keys:
        raise JwksError("no usable signing key")
    return keys


class JwksKeys(HttpFollower):
    """The key set, followed. ``get(kid)`` is synchronous (the request
    path); ``refresh_for(kid)`` an awaitable that fetches now unless a fetch
    for an unknown kid ran in the last UNKNOWN_KID_REFRESH_INTERVAL."""

    def __init__(self, url, refresh_ms=DEFAULT_REFRESH_MS, ssl_context=None,
                 clock=time.monotonic):
        parsed = urlparse(url)
        if parsed.scheme not in ("https", "file"):
            raise ValueError("sasl-oauthbearer-jwks-endpoint-url must be an https:// or file:// "
                             "URL, got %r" % url)
        self.url = url
        self._path = unquote(parsed.path) if parsed.scheme == "file" else None
        self.refresh = refresh_ms / 1000.0
        self._ssl = ssl_context
        self._clock = clock
        self.keys = {}
        self.fetches = 0
        self.failures = 0
        self._task = None
        self._fetching = None  # the fetch in flight (a future), shared
        self._last_forced = None  # when an unknown kid last caused a fetch
        self._session = None  # aiohttp's (_http)

    @property
    def describe(self):
        return "the JWKS at %s" % self.url

    def get(self, kid):
        """(PyJWK, algorithms) for ``kid``, or None. A token without a kid
        is checked against the one key of a one-key set."""
        found = self.keys.get(kid)
        if found is None and kid is None and len(self.keys) == 1:
            found = next(iter(self.keys.values()))
        return found

    def may_refresh(self):
        """Whether an unknown kid may cause a fetch now (or join one)."""
        if self._fetching is not None:
            return True
        last = self._last_forced
        return last is None or self._clock() - last >= UNKNOWN_KID_REFRESH_INTERVAL

    async def refresh_for(self, kid):
        """Fetch now for an unknown ``kid`` (rate-limited, shared); True when
        the set then holds it."""
        if self._fetching is None:
            if not self.may_refresh():
                return self.get(kid) is not None
            self._last_forced = self._clock()
            log.info("JWKS: a token names key id %r, not in the set: fetching %s", kid, self.url)
        try:
            await self._fetch_shared()
        except JwksError:
            pass  # said by _fetch_shared; the token is refused as naming an unknown key
        return self.get(kid) is not None

    async def start(self, on_update=None):
        """The first fetch (its failure is the proxy's start error), then
        one every ``refresh``."""
        try:
            await self._fetch_shared()
        except JwksError as exc:
            raise QuotaStoreError("cannot read the JWKS at %s: %s" % (self.url, exc)) from None
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def reload(self):
        """SIGHUP: fetched now."""
        try:
            await self._fetch_shared()
        except JwksError:
            pass

    async def _follow(self):
        delay = self.refresh
        while True:
            await asyncio.sleep(delay)
            try:
                await self._fetch_shared()
                delay = self.refresh
            except JwksError:
                delay = min(self.refresh, RETRY_AFTER_FAILURE)

    def _fetch_shared(self):
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
            self._fetching.add_done_callback(self._fetched)
        return asyncio.shield(self._fetching)

    def _fetched(self, future):
        self._fetching = None
        if not future.cancelled():
            future.exception()  # retrieved: each waiter has its own copy

    async def _fetch(self):
        self.fetches += 1
        try:
            text = await self._read()
            keys = parse_jwks(text)
        except (JwksError, OSError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            self.failures += 1
            reason = str(exc) or exc.__class__.__name__
            if self.keys:
                log.warning("JWKS: cannot refresh %s (%s); the %d keys known stay in use",
                            self.url, reason, len(self.keys))
            raise JwksError(reason) from None
        except Exception as exc:  # aiohttp's errors
            self.failures += 1
            if self.keys:
                log.warning("JWKS: cannot refresh %s (%s); the %d keys known stay in use",
                            self.url, exc, len(self.keys))
            raise JwksError(str(exc) or exc.__class__.__name__) from None
        if set(keys) != set(self.keys):
            log.info("JWKS: %d keys from %s (key ids: %s)", len(keys), self.url,
                     ", ".join(sorted(str(k) for k in keys)))
        self.keys = keys

    async def _read(self):
        if self._path is not None:
            return await asyncio.to_thread(_read_file, self._path)
        context = self._ssl if self._ssl is not None else ssl.create_default_context()
        async with self._http().get(self.url, ssl=context,
                                    headers={"Accept": "application/json"}) as response:
            if response.status != 200:
                raise JwksError("HTTP %d" % response.status)
            body = await response.content.read(MAX_JWKS_SIZE + 1)
            if len(body) > MAX_JWKS_SIZE:
                raise JwksError("larger than %d bytes" % MAX_JWKS_SIZE)
            return body.decode("utf-8")


def _read_file(path):
    with open(path, "rb") as f:
        body = f.read(MAX_JWKS_SIZE + 1)
    if len(body) > MAX_JWKS_SIZE:
        raise JwksError("larger than %d bytes" % MAX_JWKS_SIZE)
    return body.decode("utf-8")
