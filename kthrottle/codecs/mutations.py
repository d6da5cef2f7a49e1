"""The requests KIP-599's controller_mutation_rate counts: CreateTopics (19),
DeleteTopics (20) and CreatePartitions (37), read as plain values; the
proxy's own answer refusing one over its quota (THROTTLING_QUOTA_EXCEEDED
per topic, with throttle_time_ms); and the Metadata exchange that tells how
many partitions a topic has before it is deleted or grown.

Decoded and encoded with kafka-python's schema-generated classes (every
version, flexible ones included); malformed bytes become ProtocolError. No
kafka-python object leaves this module.
"""
import struct
import uuid
import warnings
from typing import NamedTuple

from .errors import THROTTLING_QUOTA_EXCEEDED, ProtocolError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import (
        CreatePartitionsRequest,
        CreatePartitionsResponse,
        CreateTopicsRequest,
        CreateTopicsResponse,
        DeleteTopicsRequest,
        DeleteTopicsResponse,
    )
    from kafka.protocol.metadata import MetadataRequest, MetadataResponse

CREATE_TOPICS = 19
DELETE_TOPICS = 20
CREATE_PARTITIONS = 37
MUTATION_APIS = (CREATE_TOPICS, DELETE_TOPICS, CREATE_PARTITIONS)

# KIP-599: from these versions a broker answers a request that comes while
# the quota is violated with THROTTLING_QUOTA_EXCEEDED (strict); older
# versions are accepted and the client is throttled (permissive).
STRICT_FROM = {CREATE_TOPICS: 6, DELETE_TOPICS: 5, CREATE_PARTITIONS: 3}

# Kafka's own message for the error (Errors.THROTTLING_QUOTA_EXCEEDED)
THROTTLED_MESSAGE = "The throttling quota has been exceeded."

_REQUESTS = {CREATE_TOPICS: CreateTopicsRequest, DELETE_TOPICS: DeleteTopicsRequest,
             CREATE_PARTITIONS: CreatePartitionsRequest}
_RESPONSES = {CREATE_TOPICS: CreateTopicsResponse, DELETE_TOPICS: DeleteTopicsResponse,
              CREATE_PARTITIONS: CreatePartitionsResponse}

# the versions the proxy reads (beyond them a request passes uncounted:
# the filter asks for nothing)
VERSIONS = {key: (max(cls.min_version, _RESPONSES[key].min_version),
                  min(cls.max_version, _RESPONSES[key].max_version))
            for key, cls in _REQUESTS.items()}

# Metadata versions the proxy asks partition counts with: v4 has
# allow_auto_topic_creation (a lookup must not create a topic) and every
# broker since Kafka 1.0 answers it; topic ids need v10 (Kafka 2.8, the first
# with DeleteTopics by id).
METADATA_BY_NAME = 4
METADATA_BY_ID = 10

_DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, AttributeError,
                  UnicodeDecodeError, KeyError)

_ZERO_UUID = uuid.UUID(int=0)


class TopicMutation(NamedTuple):
    """One topic of a mutation request."""

    name: str | None  # None: named by id (DeleteTopics v6)
    topic_id: uuid.UUID | None
    # partitions the request mutates, when the request itself says so;
    # None when only the broker knows (a default partition count, the
    # current count of a topic being deleted or grown)
    partitions: int | None
    # CreatePartitions: the new total count (the current one is subtracted)
    new_total: int = -1


class Mutation(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    topics: tuple  # TopicMutation, ...
    validate_only: bool

    @property
    def strict(self):
        return self.api_version >= STRICT_FROM[self.api_key]


def decode_mutation(frame):
    """A framed CreateTopics, DeleteTopics or CreatePartitions request ->
    Mutation. ProtocolError when it does not decode."""
    if len(frame) < 12:
        raise ProtocolError("truncated request header")
    api_key, api_version = struct.unpack_from(">hh", frame, 4)
    cls = _REQUESTS.get(api_key)
    if cls is None:
        raise ProtocolError("api key %d is not a controller mutation" % api_key)
    name = cls.__name__
    try:
        request = cls[api_version].decode(bytes(frame[4:]), header=True)
        correlation_id = request.header.correlation_id
        if api_key == CREATE_TOPICS:
            topics = tuple(_created(t) for t in _list(request.topics))
            validate_only = bool(request.validate_only) if api_version >= 1 else False
        elif api_key == DELETE_TOPICS:
            if api_version >= 6:
                topics = tuple(
                    TopicMutation(t.name, None if t.name is not None or t.topic_id == _ZERO_UUID
                                  else t.topic_id, None)
                    for t in _list(request.topics))
            else:
                topics = tuple(TopicMutation(_text(n), None, None)
                               for n in _list(request.topic_names))
            validate_only = False
        else:
            topics = tuple(_grown(t) for t in _list(request.topics))
            validate_only = bool(request.validate_only)
    except ProtocolError as exc:
        raise ProtocolError("malformed %s v%d: %s" % (name, api_version, exc)) from None
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed %s v%d: %s" % (name, api_version, exc)) from None
    return Mutation(api_key, api_version, correlation_id, topics, validate_only)


def _created(topic):
    name = _text(topic.name)
    assignments = topic.assignments or ()
    if assignments:  # a manual assignment: one entry per partition
        return TopicMutation(name, None, len(assignments))
    if topic.num_partitions > 0:
        return TopicMutation(name, None, int(topic.num_partitions))
    return TopicMutation(name, None, None)  # -1: the broker's num.partitions


def _grown(topic):
    name = _text(topic.name)
    count = int(topic.count)
    if topic.assignments:  # one entry per new partition
        return TopicMutation(name, None, len(topic.assignments), count)
    return TopicMutation(name, None, None, count)


def _text(value):
    if not isinstance(value, str):
        raise ProtocolError("a null topic name")
    return value


def _list(items):
    if items is None:
        raise ProtocolError("a null array")
    return items


def throttled_response(mutation, throttle_ms, message=THROTTLED_MESSAGE):
    """The broker's answer to a strict mutation request refused over its
    quota (KIP-599): every topic THROTTLING_QUOTA_EXCEEDED, throttle_time_ms
    set; framed, with the request's correlation id."""
    api_key, version = mutation.api_key, mutation.api_version
    cls = _RESPONSES[api_key][version]
    if api_key == CREATE_TOPICS:
        result = cls.CreatableTopicResult
        body = cls(throttle_time_ms=throttle_ms, topics=[
            result(name=t.name, error_code=THROTTLING_QUOTA_EXCEEDED, error_message=message)
            for t in mutation.topics])
    elif api_key == DELETE_TOPICS:
        result = cls.DeletableTopicResult
        body = cls(throttle_time_ms=throttle_ms, responses=[
            result(name=t.name, topic_id=t.topic_id, error_code=THROTTLING_QUOTA_EXCEEDED,
                   error_message=message)
            for t in mutation.topics])
    else:
        result = cls.CreatePartitionsTopicResult
        body = cls(throttle_time_ms=throttle_ms, results=[
            result(name=t.name, error_code=THROTTLING_QUOTA_EXCEEDED, error_message=message)
            for t in mutation.topics])
    body.with_header(correlation_id=mutation.correlation_id)
    return bytes(body.encode(header=True, framed=True))


def created_partitions(frame, api_version):
    """A framed CreateTopics response (v5+, which says num_partitions) ->
    {topic: partitions} of the topics it created. ProtocolError when it
    does not decode."""
    try:
        response = CreateTopicsResponse[api_version].decode(bytes(frame[4:]), header=True)
        return {t.name: int(t.num_partitions) for t in _list(response.topics)
                if t.error_code == 0 and t.num_partitions > 0}
    except ProtocolError as exc:
        raise ProtocolError("malformed CreateTopics response: %s" % exc) from None
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed CreateTopics response: %s" % exc) from None


def metadata_request(topics):
    """A framed Metadata request for the partition counts of ``topics``
    (TopicMutation, ...) that never creates one; its correlation id is left
    to the caller. -> (frame, version)."""
    by_id = any(t.name is None for t in topics)
    version = METADATA_BY_ID if by_id else METADATA_BY_NAME
    cls = MetadataRequest[version]
    wanted = [cls.MetadataRequestTopic(name=t.name, topic_id=t.topic_id) if by_id
              else cls.MetadataRequestTopic(name=t.name) for t in topics]
    request = cls(topics=wanted, allow_auto_topic_creation=False)
    if version >= 8:
        request.include_topic_authorized_operations = False
    request.with_header(correlation_id=0, client_id="kthrottle")
    return bytes(request.encode(header=True, framed=True)), version


def partition_counts(frame, version):
    """A framed Metadata response -> {topic name: partitions} and {topic
    id: partitions} of the topics it knows (error_code 0)."""
    try:
        response = MetadataResponse[version].decode(bytes(frame[4:]), header=True)
        by_name, by_id = {}, {}
        for t in _list(response.topics):
            if t.error_code != 0:
                continue
            count = len(t.partitions or ())
            if t.name is not None:
                by_name[t.name] = count
            topic_id = getattr(t, "topic_id", None)
            if topic_id is not None and topic_id != _ZERO_UUID:
                by_id[topic_id] = count
        return by_name, by_id
    except ProtocolError as exc:
        raise ProtocolError("malformed Metadata response: %s" % exc) from None
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed Metadata response: %s" % exc) from None
