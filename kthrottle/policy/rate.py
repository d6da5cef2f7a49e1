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
    """Kafka's Rate over a SampledTotal, in a fixed ring (O(samples) per call)."""

    __slots__ = ("samples", "window", "_starts", "_values", "_current")

    def __init__(self, samples=11, window=1.0):
        if samples < 2:
            raise ValueError("quota window count must be at least 2")
        if window <= 0:
            raise ValueError("quota window size must be positive")
        self.samples = samples
        self.window = window
        self._starts = [None] * samples  # start of each window, None: never used
        self._values = [0.0] * samples
        self._current = 0

    def record(self, value, now):
        i = self._current
        start = self._starts[i]
        if start is None:
            self._starts[i] = now
        elif now - start >= self.window:
            i = (i + 1) % self.samples
            self._current = i
            self._starts[i] = now
            self._values[i] = 0.0
        self._values[i] += value

    def scan(self, now):
        """(total, W) at ``now``, in one pass: windows older than samples x
        window are reset first, as Kafka purges them; W is the time since the
        oldest live window started, padded to samples - 1 windows."""
        expire = self.samples * self.window
        starts = self._starts
        values = self._values
        oldest = now
        total = 0.0
        for i in range(self.samples):
            start = starts[i]
            if start is None:
                continue
            if now - start >= expire:
                starts[i] = now
                values[i] = 0.0
                continue
            if start < oldest:
                oldest = start
            total += values[i]
        elapsed = now - oldest
        full = int(elapsed / self.window)
        if full < self.samples - 1:
            elapsed += (self.samples - 1 - full) * self.window
        return total, elapsed

    def window_seconds(self, now):
        """W: the time the rate divides by (padded to samples - 1 windows)."""
        return self.scan(now)[1]

    def total(self):
        return sum(self._values)

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
    limit is the delay that pays it back."""

    __slots__ = ("limit", "burst", "_tokens", "_last")

    def __init__(self, limit, burst):
        self.limit = limit
        self.burst = burst
        self._tokens = burst
        self._last = None

    def set_limit(self, limit, burst):
        self.limit = limit
        self.burst = burst
        self._tokens = min(self._tokens, burst)

    def _refill(self, now):
        if self._last is not None and now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.limit)
        self._last = now if self._last is None else max(self._last, now)

    def record(self, value, now):
        self._refill(now)
        self._tokens -= value

    def forgive(self, value):
        """Give back up to ``value`` units of debt (never past empty)."""
        if self._tokens < 0:
            self._tokens = min(0.0, self._tokens + value)

    def throttle_seconds(self, now):
        self._refill(now)
        return -self._tokens / self.limit if self._tokens < 0 else 0.0

    @property
    def tokens(self):
        return self._tokens


def to_ms(seconds):
    """Kafka rounds throttle times to whole milliseconds."""
    return int(math.floor(seconds * 1000 + 0.5))
