"""KIP-257's quota callback interface as the proxy calls it: the types a
callback is given (ClientQuotaType, KafkaPrincipal, Cluster ...), loading a
callback by ``module:Class`` and checking what it answers. The policy
(``quotas.py``) imports this module; the built-in callbacks, which build on
the policy's own resolution, are in ``quota_callback.py``, the module users
name (``kthrottle.policy.quota_callback``), which re-exports all of this."""
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
