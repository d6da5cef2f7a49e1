"""The proxy's listening ports, and whether the brokers behind them answer.

A client that connects straight to a broker that is down gets "connection
refused" at once, and its client library moves on (another broker, the
group's new coordinator). A proxy that accepts the connection and only then
finds no broker behind it looks up, then drops the client half-way through
its ApiVersions: clients treat that as a flaky broker and wait longer. So a
listener whose brokers do not answer stops listening while keeping its port
bound (a bound TCP socket that does not listen is answered with a reset:
"connection refused", as the broker's own port would be), probes the brokers
with TCP connections, and listens again as soon as one answers.

What reveals a broker is down: a client connection for which no broker
address answered (``unreachable``), or a broker connection lost under a
client (``check``: one probe, at once). Each change is logged once, at
WARNING, with how many client connections were turned away.

An idle proxy learns nothing from its clients, so ``BrokerContact`` asks a
bootstrap broker for its ApiVersions every few seconds (what /readyz and
kthrottle_broker_answer_age_seconds read), and says at WARNING, at start and
then once a minute while it lasts, that none answers.
"""
import asyncio
import logging
import socket

from ..sources import ended

log = logging.getLogger("kthrottle.proxy")

# /readyz: ready while a bootstrap broker answered within this many seconds
READY_WITHIN_SECONDS = 10.0
# How often the proxy asks a bootstrap broker itself: a few times within
# READY_WITHIN_SECONDS, so that one lost answer does not make it unready. One
# ApiVersions (a few hundred bytes; brokers answer it before authentication,
# KIP-511) every few seconds costs a broker nothing.
CONTACT_INTERVAL_SECONDS = 3.0
# While no bootstrap broker answers, a WARNING this often (and one at once)
STILL_DOWN_LOG_SECONDS = 60.0

LISTEN_BACKLOG = 1024
# Probes while the brokers are down: every 25 ms. A client retries a refused
# broker after its reconnect backoff (Kafka's Java client: reconnect.backoff.ms
# 50 ms growing to reconnect.backoff.max.ms 1 s), and a proxy that listened
# again later than that would add its delay to the client's recovery; a probe
# of a broker that is down costs one refused SYN.
PROBE_INTERVAL_SECONDS = 0.025
# A broker connection lost under a client is checked with one probe, at most
# this often while the brokers are thought up (a broker restart drops every
# connection at once: one probe, not one each).
CHECK_INTERVAL_SECONDS = 1.0
REFUSED_BROKER_UNREACHABLE = "broker_unreachable"


def bound_socket(host, port, listening=True, reuse_port=False):
    """A TCP socket bound to (host, port); listening, or only holding the
    port (connections to it are refused). ``reuse_port``: shared with the
    other worker processes (--workers), SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listening:
            sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, "%s:%d: %s" % (host, port, exc.strerror or exc)) from None
    return sock


class Listener(asyncio.AbstractServer):
    """One listening port of the proxy (the bootstrap one, or one per node
    id) and the broker addresses behind it (``route()``, tried in order).

    ``sock`` is the proxy's own bound socket: it listens while the brokers
    answer, and only holds the port while none does. The loop's server runs
    on a duplicate of it, so stopping that server never gives the port up.
    """

    def __init__(self, server, name, sock, route):
        self.server = server
        self.name = name
        self.route = route
        self.sock = sock
        self.address = sock.getsockname()[:2]
        self.reachable = True
        self.turned_away = 0  # client connections refused while the brokers were down
        self.down_since = None
        self._serving = None  # the loop's server, or the proxy's TLS acceptor
        self._probe = None
        self._checked_at = None
        self._closed = False

    @property
    def sockets(self):
        return [self.sock] if self.sock is not None else []

    async def start(self):
        self._serving = await self.server._serve(self.sock.dup(), self.name, self.route)

    def _brokers(self):
        return ",".join("%s:%s" % a for a in self.route()) or "no address known"

    # what connections report --------------------------------------------------

    def unreachable(self, errors):
        """A client connection found no broker answering: it is turned away,
        and the listener stops listening until one does."""
        self.turned_away += 1
        counts = self.server.refused
        counts[REFUSED_BROKER_UNREACHABLE] = counts.get(REFUSED_BROKER_UNREACHABLE, 0) + 1
        if self.reachable and not self._closed:  # closed: the proxy is stopping
            self._down(errors)

    def check(self):
        """A broker connection was lost under a client: is the broker gone?"""
        if not self.reachable or self._closed or self._probe is not None:
            return
        now = self.server.loop.time()
        if self._checked_at is not None and now - self._checked_at < CHECK_INTERVAL_SECONDS:
            return
        self._checked_at = now
        self._probe = self.server.loop.create_task(self._check_once())

    async def _check_once(self):
        try:
            errors = await self._probe_brokers()
            if errors is not None and self.reachable and not self._closed:
                self._down(errors, checked=True)
        finally:
            if self._probe is asyncio.current_task():
                self._probe = None
            if not self.reachable and not self._closed and self._probe is None:
                self._probe = self.server.loop.create_task(self._wait_for_brokers())

    # the two states -----------------------------------------------------------

    def _down(self, errors, checked=False):
        loop = self.server.loop
        self.reachable = False
        self.down_since = loop.time()
        self._stop_listening()
        log.warning(
            "%s listener: no broker answers (%s); %s:%s refuses connections, as the broker's "
            "own port would, until one does (%s)",
            self.name, "; ".join(errors) or self._brokers(), *self.address,
            "found when a broker connection was lost" if checked
            else "%d client connection(s) turned away" % self.turned_away)
        if self._probe is None:
            self._probe = loop.create_task(self._wait_for_brokers())

    def _stop_listening(self):
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.close()
        sock = self.sock
        host, port = self.address
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RD)  # the kernel refuses from now on
            except OSError:
                pass
            sock.close()
        try:
            self.sock = bound_socket(host, port, listening=False,
                                     reuse_port=self.server.reuse_port)
        except OSError as exc:  # taken meanwhile: bound again when the brokers answer
            self.sock = None
            log.error("%s listener: cannot hold %s:%d while the brokers are down: %s",
                      self.name, host, port, exc)

    async def _wait_for_brokers(self):
        try:
            while not self._closed:
                await asyncio.sleep(PROBE_INTERVAL_SECONDS)
                if await self._probe_brokers() is None and await self._listen_again():
                    return
        finally:
            if self._probe is asyncio.current_task():
                self._probe = None

    async def _listen_again(self):
        if self._closed:  # closed while the probe was out: the proxy is stopping
            return True
        host, port = self.address
        try:
            if self.sock is None:
                self.sock = bound_socket(host, port, listening=False,
                                         reuse_port=self.server.reuse_port)
            self.sock.listen(LISTEN_BACKLOG)
            self._serving = await self.server._serve(self.sock.dup(), self.name, self.route)
        except OSError as exc:
            log.error("%s listener: a broker answers again but %s:%d cannot listen: %s",
                      self.name, host, port, exc)
            return False
        down_for = self.server.loop.time() - self.down_since
        log.warning("%s listener: a broker answers again (%s) after %.1f s: listening on "
                    "%s:%d again; %d client connection(s) were turned away meanwhile",
                    self.name, self._brokers(), down_for, host, port, self.turned_away)
        self.reachable = True
        self.turned_away = 0
        self.down_since = None
        return True

    async def _probe_brokers(self):
        """None when a broker address accepts a TCP connection, else why
        each did not."""
        loop = self.server.loop
        timeout = self.server.config.upstream_connect_timeout_ms / 1000.0
        errors = []
        for host, port in self.route():
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_connection(asyncio.Protocol, host, port), timeout)
            except asyncio.TimeoutError:
                errors.append("%s:%s did not answer within %g s" % (host, port, timeout))
                continue
            except OSError as exc:
                errors.append("%s:%s %s" % (host, port, exc.strerror or exc))
                continue
            transport.close()
            return None
        return errors or ["no address known"]

    # asyncio.AbstractServer ---------------------------------------------------

    def close(self):
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
        if self._serving is not None:
            self._serving.close()
        if self.sock is not None:
            self.sock.close()

    async def wait_closed(self):
        if self._serving is not None:
            await self._serving.wait_closed()
        if self._probe is not None:
            await asyncio.gather(self._probe, return_exceptions=True)

    def get_loop(self):
        return self.server.loop

    def is_serving(self):
        return self._serving is not None and self._serving.is_serving()

    async def start_serving(self):
        pass

    async def serve_forever(self):
        while not self._closed:
            await asyncio.sleep(3600)


class BrokerContact:
    """The proxy's own contact with the bootstrap brokers: an ApiVersions
    request (over the upstream TLS settings) every CONTACT_INTERVAL_SECONDS,
    to the address that answered last first. ``age(now)`` is how long ago
    one answered (None: never). No answer is logged at WARNING at once and
    every STILL_DOWN_LOG_SECONDS while it lasts, an answer again at INFO."""

    def __init__(self, server, interval=CONTACT_INTERVAL_SECONDS,
                 still_down_every=STILL_DOWN_LOG_SECONDS):
        self.server = server
        self.interval = interval
        self.still_down_every = still_down_every
        self.answered_at = None  # loop time of the last answer
        self.answered_by = None  # "host:port" that gave it
        self.error = None  # why the last contact failed (None: it did not)
        self.down_since = None  # loop time of the first failed contact in a row
        self._warned_at = None
        self._first = 0  # index of the bootstrap address that answered last
        self._task = None

    def start(self):
        self._task = self.server.loop.create_task(self._run())

    async def stop(self):
        self._task = await ended(self._task)

    def age(self, now):
        return None if self.answered_at is None else max(0.0, now - self.answered_at)

    async def _run(self):
        while True:
            try:
                await self.contact()
            except Exception:  # a bug: said, and the contact goes on
                log.exception("asking a bootstrap broker failed")
            await asyncio.sleep(self.interval)

    async def contact(self):
        """Ask the bootstrap brokers once; True when one answered."""
        addresses = list(self.server.config.bootstrap_servers)
        first = self._first % len(addresses) if addresses else 0
        errors = []
        for i in list(range(first, len(addresses))) + list(range(first)):
            host, port = addresses[i]
            try:
                await self._ask(host, port)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    ValueError) as exc:
                errors.append("%s:%s %s" % (host, port, _why(exc)))
                continue
            self._first = i
            self._answered("%s:%s" % (host, port))
            return True
        self._failed("; ".join(errors) or "no bootstrap broker address")
        return False

    async def _ask(self, host, port):
        from ..codecs import ProtocolError
        from ..codecs.frames import MIN_RESPONSE_SIZE
        from ..codecs.versions import api_versions_request, parse_api_versions
        from ..codecs.wire import INT32

        server = self.server
        timeout = min(server.config.upstream_connect_timeout_ms / 1000.0, READY_WITHIN_SECONDS)
        tls = getattr(server, "upstream_ssl_context", None)
        writer = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None)
                writer.write(api_versions_request(1))
                size = INT32.unpack(await reader.readexactly(4))[0]
                if not MIN_RESPONSE_SIZE <= size <= 1 << 20:
                    raise ProtocolError("an ApiVersions answer of %d bytes" % size)
                parse_api_versions(INT32.pack(size) + await reader.readexactly(size))
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        finally:
            if writer is not None:
                writer.close()

    def _answered(self, by):
        loop = self.server.loop
        if self.down_since is not None:
            log.info("a bootstrap broker answers again (%s) after %.0f s without one", by,
                     loop.time() - self.down_since)
        elif self.answered_at is None:
            log.debug("bootstrap broker %s answers", by)
        self.answered_at = loop.time()
        self.answered_by = by
        self.error = self.down_since = self._warned_at = None

    def _failed(self, why):
        now = self.server.loop.time()
        self.error = why
        if self.down_since is None:
            self.down_since = now
            log.warning(
                "no bootstrap broker answers (%s): clients cannot be served, and /readyz "
                "answers 503, until one does; asking again every %g s", why, self.interval)
            self._warned_at = now
        elif now - self._warned_at >= self.still_down_every:
            log.warning("still no bootstrap broker answers after %.0f s (%s)",
                        now - self.down_since, why)
            self._warned_at = now


def _why(exc):
    if isinstance(exc, asyncio.TimeoutError):
        return "did not answer in time"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed the connection before answering"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc)
