"""A blocking kafka-python publisher of keyed records to one compacted topic.

What the volume agent (``kthrottle volume-agent``: per-broker volume usage)
publishes with. The topic is created on first contact, compacted
(cleanup.policy=compact, with segment.ms and min.cleanable.dirty.ratio set
so that compaction keeps up: TOPIC_CONFIGS), one partition, and the cluster's
default.replication.factor (read from the controller with DescribeConfigs,
capped to the live brokers; min(3, live brokers) when it cannot be read), all
explicit, as CreateTopics below v4 (Kafka < 2.4) requires. A cluster that
refuses the config gets the topic without it; one that refuses to create it
(ACLs) is logged with the broker's error, the spec tried and the kafka-topics
command that would create it, and the produce decides. A failed
publication raises PublishError with why (the last connection error
kafka-python logged, the password scrubbed), drops the producer, and the
next publication connects afresh. Each publication is bounded by ``timeout``
in all: connecting, creating the topic, the acknowledgement.

Blocking: for a process of its own (the volume agent); the proxy publishes
on its event loop with ``async_kafka.AsyncKafkaPublisher``, which shares the
pure helpers here. kafka-python is imported on first use.
"""
import logging
import re
import time

log = logging.getLogger("kthrottle.publisher")

# Compaction never touches the active segment, which rolls only at segment.bytes
# (1 GiB) or segment.ms (7 days) by default: a report topic would be read whole
# for days. Rolling every hour and cleaning once a tenth of the log is
# superseded (Kafka's default: half) keeps it near one record per key.
TOPIC_CONFIGS = {"cleanup.policy": "compact", "segment.ms": "3600000",
                 "min.cleanable.dirty.ratio": "0.1"}
DEFAULT_TIMEOUT = 10.0
DEFAULT_REPLICATION_FACTOR = "default.replication.factor"
# when the cluster's default cannot be read: Kafka's own recommendation for
# durable topics, never more than the brokers there are
FALLBACK_REPLICATION_FACTOR = 3


class PublishError(Exception):
    pass


# a failed login as kafka-python names it: SaslAuthenticationFailedError,
# AuthenticationFailedError, UnsupportedSaslMechanismError, IllegalSaslStateError
_AUTHENTICATION_FAILED = re.compile(r"Authentication\w*Error|Sasl\w*Error")


class LastConnectionError(logging.Handler):
    """Keeps the last connection error a Kafka client library logged (the
    part of a WARNING that ``_AFTER`` matches, as ``cause`` words it): the
    libraries retry until their timeout, then say only that they could not
    bootstrap, so the caller tells why itself."""

    _AFTER = None

    def __init__(self):
        super().__init__(logging.WARNING)
        self.last = None

    def emit(self, record):
        try:
            m = self._AFTER.search(record.getMessage())
        except Exception:
            return
        if m:
            cause = self.cause(m.group(1))
            if cause is not None and self.replaces(cause):
                self.last = cause

    @staticmethod
    def cause(text):
        """The error as told (None: nothing worth telling)."""
        return text

    def replaces(self, cause):
        """Whether ``cause`` is told rather than the one kept."""
        return True

    def take(self):
        last, self.last = self.last, None
        return last


class _LastKafkaError(LastConnectionError):
    """kafka-python's: a refused connection or a failed authentication is
    retried until the timeout, then "Unable to bootstrap"."""

    _AFTER = re.compile(r"(?:Connection lost|failed): (.*?)(?: \(backoff [0-9.]+ secs\))?$")

    @staticmethod
    def cause(text):
        if "KafkaTimeoutError" in text:  # the timeout itself: no news
            return None
        # kafka-python repeats the class name: "X: X: details"
        return re.sub(r"(\w+Error): \1: ", r"\1: ", text)

    def replaces(self, cause):
        """An authentication failure is kept until taken (a publication
        takes at its start): the attempt its deadline cuts short, or a
        connection lost after it, says less."""
        return not (self.last and _AUTHENTICATION_FAILED.search(self.last)
                    and not _AUTHENTICATION_FAILED.search(cause))


KAFKA_ERRORS = _LastKafkaError()


def quiet_kafka_logging(debug=False):
    """kafka-python logs every refused reconnection at ERROR and much at
    INFO: keep its WARNING and up (its DEBUG lines show the configuration,
    password included), in the process's log only when ``debug``; a
    publisher says once per publication what went wrong, with kafka-python's
    last connection error, which KAFKA_ERRORS keeps."""
    kafka_log = logging.getLogger("kafka")
    kafka_log.setLevel(logging.WARNING)
    if KAFKA_ERRORS not in kafka_log.handlers:
        kafka_log.addHandler(KAFKA_ERRORS)
    kafka_log.propagate = bool(debug)


def client_config(bootstrap_servers, client_id, security_protocol="PLAINTEXT", ssl_ca=None,
                  ssl_cert=None, ssl_key=None, sasl_mechanism=None, sasl_username=None,
                  sasl_password=None, timeout=DEFAULT_TIMEOUT, security=None):
    """kafka-python's connection and security settings (admin and producer).
    ``bootstrap_servers``: "host:port" strings or (host, port) pairs;
    ``security``: a security.KafkaClientSecurity (the loose security
    arguments make one for the callers that do not pass it)."""
    from ..security import KafkaClientSecurity

    if security is None:
        security = KafkaClientSecurity(security_protocol, ssl_ca, ssl_cert, ssl_key,
                                       sasl_mechanism, sasl_username, sasl_password)
    timeout_ms = int(timeout * 1000)
    config = {"bootstrap_servers": server_list(bootstrap_servers),
              "client_id": client_id,
              "request_timeout_ms": timeout_ms,
              "bootstrap_timeout_ms": timeout_ms,
              "reconnect_backoff_max_ms": 1000}
    config.update(security.kafka_python())
    return config


def server_list(bootstrap_servers):
    """"host:port" strings (an IPv6 host in brackets) of "host:port"
    strings or (host, port) pairs, as the clients take them."""
    servers = []
    for s in bootstrap_servers:
        if not isinstance(s, str):
            host, port = s
            s = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)
        servers.append(s)
    return servers


def _error_text(exc):
    """"Name: message" of an exception, kafka-python's "[Error N] " dropped."""
    name = type(exc).__name__
    text = re.sub(r"^\[Error -?\d+\] ", "", str(exc)).rstrip(".")
    return text if text.startswith(name) else "%s: %s" % (name, text) if text else name


def choose_replication_factor(default, live_brokers):
    """(factor, why) for a new topic: ``default`` (the cluster's
    default.replication.factor, None when it could not be read) capped to
    ``live_brokers`` (a broker refuses more replicas than there are brokers),
    else min(FALLBACK_REPLICATION_FACTOR, live brokers)."""
    live = max(1, live_brokers)
    brokers = "%d live broker%s" % (live, "" if live == 1 else "s")
    if default is None:
        return (min(FALLBACK_REPLICATION_FACTOR, live),
                "min(%d, %s)" % (FALLBACK_REPLICATION_FACTOR, brokers))
    if default > live:
        return live, "%s %d capped to the %s" % (DEFAULT_REPLICATION_FACTOR, default, brokers)
    return default, "the cluster's %s" % DEFAULT_REPLICATION_FACTOR


def refusal_warning(topic, described, configs, first, second, create_command, bootstrap):
    """The WARNING when the cluster did not create ``topic`` as asked, None
    when it did. ``described``: the spec tried, in words; ``configs``: its
    "k=v,..." (may be empty); ``first``: the broker's error with the configs
    as (kafka-python's class, "Name: message"), None once created;
    ``second``: the same without them (None: created; ``first`` itself: not
    tried). It says the broker's error and the one command that would help:
    kafka-configs when only the configs were refused, else kafka-topics."""
    from kafka import errors as Errors

    if first is None or first[0] is Errors.TopicAlreadyExistsError:
        return None
    if issubclass(first[0], Errors.AuthorizationError):
        return ("not allowed to create topic %s with %s (%s): publishing anyway; a principal "
                "allowed to create it can run: %s" % (topic, described, first[1], create_command))
    if second is None:
        return ("the cluster refused topic %s with %s (%s): created it without, so old records "
                "go by retention, not compaction; to add it: kafka-configs --bootstrap-server %s "
                "--alter --entity-type topics --entity-name %s --add-config %s"
                % (topic, configs, first[1], bootstrap, topic, configs))
    if second[0] is Errors.TopicAlreadyExistsError:
        return None
    tried = first[1]
    if second is not first:
        tried += "; without %s: %s" % (configs, second[1])
    return ("could not create topic %s with %s (%s): publishing anyway; once what the broker "
            "names is fixed, create it with: %s" % (topic, described, tried, create_command))


def create_command(bootstrap, topic, replication_factor, configs, security_protocol):
    """The kafka-topics command that creates ``topic`` as a publisher would."""
    command = ("kafka-topics --bootstrap-server %s --create --topic %s --partitions 1 "
               "--replication-factor %d" % (bootstrap, topic, replication_factor))
    for kv in sorted(configs.items()):
        command += " --config %s=%s" % kv
    if security_protocol != "PLAINTEXT":
        command += " --command-config CLIENT.properties"
    return command


def describe_connection(bootstrap_servers, security_protocol="PLAINTEXT", sasl_mechanism=None,
                        sasl_username=None, ssl_cert=None):
    """One line for the log: where and as whom, never the password."""
    servers = [s if isinstance(s, str) else "%s:%d" % tuple(s) for s in bootstrap_servers]
    text = "%s over %s" % (",".join(servers), security_protocol)
    if security_protocol.startswith("SASL_") and sasl_username is None:
        text += " with %s" % sasl_mechanism  # OAUTHBEARER: the token names who
    elif security_protocol.startswith("SASL_"):
        text += " as %r with %s" % (sasl_username, sasl_mechanism)
    if ssl_cert:
        text += " with client certificate %s" % ssl_cert
    return text


class PublisherBase:
    """What both publishers share (this module's blocking one, and
    ``async_kafka.AsyncKafkaPublisher`` on the proxy's loop): the settings,
    scrubbing the password, the warnings said once, and the decisions about
    the topic (its layout, the replication factor, a refusal); the calls to
    the cluster are each one's own.

    ``config`` is the client library's; ``describe`` says in error messages
    where and as whom; ``secret`` (the SASL password) is scrubbed from every
    message; ``logger`` gets the topic creation lines."""

    def __init__(self, config, topic, timeout=DEFAULT_TIMEOUT, describe="", secret=None,
                 logger=None, topic_configs=None):
        self.config = dict(config)
        self.topic = topic
        self.timeout = timeout
        self.describe = describe or describe_connection(
            self.config.get("bootstrap_servers", ()),
            self.config.get("security_protocol", "PLAINTEXT"))
        self.secret = secret
        self.log = logger or log
        self.topic_configs = dict(TOPIC_CONFIGS if topic_configs is None else topic_configs)
        self.producer = None
        self.topic_ready = False
        self._last_warning = None

    def _scrub(self, text):
        text = str(text)
        return text.replace(self.secret, "***") if self.secret else text

    def _warn(self, text, *args):
        """A WARNING the first time, DEBUG while it repeats: a publication
        retried every few seconds must not repeat the same lines."""
        message = self._scrub(text % args)
        if message == self._last_warning:
            self.log.debug("%s", message)
        else:
            self._last_warning = message
            self.log.warning("%s", message)

    def _bootstrap(self):
        servers = self.config.get("bootstrap_servers") or ["HOST:PORT"]
        return servers[0]

    def create_command(self, replication_factor):
        """The kafka-topics command that creates this topic as the publisher
        would."""
        return create_command(self._bootstrap(), self.topic, replication_factor,
                              self.topic_configs,
                              self.config.get("security_protocol", "PLAINTEXT"))

    def _topic_configs_text(self):
        return ",".join("%s=%s" % kv for kv in sorted(self.topic_configs.items()))

    @staticmethod
    def _retry_without_configs(first):
        """After a refused creation: whether the configs may be what the
        cluster refuses (not an existing topic, not an authorization error)."""
        from kafka import errors as Errors

        return first is not None and not (first[0] is Errors.TopicAlreadyExistsError
                                          or issubclass(first[0], Errors.AuthorizationError))

    def _topic_settled(self, factor, why, first, second):
        """Say how the topic's creation went (``first`` and ``second``: the
        creations' errors, None once created); the topic is taken as ready
        either way: the produce decides."""
        configs = self._topic_configs_text()
        layout = "1 partition, replication factor %d = %s" % (factor, why)
        if first is None:
            self.log.info("created topic %s%s with %s", self.topic,
                          " (%s)" % configs if configs else "", layout)
        warning = refusal_warning(self.topic, layout + (", " + configs if configs else ""),
                                  configs, first, second, self.create_command(factor),
                                  self._bootstrap())
        if warning:
            self._warn("%s", warning)
        self.topic_ready = True

    def _created(self, error_code, message):
        """A CreateTopics answer for this topic: None once created, else the
        broker's error as (kafka-python's class, "Name: message"). Retriable
        errors raise: the publication fails and the next one tries again."""
        from kafka import errors as Errors

        error = Errors.for_code(error_code)
        if error is Errors.NoError:
            return None
        message = message or error.description
        if error.retriable:
            raise error(message)
        return error, self._scrub("%s: %s" % (error.__name__, message))

    def _chosen_factor(self, node, live, value, missing):
        """(factor, why) from the default.replication.factor ``value`` broker
        ``node`` reported (None: ``missing`` says why it was not read), capped
        to the ``live`` brokers; a WARNING when it was not read or is capped."""
        default = None
        if value is None and missing is None:
            missing = ("broker %s answered DescribeConfigs without it (the broker does not "
                       "report it, or this principal may not describe the cluster's configs)"
                       % node)
        elif value is not None and value.isdigit() and int(value) > 0:
            default = int(value)
        elif value is not None:
            missing = "broker %s reported %r" % (node, value)
        factor, why = choose_replication_factor(default, len(live))
        if missing:
            self._warn("could not read %s: %s; creating topic %s with replication factor %d = %s",
                       DEFAULT_REPLICATION_FACTOR, missing, self.topic, factor, why)
        elif factor < default:
            self._warn("%s is %d on broker %s but only %d broker%s live: creating topic %s with "
                       "replication factor %d", DEFAULT_REPLICATION_FACTOR, default, node,
                       len(live), " is" if len(live) == 1 else "s are", self.topic, factor)
        return factor, why


class KafkaPublisher(PublisherBase):
    """Sends records with kafka-python; creates the topic (compacted, 1
    partition, the cluster's default replication factor) the first time it
    reaches the cluster. After a failure the producer is dropped and the
    next publication connects afresh.

    ``config`` is kafka-python's (``client_config``); ``describe`` says in
    error messages where and as whom (``PublisherBase``)."""

    def _error(self, what, exc):
        name = type(exc).__name__
        detail = self._scrub(exc) or name
        if name not in detail:
            detail = "%s: %s" % (name, detail)
        cause = KAFKA_ERRORS.take()
        if cause and cause not in detail:
            detail += "; last connection error: %s" % self._scrub(cause)
        return PublishError("%s (%s): %s" % (what, self.describe, detail))

    def _remaining_ms(self, deadline):
        return max(100, int((deadline - time.monotonic()) * 1000))

    def publish(self, key, value):
        """Send one record (``key`` and ``value`` bytes); the RecordMetadata
        once acknowledged, else PublishError."""
        return self.publish_all([(key, value)])[0]

    def publish_all(self, records):
        """Send ``records`` ([(key, value)], bytes), all within ``timeout``;
        the RecordMetadata of each once every one is acknowledged, else
        PublishError (some may have been written)."""
        from kafka import errors as Errors

        deadline = time.monotonic() + self.timeout
        KAFKA_ERRORS.take()
        try:
            if self.producer is None:
                self.producer = self._producer(deadline)
            if not self.topic_ready:
                self._ensure_topic(deadline)
            futures = [self.producer.send(self.topic, key=key, value=value)
                       for key, value in records]
            self.producer.flush(timeout=self._remaining_ms(deadline) / 1000.0)
            return [f.get(timeout=self._remaining_ms(deadline) / 1000.0) for f in futures]
        except PublishError:
            self.reset()
            raise
        except Errors.KafkaTimeoutError as exc:
            self.reset()
            raise self._error("not published within %gs" % self.timeout, exc) from None
        except Exception as exc:  # kafka-python raises a variety, OSError included
            self.reset()
            raise self._error("publication failed", exc) from None

    def _producer(self, deadline):
        from kafka import KafkaProducer

        config = dict(self.config)
        config.update(bootstrap_timeout_ms=self._remaining_ms(deadline), acks="all",
                      enable_idempotence=False, linger_ms=0,
                      max_block_ms=int(self.timeout * 1000),
                      delivery_timeout_ms=int(self.timeout * 1000), retry_backoff_ms=200)
        return KafkaProducer(**config)

    def _ensure_topic(self, deadline):
        """Create the topic if it is missing: 1 partition, compacted, the
        replication factor that ``_replication_factor`` chooses. Both are
        always explicit: CreateTopics below v4 (Kafka < 2.4) has no "broker
        default" (-1, KIP-464). A cluster that refuses the config gets the
        topic without it; one that refuses to create it (ACLs, or anything
        else the broker names) is logged with the broker's error and the
        spec tried, and the produce decides."""
        from kafka import KafkaAdminClient

        config = dict(self.config)
        config["bootstrap_timeout_ms"] = self._remaining_ms(deadline)
        admin = KafkaAdminClient(**config)
        topic = self.topic
        try:
            if topic in admin.list_topics():
                self.topic_ready = True
                return
            factor, why = self._replication_factor(admin)
            spec = {"num_partitions": 1, "replication_factor": factor}
            first = self._create(admin, dict(spec, configs=dict(self.topic_configs)), deadline)
            second = None
            if self._retry_without_configs(first):
                second = self._create(admin, spec, deadline) if self.topic_configs else first
            self._topic_settled(factor, why, first, second)
        finally:
            try:
                admin.close()
            except Exception:
                pass

    def _create(self, admin, spec, deadline):
        """CreateTopics for this topic: None once created, else the broker's
        error as (kafka-python's class, "Name: message"). Retriable errors
        (the broker timed out, no controller) raise: the publication fails
        and the next one tries again."""
        from kafka import errors as Errors

        try:
            result = admin.create_topics({self.topic: spec}, raise_errors=False,
                                         timeout_ms=self._remaining_ms(deadline))
        except Errors.IncompatibleBrokerVersion as exc:  # no CreateTopics (Kafka < 0.10.1)
            return type(exc), self._scrub(_error_text(exc))
        for answer in result.get("topics", ()):
            if answer.get("name") == self.topic:
                return self._created(answer.get("error_code", -1), answer.get("error_message"))
        return Errors.UnknownError, "UnknownError: no answer for topic %s" % self.topic

    def _replication_factor(self, admin):
        """(factor, why): the cluster's default.replication.factor, read with
        DescribeConfigs from the controller (it applies its own default when
        it creates a topic), capped to the live brokers; min(3, live brokers)
        when it cannot be read, saying what was missing."""
        from kafka import errors as Errors
        from kafka.admin import ConfigResource, ConfigResourceType

        cluster = admin.describe_cluster()
        live = sorted(b["broker_id"] for b in cluster.get("brokers", ()) if not b.get("is_fenced"))
        node = cluster.get("controller_id")
        if node not in live:
            node = live[0] if live else node
        value, missing = None, None
        try:
            answer = admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, str(node))], config_filter="all")
        except Errors.KafkaTimeoutError:
            raise
        except Errors.KafkaError as exc:
            answer = None
            missing = "broker %s did not answer DescribeConfigs: %s" % (node, _error_text(exc))
            KAFKA_ERRORS.take()  # that connection's loss is told here, not later
        if answer is not None:
            entry = answer.get("broker", {}).get(str(node), {}).get(DEFAULT_REPLICATION_FACTOR)
            value = entry.get("value") if entry else None
        return self._chosen_factor(node, live, value, missing)

    def reset(self):
        """Drop the producer (and what it still holds); the next publication
        reconnects and checks the topic again."""
        producer, self.producer = self.producer, None
        self.topic_ready = False
        if producer is not None:
            try:
                producer.close(timeout=0)
            except Exception:
                pass

    close = reset
