"""One client connection and its own upstream broker connection.

Requests are forwarded as the bytes they came in as; responses come back in
the order the requests were sent (Kafka answers in order on a connection), so
a FIFO of pending requests tells which response is which. Backpressure: each
side stops reading while the other side's write buffer is over its high mark.
"""
import asyncio
import logging
from collections import deque

from ..codecs import (
    ProtocolError,
    parse_request_header,
    produce_acks,
    response_correlation_id,
    rewrite_response,
    unsupported_api_versions_response,
)
from ..codecs.apis import API_VERSIONS, FETCH, MAX_DECODABLE_VERSION, PRODUCE, needs_rewrite
from ..codecs.frames import (
    DROP,
    MIN_REQUEST_SIZE,
    MIN_RESPONSE_SIZE,
    PASS,
    WHOLE,
    FrameCutter,
    fetch_max_bytes_offset,
    fetch_replica_id,
)
from ..codecs.throttle import (
    clients_back_off_from,
    raise_throttle_time,
    throttle_time_offset,
    throttle_time_patch,
)
from ..codecs.wire import INT32

log = logging.getLogger("kthrottle.proxy")

# Write-buffer marks per direction. A Fetch response is commonly ~1 MiB, so a
# 64 KiB mark (asyncio's default) would pause the broker side on every one.
WRITE_HIGH_WATER = 4 * 1024 * 1024
WRITE_LOW_WATER = 1024 * 1024

# Largest response accepted from a broker (a Fetch answer is bounded by the
# client's fetch.max.bytes, 50 MiB by default).
MAX_RESPONSE_SIZE = 1 << 30

# acks=0 Produce correlation ids remembered in case the broker answers them.
UNANSWERED_IDS_KEPT = 1024

# Requests exempt from the request-rate quota (KIP-124): cluster actions
# (LeaderAndIsr, StopReplica, UpdateMetadata, ControlledShutdown).
REQUEST_QUOTA_EXEMPT = frozenset((4, 5, 6, 7))

# Client-ids whose quota lookups one connection keeps (clients send one; a
# connection that sends more is not given unbounded memory for them).
CLIENT_IDS_KEPT = 64

# The principal of a connection that has not authenticated (KIP-55).
ANONYMOUS = "ANONYMOUS"


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

    def resume(self, reason):
        self.reasons.discard(reason)
        if not self.reasons and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class ClientConnection(asyncio.Protocol):
    """Protocol for a client socket accepted on one of the proxy's listeners."""

    def __init__(self, server, listener_name, upstream_addresses):
        self.server = server
        self.listener_name = listener_name
        self.upstream_addresses = upstream_addresses  # tried in order
        self.conn_id = server.next_connection_id()
        self.client = _Side()
        self.upstream = _Side()
        self.requests_in = FrameCutter(
            self._on_request_head, self._on_whole_request,
            server.config.max_frame_size, MIN_REQUEST_SIZE,
        )
        # Responses are not bounded by socket.request.max.bytes (a fetch may be
        # larger); only a negative or absurd size is refused.
        self.responses_in = FrameCutter(
            self._on_response_head, self._on_whole_response, MAX_RESPONSE_SIZE, MIN_RESPONSE_SIZE,
        )
        # (api_key, api_version, rewrite?, throttle ms) of a response gathered whole
        self.rewriting = None
        self.response_out = None  # what upstream_data will write to the client
        self.principal = ANONYMOUS
        self.client_quotas = {}  # client-id -> policy ClientQuotas
        self.muted_until = 0.0  # client reads paused until (loop time)
        self.unmute_timer = None
        self.mute_due = 0  # ms to mute for once the request being read is in
        self.unread = None  # client bytes received after a mute began, in order
        self.held = None  # responses held back for an old client's throttle
        self.hold_from = None  # index in response_out where holding starts
        self.hold_until = 0.0
        self.release_timer = None
        # (correlation_id, api_key, api_version, rewrite?, local answer or None,
        #  ClientQuotas or None, throttle ms earned by the request)
        self.pending = deque()
        self.unanswered = deque(maxlen=UNANSWERED_IDS_KEPT)
        self.peer = None
        self.early_data = []
        self.upstream_addr = None
        self.closed = False
        self.requests = 0
        self.bytes_from_client = 0
        self.bytes_from_upstream = 0

    # client side -------------------------------------------------------

    def connection_made(self, transport):
        self.client.transport = transport
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = "%s:%s" % peer[:2] if peer else "?"
        self.client.pause("connecting")
        self.server.connections.add(self)
        self._connect_task = asyncio.get_running_loop().create_task(self._connect_upstream())

    async def _connect_upstream(self):
        loop = asyncio.get_running_loop()
        errors = []
        for host, port in self.upstream_addresses:
            try:
                await loop.create_connection(lambda: UpstreamConnection(self), host, port)
            except OSError as exc:
                errors.append("%s:%s %s" % (host, port, exc.strerror or exc))
                continue
            self.upstream_addr = "%s:%s" % (host, port)
            if self.closed:
                self.upstream.transport.close()
                return
            log.info(
                "connection %d opened: client %s -> %s listener -> broker %s",
                self.conn_id, self.peer, self.listener_name, self.upstream_addr,
            )
            early, self.early_data = self.early_data, []
            for data in early:
                self.data_received(data)
            self.client.resume("connecting")
            return
        self.close("no broker reachable (%s)" % "; ".join(errors or ["no address known"]))

    def data_received(self, data):
        if self.upstream.transport is None:
            # uvloop may deliver bytes that arrived with the connection even
            # though reading is paused until the broker connection is up.
            self.early_data.append(data)
            return
        if self.unread is not None:  # muted: read on when the mute ends
            self.unread.append(data)
            return
        self.bytes_from_client += len(data)
        cutter = self.requests_in
        try:
            out = cutter.feed(data, [])
        except ProtocolError as exc:
            self.close("malformed request from client: %s" % exc)
            return
        if out:
            self.upstream.transport.writelines(out)
        if self.mute_due and cutter.at_boundary:
            self._start_mute()

    def _throttle_client(self, delay_ms, reading_request=False):
        """Read nothing more from the client for ``delay_ms``, from the end of
        the request being read (so that request reaches the broker whole).
        ``reading_request``: called while a request's head is being admitted."""
        if delay_ms <= self.mute_due:
            return
        self.mute_due = delay_ms
        cutter = self.requests_in
        if not reading_request and cutter.at_boundary:
            self._start_mute()
        else:
            cutter.stop_after_frame = True

    def _on_request_head(self, head, frame_len):
        try:
            return self._admit_request(head, frame_len)
        except ProtocolError:
            if len(head) < frame_len:
                return WHOLE  # a header longer than HEAD_SIZE: look at all of it
            raise

    def _on_whole_request(self, frame):
        result = self._admit_request(frame, len(frame))
        if result == DROP:
            return None
        return frame if result == PASS else result

    def _quotas(self, client_id):
        manager = self.server.quotas
        if manager is None:
            return None
        quotas = self.client_quotas.get(client_id)
        if quotas is None:
            if len(self.client_quotas) >= CLIENT_IDS_KEPT:
                self.client_quotas.clear()  # a client cycling client-ids: start over
            quotas = self.client_quotas[client_id] = manager.client(self.principal, client_id)
        return quotas

    def _admit_request(self, head, frame_len):
        """Account for one request from its first bytes: PASS it on, DROP it,
        or return a patched head to pass on instead."""
        api_key, api_version, correlation_id, client_id = parse_request_header(head)
        limit = MAX_DECODABLE_VERSION.get(api_key)
        if limit is not None and api_version > limit:
            if api_key != API_VERSIONS:
                raise ProtocolError(
                    "request api_key %d v%d is newer than the proxy can decode (max v%d)"
                    % (api_key, api_version, limit)
                )
            # Answer as a broker would: UNSUPPORTED_VERSION, retry lower.
            self.requests += 1
            answer = unsupported_api_versions_response(correlation_id)
            if self.pending:
                self.pending.append(
                    (correlation_id, api_key, api_version, False, answer, None, 0)
                )
            else:
                self.client.transport.write(answer)
            return DROP
        acks_0 = api_key == PRODUCE and produce_acks(head, api_version) == 0
        self.requests += 1
        quotas = self._quotas(client_id or "")
        if quotas is not None and api_key == FETCH and fetch_replica_id(head, api_version) >= 0:
            # replication is not a client: no client quota applies (KIP-124
            # exempts it from request quotas; Kafka has replication quotas)
            quotas = None
        delay = 0
        result = PASS
        if quotas is not None:
            now = self.server.loop.time()
            if not acks_0 and api_key not in REQUEST_QUOTA_EXEMPT:
                delay = quotas.record_request(now)
            if api_key == PRODUCE:
                # the whole request counts, as in Kafka (data is accepted,
                # then the client is throttled)
                delay = max(delay, quotas.record_produce(frame_len, now))
            elif api_key == FETCH:
                result = self._cap_fetch(head, api_version, quotas)
        if delay:
            # Stop reading after this request, not when its answer comes: a
            # client that pipelines would otherwise push many more requests
            # past the quota first (a broker reads one request at a time
            # from a channel).
            self._throttle_client(delay, reading_request=True)
        if acks_0:
            # acks=0: Kafka sends no response. Some brokers (Tansu) do anyway,
            # which trips clients that expect none (aiokafka fails its
            # connection): remember the ids to drop such answers.
            self.unanswered.append(correlation_id)
            return result
        self.pending.append(
            (correlation_id, api_key, api_version, needs_rewrite(api_key, api_version), None,
             quotas, delay)
        )
        return result

    @staticmethod
    def _cap_fetch(head, api_version, quotas):
        """Cap a consumer's fetch at what its quota allows in one window, as
        Kafka does, so one response cannot carry minutes of quota."""
        cap = quotas.fetch_max_bytes()
        if cap is None:
            return PASS
        offset = fetch_max_bytes_offset(head, api_version)
        if offset is None or offset + 4 > len(head):
            return PASS
        cap = max(int(cap), 1)
        if INT32.unpack_from(head, offset)[0] <= cap:
            return PASS
        patched = bytearray(head)
        INT32.pack_into(patched, offset, cap)
        return bytes(patched)

    def eof_received(self):
        try:
            self.requests_in.eof()
        except ProtocolError as exc:
            self.close("client disconnected: %s" % exc)
        else:
            self.close("client disconnected")
        return False

    def connection_lost(self, exc):
        self.close("client connection lost: %s" % exc if exc else "client disconnected")

    def pause_writing(self):
        self.upstream.pause("client write buffer full")

    def resume_writing(self):
        self.upstream.resume("client write buffer full")

    # upstream side -----------------------------------------------------

    def upstream_data(self, data):
        self.bytes_from_upstream += len(data)
        try:
            out = self.response_out = []
            self.responses_in.feed(data, out)
            pending = self.pending
            if pending and pending[0][4] is not None and self.responses_in.at_boundary:
                self._flush_local_answers(out)
        except ProtocolError as exc:
            self.close("malformed response from broker %s: %s" % (self.upstream_addr, exc))
            return
        except ValueError as exc:  # an address the proxy cannot advertise
            self.close(str(exc))
            return
        if self.held is not None:
            self.held += out
            return
        if self.hold_from is not None:
            out, self.held = out[: self.hold_from], out[self.hold_from :]
            self.hold_from = None
            self.upstream.pause("holding a throttled response")
            self._schedule_release()
        if out:
            self.client.transport.writelines(out)

    def _flush_local_answers(self, out):
        pending = self.pending
        while pending and pending[0][4] is not None:
            out.append(pending.popleft()[4])

    def _on_response_head(self, head, frame_len):
        correlation_id = response_correlation_id(head)
        pending = self.pending
        if pending and pending[0][4] is not None:
            # answers the proxy gave itself, due after the previous response
            self._flush_local_answers(self.response_out)
        if not pending or pending[0][0] != correlation_id:
            if correlation_id in self.unanswered:
                self.unanswered.remove(correlation_id)
                return DROP  # an answer to acks=0 that Kafka would not send
            raise ProtocolError(
                "response correlation id %d, expected %s"
                % (correlation_id, pending[0][0] if pending else "none")
            )
        _, api_key, api_version, rewrite, _, quotas, delay = pending.popleft()
        if quotas is not None:
            if api_key == FETCH:
                # a fetch counts its response size. The response is forwarded
                # whole even when over quota: Kafka answers an over-quota
                # fetch with an empty response, but a proxy that did so would
                # drop records the broker already counted as sent to an
                # incremental fetch session (KIP-227). The client is made to
                # wait instead, and its fetch size is capped (see _cap_fetch).
                fetch_delay = quotas.record_fetch(frame_len, self.server.loop.time())
                if fetch_delay > delay:
                    delay = fetch_delay
                    self._throttle_client(delay)
            if delay:
                return self._throttle(head, api_key, api_version, rewrite, delay)
        if rewrite:
            self.rewriting = (api_key, api_version, True, 0)
            return WHOLE
        return PASS

    def _on_whole_response(self, frame):
        api_key, api_version, rewrite, delay = self.rewriting
        if rewrite:
            new_frame, nodes = rewrite_response(frame, api_key, api_version, self.server.advertise)
            if nodes:
                self.server.learn_nodes(nodes)
            if new_frame is not None:
                frame = new_frame
        if delay:
            patched = raise_throttle_time(frame, api_key, api_version, delay)
            if patched is not None:
                frame = patched
        return frame

    # throttling ----------------------------------------------------------

    def _throttle(self, head, api_key, api_version, rewrite, delay):
        """Hold the client to ``delay`` ms whatever it does (KIP-219): clients
        of new enough versions are answered at once and not read from for the
        delay, older ones get their response after the delay. Either way the
        response says throttle_time_ms."""
        # The client is not read from meanwhile (see _throttle_client): that
        # is what holds librdkafka, which ignores the field and keeps up to a
        # million requests in flight.
        first = clients_back_off_from(api_key)
        if first is None or api_version < first:
            self._hold_response(delay)
        if rewrite:
            self.rewriting = (api_key, api_version, True, delay)
            return WHOLE
        offset = throttle_time_patch(head, api_key, api_version)
        if offset is not None:
            if INT32.unpack_from(head, offset)[0] >= delay:
                return PASS
            patched = bytearray(head)
            INT32.pack_into(patched, offset, delay)
            return bytes(patched)
        if throttle_time_offset(api_key, api_version) is not None:  # WALK, or past the head
            self.rewriting = (api_key, api_version, False, delay)
            return WHOLE
        return PASS

    def _start_mute(self):
        delay_ms, self.mute_due = self.mute_due, 0
        cutter = self.requests_in
        cutter.stop_after_frame = False
        rest, cutter.rest = cutter.rest, None
        if self.unread is None:
            self.unread = []
        if rest:
            self.unread.insert(0, rest)
        loop = self.server.loop
        until = loop.time() + delay_ms / 1000.0
        if until <= self.muted_until:
            return
        self.muted_until = until
        self.client.pause("throttled")
        if self.unmute_timer is not None:
            self.unmute_timer.cancel()
        self.unmute_timer = loop.call_at(until, self._unmute_client)

    def _unmute_client(self):
        self.unmute_timer = None
        unread, self.unread = self.unread, None
        for i, data in enumerate(unread or ()):
            if self.closed:
                return
            if self.unread is not None:  # throttled again on the way
                self.unread.extend(unread[i:])
                return
            self.data_received(data)
        if self.unread is None:
            self.client.resume("throttled")

    def _hold_response(self, delay_ms):
        until = self.server.loop.time() + delay_ms / 1000.0
        self.hold_until = max(self.hold_until, until)
        if self.held is None and self.hold_from is None:
            self.hold_from = len(self.response_out)
        elif self.held is not None:
            self._schedule_release()

    def _schedule_release(self):
        if self.release_timer is not None:
            self.release_timer.cancel()
        self.release_timer = self.server.loop.call_at(self.hold_until, self._release_held)

    def _release_held(self):
        self.release_timer = None
        held, self.held = self.held, None
        if self.closed:
            return
        if held:
            self.client.transport.writelines(held)
        self.upstream.resume("holding a throttled response")

    def close(self, reason):
        if self.closed:
            return
        self.closed = True
        self.server.connections.discard(self)
        for timer in (self.unmute_timer, self.release_timer):
            if timer is not None:
                timer.cancel()
        for side in (self.client, self.upstream):
            if side.transport is not None:
                side.transport.close()
        log.info(
            "connection %d closed: %s (client %s, broker %s, %d requests, %d bytes in, %d bytes out)",
            self.conn_id, reason, self.peer, self.upstream_addr, self.requests,
            self.bytes_from_client, self.bytes_from_upstream,
        )


class UpstreamConnection(asyncio.Protocol):
    """Protocol for the proxy's connection to a broker, owned by a ClientConnection."""

    __slots__ = ("owner",)

    def __init__(self, owner):
        self.owner = owner

    def connection_made(self, transport):
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        self.owner.upstream.transport = transport

    def data_received(self, data):
        self.owner.upstream_data(data)

    def eof_received(self):
        self.owner.close("broker closed the connection")
        return False

    def connection_lost(self, exc):
        self.owner.close("broker connection lost: %s" % exc if exc else "broker closed the connection")

    def pause_writing(self):
        self.owner.client.pause("broker write buffer full")

    def resume_writing(self):
        self.owner.client.resume("broker write buffer full")
