"""Quotas kept in the cluster itself (``--quota-source kafka``).

A KRaft cluster keeps client quotas in its metadata log and serves them with
DescribeClientQuotas (KIP-546); ``kafka-configs.sh --bootstrap-server``,
Strimzi and the Terraform providers set them with AlterClientQuotas. The
proxy reads them all (no filter components, strict false: every entity) at
start and every ``--quota-refresh``, on its event loop with aiokafka (the
request built with kafka-python's codecs, ``async_kafka.KafkaPythonRequest``)
and the upstream security settings.

The cluster owns them (``owned_by_cluster``): an AlterClientQuotas sent to
the proxy goes on to the cluster, and once it has passed ``refresh_soon``
reads them again at once, so the change is in force on this proxy within a
round trip, on others at their next refresh.

While the cluster cannot be read, the last quotas stay in force, ``healthy``
is false and a WARNING says why (once per reason, and once when it can be
read again). At start with no answer, the proxy starts with no quotas, says
so, and takes them on as soon as the cluster answers. A cluster that
answers but refuses (no DescribeClientQuotas, not authorized) is an error at
start: it would never give quotas.
"""
import asyncio
import logging

from ..policy.entities import (
    DEFAULT,
    ENTITY_TYPES,
    QUOTA_KEYS,
    REQUEST_RATE,
    entity_kind,
    keys_for,
    path_of_entity,
    validate_quota_config,
)
from . import QuotaSource, QuotaStoreError, entity_count
from .async_kafka import (
    MAX_READ_TIMEOUT,
    FollowedCluster,
    KafkaPythonRequest,
    aiokafka_config,
    connection_error,
    error_text,
    kafka_python_messages,
    quiet_aiokafka_logging,
    send_to_any,
    watch_aiokafka_errors,
)
from .kafka_publisher import describe_connection

log = logging.getLogger("kthrottle.quotas")

DEFAULT_REFRESH = 10.0
USER, CLIENT_ID = "user", "client-id"  # entity types as Kafka names them on the wire


class ClusterRefused(QuotaStoreError):
    """The cluster answered, and not with the quotas (it lacks the API, or
    the proxy may not describe them)."""


def _entity_text(components):
    """An entity as kafka-configs --describe words it: "user 'alice',
    client-id 'app'", "default user"."""
    parts = []
    for kind, name in components:
        parts.append("default %s" % kind if name is None else "%s '%s'" % (kind, name))
    return ", ".join(parts) or "no entity"


def snapshot_from_entries(entries):
    """DescribeClientQuotas entries -> (snapshot, skipped): the snapshot
    ``{entity path: {quota key: float}}`` of what kthrottle enforces, and
    ``{(entity text, key, value): why}`` of each value left out (an entity
    type or a key kthrottle does not enforce, a value it cannot use).
    Kafka's user, client-id and ip entities are read; a ``topic`` entity
    only comes from a kthrottle proxy answering the admin API itself (no
    Kafka cluster keeps one) and is read too.

    ``entries``: (components, values), components [(entity type, name or
    None for the default)], values [(key, value)]."""
    snapshot, skipped = {}, {}
    for components, values in entries:
        text = _entity_text(components)
        names = {kind: DEFAULT if name is None else name for kind, name in components}
        others = sorted({kind for kind, _ in components if kind not in ENTITY_TYPES})
        try:
            if others:
                raise ValueError("kthrottle enforces quotas of %s entities, not of %s"
                                 % (", ".join(ENTITY_TYPES), ", ".join(others)))
            if len(names) != len(components):
                raise ValueError("an entity type given twice")
            path = path_of_entity(names)
        except ValueError as exc:
            for key, value in values:
                skipped[(text, key, value)] = str(exc)
            continue
        config = {}
        for key, value in values:
            if key not in QUOTA_KEYS:
                why = "kthrottle does not enforce %s" % key
                if key == "request_percentage":
                    why += " (its request quota is %s, in requests per second)" % REQUEST_RATE
                skipped[(text, key, value)] = why
                continue
            if key not in keys_for(path):
                skipped[(text, key, value)] = "%s is not a quota of %s entities" % (
                    key, entity_kind(path))
                continue
            try:
                config.update(validate_quota_config({key: value}, path=path))
            except ValueError as exc:
                skipped[(text, key, value)] = str(exc)
        if config:
            snapshot[path] = config
    return snapshot, skipped


class KafkaQuotaSource(FollowedCluster, QuotaSource):
    """The cluster's client quotas, read with DescribeClientQuotas at start
    and every ``refresh`` seconds (see the module's doc). ``reads`` counts
    DescribeClientQuotas answered."""

    owned_by_cluster = True
    noun = "quotas"
    log = log
    refused = ClusterRefused  # at start
    failures = QuotaStoreError

    def __init__(self, bootstrap_servers, security, refresh=DEFAULT_REFRESH, timeout=None,
                 client_id="kthrottle-quotas", token=None):
        super().__init__(bootstrap_servers, security, refresh, timeout, client_id, token)
        self.rejected = 0
        self._applied = None  # the snapshot in force
        self._skipped = {}  # values left out of the snapshot in force (logged once each)

    @classmethod
    def from_config(cls, config, token=None):
        """From the proxy's configuration: its upstream cluster and security
        settings, --quota-refresh; ``token``: its OAUTHBEARER token, if it
        logs in with one."""
        client_id = "kthrottle-proxy-%s" % config.proxy_id if config.proxy_id else "kthrottle"
        return cls(config.bootstrap_servers, config.upstream_security(), config.quota_refresh,
                   client_id=client_id, token=token)

    # one read -------------------------------------------------------------------

    async def read(self):
        """The cluster's quotas: (snapshot, skipped) as
        ``snapshot_from_entries`` gives them. QuotaStoreError says why they
        cannot be read (ClusterRefused when the cluster answered no)."""
        from aiokafka.errors import IncompatibleBrokerVersion, for_code

        watch_aiokafka_errors()
        request_class, response_class = kafka_python_messages(
            "admin", "DescribeClientQuotasRequest", "DescribeClientQuotasResponse")
        try:
            response = await self._ask(send_to_any(KafkaPythonRequest(
                request_class, response_class, components=[], strict=False)), QuotaStoreError)
        except IncompatibleBrokerVersion as exc:
            await self._drop_client()
            raise ClusterRefused("%s does not answer DescribeClientQuotas (KIP-546, Kafka 2.6 "
                                 "and later): %s" % (self.describe, error_text(exc, self.secret)))
        if response.error_code:
            error = for_code(response.error_code)
            message = response.error_message or getattr(error, "description", "")
            raise ClusterRefused("%s refused DescribeClientQuotas: %s%s"
                                 % (self.describe, error.__name__,
                                    ": %s" % message if message else ""))
        entries = [([(e.entity_type, e.entity_name) for e in entry.entity],
                    [(v.key, v.value) for v in entry.values])
                   for entry in response.entries or ()]
        return snapshot_from_entries(entries)


    # following --------------------------------------------------------------------

    def _unread_at_start(self, exc):
        log.warning("%s; the proxy starts with no quotas and takes them on as soon as the "
                    "cluster answers (tried again every %gs)", exc, self.refresh)
        self._on_update({})
        self._applied = {}

    def _kept(self):
        return ("the last known quotas stay in force" if self._applied
                else "no quotas are in force until it answers")

    def _take(self, read):
        snapshot, skipped = read
        for (entity, key, value), why in skipped.items():
            if (entity, key, value) not in self._skipped:
                self.rejected += 1
                log.warning("quotas from %s: ignoring %s=%s of %s: %s", self.describe, key,
                            value, entity, why)
        self._skipped = skipped
        changed = snapshot != self._applied
        if changed:
            self._on_update(snapshot)
            self._applied = snapshot
        return changed, "%d entities" % entity_count(snapshot)


# kafka-configs --bootstrap-server: the admin API of a cluster or a proxy ------------

class AdminApiQuotaStore:
    """Quotas read and altered through Kafka's admin API (KIP-546) of a
    cluster, or of a kthrottle proxy answering it (``--admin-principals``):
    what ``kthrottle quotas --bootstrap-server`` uses, as kafka-configs
    --bootstrap-server does. Blocking: each call is one connection's
    requests on an event loop of its own."""

    def __init__(self, bootstrap_servers, security, timeout=MAX_READ_TIMEOUT,
                 client_id="kthrottle-quotas"):
        self.config = aiokafka_config(bootstrap_servers, client_id, security, timeout)
        self.secret = security.sasl_password
        self.timeout = timeout
        self.describe = "the admin API at %s" % describe_connection(
            bootstrap_servers, security.security_protocol, security.sasl_mechanism,
            security.sasl_username, security.ssl_cert)

    def connect(self):
        return self

    def close(self):
        pass

    def _call(self, request, response):
        """Send the kafka-python ``request`` fields (a KafkaPythonRequest) and
        return the answer; QuotaStoreError says why there is none."""
        from aiokafka import AIOKafkaClient
        from aiokafka.errors import IncompatibleBrokerVersion

        async def call():
            quiet_aiokafka_logging()
            client = AIOKafkaClient(**self.config)
            try:
                async with asyncio.timeout(self.timeout):
                    await client.bootstrap()
                    return await client.send(client.get_random_node(), request)
            finally:
                await client.close()

        try:
            return asyncio.run(call())
        except IncompatibleBrokerVersion as exc:
            raise QuotaStoreError("%s does not answer %s (KIP-546): %s" % (
                self.describe, request.request_class.__name__.replace("Request", ""),
                error_text(exc, self.secret))) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise QuotaStoreError("%s: no answer within %gs" % (self.describe, self.timeout))
        except Exception as exc:  # aiokafka raises a variety, OSError included
            raise QuotaStoreError("cannot reach %s: %s" % (
                self.describe, connection_error(exc, self.secret))) from None

    def entries(self, components=(), strict=False):
        """DescribeClientQuotas: [(components, values)] as snapshot_from_entries
        takes them. ``components``: (entity type, match type, name) each."""
        from aiokafka.errors import for_code

        request_class, response_class = kafka_python_messages(
            "admin", "DescribeClientQuotasRequest", "DescribeClientQuotasResponse")
        data = request_class.ComponentData
        response = self._call(KafkaPythonRequest(
            request_class, response_class, strict=strict,
            components=[data(entity_type=t, match_type=m, match=n) for t, m, n in components]),
            response_class)
        if response.error_code:
            raise QuotaStoreError("%s refused DescribeClientQuotas: %s%s" % (
                self.describe, for_code(response.error_code).__name__,
                ": %s" % response.error_message if response.error_message else ""))
        return [([(e.entity_type, e.entity_name) for e in entry.entity],
                 [(v.key, v.value) for v in entry.values]) for entry in response.entries or ()]

    def read(self):
        """Every entity's quotas that kthrottle knows, as a snapshot (what
        it does not know is left out)."""
        return snapshot_from_entries(self.entries())[0]

    def alter(self, path, add=None, delete=()):
        """AlterClientQuotas of one entity; its quotas after (DescribeClientQuotas,
        strict). The entry's error raises QuotaStoreError with its message."""
        from aiokafka.errors import for_code

        from ..policy.entities import parse_entity
        from ..policy.quota_file import altered

        altered({}, add, delete, path)  # refused here as it would be there
        names = parse_entity(path)
        entity = [(t, None if n == DEFAULT else n) for t, n in names.items()]
        request_class, response_class = kafka_python_messages(
            "admin", "AlterClientQuotasRequest", "AlterClientQuotasResponse")
        data = request_class.EntryData
        values = validate_quota_config(add or {}, path=path)
        ops = [data.OpData(key=k, value=v, remove=False) for k, v in values.items()]
        ops += [data.OpData(key=k, value=0.0, remove=True) for k in delete]
        response = self._call(KafkaPythonRequest(
            request_class, response_class, validate_only=False,
            entries=[data(entity=[data.EntityData(entity_type=t, entity_name=n)
                                  for t, n in entity], ops=ops)]), response_class)
        for entry in response.entries:
            if entry.error_code:
                raise QuotaStoreError("%s refused the alteration: %s%s" % (
                    self.describe, for_code(entry.error_code).__name__,
                    ": %s" % entry.error_message if entry.error_message else ""))
        components = [(t, 0, n) if n is not None else (t, 1, None) for t, n in entity]
        return snapshot_from_entries(self.entries(components, strict=True))[0].get(path, {})
