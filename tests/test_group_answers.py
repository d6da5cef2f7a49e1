"""kthrottle/codecs/group_answers.py: the answers the proxy gives in a broker's place to the
group requests kafka-python has no schema for, compared byte for byte with what Kafka 4.4's own
generated message classes serialize (tests/java/GroupAnswers.java, one JVM run for the whole
module), and the subscription it reads out of heartbeats Kafka's classes wrote."""
import struct
from pathlib import Path

import pytest

from kthrottle.kafka_kit import KafkaMissing, java_program_output
from kthrottle.codecs.errors import ProtocolError
from kthrottle.codecs.group_answers import (
    describe_groups_error_response,
    error_response,
    subscribed_topics,
)

pytestmark = pytest.mark.integration

CORRELATION_ID = 7  # GroupAnswers.java's
MESSAGE = "refused by kthrottle \u00e9"  # GroupAnswers.java's ErrorMessage
ERROR_KEYS = (68, 76, 78, 79, 88, 91, 92)
DESCRIBE_KEYS = (69, 77, 89)
# the versions the module covers: exactly those Kafka 4.4's client jar knows
VERSIONS = {68: (0, 1), 69: (0, 1), 76: (1,), 77: (1,), 78: (1, 2), 79: (1, 2), 88: (0, 1),
            89: (0, 1), 91: (0,), 92: (0,)}
# GroupAnswers.java's heartbeat requests: case -> (subscribed names, regex) in them
SUBSCRIPTIONS = {
    "names": (["orders", "pay\u00e9ments"], None),
    "null": (None, None),
    "empty": ([], ""),
    "regex": (None, "^orders-.*"),
    "both": (["a"], "b.*"),
}


@pytest.fixture(scope="module")
def java(tmp_path_factory):
    """GroupAnswers.java's output, run once: {"range": {key: (low, high)}, "plain": {(key,
    version, code): frame}, "message": ..., "request": {(key, version, code): (frame, message
    or None)}, "describe": {(key, version, code, groups): frame}, "subscribe": {(key,
    version, case): (frame, body offset)}}."""
    try:
        output = java_program_output(Path(__file__).parent / "java" / "GroupAnswers.java",
                                     "GroupAnswers", tmp_path_factory.mktemp("group-answers"))
    except KafkaMissing as e:
        pytest.skip(str(e))
    found = {"range": {}, "plain": {}, "message": {}, "request": {}, "describe": {},
             "subscribe": {}}
    for line in output.splitlines():
        what, key, rest = line.split(" ", 2)
        key = int(key)
        if what == "range":
            low, high = map(int, rest.split())
            found["range"][key] = tuple(range(low, high + 1))
        elif what in ("plain", "message"):
            version, code, frame = rest.split()
            found[what][key, int(version), int(code)] = bytes.fromhex(frame)
        elif what == "request":
            version, code, frame, *message = rest.split(" ", 3)
            found[what][key, int(version), int(code)] = (
                bytes.fromhex(frame), message[0] if message else None)
        elif what == "describe":
            version, code, groups, frame = rest.split()
            groups = () if groups == "-" else tuple(
                bytes.fromhex(group).decode() for group in groups.split(","))
            found[what][key, int(version), int(code), groups] = bytes.fromhex(frame)
        else:
            version, case, offset, frame = rest.split()
            found[what][key, int(version), case] = (bytes.fromhex(frame), int(offset))
    return found


def test_the_versions_covered_are_those_kafka_knows(java):
    assert java["range"] == VERSIONS
    for key in ERROR_KEYS:
        assert {v for k, v, _ in java["plain"] if k == key} == set(VERSIONS[key])
    for key in DESCRIBE_KEYS:
        assert {v for k, v, *_ in java["describe"] if k == key} == set(VERSIONS[key])


def test_error_responses_are_kafkas_bytes(java):
    assert len(java["plain"]) == 3 * sum(len(VERSIONS[k]) for k in ERROR_KEYS)
    for (key, version, code), frame in java["plain"].items():
        assert error_response(key, version, CORRELATION_ID, code) == frame, (key, version, code)


def test_error_responses_with_a_message_are_kafkas_bytes(java):
    assert java["message"]
    for (key, version, code), frame in java["message"].items():
        assert error_response(key, version, CORRELATION_ID, code, MESSAGE) == frame, (
            key, version, code)


def test_error_responses_are_what_the_requests_get_error_response_answers(java):
    """Kafka's XxxRequest.getErrorResponse(0, exception): the top-level error only, except that
    AlterShareGroupOffsets and DeleteShareGroupOffsets also carry the error's standard text."""
    with_message = set()
    for (key, version, code), (frame, message) in java["request"].items():
        if message is not None:
            with_message.add(key)
        assert error_response(key, version, CORRELATION_ID, code, message) == frame, (
            key, version, code)
    assert with_message == {91, 92}
    assert java["request"][91, 0, 30][1] == "Group authorization failed."


def test_describe_error_responses_are_kafkas_bytes(java):
    # three codes, four group lists (two groups, none, a non-ASCII id, an id of 200 bytes,
    # whose length takes two bytes) at each version
    assert len(java["describe"]) == 12 * sum(len(VERSIONS[k]) for k in DESCRIBE_KEYS)
    assert (69, 1, 30, ("g1", "g2")) in java["describe"]
    assert (89, 1, 15, ("gr\u00fcppe",)) in java["describe"]
    for (key, version, code, groups), frame in java["describe"].items():
        assert describe_groups_error_response(
            key, version, CORRELATION_ID, list(groups), code) == frame, (key, version, code)


def test_subscriptions_read_back_from_kafkas_requests(java):
    cases = java["subscribe"]
    # no regex case before ConsumerGroupHeartbeat v1
    assert len(cases) == 2 + 5 + 5
    for (key, version, case), (frame, offset) in cases.items():
        names, regex = SUBSCRIPTIONS[case]
        if key == 76:
            regex = None  # ShareGroupHeartbeat has no SubscribedTopicRegex
        assert subscribed_topics(key, version, frame, offset) == (names, regex), (
            key, version, case)
        # a memoryview and a bytearray read the same
        assert subscribed_topics(key, version, memoryview(frame), offset) == (names, regex)
        assert subscribed_topics(key, version, bytearray(frame), offset) == (names, regex)


def test_every_truncation_of_kafkas_requests_is_a_protocol_error(java):
    for (key, version, case), (frame, offset) in java["subscribe"].items():
        names, regex = subscribed_topics(key, version, frame, offset)
        # the subscription's last byte: the regex's, else the names'
        end = len(frame) - 1
        while True:
            try:
                if subscribed_topics(key, version, frame[:end], offset) != (names, regex):
                    break
            except ProtocolError:
                break
            end -= 1
        for cut in range(end + 1):
            with pytest.raises(ProtocolError):
                subscribed_topics(key, version, frame[:cut], offset)


# ---- pure unit tests: frames built here, by hand --------------------------------------------

def compact_string(text):
    if text is None:
        return b"\x00"
    data = text.encode()
    return bytes([len(data) + 1]) + data


def compact_names(names):
    if names is None:
        return b"\x00"
    return bytes([len(names) + 1]) + b"".join(compact_string(n) for n in names)


def heartbeat_frame(key, version, names, regex=None):
    """(frame, body offset) of a request: header v2 with client id "c", then the body."""
    if key == 68:
        body = (compact_string("g") + compact_string("m") + struct.pack(">i", 3)
                + compact_string(None) + compact_string("rack") + struct.pack(">i", 1000)
                + compact_names(names) + (compact_string(regex) if version >= 1 else b"")
                + compact_string(None) + b"\x00" + b"\x00")
    else:
        body = (compact_string("g") + compact_string("m") + struct.pack(">i", 0)
                + compact_string(None) + compact_names(names) + b"\x00")
    header = struct.pack(">hhih", key, version, 1, 1) + b"c" + b"\x00"
    frame = struct.pack(">i", len(header) + len(body)) + header + body
    return frame, 4 + len(header)


@pytest.mark.parametrize("key,version", [(68, 0), (68, 1), (76, 1)])
def test_null_and_empty_subscriptions_differ(key, version):
    assert subscribed_topics(key, version, *heartbeat_frame(key, version, None)) == (None, None)
    assert subscribed_topics(key, version, *heartbeat_frame(key, version, [])) == ([], None)
    assert subscribed_topics(key, version, *heartbeat_frame(key, version, ["t1", "t2"])) == (
        ["t1", "t2"], None)


def test_the_regex_from_consumer_group_heartbeat_v1():
    assert subscribed_topics(68, 1, *heartbeat_frame(68, 1, None, "^a.*")) == (None, "^a.*")
    assert subscribed_topics(68, 1, *heartbeat_frame(68, 1, ["x"], "")) == (["x"], "")
    # v0 has none: the bytes after the names are not read as one
    assert subscribed_topics(68, 0, *heartbeat_frame(68, 0, ["x"])) == (["x"], None)


@pytest.mark.parametrize("key,version", [(68, 0), (68, 1), (76, 1)])
def test_truncated_frames_raise_protocol_error(key, version):
    frame, offset = heartbeat_frame(key, version, ["orders", "payments"], "re")
    assert subscribed_topics(key, version, frame, offset)[0] == ["orders", "payments"]
    # every cut up to the subscription's end (the regex's in 68 v1, else the names')
    tail = len(compact_string(None)) + 2 if key == 68 else 1
    if key == 68 and version >= 1:
        tail += len(compact_string("re"))
    for cut in range(0, len(frame) - tail):
        with pytest.raises(ProtocolError):
            subscribed_topics(key, version, frame[:cut], offset)


def test_malformed_subscriptions_raise_protocol_error():
    frame, offset = heartbeat_frame(76, 1, ["t"])
    names_at = len(frame) - 4  # count, "t" (2 bytes), tagged fields
    assert frame[names_at] == 2
    # a count beyond the bytes left
    huge = frame[:names_at] + b"\xff\xff\xff\x0f" + frame[names_at + 1:]
    with pytest.raises(ProtocolError):
        subscribed_topics(76, 1, huge, offset)
    # a null name in the array
    null_name = frame[:names_at + 1] + b"\x00" + frame[names_at + 3:]
    with pytest.raises(ProtocolError):
        subscribed_topics(76, 1, null_name, offset)
    # a varint that never ends
    endless = frame[:offset] + b"\xff" * 8
    with pytest.raises(ProtocolError):
        subscribed_topics(76, 1, endless, offset)
    # a name that is not UTF-8
    bad_utf8 = frame[:names_at + 2] + b"\xff" + frame[names_at + 3:]
    with pytest.raises(ProtocolError):
        subscribed_topics(76, 1, bad_utf8, offset)
    for bad_offset in (-1, len(frame) + 1):
        with pytest.raises(ProtocolError):
            subscribed_topics(76, 1, frame, bad_offset)


def test_unknown_keys_and_versions_raise_value_error():
    for key, version in [(0, 0), (69, 0), (68, 2), (76, 0), (78, 0), (79, 3), (93, 0)]:
        with pytest.raises(ValueError):
            error_response(key, version, 1, 30)
    for key, version in [(68, 0), (69, 2), (77, 0), (90, 0)]:
        with pytest.raises(ValueError):
            describe_groups_error_response(key, version, 1, ["g"], 30)
    for key, version in [(69, 0), (68, 2), (76, 0), (88, 0)]:
        with pytest.raises(ValueError):
            subscribed_topics(key, version, b"\x00" * 32, 4)
    with pytest.raises(ValueError):
        error_response(68, 1, 1, 40000)


def test_error_response_layout():
    """Independent of Java: size, correlation id, empty header tags, throttle 0, the code."""
    frame = error_response(68, 1, 0x01020304, 30)
    size, cid, tags, throttle, code = struct.unpack_from(">iibih", frame)
    assert (size, cid, tags, throttle, code) == (len(frame) - 4, 0x01020304, 0, 0, 30)
    frame = describe_groups_error_response(69, 1, 9, ["g1", "g2"], 30)
    assert frame[13] == 3  # compact array of two groups
    assert frame.count(b"\x80\x00\x00\x00") == 2  # AuthorizedOperations Integer.MIN_VALUE
