"""Property-based fuzzing of the connection pipeline (kthrottle/proxy/pipeline.py)
with hypothesis: bytes in from both sides, actions out, no sockets.

A client session (a SASL login, then real requests of every API and version
of tests/test_fuzz_codecs.py's corpus) is perturbed (frames mutated, swapped,
dropped, repeated; SASL frames, raw tokens, unknown API keys and versions
inserted) and fed in pieces of random sizes; a model broker cuts what
reaches it into frames and answers each, in order, with a real response of
the same API and version, mutated, with the wrong correlation id, garbage, a
raw token, or not at all; the broker connection comes up, jobs finish and
timers fire at random moments, as the adapter (connection.py) would make
them. Each connection runs one filter list: the standard filters alone, with
quotas tight enough to throttle, SASL terminate (with and without the
proxy's own login to the broker), SASL passthrough, the proxy's login alone,
or the storage filter (reading Produce partitions as they stream).

Properties:

1. no input makes the connection raise; it carries on, or ends with exactly
   one Close action, after which nothing more is sent either way (the client
   closing its side ends every connection with one);
2. nothing is sent to the broker before it is connected, and with SASL
   terminate nothing before the client has authenticated;
3. a huge count or size prefix costs lines and memory in proportion to the
   bytes that came (as tests/test_fuzz_codecs.py checks the codecs).

Bugs found in kthrottle/proxy are pinned at the end of this module, each as
its smallest case, as regression tests.

Runs as tests/test_fuzz_codecs.py does: the "ci" profile by default; the
environment variable ``KTHROTTLE_FUZZ_EXAMPLES=N`` runs N randomized examples
per test (see that module's docstring).
"""
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthrottle.codecs import apis
from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.policy.quotas import QuotaManager
from kthrottle.policy.storage import (
    PAUSE,
    PAUSE_STATE,
    THROTTLE,
    ClusterState,
    State,
    StoragePolicy,
)
from kthrottle.proxy.filters.sasl_passthrough import SaslPassthrough
from kthrottle.proxy.filters.sasl_terminate import SaslTerminate
from kthrottle.proxy.filters.upstream_login import UpstreamSaslLogin
from kthrottle.proxy.filters import standard_filters
from kthrottle.proxy.pipeline import (
    ANONYMOUS,
    MAX_RESPONSE_SIZE,
    Close,
    Connection,
    ConnectUpstream,
    FilterTable,
    HELD,
    HoldResponses,
    NodesSeen,
    PauseClient,
    ResumeBroker,
    ResumeClient,
    RunJob,
    SendToBroker,
    SendToClient,
)
from kthrottle.proxy.filters.storage import StorageThrottle
from kthrottle.sources.credentials import Credentials, scram_from_password
from kthrottle_testkit.frames import filled_response
from test_fuzz_codecs import (
    ANY_RESPONSES,
    INT32,
    REQUESTS,
    RESPONSES,
    examples,
    mutate,
    mutation,
    run_bounded,
    with_huge_count,
)
from test_sasl import authenticate, handshake, plain

pytestmark = pytest.mark.fuzz

MAX_FRAME = 1 << 20
MECHANISMS = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = apis.API_VERSIONS, 17, 36
ACTIONS = (SendToBroker, SendToClient, PauseClient, ResumeClient, HoldResponses, ResumeBroker,
           NodesSeen, ConnectUpstream, RunJob, Close)
# what a broker answers ApiVersions with (the ranges a terminating proxy answers from)
BROKER_RANGES = ((0, 0, 13), (1, 0, 18), (3, 0, 13), (17, 0, 1), (18, 0, 4), (36, 0, 2))


def advertise(node_id):
    """As the proxy's (server.py): a node id mapping outside 1-65535 is a
    ValueError, which closes the connection."""
    port = 30000 + node_id
    if not 0 < port < 65536:
        raise ValueError("node id %d maps to port %d" % (node_id, port))
    return "proxy.example", port


# -- the filter lists ---------------------------------------------------------------

def _quotas():
    # tight enough that a few requests are throttled, responses patched and held
    return QuotaManager({"clients/<default>": {PRODUCER_BYTE_RATE: 300.0,
                                               CONSUMER_BYTE_RATE: 300.0, REQUEST_RATE: 4.0}})


def _storage(scope, states):
    storage = StorageThrottle(StoragePolicy("cluster", PAUSE, max_age=60), pause_max_ms=2000,
                              base_rate=500.0)
    storage.policy.scope = scope
    wall = 1_800_000_000.0
    cluster, partitions = states
    storage.policy.update(ClusterState(wall, cluster, (), partitions))
    storage.refresh(wall, 0.0)
    return storage


class _BrokerVersions:
    """A terminating proxy's ApiVersions cache (server.ApiVersionsCache):
    the ranges known, or asked for in a job that may fail."""

    def __init__(self, known):
        self.current = BROKER_RANGES if known else None
        self.calls = 0

    def fetch(self):
        self.calls += 1
        if self.calls % 2 == 0:
            raise OSError("no broker answered")
        return BROKER_RANGES


# SCRAM credentials, derived once; each connection gets a snapshot of its own,
# since a snapshot remembers the PLAIN logins it checked (and an example must
# not depend on the ones before it)
SCRAM_CREDENTIALS = {user: {m: scram_from_password(m, password, iterations=4096)
                            for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")}
                     for user, password in (("alice", "alice-secret"), ("bob", "bob-secret"))}


def _terminate(known_versions, upstream_login):
    quotas = _quotas()
    credentials = Credentials(SCRAM_CREDENTIALS)
    authenticator = SaslTerminate(MECHANISMS, lambda: credentials, failed_delay_ms=100,
                                  api_versions=_BrokerVersions(known_versions))
    login = UpstreamSaslLogin("PLAIN", "proxy", "proxy-secret") if upstream_login else None
    return standard_filters(advertise, quotas, authenticator, upstream_login=login), quotas


CONFIGS = {
    "standard": lambda: (standard_filters(advertise), None),
    "quotas": lambda: (lambda m: (standard_filters(advertise, m), m))(_quotas()),
    # as the proxy runs it: the proxy's own login to a SASL broker once the client is in
    "sasl-terminate": lambda: _terminate(True, True),
    "sasl-terminate-fetching-versions": lambda: _terminate(False, False),
    "sasl-passthrough": lambda: (lambda m: (standard_filters(
        advertise, m, SaslPassthrough(MECHANISMS, failed_delay_ms=100)), m))(_quotas()),
    "upstream-login": lambda: (standard_filters(
        advertise, None, upstream_login=UpstreamSaslLogin("PLAIN", "proxy", "proxy-secret")), None),
    "storage-partitions": lambda: (standard_filters(advertise, storage=_storage(
        "partition", (State(THROTTLE, 0.5), {("s1", 7): PAUSE_STATE, ("orders", 0): PAUSE_STATE,
                                            ("orders", 1): State(THROTTLE, 0.2)}))), None),
    "storage-cluster": lambda: (standard_filters(advertise, storage=_storage(
        "cluster", (PAUSE_STATE, {}))), None),
}


# -- client frames ----------------------------------------------------------------------

def raw_token(token):
    return INT32.pack(len(token)) + token


def _scram_first(user):
    return ("n,,n=%s,r=fyko+d2lbbFgONRv9qkxdawL" % user).encode()


SASL_FRAMES = (
    [handshake(1, m, v) for m in MECHANISMS + ["GSSAPI", ""] for v in (0, 1)]
    + [authenticate(2, token, v) for v in (0, 1, 2)
       for token in (plain("alice", "alice-secret"), plain("alice", "wrong"),
                     plain("bob", "bob-secret", authzid="alice"), _scram_first("bob"),
                     b"", b"\xff\xfe", b"n,,n=,r=x")]
    + [raw_token(token) for token in (plain("alice", "alice-secret"), _scram_first("alice"),
                                      b"c=biws,r=x,p=AAAA", b"", b"\x00" * 9)]
)


def _raw_request(api_key, version, body=b"", client_id=b"app-1"):
    payload = struct.pack(">hhih", api_key, version, 3, len(client_id)) + client_id + body
    return INT32.pack(len(payload)) + payload


ODD_FRAMES = [
    _raw_request(999, 0), _raw_request(0, 50), _raw_request(1, 99), _raw_request(-1, 0),
    _raw_request(18, 7, b"\x00\x00"),  # an ApiVersions newer than the proxy decodes
    _raw_request(4, 0), _raw_request(7, 0),  # LeaderAndIsr; ControlledShutdown v0 (header v0)
    _raw_request(0, 3, b"\xff\xff\x00\x00"),  # a Produce cut short after transactional_id
    INT32.pack(0), INT32.pack(-1), INT32.pack(6) + b"\x00" * 6,
]

ALL_CLIENT_FRAMES = [frame for _, _, frame in REQUESTS] + SASL_FRAMES + ODD_FRAMES
# requests a client sends once connected (real ones, at every version)
SESSION_FRAMES = [frame for key, _, frame in REQUESTS
                  if key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE)]


def with_correlation_id(frame, correlation_id):
    if len(frame) < 12:
        return frame
    frame = bytearray(frame)
    INT32.pack_into(frame, 8, correlation_id)
    return bytes(frame)


def _api_versions_request(version):
    return next(frame for key, v, frame in REQUESTS if key == API_VERSIONS and v == version)


@st.composite
def sasl_login(draw):
    """The frames of one SASL login: (ApiVersions,) a handshake and its first
    token, right or wrong, in SaslAuthenticate or raw (SaslHandshake v0)."""
    frames = []
    if draw(st.booleans()):
        frames.append(_api_versions_request(draw(st.integers(0, 4))))
    mechanism = draw(st.sampled_from(["PLAIN"] * 4 + ["SCRAM-SHA-256", "SCRAM-SHA-512"]))
    version = draw(st.integers(0, 1))
    frames.append(handshake(1, mechanism, version))
    if mechanism == "PLAIN":
        token = draw(st.sampled_from([plain("alice", "alice-secret")] * 3
                                     + [plain("alice", "wrong"), plain("eve", "x", "alice")]))
    else:
        token = _scram_first(draw(st.sampled_from(["alice", "mallory"])))
    tokens = [token]
    if mechanism != "PLAIN":  # a client-final (its proof wrong: the client is not interactive)
        tokens.append(b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=AAAA")
    authenticate_version = draw(st.integers(0, 2))
    frames += [raw_token(t) if version == 0 else authenticate(2, t, authenticate_version)
               for t in tokens]
    return frames


@st.composite
def client_session(draw, sasl):
    """What one client sends: (a SASL login, then) requests, in order and
    with correlation ids 1, 2, ... as a client numbers them; then a few
    perturbations: a frame mutated, two swapped, one dropped, repeated, or
    another (any request, SASL frame, raw token, odd frame) inserted.
    Returns (login, requests): a client sends its requests once logged in."""
    frames = draw(sasl_login()) if sasl else []
    login = len(frames)
    frames += draw(st.lists(st.sampled_from(SESSION_FRAMES), max_size=6))
    frames = [with_correlation_id(f, i + 1) for i, f in enumerate(frames)]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["mutate", "mutate", "swap", "drop", "repeat", "insert"]))
        if kind == "insert" or not frames:
            frames.insert(draw(st.integers(0, len(frames))), draw(st.sampled_from(
                SASL_FRAMES if sasl and draw(st.booleans()) else ALL_CLIENT_FRAMES)))
            continue
        i = draw(st.integers(0, len(frames) - 1))
        if kind == "mutate":
            frames[i] = mutate(frames[i], draw(st.lists(mutation, min_size=1, max_size=2)),
                               reframe=draw(st.booleans()))
        elif kind == "swap":
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif kind == "drop":
            del frames[i]
            login -= i < login
        else:
            frames.insert(i, frames[i])
            login += i < login
    return b"".join(frames[:login]), b"".join(frames[login:])


# -- a model broker --------------------------------------------------------------------

ANSWERS = {}  # (api_key, version) -> real responses of that API and version
for case in RESPONSES + ANY_RESPONSES:
    ANSWERS.setdefault(case[:2], []).append(case[2])


def _answer_of(api_key, version, correlation_id, data):
    """A real response to this request, or None when kafka-python knows none."""
    frames = ANSWERS.get((api_key, version))
    if frames is None:
        cls = apis.ALL_RESPONSES.get(api_key)
        if cls is None or not cls.min_version <= version <= cls.max_version:
            return None
        frames = ANSWERS[api_key, version] = [filled_response(cls, version)]
    frame = bytearray(data.draw(st.sampled_from(frames)))
    INT32.pack_into(frame, 4, correlation_id)
    return bytes(frame)


class Broker:
    """Cuts what the proxy sends into frames and answers them when asked."""

    def __init__(self):
        self.rx = bytearray()  # bytes from the proxy not yet cut into a frame
        self.offset = 0  # stream offset of rx[0]
        self.garbage = False  # a size prefix no frame can have: cut no more
        self.requests = []  # to answer: (api_key, version, correlation_id), None if raw
        self.seen = []  # every frame cut: (stream offset, what requests holds for it)
        self.tx = bytearray()  # bytes for the proxy, not yet delivered

    def receive(self, data):
        self.rx += data
        while not self.garbage and len(self.rx) >= 4:
            size = INT32.unpack_from(self.rx, 0)[0]
            if size < 0:
                self.garbage = True
                return
            if len(self.rx) < 4 + size:
                return
            request = struct.unpack_from(">hhi", self.rx, 4) if size >= 8 else None
            self.requests.append(request)
            self.seen.append((self.offset, request))
            del self.rx[: 4 + size]
            self.offset += 4 + size

    def answer(self, data):
        """Queue an answer to the oldest request not answered yet."""
        if not self.requests:
            return
        request = self.requests.pop(0)
        kind = data.draw(st.sampled_from(["real"] * 5 + ["mutated"] * 2
                                         + ["wrong-id", "garbage", "raw", "none"]))
        answer = None
        if request is not None and kind in ("real", "mutated", "wrong-id"):
            api_key, version, correlation_id = request
            if kind == "wrong-id":
                correlation_id += 1
            answer = _answer_of(api_key, version, correlation_id, data)
            if answer is not None and kind == "mutated":
                answer = mutate(answer, data.draw(st.lists(mutation, min_size=1, max_size=2)),
                                reframe=data.draw(st.booleans()))
        if answer is None and kind != "none":
            if kind == "garbage":
                answer = data.draw(st.binary(max_size=24))
            else:  # a raw token's answer (SaslHandshake v0): a length, then bytes
                answer = raw_token(data.draw(st.binary(max_size=16)))
        if answer:
            self.tx += answer


# -- the driver ---------------------------------------------------------------------------

# What happens next, weighted; the client rarely goes away mid-way (it does
# at the end of every run), and not as hypothesis's simplest choice.
OPS = (["client", "answer", "broker"] * 10 + ["connect", "job", "tick"] * 6 + ["eof", "impatient"]
       + ["client", "answer", "broker"] * 10)


class Driver:
    """Feeds one Connection as the adapter (connection.py) would and checks
    every action list it returns."""

    def __init__(self, config):
        filters, quotas = CONFIGS[config]()
        self.terminate = config.startswith("sasl-terminate")
        self.conn = Connection(FilterTable(filters), MAX_FRAME, quotas,
                               max_receive_before_auth=4096)
        self.now = 0.0
        self.closed = False
        self.connect_asked = False  # ConnectUpstream seen
        self.connected = False  # broker_connected called
        self.jobs = []  # RunJob actions not carried out yet
        self.client = bytearray()  # what the client still has to send
        self.later = b""  # and what it sends once authenticated (or impatient)
        self.broker = Broker()

    def run(self, actions):
        assert isinstance(actions, (list, tuple))
        for action in actions:
            assert isinstance(action, ACTIONS), action
            if self.closed:
                assert not isinstance(action, (SendToBroker, SendToClient, Close)), (
                    "%r after the connection was closed" % (action,))
            if isinstance(action, Close):
                assert isinstance(action.reason, str)
                self.closed = True
            elif isinstance(action, SendToBroker):
                assert self.connected, "%r before the broker connection" % (action,)
                if self.terminate:  # nothing of the client's before it authenticated
                    assert self.conn.principal != ANONYMOUS, action
                self.broker.receive(b"".join(bytes(c) for c in action.chunks))
            elif isinstance(action, SendToClient):
                b"".join(bytes(c) for c in action.chunks)
            elif isinstance(action, NodesSeen):
                assert all(isinstance(node.host, str) for node in action.nodes)
            elif isinstance(action, ConnectUpstream):
                assert not self.connected
                self.connect_asked = True
            elif isinstance(action, RunJob):
                self.jobs.append(action)
        # each side's state is the one its fields make, whatever the input did
        assert self.conn.reading is self.conn._reading_now()
        assert self.conn.responding is self.conn._responding_now()

    def call(self, method, *args):
        """One input to the connection; its actions checked and carried out."""
        self.run(method(*args))

    def step(self, data):
        op = data.draw(st.sampled_from(OPS))
        if self.later and (op == "impatient" or self.conn.principal != ANONYMOUS):
            self.client += self.later
            self.later = b""
        if op == "client" and self.client:
            self.feed_client(data.draw(st.one_of(st.just(len(self.client)),
                                                 st.integers(1, len(self.client)))))
        elif op == "answer":
            self.broker.answer(data)
        elif op == "broker" and self.broker.tx and self.connected:
            self.feed_broker(data.draw(st.one_of(st.just(len(self.broker.tx)),
                                                 st.integers(1, len(self.broker.tx)))))
        elif op == "tick":
            self.now += data.draw(st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.3, 1.0, 2.5, 12.0]))
            self.call(self.conn.tick, self.now)
        elif op == "connect":
            self.connect()
        elif op == "job" and self.jobs:
            self.finish_job()
        elif op == "eof":
            self.call(self.conn.client_eof)

    def feed_client(self, n):
        chunk, self.client = bytes(self.client[:n]), self.client[n:]
        passed = self.conn.pass_request(chunk, self.now)
        if passed:  # the adapter's short way
            assert self.connected and not self.closed
            if self.terminate:
                assert self.conn.principal != ANONYMOUS
            if passed is True:
                self.broker.receive(chunk)
            else:  # a mute: what goes on before it, then the mute
                self.run(passed)
            return
        self.call(self.conn.client_data, chunk, self.now)

    def feed_broker(self, n):
        chunk, self.broker.tx = bytes(self.broker.tx[:n]), self.broker.tx[n:]
        passed = self.conn.pass_response(chunk)
        if passed:  # the adapter's short way: data, nothing yet, or a response made whole
            assert not self.closed
            assert passed is True or passed is HELD or (
                isinstance(passed, list) and b"".join(bytes(c) for c in passed))
            return
        self.call(self.conn.broker_data, chunk, self.now)

    def connect(self):
        if self.connect_asked and not self.connected and not self.closed:
            self.connected = True
            self.call(self.conn.broker_connected, self.now)

    def finish_job(self):
        job = self.jobs.pop(0)
        try:
            result, error = job.job(), None
        except Exception as exc:  # the adapter hands a job's exception on
            result, error = None, exc
        self.call(self.conn.job_done, job.token, result, error, self.now)

    def drain(self, data):
        """Everything still on its way is delivered, in a few rounds (the
        broker answers, the timers fire)."""
        for round in range(4):
            if self.later and (round == 2 or self.conn.principal != ANONYMOUS):
                self.client += self.later
                self.later = b""
            self.connect()
            while self.jobs:
                self.finish_job()
            if self.client:
                self.feed_client(len(self.client))
            while self.broker.requests:
                self.broker.answer(data)
            if self.broker.tx and self.connected:
                self.feed_broker(len(self.broker.tx))
            self.now += 15.0
            self.call(self.conn.tick, self.now)

    def finish(self):
        """The client goes away: the connection ends with its one Close."""
        self.call(self.conn.client_eof)
        assert self.closed
        self.call(self.conn.close, "shutdown")
        self.call(self.conn.client_data, b"\x00\x00\x00\x0a", self.now + 1)
        if self.connected:
            self.call(self.conn.broker_data, b"\x00\x00\x00\x0a", self.now + 1)
        self.call(self.conn.tick, self.now + 100)
        for job in self.jobs:
            self.call(self.conn.job_done, job.token, None, OSError("closed"), self.now + 100)


def _fuzz(config, data, steps=40):
    driver = Driver(config)
    login, requests = data.draw(client_session(sasl="sasl" in config))
    if login:  # the requests wait for the answer to the login
        driver.client += login
        driver.later = requests
    else:
        driver.client += requests
    driver.call(driver.conn.client_accepted, driver.now)
    for _ in range(data.draw(st.integers(steps // 2, steps))):
        driver.step(data)
    driver.drain(data)
    driver.finish()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@examples(400)
@given(data=st.data())
def test_any_bytes_from_either_side_never_raise_and_close_once(config, data):
    _fuzz(config, data)


# -- property 2 through the pipeline: a size or count costs what arrived ----------------

GATHERED_RESPONSES = [case for case in RESPONSES
                      if apis.needs_rewrite(case[0], case[1]) and (case[0], case[1]) in {
                          (key, version) for key, version, _ in REQUESTS}]
KTHROTTLE_DIR = os.path.dirname(os.path.dirname(apis.__file__))


@examples(100)
@given(with_huge_count(GATHERED_RESPONSES), st.booleans(), st.data())
def test_a_huge_count_or_size_in_a_response_costs_what_arrived(case, lie_about_size, data):
    """A response the proxy reads (addresses, throttle time) with a huge
    count, or a size prefix claiming 1 GiB, costs lines and memory in
    proportion to the bytes that came, not to what they claim."""
    api_key, version, response = case
    config = data.draw(st.sampled_from(["standard", "quotas"]))
    request = next(frame for key, v, frame in REQUESTS if (key, v) == (api_key, version))
    response = with_correlation_id(response, 1)
    if lie_about_size:
        response = INT32.pack(MAX_RESPONSE_SIZE) + response[4:]

    drivers = [_driver(config), _driver(config)]  # run_bounded runs twice: traced, untraced

    def run():
        driver = drivers.pop()
        driver.call(driver.conn.client_data, with_correlation_id(request, 1), 0.0)
        driver.call(driver.conn.broker_data, response, 0.0)

    run_bounded(run, len(request) + len(response), traced_dir=KTHROTTLE_DIR)


@examples(100)
@given(with_huge_count(REQUESTS), st.booleans(), st.sampled_from(
    ["standard", "storage-partitions", "sasl-terminate", "sasl-passthrough"]))
def test_a_huge_count_or_size_in_a_request_costs_what_arrived(case, lie_about_size, config):
    _api_key, _version, request = case
    if lie_about_size:
        request = INT32.pack(MAX_FRAME) + request[4:]

    drivers = [_driver(config, connect=not config.startswith("sasl-terminate"))
               for _ in range(2)]

    def run():
        driver = drivers.pop()
        driver.call(driver.conn.client_data, request, 0.0)

    run_bounded(run, len(request), traced_dir=KTHROTTLE_DIR)


# -- the bugs the fuzzing found in kthrottle/proxy, each as its smallest case --------------

def _driver(config, connect=True):
    driver = Driver(config)
    driver.call(driver.conn.client_accepted, 0.0)
    if connect:
        driver.connect()
    return driver


def _frame(api_key, version, correlation_id, body=b""):
    """A request frame with an empty client-id and ``body``."""
    payload = struct.pack(">hhih", api_key, version, correlation_id, 0) + body
    return INT32.pack(len(payload)) + payload


@pytest.mark.parametrize("config", ["sasl-terminate", "sasl-passthrough"])
@pytest.mark.parametrize("frames", [
    # SaslHandshake v1 without its mechanism
    [_frame(SASL_HANDSHAKE, 1, 1)],
    # SaslHandshake v1 whose mechanism is not UTF-8
    [_frame(SASL_HANDSHAKE, 1, 1, b"\x00\x01\xff")],
    # SaslHandshake v1 (PLAIN), then SaslAuthenticate v1 without auth_bytes
    [handshake(1, "PLAIN", 1), _frame(SASL_AUTHENTICATE, 1, 2)],
    # ... or with null auth_bytes (length -1)
    [handshake(1, "PLAIN", 1), _frame(SASL_AUTHENTICATE, 1, 2, b"\xff\xff\xff\xff")],
    # ... or SaslAuthenticate v2 (flexible) ending after its header's tagged fields
    [handshake(1, "PLAIN", 1), _frame(SASL_AUTHENTICATE, 2, 2, b"\x00")],
], ids=["handshake-without-mechanism", "mechanism-not-utf8", "authenticate-without-bytes",
        "authenticate-null-bytes", "authenticate-v2-cut-short"])
def test_found_a_malformed_sasl_request_closes(config, frames):
    """kafka-python's decoders raised out of client_data (struct.error,
    UnicodeDecodeError, IndexError; TypeError from a null auth_bytes)."""
    driver = _driver(config, connect=config == "sasl-passthrough")
    for frame in frames:
        driver.call(driver.conn.client_data, frame, 0.0)
    driver.finish()


def _sasl_answer(correlation_id, body):
    return INT32.pack(4 + len(body)) + INT32.pack(correlation_id) + body


@pytest.mark.parametrize("case", [
    # passthrough: the client's SaslAuthenticate v1 answered with an error code alone
    ("sasl-passthrough", "authenticate-answer-cut-short"),
    # the proxy's own login: its SaslHandshake v1 answered with an error code alone
    ("upstream-login", "handshake-answer-cut-short"),
    # ... or refused (33) with a null mechanisms array
    ("upstream-login", "handshake-refused-null-mechanisms"),
], ids=lambda case: "-".join(case))
def test_found_a_malformed_sasl_answer_from_the_broker_closes(case):
    """The same decoders raised out of broker_data (struct.error; TypeError
    joining a null mechanisms array)."""
    config, kind = case
    driver = _driver(config)
    conn = driver.conn
    if config == "sasl-passthrough":
        driver.call(conn.client_data, handshake(1, "PLAIN", 1), 0.0)
        driver.call(conn.broker_data, _sasl_answer(1, b"\x00\x00\x00\x00\x00\x00"), 0.0)
        driver.call(conn.client_data, authenticate(2, plain("alice", "alice-secret"), 1), 0.0)
        driver.call(conn.broker_data, _sasl_answer(2, b"\x00\x00"), 0.0)
    else:
        (_offset, (_key, _version, correlation_id)), = driver.broker.seen
        body = b"\x00\x00" if kind == "handshake-answer-cut-short" else b"\x00\x21\xff\xff\xff\xff"
        driver.call(conn.broker_data, _sasl_answer(correlation_id, body), 0.0)
    driver.finish()


def test_found_an_empty_frame_from_the_broker_while_a_raw_token_is_in_flight_closes():
    """The response framing admits 0-byte frames while a raw SASL token
    (SaslHandshake v0) is in flight; _response_head read a correlation id
    from one (struct.error out of broker_data) when the response due was
    not the raw answer."""
    driver = _driver("sasl-passthrough")
    conn = driver.conn
    # SaslHandshake v0 and an ApiVersions request, pipelined
    driver.call(conn.client_data, handshake(1, "PLAIN", 0)
                + with_correlation_id(_api_versions_request(0), 2), 0.0)
    driver.call(conn.broker_data, _sasl_answer(1, b"\x00\x00\x00\x00\x00\x00"), 0.0)
    driver.call(conn.client_data, raw_token(plain("alice", "alice-secret")), 0.0)  # relayed raw
    driver.call(conn.broker_data, INT32.pack(0), 0.0)  # the ApiVersions answer is due
    driver.finish()


def test_fixed_bug_send_after_close_when_early_bytes_close():
    """Client bytes that came before the proxy's own login ended are replayed
    inside broker_data; when they close the connection after a request the
    proxy answers itself, nothing may be sent after the Close."""
    driver = _driver("upstream-login")
    conn = driver.conn
    # before the login is through: an ApiVersions too new (answered by the
    # proxy, UNSUPPORTED_VERSION), then a frame of negative size
    driver.call(conn.client_data, _frame(API_VERSIONS, 5, 1) + INT32.pack(-1), 0.0)
    (_offset, (_key, _version, correlation_id)), = driver.broker.seen
    driver.call(conn.broker_data, _sasl_answer(correlation_id, b"\x00\x00\x00\x00\x00\x00"),
                0.0)  # SaslHandshake: no error, no mechanisms listed
    (_offset, (_key, _version, correlation_id)) = driver.broker.seen[-1]
    # SaslAuthenticate: no error, no message, no bytes, session lifetime 0
    driver.call(conn.broker_data, _sasl_answer(correlation_id, b"\x00\x00\xff\xff\x00\x00\x00\x00"
                                               + bytes(8)), 0.0)
    driver.finish()
