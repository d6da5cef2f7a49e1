"""Apache Kafka itself as a test component: a single KRaft node (broker and controller in one
process) on 127.0.0.1 and free ports, with its data in a directory of its own; and Kafka's own
command-line tools (kafka-tools) run from the same jars. For tests and benchmarks alike.

The jars come from Maven Central through ``scripts/kafka-jars`` (pinned in pom.xml), which
``scripts/test`` runs before pytest. Nothing here downloads anything: a missing JDK or missing
jars raise ``KafkaMissing`` with the command that fixes it.

    with KafkaBroker(workdir) as kafka:
        kafka.bootstrap                    # "127.0.0.1:PORT"
        kafka.create_topic("orders", partitions=3)
        kafka.tool("org.apache.kafka.tools.consumer.ConsoleShareConsumer", "--help")
"""
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from kthrottle.embedded import _PORTS_GIVEN, _die_with_parent, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
KAFKA_VERSION = "4.4.0"  # the default of pom.xml
KAFKA_JARS_COMMAND = "scripts/kafka-jars"
# the class behind bin/kafka-storage.sh: still the Scala object in core (kafka_2.13) in 4.4
STORAGE_TOOL = "kafka.tools.StorageTool"
BROKER_MAIN = "kafka.Kafka"
CONSOLE_SHARE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleShareConsumer"  # KIP-932

# Settings that make a one-node cluster quick to start and to use: every internal topic with
# one replica (a default of 3 could never be met) and few partitions, and no wait before the
# first rebalance of a classic group.
ONE_NODE_SETTINGS = {
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    # KIP-932: the share-group state topic (__share_group_state)
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "share.coordinator.state.topic.num.partitions": "1",
    "group.initial.rebalance.delay.ms": "0",
}
# Share groups need no setting of their own from 4.2 on (KIP-932 production-ready): the storage
# tool's default release version (4.4-IV2 for 4.4.0) finalizes share.version=2. For an older
# release version pass feature={"share.version": "1"}.


# A JVM started with this cannot open IPv6 sockets: a Java client so started cannot reach the
# broker's IPv6-only listener (``ipv6_listener``), only a proxy on 127.0.0.1 in front of it.
IPV4_ONLY_JVM_ARGS = ["-Djava.net.preferIPv4Stack=true"]


def ipv6_loopback():
    """Can this machine listen on [::1]? (Not every container has IPv6 loopback.)"""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port6():
    """``free_port`` for [::1]."""
    while True:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class KafkaMissing(RuntimeError):
    """No JDK or no jars: the message says how to get them."""


def java_binary():
    """The ``java`` that runs Kafka (``JAVA_HOME`` first, as kafka-run-class.sh does)."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    found = shutil.which("java")
    if not found:
        raise KafkaMissing("Apache Kafka needs a Java runtime (17 or newer) and none is on PATH: "
                           "apt-get install -y --no-install-recommends openjdk-17-jre-headless")
    return found


def kafka_lib(version=KAFKA_VERSION):
    """The folder of Kafka ``version``'s jars (``KTHROTTLE_KAFKA_LIB`` overrides), as
    ``scripts/kafka-jars`` leaves it; KafkaMissing if it is not there (complete)."""
    explicit = os.environ.get("KTHROTTLE_KAFKA_LIB")
    lib = Path(explicit) if explicit else ROOT / ".cache" / ("kafka-%s" % version) / "lib"
    complete = explicit or any(lib.glob(".complete-*"))
    if not complete or not any(lib.glob("kafka_2.13-*.jar")):
        if explicit:
            raise KafkaMissing("KTHROTTLE_KAFKA_LIB=%s has no Kafka jars (kafka_2.13-*.jar)"
                               % explicit)
        arg = "" if version == KAFKA_VERSION else " " + version.rpartition(".")[0]
        raise KafkaMissing("Apache Kafka %s's jars are not in %s: run %s%s (Maven fetches them "
                           "from Maven Central; scripts/test does it before pytest)"
                           % (version, lib, KAFKA_JARS_COMMAND, arg))
    return lib


def fetch_kafka_lib(version=KAFKA_VERSION):
    """Run ``scripts/kafka-jars`` (quick once done) and return the lib folder: for
    benchmarks and scripts that may fetch; tests only look (``kafka_lib``)."""
    arg = [] if version == KAFKA_VERSION else [version]
    out = subprocess.run([str(ROOT / KAFKA_JARS_COMMAND), *arg], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def metadata_brokers(host, port, timeout=2.0):
    """Ask ``host:port`` for Metadata (v1, no topics): [(node_id, host, port)] of the brokers
    it names, and the controller id. Raises OSError if it does not answer."""
    client_id = b"kthrottle-tests"
    body = struct.pack(">hhih", 3, 1, 7, len(client_id)) + client_id + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _read_exactly(sock, 4))[0]
        data = _read_exactly(sock, size)
    pos = 4  # correlation id
    count = struct.unpack_from(">i", data, pos)[0]
    pos += 4
    brokers = []
    for _ in range(count):
        node_id = struct.unpack_from(">i", data, pos)[0]
        n = struct.unpack_from(">h", data, pos + 4)[0]
        name = data[pos + 6:pos + 6 + n].decode()
        pos += 6 + n
        broker_port = struct.unpack_from(">i", data, pos)[0]
        rack = struct.unpack_from(">h", data, pos + 4)[0]
        pos += 6 + max(rack, 0)
        brokers.append((node_id, name, broker_port))
    controller = struct.unpack_from(">i", data, pos)[0]
    return brokers, controller


def _read_exactly(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return buf


class KafkaBroker:
    """One Apache Kafka node in KRaft combined mode (process.roles=broker,controller) on
    ``host`` and free ports. ``advertised_host``: the host the broker gives clients for itself
    (its listener stays on ``host``). ``ipv6_listener``: a second client listener on [::1]
    only, which advertises [::1] (``bootstrap_ipv6``); a client that bootstraps there learns no
    other address of the broker. ``config``: more server.properties (they win over the
    defaults); ``feature``: {name: level} for the storage tool's ``--feature``. Its data is in
    ``workdir`` (a new temporary directory if None), removed by ``stop`` unless ``keep``."""

    def __init__(self, workdir=None, version=KAFKA_VERSION, lib=None, host="127.0.0.1",
                 advertised_host=None, ipv6_listener=False, node_id=1, heap="512m",
                 config=None, feature=None, log_path=None, keep=False):
        self.version = version
        self.lib = Path(lib) if lib else None
        self.host = host
        self.advertised_host = advertised_host or host
        self.node_id = node_id
        self.heap = heap
        self.config = dict(config or {})
        self.feature = dict(feature or {})
        self.workdir = Path(workdir) if workdir else None
        self.log_path = Path(log_path) if log_path else None
        self.keep = keep
        self.port = free_port(host)
        self.controller_port = free_port(host)
        self.ipv6_port = free_port6() if ipv6_listener else None
        self.cluster_id = None
        self.proc = None
        self.started_in = None  # seconds from format to the first Metadata answer

    # addresses -----------------------------------------------------------------------------

    @property
    def bootstrap(self):
        """The listener's address: what a client (or the proxy) bootstraps from."""
        return "%s:%d" % (self.host, self.port)

    @property
    def advertised(self):
        return "%s:%d" % (self.advertised_host, self.port)

    @property
    def bootstrap_ipv6(self):
        """The [::1] listener's address (``ipv6_listener``), or None."""
        return "[::1]:%d" % self.ipv6_port if self.ipv6_port else None

    # running Java --------------------------------------------------------------------------

    def classpath(self):
        return str(self.lib / "*")

    def java_command(self, main_class, *args, heap="256m", jvm_args=()):
        """The command line that runs ``main_class`` from Kafka's jars, as
        ``bin/kafka-run-class.sh`` would."""
        return [java_binary(), "-Xmx%s" % heap, "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                *self._log_settings(tool=True), *jvm_args, "-cp", self.classpath(), main_class,
                *map(str, args)]

    def tool(self, main_class, *args, timeout=60, check=True, jvm_args=()):
        """Run one of Kafka's command-line tools to its end: the CompletedProcess (text)."""
        return subprocess.run(self.java_command(main_class, *args, jvm_args=jvm_args),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def _log_settings(self, tool=False):
        """The broker logs at INFO to its stdout (the log file); a tool warnings only, to its
        stderr, as bin/*.sh do with config/tools-log4j2.yaml."""
        if self.workdir is None:
            return []
        name = "tools-log4j" if tool else "log4j"
        if self.version.startswith("3."):  # reload4j (log4j 1 syntax)
            return ["-Dlog4j.configuration=file:%s" % (self.workdir / (name + ".properties"))]
        return ["-Dlog4j2.configurationFile=%s" % (self.workdir / (name + "2.properties"))]

    # lifecycle -----------------------------------------------------------------------------

    def server_properties(self):
        listeners = ["PLAINTEXT://%s:%d" % (self.host, self.port),
                     "CONTROLLER://%s:%d" % (self.host, self.controller_port)]
        advertised = ["PLAINTEXT://%s" % self.advertised]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        if self.ipv6_port:
            listeners.append("LOOPBACK6://%s" % self.bootstrap_ipv6)
            advertised.append("LOOPBACK6://%s" % self.bootstrap_ipv6)
            protocols.append("LOOPBACK6:PLAINTEXT")
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            # a static one-voter quorum: the same on 3.9 and 4.x, no --standalone needed
            "controller.quorum.voters": "%d@%s:%d" % (self.node_id, self.host,
                                                      self.controller_port),
            "controller.listener.names": "CONTROLLER",
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": ",".join(protocols),
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            **ONE_NODE_SETTINGS,
        }
        props.update({k: str(v) for k, v in self.config.items()})
        return props

    def _write_files(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "server.properties", "w") as f:
            f.writelines("%s=%s\n" % item for item in self.server_properties().items())
        # Kafka's distribution ships these in config/; the Maven artifacts do not
        for name, level, target in (("log4j", "info", "SYSTEM_OUT"),
                                    ("tools-log4j", "warn", "SYSTEM_ERR")):
            (self.workdir / (name + "2.properties")).write_text(
                "status = warn\n"
                "appender.out.type = Console\nappender.out.name = OUT\n"
                "appender.out.target = %s\n"
                "appender.out.layout.type = PatternLayout\n"
                "appender.out.layout.pattern = [%%d] %%p %%m (%%c)%%n\n"
                "rootLogger.level = %s\nrootLogger.appenderRef.out.ref = OUT\n" % (target, level))
            (self.workdir / (name + ".properties")).write_text(
                "log4j.rootLogger=%s, out\n"
                "log4j.appender.out=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.out.Target=%s\n"
                "log4j.appender.out.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.out.layout.ConversionPattern=[%%d] %%p %%m (%%c)%%n\n"
                "log4j.logger.org.apache.zookeeper=WARN\n"
                % (level.upper(), "System.err" if target == "SYSTEM_ERR" else "System.out"))

    def start(self, timeout=90.0):
        """Format (first start only) and start the node; return once it answers Metadata
        naming itself. A second ``start`` after ``stop(keep=True)`` keeps the data."""
        if self.lib is None:
            self.lib = kafka_lib(self.version)
        if java_version() < 17:
            raise KafkaMissing("Apache Kafka %s needs Java 17 or newer; %s is %s" % (
                self.version, java_binary(), java_version()))
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kafka-"))
        if self.log_path is None:
            self.log_path = self.workdir / "kafka.log"
        began = time.monotonic()
        self._write_files()
        if not (self.workdir / "data" / "meta.properties").exists():
            self.format()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [java_binary(), "-Xmx%s" % self.heap, "-XX:+UseG1GC",
                 "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                 *self._log_settings(), "-cp", self.classpath(), BROKER_MAIN,
                 str(self.workdir / "server.properties")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, preexec_fn=_die_with_parent)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def format(self):
        """The storage tool's ``format``, as bin/kafka-storage.sh does before a first start."""
        self.cluster_id = self.cluster_id or _random_cluster_id()
        args = ["format", "--config", self.workdir / "server.properties",
                "--cluster-id", self.cluster_id]
        for name, level in self.feature.items():
            args += ["--feature", "%s=%s" % (name, level)]
        done = self.tool(STORAGE_TOOL, *args, check=False)
        if done.returncode != 0:
            raise RuntimeError("kafka-storage format failed (%d): %s%s"
                               % (done.returncode, done.stdout, done.stderr))

    def wait_ready(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("Apache Kafka exited with code %s before it answered; the "
                                   "end of its log (%s):\n%s" % (self.proc.returncode,
                                                                 self.log_path, self.log_tail()))
            try:
                brokers, controller = metadata_brokers(self.host, self.port)
                if any(b[0] == self.node_id for b in brokers):
                    if self.ipv6_port:
                        metadata_brokers("::1", self.ipv6_port)
                    return
                last = "Metadata names brokers %s, controller %s" % (brokers, controller)
            except (OSError, struct.error) as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError("Apache Kafka did not answer Metadata on %s within %.0f s (%s); the "
                           "end of its log (%s):\n%s" % (self.bootstrap, timeout, last,
                                                         self.log_path, self.log_tail()))

    def stop(self, grace=20.0, keep=None):
        """SIGTERM (a controlled shutdown), SIGKILL after ``grace`` seconds; then its files go,
        unless ``keep`` (or the constructor's)."""
        stop_process(self.proc, grace=grace)
        self.proc = None
        keep = self.keep if keep is None else keep
        if not keep and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # conveniences for tests ----------------------------------------------------------------

    def admin(self, **settings):
        """A confluent-kafka AdminClient on the broker itself (not through any proxy)."""
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, **settings})

    def create_topic(self, name, partitions=1, config=None, timeout=30.0):
        from confluent_kafka.admin import NewTopic

        admin = self.admin()  # kept until the answer: a dropped client cancels its futures
        futures = admin.create_topics(
            [NewTopic(name, partitions, 1, config=dict(config or {}))],
            operation_timeout=timeout, request_timeout=timeout)
        futures[name].result(timeout)

    def set_group_config(self, group, **settings):
        """Group configs (KIP-848/KIP-932), e.g. share_auto_offset_reset="earliest" for
        ``share.auto.offset.reset`` (a share group starts at the latest offset by default)."""
        from confluent_kafka.admin import (AlterConfigOpType, ConfigEntry, ConfigResource,
                                           ResourceType)

        entries = [ConfigEntry(k.replace("_", "."), str(v),
                               incremental_operation=AlterConfigOpType.SET)
                   for k, v in settings.items()]
        admin = self.admin()
        futures = admin.incremental_alter_configs(
            [ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)])
        for future in futures.values():
            future.result(30)


def _random_cluster_id():
    """What ``kafka-storage random-uuid`` prints: a random UUID, base64url, no padding, and
    never starting with '-' (Kafka's Uuid.randomUuid draws again then: a command line would
    read it as an option)."""
    import base64

    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


def java_version():
    """The major version of ``java_binary()`` (17, 21, ...)."""
    out = subprocess.run([java_binary(), "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        return 0
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 else major
