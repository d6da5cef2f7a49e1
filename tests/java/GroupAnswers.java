// Prints, as hex, what Kafka's own generated message classes serialize for the answers
// kthrottle.codecs.group_answers builds, and requests it reads: tests/test_group_answers.py
// compares them byte for byte. One line each:
//   range <key> <lowest> <highest>
//   plain <key> <version> <code> <hex>           data class: ErrorCode set, all else default
//   message <key> <version> <code> <hex>         the same with ErrorMessage MESSAGE
//   request <key> <version> <code> <hex> [<msg>] XxxRequest.getErrorResponse(0, exception)
//                                                and the top-level ErrorMessage it carries
//   describe <key> <version> <code> <group ids> <hex>  getErrorResponse of a describe
//                                                request naming those groups
//   subscribe <key> <version> <case> <body offset> <hex>  a heartbeat request
// Usage: java -cp kafka-clients.jar:. GroupAnswers
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;

import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.message.ConsumerGroupDescribeRequestData;
import org.apache.kafka.common.message.ConsumerGroupHeartbeatRequestData;
import org.apache.kafka.common.message.ShareGroupDescribeRequestData;
import org.apache.kafka.common.message.ShareGroupHeartbeatRequestData;
import org.apache.kafka.common.message.StreamsGroupDescribeRequestData;
import org.apache.kafka.common.protocol.ApiKeys;
import org.apache.kafka.common.protocol.ApiMessage;
import org.apache.kafka.common.protocol.ByteBufferAccessor;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.protocol.MessageUtil;
import org.apache.kafka.common.requests.AbstractRequest;
import org.apache.kafka.common.requests.AbstractResponse;
import org.apache.kafka.common.requests.RequestHeader;
import org.apache.kafka.common.requests.RequestUtils;
import org.apache.kafka.common.requests.ResponseHeader;

public class GroupAnswers {
    static final int CORRELATION_ID = 7;
    static final String MESSAGE = "refused by kthrottle \u00e9";
    static final int[] ERROR_KEYS = {68, 76, 78, 79, 88, 91, 92};
    static final int[] DESCRIBE_KEYS = {69, 77, 89};
    static final short[] CODES = {30, 15, -1};

    public static void main(String[] args) throws Exception {
        for (int key : ERROR_KEYS) {
            ApiKeys api = ApiKeys.forId(key);
            range(api);
            for (short v = low(api); v <= high(api); v++) {
                for (short code : CODES) {
                    ApiMessage plain = api.messageType.newResponse();
                    set(plain, "setErrorCode", short.class, code);
                    print("plain", api, v, code, hex(response(api, v, plain)));
                    ApiMessage withMessage = api.messageType.newResponse();
                    set(withMessage, "setErrorCode", short.class, code);
                    set(withMessage, "setErrorMessage", String.class, MESSAGE);
                    print("message", api, v, code, hex(response(api, v, withMessage)));
                    AbstractRequest request = parse(api, v, api.messageType.newRequest());
                    AbstractResponse answer = request.getErrorResponse(
                        0, Errors.forCode(code).exception());
                    String message = (String) answer.data().getClass()
                        .getMethod("errorMessage").invoke(answer.data());
                    print("request", api, v, code, hex(response(api, v, answer.data()))
                          + (message == null ? "" : " " + message));
                }
            }
        }
        List<List<String>> groupLists = List.of(List.of("g1", "g2"), List.of(),
                                                List.of("gr\u00fcppe"),
                                                List.of("g".repeat(200), "x"));
        for (int key : DESCRIBE_KEYS) {
            ApiKeys api = ApiKeys.forId(key);
            range(api);
            for (short v = low(api); v <= high(api); v++) {
                for (short code : CODES) {
                    for (List<String> groups : groupLists) {
                        AbstractRequest request = parse(api, v, describe(key, groups));
                        AbstractResponse answer = request.getErrorResponse(
                            0, Errors.forCode(code).exception());
                        print("describe", api, v, code,
                              ids(groups) + " " + hex(response(api, v, answer.data())));
                    }
                }
            }
        }
        for (int key : new int[] {68, 76}) {
            ApiKeys api = ApiKeys.forId(key);
            range(api);
            for (short v = low(api); v <= high(api); v++)
                for (String name : new String[] {"names", "null", "empty", "regex", "both"})
                    subscribe(api, v, name);
        }
    }

    static short low(ApiKeys api) {
        return api.messageType.lowestSupportedVersion();
    }

    static short high(ApiKeys api) {
        return api.messageType.highestSupportedVersion(true);
    }

    static void range(ApiKeys api) {
        System.out.println("range " + api.id + " " + low(api) + " " + high(api));
    }

    static void print(String what, ApiKeys api, short version, short code, String rest) {
        System.out.println(what + " " + api.id + " " + version + " " + code + " " + rest);
    }

    static void set(Object target, String method, Class<?> type, Object value) throws Exception {
        target.getClass().getMethod(method, type).invoke(target, value);
    }

    static AbstractRequest parse(ApiKeys api, short version, ApiMessage data) {
        ByteBuffer buffer = MessageUtil.toByteBufferAccessor(data, version).buffer();
        buffer.rewind();
        return AbstractRequest.parseRequest(api, version, new ByteBufferAccessor(buffer)).request;
    }

    static ApiMessage describe(int key, List<String> groups) {
        switch (key) {
            case 69: return new ConsumerGroupDescribeRequestData().setGroupIds(groups);
            case 77: return new ShareGroupDescribeRequestData().setGroupIds(groups);
            default: return new StreamsGroupDescribeRequestData().setGroupIds(groups);
        }
    }

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

    // a heartbeat request whose subscription is the case named; the fields before it set so
    // that a reader must skip them right
    static void subscribe(ApiKeys api, short version, String name) {
        List<String> names;
        String regex = null;
        switch (name) {
            case "names": names = List.of("orders", "pay\u00e9ments"); break;
            case "null": names = null; break;
            case "empty": names = new ArrayList<>(); regex = ""; break;
            case "regex": names = null; regex = "^orders-.*"; break;
            default: names = List.of("a"); regex = "b.*"; break;
        }
        if (regex != null && api.id == 68 && version < 1)
            return;  // no SubscribedTopicRegex before v1
        ApiMessage data;
        if (api.id == 68) {
            ConsumerGroupHeartbeatRequestData d = new ConsumerGroupHeartbeatRequestData()
                .setGroupId("group-\u00fc").setMemberId(Uuid.randomUuid().toString())
                .setMemberEpoch(12).setInstanceId(name.equals("names") ? "instance-1" : null)
                .setRackId(name.equals("both") ? "rack-9" : null).setRebalanceTimeoutMs(300000)
                .setSubscribedTopicNames(names).setServerAssignor("uniform");
            if (regex != null)
                d.setSubscribedTopicRegex(regex);
            data = d;
        } else {
            data = new ShareGroupHeartbeatRequestData()
                .setGroupId("share-group").setMemberId(Uuid.randomUuid().toString())
                .setMemberEpoch(0).setRackId(name.equals("null") ? null : "rack-2")
                .setSubscribedTopicNames(names);
        }
        RequestHeader header = new RequestHeader(api, version, "client-" + name, 99);
        byte[] frame = framed(RequestUtils.serialize(header.data(), header.headerVersion(), data,
                                                     version));
        System.out.println("subscribe " + api.id + " " + version + " " + name + " "
                           + (4 + header.size()) + " " + hex(frame));
    }

    // the group ids as hex of their UTF-8, comma-separated ("-": none): stdout's charset is
    // the locale's
    static String ids(List<String> groups) {
        List<String> out = new ArrayList<>();
        for (String group : groups)
            out.add(hex(group.getBytes(StandardCharsets.UTF_8)));
        return groups.isEmpty() ? "-" : String.join(",", out);
    }

    static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes)
            out.append(String.format("%02x", b));
        return out.toString();
    }
}
