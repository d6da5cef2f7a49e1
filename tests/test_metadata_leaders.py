"""codecs.metadata_leaders against frames kafka-python's schema classes write,
every Metadata version: the leaders named, errors and unnamed topics left
out, a cut frame refused."""
import uuid

import pytest

from kthrottle.codecs import ProtocolError, apis
from kthrottle.codecs.metadata_leaders import MAX_VERSION, metadata_leaders
from kthrottle_testkit.frames import MetadataResponse, frame_response

pytestmark = pytest.mark.unit


def _frame(version, topics):
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    body = [T(error_code=err, name=name, topic_id=uuid.UUID(int=i + 1), is_internal=False,
              partitions=[P(error_code=perr, partition_index=p, leader_id=leader,
                            leader_epoch=4, replica_nodes=[1, 2, 3], isr_nodes=[1, 2],
                            offline_replicas=[3])
                          for p, leader, perr in parts])
            for i, (err, name, parts) in enumerate(topics)]
    brokers = [M.MetadataResponseBroker(node_id=n, host="kafka-%d" % n, port=9092, rack="r")
               for n in (1, 2, 3)]
    return frame_response(apis.METADATA, version, M[version](
        throttle_time_ms=1, brokers=brokers, cluster_id="c", controller_id=1, topics=body,
        error_code=0).encode())


@pytest.mark.parametrize("version", range(MAX_VERSION + 1))
def test_every_version_names_each_partitions_leader(version):
    frame = _frame(version, [(0, "orders", [(0, 1, 0), (1, 2, 0), (2, 3, 9)]),
                             (3, "gone", []),  # UNKNOWN_TOPIC_OR_PARTITION
                             (0, "pay", [(0, -1, 5), (1, 2, 0)])])  # 5: LEADER_NOT_AVAILABLE
    assert metadata_leaders(frame, version) == {
        ("orders", 0): 1, ("orders", 1): 2, ("orders", 2): 3, ("pay", 1): 2}


def test_a_frame_cut_short_is_refused():
    frame = _frame(12, [(0, "orders", [(0, 1, 0), (1, 2, 0)])])
    for cut in (10, 40, len(frame) - 30):
        with pytest.raises(ProtocolError):
            metadata_leaders(frame[:cut], 12)


def test_a_version_past_the_known_ones_is_refused():
    with pytest.raises(ProtocolError, match="not a version"):
        metadata_leaders(_frame(13, []), MAX_VERSION + 1)
