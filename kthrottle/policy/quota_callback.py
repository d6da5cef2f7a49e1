"""Pluggable quota allocation with KIP-257's shape: a quota callback.

A callback decides two things for the client quotas (produce, fetch,
request, controller mutation): which bucket a request counts in, as metric
tags (every client whose requests get the same tags shares one quota), and
the limit of the bucket those tags name. The methods are KIP-257's
``ClientQuotaCallback`` in Python's spelling::

    quota_metric_tags(quota_type, principal, client_id) -> {str: str} | None
    quota_limit(quota_type, metric_tags) -> float | None   (None: unlimited)
    update_quota(quota_type, entity, value)     a quota source set a quota
    remove_quota(quota_type, entity)            ... or removed one
    quota_reset_required(quota_type) -> bool    polled once a second
    update_cluster_metadata(cluster) -> bool    partition leaders changed
    close()

plus ``configure(config)`` (Kafka's ``Configurable``), given the
``[quota-callback.config]`` table. The proxy asks for a client's tags once
per (principal, client-id) and caches the buckets they name; it asks again
after ``quota_reset_required`` or ``update_cluster_metadata`` returned true
and after a quota source changed something, never per request.

A proxy fronts several brokers where a broker's callback sees only its own.
A callback whose ``quota_metric_tags`` takes a ``broker`` parameter is given
the node id of the broker the connection talks to (None before it is
known), so that it may tag, and limit, each broker's share apart
(LeaderProportional below).

Without ``--quota-callback`` the proxy's own resolution applies
(``QuotaConfig``: KIP-55's levels and the quota file's groups);
``DefaultQuotaCallback`` is that resolution behind this interface, for a
callback that wants to build on it.
"""
import fnmatch
import importlib
import importlib.util
import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Mapping, NamedTuple, Protocol, runtime_checkable
from urllib.parse import urlencode

from .entities import (
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    DEFAULT,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
    parse_entity_path,
)


class ClientQuotaType(str, Enum):
    """Kafka's quota types (org.apache.kafka.server.quota.ClientQuotaType)."""

    PRODUCE = "PRODUCE"
    FETCH = "FETCH"
    REQUEST = "REQUEST"
    CONTROLLER_MUTATION = "CONTROLLER_MUTATION"


QUOTA_TYPE_OF_KEY = {
    PRODUCER_BYTE_RATE: ClientQuotaType.PRODUCE,
    CONSUMER_BYTE_RATE: ClientQuotaType.FETCH,
    REQUEST_RATE: ClientQuotaType.REQUEST,
    CONTROLLER_MUTATION_RATE: ClientQuotaType.CONTROLLER_MUTATION,
}
KEY_OF_QUOTA_TYPE = {t: k for k, t in QUOTA_TYPE_OF_KEY.items()}


class KafkaPrincipal(NamedTuple):
    """The authenticated principal of a connection: ``User:alice``;
    ``User:ANONYMOUS`` where nothing authenticates the client."""

    principal_type: str
    name: str

    def __str__(self):
        return "%s:%s" % (self.principal_type, self.name)


class ConfigEntityType(str, Enum):
    USER = "USER"
    CLIENT_ID = "CLIENT_ID"
    DEFAULT_USER = "DEFAULT_USER"
    DEFAULT_CLIENT_ID = "DEFAULT_CLIENT_ID"


class ConfigEntity(NamedTuple):
    name: str  # "" for a default
    entity_type: ConfigEntityType


@dataclass(frozen=True)
class ClientQuotaEntity:
    """The entity a quota is configured for (KIP-257's ClientQuotaEntity):
    one config entity for a ``<user>`` or ``<client-id>`` quota, two for
    ``<user, client-id>``; ``path`` is its config path (users/alice/...)."""

    config_entities: tuple
    path: str

    @classmethod
    def from_path(cls, path):
        """The entity of a client quota's config path; None for any other
        (ips/..., topics/..., static)."""
        try:
            user, client_id = parse_entity_path(path)
        except ValueError:
            return None
        parts = []
        if user is not None:
            parts.append(ConfigEntity("", ConfigEntityType.DEFAULT_USER) if user == DEFAULT
                         else ConfigEntity(user, ConfigEntityType.USER))
        if client_id is not None:
            parts.append(ConfigEntity("", ConfigEntityType.DEFAULT_CLIENT_ID)
                         if client_id == DEFAULT
                         else ConfigEntity(client_id, ConfigEntityType.CLIENT_ID))
        return cls(tuple(parts), path)


@dataclass(frozen=True)
class Cluster:
    """What a callback learns of the cluster (KIP-257 hands it Kafka's
    ``Cluster``): the live brokers and each partition's leader, from the
    Metadata answers the proxy relays and the Spark job's cluster state."""

    brokers: frozenset = frozenset()  # node ids
    leaders: Mapping = field(default_factory=dict)  # (topic, partition) -> leader node id

    def to_json(self):
        """Bytes another worker process reads back with from_json."""
        return json.dumps({"brokers": sorted(self.brokers),
                           "leaders": [[t, p, n] for (t, p), n in sorted(
                               self.leaders.items(), key=lambda item: item[0])]}).encode()

    @classmethod
    def from_json(cls, data):
        doc = json.loads(data)
        try:
            leaders = {}
            for t, p, n in doc["leaders"]:
                if not isinstance(t, str):
                    raise TypeError("a topic name is a string, got %r" % (t,))
                leaders[(t, int(p))] = None if n is None else int(n)
            return cls(frozenset(int(b) for b in doc["brokers"]), leaders)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError("not partition leaders: %s" % exc) from None

    def check_clock(self, now):
        """(what a worker's follower asks of what it is passed; nothing here)"""

    def partitions_led(self, topics):
        """{node id: how many partitions of ``topics`` it leads}."""
        wanted = set(topics)
        counts = {}
        for (topic, _partition), leader in self.leaders.items():
            if topic in wanted and leader is not None and leader >= 0:
                counts[leader] = counts.get(leader, 0) + 1
        return counts


@runtime_checkable
class ClientQuotaCallback(Protocol):
    """What ``--quota-callback`` loads (see the module's text). ``configure``
    is called once, before any other method, with the
    ``[quota-callback.config]`` table ({} without one)."""

    def configure(self, config: Mapping) -> None: ...

    def quota_metric_tags(self, quota_type: ClientQuotaType, principal: KafkaPrincipal,
                          client_id: str) -> Mapping[str, str] | None: ...

    def quota_limit(self, quota_type: ClientQuotaType,
                    metric_tags: Mapping[str, str]) -> float | None: ...

    def update_quota(self, quota_type: ClientQuotaType, entity: ClientQuotaEntity,
                     new_value: float) -> None: ...

    def remove_quota(self, quota_type: ClientQuotaType, entity: ClientQuotaEntity) -> None: ...

    def quota_reset_required(self, quota_type: ClientQuotaType) -> bool: ...

    def update_cluster_metadata(self, cluster: Cluster) -> bool: ...

    def close(self) -> None: ...


class QuotaCallbackError(Exception):
    """A callback that cannot be loaded or configured (the start stops), or
    that failed or answered nonsense while serving (the one connection that
    asked is closed)."""


# the methods the proxy calls; a class missing one is refused at load
_METHODS = ("configure", "quota_metric_tags", "quota_limit", "update_quota", "remove_quota",
            "quota_reset_required", "update_cluster_metadata", "close")


# metric tags <-> a bucket's (user tag, client tag) ----------------------------------------

def tags_identity(tags):
    """A bucket's (user tag, client tag) for ``tags``, the names /metrics
    and /quotas give it. KIP-55's shape ({"user", "client-id"}, either may
    be "") maps to itself; any other tags go in the user tag, URL-encoded
    and sorted (``team=analytics``), with a client-id tag still in the
    client tag. Which bucket it is is the tags themselves (quotas.
    callback_scope), never these names."""
    if not tags:
        return "", ""
    user = tags.get("user", "")
    client = tags.get("client-id", "")
    if len(tags) == ("user" in tags) + ("client-id" in tags):
        return user, client
    rest = sorted((k, v) for k, v in tags.items() if k != "client-id")
    return urlencode(rest), client


def check_tags(tags, where):
    if tags is None:
        return None
    if not isinstance(tags, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
        raise QuotaCallbackError("%s returned %r, not a mapping of str to str" % (where, tags))
    return tags


def check_limit(limit, where):
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) \
            or not math.isfinite(limit) or limit <= 0:
        raise QuotaCallbackError("%s returned %r, not a positive number or None"
                                 % (where, limit))
    return float(limit)


# loading ---------------------------------------------------------------------------------

def _import(module_name):
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError("no such file: %s" % path)
        name = "kthrottle_quota_callback_%s" % path.stem
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(module_name)


def load_callback(spec, config=None):
    """The callback ``spec`` names, made and configured: ``module:Class``
    (a module on the import path) or ``path/to/file.py:Class``. Raises
    QuotaCallbackError saying what went wrong."""
    module_name, sep, class_name = str(spec).rpartition(":")
    if not sep or not module_name or not class_name:
        raise QuotaCallbackError("quota callback %r is not module:Class" % (spec,))
    try:
        module = _import(module_name)
    except QuotaCallbackError:
        raise
    except Exception as exc:
        raise QuotaCallbackError("quota callback %s: cannot import %s: %s: %s"
                                 % (spec, module_name, type(exc).__name__, exc)) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise QuotaCallbackError("quota callback %s: %s has no %s" % (spec, module_name,
                                                                       class_name))
    missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise QuotaCallbackError("quota callback %s lacks %s (KIP-257's ClientQuotaCallback)"
                                 % (spec, ", ".join(missing)))
    try:
        callback = cls()
        callback.configure(dict(config or {}))
    except QuotaCallbackError:
        raise
    except Exception as exc:
        raise QuotaCallbackError("quota callback %s: configure failed: %s: %s"
                                 % (spec, type(exc).__name__, exc)) from None
    return callback


def takes_broker(callback):
    """Whether ``quota_metric_tags`` takes the connection's broker."""
    try:
        return "broker" in inspect.signature(callback.quota_metric_tags).parameters
    except (TypeError, ValueError):
        return False


def snapshot_changes(old, new):
    """The update_quota and remove_quota calls that turn ``old`` into
    ``new`` (quota snapshots): [(quota type, entity, value or None)], client
    entities only, in a stable order."""
    out = []
    old, new = old or {}, new or {}
    for path in sorted(set(old) | set(new)):
        entity = ClientQuotaEntity.from_path(path)
        if entity is None:
            continue
        before, after = old.get(path) or {}, new.get(path) or {}
        for key, quota_type in QUOTA_TYPE_OF_KEY.items():
            if key in after and after[key] != before.get(key):
                out.append((quota_type, entity, float(after[key])))
            elif key in before and key not in after:
                out.append((quota_type, entity, None))
    return out


# built-in callbacks ------------------------------------------------------------------------

class DefaultQuotaCallback:
    """The proxy's own resolution (KIP-55's levels, the quota file's groups
    and static defaults) behind the callback interface. It follows the quota
    source through ``quota_snapshot``, kthrottle's addition to KIP-257 (the
    whole snapshot, groups and static defaults included, after each change),
    and through update_quota and remove_quota as Kafka's default callback
    does. A callback may subclass it and change one decision. Its tags are
    KIP-55's {"user", "client-id"}, or {"group": NAME} for a quota group."""

    def __init__(self):
        self._snapshot = {}  # entity path (and "static", "groups") -> {quota key: value}
        self._config = None

    def configure(self, config):
        pass

    def _resolver(self):
        if self._config is None:
            from .quotas import QuotaConfig  # quotas imports this module

            self._config = QuotaConfig(self._snapshot)
        return self._config

    def quota_snapshot(self, snapshot):
        self._snapshot = dict(snapshot)
        self._config = None

    def quota_metric_tags(self, quota_type, principal, client_id):
        r = self._resolver().resolve(principal.name, client_id, KEY_OF_QUOTA_TYPE[quota_type])
        if r.limit is None:
            return None
        if r.scope is not None:  # a quota group's
            return {"group": r.entity[len("groups/"):]}
        return {"user": r.user_tag, "client-id": r.client_tag}

    def quota_limit(self, quota_type, metric_tags):
        key = KEY_OF_QUOTA_TYPE[quota_type]
        if "group" in metric_tags:
            return self._resolver().group_limit(metric_tags["group"], key)
        return self._resolver().limit_for_tags(key, metric_tags.get("user", ""),
                                               metric_tags.get("client-id", ""))

    def update_quota(self, quota_type, entity, new_value):
        config = dict(self._snapshot.get(entity.path, {}))
        config[KEY_OF_QUOTA_TYPE[quota_type]] = new_value
        self._snapshot[entity.path] = config
        self._config = None

    def remove_quota(self, quota_type, entity):
        config = dict(self._snapshot.get(entity.path, {}))
        config.pop(KEY_OF_QUOTA_TYPE[quota_type], None)
        if config:
            self._snapshot[entity.path] = config
        else:
            self._snapshot.pop(entity.path, None)
        self._config = None

    def quota_reset_required(self, quota_type):
        return False

    def update_cluster_metadata(self, cluster):
        return False

    def close(self):
        pass


# What a broker leading none of a client's partitions gets of its quota.
NO_SHARE_FRACTION = 0.001


class LeaderProportional(DefaultQuotaCallback):
    """KIP-257's second scenario: a client's quota split among the brokers in
    proportion to the partitions of its topics each one leads, recomputed as
    leaders move. The quotas are the usual KIP-55 ones (quota file,
    ZooKeeper or the cluster's admin API); the config says which topics each
    principal uses::

        [quota-callback]
        class = "kthrottle.policy.quota_callback:LeaderProportional"
        [quota-callback.config.topics]
        alice = ["orders", "orders-*"]      # fnmatch patterns
        "*" = ["shared"]                    # any principal not named

    A connection to broker B counts in a bucket of its own, limited to
    quota x (partitions of the client's topics B leads) / (all of them); a
    broker that leads none of them gets none of the quota (the client has
    nothing to ask of it but metadata, which only the request quota
    counts), and until the leaders are known every broker gets the whole
    quota, as Kafka's default would."""

    def __init__(self):
        super().__init__()
        self.topics = {}  # principal name or "*" -> (patterns)
        self.cluster = Cluster()
        self._shares = {}  # principal name -> {node: fraction} (None: not known)

    def configure(self, config):
        topics = config.get("topics", {})
        if not isinstance(topics, Mapping) or not all(
                isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v)
                for v in topics.values()):
            raise ValueError("topics must be a table of principal = [topic patterns]")
        self.topics = {str(k): tuple(v) for k, v in topics.items()}

    def _patterns(self, user):
        return self.topics.get(user, self.topics.get("*", ()))

    def share(self, user, broker):
        """The fraction of ``user``'s quota its connections to ``broker`` get
        (0.0 for a broker not known: a connection the proxy could not place
        gets no more than a broker leading none of the partitions); None
        when every broker gets the whole quota."""
        shares = self._shares.get(user)
        if shares is None:
            patterns = self._patterns(user)
            if not patterns or not self.cluster.leaders:
                return None
            names = {t for t, _ in self.cluster.leaders
                     if any(fnmatch.fnmatchcase(t, p) for p in patterns)}
            counts = self.cluster.partitions_led(names)
            total = sum(counts.values())
            shares = self._shares[user] = ({n: c / total for n, c in counts.items()}
                                           if total else {})
        if not shares:
            return None
        return shares.get(broker, 0.0)

    def quota_metric_tags(self, quota_type, principal, client_id, broker=None):
        tags = super().quota_metric_tags(quota_type, principal, client_id)
        if tags is None or quota_type not in (ClientQuotaType.PRODUCE, ClientQuotaType.FETCH):
            return tags
        if self.share(principal.name, broker) is None:
            return tags
        # a broker's share, so each broker's connections count apart
        tags = dict(tags)
        tags["broker"] = "none" if broker is None else str(broker)
        if tags.get("user") != principal.name:
            # a bucket shared beyond one principal (a client-id quota, a group):
            # each principal's share is its own
            tags["principal"] = principal.name
        return tags

    def quota_limit(self, quota_type, metric_tags):
        broker = metric_tags.get("broker")
        if broker is None:
            return super().quota_limit(quota_type, metric_tags)
        tags = {k: v for k, v in metric_tags.items() if k != "broker"}
        user = tags.pop("principal", None)
        limit = super().quota_limit(quota_type, tags)
        share = self.share(user if user is not None else tags.get("user", ""),
                           None if broker == "none" else int(broker))
        if limit is None or share is None:
            return limit
        # a broker that leads none of its partitions: a sliver (a limit of 0 divides by 0)
        return max(limit * share, limit * NO_SHARE_FRACTION)

    def update_cluster_metadata(self, cluster):
        if cluster.leaders == self.cluster.leaders:
            return False
        self.cluster = cluster
        self._shares = {}
        return True


__all__ = [
    "ClientQuotaCallback", "ClientQuotaEntity", "ClientQuotaType", "Cluster", "ConfigEntity",
    "ConfigEntityType", "DefaultQuotaCallback", "KafkaPrincipal", "LeaderProportional",
    "QUOTA_TYPE_OF_KEY", "QuotaCallbackError", "load_callback",
    "snapshot_changes", "tags_identity", "takes_broker",
]
