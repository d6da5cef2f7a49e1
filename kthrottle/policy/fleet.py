"""Fleet-wide quotas: each proxy's share of a quota set once for the cluster.

Several proxies in front of one cluster each count their clients in their own
buckets (``QuotaManager.buckets[(key, user tag, client tag)]``); that triple is
the *sharing key* across the fleet. A KIP-55 quota is meant for the cluster,
so each proxy applies only its *share* of it: bytes (or requests) per second
for that bucket on that proxy, the shares of one bucket summing to its quota.

Three pieces, none of which does I/O or reads a clock (time is passed in, in
seconds since the epoch, since reports cross machines):

- the usage report every fleet member publishes (``UsageReport``): for each
  bucket used in the last interval, the configured quota, the measured rate
  and the demand, the rate its clients would have had unthrottled
  (``estimate_demand``: Rate / max(0.1, 1 - f), f the part of the interval
  spent throttled, at most 0.9);
- the shares of one bucket (``compute_shares``): a proxy alone gets the whole
  quota; otherwise each of the n proxies reporting the bucket gets a floor,
  ``floor_fraction * quota / n`` (a proxy whose clients were idle for an
  interval can still serve them), and the rest is split in proportion to
  demand, none getting more than it wants (``max(floor, demand * headroom)``);
  what one does not want goes to the others in proportion to their demand
  (water-filling), and if every want is met the leftover is spread in
  proportion to the shares. A proxy whose demand is at the estimate's cap
  (``BucketUsage.held``: its clients were held back at least 90% of the
  interval) only says it wants more than it got, not how much: its demand
  is ten times whatever share it had, so splitting by it would keep any
  split the fleet already has (both proxies held at 79/21 gave 76/24, then
  74/26: only the floor moved them, 10% a cycle). When any proxy is held,
  the bucket is split max-min instead: the others get their want, up to an
  equal part of what is left, and the held proxies split the rest equally.
  The shares always sum to the quota;
- the shares the Spark job computes from the latest report of every proxy
  (``fleet_shares``) and writes to ZooKeeper, one document per proxy
  (``shares_document``, read back with ``parse_shares_document``), with the
  proxy's ``prior``: the fraction of a quota it applies to a bucket not listed
  (no history yet), from the share of partition leaders it fronts
  (``prior_fractions``).

Accuracy. A share follows demand late: by one report interval (the demand is
measured over the interval before the report) plus one job cycle (plus the
time a proxy takes to read the new shares). Within that lag a proxy whose
clients' demand grows is held to its old share (at least the floor, and its
old demand times the headroom), and its unused share elsewhere is not given
back until the next cycle; the fleet admits less than the quota then, never
more, for buckets every proxy reports. A bucket new on a proxy (not in its
last report) is applied at ``prior * quota`` there until the next cycle, on
top of the shares of the proxies that reported it: the fleet may admit up to
that much over the quota for one cycle. Shorter intervals and cycles make the
shares follow demand more closely, at the cost of more reports and jobs.
"""
import json
import math
from collections import Counter
from typing import NamedTuple

from .entities import RATE_KEYS as QUOTA_KEYS
from .storage import (
    MAX_CLOCK_SKEW,
    check_time,
    decode_document,
    decode_snapshot,
    encode_snapshot,
    iso_time,
    parse_iso_time,
)

SHARES_FORMAT = "kthrottle-quota-shares"
# 2: the fleet's size in place of its member list (1,000 lists of 1,000 ids
# made 13 MB a cycle, too much for one ZooKeeper transaction)
SHARES_VERSION = 2

DEFAULT_FLOOR_FRACTION = 0.1
DEFAULT_HEADROOM = 1.2
# estimate_demand: the most of an interval counted as throttled, so a bucket
# throttled throughout is estimated at ten times its rate, not infinitely.
MAX_THROTTLED_FRACTION = 0.9
# A demand at least this many times its rate was estimated at the cap: held
# (the margin absorbs the rounding of Rate / (1 - 0.9)).
HELD_RATIO = (1.0 - 1e-9) / (1.0 - MAX_THROTTLED_FRACTION)


def _number(value, what, minimum=0.0, strict=False):
    """``value`` as a finite float >= minimum (> minimum when ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError("%s must be a finite number %s %s, got %r"
                         % (what, ">" if strict else ">=", _g(minimum), value))
    return float(value)


def _g(x):
    return "%g" % x


def _string(value, what):
    if not isinstance(value, str):
        raise ValueError("%s must be a string, got %r" % (what, value))
    return value


def _key(value, what):
    if value not in QUOTA_KEYS:
        raise ValueError("%s must be one of %s, got %r" % (what, ", ".join(QUOTA_KEYS), value))
    return value


# the usage report (proxy -> compacted topic) ----------------------------------------

class BucketUsage(NamedTuple):
    """One bucket of a proxy in a usage report. Its sharing key across the
    fleet is ``(key, user, client_id)``."""

    key: str  # producer_byte_rate | consumer_byte_rate | request_rate
    user: str  # the bucket's user tag ("" when the quota names no user)
    client_id: str  # the bucket's client tag
    entity: str  # the config path that set the quota (informational)
    quota: float  # the configured, fleet-wide quota (not the share in force)
    rate: float  # measured rate at report time
    demand: float  # estimate_demand(): the rate including what throttling held back

    @property
    def sharing_key(self):
        return self.key, self.user, self.client_id

    @property
    def held(self):
        """Whether the demand is only a lower bound: see ``is_held``."""
        return is_held(self.rate, self.demand)


class UsageReport(NamedTuple):
    proxy_id: str
    reported_at: float  # epoch seconds
    interval_s: float
    fronted_brokers: tuple  # broker node ids this proxy forwards to
    buckets: tuple  # BucketUsage, the buckets used within the last interval

    def to_json(self):
        """The report as published (UTF-8 this, keyed by the proxy id)."""
        return json.dumps({
            "ProxyId": self.proxy_id, "ReportedAt": iso_time(self.reported_at),
            "IntervalSeconds": float(self.interval_s),
            "FrontedBrokers": [int(b) for b in self.fronted_brokers],
            "Buckets": [{"Key": b.key, "User": b.user, "ClientId": b.client_id,
                         "Entity": b.entity, "Quota": float(b.quota), "Rate": float(b.rate),
                         "Demand": float(b.demand)} for b in self.buckets],
        }, separators=(",", ":"))


def parse_usage_report(data, now=None):
    """A UsageReport from a proxy's JSON (bytes, str or already parsed);
    ValueError says what is wrong. A bucket listed twice is an error, and so
    is a ReportedAt more than MAX_CLOCK_SKEW ahead of ``now`` (when given)."""
    data = decode_snapshot(data)
    if not isinstance(data, dict):
        raise ValueError("a usage report is a JSON object")
    proxy_id = data.get("ProxyId")
    if not isinstance(proxy_id, str) or not proxy_id:
        raise ValueError("ProxyId must be a non-empty string, got %r" % (proxy_id,))
    reported_at = check_time(parse_iso_time(data.get("ReportedAt"), "ReportedAt"), "ReportedAt",
                             now)
    interval = _number(data.get("IntervalSeconds"), "IntervalSeconds", strict=True)
    brokers = data.get("FrontedBrokers")
    if not isinstance(brokers, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in brokers):
        raise ValueError("FrontedBrokers must be a list of broker ids, got %r" % (brokers,))
    buckets = data.get("Buckets")
    if not isinstance(buckets, list):
        raise ValueError("Buckets must be a list")
    out, seen = [], set()
    for i, b in enumerate(buckets):
        what = "Buckets[%d]" % i
        if not isinstance(b, dict):
            raise ValueError("%s must be an object" % what)
        usage = BucketUsage(
            _key(b.get("Key"), what + ".Key"), _string(b.get("User"), what + ".User"),
            _string(b.get("ClientId"), what + ".ClientId"),
            _string(b.get("Entity", ""), what + ".Entity"),
            _number(b.get("Quota"), what + ".Quota", strict=True),
            _number(b.get("Rate"), what + ".Rate"), _number(b.get("Demand"), what + ".Demand"))
        if usage.sharing_key in seen:
            raise ValueError("%s: bucket %s is listed twice" % (what, "/".join(usage.sharing_key)))
        seen.add(usage.sharing_key)
        out.append(usage)
    return UsageReport(proxy_id, reported_at, interval, tuple(brokers), tuple(out))


def estimate_demand(rate, throttled_ms, interval_s):
    """What a bucket's clients asked for over the last interval: ``rate``
    divided by the part of the interval they were not throttled,
    Rate / max(0.1, 1 - f) with f = throttled_ms / (interval_s * 1000) capped
    at 0.9. ``throttled_ms`` is the growth of ``Bucket.throttle_ms_total`` over
    the interval; it sums the delays of all the bucket's connections, so it
    may exceed the interval (then f is 0.9: ten times the rate)."""
    rate = _number(rate, "rate")
    throttled_ms = _number(throttled_ms, "throttled_ms")
    interval_s = _number(interval_s, "interval_s", strict=True)
    f = min(MAX_THROTTLED_FRACTION, throttled_ms / (interval_s * 1000.0))
    return rate / max(1.0 - MAX_THROTTLED_FRACTION, 1.0 - f)


def is_held(rate, demand):
    """Whether ``demand`` (from estimate_demand) is at the cap, Demand >=
    Rate / (1 - 0.9): the bucket's clients were held back at least 90% of the
    interval, so what they would send unthrottled is unknown above it. The
    report needs no more than Rate and Demand to tell: Demand / Rate is
    1 / max(0.1, 1 - f). A rate of 0 is never held (nothing was measured)."""
    return rate > 0.0 and demand >= rate * HELD_RATIO


# the shares -------------------------------------------------------------------------

def _check_shape(floor_fraction, headroom):
    if isinstance(floor_fraction, bool) or not isinstance(floor_fraction, (int, float)) \
            or not 0.0 <= floor_fraction < 1.0:
        raise ValueError("floor_fraction must be within [0, 1), got %r" % (floor_fraction,))
    _number(headroom, "headroom", strict=True)


def compute_shares(quota, demands, floor_fraction=DEFAULT_FLOOR_FRACTION,
                   headroom=DEFAULT_HEADROOM, held=()):
    """{proxy id: share} of one bucket's ``quota`` among the proxies of
    ``demands`` ({proxy id: demand >= 0}), in sorted proxy-id order.
    ``held`` names the proxies whose demand is only a lower bound (is_held).

    One proxy gets the whole quota. Otherwise each of the n gets the floor
    f = floor_fraction * quota / n, and the rest, quota * (1 - floor_fraction),
    is split as follows; the shares sum to ``quota`` (within float rounding).

    None held: in proportion to demand with no proxy above its want,
    max(f, demand * headroom): what a proxy does not want goes to the others
    in proportion to their demand (water-filling). If every want is met, the
    leftover is spread in proportion to the shares. All demands 0: an equal
    split. A larger demand never gets a smaller share.

    Some held: max-min. Each proxy not held gets its want, up to the level L
    the held proxies get, f + L each, L such that the shares sum to the
    quota. Equal demands held get equal shares whatever they had before, a
    proxy wanting less than L keeps what it wants, and a held proxy never
    gets less than one that is not."""
    quota = _number(quota, "quota", strict=True)
    _check_shape(floor_fraction, headroom)
    ids = sorted(demands)
    held = set(held)
    return dict(zip(ids, _shares(quota, [_number(demands[p], "demand of %s" % p) for p in ids],
                                 floor_fraction, headroom, [p in held for p in ids])))


def _shares(quota, d, floor_fraction, headroom, held=None):
    """The shares for demands ``d`` (a list, validated), in the same order;
    ``held`` a list of flags (None: none held)."""
    n = len(d)
    if n <= 1:
        return [quota] * n
    floor = floor_fraction * quota / n
    rest = quota - n * floor
    total = math.fsum(d)
    if held is not None and any(held):
        # max-min: the level rises as the proxies wanting less than it are
        # served (in order of want); the held ones, and any wanting more,
        # get the level.
        extra = [None] * n
        served = sorted((i for i in range(n) if not held[i]), key=d.__getitem__)
        left, remaining = n, rest
        level = remaining / left
        for i in served:
            cap = max(0.0, d[i] * headroom - floor)
            if cap > level:
                break
            extra[i] = cap
            remaining -= cap
            left -= 1  # never 0: at least one is held
            level = remaining / left
        shares = [floor + (level if e is None else e) for e in extra]
    elif total == 0.0:
        shares = [quota / n] * n
    else:
        # what each wants above the floor
        caps = [max(0.0, x * headroom - floor) for x in d]
        if math.fsum(caps) <= rest:
            # every want met: the leftover in proportion to the shares
            wants = [floor + c for c in caps]
            scale = quota / math.fsum(wants)
            shares = [w * scale for w in wants]
        else:
            # extra_i = min(level * d_i, cap_i) summing to rest. cap_i / d_i =
            # headroom - floor / d_i grows with d_i, so proxies saturate in
            # order of demand; the level only rises as they do.
            order = sorted((i for i in range(n) if d[i] > 0.0), key=d.__getitem__)
            active = [0.0] * (len(order) + 1)  # demand not yet saturated, from each position
            for pos in range(len(order) - 1, -1, -1):
                active[pos] = active[pos + 1] + d[order[pos]]
            extra = [0.0] * n
            remaining = rest
            for pos, i in enumerate(order):
                level = remaining / active[pos]
                if caps[i] <= level * d[i]:
                    extra[i] = caps[i]
                    remaining -= caps[i]
                    continue
                for j in order[pos:]:
                    extra[j] = level * d[j]
                break
            shares = [floor + e for e in extra]
    # rounding: the residual to the largest share, so the sum is the quota
    big = max(range(n), key=shares.__getitem__)
    shares[big] += quota - math.fsum(shares)
    return shares


def prior_fractions(proxies_brokers, leaders, floor_fraction=0.0):
    """{proxy id: fraction} a proxy applies to a bucket it has no share of
    yet: the share of partitions whose leader it fronts, normalised to sum 1
    (a partition whose leader several proxies front counts for each).
    ``proxies_brokers`` is {proxy id: broker ids it forwards to}, ``leaders``
    {(topic, partition): leader broker id}. Equal split when nothing is known
    (no leaders, or no proxy fronts any of them); it follows when every proxy
    fronts every broker. ``floor_fraction`` (0 by default, as the contract
    says) gives each of the n proxies at least floor_fraction / n of it, so
    that a proxy fronting no leader does not apply a limit of 0."""
    _check_shape(floor_fraction, 1.0)
    ids = sorted(proxies_brokers)
    n = len(ids)
    if not n:
        return {}
    per_broker = Counter(leaders.values()) if leaders else Counter()
    counts = [sum(per_broker.get(b, 0) for b in set(proxies_brokers[p])) for p in ids]
    total = sum(counts)
    if not total:
        return {p: 1.0 / n for p in ids}
    keep = 1.0 - floor_fraction
    return {p: floor_fraction / n + keep * c / total for p, c in zip(ids, counts)}


class ProxyShares(NamedTuple):
    """What the job computed for one proxy."""

    proxy: str
    proxies: tuple  # the fleet members with a fresh report, sorted
    prior: float  # the fraction of a quota applied to a bucket not listed
    shares: list  # sorted [(key, user, client_id, share, quota)], every bucket it reported


def fleet_shares(reports, now, freshness, floor_fraction=DEFAULT_FLOOR_FRACTION, leaders=None,
                 headroom=DEFAULT_HEADROOM):
    """{proxy id: ProxyShares} for ``reports`` ({proxy id: UsageReport}, the
    latest of each; the dict's key is the proxy id). A report older than
    ``freshness`` seconds at ``now``, or dated more than MAX_CLOCK_SKEW ahead
    of it (that proxy's clock is wrong: its report would never grow old), is
    ignored: that proxy gets nothing and is not counted. Each bucket (sharing
    key) is split with compute_shares() among the fresh proxies that report
    it, by their demands, those at the estimate's cap held (is_held); a
    bucket only one proxy reports is wholly its own. The quota of a bucket
    is the one reported; when proxies disagree (a quota changed between their
    reports), the latest report's quota wins (at the same time, the greatest
    proxy id's). The prior is prior_fractions() over the proxies' fronted
    brokers and ``leaders`` ({(topic, partition): leader id}; None: an equal
    split), with the same floor_fraction as the shares."""
    _check_shape(floor_fraction, headroom)
    fresh = {p: r for p, r in reports.items()
             if -MAX_CLOCK_SKEW <= now - r.reported_at <= freshness}  # NaN: never
    ids = tuple(sorted(fresh))
    # sharing key -> [quota, reported_at of the quota, proxy, demand, held,
    # proxy, demand, held, ...]: one list a bucket (a third of the objects
    # three lists would be, and of the garbage collector's work: it was a
    # third of the time)
    groups = {}
    get = groups.get
    for p in ids:  # ascending: at the same time, the greatest id comes last
        report = fresh[p]
        at = report.reported_at
        for b in report.buckets:
            sk = b[:3]  # (key, user, client_id)
            g = get(sk)
            demand, rate = b.demand, b.rate
            held = rate > 0.0 and demand >= rate * HELD_RATIO  # is_held, inline
            if g is None:
                groups[sk] = [b.quota, at, p, demand, held]
            else:
                g.append(p)
                g.append(demand)
                g.append(held)
                if at >= g[1]:
                    g[0] = b.quota
                    g[1] = at
    per_proxy = {p: [] for p in ids}
    isfinite, fsum = math.isfinite, math.fsum
    for sk in sorted(groups):
        g = groups[sk]
        quota = g[0]
        key, user, client_id = sk
        if not (isinstance(quota, (int, float)) and 0.0 < quota < math.inf):
            _number(quota, "the quota of bucket %s/%s/%s" % sk, strict=True)
        quota = float(quota)
        if len(g) == 5:
            per_proxy[g[2]].append((key, user, client_id, quota, quota))
            continue
        members, demands, held = g[2::3], g[3::3], g[4::3]
        try:
            valid = isfinite(fsum(demands)) and min(demands) >= 0.0
        except TypeError:
            valid = False
        if not valid:
            for p, x in zip(members, demands):
                _number(x, "the demand of bucket %s/%s/%s on %s" % (sk + (p,)))
        for p, share in zip(members, _shares(quota, demands, floor_fraction, headroom, held)):
            per_proxy[p].append((key, user, client_id, share, quota))
    prior = prior_fractions({p: fresh[p].fronted_brokers for p in ids}, leaders, floor_fraction)
    return {p: ProxyShares(p, ids, prior[p], per_proxy[p]) for p in ids}


# the shares in ZooKeeper (the job writes one document per proxy) ----------------------

def shares_document(proxy_shares, generated_at, cycle):
    """The JSON-ready document of one proxy's ProxyShares."""
    return {
        "format": SHARES_FORMAT, "version": SHARES_VERSION, "generated_at": generated_at,
        "cycle": cycle, "proxy": proxy_shares.proxy, "fleet_size": len(proxy_shares.proxies),
        "prior": proxy_shares.prior, "shares": [list(entry) for entry in proxy_shares.shares],
    }


def encode_shares_document(document):
    """The bytes a document is stored as: compact JSON, gzip-compressed when
    larger than storage.COMPRESS_ABOVE (storage.encode_snapshot)."""
    return encode_snapshot(document)


class Share(NamedTuple):
    share: float
    quota: float  # the fleet quota the share was computed from


class SharesDocument:
    """A shares document as a proxy reads it back: validated, with the shares
    in a dict {(key, user, client_id): Share}."""

    __slots__ = ("generated_at", "cycle", "proxy", "fleet_size", "prior", "shares")

    def __init__(self, generated_at, cycle, proxy, fleet_size, prior, shares):
        self.generated_at = generated_at
        self.cycle = cycle
        self.proxy = proxy
        self.fleet_size = fleet_size  # the fleet members with a fresh report
        self.prior = prior
        self.shares = shares

    def limit(self, key, user, client_id, quota):
        """The limit a bucket of configured ``quota`` gets: its listed share
        (scaled by quota / the listed fleet quota, if the quota changed since
        the cycle), else prior * quota."""
        s = self.shares.get((key, user, client_id))
        if s is None:
            return self.prior * quota
        if s.quota == quota:
            return s.share
        return s.share / s.quota * quota

    def check_clock(self, now):
        """ValueError when the document is dated more than MAX_CLOCK_SKEW
        ahead of ``now`` (it would never grow old: issue 14)."""
        check_time(self.generated_at, "generated_at", now)

    def to_json(self):
        """The document again (JSON-ready dict)."""
        doc = shares_document(ProxyShares(
            self.proxy, (), self.prior,
            [sk + tuple(s) for sk, s in sorted(self.shares.items())]),
            self.generated_at, self.cycle)
        doc["fleet_size"] = self.fleet_size
        return doc

    def __repr__(self):
        return "SharesDocument(proxy=%r, cycle=%r, %d shares, prior=%r)" % (
            self.proxy, self.cycle, len(self.shares), self.prior)


def parse_shares_document(data):
    """A SharesDocument from stored bytes (plain or gzip), JSON text or an
    already parsed dict; ValueError says what is wrong (the reader keeps its
    last shares). Whether it is dated ahead of the reader's clock is
    SharesDocument.check_clock's question."""
    data, generated_at = decode_document(data, SHARES_FORMAT, SHARES_VERSION, "shares document")
    cycle = data.get("cycle")
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 0:
        raise ValueError("cycle must be an integer >= 0, got %r" % (cycle,))
    proxy = data.get("proxy")
    if not isinstance(proxy, str) or not proxy:
        raise ValueError("proxy must be a non-empty string, got %r" % (proxy,))
    fleet_size = data.get("fleet_size")
    if isinstance(fleet_size, bool) or not isinstance(fleet_size, int) or fleet_size < 1:
        raise ValueError("fleet_size must be an integer >= 1 (the proxy is one), got %r"
                         % (fleet_size,))
    prior = data.get("prior")
    if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0.0 <= prior <= 1.0:
        raise ValueError("prior must be a fraction within 0-1, got %r" % (prior,))
    entries = data.get("shares")
    if not isinstance(entries, list):
        raise ValueError("shares must be a list")
    shares = {}
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 5 and entry[0] in QUOTA_KEYS
                and isinstance(entry[1], str) and isinstance(entry[2], str)):
            raise ValueError("a share entry is [key, user, client_id, share, quota] with key one "
                             "of %s, got %r" % (", ".join(QUOTA_KEYS), entry))
        sk = tuple(entry[:3])
        what = "the share of %s/%s/%s" % sk
        quota = _number(entry[4], what + ": quota", strict=True)
        share = _number(entry[3], what)
        if share > quota * (1.0 + 1e-9):
            raise ValueError("%s is %r, more than its quota %r" % (what, share, quota))
        if sk in shares:
            raise ValueError("%s is listed twice" % what)
        shares[sk] = Share(share, quota)
    return SharesDocument(generated_at, cycle, proxy, fleet_size, float(prior), shares)


def parse_own_shares(data, proxy_id):
    """``parse_shares_document`` for the proxy ``proxy_id``: a document
    written for another proxy is refused (ValueError) as malformed ones are."""
    document = parse_shares_document(data)
    if document.proxy != proxy_id:
        raise ValueError("the document is for proxy %r, this is %r" % (document.proxy, proxy_id))
    return document
