"""Where quotas live: a TOML file or ZooKeeper in Kafka's own layout.

A *store* is blocking and stateless: it reads a whole snapshot
(``{entity path: {quota key: float}}``, see ``kthrottle.policy.entities``) and
alters one entity. ``kthrottle quotas`` uses stores directly.

A *source* follows a store for a long-running process (the proxy, a sync
job): ``start`` reads once and hands the snapshot to ``on_update`` on the event
loop, then keeps following changes, handing over each new snapshot the same
way. When the file or ZooKeeper goes away or holds something unusable, the
last known quotas stay in force, ``healthy`` turns false and a log line says
why; ``rejected`` counts what was refused, for a metric.

SASL/SCRAM credentials, kept in the same two places, are followed the same
way (``credentials``: ``on_update`` gets a ``Credentials`` snapshot).

Nothing here depends on the proxy.
"""
import asyncio
import logging

log = logging.getLogger("kthrottle.quotas")


class QuotaStoreError(Exception):
    """The store cannot be read or written; the message says which and why,
    on one line (it is shown to users as is)."""


class QuotaStore:
    """Blocking access to where quotas are kept."""

    def read(self):
        """The whole snapshot: ``{entity path: {quota key: float}}``, plus
        ``"static"`` for a file's static defaults. Raises QuotaStoreError."""
        raise NotImplementedError

    def alter(self, path, add=None, delete=()):
        """Set the ``add`` ({key: value}) and remove the ``delete`` quota keys
        of the entity at ``path``; returns its new config ({} if none is
        left). A bad key or value raises ValueError with nothing written."""
        raise NotImplementedError

    def close(self):
        """Release connections; the store is not used afterwards."""


class QuotaSource:
    """A store followed live. ``start``/``stop`` run on the event loop;
    ``on_update`` is only ever called on that loop."""

    #: True while the quotas in force are what the store holds now
    healthy = False
    #: what is followed, for log lines ("quota file /etc/q.toml")
    describe = ""
    #: entries (ZooKeeper znodes, notifications) or file versions refused
    #: since start; each is logged once
    rejected = 0

    async def start(self, on_update):
        """Read once and call ``on_update(snapshot)`` before returning, then
        follow changes. Raises QuotaStoreError if the first read fails."""
        raise NotImplementedError

    async def stop(self):
        """Stop following; safe to call after a failed or no ``start``."""
        raise NotImplementedError


class Registered:
    """A source kind registered by name: the option that names it (its
    attribute in the proxy's configuration) and where its class is."""

    def __init__(self, name, option, module, cls):
        self.name, self.option, self.module, self.cls = name, option, module, cls

    def load(self):
        import importlib

        return getattr(importlib.import_module(self.module, __name__), self.cls)


# In order of preference: the first whose option is set is built.
QUOTA_SOURCES = (
    Registered("file", "quota_file", ".file", "FileQuotaSource"),
    Registered("zookeeper", "zookeeper", ".zookeeper", "ZooKeeperQuotaSource"),
    # never inferred: only when --quota-source kafka names it
    Registered("kafka", None, ".kafka_quotas", "KafkaQuotaSource"),
)
CREDENTIAL_STORES = (
    Registered("file", "credentials_file", ".credentials", "FileCredentialSource"),
    Registered("zookeeper", "zookeeper", ".credentials", "ZooKeeperCredentialSource"),
)


def build_source(registry, config, name=None, **extra):
    """The source the configuration names: the kind called ``name`` when
    given, else the first registered kind whose option is set; built from
    that option's value, or by the class's ``from_config(config, **extra)``
    when it has one. None if there is none."""
    for kind in registry:
        if name is None:
            value = getattr(config, kind.option, None) if kind.option else None
            if value:
                return kind.load()(value)
        elif kind.name == name:
            cls = kind.load()
            if hasattr(cls, "from_config"):
                return cls.from_config(config, **extra)
            return cls(getattr(config, kind.option))
    return None


_LAZY = {"FileQuotaStore": "file", "FileQuotaSource": "file",
         "ZooKeeperQuotaStore": "zookeeper", "ZooKeeperQuotaSource": "zookeeper"}


def __getattr__(name):
    # the implementations load on first use (kazoo only when ZooKeeper is)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module("." + _LAZY[name], __name__), name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


async def cancelled(task):
    """Cancel ``task`` (None: nothing) and wait until it has ended; None,
    for the caller's ``self._task = await cancelled(self._task)``."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return None


async def ended(task):
    """Cancel ``task`` (None: nothing) and wait until it has ended, however
    it ends: unlike ``cancelled``, an exception it died of is not raised
    here (a stop that always completes); None, for the caller's
    ``self._task = await ended(self._task)``."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return None


class HttpFollower:
    """What fetches over HTTP (aiohttp) on the event loop, again and again
    from a task of its own (``_task``): ``_http()`` is its one session, made
    on first use (requests time out after ``FETCH_TIMEOUT`` seconds in all);
    ``stop`` ends the task, then closes the session."""

    FETCH_TIMEOUT = 10.0
    _task = None
    _session = None

    def _http(self):
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.FETCH_TIMEOUT))
        return self._session

    async def stop(self):
        self._task = await cancelled(self._task)
        if self._session is not None:
            await self._session.close()
            self._session = None


def entity_count(snapshot):
    """Entities in a snapshot (the file's static defaults are not one; each
    quota group is)."""
    return sum(1 for p in snapshot if p not in ("static", "groups")) \
        + len(snapshot.get("groups") or ())
