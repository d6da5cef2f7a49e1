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
from ..codecs.frames import DROP, MIN_REQUEST_SIZE, MIN_RESPONSE_SIZE, PASS, WHOLE, FrameCutter
from ..codecs.apis import API_VERSIONS, MAX_DECODABLE_VERSION, PRODUCE, needs_rewrite

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
        self.rewriting = None  # (api_key, api_version) of the response being gathered
        self.response_out = None  # what upstream_data will write to the client
        # (correlation_id, api_key, api_version, rewrite?, local answer or None)
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
        self.bytes_from_client += len(data)
        try:
            out = self.requests_in.feed(data, [])
        except ProtocolError as exc:
            self.close("malformed request from client: %s" % exc)
            return
        if out:
            self.upstream.transport.writelines(out)

    def _on_request_head(self, head, frame_len):
        try:
            return self._admit_request(head)
        except ProtocolError:
            if len(head) < frame_len:
                return WHOLE  # a header longer than HEAD_SIZE: look at all of it
            raise

    def _on_whole_request(self, frame):
        return frame if self._admit_request(frame) == PASS else None

    def _admit_request(self, head):
        """Account for one request from its first bytes; PASS it on or DROP it."""
        api_key, api_version, correlation_id, _client_id = parse_request_header(head)
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
                self.pending.append((correlation_id, api_key, api_version, False, answer))
            else:
                self.client.transport.write(answer)
            return DROP
        acks_0 = api_key == PRODUCE and produce_acks(head, api_version) == 0
        self.requests += 1
        if acks_0:
            # acks=0: Kafka sends no response. Some brokers (Tansu) do anyway,
            # which trips clients that expect none (aiokafka fails its
            # connection): remember the ids to drop such answers.
            self.unanswered.append(correlation_id)
            return PASS
        self.pending.append(
            (correlation_id, api_key, api_version, needs_rewrite(api_key, api_version), None)
        )
        return PASS

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
        _, api_key, api_version, rewrite, _ = pending.popleft()
        if rewrite:
            self.rewriting = (api_key, api_version)
            return WHOLE
        return PASS

    def _on_whole_response(self, frame):
        api_key, api_version = self.rewriting
        new_frame, nodes = rewrite_response(frame, api_key, api_version, self.server.advertise)
        if nodes:
            self.server.learn_nodes(nodes)
        return frame if new_frame is None else new_frame

    def close(self, reason):
        if self.closed:
            return
        self.closed = True
        self.server.connections.discard(self)
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
