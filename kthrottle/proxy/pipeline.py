"""One client connection as a machine with no I/O and no clock of its own.

In the manner of h11's ``Connection``: bytes from the client, bytes from the
broker and timer ticks go in, each with ``now``; actions come out as plain
values for the asyncio adapter (``connection.py``) to carry out, in order.
Nothing here touches a socket, a loop or a clock, so every rule of a
connection is tested by feeding bytes.

Kafka answers requests in order on a connection, so a FIFO of in-flight
requests tells which response is which. What the proxy does to a request or
a response comes from a fixed list of filters (``filters/``). Each says,
per API key and version, whether it needs nothing of a frame, its head, the
whole frame, or (responses) a stream rewrite; the table of who looks at what
is built once, so an API no filter wants costs one dict lookup and passes
through as the bytes it came in as. A filter sees the connection only
through its own ``FilterContext`` (``filter.py``); the phases, buffers and
queues below are the pipeline's alone.
"""
import dataclasses
import enum
from collections import deque
from struct import Struct

from ..codecs import ProtocolError
from ..codecs.apis import FETCH, KNOWN_MAX_VERSION, PRODUCE
from ..codecs.frames import (
    DEFER,
    DROP,
    HEAD_SIZE,
    MIN_REQUEST_SIZE,
    MIN_RESPONSE_SIZE,
    PASS,
    WHOLE,
    FrameCutter,
    NeedHead,
)
from ..codecs.request import HeadTooShort, RequestHead, fetch_head, produce_acks
from ..codecs.stream import StreamRewriter
from ..codecs.throttle import (
    clients_back_off_from,
    raise_throttle_time,
    throttle_time_offset,
    throttle_time_patch,
)
from ..codecs.wire import INT16_INT16_INT32, INT32
from .filter import (  # noqa: F401 (the filter API, named here for the adapter and tests)
    ANONYMOUS,
    GATHER,
    HEAD,
    NOTHING,
    REFUSED_AUTHENTICATION,
    REFUSED_MALFORMED_REQUEST,
    REFUSED_UNAUTHENTICATED_REQUEST,
    STREAM,
    Answer,
    Defer,
    Filter,
    FilterContext,
    Forward,
    ForwardRaw,
    Gather,
    Observe,
    Pending,
    QuickFilter,
    QuickHead,
    Refuse,
    Replace,
    Throttle,
)

# Largest response accepted from a broker: responses are not bounded by
# socket.request.max.bytes (a Fetch answer is bounded by the client's
# fetch.max.bytes, 50 MiB by default); only an absurd size is refused.
MAX_RESPONSE_SIZE = 1 << 30

# A response up to this size goes to the client only once it is whole, so that
# a broker that dies in the middle of it never leaves the client half a frame
# (the client sees the connection close between frames). A larger one (a
# Fetch of many partitions) streams through as it comes, bounding what one
# connection holds to about this much.
WHOLE_RESPONSE_MAX = 1 << 20

# A read of several whole responses up to this size takes the short way
# (Connection.pass_response) when each would on its own: those a quick filter
# reads are copied for it, so a larger read goes the long way, which copies
# none.
SEVERAL_RESPONSES_MAX = 64 * 1024

# acks=0 Produce correlation ids remembered in case the broker answers them.
UNANSWERED_IDS_KEPT = 1024

# Client-ids whose quota lookups one connection keeps (clients send one; a
# connection that sends more is not given unbounded memory for them).
CLIENT_IDS_KEPT = 64

# A timer that fires this close to its deadline counts as due (event loops
# round timers to the millisecond, and may fire a fraction of one early).
TIMER_SLACK = 0.002

# Correlation ids of the proxy's own requests to the broker start here (any
# int32 works: the broker echoes it and responses are matched in order).
INTERNAL_CORRELATION_BASE = 0x7F000000


class Phase(enum.Enum):
    CONNECTING = "connecting"  # the broker connection is not up yet
    AUTHENTICATING = "authenticating"  # a filter holds the connection until it knows the principal
    READY = "ready"
    CLOSED = "closed"


class Reading(enum.Enum):
    """The request side's state, beside the phase (Connection.reading),
    made of the fields named; the first that holds is the state."""
    STOPPED = "stopped"  # muted or waiting on a job: nothing is read, what comes is kept (_unread)
    STOP_DUE = "stop due"  # a mute or a wait starts once the request being read is in
    RAW_TOKENS = "raw tokens"  # SASL tokens without Kafka framing (raw_request: SaslHandshake v0)
    FLOWING = "flowing"  # requests are read and passed on


class Responding(enum.Enum):
    """The response side's state (Connection.responding), made of the fields
    named; the first that holds is the state. The response in progress may
    also be gathered whole (_gathering) or streamed through a rewrite
    (_streaming), whatever the state."""
    HOLDING = "holding"  # responses held back for an old client's throttle (_held, _hold_from)
    RAW_ANSWERS = "raw answers"  # answers to raw SASL tokens awaited (_raw_in_flight)
    FLOWING = "flowing"


# globals are read faster than Enum members (hot path)
_READY = Phase.READY
_STOPPED = Reading.STOPPED
_STOP_DUE = Reading.STOP_DUE
_RAW_TOKENS = Reading.RAW_TOKENS
_FLOWING = Reading.FLOWING
_HOLDING = Responding.HOLDING
_RAW_ANSWERS = Responding.RAW_ANSWERS
_PASSING = Responding.FLOWING
# a frame's size and request header, or its size and correlation id (pass_request/pass_response)
_FRAME_HEAD = Struct(">ihhi")
_RESPONSE_HEAD = Struct(">ii")
_CONNECTING = Phase.CONNECTING
_CLOSED = Phase.CLOSED
# pass_response: nothing to send the client yet
HELD = "held"


# Actions: what the adapter must do, in the order given. Plain values; small
# slotted classes rather than NamedTuples, which cost twice as much to make
# (one or two are made per read on the hot path).

class _Value:
    """An action: equal to another of its class with the same fields (the
    slots of its class and of those it derives from, ``_fields``)."""

    __slots__ = ()
    _fields = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fields = tuple(name for klass in reversed(cls.__mro__)
                            for name in klass.__dict__.get("__slots__", ()))

    def __eq__(self, other):
        return type(self) is type(other) and all(
            getattr(self, k) == getattr(other, k) for k in self._fields)

    __hash__ = None

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__,
                           ", ".join("%s=%r" % (k, getattr(self, k)) for k in self._fields))


class _Send(_Value):
    __slots__ = ("chunks",)

    def __init__(self, chunks):
        self.chunks = chunks  # bytes-like objects, written in order


class SendToBroker(_Send):
    __slots__ = ()


class SendToClient(_Send):
    __slots__ = ()


class _Until(_Value):
    __slots__ = ("until",)

    def __init__(self, until):
        self.until = until


class PauseClient(_Until):
    """Read nothing from the client until ``until``; call tick() then.
    ``until`` None: until further notice (a job the pipeline waits on)."""

    __slots__ = ()


class ResumeClient(_Value):
    __slots__ = ()


class HoldResponses(_Until):
    """Read nothing more from the broker: responses are held back until
    ``until`` (an old client being throttled); call tick() then."""

    __slots__ = ()


class ResumeBroker(_Value):
    __slots__ = ()


class NodesSeen(_Value):
    """Broker addresses found in a response, before it reaches the client
    (the adapter opens a listener per new node id)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes):
        self.nodes = nodes


class ConnectUpstream(_Value):
    """Open the broker connection now (then call broker_connected). Read
    nothing from the client meanwhile: its bytes wait for the broker."""

    __slots__ = ()


class RunJob(_Value):
    """Run ``job()`` outside the pipeline (its result may be awaitable: a key
    derivation in a worker thread, a question to a broker), then call
    ``job_done(token, result, error, now)``."""

    __slots__ = ("job", "token")

    def __init__(self, job, token):
        self.job = job
        self.token = token


class SessionDeadline(_Value):
    """KIP-368: call tick() at ``until``; the connection closes then unless
    the client has re-authenticated (a later SessionDeadline)."""

    __slots__ = ("until",)

    def __init__(self, until):
        self.until = until


class Close(_Value):
    __slots__ = ("reason", "refused")

    def __init__(self, reason, refused=None):
        self.reason = reason
        # why the client was turned away (a failed login, a request before
        # authentication), for the refusal log and its counter; None for an
        # ordinary close
        self.refused = refused


RESUME_CLIENT = ResumeClient()
RESUME_BROKER = ResumeBroker()
CONNECT_UPSTREAM = ConnectUpstream()


class _Observed:
    """A request stream whose reader decides at the end of the frame;
    ``next``: another filter's, fed the same bytes (each Observe is kept)."""

    __slots__ = ("reader", "on_done", "ctx", "conn", "inflight", "next")

    def __init__(self, reader, on_done, ctx, conn, inflight, next_=None):
        self.reader = reader
        self.on_done = on_done
        self.ctx = ctx
        self.conn = conn
        self.inflight = inflight
        self.next = next_

    def feed(self, chunk, out):
        reader = self.reader
        reader.feed(chunk, out)
        if reader.done:
            verdict = self.on_done(self.ctx, reader)
            self.conn._earned(self.inflight, verdict, reading_request=True)
        if self.next is not None:
            self.next.feed(chunk, [])  # forwarded once, above


class _StreamObserved:
    """A response streaming on (through ``inner``, a filter's rewriter, if
    any) while another filter's reader reads it (its ``stream`` answered
    Observe). Once the frame is through, the reader's verdict throttles the
    client: the response's head has gone, so it is not read for that long."""

    __slots__ = ("inner", "reader", "on_done", "ctx", "conn", "inflight", "done", "nodes")

    def __init__(self, inner, observe, ctx, conn, inflight):
        self.inner = inner
        self.reader = observe.stream
        self.on_done = observe.on_done
        self.ctx = ctx
        self.conn = conn
        self.inflight = inflight
        self.done = False
        self.nodes = inner.nodes if inner is not None else ()

    def feed(self, chunk, out):
        inner = self.inner
        reader = self.reader
        if inner is None:
            reader.feed(chunk, out)
        else:
            start = len(out)
            inner.feed(chunk, out)
            sink = []
            for piece in out[start:]:  # what the rewriter let out, in order
                reader.feed(piece, sink)
        if reader.done and (inner is None or inner.done):
            self.done = True
            verdict = self.on_done(self.ctx, reader)
            self.conn._earned(self.inflight, verdict)


class Route:
    """What the filters do with requests and responses of one API key and
    version (FilterTable): each side's need (the most any filter has) and
    its filters, as (filter, its place in the table) pairs. A quick route
    (FilterTable.quick: a Produce or Fetch whose filters all judge a request
    from its head, QuickFilter) also names the filters that have a
    quick_ready, a quick_judge and a quick_check of their own."""

    __slots__ = ("request_need", "request_filters", "response_need", "response_filters",
                 "quick", "quick_ready", "quick_judge", "quick_check")

    def __init__(self, request_need, request_filters, response_need, response_filters):
        self.request_need = request_need
        self.request_filters = request_filters
        self.response_need = response_need
        self.response_filters = response_filters
        self.quick = False
        self.quick_ready = self.quick_judge = self.quick_check = ()

    def quickened(self):
        """This route as a quick one (a copy)."""
        route = Route(self.request_need, self.request_filters, self.response_need,
                      self.response_filters)
        filters = self.request_filters
        route.quick = True
        route.quick_ready = _overriding(filters, "quick_ready")
        route.quick_judge = _overriding(filters, "quick_judge")
        route.quick_check = _overriding(filters, "quick_check")
        return route


class QuickResponse:
    """The filters of a response that each read at most its head and have a
    quick_response_ready (``readies``) or a quick_response_head (``heads``)
    of their own (FilterTable.quick_heads)."""

    __slots__ = ("readies", "heads")

    def __init__(self, readies, heads):
        self.readies = readies
        self.heads = heads


class FilterTable:
    """Who looks at what, per (api key, version), built once at start-up:
    a Route each."""

    def __init__(self, filters):
        self.filters = tuple(filters)
        self._routes = {}
        self._authenticating = {}
        for api_key, newest in KNOWN_MAX_VERSION.items():
            for version in range(newest + 2):  # one past: a too-new client
                self._routes[api_key, version] = self._build(api_key, version)
                self._authenticating[api_key, version] = self._build(api_key, version, True)
        routes = self._routes
        # the routes no filter reads a request of (Connection.pass_request)
        self.plain = {key: route for key, route in routes.items()
                      if not route.request_need and not route.request_filters}
        # the Produce and Fetch routes whose filters all judge a request from
        # its head's usual fields (QuickFilter.quick)
        self.quick = {key: route.quickened() for key, route in routes.items()
                      if _judged_quickly(key, route)}
        # the responses whose filters all have a check for them
        # (QuickFilter.quick_response_check; without one a filter would
        # decline every one: not worth asking the rest): (key) -> those checks
        self.quick_responses = {}
        for key, route in routes.items():
            checks = tuple(_quick_response_check(f, key) for f, _ in route.response_filters)
            if checks and None not in checks:
                self.quick_responses[key] = checks
        # the responses whose filters each read at most their head and have
        # a quick_response_head or a quick_response_ready of their own: the
        # first read of one takes the short way when each is ready, its size
        # counted by the former: (key) -> QuickResponse
        self.quick_heads = {}
        for key, route in routes.items():
            filters = route.response_filters
            if filters and route.response_need <= STREAM:
                readies = _overriding(filters, "quick_response_ready")
                heads = _overriding(filters, "quick_response_head")
                if all(f in readies or f in heads for f in filters):
                    self.quick_heads[key] = QuickResponse(readies, heads)

    def _build(self, api_key, version, authenticating=False):
        if authenticating:
            request_needs = [(f, f.authenticating_need(api_key, version)) for f in self.filters]
        else:
            request_needs = [(f, f.request_need(api_key, version)) for f in self.filters]
        request_filters = tuple((f, i) for i, (f, need) in enumerate(request_needs) if need)
        request_need = max((need for _, need in request_needs), default=0)
        needs = [(f, f.response_need(api_key, version)) for f in self.filters]
        response_filters = tuple((f, i) for i, (f, need) in enumerate(needs) if need)
        response_need = max((need for _, need in needs), default=0)
        return Route(request_need, request_filters, response_need, response_filters)

    def lookup(self, api_key, api_version):
        route = self._routes.get((api_key, api_version))
        if route is None:
            # an API or version kafka-python does not know: not kept, so that
            # a client sending garbage keys cannot grow the table
            route = self._build(api_key, api_version)
        return route

    def lookup_authenticating(self, api_key, api_version):
        route = self._authenticating.get((api_key, api_version))
        if route is None:
            route = self._build(api_key, api_version, True)
        return route


def _judged_quickly(key, route):
    """Whether requests of ``key`` take the short way judged: a Produce or a
    Fetch (a Produce's filters have no quick_check: checks are a Fetch's)
    read at most to its head, by quick filters only."""
    api_key = key[0]
    filters = route.request_filters
    if api_key != FETCH and (api_key != PRODUCE or _overriding(filters, "quick_check")):
        return False
    return (route.request_need == HEAD and bool(filters)
            and all(isinstance(f, QuickFilter) and f.quick(*key) for f, _ in filters))


def _quick_response_check(f, key):
    return f.quick_response_check(*key) if isinstance(f, QuickFilter) else None


def _overriding(filters, method):
    """Those of ``filters`` ((filter, index) pairs) that are quick filters
    (QuickFilter) whose class has its own ``method``, not QuickFilter's."""
    default = getattr(QuickFilter, method)
    return tuple((f, i) for f, i in filters
                 if isinstance(f, QuickFilter) and getattr(type(f), method) is not default)


class InFlight:
    """A request sent to the broker (or answered by the proxy) whose
    response the client is still owed."""

    __slots__ = ("correlation_id", "api_key", "api_version", "answer",
                 "throttle_ms", "throttle_reason", "response_need",
                 "response_filters", "on_response", "raw_answer", "ctx", "notes", "replaced")

    def __init__(self, correlation_id, api_key, api_version, response_need=NOTHING,
                 response_filters=()):
        self.correlation_id = correlation_id
        self.api_key = api_key
        self.api_version = api_version
        self.answer = None  # the proxy's own answer, sent in the response's turn
        self.throttle_ms = 0  # what the request earned (Throttle)
        self.throttle_reason = None
        self.response_need = response_need
        self.response_filters = response_filters
        self.on_response = None  # a filter's own request: who gets the answer
        self.raw_answer = None  # a raw token forwarded: who gets the raw answer (ForwardRaw)
        self.ctx = None  # the context of the filter that gets one of those
        self.notes = None  # filter -> its record of this request (FilterContext.note)
        # an Answer a filter gave for the response's head: sent in its place
        self.replaced = None

    def again(self, correlation_id, api_key, api_version, response_need, response_filters):
        """This InFlight, whose response went on as it came with nothing to
        do (Connection.pass_response), stands for another request: as new,
        without the allocations and the type call of making one (a quarter
        of the cache lines a short-way Produce exchange misses from cold
        caches, as it runs in a proxy: frame_cost.py --cold)."""
        self.correlation_id = correlation_id
        self.api_key = api_key
        self.api_version = api_version
        self.response_need = response_need
        self.response_filters = response_filters
        # (answer, throttle_ms and on_response are as new: see _spare)
        self.throttle_reason = self.raw_answer = self.ctx = self.notes = self.replaced = None

    def __repr__(self):
        return "InFlight(%d, api %d v%d)" % (self.correlation_id, self.api_key, self.api_version)


class KnownHead:
    """What the short way keeps of the last Produce or Fetch request head a
    connection sent (Connection._heads), to compare the next one with: its
    version, its bytes from the client-id's length to acks or to max_bytes
    (``head``), whether it is answered (a Produce with acks 1 or -1, any
    Fetch), the least frame length its reader reads it in, its quick
    filters' judges and checks, its route, and the callable that leases
    quota to the requests of that head (QuickFilter.quick_lease) or None."""

    __slots__ = ("version", "head", "answered", "least", "judges", "checks", "route", "lessor")

    def __init__(self, version, head, answered, least, judges, checks, route, lessor):
        self.version = version
        self.head = head
        self.answered = answered
        self.least = least
        self.judges = judges
        self.checks = checks
        self.route = route
        self.lessor = lessor


# the short way's small records: slotted, compared by identity
_record = dataclasses.dataclass(slots=True, eq=False)


@_record
class _Mark:
    """A request of a read to judge (Connection._requests): its InFlight,
    its head, its length and where it ends in the read."""

    inflight: InFlight
    known: KnownHead
    frame_len: int
    end: int


@_record
class _Counting:
    """A response's first read that pass_response left to broker_data to
    count (FilterTable.quick_heads): the read, its InFlight, the filters
    counting it, and the response's length."""

    data: object
    inflight: InFlight
    filters: tuple
    frame_len: int


class _Refused(Exception):
    def __init__(self, reason, refused=None):
        super().__init__(reason)
        self.refused = refused


_RAW = object()  # a raw token being gathered (see Connection.raw_request)


class Connection:
    """The pipeline of one client connection and its broker connection."""

    def __init__(self, table, max_frame_size, quotas=None, max_receive_before_auth=None,
                 whole_response_max=WHOLE_RESPONSE_MAX):
        self.table = table
        self.quota_manager = quotas  # policy QuotaManager, or None
        self.phase = Phase.CONNECTING
        self._principal = ANONYMOUS
        self.client_host = None  # the client's IP address as text (ACLs' hosts), once accepted
        self.max_frame_size = max_frame_size
        # Kafka's sasl.server.max.receive.size: frames are capped at this
        # until the client has authenticated
        self.max_receive_before_auth = max_receive_before_auth or max_frame_size
        self.upstream_connected = False
        self._authenticator = None  # the filter holding the connection until authenticated
        self._jobs = {}  # token -> (InFlight, on_done): answers a job will give
        self._next_job = 0
        self._wait_due = False  # stop reading once the request being read is in
        self._in_job = False  # within job_done
        # set by a filter with expect_raw(): the next request frames are not
        # Kafka requests but raw tokens (SASL after SaslHandshake v0):
        # (handler, its filter's context)
        self.raw_request = None
        self._raw_in_flight = 0  # raw tokens forwarded, their answers not yet in
        self._close_when_released = None
        self._upstream_waiting = 0  # filters still logging in to the broker
        self.now = 0.0  # the time given with the current input
        self.client_quotas = {}  # (principal, client-id) -> policy ClientQuotas
        self.node_id = None  # the broker this connection talks to, when one node's listener
        self.requests_in = FrameCutter(self._request_head, self._whole_request,
                                       max_frame_size, MIN_REQUEST_SIZE)
        self.responses_in = FrameCutter(self._response_head, self._whole_response,
                                        MAX_RESPONSE_SIZE, MIN_RESPONSE_SIZE)
        self.pending = deque()  # InFlight, in the order the broker will answer
        self.unanswered = None  # acks=0 correlation ids (a deque from the first)
        self.muted_until = 0.0  # the client is not read until then (throttled)
        self.hold_until = 0.0  # responses are held until then (old clients)
        self.session_deadline = None  # KIP-368: closed then unless re-authenticated
        self.requests = 0
        self.bytes_from_client = 0
        self.bytes_from_broker = 0
        self._early = []  # client bytes that came before the broker connection
        self._early_bytes = 0
        self._unread = None  # client bytes received since a mute began, in order
        self._mute_due = 0  # ms to mute for once the request being read is in
        self._held = None  # responses held back for an old client's throttle
        self._hold_from = None  # index in the response output where holding starts
        self.reading = _FLOWING  # the request side's state (_reading_now)
        self.responding = _PASSING  # the response side's (_responding_now)
        self._actions = None  # the actions of the current input
        self._to_broker = None  # the request output of the current input
        self._to_client = None  # the response output of the current input
        self._partial = None  # a response not yet whole (see WHOLE_RESPONSE_MAX)
        self.whole_response_max = whole_response_max
        self._internal = []  # the proxy's own requests waiting for a frame boundary
        # requests whose responses a filter asked for whole (FilterContext.gather_response):
        # no response takes the short way while one is awaited
        self._gathered_for = None  # (a set from the first)
        self._next_internal_id = INTERNAL_CORRELATION_BASE
        self._gathering = None  # the InFlight whose response is being gathered whole
        self._streaming = None  # the rewriter of the response being streamed
        self._request_gathered = None  # the entry of a request being gathered whole
        self._admitting_whole = False  # its filters are being asked (Gather, Replace)
        # each filter's view of this connection, in the table's order
        self.contexts = tuple(FilterContext(self, f, f.new_state()) for f in table.filters)
        self._plain = table.plain
        self._quick = table.quick
        # the last Produce and the last Fetch head pass_request read, by api key
        self._heads = [None, None]
        # the lease the Produce head's requests take from (Filter.quick_lease)
        self._lease = None
        # an InFlight whose response pass_response passed with nothing to do
        # (no filter had anything to do with it, no answer, throttle or
        # callback: no one else holds it): the short way's next request takes
        # it (InFlight.again)
        self._spare = None
        # (data, InFlight, the filters, its size): a response's first read
        # pass_response left to broker_data to count (FilterTable.quick_heads)
        self._counting = None
        self._quick_heads = table.quick_heads
        self._quick_responses = table.quick_responses

    # inputs -----------------------------------------------------------

    def client_accepted(self, now, principal=None):
        """The client connection is accepted (its TLS handshake done;
        ``principal``: the one its certificate maps to, on an SSL listener).
        Where a filter authenticates the client itself, the client is read at
        once and the broker connected only once it has authenticated;
        otherwise the broker is connected first (ConnectUpstream)."""
        self.now = now
        if principal is not None:
            self.principal = principal
        actions = self._actions = []
        for ctx in self.contexts:
            ctx._filter.on_accept(ctx)
        if self.phase is Phase.AUTHENTICATING:
            actions.append(RESUME_CLIENT)
        else:
            actions.append(CONNECT_UPSTREAM)
        return actions

    @property
    def principal(self):
        """Who the client is (ANONYMOUS until named)."""
        return self._principal

    @principal.setter
    def principal(self, principal):
        self._principal = principal
        # the heads pass_request keeps were judged for the one before (_read_head)
        self._heads[0] = self._heads[1] = None
        self._drop_lease()

    @property
    def authenticating(self):
        return self.phase is Phase.AUTHENTICATING

    def begin_authentication(self, by):
        """Filter ``by`` holds the connection until the client has
        authenticated (FilterContext.begin_authentication): only its
        requests are accepted (authenticating_need), and frames are capped
        at max_receive_before_auth."""
        if self._authenticator is not None:
            raise RuntimeError("filter %s: the connection is already authenticated by %s"
                               % (by.name, self._authenticator.name))
        self._authenticator = by
        self.phase = Phase.AUTHENTICATING
        self.requests_in.max_frame_size = self.max_receive_before_auth

    def authenticated(self, principal, by):
        """The authenticating filter's verdict, given once: the connection's
        principal for its life. Without a broker connection yet, it is opened
        now and the client's next bytes wait for it."""
        if by is not self._authenticator or self.phase is not Phase.AUTHENTICATING:
            raise RuntimeError("filter %s named a principal without holding the connection "
                               "for authentication" % by.name)
        self.principal = principal
        self.requests_in.max_frame_size = self.max_frame_size
        if self.upstream_connected:
            self.phase = Phase.READY
            return
        self.phase = Phase.CONNECTING
        if not self._in_job:  # within a request: what follows it waits in _early
            self.requests_in.stop_after_frame = True
        self._actions.append(CONNECT_UPSTREAM)

    def broker_connected(self, now):
        """The broker connection is up. Filters that must first talk to the
        broker themselves (the proxy's own SASL login) do so while the
        client waits; then the client's bytes are replayed."""
        self.now = now
        actions = self._actions = []
        if self.phase is not Phase.CONNECTING or self._upstream_waiting:
            return actions
        self.upstream_connected = True
        for ctx in self.contexts:
            if ctx._filter.on_upstream(ctx):
                self._upstream_waiting += 1
        if self._upstream_waiting:
            requests = []
            self._flush_internal(requests)
            actions.append(SendToBroker(requests))
            return actions
        self._client_may_start(actions)
        return actions

    def upstream_ready(self, ok=True, reason=None):
        """A filter's exchange with the broker is over (from its response
        callback); the last one lets the client in, a failure closes."""
        if not ok:
            self._close(reason or "the broker refused the proxy")
            return
        self._upstream_waiting -= 1
        if not self._upstream_waiting:
            self._client_may_start(self._actions)

    def _client_may_start(self, actions):
        self.phase = Phase.READY
        for ctx in self.contexts:
            ctx._filter.on_connect(ctx)
        early, self._early = self._early, []
        if not self._client_bytes(early, actions):
            return
        if self.reading is not _STOPPED:
            actions.append(RESUME_CLIENT)

    def pass_request(self, data, now=None):
        """The short way for the common read: ``data`` holds the rest of a
        request being passed on, whole requests, and the start of one whose
        head is in, the connection is in no special state, and no filter
        looks at these requests (FilterTable.plain) but those that filters
        may judge quickly (FilterTable.quick; ``now`` given). Then they are
        counted and awaited as client_data would, and the answer says:
        forward ``data`` as it is (True), or carry out these actions instead
        (a list: a request earned a mute, so what follows it waits). False:
        nothing was done, call client_data (which also gives every error)."""
        cutter = self.requests_in
        if (self.phase is not _READY or self.reading is not _FLOWING or self._internal
                or cutter.head or cutter.stop_after_frame):
            return False
        pending = self.pending
        if pending and pending[0].answer is not None:
            return False  # client_data sends it
        n = len(data)
        pos = cutter.left
        if pos:  # the rest of a request already on its way
            mode = cutter.mode
            if mode.__class__ is not int or mode != PASS:
                return False
            if pos >= n:
                cutter.went_by(n)
                self.bytes_from_client += n
                return True
        elif n >= 12:
            one = self._one_request(data, n, now)
            if one is not None:
                return one
        return self._requests(data, n, pos, now)

    def _one_request(self, data, n, now):
        """pass_request's commonest read: one whole request, or the start of
        one longer than the read (head in), most often of the head read last
        (a producer's, or a judged consumer's: _heads), as a client sends
        request after request; written out, lease and readiness checks too,
        as a call costs. None: not that read (_requests takes it)."""
        size, api_key, api_version, correlation_id = _FRAME_HEAD.unpack_from(data)
        total = size + 4
        cutter = self.requests_in
        if total < n or size > cutter.max_frame_size or total > n and n < HEAD_SIZE:
            return None
        known = self._heads[api_key] if api_key in (0, 1) else None  # PRODUCE, FETCH
        # (a frame that holds the head meets min_frame_size; a whole one that
        # ends at the head or just past it goes on, as the long way passes it)
        if (known is not None and known.version == api_version and known.answered
                and data.startswith(known.head, 12) and (total == n or total >= known.least)):
            route = known.route
        elif api_key != PRODUCE and size >= cutter.min_frame_size:
            route = self._plain.get((api_key, api_version))
            if route is None:
                return None
            known = None  # nothing reads it (a Fetch without quotas)
        else:
            return None
        inflight = self._spare  # (see _spare)
        if inflight is None:
            inflight = InFlight(correlation_id, api_key, api_version, route.response_need,
                                route.response_filters)
        else:
            self._spare = None
            inflight.again(correlation_id, api_key, api_version, route.response_need,
                           route.response_filters)
        delay = 0
        if known is not None and route.quick:  # judged (FilterTable.quick)
            if now is None:
                return False
            lease = self._lease  # a Produce's (KnownHead.lessor); as Lease.take
            if (lease is not None and not api_key and lease.bytes_left >= total
                    and lease.requests_left and now < lease.until):
                lease.bytes_left -= total
                lease.requests_left -= 1
            else:  # not in the lease: judged, when each quick filter is ready
                contexts = self.contexts
                for f, i in route.quick_ready:
                    if not f.quick_ready(contexts[i]):
                        return False
                self.now = now  # (a check may read it)
                for check in known.checks:
                    if not check(data):
                        return False
                delay = self._judged(known, inflight, total, now)
                if delay < 0:
                    return False  # its quota is owed: the long way holds it
                if not delay and not api_key and known.lessor is not None:
                    self._renew_lease(known.lessor, total, now)
        self.bytes_from_client += n
        self.requests += 1
        self.pending.append(inflight)
        if total > n:  # it goes on in the next reads
            cutter.pass_rest(total - n)
        return self._mute_for(delay, data, total) if delay else True

    def _ready(self, route):
        """Whether each quick filter of ``route`` lets its request take the
        short way now (QuickFilter.quick_ready)."""
        contexts = self.contexts
        for f, i in route.quick_ready:
            if not f.quick_ready(contexts[i]):
                return False
        return True

    def _requests(self, data, n, pos, now):
        """pass_request's general read, from ``pos``: whole requests and the
        start of one, each admitted as client_data would (one quick route at
        most per read, its requests judged in order: _judge_all)."""
        cutter = self.requests_in
        plain = self._plain
        quick = self._quick if now is not None else None
        max_size = cutter.max_frame_size
        min_size = cutter.min_frame_size
        admitted = []
        judged = None  # the quick route of the requests to judge (one per read)
        marks = None  # theirs, in order
        while pos < n:
            available = n - pos
            if available < 12:
                return False
            size, api_key, api_version, correlation_id = _FRAME_HEAD.unpack_from(data, pos)
            route = plain.get((api_key, api_version))
            if route is None:
                if not quick:
                    return False
                route = quick.get((api_key, api_version))
                if route is None:
                    return False  # FilterTable.quick admits Produce and Fetch alone
                if judged is not route:
                    if judged is not None:
                        return False  # versions mixed in one read: the long way
                    judged = route
                    marks = []
            if size > max_size or size < min_size:
                return False
            end = pos + size + 4
            if end > n and available < HEAD_SIZE:
                return False  # the long way gathers this much first
            inflight = InFlight(correlation_id, api_key, api_version, route.response_need,
                                route.response_filters)
            if api_key == PRODUCE or route is judged:
                # a producer's head (client-id, transactional.id, acks) is the
                # same request after request, and a consumer's (client-id,
                # replica_id, max_bytes): read once, then compared
                known = self._heads[api_key]
                if (known is None or known.version != api_version or end < pos + known.least
                        or not data.startswith(known.head, pos + 12)):
                    known = self._read_head(
                        data if not pos and end == n else memoryview(data)[pos:end], api_key,
                        api_version, route)
                    if known is None:
                        return False  # unusual: the long way
                if not known.answered:
                    return False  # acks=0 awaits nothing (client_data notes it)
                if route is judged:
                    marks.append(_Mark(inflight, known, size + 4, end))
            admitted.append(inflight)
            pos = end
        delay = 0
        if judged is not None:
            judging = self._judge_all(judged, marks, admitted, data, now)
            if judging is None:
                return False
            delay, end = judging
            if end is not None:
                pos = end
        self.bytes_from_client += n
        self.requests += len(admitted)
        self.pending.extend(admitted)
        # the last one goes on in the next reads, or all are through
        cutter.pass_rest(pos - n if pos > n else 0)
        return self._mute_for(delay, data, pos) if delay else True

    def _judge_all(self, route, marks, admitted, data, now):
        """_requests: judge the requests of the quick ``route`` (``marks``,
        in order) after their checks; one that earns a delay is the last
        taken now (as the long way stops after it), and one whose quota is
        owed waits unread behind those before it (as a Defer on the long
        way): cut from ``admitted``. (delay, where the read stops or None),
        or None: the long way takes the whole read. A Produce of the head
        kept last takes from its lease as on _one_request, or renews it."""
        if not self._ready(route):
            return None
        self.now = now  # (a check may read it)
        for mark in marks:  # QuickFilter.quick_check (a Fetch's), before any is judged
            checks = mark.known.checks
            if checks:
                frame = memoryview(data)[mark.end - mark.frame_len:mark.end]
                for check in checks:
                    if not check(frame):
                        return None
        producing = self._heads[0]
        delay = 0
        for k, mark in enumerate(marks):
            known, inflight, frame_len, end = mark.known, mark.inflight, mark.frame_len, mark.end
            if known is producing:
                lease = self._lease
                if lease is not None and lease.take(frame_len, now):
                    continue
                delay = self._judged(known, inflight, frame_len, now)
                if not delay and known.lessor is not None:
                    self._renew_lease(known.lessor, frame_len, now)
            else:
                delay = self._judged(known, inflight, frame_len, now)
            if delay < 0:
                if not k:
                    return None  # nothing taken yet: the long way holds it
                del admitted[admitted.index(inflight):]
                return -delay, end - frame_len
            if delay:
                if end < len(data):  # what follows it waits for the mute's end
                    del admitted[admitted.index(inflight) + 1:]
                    return delay, end
                return delay, None
        return 0, None

    def _judged(self, known, inflight, frame_len, now):
        """The delay (ms, 0 for none) the quick filters' judges of a
        request's head ``known`` (QuickFilter.quick_judge) give ``inflight``,
        the longest of them; a Fetch's judge also notes what its response
        counts against. Negative: a judge deferred it (Defer), counting
        nothing: minus the time it waits."""
        delay = 0
        fetch = inflight.api_key  # PRODUCE is 0
        for judge in known.judges:
            verdict = judge(frame_len, now, inflight) if fetch else judge(frame_len, now)
            if verdict is None:
                continue
            if verdict.__class__ is Defer:
                # its quota is owed (the first judge, before any counted it):
                # not taken now (a negative delay says so)
                return -verdict.delay_ms
            if verdict.delay_ms > delay:
                delay = inflight.throttle_ms = verdict.delay_ms
                inflight.throttle_reason = verdict.reason
        return delay

    def _renew_lease(self, lessor, frame_len, now):
        """The Produce head's lease ran out (or there was none) and a request
        of ``frame_len`` earned no delay: what it took is counted, and a new
        one asked for."""
        self._drop_lease()  # (self.now is ``now``: set before the judges)
        self._lease = lessor(frame_len, now)

    def _drop_lease(self):
        """The Produce head's lease ends: what it took is counted (the head
        changes, the principal is named, the connection closes)."""
        lease = self._lease
        if lease is not None:
            self._lease = None
            self.quota_manager.settle(lease, self.now)

    def _read_head(self, frame, api_key, version, route):
        """What the short way keeps of a Produce or Fetch request's head
        ``frame`` (a KnownHead, in ``_heads``; dropped when the principal is
        named, as its judges count for the principal); None when
        produce_acks or fetch_head cannot read it."""
        if api_key == PRODUCE:
            found = produce_acks(frame, version)
            if found is None:
                return None
            acks, client_id, size, end = found
            head = QuickHead(PRODUCE, version, client_id, acks)
            least = max(end, 18 + size)
        else:
            found = fetch_head(frame, version)
            if found is None:
                return None
            client_id, replica_id, max_bytes, size, end = found
            head = QuickHead(FETCH, version, client_id, None, replica_id, max_bytes)
            acks = True
            least = end
        judges = checks = ()
        lessor = None
        if acks and route.quick:
            contexts = self.contexts
            judging = [(f, i, f.quick_judge(contexts[i], head)) for f, i in route.quick_judge]
            judges = tuple(judge for _, _, judge in judging if judge is not None)
            if api_key == FETCH:  # FilterTable.quick: a Produce's filters have none
                checks = tuple(check for check in (f.quick_check(contexts[i], head)
                                                   for f, i in route.quick_check)
                               if check is not None)
            elif (len(judges) == 1 and len(judging) == 1
                  and all(f.quick_ready_follows_quotas for f, _ in route.quick_ready)):
                # one judge, and readiness that a lease's settling follows
                (f, i, _), = judging
                lessor = f.quick_lease(contexts[i], head)
        if api_key == PRODUCE:
            self._drop_lease()  # it was for the head before
        known = self._heads[api_key] = KnownHead(version, bytes(frame[12:end]), bool(acks),
                                                 least, judges, checks, route, lessor)
        return known

    def _mute_for(self, delay, data, end):
        """What a delay earned on the short way does (as _throttle_client):
        the actions that forward ``data`` up to ``end``, the end of the
        request that earned it, and mute the client from there; what follows
        in ``data`` waits for the mute's end, as the long way keeps it."""
        n = len(data)
        actions = self._actions = [SendToBroker([data if end >= n else memoryview(data)[:end]])]
        self._throttle_client(delay, reading_request=True)  # from the end of that request
        cutter = self.requests_in
        if end < n:
            cutter.rest = data[end:]
        if cutter.at_boundary:
            self._start_mute()
        return actions

    def pass_response(self, data):
        """The same for the common read from the broker: the rest of a
        response being passed on, or all of the response awaited next, or
        its start (head in), when nothing looks at it and nothing is held.
        The answer says what to send the client now: ``data`` as it is
        (True), nothing yet (HELD: a response the long way also sends only
        once whole, WHOLE_RESPONSE_MAX), or the chunks of such a response
        that ``data`` completes (a list). False: nothing was done, call
        broker_data (which also gives every error, and counts a response
        whose filters only count its size: FilterTable.quick_heads)."""
        if (self.responding is not _PASSING or self._internal or self._gathered_for
                or self.phase is _CLOSED):
            return False
        cutter = self.responses_in
        if cutter.head:
            return False
        left = cutter.left
        if left:  # more of the response on its way (the commonest read of a large one)
            n = len(data)
            if n > left:
                return False  # more frames follow in this read
            mode = cutter.mode
            if mode.__class__ is not int or mode != PASS:
                # read by a filter; but records a NodeEndpoints rewrite skips go on as they are
                if mode.__class__ is not StreamRewriter or n == left or not mode.passes(n):
                    return False
            if n == left and self.pending and self.pending[0].answer is not None:
                return False  # an answer of the proxy's own follows: broker_data sends it
            cutter.went_by(n)
            self.bytes_from_broker += n
            partial = self._partial
            if partial is None:
                return True
            partial.append(data)
            if n < left:
                return HELD
            self._partial = None
            return partial
        pending = self.pending
        n = len(data)
        if not pending or n < 8 or self._streaming is not None:
            return False
        inflight = pending[0]
        need = inflight.response_need
        if inflight.throttle_ms or inflight.on_response is not None or inflight.answer is not None:
            return False
        size, correlation_id = _RESPONSE_HEAD.unpack_from(data)
        total = size + 4
        if (inflight.correlation_id != correlation_id or size > cutter.max_frame_size
                or size < cutter.min_frame_size):
            return False
        if total < n:  # more responses in this read
            return self._several_responses(data, n)
        if total == n:
            if len(pending) > 1 and pending[1].answer is not None:
                return False  # an answer of the proxy's own follows: broker_data sends it
            if need:  # read by filters: unless each has nothing to do with this one
                checks = self._quick_responses.get((inflight.api_key, inflight.api_version))
                if checks is not None:
                    for check in checks:
                        if not check(data):
                            return False
                elif not self._quick_head(data, inflight, total):
                    return False
            pending.popleft()
            self._spare = inflight  # no filter had anything to do with it: no one holds it
            self.bytes_from_broker += n
            return True
        if n < HEAD_SIZE or need and not self._quick_head(data, inflight, total):
            return False  # the long way gathers this much first; or read by filters
        pending.popleft()
        self._spare = inflight
        self.bytes_from_broker += n
        cutter.pass_rest(total - n, total)
        if total > self.whole_response_max:
            return True  # streamed as it comes
        self._partial = [data]
        return HELD

    def _several_responses(self, data, n):
        """pass_response: a read of several whole responses (a producer with
        requests in flight gets two or three at once) goes on as it is when
        each would on its own: nothing to answer, throttle or call back, and
        no filter reads it or each filter reading it has nothing to do with
        it (Filter.quick_response_check). Anything else, a response that
        does not end in this read among them, is left to broker_data (False)."""
        if n > SEVERAL_RESPONSES_MAX:
            return False
        pending = self.pending
        cutter = self.responses_in
        max_size = cutter.max_frame_size
        min_size = cutter.min_frame_size
        count = len(pending)
        pos = k = 0
        while pos < n:
            if k == count or n - pos < 8:
                return False
            inflight = pending[k]
            if (inflight.throttle_ms or inflight.on_response is not None
                    or inflight.answer is not None):
                return False
            size, correlation_id = _RESPONSE_HEAD.unpack_from(data, pos)
            end = pos + size + 4
            if (inflight.correlation_id != correlation_id or size > max_size
                    or size < min_size or end > n):
                return False
            if inflight.response_need:
                checks = self._quick_responses.get((inflight.api_key, inflight.api_version))
                if checks is None:
                    return False
                frame = data[pos:end]
                for check in checks:
                    if not check(frame):
                        return False
            pos = end
            k += 1
        if k < count and pending[k].answer is not None:
            return False  # an answer of the proxy's own follows: broker_data sends it
        for _ in range(k):
            pending.popleft()
        self._spare = inflight  # the last: no one holds it
        self.bytes_from_broker += n
        return True

    def _quick_head(self, data, inflight, frame_len):
        """pass_response: whether the filters reading the response to
        ``inflight`` at most to its head (FilterTable.quick_heads) have
        nothing to do with it now, ``data`` its first read; when some count
        its size, this is left to broker_data, which has the time (False)."""
        quick = self._quick_heads.get((inflight.api_key, inflight.api_version))
        if quick is None:
            return False
        contexts = self.contexts
        for f, i in quick.readies:
            if not f.quick_response_ready(contexts[i], inflight):
                return False
        if quick.heads:  # QuickFilter.quick_response_head: broker_data calls them
            self._counting = _Counting(data, inflight, quick.heads, frame_len)
            return False
        return True

    def client_data(self, data, now):
        """Bytes from the client."""
        self.bytes_from_client += len(data)
        if self.reading is _STOPPED or self.phase is not _READY:
            phase = self.phase
            if phase is Phase.CONNECTING:
                self._early.append(data)
                self._early_bytes += len(data)
                if self._early_bytes > self.max_receive_before_auth:
                    self._actions = []
                    return self._close("%d bytes sent before the broker connection was up, more "
                                       "than the %d a frame may have then"
                                       % (self._early_bytes, self.max_receive_before_auth),
                                       REFUSED_MALFORMED_REQUEST)
                return ()
            if self.reading is _STOPPED:  # read on when the mute or the wait ends
                self._unread.append(data)
                return ()
            if phase is Phase.CLOSED:
                return ()
        self.now = now
        actions = self._actions = []
        out = self._to_broker = []
        cutter = self.requests_in
        try:
            cutter.feed(data, out)
            if self._internal or self.reading is _STOP_DUE:
                self._at_request_boundary(out)
            elif self.phase is _CONNECTING:
                self._await_upstream()
            pending = self.pending
            if pending and pending[0].answer is not None:
                self._flush_answers()
        except ProtocolError as exc:
            self._to_broker = None
            return self._malformed(exc)
        except _Refused as exc:
            self._to_broker = None
            return self._close(str(exc), exc.refused)
        self._to_broker = None
        if out:
            if actions:
                actions.insert(0, SendToBroker(out))
            else:
                return [SendToBroker(out)]
        return actions

    def _client_bytes(self, chunks, actions):
        """Feed client bytes; False if that closed the connection."""
        self._to_broker = out = []
        try:
            if self._internal and self.requests_in.at_boundary:
                self._flush_internal(out)
            for i, data in enumerate(chunks):
                if self.reading is _STOPPED:  # throttled on the way
                    self._unread.extend(chunks[i:])
                    break
                if self.phase is Phase.CONNECTING:  # authenticated on the way
                    self._early.extend(chunks[i:])
                    break
                self._feed_client(data, out)
        except ProtocolError as exc:
            self._malformed(exc)
            return False
        except _Refused as exc:
            self._close(str(exc), exc.refused)
            return False
        finally:
            self._to_broker = None
        if out:
            actions.insert(0, SendToBroker(out))
        return True

    def broker_data(self, data, now):
        """Bytes from the broker."""
        actions = self._actions = []
        counting = self._counting
        if counting is not None:
            self._counting = None
            if counting.data is data and self._count_response(
                    data, now, counting.inflight, counting.filters, counting.frame_len):
                return actions
        self.bytes_from_broker += len(data)
        if self.phase is Phase.CLOSED:
            return actions
        self.now = now
        out = self._partial
        if out is None:
            out = []
        else:
            self._partial = None
        self._to_client = out
        try:
            self.responses_in.feed(data, out)
            if self._streaming is not None:
                self._finish_stream()
            if not self.responses_in.at_boundary:
                self._partial = self.responses_in.take_partial(out, self.whole_response_max)
            pending = self.pending
            if pending and pending[0].answer is not None:
                self._flush_answers()
        except ProtocolError as exc:
            self._to_client = None
            return self._close("malformed response from broker: %s" % exc)
        except ValueError as exc:  # an address the proxy cannot advertise (UnmappedNode)
            self._to_client = None
            return self._close(str(exc), getattr(exc, "refused", None))
        self._to_client = None
        if self.phase is _CLOSED:  # the client's bytes replayed after a login closed it
            return actions
        if self._internal and self.requests_in.at_boundary:
            # requests of the proxy's own, sent from a response callback
            requests = []
            self._flush_internal(requests)
            actions.append(SendToBroker(requests))
        if self.responding is not _HOLDING:
            if out:
                if not actions:
                    return [SendToClient(out)]
                actions.append(SendToClient(out))
        else:
            self._send_to_client(out, actions)
        return actions

    def _count_response(self, data, now, inflight, filters, frame_len):
        """The first read ``data`` of the response to ``inflight``, which
        pass_response left to count: its quick filters count ``frame_len``
        (Filter.quick_response_head), then it takes the short way; False when
        they earned a throttle, which the long way says in the response."""
        pending = self.pending
        if not pending or pending[0] is not inflight:
            return False
        self.now = now
        contexts = self.contexts
        for f, i in filters:
            verdict = f.quick_response_head(contexts[i], inflight, frame_len)
            if verdict.__class__ is Answer:  # the long way sends it in the response's place
                inflight.replaced = verdict
                return False
            self._earned(inflight, verdict)
        inflight.response_need = NOTHING  # its filters are done with it
        if inflight.throttle_ms:
            return False
        passed = self.pass_response(data)
        if not passed:
            return False
        if passed is True:
            self._actions.append(SendToClient([data]))
        elif passed is not HELD:
            self._actions.append(SendToClient(passed))
        return True

    def tick(self, now):
        """A timer the adapter set (PauseClient, HoldResponses) is due. A
        timer that fires early (event loops round timers to the millisecond)
        is set again rather than lost."""
        self.now = now
        actions = self._actions = []
        if self.phase is Phase.CLOSED:
            return actions
        due = now + TIMER_SLACK
        deadline = self.session_deadline
        if deadline is not None and due >= deadline:
            return self._close("session expired: the client did not re-authenticate within its "
                               "session lifetime (KIP-368, connections-max-reauth-ms)")
        if self._held is not None:
            if due >= self.hold_until:
                held, self._held = self._held, None
                self._responding_changed()
                if held:
                    actions.append(SendToClient(held))
                if self._close_when_released is not None:
                    return self._close(*self._close_when_released)
                actions.append(RESUME_BROKER)
            else:
                actions.append(HoldResponses(self.hold_until))
        if self.reading is _STOPPED and not self._jobs:
            if due >= self.muted_until:
                self._read_unread(actions)
            else:
                actions.append(PauseClient(self.muted_until))
        return actions

    def _read_unread(self, actions):
        """The client may be read again: what came meanwhile first."""
        unread, self._unread = self._unread, None
        self._reading_changed()
        if not self._client_bytes(unread, actions):
            return
        if self.reading is not _STOPPED and self.phase is not Phase.CONNECTING:
            actions.append(RESUME_CLIENT)

    def job_done(self, token, result, error, now):
        """A job (RunJob) has finished, with its result or the exception it
        raised; its answer goes out in its turn, and the client is read on."""
        self.now = now
        actions = self._actions = []
        entry = self._jobs.pop(token, None)
        if entry is None or self.phase is Phase.CLOSED:
            return actions
        inflight, on_done, ctx = entry
        if inflight is None:  # a filter's own job (FilterContext.run_job), no request's
            try:
                on_done(ctx, result, error)
            except _Refused as exc:
                return self._close(str(exc), exc.refused)
            if self.phase is not Phase.CLOSED and self._internal:
                requests = []
                self._flush_internal(requests)
                actions.append(SendToBroker(requests))
            return actions
        self._in_job = True
        try:
            answer = on_done(ctx, result, error)
        except _Refused as exc:
            return self._close(str(exc), exc.refused)
        finally:
            self._in_job = False
        if self.phase is Phase.CLOSED:
            return actions
        if answer.__class__ is Refuse:
            return self._close(answer.reason, answer.refused)
        inflight.answer = b"" if answer is None else answer
        self._flush_answers()
        if self.reading is _STOPPED and not self._jobs and now + TIMER_SLACK >= self.muted_until:
            self._read_unread(actions)
        return actions

    def passing_through(self, from_client):
        """Bytes still to come of the frame in progress from the client (or
        the broker) that may go from socket to socket without being read here
        (--zero-copy): the frame is passed on as it is and nothing is held,
        throttled, gathered or waited for. 0 otherwise."""
        if (self.phase is not _READY or self.reading is not _FLOWING
                or self.responding is not _PASSING or self._jobs or self._internal):
            return 0
        if from_client:
            return self.requests_in.passing
        if self._streaming is not None or self._gathering is not None:
            return 0  # a response read or rewritten
        return self.responses_in.passing

    @property
    def holding_response(self):
        """A response part-way in is held until whole (WHOLE_RESPONSE_MAX): a
        move of its rest takes it all in before sending any of it."""
        return self._partial is not None

    def release_held_response(self):
        """The held response's bytes so far, for the adapter to send right
        before its rest (its rest all in, passed through)."""
        partial, self._partial = self._partial, None
        return partial

    def passed_through(self, from_client, nbytes, now):
        """``nbytes`` of the frame that passing_through offered went from
        socket to socket: counted, then what follows the frame as if they
        had been fed."""
        if from_client:
            self.requests_in.skip(nbytes)
            self.bytes_from_client += nbytes
            return self.client_data(b"", now)
        self.responses_in.skip(nbytes)
        self.bytes_from_broker += nbytes
        return self.broker_data(b"", now)

    def client_eof(self):
        """The client closed its side."""
        self._actions = []
        try:
            self.requests_in.eof()
        except ProtocolError as exc:
            return self._close("client disconnected: %s" % exc)
        return self._close("client disconnected")

    # a proxy that drains on SIGTERM (ProxyServer.drain): asked once per
    # connection and per look, never on the request path

    @property
    def in_flight(self):
        """Responses the client is still owed: requests not yet answered
        (by the broker, a job or the proxy), a response arriving, and
        responses held back for an old client's throttle (counted as one)."""
        owed = len(self.pending)
        responses = self.responses_in
        if not responses.at_boundary and (not responses.buffered or self._gathering is not None):
            owed += 1  # a response past its head: its request has left the queue
        if self._held:
            owed += 1
        return owed

    def stop_reading(self):
        """Read no request after the one being read, as a broker shutting
        down stops reading requests. True when none is part-way: the caller
        stops reading the client now. Otherwise the rest of that request is
        read and forwarded, then the client is paused (PauseClient(None))
        and what follows it is left unread."""
        if self.phase is _CLOSED or self.requests_in.at_boundary:
            return True
        self._wait_due = True
        self._reading_changed()
        self.requests_in.stop_after_frame = True
        return False

    def close(self, reason, refused=None):
        """Closed from outside (the broker went away, shutdown, a limit)."""
        self._actions = []
        return self._close(reason, refused)

    def _close(self, reason, refused=None):
        actions = self._actions
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.CLOSED
            self._drop_lease()
            actions.append(Close(reason, refused))
        return actions

    def _malformed(self, exc):
        # before authentication a malformed or oversized frame is a refusal
        refused = REFUSED_MALFORMED_REQUEST if self.phase is Phase.AUTHENTICATING else None
        return self._close("malformed request from client: %s" % exc, refused)

    # the request side ---------------------------------------------------

    def _feed_client(self, data, out):
        self.requests_in.feed(data, out)
        if self._internal or self.reading is _STOP_DUE:
            self._at_request_boundary(out)
        elif self.phase is Phase.CONNECTING:
            self._await_upstream()
        pending = self.pending
        if pending and pending[0].answer is not None:
            self._flush_answers()

    def _at_request_boundary(self, out):
        """Between requests: send the proxy's own, start a due mute."""
        if self.requests_in.at_boundary:
            if self._internal:
                self._flush_internal(out)
            if self._mute_due:
                self._start_mute()
            if self._wait_due:
                self._start_wait()
            elif self.phase is Phase.CONNECTING:
                self._await_upstream()

    def _await_upstream(self):
        """Authenticated before the broker connection (see authenticated):
        what the client sent after that waits for the broker."""
        cutter = self.requests_in
        cutter.stop_after_frame = False
        rest, cutter.rest = cutter.rest, None
        if rest:
            self._early.append(rest)

    def _start_wait(self):
        """Read nothing more until the jobs are done (job_done)."""
        self._wait_due = False
        self._stop_reading()
        self._actions.append(PauseClient(None))

    def _stop_reading(self):
        """What the cutter left unread waits in _unread, first."""
        cutter = self.requests_in
        cutter.stop_after_frame = False
        rest, cutter.rest = cutter.rest, None
        if self._unread is None:
            self._unread = []
            self._reading_changed()
        if rest:
            self._unread.insert(0, rest)

    def _request_head(self, head, frame_len):
        if self.raw_request is not None:
            self._request_gathered = _RAW
            return WHOLE
        api_key, api_version, correlation_id = INT16_INT16_INT32.unpack_from(head, 4)
        if self.phase is _READY:
            entry = self.table.lookup(api_key, api_version)
        else:
            entry = self.table.lookup_authenticating(api_key, api_version)
        request_need = entry.request_need
        if not request_need and api_key != PRODUCE:
            if api_key < 0 or api_version < 0:
                raise ProtocolError("invalid api key %d version %d" % (api_key, api_version))
            return self._admit(correlation_id, api_key, api_version, None, entry, False)
        try:
            request = RequestHead(head, frame_len)
            acks_0 = api_key == PRODUCE and request.acks == 0
            if request_need:
                request.fields_for_policy()
        except HeadTooShort as exc:
            return NeedHead(exc.needed)
        if request_need == GATHER and len(head) < frame_len:
            self._request_gathered = entry
            return WHOLE
        return self._admit(correlation_id, api_key, api_version, request, entry, acks_0)

    def _whole_request(self, frame):
        entry, self._request_gathered = self._request_gathered, None
        if entry is _RAW:
            handler, ctx = self.raw_request
            answer = handler(ctx, frame)
            if answer is None:
                return None
            inflight = InFlight(-1, -1, -1, GATHER)
            if answer.__class__ is Pending:
                self._pending_job(inflight, answer, ctx)
                return None
            if answer.__class__ is ForwardRaw:
                inflight.raw_answer = answer.on_answer
                inflight.ctx = ctx
                self.pending.append(inflight)
                self._raw_in_flight += 1
                self._responding_changed()
                self.responses_in.min_frame_size = 0  # an empty token is a frame of 0
                return frame
            inflight.answer = answer
            self.pending.append(inflight)
            return None
        request = RequestHead(frame, len(frame))
        acks_0 = request.api_key == PRODUCE and request.acks == 0
        self._admitting_whole = True
        try:
            result = self._admit(request.correlation_id, request.api_key, request.api_version,
                                 request, entry, acks_0)
        finally:
            self._admitting_whole = False
        if result == DROP:
            return None
        if result == DEFER:
            raise TypeError("a request gathered whole cannot be deferred")
        if result.__class__ is tuple or result.__class__ is _Observed:
            head, observed = result if result.__class__ is tuple else (None, result)
            if head.__class__ is Replace:
                frame = head.frame
            elif head is not None:
                frame = head + frame[len(head):]
            observed.feed(frame, [])
            return frame
        if result.__class__ is Replace:
            return result.frame
        return frame if result == PASS else result

    def _admit(self, correlation_id, api_key, api_version, request, entry, acks_0):
        """Run the request's filters; PASS, DROP, or a patched head."""
        self.requests += 1
        inflight = InFlight(correlation_id, api_key, api_version, entry.response_need,
                            entry.response_filters)
        result = PASS
        delay = 0
        observed = None
        contexts = self.contexts
        for f, i in entry.request_filters:
            verdict = f.on_request(contexts[i], request, inflight)
            if verdict is None:
                continue
            cls = verdict.__class__
            if cls is Throttle:
                if verdict.delay_ms > delay:
                    delay = verdict.delay_ms
                    inflight.throttle_ms = delay
                    inflight.throttle_reason = verdict.reason
            elif cls is Forward or cls is Replace:
                result = self._rewritten(result, verdict, request, f)
            elif cls is Answer:
                inflight.answer = verdict.frame
                inflight.throttle_ms = 0  # the proxy's own answer says its own
                self._not_gathered(inflight)  # no broker response comes
                self.pending.append(inflight)
                # a throttle earned (a request quota, or the answer's own for
                # a quota it refuses) still mutes the client
                mute = max(delay, verdict.mute_ms)
                if mute:
                    self._throttle_client(mute, reading_request=True)
                return DROP
            elif cls is Refuse:
                raise _Refused(verdict.reason, verdict.refused)
            elif cls is Pending:
                self._not_gathered(inflight)  # answered by the job
                self._pending_job(inflight, verdict, contexts[i])
                return DROP
            elif cls is Observe:
                observed = _Observed(verdict.stream, verdict.on_done, contexts[i], self, inflight,
                                     observed)
            elif cls is Defer and self._admitting_whole:
                # read whole already (a filter asked for it): it cannot wait unread, so
                # it goes on and the client is not read for that long instead
                if verdict.delay_ms > delay:
                    delay = verdict.delay_ms
                    inflight.throttle_ms = delay
                    inflight.throttle_reason = verdict.reason
            elif cls is Defer:
                self.requests -= 1  # counted when it is read for good
                if verdict.delay_ms > self._mute_due:
                    self._mute_due = verdict.delay_ms
                    self._reading_changed()
                return DEFER
            elif cls is Gather:
                if request is None or self._admitting_whole:
                    raise TypeError("filter %s asked to gather a request it has whole" % f.name)
                self.requests -= 1  # counted when it is read whole
                self._request_gathered = entry
                return WHOLE
            else:
                raise TypeError("filter %s answered %r" % (f.name, verdict))
        if delay:
            # Stop reading after this request, not when its answer comes: a
            # client that pipelines would otherwise push many more requests
            # past the quota first (a broker reads one request at a time).
            self._throttle_client(delay, reading_request=True)
        if observed is not None:
            result = observed if result == PASS else (result, observed)
        if acks_0:
            # acks=0: Kafka sends no response. Some brokers (Tansu) do anyway,
            # which trips clients that expect none (aiokafka fails its
            # connection): remember the id to drop such an answer.
            if self.unanswered is None:
                self.unanswered = deque(maxlen=UNANSWERED_IDS_KEPT)
            self.unanswered.append(correlation_id)
            return result
        self.pending.append(inflight)
        return result

    def _rewritten(self, result, verdict, request, f):
        """_admit: the request as a Forward (a patched head) or a Replace (a
        new frame, of a request read whole) of filter ``f`` leaves it."""
        if verdict.__class__ is Forward:
            if result.__class__ is Replace:  # a patched head on a request replaced
                result = Replace(verdict.head + result.frame[len(verdict.head):])
                request.buf = result.frame
            else:
                result = verdict.head
                request.buf = result
            return result
        if not self._admitting_whole:
            raise TypeError("filter %s replaced a request it does not have whole" % f.name)
        request.buf = verdict.frame
        request.frame_len = len(verdict.frame)
        return verdict

    def _pending_job(self, inflight, pending, ctx):
        """Pending: the answer comes from a job; nothing more is read meanwhile."""
        self._next_job += 1
        self._jobs[self._next_job] = (inflight, pending.on_done, ctx)
        self.pending.append(inflight)
        self._actions.append(RunJob(pending.job, self._next_job))
        self._wait_due = True
        self._reading_changed()
        self.requests_in.stop_after_frame = True

    def gather_response(self, inflight, filter_):
        """FilterContext.gather_response: the response to ``inflight`` is read
        whole and given to ``filter_``'s on_response, whatever the filter
        table says of its API."""
        place = self.table.filters.index(filter_)
        if (filter_, place) not in inflight.response_filters:
            inflight.response_filters = tuple(sorted(
                inflight.response_filters + ((filter_, place),), key=lambda pair: pair[1]))
        if inflight.response_need < GATHER:
            inflight.response_need = GATHER
        if self._gathered_for is None:
            self._gathered_for = set()
        self._gathered_for.add(inflight)

    def _not_gathered(self, inflight):
        """``inflight``'s response is no longer awaited whole (gather_response)."""
        if self._gathered_for:
            self._gathered_for.discard(inflight)

    def run_filter_job(self, job, on_done, ctx):
        """FilterContext.run_job: ``job`` run outside the pipeline, then
        ``on_done(ctx, result, error)``, which may send requests of its own."""
        self._next_job += 1
        self._jobs[self._next_job] = (None, on_done, ctx)
        self._actions.append(RunJob(job, self._next_job))

    def send_request(self, frame, api_key, api_version, on_response, ctx):
        """A request of a filter's own to the broker (FilterContext.send_request):
        ``on_response(ctx, frame)`` gets the whole response."""
        correlation_id = self._next_internal_id
        self._next_internal_id += 1
        frame = bytearray(frame)
        INT32.pack_into(frame, 8, correlation_id)
        inflight = InFlight(correlation_id, api_key, api_version, GATHER)
        inflight.on_response = on_response
        inflight.ctx = ctx
        self._internal.append((bytes(frame), inflight))
        if self._to_broker is not None and self.requests_in.at_boundary:
            # within a request's head (or between frames): in stream order
            self._flush_internal(self._to_broker)
        return correlation_id

    def _flush_internal(self, out):
        for frame, inflight in self._internal:
            out.append(frame)
            self.pending.append(inflight)
        self._internal.clear()

    def expect_raw(self, handler):
        """Raw tokens from the next request frame on (FilterContext.expect_raw):
        ``handler`` is (function, context), or None to end them."""
        self.raw_request = handler
        self._reading_changed()
        self.requests_in.min_frame_size = MIN_REQUEST_SIZE if handler is None else 0

    def set_session_deadline(self, until):
        """KIP-368 (FilterContext.set_session_deadline): closed at ``until``
        unless set again before."""
        self.session_deadline = until
        self._actions.append(SessionDeadline(until))

    def fail_authentication(self, reason, delay_ms):
        """Answers already queued (the failure itself) go out after
        ``delay_ms``, then the connection closes (KIP-306's
        connection.failed.authentication.delay.ms: a client cannot retry
        passwords at full speed). Nothing more is read from the client."""
        until = self.now + delay_ms / 1000.0
        self._close_when_released = reason, REFUSED_AUTHENTICATION
        self.expect_raw(None)
        if until > self.hold_until:
            self.hold_until = until
        if self._held is None:
            self._held = []
            self._responding_changed()
        self._actions.append(HoldResponses(self.hold_until))
        # called while a request is handled (or its job's answer): read
        # nothing after it
        self._throttle_client(max(delay_ms, 1), reading_request=not self._in_job)

    def quotas_for(self, client_id):
        """The policy's ClientQuotas for this connection's principal and
        ``client_id`` (kept per connection; None without quotas)."""
        manager = self.quota_manager
        if manager is None:
            return None
        key = (self.principal, client_id)
        quotas = self.client_quotas.get(key)
        if quotas is None:
            if len(self.client_quotas) >= CLIENT_IDS_KEPT:
                self.client_quotas.clear()  # a client cycling client-ids: start over
                self._heads[0] = self._heads[1] = None  # and its quotas with them
                self._drop_lease()
            quotas = self.client_quotas[key] = manager.client(self.principal, client_id,
                                                              self.node_id)
        return quotas

    # throttling the client -----------------------------------------------

    def _earned(self, inflight, verdict, reading_request=False):
        """A filter's verdict (None or a Throttle) on ``inflight``, from a
        frame it observed or a response's head: a longer throttle than it
        has is said in its response and mutes the client (from the end of
        the request being read, with ``reading_request``)."""
        if verdict is not None and verdict.delay_ms > inflight.throttle_ms:
            inflight.throttle_ms = verdict.delay_ms
            inflight.throttle_reason = verdict.reason
            self._throttle_client(verdict.delay_ms, reading_request)

    def _throttle_client(self, delay_ms, reading_request=False):
        """Read nothing more from the client for ``delay_ms``, from the end
        of the request being read (so that request reaches the broker whole)."""
        if delay_ms <= self._mute_due:
            return
        self._mute_due = delay_ms
        self._reading_changed()
        cutter = self.requests_in
        if not reading_request and cutter.at_boundary:
            self._start_mute()
        else:
            cutter.stop_after_frame = True

    def _start_mute(self):
        delay_ms, self._mute_due = self._mute_due, 0
        self._stop_reading()
        until = self.now + delay_ms / 1000.0
        if until <= self.muted_until:
            return
        self.muted_until = until
        self._actions.append(PauseClient(until))

    @property
    def muted(self):
        return self.reading is _STOPPED

    def _reading_now(self):
        """The request side's state its fields make (Reading)."""
        if self._unread is not None:
            return _STOPPED
        if self._mute_due or self._wait_due:
            return _STOP_DUE
        return _FLOWING if self.raw_request is None else _RAW_TOKENS

    def _reading_changed(self):
        self.reading = self._reading_now()

    def _responding_now(self):
        """The response side's state its fields make (Responding)."""
        if self._held is not None or self._hold_from is not None:
            return _HOLDING
        return _RAW_ANSWERS if self._raw_in_flight else _PASSING

    def _responding_changed(self):
        self.responding = self._responding_now()

    # the response side ----------------------------------------------------

    def _flush_answers(self):
        """Send the proxy's own answers whose turn has come: the ones at the
        front of the queue, once no response is part-way through."""
        pending = self.pending
        if not pending or pending[0].answer is None or not self.responses_in.at_boundary:
            return
        answers = []
        while pending and pending[0].answer is not None:
            answers.append(pending.popleft().answer)
        if self._to_client is not None:  # within broker_data: in stream order
            self._to_client.extend(answers)
        else:
            self._send_to_client(answers, self._actions)

    def _send_to_client(self, out, actions):
        if self._held is not None:
            self._held += out
            return
        if self._hold_from is not None:
            out, self._held = out[: self._hold_from], out[self._hold_from :]
            self._hold_from = None  # (holding still: _held)
            actions.append(HoldResponses(self.hold_until))
        if out:
            actions.append(SendToClient(out))

    def _response_head(self, head, frame_len):
        if self._streaming is not None:
            self._finish_stream()
        pending = self.pending
        if pending and pending[0].answer is not None:
            # the proxy's own answers, due before this response
            while pending and pending[0].answer is not None:
                self._to_client.append(pending.popleft().answer)
        if self._raw_in_flight:
            if pending and pending[0].raw_answer is not None:
                self._gathering = pending.popleft()  # a raw answer: no correlation id
                return WHOLE
            if len(head) < 8:  # raw framing admits empty frames; a response has an id
                raise ProtocolError("response frame of %d bytes" % (len(head) - 4))
        correlation_id = INT32.unpack_from(head, 4)[0]
        if not pending or pending[0].correlation_id != correlation_id:
            if self.unanswered and correlation_id in self.unanswered:
                self.unanswered.remove(correlation_id)
                return DROP  # an answer to acks=0 that Kafka would not send
            raise ProtocolError(
                "response correlation id %d, expected %s"
                % (correlation_id, pending[0].correlation_id if pending else "none")
            )
        inflight = pending.popleft()
        need = inflight.response_need
        if self._gathered_for:
            self._not_gathered(inflight)
        if inflight.on_response is not None:
            self._gathering = inflight
            return WHOLE
        if inflight.replaced is not None:  # (its filters saw its head: _count_response)
            return self._replace_response(inflight, inflight.replaced)
        if need == NOTHING:
            if inflight.throttle_ms:
                return self._throttled_head(inflight, head, PASS)
            return PASS
        contexts = self.contexts
        for f, i in inflight.response_filters:
            verdict = f.on_response_head(contexts[i], inflight, head, frame_len)
            if verdict.__class__ is Answer:
                return self._replace_response(inflight, verdict)
            self._earned(inflight, verdict)
        if need == GATHER:
            self._gathering = inflight
            if inflight.throttle_ms:
                self._hold_if_needed(inflight)
            return WHOLE
        if need == STREAM:
            rewriter = self._stream_rewriter(inflight)
            if rewriter is not None:
                self._streaming = rewriter
                if inflight.throttle_ms:
                    return self._throttled_head(inflight, head, rewriter)
                return rewriter
        if inflight.throttle_ms:
            return self._throttled_head(inflight, head, PASS)
        return PASS

    def _replace_response(self, inflight, answer):
        """A filter answers in the broker's response's place (an Answer from
        on_response_head): its frame goes to the client, the broker's is
        dropped as it comes, and ``mute_ms`` mutes the client."""
        self._to_client.append(answer.frame)
        if answer.mute_ms:
            inflight.throttle_ms = answer.mute_ms
            self._throttle_client(answer.mute_ms)
        return DROP

    def _hold_if_needed(self, inflight):
        first = clients_back_off_from(inflight.api_key)
        if first is None or inflight.api_version < first:
            until = self.now + inflight.throttle_ms / 1000.0
            if until > self.hold_until:
                self.hold_until = until
            if self.responding is not _HOLDING:
                self._hold_from = len(self._to_client)
                self._responding_changed()
            elif self._held is not None:
                self._actions.append(HoldResponses(self.hold_until))

    def _throttled_head(self, inflight, head, mode):
        """Say the throttle time in the response (KIP-219) and hold the
        response if the client would not back off by itself. librdkafka
        ignores the field at every version: not reading it (see
        _throttle_client) is what holds it."""
        self._hold_if_needed(inflight)
        api_key, api_version = inflight.api_key, inflight.api_version
        offset = throttle_time_patch(head, api_key, api_version)
        if offset is not None:
            if INT32.unpack_from(head, offset)[0] >= inflight.throttle_ms:
                return mode
            patched = bytearray(head)
            INT32.pack_into(patched, offset, inflight.throttle_ms)
            patched = bytes(patched)
            return patched if mode == PASS else (patched, mode)
        if throttle_time_offset(api_key, api_version) is not None:
            # the field follows variable-length data past the head
            self._streaming = None
            self._gathering = inflight
            return WHOLE
        return mode

    def _whole_response(self, frame):
        inflight, self._gathering = self._gathering, None
        if inflight.raw_answer is not None:
            self._raw_in_flight -= 1
            if not self._raw_in_flight:
                self.responses_in.min_frame_size = MIN_RESPONSE_SIZE
                self._responding_changed()
            return inflight.raw_answer(inflight.ctx, frame)
        if inflight.on_response is not None:
            inflight.on_response(inflight.ctx, frame)
            return None
        contexts = self.contexts
        for f, i in inflight.response_filters:
            frame = f.on_response(contexts[i], inflight, frame)
        if inflight.response_need >= STREAM:  # gathered after all (see _throttled_head)
            rewriter = self._stream_rewriter(inflight)
            if rewriter is not None:
                out = []
                rewriter.feed(frame, out)
                frame = b"".join(out)
                self.nodes_seen(rewriter.nodes)
        if inflight.throttle_ms:
            patched = raise_throttle_time(frame, inflight.api_key, inflight.api_version,
                                          inflight.throttle_ms)
            if patched is not None:
                frame = patched
        return frame

    def _stream_rewriter(self, inflight):
        """The rewriter of the first filter that streams this response (one
        filter rewrites a response; others may gather it instead), wrapped
        for each filter that only reads it as it streams (Observe)."""
        contexts = self.contexts
        rewriter = None
        observers = None
        for f, i in inflight.response_filters:
            got = f.stream(contexts[i], inflight)
            if got is None:
                continue
            if got.__class__ is Observe:
                if observers is None:
                    observers = []
                observers.append((got, contexts[i]))
            elif rewriter is None:
                rewriter = got
        if observers is not None:
            for observe, ctx in observers:
                rewriter = _StreamObserved(rewriter, observe, ctx, self, inflight)
        return rewriter

    def _finish_stream(self):
        """A streamed response is through: report the addresses it held
        (its tail is in the output not yet sent)."""
        rewriter = self._streaming
        if rewriter is not None and rewriter.done:
            self._streaming = None
            self.nodes_seen(rewriter.nodes)

    def nodes_seen(self, nodes):
        """Broker addresses found in a response (FilterContext.nodes_seen)."""
        if nodes:
            self._actions.append(NodesSeen(list(nodes)))
