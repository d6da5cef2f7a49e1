"""The status page at ``/`` of the admin endpoint, and its data.

- ``/`` is a static page (``static/status.html``, one script, one style
  sheet: no build step, nothing fetched from elsewhere) that holds no data
  itself: it draws what ``/status.json`` answers and asks again every few
  seconds.
- ``/status.json`` names principals and client-ids, so it is refused exactly
  as /quotas is (bearer token and/or client certificate). A browser cannot
  send a bearer token when it opens a page, so the page takes it from the URL
  fragment (``/#token=...``, which the browser never sends to the server) and
  sends it as ``Authorization: Bearer`` with its own requests. Once it holds
  the history it asks with ``?since=<the previous generated_at>`` for the
  points taken since.

History: each quota bucket's measured rate (Kafka's windowed rate, as the
``kthrottle_*_rate`` gauges) and applied limit are sampled every
SAMPLE_INTERVAL seconds by a task on the proxy's loop, and kept for
HISTORY_SECONDS, so that a page opened now shows the minutes before. A sample
measures each charted bucket and looks at the others' last use (about 2 ms
for 10,000 buckets); the request path never sees it. Memory is bounded by
MAX_ENTITIES series of HISTORY_SECONDS / SAMPLE_INTERVAL points each; a
bucket beyond that is counted, not charted, until a charted one has been idle
for its whole history.
"""
import asyncio
import heapq
import json
import logging
import math
import time
from collections import deque
from importlib import resources

from aiohttp import web

from ..policy.entities import (
    CLIENT_ID_TYPE,
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
    USER_TYPE,
    parse_entity,
)
from .filter import json_number
from .pipeline import TIMER_SLACK

log = logging.getLogger("kthrottle.admin")

HISTORY_SECONDS = 15 * 60
SAMPLE_INTERVAL = 5.0
MAX_ENTITIES = 100  # charted quota buckets (points: x HISTORY_SECONDS / SAMPLE_INTERVAL)
MAX_THROTTLED = 500  # rows of the throttled table
MAX_SHARES = 200  # fleet rows

KIND = {PRODUCER_BYTE_RATE: "produce", CONSUMER_BYTE_RATE: "fetch", REQUEST_RATE: "request",
        CONTROLLER_MUTATION_RATE: "controller mutation"}
UNIT = {PRODUCER_BYTE_RATE: "B/s", CONSUMER_BYTE_RATE: "B/s", REQUEST_RATE: "requests/s",
        CONTROLLER_MUTATION_RATE: "partitions/s"}

# What the page may load: its own files and its own data, nothing inline and
# nothing from elsewhere (client-ids are the clients' own text).
_PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_STATIC = {  # path -> (file in static/, content type)
    "/": ("status.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}


def _shared_by(entity):
    """{"all_users": ..., "all_client_ids": ...}: whether the quota entity a
    bucket counts for names no user (``clients/app``: every user's
    connections with that client-id share the bucket; the static defaults
    too) or no client-id (``users/alice``). The bucket's tags cannot say it:
    a client may send an empty client-id."""
    if entity == "static":  # quota.producer.default: per client-id, any user
        return {"all_users": True, "all_client_ids": False}
    if entity == "callback" or (entity or "").startswith("groups/"):
        # a callback's tags or a group's members say who shares it
        return {"all_users": False, "all_client_ids": True}
    try:
        types = parse_entity(entity)
    except (TypeError, ValueError):
        return {"all_users": False, "all_client_ids": False}
    return {"all_users": USER_TYPE not in types, "all_client_ids": CLIENT_ID_TYPE not in types}


class _Series:
    __slots__ = ("key", "user", "client_id", "entity", "quota", "limit", "rate", "points",
                 "throttle_total", "observe_only")

    def __init__(self, bucket_key, length):
        self.key, self.user, self.client_id = bucket_key[:3]  # (a group's has a 4th part)
        self.entity = None
        self.quota = self.limit = self.rate = None
        # (epoch s, rate, limit, throttle ms given since, rate let through)
        self.points = deque(maxlen=length)
        self.throttle_total = None
        self.observe_only = False

    def add(self, wall, bucket, rate, now):
        # observe-only: the throttle it would have given takes the place of
        # the one given (none)
        if bucket.observe_only != self.observe_only:
            self.observe_only = bucket.observe_only
            self.throttle_total = None
        total = bucket.observed_ms_total if bucket.observe_only else bucket.throttle_ms_total
        given = 0 if self.throttle_total is None else max(0, total - self.throttle_total)
        self.throttle_total = total
        self.entity, self.quota, self.limit, self.rate = (
            bucket.entity, bucket.quota, bucket.limit, rate)
        self.points.append((round(wall, 3), json_number(rate), json_number(bucket.limit), given,
                            json_number(bucket.released(now))))

    def idle(self):
        """Nothing measured in the whole history kept (and it is full)."""
        return len(self.points) == self.points.maxlen and not any(p[1] for p in self.points)

    def to_json(self, since=None):
        """With ``since`` (epoch s), the points taken at or after it only."""
        points = self.points
        if since is not None:
            newer = []
            for p in reversed(points):
                if p[0] < since:
                    break
                newer.append(p)
            points = reversed(newer)
        return {
            "key": self.key, "kind": KIND.get(self.key, self.key), "unit": UNIT.get(self.key, ""),
            "user": self.user, "client_id": self.client_id, "entity": self.entity,
            "quota": json_number(self.quota), "limit": json_number(self.limit),
            "rate": json_number(self.rate), "points": [list(p) for p in points],
            "observe_only": self.observe_only, **_shared_by(self.entity),
        }


class History:
    """Each quota bucket's rate and limit over the last ``span`` seconds, one
    point per sample. Time is passed in (``now``: the loop's clock, which the
    buckets count in; ``wall``: epoch seconds, what the page shows)."""

    def __init__(self, span=HISTORY_SECONDS, interval=SAMPLE_INTERVAL,
                 max_entities=MAX_ENTITIES):
        self.span = span
        self.interval = interval
        self.max_entities = max_entities
        self.length = max(2, int(round(span / interval)) + 1)
        self.series = {}  # (key, user tag, client tag) -> _Series
        # buckets used since the previous sample, left out (over max_entities)
        self.not_charted = 0
        self._last = None  # the clock at the previous sample

    def sample(self, manager, now, wall):
        """One point per charted bucket. Only charted buckets are measured;
        the others are looked at (one attribute) unless a place is free."""
        series = self.series
        buckets = manager.buckets if manager is not None else {}
        since = self._last
        self._last = now
        newcomers = []  # buckets used since the previous sample, not charted
        for bucket_key, bucket in buckets.items():
            used = bucket.last_used
            if used is None or bucket.limit is None:
                continue
            s = series.get(bucket_key)
            if s is not None:
                s.add(wall, bucket, bucket.measure(now), now)
            elif since is None or used > since:
                newcomers.append((bucket_key, bucket))
        # a bucket that is gone (expired, its quota removed) keeps its
        # points until they are older than the span
        oldest = wall - self.span
        for bucket_key in [k for k in series if k not in buckets]:
            points = series[bucket_key].points
            while points and points[0][0] < oldest:
                points.popleft()
            if not points:
                del series[bucket_key]
        room = self.max_entities - len(series)
        arrived = len(newcomers)
        if arrived > room:
            # a busy bucket takes the place of one idle for its whole history
            idle = [k for k, s in series.items() if s.idle()]
            if idle:
                measured = [(bucket.measure(now) / bucket.limit, bucket_key, bucket)
                            for bucket_key, bucket in newcomers]
                busiest = heapq.nlargest(room + len(idle), measured, key=lambda m: m[0])
                newcomers = [(k, b) for used, k, b in busiest if used > 0]
                for bucket_key in idle[:max(0, len(newcomers) - room)]:
                    del series[bucket_key]
                room = self.max_entities - len(series)
        admitted = newcomers[:max(0, room)]
        for bucket_key, bucket in admitted:
            s = series[bucket_key] = _Series(bucket_key, self.length)
            s.add(wall, bucket, bucket.measure(now), now)
        self.not_charted = arrived - len(admitted)

    def to_json(self, since=None):
        ordered = sorted(self.series.values(),
                         key=lambda s: (s.key, s.user, s.client_id))
        return {"entities": [s.to_json(since) for s in ordered],
                "not_charted": self.not_charted}


def throttled_report(server, now):
    """Who is throttled now: the connections not read until later (a
    throttle time being served) or whose responses are held (old clients),
    per principal and client-id, with the longest time still to serve. A
    wait within TIMER_SLACK of its end is over: the pipeline reads the
    client (and sends what it held) then, so it is not shown as "0.00 s"."""
    manager = server.quotas
    rows = {}
    for conn in list(server.connections):
        muted = conn.muted_until - now
        held = getattr(getattr(conn, "pipeline", None), "hold_until", 0.0) - now
        if muted <= TIMER_SLACK and held <= TIMER_SLACK:
            continue
        remaining = max(muted, held, 0.0)
        over = set()
        client_ids = []
        for (_principal, client_id), quotas in list(conn.client_quotas.items()):
            client_ids.append(client_id)
            if manager is None:
                continue
            # as last resolved: resolving again here could make buckets
            for key, bucket in ((PRODUCER_BYTE_RATE, quotas.produce),
                                (CONSUMER_BYTE_RATE, quotas.fetch),
                                (REQUEST_RATE, quotas.request)):
                if bucket is not None and bucket.limit and bucket.measure(now) > bucket.limit:
                    over.add(KIND[key])
        for client_id in client_ids or [None]:
            row = rows.get((conn.principal, client_id))
            if row is None:
                row = rows[conn.principal, client_id] = {
                    "principal": conn.principal, "client_id": client_id, "connections": 0,
                    "remaining_ms": 0, "muted_ms": 0, "held_ms": 0, "over": set()}
            row["connections"] += 1
            row["remaining_ms"] = max(row["remaining_ms"], round(remaining * 1000))
            row["muted_ms"] = max(row["muted_ms"], round(max(muted, 0.0) * 1000))
            row["held_ms"] = max(row["held_ms"], round(max(held, 0.0) * 1000))
            row["over"] |= over
    ordered = sorted(rows.values(), key=lambda r: (-r["remaining_ms"], str(r["principal"]),
                                                   str(r["client_id"])))
    for row in ordered:
        row["over"] = sorted(row["over"])
    return {"clients": ordered[:MAX_THROTTLED], "total": len(ordered)}


def fleet_report(fleet, manager, wall):
    """This proxy's fleet shares; ``{"configured": False}`` outside a fleet."""
    if fleet is None:
        return {"configured": False}
    follower = fleet.follower
    document = follower.document
    out = {
        "configured": True,
        "proxy_id": fleet.proxy_id,
        "sharing": getattr(manager, "sharing", None),
        "fail_safe": follower.fail_safe,
        "fail_safe_active": bool(follower.fail_safe_active),
        "reason": follower.reason,
        "max_age_s": json_number(follower.max_age),
        "shares_age_s": json_number(follower.age(wall), 1),
        "cycle": document.cycle if document is not None else None,
        "fleet_size": document.fleet_size if document is not None else None,
        "prior": json_number(document.prior) if document is not None else None,
        "reports": fleet.reports,
        "report_errors": fleet.errors,
        "buckets": [],
        "buckets_total": 0,
    }
    buckets = []
    if manager is not None:
        for bucket in list(manager.buckets.values()):
            key, user, client_id = bucket.key, bucket.user_tag, bucket.client_tag
            if bucket.last_used is None or not bucket.quota:
                continue
            buckets.append({"key": key, "kind": KIND.get(key, key), "unit": UNIT.get(key, ""),
                            "user": user, "client_id": client_id,
                            "quota": json_number(bucket.quota), "share": json_number(bucket.limit),
                            "fraction": json_number((bucket.limit or 0.0) / bucket.quota, 4),
                            **_shared_by(bucket.entity)})
    buckets.sort(key=lambda b: (b["key"], b["user"], b["client_id"]))
    out["buckets"] = buckets[:MAX_SHARES]
    out["buckets_total"] = len(buckets)
    return out


def filters_report(filters):
    """Each registered filter's section (Filter.status) under its name: the
    built filter's, else what its class shows when none is built
    (Filter.status_absent)."""
    from .filters import REGISTERED

    built = {type(f): f for f in filters}
    out = {}
    for cls in REGISTERED:
        f = built.pop(cls, None)
        section = f.status() if f is not None else cls.status_absent
        if section is not None:
            out[cls.name] = section
    for f in built.values():  # made by hand, not registered
        section = f.status()
        if section is not None:
            out[f.name] = section
    return out


class StatusPage:
    """The routes of the status page and the sampler behind its history."""

    def __init__(self, server, deny, fleet=None, interval=SAMPLE_INTERVAL,
                 span=HISTORY_SECONDS):
        self.server = server
        self.deny = deny  # request -> the refusal, or None (the /quotas rule)
        self.fleet = fleet
        self.history = History(span, interval)
        self.samples = 0
        self.started_at = None  # epoch s: a page that sees it change starts over
        self._task = None
        self._files = {}
        for path, (name, content_type) in _STATIC.items():
            data = resources.files(__package__).joinpath("static", name).read_bytes()
            self._files[path] = (data, content_type)

    def report(self, since=None):
        """The page's data; with ``since`` (a previous answer's
        generated_at), only the history's points taken since then: a page
        that keeps what it was given asks for one point per entity."""
        server = self.server
        now = server.loop.time()
        wall = time.time()
        history = self.history
        quotas = {"configured": server.quotas is not None,
                  "interval_s": history.interval, "span_s": history.span,
                  "history_started_at": self.started_at, "points_since": since}
        quotas.update(history.to_json(since))
        report = {
            "generated_at": round(wall, 3),
            "quotas": quotas,
            "throttled": throttled_report(server, now),
        }
        report.update(filters_report(getattr(server, "filters", ())))
        report["fleet"] = fleet_report(self.fleet, server.quotas, wall)
        return report

    # the sampler: a task on the loop, started and stopped with the endpoint

    def sample(self):
        self.history.sample(self.server.quotas, self.server.loop.time(), time.time())
        self.samples += 1

    async def _sampling(self):
        interval = self.history.interval
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                self.sample()
            except Exception:  # a bug: said, and sampling goes on
                log.exception("status page: sampling the quota buckets failed")
            next_at += interval
            if next_at <= loop.time():  # the loop was held up: no catching up
                next_at = loop.time() + interval
            await asyncio.sleep(next_at - loop.time())

    async def running(self, app):
        """aiohttp cleanup context: sampling while the endpoint runs."""
        self.started_at = round(time.time(), 3)
        self._task = asyncio.get_running_loop().create_task(self._sampling())
        try:
            yield
        finally:
            task, self._task = self._task, None
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # the routes

    async def static(self, request):
        data, content_type = self._files[request.path]
        return web.Response(body=data, headers={
            "Content-Type": content_type, "Cache-Control": "no-cache",
            "Content-Security-Policy": _PAGE_POLICY, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"})

    async def data(self, request):
        denied = self.deny(request)
        if denied is not None:
            return denied
        since = request.query.get("since")
        if since is not None:
            try:
                since = float(since)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                return web.Response(status=400, text="since must be epoch seconds (the "
                                    "generated_at of an earlier answer)\n")
        body = json.dumps(self.report(since), separators=(",", ":"),
                          allow_nan=False).encode()
        # principals and client-ids: not for shared caches (RFC 9111 section 5.2.2.5)
        return web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store",
                                     "X-Content-Type-Options": "nosniff"})


def add_routes(app, admin, **kwargs):
    """Register the status page on the admin endpoint's aiohttp ``app``
    (before it starts): ``/``, its script and style sheet, ``/status.json``
    (guarded as /quotas is), and the sampler, which runs while the app
    does. Returns the StatusPage."""
    page = StatusPage(admin.proxy, admin._deny, getattr(admin, "fleet", None), **kwargs)
    for path in _STATIC:
        app.router.add_get(path, page.static)
    app.router.add_get("/status.json", page.data)
    app.cleanup_ctx.append(page.running)
    return page
