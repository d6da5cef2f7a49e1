"""Realistic multi-broker Kafka frames, built with kafka-python's schema-generated
classes, for codec tests that need no network."""
import uuid
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import DescribeClusterResponse
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.metadata import ApiVersionsResponse, FindCoordinatorResponse, MetadataResponse
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

from kthrottle.codecs.apis import response_header_is_flexible

BROKERS = [(1, "kafka-1.internal.example", 9092, "rack-a"),
           (2, "kafka-2.internal.example", 9093, "rack-b"),
           (3, "kafka-3.internal.example", 19094, None)]
PROXY_HOST = "proxy.example"


def advertise(node_id):
    return PROXY_HOST, 30000 + node_id


def frame_response(api_key, version, body, correlation_id=42):
    header = correlation_id.to_bytes(4, "big", signed=True)
    if response_header_is_flexible(api_key, version):
        header += b"\x00"
    payload = header + bytes(body)
    return len(payload).to_bytes(4, "big") + payload


def _brokers(cls, addresses, id_name="node_id"):
    return [cls(**{id_name: n, "host": h, "port": p, "rack": r}) for n, h, p, r in addresses]


def proxied(addresses):
    return [(n, *advertise(n), r) for n, _h, _p, r in addresses]


def metadata(version, addresses=BROKERS):
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    topics = [T(error_code=0, name="orders", topic_id=uuid.UUID(int=7), is_internal=False,
                partitions=[P(error_code=0, partition_index=i, leader_id=i + 1, leader_epoch=3,
                              replica_nodes=[1, 2, 3], isr_nodes=[1, 2, 3], offline_replicas=[])
                            for i in range(3)],
)]
    return M[version](throttle_time_ms=5, brokers=_brokers(M.MetadataResponseBroker, addresses),
                      cluster_id="cluster-x", controller_id=2, topics=topics,
                      error_code=0).encode()


def find_coordinator(version, addresses=BROKERS, error_code=0):
    F = FindCoordinatorResponse
    n, h, p, _ = addresses[1]
    if version < 4:
        if error_code:
            n, h, p = -1, "", -1
        return F[version](throttle_time_ms=0, error_code=error_code, error_message=None,
                          node_id=n, host=h, port=p).encode()
    coordinators = [F.Coordinator(key="group-%d" % i, node_id=a[0], host=a[1], port=a[2],
                                  error_code=0, error_message=None)
                    for i, a in enumerate(addresses)]
    if error_code:
        coordinators.append(F.Coordinator(key="bad", node_id=-1, host="", port=-1,
                                          error_code=error_code, error_message="not available"))
    return F[version](throttle_time_ms=0, coordinators=coordinators).encode()


def describe_cluster(version, addresses=BROKERS):
    D = DescribeClusterResponse
    brokers = [D.DescribeClusterBroker(broker_id=n, host=h, port=p, rack=r, is_fenced=False)
               for n, h, p, r in addresses]
    return D[version](throttle_time_ms=0, error_code=0, error_message=None, endpoint_type=1,
                      cluster_id="cluster-x", controller_id=1, brokers=brokers).encode()


def produce(version, addresses=BROKERS, with_endpoints=True):
    R = ProduceResponse
    T = R.TopicProduceResponse
    P = T.PartitionProduceResponse
    topics = [T(name="orders", topic_id=uuid.UUID(int=7),
                partition_responses=[P(index=i, error_code=6 if i == 1 else 0, base_offset=100 * i,
                                       log_append_time_ms=-1, log_start_offset=0,
                                       record_errors=[], error_message=None)
                                     for i in range(3)])]
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return R[version](responses=topics, throttle_time_ms=0, node_endpoints=endpoints).encode()


def fetch(version, addresses=BROKERS, with_endpoints=True, records=b"\x00" * 300):
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    parts = [P(partition_index=i, error_code=0, high_watermark=10, last_stable_offset=10,
               log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
               records=records if i != 1 else None)
             for i in range(3)]
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return R[version](throttle_time_ms=0, error_code=0, session_id=9,
                      responses=[T(topic="orders", topic_id=uuid.UUID(int=7), partitions=parts)],
                      node_endpoints=endpoints).encode()


def api_versions(version, ranges):
    A = ApiVersionsResponse
    return A[version](error_code=0,
                      api_keys=[A.ApiVersion(api_key=k, min_version=lo, max_version=hi)
                                for k, lo, hi in ranges],
                      throttle_time_ms=0).encode()


def produce_request(version, acks, transactional_id=None, client_id="app-1"):
    R = ProduceRequest
    D = R.TopicProduceData
    req = R[version](transactional_id=transactional_id, acks=acks, timeout_ms=30000,
                     topic_data=[D(name="orders", topic_id=uuid.UUID(int=7),
                                   partition_data=[D.PartitionProduceData(index=0, records=b"x" * 70)])])
    req.with_header(correlation_id=11, client_id=client_id)
    return req.encode(header=True, framed=True)


# -- KIP-951 responses for the stream rewriter (tests/test_stream_rewrite.py) --

import random as _random  # noqa: E402


from kthrottle.codecs.wire import write_uvarint as _uvarint  # noqa: E402


def tagged_field(tag, value):
    """One raw tagged field (KIP-482): tag, size, value."""
    return _uvarint(tag) + _uvarint(len(value)) + value


# A partition's snapshot_id as kafka-python encodes it in the partition's tag
# section (count 1, tag 2, 13 bytes: end_offset, epoch, empty tags); the
# builders below splice unknown tags in after it.
SNAPSHOT_END_OFFSET, SNAPSHOT_EPOCH = 0x0102030405060708, 0x0A0B0C0D
_SNAPSHOT_TAGS = (b"\x01\x02\x0d" + SNAPSHOT_END_OFFSET.to_bytes(8, "big")
                  + SNAPSHOT_EPOCH.to_bytes(4, "big") + b"\x00")


def with_partition_unknown_tag(body, tag=9, value=b"\xde\xad"):
    """``body`` with one more (unknown) tag in each partition tag section that
    holds only the snapshot_id built by fetch_many (a newer broker's field)."""
    assert _SNAPSHOT_TAGS in body
    return body.replace(_SNAPSHOT_TAGS, b"\x02" + _SNAPSHOT_TAGS[1:] + tagged_field(tag, value))


def with_top_level_tags(body_without, body_with, extra):
    """The response ``body_with`` (NodeEndpoints present) or ``body_without``
    (absent; pass body_with=None) with its top-level tag section replaced by
    its own fields plus the raw ``extra`` ones {tag: value}, in tag order."""
    prefix = bytes(body_without)[:-1]
    assert bytes(body_without)[-1] == 0  # no top-level tags
    fields = dict(extra)
    if body_with is not None:
        body_with = bytes(body_with)
        assert body_with.startswith(prefix) and body_with[len(prefix)] == 1
        fields[0] = None
    section = _uvarint(len(fields))
    for tag in sorted(fields):
        section += body_with[len(prefix) + 1:] if tag == 0 else tagged_field(tag, fields[tag])
    return prefix + section


def fetch_many(version, addresses=BROKERS, with_endpoints=True, seed=0):
    """A Fetch v12+ answer from one of 3 brokers as a consumer sees it: three
    topics, partitions with records of many sizes (1-, 2- and 3-byte length
    varints, empty, null), aborted transactions, a NOT_LEADER_OR_FOLLOWER
    partition naming its current leader, diverging_epoch and snapshot_id tags."""
    rng = _random.Random(seed)
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    sizes = [700, 0, None, 60, 20000, 3000, 90000, 1, 127, 128]
    topics = []
    for t in range(3):
        parts = []
        for i in range(3 + t):
            size = sizes[(t * 4 + i) % len(sizes)]
            kw = {}
            if i == 1:
                kw["aborted_transactions"] = [
                    P.AbortedTransaction(producer_id=1000 + k, first_offset=k * 7) for k in range(t + 1)]
            elif i == 2:
                kw["aborted_transactions"] = None  # nullable: null
            if (t, i) == (1, 0):  # moved: the client is told where to (KIP-951)
                kw["error_code"] = 6
                kw["current_leader"] = P.LeaderIdAndEpoch(leader_id=addresses[2][0], leader_epoch=12)
                size = None
            if (t, i) == (0, 2):
                kw["diverging_epoch"] = P.EpochEndOffset(epoch=4, end_offset=77)
            if i == 0 and t != 1:
                kw["snapshot_id"] = P.SnapshotId(end_offset=SNAPSHOT_END_OFFSET, epoch=SNAPSHOT_EPOCH)
            parts.append(P(**{"partition_index": i, "error_code": 0, "high_watermark": 5000 + i,
                              "last_stable_offset": 4000 + i, "log_start_offset": i,
                              "aborted_transactions": [], "preferred_read_replica": -1,
                              "records": None if size is None else rng.randbytes(size), **kw}))
        topics.append(T(topic="topic-%d" % t, topic_id=uuid.UUID(int=100 + t), partitions=parts))
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return bytes(R[version](throttle_time_ms=25, error_code=0, session_id=123456,
                            responses=topics, node_endpoints=endpoints).encode())


def produce_many(version, addresses=BROKERS, with_endpoints=True):
    """A Produce v10+ answer: two topics, record errors with messages, error
    messages and a NOT_LEADER_OR_FOLLOWER partition naming its current leader."""
    R = ProduceResponse
    T = R.TopicProduceResponse
    P = T.PartitionProduceResponse
    topics = []
    for t in range(2):
        parts = []
        for i in range(3):
            kw = {}
            if i == 1:
                kw = {"error_code": 6, "error_message": "not leader",
                      "current_leader": P.LeaderIdAndEpoch(leader_id=addresses[i][0], leader_epoch=8)}
            elif i == 2:
                kw = {"error_code": 87, "error_message": "invalid record",
                      "record_errors": [
                          P.BatchIndexAndErrorMessage(batch_index=3, batch_index_error_message="bad"),
                          P.BatchIndexAndErrorMessage(batch_index=5, batch_index_error_message=None)]}
            parts.append(P(**{"index": i, "error_code": 0, "base_offset": 100 * i,
                              "log_append_time_ms": -1, "log_start_offset": 0, "record_errors": [],
                              "error_message": None, **kw}))
        topics.append(T(name="topic-%d" % t, topic_id=uuid.UUID(int=100 + t), partition_responses=parts))
    endpoints = _brokers(R.NodeEndpoint, addresses) if with_endpoints else []
    return bytes(R[version](responses=topics, throttle_time_ms=30, node_endpoints=endpoints).encode())


# -- any response, filled generically from its schema (tests/test_throttle_codec.py) --

# One value per schema type: short, non-empty, distinct from the throttle
# values the tests look for.
_SAMPLE = {
    "int8": 3, "int16": 7, "uint16": 7, "int32": 7, "int64": 7, "float64": 1.5,
    "bool": True, "uuid": uuid.UUID(int=0x5EED), "string": "s1",
    "bytes": b"\x01\x02", "records": b"rec",
}


def _sample(field, name_values):
    if field.name in name_values:
        return name_values[field.name]
    if field.name == "error_code":
        return 0  # ApiVersions reads a non-zero one as "v0 body follows" (KIP-511)
    if field.type_str == "bitfield":  # kafka-python's authorized-operations sets
        return {2, 3}
    if field.type_str not in _SAMPLE:
        raise TypeError("no sample value for %s of type %s" % (field.name, field.type_str))
    return _SAMPLE[field.type_str]


def _fill(data_class, version, name_values, repeat=1):
    """Field values for ``data_class`` (a kafka-python DataContainer class):
    those of ``version``, arrays of ``repeat`` elements (nested ones: 1)."""
    values = {}
    for field in data_class._struct._fields:
        if not field.for_version_q(version):
            continue
        if field.is_struct_array() or field.is_struct():
            # nested classes hang off their parent class, by type name
            nested = getattr(data_class, field.type_str)
            value = nested(**_fill(nested, version, name_values))
            if field.is_struct_array():
                value = [value] + [nested(**_fill(nested, version, name_values))
                                   for _ in range(repeat - 1)]
        elif field.is_array():
            value = [_sample(field.array_of, {})] * repeat
        else:
            value = _sample(field, name_values)
        values[field.name] = value
    return values


def filled_response(cls, version, repeat=1, correlation_id=77, framed=True, **name_values):
    """A framed response (size, header, body; ``framed=False``: the body) of
    kafka-python schema class ``cls`` at ``version`` with every field of that
    version set: arrays of one element (``repeat`` for the top-level ones),
    short strings, tagged fields set too. ``name_values`` override fields by
    name at any depth (e.g. throttle_time_ms=12345)."""
    response = cls[version](**_fill(cls, version, name_values, repeat))
    if not framed:
        return bytes(response.encode())
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


# -- KIP-932 ShareFetch and ShareAcknowledge responses --------------------------------------
#
# kafka-python has no schema for them: built byte by byte from Kafka's
# ShareFetchResponse.json and ShareAcknowledgeResponse.json (v1, Kafka 4.1; v2 adds
# AcquisitionLockTimeoutMs to ShareAcknowledge). Every version is flexible: compact strings,
# arrays and records, a tagged-field section after every struct, response header v1.

NO_TAGS = b"\x00"


def compact_string(value):
    """COMPACT_NULLABLE_STRING: uvarint N+1 (0: null), then N bytes."""
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")
    return _uvarint(len(data) + 1) + data


def compact_array(items):
    """COMPACT_ARRAY of already-encoded elements: uvarint N+1, then them."""
    return _uvarint(len(items) + 1) + b"".join(items)


def _int16(value):
    return value.to_bytes(2, "big", signed=True)


def _int32(value):
    return value.to_bytes(4, "big", signed=True)


def _int64(value):
    return value.to_bytes(8, "big", signed=True)


def share_node_endpoints(addresses=BROKERS):
    """The NodeEndpoints field: node_id, host, port, rack, tagged fields, per node."""
    return compact_array([_int32(n) + compact_string(h) + _int32(p) + compact_string(r) + NO_TAGS
                          for n, h, p, r in addresses])


# records sizes that give compact-bytes lengths of 1, 2 and 3 varint bytes, and empty ones
# (Records is not nullable from v1)
SHARE_RECORD_SIZES = (300, 0, 1, 126, 127, 20000, 90000)


def share_fetch_parts(version, addresses=BROKERS, with_endpoints=True, top_tags=NO_TAGS,
                      partition_tag=None, error_message=None, record_sizes=SHARE_RECORD_SIZES):
    """A ShareFetch response body of ``version`` (v1+) as (head, NodeEndpoints, top-level
    tagged section): two topics, partitions with records of many sizes and acquired record
    ranges, one answering NOT_LEADER_OR_FOLLOWER (6) with its current leader (the last of
    ``addresses``), whose address NodeEndpoints gives (``with_endpoints``: else it is empty).
    ``partition_tag``: (tag, value), an unknown tagged field in each partition's section."""
    sizes = iter(tuple(record_sizes) * 7)
    topics = []
    for t, partitions in enumerate((3, 4)):
        parts = []
        for i in range(partitions):
            size = next(sizes)
            moved = (t, i) == (1, 1)
            leader = addresses[-1][0] if moved else -1
            if moved:
                size = 0
            records = _uvarint(size + 1) + b"r" * size
            acquired = [] if not size else [
                _int64(100 * i) + _int64(100 * i + 9) + _int16(1) + NO_TAGS,
                _int64(100 * i + 20) + _int64(100 * i + 20) + _int16(3) + NO_TAGS]
            tags = NO_TAGS
            if partition_tag is not None:
                tag, value = partition_tag
                tags = b"\x01" + tagged_field(tag, value)
            parts.append(
                _int32(i) + _int16(6 if moved else 0)
                + compact_string("not the leader" if moved else None)
                + _int16(0) + compact_string(None)  # acknowledge_error_code, _message
                + _int32(leader) + _int32(12 if moved else -1) + NO_TAGS  # current_leader
                + records + compact_array(acquired) + tags)
        topics.append(uuid.UUID(int=7 + t).bytes + compact_array(parts) + NO_TAGS)
    head = (_int32(0) + _int16(0) + compact_string(error_message)  # throttle_time_ms, error
            + _int32(30000)  # acquisition_lock_timeout_ms (v1+)
            + compact_array(topics))
    endpoints = share_node_endpoints(addresses) if with_endpoints else compact_array([])
    return head, endpoints, top_tags


def share_acknowledge_parts(version, addresses=BROKERS, with_endpoints=True, top_tags=NO_TAGS,
                            partition_tag=None, error_message=None):
    """A ShareAcknowledge response body of ``version`` (v1+), as share_fetch_parts: two
    topics, one partition answering NOT_LEADER_OR_FOLLOWER with its current leader."""
    topics = []
    for t, partitions in enumerate((2, 3)):
        parts = []
        for i in range(partitions):
            moved = (t, i) == (1, 2)
            tags = NO_TAGS
            if partition_tag is not None:
                tag, value = partition_tag
                tags = b"\x01" + tagged_field(tag, value)
            parts.append(_int32(i) + _int16(6 if moved else 0)
                         + compact_string("not the leader" if moved else None)
                         + _int32(addresses[-1][0] if moved else -1) + _int32(12 if moved else -1)
                         + NO_TAGS + tags)
        topics.append(uuid.UUID(int=7 + t).bytes + compact_array(parts) + NO_TAGS)
    head = _int32(0) + _int16(0) + compact_string(error_message)
    if version >= 2:
        head += _int32(30000)  # acquisition_lock_timeout_ms (v2+)
    head += compact_array(topics)
    endpoints = share_node_endpoints(addresses) if with_endpoints else compact_array([])
    return head, endpoints, top_tags


def share_fetch(version, addresses=BROKERS, with_endpoints=True, **kw):
    return b"".join(share_fetch_parts(version, addresses, with_endpoints, **kw))


def share_acknowledge(version, addresses=BROKERS, with_endpoints=True, **kw):
    return b"".join(share_acknowledge_parts(version, addresses, with_endpoints, **kw))


def parse_share_tail(tail):
    """A ShareFetch or ShareAcknowledge tail (NodeEndpoints, then the top-level tagged
    section, to the end) -> ([(node_id, host, port, rack)], [(tag, value)]), read without
    the proxy's codecs; AssertionError unless it is exactly that."""
    def uvarint(pos):
        value = shift = 0
        while True:
            b = tail[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value, pos
            shift += 7

    def string(pos):
        n, pos = uvarint(pos)
        if n == 0:
            return None, pos
        return bytes(tail[pos:pos + n - 1]).decode(), pos + n - 1

    count, pos = uvarint(0)
    endpoints = []
    for _ in range(count - 1):
        node_id = int.from_bytes(tail[pos:pos + 4], "big", signed=True)
        host, pos = string(pos + 4)
        port = int.from_bytes(tail[pos:pos + 4], "big", signed=True)
        rack, pos = string(pos + 4)
        assert tail[pos] == 0  # the entry's tagged fields: none
        pos += 1
        endpoints.append((node_id, host, port, rack))
    tags = []
    n, pos = uvarint(pos)
    for _ in range(n):
        tag, pos = uvarint(pos)
        size, pos = uvarint(pos)
        tags.append((tag, bytes(tail[pos:pos + size])))
        pos += size
    assert pos == len(tail), (pos, len(tail))
    assert [t for t, _ in tags] == sorted({t for t, _ in tags})  # ascending, each once
    return endpoints, tags
