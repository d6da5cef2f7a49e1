// Prints, as hex, the ShareFetch (78) and ShareAcknowledge (79) requests and responses Kafka's own
// generated message classes serialize, for tests/test_share_topics.py to compare byte for byte
// with kthrottle.codecs.share_topics. One line each:
//   range <key> <lowest> <highest>
//   request <key> <version> <case> <body offset> <hex>   a request naming 0 or more topics
//   topics <key> <version> <case> <entries>     its Topics: <uuid hex>:<p>,<p>...;... ("-": none)
//   options <key> <version> <case> <acks 0|1> <renew 0|1>   what the broker reads of it
//   kept <key> <version> <case> <pattern> <hex>  the same request naming the kept topics only
//   refused <key> <version> <case> <pattern> <code> <lock> <hex>   the response the broker
//                                                builds for the refused topics alone
//   broker <key> <version> <case> <pattern> <hex>   a broker's response to the kept topics
//   merged <key> <version> <case> <pattern> <code> <hex>   that response with the refused
//                                                topics' entries first
// A pattern has a character per distinct topic id of the request, in order of first
// appearance: 1 kept, 0 refused.
//
// The refused responses are built as KafkaApis (Kafka 4.4) builds them for topics its
// authorizer refuses: the public ShareFetchResponse.partitionResponse /
// ShareAcknowledgeResponse.partitionResponse and ShareFetchResponse.of /
// ShareAcknowledgeResponse.of, and the private glue of KafkaApis repeated here:
// handleFetchFromShareFetchRequest (no fetch at all under IsRenewAck), handleAcknowledgements
// (every partition of every topic once the request acknowledges anything),
// processShareFetchResponse / createResponse / getResponsePartitionData, and the combining of
// fetch and acknowledgement results in handleShareFetchRequest.
// Usage: java -cp kafka-clients.jar:. ShareTopics
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;

import org.apache.kafka.common.TopicIdPartition;
import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.compress.Compression;
import org.apache.kafka.common.message.ShareAcknowledgeRequestData;
import org.apache.kafka.common.message.ShareAcknowledgeResponseData;
import org.apache.kafka.common.message.ShareFetchRequestData;
import org.apache.kafka.common.message.ShareFetchResponseData;
import org.apache.kafka.common.protocol.ApiKeys;
import org.apache.kafka.common.protocol.ApiMessage;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.protocol.types.RawTaggedField;
import org.apache.kafka.common.record.internal.MemoryRecords;
import org.apache.kafka.common.record.internal.SimpleRecord;
import org.apache.kafka.common.requests.RequestHeader;
import org.apache.kafka.common.requests.RequestUtils;
import org.apache.kafka.common.requests.ResponseHeader;
import org.apache.kafka.common.requests.ShareAcknowledgeResponse;
import org.apache.kafka.common.requests.ShareFetchResponse;

public class ShareTopics {
    static final int CORRELATION_ID = 7;
    static final short[] CODES = {29, 3};
    static final int[] LOCKS = {0, 30000};
    static final Uuid A = new Uuid(0x0123456789abcdefL, 0x1122334455667788L);
    static final Uuid B = new Uuid(0xfedcba9876543210L, 0x8877665544332211L);
    static final Uuid C = new Uuid(0x7fedcba987654321L, 0x0f0e0d0c0b0a0908L);
    static final Uuid D = new Uuid(0x5555aaaa5555aaaaL, 0x0000000000000001L);
    static final Uuid MEMBER = new Uuid(0x4242424242424242L, 0x1313131313131313L);

    // one Topics entry: its id, partitions, and which partitions acknowledge records
    static class Entry {
        final Uuid id;
        final int[] partitions;
        final boolean[] acks;

        Entry(Uuid id, int[] partitions, boolean... acks) {
            this.id = id;
            this.partitions = partitions;
            this.acks = acks.length == 0 ? new boolean[partitions.length] : acks;
        }
    }

    static class Case {
        final String name;
        final List<Entry> topics;
        final List<Entry> forgotten;
        final int epoch;
        final boolean renew;

        Case(String name, List<Entry> topics, List<Entry> forgotten, int epoch, boolean renew) {
            this.name = name;
            this.topics = topics;
            this.forgotten = forgotten;
            this.epoch = epoch;
            this.renew = renew;
        }

        List<Uuid> ids() {
            return new ArrayList<>(new LinkedHashSet<>(topics.stream().map(e -> e.id).toList()));
        }
    }

    static int[] range(int from, int to) {
        int[] out = new int[to - from];
        for (int i = from; i < to; i++)
            out[i - from] = i;
        return out;
    }

    static List<Case> cases(int key, short version) {
        List<Case> out = new ArrayList<>();
        List<Entry> forgotten = List.of(new Entry(D, new int[] {1, 2}), new Entry(A, new int[] {7}));
        out.add(new Case("acks", List.of(
            new Entry(A, new int[] {0, 1, 2}, false, true, false),
            new Entry(B, new int[] {5}),
            new Entry(C, new int[] {0, 3}, true, false)), forgotten, 3, false));
        out.add(new Case("plain", List.of(
            new Entry(A, new int[] {0}), new Entry(B, new int[] {1, 2}),
            new Entry(C, new int[] {4})), List.of(), 0, false));
        // 200 partitions: a count of two varint bytes
        out.add(new Case("wide", List.of(
            new Entry(A, range(0, 200)), new Entry(B, new int[] {2147483647, 0})),
            List.of(new Entry(C, range(0, 150))), 9, false));
        // a topic named twice, a partition twice: the broker keys them by topic-id-partition
        out.add(new Case("dup", List.of(
            new Entry(A, new int[] {0, 1}, true, false), new Entry(B, new int[] {2}),
            new Entry(A, new int[] {1, 3})), List.of(), 5, false));
        out.add(new Case("empty", List.of(), List.of(new Entry(D, new int[] {0})), 6, false));
        // 130 topics: the Responses count crosses from one varint byte to two
        List<Entry> many = new ArrayList<>();
        for (int i = 0; i < 130; i++)
            many.add(new Entry(new Uuid(0x1000 + i, 0x2000 + i), new int[] {i % 3}));
        out.add(new Case("many", many, List.of(), 1, false));
        if (version >= 2) {
            out.add(new Case("renew", List.of(
                new Entry(A, new int[] {0, 1}, true, false), new Entry(B, new int[] {4}),
                new Entry(C, new int[] {0})), List.of(), 2, true));
            out.add(new Case("renew-noacks", List.of(
                new Entry(A, new int[] {0}), new Entry(B, new int[] {4})), List.of(), 2, true));
        }
        return out;
    }

    // the patterns tried: every one for up to three topic ids, a few for more
    static List<String> patterns(int n) {
        List<String> out = new ArrayList<>();
        if (n <= 3) {
            for (int mask = 0; mask < (1 << n); mask++) {
                StringBuilder p = new StringBuilder();
                for (int i = 0; i < n; i++)
                    p.append((mask >> i & 1) == 1 ? '1' : '0');
                out.add(p.toString());
            }
            return out;
        }
        StringBuilder alternate = new StringBuilder(), head = new StringBuilder();
        for (int i = 0; i < n; i++) {
            alternate.append(i % 2 == 0 ? '1' : '0');
            head.append(i < 3 ? '0' : '1');
        }
        out.add("1".repeat(n));
        out.add("0".repeat(n));
        out.add(alternate.toString());
        out.add(head.toString());
        return out;
    }

    public static void main(String[] args) {
        for (int key : new int[] {78, 79}) {
            ApiKeys api = ApiKeys.forId(key);
            short low = api.messageType.lowestSupportedVersion();
            short high = api.messageType.highestSupportedVersion(true);
            System.out.println("range " + key + " " + low + " " + high);
            for (short v = low; v <= high; v++) {
                for (Case c : cases(key, v)) {
                    String at = key + " " + v + " " + c.name;
                    List<Uuid> ids = c.ids();
                    RequestHeader header = new RequestHeader(api, v, "client-\u00e9", 99);
                    System.out.println("request " + at + " " + (4 + header.size()) + " "
                                       + hex(request(api, v, header, c, null, ids)));
                    System.out.println("topics " + at + " " + entries(c.topics));
                    boolean acks = acknowledges(c);
                    boolean renew = v >= 2 && c.renew;
                    System.out.println("options " + at + " " + (acks ? 1 : 0) + " "
                                       + (key == 78 && renew ? 1 : 0));
                    for (String pattern : patterns(ids.size())) {
                        String pat = pattern.isEmpty() ? "-" : pattern;
                        List<Entry> refused = new ArrayList<>(), kept = new ArrayList<>();
                        for (Entry e : c.topics)
                            (pattern.charAt(ids.indexOf(e.id)) == '1' ? kept : refused).add(e);
                        System.out.println("kept " + at + " " + pat + " "
                                           + hex(request(api, v, header, c, pattern, ids)));
                        for (short code : CODES)
                            for (int lock : LOCKS)
                                System.out.println("refused " + at + " " + pat + " " + code + " "
                                    + lock + " " + hex(response(api, v,
                                        refusedData(key, refused, code, acks, renew, lock))));
                        System.out.println("broker " + at + " " + pat + " "
                                           + hex(response(api, v, brokerData(key, kept))));
                        for (short code : CODES)
                            System.out.println("merged " + at + " " + pat + " " + code + " "
                                + hex(response(api, v, merged(key, kept, refused, code, acks,
                                                               renew))));
                    }
                }
            }
        }
    }

    // KafkaApis.handleShareFetchRequest's isAcknowledgeDataPresentInFetchRequest
    static boolean acknowledges(Case c) {
        for (Entry e : c.topics)
            for (boolean a : e.acks)
                if (a)
                    return true;
        return false;
    }

    static String entries(List<Entry> topics) {
        if (topics.isEmpty())
            return "-";
        List<String> out = new ArrayList<>();
        for (Entry e : topics) {
            List<String> parts = new ArrayList<>();
            for (int p : e.partitions)
                parts.add(Integer.toString(p));
            out.add(uuidHex(e.id) + ":" + String.join(",", parts));
        }
        return String.join(";", out);
    }

    static String uuidHex(Uuid id) {
        return String.format("%016x%016x", id.getMostSignificantBits(),
                             id.getLeastSignificantBits());
    }

    static boolean keep(String pattern, List<Uuid> ids, Entry e) {
        return pattern == null || pattern.charAt(ids.indexOf(e.id)) == '1';
    }

    // ---- requests ----------------------------------------------------------------------------

    static byte[] request(ApiKeys api, short v, RequestHeader header, Case c, String pattern,
                          List<Uuid> ids) {
        ApiMessage data = api.id == 78 ? fetchRequest(v, c, pattern, ids)
            : acknowledgeRequest(v, c, pattern, ids);
        return framed(RequestUtils.serialize(header.data(), header.headerVersion(), data, v));
    }

    static ShareFetchRequestData fetchRequest(short v, Case c, String pattern, List<Uuid> ids) {
        ShareFetchRequestData d = new ShareFetchRequestData()
            .setGroupId("share-gr\u00fcppe").setMemberId(MEMBER.toString())
            .setShareSessionEpoch(c.epoch).setMaxWaitMs(c.renew ? 0 : 500)
            .setMinBytes(c.renew ? 0 : 1).setMaxBytes(c.renew ? 0 : 52428800)
            .setMaxRecords(c.renew ? 0 : 500).setBatchSize(100);
        if (v >= 2)
            d.setShareAcquireMode((byte) (c.name.equals("plain") ? 1 : 0)).setIsRenewAck(c.renew);
        ShareFetchRequestData.FetchTopicCollection topics =
            new ShareFetchRequestData.FetchTopicCollection();
        for (Entry e : c.topics) {
            if (!keep(pattern, ids, e))
                continue;
            ShareFetchRequestData.FetchPartitionCollection partitions =
                new ShareFetchRequestData.FetchPartitionCollection();
            for (int i = 0; i < e.partitions.length; i++) {
                List<ShareFetchRequestData.AcknowledgementBatch> batches = new ArrayList<>();
                if (e.acks[i]) {
                    batches.add(new ShareFetchRequestData.AcknowledgementBatch()
                        .setFirstOffset(100).setLastOffset(102)
                        .setAcknowledgeTypes(List.of((byte) 1, (byte) 2, (byte) 1)));
                    batches.add(new ShareFetchRequestData.AcknowledgementBatch()
                        .setFirstOffset(103).setLastOffset(103)
                        .setAcknowledgeTypes(List.of(c.renew ? (byte) 4 : (byte) 3)));
                }
                partitions.add(new ShareFetchRequestData.FetchPartition()
                    .setPartitionIndex(e.partitions[i]).setAcknowledgementBatches(batches));
            }
            topics.add(new ShareFetchRequestData.FetchTopic().setTopicId(e.id)
                .setPartitions(partitions));
        }
        List<ShareFetchRequestData.ForgottenTopic> forgotten = new ArrayList<>();
        for (Entry e : c.forgotten) {
            List<Integer> parts = new ArrayList<>();
            for (int p : e.partitions)
                parts.add(p);
            forgotten.add(new ShareFetchRequestData.ForgottenTopic().setTopicId(e.id)
                .setPartitions(parts));
        }
        return d.setTopics(topics).setForgottenTopicsData(forgotten);
    }

    static ShareAcknowledgeRequestData acknowledgeRequest(short v, Case c, String pattern,
                                                          List<Uuid> ids) {
        ShareAcknowledgeRequestData d = new ShareAcknowledgeRequestData()
            .setGroupId("share-gr\u00fcppe").setMemberId(MEMBER.toString())
            .setShareSessionEpoch(c.epoch);
        if (v >= 2)
            d.setIsRenewAck(c.renew);
        ShareAcknowledgeRequestData.AcknowledgeTopicCollection topics =
            new ShareAcknowledgeRequestData.AcknowledgeTopicCollection();
        for (Entry e : c.topics) {
            if (!keep(pattern, ids, e))
                continue;
            ShareAcknowledgeRequestData.AcknowledgePartitionCollection partitions =
                new ShareAcknowledgeRequestData.AcknowledgePartitionCollection();
            for (int i = 0; i < e.partitions.length; i++) {
                List<ShareAcknowledgeRequestData.AcknowledgementBatch> batches = new ArrayList<>();
                // every partition acknowledges something but the "plain" case's last one
                if (e.acks[i] || !c.name.equals("plain") || e.id != C)
                    batches.add(new ShareAcknowledgeRequestData.AcknowledgementBatch()
                        .setFirstOffset(40 + i).setLastOffset(41 + i)
                        .setAcknowledgeTypes(List.of((byte) 1, (byte) 3)));
                partitions.add(new ShareAcknowledgeRequestData.AcknowledgePartition()
                    .setPartitionIndex(e.partitions[i]).setAcknowledgementBatches(batches));
            }
            topics.add(new ShareAcknowledgeRequestData.AcknowledgeTopic().setTopicId(e.id)
                .setPartitions(partitions));
        }
        return d.setTopics(topics);
    }

    // ---- the broker's refusals ---------------------------------------------------------------

    static String name(Uuid id) {
        return "topic-" + uuidHex(id);
    }

    static ApiMessage refusedData(int key, List<Entry> refused, short code, boolean acks,
                                  boolean renew, int lock) {
        Errors error = Errors.forCode(code);
        if (key == 79) {
            // handleAcknowledgements, then processShareAcknowledgeResponse
            LinkedHashMap<TopicIdPartition, ShareAcknowledgeResponseData.PartitionData> acked =
                new LinkedHashMap<>();
            for (Entry e : refused)
                for (int p : e.partitions) {
                    TopicIdPartition tip = new TopicIdPartition(e.id, p, name(e.id));
                    acked.put(tip, ShareAcknowledgeResponse.partitionResponse(tip, error));
                }
            return ShareAcknowledgeResponse.of(Errors.NONE, 0, acked, List.of(), lock).data();
        }
        // handleFetchFromShareFetchRequest (not called under IsRenewAck) and, when the request
        // acknowledges anything, handleAcknowledgements over every partition of the request
        LinkedHashMap<TopicIdPartition, ShareFetchResponseData.PartitionData> fetched =
            new LinkedHashMap<>();
        LinkedHashMap<TopicIdPartition, ShareAcknowledgeResponseData.PartitionData> acked =
            new LinkedHashMap<>();
        for (Entry e : refused)
            for (int p : e.partitions) {
                TopicIdPartition tip = new TopicIdPartition(e.id, p, name(e.id));
                if (!renew)
                    fetched.put(tip, ShareFetchResponse.partitionResponse(tip, error));
                if (acks)
                    acked.put(tip, ShareAcknowledgeResponse.partitionResponse(tip, error));
            }
        // processShareFetchResponse: the share session context's response (ShareFetchResponse.of),
        // then createResponse: each partition through getResponsePartitionData, and .of again
        ShareFetchResponse generated = ShareFetchResponse.of(Errors.NONE, 0, fetched, List.of(), 0);
        LinkedHashMap<TopicIdPartition, ShareFetchResponseData.PartitionData> responseData =
            new LinkedHashMap<>();
        for (ShareFetchResponseData.ShareFetchableTopicResponse topic
                : generated.data().responses())
            for (ShareFetchResponseData.PartitionData pd : topic.partitions()) {
                TopicIdPartition tip = new TopicIdPartition(topic.topicId(), pd.partitionIndex(),
                                                            name(topic.topicId()));
                responseData.put(tip, new ShareFetchResponseData.PartitionData()
                    .setPartitionIndex(tip.partition())
                    .setErrorCode(Errors.forCode(pd.errorCode()).code())
                    .setRecords(ShareFetchResponse.recordsOrFail(pd))
                    .setAcquiredRecords(pd.acquiredRecords())
                    .setCurrentLeader(pd.currentLeader()));
            }
        ShareFetchResponseData data =
            ShareFetchResponse.of(generated.error(), 0, responseData, List.of(), lock).data();
        // handleShareFetchRequest's combining of the acknowledgement results
        Map<Uuid, LinkedHashMap<Integer, ShareAcknowledgeResponseData.PartitionData>> byTopic =
            new LinkedHashMap<>();
        acked.forEach((tip, pd) -> byTopic.computeIfAbsent(tip.topicId(), k -> new LinkedHashMap<>())
            .put(tip.partition(), pd));
        for (ShareFetchResponseData.ShareFetchableTopicResponse topic : data.responses()) {
            LinkedHashMap<Integer, ShareAcknowledgeResponseData.PartitionData> sub =
                byTopic.remove(topic.topicId());
            if (sub == null)
                continue;
            for (ShareFetchResponseData.PartitionData pd : topic.partitions()) {
                ShareAcknowledgeResponseData.PartitionData a = sub.remove(pd.partitionIndex());
                if (a != null)
                    pd.setAcknowledgeErrorCode(a.errorCode())
                        .setAcknowledgeErrorMessage(a.errorMessage());
            }
            sub.forEach((index, a) -> topic.partitions().add(acknowledgedOnly(index, a)));
        }
        byTopic.forEach((id, sub) -> {
            ShareFetchResponseData.ShareFetchableTopicResponse topic =
                new ShareFetchResponseData.ShareFetchableTopicResponse().setTopicId(id);
            sub.forEach((index, a) -> topic.partitions().add(acknowledgedOnly(index, a)));
            data.responses().add(topic);
        });
        return data;
    }

    static ShareFetchResponseData.PartitionData acknowledgedOnly(
            int index, ShareAcknowledgeResponseData.PartitionData a) {
        return new ShareFetchResponseData.PartitionData().setPartitionIndex(index)
            .setErrorCode(Errors.NONE.code()).setAcknowledgeErrorCode(a.errorCode())
            .setAcknowledgeErrorMessage(a.errorMessage()).setRecords(MemoryRecords.EMPTY);
    }

    // ---- a broker's answer to the kept topics ----------------------------------------------

    static ApiMessage brokerData(int key, List<Entry> kept) {
        Map<Uuid, LinkedHashSet<Integer>> byTopic = new LinkedHashMap<>();
        for (Entry e : kept)
            for (int p : e.partitions)
                byTopic.computeIfAbsent(e.id, k -> new LinkedHashSet<>()).add(p);
        if (key == 79) {
            ShareAcknowledgeResponseData data = new ShareAcknowledgeResponseData()
                .setThrottleTimeMs(12).setAcquisitionLockTimeoutMs(15000);
            byTopic.forEach((id, parts) -> {
                ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponse topic =
                    new ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponse().setTopicId(id);
                for (int p : parts)
                    topic.partitions().add(new ShareAcknowledgeResponseData.PartitionData()
                        .setPartitionIndex(p).setErrorCode((short) (p == 2 ? 6 : 0))
                        .setErrorMessage(p == 2 ? "not the leader" : null)
                        .setCurrentLeader(new ShareAcknowledgeResponseData.LeaderIdAndEpoch()
                            .setLeaderId(p == 2 ? 3 : -1).setLeaderEpoch(p == 2 ? 11 : -1)));
                data.responses().add(topic);
            });
            data.nodeEndpoints().add(new ShareAcknowledgeResponseData.NodeEndpoint()
                .setNodeId(3).setHost("broker-3.example").setPort(9093).setRack("rack-c"));
            data.unknownTaggedFields().add(new RawTaggedField(9, new byte[] {1, 2, 3}));
            return data;
        }
        ShareFetchResponseData data = new ShareFetchResponseData()
            .setThrottleTimeMs(12).setAcquisitionLockTimeoutMs(15000);
        byTopic.forEach((id, parts) -> {
            ShareFetchResponseData.ShareFetchableTopicResponse topic =
                new ShareFetchResponseData.ShareFetchableTopicResponse().setTopicId(id);
            for (int p : parts)
                topic.partitions().add(new ShareFetchResponseData.PartitionData()
                    .setPartitionIndex(p).setErrorCode((short) (p == 2 ? 6 : 0))
                    .setAcknowledgeErrorCode((short) (p == 1 ? 2 : 0))
                    .setCurrentLeader(new ShareFetchResponseData.LeaderIdAndEpoch()
                        .setLeaderId(2).setLeaderEpoch(9))
                    .setRecords(p == 2 ? MemoryRecords.EMPTY : MemoryRecords.withRecords(
                        Compression.NONE, new SimpleRecord(("key-" + p).getBytes(),
                                                           ("value \u00e9 " + p).getBytes())))
                    .setAcquiredRecords(List.of(new ShareFetchResponseData.AcquiredRecords()
                        .setFirstOffset(10).setLastOffset(10).setDeliveryCount((short) 1))));
            data.responses().add(topic);
        });
        data.nodeEndpoints().add(new ShareFetchResponseData.NodeEndpoint()
            .setNodeId(3).setHost("broker-3.example").setPort(9093).setRack("rack-c"));
        data.unknownTaggedFields().add(new RawTaggedField(9, new byte[] {1, 2, 3}));
        return data;
    }

    // the broker's answer with the refused topics' entries put first
    static ApiMessage merged(int key, List<Entry> kept, List<Entry> refused, short code,
                             boolean acks, boolean renew) {
        ApiMessage broker = brokerData(key, kept);
        ApiMessage answer = refusedData(key, refused, code, acks, renew, 0);
        if (key == 79) {
            ShareAcknowledgeResponseData b = (ShareAcknowledgeResponseData) broker;
            ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponseCollection all =
                new ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponseCollection();
            for (ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponse t
                    : ((ShareAcknowledgeResponseData) answer).responses())
                all.add(t.duplicate());
            for (ShareAcknowledgeResponseData.ShareAcknowledgeTopicResponse t : b.responses())
                all.add(t.duplicate());
            return b.setResponses(all);
        }
        ShareFetchResponseData b = (ShareFetchResponseData) broker;
        ShareFetchResponseData.ShareFetchableTopicResponseCollection all =
            new ShareFetchResponseData.ShareFetchableTopicResponseCollection();
        for (ShareFetchResponseData.ShareFetchableTopicResponse t
                : ((ShareFetchResponseData) answer).responses())
            all.add(t.duplicate());
        for (ShareFetchResponseData.ShareFetchableTopicResponse t : b.responses())
            all.add(t.duplicate());
        return b.setResponses(all);
    }

    // ---- framing -----------------------------------------------------------------------------

    // a whole framed response: size, response header (correlation id), body
    static byte[] response(ApiKeys api, short version, ApiMessage body) {
        ResponseHeader header = new ResponseHeader(CORRELATION_ID,
                                                   api.responseHeaderVersion(version));
        return framed(RequestUtils.serialize(header.data(), header.headerVersion(), body, version));
    }

    static byte[] framed(ByteBuffer buffer) {
        byte[] bytes = new byte[buffer.remaining()];
        buffer.get(bytes);
        return ByteBuffer.allocate(4 + bytes.length).putInt(bytes.length).put(bytes).array();
    }

    static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes)
            out.append(String.format("%02x", b));
        return out.toString();
    }
}
