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
from typing import Mapping

from .callback_api import (  # the interface, named here as users have always named it
    KEY_OF_QUOTA_TYPE,
    QUOTA_TYPE_OF_KEY,
    ClientQuotaCallback,
    ClientQuotaEntity,
    ClientQuotaType,
    Cluster,
    ConfigEntity,
    ConfigEntityType,
    KafkaPrincipal,
    QuotaCallbackError,
    load_callback,
    snapshot_changes,
    tags_identity,
    takes_broker,
)
from .quotas import QuotaConfig


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
