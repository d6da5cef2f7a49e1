// Prints StreamsGroupHeartbeat (88) requests as Kafka's own generated message classes serialize
// them, and the topics Kafka 4.4's broker reads out of their Topology, for
// tests/test_streams_topology.py to compare with kthrottle.codecs.streams_topology. One line
// each:
//   range <key> <lowest> <highest>
//   topology <version> <case> <body offset> <hex> <describe> <internal> <code> <message>
//       a whole framed request (size, request header v2, body); then, computed from the body
//       as Kafka's own reader parses it back: the topics the broker checks DESCRIBE on, the
//       internal topics (repartition source and changelog) it may have to create, and the
//       error and ErrorMessage it answers before the DESCRIBE check (0 -: none)
//   valid <name> <internal 0|1> <valid 0|1>   Topic.isInternal and Topic.isValid of a name
// A list of names is "null", "-" (empty) or the names comma-separated; a name or a message is
// "x" and the hex of its UTF-8 (stdout's charset is the locale's).
//
// The collection repeats KafkaApis.handleStreamsGroupHeartbeat (Kafka 4.4, Scala): per
// subtopology sourceTopics ++ repartitionSinkTopics ++ repartitionSourceTopics.map(_.name) ++
// stateChangelogTopics.map(_.name), flattened, .distinct; then the topics that are
// Topic.isInternal (STREAMS_INVALID_TOPOLOGY, "Use of Kafka internal topics <a,b> in a Kafka
// Streams topology is prohibited."), else those not Topic.isValid (STREAMS_INVALID_TOPOLOGY,
// "Topic names <a,b> are not valid topic names."), and only then filterByAuthorized(DESCRIBE,
// TOPIC, topics). The internal topics repeat InternalTopicManager.missingInternalTopics: per
// subtopology its repartition source topics, then its state changelog topics.
// Usage: java -cp kafka-clients.jar:. StreamsTopology
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Set;
import java.util.stream.Collectors;

import org.apache.kafka.common.internals.Topic;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.CopartitionGroup;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.Endpoint;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.KeyValue;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.Subtopology;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.TaskIds;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.TaskOffset;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.TopicInfo;
import org.apache.kafka.common.message.StreamsGroupHeartbeatRequestData.Topology;
import org.apache.kafka.common.protocol.ApiKeys;
import org.apache.kafka.common.protocol.ByteBufferAccessor;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.protocol.MessageUtil;
import org.apache.kafka.common.protocol.types.RawTaggedField;
import org.apache.kafka.common.requests.RequestHeader;
import org.apache.kafka.common.requests.RequestUtils;

public class StreamsTopology {
    static final String LONG_NAME = "t".repeat(200);  // its length takes two bytes

    public static void main(String[] args) {
        ApiKeys api = ApiKeys.STREAMS_GROUP_HEARTBEAT;
        short low = api.messageType.lowestSupportedVersion();
        short high = api.messageType.highestSupportedVersion(true);
        System.out.println("range " + api.id + " " + low + " " + high);
        for (short v = low; v <= high; v++) {
            for (String name : new String[] {"null", "full", "empty", "regexes", "internal",
                                             "invalid", "plain"})
                topology(api, v, name);
        }
        for (String name : new String[] {"", ".", "..", "...", "a", "a-b_c.D9", "a b", "a/b",
                                         "caf\u00e9", "\u6f22\u5b57", "t".repeat(249),
                                         "t".repeat(250), "__consumer_offsets",
                                         "__transaction_state", "__share_group_state",
                                         "__cluster_metadata", "_", "__consumer_offsets2"})
            System.out.println("valid " + x(name) + " " + (Topic.isInternal(name) ? 1 : 0) + " "
                               + (Topic.isValid(name) ? 1 : 0));
    }

    static void topology(ApiKeys api, short version, String name) {
        StreamsGroupHeartbeatRequestData data = new StreamsGroupHeartbeatRequestData()
            .setGroupId("streams-gr\u00fcppe").setMemberId("member-" + name).setMemberEpoch(0)
            .setEndpointInformationEpoch(5).setInstanceId(name.equals("full") ? "inst\u00e9" : null)
            .setRackId(name.equals("null") ? null : "rack-" + LONG_NAME)
            .setRebalanceTimeoutMs(45000)
            .setTopology(topology(name))
            .setActiveTasks(List.of(new TaskIds().setSubtopologyId("0")
                                    .setPartitions(List.of(0, 2))))
            .setStandbyTasks(List.of()).setWarmupTasks(name.equals("null") ? null : List.of())
            .setProcessId("process-1").setUserEndpoint(new Endpoint().setHost("h").setPort(65535))
            .setClientTags(List.of(new KeyValue().setKey("zone").setValue("a")))
            .setTaskOffsets(List.of(new TaskOffset().setSubtopologyId("0").setPartition(1)
                                    .setOffset(9L)))
            .setTaskEndOffsets(List.of()).setShutdownApplication(true);
        data.unknownTaggedFields().add(new RawTaggedField(7, new byte[] {1, 2, 3}));
        RequestHeader header = new RequestHeader(api, version, "client-" + name, 99);
        byte[] frame = framed(RequestUtils.serialize(header.data(), header.headerVersion(), data,
                                                     version));
        // what the broker works on: the body as Kafka's reader parses it back
        ByteBuffer body = MessageUtil.toByteBufferAccessor(data, version).buffer();
        body.rewind();
        StreamsGroupHeartbeatRequestData parsed =
            new StreamsGroupHeartbeatRequestData(new ByteBufferAccessor(body), version);
        String describe = "null", internal = "null", error = "0 -";
        if (parsed.topology() != null) {
            List<String> topics = describeTopics(parsed.topology());
            describe = names(topics);
            internal = names(internalTopics(parsed.topology()));
            List<String> bad = topics.stream().filter(Topic::isInternal)
                .collect(Collectors.toList());
            List<String> invalid = topics.stream().filter(t -> !Topic.isValid(t))
                .collect(Collectors.toList());
            if (!bad.isEmpty())
                error = Errors.STREAMS_INVALID_TOPOLOGY.code() + " "
                    + x("Use of Kafka internal topics " + String.join(",", bad)
                        + " in a Kafka Streams topology is prohibited.");
            else if (!invalid.isEmpty())
                error = Errors.STREAMS_INVALID_TOPOLOGY.code() + " " + x("Topic names "
                    + String.join(",", invalid) + " are not valid topic names.");
        }
        System.out.println("topology " + version + " " + name + " " + (4 + header.size()) + " "
                           + hex(frame) + " " + describe + " " + internal + " " + error);
    }

    static List<String> describeTopics(Topology topology) {
        Set<String> topics = new LinkedHashSet<>();
        for (Subtopology s : topology.subtopologies()) {
            topics.addAll(s.sourceTopics());
            topics.addAll(s.repartitionSinkTopics());
            for (TopicInfo t : s.repartitionSourceTopics())
                topics.add(t.name());
            for (TopicInfo t : s.stateChangelogTopics())
                topics.add(t.name());
        }
        return new ArrayList<>(topics);
    }

    static List<String> internalTopics(Topology topology) {
        Set<String> topics = new LinkedHashSet<>();
        for (Subtopology s : topology.subtopologies()) {
            for (TopicInfo t : s.repartitionSourceTopics())
                topics.add(t.name());
            for (TopicInfo t : s.stateChangelogTopics())
                topics.add(t.name());
        }
        return new ArrayList<>(topics);
    }

    static Topology topology(String name) {
        switch (name) {
            case "null":
                return null;
            case "empty":
                return new Topology().setEpoch(1).setSubtopologies(List.of());
            case "regexes":
                return new Topology().setEpoch(2).setSubtopologies(List.of(
                    new Subtopology().setSubtopologyId("0")
                        .setSourceTopicRegex(List.of("^in-.*", "b"))
                        .setCopartitionGroups(List.of(new CopartitionGroup()
                            .setSourceTopicRegex(List.of((short) 0, (short) 1))))));
            case "internal":
                return new Topology().setEpoch(3).setSubtopologies(List.of(
                    new Subtopology().setSubtopologyId("0")
                        .setSourceTopics(List.of("ok", "__consumer_offsets", "bad name"))
                        .setStateChangelogTopics(List.of(info("__transaction_state", 0, 0)))));
            case "invalid":
                return new Topology().setEpoch(4).setSubtopologies(List.of(
                    new Subtopology().setSubtopologyId("0")
                        .setSourceTopics(List.of(".", "ok", "a/b"))
                        .setRepartitionSinkTopics(List.of("t".repeat(250), "caf\u00e9"))));
            case "plain":
                return new Topology().setEpoch(5).setSubtopologies(List.of(
                    new Subtopology().setSubtopologyId("0").setSourceTopics(List.of("input"))
                        .setRepartitionSinkTopics(List.of("app-KSTREAM-REPARTITION-1"))
                        .setStateChangelogTopics(List.of(info("app-store-changelog", 0, 3))),
                    new Subtopology().setSubtopologyId("1")
                        .setSourceTopics(List.of("input"))
                        .setRepartitionSourceTopics(
                            List.of(info("app-KSTREAM-REPARTITION-1", 6, -1)))
                        .setStateChangelogTopics(List.of(info("app-agg-changelog", 0, 0)))));
            default:  // "full"
                return full();
        }
    }

    // several subtopologies, every field set, names repeated across them and across kinds,
    // non-ASCII names, unknown tagged fields at every level
    static Topology full() {
        TopicInfo changelog = info("store-\u00e9t\u00e9-changelog", 0, 3);
        changelog.setTopicConfigs(List.of(kv("cleanup.policy", "compact"),
                                          kv("min.insync.replicas", "2"),
                                          kv("k\u00fc", "v\u00e9")));
        changelog.unknownTaggedFields().add(new RawTaggedField(3, new byte[] {9}));
        TopicInfo repartition = info("app-repartition", 12, 2);
        repartition.setTopicConfigs(List.of(kv("retention.ms", "-1")));
        CopartitionGroup group = new CopartitionGroup()
            .setSourceTopics(List.of((short) 0, (short) 1)).setSourceTopicRegex(List.of((short) 0))
            .setRepartitionSourceTopics(List.of((short) 0));
        group.unknownTaggedFields().add(new RawTaggedField(1, new byte[] {}));
        Subtopology first = new Subtopology().setSubtopologyId("sub-0")
            .setSourceTopics(List.of("orders", "pay\u00e9ments"))
            .setSourceTopicRegex(List.of("^in-.*", "r\u00e9gex"))
            .setStateChangelogTopics(List.of(changelog, info("orders", 0, 0)))
            .setRepartitionSinkTopics(List.of("app-repartition", "orders"))
            .setRepartitionSourceTopics(List.of())
            .setCopartitionGroups(List.of(group, new CopartitionGroup()));
        first.unknownTaggedFields().add(
            new RawTaggedField(0, "tag".getBytes(StandardCharsets.UTF_8)));
        first.unknownTaggedFields().add(new RawTaggedField(200, new byte[150]));
        Subtopology second = new Subtopology().setSubtopologyId("sub-1")
            .setSourceTopics(List.of(LONG_NAME))
            .setStateChangelogTopics(List.of(info("\u6f22\u5b57-changelog", 0, -1)))
            .setRepartitionSinkTopics(List.of())
            .setRepartitionSourceTopics(List.of(repartition, info("pay\u00e9ments", 4, 1),
                                                info("fresh-repartition", 3, 1)))
            .setCopartitionGroups(List.of(group));
        Subtopology nothing = new Subtopology().setSubtopologyId("");
        Subtopology third = new Subtopology().setSubtopologyId("sub-\u00e9")
            .setSourceTopicRegex(List.of(".*"))
            .setRepartitionSinkTopics(List.of("sink-\u00fc", LONG_NAME))
            .setStateChangelogTopics(List.of(info("store-\u00e9t\u00e9-changelog", 0, 3)));
        Topology topology = new Topology().setEpoch(42)
            .setSubtopologies(List.of(first, second, nothing, third));
        topology.unknownTaggedFields().add(new RawTaggedField(5, new byte[] {0, 0}));
        return topology;
    }

    static TopicInfo info(String name, int partitions, int replicationFactor) {
        return new TopicInfo().setName(name).setPartitions(partitions)
            .setReplicationFactor((short) replicationFactor);
    }

    static KeyValue kv(String key, String value) {
        KeyValue out = new KeyValue().setKey(key).setValue(value);
        out.unknownTaggedFields().add(new RawTaggedField(2, new byte[] {7}));
        return out;
    }

    static byte[] framed(ByteBuffer buffer) {
        byte[] bytes = new byte[buffer.remaining()];
        buffer.get(bytes);
        return ByteBuffer.allocate(4 + bytes.length).putInt(bytes.length).put(bytes).array();
    }

    static String names(List<String> names) {
        if (names.isEmpty())
            return "-";
        List<String> out = new ArrayList<>();
        for (String name : names)
            out.add(x(name));
        return String.join(",", out);
    }

    static String x(String text) {
        return "x" + hex(text.getBytes(StandardCharsets.UTF_8));
    }

    static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes)
            out.append(String.format("%02x", b));
        return out.toString();
    }
}
