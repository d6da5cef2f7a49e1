"""kthrottle/codecs/share_topics.py: the topics of ShareFetch (78) and ShareAcknowledge (79)
requests, the requests without the refused ones, the broker's answer for refused topics, and
that answer spliced into a broker's response, compared byte for byte with what Kafka 4.4's own
generated message classes serialize (tests/java/ShareTopics.java, one JVM run for the whole
module; its refused answers are built with the helpers KafkaApis builds them with)."""
import struct
import uuid
from pathlib import Path

import pytest

from kthrottle.codecs.errors import ProtocolError
from kthrottle.codecs.share_topics import (
    add_topics,
    refusal_options,
    refused_response,
    request_partitions,
    request_topics,
    request_without,
)
from kthrottle.kafka_kit import KafkaMissing, java_program_output

pytestmark = pytest.mark.integration

CORRELATION_ID = 7  # ShareTopics.java's
VERSIONS = {78: (1, 2), 79: (1, 2)}  # exactly those Kafka 4.4's client jar knows
CASES = {"acks", "plain", "wide", "dup", "empty", "many"}
V2_CASES = {"renew", "renew-noacks"}
CODES = (29, 3)
LOCKS = (0, 30000)
TOPIC_AUTHORIZATION_FAILED = 29


@pytest.fixture(scope="module")
def java(tmp_path_factory):
    """ShareTopics.java's output, run once: {"range": {key: versions}, "request": {(key, v,
    case): (frame, body offset)}, "topics": {(key, v, case): [(UUID, [partitions])]},
    "options": {(key, v, case): (acks, renew)}, "kept": {(key, v, case, pattern): frame},
    "refused": {(key, v, case, pattern, code, lock): frame}, "broker": {(key, v, case,
    pattern): frame}, "merged": {(key, v, case, pattern, code): frame}}."""
    try:
        output = java_program_output(Path(__file__).parent / "java" / "ShareTopics.java",
                                     "ShareTopics", tmp_path_factory.mktemp("share-topics"))
    except KafkaMissing as e:
        pytest.skip(str(e))
    found = {what: {} for what in ("range", "request", "topics", "options", "kept", "refused",
                                   "broker", "merged")}
    for line in output.splitlines():
        what, key, rest = line.split(" ", 2)
        key = int(key)
        if what == "range":
            low, high = map(int, rest.split())
            found["range"][key] = tuple(range(low, high + 1))
            continue
        version, case, *fields = rest.split(" ")
        at = (key, int(version), case)
        if what == "request":
            found[what][at] = (bytes.fromhex(fields[1]), int(fields[0]))
        elif what == "topics":
            found[what][at] = [] if fields[0] == "-" else [
                (uuid.UUID(topic_id), [int(p) for p in parts.split(",")])
                for topic_id, parts in (entry.split(":") for entry in fields[0].split(";"))]
        elif what == "options":
            found[what][at] = (fields[0] == "1", fields[1] == "1")
        else:
            pattern = "" if fields[0] == "-" else fields[0]
            numbers = tuple(int(n) for n in fields[1:-1])
            found[what][at + (pattern,) + numbers] = bytes.fromhex(fields[-1])
    return found


def keeper(pattern, topics):
    """keep(topic_id) for a pattern: a character per distinct id, in order, 1 kept."""
    ids = list(dict.fromkeys(topic_id for topic_id, _ in topics))
    assert len(ids) == len(pattern)
    kept = {topic_id for topic_id, bit in zip(ids, pattern) if bit == "1"}
    return lambda topic_id: topic_id in kept


def refused_parts(java, key, version, case, pattern):
    frame, offset = java["request"][key, version, case]
    topics = request_partitions(key, version, frame, offset)
    keep = keeper(pattern, topics)
    return [(t, p) for t, p in topics if not keep(t)], refusal_options(key, version, frame, offset)


def test_the_versions_covered_are_those_kafka_knows(java):
    assert java["range"] == VERSIONS
    for key, versions in VERSIONS.items():
        for version in versions:
            cases = {c for k, v, c in java["request"] if (k, v) == (key, version)}
            assert cases == CASES | (V2_CASES if version >= 2 else set())


def test_topics_and_partitions_read_from_kafkas_requests(java):
    assert len(java["request"]) == 2 * (6 + 8)
    for (key, version, case), (frame, offset) in java["request"].items():
        expected = java["topics"][key, version, case]
        assert request_partitions(key, version, frame, offset) == expected, (key, version, case)
        assert request_topics(key, version, frame, offset) == [t for t, _ in expected]
        # a memoryview and a bytearray read the same
        assert request_topics(key, version, memoryview(frame), offset) == [
            t for t, _ in expected]
        assert request_partitions(key, version, bytearray(frame), offset) == expected
    # ForgottenTopicsData is not read as topics: D is forgotten only
    frame, offset = java["request"][78, 1, "empty"]
    assert request_topics(78, 1, frame, offset) == []
    assert java["topics"][78, 2, "many"][129] == (
        uuid.UUID("00000000000010810000000000002081"), [0])


def test_refusal_options_are_what_the_broker_reads(java):
    for (key, version, case), (frame, offset) in java["request"].items():
        acks, renew = java["options"][key, version, case]
        expected = {"acknowledgements": acks, "renew_ack": renew} if key == 78 else {}
        assert refusal_options(key, version, frame, offset) == expected, (key, version, case)
    assert refusal_options(78, 2, *java["request"][78, 2, "renew"]) == {
        "acknowledgements": True, "renew_ack": True}
    assert refusal_options(78, 1, *java["request"][78, 1, "plain"]) == {
        "acknowledgements": False, "renew_ack": False}


def test_requests_without_refused_topics_are_kafkas_bytes(java):
    assert len(java["kept"]) == 2 * (2 * (8 + 8 + 4 + 4 + 1 + 4) + 8 + 4)  # v1 and v2, v2's renewals
    for (key, version, case, pattern), kept in java["kept"].items():
        frame, offset = java["request"][key, version, case]
        keep = keeper(pattern, java["topics"][key, version, case])
        asked = []

        def counting(topic_id):
            asked.append(topic_id)
            return keep(topic_id)

        assert request_without(key, version, frame, offset, counting) == kept, (
            key, version, case, pattern)
        assert asked == request_topics(key, version, frame, offset)  # once per entry, in order
        assert request_without(key, version, memoryview(frame), offset, keep) == kept
        # and the kept request reads back as the kept topics
        assert request_topics(key, version, kept, offset) == [
            t for t in request_topics(key, version, frame, offset) if keep(t)]


def test_keeping_every_topic_gives_the_same_bytes(java):
    for (key, version, case), (frame, offset) in java["request"].items():
        same = request_without(key, version, bytearray(frame), offset, lambda t: True)
        assert type(same) is bytes and same == frame
        assert java["kept"][key, version, case, "1" * len(
            {t for t, _ in java["topics"][key, version, case]})] == frame


def test_refused_responses_are_what_kafkas_broker_builds(java):
    assert len(java["refused"]) == 4 * len(java["kept"])
    for (key, version, case, pattern, code, lock), expected in java["refused"].items():
        parts, options = refused_parts(java, key, version, case, pattern)
        answer = refused_response(key, version, CORRELATION_ID, parts, code, **options,
                                  acquisition_lock_timeout_ms=lock)
        assert answer == expected, (key, version, case, pattern, code, lock)


def test_a_refused_fetch_partition_carries_the_acknowledgement_error_too(java):
    """When the request acknowledges anything, the broker refuses the acknowledgements of every
    partition of a refused topic as well (AcknowledgeErrorCode); under IsRenewAck it fetches
    nothing, answering on the acknowledgement only, or not at all."""
    one = [(uuid.UUID(int=1), [0])]
    plain = refused_response(78, 1, 1, one, 29)
    acked = refused_response(78, 1, 1, one, 29, acknowledgements=True)
    renewed = refused_response(78, 2, 1, one, 29, acknowledgements=True, renew_ack=True)
    # size, correlation id, header tags; throttle, error, message, lock timeout; count, id, count
    partition = 4 + 4 + 1 + 4 + 2 + 1 + 4 + 1 + 16 + 1
    # PartitionIndex, ErrorCode, ErrorMessage (null), AcknowledgeErrorCode
    assert plain[partition:partition + 9] == bytes.fromhex("00000000" "001d" "00" "0000")
    assert acked[partition:partition + 9] == bytes.fromhex("00000000" "001d" "00" "001d")
    assert renewed[partition:partition + 9] == bytes.fromhex("00000000" "0000" "00" "001d")
    assert refused_response(78, 2, 1, one, 29, renew_ack=True) == refused_response(
        78, 2, 1, [], 29)
    assert java["refused"][78, 2, "renew-noacks", "00", 29, 0] == refused_response(
        78, 2, CORRELATION_ID, [], 29)


def test_refused_entries_put_before_a_brokers_are_kafkas_bytes(java):
    assert len(java["merged"]) == 2 * len(java["broker"])
    for (key, version, case, pattern, code), expected in java["merged"].items():
        parts, options = refused_parts(java, key, version, case, pattern)
        answer = refused_response(key, version, CORRELATION_ID, parts, code, **options)
        broker = java["broker"][key, version, case, pattern]
        assert add_topics(key, version, broker, answer) == expected, (
            key, version, case, pattern, code)
        assert add_topics(key, version, memoryview(broker), bytearray(answer)) == expected
    # the Responses count grows from one varint byte to two
    broker = java["broker"][78, 1, "many", "1" * 130]
    assert add_topics(78, 1, broker, refused_response(78, 1, CORRELATION_ID, [], 29)) == broker


def test_a_broker_response_with_a_top_level_error_is_left_alone(java):
    broker = java["broker"][78, 2, "acks", "101"]
    answer = refused_response(78, 2, CORRELATION_ID, [(uuid.UUID(int=5), [0, 1])], 29)
    throttle_at = 4 + 4 + 1
    failed = broker[:throttle_at + 4] + struct.pack(">h", 72) + broker[throttle_at + 6:]
    assert add_topics(78, 2, failed, answer) == failed
    assert add_topics(78, 2, broker, answer) != broker


def test_every_truncation_of_kafkas_requests_is_a_protocol_error(java):
    for (key, version, case), (frame, offset) in java["request"].items():
        if case in ("wide", "many"):
            cuts = range(offset, len(frame), 7)
        else:
            cuts = range(len(frame))
        for cut in cuts:
            for read in (request_topics, request_partitions, refusal_options):
                with pytest.raises(ProtocolError):
                    read(key, version, frame[:cut], offset)
            with pytest.raises(ProtocolError):
                request_without(key, version, frame[:cut], offset, lambda t: False)


def test_every_truncation_of_a_response_or_answer_is_a_protocol_error(java):
    broker = java["broker"][79, 2, "acks", "110"]
    answer = java["refused"][79, 2, "acks", "110", 29, 0]
    at = 4 + 4 + 1 + 4 + 2 + 1 + 4  # the Responses count
    for cut in range(at + 1):
        with pytest.raises(ProtocolError):
            add_topics(79, 2, broker[:cut], answer)
    for cut in range(len(answer) - 2):  # NodeEndpoints and tagged fields are not read
        with pytest.raises(ProtocolError):
            add_topics(79, 2, broker, answer[:cut])


# ---- pure unit tests: frames built here, by hand --------------------------------------------

def header(key, version):
    """Request header v2: key, version, correlation id 1, client id "c", no tagged fields."""
    return struct.pack(">hhih", key, version, 1, 1) + b"c" + b"\x00"


def framed(key, version, body):
    head = header(key, version)
    return struct.pack(">i", len(head) + len(body)) + head + body, 4 + len(head)


def ack_body(version, topics):
    """A ShareAcknowledge body: group "g", member "m", epoch 1, (v2: IsRenewAck), topics of
    (id, [partitions]) with no batches."""
    body = b"\x02g\x02m" + struct.pack(">i", 1) + (b"\x00" if version >= 2 else b"")
    body += bytes([len(topics) + 1])
    for topic_id, partitions in topics:
        body += topic_id.bytes + bytes([len(partitions) + 1])
        body += b"".join(struct.pack(">i", p) + b"\x01\x00" for p in partitions) + b"\x00"
    return body + b"\x00"


def test_unknown_keys_and_versions_raise_value_error():
    frame, offset = framed(79, 1, ack_body(1, []))
    for key, version in [(78, 0), (79, 0), (78, 3), (79, 3), (1, 12), (76, 1)]:
        for read in (request_topics, request_partitions, refusal_options):
            with pytest.raises(ValueError):
                read(key, version, frame, offset)
        with pytest.raises(ValueError):
            request_without(key, version, frame, offset, lambda t: True)
        with pytest.raises(ValueError):
            refused_response(key, version, 1, [], 29)
        with pytest.raises(ValueError):
            add_topics(key, version, frame, frame)


def test_options_an_api_or_version_lacks_raise_value_error():
    with pytest.raises(ValueError):
        refused_response(78, 1, 1, [], 29, renew_ack=True)
    with pytest.raises(ValueError):
        refused_response(79, 2, 1, [], 29, acknowledgements=True)
    with pytest.raises(ValueError):
        refused_response(78, 1, 1, [], 40000)
    with pytest.raises(ValueError):
        refused_response(78, 1, 1, [("not a uuid", [0])], 29)
    with pytest.raises(ValueError):
        refused_response(78, 1, 1, [(uuid.UUID(int=1), [2 ** 31])], 29)


def test_correlation_ids_must_match():
    one = refused_response(79, 1, 1, [(uuid.UUID(int=1), [0])], 29)
    with pytest.raises(ValueError):
        add_topics(79, 1, refused_response(79, 1, 2, [], 29), one)


def test_a_request_read_and_rewritten_by_hand():
    a, b = uuid.UUID(int=0xA), uuid.UUID(int=0xB)
    frame, offset = framed(79, 2, ack_body(2, [(a, [0, 1]), (b, [7])]))
    assert request_topics(79, 2, frame, offset) == [a, b]
    assert request_partitions(79, 2, frame, offset) == [(a, [0, 1]), (b, [7])]
    assert request_without(79, 2, frame, offset, lambda t: t == b) == framed(
        79, 2, ack_body(2, [(b, [7])]))[0]
    assert request_without(79, 2, frame, offset, lambda t: False) == framed(
        79, 2, ack_body(2, []))[0]
    assert request_without(79, 2, frame, offset, lambda t: True) == frame


def test_refused_response_layout():
    """Independent of Java: size, correlation id, header tags, throttle 0, error 0, message
    null, the lock timeout where the version has it, one entry per topic id, partitions once."""
    a = uuid.UUID(int=0xA)
    frame = refused_response(79, 1, 0x01020304, [(a, [3, 3]), (a, [4])], 29)
    size, cid, tags, throttle, code, message, count = struct.unpack_from(">iibihbb", frame)
    assert (size, cid, tags, throttle, code, message, count) == (
        len(frame) - 4, 0x01020304, 0, 0, 0, 0, 2)
    assert frame[17:33] == a.bytes and frame[33] == 3  # two partitions: 3 and 4
    frame = refused_response(79, 2, 1, [], 29, acquisition_lock_timeout_ms=30000)
    assert struct.unpack_from(">i", frame, 16)[0] == 30000
    assert frame[20:] == b"\x01\x01\x00"  # no responses, no endpoints, no tags


def test_malformed_requests_raise_protocol_error():
    a = uuid.UUID(int=0xA)
    frame, offset = framed(79, 1, ack_body(1, [(a, [0])]))
    topics_at = offset + 2 + 2 + 4
    assert frame[topics_at] == 2
    # a null Topics array (not nullable), and a count beyond the bytes left
    for count in (b"\x00", b"\xff\xff\xff\x0f"):
        bad = frame[:topics_at] + count + frame[topics_at + 1:]
        with pytest.raises(ProtocolError):
            request_topics(79, 1, bad, offset)
    # a varint that never ends
    with pytest.raises(ProtocolError):
        request_topics(79, 1, frame[:offset] + b"\xff" * 8, offset)
    # a null partitions array
    partitions_at = topics_at + 1 + 16
    bad = frame[:partitions_at] + b"\x00" + frame[partitions_at + 1:]
    with pytest.raises(ProtocolError):
        request_topics(79, 1, bad, offset)
    for bad_offset in (-1, len(frame) + 1):
        with pytest.raises(ProtocolError):
            request_topics(79, 1, frame, bad_offset)


def test_session_epoch_is_read_after_the_group_and_member_and_a_short_frame_is_refused():
    from kthrottle.codecs import share_topics

    def body(epoch, group=b"g1", member=b"member-7"):
        return (bytes([len(group) + 1]) + group + bytes([len(member) + 1]) + member
                + struct.pack(">i", epoch) + b"\x00" * 20)

    for epoch in (0, -1, 5, 2 ** 31 - 1):
        frame = b"\x00" * 9 + body(epoch)
        for key in (78, 79):
            assert share_topics.session_epoch(key, 1, frame, 9) == epoch
    frame = b"\x00" * 9 + body(3)
    with pytest.raises(ProtocolError):
        share_topics.session_epoch(78, 1, frame[:9 + 3 + 9 + 2], 9)
    with pytest.raises(ValueError):
        share_topics.session_epoch(78, 0, frame, 9)
