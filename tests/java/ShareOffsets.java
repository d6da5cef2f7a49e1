// Prints, as hex, the DescribeShareGroupOffsets (90), AlterShareGroupOffsets (91) and
// DeleteShareGroupOffsets (92) requests and responses Kafka's own generated message classes
// serialize, for tests/test_share_offsets.py to compare byte for byte with
// kthrottle.codecs.share_offsets. One line each:
//   range <key> <lowest> <highest>          ApiKeys.X.oldestVersion() / latestVersion()
//   id <topic name, UTF-8 hex> <uuid hex>    the topic ids the broker's metadata knows
//   request <key> <version> <case> <hex>     a request (size, header v2, body)
//   broker <key> <version> <case> <hex>      the broker's answer to that request without the
//                                            refused groups and topics (what a proxy that
//                                            took them out gets back)
//   refused <key> <version> <case> <hex>     the broker's answer to the whole request, the
//                                            refused groups and topics answered as KafkaApis
//                                            (Kafka 4.4) answers them
//   response <key> <version> <case> <hex>    other answers: throttle time, top-level errors,
//                                            empty and null messages, unknown tagged fields
// A group or topic whose name starts with "denied" is refused; a group whose name starts with
// "gone" makes the group coordinator answer GROUP_ID_NOT_FOUND; a topic whose name contains
// "unknown" has no id in the broker's metadata. A case whose name starts with "edge-" is an
// AlterShareGroupOffsets request the broker answers with fewer entries than it names topics
// (a refused topic named twice, a refused topic with no partitions).
//
// The refusals are KafkaApis's (handleDescribeShareGroupOffsetsRequest /
// describeShareGroupOffsetsForGroup, handleAlterShareGroupOffsetsRequest,
// handleDeleteShareGroupOffsetsRequest), repeated here around a stand-in for the group
// coordinator; AlterShareGroupOffsets uses the public AlterShareGroupOffsetsResponse.Builder
// exactly as KafkaApis does.
// Usage: java -cp kafka-clients.jar:. ShareOffsets
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.message.AlterShareGroupOffsetsRequestData;
import org.apache.kafka.common.message.AlterShareGroupOffsetsResponseData;
import org.apache.kafka.common.message.DeleteShareGroupOffsetsRequestData;
import org.apache.kafka.common.message.DeleteShareGroupOffsetsResponseData;
import org.apache.kafka.common.message.DescribeShareGroupOffsetsRequestData;
import org.apache.kafka.common.message.DescribeShareGroupOffsetsResponseData;
import org.apache.kafka.common.protocol.ApiKeys;
import org.apache.kafka.common.protocol.ApiMessage;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.protocol.types.RawTaggedField;
import org.apache.kafka.common.requests.AlterShareGroupOffsetsResponse;
import org.apache.kafka.common.requests.ApiError;
import org.apache.kafka.common.requests.RequestHeader;
import org.apache.kafka.common.requests.RequestUtils;
import org.apache.kafka.common.requests.ResponseHeader;

public class ShareOffsets {
    static final ApiKeys[] APIS = {ApiKeys.DESCRIBE_SHARE_GROUP_OFFSETS,
        ApiKeys.ALTER_SHARE_GROUP_OFFSETS, ApiKeys.DELETE_SHARE_GROUP_OFFSETS};
    static final String EMOJI = "t-\ud83d\ude00";  // four UTF-8 bytes, a surrogate pair in Java
    // the topic ids the broker knows (metadataCache.topicNamesToIds), in order of first use
    static final Map<String, Uuid> IDS = new LinkedHashMap<>();

    // a request's topic entry: its name and partitions (none for DeleteShareGroupOffsets)
    record T(String name, int... partitions) {}

    // a DescribeShareGroupOffsets group: topics null for "every topic"
    record G(String id, List<T> topics) {}

    // a case: its name, the client id and correlation id of its frames, and for key 90 its
    // groups, for 91 and 92 its group and topics
    record Case(String name, String clientId, int correlationId, List<G> groups, String group,
                List<T> topics) {}

    static boolean denied(String name) {
        return name.startsWith("denied");
    }

    static Uuid id(String topic) {
        if (topic.contains("unknown"))
            return null;
        return IDS.computeIfAbsent(topic, t -> {
            long h = 0x9e3779b97f4a7c15L;
            for (byte b : t.getBytes(StandardCharsets.UTF_8))
                h = (h ^ (b & 0xff)) * 0x100000001b3L;
            return new Uuid(h, 0x1000 + IDS.size());
        });
    }

    static Map<String, Uuid> topicNamesToIds() {
        return IDS;
    }

    static List<T> many(int count, int partitions) {
        List<T> out = new ArrayList<>();
        for (int i = 0; i < count; i++)
            out.add(new T((i % 3 == 1 ? "denied-" : "topic-") + i, i % partitions));
        return out;
    }

    static Case c(String name, int correlationId, List<G> groups) {
        return new Case(name, "client-\u00e9", correlationId, groups, null, null);
    }

    static Case c(String name, int correlationId, String group, List<T> topics) {
        return new Case(name, "client-\u00e9", correlationId, null, group, topics);
    }

    static List<Case> cases(int key) {
        List<Case> out = new ArrayList<>();
        if (key == 90) {
            out.add(new Case("one", null, 1, List.of(
                new G("g1", List.of(new T("t-a", 0, 1, 2, 3)))), null, null));
            out.add(new Case("several", "", -5, List.of(
                new G("grp-a", List.of(new T("t-a", 0), new T("denied-t", 1, 2),
                                       new T("t-b", 3))),
                new G("denied-grp", List.of(new T("t-a", 0))),
                new G("grp-null", null),
                new G("grp-\u00fc", List.of(new T("denied-\u00e9", 0),
                                            new T(EMOJI, 5, 2147483647))),
                new G("grp-empty", List.of())), null, null));
            out.add(c("null", 2147483647, List.of(new G("g", null))));
            out.add(c("empty-topics", 3, List.of(new G("g", List.of()))));
            out.add(c("no-groups", 4, List.of()));
            out.add(c("all-denied", 5, List.of(
                new G("denied-a", List.of(new T("t-a", 0))), new G("denied-b", null))));
            out.add(c("topics-denied", 6, List.of(
                new G("g", List.of(new T("denied-1", 0, 1), new T("denied-2"))))));
            out.add(c("group-error", 7, List.of(
                new G("gone-g", List.of(new T("t-a", 0), new T("denied-t", 1))),
                new G("g", List.of(new T("denied-t", 2), new T("t-a", 3))))));
            out.add(c("denied-twice", 8, List.of(
                new G("g", List.of(new T("denied-t", 0), new T("t-a", 1),
                                   new T("denied-t", 2))))));
            out.add(c("many", 9, List.of(new G("g", many(130, 5)))));
            List<G> groups = new ArrayList<>();
            for (int i = 0; i < 130; i++)
                groups.add(new G((i % 4 == 1 ? "denied-" : "g-") + i,
                                 i % 5 == 0 ? null : List.of(new T("t-a", i % 3))));
            out.add(c("many-groups", 10, groups));
            return out;
        }
        if (key == 91) {
            out.add(new Case("one", null, 1, null, "g", List.of(new T("t-a", 0, 1))));
            out.add(new Case("mixed", "", -5, null, "grp-\u00fc", List.of(
                new T("t-a", 0, 3), new T("denied-t", 1, 2), new T(EMOJI, 7),
                new T("denied-unknown-\u00e9", 0), new T("t-unknown", 4))));
            out.add(c("all-denied", 2147483647, "g", List.of(
                new T("denied-a", 0), new T("denied-b", 5, 6))));
            out.add(c("empty", 3, "g", List.of()));
            out.add(c("coordinator-error", 4, "gone-g", List.of(
                new T("t-a", 0), new T("denied-t", 1))));
            out.add(c("many", 5, "g", many(130, 4)));
            // the Builder merges a topic named twice into one entry, and adds none for a topic
            // with no partitions
            out.add(c("edge-denied-twice", 6, "g", List.of(
                new T("denied-t", 0), new T("t-a", 1), new T("denied-t", 2))));
            out.add(c("edge-no-partitions", 7, "g", List.of(
                new T("denied-t"), new T("t-a", 1))));
            return out;
        }
        out.add(new Case("one", null, 1, null, "g", List.of(new T("t-a"))));
        out.add(new Case("mixed", "", -5, null, "grp-\u00fc", List.of(
            new T("t-a"), new T("denied-t"), new T("t-unknown-x"), new T("denied-\u00e9"),
            new T(EMOJI))));
        out.add(c("all-denied", 2147483647, "g", List.of(new T("denied-a"), new T("denied-b"))));
        out.add(c("empty", 3, "g", List.of()));
        out.add(c("coordinator-error", 4, "gone-g", List.of(new T("t-a"), new T("denied-t"))));
        out.add(c("denied-twice", 5, "g", List.of(
            new T("denied-t"), new T("t-a"), new T("denied-t"))));
        out.add(c("many", 6, "g", many(130, 1)));
        return out;
    }

    public static void main(String[] args) {
        // the metadata knows every topic of the cases but the "unknown" ones
        for (ApiKeys api : APIS)
            for (Case c : cases(api.id)) {
                for (T t : c.topics == null ? List.<T>of() : c.topics)
                    id(t.name);
                for (G g : c.groups == null ? List.<G>of() : c.groups)
                    for (T t : g.topics == null ? List.<T>of() : g.topics)
                        id(t.name);
            }
        for (ApiKeys api : APIS)
            System.out.println("range " + api.id + " " + api.oldestVersion() + " "
                               + api.latestVersion());
        for (ApiKeys api : APIS) {
            for (short v = api.oldestVersion(); v <= api.latestVersion(); v++) {
                for (Case c : cases(api.id)) {
                    String at = api.id + " " + v + " " + c.name;
                    RequestHeader header = new RequestHeader(api, v, c.clientId, c.correlationId);
                    ApiMessage whole = request(api.id, c, false);
                    ApiMessage kept = request(api.id, c, true);
                    System.out.println("request " + at + " " + hex(framed(RequestUtils.serialize(
                        header.data(), header.headerVersion(), whole, v))));
                    System.out.println("broker " + at + " "
                                       + hex(response(api, v, c, answer(api.id, v, kept))));
                    System.out.println("refused " + at + " "
                                       + hex(response(api, v, c, answer(api.id, v, whole))));
                }
                for (Map.Entry<String, ApiMessage> other : others(api.id, v).entrySet())
                    System.out.println("response " + api.id + " " + v + " " + other.getKey()
                        + " " + hex(response(api, v, new Case(other.getKey(), null, 11, null,
                                                               null, null), other.getValue())));
            }
        }
        for (Map.Entry<String, Uuid> e : IDS.entrySet())
            System.out.println("id " + hex(e.getKey().getBytes(StandardCharsets.UTF_8)) + " "
                               + uuidHex(e.getValue()));
    }

    // ---- requests ------------------------------------------------------------------------------

    // the case's request; onlyKept: without the refused groups and topics
    static ApiMessage request(int key, Case c, boolean onlyKept) {
        if (key == 90) {
            DescribeShareGroupOffsetsRequestData d = new DescribeShareGroupOffsetsRequestData();
            for (G g : c.groups) {
                if (onlyKept && denied(g.id))
                    continue;
                List<DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestTopic>
                    topics = null;
                if (g.topics != null) {
                    topics = new ArrayList<>();
                    for (T t : g.topics)
                        if (!onlyKept || !denied(t.name))
                            topics.add(new DescribeShareGroupOffsetsRequestData
                                .DescribeShareGroupOffsetsRequestTopic().setTopicName(t.name)
                                .setPartitions(ints(t.partitions)));
                }
                d.groups().add(new DescribeShareGroupOffsetsRequestData
                    .DescribeShareGroupOffsetsRequestGroup().setGroupId(g.id).setTopics(topics));
            }
            return d;
        }
        if (key == 91) {
            AlterShareGroupOffsetsRequestData d = new AlterShareGroupOffsetsRequestData()
                .setGroupId(c.group);
            for (T t : c.topics) {
                if (onlyKept && denied(t.name))
                    continue;
                AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopic topic =
                    new AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopic()
                        .setTopicName(t.name);
                for (int p : t.partitions)
                    topic.partitions().add(new AlterShareGroupOffsetsRequestData
                        .AlterShareGroupOffsetsRequestPartition().setPartitionIndex(p)
                        .setStartOffset(p == 7 ? Long.MAX_VALUE : p == 2 ? -1 : 100L * p));
                d.topics().add(topic);
            }
            return d;
        }
        DeleteShareGroupOffsetsRequestData d = new DeleteShareGroupOffsetsRequestData()
            .setGroupId(c.group);
        for (T t : c.topics)
            if (!onlyKept || !denied(t.name))
                d.topics().add(new DeleteShareGroupOffsetsRequestData
                    .DeleteShareGroupOffsetsRequestTopic().setTopicName(t.name));
        return d;
    }

    static List<Integer> ints(int[] values) {
        List<Integer> out = new ArrayList<>();
        for (int v : values)
            out.add(v);
        return out;
    }

    // ---- the broker: KafkaApis around a stand-in group coordinator ---------------------------

    static ApiMessage answer(int key, short v, ApiMessage request) {
        if (key == 90)
            return describe(v, (DescribeShareGroupOffsetsRequestData) request);
        if (key == 91)
            return alter((AlterShareGroupOffsetsRequestData) request);
        return delete((DeleteShareGroupOffsetsRequestData) request);
    }

    // handleDescribeShareGroupOffsetsRequest and describeShareGroupOffsetsForGroup
    static DescribeShareGroupOffsetsResponseData describe(
            short v, DescribeShareGroupOffsetsRequestData request) {
        List<DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseGroup> groups =
            new ArrayList<>();
        for (DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestGroup g
                : request.groups()) {
            if (denied(g.groupId())) {
                groups.add(new DescribeShareGroupOffsetsResponseData
                    .DescribeShareGroupOffsetsResponseGroup().setGroupId(g.groupId())
                    .setErrorCode(Errors.GROUP_AUTHORIZATION_FAILED.code()));
            } else if (g.topics() == null) {
                groups.add(describeCoordinator(v, g.groupId(), null));
            } else if (g.topics().isEmpty()) {
                groups.add(new DescribeShareGroupOffsetsResponseData
                    .DescribeShareGroupOffsetsResponseGroup().setGroupId(g.groupId()));
            } else {
                List<DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestTopic>
                    authorized = new ArrayList<>(), unauthorized = new ArrayList<>();
                for (DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestTopic t
                        : g.topics())
                    (denied(t.topicName()) ? unauthorized : authorized).add(t);
                DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseGroup
                    answer = describeCoordinator(v, g.groupId(), authorized);
                if (answer.errorCode() == Errors.NONE.code()) {
                    var topics = new ArrayList<>(answer.topics());
                    for (var t : unauthorized) {
                        DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseTopic
                            topic = new DescribeShareGroupOffsetsResponseData
                                .DescribeShareGroupOffsetsResponseTopic()
                                .setTopicName(t.topicName()).setTopicId(Uuid.ZERO_UUID);
                        t.partitions().forEach(p -> topic.partitions().add(
                            new DescribeShareGroupOffsetsResponseData
                                .DescribeShareGroupOffsetsResponsePartition().setPartitionIndex(p)
                                .setStartOffset(-1).setLag(-1)
                                .setErrorCode(Errors.TOPIC_AUTHORIZATION_FAILED.code())
                                .setErrorMessage(Errors.TOPIC_AUTHORIZATION_FAILED.message())));
                        topics.add(topic);
                    }
                    answer.setTopics(topics);
                }
                groups.add(answer);
            }
        }
        return new DescribeShareGroupOffsetsResponseData().setGroups(groups);
    }

    // the group coordinator's answer for a group (topics null: every topic of the group)
    static DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseGroup
            describeCoordinator(short v, String group,
            List<DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestTopic>
                asked) {
        DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseGroup answer =
            new DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseGroup()
                .setGroupId(group);
        if (group.startsWith("gone"))
            return answer.setErrorCode(Errors.GROUP_ID_NOT_FOUND.code())
                .setErrorMessage(Errors.GROUP_ID_NOT_FOUND.message());
        List<T> topics = new ArrayList<>();
        if (asked == null) {
            topics.add(new T("t-a", 0, 1));
            topics.add(new T("t-\u00e9", 2));
        } else {
            for (DescribeShareGroupOffsetsRequestData.DescribeShareGroupOffsetsRequestTopic t
                    : asked)
                topics.add(new T(t.topicName(),
                                 t.partitions().stream().mapToInt(Integer::intValue).toArray()));
        }
        for (T t : topics) {
            Uuid topicId = id(t.name);
            DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseTopic topic =
                new DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponseTopic()
                    .setTopicName(t.name).setTopicId(topicId == null ? Uuid.ZERO_UUID : topicId);
            for (int p : t.partitions) {
                DescribeShareGroupOffsetsResponseData.DescribeShareGroupOffsetsResponsePartition
                    partition = new DescribeShareGroupOffsetsResponseData
                        .DescribeShareGroupOffsetsResponsePartition().setPartitionIndex(p)
                        .setStartOffset(p == 1 ? -1 : 1000L + p).setLeaderEpoch(p == 1 ? -1 : 4)
                        .setErrorCode((short) (p == 3 ? 6 : 0))
                        .setErrorMessage(p == 3 ? "not the leader \u00e9" : null);
                if (v >= 1 && p != 2)
                    partition.setLag(17L + p);
                topic.partitions().add(partition);
            }
            answer.topics().add(topic);
        }
        return answer;
    }

    // handleAlterShareGroupOffsetsRequest, the group READ granted
    static AlterShareGroupOffsetsResponseData alter(AlterShareGroupOffsetsRequestData request) {
        AlterShareGroupOffsetsResponse.Builder builder =
            new AlterShareGroupOffsetsResponse.Builder();
        AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopicCollection authorized =
            new AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopicCollection();
        for (AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopic t
                : request.topics()) {
            if (denied(t.topicName())) {
                ApiError error = new ApiError(Errors.TOPIC_AUTHORIZATION_FAILED);
                t.partitions().forEach(p -> builder.addPartition(
                    t.topicName(), p.partitionIndex(), topicNamesToIds(), error));
            } else {
                authorized.add(t.duplicate());
            }
        }
        AlterShareGroupOffsetsResponseData coordinator = alterCoordinator(request.groupId(),
                                                                          authorized);
        if (coordinator.errorCode() != Errors.NONE.code())
            return new AlterShareGroupOffsetsResponseData().setThrottleTimeMs(0)
                .setErrorCode(coordinator.errorCode())
                .setErrorMessage(coordinator.errorMessage());
        return builder.merge(coordinator, topicNamesToIds()).build().data();
    }

    static AlterShareGroupOffsetsResponseData alterCoordinator(
            String group,
            AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopicCollection topics) {
        AlterShareGroupOffsetsResponseData answer = new AlterShareGroupOffsetsResponseData();
        if (group.startsWith("gone"))
            return answer.setErrorCode(Errors.GROUP_ID_NOT_FOUND.code())
                .setErrorMessage(Errors.GROUP_ID_NOT_FOUND.message());
        for (AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestTopic t : topics) {
            AlterShareGroupOffsetsResponseData.AlterShareGroupOffsetsResponseTopic topic =
                new AlterShareGroupOffsetsResponseData.AlterShareGroupOffsetsResponseTopic()
                    .setTopicName(t.topicName());
            for (AlterShareGroupOffsetsRequestData.AlterShareGroupOffsetsRequestPartition p
                    : t.partitions())
                topic.partitions().add(new AlterShareGroupOffsetsResponseData
                    .AlterShareGroupOffsetsResponsePartition().setPartitionIndex(p.partitionIndex())
                    .setErrorCode((short) (p.partitionIndex() == 3 ? 6 : 0))
                    .setErrorMessage(p.partitionIndex() == 3 ? "not the leader" : null));
            answer.responses().add(topic);
        }
        return answer;
    }

    // handleDeleteShareGroupOffsetsRequest, the group DELETE granted
    static DeleteShareGroupOffsetsResponseData delete(DeleteShareGroupOffsetsRequestData request) {
        List<DeleteShareGroupOffsetsResponseData.DeleteShareGroupOffsetsResponseTopic> responses =
            new ArrayList<>();
        List<DeleteShareGroupOffsetsRequestData.DeleteShareGroupOffsetsRequestTopic> authorized =
            new ArrayList<>();
        for (DeleteShareGroupOffsetsRequestData.DeleteShareGroupOffsetsRequestTopic t
                : request.topics()) {
            if (denied(t.topicName()))
                responses.add(new DeleteShareGroupOffsetsResponseData
                    .DeleteShareGroupOffsetsResponseTopic().setTopicName(t.topicName())
                    .setErrorCode(Errors.TOPIC_AUTHORIZATION_FAILED.code())
                    .setErrorMessage(Errors.TOPIC_AUTHORIZATION_FAILED.message()));
            else
                authorized.add(t);
        }
        if (request.groupId().startsWith("gone"))
            return new DeleteShareGroupOffsetsResponseData().setThrottleTimeMs(0)
                .setErrorMessage(Errors.GROUP_ID_NOT_FOUND.message())
                .setErrorCode(Errors.GROUP_ID_NOT_FOUND.code());
        for (DeleteShareGroupOffsetsRequestData.DeleteShareGroupOffsetsRequestTopic t
                : authorized) {
            Uuid topicId = id(t.topicName());
            boolean unknown = topicId == null;
            responses.add(new DeleteShareGroupOffsetsResponseData
                .DeleteShareGroupOffsetsResponseTopic().setTopicName(t.topicName())
                .setTopicId(unknown ? Uuid.ZERO_UUID : topicId)
                .setErrorCode(unknown ? Errors.UNKNOWN_TOPIC_OR_PARTITION.code() : 0)
                .setErrorMessage(unknown ? Errors.UNKNOWN_TOPIC_OR_PARTITION.message() : null));
        }
        return new DeleteShareGroupOffsetsResponseData().setResponses(responses);
    }

    // ---- answers no refusal builds ---------------------------------------------------------

    static Map<String, ApiMessage> others(int key, short v) {
        Map<String, ApiMessage> out = new LinkedHashMap<>();
        RawTaggedField tag = new RawTaggedField(7, new byte[] {1, 2, 3});
        if (key == 90) {
            DescribeShareGroupOffsetsResponseData throttled = describe(v,
                (DescribeShareGroupOffsetsRequestData) request(90, cases(90).get(1), false));
            out.put("throttled", throttled.setThrottleTimeMs(250));
            DescribeShareGroupOffsetsResponseData messages = describe(v,
                (DescribeShareGroupOffsetsRequestData) request(90, cases(90).get(0), false));
            messages.groups().add(new DescribeShareGroupOffsetsResponseData
                .DescribeShareGroupOffsetsResponseGroup().setGroupId("")
                .setErrorCode((short) 16).setErrorMessage(""));
            messages.groups().get(0).topics().get(0).partitions().get(0).setErrorMessage("");
            out.put("messages", messages);
            DescribeShareGroupOffsetsResponseData tagged = describe(v,
                (DescribeShareGroupOffsetsRequestData) request(90, cases(90).get(0), false));
            tagged.unknownTaggedFields().add(tag);
            tagged.groups().get(0).topics().get(0).partitions().get(0).unknownTaggedFields()
                .add(new RawTaggedField(3, new byte[0]));
            out.put("tagged", tagged);
            return out;
        }
        if (key == 91) {
            out.put("throttled", alter((AlterShareGroupOffsetsRequestData) request(
                91, cases(91).get(1), false)).setThrottleTimeMs(250));
            out.put("top-level-error", new AlterShareGroupOffsetsResponseData()
                .setErrorCode(Errors.GROUP_AUTHORIZATION_FAILED.code())
                .setErrorMessage(Errors.GROUP_AUTHORIZATION_FAILED.message()));
            out.put("empty-message", new AlterShareGroupOffsetsResponseData()
                .setErrorCode((short) 15).setErrorMessage(""));
            AlterShareGroupOffsetsResponseData tagged = alter((AlterShareGroupOffsetsRequestData)
                request(91, cases(91).get(0), false));
            tagged.unknownTaggedFields().add(tag);
            out.put("tagged", tagged);
            return out;
        }
        out.put("throttled", delete((DeleteShareGroupOffsetsRequestData) request(
            92, cases(92).get(1), false)).setThrottleTimeMs(250));
        out.put("top-level-error", new DeleteShareGroupOffsetsResponseData()
            .setErrorCode(Errors.GROUP_AUTHORIZATION_FAILED.code())
            .setErrorMessage(Errors.GROUP_AUTHORIZATION_FAILED.message()));
        out.put("empty-message", new DeleteShareGroupOffsetsResponseData()
            .setErrorCode((short) 15).setErrorMessage(""));
        DeleteShareGroupOffsetsResponseData tagged = delete((DeleteShareGroupOffsetsRequestData)
            request(92, cases(92).get(0), false));
        tagged.unknownTaggedFields().add(tag);
        out.put("tagged", tagged);
        return out;
    }

    // ---- framing ---------------------------------------------------------------------------

    // a whole framed response: size, response header v1 (correlation id, tags), body
    static byte[] response(ApiKeys api, short version, Case c, ApiMessage body) {
        ResponseHeader header = new ResponseHeader(c.correlationId,
                                                   api.responseHeaderVersion(version));
        return framed(RequestUtils.serialize(header.data(), header.headerVersion(), body,
                                             version));
    }

    static byte[] framed(ByteBuffer buffer) {
        byte[] bytes = new byte[buffer.remaining()];
        buffer.get(bytes);
        return ByteBuffer.allocate(4 + bytes.length).putInt(bytes.length).put(bytes).array();
    }

    static String uuidHex(Uuid id) {
        return String.format("%016x%016x", id.getMostSignificantBits(),
                             id.getLeastSignificantBits());
    }

    static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes)
            out.append(String.format("%02x", b));
        return out.toString();
    }
}
