"""The authorization filter (``proxy/filters/authorization.py``) in a whole
pipeline without I/O: the cluster's ACLs enforced for the client's own
principal, refusals answered as a Kafka broker answers them.

ACLs: alice may WRITE, READ and DESCRIBE the topics prefixed ``alice-`` and
READ the groups prefixed ``alice-``; nothing else is granted to anyone."""
import struct
import uuid
import warnings

import pytest

from kthrottle.policy.acls import Operation as Op
from kthrottle.policy.acls import PatternType, Permission, ResourceType
from kthrottle.proxy import filters as registry
from kthrottle.proxy.filters.authorization import AclView, Authorization
from kthrottle.sources.acls import AclSnapshot
from kthrottle_testkit.frames import frame_response
from test_pipeline import Harness, advertise, cids, frames_of, raw_request, req_cids

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import (CreateTopicsRequest, CreateTopicsResponse,
                                      DescribeAclsRequest, DescribeAclsResponse)
    from kafka.protocol.consumer import (FetchRequest, FetchResponse, JoinGroupRequest,
                                         JoinGroupResponse, OffsetCommitRequest,
                                         OffsetCommitResponse)
    from kafka.protocol.metadata import (FindCoordinatorRequest, FindCoordinatorResponse,
                                         MetadataRequest, MetadataResponse)
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

pytestmark = pytest.mark.unit

TOPIC_AUTHORIZATION_FAILED = 29
UNKNOWN_TOPIC_ID = 100
GROUP_AUTHORIZATION_FAILED = 30
CLUSTER_AUTHORIZATION_FAILED = 31
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
ALICE_TOPIC_ID, BOB_TOPIC_ID = uuid.UUID(int=0xA1), uuid.UUID(int=0xB0)
TOPIC_IDS = {"alice-t": ALICE_TOPIC_ID, "bob-t": BOB_TOPIC_ID, "alice-new": uuid.UUID(int=0xA2)}


# ACLs ------------------------------------------------------------------------

def acl(resource_type, name, principal, operation, pattern=PatternType.PREFIXED,
        permission=Permission.ALLOW, host="*"):
    return (int(resource_type), name, int(pattern), principal, host, int(operation),
            int(permission))


ALICE_ACLS = (
    acl(ResourceType.TOPIC, "alice-", "User:alice", Op.WRITE),
    acl(ResourceType.TOPIC, "alice-", "User:alice", Op.READ),
    acl(ResourceType.TOPIC, "alice-", "User:alice", Op.DESCRIBE),
    acl(ResourceType.GROUP, "alice-", "User:alice", Op.READ),
)


def view_of(bindings=ALICE_ACLS, super_users=(), enabled=True, allow_everyone=False):
    view = AclView()
    view.update(AclSnapshot(enabled, tuple(bindings), frozenset(super_users), allow_everyone))
    return view


SNAPSHOT = AclSnapshot(True, tuple(ALICE_ACLS), frozenset(), False)


def harness(view, principal="alice", host="10.0.0.1"):
    """A connection accepted from ``host`` for ``principal`` (as a TLS
    listener names it), the authorization filter after the standard ones."""
    f = Authorization(view)
    h = Harness(filters=registry.standard_filters(advertise) + [f], connect=False)
    h.conn.client_host = host
    h.run(h.conn.client_accepted(h.now, principal=principal))
    assert h.conn.principal == principal and h.closed is None
    return h


# frames ----------------------------------------------------------------------

def framed(request, cid, client_id="app-1"):
    request.with_header(correlation_id=cid, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def framed_response(response, cid):
    response.with_header(correlation_id=cid)
    return bytes(response.encode(header=True, framed=True))


def decoded(cls, version, frame):
    """A framed request or response, decoded with its header."""
    return cls[version].decode(frame[4:], header=True)


def produce(cid, topics, version=9, acks=-1, transactional_id=None):
    """A Produce of ``topics`` ({name: [partition, ...]})."""
    D = ProduceRequest.TopicProduceData
    P = D.PartitionProduceData
    data = [D(name=name, partition_data=[P(index=i, records=b"rec-%s-%d" % (name.encode(), i))
                                         for i in parts])
            for name, parts in topics.items()]
    return framed(ProduceRequest[version](transactional_id=transactional_id, acks=acks,
                                          timeout_ms=30000, topic_data=data), cid)


def produce_answer(cid, topics, version=9):
    T = ProduceResponse.TopicProduceResponse
    P = T.PartitionProduceResponse
    return framed_response(ProduceResponse[version](throttle_time_ms=0, responses=[
        T(name=name, partition_responses=[P(index=i, error_code=0, base_offset=100)
                                          for i in parts])
        for name, parts in topics.items()]), cid)


def fetch(cid, topics, version=12):
    F = FetchRequest
    P = F.FetchTopic.FetchPartition
    return framed(F[version](
        replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20, isolation_level=0,
        session_id=0, session_epoch=-1,
        topics=[F.FetchTopic(topic=name, partitions=[
            P(partition=i, current_leader_epoch=-1, fetch_offset=5, last_fetched_epoch=-1,
              log_start_offset=-1, partition_max_bytes=1 << 20) for i in parts])
            for name, parts in topics.items()],
        forgotten_topics_data=[], rack_id=""), cid)


def metadata(cid, names=None, version=12, auto_create=False):
    T = MetadataRequest.MetadataRequestTopic
    topics = None if names is None else [T(name=n, topic_id=uuid.UUID(int=0)) for n in names]
    return framed(MetadataRequest[version](
        topics=topics, allow_auto_topic_creation=auto_create,
        include_cluster_authorized_operations=False,
        include_topic_authorized_operations=False), cid)


def metadata_answer(cid, names, version=12):
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    return framed_response(M[version](
        throttle_time_ms=0, cluster_id="cluster-x", controller_id=1,
        brokers=[M.MetadataResponseBroker(node_id=1, host="kafka-1.internal", port=9092,
                                          rack=None)],
        topics=[T(error_code=0, name=n, topic_id=TOPIC_IDS[n], is_internal=False,
                  partitions=[P(error_code=0, partition_index=i, leader_id=1, leader_epoch=0,
                                replica_nodes=[1], isr_nodes=[1], offline_replicas=[])
                              for i in range(2)])
                for n in names]), cid)


def find_coordinator(cid, keys, version):
    if version < 4:
        request = FindCoordinatorRequest[version](key=keys[0], key_type=0)
    else:
        request = FindCoordinatorRequest[version](key_type=0, coordinator_keys=list(keys))
    return framed(request, cid)


def offset_commit(cid, group, topics, version=8):
    T = OffsetCommitRequest.OffsetCommitRequestTopic
    P = T.OffsetCommitRequestPartition
    return framed(OffsetCommitRequest[version](
        group_id=group, generation_id_or_member_epoch=3, member_id="m-1",
        group_instance_id=None,
        topics=[T(name=name, partitions=[P(partition_index=i, committed_offset=42,
                                           committed_leader_epoch=-1, committed_metadata="")
                                         for i in parts])
                for name, parts in topics.items()]), cid)


def describe_acls(cid, version=3):
    return framed(DescribeAclsRequest[version](
        resource_type_filter=1, resource_name_filter=None, pattern_type_filter=1,
        principal_filter=None, host_filter=None, operation=1, permission_type=1), cid)


def partition_errors(response, topics_field, name_field, parts_field, index_field):
    """{topic: {partition: error}} of a decoded response."""
    return {getattr(t, name_field): {getattr(p, index_field): p.error_code
                                     for p in getattr(t, parts_field)}
            for t in getattr(response, topics_field)}


# 1. Produce --------------------------------------------------------------------

def test_a_produce_to_her_own_topic_reaches_the_broker_byte_for_byte():
    h = harness(view_of())
    request = produce(1, {"alice-t": [0, 1]})
    h.client(request)
    assert h.take_broker() == request
    h.broker(produce_answer(1, {"alice-t": [0, 1]}))
    answer = decoded(ProduceResponse, 9, h.take_client())
    assert answer.header.correlation_id == 1
    assert partition_errors(answer, "responses", "name", "partition_responses", "index") == {
        "alice-t": {0: 0, 1: 0}}
    assert h.closed is None


def test_a_produce_to_bobs_topic_is_answered_refused_on_every_partition_without_the_broker():
    h = harness(view_of())
    h.client(produce(7, {"bob-t": [0, 1, 2]}))
    assert h.take_broker() == b""
    out = h.take_client()
    assert cids(out) == [7]
    answer = decoded(ProduceResponse, 9, out)
    assert partition_errors(answer, "responses", "name", "partition_responses", "index") == {
        "bob-t": {0: TOPIC_AUTHORIZATION_FAILED, 1: TOPIC_AUTHORIZATION_FAILED,
                  2: TOPIC_AUTHORIZATION_FAILED}}
    assert h.closed is None
    # the connection goes on: her own topic next
    h.client(produce(8, {"alice-t": [0]}))
    assert req_cids(h.take_broker()) == [8]


def test_a_produce_naming_both_topics_reaches_the_broker_with_hers_only():
    h = harness(view_of())
    h.client(produce(11, {"alice-t": [0, 1], "bob-t": [0]}))
    sent = h.take_broker()
    assert req_cids(sent) == [11]
    got = decoded(ProduceRequest, 9, sent)
    assert got.header.correlation_id == 11 and got.header.client_id == "app-1"
    assert [t.name for t in got.topic_data] == ["alice-t"]
    assert [(p.index, p.records) for p in got.topic_data[0].partition_data] == [
        (0, b"rec-alice-t-0"), (1, b"rec-alice-t-1")]
    assert got.acks == -1 and got.timeout_ms == 30000
    assert h.take_client() == b""  # the broker answers it
    h.broker(produce_answer(11, {"alice-t": [0, 1]}))
    answer = decoded(ProduceResponse, 9, h.take_client())
    # her partitions as the broker answered them, bob's refused as Kafka refuses them
    assert answer.header.correlation_id == 11
    assert sorted((t.name, p.index, p.error_code) for t in answer.responses
                  for p in t.partition_responses) == [
        ("alice-t", 0, 0), ("alice-t", 1, 0), ("bob-t", 0, 29)]
    # the next answers, with nothing to put in, take the short way again
    request = produce(12, {"alice-t": [0]})
    h.client(request)
    assert h.take_broker() == request
    h.log.clear()
    h.broker(produce_answer(12, {"alice-t": [0]}))
    assert cids(h.take_client()) == [12] and "pass_response" in h.log


def test_a_refused_produce_with_acks_0_gets_no_answer():
    h = harness(view_of())
    h.client(produce(21, {"bob-t": [0]}, acks=0))
    assert h.take_broker() == b""
    assert h.take_client() == b""


def test_a_transactional_produce_needs_write_on_its_transactional_id():
    h = harness(view_of())  # no TRANSACTIONAL_ID ACL at all: alice may not write bob-tx
    h.client(produce(22, {"alice-t": [0]}, transactional_id="bob-tx"))
    assert h.take_broker() == b""
    answer = decoded(ProduceResponse, 9, h.take_client())
    assert partition_errors(answer, "responses", "name", "partition_responses", "index") == {
        "alice-t": {0: TRANSACTIONAL_ID_AUTHORIZATION_FAILED}}


def test_a_refused_produce_partition_has_kafkas_invalid_offset():
    h = harness(view_of())
    h.client(produce(23, {"bob-t": [0]}))
    part = decoded(ProduceResponse, 9, h.take_client()).responses[0].partition_responses[0]
    assert part.error_code == TOPIC_AUTHORIZATION_FAILED
    assert (part.base_offset, part.log_append_time_ms, part.log_start_offset) == (-1, -1, -1)


# 2. Fetch ----------------------------------------------------------------------

def test_a_fetch_of_bobs_topic_only_is_answered_refused_without_the_broker():
    h = harness(view_of())
    h.client(fetch(3, {"bob-t": [0, 1]}))
    assert h.take_broker() == b""
    out = h.take_client()
    assert cids(out) == [3]
    answer = decoded(FetchResponse, 12, out)
    assert answer.error_code == 0 and answer.session_id == 0
    assert partition_errors(answer, "responses", "topic", "partitions", "partition_index") == {
        "bob-t": {0: TOPIC_AUTHORIZATION_FAILED, 1: TOPIC_AUTHORIZATION_FAILED}}
    assert all(p.records in (None, b"") for p in answer.responses[0].partitions)
    assert h.closed is None


def fetch_answer(cid, topics, version=12, records=b""):
    """A Fetch answer of ``topics`` ({name: [partition, ...]}), each partition with ``records``."""
    R = FetchResponse
    T = R.fields["responses"].data_class
    P = T.fields["partitions"].data_class
    return framed_response(R[version](throttle_time_ms=0, error_code=0, session_id=77, responses=[
        T(topic=name, partitions=[P(partition_index=i, error_code=0, high_watermark=50,
                                    last_stable_offset=50, log_start_offset=0,
                                    aborted_transactions=[], preferred_read_replica=-1,
                                    records=records) for i in parts])
        for name, parts in topics.items()]), cid)


@pytest.mark.parametrize("version", [4, 7, 11, 12])
def test_a_fetch_of_both_topics_reaches_the_broker_with_hers_only(version):
    h = harness(view_of())
    h.client(fetch(4, {"bob-t": [0, 2], "alice-t": [1]}, version=version))
    got = decoded(FetchRequest, version, h.take_broker())
    assert got.header.correlation_id == 4
    assert [(t.topic, [p.partition for p in t.partitions]) for t in got.topics] == [
        ("alice-t", [1])]
    assert h.take_client() == b""
    # the broker's answer, records and all, with bob's partitions refused in it as Kafka does
    records = bytes(range(256)) * 40
    h.broker(fetch_answer(4, {"alice-t": [1]}, version, records))
    answer = decoded(FetchResponse, version, h.take_client())
    assert answer.header.correlation_id == 4
    assert partition_errors(answer, "responses", "topic", "partitions", "partition_index") == {
        "alice-t": {1: 0}, "bob-t": {0: TOPIC_AUTHORIZATION_FAILED, 2: TOPIC_AUTHORIZATION_FAILED}}
    if version >= 7:
        assert answer.session_id == 77
    hers = next(t for t in answer.responses if t.topic == "alice-t").partitions[0]
    assert bytes(hers.records) == records and hers.high_watermark == 50
    # the next answer, with nothing to put in, takes the short way again
    request = fetch(5, {"alice-t": [1]}, version=version)
    h.client(request)
    assert h.take_broker() == request
    h.log.clear()
    plain = fetch_answer(5, {"alice-t": [1]}, version, records)
    h.broker(plain)
    assert h.take_client() == plain and "pass_response" in h.log


def test_a_fetch_v17_by_topic_id_gets_bobs_refusal_and_her_records_with_addresses_rewritten():
    h = harness(view_of())
    h.client(metadata(60, ["alice-t", "bob-t"]))  # the ids are learnt from the answers she gets
    h.take_broker()
    h.broker(metadata_answer(60, ["alice-t", "bob-t"]))
    h.take_client()
    Q = FetchRequest
    T = Q.fields["topics"].data_class
    P = T.fields["partitions"].data_class
    h.client(framed(Q[17](
        replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20, isolation_level=0,
        session_id=0, session_epoch=-1, topics=[
            T(topic_id=tid, partitions=[P(partition=0, current_leader_epoch=-1, fetch_offset=5,
                                          last_fetched_epoch=-1, log_start_offset=-1,
                                          partition_max_bytes=1 << 20)])
            for tid in (BOB_TOPIC_ID, ALICE_TOPIC_ID)],
        forgotten_topics_data=[], rack_id=""), 61))
    got = decoded(FetchRequest, 17, h.take_broker())
    assert [t.topic_id for t in got.topics] == [ALICE_TOPIC_ID]
    R = FetchResponse
    RT = R.fields["responses"].data_class
    RP = RT.fields["partitions"].data_class
    NE = R.fields["node_endpoints"].data_class
    records = b"r" * 5000
    h.broker(framed_response(R[17](
        throttle_time_ms=0, error_code=0, session_id=9, responses=[RT(
            topic_id=ALICE_TOPIC_ID, partitions=[RP(
                partition_index=0, error_code=0, high_watermark=50, last_stable_offset=50,
                log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
                records=records)])],
        node_endpoints=[NE(node_id=1, host="kafka-1.internal", port=9092, rack=None)]), 61))
    answer = decoded(FetchResponse, 17, h.take_client())
    assert {(t.topic_id, p.partition_index, p.error_code) for t in answer.responses
            for p in t.partitions} == {(ALICE_TOPIC_ID, 0, 0),
                                       (BOB_TOPIC_ID, 0, TOPIC_AUTHORIZATION_FAILED)}
    hers = next(t for t in answer.responses if t.topic_id == ALICE_TOPIC_ID).partitions[0]
    assert bytes(hers.records) == records
    assert [(e.host, e.port) for e in answer.node_endpoints] == [advertise(1)]  # the proxy's
    assert h.closed is None


def test_a_topic_id_never_seen_is_asked_of_the_cluster_and_answered_unknown_until_read():
    """Her Metadata went through another worker process: this one has not seen
    the id. Kafka's retriable UNKNOWN_TOPIC_ID, and the ids read for her retry."""
    view = view_of()
    asked = []
    view.want_topic_ids = lambda: asked.append(1)
    h = harness(view)
    Q = FetchRequest
    T = Q.fields["topics"].data_class
    P = T.fields["partitions"].data_class

    def fetch_by_id(cid):
        return framed(Q[17](
            replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20, isolation_level=0,
            session_id=0, session_epoch=-1, topics=[T(topic_id=ALICE_TOPIC_ID, partitions=[
                P(partition=0, current_leader_epoch=-1, fetch_offset=5, last_fetched_epoch=-1,
                  log_start_offset=-1, partition_max_bytes=1 << 20)])],
            forgotten_topics_data=[], rack_id=""), cid)

    h.client(fetch_by_id(70))
    assert h.take_broker() == b""
    answer = decoded(FetchResponse, 17, h.take_client())
    assert [(t.topic_id, p.error_code) for t in answer.responses for p in t.partitions] == [
        (ALICE_TOPIC_ID, UNKNOWN_TOPIC_ID)]
    assert asked == [1] and h.closed is None
    view.set_topic_ids({ALICE_TOPIC_ID: "alice-t", BOB_TOPIC_ID: "bob-t"})
    request = fetch_by_id(71)
    h.client(request)
    assert h.take_broker() == request


def test_a_refused_fetch_partition_has_kafkas_invalid_high_watermark():
    h = harness(view_of())
    h.client(fetch(5, {"bob-t": [0]}))
    part = decoded(FetchResponse, 12, h.take_client()).responses[0].partitions[0]
    assert part.error_code == TOPIC_AUTHORIZATION_FAILED
    assert (part.high_watermark, part.last_stable_offset, part.log_start_offset) == (-1, -1, -1)


# 3. Metadata -------------------------------------------------------------------

def test_metadata_for_every_topic_leaves_out_what_she_may_not_describe():
    h = harness(view_of())
    request = metadata(1)
    h.client(request)
    assert h.take_broker() == request  # asked of the broker as it is
    h.broker(metadata_answer(1, ["alice-t", "bob-t"]))
    out = h.take_client()
    assert cids(out) == [1]
    answer = decoded(MetadataResponse, 12, out)
    assert [t.name for t in answer.topics] == ["alice-t"]
    assert answer.topics[0].error_code == 0 and len(answer.topics[0].partitions) == 2
    assert answer.topics[0].topic_id == ALICE_TOPIC_ID
    assert [(b.node_id, b.host, b.port) for b in answer.brokers] == [(1, *advertise(1))]


def test_metadata_naming_bobs_topic_answers_it_refused_without_partitions():
    h = harness(view_of())
    h.client(metadata(2, ["alice-t", "bob-t"]))
    got = decoded(MetadataRequest, 12, h.take_broker())
    assert [t.name for t in got.topics] == ["alice-t", "bob-t"]
    h.broker(metadata_answer(2, ["alice-t", "bob-t"]))
    answer = decoded(MetadataResponse, 12, h.take_client())
    topics = {t.name: t for t in answer.topics}
    assert set(topics) == {"alice-t", "bob-t"}
    assert topics["bob-t"].error_code == TOPIC_AUTHORIZATION_FAILED
    assert topics["bob-t"].partitions == []
    assert topics["bob-t"].topic_id in (None, uuid.UUID(int=0))  # its id not given away
    assert topics["alice-t"].error_code == 0 and len(topics["alice-t"].partitions) == 2


def test_a_topic_she_may_describe_but_not_create_is_not_created_automatically():
    bindings = (acl(ResourceType.TOPIC, "alice-new", "User:alice", Op.DESCRIBE,
                    pattern=PatternType.LITERAL),)
    h = harness(view_of(bindings))
    h.client(metadata(3, ["alice-new"], auto_create=True))
    sent = h.take_broker()
    assert req_cids(sent) == [3]
    got = decoded(MetadataRequest, 12, sent)
    assert got.allow_auto_topic_creation is False
    assert [t.name for t in got.topics] == ["alice-new"]
    assert got.header.client_id == "app-1"


def test_a_topic_she_may_create_keeps_auto_creation():
    bindings = (acl(ResourceType.TOPIC, "alice-", "User:alice", Op.CREATE),
                acl(ResourceType.TOPIC, "alice-", "User:alice", Op.DESCRIBE))
    h = harness(view_of(bindings))
    request = metadata(4, ["alice-new"], auto_create=True)
    h.client(request)
    assert h.take_broker() == request


# 4. FindCoordinator -------------------------------------------------------------

def test_find_coordinator_v3_of_bobs_group_is_refused_without_the_broker():
    h = harness(view_of())
    h.client(find_coordinator(5, ["bob-g"], 3))
    assert h.take_broker() == b""
    answer = decoded(FindCoordinatorResponse, 3, h.take_client())
    assert answer.header.correlation_id == 5
    assert answer.error_code == GROUP_AUTHORIZATION_FAILED
    assert (answer.node_id, answer.host, answer.port) == (-1, "", -1)


def test_find_coordinator_v4_answers_each_refused_key_in_its_coordinators():
    h = harness(view_of())
    h.client(find_coordinator(6, ["bob-g"], 4))
    assert h.take_broker() == b""
    answer = decoded(FindCoordinatorResponse, 4, h.take_client())
    assert answer.header.correlation_id == 6
    assert [(c.key, c.error_code, c.node_id) for c in answer.coordinators] == [
        ("bob-g", GROUP_AUTHORIZATION_FAILED, -1)]


@pytest.mark.parametrize("version", [3, 4])
def test_find_coordinator_of_her_group_passes(version):
    h = harness(view_of())
    request = find_coordinator(7, ["alice-g"], version)
    h.client(request)
    assert h.take_broker() == request
    assert h.take_client() == b""


# 5. JoinGroup -------------------------------------------------------------------

def join_group(cid, group, version=7):
    R = JoinGroupRequest
    return framed(R[version](
        group_id=group, session_timeout_ms=45000, rebalance_timeout_ms=300000, member_id="",
        group_instance_id=None, protocol_type="consumer",
        protocols=[R.JoinGroupRequestProtocol(name="range", metadata=b"\x00\x01")]), cid)


def test_join_group_of_bobs_group_is_refused_in_its_top_level_error():
    h = harness(view_of())
    h.client(join_group(8, "bob-g"))
    assert h.take_broker() == b""
    answer = decoded(JoinGroupResponse, 7, h.take_client())
    assert answer.header.correlation_id == 8
    assert answer.error_code == GROUP_AUTHORIZATION_FAILED
    assert answer.generation_id == -1 and answer.members == []
    request = join_group(9, "alice-g")
    h.client(request)
    assert h.take_broker() == request


# 6. OffsetCommit ----------------------------------------------------------------

def test_offset_commit_reaches_the_broker_with_her_topic_and_the_refusal_is_merged_back():
    h = harness(view_of())
    h.client(offset_commit(10, "alice-g", {"alice-t": [0, 1], "bob-t": [0]}))
    got = decoded(OffsetCommitRequest, 8, h.take_broker())
    assert got.header.correlation_id == 10 and got.group_id == "alice-g"
    assert [(t.name, [p.partition_index for p in t.partitions]) for t in got.topics] == [
        ("alice-t", [0, 1])]
    assert h.take_client() == b""
    T = OffsetCommitResponse.OffsetCommitResponseTopic
    P = T.OffsetCommitResponsePartition
    h.broker(framed_response(OffsetCommitResponse[8](throttle_time_ms=0, topics=[
        T(name="alice-t", partitions=[P(partition_index=0, error_code=0),
                                      P(partition_index=1, error_code=0)])]), 10))
    out = h.take_client()
    assert cids(out) == [10]
    answer = decoded(OffsetCommitResponse, 8, out)
    assert partition_errors(answer, "topics", "name", "partitions", "partition_index") == {
        "alice-t": {0: 0, 1: 0}, "bob-t": {0: TOPIC_AUTHORIZATION_FAILED}}


def test_offset_commit_for_bobs_group_refuses_every_partition_with_the_group_error():
    h = harness(view_of())
    h.client(offset_commit(12, "bob-g", {"alice-t": [0], "bob-t": [1]}))
    assert h.take_broker() == b""
    answer = decoded(OffsetCommitResponse, 8, h.take_client())
    assert partition_errors(answer, "topics", "name", "partitions", "partition_index") == {
        "alice-t": {0: GROUP_AUTHORIZATION_FAILED}, "bob-t": {1: GROUP_AUTHORIZATION_FAILED}}


# CreateTopics ------------------------------------------------------------------

def test_create_topics_creates_hers_and_answers_bobs_refused_in_the_same_answer():
    bindings = ALICE_ACLS + (acl(ResourceType.TOPIC, "alice-", "User:alice", Op.CREATE),)
    h = harness(view_of(bindings))
    C = CreateTopicsRequest.CreatableTopic
    h.client(framed(CreateTopicsRequest[5](topics=[
        C(name=n, num_partitions=3, replication_factor=1, assignments=[], configs=[])
        for n in ("bob-x", "alice-x")], timeout_ms=10000, validate_only=False), 13))
    got = decoded(CreateTopicsRequest, 5, h.take_broker())
    assert [t.name for t in got.topics] == ["alice-x"]
    R = CreateTopicsResponse.CreatableTopicResult
    h.broker(framed_response(CreateTopicsResponse[5](throttle_time_ms=0, topics=[
        R(name="alice-x", error_code=0, error_message=None, num_partitions=3,
          replication_factor=1, configs=[])]), 13))
    answer = decoded(CreateTopicsResponse, 5, h.take_client())
    assert answer.header.correlation_id == 13
    assert {t.name: t.error_code for t in answer.topics} == {
        "alice-x": 0, "bob-x": TOPIC_AUTHORIZATION_FAILED}


# 7. cluster APIs ----------------------------------------------------------------

def test_describe_acls_without_describe_on_the_cluster_is_refused_in_its_top_level_error():
    h = harness(view_of())
    h.client(describe_acls(14))
    assert h.take_broker() == b""
    answer = decoded(DescribeAclsResponse, 3, h.take_client())
    assert answer.header.correlation_id == 14
    assert answer.error_code == CLUSTER_AUTHORIZATION_FAILED and answer.resources == []
    assert h.closed is None


def test_describe_acls_with_describe_on_the_cluster_passes():
    bindings = ALICE_ACLS + (acl(ResourceType.CLUSTER, "kafka-cluster", "User:alice",
                                 Op.DESCRIBE, pattern=PatternType.LITERAL),)
    h = harness(view_of(bindings))
    request = describe_acls(15)
    h.client(request)
    assert h.take_broker() == request
    assert h.take_client() == b""


# 8. delegation tokens -----------------------------------------------------------

def test_create_delegation_token_closes_the_connection_and_reaches_no_broker():
    h = harness(view_of())
    # CreateDelegationToken v1 (not flexible): no renewers, max lifetime -1
    h.client(raw_request(16, 38, 1, b"\x00\x00\x00\x00" + b"\xff" * 8))
    assert h.take_broker() == b"" and h.take_client() == b""
    assert h.closed is not None
    assert "api key 38" in h.closed and "delegation token" in h.closed
    assert "alice" in h.closed
    assert h.refused == "authorization"


# 9. before the ACLs are read, and without an authorizer --------------------------

def test_before_the_acls_are_read_a_request_waits_unread_then_is_decided():
    """No decision without the ACLs: the request waits (nothing reaches the
    broker, the connection stays), and once they are read it is decided."""
    view = AclView()
    h = harness(view)
    h.client(metadata(17, ["bob-t"]))
    h.at(1.0)
    assert h.take_broker() == b"" and h.take_client() == b"" and h.closed is None
    view.update(SNAPSHOT)
    h.at(2.0)
    assert h.closed is None
    assert h.take_broker() == metadata(17, ["bob-t"])  # decided: its answer is then filtered


def test_before_the_acls_are_read_a_produce_waits_too():
    view = AclView()
    h = harness(view)
    h.client(produce(18, {"alice-t": [0]}))
    h.at(1.0)
    assert h.take_broker() == b"" and h.closed is None
    view.update(SNAPSHOT)
    h.at(2.0)
    assert h.take_broker() == produce(18, {"alice-t": [0]}) and h.closed is None


def test_a_cluster_without_an_authorizer_lets_every_request_through_untouched():
    h = harness(view_of(enabled=False))
    requests = [produce(19, {"bob-t": [0], "alice-t": [1]}), fetch(20, {"bob-t": [0]}),
                metadata(21, ["bob-t"], auto_create=True), describe_acls(22),
                join_group(23, "bob-g"), find_coordinator(24, ["bob-g"], 4)]
    for request in requests:
        h.client(request)
        assert h.take_broker() == request
    assert h.take_client() == b"" and h.closed is None
    h.broker(produce_answer(19, {"bob-t": [0], "alice-t": [1]}))
    answer = decoded(ProduceResponse, 9, h.take_client())
    assert partition_errors(answer, "responses", "name", "partition_responses", "index") == {
        "bob-t": {0: 0}, "alice-t": {1: 0}}


# 10. super users ----------------------------------------------------------------

def test_a_super_user_gets_bobs_topic_through():
    h = harness(view_of(super_users={"User:admin"}), principal="admin")
    request = produce(25, {"bob-t": [0]})
    h.client(request)
    assert h.take_broker() == request
    request = metadata(26, ["bob-t"])
    h.client(request)
    assert h.take_broker() == request
    h.broker(produce_answer(25, {"bob-t": [0]}) + metadata_answer(26, ["bob-t"]))
    out = h.take_client()
    assert cids(out) == [25, 26]


def test_the_super_user_list_names_principals_not_user_names():
    h = harness(view_of(super_users={"admin"}), principal="admin")  # not User:admin
    h.client(produce(27, {"bob-t": [0]}))
    assert h.take_broker() == b""
    answer = decoded(ProduceResponse, 9, h.take_client())
    assert answer.responses[0].partition_responses[0].error_code == TOPIC_AUTHORIZATION_FAILED


# 11. DENY beats ALLOW -------------------------------------------------------------

def test_a_deny_for_everyone_beats_her_prefixed_allow():
    bindings = ALICE_ACLS + (acl(ResourceType.TOPIC, "alice-t", "User:*", Op.WRITE,
                                 pattern=PatternType.LITERAL, permission=Permission.DENY),)
    h = harness(view_of(bindings))
    h.client(produce(28, {"alice-t": [0]}))
    assert h.take_broker() == b""
    answer = decoded(ProduceResponse, 9, h.take_client())
    assert partition_errors(answer, "responses", "name", "partition_responses", "index") == {
        "alice-t": {0: TOPIC_AUTHORIZATION_FAILED}}
    # the DENY is of WRITE only: she still reads it, and writes her other topics
    request = fetch(29, {"alice-t": [0]})
    h.client(request)
    assert h.take_broker() == request
    request = produce(30, {"alice-other": [0]})
    h.client(request)
    assert h.take_broker() == request


def test_an_acl_for_another_host_does_not_apply():
    bindings = (acl(ResourceType.TOPIC, "alice-", "User:alice", Op.WRITE, host="10.0.0.2"),)
    h = harness(view_of(bindings), host="10.0.0.1")
    h.client(produce(31, {"alice-t": [0]}))
    assert h.take_broker() == b""
    h = harness(view_of(bindings), host="10.0.0.2")
    request = produce(32, {"alice-t": [0]})
    h.client(request)
    assert h.take_broker() == request


def test_a_pipelined_refusal_is_answered_in_request_order():
    h = harness(view_of())
    h.client(produce(33, {"alice-t": [0]}) + produce(34, {"bob-t": [0]})
             + produce(35, {"alice-t": [1]}))
    assert req_cids(h.take_broker()) == [33, 35]
    assert h.take_client() == b""  # 34's answer waits for 33's
    h.broker(produce_answer(33, {"alice-t": [0]}) + produce_answer(35, {"alice-t": [1]}))
    assert cids(h.take_client()) == [33, 34, 35]


def test_the_broker_answer_frames_are_kafka_frames():
    # sanity of the helpers: a frame built here reads back with kthrottle_testkit.frames' framing
    frame = frame_response(0, 9, ProduceResponse[9](throttle_time_ms=0, responses=[]).encode(), 5)
    assert frame == produce_answer(5, {})


# Metadata by topic id ------------------------------------------------------------

def test_metadata_by_id_of_bobs_topic_does_not_give_away_its_name():
    h = harness(view_of())
    T = MetadataRequest.MetadataRequestTopic
    h.client(framed(MetadataRequest[12](
        topics=[T(name=None, topic_id=BOB_TOPIC_ID)], allow_auto_topic_creation=False,
        include_cluster_authorized_operations=False,
        include_topic_authorized_operations=False), 40))
    assert req_cids(h.take_broker()) == [40]
    h.broker(metadata_answer(40, ["bob-t"]))  # the broker answers the proxy's principal
    answer = decoded(MetadataResponse, 12, h.take_client())
    [topic] = answer.topics
    assert topic.error_code == TOPIC_AUTHORIZATION_FAILED and topic.partitions == []
    assert topic.name is None
    assert topic.topic_id == BOB_TOPIC_ID


# FindCoordinator v4 with allowed and refused keys -------------------------------

def test_find_coordinator_v4_with_her_group_and_bobs_answers_bobs_refused():
    h = harness(view_of())
    h.client(find_coordinator(41, ["alice-g", "bob-g"], 4))
    assert h.closed is None
    got = decoded(FindCoordinatorRequest, 4, h.take_broker())
    assert got.coordinator_keys == ["alice-g"]


# KIP-848: a group API the proxy has no schema for --------------------------------

def consumer_group_heartbeat(cid, group):
    """ConsumerGroupHeartbeat v0 (flexible, header v2): only its first field,
    the group id, is read by the filter."""
    name = group.encode()
    body = b"\x00" + bytes([len(name) + 1]) + name + b"\x00" * 16
    return raw_request(cid, 68, 0, body)


def _cstr(text):
    if text is None:
        return b"\x00"
    data = text.encode()
    return bytes([len(data) + 1]) + data


def cg_heartbeat(cid, group, names=None, regex=None, version=1):
    """ConsumerGroupHeartbeat (ConsumerGroupHeartbeatRequest.json) with its subscription."""
    subscribed = b"\x00" if names is None else bytes([len(names) + 1]) + b"".join(
        _cstr(n) for n in names)
    body = (b"\x00" + _cstr(group) + _cstr("m1") + struct.pack(">i", 0) + b"\x00\x00"
            + struct.pack(">i", -1) + subscribed + (_cstr(regex) if version >= 1 else b"")
            + b"\x00\x00\x00")
    return raw_request(cid, 68, version, body)


def cg_heartbeat_answer(cid, assignment):
    """Its answer, assigning ``assignment`` ([(topic id, [partition, ...])])."""
    entries = b"".join(tid.bytes + bytes([len(parts) + 1])
                       + b"".join(struct.pack(">i", p) for p in parts) + b"\x00"
                       for tid, parts in assignment)
    payload = (struct.pack(">i", cid) + b"\x00" + struct.pack(">ih", 0, 0) + b"\x00"
               + _cstr("m1") + struct.pack(">ii", 5, 3000) + b"\x01"
               + bytes([len(assignment) + 1]) + entries + b"\x00\x00")
    return struct.pack(">i", len(payload)) + payload


def heartbeat_error(frame):
    """The ErrorCode of a framed ConsumerGroupHeartbeat answer."""
    return struct.unpack_from(">h", frame, 13)[0]  # size, id, header tags, throttle


def test_a_kip_848_heartbeat_is_checked_on_its_group_id():
    h = harness(view_of())
    request = consumer_group_heartbeat(42, "alice-g")
    h.client(request)
    assert h.take_broker() == request and h.closed is None
    h.client(consumer_group_heartbeat(43, "bob-g"))
    assert h.take_broker() == b""
    h.broker(cg_heartbeat_answer(42, []))
    # Kafka's answer, in the layout the proxy writes for APIs kafka-python has no schema of,
    # in its turn
    out = h.take_client()
    assert cids(out) == [42, 43] and heartbeat_error(frames_of(out)[1]) == \
        GROUP_AUTHORIZATION_FAILED
    assert h.closed is None


def test_a_kip_848_heartbeat_subscribing_to_bobs_topic_is_refused_as_kafka_refuses_it():
    h = harness(view_of())
    h.client(cg_heartbeat(44, "alice-g", names=["alice-t", "bob-t"]))
    assert h.take_broker() == b""
    out = h.take_client()
    assert cids(out) == [44] and heartbeat_error(out) == TOPIC_AUTHORIZATION_FAILED
    request = cg_heartbeat(45, "alice-g", names=["alice-t"])
    h.client(request)
    assert h.take_broker() == request


def test_a_kip_848_assignment_leaves_out_the_topics_she_may_not_describe():
    """A regex is resolved by the coordinator as the proxy's principal: her
    answer keeps what she may describe (an id not seen yet stays: its Fetch is
    checked on its own)."""
    h = harness(view_of())
    h.client(metadata(46, ["alice-t", "bob-t"]))
    h.take_broker()
    h.broker(metadata_answer(46, ["alice-t", "bob-t"]))
    h.take_client()
    request = cg_heartbeat(47, "alice-g", regex="alice-.*|bob-.*")
    h.client(request)
    assert h.take_broker() == request
    unseen = uuid.UUID(int=0xC0)
    h.broker(cg_heartbeat_answer(47, [(ALICE_TOPIC_ID, [0, 1]), (BOB_TOPIC_ID, [0]),
                                      (unseen, [3])]))
    assert h.take_client() == cg_heartbeat_answer(47, [(ALICE_TOPIC_ID, [0, 1]), (unseen, [3])])
    # one with nothing of bob's goes on as it came
    h.client(cg_heartbeat(48, "alice-g"))
    h.take_broker()
    answer = cg_heartbeat_answer(48, [(ALICE_TOPIC_ID, [0, 1])])
    h.broker(answer)
    assert h.take_client() == answer


def consumer_group_describe(cid, groups, version=1):
    body = b"\x00" + bytes([len(groups) + 1]) + b"".join(_cstr(g) for g in groups) + b"\x00\x00"
    return raw_request(cid, 69, version, body)


def test_a_kip_848_describe_of_her_group_and_bobs_gets_bobs_refused_in_the_brokers_answer():
    from kthrottle.codecs.group_answers import describe_groups_error_response

    h = harness(view_of())
    h.client(consumer_group_describe(49, ["bob-g", "alice-g", "bob-2"]))
    assert h.take_broker() == consumer_group_describe(49, ["alice-g"])
    # the broker describes alice-g (an error answer is as good a layout as any)
    h.broker(describe_groups_error_response(69, 1, 49, ["alice-g"], 0))
    refused = describe_groups_error_response(69, 1, 49, ["bob-g", "bob-2"],
                                             GROUP_AUTHORIZATION_FAILED)
    hers = describe_groups_error_response(69, 1, 49, ["alice-g"], 0)
    # size, id, header tags, throttle; then the array: bob's two first, then the broker's
    payload = hers[4:13] + bytes([3 + 1]) + refused[14:-1] + hers[14:]
    assert h.take_client() == struct.pack(">i", len(payload)) + payload
    # every group refused: answered without the broker
    h.client(consumer_group_describe(50, ["bob-g"]))
    assert h.take_broker() == b""
    assert h.take_client() == describe_groups_error_response(69, 1, 50, ["bob-g"],
                                                             GROUP_AUTHORIZATION_FAILED)


def test_authorized_operations_in_metadata_are_the_principals_not_the_proxys():
    """KIP-430: a client that asks what it may do on a topic is told what
    alice may (READ, WRITE, DESCRIBE), not what the proxy's principal may."""
    h = harness(view_of())
    h.client(metadata(40, ["alice-t"]))
    assert h.take_broker()
    answer = decoded(MetadataResponse, 12, metadata_answer(40, ["alice-t"]))
    answer.topics[0].authorized_operations = set(range(2, 13))  # the proxy's: everything
    answer.with_header(correlation_id=40)
    h.broker(bytes(answer.encode(header=True, framed=True)))
    seen = decoded(MetadataResponse, 12, h.take_client())
    assert seen.topics[0].authorized_operations == {Op.READ, Op.WRITE, Op.DESCRIBE}


def test_a_malformed_produce_closes_its_connection_with_a_clear_reason():
    h = harness(view_of())
    good = bytearray(produce(50, {"alice-t": [0]}))
    client_id_len = int.from_bytes(good[12:14], "big")
    at = 14 + client_id_len + 1 + 1 + 2 + 4  # header tags, null txn id, acks, timeout
    assert good[at] == 2  # one topic (compact array: count + 1)
    good[at] = 0x7f  # 126 topics in a frame that holds one
    h.client(bytes(good))
    assert h.take_broker() == b""
    assert h.closed is not None and "Traceback" not in h.closed


@pytest.mark.parametrize("version", range(4, 18))
def test_the_fetch_topic_reader_agrees_with_kafkas_schema(version):
    """codecs.acl_requests.fetch_request_topics, which spares a decode, reads the
    topics kafka-python's schema (Kafka's FetchRequest.json) puts in."""
    from kthrottle.codecs.acl_requests import fetch_request_topics
    from kthrottle.codecs.request import RequestHead

    F = FetchRequest
    P = F.FetchTopic.FetchPartition
    ids = [uuid.uuid4(), uuid.uuid4()]
    topics = [F.FetchTopic(topic="t-%d" % i, topic_id=ids[i], partitions=[
        P(partition=p, current_leader_epoch=-1, fetch_offset=5, last_fetched_epoch=-1,
          log_start_offset=-1, partition_max_bytes=1 << 20) for p in range(3)])
        for i in range(2)]
    frame = framed(F[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=1 << 20,
                              isolation_level=0, session_id=0, session_epoch=-1, topics=topics,
                              forgotten_topics_data=[], rack_id=""), 7)
    head = RequestHead(frame, len(frame))
    got = fetch_request_topics(frame, head.body_offset, version)
    assert got == (ids if version >= 13 else ["t-0", "t-1"])
    from kthrottle.codecs import ProtocolError

    for cut in (head.body_offset + 20, head.body_offset + 40, len(frame) - 30):
        with pytest.raises(ProtocolError):
            fetch_request_topics(frame[:cut], head.body_offset, version)


def share_fetch(cid, group, topics=(), acknowledging=False, epoch=1):
    """ShareFetch v1 (ShareFetchRequest.json) of ``topics`` ([(topic id, [partition, ...])]),
    each partition acknowledging one batch when ``acknowledging``."""
    batch = (struct.pack(">qq", 0, 9) + b"\x02\x01\x00") if acknowledging else b""
    entries = b"".join(
        tid.bytes + bytes([len(parts) + 1]) + b"".join(
            struct.pack(">i", p) + bytes([2 if acknowledging else 1]) + batch + b"\x00"
            for p in parts) + b"\x00"
        for tid, parts in topics)
    body = (b"\x00" + _cstr(group) + _cstr("member-1")
            + struct.pack(">iiiiii", epoch, 500, 1, 1 << 20, 500, 500)
            + bytes([len(topics) + 1]) + entries + b"\x01" + b"\x00")
    return raw_request(cid, 78, 1, body)


def test_a_share_fetch_of_her_topic_and_bobs_goes_on_with_hers_and_bobs_refused_in_the_answer():
    """KIP-932: ShareFetch names its topics by id; each needs READ, as Kafka
    checks it, and a refused one is answered in the broker's answer."""
    from kthrottle.codecs import share_topics

    h = harness(view_of())  # alice: her own topics only
    h.client(metadata(43, ["alice-t", "bob-t"]))  # (the ids, from the answers she gets)
    h.take_broker()
    h.broker(metadata_answer(43, ["alice-t", "bob-t"]))
    h.take_client()
    for cid, acknowledging in ((44, False), (46, True)):
        h.client(share_fetch(cid, "alice-g", [(BOB_TOPIC_ID, [0, 1]), (ALICE_TOPIC_ID, [0])],
                             acknowledging, epoch=0))
        assert h.take_broker() == share_fetch(cid, "alice-g", [(ALICE_TOPIC_ID, [0])],
                                              acknowledging, epoch=0)
        # the broker's answer for hers (its layout as Kafka writes it, error 0 on each partition)
        broker = share_topics.refused_response(78, 1, cid, [(ALICE_TOPIC_ID, [0])], 0)
        h.broker(broker)
        refused = share_topics.refused_response(78, 1, cid, [(BOB_TOPIC_ID, [0, 1])],
                                                TOPIC_AUTHORIZATION_FAILED,
                                                acknowledgements=acknowledging)
        assert h.take_client() == share_topics.add_topics(78, 1, broker, refused)
    # only bob's: the request still goes on (the broker keeps the share session's epoch)
    h.client(share_fetch(47, "alice-g", [(BOB_TOPIC_ID, [0])]))
    assert h.take_broker() == share_fetch(47, "alice-g", [])
    assert h.closed is None
    # a tenant allowed to read every topic: as it came
    everything = ALICE_ACLS + (acl(ResourceType.TOPIC, "*", "User:alice", Op.READ,
                                   pattern=PatternType.LITERAL),)
    h = harness(view_of(everything))
    request = share_fetch(45, "alice-g", [(BOB_TOPIC_ID, [0])])
    h.client(request)
    assert h.take_broker() == request and h.closed is None


def test_a_head_patched_after_a_request_was_replaced_patches_the_new_request():
    """A later filter's Forward (a patched head, as the quota's Fetch cap gives)
    applies to the request the authorization filter replaced, not to the one
    the client sent."""
    from kthrottle.proxy.filter import HEAD, NOTHING, Filter, Forward
    from kthrottle.codecs.wire import INT32

    class PatchMaxWait(Filter):
        name = "patch-max-wait"

        def request_need(self, api_key, api_version):
            return HEAD if api_key == 1 else NOTHING

        def on_request(self, ctx, head, inflight):
            patched = bytearray(head.buf[:head.body_offset + 8])
            INT32.pack_into(patched, head.body_offset + 4, 1234)  # max_wait_ms (v12)
            return Forward(bytes(patched))

    h = Harness(filters=registry.standard_filters(advertise) + [Authorization(view_of()),
                                                                PatchMaxWait()],
                connect=False)
    h.conn.client_host = "10.0.0.1"
    h.run(h.conn.client_accepted(h.now, principal="alice"))
    h.client(fetch(60, {"alice-t": [0], "bob-t": [0]}))
    got = decoded(FetchRequest, 12, h.take_broker())
    assert [t.topic for t in got.topics] == ["alice-t"] and got.max_wait_ms == 1234
    assert h.closed is None


# requests naming several groups, transactional ids or resources, some refused -------
# (Kafka answers each refused one with its error and serves the rest)

from kthrottle.codecs import acl_requests as wire  # noqa: E402


def req(key, version, cid, **fields):
    return framed(wire.request_class(key)[version](**fields), cid)


def resp(key, version, cid, **fields):
    return wire.response_for(key, version, cid, **fields)


def sub(cls, field):
    return cls.fields[field].data_class


def got(key, version, frame):
    return decoded(wire.response_class(key), version, frame)


def sent(key, version, frame):
    return decoded(wire.request_class(key), version, frame)


def test_describe_groups_of_hers_and_bobs_gets_bobs_refused_in_the_brokers_answer():
    h = harness(view_of())
    h.client(req(15, 5, 80, groups=["alice-g", "bob-g"], include_authorized_operations=False))
    assert sent(15, 5, h.take_broker()).groups == ["alice-g"]
    G = sub(wire.response_class(15)[5], "groups")
    h.broker(resp(15, 5, 80, groups=[G(error_code=0, group_id="alice-g", group_state="Stable",
                                       protocol_type="consumer", protocol_data="range",
                                       members=[], authorized_operations=None)]))
    answer = got(15, 5, h.take_client())
    assert [(g.group_id, g.error_code, g.group_state) for g in answer.groups] == [
        ("alice-g", 0, "Stable"), ("bob-g", GROUP_AUTHORIZATION_FAILED, "")]


def test_delete_groups_of_hers_and_bobs_deletes_hers_only():
    view = view_of(ALICE_ACLS + (acl(ResourceType.GROUP, "alice-", "User:alice", Op.DELETE),))
    h = harness(view)
    h.client(req(42, 2, 81, groups_names=["bob-g", "alice-g"]))
    assert sent(42, 2, h.take_broker()).groups_names == ["alice-g"]
    R = sub(wire.response_class(42)[2], "results")
    h.broker(resp(42, 2, 81, results=[R(group_id="alice-g", error_code=0)]))
    assert sorted((r.group_id, r.error_code) for r in got(42, 2, h.take_client()).results) == [
        ("alice-g", 0), ("bob-g", GROUP_AUTHORIZATION_FAILED)]


def test_offset_fetch_v8_of_two_groups_refuses_bobs_group_and_bobs_topic_in_hers():
    h = harness(view_of())
    Q = wire.request_class(9)[8]
    QG = sub(Q, "groups")
    QT = sub(QG, "topics")
    h.client(framed(Q(groups=[
        QG(group_id="alice-g", topics=[QT(name="alice-t", partition_indexes=[0]),
                                       QT(name="bob-t", partition_indexes=[0, 1])]),
        QG(group_id="bob-g", topics=None)], require_stable=False), 82))
    asked = sent(9, 8, h.take_broker())
    assert [(g.group_id, [t.name for t in g.topics]) for g in asked.groups] == [
        ("alice-g", ["alice-t"])]
    R = wire.response_class(9)[8]
    RG = sub(R, "groups")
    RT = sub(RG, "topics")
    RP = sub(RT, "partitions")
    h.broker(resp(9, 8, 82, groups=[RG(group_id="alice-g", error_code=0, topics=[
        RT(name="alice-t", partitions=[RP(partition_index=0, committed_offset=42,
                                          committed_leader_epoch=-1, metadata="",
                                          error_code=0)])])]))
    answer = got(9, 8, h.take_client())
    assert {g.group_id: (g.error_code, {(t.name, p.partition_index, p.committed_offset,
                                         p.error_code) for t in g.topics for p in t.partitions})
            for g in answer.groups} == {
        "alice-g": (0, {("alice-t", 0, 42, 0), ("bob-t", 0, -1, TOPIC_AUTHORIZATION_FAILED),
                        ("bob-t", 1, -1, TOPIC_AUTHORIZATION_FAILED)}),
        "bob-g": (GROUP_AUTHORIZATION_FAILED, set())}


def test_offset_fetch_v5_of_every_topic_keeps_only_what_she_may_describe():
    h = harness(view_of())
    h.client(req(9, 5, 83, group_id="alice-g", topics=None))
    h.take_broker()
    R = wire.response_class(9)[5]
    RT = sub(R, "topics")
    RP = sub(RT, "partitions")

    def topic(name):
        return RT(name=name, partitions=[RP(partition_index=0, committed_offset=7,
                                            committed_leader_epoch=-1, metadata="",
                                            error_code=0)])

    h.broker(resp(9, 5, 83, topics=[topic("alice-t"), topic("bob-t")], error_code=0))
    assert [t.name for t in got(9, 5, h.take_client()).topics] == ["alice-t"]


def test_describe_configs_of_her_topic_and_bobs_and_the_brokers():
    view = view_of(ALICE_ACLS + (acl(ResourceType.TOPIC, "alice-", "User:alice",
                                     Op.DESCRIBE_CONFIGS),))
    h = harness(view)
    Q = wire.request_class(32)[4]
    QR = sub(Q, "resources")
    h.client(framed(Q(resources=[QR(resource_type=2, resource_name="alice-t",
                                    configuration_keys=None),
                                 QR(resource_type=2, resource_name="bob-t",
                                    configuration_keys=None),
                                 QR(resource_type=4, resource_name="1",
                                    configuration_keys=None)],
                      include_synonyms=False, include_documentation=False), 84))
    assert [r.resource_name for r in sent(32, 4, h.take_broker()).resources] == ["alice-t"]
    RR = sub(wire.response_class(32)[4], "results")
    h.broker(resp(32, 4, 84, results=[RR(error_code=0, error_message=None, resource_type=2,
                                         resource_name="alice-t", configs=[])]))
    assert [(r.resource_name, r.error_code) for r in got(32, 4, h.take_client()).results] == [
        ("alice-t", 0), ("bob-t", TOPIC_AUTHORIZATION_FAILED),
        ("1", CLUSTER_AUTHORIZATION_FAILED)]


def test_describe_transactions_refuses_the_ids_she_may_not_describe():
    view = view_of(ALICE_ACLS + (acl(ResourceType.TRANSACTIONAL_ID, "alice-", "User:alice",
                                     Op.DESCRIBE),))
    h = harness(view)
    h.client(req(65, 0, 85, transactional_ids=["alice-tx", "bob-tx"]))
    assert sent(65, 0, h.take_broker()).transactional_ids == ["alice-tx"]
    S = sub(wire.response_class(65)[0], "transaction_states")
    h.broker(resp(65, 0, 85, transaction_states=[S(
        error_code=0, transactional_id="alice-tx", transaction_state="Ongoing",
        transaction_timeout_ms=60000, transaction_start_time_ms=1, producer_id=5,
        producer_epoch=0, topics=[])]))
    assert [(t.transactional_id, t.error_code) for t in
            got(65, 0, h.take_client()).transaction_states] == [
        ("alice-tx", 0), ("bob-tx", TRANSACTIONAL_ID_AUTHORIZATION_FAILED)]


def test_list_transactions_lists_only_the_ids_she_may_describe():
    view = view_of(ALICE_ACLS + (acl(ResourceType.TRANSACTIONAL_ID, "alice-", "User:alice",
                                     Op.DESCRIBE),))
    h = harness(view)
    h.client(req(66, 1, 86, state_filters=[], producer_id_filters=[], duration_filter=-1))
    assert req_cids(h.take_broker()) == [86]
    S = sub(wire.response_class(66)[1], "transaction_states")
    h.broker(resp(66, 1, 86, error_code=0, unknown_state_filters=[], transaction_states=[
        S(transactional_id=t, producer_id=1, transaction_state="Ongoing")
        for t in ("alice-tx", "bob-tx")]))
    assert [t.transactional_id for t in got(66, 1, h.take_client()).transaction_states] == [
        "alice-tx"]


def test_describe_topic_partitions_of_every_topic_leaves_out_bobs():
    h = harness(view_of())
    h.client(req(75, 0, 87, topics=[], response_partition_limit=2000, cursor=None))
    assert req_cids(h.take_broker()) == [87]
    T = sub(wire.response_class(75)[0], "topics")

    def topic(name):
        return T(error_code=0, name=name, topic_id=TOPIC_IDS[name], is_internal=False,
                 partitions=[], topic_authorized_operations=NOT_ASKED_OPS)

    mine = topic("alice-t")
    mine.topic_authorized_operations = 0xFF8  # what the proxy's principal may: everything
    h.broker(resp(75, 0, 87, topics=[mine, topic("bob-t")], next_cursor=None))
    answer = got(75, 0, h.take_client())
    assert [t.name for t in answer.topics] == ["alice-t"]
    # KIP-430: what she may do (READ, WRITE, DESCRIBE), not the proxy's principal
    assert answer.topics[0].topic_authorized_operations == (1 << 3) | (1 << 4) | (1 << 8)
    # named: bob's refused in the broker's answer
    h.client(req(75, 0, 88, topics=[sub(wire.request_class(75)[0], "topics")(name=n)
                                    for n in ("alice-t", "bob-t")],
                 response_partition_limit=2000, cursor=None))
    assert [t.name for t in sent(75, 0, h.take_broker()).topics] == ["alice-t"]
    h.broker(resp(75, 0, 88, topics=[topic("alice-t")], next_cursor=None))
    assert [(t.name, t.error_code) for t in got(75, 0, h.take_client()).topics] == [
        ("alice-t", 0), ("bob-t", TOPIC_AUTHORIZATION_FAILED)]


NOT_ASKED_OPS = -2 ** 31  # Kafka's "not asked for"


def test_add_partitions_to_txn_v3_with_bobs_topic_fails_whole_as_kafka_fails_it():
    view = view_of(ALICE_ACLS + (acl(ResourceType.TRANSACTIONAL_ID, "alice-", "User:alice",
                                     Op.WRITE),))
    h = harness(view)
    T = sub(wire.request_class(24)[3], "v3_and_below_topics")
    h.client(req(24, 3, 89, v3_and_below_transactional_id="alice-tx",
                 v3_and_below_producer_id=5, v3_and_below_producer_epoch=0,
                 v3_and_below_topics=[T(name="alice-t", partitions=[0]),
                                      T(name="bob-t", partitions=[1, 2])]))
    assert h.take_broker() == b""
    answer = got(24, 3, h.take_client())
    assert {(t.name, p.partition_index, p.partition_error_code)
            for t in answer.results_by_topic_v3_and_below for p in t.results_by_partition} == {
        ("alice-t", 0, 55), ("bob-t", 1, TOPIC_AUTHORIZATION_FAILED),
        ("bob-t", 2, TOPIC_AUTHORIZATION_FAILED)}
    assert h.closed is None


def session_fetch(cid, topics, session_id, epoch, version=12):
    """A Fetch in a fetch session (KIP-227): epoch 0 opens one, more continue it."""
    F = FetchRequest
    P = F.FetchTopic.FetchPartition
    return framed(F[version](
        replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20, isolation_level=0,
        session_id=session_id, session_epoch=epoch,
        topics=[F.FetchTopic(topic=name, partitions=[
            P(partition=i, current_leader_epoch=-1, fetch_offset=5, last_fetched_epoch=-1,
              log_start_offset=-1, partition_max_bytes=1 << 20) for i in parts])
            for name, parts in topics.items()],
        forgotten_topics_data=[], rack_id=""), cid)


def test_after_a_change_of_acls_a_fetch_session_is_opened_again_with_a_full_request():
    """The broker serves a session's partitions whether the incremental request
    names them or not: once the ACLs change, the proxy has the client open a new
    session (FETCH_SESSION_ID_NOT_FOUND), whose full request it checks whole."""
    view = view_of(ALICE_ACLS + (acl(ResourceType.TOPIC, "bob-t", "User:alice", Op.READ,
                                     pattern=PatternType.LITERAL),))
    h = harness(view)
    full = session_fetch(1, {"alice-t": [0], "bob-t": [0]}, 0, 0)
    h.client(full)
    assert h.take_broker() == full
    h.broker(fetch_answer(1, {"alice-t": [0], "bob-t": [0]}))
    h.take_client()
    incremental = session_fetch(2, {}, 77, 1)
    h.client(incremental)
    assert h.take_broker() == incremental  # ACLs unchanged: as it came
    h.broker(fetch_answer(2, {}))
    h.take_client()
    # bob takes his topic back
    view.update(AclSnapshot(True, ALICE_ACLS, frozenset(), False))
    h.client(session_fetch(3, {}, 77, 2))
    assert h.take_broker() == b""
    answer = decoded(FetchResponse, 12, h.take_client())
    assert (answer.error_code, answer.session_id, answer.responses) == (70, 0, [])
    # the client opens a new session: its full request is checked, bob's topic refused
    h.client(session_fetch(4, {"alice-t": [0], "bob-t": [0]}, 0, 0))
    sent = decoded(FetchRequest, 12, h.take_broker())
    assert [t.topic for t in sent.topics] == ["alice-t"]
    h.broker(fetch_answer(4, {"alice-t": [0]}))
    h.take_client()
    incremental = session_fetch(5, {}, 78, 1)
    h.client(incremental)
    assert h.take_broker() == incremental
    assert h.closed is None


def describe_share_group_offsets(cid, groups):
    """DescribeShareGroupOffsets v0 of ``groups`` ({group: [topic] or None})."""
    body = b"\x00" + bytes([len(groups) + 1])
    for group, topics in groups.items():
        body += _cstr(group)
        if topics is None:
            body += b"\x00"
        else:
            body += bytes([len(topics) + 1]) + b"".join(
                _cstr(t) + b"\x02" + struct.pack(">i", 0) + b"\x00" for t in topics)
        body += b"\x00"
    return raw_request(cid, 90, 0, body + b"\x00")


def test_describe_share_group_offsets_of_her_own_groups_and_topics_reaches_the_broker_as_sent():
    h = harness(view_of())
    request = describe_share_group_offsets(90, {"alice-g": ["alice-t"]})
    h.client(request)
    assert h.take_broker() == request and h.closed is None


def share_offsets_answer(cid, groups, version=0):
    """DescribeShareGroupOffsets answer of ``groups`` ({group: [topic] or an error code})."""
    from kthrottle.codecs import share_offsets as so

    G = so.DescribeShareGroupOffsetsResponse[version].DescribeShareGroupOffsetsResponseGroup
    T = G.DescribeShareGroupOffsetsResponseTopic
    P = T.DescribeShareGroupOffsetsResponsePartition
    entries = []
    for group, topics in groups.items():
        if isinstance(topics, int):
            entries.append(G(group_id=group, topics=[], error_code=topics))
            continue
        entries.append(G(group_id=group, error_code=0, topics=[
            T(topic_name=t, topic_id=TOPIC_IDS[t], partitions=[
                P(partition_index=0, start_offset=5, leader_epoch=1, error_code=0)])
            for t in topics]))
    return so.response(90, version, cid, groups=entries)


def test_describe_share_group_offsets_answers_refused_groups_and_topics_in_their_places():
    """As Kafka answers it: a refused group in its place with GROUP_AUTHORIZATION_FAILED, a
    refused topic after the group's others with TOPIC_AUTHORIZATION_FAILED on each partition
    (StartOffset -1, its message), and a group naming no topics gets only those she may
    describe; the broker sees neither bob's group nor bob's topic."""
    from kthrottle.codecs import share_offsets as so

    h = harness(view_of())
    h.client(describe_share_group_offsets(
        7, {"alice-g": ["alice-t", "bob-t"], "bob-g": ["alice-t"], "alice-h": None}))
    sent = so.decode_request(90, 0, h.take_broker())
    assert [(g.group_id, None if g.topics is None else [t.topic_name for t in g.topics])
            for g in sent.groups] == [("alice-g", ["alice-t"]), ("alice-h", None)]
    h.broker(share_offsets_answer(7, {"alice-g": ["alice-t"], "alice-h": ["alice-t", "bob-t"]}))
    answer = so.decode_response(90, 0, h.take_client())
    assert [g.group_id for g in answer.groups] == ["alice-g", "bob-g", "alice-h"]
    mine, bobs, every = answer.groups
    assert [(t.topic_name, [(p.start_offset, p.error_code) for p in t.partitions])
            for t in mine.topics] == [("alice-t", [(5, 0)]), ("bob-t", [(-1, 29)])]
    assert mine.topics[1].partitions[0].error_message == "Topic authorization failed."
    assert mine.topics[1].topic_id is None  # the zero id, as kafka-python reads it
    assert (bobs.error_code, bobs.error_message, bobs.topics) == (30, None, [])
    assert [t.topic_name for t in every.topics] == ["alice-t"]
    assert h.closed is None


def test_describe_share_group_offsets_of_only_refused_groups_is_answered_without_the_broker():
    from kthrottle.codecs import share_offsets as so

    h = harness(view_of())
    h.client(describe_share_group_offsets(8, {"bob-g": ["bob-t"], "bob-h": None}))
    assert h.take_broker() == b""
    answer = so.decode_response(90, 0, h.take_client())
    assert [(g.group_id, g.error_code) for g in answer.groups] == [("bob-g", 30), ("bob-h", 30)]


def test_a_group_error_from_the_broker_is_the_groups_whole_answer():
    from kthrottle.codecs import share_offsets as so

    h = harness(view_of())
    h.client(describe_share_group_offsets(9, {"alice-g": ["alice-t", "bob-t"]}))
    h.take_broker()
    h.broker(share_offsets_answer(9, {"alice-g": 69}))  # GROUP_ID_NOT_FOUND
    answer = so.decode_response(90, 0, h.take_client())
    assert [(g.group_id, g.error_code, g.topics) for g in answer.groups] == [("alice-g", 69, [])]


def alter_share_offsets(cid, group, topics):
    from kthrottle.codecs import share_offsets as so

    R = so.AlterShareGroupOffsetsRequest[0]
    T = R.AlterShareGroupOffsetsRequestTopic
    P = T.AlterShareGroupOffsetsRequestPartition
    return framed(R(group_id=group, topics=[
        T(topic_name=t, partitions=[P(partition_index=0, start_offset=3),
                                    P(partition_index=1, start_offset=4)]) for t in topics]), cid)


def delete_share_offsets(cid, group, topics):
    from kthrottle.codecs import share_offsets as so

    R = so.DeleteShareGroupOffsetsRequest[0]
    return framed(R(group_id=group, topics=[R.DeleteShareGroupOffsetsRequestTopic(topic_name=t)
                                            for t in topics]), cid)


def test_alter_share_group_offsets_needs_read_on_the_group_and_on_each_topic():
    """KIP-932's AlterShareGroupOffsets, as Kafka 4.4 checks it: READ on the group (its
    top-level error, with the error's message), READ on each topic; bob's topic is left out
    of the request and answered first, each partition refused, with its id where known."""
    from kthrottle.codecs import share_offsets as so

    h = harness(view_of())
    h.client(metadata(1, ["alice-t", "bob-t"]))
    h.take_broker()
    h.broker(metadata_answer(1, ["alice-t", "bob-t"]))
    h.take_client()
    h.client(alter_share_offsets(2, "bob-g", ["alice-t"]))
    assert h.take_broker() == b""
    refused = so.decode_response(91, 0, h.take_client())
    assert (refused.error_code, refused.error_message) == (30, "Group authorization failed.")
    h.client(alter_share_offsets(3, "alice-g", ["alice-t", "bob-t"]))
    assert h.take_broker() == alter_share_offsets(3, "alice-g", ["alice-t"])
    R = so.AlterShareGroupOffsetsResponse[0]
    T = R.AlterShareGroupOffsetsResponseTopic
    h.broker(so.encode_response(R(error_code=0, responses=[T(
        topic_name="alice-t", topic_id=ALICE_TOPIC_ID, partitions=[
            T.AlterShareGroupOffsetsResponsePartition(partition_index=0, error_code=0)])]), 3))
    answer = so.decode_response(91, 0, h.take_client())
    assert [(t.topic_name, t.topic_id, [(p.partition_index, p.error_code, p.error_message)
                                        for p in t.partitions]) for t in answer.responses] == [
        ("bob-t", BOB_TOPIC_ID, [(0, 29, "Topic authorization failed."),
                                 (1, 29, "Topic authorization failed.")]),
        ("alice-t", ALICE_TOPIC_ID, [(0, 0, None)])]
    assert h.closed is None


def test_delete_share_group_offsets_needs_delete_on_the_group_and_read_on_each_topic():
    from kthrottle.codecs import share_offsets as so

    h = harness(view_of(ALICE_ACLS + (acl(ResourceType.GROUP, "alice-", "User:alice",
                                          Op.DELETE),)))
    h.client(delete_share_offsets(1, "bob-g", ["alice-t"]))
    assert h.take_broker() == b""
    assert so.decode_response(92, 0, h.take_client()).error_code == 30
    h.client(delete_share_offsets(2, "alice-g", ["bob-t", "alice-t"]))
    assert h.take_broker() == delete_share_offsets(2, "alice-g", ["alice-t"])
    R = so.DeleteShareGroupOffsetsResponse[0]
    T = R.DeleteShareGroupOffsetsResponseTopic
    h.broker(so.encode_response(R(error_code=0, responses=[
        T(topic_name="alice-t", topic_id=ALICE_TOPIC_ID, error_code=0)]), 2))
    answer = so.decode_response(92, 0, h.take_client())
    assert [(t.topic_name, t.error_code, t.error_message) for t in answer.responses] == [
        ("bob-t", 29, "Topic authorization failed."), ("alice-t", 0, None)]
    # a top-level error (the group is not empty, say) is the whole answer
    h.client(delete_share_offsets(3, "alice-g", ["bob-t", "alice-t"]))
    h.take_broker()
    h.broker(so.encode_response(R(error_code=68, error_message="not empty", responses=[]), 3))
    answer = so.decode_response(92, 0, h.take_client())
    assert (answer.error_code, answer.responses) == (68, [])
    assert h.closed is None


def test_a_truncated_describe_share_group_offsets_closes_with_a_clear_reason():
    h = harness(view_of())
    request = describe_share_group_offsets(91, {"alice-g": ["alice-t"]})
    cut = request[4:-8]  # a whole frame whose fields run past its end
    h.client(struct.pack(">i", len(cut)) + cut)
    assert h.take_broker() == b""
    assert "malformed api key 90" in h.closed


def test_after_a_change_of_acls_a_share_session_is_opened_again():
    """As a fetch session: a share session's incremental requests name only what
    changed, so after a change of ACLs the client is told SHARE_SESSION_NOT_FOUND
    (Kafka's client then opens a new one, whose first request names every partition)."""
    view = view_of(ALICE_ACLS + (acl(ResourceType.TOPIC, "bob-t", "User:alice", Op.READ,
                                     pattern=PatternType.LITERAL),))
    h = harness(view)
    h.client(metadata(1, ["alice-t", "bob-t"]))
    h.take_broker()
    h.broker(metadata_answer(1, ["alice-t", "bob-t"]))
    h.take_client()
    both = [(ALICE_TOPIC_ID, [0]), (BOB_TOPIC_ID, [0])]
    opening = share_fetch(2, "alice-g", both, epoch=0)
    h.client(opening)
    assert h.take_broker() == opening
    h.broker(share_topics_answer(2, both))
    h.take_client()
    incremental = share_fetch(3, "alice-g", [], epoch=1)
    h.client(incremental)
    assert h.take_broker() == incremental
    h.broker(share_topics_answer(3, []))
    h.take_client()
    view.update(AclSnapshot(True, ALICE_ACLS, frozenset(), False))  # bob's back to bob
    h.client(share_fetch(4, "alice-g", [], epoch=2))
    assert h.take_broker() == b""
    assert heartbeat_error(h.take_client()) == 122  # ThrottleTimeMs, then ErrorCode
    h.client(share_fetch(5, "alice-g", both, epoch=0))
    assert h.take_broker() == share_fetch(5, "alice-g", [(ALICE_TOPIC_ID, [0])], epoch=0)
    assert h.closed is None


def share_topics_answer(cid, topics):
    from kthrottle.codecs import share_topics

    return share_topics.refused_response(78, 1, cid, topics, 0)


def streams_heartbeat(cid, group, subtopologies):
    """StreamsGroupHeartbeat v0 (KIP-1071) of ``group`` with a Topology of ``subtopologies``."""
    from test_streams_topology import cstr, uvarint

    topology = (b"\x01" + struct.pack(">i", 1) + uvarint(len(subtopologies) + 1)
                + b"".join(subtopologies) + b"\x00")
    body = (b"\x00" + cstr(group) + cstr("m") + struct.pack(">ii", 0, 0) + cstr(None)
            + cstr(None) + struct.pack(">i", -1) + topology
            + b"\x00\x00\x00" + cstr(None) + b"\xff" + b"\x00\x00\x00" + b"\x00" + b"\x00")
    return raw_request(cid, 88, 0, body)


def test_a_streams_heartbeat_needs_describe_on_its_topologys_topics():
    """KIP-1071: Kafka checks DESCRIBE on every topic of the topology (sources,
    repartition sinks and sources, changelogs), TOPIC_AUTHORIZATION_FAILED if one is refused;
    an invalid topology is the broker's to answer, as it does before any check."""
    from test_streams_topology import subtopology

    h = harness(view_of())
    mine = streams_heartbeat(1, "alice-g", [subtopology(sources=["alice-t"],
                                                       changelogs=["alice-g-store-changelog"])])
    h.client(mine)
    assert h.take_broker() == mine
    h.broker(cg_heartbeat_answer(1, []))
    h.take_client()
    h.client(streams_heartbeat(2, "alice-g", [subtopology(sources=["alice-t"]),
                                              subtopology(sinks=["bob-t"])]))
    assert h.take_broker() == b""
    out = h.take_client()
    assert cids(out) == [2] and heartbeat_error(out) == TOPIC_AUTHORIZATION_FAILED
    invalid = streams_heartbeat(3, "alice-g", [subtopology(sources=["bob t"])])
    h.client(invalid)
    assert h.take_broker() == invalid  # STREAMS_INVALID_TOPOLOGY comes from the broker
    h.client(streams_heartbeat(4, "bob-g", [subtopology(sources=["alice-t"])]))
    h.broker(cg_heartbeat_answer(3, []))
    out = frames_of(h.take_client())
    assert heartbeat_error(out[-1]) == GROUP_AUTHORIZATION_FAILED
    assert h.closed is None
