"""KIP-599 controller_mutation_rate without sockets: the codec of CreateTopics,
DeleteTopics and CreatePartitions at every version, and the filter fed bytes
through the pipeline with a fake clock."""
import struct
import uuid
import warnings

import pytest

from kthrottle.codecs.errors import THROTTLING_QUOTA_EXCEEDED, ProtocolError
from kthrottle.codecs.mutations import (
    CREATE_PARTITIONS,
    CREATE_TOPICS,
    DELETE_TOPICS,
    METADATA_BY_ID,
    METADATA_BY_NAME,
    STRICT_FROM,
    VERSIONS,
    created_partitions,
    decode_mutation,
    metadata_request,
    partition_counts,
    throttled_response,
)
from kthrottle.policy.entities import CONTROLLER_MUTATION_RATE, OBSERVE_ONLY, REQUEST_RATE
from test_pipeline import Harness, cids, frames_of, req_cids

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

pytestmark = pytest.mark.unit

CLIENT = "admin-tool"


# frames ----------------------------------------------------------------------

def _framed(message, cid, client_id=None):
    if client_id is None:
        message.with_header(correlation_id=cid)
    else:
        message.with_header(correlation_id=cid, client_id=client_id)
    return bytes(message.encode(header=True, framed=True))


def create_topics_req(cid, topics, version=6, validate_only=False, client_id=CLIENT):
    """``topics``: {name: partitions, or a list of assignments' broker ids}"""
    cls = CreateTopicsRequest[version]
    wanted = []
    for name, spec in topics.items():
        if isinstance(spec, list):
            wanted.append(cls.CreatableTopic(
                name=name, num_partitions=-1, replication_factor=-1, configs=[],
                assignments=[cls.CreatableTopic.CreatableReplicaAssignment(
                    partition_index=i, broker_ids=ids) for i, ids in enumerate(spec)]))
        else:
            wanted.append(cls.CreatableTopic(name=name, num_partitions=spec,
                                             replication_factor=1, assignments=[], configs=[]))
    return _framed(cls(topics=wanted, timeout_ms=1000, validate_only=validate_only), cid,
                   client_id)


def create_topics_resp(cid, topics, version=6, throttle_ms=0):
    """``topics``: {name: (error code, num_partitions)}"""
    cls = CreateTopicsResponse[version]
    return _framed(cls(throttle_time_ms=throttle_ms, topics=[
        cls.CreatableTopicResult(name=n, error_code=e, error_message=None, num_partitions=p,
                                 replication_factor=1, configs=None)
        for n, (e, p) in topics.items()]), cid)


def delete_topics_req(cid, names, version=5, client_id=CLIENT, ids=()):
    cls = DeleteTopicsRequest[version]
    if version >= 6:
        state = cls.DeleteTopicState
        topics = [state(name=n, topic_id=uuid.UUID(int=0)) for n in names]
        topics += [state(name=None, topic_id=i) for i in ids]
        return _framed(cls(topics=topics, timeout_ms=1000), cid, client_id)
    return _framed(cls(topic_names=list(names), timeout_ms=1000), cid, client_id)


def delete_topics_resp(cid, names, version=5):
    cls = DeleteTopicsResponse[version]
    return _framed(cls(throttle_time_ms=0, responses=[
        cls.DeletableTopicResult(name=n, error_code=0) for n in names]), cid)


def create_partitions_req(cid, topics, version=3, validate_only=False, client_id=CLIENT):
    """``topics``: {name: new total, or (new total, assignments)}"""
    cls = CreatePartitionsRequest[version]
    wanted = []
    for name, spec in topics.items():
        count, assignments = spec if isinstance(spec, tuple) else (spec, None)
        wanted.append(cls.CreatePartitionsTopic(
            name=name, count=count,
            assignments=None if assignments is None else [
                cls.CreatePartitionsTopic.CreatePartitionsAssignment(broker_ids=ids)
                for ids in assignments]))
    return _framed(cls(topics=wanted, timeout_ms=1000, validate_only=validate_only), cid,
                   client_id)


def create_partitions_resp(cid, names, version=3):
    cls = CreatePartitionsResponse[version]
    return _framed(cls(throttle_time_ms=0, results=[
        cls.CreatePartitionsTopicResult(name=n, error_code=0, error_message=None)
        for n in names]), cid)


def metadata_resp(cid, topics, version=METADATA_BY_NAME, ids=None):
    """``topics``: {name: partitions}; a name absent from the cluster: None."""
    cls = MetadataResponse[version]
    topic_cls = cls.MetadataResponseTopic
    part_cls = topic_cls.MetadataResponsePartition
    out = []
    for name, count in topics.items():
        extra = {"topic_id": (ids or {}).get(name, uuid.UUID(int=0))} if version >= 10 else {}
        if count is None:
            out.append(topic_cls(error_code=3, name=name, is_internal=False, partitions=[],
                                 **extra))
            continue
        out.append(topic_cls(error_code=0, name=name, is_internal=False, partitions=[
            part_cls(error_code=0, partition_index=i, leader_id=111, leader_epoch=0,
                     replica_nodes=[111], isr_nodes=[111], offline_replicas=[])
            for i in range(count)], **extra))
    body = cls(throttle_time_ms=0, brokers=[cls.MetadataResponseBroker(
        node_id=111, host="127.0.0.1", port=9092, rack=None)], cluster_id="c",
        controller_id=111, topics=out)
    return _framed(body, cid)


def decoded_answer(cls, frame):
    return cls.decode(frame[4:], header=True)


# the codec -------------------------------------------------------------------------

@pytest.mark.parametrize("version", range(VERSIONS[CREATE_TOPICS][0],
                                          VERSIONS[CREATE_TOPICS][1] + 1))
def test_create_topics_count_their_partitions_at_every_version(version):
    frame = create_topics_req(7, {"a": 3, "b": [[1], [2]], "c": -1}, version=version,
                              validate_only=version >= 1)
    m = decode_mutation(frame)
    assert (m.api_key, m.api_version, m.correlation_id) == (CREATE_TOPICS, version, 7)
    assert [(t.name, t.partitions) for t in m.topics] == [("a", 3), ("b", 2), ("c", None)]
    assert m.validate_only == (version >= 1)  # v0 has no validate_only
    assert m.strict == (version >= 6)


@pytest.mark.parametrize("version", range(VERSIONS[DELETE_TOPICS][0],
                                          VERSIONS[DELETE_TOPICS][1] + 1))
def test_deleted_topics_leave_their_count_to_the_broker(version):
    topic_id = uuid.uuid4()
    ids = (topic_id,) if version >= 6 else ()
    m = decode_mutation(delete_topics_req(3, ["x", "y"], version=version, ids=ids))
    assert [(t.name, t.partitions) for t in m.topics][:2] == [("x", None), ("y", None)]
    if version >= 6:
        assert (m.topics[2].name, m.topics[2].topic_id) == (None, topic_id)
    assert not m.validate_only and m.strict == (version >= 5)


@pytest.mark.parametrize("version", range(VERSIONS[CREATE_PARTITIONS][0],
                                          VERSIONS[CREATE_PARTITIONS][1] + 1))
def test_create_partitions_say_the_new_total_or_the_new_assignments(version):
    m = decode_mutation(create_partitions_req(4, {"p": 6, "q": (5, [[1], [1]])},
                                              version=version, validate_only=True))
    assert [(t.name, t.partitions, t.new_total) for t in m.topics] == [
        ("p", None, 6), ("q", 2, 5)]
    assert m.validate_only and m.strict == (version >= 3)


@pytest.mark.parametrize("api_key,cls", [(CREATE_TOPICS, CreateTopicsResponse),
                                         (DELETE_TOPICS, DeleteTopicsResponse),
                                         (CREATE_PARTITIONS, CreatePartitionsResponse)])
def test_the_refusal_decodes_at_every_version_with_error_89_per_topic(api_key, cls):
    low, high = VERSIONS[api_key]
    for version in range(max(low, STRICT_FROM[api_key] - 2), high + 1):
        if api_key == CREATE_TOPICS:
            request = create_topics_req(11, {"a": 1, "b": 2}, version=version)
        elif api_key == DELETE_TOPICS:
            request = delete_topics_req(11, ["a", "b"], version=version)
        else:
            request = create_partitions_req(11, {"a": 2, "b": 3}, version=version)
        answer = decoded_answer(cls[version], throttled_response(decode_mutation(request), 1234))
        assert answer.header.correlation_id == 11
        assert answer.throttle_time_ms == 1234
        results = answer.topics if api_key == CREATE_TOPICS else (
            answer.responses if api_key == DELETE_TOPICS else answer.results)
        assert [(r.name, r.error_code) for r in results] == [
            ("a", THROTTLING_QUOTA_EXCEEDED), ("b", THROTTLING_QUOTA_EXCEEDED)]


def test_malformed_mutations_are_protocol_errors():
    frame = bytearray(create_topics_req(1, {"a": 3}))
    with pytest.raises(ProtocolError, match="malformed CreateTopicsRequest v6"):
        decode_mutation(bytes(frame[:-6]))
    with pytest.raises(ProtocolError, match="truncated"):
        decode_mutation(b"\x00\x00\x00\x04\x00\x13")
    with pytest.raises(ProtocolError, match="not a controller mutation"):
        decode_mutation(b"\x00\x00\x00\x0a\x00\x03\x00\x04\x00\x00\x00\x01\x00\x00")


def test_partition_counts_are_asked_without_creating_a_topic():
    m = decode_mutation(delete_topics_req(1, ["x", "gone"]))
    frame, version = metadata_request(m.topics)
    assert version == METADATA_BY_NAME
    asked = MetadataRequest[version].decode(frame[4:], header=True)
    assert [t.name for t in asked.topics] == ["x", "gone"]
    assert asked.allow_auto_topic_creation is False
    by_name, by_id = partition_counts(metadata_resp(0, {"x": 4, "gone": None}), version)
    assert by_name == {"x": 4} and by_id == {}


def test_topics_named_by_id_are_asked_by_id():
    topic_id = uuid.uuid4()
    m = decode_mutation(delete_topics_req(1, ["x"], version=6, ids=(topic_id,)))
    frame, version = metadata_request(m.topics)
    assert version == METADATA_BY_ID
    asked = MetadataRequest[version].decode(frame[4:], header=True)
    assert [(t.name, t.topic_id) for t in asked.topics][1] == (None, topic_id)
    by_name, by_id = partition_counts(
        metadata_resp(0, {"x": 2, "y": 5}, version=version, ids={"y": topic_id}), version)
    assert by_name == {"x": 2, "y": 5} and by_id == {topic_id: 5}


def test_created_partitions_are_read_from_the_answer():
    frame = create_topics_resp(1, {"a": (0, 4), "b": (36, -1), "c": (0, 1)})
    assert created_partitions(frame, 6) == {"a": 4, "c": 1}


# the filter, through the pipeline ------------------------------------------------------

def harness(rate=2.0, **cfg):
    """Token bucket (the default): a burst of 1 s of the quota."""
    return Harness({"clients/" + CLIENT: {CONTROLLER_MUTATION_RATE: rate, **cfg}})


def mutation_bucket(h):
    return h.conn.quotas_for(CLIENT).current().mutation


def test_a_strict_request_over_the_quota_is_answered_89_and_never_reaches_the_broker():
    h = harness(rate=2.0)
    h.client(create_topics_req(1, {"a": 5, "b": 5}))  # 10 partitions: crosses the quota
    assert req_cids(h.take_broker()) == [1]  # the one that crosses goes through
    h.broker(create_topics_resp(1, {"a": (0, 5), "b": (0, 5)}))
    first = decoded_answer(CreateTopicsResponse[6], h.take_client())
    assert first.throttle_time_ms == 0 and h.client_paused_until is None
    bucket = mutation_bucket(h)
    assert bucket.total == 10 and bucket.throttled == 0

    h.at(1.0)  # 2 tokens back of the 8 owed: 3 s to go
    h.client(create_topics_req(2, {"c": 1, "d": 1}))
    assert h.take_broker() == b""
    refused = decoded_answer(CreateTopicsResponse[6], h.take_client())
    assert refused.header.correlation_id == 2
    assert refused.throttle_time_ms == 3000
    assert [(t.name, t.error_code) for t in refused.topics] == [
        ("c", THROTTLING_QUOTA_EXCEEDED), ("d", THROTTLING_QUOTA_EXCEEDED)]
    assert bucket.total == 10  # a refused request records nothing
    assert (bucket.throttled, bucket.throttle_ms_total) == (1, 3000)
    assert h.closed is None
    # muted for the debt, as a broker mutes the channel: nothing read meanwhile
    assert h.client_paused_until == pytest.approx(4.0)
    h.client(create_topics_req(3, {"c": 1}))
    assert h.take_broker() == b""

    h.at(4.0)  # paid back: the request that waited goes through
    assert req_cids(h.take_broker()) == [3]
    assert bucket.total == 11


def test_a_permissive_request_goes_through_and_the_client_is_throttled():
    h = harness(rate=2.0)
    h.client(create_topics_req(1, {"a": 6}, version=5))  # 4 over a 2/s quota: 2 s
    assert req_cids(h.take_broker()) == [1]
    assert h.client_paused_until == pytest.approx(2.0)
    h.client(create_topics_req(2, {"b": 1}, version=5))
    assert h.take_broker() == b""  # not read while muted
    h.broker(create_topics_resp(1, {"a": (0, 6)}, version=5))
    answer = decoded_answer(CreateTopicsResponse[5], h.take_client())
    assert answer.throttle_time_ms == 2000
    assert [t.error_code for t in answer.topics] == [0]
    h.at(2.0)
    assert req_cids(h.take_broker()) == [2]  # never refused at a permissive version


def test_validate_only_and_other_clients_count_nothing():
    h = harness(rate=2.0)
    h.client(create_topics_req(1, {"a": 50}, validate_only=True))
    h.client(create_partitions_req(2, {"a": 100}, validate_only=True))
    assert req_cids(h.take_broker()) == [1, 2]
    assert mutation_bucket(h).total == 0
    h.client(create_topics_req(3, {"a": 50}, client_id="another-tool"))
    h.client(create_topics_req(4, {"b": 50}, client_id="another-tool"))
    assert req_cids(h.take_broker()) == [3, 4]
    assert h.conn.quotas_for("another-tool").current().mutation is None
    assert mutation_bucket(h).total == 0


def test_deleted_partitions_are_asked_of_the_broker_ahead_of_the_deletion():
    h = harness(rate=2.0)
    h.client(delete_topics_req(1, ["x", "gone"], version=4))  # permissive
    sent = frames_of(h.take_broker())
    assert len(sent) == 2
    assert struct.unpack_from(">h", sent[0], 4)[0] == 3  # Metadata first ...
    assert struct.unpack_from(">hh", sent[1], 4) == (DELETE_TOPICS, 4)  # ... then the deletion
    internal = struct.unpack_from(">i", sent[0], 8)[0]
    assert req_cids(sent[1]) == [1]
    h.broker(metadata_resp(internal, {"x": 6, "gone": None}))
    assert h.take_client() == b""  # the proxy's own exchange
    bucket = mutation_bucket(h)
    assert bucket.total == 6  # an unknown topic deletes nothing
    h.broker(delete_topics_resp(1, ["x", "gone"], version=4))
    answer = decoded_answer(DeleteTopicsResponse[4], h.take_client())
    assert answer.throttle_time_ms == 2000  # 4 over a 2/s quota
    assert h.client_paused_until is not None


def test_a_strict_deletion_is_counted_from_the_broker_and_refuses_the_next():
    h = harness(rate=2.0)
    h.client(delete_topics_req(1, ["x"], version=5))
    sent = frames_of(h.take_broker())
    h.broker(metadata_resp(struct.unpack_from(">i", sent[0], 8)[0], {"x": 8}))
    h.broker(delete_topics_resp(1, ["x"], version=5))
    assert decoded_answer(DeleteTopicsResponse[5], h.take_client()).throttle_time_ms == 0
    h.client(delete_topics_req(2, ["y"], version=5))
    assert h.take_broker() == b""
    refused = decoded_answer(DeleteTopicsResponse[5], h.take_client())
    assert refused.throttle_time_ms == 3000  # 6 owed at 2/s
    assert [(r.name, r.error_code) for r in refused.responses] == [
        ("y", THROTTLING_QUOTA_EXCEEDED)]


def test_added_partitions_are_the_new_total_minus_the_current_count():
    h = harness(rate=100.0)
    h.client(create_partitions_req(1, {"p": 10, "q": (4, [[1], [1]])}))
    sent = frames_of(h.take_broker())
    assert len(sent) == 2  # p is asked; q says its two new partitions itself
    assert mutation_bucket(h).total == 2
    h.broker(metadata_resp(struct.unpack_from(">i", sent[0], 8)[0], {"p": 3}))
    assert mutation_bucket(h).total == 9
    h.broker(create_partitions_resp(1, ["p", "q"]))
    assert cids(h.take_client()) == [1]


def test_a_default_partition_count_is_corrected_from_the_answer():
    h = harness(rate=100.0)
    h.client(create_topics_req(1, {"d": -1}, version=6))
    assert mutation_bucket(h).total == 1  # Kafka's default num.partitions, for now
    h.broker(create_topics_resp(1, {"d": (0, 12)}, version=6))
    assert decoded_answer(CreateTopicsResponse[6], h.take_client()).topics[0].num_partitions == 12
    assert mutation_bucket(h).total == 12


def test_an_observe_only_quota_refuses_nothing_and_counts_what_it_would_have():
    h = harness(rate=2.0, **{OBSERVE_ONLY: 1.0})
    for cid in range(1, 5):
        h.client(create_topics_req(cid, {"t%d" % cid: 5}))
    assert req_cids(h.take_broker()) == [1, 2, 3, 4]
    bucket = mutation_bucket(h)
    assert bucket.observe_only and bucket.total == 20
    assert bucket.throttled == 0 and bucket.observed >= 3 and bucket.observed_ms_total > 0
    assert h.client_paused_until is None


def test_a_refused_mutation_still_counts_against_the_request_rate():
    h = Harness({"clients/" + CLIENT: {CONTROLLER_MUTATION_RATE: 1.0, REQUEST_RATE: 100.0}})
    h.client(create_topics_req(1, {"a": 5}))
    h.client(create_topics_req(2, {"b": 5}))
    assert req_cids(h.take_broker()) == [1]
    assert h.conn.quotas_for(CLIENT).current().request.total == 2


def test_a_malformed_mutation_closes_only_its_connection():
    h = harness()
    frame = bytearray(create_topics_req(1, {"a": 3}))
    bad = frame[:-6]
    struct.pack_into(">i", bad, 0, len(bad) - 4)
    h.client(bytes(bad))
    assert h.take_broker() == b""
    assert "malformed CreateTopicsRequest v6" in h.closed
