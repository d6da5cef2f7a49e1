"""KIP-55 quota resolution and the per-bucket accounting behind throttling.

Resolution: for a connection's (user principal, client-id) and one quota key,
the most specific configured entity wins, in this order (Kafka's own):

    1 users/<u>/clients/<c>        2 users/<u>/clients/<default>
    3 users/<u>                    4 users/<default>/clients/<c>
    5 users/<default>/clients/<default>
    6 users/<default>              7 clients/<c>
    8 clients/<default>            9 static quota.producer/consumer.default
    then unlimited.

Sharing: Kafka keys a quota's bucket by metric tags (user, client-id). A
level that names a user but no client (3, 6) gives each user one bucket for
all its clients; levels with both (1, 2, 4, 5) give each <user, client> its
own; client levels (7, 8, 9) give each client-id one bucket across users.
So a <default> quota still gives every user or client a bucket of its own.
Each quota key resolves on its own (a user may have a produce quota at one
level and a fetch quota at another), as each of Kafka's quota managers does.

Beside the client quotas: ``ips/<ip>`` then ``ips/<default>`` for the
connection creation rate (KIP-612: each address its own bucket), and
``topics/<topic>`` then ``topics/<default>`` for kthrottle's per-topic byte
rates (each topic its own bucket, shared by every client writing or reading
it). A quota whose entity holds observe_only (or every quota, with
QuotaSettings.observe_only) is measured and reported but delays no one.
"""
import json
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .entities import (
    CONNECTION_CREATION_RATE,
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    DEFAULT,
    OBSERVE_ONLY,
    PRODUCER_BYTE_RATE,
    QUOTA_KEYS,
    REQUEST_RATE,
    sanitize,
)
from .callback_api import (
    QUOTA_TYPE_OF_KEY,
    Cluster,
    KafkaPrincipal,
    QuotaCallbackError,
    check_limit,
    check_tags,
    snapshot_changes,
    tags_identity,
    takes_broker,
)
from .rate import SampledRate, TokenBucket, released_total, throttle_seconds, to_ms

log = logging.getLogger("kthrottle.quotas")

# The entity of a bucket a quota callback made (QuotaManager.callback).
CALLBACK_ENTITY = "callback"

WINDOW = "window"
TOKEN_BUCKET = "token-bucket"

# Kafka's API keys for the rules below (the policy speaks Kafka's numbering
# without depending on the codecs).
PRODUCE = 0
FETCH = 1
SHARE_FETCH = 78  # KIP-932: counted on the fetch quota, as Fetch is
# Inter-broker cluster actions are exempt from request quotas (KIP-124):
# LeaderAndIsr, StopReplica, UpdateMetadata, ControlledShutdown.
REQUEST_QUOTA_EXEMPT = frozenset((4, 5, 6, 7))


class Decision(NamedTuple):
    """What a request or response earned: a throttle time and why."""

    delay_ms: int
    reason: str | None  # the quota key that set the delay (None: no delay)


NO_DELAY = Decision(0, None)

# Leases (QuotaManager.lease): what a connection may send without its buckets
# being asked, in token-bucket mode. A lease is taken from what the buckets
# hold less what is leased from them already, this fraction of it, so that
# all the leases of a bucket together stay within what it holds; it lasts at
# most LEASE_SECONDS, and is not given for fewer than LEASE_LEAST requests.
# Fetch grants (ClientQuotas.fetch_grant): the share of what a bucket holds
# one Fetch may ask for, and the least share of the burst one goes with.
FETCH_GRANT_FRACTION = 0.5
FETCH_GRANT_LEAST = 1 / 16

LEASE_FRACTION = 0.125
LEASE_SECONDS = 0.1
LEASE_LEAST = 4
UNLIMITED = 1 << 62  # a lease's share of a quota key without a quota


def client_quotas_apply(api_key, replica_id):
    """A follower's replication fetch (replica_id >= 0) is a broker, not a
    client: no client quota counts it (KIP-124 exempts it from request
    quotas; Kafka has separate replication quotas)."""
    return not (api_key == FETCH and replica_id >= 0)


def request_quota_applies(api_key, acks):
    """Whether a request counts against the request-rate quota (KIP-124):
    cluster actions do not (the proxy refuses them from clients anyway). An
    acks=0 Produce does, unlike in Kafka: Kafka exempts it because no
    response can carry its throttle time, but the proxy can stop reading the
    client instead, and an exempt request is a way past the quota."""
    return api_key not in REQUEST_QUOTA_EXEMPT


class Resolution(NamedTuple):
    """Where a quota comes from and which bucket it is counted in."""

    limit: float | None  # None: unlimited
    entity: str | None  # the config path that set it ("static" or None)
    user_tag: str  # metric tags: who shares the bucket
    client_tag: str
    observe_only: bool = False  # the entity marks it observe-only (a dry run)
    # a bucket that KIP-55's levels did not make (a quota group's, a
    # callback's): what sets it apart from any (user, client-id) bucket, the
    # fourth part of its key (see bucket_key)
    scope: str | None = None


# A shared capacity is reported to the fleet as a bucket of its own (its rate
# and demand the sum of its buckets'), so that the fleet splits it among the
# proxies as it splits any quota; this user tag names it.
CAPACITY_USER = "<shared capacity>"
CAPACITY_ENTITY = "capacity"


def capacity_sharing_key(key):
    return (key, CAPACITY_USER, "")


def bucket_key(key, resolution):
    """A client bucket's key in QuotaManager.buckets: (key, user tag, client
    tag) as Kafka's metric tags name it, and a fourth part for a scoped one
    (a group's, a callback's), so that no principal's name, however it is
    spelt, lands in a group's or a callback's bucket."""
    if resolution.scope is None:
        return (key, resolution.user_tag, resolution.client_tag)
    return (key, resolution.user_tag, resolution.client_tag, resolution.scope)


def callback_scope(tags):
    """The scope of a callback's bucket: its tags, exactly (JSON)."""
    return json.dumps(sorted(tags.items()), separators=(",", ":"), ensure_ascii=False)


def scope_tags(scope):
    """The tags callback_scope wrote."""
    return dict(json.loads(scope))


def exchanged_entity(text):
    """(entity, scope) of the entity field Bucket.exchanged_entity wrote."""
    if text.startswith(GROUP_PREFIX):
        return text, text
    if text.startswith(CALLBACK_ENTITY + ":"):
        return CALLBACK_ENTITY, text[len(CALLBACK_ENTITY) + 1:]
    return text, None


class QuotaConfig:
    """An immutable index over a quota snapshot for O(1) resolution.

    ``snapshot`` is ``{entity path: {quota key: value}}`` with sanitized names
    (see entities.entity_path), plus an optional ``"static"`` entry holding
    static defaults keyed by quota key.
    """

    def __init__(self, snapshot=None):
        self.snapshot = dict(snapshot or {})
        self._paths = {path: cfg for path, cfg in self.snapshot.items()
                       if path not in ("static", GROUPS)}
        self._static = dict(self.snapshot.get("static", {}))
        self.groups = QuotaGroups(self.snapshot.get(GROUPS))
        # has_topic_quotas and has_ip_quotas, once known: every /metrics scrape
        # asks, and each answer is a scan of every entity (22 ms at 100,000)
        self._has_topic_quotas = self._has_ip_quotas = None

    def has_entity(self, entity):
        """Whether ``entity`` (a bucket's) is still configured."""
        if entity in self.snapshot:
            return True
        return entity is not None and entity.startswith(GROUP_PREFIX) \
            and entity[len(GROUP_PREFIX):] in self.groups.config

    def entity_config(self, entity):
        """{quota key: value} of an entity path, "static" or groups/NAME."""
        if entity is not None and entity.startswith(GROUP_PREFIX):
            return self.groups.config.get(entity[len(GROUP_PREFIX):])
        cfg = self.snapshot.get(entity)
        return cfg if entity != GROUPS else None

    def resolve(self, user, client_id, key):
        """The quota for ``key`` of a connection of principal ``user`` (name as
        is; ANONYMOUS for PLAINTEXT, KIP-55) sending ``client_id``. A quota
        group a User member puts the principal in comes first; one a
        client-id member puts the client in comes after every level naming
        a user (as clients/<c> does), so that no client escapes its user's
        quota by the client-id it picks."""
        groups = self.groups
        if groups:
            found = groups.by_user(user, key)
            if found is not None:
                return found
        su = sanitize(user)
        sc = sanitize(client_id or "")
        paths = self._paths
        d = DEFAULT
        for path, user_tag, client_tag in (
            ("users/%s/clients/%s" % (su, sc), user, client_id),
            ("users/%s/clients/%s" % (su, d), user, client_id),
            ("users/%s" % su, user, ""),
            ("users/%s/clients/%s" % (d, sc), user, client_id),
            ("users/%s/clients/%s" % (d, d), user, client_id),
            ("users/%s" % d, user, ""),
            (None, None, None),  # the client-id members of quota groups, here
            ("clients/%s" % sc, "", client_id),
            ("clients/%s" % d, "", client_id),
        ):
            if path is None:
                if groups:
                    found = groups.by_client(client_id or "", key)
                    if found is not None:
                        return found
                continue
            cfg = paths.get(path)
            if cfg is not None and key in cfg:
                return Resolution(cfg[key], path, user_tag, client_tag or "",
                                  bool(cfg.get(OBSERVE_ONLY)))
        if key in self._static:
            return Resolution(self._static[key], "static", "", client_id or "")
        return Resolution(None, None, "", client_id or "")

    def group_limit(self, name, key):
        cfg = self.groups.config.get(name)
        return None if cfg is None else cfg.get(key)

    def limit_for_tags(self, key, user_tag, client_tag):
        """The quota of the (user, client-id) bucket ``resolve`` tagged (user
        tag, client tag), None when no entity gives such tags any more
        (KIP-257's quotaLimit of the default callback)."""
        paths = self._paths
        d = DEFAULT
        if user_tag:
            su = sanitize(user_tag)
            if client_tag:
                sc = sanitize(client_tag)
                candidates = ("users/%s/clients/%s" % (su, sc), "users/%s/clients/%s" % (su, d),
                              "users/%s/clients/%s" % (d, sc), "users/%s/clients/%s" % (d, d))
            else:
                candidates = ("users/%s" % su, "users/%s" % d)
        else:
            candidates = ("clients/%s" % sanitize(client_tag), "clients/%s" % d)
        for path in candidates:
            cfg = paths.get(path)
            if cfg is not None and key in cfg:
                return cfg[key]
        return None if user_tag else self._static.get(key)

    def _resolve_named(self, kind, name, key):
        """``<kind>/<name>`` then ``<kind>/<default>``; each name its own
        bucket either way (tagged by the name, in the client tag)."""
        paths = self._paths
        for path in (kind + "/" + name, kind + "/" + DEFAULT):
            cfg = paths.get(path)
            if cfg is not None and key in cfg:
                return Resolution(cfg[key], path, "", name, bool(cfg.get(OBSERVE_ONLY)))
        return Resolution(None, None, "", name)

    def resolve_topic(self, topic, key):
        """A topic's producer_byte_rate or consumer_byte_rate."""
        return self._resolve_named("topics", topic, key)

    def resolve_ip(self, ip, key=CONNECTION_CREATION_RATE):
        """An address's connection_creation_rate (KIP-612); ``ip`` in its
        canonical text (entities.ip_name)."""
        return self._resolve_named("ips", ip, key)

    @property
    def has_topic_quotas(self):
        if self._has_topic_quotas is None:
            self._has_topic_quotas = any(path.startswith("topics/") for path in self._paths)
        return self._has_topic_quotas

    @property
    def has_ip_quotas(self):
        if self._has_ip_quotas is None:
            self._has_ip_quotas = any(path.startswith("ips/") for path in self._paths)
        return self._has_ip_quotas


# Quota groups (KIP-257's first scenario, built in): the snapshot's "groups"
# entry, {name: {"members": [...], quota key: value, ...}}, from the quota
# file's [groups.NAME] tables. Every member shares one bucket per quota key,
# tagged {"group": NAME}; its entity is groups/NAME.
GROUPS = "groups"
GROUP_PREFIX = "groups/"
USER_MEMBER = "User:"
CLIENT_MEMBER = "client-id:"


def member_pattern(member):
    """``User:alice``, ``User:team-*``, ``client-id:etl-*`` -> (kind, pattern);
    ``*`` stands for any run of characters and is the only special one.
    Raises ValueError for anything else."""
    for kind in (USER_MEMBER, CLIENT_MEMBER):
        if isinstance(member, str) and member.startswith(kind) and len(member) > len(kind):
            return kind, member[len(kind):]
    raise ValueError("a group member is User:<principal> or client-id:<client-id> "
                     "(* for any characters), got %r" % (member,))


def _matcher(pattern):
    if "*" not in pattern:
        return pattern.__eq__
    import re

    rx = re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)
    return lambda name: rx.fullmatch(name) is not None


class QuotaGroups:
    """The quota groups of a snapshot, for resolution: the first group (in
    the file's order) that has the member and the quota key wins."""

    def __init__(self, groups=None):
        self.config = dict(groups or {})
        self._users, self._clients = [], []
        for name, cfg in self.config.items():
            for member in cfg.get("members", ()):
                kind, pattern = member_pattern(member)
                (self._users if kind == USER_MEMBER else self._clients).append(
                    (_matcher(pattern), name))
        self._tags = {name: tags_identity({"group": name})[0] for name in self.config}

    def __bool__(self):
        return bool(self.config)

    def _first(self, members, name, key):
        for match, group in members:
            if match(name):
                cfg = self.config[group]
                if key in cfg:
                    return Resolution(cfg[key], GROUP_PREFIX + group, self._tags[group], "",
                                      bool(cfg.get(OBSERVE_ONLY)), GROUP_PREFIX + group)
        return None

    def by_user(self, user, key):
        return self._first(self._users, user, key) if self._users else None

    def by_client(self, client_id, key):
        return self._first(self._clients, client_id, key) if self._clients else None


@dataclass(frozen=True)
class QuotaSettings:
    samples: int = 11  # quota.window.num
    window: float = 1.0  # quota.window.size.seconds
    # Longest byte-rate delay for one response, in seconds. None: W, the
    # padded window the rate is measured over (10-11 s by default). Kafka
    # leaves byte-rate throttles uncapped; capping them keeps a client from
    # being parked for minutes after a burst, while a sustained overuse is
    # still repaid over successive responses.
    max_throttle: float | None = None
    # Longest request-rate delay, in seconds. None: one quota window, as
    # Kafka caps request-quota throttles (KIP-124), so that a throttled
    # coordinator connection still heartbeats within a session timeout.
    max_request_throttle: float | None = None
    # TOKEN_BUCKET (default): a client may burst ``burst_seconds`` of its quota,
    # then is held to the quota; steady state lands on the quota. WINDOW:
    # exactly Kafka's sampled windows and X = (O - T) / T x W, including the
    # broker's ~10 s initial burst and the re-bursts each time the window
    # holding a burst expires (about 10% over the quota in steady state).
    mode: str = TOKEN_BUCKET
    # Token bucket only: the burst allowance, in seconds of the quota.
    burst_seconds: float = 1.0
    # Every quota observe-only (a dry run of the whole source): measured and
    # reported, no one delayed.
    observe_only: bool = False

    def __post_init__(self):
        if self.samples < 2:
            raise ValueError("quota window count must be at least 2")
        if self.window <= 0:
            raise ValueError("quota window size must be positive")
        if self.mode not in (WINDOW, TOKEN_BUCKET):
            raise ValueError("quota mode must be %r or %r" % (WINDOW, TOKEN_BUCKET))
        if self.burst_seconds <= 0:
            raise ValueError("burst seconds must be positive")
        if self.max_throttle is not None and self.max_throttle <= 0:
            raise ValueError("max throttle must be positive")
        if self.max_request_throttle is not None and self.max_request_throttle <= 0:
            raise ValueError("max request throttle must be positive")


class Bucket:
    """The accounting for one (quota key, user tag, client tag).

    ``quota`` is the configured quota (the fleet-wide one, KIP-55);
    ``limit`` is the one applied, what requests are measured against: the
    quota itself, or this proxy's share of it in a fleet (``QuotaManager.
    apply_shares``). Both change only when the configuration or the shares
    do, never per request."""

    __slots__ = ("key", "user_tag", "client_tag", "quota", "limit", "entity", "settings",
                 "rate", "tokens", "cap", "last_used", "throttle_ms_total", "throttled",
                 "held", "observe_only", "observed", "observed_ms_total",
                 "observed_last_ms", "others_total", "others_throttle_ms", "others_throttled",
                 "others_observed", "others_observed_ms", "leased", "credit", "scope",
                 "kind", "touched")

    def __init__(self, key, resolution, settings, limit=None, kind=None, touched=None):
        self.key = key
        self.kind = kind or CLIENT_BUCKETS  # which of QuotaManager's dicts holds it
        # QuotaManager.touched while the usage exchange (--workers) has not
        # seen this bucket's use since its last look: the first use appends
        # the bucket there and sets this to None, the exchange sets it back.
        # None without an exchange, so that each use costs one test.
        self.touched = touched
        self.user_tag = resolution.user_tag
        self.client_tag = resolution.client_tag
        self.scope = resolution.scope  # (bucket_key)
        self.settings = settings
        # the longest delay (None: W as measured, window mode)
        if key == REQUEST_RATE:
            self.cap = settings.max_request_throttle or settings.window
        elif key == CONNECTION_CREATION_RATE:
            self.cap = settings.window  # Kafka's cap for a throttled connection (KIP-612)
        else:
            self.cap = settings.max_throttle or (
                (settings.samples - 1) * settings.window if settings.mode == TOKEN_BUCKET else None)
        self.rate = SampledRate(settings.samples, settings.window)
        self.tokens = None
        self.quota = None
        self.limit = None
        self.entity = None
        self.last_used = None
        self.throttle_ms_total = 0
        self.throttled = 0
        # observe-only: the throttles it would have given (how many, their
        # total and the last one, ms); throttled and throttle_ms_total stay 0
        self.observe_only = False
        self.observed = 0
        self.observed_ms_total = 0
        self.observed_last_ms = 0
        # throttled requests of the last window or so, (recorded at, released
        # at, value): for the rate let through (released); made when needed
        self.held = None
        # what the other worker processes counted in their bucket of this
        # identity (--workers, add_others): apart from the counters above,
        # which are what this process sends them
        self.others_total = 0
        self.others_throttle_ms = 0
        self.others_throttled = 0
        self.others_observed = 0
        self.others_observed_ms = 0
        self.leased = 0  # units leased from it and not settled yet (QuotaManager.lease)
        self.credit = 0  # bytes paid for ahead and not delivered yet (ClientQuotas.prepay_fetch)
        self.set_limit(resolution, limit)

    def set_limit(self, resolution, limit=None):
        """A new configured quota (and entity); ``limit`` is the one to apply
        (default: the quota itself)."""
        self.quota = resolution.limit
        self.entity = resolution.entity
        self.observe_only = resolution.observe_only or self.settings.observe_only
        self.apply_limit(resolution.limit if limit is None else limit)

    def apply_limit(self, limit):
        """Apply ``limit`` live: the measured rate stays, a token bucket keeps
        what it holds (up to the new burst allowance)."""
        self.limit = limit
        if self.settings.mode == TOKEN_BUCKET and limit is not None:
            burst = limit * self.settings.burst_seconds
            if self.key == CONNECTION_CREATION_RATE and burst < 1.0:
                burst = 1.0  # a connection is one unit: under one, none would ever be taken
            if self.tokens is None:
                self.tokens = TokenBucket(limit, burst)
            else:
                self.tokens.set_limit(limit, burst)

    @property
    def exchanged_entity(self):
        """The entity another worker process is told this bucket counts for:
        its entity, and a callback bucket's tags after it (exchanged_entity)."""
        if self.entity == CALLBACK_ENTITY:
            return "%s:%s" % (CALLBACK_ENTITY, self.scope)
        return self.entity or ""

    @property
    def total(self):
        """Everything this process recorded: bytes, or requests (a counter);
        the rate's running sum holds the other workers' too."""
        return self.rate.counted - self.others_total

    def used(self, now):
        """Used at ``now``: for the idle expiry, and noted for the usage
        exchange (--workers) if it has not seen this bucket's use yet."""
        self.last_used = now
        if self.touched is not None:
            self.touched.append(self)
            self.touched = None

    def record(self, value, now):
        """Count ``value`` and return the throttle time in ms it earns."""
        self.last_used = now  # used(now), written out (this runs per request)
        if self.touched is not None:
            self.touched.append(self)
            self.touched = None
        rate = self.rate  # SampledRate.record, written out (this runs per request)
        if now >= rate._end:
            rate.roll(now)
        rate.counted += value
        if self.limit is None:
            return 0
        bucket = self.tokens
        if bucket is not None:
            # TokenBucket.record, written out: ``value`` taken moves the time
            # the bucket is full again on; beyond its span, that is the delay
            full_at = bucket.full_at
            if full_at < now:
                full_at = now
            full_at += value / bucket.limit
            bucket.full_at = full_at
            bucket._last = now
            delay = full_at - now - bucket.span
            if delay <= 0:
                return 0
            cap = self.cap
        else:
            total, w = rate.scan(now)
            delay = throttle_seconds(total / w, self.limit, w)
            if delay <= 0:
                return 0
            cap = self.cap or w
        ms = to_ms(delay if delay < cap else cap)
        if ms and self.observe_only:
            self.observed += 1
            self.observed_ms_total += ms
            self.observed_last_ms = ms
            if self.tokens is not None:
                # as if the client had waited: the debt it would have paid
                # back meanwhile is not carried into the next request's delay
                self.tokens.forgive(ms / 1000.0 * self.limit)
            return 0
        if ms:
            self.throttled += 1
            self.throttle_ms_total += ms
            self._hold(value, now, ms)
        return ms

    def lease(self, now, least):
        """Units a lease may take from this bucket (QuotaManager.lease):
        LEASE_FRACTION of what it holds at ``now`` less what is leased from
        it already; 0 when that is under ``least`` or in window mode (each
        request there is measured, as Kafka measures it)."""
        tokens = self.tokens
        if tokens is None:
            return 0 if self.limit is not None else UNLIMITED
        grant = int((tokens.held(now) - self.leased) * LEASE_FRACTION)
        if grant < least:
            return 0
        self.leased += grant
        return grant

    def charge(self, value, now):
        """Count ``value`` with no throttle of its own: KIP-599's strict mode
        lets the request that crosses the quota through whole, and the debt it
        leaves refuses the next ones (debt_ms)."""
        self.used(now)
        self.rate.record(value, now)
        if self.tokens is not None:
            self.tokens.record(value, now)

    def add_others(self, value, now, throttle_ms=0, throttled=0, observed=0, observed_ms=0):
        """Usage another worker process of this proxy counted in its bucket
        of the same identity (--workers): in the rate and the token bucket
        here too, so that the clients of every worker are held to the quota
        together, but no throttle of its own (that worker gave its client
        the throttle). Kept apart from ``total`` and the other own counters,
        so it is never sent back."""
        self.last_used = now
        self.rate.record(value, now)
        if self.tokens is not None:
            self.tokens.record(value, now)
        self.others_total += value
        self.others_throttle_ms += throttle_ms
        self.others_throttled += throttled
        self.others_observed += observed
        self.others_observed_ms += observed_ms

    def note_refused(self, ms, now):
        """A request refused in the broker's place for a violated quota: a
        throttle of ``ms`` given, nothing recorded (Kafka checks the quota
        before it records)."""
        self.used(now)
        self.throttled += 1
        self.throttle_ms_total += ms

    def unrecord(self, value, now):
        """Take back ``value`` just recorded and throttled: it was not taken
        (KIP-612 does not count a throttled connection, so a flood does not
        push the address's next connections further out). The throttle it
        earned stays counted."""
        self.rate.record(-value, now)
        if self.tokens is not None:
            self.tokens.record(-value, now)  # exactly what record() took
        if self.held:
            self.held.pop()  # the entry record() just added: nothing was let through

    def _hold(self, value, now, ms):
        """A throttled request: let through over the ``ms`` it earned."""
        held = self.held
        if held is None:
            held = self.held = deque(maxlen=MAX_HELD)
        else:
            _forget_released(held, now, self.settings)
        held.append((now, now + ms / 1000.0, value))

    def debt_ms(self, now):
        """The throttle time in ms the bucket is in violation by now, without
        recording anything (KIP-599's strict check: a request that comes while
        its quota is violated is refused: note_refused)."""
        if self.limit is None:
            return 0
        if self.tokens is not None:
            delay = self.tokens.throttle_seconds(now)
            cap = self.cap
        else:
            total, w = self.rate.scan(now)
            delay = throttle_seconds(total / w, self.limit, w)
            cap = self.cap or w
        if delay <= 0:
            return 0
        return to_ms(delay if delay < cap else cap)

    def debt_seconds(self, now):
        """How long the bucket is in debt for at ``now`` (0.0: it is not),
        uncapped and without recording anything: while it is, no request
        counted in it is let through, on any connection (Kafka keys the
        quota on the <user, client-id> sensor, never on the connection). An
        observe-only bucket owes nothing."""
        if self.limit is None or self.observe_only:
            return 0.0
        tokens = self.tokens
        if tokens is not None:
            delay = tokens.full_at - now - tokens.span
            return delay if delay > 0 else 0.0
        total, w = self.rate.scan(now)
        return throttle_seconds(total / w, self.limit, w)

    def measure(self, now):
        """Kafka's windowed rate: each request counted when it arrives."""
        return self.rate.measure(now)

    def released(self, now):
        """The rate let through over the window measure() reads: a
        throttled request counts as let through evenly over its delay, as
        its client is held back for it, so the request that earned a
        throttle is not all counted at once (measure() counts it whole on
        arrival, as Kafka does: a 1 MB batch against a 200 KB/s quota reads
        up to 1.5x the quota there)."""
        total, w = self.rate.scan(now)
        held = self.held
        if held:
            _forget_released(held, now, self.settings)
            total = released_total(total, w, now, held)
        return max(0.0, total / w)

    def max_in_window(self):
        """The most one fetch may ask for: Kafka's cap, quota x (samples - 1)
        x window, in window mode; the burst allowance in token-bucket mode, so
        that one response cannot carry ten times what the bucket holds."""
        if self.limit is None:
            return None
        settings = self.settings
        if settings.mode == TOKEN_BUCKET:
            return self.limit * settings.burst_seconds
        return self.limit * (settings.samples - 1) * settings.window


# Throttled requests a bucket remembers for its released rate: a throttled
# client is held back for its delay, so this many in one window are many
# clients sharing the bucket; past it the oldest are forgotten (the rate then
# reads a little high).
MAX_HELD = 4096


class Lease:
    """What one connection's Produce requests may take unjudged until
    ``until`` (QuotaManager.lease): bytes and requests left of those given,
    from the ``produce`` and ``request`` buckets (None: no quota)."""

    __slots__ = ("bytes_left", "requests_left", "until", "bytes_given", "requests_given",
                 "produce", "request")

    def __init__(self, nbytes, requests, until, produce, request):
        self.bytes_left = self.bytes_given = nbytes
        self.requests_left = self.requests_given = requests
        self.until = until
        self.produce = produce
        self.request = request

    def take(self, nbytes, now):
        """A request of ``nbytes`` at ``now`` takes from the lease and goes on
        unjudged (True), or does not fit (False: it is judged)."""
        if self.bytes_left >= nbytes and self.requests_left and now < self.until:
            self.bytes_left -= nbytes
            self.requests_left -= 1
            return True
        return False


def _forget_released(held, now, settings):
    """Throttled requests let through before any window the rate can read
    (samples x window back) no longer count."""
    horizon = now - settings.samples * settings.window
    while held and held[0][1] <= horizon:
        held.popleft()


class ClientQuotas:
    """The buckets one (user, client-id) counts in, resolved once per
    configuration generation; None for a quota key with no quota (no quota,
    no bucket). What a connection holds on to; it asks for decisions."""

    __slots__ = ("manager", "user", "client_id", "broker", "generation", "produce", "fetch",
                 "request", "mutation", "fetch_cap")

    def __init__(self, manager, user, client_id, broker=None):
        self.manager = manager
        self.user = user
        self.client_id = client_id
        self.broker = broker  # the node id the connection talks to (a callback may use it)
        self.generation = -1
        self.produce = self.fetch = self.request = self.mutation = None
        # the grant of the Fetch let through last (fetch_grant), for the
        # filter that caps its max_bytes to it; None: none given
        self.fetch_cap = None
        self.refresh()

    def refresh(self):
        m = self.manager
        user, client_id, broker = self.user, self.client_id, self.broker
        self.produce = m.bucket(PRODUCER_BYTE_RATE, user, client_id, broker)
        self.fetch = m.bucket(CONSUMER_BYTE_RATE, user, client_id, broker)
        self.request = m.bucket(REQUEST_RATE, user, client_id, broker)
        self.mutation = m.bucket(CONTROLLER_MUTATION_RATE, user, client_id, broker)
        self.generation = m.generation

    def current(self):
        if self.generation != self.manager.generation:
            self.refresh()
        return self

    def debt(self, api_key, acks, now):
        """Decision: how long (ms, uncapped) the buckets a request of
        ``api_key`` counts in are in debt at ``now``, and which quota key;
        None when none is. The request quota for every request it applies to,
        the producer byte rate for a Produce, the consumer byte rate for a
        Fetch or ShareFetch."""
        if self.generation != self.manager.generation:
            self.refresh()
        owed = 0.0
        reason = None
        bucket = self.request
        if bucket is not None and request_quota_applies(api_key, acks):
            owed = bucket.debt_seconds(now)
            if owed:
                reason = REQUEST_RATE
        if api_key == PRODUCE:
            bucket, key = self.produce, PRODUCER_BYTE_RATE
        elif api_key == FETCH or api_key == SHARE_FETCH:
            bucket, key = self.fetch, CONSUMER_BYTE_RATE
        else:
            bucket = None
        if bucket is not None:
            d = bucket.debt_seconds(now)
            if d > owed:
                owed, reason = d, key
        # under a millisecond is paid: a timer due within one fires (as a
        # mute that ends a little early must not hold the next request)
        ms = int(owed * 1000)
        return Decision(ms, reason) if ms > 0 else None

    def on_request(self, api_key, nbytes, acks, now):
        """A request of ``nbytes`` (the whole frame). A Produce counts whole
        against the byte quota, as in Kafka (data is accepted, then the
        client is throttled); every request but the exempt ones counts
        against the request quota. When both are violated the larger delay
        applies (KIP-124)."""
        if api_key == PRODUCE and acks != 0:
            return self.on_produce(nbytes, now) or NO_DELAY
        if self.generation != self.manager.generation:
            self.refresh()
        delay = 0
        reason = None
        bucket = self.request
        if bucket is not None and request_quota_applies(api_key, acks):
            delay = bucket.record(1, now)
            if delay:
                reason = REQUEST_RATE
        if api_key == PRODUCE:
            bucket = self.produce
            if bucket is not None:
                produce_delay = bucket.record(nbytes, now)
                if produce_delay > delay:
                    delay = produce_delay
                    reason = PRODUCER_BYTE_RATE
        return Decision(delay, reason) if delay else NO_DELAY

    def on_produce(self, nbytes, now):
        """on_request for a Produce awaiting its response (acks 1 or -1): it
        counts against both quotas; None when it earned no delay. The common
        request, so written out."""
        if self.generation != self.manager.generation:
            self.refresh()
        delay = 0
        bucket = self.request
        if bucket is not None:
            delay = bucket.record(1, now)
        bucket = self.produce
        if bucket is not None:
            produce_delay = bucket.record(nbytes, now)
            if produce_delay > delay:
                return Decision(produce_delay, PRODUCER_BYTE_RATE)
        return Decision(delay, REQUEST_RATE) if delay else None

    def fetch_grant(self, now):
        """What a Fetch let through at ``now`` may ask for: FETCH_GRANT_FRACTION
        of what its bucket holds, so that the fetches in flight together (a
        client pipelining, or on many connections) ask for no more than the
        bucket holds; each is charged what it asks for when it goes
        (admit_fetch) and its response settles the difference. None without
        a fetch quota to enforce, or in window mode (Kafka's cap applies,
        fetch_max_bytes)."""
        fetch = self.current().fetch
        if fetch is None or fetch.observe_only or fetch.tokens is None:
            return None
        held = fetch.tokens.held(now)
        return held * FETCH_GRANT_FRACTION if held > 0 else 0.0

    def admit_fetch(self, asked, now):
        """A Fetch (or ShareFetch) goes at ``now`` asking for ``asked`` bytes
        (None: as much as it may): what it is charged, at least one byte and
        at most its grant (fetch_grant), which becomes ``fetch_cap``, what
        the request is capped to. The charge is taken from the bucket's
        tokens until the response settles it (on_fetch_response); the
        measured rate counts the response alone. 0 without a grant to
        enforce (``fetch_cap`` None); None when the grant is under the least
        (fetch_grant_least): it waits (fetch_grant_wait_ms), charged nothing."""
        grant = self.fetch_cap = self.fetch_grant(now)
        if grant is None:
            return 0
        if grant < self.fetch.tokens.burst * FETCH_GRANT_LEAST:  # (fetch_grant_least)
            self.fetch_cap = None
            return None
        charged = int(min(max(grant if asked is None else asked, 1), grant))
        self.fetch.tokens.record(charged, now)
        return charged

    def fetch_grant_least(self):
        """The least grant a Fetch goes with: less, and it waits
        (fetch_grant_wait_ms) rather than go for a sliver, which a broker
        would answer with one whole batch anyway (KIP-74)."""
        return self.fetch.tokens.burst * FETCH_GRANT_LEAST

    def fetch_grant_wait_ms(self, now):
        """How long until the bucket holds enough for the least grant."""
        tokens = self.fetch.tokens
        need = tokens.burst * FETCH_GRANT_LEAST / FETCH_GRANT_FRACTION - tokens.held(now)
        return max(1, to_ms(need / tokens.limit))

    def on_fetch_response(self, nbytes, now, charged=0):
        """A Fetch response of ``nbytes`` on its way to the client; its
        request was charged ``charged`` (admit_fetch), given back now."""
        if self.generation != self.manager.generation:
            self.refresh()
        bucket = self.fetch
        if bucket is None:
            return NO_DELAY
        if charged and bucket.tokens is not None:
            bucket.tokens.record(-charged, now)
        delay = bucket.record(nbytes, now)
        return Decision(delay, CONSUMER_BYTE_RATE) if delay else NO_DELAY

    def prepay_fetch(self, nbytes, now, charged=0):
        """A Fetch response of ``nbytes``, more than its bucket's whole burst
        holds (a record batch larger than that: a broker sends one whole,
        KIP-74): None when it is to go on as it is (counted by
        on_fetch_response), 0 when it goes on paid for already (counted
        here), or a throttle in ms when it is not to be delivered now. Such
        a response is paid for ahead: the bucket takes it
        now (its debt holds the client's next fetches), the proxy answers the
        fetch empty, and when the client fetches it again once the debt is
        paid it goes out of that credit, counted then in the measured rate.
        So a batch larger than the burst comes no sooner than the quota
        allows, as the client is held by the time that has not passed yet
        rather than by the time after."""
        if self.generation != self.manager.generation:
            self.refresh()
        bucket = self.fetch
        if bucket is None or bucket.tokens is None or bucket.observe_only:
            return None
        tokens = bucket.tokens
        if nbytes <= tokens.burst:
            return None
        if charged:
            tokens.record(-charged, now)
        if bucket.credit >= nbytes:  # paid for: delivered now, counted (0)
            bucket.credit -= nbytes
            bucket.used(now)
            bucket.rate.record(nbytes, now)
            return 0
        tokens.record(nbytes, now)
        bucket.credit += nbytes
        bucket.used(now)
        owed = tokens.throttle_seconds(now)
        ms = max(1, to_ms(min(owed, bucket.cap or owed)))
        bucket.throttled += 1
        bucket.throttle_ms_total += ms
        return ms

    def lease_produce(self, nbytes, now):
        """QuotaManager.lease for this client's Produce requests, after one of
        ``nbytes`` earned no delay; None in window mode or when its buckets
        hold too little."""
        m = self.manager
        if self.generation != m.generation:
            self.refresh()
        if m.settings.mode != TOKEN_BUCKET:
            return None
        return m.lease(self.produce, self.request, nbytes, now)

    # One quota key at a time (benchmarks and tests of the rate rules).

    def record_produce(self, nbytes, now):
        self.current()
        return self.produce.record(nbytes, now) if self.produce is not None else 0

    def record_fetch(self, nbytes, now):
        self.current()
        return self.fetch.record(nbytes, now) if self.fetch is not None else 0

    def record_request(self, now):
        self.current()
        return self.request.record(1, now) if self.request is not None else 0

    def fetch_max_bytes(self):
        """The most one Fetch may ask for (None: no fetch quota)."""
        fetch = self.current().fetch
        if fetch is None or fetch.observe_only:  # a dry run caps nothing
            return None
        return fetch.max_in_window()


# The kinds of buckets (QuotaManager.buckets_of): a bucket's identity across
# the worker processes is its kind, key and tags.
CLIENT_BUCKETS = "c"  # (key, user tag, client tag)
TOPIC_BUCKETS = "t"  # (key, topic): topic in the client tag
IP_BUCKETS = "i"  # ip: connection_creation_rate, the address in the client tag

# What a bucket's applied limit follows (QuotaManager.sharing).
CONFIGURED = "configured"  # the configured quota: not a fleet member, or fail-safe "whole"
SHARES = "shares"  # this proxy's share; prior x quota for a bucket not listed
EQUAL = "equal"  # quota / number of proxies (fail-safe "equal")

# The least fraction of its quota a share leaves a bucket: a limit of 0 would
# divide by zero, and a share of nothing still lets a client through slowly.
MIN_SHARE_FRACTION = 0.001


class QuotaManager:
    """All buckets of one proxy. Per request: a dict lookup at most, no work
    proportional to the number of configured entities or live buckets.

    In a fleet of proxies (``apply_shares``) each bucket's applied limit is
    this proxy's share of the configured quota; shares change limits when
    they are applied, on the buckets themselves, so requests pay nothing."""

    def __init__(self, snapshot=None, settings=None, callback=None):
        self.settings = settings or QuotaSettings()
        self.config = QuotaConfig(snapshot)
        self.generation = 0
        # a quota callback (KIP-257, --quota-callback); None: the proxy's own
        # resolution (QuotaConfig: KIP-55's levels and quota groups)
        self.callback = callback
        self.callback_name = callback and type(callback).__name__
        self._callback_broker = callback is not None and takes_broker(callback)
        if callback is not None and snapshot:
            self._tell_callback({}, self.config.snapshot)  # (at start: an error stops it)
        self.cluster = Cluster()  # the partition leaders the callback was last given
        # shared capacity (capacity.SharedCapacity) per quota key: the limits
        # of that key's buckets are their parts of it (apply_capacity)
        self.capacity = {}
        self.buckets = {}  # (key, user tag, client tag) -> Bucket
        self.topic_buckets = {}  # (key, topic) -> Bucket (tags: "", topic)
        self.ip_buckets = {}  # ip -> Bucket of connection_creation_rate (tags: "", ip)
        # the buckets used since the usage exchange's last look (track_touched;
        # None: no exchange, --workers 1)
        self.touched = None
        # fleet shares (see apply_shares)
        self.sharing = CONFIGURED
        self.shares = {}  # (key, user tag, client tag) -> share
        self.share_quotas = {}  # (key, user tag, client tag) -> fleet quota the share is of
        self.prior = 1.0
        self.fleet_size = 0  # the fleet members the shares were computed for
        # the leases given and not settled yet, by id(), and the latest time
        # a lease was asked for (for a settle that is given none)
        self.leases = {}
        self.latest = -math.inf

    # leases ----------------------------------------------------------------

    def lease(self, produce, request, nbytes, now):
        """A lease for the Produce requests of one connection (``produce``
        and ``request``: its buckets, None where no quota applies) after one
        of ``nbytes`` was judged and earned no delay, or None: a Lease.
        Until its ``until``, a request that fits in what is
        left takes it from there and goes on unjudged: none of them could
        earn a delay, as together they take no more than the buckets hold
        (tokens only come back with time). What was taken is counted in the
        buckets when the lease is settled (settle): by the connection when
        it runs out, ends or changes client, and here whenever a reader of
        the buckets (metrics, the workers' and the fleet's exchanges) or a
        change of configuration or limits needs them exact. Token-bucket
        mode only."""
        if now > self.latest:
            self.latest = now
        nbytes = UNLIMITED if produce is None else produce.lease(now, LEASE_LEAST * nbytes)
        if not nbytes:
            return None
        requests = UNLIMITED if request is None else request.lease(now, LEASE_LEAST)
        if not requests:
            if produce is not None:
                produce.leased -= nbytes
            return None
        lease = Lease(nbytes, requests, now + LEASE_SECONDS, produce, request)
        self.leases[id(lease)] = lease
        return lease

    def settle(self, lease, now=None):
        """Count what ``lease`` took in its buckets (at ``now``, or the latest
        time a lease was asked for) and end it: its next request is judged."""
        if self.leases.get(id(lease)) is not lease:
            return  # settled already
        del self.leases[id(lease)]
        if now is None or now < self.latest:
            now = self.latest
        nbytes, requests = lease.bytes_left, lease.requests_left
        given_bytes, given_requests = lease.bytes_given, lease.requests_given
        produce, request = lease.produce, lease.request
        lease.bytes_left = lease.requests_left = 0
        lease.until = -math.inf
        if request is not None:
            request.leased -= given_requests
            if requests < given_requests:
                request.charge(given_requests - requests, now)
        if produce is not None:
            produce.leased -= given_bytes
            if nbytes < given_bytes:
                produce.charge(given_bytes - nbytes, now)

    def settle_leases(self, now=None):
        """Settle every lease: the buckets are exact (before they are read),
        and what a lease was sized on may change."""
        if self.leases:
            for lease in list(self.leases.values()):
                self.settle(lease, now)

    def update(self, snapshot):
        """A new configuration: live connections re-resolve on their next
        request; existing buckets keep their measured rates (and, in a
        fleet, their shares, against the new quota)."""
        self.settle_leases()
        before = self.config.snapshot
        self.config = QuotaConfig(snapshot)
        self.generation += 1
        if self.callback is not None:
            try:
                self._tell_callback(before, self.config.snapshot)
            except QuotaCallbackError as exc:  # the source goes on; so do the quotas
                log.warning("%s; the callback may not know every quota", exc)
            self._relimit_callback_buckets()
        # a bucket whose entity is gone is dropped now (its clients resolve
        # again on their next request), not left in the metrics for an hour
        config = self.config
        for buckets in (self.buckets, self.topic_buckets, self.ip_buckets):
            gone = [k for k, b in buckets.items()
                    if b.entity != CALLBACK_ENTITY and not config.has_entity(b.entity)]
            for k in gone:
                del buckets[k]

    # the quota callback (KIP-257) --------------------------------------------------

    def _call(self, what, method, *args):
        """A callback's method; what it raises becomes a QuotaCallbackError
        naming the call (the connection that asked is closed for it)."""
        try:
            return method(*args)
        except QuotaCallbackError:
            raise
        except Exception as exc:
            raise QuotaCallbackError("quota callback %s.%s failed: %s: %s" % (
                self.callback_name, what, type(exc).__name__, exc)) from exc

    def _tell_callback(self, before, after):
        """update_quota and remove_quota for what changed, then (kthrottle's
        addition, for a callback that has it) quota_snapshot with the whole."""
        cb = self.callback
        for quota_type, entity, value in snapshot_changes(before, after):
            if value is None:
                self._call("remove_quota", cb.remove_quota, quota_type, entity)
            else:
                self._call("update_quota", cb.update_quota, quota_type, entity, value)
        whole = getattr(cb, "quota_snapshot", None)
        if whole is not None:
            self._call("quota_snapshot", whole, after)

    def _callback_resolution(self, key, user, client_id, broker):
        cb = self.callback
        quota_type = QUOTA_TYPE_OF_KEY[key]
        principal = KafkaPrincipal("User", user)
        client_id = client_id or ""
        if self._callback_broker:
            tags = self._call("quota_metric_tags", cb.quota_metric_tags, quota_type, principal,
                              client_id, broker)
        else:
            tags = self._call("quota_metric_tags", cb.quota_metric_tags, quota_type, principal,
                              client_id)
        tags = check_tags(tags, "%s.quota_metric_tags" % self.callback_name)
        if tags is None:
            return Resolution(None, None, "", client_id)
        limit = check_limit(self._call("quota_limit", cb.quota_limit, quota_type, tags),
                            "%s.quota_limit" % self.callback_name)
        user_tag, client_tag = tags_identity(tags)
        return Resolution(limit, CALLBACK_ENTITY, user_tag, client_tag, False,
                          callback_scope(tags))

    def _relimit_callback_buckets(self):
        """Every callback bucket's limit asked again (after an update, a
        reset or new cluster metadata); a bucket whose tags have no limit
        any more is dropped."""
        cb = self.callback
        gone = []
        for bkey, bucket in self.buckets.items():
            if bucket.entity != CALLBACK_ENTITY:
                continue
            try:
                limit = check_limit(self._call("quota_limit", cb.quota_limit,
                                               QUOTA_TYPE_OF_KEY[bucket.key],
                                               scope_tags(bucket.scope)),
                                    "%s.quota_limit" % self.callback_name)
            except QuotaCallbackError as exc:
                log.warning("%s; its bucket %r is dropped", exc, bkey)
                limit = None
            if limit is None:
                gone.append(bkey)
            elif limit != bucket.quota:
                bucket.set_limit(Resolution(limit, CALLBACK_ENTITY, bucket.user_tag,
                                            bucket.client_tag, False, bucket.scope),
                                 self.applied_limit(bkey, limit))
        for bkey in gone:
            del self.buckets[bkey]

    def _reset(self):
        self.settle_leases()
        self.generation += 1  # every client asks for its tags again
        self._relimit_callback_buckets()

    def poll_callback(self):
        """Once a second: a callback whose quotas changed on their own
        (quota_reset_required) has every client's tags and every limit
        asked again. True when it did."""
        cb = self.callback
        if cb is None:
            return False
        try:
            required = any([self._call("quota_reset_required", cb.quota_reset_required, t)
                            for t in QUOTA_TYPE_OF_KEY.values()])
        except QuotaCallbackError as exc:
            log.warning("%s; the quotas stay as they are", exc)
            return False
        if required:
            self._reset()
        return required

    def note_leaders(self, leaders, brokers=()):
        """Leaders a Metadata answer named ({(topic, partition): node}), over
        those known: update_cluster with the whole when any moved."""
        known = self.cluster.leaders
        if all(known.get(tp) == node for tp, node in leaders.items()):
            return False
        merged = dict(known)
        merged.update(leaders)
        return self.update_cluster(Cluster(self.cluster.brokers | frozenset(brokers), merged))

    def update_cluster(self, cluster):
        """New partition leaders for the callback (update_cluster_metadata);
        True when its quotas changed and were applied."""
        cb = self.callback
        if cb is None:
            return False
        self.cluster = cluster
        try:
            changed = self._call("update_cluster_metadata", cb.update_cluster_metadata, cluster)
        except QuotaCallbackError as exc:
            log.warning("%s; the quotas stay as they are", exc)
            return False
        if changed:
            self._reset()
        return bool(changed)

    def close_callback(self):
        cb, self.callback = self.callback, None
        if cb is not None:
            try:
                cb.close()
            except Exception as exc:
                log.warning("quota callback %s.close failed: %s: %s", self.callback_name,
                            type(exc).__name__, exc)

    def bucket(self, key, user, client_id, broker=None):
        """The bucket counting ``key`` for this user and client-id (and the
        broker its connection talks to, for a callback that tags by broker);
        None when no quota applies (nothing is measured for unlimited
        clients). Raises QuotaCallbackError when a callback fails."""
        if self.callback is None:
            resolution = self.config.resolve(user, client_id, key)
        else:
            resolution = self._callback_resolution(key, user, client_id, broker)
        if resolution.limit is None:
            return None
        bkey = bucket_key(key, resolution)
        bucket = self.buckets.get(bkey)
        if bucket is None:
            bucket = self.buckets[bkey] = Bucket(
                key, resolution, self.settings, self.applied_limit(bkey, resolution.limit),
                touched=self.touched)
        elif (bucket.quota != resolution.limit or bucket.entity != resolution.entity
              or bucket.observe_only != (resolution.observe_only or self.settings.observe_only)):
            bucket.set_limit(resolution, self.applied_limit(bkey, resolution.limit))
        return bucket

    def client(self, user, client_id, broker=None):
        return ClientQuotas(self, user, client_id, broker)

    def _named_bucket(self, kind, bucket_key, key, resolution):
        if resolution.limit is None:
            return None
        buckets = self.buckets_of(kind)
        bucket = buckets.get(bucket_key)
        if bucket is None:
            bucket = buckets[bucket_key] = Bucket(key, resolution, self.settings, kind=kind,
                                                  touched=self.touched)
        elif (bucket.quota != resolution.limit or bucket.entity != resolution.entity
              or bucket.observe_only != (resolution.observe_only or self.settings.observe_only)):
            bucket.set_limit(resolution)
        return bucket

    def topic_bucket(self, key, topic):
        """The bucket counting ``key`` (producer_byte_rate or
        consumer_byte_rate) for ``topic``, shared by every client; None when
        the topic has no such quota. Not shared out in a fleet: each proxy
        holds the topic's whole quota. Callers keep what it returns for a
        generation (it resolves two paths)."""
        return self._named_bucket(TOPIC_BUCKETS, (key, topic), key,
                                  self.config.resolve_topic(topic, key))

    def connection_bucket(self, ip):
        """The connection_creation_rate bucket of the address ``ip``
        (canonical text, entities.ip_name); None when it has none."""
        return self._named_bucket(IP_BUCKETS, ip, CONNECTION_CREATION_RATE,
                                  self.config.resolve_ip(ip))

    # worker processes (--workers) ----------------------------------------------------

    def buckets_of(self, kind):
        """The buckets of one kind: CLIENT_BUCKETS, TOPIC_BUCKETS or IP_BUCKETS."""
        return (self.buckets if kind == CLIENT_BUCKETS else self.topic_buckets
                if kind == TOPIC_BUCKETS else self.ip_buckets)

    def bucket_for_others(self, kind, key, user_tag, client_tag, entity):
        """The bucket another worker process counted usage in (its kind, key,
        tags and entity), made here if this process has none yet: its
        clients and the fleet reports then see that usage from the first
        request. None when this process's quotas have no such entity (its
        quota source has not caught up, or has moved on): nothing to hold."""
        buckets = self.buckets_of(kind)
        scope = None
        if kind == CLIENT_BUCKETS:
            entity, scope = exchanged_entity(entity)
            bkey = ((key, user_tag, client_tag) if scope is None
                    else (key, user_tag, client_tag, scope))
        else:
            bkey = (key, client_tag) if kind == TOPIC_BUCKETS else client_tag
        bucket = buckets.get(bkey)
        if bucket is not None:
            return bucket
        if entity == CALLBACK_ENTITY:
            if self.callback is None or kind != CLIENT_BUCKETS:
                return None
            try:
                quota = check_limit(self._call("quota_limit", self.callback.quota_limit,
                                               QUOTA_TYPE_OF_KEY[key], scope_tags(scope)),
                                    "%s.quota_limit" % self.callback_name)
            except (QuotaCallbackError, ValueError) as exc:
                log.warning("%s", exc)
                return None
            cfg = {}
        else:
            cfg = self.config.entity_config(entity)  # "static": {key: value} too
            quota = cfg.get(key) if isinstance(cfg, dict) else None
        if quota is None:
            return None
        resolution = Resolution(quota, entity, user_tag, client_tag, bool(cfg.get(OBSERVE_ONLY)),
                                scope)
        limit = self.applied_limit(bkey, quota) if kind == CLIENT_BUCKETS else None
        bucket = buckets[bkey] = Bucket(key, resolution, self.settings, limit, kind=kind,
                                        touched=self.touched)
        return bucket

    def track_touched(self):
        """From now on every bucket notes its first use after each look of
        the usage exchange (--workers) in ``touched``, so that the exchange
        reads the buckets used since, not every bucket: an idle worker with
        many idle clients spends nothing on it. The buckets there already are
        all put in ``touched`` for the first look. Returns that list."""
        if self.touched is None:
            self.touched = touched = []
            for buckets in (self.buckets, self.topic_buckets, self.ip_buckets):
                for bucket in buckets.values():
                    bucket.touched = None
                    touched.append(bucket)
        return self.touched

    # shared capacity --------------------------------------------------------------

    def set_capacity(self, key, capacity):
        """Share ``capacity`` (bytes/s; None: no longer) among the buckets of
        ``key`` in use, weighted by their quotas (capacity.SharedCapacity)."""
        from .capacity import SharedCapacity

        if capacity is None:
            self.capacity.pop(key, None)
        else:
            self.capacity[key] = SharedCapacity(capacity)
        self._reapply()

    def capacity_in_force(self, key):
        """This proxy's part of ``key``'s shared capacity: all of it, or in a
        fleet its share, which the fleet computes as for any bucket (the
        capacity is reported as one: capacity_sharing_key)."""
        shared = self.capacity[key]
        return self._fleet_part(capacity_sharing_key(key), shared.capacity)

    def apply_capacity(self, now):
        """Once a second: every shared capacity's parts, applied live."""
        if not self.capacity:
            return
        self.settle_leases(now)
        by_key = {key: [] for key in self.capacity}
        for bucket in self.buckets.values():
            if bucket.key in by_key:
                by_key[bucket.key].append(bucket)
        for key, shared in self.capacity.items():
            parts = shared.limits(by_key[key], now, self.capacity_in_force(key))
            for bucket, limit in parts.items():
                if bucket.limit is None or abs(limit - bucket.limit) > 1e-6 * limit:
                    bucket.apply_limit(limit)

    # fleet shares ----------------------------------------------------------------

    def applied_limit(self, bucket_key, quota):
        """The limit a bucket with configured ``quota`` gets under the sharing
        in force. A share never exceeds the quota, nor falls under
        MIN_SHARE_FRACTION of it; a share computed against another fleet
        quota than the one configured now (a configuration changed since
        the shares were written) keeps its fraction of the quota. Under a
        shared capacity, the bucket's part of it."""
        if quota is not None and self.capacity:
            shared = self.capacity.get(bucket_key[0])
            if shared is not None:
                return shared.first_limit(quota)
        return self._fleet_part(bucket_key[:3], quota)

    def _fleet_part(self, sharing_key, quota):
        """``quota``, or this proxy's part of it under the sharing in force."""
        if quota is None or self.sharing == CONFIGURED:
            return quota
        if self.sharing == EQUAL:
            return quota / max(1, self.fleet_size)
        share = self.shares.get(sharing_key)
        if share is None:
            share = self.prior * quota
        else:
            of = self.share_quotas.get(sharing_key)
            if of and of != quota:
                share = share * quota / of
        return min(quota, max(share, quota * MIN_SHARE_FRACTION))

    def _reapply(self):
        self.settle_leases()  # sized on the limits before
        for bucket_key, bucket in self.buckets.items():
            limit = self.applied_limit(bucket_key, bucket.quota)
            if limit != bucket.limit:
                bucket.apply_limit(limit)

    def apply_shares(self, shares, prior, fleet_size=0, quotas=None):
        """Apply this proxy's fleet shares live: ``shares`` is {(key, user
        tag, client tag): share per second}; a bucket not listed (no history
        in the fleet yet) gets ``prior`` x its quota; ``fleet_size`` is how
        many proxies the fleet has (kept for the ``equal`` fail-safe). ``quotas`` may say
        {(key, user tag, client tag): the fleet quota each share was
        computed against}. Buckets made later get their share when made."""
        self.shares = dict(shares)
        self.share_quotas = dict(quotas or {})
        self.prior = float(prior)
        self.fleet_size = int(fleet_size)
        self.sharing = SHARES
        self._reapply()

    def apply_equal(self, fleet_size=None):
        """Fail-safe ``equal``: every bucket gets quota / fleet_size (the
        fleet size last seen when None); the shares are kept for later."""
        if fleet_size is not None:
            self.fleet_size = int(fleet_size)
        self.sharing = EQUAL
        self._reapply()

    def apply_whole(self):
        """Fail-safe ``whole``: every bucket gets its configured quota; the
        shares are kept for later."""
        self.sharing = CONFIGURED
        self._reapply()

    def clear_shares(self):
        """Not a fleet member: back to the configured quotas, shares forgotten."""
        self.shares = {}
        self.share_quotas = {}
        self.prior = 1.0
        self.fleet_size = 0
        self.sharing = CONFIGURED
        self._reapply()

    def expire(self, now, idle=3600.0):
        """Drop buckets unused for ``idle`` seconds (Kafka expires quota
        sensors after an hour). Call now and then, not per request."""
        self.settle_leases(now)
        dropped = 0
        for buckets in (self.buckets, self.topic_buckets, self.ip_buckets):
            stale = []
            for k, b in buckets.items():
                if b.last_used is None:
                    b.last_used = now  # never recorded: its idle time starts now
                elif now - b.last_used >= idle:
                    stale.append(k)
            for k in stale:
                del buckets[k]
            dropped += len(stale)
        if dropped:
            self.generation += 1  # connections holding a dropped bucket look again
        return dropped


__all__ = [
    "CLIENT_BUCKETS", "IP_BUCKETS", "TOPIC_BUCKETS",
    "CONFIGURED", "EQUAL", "NO_DELAY", "QUOTA_KEYS", "SHARES", "Bucket", "ClientQuotas", "Decision", "QuotaConfig",
    "QuotaManager", "QuotaSettings", "Resolution", "TOKEN_BUCKET", "WINDOW",
    "client_quotas_apply", "request_quota_applies",
]
