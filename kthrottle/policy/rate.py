"""Rate measurement and throttle time, as Kafka's broker computes them.

Kafka measures a quota metric with a sampled rate: ``samples`` windows of
``window`` seconds each (quota.window.num=11, quota.window.size.seconds=1).
The rate is the sum over the live windows divided by the time since the
oldest one started, padded to at least (samples - 1) windows, so a client
that just appeared counts as having ten quiet seconds behind it. A client
over its quota T at measured rate O is delayed X = (O - T) / T * W, W being
that padded window: the delay after which its rate is back at T.

Time is passed in (seconds, any monotonic origin); nothing here reads a clock.
"""
import math


class SampledRate:
    """Kafka's Rate over a SampledTotal, in a fixed ring.

    Kept as a running sum: ``counted`` is everything ever recorded, and the
    current window holds what came since it started (``counted`` less
    ``_base``), so a record within the current window is one addition; a
    window's own total is written down only when it closes. What is recorded
    is counted in whole units (bytes, requests, partitions): Python's
    integers keep the sum exact however long the proxy runs.

    A scan walks the ring (O(samples)) only when a window has closed or
    one may have expired since the last walk: in between, the closed
    windows' total and the oldest start it found still hold, so a scan
    is a few additions (this runs per request with a quota)."""

    __slots__ = ("samples", "window", "_starts", "_values", "_current", "_end", "counted",
                 "_base", "_closed", "_oldest", "_walked_at", "_walked_span")

    def __init__(self, samples=11, window=1.0):
        if samples < 2:
            raise ValueError("quota window count must be at least 2")
        if window <= 0:
            raise ValueError("quota window size must be positive")
        self.samples = samples
        self.window = window
        self._starts = [None] * samples  # start of each window, None: never used
        self._values = [0.0] * samples  # the closed windows' totals
        self._current = 0
        # when the current window ends: a record before then adds to it
        # (-inf: none started yet)
        self._end = -math.inf
        self.counted = 0
        self._base = 0  # counted when the current window started
        # what the last walk of the ring found (scan): the closed windows'
        # total and the oldest live start, good from _walked_at for as long
        # as the oldest is younger than _walked_span (samples x window, when
        # it expires; -inf: walk again)
        self._closed = 0.0
        self._oldest = 0.0
        self._walked_at = math.inf
        self._walked_span = -math.inf

    def record(self, value, now):
        if now >= self._end:
            self.roll(now)
        self.counted += value

    def roll(self, now):
        """The current window has ended (``now`` at or past ``_end``): close
        it and start the next at ``now``, before what comes at ``now`` is
        added."""
        i = self._current
        if self._starts[i] is not None:
            self._values[i] = self.counted - self._base
            i = (i + 1) % self.samples
            self._current = i
        self._starts[i] = now
        self._base = self.counted
        self._end = now + self.window
        self._walked_span = -math.inf  # a window closed: the next scan walks the ring

    def scan(self, now):
        """(total, W) at ``now``: windows older than samples x window are
        reset first, as Kafka purges them; W is the time since the oldest
        live window started, padded to samples - 1 windows."""
        elapsed = now - self._oldest
        if elapsed < self._walked_span and self._walked_at <= now:
            # nothing closed or expired since the walk (the oldest live
            # window, the first to expire, is as _walk checks it): only the
            # current window, live here, has grown
            total = self._closed + (self.counted - self._base)
        else:
            total, elapsed = self._walk(now)
        full = int(elapsed / self.window)
        if full < self.samples - 1:
            elapsed += (self.samples - 1 - full) * self.window
        return total, elapsed

    def _walk(self, now):
        """scan's pass over the ring: expired windows reset, then (total,
        time since the oldest live start); what it found is kept for the
        scans until a window closes or the oldest live one expires."""
        expire = self.samples * self.window
        starts = self._starts
        values = self._values
        current = self._current
        oldest = now
        closed = 0.0
        for i in range(self.samples):
            start = starts[i]
            if start is None:
                continue
            if now - start >= expire:
                starts[i] = now
                values[i] = 0.0
                if i == current:  # it starts again now
                    self._base = self.counted
                    self._end = now + self.window
                continue
            if start < oldest:
                oldest = start
            if i != current:
                closed += values[i]
        if starts[current] is None:  # nothing recorded yet
            self._walked_span = -math.inf
            return closed, now - oldest
        # (a window reset above starts at now: oldest is the least live start)
        self._closed = closed
        self._oldest = oldest
        self._walked_at = now
        self._walked_span = expire
        return closed + (self.counted - self._base), now - oldest

    def window_seconds(self, now):
        """W: the time the rate divides by (padded to samples - 1 windows)."""
        return self.scan(now)[1]

    def total(self):
        """What the windows hold (the expired ones too, until a scan resets
        them)."""
        live = self.counted - self._base if self._starts[self._current] is not None else 0
        return sum(v for i, v in enumerate(self._values) if i != self._current) + live

    def measure(self, now):
        """Rate per second at ``now``."""
        total, w = self.scan(now)
        return total / w


def unreleased(held, t, recorded_by_then):
    """What of ``held`` (throttled requests as (recorded at, released at,
    value)) is not let through yet at ``t``: each is let through evenly over
    its delay. ``recorded_by_then(t0, t)`` says whether one recorded at t0
    counts as recorded at ``t``."""
    total = 0.0
    for t0, t1, value in held:
        if t < t1 and recorded_by_then(t0, t):
            total += value if t <= t0 else value * (t1 - t) / (t1 - t0)
    return total


def released_total(total, w, now, held):
    """Kafka's windowed total (``total`` recorded over the ``w`` seconds to
    ``now``, as SampledRate.scan gives it) as it was let through: what the
    window's throttled requests have still to be let through at ``now`` is
    taken out, what earlier ones were let through within the window is put
    in (flow: in, less the growth of what is held back)."""
    if not held:
        return total
    start = now - w
    return (total + unreleased(held, start, _before)
            - unreleased(held, now, _by))


def _before(t0, t):
    return t0 < t  # a request at the window's start is in the window's total


def _by(t0, t):
    return t0 <= t


def throttle_seconds(rate, limit, window_seconds):
    """X = (O - T) / T x W, 0 when within the limit."""
    if rate <= limit:
        return 0.0
    return (rate - limit) / limit * window_seconds


class TokenBucket:
    """An explicit burst allowance (as KIP-599 does for controller mutations):
    a bucket of ``burst`` units refilled at ``limit`` per second. Recording
    takes units out and may leave the bucket in debt; the debt divided by the
    limit is the delay that pays it back.

    Kept as the time the bucket is full again (``full_at``, the generic cell
    rate algorithm's theoretical arrival time): at ``now`` it holds
    ``burst - (full_at - now) x limit`` units, all of them once ``full_at``
    has passed. Taking ``value`` moves ``full_at`` on by ``value / limit``
    from no earlier than ``now``; the debt's delay is how far it then lies
    beyond ``span`` (burst / limit). So a request takes a few arithmetic
    steps, and a refill is never computed."""

    __slots__ = ("limit", "burst", "span", "full_at", "_last")

    def __init__(self, limit, burst):
        self.limit = limit
        self.burst = burst
        self.span = burst / limit
        self.full_at = -math.inf
        self._last = None  # the latest time given: where set_limit keeps the units held

    def set_limit(self, limit, burst):
        """The units held (at the latest time given) stay, up to ``burst``;
        from then on the bucket fills at ``limit``."""
        tokens = self.tokens
        self.limit = limit
        self.burst = burst
        self.span = burst / limit
        if self._last is not None:
            self.full_at = self._last + (burst - min(tokens, burst)) / limit

    def record(self, value, now):
        full_at = self.full_at
        if full_at < now:
            full_at = now
        self.full_at = full_at + value / self.limit
        if self._last is None or now > self._last:
            self._last = now

    def forgive(self, value):
        """Give back up to ``value`` units of debt (never past empty)."""
        if self._last is None:
            return
        debt = (self.full_at - self._last) * self.limit - self.burst
        if debt > 0:
            self.full_at -= min(debt, value) / self.limit

    def throttle_seconds(self, now):
        """The delay that pays the debt back at ``now`` (0.0: none)."""
        if self._last is None or now > self._last:
            self._last = now
        delay = self.full_at - self._last - self.span
        return delay if delay > 0 else 0.0

    @property
    def tokens(self):
        """The units held at the latest time given."""
        return self.burst if self._last is None else self.held(self._last)

    def held(self, now):
        """The units held at ``now`` (not before the latest time given)."""
        full_at = self.full_at
        return self.burst if full_at <= now else self.burst - (full_at - now) * self.limit


def to_ms(seconds):
    """Kafka rounds throttle times to whole milliseconds."""
    return int(math.floor(seconds * 1000 + 0.5))
