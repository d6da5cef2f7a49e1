"""The proxy's own requests to the cluster, on its event loop (aiokafka).

What the proxy asks the cluster for itself (the quotas kept there with
``--quota-source kafka``, the usage reports a fleet member publishes) goes
through aiokafka on the proxy's event loop, never a blocking client on a
thread. APIs aiokafka has no request class for are sent with kafka-python's
schema-generated codecs through ``KafkaPythonRequest``.

``AsyncKafkaPublisher`` is the asyncio counterpart of the blocking
``kafka_publisher.KafkaPublisher`` (which the volume agent, a process of its
own, keeps): the same topic (compacted, one partition, the cluster's
default replication factor, TOPIC_CONFIGS), the same log lines, each
publication bounded by ``timeout`` in all, the password scrubbed from every
message, and after a failure the next publication connects afresh.

``FollowedCluster`` is what the sources that read the cluster now and then
share (``kafka_quotas``, ``acls``): the reads at start, every refresh and on
demand, the outage's log lines; ``PolledClient`` is their client (and
``leaders``'s).
"""
import asyncio
import logging
import re
import time
import warnings

from ..security import upstream_tls_context
from .kafka_publisher import (
    DEFAULT_REPLICATION_FACTOR,
    DEFAULT_TIMEOUT,
    LastConnectionError,
    PublisherBase,
    PublishError,
    describe_connection,
    server_list,
)
from .outage import Outage

log = logging.getLogger("kthrottle.publisher")


# aiokafka's settings and log ---------------------------------------------------

def aiokafka_config(bootstrap_servers, client_id, security, timeout=DEFAULT_TIMEOUT, token=None):
    """aiokafka's connection and security settings (AIOKafkaClient,
    AIOKafkaProducer, AIOKafkaAdminClient take them alike).
    ``bootstrap_servers``: "host:port" strings or (host, port) pairs;
    ``security``: a security.KafkaClientSecurity. The brokers' certificates
    are checked, host names too (Kafka's ssl.endpoint.identification.
    algorithm=https). ``token``: for an OAUTHBEARER login, what keeps the
    proxy's own token (``current``: the token, None while there is none;
    sources.oauth_token)."""
    config = {"bootstrap_servers": server_list(bootstrap_servers), "client_id": client_id,
              "request_timeout_ms": max(1, int(timeout * 1000)), "retry_backoff_ms": 200,
              "security_protocol": security.security_protocol}
    if security.tls:
        config["ssl_context"] = upstream_tls_context(security.ssl_ca, security.ssl_cert,
                                                     security.ssl_key)
    if security.sasl and security.sasl_mechanism == "OAUTHBEARER":
        if token is None:
            raise ValueError("an OAUTHBEARER login needs the proxy's token "
                             "(--upstream-sasl-oauthbearer-token-endpoint-url)")
        config.update(sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=_Token(token))
    elif security.sasl:
        config.update(security.sasl_login())
    return config


def _Token(token):
    """aiokafka's token provider over the proxy's own token."""
    from aiokafka.abc import AbstractTokenProvider

    class Provider(AbstractTokenProvider):
        async def token(self):
            current = token.current
            if current is None:
                raise ConnectionError("no OAUTHBEARER token from %s yet" % token.url)
            return current

    return Provider()


class _LastAioKafkaError(LastConnectionError):
    """aiokafka's: its bootstrap says only "Unable to bootstrap from [...]"
    when every address failed."""

    _AFTER = re.compile(r'^Unable (?:to )?connect to (?:"[^"]*"|node with id \S+): (.*)$')


AIOKAFKA_ERRORS = _LastAioKafkaError()


def watch_aiokafka_errors():
    """Have AIOKAFKA_ERRORS keep aiokafka's connection errors (once), from
    now on; take() what it kept before."""
    aiokafka_log = logging.getLogger("aiokafka")
    if AIOKAFKA_ERRORS not in aiokafka_log.handlers:
        aiokafka_log.addHandler(AIOKAFKA_ERRORS)
    AIOKAFKA_ERRORS.take()


def quiet_aiokafka_logging(debug=False):
    """aiokafka logs every refused connection at ERROR: keep its WARNING
    and up in the process's log only when ``debug``; the proxy's own
    clients say once per outage what went wrong, with aiokafka's last
    connection error, which AIOKAFKA_ERRORS keeps."""
    aiokafka_log = logging.getLogger("aiokafka")
    aiokafka_log.setLevel(logging.WARNING)
    watch_aiokafka_errors()
    aiokafka_log.propagate = bool(debug)


def error_text(exc, secret=None):
    """"Name: message" of an exception (the name alone if it says nothing
    more), ``secret`` scrubbed."""
    name = type(exc).__name__
    text = str(exc).strip()
    text = re.sub(r"^\[Error -?\d+\] ", "", text).rstrip(".")
    if secret:
        text = text.replace(secret, "***")
    if not text or text == name:
        return name
    return text if text.startswith(name) else "%s: %s" % (name, text)


def connection_error(exc, secret=None):
    """What went wrong reaching the cluster, in words: aiokafka's "Unable
    to bootstrap from [...]" said with the last connection error it logged
    (taken), ``secret`` scrubbed."""
    from aiokafka.errors import KafkaConnectionError

    cause = AIOKAFKA_ERRORS.take()
    if isinstance(exc, KafkaConnectionError) and "bootstrap" in str(exc):
        detail = "no bootstrap server answered"
    else:
        detail = error_text(exc, secret)
    if cause and cause not in detail:
        detail += " (last connection error: %s)" % cause
    return detail.replace(secret, "***") if secret else detail


# kafka-python's codecs through aiokafka --------------------------------------------

def kafka_python_messages(module, *names):
    """Classes of kafka-python's ``kafka.protocol.<module>`` (its import
    warns a few hundred times; silenced here)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module("kafka.protocol." + module)
    return tuple(getattr(mod, name) for name in names)


class KafkaPythonRequest:
    """A request aiokafka's client sends (``AIOKafkaClient.send``) built with
    kafka-python's codecs: the newest version both the broker (its
    ApiVersions, as aiokafka negotiated them on the connection) and the
    codec have. ``fields`` are the request's, by kafka-python's names."""

    def __init__(self, request_class, response_class, **fields):
        self.request_class = request_class
        self.response_class = response_class
        self.fields = fields

    def prepare(self, versions):
        from aiokafka.errors import IncompatibleBrokerVersion

        cls = self.request_class
        if cls.API_KEY not in versions:
            raise IncompatibleBrokerVersion("the broker does not support %s (API key %d)"
                                            % (cls.name, cls.API_KEY))
        low, high = versions[cls.API_KEY]
        version = min(high, cls.max_version)
        if version < low:
            raise IncompatibleBrokerVersion("the broker supports %s versions %d-%d only, this "
                                            "client %d at most" % (cls.name, low, high,
                                                                   cls.max_version))
        return _Prepared(cls(version=version, **self.fields), self.response_class, version)


class _Prepared:
    """One KafkaPythonRequest at its version, as aiokafka's connection
    handles a request: header and body encoded, the response's header and
    body decoded."""

    def __init__(self, message, response_class, version):
        self.message = message
        self.API_KEY = message.API_KEY
        self.API_VERSION = version
        self.RESPONSE_TYPE = _Decoder(response_class, version)

    def build_request_header(self, correlation_id, client_id):
        self.message.with_header(correlation_id=correlation_id, client_id=client_id)
        return _Header(self.message, self.message.flexible_version_q(self.API_VERSION))

    def encode(self):
        return bytes(self.message.encode())

    def parse_response_header(self, buffer):
        return self.RESPONSE_TYPE.parse_header(buffer)

    def __repr__(self):
        return "%s_v%d" % (self.message.name, self.API_VERSION)


class _Header:
    def __init__(self, message, flexible):
        self.message, self.flexible = message, flexible

    def encode(self):
        return bytes(self.message.encode_header(flexible=self.flexible))


class _Decoder:
    def __init__(self, response_class, version):
        self.response_class, self.version = response_class, version

    def parse_header(self, buffer):
        return self.response_class.parse_header(buffer, version=self.version)

    def decode(self, buffer):
        return self.response_class.decode(buffer, version=self.version)


# usage reports, published on the event loop ---------------------------------------

class AsyncKafkaPublisher(PublisherBase):
    """Sends records with aiokafka on the running loop; creates the topic
    (compacted, 1 partition, the cluster's default replication factor) the
    first time it reaches the cluster. After a failure the producer is
    dropped and the next publication connects afresh.

    ``config`` is aiokafka's (``aiokafka_config``); ``describe`` says in
    error messages where and as whom (``PublisherBase``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = None  # of the publication under way

    def _error(self, what, exc):
        return PublishError("%s (%s): %s" % (what, self.describe,
                                              connection_error(exc, self.secret)))

    async def publish(self, key, value):
        """Send one record (``key`` and ``value`` bytes); aiokafka's
        RecordMetadata once acknowledged, else PublishError."""
        watch_aiokafka_errors()
        self._deadline = time.monotonic() + self.timeout
        try:
            async with asyncio.timeout(self.timeout):
                if self.producer is None:
                    self.producer = await self._producer()
                if not self.topic_ready:
                    await self._ensure_topic()
                return await self.producer.send_and_wait(self.topic, value=value, key=key)
        except PublishError:
            await self.reset()
            raise
        except (asyncio.TimeoutError, TimeoutError) as exc:
            await self.reset()
            raise self._error("not published within %gs" % self.timeout, exc) from None
        except asyncio.CancelledError:
            await self.reset()
            raise
        except Exception as exc:  # aiokafka raises a variety, OSError included
            await self.reset()
            raise self._error("publication failed", exc) from None

    async def _producer(self):
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(acks="all", enable_idempotence=False, linger_ms=0,
                                    **self.config)
        try:
            await producer.start()
        except BaseException:
            await _closed(producer)
            raise
        return producer

    async def _ensure_topic(self):
        """Create the topic if it is missing, as the blocking publisher does
        (kafka_publisher.KafkaPublisher._ensure_topic): 1 partition,
        compacted, the replication factor ``_replication_factor`` chooses,
        both explicit (CreateTopics below v4 has no broker default); without
        the configs if the cluster refuses them; a refusal to create it is
        logged and the produce decides."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(**self.config)
        try:
            await admin.start()
            topic = self.topic
            if topic in await admin.list_topics():
                self.topic_ready = True
                return
            factor, why = await self._replication_factor(admin)
            first = await self._create(admin, factor, self.topic_configs)
            second = None
            if self._retry_without_configs(first):
                second = await self._create(admin, factor, {}) if self.topic_configs else first
            self._topic_settled(factor, why, first, second)
        finally:
            await _closed(admin)

    async def _create(self, admin, factor, configs):
        """CreateTopics for this topic: None once created, else the broker's
        error as (kafka-python's error class, "Name: message"), the classes
        ``refusal_warning`` knows. Retriable errors raise: the publication
        fails and the next one tries again."""
        from aiokafka.admin import NewTopic
        from aiokafka.errors import IncompatibleBrokerVersion
        from kafka import errors as Errors

        remaining = max(100, int(self._remaining() * 1000))
        try:
            response = await admin.create_topics(
                [NewTopic(self.topic, 1, factor, topic_configs=dict(configs))],
                timeout_ms=remaining)
        except IncompatibleBrokerVersion as exc:  # no CreateTopics (Kafka < 0.10.1)
            return Errors.IncompatibleBrokerVersion, self._scrub(error_text(exc))
        for answer in response.to_object()["topic_errors"]:
            if answer["topic"] != self.topic:
                continue
            return self._created(answer["error_code"], answer.get("error_message"))
        return Errors.UnknownError, "UnknownError: no answer for topic %s" % self.topic

    def _remaining(self):
        """Seconds left of the publication under way."""
        if self._deadline is None:
            return self.timeout
        return max(0.1, self._deadline - time.monotonic())

    async def _replication_factor(self, admin):
        """(factor, why): the cluster's default.replication.factor, read with
        DescribeConfigs from the controller, capped to the live brokers;
        min(3, live brokers) when it cannot be read, saying what was
        missing."""
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
        from aiokafka.errors import KafkaError

        cluster = await admin.describe_cluster()
        live = sorted(b["node_id"] for b in cluster.get("brokers", ()))
        node = cluster.get("controller_id")
        if node not in live:
            node = live[0] if live else node
        value, missing = None, None
        try:
            answers = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, str(node))])
        except (asyncio.TimeoutError, TimeoutError):
            raise
        except KafkaError as exc:
            answers = None
            missing = "broker %s did not answer DescribeConfigs: %s" % (node, error_text(exc))
            AIOKAFKA_ERRORS.take()  # that connection's loss is told here, not later
        if answers is not None:
            value = _config_value(answers, str(node), DEFAULT_REPLICATION_FACTOR)
        return self._chosen_factor(node, live, value, missing)

    async def reset(self):
        """Drop the producer (and what it still holds); the next publication
        reconnects and checks the topic again."""
        producer, self.producer = self.producer, None
        self.topic_ready = False
        if producer is not None:
            await _closed(producer)

    close = reset


def _config_value(answers, resource_name, key):
    """``key``'s value in DescribeConfigs responses (aiokafka's structs),
    for the resource named ``resource_name``; None if absent."""
    for answer in answers:
        for resource in answer.to_object()["resources"]:
            if str(resource["resource_name"]) != resource_name or resource["error_code"]:
                continue
            for entry in resource["config_entries"]:
                if entry["config_names"] == key:
                    return entry["config_value"]
    return None


async def _closed(client):
    """Close an aiokafka client (a producer: stop it), whatever state it is
    in; never raises, takes 2 s at most."""
    close = client.stop if hasattr(client, "stop") else client.close
    try:
        await asyncio.wait_for(close(), 2)
    except Exception:
        pass


MAX_READ_TIMEOUT = 10.0  # seconds a read of a FollowedCluster may take, at most
MIN_READ_TIMEOUT = 2.0  # ... and at least, whatever its refresh


class PolledClient:
    """The aiokafka client of a source that reads the cluster now and then
    (``kafka_quotas``, ``acls``, ``leaders``): ``_reach`` sets ``config``,
    ``secret`` and ``describe`` (``timeout`` set before), ``noun`` is the
    source's."""

    def _reach(self, bootstrap_servers, security, client_id, token):
        self.config = aiokafka_config(bootstrap_servers, client_id, security, self.timeout, token)
        self.secret = security.sasl_password
        self.describe = "the cluster at %s" % describe_connection(
            bootstrap_servers, security.security_protocol, security.sasl_mechanism,
            security.sasl_username, security.ssl_cert)
        self._client = None
        self._task = None

    def _unreachable(self, detail):
        cause = AIOKAFKA_ERRORS.take()
        if cause and cause not in detail:
            detail += " (last connection error: %s)" % cause
        if self.secret:
            detail = detail.replace(self.secret, "***")
        return "cannot read the %s from %s: %s" % (self.noun, self.describe, detail)

    async def _connected(self):
        """aiokafka's client, bootstrapped; made afresh after a failure."""
        if self._client is None:
            from aiokafka import AIOKafkaClient

            client = AIOKafkaClient(**self.config)
            self._client = client
            await client.bootstrap()
        return self._client

    async def _ask(self, ask, error, versions_pass=True):
        """``await ask(client)`` with the client (``_connected``) within
        ``timeout``: its answer. When the cluster gives none the client is
        dropped (the next read connects afresh) and ``error(why)`` raised;
        IncompatibleBrokerVersion passes, the client kept (unless not
        ``versions_pass``: then it is one more failure)."""
        from aiokafka.errors import IncompatibleBrokerVersion

        try:
            async with asyncio.timeout(self.timeout):
                return await ask(await self._connected())
        except (asyncio.TimeoutError, TimeoutError):
            await self._drop_client()
            raise error(self._unreachable("no answer within %gs" % self.timeout)) from None
        except asyncio.CancelledError:
            await self._drop_client()
            raise
        except Exception as exc:  # aiokafka raises a variety, OSError included
            if versions_pass and isinstance(exc, IncompatibleBrokerVersion):
                raise
            await self._drop_client()
            raise error(self._unreachable(connection_error(exc, self.secret))) from None

    async def stop(self):
        """Stop following (the source's ``_task``) and close the client."""
        from . import cancelled

        self._task = await cancelled(getattr(self, "_task", None))
        await self._drop_client()

    async def _drop_client(self):
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 2)
            except Exception:
                pass


def send_to_any(request):
    """What _ask asks: ``request`` (a KafkaPythonRequest) sent to some broker."""
    return lambda client: client.send(client.get_random_node(), request)


class FollowedCluster(PolledClient):
    """A source that reads the cluster (``read``) at start and every
    ``refresh`` seconds, and at once after ``refresh_soon``, on the event
    loop (``kafka_quotas``, ``acls``).

    What a read gives goes to ``_take``, which hands it on to
    ``on_update`` when it changed: (changed, summary). While the cluster
    cannot be read (a read raises one of ``failures``), what was read last
    stays, ``healthy`` is false and a WARNING says why (``_kept``: what
    stays), once per reason, and once when it can be read again. At start,
    ``refused`` is raised (the cluster will never give it), any other
    failure noted (``_unread_at_start``) and the reads go on. ``log`` is the
    source's logger."""

    log = None
    refused = failures = ()

    def __init__(self, bootstrap_servers, security, refresh, timeout, client_id, token):
        self.refresh = refresh
        self.timeout = timeout if timeout is not None else min(
            MAX_READ_TIMEOUT, max(MIN_READ_TIMEOUT, refresh))
        self._reach(bootstrap_servers, security, client_id, token)
        self.healthy = False
        self.reads = 0  # reads answered
        self.read_errors = 0  # reads that failed
        self._wake = None  # asyncio.Event: refresh_soon
        self._on_update = None
        self._outage = Outage()

    async def read(self):
        raise NotImplementedError

    def _take(self, read):
        raise NotImplementedError

    def _unread_at_start(self, exc):
        raise NotImplementedError

    def _kept(self):
        raise NotImplementedError

    def _next_read(self):
        """Seconds until the next read (unless refresh_soon)."""
        return self.refresh

    async def start(self, on_update):
        """Read once (``on_update(what was read)`` when read), then every
        ``refresh`` seconds."""
        quiet_aiokafka_logging(debug=logging.getLogger("kthrottle").getEffectiveLevel()
                               <= logging.DEBUG)
        self._on_update = on_update
        self._wake = asyncio.Event()
        try:
            read = await self.read()
        except self.refused:
            await self._drop_client()
            raise
        except self.failures as exc:
            self.read_errors += 1
            self._outage.failed(str(exc))
            self._unread_at_start(exc)
        else:
            self._apply(read, first=True)
        self._task = asyncio.get_running_loop().create_task(self._follow())

    def refresh_soon(self):
        """Read again now rather than at the next refresh (what is read was
        just changed through the proxy). On the event loop."""
        if self._wake is not None:
            self._wake.set()

    async def reload(self):
        """SIGHUP: read now."""
        if self._on_update is not None:
            await self.poll()

    async def _follow(self):
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._next_read())
            except (asyncio.TimeoutError, TimeoutError):
                pass
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: said, and the next refresh still happens
                self.log.exception("reading the %s from %s failed", self.noun, self.describe)

    async def poll(self):
        """One read; what it gives is applied, or its failure noted (a
        refusal after start too)."""
        self._wake.clear()  # a change from now on is read again after this
        try:
            read = await self.read()
        except self.failures as exc:
            self.read_errors += 1
            self.healthy = False
            reason = str(exc)
            if self._outage.failed(reason):
                if self._outage.failures == 1:
                    self.log.warning("%s; %s, read again every %gs", reason, self._kept(),
                                     self.refresh)
                else:
                    self.log.warning("%s still not read (%d failed reads so far), now: %s; %s",
                                     self.noun, self._outage.failures, reason, self._kept())
            return
        self._apply(read)

    def _apply(self, read, first=False):
        self.reads += 1
        failed = self._outage.recovered()
        changed, summary = self._take(read)
        self.healthy = True
        if first:
            self.log.info("%s from %s: %s, read again every %gs", self.noun, self.describe,
                          summary, self.refresh)
        elif failed:
            self.log.info("%s read from %s again after %d failed read(s): %s", self.noun,
                          self.describe, failed, summary)
        elif changed:
            self.log.info("%s reloaded from %s: %s", self.noun, self.describe, summary)
