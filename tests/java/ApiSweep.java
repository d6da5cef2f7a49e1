// Sends each API's default request (Kafka's own generated message at its defaults) at each
// version asked, one connection each, to one address; prints what came back:
//   <key> <version> answered <error>=<count>,... | closed | silent | unreadable <why>
// Usage: java -cp kafka-clients.jar:. ApiSweep host:port key:low-high ...
import java.io.DataInputStream;
import java.io.EOFException;
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.net.SocketTimeoutException;
import java.nio.ByteBuffer;
import java.util.Map;
import java.util.TreeMap;

import org.apache.kafka.common.protocol.ApiKeys;
import org.apache.kafka.common.protocol.ApiMessage;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.requests.AbstractResponse;
import org.apache.kafka.common.requests.RequestHeader;
import org.apache.kafka.common.requests.RequestUtils;

public class ApiSweep {
    public static void main(String[] args) throws Exception {
        String[] hostPort = args[0].split(":");
        InetSocketAddress address = new InetSocketAddress(hostPort[0], Integer.parseInt(hostPort[1]));
        for (int i = 1; i < args.length; i++) {
            String[] spec = args[i].split("[:-]");
            ApiKeys api = ApiKeys.forId(Integer.parseInt(spec[0]));
            for (short v = Short.parseShort(spec[1]); v <= Short.parseShort(spec[2]); v++)
                System.out.println(api.id + " " + v + " " + outcome(address, api, v));
        }
    }

    static String outcome(InetSocketAddress address, ApiKeys api, short version) {
        RequestHeader header = new RequestHeader(api, version, "sweep", 7);
        ApiMessage request = api.messageType.newRequest();
        ByteBuffer frame;
        try {
            frame = RequestUtils.serialize(header.data(), header.headerVersion(), request, version);
        } catch (RuntimeException e) {  // a default this version cannot carry
            return "unbuildable " + e.getClass().getSimpleName();
        }
        byte[] answer;
        try (Socket socket = new Socket()) {
            socket.connect(address, 3000);
            socket.setSoTimeout(3000);
            byte[] body = new byte[frame.remaining()];
            frame.get(body);
            ByteBuffer out = ByteBuffer.allocate(4 + body.length).putInt(body.length).put(body);
            socket.getOutputStream().write(out.array());
            DataInputStream in = new DataInputStream(socket.getInputStream());
            answer = new byte[in.readInt()];
            in.readFully(answer);
        } catch (SocketTimeoutException e) {
            return "silent";
        } catch (EOFException e) {
            return "closed";
        } catch (IOException e) {  // reset by the peer
            return "closed";
        }
        try {
            AbstractResponse response = AbstractResponse.parseResponse(ByteBuffer.wrap(answer), header);
            Map<String, Integer> errors = new TreeMap<>();
            for (Map.Entry<Errors, Integer> e : response.errorCounts().entrySet())
                errors.put(e.getKey().name(), e.getValue());
            StringBuilder text = new StringBuilder("answered");
            String sep = " ";
            for (Map.Entry<String, Integer> e : errors.entrySet()) {
                text.append(sep).append(e.getKey()).append('=').append(e.getValue());
                sep = ",";
            }
            return text.toString();
        } catch (RuntimeException e) {
            return "unreadable " + e.getClass().getSimpleName();
        }
    }
}
