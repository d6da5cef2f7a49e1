"""The proxy's own acceptor, for listeners with TLS or the PROXY protocol:
a failed handshake is seen with its client's address (the loop's server
drops it silently), logged and counted like any refusal, and a PROXY
protocol header is read before anything else."""
import asyncio
import logging
import socket

from ..codecs import ProtocolError
from ..codecs.proxy_protocol import MAX_SIZE as PROXY_HEADER_MAX_SIZE
from ..codecs.proxy_protocol import parse_header as parse_proxy_header
from .limits import PROXY_PROTOCOL, TLS_HANDSHAKE

log = logging.getLogger("kthrottle.proxy")


class Acceptor(asyncio.AbstractServer):
    """A listener of the proxy's own (TLS, or the PROXY protocol): accepts;
    with the PROXY protocol reads the header first (bounded by
    handshake-timeout-ms) and takes the client's address from it; applies
    the address's connection_creation_rate and the connection limits; runs
    the TLS handshake (bounded by handshake-timeout-ms) before the
    connection is handed to a ClientConnection. A missing or invalid
    header, or a handshake that fails, is a refusal."""

    def __init__(self, server, sock, name, route):
        self.server = server
        self.sockets = [sock]
        self.name = name
        self.route = route
        self._handshakes = set()
        self._task = server.loop.create_task(self._accept())

    async def _accept(self):
        loop = self.server.loop
        sock = self.sockets[0]
        while True:
            try:
                client, address = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, say: wait, as a listener does
                log.error("%s listener cannot accept: %s", self.name, exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handshake(client, address))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, client, address):
        server = self.server
        ip = address[0]
        peer = "%s:%s" % address[:2]
        if server.proxy_protocol:
            introduced = await self._introduction(client, address, peer)
            if introduced is None:
                return
            ip, peer = introduced
        # before the TLS handshake, as a broker checks it on accept
        if (server.over_connection_rate(ip, peer, self.name, client.close)
                or server.over_failed_logins(ip, peer, self.name, client.close)):
            if server.proxy_protocol:
                server.limits.unreserve()
            return
        if server.proxy_protocol:
            over = server.limits.admit_reserved(ip)
        else:
            over = server.limits.admit(ip)
        if over is not None:
            client.close()
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), *over)
            return
        conn = server.connection_class(server.env, self.name, self.route())
        conn.counted = True
        if server.proxy_protocol:
            conn.peer, conn.address = peer, ip
        tls = server.ssl_context
        try:
            if tls is None:
                await server.loop.connect_accepted_socket(lambda: conn, client)
            else:
                await server.loop.connect_accepted_socket(
                    lambda: conn, client, ssl=tls,
                    ssl_handshake_timeout=server.config.handshake_timeout_ms / 1000.0)
        except asyncio.CancelledError:
            server.limits.release(ip)
            client.close()
            raise
        except Exception as exc:  # ssl.SSLError, a timeout, the client closing
            server.limits.release(ip)
            client.close()
            if tls is None:
                log.info("connection from %s (%s listener) lost at once: %s", peer, self.name, exc)
                return
            server.tls_handshakes["failed"] += 1
            server.refusals.refused(ip, "%s (%s listener)" % (peer, self.name), TLS_HANDSHAKE,
                                    "TLS handshake failed: %s" % _tls_error(exc))
            return
        if tls is not None:
            server.tls_handshakes["completed"] += 1

    async def _introduction(self, client, address, peer):
        """The PROXY protocol header: (client address, peer shown in logs),
        the socket's own when the header names no client (a balancer's
        health check: v2 LOCAL, v1 UNKNOWN); None when the connection was
        refused (no valid header in time). Counted against max-connections
        meanwhile, and against max-connections-per-ip once the client is
        known."""
        server = self.server
        over = server.limits.reserve()
        if over is not None:
            client.close()
            server.refusals.refused(address[0], "%s (%s listener)" % (peer, self.name), *over)
            return None
        timeout = server.config.handshake_timeout_ms / 1000.0
        try:
            header = await asyncio.wait_for(_read_proxy_header(server.loop, client), timeout)
        except asyncio.CancelledError:
            server.limits.unreserve()
            client.close()
            raise
        except (asyncio.TimeoutError, ProtocolError, OSError) as exc:
            server.limits.unreserve()
            client.close()
            if isinstance(exc, asyncio.TimeoutError):
                why = ("no PROXY protocol header within handshake-timeout-ms (%d ms)"
                       % round(timeout * 1000))
            elif isinstance(exc, ProtocolError):
                why = str(exc)
            else:
                why = "the connection failed before its PROXY protocol header: %s" % exc
            server.refusals.refused(address[0], "%s (%s listener, --proxy-protocol)"
                                    % (peer, self.name), PROXY_PROTOCOL, why)
            return None
        if header.source is None:
            return address[0], peer
        return header.source[0], "%s:%d" % header.source

    def close(self):
        self._task.cancel()
        for task in self._handshakes:
            task.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self):
        await asyncio.gather(self._task, *self._handshakes, return_exceptions=True)

    def get_loop(self):
        return self.server.loop

    def is_serving(self):
        return not self._task.done()

    async def start_serving(self):
        pass

    async def serve_forever(self):
        await self._task


async def _read_proxy_header(loop, sock):
    """Read a PROXY protocol header off an accepted socket, and not one
    byte more: what follows is the client's (a TLS ClientHello, say), for
    the transport made next. The bytes are peeked at; those of an
    unfinished header are taken off the socket, and of a finished one
    exactly its length."""
    sock.setblocking(False)
    taken = b""
    while True:
        await _readable(loop, sock)
        try:
            data = sock.recv(max(1, PROXY_HEADER_MAX_SIZE - len(taken)), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        if not data:
            raise ProtocolError("the client closed the connection before sending a PROXY "
                                "protocol header%s" % (" (%d bytes of one)" % len(taken)
                                                       if taken else ""))
        header = parse_proxy_header(taken + data)
        if header is None:  # every byte so far is header
            taken += sock.recv(len(data))
            continue
        rest = header.length - len(taken)
        if rest:
            sock.recv(rest)  # there already (peeked): the call takes exactly that
        return header


async def _readable(loop, sock):
    ready = loop.create_future()

    def wake():
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)



def _tls_error(exc):
    if isinstance(exc, asyncio.TimeoutError) or "timed out" in str(exc):
        return "not finished within handshake-timeout-ms"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)) or not str(exc):
        return "the client closed the connection (%s; a client that does not trust the " \
               "proxy's certificate, or that does not speak TLS)" % type(exc).__name__
    return str(exc)
