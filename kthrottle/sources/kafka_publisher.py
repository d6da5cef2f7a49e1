"""A blocking kafka-python publisher of keyed records to one compacted topic.

What the volume agent (``kthrottle volume-agent``: per-broker volume usage)
and the proxy (``--proxy-id``: its usage reports for fleet-wide quotas) both
publish with. The topic is created on first contact, compacted
(cleanup.policy=compact), one partition, the cluster's default replication
factor; a cluster that refuses the config gets it without, one that refuses
to create topics (ACLs) is logged and the produce decides. A failed
publication raises PublishError with why (the last connection error
kafka-python logged, the password scrubbed), drops the producer, and the
next publication connects afresh. Each publication is bounded by ``timeout``
in all: connecting, creating the topic, the acknowledgement.

Blocking: call it from a thread of its own (the proxy does, never on its
event loop). kafka-python is imported on first use.
"""
import logging
import re
import time

log = logging.getLogger("kthrottle.publisher")

TOPIC_CONFIGS = {"cleanup.policy": "compact"}
DEFAULT_TIMEOUT = 10.0


class PublishError(Exception):
    pass


class _LastKafkaError(logging.Handler):
    """Keeps the last connection error kafka-python logged: it retries a
    refused connection or a failed authentication until its timeout, then
    says only "Unable to bootstrap", so the publisher tells why itself."""

    _AFTER = re.compile(r"(?:Connection lost|failed): (.*?)(?: \(backoff [0-9.]+ secs\))?$")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.last = None

    def emit(self, record):
        try:
            m = self._AFTER.search(record.getMessage())
        except Exception:
            return
        if m and "KafkaTimeoutError" not in m.group(1):  # the timeout itself: no news
            # kafka-python repeats the class name: "X: X: details"
            self.last = re.sub(r"(\w+Error): \1: ", r"\1: ", m.group(1))

    def take(self):
        last, self.last = self.last, None
        return last


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
                  sasl_password=None, timeout=DEFAULT_TIMEOUT):
    """kafka-python's connection and security settings (admin and producer).
    ``bootstrap_servers``: "host:port" strings or (host, port) pairs."""
    servers = []
    for s in bootstrap_servers:
        if not isinstance(s, str):
            host, port = s
            s = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)
        servers.append(s)
    timeout_ms = int(timeout * 1000)
    config = {"bootstrap_servers": servers,
              "client_id": client_id,
              "security_protocol": security_protocol,
              "request_timeout_ms": timeout_ms,
              "bootstrap_timeout_ms": timeout_ms,
              "reconnect_backoff_max_ms": 1000}
    if security_protocol in ("SSL", "SASL_SSL"):
        config.update(ssl_cafile=ssl_ca, ssl_certfile=ssl_cert, ssl_keyfile=ssl_key)
    if security_protocol.startswith("SASL_"):
        config.update(sasl_mechanism=sasl_mechanism, sasl_plain_username=sasl_username,
                      sasl_plain_password=sasl_password)
    return config


def describe_connection(bootstrap_servers, security_protocol="PLAINTEXT", sasl_mechanism=None,
                        sasl_username=None, ssl_cert=None):
    """One line for the log: where and as whom, never the password."""
    servers = [s if isinstance(s, str) else "%s:%d" % tuple(s) for s in bootstrap_servers]
    text = "%s over %s" % (",".join(servers), security_protocol)
    if security_protocol.startswith("SASL_"):
        text += " as %r with %s" % (sasl_username, sasl_mechanism)
    if ssl_cert:
        text += " with client certificate %s" % ssl_cert
    return text


class KafkaPublisher:
    """Sends records with kafka-python; creates the topic (compacted) the
    first time it reaches the cluster. After a failure the producer is
    dropped and the next publication connects afresh.

    ``config`` is kafka-python's (``client_config``); ``describe`` says in
    error messages where and as whom; ``secret`` (the SASL password) is
    scrubbed from every message; ``logger`` gets the topic creation lines."""

    def __init__(self, config, topic, timeout=DEFAULT_TIMEOUT, describe="", secret=None,
                 logger=None, topic_configs=None):
        self.config = dict(config)
        self.topic = topic
        self.timeout = timeout
        self.describe = describe or describe_connection(
            self.config.get("bootstrap_servers", ()), self.config.get("security_protocol",
                                                                      "PLAINTEXT"))
        self.secret = secret
        self.log = logger or log
        self.topic_configs = dict(TOPIC_CONFIGS if topic_configs is None else topic_configs)
        self.producer = None
        self.topic_ready = False

    def _scrub(self, text):
        text = str(text)
        return text.replace(self.secret, "***") if self.secret else text

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
        from kafka import errors as Errors

        deadline = time.monotonic() + self.timeout
        KAFKA_ERRORS.take()
        try:
            if self.producer is None:
                self.producer = self._producer(deadline)
            if not self.topic_ready:
                self._ensure_topic(deadline)
            future = self.producer.send(self.topic, key=key, value=value)
            return future.get(timeout=self._remaining_ms(deadline) / 1000.0)
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
        """Create the topic if it is missing: compacted, 1 partition, the
        cluster's default replication factor. A cluster that refuses the
        config gets the topic without it; one that refuses to create topics
        at all (ACLs) is logged and the produce decides."""
        from kafka import KafkaAdminClient
        from kafka import errors as Errors

        config = dict(self.config)
        config["bootstrap_timeout_ms"] = self._remaining_ms(deadline)
        admin = KafkaAdminClient(**config)
        topic = self.topic
        try:
            if topic in admin.list_topics():
                self.topic_ready = True
                return
            spec = {"num_partitions": 1, "replication_factor": -1}
            timeout_ms = self._remaining_ms(deadline)
            configs = ",".join("%s=%s" % kv for kv in sorted(self.topic_configs.items()))
            try:
                admin.create_topics({topic: dict(spec, configs=dict(self.topic_configs))},
                                    timeout_ms=timeout_ms)
                self.log.info("created topic %s (%s)", topic, configs)
            except Errors.TopicAlreadyExistsError:
                pass
            except Errors.AuthorizationError as exc:
                self.log.warning("not allowed to create topic %s (%s): publishing anyway; create "
                                 "it with %s", topic, type(exc).__name__, configs)
            except Errors.KafkaTimeoutError:
                raise
            except Errors.KafkaError as exc:
                self.log.warning("the cluster refused to create topic %s with %s (%s): creating "
                                 "it without configs; set them with kafka-configs --alter "
                                 "--add-config %s", topic, configs, self._scrub(exc), configs)
                try:
                    admin.create_topics({topic: spec}, timeout_ms=timeout_ms)
                    self.log.info("created topic %s (without %s)", topic, configs)
                except Errors.TopicAlreadyExistsError:
                    pass
            self.topic_ready = True
        finally:
            try:
                admin.close()
            except Exception:
                pass

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
