"""The share-group offset APIs (KIP-932), which kafka-python has no classes for:
DescribeShareGroupOffsets (90) v0-1, AlterShareGroupOffsets (91) v0 and
DeleteShareGroupOffsets (92) v0, the versions Apache Kafka 4.4 offers. Their layouts are in
``codecs/schemas/``, read by kafka-python's schema machinery, so a request or an answer is
decoded, changed and encoded like any other.

What Kafka 4.4's broker answers for what it refuses (KafkaApis), which the functions here
build:

- DescribeShareGroupOffsets: DESCRIBE on each group, a refused one answered in its place with
  GROUP_AUTHORIZATION_FAILED (no message, no topics); DESCRIBE on each topic a group names, a
  refused one answered after the group's others with TOPIC_AUTHORIZATION_FAILED and its
  standard message on each partition (StartOffset -1, TopicId zero), unless the group's answer
  carries an error; a group naming no topics (null) gets only the topics the principal may
  describe.
- AlterShareGroupOffsets: READ on the group (a top-level error), READ on each topic; a refused
  topic is answered first, each partition with TOPIC_AUTHORIZATION_FAILED and its message, and
  the topic's id where the broker knows it.
- DeleteShareGroupOffsets: DELETE on the group, READ on each topic; a refused topic is answered
  first, with TOPIC_AUTHORIZATION_FAILED and its message (TopicId zero).

In Alter and Delete, a top-level error in the coordinator's answer is the whole answer.
"""
import types
import uuid
import warnings

from . import schemas
from ._kafka import decode_framed, framed_request, framed_response

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.api_message import ApiMessage

DESCRIBE_OFFSETS, ALTER_OFFSETS, DELETE_OFFSETS = 90, 91, 92
KEYS = (DESCRIBE_OFFSETS, ALTER_OFFSETS, DELETE_OFFSETS)
NO_TOPIC_ID = uuid.UUID(int=0)
# Java's Errors.message() of the refusals
MESSAGES = {29: "Topic authorization failed.", 30: "Group authorization failed."}


def _messages(name):
    """The request and the response class of the API ``name``, their layouts
    read from ``schemas/<name>Request.json`` and ``<name>Response.json``."""
    return tuple(types.new_class(name + kind, (ApiMessage,), {"load_json": schemas},
                                 lambda ns: ns.update(__module__=__name__))
                 for kind in ("Request", "Response"))


DescribeShareGroupOffsetsRequest, DescribeShareGroupOffsetsResponse = _messages(
    "DescribeShareGroupOffsets")
AlterShareGroupOffsetsRequest, AlterShareGroupOffsetsResponse = _messages(
    "AlterShareGroupOffsets")
DeleteShareGroupOffsetsRequest, DeleteShareGroupOffsetsResponse = _messages(
    "DeleteShareGroupOffsets")

REQUESTS = {90: DescribeShareGroupOffsetsRequest, 91: AlterShareGroupOffsetsRequest,
            92: DeleteShareGroupOffsetsRequest}
RESPONSES = {90: DescribeShareGroupOffsetsResponse, 91: AlterShareGroupOffsetsResponse,
             92: DeleteShareGroupOffsetsResponse}


def _cls(table, api_key, api_version):
    """The class of ``api_key`` in ``table``; ValueError unless it has ``api_version``."""
    cls = table.get(api_key)
    if cls is None or not 0 <= api_version <= cls.max_version:
        raise ValueError("no layout for API key %r version %r" % (api_key, api_version))
    return cls


def _decode(table, api_key, api_version, frame):
    cls = _cls(table, api_key, api_version)
    return decode_framed(cls, api_version, frame,
                         "%s v%d" % (cls[api_version].__name__, api_version))


def decode_request(api_key, api_version, frame):
    """A whole framed request (size, header v2, body) as an object; ProtocolError when it does
    not decode, ValueError for a key or version not covered."""
    return _decode(REQUESTS, api_key, api_version, frame)


def decode_response(api_key, api_version, frame):
    return _decode(RESPONSES, api_key, api_version, frame)


encode_request = framed_request  # (request, correlation_id, client_id)
encode_response = framed_response  # (response, correlation_id)


def response(api_key, api_version, correlation_id, **fields):
    """A whole framed answer: ThrottleTimeMs 0, ``fields``, the rest at their defaults."""
    return framed_response(_cls(RESPONSES, api_key, api_version)[api_version](**fields),
                           correlation_id)


def refused_group(api_version, group_id, error_code):
    """A DescribeShareGroupOffsets answer's entry for a group refused: ``error_code``, no
    message, no topics."""
    group_cls = DescribeShareGroupOffsetsResponse[api_version].DescribeShareGroupOffsetsResponseGroup
    return group_cls(group_id=group_id, topics=[], error_code=error_code, error_message=None)


def refused_described_topic(api_version, topic, error_code):
    """A DescribeShareGroupOffsets answer's topic entry for a request topic entry refused."""
    cls = DescribeShareGroupOffsetsResponse[api_version]
    topic_cls = cls.DescribeShareGroupOffsetsResponseGroup.DescribeShareGroupOffsetsResponseTopic
    part_cls = topic_cls.DescribeShareGroupOffsetsResponsePartition
    extra = {"lag": -1} if api_version >= 1 else {}
    return topic_cls(topic_name=topic.topic_name, topic_id=NO_TOPIC_ID, partitions=[
        part_cls(partition_index=p, start_offset=-1, leader_epoch=0, error_code=error_code,
                 error_message=MESSAGES.get(error_code), **extra)
        for p in topic.partitions or []])


def refused_altered_topic(topic, topic_id, error_code):
    """An AlterShareGroupOffsets answer's entry for a request topic entry refused; ``topic_id``
    the topic's id where known (else zero)."""
    topic_cls = AlterShareGroupOffsetsResponse[0].AlterShareGroupOffsetsResponseTopic
    part_cls = topic_cls.AlterShareGroupOffsetsResponsePartition
    return topic_cls(topic_name=topic.topic_name, topic_id=topic_id or NO_TOPIC_ID, partitions=[
        part_cls(partition_index=p.partition_index, error_code=error_code,
                 error_message=MESSAGES.get(error_code)) for p in topic.partitions or []])


def refused_altered_topics(topics, topic_ids, error_code):
    """AlterShareGroupOffsets answer entries for the request topic entries ``topics``, all
    refused, as Kafka's answer builder makes them: one entry per topic name with every
    partition the request names for it, none for a topic named without partitions;
    ``topic_ids``: name -> id, for the ids known."""
    merged = {}
    for topic in topics:
        partitions = list(topic.partitions or [])
        if topic.topic_name in merged:
            merged[topic.topic_name] += partitions
        elif partitions:
            merged[topic.topic_name] = partitions
    cls = AlterShareGroupOffsetsRequest[0].AlterShareGroupOffsetsRequestTopic
    return [refused_altered_topic(cls(topic_name=name, partitions=partitions),
                                  topic_ids.get(name), error_code)
            for name, partitions in merged.items()]


def refused_deleted_topic(topic, error_code):
    """A DeleteShareGroupOffsets answer's entry for a request topic entry refused."""
    topic_cls = DeleteShareGroupOffsetsResponse[0].DeleteShareGroupOffsetsResponseTopic
    return topic_cls(topic_name=topic.topic_name, topic_id=NO_TOPIC_ID, error_code=error_code,
                     error_message=MESSAGES.get(error_code))
