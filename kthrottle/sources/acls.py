"""The cluster's ACLs, followed so that the proxy can enforce them per client.

With ``--authorization`` the proxy decides, per client principal, what the
cluster's authorizer would: it needs the ACLs the cluster keeps (in its
metadata log under KRaft, in ZooKeeper before), as ``kafka-acls --list``
shows them. They are read with DescribeAcls (API key 29) and a filter that
matches every binding (resource type, pattern type, operation and
permission ANY, no name, principal or host), at start and every ``refresh``
seconds, on the proxy's event loop with aiokafka (the request built with
kafka-python's codecs, ``async_kafka.KafkaPythonRequest``) and the upstream
security settings, as ``kafka_quotas.KafkaQuotaSource`` reads the quotas.

Two broker settings decide beside the bindings: ``super.users`` (allowed
everything) and ``allow.everyone.if.no.acl.found``. They are read with
DescribeConfigs (key 32) of one broker (resource type BROKER), at start and
every ``CONFIG_EVERY`` refreshes. Kafka itself hides them: they are the
authorizer's settings, which the broker's configuration does not define, so
DescribeConfigs answers each one that is set as sensitive, with no value
(Kafka 4.4 does). What cannot be read (hidden, or DescribeConfigs not
authorized) is taken as no super users and false, said once in a WARNING:
the proxy then refuses what only a super user could do, erring on the safe
side. ``super_users``, when given, is used instead of the brokers' setting.

The snapshot (``AclSnapshot``) is handed to ``on_update`` at the first read
and again whenever it changed. A cluster without an authorizer (DescribeAcls
answers SECURITY_DISABLED) or without DescribeAcls at all gives a snapshot
that is not ``enabled``: nothing to enforce. After the proxy forwarded
CreateAcls or DeleteAcls, ``refresh_soon`` reads them again at once.

Requests name topics by id from Fetch v13 and Produce v13 on (KIP-516); the
proxy learns ids with their names from the Metadata answers its clients get,
but a client's connections may be spread over several worker processes, each
learning from what it serves. A worker asked for an id it has not seen
(``topic_ids_soon``) reads every topic's id with Metadata as the proxy's
principal, at most once every ``TOPIC_IDS_INTERVAL`` seconds, and hands the map
to ``on_topic_ids``. A read that finds no topic the last one did not have
doubles that wait, up to ``TOPIC_IDS_MAX_INTERVAL``: a client naming ids that
exist nowhere (a probe) cannot have the cluster's whole Metadata read every
second.

While the cluster cannot be read, the last snapshot stays, ``healthy`` is
false and a WARNING says why (once per reason, and once when it can be read
again). At start with no answer, the snapshot stays None until the cluster
answers. A cluster that answers but refuses (the proxy's principal may not
describe the ACLs: CLUSTER_AUTHORIZATION_FAILED) is an error at start,
``AclsRefused``: it would never give them.
"""
import asyncio
import logging
from typing import NamedTuple

from .async_kafka import (
    FollowedCluster,
    KafkaPythonRequest,
    connection_error,
    error_text,
    kafka_python_messages,
    send_to_any,
    watch_aiokafka_errors,
)

log = logging.getLogger("kthrottle.acls")

DEFAULT_REFRESH = 5.0  # seconds between reads
CONFIG_EVERY = 10  # the brokers' settings are read again every this many reads

ANY = 1  # in a filter: resource type, pattern type, operation, permission
RESOURCE_BROKER = 4  # DescribeConfigs' resource type of a broker's settings
CLUSTER_AUTHORIZATION_FAILED = 31
SECURITY_DISABLED = 54
UNREAD_RETRY = 0.5  # seconds between reads until the first answer
SUPER_USERS = "super.users"
ALLOW_EVERYONE = "allow.everyone.if.no.acl.found"
AUTHORIZER = "authorizer.class.name"  # a broker setting Kafka shows
TOPIC_IDS_INTERVAL = 1.0  # seconds at least between two reads of every topic's id
TOPIC_IDS_MAX_INTERVAL = 30.0  # ... after reads that found nothing new


class AclSnapshot(NamedTuple):
    """What the cluster's authorizer decides with."""

    #: False: the cluster has no authorizer (SECURITY_DISABLED) or no
    #: DescribeAcls: nothing to enforce
    enabled: bool
    #: (resource_type, name, pattern_type, principal, host, operation,
    #: permission) tuples with Kafka's int codes, sorted
    bindings: tuple
    #: principals as in super.users ("User:admin")
    super_users: frozenset
    allow_everyone_if_no_acl_found: bool


DISABLED = AclSnapshot(False, (), frozenset(), False)


class AclsRefused(Exception):
    """The cluster answered, and will never give the ACLs: the proxy's
    principal may not describe them. The message says who needs what."""


class AclReadError(Exception):
    """The ACLs cannot be read now (no answer, or an error worth trying
    again); the message says from where and why, on one line."""


def bindings_of(resources):
    """DescribeAcls' resources -> the sorted tuple of binding tuples
    (resource_type, name, pattern_type, principal, host, operation,
    permission)."""
    return tuple(sorted(
        (r.resource_type, r.resource_name, r.pattern_type, a.principal, a.host, a.operation,
         a.permission_type)
        for r in resources or () for a in r.acls or ()))


def parse_super_users(text):
    """super.users ("User:admin;User:ops", spaces allowed) -> frozenset."""
    return frozenset(p.strip() for p in (text or "").split(";") if p.strip())


def principal_of(security):
    """The proxy's principal as the cluster names it, as far as it can be
    told from here (for messages)."""
    if security.sasl and security.sasl_mechanism == "OAUTHBEARER":
        return "the principal of the proxy's OAUTHBEARER token"
    if security.sasl:
        return "User:%s" % security.sasl_username
    if security.tls and security.ssl_cert:
        try:
            from cryptography import x509

            with open(security.ssl_cert, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
            # Kafka's default ssl.principal.mapping.rules: User: and the subject's DN
            return "User:%s" % cert.subject.rfc4514_string()
        except Exception:
            return "the principal of the client certificate %s" % security.ssl_cert
    return "User:ANONYMOUS"


class _Settings(NamedTuple):
    super_users: frozenset
    allow_everyone: bool
    problems: tuple  # why a setting was not read, one line each
    # the broker's authorizer.class.name: "" not set, None not read
    authorizer: object = None


class KafkaAclSource(FollowedCluster):
    """The cluster's ACLs, read with DescribeAcls at start and every
    ``refresh`` seconds (see the module's doc). ``snapshot``: the last
    AclSnapshot read, None before the first. ``reads`` counts DescribeAcls
    answered."""

    noun = "ACLs"
    log = log
    refused = AclsRefused  # at start
    failures = (AclReadError, AclsRefused)  # a refusal after start: the ACLs last read stay

    def __init__(self, bootstrap_servers, security, refresh=DEFAULT_REFRESH, timeout=None,
                 client_id="kthrottle-acls", token=None, super_users=None,
                 allow_everyone_if_no_acl_found=None):
        super().__init__(bootstrap_servers, security, refresh, timeout, client_id, token)
        self.principal = principal_of(security)
        self.given_super_users = (None if super_users is None
                                  else frozenset(super_users))
        self.given_allow_everyone = allow_everyone_if_no_acl_found  # None: read it
        self.snapshot = None
        self._settings = None  # _Settings last read
        self._since_settings = 0  # reads since
        self._warned = set()  # problems with the settings, said once each
        self.on_topic_ids = None  # called with {topic id: name} after each read of them
        self.topic_id_reads = 0
        self.topic_ids_wait = TOPIC_IDS_INTERVAL  # before the next read may be
        self._ids_wake = None  # asyncio.Event: topic_ids_soon
        self._ids_task = None

    # one read -------------------------------------------------------------------

    async def read(self):
        """The cluster's ACLs now, an AclSnapshot. AclsRefused when the
        cluster will not give them, AclReadError when they cannot be read
        now."""
        from aiokafka.errors import IncompatibleBrokerVersion, for_code

        watch_aiokafka_errors()
        request_class, response_class = kafka_python_messages(
            "admin", "DescribeAclsRequest", "DescribeAclsResponse")
        try:
            # kafka-python leaves the pattern filter out of v0, which knows LITERAL only
            response = await self._ask(send_to_any(KafkaPythonRequest(
                request_class, response_class, resource_type_filter=ANY,
                resource_name_filter=None, pattern_type_filter=ANY, principal_filter=None,
                host_filter=None, operation=ANY, permission_type=ANY)), AclReadError)
        except IncompatibleBrokerVersion as exc:
            # no DescribeAcls (a stand-in broker): nothing to enforce
            log.debug("%s: %s", self.describe, error_text(exc, self.secret))
            return DISABLED
        if response.error_code == SECURITY_DISABLED:
            return DISABLED
        if response.error_code == CLUSTER_AUTHORIZATION_FAILED:
            # the broker's message only names the request's Java object
            raise AclsRefused(
                "%s refused DescribeAcls (CLUSTER_AUTHORIZATION_FAILED): the proxy's principal "
                "%s needs DESCRIBE on the Cluster resource (kafka-acls --add --allow-principal "
                "%s --operation Describe --cluster), or run the proxy with --authorization none"
                % (self.describe, self.principal, self.principal))
        if response.error_code:
            error = for_code(response.error_code)
            message = response.error_message or getattr(error, "description", "")
            raise AclReadError("%s refused DescribeAcls: %s%s" % (
                self.describe, error.__name__, ": %s" % message if message else ""))
        bindings = bindings_of(response.resources)
        settings = await self._current_settings()
        if not bindings and not settings.authorizer:
            # no ACL, and no authorizer named (or none readable): a broker that
            # answers DescribeAcls without keeping ACLs (Tansu) rather than a
            # cluster whose authorizer refuses everyone but its super users
            if "no-acls" not in self._warned:
                self._warned.add("no-acls")
                log.info("%s keeps no ACL and names no authorizer (authorizer.class.name): "
                         "nothing to enforce until it has an ACL", self.describe)
            return DISABLED
        allow = (settings.allow_everyone if self.given_allow_everyone is None
                 else self.given_allow_everyone)
        return AclSnapshot(True, bindings, settings.super_users, allow)

    async def read_topic_ids(self):
        """{topic id (uuid.UUID): name} of every topic in the cluster, read
        with Metadata (v10 and later give ids); AclReadError when it cannot."""
        request_class, response_class = kafka_python_messages(
            "metadata", "MetadataRequest", "MetadataResponse")
        watch_aiokafka_errors()
        response = await self._ask(send_to_any(KafkaPythonRequest(
            request_class, response_class, topics=None, allow_auto_topic_creation=False,
            include_cluster_authorized_operations=False,
            include_topic_authorized_operations=False)), AclReadError)
        return {t.topic_id: t.name for t in response.topics or ()
                if t.name and getattr(t, "topic_id", None) is not None
                and t.topic_id.int != 0}

    def topic_ids_soon(self):
        """A request named a topic id this process has not seen: read every
        topic's id (not more often than TOPIC_IDS_INTERVAL). On the event loop."""
        if self._ids_wake is None:
            return
        self._ids_wake.set()
        if self._ids_task is None:
            self._ids_task = asyncio.get_running_loop().create_task(self._follow_ids())

    async def _follow_ids(self):
        warned = False
        known = None
        interval = TOPIC_IDS_INTERVAL
        while True:
            await self._ids_wake.wait()
            self._ids_wake.clear()
            try:
                names = await self.read_topic_ids()
            except AclReadError as exc:
                if not warned:
                    log.warning("%s (the topic ids a request named); tried again when one "
                                "is asked for", exc)
                    warned = True
            else:
                warned = False
                self.topic_id_reads += 1
                if known is None or not names.keys() <= known:
                    interval = TOPIC_IDS_INTERVAL
                else:  # nothing new: what was asked for is in no topic (yet)
                    interval = min(interval * 2, TOPIC_IDS_MAX_INTERVAL)
                known = set(names)
                if self.on_topic_ids is not None:
                    self.on_topic_ids(names)
            self.topic_ids_wait = interval
            await asyncio.sleep(interval)

    async def stop(self):
        from . import cancelled

        self._ids_task = await cancelled(self._ids_task)
        await super().stop()

    async def _current_settings(self):
        """The brokers' super.users and allow.everyone.if.no.acl.found:
        read the first time and every CONFIG_EVERY reads, else the last."""
        self._since_settings += 1
        if self._settings is not None and self._since_settings < CONFIG_EVERY:
            return self._settings
        try:
            settings = await self._read_settings()
        except AclReadError as exc:
            if self._settings is not None:  # tried again at the next read
                log.debug("%s", exc)
                return self._settings
            settings = _Settings(self.given_super_users or frozenset(), False, (str(exc),))
        else:
            self._since_settings = 0
        for problem in settings.problems:
            if problem not in self._warned:
                self._warned.add(problem)
                if self.given_super_users is not None:
                    log.warning("%s; the proxy takes %s as false", problem, ALLOW_EVERYONE)
                else:
                    log.warning("%s; the proxy takes what it cannot read as not set (no super "
                                "users, %s false), refusing what only a super user could do",
                                problem, ALLOW_EVERYONE)
        self._settings = settings
        return settings

    async def _read_settings(self):
        """DescribeConfigs of one broker: _Settings, problems saying what
        could not be read. AclReadError when the broker did not answer."""
        from aiokafka.errors import for_code

        request_class, response_class = kafka_python_messages(
            "admin", "DescribeConfigsRequest", "DescribeConfigsResponse")
        keys = [ALLOW_EVERYONE, AUTHORIZER] if self.given_super_users is not None else [
            SUPER_USERS, ALLOW_EVERYONE, AUTHORIZER]
        try:
            async with asyncio.timeout(self.timeout):
                client = await self._connected()
                node = client.get_random_node()  # a broker's id: its settings, asked of it
                response = await client.send(node, KafkaPythonRequest(
                    request_class, response_class, include_synonyms=False,
                    include_documentation=False, resources=[
                        request_class.DescribeConfigsResource(
                            resource_type=RESOURCE_BROKER, resource_name=str(node),
                            configuration_keys=keys)]))
        except (asyncio.TimeoutError, TimeoutError):
            await self._drop_client()
            raise AclReadError("cannot read %s of %s: no answer within %gs" % (
                " and ".join(keys), self.describe, self.timeout)) from None
        except asyncio.CancelledError:
            await self._drop_client()
            raise
        except Exception as exc:
            await self._drop_client()
            raise AclReadError("cannot read %s of %s: %s" % (
                " and ".join(keys), self.describe,
                connection_error(exc, self.secret))) from None
        problems = []
        values = {}
        for result in response.results or ():
            if result.error_code:
                error = for_code(result.error_code)
                why = "DescribeConfigs: %s" % error.__name__
                if result.error_code == CLUSTER_AUTHORIZATION_FAILED:
                    why += " (%s needs DESCRIBE_CONFIGS on the Cluster resource)" % (
                        self.principal)
                problems.append("cannot read %s of broker %s from %s: %s" % (
                    " and ".join(keys), node, self.describe, why))
                return _Settings(self.given_super_users or frozenset(), False, tuple(problems))
            for entry in result.configs or ():
                values[entry.name] = entry
        hidden = [k for k in (SUPER_USERS, ALLOW_EVERYONE)
                  if k in keys and k in values and values[k].value is None]
        if self.given_allow_everyone is not None and ALLOW_EVERYONE in hidden:
            hidden.remove(ALLOW_EVERYONE)
        if hidden:
            problems.append(
                "broker %s of %s hides %s (Kafka answers the authorizer's settings as "
                "sensitive, without their value: give %s to the proxy)"
                % (node, self.describe, " and ".join(hidden),
                   " and ".join("--" + k.replace(".", "-") for k in hidden)))
        if self.given_super_users is not None:
            super_users = self.given_super_users
        else:
            entry = values.get(SUPER_USERS)  # absent: not set
            super_users = parse_super_users(entry.value if entry is not None else None)
        entry = values.get(ALLOW_EVERYONE)  # absent: not set, false
        allow = entry is not None and (entry.value or "").strip().lower() == "true"
        entry = values.get(AUTHORIZER)
        authorizer = (entry.value or "").strip() if entry is not None else ""
        return _Settings(super_users, allow, tuple(problems), authorizer)


    # following --------------------------------------------------------------------

    async def start(self, on_update):
        """Read once (``on_update(snapshot)`` when read), then every
        ``refresh`` seconds. AclsRefused when the cluster refuses; when it
        does not answer, a WARNING, and the reads go on."""
        self._ids_wake = asyncio.Event()
        await super().start(on_update)

    def _next_read(self):
        # while never read, requests wait for them at the proxy: sooner
        return self.refresh if self.snapshot is not None else min(self.refresh, UNREAD_RETRY)

    def _unread_at_start(self, exc):
        log.warning("%s; requests wait until the cluster answers (tried again every %gs)",
                    exc, min(self.refresh, UNREAD_RETRY))

    def _kept(self):
        return ("the ACLs last read stay" if self.snapshot is not None
                else "the proxy has no ACLs until it answers")

    def _take(self, snapshot):
        changed = snapshot != self.snapshot
        if changed:
            self.snapshot = snapshot
            self._on_update(snapshot)
        return changed, _summary(snapshot)


def _summary(snapshot):
    if not snapshot.enabled:
        return "no authorizer (or no DescribeAcls): nothing to enforce"
    return "%d bindings, %d super users%s" % (
        len(snapshot.bindings), len(snapshot.super_users),
        ", everyone allowed where no ACL is found" if snapshot.allow_everyone_if_no_acl_found
        else "")
