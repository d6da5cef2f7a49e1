"""kthrottle/codecs/streams_topology.py: the topics of a StreamsGroupHeartbeat's Topology, read out
of requests Kafka 4.4's own generated message classes wrote and compared with what Kafka's
broker collects from them (tests/java/StreamsTopology.java, one JVM run for the whole module,
repeating KafkaApis.handleStreamsGroupHeartbeat's collection on the request as Kafka's reader
parses it back); then frames built here, by hand, truncated and broken."""
import struct
from pathlib import Path

import pytest

from kthrottle.kafka_kit import KafkaMissing, java_program_output
from kthrottle.codecs.errors import ProtocolError
from kthrottle.codecs.streams_topology import (
    INTERNAL_TOPICS,
    STREAMS_INVALID_TOPOLOGY,
    internal_topics,
    invalid_topology,
    is_valid_topic_name,
    topology_topics,
)
from kthrottle.codecs.wire import encode_string, write_uvarint

pytestmark = pytest.mark.integration

VERSIONS = (0, 1)  # StreamsGroupHeartbeat's in Kafka 4.4's client jar
CASES = ("null", "full", "empty", "regexes", "internal", "invalid", "plain")
LONG_NAME = "t" * 200  # StreamsTopology.java's


def _text(field):
    assert field.startswith("x"), field
    return bytes.fromhex(field[1:]).decode("utf-8")


def _names(field):
    if field == "null":
        return None
    if field == "-":
        return []
    return [_text(name) for name in field.split(",")]


@pytest.fixture(scope="module")
def java(tmp_path_factory):
    """StreamsTopology.java's output, run once: {"range": (low, ..., high), "topology":
    {(version, case): (frame, body offset, describe names, internal names, error)},
    "valid": {name: (internal, valid)}}; an error is (code, message) or None."""
    try:
        output = java_program_output(Path(__file__).parent / "java" / "StreamsTopology.java",
                                     "StreamsTopology", tmp_path_factory.mktemp("streams-topology"))
    except KafkaMissing as e:
        pytest.skip(str(e))
    found = {"range": None, "topology": {}, "valid": {}}
    for line in output.splitlines():
        what, rest = line.split(" ", 1)
        if what == "range":
            key, low, high = map(int, rest.split())
            assert key == 88
            found["range"] = tuple(range(low, high + 1))
        elif what == "topology":
            version, case, offset, frame, describe, internal, code, message = rest.split()
            error = None if code == "0" else (int(code), _text(message))
            found[what][int(version), case] = (bytes.fromhex(frame), int(offset),
                                               _names(describe), _names(internal), error)
        else:
            name, internal, valid = rest.split()
            found[what][_text(name)] = (internal == "1", valid == "1")
    return found


def test_the_versions_covered_are_those_kafka_knows(java):
    assert java["range"] == VERSIONS
    assert set(java["topology"]) == {(v, case) for v in VERSIONS for case in CASES}


def test_topics_read_back_from_kafkas_requests(java):
    for (version, case), (frame, offset, describe, internal, _) in java["topology"].items():
        assert topology_topics(88, version, frame, offset) == describe, (version, case)
        assert internal_topics(88, version, frame, offset) == internal, (version, case)
        # a memoryview and a bytearray read the same
        for buf in (memoryview(frame), bytearray(frame)):
            assert topology_topics(88, version, buf, offset) == describe
            assert internal_topics(88, version, buf, offset) == internal


def test_the_broker_collects_sources_sinks_repartition_sources_and_changelogs(java):
    """What the Java side (KafkaApis' collection repeated) gives, spelt out: per subtopology
    SourceTopics, RepartitionSinkTopics, RepartitionSourceTopics, StateChangelogTopics, each
    name once at its first place; never a regex."""
    for version in VERSIONS:
        topology = java["topology"]
        assert topology[version, "full"][2] == [
            "orders", "pay\u00e9ments", "app-repartition", "store-\u00e9t\u00e9-changelog",
            LONG_NAME, "fresh-repartition", "\u6f22\u5b57-changelog", "sink-\u00fc"]
        assert topology[version, "full"][3] == [
            "store-\u00e9t\u00e9-changelog", "orders", "app-repartition", "pay\u00e9ments",
            "fresh-repartition", "\u6f22\u5b57-changelog"]
        assert topology[version, "plain"][2] == [
            "input", "app-KSTREAM-REPARTITION-1", "app-store-changelog", "app-agg-changelog"]
        assert topology[version, "plain"][3] == [
            "app-store-changelog", "app-KSTREAM-REPARTITION-1", "app-agg-changelog"]
        assert topology[version, "regexes"][2:4] == ([], [])
        assert topology[version, "empty"][2:4] == ([], [])
        assert topology[version, "null"][2:4] == (None, None)


def test_invalid_topologies_are_answered_as_the_broker_does(java):
    errors = {}
    for (version, case), (frame, offset, describe, _, error) in java["topology"].items():
        if describe is not None:
            assert invalid_topology(describe) == error, (version, case)
            errors[case] = error
    # non-ASCII names are not valid topic names: the broker refuses the topology before it
    # checks DESCRIBE
    assert errors["full"] == (STREAMS_INVALID_TOPOLOGY, "Topic names pay\u00e9ments,"
                              "store-\u00e9t\u00e9-changelog,\u6f22\u5b57-changelog,sink-\u00fc "
                              "are not valid topic names.")
    # internal topics first, before invalid names
    assert errors["internal"] == (STREAMS_INVALID_TOPOLOGY, "Use of Kafka internal topics "
                                  "__consumer_offsets,__transaction_state in a Kafka Streams "
                                  "topology is prohibited.")
    assert errors["invalid"][1].startswith("Topic names .,a/b,ttt")
    assert errors["plain"] is errors["empty"] is errors["regexes"] is None


def test_topic_name_checks_are_kafkas(java):
    assert len(java["valid"]) == 18
    for name, (internal, valid) in java["valid"].items():
        assert (name in INTERNAL_TOPICS) == internal, name
        assert is_valid_topic_name(name) == valid, name


def test_every_truncation_of_kafkas_requests_is_a_protocol_error(java):
    for (version, case), (frame, offset, describe, internal, _) in java["topology"].items():
        # the Topology's last byte (or its null marker's)
        end = len(frame) - 1
        while True:
            try:
                if topology_topics(88, version, frame[:end], offset) != describe:
                    break
            except ProtocolError:
                break
            end -= 1
        assert end > offset
        for cut in range(end + 1):
            with pytest.raises(ProtocolError):
                topology_topics(88, version, frame[:cut], offset)
            with pytest.raises(ProtocolError):
                internal_topics(88, version, frame[:cut], offset)


# ---- pure unit tests: frames built here, by hand --------------------------------------------

uvarint = write_uvarint


def cstr(text):
    return b"\x00" if text is None else encode_string(text, True)


def carray(items, encode):
    if items is None:
        return b"\x00"
    return uvarint(len(items) + 1) + b"".join(encode(item) for item in items)


def topic_info(topic):
    """A TopicInfo: ``topic`` a name, or (name, [(config key, value), ...])."""
    name, configs = (topic, ()) if isinstance(topic, str) else topic
    return (cstr(name) + struct.pack(">ih", 3, 2)
            + carray(list(configs), lambda kv: cstr(kv[0]) + cstr(kv[1]) + b"\x00") + b"\x00")


def subtopology(sources=(), regexes=(), changelogs=(), sinks=(), repartitions=(), groups=0,
                sub_id="0"):
    group = b"\x02\x00\x00\x02\x00\x01\x01\x00"  # SourceTopics [0], SourceTopicRegex [1], []
    return (cstr(sub_id) + carray(list(sources), cstr) + carray(list(regexes), cstr)
            + carray(list(changelogs), topic_info) + carray(list(sinks), cstr)
            + carray(list(repartitions), topic_info) + uvarint(groups + 1) + group * groups
            + b"\x00")


def heartbeat(subtopologies, version=0, marker=1):
    """(frame, body offset): header v2 with client id "c", then the body; ``subtopologies`` a
    list of encoded subtopologies, None for a null Topology."""
    if subtopologies is None:
        topology = b"\xff"
    else:
        topology = (bytes([marker]) + struct.pack(">i", 1)
                    + uvarint(len(subtopologies) + 1) + b"".join(subtopologies) + b"\x00")
    body = (cstr("g") + cstr("m") + struct.pack(">ii", 0, 0) + cstr(None) + cstr("rack")
            + struct.pack(">i", -1) + topology
            + b"\x00\x00\x00" + cstr(None) + b"\xff" + b"\x00\x00\x00" + b"\x00" + b"\x00")
    header = struct.pack(">hhih", 88, version, 1, 1) + b"c" + b"\x00"
    frame = struct.pack(">i", len(header) + len(body)) + header + body
    return frame, 4 + len(header)


SUBTOPOLOGIES = [
    subtopology(sources=["in", "x"], regexes=["re.*"], changelogs=["cl"], sinks=["rp", "in"],
                groups=2),
    subtopology(repartitions=[("rp", [("k", "v")])], changelogs=["cl2"], sources=["in2"]),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_topology_read_by_hand(version):
    frame, offset = heartbeat(SUBTOPOLOGIES, version)
    assert topology_topics(88, version, frame, offset) == ["in", "x", "rp", "cl", "in2", "cl2"]
    assert internal_topics(88, version, frame, offset) == ["cl", "rp", "cl2"]
    assert topology_topics(88, version, *heartbeat(None, version)) is None
    assert internal_topics(88, version, *heartbeat(None, version)) is None
    assert topology_topics(88, version, *heartbeat([], version)) == []
    assert topology_topics(88, version, *heartbeat([subtopology(regexes=["a"])], version)) == []


def test_the_null_marker_is_a_negative_byte():
    """Kafka's reader: readByte() < 0 is null, anything else a Topology (it writes 1)."""
    for marker in (0, 1, 0x7F):
        assert topology_topics(88, 1, *heartbeat(SUBTOPOLOGIES[1:], marker=marker)) == [
            "in2", "rp", "cl2"]
    for marker in (0x80, 0xFE, 0xFF):
        frame, offset = heartbeat(SUBTOPOLOGIES, marker=marker)
        assert topology_topics(88, 1, frame, offset) is None


def test_truncated_frames_raise_protocol_error():
    frame, offset = heartbeat(SUBTOPOLOGIES)
    # the Topology ends before the three null task arrays, ProcessId, UserEndpoint, ClientTags,
    # the two task offsets, ShutdownApplication and the tagged fields: 10 bytes
    end = len(frame) - 10
    assert topology_topics(88, 0, frame[:end], offset) == topology_topics(88, 0, frame, offset)
    for cut in range(end):
        with pytest.raises(ProtocolError):
            topology_topics(88, 0, frame[:cut], offset)
        with pytest.raises(ProtocolError):
            internal_topics(88, 0, memoryview(frame)[:cut], offset)


def replace_once(frame, old, new):
    assert frame.count(old) == 1, old
    return frame.replace(old, new)


def test_nulls_kafka_refuses_are_protocol_errors():
    good = subtopology(sources=["src"], regexes=["rgx"], changelogs=[("chg", [("key", "val")])],
                       sinks=["snk"], repartitions=["rep"], groups=1, sub_id="sid")
    frame, offset = heartbeat([good])
    assert topology_topics(88, 0, frame, offset) == ["src", "snk", "rep", "chg"]
    for old in (b"\x04sid", b"\x04src", b"\x04rgx", b"\x04chg", b"\x04key", b"\x04val",
                b"\x04snk", b"\x04rep", b"\x02g"):  # a null string where Kafka refuses one
        with pytest.raises(ProtocolError):
            topology_topics(88, 0, replace_once(frame, old, b"\x00" + old[1:]), offset)
    for old in (b"\x02\x04src", b"\x02\x04rgx", b"\x02\x04chg", b"\x02\x04snk",
                b"\x02\x04rep", b"\x02\x04key"):  # a null array where Kafka refuses one
        with pytest.raises(ProtocolError):
            topology_topics(88, 0, replace_once(frame, old, b"\x00" + old[1:]), offset)
    # a null Subtopologies
    at = frame.index(b"\x02\x04sid")
    with pytest.raises(ProtocolError):
        topology_topics(88, 0, frame[:at] + b"\x00" + frame[at + 1:], offset)
    # the nullable InstanceId (null here) and RackId may be null
    no_rack = replace_once(frame, b"\x05rack", b"\x00")
    assert topology_topics(88, 0, no_rack, offset) == ["src", "snk", "rep", "chg"]


def test_malformed_topologies_raise_protocol_error():
    frame, offset = heartbeat([subtopology(sources=["t"])])
    at = frame.index(b"\x02\x02t")
    for bad in (
        frame[:at] + b"\xff\xff\xff\x0f" + frame[at + 1:],  # more names than bytes
        frame[:at + 2] + b"\xff" + frame[at + 3:],  # a name that is not UTF-8
        frame[:at + 1] + b"\x81\x80\x02" + frame[at + 2:],  # a name of 32768 bytes
        frame[:offset] + b"\xff" * 8,  # a varint that never ends
    ):
        with pytest.raises(ProtocolError):
            topology_topics(88, 0, bad, offset)
    for bad_offset in (-1, len(frame) + 1):
        with pytest.raises(ProtocolError):
            topology_topics(88, 0, frame, bad_offset)


def test_tagged_fields_are_skipped():
    plain = subtopology(sources=["a"], changelogs=[("c", [("k", "v")])])
    tagged = plain[:-1] + b"\x02\x00\x01z\x07\x03xyz"  # the subtopology's own tagged fields
    frame, offset = heartbeat([tagged, plain])
    assert topology_topics(88, 0, frame, offset) == ["a", "c"]
    long = plain[:-1] + b"\x01\x00\x7f"  # a tagged field of 127 bytes: past the frame's end
    with pytest.raises(ProtocolError):
        topology_topics(88, 0, *heartbeat([long]))


def test_unknown_keys_and_versions_raise_value_error():
    frame, offset = heartbeat(SUBTOPOLOGIES)
    for key, version in [(88, 2), (88, -1), (68, 0), (89, 0), (0, 0)]:
        with pytest.raises(ValueError):
            topology_topics(key, version, frame, offset)
        with pytest.raises(ValueError):
            internal_topics(key, version, frame, offset)


def test_invalid_topology_by_hand():
    assert invalid_topology([]) is None
    assert invalid_topology(["a", "b-c", "D.9_"]) is None
    assert invalid_topology(["a", "b c", "", "__share_group_state"]) == (
        130, "Use of Kafka internal topics __share_group_state in a Kafka Streams topology is "
        "prohibited.")
    assert invalid_topology(iter(["ok", "b c", "..", "t" * 250])) == (
        130, "Topic names b c,..,%s are not valid topic names." % ("t" * 250))
    assert invalid_topology(["__cluster_metadata"]) is None  # not one of Topic's internal topics
