"""What Kafka authorizes in each client request, and the answers a broker
gives a request it refuses.

Kafka's broker checks every request against its authorizer before it acts:
which operation on which resource each API needs is Kafka's table
("Operations and Resources on Protocols", in its security documentation).
``TOPIC_LISTS`` says where each topic-list API keeps its topics, in the
request and in the answer; ``decode``/``encode`` read and write a request
with kafka-python's schema-built classes; ``refused_topic_entries`` builds
the entries a broker answers for topics it refuses, and
``fetch_topic_entries``/``add_fetch_topics`` put them into a Fetch answer
without decoding its records; ``fetch_request_topics`` reads a Fetch
request's topics straight from the frame.

Codes are Kafka's (``ResourceType``, ``Operation`` in ``policy/acls.py``).
"""
import struct
import uuid
import warnings
from typing import NamedTuple

from ._kafka import decode_framed, framed_request, framed_response
from .errors import ProtocolError
from .wire import INT32, read_array_length, read_string, skip_tagged_fields, write_uvarint

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import importlib
    import pkgutil

    import kafka.protocol as _protocol

TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID = 2, 3, 4, 5
READ, WRITE, CREATE, DELETE, ALTER, DESCRIBE = 3, 4, 5, 6, 7, 8
CLUSTER_ACTION, DESCRIBE_CONFIGS, ALTER_CONFIGS, IDEMPOTENT_WRITE = 9, 10, 11, 12
CLUSTER_NAME = "kafka-cluster"

# Kafka's error codes for a refusal
TOPIC_AUTHORIZATION_FAILED = 29
GROUP_AUTHORIZATION_FAILED = 30
CLUSTER_AUTHORIZATION_FAILED = 31
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
UNKNOWN_TOPIC_ID = 100
ERROR_FOR = {TOPIC: TOPIC_AUTHORIZATION_FAILED, GROUP: GROUP_AUTHORIZATION_FAILED,
             CLUSTER: CLUSTER_AUTHORIZATION_FAILED,
             TRANSACTIONAL_ID: TRANSACTIONAL_ID_AUTHORIZATION_FAILED}
NO_TOPIC_ID = uuid.UUID(int=0)


def _classes():
    """{(api key, is request): kafka-python class} of every API it describes."""
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(_protocol.__path__, "kafka.protocol."):
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 (a module needing an optional dependency)
                continue
            for name, obj in vars(module).items():
                key = getattr(obj, "API_KEY", None)
                if isinstance(key, int) and getattr(obj, "max_version", None) is not None \
                        and name.endswith(("Request", "Response")):
                    found.setdefault((key, name.endswith("Request")), obj)
    return found


_CLASSES = _classes()


def request_class(api_key):
    return _CLASSES.get((api_key, True))


def response_class(api_key):
    return _CLASSES.get((api_key, False))


class TopicList(NamedTuple):
    """Where a topic-list API keeps its topics, in the request and in the
    response: the array field, the topic's name (and id) field, the
    partitions array and a partition's index field (None: the partitions are
    plain ints, or the response has none), and the error field."""

    operation: int
    req_topics: str
    req_name: str
    req_parts: str
    req_index: object
    resp_topics: str
    resp_name: str
    resp_parts: object
    resp_index: object
    resp_error: str = "error_code"


def _usual(operation):
    """The usual layout, alike in request and response: ``topics``, each a
    ``name`` and ``partitions``, each with a ``partition_index``."""
    return TopicList(operation, "topics", "name", "partitions", "partition_index",
                     "topics", "name", "partitions", "partition_index")


TOPIC_LISTS = {
    0: TopicList(WRITE, "topic_data", "name", "partition_data", "index",
                 "responses", "name", "partition_responses", "index"),
    1: TopicList(READ, "topics", "topic", "partitions", "partition",
                 "responses", "topic", "partitions", "partition_index"),
    2: _usual(DESCRIBE),
    8: _usual(READ),
    21: _usual(DELETE),
    23: TopicList(DESCRIBE, "topics", "topic", "partitions", "partition",
                  "topics", "topic", "partitions", "partition"),
    28: _usual(READ),
    47: _usual(READ),
    61: TopicList(READ, "topics", "name", "partition_indexes", None,
                  "topics", "name", "partitions", "partition_index"),
    19: TopicList(CREATE, "topics", "name", None, None, "topics", "name", None, None),
    20: TopicList(DELETE, "topics", "name", None, None, "responses", "name", None, None),
    37: TopicList(ALTER, "topics", "name", None, None, "results", "name", None, None),
}


def decode(api_key, api_version, frame):
    """The framed request as kafka-python's object; ProtocolError if it does not decode."""
    cls = request_class(api_key)
    if cls is None:
        raise ProtocolError("api key %d cannot be decoded" % api_key)
    return decode_framed(cls, api_version, frame, "%s v%d" % (cls.__name__, api_version))


encode = framed_request  # (request, correlation_id, client_id): framed again, with its header


def topic_key(entry, spec, names):
    """A request topic entry's name, or its id named through ``names`` (None:
    an id the proxy does not know)."""
    name = getattr(entry, spec.req_name, None)
    if name:
        return name
    topic_id = getattr(entry, "topic_id", None)
    if topic_id is not None and topic_id != NO_TOPIC_ID:
        return names.get(topic_id)
    return name


# what a broker says of offsets in a partition it refuses: none (-1)
_INVALID_OFFSETS = {"base_offset": -1, "high_watermark": -1, "last_stable_offset": -1,
                    "log_start_offset": -1, "offset": -1, "low_watermark": -1,
                    "end_offset": -1, "committed_offset": -1}


def _entry_class(parent_cls, field_name):
    return parent_cls.fields[field_name].data_class


def refused_topic_entries(api_key, version, request, refused, errors):
    """Response topic entries for the request's topic entries in ``refused``
    (a list of request entries), each partition (or the topic) with
    ``errors[i]``: Kafka's answer for a topic it refuses."""
    spec = TOPIC_LISTS[api_key]
    response = response_class(api_key)[version]
    topic_cls = _entry_class(response, spec.resp_topics)
    out = []
    for entry, error in zip(refused, errors):
        fields = {}
        name = getattr(entry, spec.req_name, None)
        if spec.resp_name in topic_cls.fields:
            fields[spec.resp_name] = name
        if "topic_id" in topic_cls.fields:
            fields["topic_id"] = getattr(entry, "topic_id", None) or NO_TOPIC_ID
        if spec.resp_parts is None:
            fields[spec.resp_error] = error
            if "error_message" in topic_cls.fields:
                fields["error_message"] = None
        else:
            part_cls = _entry_class(topic_cls, spec.resp_parts)
            parts = getattr(entry, spec.req_parts, None) or []
            indexes = [p if spec.req_index is None else getattr(p, spec.req_index)
                       for p in parts]
            extra = {k: v for k, v in _INVALID_OFFSETS.items() if k in part_cls.fields}
            fields[spec.resp_parts] = [part_cls(**{spec.resp_index: i, spec.resp_error: error},
                                                **extra) for i in indexes]
        out.append(topic_cls(**fields))
    return out


def response_for(api_key, version, correlation_id, **fields):
    return framed_response(response_class(api_key)[version](**fields), correlation_id)


def decode_response(api_key, version, frame):
    return decode_framed(response_class(api_key), version, frame,
                         "response v%d of api key %d" % (version, api_key))


encode_response = framed_response  # (response, correlation_id)


def has_field(api_key, version, name):
    cls = response_class(api_key)
    return cls is not None and name in cls[version].fields


def fetch_request_topics(frame, body, version):
    """The topics a whole framed Fetch request names (FetchRequest.json, v4-17),
    read straight from the frame from ``body`` (the body's offset): names, or
    uuid.UUID topic ids from v13. ProtocolError when it is malformed."""
    if version < 4:
        raise ProtocolError("Fetch v%d is not read here" % version)
    pos = body + (12 if version >= 15 else 16)  # [replica_id,] max_wait, min_bytes, max_bytes
    pos += 1  # isolation_level
    if version >= 7:
        pos += 8  # session_id, session_epoch
    compact = version >= 12
    topics = []
    try:
        count, pos = read_array_length(frame, pos, compact)
        for _ in range(max(count, 0)):
            if version >= 13:
                topics.append(uuid.UUID(bytes=bytes(frame[pos:pos + 16])))
                pos += 16
            else:
                name, pos = read_string(frame, pos, compact)
                topics.append(name)
            partitions, pos = read_array_length(frame, pos, compact)
            each = (4 + (4 if version >= 9 else 0) + 8 + (4 if version >= 12 else 0)
                    + (8 if version >= 5 else 0) + 4)
            for _ in range(max(partitions, 0)):
                pos += each
                if compact:
                    pos = skip_tagged_fields(frame, pos)
            if compact:
                pos = skip_tagged_fields(frame, pos)
    except (IndexError, ValueError, struct.error):
        raise ProtocolError("truncated Fetch request") from None
    if pos > len(frame):
        raise ProtocolError("truncated Fetch request")
    return topics


def _fetch_topics_at(frame, version):
    """Where a framed Fetch response's topic array starts (FetchResponse.json):
    after the header, throttle_time_ms (v1+), error_code and session_id (v7+)."""
    pos = 8
    if version >= 12:
        pos = skip_tagged_fields(frame, pos)  # the response header's
    if version >= 1:
        pos += 4
    if version >= 7:
        pos += 6
    return pos


def fetch_topic_entries(version, entries):
    """(count, bytes) of Fetch response topic entries (from
    refused_topic_entries) as they are written in a response's array, for
    ``add_fetch_topics``."""
    frame = response_for(1, version, 0, responses=entries, error_code=0, session_id=0)
    compact = version >= 12
    count, pos = read_array_length(frame, _fetch_topics_at(frame, version), compact)
    end = len(frame) - 1 if compact else len(frame)  # the body's (empty) tagged fields
    return count, bytes(frame[pos:end])


def add_fetch_topics(frame, version, added):
    """The framed Fetch response with the topic entries ``added``
    (fetch_topic_entries) put first in its array; the broker's bytes, records
    and all, are copied once and not decoded."""
    count_added, entries = added
    compact = version >= 12
    try:
        at = _fetch_topics_at(frame, version)
        count, pos = read_array_length(frame, at, compact)
    except (IndexError, ValueError, struct.error):
        raise ProtocolError("truncated Fetch response") from None
    if pos > len(frame):
        raise ProtocolError("truncated Fetch response")
    total = max(count, 0) + count_added
    head = write_uvarint(total + 1) if compact else INT32.pack(total)
    view = memoryview(frame)
    body = b"".join((view[4:at], head, entries, view[pos:]))
    return INT32.pack(len(body)) + body
