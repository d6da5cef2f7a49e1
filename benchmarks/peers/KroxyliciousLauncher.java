// The main class kthrottle's benchmarks run Kroxylicious with: the project's own launcher
// (kroxylicious-app) is not on the Maven Central this machine reaches, its runtime is. Reads the
// YAML configuration named on the command line, starts the proxy and serves until SIGTERM or
// Ctrl-C, then shuts it down. scripts/peer-proxies compiles this file against the jars it fetched.
//
//   java -cp ".cache/kroxylicious-0.12.0/classes:.cache/kroxylicious-0.12.0/lib/*" \
//       KroxyliciousLauncher proxy.yaml
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.concurrent.CountDownLatch;

import io.kroxylicious.proxy.KafkaProxy;
import io.kroxylicious.proxy.config.ConfigParser;
import io.kroxylicious.proxy.config.Configuration;
import io.kroxylicious.proxy.internal.config.Features;

public final class KroxyliciousLauncher {

    private KroxyliciousLauncher() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: KroxyliciousLauncher CONFIG.yaml");
            System.exit(2);
        }
        Path file = Path.of(args[0]);
        if (!Files.isReadable(file)) {
            System.err.println("KroxyliciousLauncher: cannot read " + file.toAbsolutePath());
            System.exit(2);
        }
        ConfigParser parser = new ConfigParser();  // also the registry of the plugins it names
        Configuration config;
        try (InputStream in = Files.newInputStream(file)) {
            config = parser.parseConfiguration(in);
        }
        KafkaProxy proxy = new KafkaProxy(parser, config, Features.defaultFeatures());
        CountDownLatch stopped = new CountDownLatch(1);
        // SIGTERM and SIGINT run the shutdown hooks: close the listeners, then let the JVM exit
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                proxy.close();
            }
            catch (Exception e) {
                System.err.println("KroxyliciousLauncher: shutting down: " + e);
            }
            finally {
                stopped.countDown();
            }
        }, "launcher-shutdown"));
        try {
            proxy.startup();
        }
        catch (Exception e) {
            System.err.println("KroxyliciousLauncher: the proxy did not start: " + e);
            e.printStackTrace();
            System.exit(1);
        }
        System.out.println("KroxyliciousLauncher: serving the configuration in " + file);
        System.out.flush();
        proxy.block();  // returns once the shutdown hook has closed the proxy
        stopped.await();
    }
}
