"""Shared capacity: one cluster-wide byte rate (produce, fetch) divided among
the buckets in use, by weighted max-min fairness.

Each bucket's weight is its configured quota; the quotas then say how the
capacity is split, not how much each client may have. Every second the
proxy looks at the buckets of a quota key used in the last ACTIVE_SECONDS:

- a bucket that was throttled since the last look, or runs at its limit,
  wants more than it has (its demand is unknown: unbounded);
- any other bucket wants what it was measured at, HEADROOM more;
- the water level L solves sum(min(demand_i, weight_i x L)) = capacity (the
  level at which the capacity is used up): a bucket wanting less than its
  part keeps what it wants, and what it leaves is shared by the others in
  proportion to their weights;
- each bucket's limit becomes weight_i x L.

So with three equal tenants busy each gets a third; when one stops (no
request for ACTIVE_SECONDS) the two others get half each at the next look;
a tenant using a trickle leaves the rest to the busy ones. Limits of
buckets using less than their part may sum to more than the capacity: the
capacity holds for what is used, and a bucket that starts using more is
held to its part within a second. No I/O, time passed in.
"""
import math

ACTIVE_SECONDS = 2.0  # a bucket with no request for this long has no part
HEADROOM = 1.2  # what a bucket below its limit may grow to before the next look
AT_LIMIT = 0.9  # a bucket measured at this much of its limit wants more


def water_level(capacity, wants):
    """L such that sum(min(demand, weight x L)) = ``capacity`` over ``wants``,
    [(weight, demand)] with demand None for unbounded; math.inf when every
    demand fits with capacity to spare and none is unbounded (no one needs
    holding; the caller decides what that means)."""
    if capacity <= 0:
        raise ValueError("a capacity must be positive")
    total_weight = sum(w for w, _ in wants)
    if total_weight <= 0:
        return math.inf
    bounded = sorted(((d / w, w, d) for w, d in wants if d is not None), key=lambda x: x[0])
    left, weight = capacity, total_weight
    for ratio, w, d in bounded:
        if ratio * weight <= left:  # this demand fits below the level: it is met
            left -= d
            weight -= w
        else:
            break
    if weight <= 0:
        return math.inf
    return left / weight


class SharedCapacity:
    """The parts of one quota key's capacity (see the module's text)."""

    def __init__(self, capacity):
        if not capacity or capacity <= 0:
            raise ValueError("a shared capacity must be a positive byte rate, got %r"
                             % (capacity,))
        self.capacity = float(capacity)
        self.level = None  # the last water level (None: not looked yet)
        self._throttled = {}  # bucket id -> its throttled count at the last look

    def limits(self, buckets, now, capacity=None):
        """{bucket: new limit} for the buckets in use among ``buckets``
        (policy Buckets of one quota key, with their configured quota as
        weight), sharing ``capacity`` (default: all of it; in a fleet, this
        proxy's share); those not in use keep theirs (they get a part when
        they are used again, at the next look)."""
        capacity = self.capacity if capacity is None else capacity
        active, wants, seen = [], [], {}
        for bucket in buckets:
            if bucket.quota is None or bucket.observe_only or bucket.last_used is None \
                    or now - bucket.last_used > ACTIVE_SECONDS:
                continue
            throttled = bucket.throttled + bucket.others_throttled
            seen[id(bucket)] = throttled
            held = throttled > self._throttled.get(id(bucket), throttled) \
                or bucket.debt_seconds(now) > 0
            rate = bucket.measure(now)
            if held or (bucket.limit and rate >= AT_LIMIT * bucket.limit):
                demand = None
            else:
                demand = rate * HEADROOM
            active.append(bucket)
            wants.append((bucket.quota, demand))
        self._throttled = seen
        if not active:
            return {}
        level = water_level(capacity, wants)
        if math.isinf(level):  # all fit: an even split by weight
            level = capacity / sum(w for w, _ in wants)
        self.level = level
        return {bucket: bucket.quota * level for bucket in active}

    def first_limit(self, quota):
        """The limit of a bucket made between two looks: its part at the last
        level; before any look, its quota (never more than the capacity)."""
        if self.level is not None:
            return quota * self.level
        return min(quota, self.capacity)
