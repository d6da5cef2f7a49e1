// Kafka's own Admin client on the share-group offset APIs (KIP-932): DescribeShareGroupOffsets
// (90, Admin.listShareGroupOffsets), AlterShareGroupOffsets (91) and DeleteShareGroupOffsets
// (92), as one principal (alice) through a proxy that enforces the cluster's ACLs for her, for
// tests/test_share_offsets_authorization.py. One JVM run:
//
//   1. a KafkaShareConsumer of alice's (group <alice group>) subscribes to her topic, polls
//      until it has a record or 30 s, and close()s: the share group exists and is empty (a
//      member that left gracefully), as Alter and Delete want it;
//   2. the super user admin, straight to the broker (the second properties file), sets the
//      group's start offset on bob's topic too: the group then holds a topic alice may not
//      describe, which a listing of all its topics through the proxy must leave out;
//   3. alice alters the group's offsets {her topic-0: 0, bob's topic-0: 0};
//   4. alice lists them, naming both topics; and once naming none (all of the group's topics),
//      and admin the same straight to the broker;
//   5. alice deletes the group's offsets of both topics;
//   6. alice alters bob's group's offsets (refused at FindCoordinator: she may not describe it);
//   7. alice alters and deletes the offsets of a group she may only describe (refused by the
//      group check of AlterShareGroupOffsets and DeleteShareGroupOffsets themselves).
//
// One line per outcome, fields separated by single spaces (topic names have none):
//   consumed <group> <records>
//   <step> <group> <topic>:<partition> <outcome>   step alter, list, listall, admin-alter,
//                                                  admin-listall; outcome OK, an offset,
//                                                  "absent" (not in the listing's map), "null"
//                                                  (no start offset) or an exception's class
//   <step> <group> <topic> <outcome>               step delete
//   <step> <group> * <exception class>             a listing whose future failed as a whole
//   retry <step> <group> <outcomes>                a transient outcome, tried again
//   done
// Usage: java -cp kafka-clients.jar:. ShareOffsetsAdmin <alice properties> <admin properties>
//            <alice topic> <bob topic> <alice group> <bob group> <describe-only group>
import java.io.FileInputStream;
import java.io.InputStream;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AlterShareGroupOffsetsResult;
import org.apache.kafka.clients.admin.DeleteShareGroupOffsetsResult;
import org.apache.kafka.clients.admin.ListShareGroupOffsetsSpec;
import org.apache.kafka.clients.admin.SharePartitionOffsetInfo;
import org.apache.kafka.clients.consumer.KafkaShareConsumer;
import org.apache.kafka.common.KafkaFuture;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.StringDeserializer;

public class ShareOffsetsAdmin {
    static final long RETRY_MS = 30_000;
    // outcomes worth another try: the coordinator still being found or loaded, or the group
    // not empty yet (the member's leave not yet seen). Not a TimeoutException: the Admin
    // client has retried for default.api.timeout.ms already (a proxy that closes the
    // connection on every try ends there)
    static final Set<String> TRANSIENT = Set.of(
        "CoordinatorNotAvailableException", "NotCoordinatorException",
        "CoordinatorLoadInProgressException", "GroupNotEmptyException",
        "RebalanceInProgressException");

    static Properties load(String path) throws Exception {
        Properties props = new Properties();
        try (InputStream in = new FileInputStream(path)) {
            props.load(in);
        }
        // an answer comes in milliseconds: a call that gets none fails in 15 s
        props.put("default.api.timeout.ms", "15000");
        props.put("request.timeout.ms", "10000");
        return props;
    }

    static Throwable cause(Throwable t) {
        while (t instanceof ExecutionException && t.getCause() != null)
            t = t.getCause();
        return t;
    }

    static String outcome(KafkaFuture<?> future) {
        try {
            future.get(30, TimeUnit.SECONDS);
            return "OK";
        } catch (Throwable t) {
            return cause(t).getClass().getSimpleName();
        }
    }

    static String tp(TopicPartition tp) {
        return tp.topic() + ":" + tp.partition();
    }

    // ``attempt`` again while one of its outcomes is transient, for up to RETRY_MS; then print
    // the last outcomes, one line each
    static void retrying(String step, String group, Supplier<Map<String, String>> attempt)
            throws InterruptedException {
        long deadline = System.currentTimeMillis() + RETRY_MS;
        Map<String, String> outcomes = attempt.get();
        while (outcomes.values().stream().anyMatch(TRANSIENT::contains)
                && System.currentTimeMillis() < deadline) {
            System.out.println("retry " + step + " " + group + " "
                + outcomes.toString().replace(' ', '_'));
            System.out.flush();
            Thread.sleep(500);
            outcomes = attempt.get();
        }
        outcomes.forEach((what, result) ->
            System.out.println(step + " " + group + " " + what + " " + result));
        System.out.flush();
    }

    static void alter(Admin admin, String step, String group, Map<TopicPartition, Long> offsets)
            throws InterruptedException {
        retrying(step, group, () -> {
            AlterShareGroupOffsetsResult result = admin.alterShareGroupOffsets(group, offsets);
            Map<String, String> outcomes = new LinkedHashMap<>();
            offsets.keySet().forEach(p -> outcomes.put(tp(p), outcome(result.partitionResult(p))));
            return outcomes;
        });
    }

    static void delete(Admin admin, String group, Set<String> topics) throws InterruptedException {
        retrying("delete", group, () -> {
            DeleteShareGroupOffsetsResult result = admin.deleteShareGroupOffsets(group, topics);
            Map<String, String> outcomes = new LinkedHashMap<>();
            topics.forEach(t -> outcomes.put(t, outcome(result.topicResult(t))));
            return outcomes;
        });
    }

    // ``partitions`` null: every topic of the group (the request's Topics null)
    static void list(Admin admin, String step, String group, List<TopicPartition> partitions)
            throws InterruptedException {
        retrying(step, group, () -> {
            ListShareGroupOffsetsSpec spec = new ListShareGroupOffsetsSpec();
            if (partitions != null)
                spec.topicPartitions(partitions);
            Map<String, String> outcomes = new TreeMap<>();
            Map<TopicPartition, SharePartitionOffsetInfo> got;
            try {
                got = admin.listShareGroupOffsets(Map.of(group, spec))
                    .partitionsToOffsetInfo(group).get(30, TimeUnit.SECONDS);
            } catch (Throwable t) {
                outcomes.put("*", cause(t).getClass().getSimpleName());
                return outcomes;
            }
            if (partitions != null)
                for (TopicPartition p : partitions)
                    if (!got.containsKey(p))
                        outcomes.put(tp(p), "absent");
            got.forEach((p, info) ->
                outcomes.put(tp(p), info == null ? "null" : Long.toString(info.startOffset())));
            return outcomes;
        });
    }

    public static void main(String[] args) throws Exception {
        Properties alice = load(args[0]);
        Properties admin = load(args[1]);
        String aliceTopic = args[2], bobTopic = args[3];
        String aliceGroup = args[4], bobGroup = args[5], describeOnlyGroup = args[6];
        TopicPartition aliceTp = new TopicPartition(aliceTopic, 0);
        TopicPartition bobTp = new TopicPartition(bobTopic, 0);

        // 1. the share group made, and left empty
        Properties consumer = new Properties();
        consumer.putAll(alice);
        consumer.put("group.id", aliceGroup);
        consumer.put("client.id", "share-offsets-consumer");
        int records = 0;
        try (KafkaShareConsumer<String, String> c = new KafkaShareConsumer<>(
                consumer, new StringDeserializer(), new StringDeserializer())) {
            c.subscribe(List.of(aliceTopic));
            long deadline = System.currentTimeMillis() + 30_000;
            while (records == 0 && System.currentTimeMillis() < deadline)
                records += c.poll(Duration.ofMillis(500)).count();
        }  // close(): its acknowledgements, then a graceful leave
        System.out.println("consumed " + aliceGroup + " " + records);
        System.out.flush();

        try (Admin asAlice = Admin.create(alice); Admin asAdmin = Admin.create(admin)) {
            // 2. the group holds bob's topic too (set by the super user, on the broker itself)
            Map<TopicPartition, Long> bobOnly = new LinkedHashMap<>();
            bobOnly.put(bobTp, 0L);
            alter(asAdmin, "admin-alter", aliceGroup, bobOnly);

            // 3. alice alters both
            Map<TopicPartition, Long> both = new LinkedHashMap<>();
            both.put(aliceTp, 0L);
            both.put(bobTp, 0L);
            alter(asAlice, "alter", aliceGroup, both);

            // 4. and lists them: both named, then all of the group's
            list(asAlice, "list", aliceGroup, List.of(aliceTp, bobTp));
            list(asAlice, "listall", aliceGroup, null);
            list(asAdmin, "admin-listall", aliceGroup, null);

            // 5. deletes both topics' offsets
            Set<String> topics = new LinkedHashSet<>(List.of(aliceTopic, bobTopic));
            delete(asAlice, aliceGroup, topics);

            // 6. bob's group
            alter(asAlice, "alter", bobGroup, both);

            // 7. a group she may describe, not read nor delete
            alter(asAlice, "alter", describeOnlyGroup, both);
            delete(asAlice, describeOnlyGroup, topics);
        }
        System.out.println("done");
    }
}
