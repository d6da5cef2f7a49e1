"""What a filter is, and all it sees of a connection.

A filter is one behaviour of the proxy (authentication, address rewriting,
quotas ...), in the spirit of Kroxylicious's ``Filter`` and
``FilterContext``. It says per API key and version what it needs of a frame
(nothing, the head, a stream rewrite, the whole frame), so the pipeline's
table sends it only those frames, and it answers each with a verdict: a plain
value (forward, answer in the broker's place, throttle, defer, refuse ...).

It sees one connection through its ``FilterContext``: the principal
(read-only), ``now``, a state object of its own made per connection by
``new_state()``, and the verbs it may use. It never touches the connection's
fields: the pipeline (``pipeline.py``) keeps its phases and buffers to
itself. A filter module imports this module, never the pipeline.

Registering a filter: ``filters/__init__.py``.
"""
import math
from operator import attrgetter
from typing import NamedTuple

# What a frame needs from a filter (ordered: the strongest need wins).
NOTHING = 0
HEAD = 1
STREAM = 2  # responses only: a length-keeping rewrite while the frame streams
GATHER = 3  # the whole frame

# The principal of a connection that has not authenticated (KIP-55).
ANONYMOUS = "ANONYMOUS"

# Close.refused reasons (the label of kthrottle_connections_refused_total)
REFUSED_AUTHENTICATION = "authentication"
REFUSED_UNAUTHENTICATED_REQUEST = "unauthenticated_request"
REFUSED_MALFORMED_REQUEST = "malformed_request"  # before authentication


# Verdicts: what a filter answers about one frame (None: forward as is). ----

class Forward(NamedTuple):
    """Forward the request with this head in place of the original (same
    length: a patched field)."""

    head: bytes


class Replace(NamedTuple):
    """Forward this frame in place of a request read whole (GATHER, or after
    Gather): the same request rewritten, of any length, its correlation id
    kept (the response answers it)."""

    frame: bytes


class Answer(NamedTuple):
    """Answer in the broker's place; the request is not forwarded. The
    answer reaches the client in request order. ``mute_ms``: the client is
    not read from for that long after this request (an answer refusing it for
    a quota, whose throttle_time_ms the frame carries, KIP-219)."""

    frame: bytes
    mute_ms: int = 0


class Throttle(NamedTuple):
    """The client earned ``delay_ms`` (KIP-219): it is not read from for that
    long after this request, the response says so in throttle_time_ms, and
    an old client that would not back off gets its response that late."""

    delay_ms: int
    reason: str


class Refuse(NamedTuple):
    """Close the connection; the request reaches no broker. ``refused``:
    the reason's kind when the client is turned away (Close.refused)."""

    reason: str
    refused: str | None = None


class Pending(NamedTuple):
    """Answer later, in the broker's place: ``job`` is run outside the
    pipeline (a key derivation in a worker thread, a question to a broker);
    ``on_done(ctx, result, error)`` then returns the answer frame (b"" for
    none) or a Refuse. Nothing after the request is read meanwhile; the
    answer goes out in request order, behind the broker's answers to what
    came before it (a store write by the admin API, after authentication)."""

    job: object
    on_done: object


class Observe(NamedTuple):
    """Stream the request on while ``stream`` (with ``feed(chunk, out)``
    that appends the chunk, and ``done``) reads it; once the whole frame has
    gone, ``on_done(ctx, stream)`` returns None or a Throttle for it (the
    client is then not read further, and the response says so). Several
    filters may observe one request. Also an answer of ``Filter.stream``: a
    response read as it streams to the client (its Throttle then mutes the
    client; the response's head has gone without it)."""

    stream: object
    on_done: object


class Defer(NamedTuple):
    """Not now: the request is left unread, and nothing after it is read,
    for ``delay_ms``; then it is read again (and its filters asked again).
    Nothing of it reaches the broker meanwhile; the client waits for its
    answer. Only for requests whose head is enough to decide (HEAD)."""

    delay_ms: int
    reason: str


class Gather(NamedTuple):
    """The head was not enough for this one: read the whole request, then
    ask the filters again with it (they see every field). Only from a
    request's head; the request is not counted twice."""


GATHER_WHOLE = Gather()


class ForwardRaw(NamedTuple):
    """For a raw token (see ``FilterContext.expect_raw``): send it on to the
    broker as it came. The broker's answer is a raw token too, matched by
    order alone (it has no correlation id); it is given whole to
    ``on_answer(ctx, frame)``, which returns what the client gets (None:
    nothing)."""

    on_answer: object


class QuickHead(NamedTuple):
    """The usual fields of a Produce or Fetch request's head, as the short
    way reads them (QuickFilter.quick_check, quick_judge): ``acks`` for a Produce,
    ``replica_id`` and ``max_bytes`` (None before v3) for a Fetch, None
    otherwise."""

    api_key: int
    api_version: int
    client_id: str
    acks: object = None
    replica_id: object = None
    max_bytes: object = None


# Filter.built: when the default Filter.build makes the filter
BUILT_ALWAYS = "always"
BUILT_WITH_QUOTAS = "with client quotas"


def json_number(value, digits=3):
    """A float JSON can carry (None for NaN and infinities), rounded: for
    what ``Filter.status`` and the status page show."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return round(value, digits) if math.isfinite(value) else None


class Filter:
    """One behaviour of the proxy. Subclasses override what they need.

    Registered filters (``filters/__init__.py``) also say which options they
    read (``options``: a tuple of ``options.Option``) and how they are made
    from the configuration (``build``)."""

    name = "filter"
    options = ()  # options of its own (options.Option): flags and TOML keys it adds
    # what build() reads of the configuration beyond its own options (the
    # proxy's core settings, by attribute name)
    reads = ()
    # when the default build() makes the filter, as cls(): BUILT_ALWAYS,
    # BUILT_WITH_QUOTAS (when client quotas are configured), or None (never:
    # a filter made otherwise overrides build)
    built = None

    @classmethod
    def build(cls, config, services):
        """The filter the configuration asks for, or None when it asks for
        none. ``config`` has the attributes of ``options`` (and the core
        ones); ``services`` what the proxy has made for filters to share
        (``app.Services``). This one: ``cls()`` when ``built`` says so."""
        if cls.built == BUILT_ALWAYS or (cls.built == BUILT_WITH_QUOTAS
                                         and services.quotas is not None):
            return cls()
        return None

    @classmethod
    def check(cls, config):
        """Refuse bad values of this filter's options (ConfigError saying
        which and why), when the configuration is validated."""

    # Lifecycle: what the composition root (app.py), the listeners and the
    # admin endpoint ask of every filter alike, never of one by its name.

    # capabilities the core asks of the built filters (``any(...)``)
    authenticates_clients = False  # verifies clients itself: ApiVersions is
    # then answered before authentication from what a broker said
    follows_cluster_state = False  # takes the cluster state (on_cluster_state)
    # what the status page shows for this filter when the configuration
    # builds none (None: no section)
    status_absent = None

    async def start(self, services):
        """Once, before the first client is accepted, when what the proxy
        follows is in force (``services``: those given to ``build``, with
        ``cluster_state`` by now). The composition root calls ``stop`` however
        the run ends, in reverse order."""

    async def stop(self):
        """Undo ``start``: its tasks cancelled."""

    def on_cluster_state(self, state):
        """A new cluster-state snapshot (policy.storage.ClusterState), for a
        filter with ``follows_cluster_state``."""

    def api_ranges(self, ranges):
        """The API version ranges the proxy advertises ((api_key, min, max),
        ...), given the broker's: the same, for a filter that neither answers
        an API itself nor withholds one."""
        return ranges

    def metrics(self, family):
        """This filter's metric families for /metrics: ``family(name)``
        makes the empty family of an entry of admin.METRICS (its help and
        labels as the reference lists them); families of one name from
        several filters are merged."""
        return ()

    def status(self):
        """A JSON-able dict for the status page (under the filter's name),
        or None."""
        return None

    def degraded(self):
        """What the filter serves without for now, one line each, for
        /readyz (shown without making it 503)."""
        return ()

    def new_state(self):
        """This filter's state on one connection, made when the connection
        is (``ctx.state``); None for a filter that keeps none."""
        return None

    def request_need(self, api_key, api_version):
        """NOTHING, HEAD or GATHER for requests of this API and version."""
        return NOTHING

    def authenticating_need(self, api_key, api_version):
        """The same, while the client authenticates (an authenticator sees
        every request then, and only then)."""
        return self.request_need(api_key, api_version)

    def response_need(self, api_key, api_version):
        """NOTHING, HEAD, STREAM or GATHER for their responses."""
        return NOTHING

    def on_accept(self, ctx):
        """The client is accepted, before any broker connection. A filter
        that authenticates clients itself starts here
        (``ctx.begin_authentication``); the broker is then connected only
        once it has called ``ctx.authenticated``."""

    def on_upstream(self, ctx):
        """The broker connection is up, before any client byte reaches it.
        Return True to talk to the broker first (``ctx.send_request``); the
        client waits until the filter calls ``ctx.upstream_ready()``."""
        return False

    def on_connect(self, ctx):
        """The client may now be served (the filter may send requests of its
        own, or hold the connection with ``ctx.begin_authentication``)."""

    def on_request(self, ctx, head, inflight):
        """``head`` is a RequestHead (the whole frame when GATHER was asked);
        ``inflight`` the request's record (api_key, api_version,
        correlation_id). Returns None or a verdict."""
        return None

    def on_response_head(self, ctx, inflight, head, frame_len):
        """The first bytes of the response to ``inflight``; None, Throttle,
        or Answer: its frame goes to the client in the response's place (the
        broker's response is dropped as it comes), ``mute_ms`` muting the
        client."""
        return None

    def stream(self, ctx, inflight):
        """For STREAM: a fresh rewriter with ``feed(chunk, out)``, ``done``
        and ``nodes`` (codecs.stream), an Observe of a reader that only
        reads it, or None to leave this one alone."""
        return None

    def on_response(self, ctx, inflight, frame):
        """For GATHER: the whole framed response; returns the frame to send
        on (the same object when unchanged)."""
        return frame


class QuickFilter(Filter):
    """A filter that takes part in the short way (Connection.pass_request,
    pass_response) implements these as well as ``on_request`` and the
    response hooks: the filter table detects the methods a subclass has of
    its own, and a filter that is not a QuickFilter sends every request and
    response it reads the long way (only ``on_request``, ``on_response_head``,
    ``stream`` and ``on_response`` are asked)."""

    # The requests a filter judges from their head's usual fields alone
    # (QuickHead), and their responses, read with nothing else to do.

    def quick(self, api_key, api_version):
        """True when ``quick_judge`` (and ``quick_check``) may stand for
        ``on_request`` for this API and version: Produce or Fetch (asked
        once, when the table is built)."""
        return False

    def quick_ready(self, ctx):
        """Whether this request may take the short way now; False sends it
        the long way (to on_request). Must change nothing."""
        return True

    # True: quick_ready changes only with the quota configuration (the
    # QuotaManager's generation, which settles every lease): a lease
    # (quick_lease) may then stand for it too.
    quick_ready_follows_quotas = False

    def quick_lease(self, ctx, head):
        """None, or for a Produce ``head`` (a QuickHead) whose only judge is
        this filter's: a callable ``lease(frame_len, now)``, asked after a
        request of that head earned no delay, answering None or a lease (a
        list: [bytes left, requests left, until, ...], QuotaManager.lease)
        that the connection's next requests of that head take from,
        unjudged, while they fit and ``now`` is before ``until``. The
        connection settles it (QuotaManager.settle) when it runs out, ends,
        or the head changes."""
        return None

    def quick_check(self, ctx, head):
        """None, or a callable ``check(frame)`` asked before each Fetch with
        this ``head`` (a QuickHead) is judged, given that whole framed
        request: False sends it the long way (a Produce whose filters have a
        quick_check goes the long way). Must change nothing, nor keep
        ``frame``. Kept with the head as ``quick_judge``'s judge."""
        return None

    def quick_judge(self, ctx, head):
        """``on_request`` for the requests ``quick`` admits, from their
        ``head`` (a QuickHead; a Produce with acks 1 or -1): a callable
        answering None or a verdict with ``delay_ms`` and ``reason``, as a
        Throttle; None when there is nothing to judge. For a Produce it is
        ``judge(frame_len, now)``, for a Fetch ``judge(frame_len, now,
        inflight)`` (``frame_len``: the size with its prefix, ``now``: what
        ``ctx.now`` says; ``inflight`` for ``ctx.note``). The connection
        keeps it with that client's head for its next requests, until it
        forgets the client-id's quotas (``ctx.quotas_for``)."""
        return None

    def quick_response_check(self, api_key, api_version):
        """For the responses of this API and version that this filter reads
        (response_need), asked once when the filter table is built: None,
        or a function ``check(frame)`` of such a response read whole in one
        piece, True when the filter has nothing to do with it, so that it
        goes on as it is with none of the calls below (Connection.
        pass_response). A check must change nothing: it is given no context
        and no InFlight (the short way takes the InFlight again for a later
        request, InFlight.again)."""
        return None

    def quick_response_ready(self, ctx, inflight):
        """For a response this filter reads at most the head of
        (response_need HEAD or STREAM) but has nothing to do with now: True
        lets it pass with none of the calls below. Must change nothing, nor
        keep ``inflight``: the short way takes it again for a later request."""
        return False

    def quick_response_head(self, ctx, inflight, frame_len):
        """``on_response_head`` without the head's bytes, for a filter that
        reads the head of a response (response_need HEAD) for its size
        (``frame_len``) alone: a filter that has its own takes the response's
        first read on the short way. None, Throttle or Answer (as
        on_response_head; the long way then sends it); keeps no ``inflight``
        (as quick_response_ready)."""
        return None


class FilterContext:
    """What one filter sees of one connection: read-only facts, its own
    state, and the verbs it may use. Made by the pipeline, one per filter
    per connection."""

    __slots__ = ("_conn", "_filter", "state", "quotas_for")

    def __init__(self, conn, filter_, state):
        self._conn = conn
        self._filter = filter_
        self.state = state  # the filter's own (Filter.new_state)
        # quotas_for(client_id): the quotas of this connection's principal
        # and that client-id (policy ClientQuotas; None when the proxy has
        # no quotas). Bound here: it is on the request path.
        self.quotas_for = conn.quotas_for

    # facts: the connection's, read-only (read by C getters: on the request path)

    principal = property(attrgetter("_conn._principal"), doc="Who the client is: "
                         "ANONYMOUS until authenticated, then fixed.")
    request_whole = property(attrgetter("_conn._admitting_whole"), doc="In on_request: the "
                             "request is read whole (GATHER, or after Gather), so its body "
                             "may be read and it may be replaced (Replace).")
    client_host = property(attrgetter("_conn.client_host"), doc="The client's IP address as "
                           "text (from a PROXY protocol header where one came), None before "
                           "the connection is accepted.")
    now = property(attrgetter("_conn.now"),
                   doc="The time given with the input being handled (seconds).")
    authenticating = property(attrgetter("_conn.authenticating"),
                              doc="True while an authenticating filter holds the connection.")

    # a filter's own record of a request in flight ------------------------

    def note(self, inflight, value):
        """Keep ``value`` with a request until its response (``noted``)."""
        notes = inflight.notes
        if notes is None:
            notes = inflight.notes = {}
        notes[self._filter] = value

    def noted(self, inflight):
        notes = inflight.notes
        return None if notes is None else notes.get(self._filter)

    # verbs ---------------------------------------------------------------

    def send_request(self, frame, api_key, api_version, on_response):
        """Send a request of the filter's own to the broker (a SASL login,
        say): ``frame`` is framed, its correlation id left to the pipeline;
        ``on_response(ctx, frame)`` gets the whole response, which the
        client never sees. Sent at the next frame boundary."""
        return self._conn.send_request(frame, api_key, api_version, on_response, self)

    def gather_response(self, inflight):
        """From on_request: the broker's response to this request is read
        whole and given to this filter's ``on_response``, whatever its
        ``response_need`` says of the API (a Fetch answer the filter must
        add to, say). That response, and those after it on the connection,
        take the long way."""
        self._conn.gather_response(inflight, self._filter)

    def run_job(self, job, on_done):
        """Run ``job`` outside the pipeline (a coroutine: a question to the
        cluster), then ``on_done(ctx, result, error)``, which may call the
        verbs here (send_request, upstream_ready). For on_upstream's work."""
        self._conn.run_filter_job(job, on_done, self)

    def upstream_ready(self, ok=True, reason=None):
        """The filter's exchange with the broker (on_upstream) is over; a
        failure closes the connection with ``reason``."""
        self._conn.upstream_ready(ok, reason)

    def begin_authentication(self):
        """Hold the connection until the client has authenticated: only this
        filter's requests are accepted (authenticating_need), and frames are
        capped at Kafka's sasl.server.max.receive.size."""
        self._conn.begin_authentication(self._filter)

    def authenticated(self, principal):
        """The authenticating filter's verdict, given once: the connection's
        principal for its life."""
        self._conn.authenticated(principal, self._filter)

    def set_session_deadline(self, until):
        """KIP-368: the connection closes at ``until`` (``now``'s clock)
        unless this is called again before (a re-authentication)."""
        self._conn.set_session_deadline(until)

    def fail_authentication(self, reason, delay_ms):
        """Answers already queued (the failure itself) go out after
        ``delay_ms``, then the connection closes (KIP-306's
        connection.failed.authentication.delay.ms)."""
        self._conn.fail_authentication(reason, delay_ms)

    def expect_raw(self, handler):
        """From the next request frame on, client frames are raw tokens,
        framed by their length alone (SASL after SaslHandshake v0), until
        called again with None. Each goes whole to ``handler(ctx, frame)``,
        which returns the framed answer (bytes), ForwardRaw, Pending, or None
        (nothing: a failure has been handled)."""
        self._conn.expect_raw(None if handler is None else (handler, self))

    def nodes_seen(self, nodes):
        """Broker addresses found in a response, before it is sent on (the
        proxy opens a listener per new node id)."""
        self._conn.nodes_seen(nodes)


class Services:
    """What the proxy makes once and its filters share; given to
    ``Filter.build`` with the configuration. A filter takes what it needs."""

    def __init__(self, quotas=None, credentials=None):
        self.quotas = quotas  # policy QuotaManager, or None: no quotas configured
        # the current credentials snapshot, for a proxy that verifies clients
        # (sources.credentials; replaced live as the store changes)
        self.credentials = credentials
        # the quota source and credential source followed (sources), for the
        # admin API that alters them; None when not configured
        self.quota_source = None
        self.credential_source = None
        # set by the server, which owns what they use
        self.advertise = None  # node id -> the (host, port) a client is given
        self.offload = None  # offload(fn, *args): run a key derivation off the loop
        self.api_versions = None  # the broker's ApiVersions ranges (``current``, ``fetch()``)
        # OAUTHBEARER: the JWKS keys clients' tokens are checked against
        # (sources.jwks.JwksKeys), and the proxy's own token towards the brokers
        self.jwks = None
        self.upstream_token = None
        # --upstream-identity delegation-token: sources.delegation_tokens.DelegationTokens
        self.tokens = None
        # the cluster's ACLs enforced per client principal (filters.authorization.
        # AclView), or None: not asked for (--authorization none, sasl passthrough)
        self.acls = None
        # the cluster state followed for the filters that take it
        # (follows_cluster_state): sources.cluster_state or state_topic, or None
        self.cluster_state = None
