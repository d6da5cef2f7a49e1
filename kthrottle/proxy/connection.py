"""The asyncio side of one client connection: sockets, timers, backpressure.

Everything the proxy decides about a connection lives in the pipeline
(``pipeline.Connection``), which does no I/O. This adapter feeds it what the
sockets deliver, with the loop's time, and carries out the actions it
returns. Backpressure: each side stops reading while the other side's write
buffer is over its high mark.
"""
import asyncio
import errno
import functools
import logging
import socket
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable

from ..policy.quota_callback import QuotaCallbackError
from .filter import REFUSED_AUTHENTICATION
from .health import REFUSED_BROKER_UNREACHABLE
from .limits import HANDSHAKE_TIMEOUT, OPEN_FILES, TLS_HANDSHAKE, UNKNOWN_NODE
from .pipeline import (
    Close,
    Connection,
    ConnectUpstream,
    HELD,
    HoldResponses,
    NodesSeen,
    PauseClient,
    Phase,
    ResumeBroker,
    ResumeClient,
    RunJob,
    SendToBroker,
    SendToClient,
    SessionDeadline,
)
from .tls import certificate_subject
from .zero_copy import TO_BROKER, TO_CLIENT, Splice, unsupported_error

log = logging.getLogger("kthrottle.proxy")

# Write-buffer marks per direction. A Fetch response is commonly ~1 MiB, so a
# 64 KiB mark (asyncio's default) would pause the broker side on every one.
WRITE_HIGH_WATER = 4 * 1024 * 1024
WRITE_LOW_WATER = 1024 * 1024
# Over TLS every write is at least one record (its own header, tag and cipher
# call, and one more decryption for the peer): a frame's small pieces (a patched
# head, a rewritten tail) are joined into one write.
TLS_JOIN_MAX = 64 * 1024


def tls_writes(transport, chunks):
    """Write ``chunks`` to a TLS transport: joined when they are small together."""
    if len(chunks) > 1 and sum(map(len, chunks)) <= TLS_JOIN_MAX:
        transport.write(b"".join(chunks))
    else:
        transport.writelines(chunks)

# the reading pause of a side whose bytes go socket to socket (--zero-copy)
ZERO_COPY = "zero-copy"
# After the answer to a failed authentication the proxy waits for the client
# to close (clients close on that answer), at most this long (seconds), before
# closing itself: the answer and the close arriving together, kafka-python 3
# drops the answer (the bytes it read in the same pass as the end of the
# stream) and says "socket disconnected" instead of the authentication failure.
FAILED_AUTHENTICATION_LINGER = 1.0


def no_delay(transport):
    """TCP_NODELAY on a transport's socket: a frame leaves at once instead of
    waiting for the ACK of the previous one (Nagle), which the peer's delayed
    ACK can hold back for 40 ms. uvloop sets it on every TCP transport;
    asyncio only on sockets created with proto IPPROTO_TCP, which the proxy's
    own listening sockets, and so the sockets they accept, are not."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the socket is already gone: connection_lost follows
            pass


class _Unread(asyncio.Protocol):
    """The protocol of a connection held over its connection_creation_rate,
    or answered a failed authentication, until the server closes it: what its
    client sends is dropped; its client's close closes it."""

    def data_received(self, data):
        pass


_UNREAD = _Unread()


class _Side:
    """Reading pause bookkeeping for one transport: paused while any reason holds."""

    __slots__ = ("transport", "reasons")

    def __init__(self):
        self.transport = None
        self.reasons = set()

    def pause(self, reason):
        if not self.reasons and self.transport is not None:
            self.transport.pause_reading()
        self.reasons.add(reason)

    def reassert(self):
        if self.reasons and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume(self, reason):
        self.reasons.discard(reason)
        if not self.reasons and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class _Move:
    """The rest of one frame going socket to socket (--zero-copy)."""

    __slots__ = ("from_client", "nbytes", "draining", "splice")

    def __init__(self, from_client, nbytes):
        self.from_client = from_client
        self.nbytes = nbytes
        self.draining = False  # waiting for the destination's write buffer to empty
        self.splice = None


@dataclass(frozen=True, slots=True)
class ConnectionEnv:
    """All a client connection uses of the proxy, made once by the server
    when its loop runs (ProxyServer.start). The mutable ones are the
    server's own objects, shared: ``nodes`` grows as the cluster names nodes,
    ``connections`` is the set of open ones."""

    loop: Any
    filter_table: Any  # pipeline.FilterTable
    quotas: Any  # policy QuotaManager, or None
    max_frame_size: int
    sasl_max_receive_size: int  # sasl.server.max.receive.size, while authenticating
    upstream_connect_timeout: float  # seconds
    upstream_tls: Any  # ssl.SSLContext towards the brokers, or None
    zero_copy: Any  # zero_copy.ZeroCopy (--zero-copy, plaintext both ways), or None
    principal_mapper: Any  # SSL listeners: policy.principal.PrincipalMapper, or None
    sni: Any  # SNI routing: addressing.SniPattern, or None
    nodes: dict  # node id -> the (host, port) the broker advertises
    connections: set  # the open ClientConnections
    limits: Any  # limits.ConnectionLimits
    failed_logins: Any  # limits.FailedLogins
    held: Any  # limits.HeldConnections
    refusals: Any  # limits.RefusalLog
    next_id: Callable  # () -> a new connection id
    over_connection_rate: Callable  # (ip, peer, listener, close) -> held and refused?
    over_failed_logins: Callable  # the same for the failed-login allowance
    learn_nodes: Callable  # (nodes): route them and open their listeners
    listener_named: Callable  # (name) -> the health.Listener, or None


def _node_of(listener_name):
    """The node id of a node's listener ("node 3"); None for the bootstrap."""
    if listener_name.startswith("node "):
        return int(listener_name[5:])
    return None


class ClientConnection(asyncio.Protocol):
    """Protocol for a client socket accepted on one of the proxy's listeners."""

    def __init__(self, env, listener_name, upstream_addresses):
        self.env = env  # ConnectionEnv
        self.listener_name = listener_name
        self.upstream_addresses = upstream_addresses  # tried in order
        self.conn_id = env.next_id()
        self.pipeline = Connection(env.filter_table, env.max_frame_size, env.quotas,
                                   env.sasl_max_receive_size)
        self.pipeline.node_id = _node_of(listener_name)
        self.client = _Side()
        self.upstream = _Side()
        self.client_tls = False  # the client's side encrypts (small writes joined)
        self.upstream_tls = env.upstream_tls is not None  # and the broker's
        self.loop = env.loop
        self.peer = None
        self.address = None  # the client's IP address (connection limits)
        self.upstream_addr = None
        self.closed = False
        self.accepted_at = None
        self.counted = False  # in the connection limits' counts (TLS: by the acceptor)
        self._activity = (0, None)  # (bytes both ways, when they last changed)
        self._connect_task = None
        self._client_timer = None
        self._hold_timer = None
        self._session_timer = None  # KIP-368: the session's end
        # --zero-copy (plaintext both ways only): the ZeroCopy of the proxy,
        # and the frame moving socket to socket per direction (index: from
        # the client)
        self.zero_copy = env.zero_copy if env.upstream_tls is None else None
        self._moves = [None, None]

    # what the admin endpoint reads
    principal = property(attrgetter("pipeline.principal"))
    client_quotas = property(attrgetter("pipeline.client_quotas"))
    muted_until = property(attrgetter("pipeline.muted_until"))

    # client side -------------------------------------------------------

    def connection_made(self, transport):
        peer = transport.get_extra_info("peername")
        self.peer = "%s:%s" % peer[:2] if peer else "?"
        self.address = peer[0] if peer else "?"
        self._accepted(transport)

    def _accepted(self, transport):
        self.client.transport = transport
        self.pipeline.client_host = self.address
        if transport.get_extra_info("ssl_object") is not None:
            self.zero_copy = None  # its bytes are decrypted here
            self.client_tls = True
        no_delay(transport)
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        self.accepted_at = self.loop.time()
        self.client.pause("connecting")
        # uvloop starts reading right after connection_made, whatever was
        # asked there: say it again once it has
        self.loop.call_soon(self.client.reassert)
        env = self.env
        if not self.counted and (
                env.over_connection_rate(self.address, self.peer, self.listener_name,
                                         transport.close)
                or env.over_failed_logins(self.address, self.peer, self.listener_name,
                                          transport.close)):
            # held by the server, unread (the proxy's acceptor checks its own
            # listeners before the handshake)
            self.closed = True
            transport.set_protocol(_UNREAD)
            return
        env.connections.add(self)
        if not self.counted:  # a TLS listener's acceptor counts before the handshake
            over = env.limits.admit(self.address)
            if over is not None:
                self.refuse(*over)
                return
            self.counted = True
        mapper = env.principal_mapper
        principal = None
        if mapper is not None:
            principal = self._tls_principal(transport, mapper)
            if principal is False:
                return
        self._run(self.pipeline.client_accepted(self.loop.time(), principal))

    def _tls_principal(self, transport, mapper):
        """SSL listeners: the client certificate's subject, mapped, is the
        principal (without a certificate: None, ANONYMOUS as in Kafka); False
        when a certificate maps to no principal (the client is refused)."""
        from ..policy.principal import NoMatchingRule

        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der is None:
            return None
        subject = certificate_subject(der)
        try:
            return mapper.principal(subject)
        except NoMatchingRule as exc:
            self.refuse(TLS_HANDSHAKE, "client certificate refused: %s" % exc)
            return False

    def _start_upstream(self):
        self.client.pause("connecting")
        if self._connect_task is None:
            self._connect_task = self.loop.create_task(self._connect_upstream())
            self._connect_task.add_done_callback(self._connect_done)

    def refuse(self, reason, message):
        """Turn the client away: one WARNING line (summarised per address by
        the refusal log) and kthrottle_connections_refused_total."""
        if not self.closed:
            self._run(self.pipeline.close(message, reason))
            self._closed(message, reason)

    def sweep(self, now, idle, handshake):
        """The server's periodic look (see ProxyServer._sweep)."""
        if self.closed:
            return
        p = self.pipeline
        if p.phase is Phase.AUTHENTICATING:
            if now - self.accepted_at >= handshake:
                self.refuse(HANDSHAKE_TIMEOUT, "authentication not done %d ms after the "
                            "connection was accepted (handshake-timeout-ms)"
                            % round(handshake * 1000))
            return
        moved = p.bytes_from_client + p.bytes_from_broker
        for move in self._moves:
            if move is not None and move.splice is not None:
                moved += move.splice.taken
        count, since = self._activity
        if moved != count or since is None:
            self._activity = (moved, now)
        elif now - since >= idle:
            self.close("idle for %d ms (connections-max-idle-ms)" % round((now - since) * 1000))

    async def _connect_upstream(self):
        errors = []
        timeout = self.env.upstream_connect_timeout
        tls = self.env.upstream_tls
        for host, port in self.upstream_addresses:
            try:
                await asyncio.wait_for(
                    self.loop.create_connection(lambda: UpstreamConnection(self), host, port,
                                                ssl=tls, server_hostname=host if tls else None),
                    timeout)
            except asyncio.TimeoutError:
                errors.append("%s:%s did not answer within %g s" % (host, port, timeout))
                log.warning("connection %d: broker %s; trying the next address", self.conn_id,
                            errors[-1])
                continue
            except OSError as exc:  # ssl.SSLError included: a certificate not trusted
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_files(exc)  # the proxy's limit: no broker is at fault
                    return
                errors.append("%s:%s %s" % (host, port, exc.strerror or exc))
                continue
            self.upstream_addr = "%s:%s" % (host, port)
            if self.closed:
                self.upstream.transport.close()
                return
            if self.pipeline.node_id is None:  # a bootstrap connection: the node it reached
                self.pipeline.node_id = next(
                    (n for n, address in self.env.nodes.items() if address == (host, port)),
                    None)
            log.info(
                "connection %d opened: client %s -> %s listener -> broker %s",
                self.conn_id, self.peer, self.listener_name, self.upstream_addr,
            )
            try:
                self._run(self.pipeline.broker_connected(self.loop.time()))
            except QuotaCallbackError as exc:  # what the client sent meanwhile asked for it
                self._callback_failed(exc)
                return
            if self.zero_copy is not None:  # what the client sent meanwhile, replayed
                self._pass_through(True)
            return
        errors = errors or ["no address known"]
        listener = self.env.listener_named(self.listener_name)
        if listener is not None:
            listener.unreachable(errors)  # logged there, once for the whole outage
        if not self.closed:
            self.pipeline.close("no broker reachable")  # its only action: Close
            if listener is None:  # a node reached by TLS server name: no listener of its own
                self._closed("no broker reachable for %s (%s)" % (
                    self.listener_name, "; ".join(errors)), REFUSED_BROKER_UNREACHABLE)
                return
            self._closed("no broker reachable (%s)" % "; ".join(errors), quiet=True)

    def _out_of_files(self, exc):
        """No file descriptor left for this client's broker connection: this
        client is refused (counted and logged as a refusal, not a flood), and
        the listener goes on as before, since the brokers may well answer."""
        if not self.closed:
            self.pipeline.close("no file descriptor left")  # its only action: Close
            self._closed("no file descriptor left for its broker connection (%s): raise the "
                         "proxy's open-files limit (ulimit -n) or lower max-connections"
                         % (exc.strerror or exc), OPEN_FILES)

    def _connect_done(self, task):
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug, not a network error: never leave the client hanging
            log.error("connection %d: connecting to the broker failed", self.conn_id,
                      exc_info=exc)
            self.close("internal error while connecting to the broker: %s" % exc)

    def data_received(self, data):
        now = self.loop.time()
        try:
            passed = self.pipeline.pass_request(data, now)
        except QuotaCallbackError as exc:  # this connection's quotas cannot be had
            self._callback_failed(exc)
            return
        if passed:  # the common read: requests passed as they are
            if passed is True:
                self.upstream.transport.write(data)
            else:  # a mute one of them earned: what goes on before it, then the mute
                self._run(passed)
            if self.zero_copy is not None:  # the rest of the last one, socket to socket
                self._pass_through(True)
            return
        self._long_way(self.pipeline.client_data, data, now, True)

    def eof_received(self):
        self._run(self.pipeline.client_eof())
        return False

    def connection_lost(self, exc):
        self.close("client connection lost: %s" % exc if exc else "client disconnected")

    def pause_writing(self):
        self.upstream.pause("client write buffer full")

    def resume_writing(self):
        self.upstream.resume("client write buffer full")
        if self._moves[0] is not None:
            self._drained(False)

    # broker side -------------------------------------------------------

    def upstream_data(self, data):
        try:
            passed = self.pipeline.pass_response(data)
        except QuotaCallbackError as exc:
            self._callback_failed(exc)
            return
        if passed:  # the common read: a response, or part of one, passed as it is
            if passed is True:
                self.client.transport.write(data)
            elif passed is not HELD:  # the chunks of a response held until whole
                if self.client_tls:
                    tls_writes(self.client.transport, passed)
                else:
                    self.client.transport.writelines(passed)
            if self.zero_copy is not None:
                self._pass_through(False)
            return
        self._long_way(self.pipeline.broker_data, data, self.loop.time(), False)

    def _long_way(self, read, data, now, from_client):
        """A read the short way did not take: ``read`` (the pipeline's
        client_data or broker_data) makes its actions, run here; then what
        moves socket to socket from the client (``from_client``) or the
        broker."""
        try:
            actions = read(data, now)
        except QuotaCallbackError as exc:  # this connection's quotas cannot be had
            self._callback_failed(exc)
            return
        if actions:
            self._run(actions)
        if self.zero_copy is not None:
            self._pass_through(from_client)

    def _callback_failed(self, exc):
        """A quota callback failed for this connection's client: it alone is
        closed, with a WARNING (the callback is the operator's code)."""
        log.warning("connection %d (principal %s): %s; the connection is closed",
                    self.conn_id, self.pipeline.principal, exc)
        self.close("quota callback failed: %s" % exc)

    # --zero-copy --------------------------------------------------------

    def _pass_through(self, from_client):
        """The rest of a large frame that the pipeline passes on as it is
        goes from socket to socket: the source is not read meanwhile, and
        the move starts once the destination's write buffer is empty."""
        zc = self.zero_copy
        if self.closed or not zc.enabled or self._moves[from_client] is not None:
            return
        nbytes = self.pipeline.passing_through(from_client)
        if nbytes < zc.min_bytes:
            return
        src, dst = (self.client, self.upstream) if from_client else (self.upstream, self.client)
        if dst.transport is None or dst.transport.is_closing():
            return
        move = self._moves[from_client] = _Move(from_client, nbytes)
        src.pause(ZERO_COPY)
        if not from_client and self.pipeline.holding_response:
            # the client sees it only once whole: all of it into the pipe first
            self._start_move(move, whole_first=True)
        else:
            self._when_drained(move)

    def _when_drained(self, move):
        """Start writing once the destination's write buffer is empty: what
        the pipeline handed it first goes first."""
        transport = (self.upstream if move.from_client else self.client).transport
        if transport.get_write_buffer_size():
            # no mark but empty: resume_writing says when the last byte has gone
            move.draining = True
            transport.set_write_buffer_limits(0, 0)
        elif move.splice is None:
            self._start_move(move)
        else:
            move.splice.drain()

    def _drained(self, from_client):
        """The destination of a move waiting for its write buffer is empty."""
        move = self._moves[from_client]
        if move is not None and move.draining:
            move.draining = False
            dst = self.upstream if from_client else self.client
            dst.transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
            self._when_drained(move)

    def _start_move(self, move, whole_first=False):
        from_client = move.from_client
        src, dst = (self.client, self.upstream) if from_client else (self.upstream, self.client)
        try:
            move.splice = Splice(self.loop, src.transport.get_extra_info("socket").fileno(),
                                 dst.transport.get_extra_info("socket").fileno(), move.nbytes,
                                 functools.partial(self._guarded, self._moved, move),
                                 (functools.partial(self._guarded, self._filled)
                                  if whole_first else None), self.zero_copy.bytes,
                                 TO_BROKER if from_client else TO_CLIENT)
        except OSError as exc:  # out of descriptors, say: this frame the usual way
            log.debug("connection %d: no zero-copy pass-through for a frame: %s",
                      self.conn_id, exc)
            self._moves[from_client] = None
            src.resume(ZERO_COPY)
            return
        move.splice.start()

    def _guarded(self, callback, *args):
        """A move's callbacks come from the loop: a bug there closes this
        connection rather than leaving it paused."""
        try:
            callback(*args)
        except QuotaCallbackError as exc:
            self._callback_failed(exc)
        except Exception as exc:
            log.error("connection %d: zero-copy pass-through failed", self.conn_id, exc_info=exc)
            self.close("internal error in a zero-copy pass-through: %s" % exc)

    def _filled(self, splice):
        """A held response is all in the pipe: what came before it goes out,
        then the rest, once that has gone."""
        held = self.pipeline.release_held_response()
        if held:
            self.client.transport.writelines(held)
        self._when_drained(self._moves[False])  # a response

    def _moved(self, move, splice, error):
        """A move is over: the pipeline counts its bytes and goes on after
        the frame, and the source is read again."""
        from_client = move.from_client
        self._moves[from_client] = None
        if self.closed:
            return
        src = self.client if from_client else self.upstream
        zc = self.zero_copy
        if splice.spilled is not None:
            # the pipe filled up before the frame was in: the usual way from here
            actions = self.pipeline.broker_data(splice.spilled, self.loop.time())
            if actions:
                self._run(actions)
            if not self.closed:
                src.resume(ZERO_COPY)
            return
        if error is not None and not splice.taken:
            # nothing left the source: the usual reads find what is there (an
            # end of stream, an error) and the frame goes the usual way
            if unsupported_error(error):
                zc.unsupported(error)
            src.resume(ZERO_COPY)
            return
        actions = self.pipeline.passed_through(from_client, splice.moved, self.loop.time())
        if error is not None:
            if (splice.failed == "source") == from_client:
                who = "client disconnected"
            else:
                who = "broker connection lost"
            self.close("%s in the middle of a %s passed through with splice (%d of %d bytes "
                       "moved): %s" % (who, "request" if from_client else "response",
                                       splice.moved, splice.nbytes, error.strerror or error))
            return
        if actions:
            self._run(actions)
        if not self.closed:
            src.resume(ZERO_COPY)

    # carrying out the pipeline's actions -------------------------------

    def _run(self, actions):
        for action in actions:
            kind = action.__class__
            if kind is SendToBroker:
                if self.upstream.transport is None:  # never: a filter let a request through early
                    self._closed("internal error: a request before the broker connection")
                    return
                if self.upstream_tls:
                    tls_writes(self.upstream.transport, action.chunks)
                else:
                    self.upstream.transport.writelines(action.chunks)
            elif kind is SendToClient:
                if self.client_tls:
                    tls_writes(self.client.transport, action.chunks)
                else:
                    self.client.transport.writelines(action.chunks)
            elif kind is PauseClient:
                self.client.pause("throttled")
                if action.until is not None:  # None: until a job is done
                    self._client_timer = self._set_timer(self._client_timer, action.until)
            elif kind is ResumeClient:
                self.client.resume("throttled")
                self.client.resume("connecting")
            elif kind is HoldResponses:
                self.upstream.pause("holding a throttled response")
                self._hold_timer = self._set_timer(self._hold_timer, action.until)
            elif kind is SessionDeadline:
                self._session_timer = self._set_timer(self._session_timer, action.until)
            elif kind is ResumeBroker:
                self.upstream.resume("holding a throttled response")
            elif kind is NodesSeen:
                self.env.learn_nodes(action.nodes)
            elif kind is ConnectUpstream:
                self._start_upstream()
            elif kind is RunJob:
                self._start_job(action)
            elif kind is Close:
                self._closed(action.reason, action.refused,
                             answered=any(a.__class__ is SendToClient for a in actions))
                return

    def _start_job(self, action):
        try:
            result = action.job()
        except Exception as exc:
            self.loop.call_soon(self._job_done, action.token, None, exc)
            return
        if not asyncio.isfuture(result) and not asyncio.iscoroutine(result):
            self.loop.call_soon(self._job_done, action.token, result, None)
            return
        future = asyncio.ensure_future(result)

        def done(future):
            if future.cancelled():
                return
            exc = future.exception()
            self._job_done(action.token, None if exc else future.result(), exc)

        future.add_done_callback(done)

    def _job_done(self, token, result, error):
        if self.closed:
            return
        try:
            self._run(self.pipeline.job_done(token, result, error, self.loop.time()))
        except QuotaCallbackError as exc:
            self._callback_failed(exc)
        except Exception as exc:  # a bug: never leave the client hanging
            log.error("connection %d: handling a job's answer failed", self.conn_id, exc_info=exc)
            self.close("internal error: %s" % exc)

    def _set_timer(self, timer, until):
        if timer is not None:
            timer.cancel()
        return self.loop.call_at(until, self._tick)

    def _tick(self):
        if self.closed:
            return
        try:
            self._run(self.pipeline.tick(self.loop.time()))
            if self.zero_copy is not None:  # bytes read during a mute, replayed
                self._pass_through(True)
        except QuotaCallbackError as exc:
            self._callback_failed(exc)
        except Exception as exc:  # a bug: never leave a paused client and two sockets open
            log.error("connection %d: a timer failed", self.conn_id, exc_info=exc)
            self.close("internal error after a timer: %s" % exc)

    def close(self, reason):
        if not self.closed:
            self._run(self.pipeline.close(reason))
            self._closed(reason)

    def _closed(self, reason, refused=None, quiet=False, answered=False):
        """``answered``: the last actions wrote the client an answer (a
        failed authentication's: see FAILED_AUTHENTICATION_LINGER)."""
        if self.closed:
            return
        self.closed = True
        env = self.env
        env.connections.discard(self)
        if self.counted:
            env.limits.release(self.address)
        for timer in (self._client_timer, self._hold_timer, self._session_timer):
            if timer is not None:
                timer.cancel()
        for move in self._moves:
            if move is not None and move.splice is not None:
                move.splice.cancel()
        task = self._connect_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        client = self.client.transport
        if client is not None:
            held = env.held
            if (answered and refused == REFUSED_AUTHENTICATION and held is not None
                    and not client.is_closing()):
                # the answer goes out; the socket closes when the client closes
                # it (what it sends meanwhile is dropped), at the latest when
                # the server's HeldConnections does (at once when it is full)
                client.set_protocol(_UNREAD)
                client.resume_reading()
                held.hold(client.close, FAILED_AUTHENTICATION_LINGER * 1000)
            else:
                client.close()
        if self.upstream.transport is not None:
            self.upstream.transport.close()
        if refused == REFUSED_AUTHENTICATION:
            if env.failed_logins is not None:
                env.failed_logins.failed(self.address, self.loop.time())
        if refused is not None:
            env.refusals.refused(self.address, "%s (connection %d, %s listener)" % (
                self.peer, self.conn_id, self.listener_name), refused, reason)
            return
        p = self.pipeline
        (log.debug if quiet else log.info)(
            "connection %d closed: %s (client %s, broker %s, %d requests, %d bytes in, %d bytes out)",
            self.conn_id, reason, self.peer, self.upstream_addr, p.requests,
            p.bytes_from_client, p.bytes_from_broker,
        )


class RoutedConnection(ClientConnection):
    """A client connection accepted by the proxy's own acceptor on a
    listener with the PROXY protocol or SNI routing: its address may have
    come from a PROXY protocol header (set before the transport is made),
    and its broker from the TLS server name it asked for."""

    def connection_made(self, transport):
        if self.address is None:  # no PROXY protocol header: the socket's peer
            peer = transport.get_extra_info("peername")
            self.peer = "%s:%s" % peer[:2] if peer else "?"
            self.address = peer[0] if peer else "?"
        sni = self.env.sni
        if sni is not None:
            refusal = self._route_by_server_name(sni, transport)
            if refusal is not None:
                self.client.transport = transport
                self.accepted_at = self.loop.time()
                self.refuse(UNKNOWN_NODE, refusal)
                return
        self._accepted(transport)

    def _route_by_server_name(self, sni, transport):
        """A server name the pattern matches goes to that node's broker; any
        other (or none) to the bootstrap brokers. Returns why the client is
        refused: its name names a node id the cluster has not named."""
        ssl_object = transport.get_extra_info("ssl_object")
        name = getattr(ssl_object, "kthrottle_server_name", None)
        node_id = sni.node_id(name)
        if node_id is None:
            return None
        address = self.env.nodes.get(node_id)
        if address is None:
            known = sorted(self.env.nodes)
            return ("TLS server name %s names node %d, which the cluster has not named (%s)"
                    % (name, node_id, "nodes known: %s" % ", ".join(map(str, known))
                       if known else "no node known yet"))
        self.listener_name = "node %d" % node_id
        self.pipeline.node_id = node_id
        self.upstream_addresses = [address]
        return None


class UpstreamConnection(asyncio.Protocol):
    """Protocol for the proxy's connection to a broker, owned by a ClientConnection."""

    __slots__ = ("owner", "data_received")

    def __init__(self, owner):
        self.owner = owner
        # the loop calls the owner's method itself: a call less per read
        self.data_received = owner.upstream_data

    def connection_made(self, transport):
        no_delay(transport)
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        self.owner.upstream.transport = transport

    def eof_received(self):
        self._lost("broker closed the connection")
        return False

    def connection_lost(self, exc):
        self._lost("broker connection lost: %s" % exc if exc else "broker closed the connection")

    def _lost(self, reason):
        owner = self.owner
        if not owner.closed:  # the broker went first: is it still there?
            listener = owner.env.listener_named(owner.listener_name)
            if listener is not None:
                listener.check()
            owner.close(reason)

    def pause_writing(self):
        self.owner.client.pause("broker write buffer full")

    def resume_writing(self):
        owner = self.owner
        owner.client.resume("broker write buffer full")
        if owner._moves[1] is not None:
            owner._drained(True)
