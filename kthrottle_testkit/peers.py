"""The proxies kthrottle is measured against, and Kafka's own Java client, for
``benchmarks/proxy_overhead.py`` and its tests.

* Kroxylicious (Java/Netty), pass-through: no filters, one virtual cluster whose gateway gives
  every upstream node a port of its own (``portIdentifiesNode``), run by this project's launcher
  (``benchmarks/peers/KroxyliciousLauncher.java``) from the jars ``scripts/peer-proxies``
  fetched;
* grepplabs/kafka-proxy (Go), pass-through: ``kafka-proxy server`` with a
  ``--bootstrap-server-mapping`` per upstream node;
* Kafka's performance tools (``ProducerPerformance``, ``ConsumerPerformance``) as a client:
  their command lines and parsers for what they print.

Every server here listens on 127.0.0.1 and free ports, is started through a harness
``Processes`` (``proxy=True``, so that ``--proxy-cpus`` pins it like kthrottle) and is stopped by
its own PID by whoever started it. ``PeerMissing`` says what to run when a peer is not
installed.
"""
import re
import subprocess
from pathlib import Path

from kthrottle.embedded import free_port, wait_for_port
from kthrottle.kafka_kit import java_binary, metadata_brokers
from kthrottle_testkit import ROOT

PEER_PROXIES = ROOT / "scripts" / "peer-proxies"


def _pinned(path, pattern):
    found = re.search(pattern, Path(path).read_text(), re.MULTILINE)
    return found.group(1) if found else "unknown"


# the versions pinned where they are installed from
KROXYLICIOUS_VERSION = _pinned(ROOT / "benchmarks" / "peers" / "pom.xml",
                               r"<kroxylicious\.version>([^<]+)</")
KAFKA_PROXY_VERSION = _pinned(PEER_PROXIES, r"^KAFKA_PROXY_VERSION=(\S+)")
KROXYLICIOUS_MAIN = "KroxyliciousLauncher"
PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_PERFORMANCE = "org.apache.kafka.tools.ConsumerPerformance"
# the JVM options of the Java proxy and tools: a fixed heap, so that RSS compares across runs,
# and an English locale, so that the tools print numbers as the parsers below read them
KROXYLICIOUS_HEAP = "512m"
TOOL_HEAP = "512m"
ENGLISH = ("-Duser.language=en", "-Duser.country=US")


class PeerMissing(RuntimeError):
    """A peer proxy is not installed and ``scripts/peer-proxies`` could not install it."""


def install(peer):
    """``scripts/peer-proxies PEER`` (quick once done): Kroxylicious's folder or kafka-proxy's
    binary, as a Path; PeerMissing with the script's own explanation when it fails."""
    done = subprocess.run([str(PEER_PROXIES), peer], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        said = "\n".join(line for line in done.stderr.splitlines() if line.strip())
        raise PeerMissing("%s is not installed: scripts/peer-proxies %s failed (exit %d): %s"
                          % (peer, peer, done.returncode, said[-2000:] or "no message"))
    return Path(done.stdout.strip().splitlines()[-1])


def describe(peer, installed):
    """One line on what ``install(peer)`` gave: version, and how kafka-proxy was built."""
    if peer == "kroxylicious":
        return ("Kroxylicious %s (kroxylicious-runtime from Maven Central, this project's "
                "launcher; JVM heap %s)" % (KROXYLICIOUS_VERSION, KROXYLICIOUS_HEAP))
    stamp = Path(installed).parent / (".kafka-proxy-%s" % KAFKA_PROXY_VERSION)
    how = stamp.read_text().strip() if stamp.exists() else "origin unknown"
    return "kafka-proxy %s (%s)" % (KAFKA_PROXY_VERSION, how)


def upstream_nodes(bootstrap, timeout=10.0):
    """[(node_id, host, port)] of the brokers a Metadata request to ``bootstrap`` names."""
    host, _, port = bootstrap.rpartition(":")
    brokers, _ = metadata_brokers(host, int(port), timeout=timeout)
    if not brokers:
        raise RuntimeError("Metadata from %s names no broker" % bootstrap)
    return sorted(brokers)


def check_behind(name, bootstrap, ports, proc, upstream):
    """A Metadata answer through ``bootstrap`` names every node at 127.0.0.1 on one of the
    proxy's ``ports``, and the same nodes as ``upstream`` does; returns those nodes."""
    host, _, port = bootstrap.rpartition(":")
    seen, _ = metadata_brokers(host, int(port), timeout=10.0)
    seen = sorted(seen)
    wrong = [b for b in seen if b[1] != "127.0.0.1" or b[2] not in ports]
    if wrong or [b[0] for b in seen] != [b[0] for b in upstream]:
        raise RuntimeError("Metadata through %s on %s names %s (upstream: %s): clients would "
                           "not stay behind it" % (name, bootstrap, seen, upstream))
    if proc.poll() is not None:
        raise RuntimeError("%s exited with code %s" % (name, proc.returncode))
    return seen


def _started(procs, name, proc, bootstrap, ports, upstream, timeout):
    """Wait until the proxy listens and keeps clients behind it; stop it and raise with the
    end of its log otherwise."""
    from kthrottle_testkit.harness import last_log_line

    try:
        wait_for_port("127.0.0.1", int(bootstrap.rpartition(":")[2]), timeout=timeout,
                      proc=proc)
        return check_behind(name, bootstrap, ports, proc, upstream)
    except Exception as exc:
        procs.stop(proc)
        said = last_log_line(procs.log_dir / (name + ".log"))
        raise RuntimeError("%s did not start: %s%s (log in %s)" % (
            name, exc, "; its log ends with: %s" % said if said else "",
            procs.log_dir)) from None


def api_versions(host, port, timeout=10.0):
    """{api_key: (min_version, max_version)} from an ApiVersions v0 request to host:port."""
    import socket
    import struct

    from kthrottle.kafka_kit import _read_exactly

    client_id = b"kthrottle-bench"
    body = struct.pack(">hhih", 18, 0, 1, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _read_exactly(sock, 4))[0]
        answer = _read_exactly(sock, size)
    _, error, count = struct.unpack(">ihi", answer[:10])
    if error:
        raise RuntimeError("ApiVersions on %s:%d answered error %d" % (host, port, error))
    return {key: (low, high) for key, low, high in
            (struct.unpack(">hhh", answer[10 + 6 * i:16 + 6 * i]) for i in range(count))}


def invalid_api_ranges(host, port):
    """[(api_key, (min, max))] of the APIs host:port advertises with min > max."""
    return sorted((key, r) for key, r in api_versions(host, port).items() if r[0] > r[1])


def wait_for_leaders(admin, topic, partitions, timeout=30.0):
    """Until Metadata (through a confluent-kafka AdminClient ``admin``) names a leader for
    each of ``topic``'s ``partitions``. A Produce or Fetch sent before is answered
    NOT_LEADER, and since KIP-951 (Produce v10, Fetch v16) such an answer carries the new
    leader's address in its NodeEndpoints: a proxy that does not rewrite them (kafka-proxy
    v0.4.3) sends the client to the broker itself, and a producer without idempotence
    writes the batches it had in flight twice."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) == partitions \
                and all(p.leader >= 0 and p.error is None for p in found.partitions.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("topic %s has no leader for every partition after %.0f s: %s"
                               % (topic, timeout, found and found.partitions))
        time.sleep(0.05)


# --------------------------------------------------------------------------- Kroxylicious


def kroxylicious_config(upstream_bootstrap, bootstrap_port, node_start_port, node_ids):
    """Kroxylicious 0.12's YAML: one virtual cluster, no filters, a gateway whose port names
    the node (``portIdentifiesNode``): ``bootstrap_port`` for bootstrapping, then
    ``node_start_port`` + i for the i-th node id of ``node_ids`` (one range per id, in order),
    all on 127.0.0.1, which it also advertises. No management endpoint."""
    ranges = "".join(
        "\n          - name: node-%d\n            start: %d\n            end: %d" % (n, n, n)
        for n in node_ids)
    return """\
# written by kthrottle_testkit/peers.py: Kroxylicious pass-through, port per node
virtualClusters:
  - name: bench
    targetCluster:
      bootstrapServers: "%s"
    gateways:
      - name: port-per-node
        portIdentifiesNode:
          bootstrapAddress: "127.0.0.1:%d"
          advertisedBrokerAddressPattern: "127.0.0.1"
          nodeStartPort: %d
          nodeIdRanges:%s
    logNetwork: false
    logFrames: false
defaultFilters: []
""" % (upstream_bootstrap, bootstrap_port, node_start_port, ranges)


def start_kroxylicious(upstream, procs, name="kroxylicious", home=None, heap=KROXYLICIOUS_HEAP,
                       timeout=60.0):
    """Kroxylicious in front of ``upstream`` (a broker or "host:port"), pass-through, a port
    per upstream node, on 127.0.0.1 and free ports: (bootstrap "127.0.0.1:PORT", the process).
    Ready once a Metadata answer through it names every node on its own ports. ``home``:
    what ``install("kroxylicious")`` returns (installed here when not given)."""
    home = Path(home) if home else install("kroxylicious")
    upstream_bootstrap = getattr(upstream, "bootstrap", upstream)
    nodes = upstream_nodes(upstream_bootstrap)
    ids = [n for n, _, _ in nodes]
    # the bootstrap port, then one port per node in a row (Kroxylicious counts up from
    # nodeStartPort): search for a free run of them
    from kthrottle.kafka_kit import free_ports_in_a_row

    first = free_ports_in_a_row(len(ids) + 1)
    ports = list(range(first, first + len(ids) + 1))
    bootstrap_port, node_ports = ports[0], ports[1:]
    config = procs.log_dir / ("%s.yaml" % name)
    config.write_text(kroxylicious_config(upstream_bootstrap, bootstrap_port, node_ports[0], ids))
    argv = [java_binary(), "-Xms%s" % heap, "-Xmx%s" % heap, "-Djava.awt.headless=true",
            "-Dlog4j2.configurationFile=%s" % (home / "log4j2.properties"),
            "-cp", "%s:%s" % (home / "classes", home / "lib" / "*"), KROXYLICIOUS_MAIN,
            str(config)]
    proc = procs.spawn(name, argv, proxy=True)
    bootstrap = "127.0.0.1:%d" % bootstrap_port
    _started(procs, name, proc, bootstrap, set(ports), nodes, timeout)
    return bootstrap, proc


# --------------------------------------------------------------------------- kafka-proxy


def kafka_proxy_argv(binary, nodes, listen_ports):
    """``kafka-proxy server`` in front of ``nodes`` ([(id, host, port)], as the brokers
    advertise themselves): node i's address mapped to 127.0.0.1:``listen_ports[i]``; any other
    node it learns of gets a dynamic listener on 127.0.0.1 (a free port the kernel picks). No
    HTTP (health, metrics) or debug endpoint."""
    argv = [str(binary), "server", "--default-listener-ip", "127.0.0.1",
            "--http-disable", "--log-level", "warning"]
    for (_, host, port), listen in zip(nodes, listen_ports):
        argv += ["--bootstrap-server-mapping", "%s:%d,127.0.0.1:%d" % (host, port, listen)]
    return argv


def start_kafka_proxy(upstream, procs, name="kafka-proxy", binary=None, timeout=30.0):
    """grepplabs/kafka-proxy in front of ``upstream`` (a broker or "host:port"), one listener
    per upstream node on 127.0.0.1 and free ports: (bootstrap, the process), the bootstrap
    being the first node's listener. Ready once a Metadata answer through it names every
    node on its own listeners. ``binary``: what ``install("kafka-proxy")`` returns
    (installed here when not given)."""
    binary = binary or install("kafka-proxy")
    nodes = upstream_nodes(getattr(upstream, "bootstrap", upstream))
    ports = []
    while len(ports) < len(nodes):
        port = free_port()
        if port not in ports:
            ports.append(port)
    proc = procs.spawn(name, kafka_proxy_argv(binary, nodes, ports), proxy=True)
    bootstrap = "127.0.0.1:%d" % ports[0]
    for port in ports[1:]:
        wait_for_port("127.0.0.1", port, timeout=timeout, proc=proc)
    _started(procs, name, proc, bootstrap, set(ports), nodes, timeout)
    return bootstrap, proc


# --------------------------------------------------------------------------- Kafka's tools


def java_tool_command(lib, main_class, *args, heap=TOOL_HEAP):
    """``main_class`` of Kafka's jars in ``lib`` with ``args``, as bin/kafka-run-class.sh
    would run it (with the logging those jars default to: errors only)."""
    return [java_binary(), "-Xmx%s" % heap, "-Djava.awt.headless=true", *ENGLISH,
            "-cp", str(Path(lib) / "*"), main_class, *map(str, args)]


def producer_performance_args(bootstrap, topic, records, record_size, throughput, props,
                              warm_up=0):
    """ProducerPerformance's arguments: ``records`` values of ``record_size`` random bytes
    (after ``warm_up`` records left out of its steady-state figures), at most ``throughput``
    records/s (-1: as fast as it can), producer settings ``props``."""
    warm = ["--warmup-records", warm_up] if warm_up else []
    return ["--topic", topic, "--num-records", records + warm_up, *warm,
            "--record-size", record_size,
            "--throughput", throughput, "--command-property",
            "bootstrap.servers=%s" % bootstrap,
            *("%s=%s" % kv for kv in props.items())]


# ProducerPerformance's last line: "200000 records sent, 41237.1 records/sec (40.27 MB/sec),
# 12.31 ms avg latency, 187.00 ms max latency, 9 ms 50th, 27 ms 95th, 44 ms 99th, 120 ms 99.9th."
# (its lines every --reporting-interval stop after "max latency").
_NUM = r"([0-9][0-9.,]*|NaN)"
PRODUCER_SUMMARY_RE = re.compile(
    r"(\d+) (steady state )?records sent, %s records/sec \(%s MB/sec\), "
    r"%s ms avg latency, %s ms max latency, "
    r"(\d+) ms 50th, (\d+) ms 95th, (\d+) ms 99th, (\d+) ms 99\.9th" % ((_NUM,) * 4))


def _number(text):
    return float("nan") if text == "NaN" else float(text.replace(",", ""))


def parse_producer_performance(text):
    """ProducerPerformance's summary (its last line of ``text``; with --warmup-records, its
    steady-state line): {"records", "steady_state",
    "records_per_sec", "mib_per_sec", "avg_ms", "max_ms", "p50_ms", "p95_ms", "p99_ms",
    "p999_ms"}. The tool prints its percentiles in whole milliseconds and its MB/sec in MiB.
    ValueError, quoting the end of ``text``, when there is no summary."""
    found = PRODUCER_SUMMARY_RE.findall(text)
    if not found:
        tail = " | ".join([line.strip() for line in text.splitlines() if line.strip()][-5:])
        raise ValueError("no ProducerPerformance summary line in its output; it ends with: %s"
                         % (tail or "(nothing)"))
    # with --warmup-records, the steady state (the records after the warm-up) comes last
    steady = [f for f in found if f[1]]
    (records, _, rate, mib, avg, top, p50, p95, p99, p999) = (steady or found)[-1]
    return {"records": int(records), "steady_state": bool(steady), "records_per_sec": _number(rate),
            "mib_per_sec": _number(mib), "avg_ms": _number(avg), "max_ms": _number(top),
            "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
            "p999_ms": float(p999)}


def consumer_performance_args(bootstrap, topic, records, group, timeout_ms=30_000, props=None):
    """ConsumerPerformance's arguments: read ``records`` records of ``topic`` from the start
    in group ``group``, giving up after ``timeout_ms`` without a record."""
    args = ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records", records,
            "--group", group, "--timeout", timeout_ms]
    for kv in (props or {}).items():
        args += ["--command-property", "%s=%s" % kv]
    return args


def parse_consumer_performance(text):
    """ConsumerPerformance's result: the line after its CSV header ("start.time, end.time,
    data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, rebalance.time.ms,
    fetch.time.ms, ...") as {column: value} (numbers as floats, the times as text).
    ValueError, quoting the end of ``text``, when there is none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("start.time"):
            names = [n.strip() for n in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            if len(values) == len(names):
                out = {}
                for n, v in zip(names, values):
                    try:
                        out[n] = _number(v)
                    except ValueError:
                        out[n] = v
                if isinstance(out.get("data.consumed.in.nMsg"), float):
                    return out
    tail = " | ".join(lines[-5:])
    raise ValueError("no ConsumerPerformance result in its output; it ends with: %s"
                     % (tail or "(nothing)"))
