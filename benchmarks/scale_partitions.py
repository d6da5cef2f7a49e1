#!/usr/bin/env python3
"""How does kthrottle's cost grow with the partitions a cluster has (issue 48's partitions curve)?

Three measurements, each a table of the scale report (``benchmarks/scale.py``, which imports
this module: ``add_arguments(parser)`` and ``measure(args, run)``) or of a run of its own:

* **Metadata in process** - a Metadata response of ``--partitions`` partitions (1,000, 10,000,
  100,000), three brokers, spread over topics of ``--partitions-per-topic`` partitions each
  (100: 1,000 topics at 100,000; 1,000: 100 topics), built with kafka-python's schema classes
  for each of ``--partitions-metadata-versions`` (v1: aiokafka and kafka-python; v12:
  librdkafka and the Java client), is fed in 64 KiB reads to a pipeline ``Connection`` (no
  sockets, as ``tests/test_pipeline.py`` drives one) after the Metadata request that asks for
  every topic, with the filters a proxy builds: by default (``standard_filters``); with a
  quota file that never binds; with a quota callback (``LeaderProportional``: every
  partition's leader read); with per-topic quotas (v10+: every topic id read); with the
  cluster's ACLs (``--authorization acls``: the topics the principal may not describe, half of
  them, left out). Measured: the CPU time of the calls that take the response (the thread's
  clock, median of ``--partitions-repeats``) and their allocations' peak (tracemalloc), i.e.
  the time and memory to rewrite it. The issue's target, "a Metadata of 100,000 partitions is
  rewritten in under 100 ms", is judged on the default and quota-file rows.
* **Metadata end to end** - a real ``kthrottle proxy`` process in front of a fake upstream
  broker in this process that answers ApiVersions and Metadata (a prebuilt response of that
  size, its correlation id patched in) and nothing else. Chosen over a real broker: a Tansu
  broker or an Apache Kafka KRaft node with 100,000 partitions takes long to create on the
  2-core project VM and would share its cores with the proxy while answering; the fake costs
  the same whatever the proxy does, so what the proxy's process spends is the proxy's.
  ``--partitions-requests`` Metadata requests (every topic, in topics of the first
  ``--partitions-per-topic``, the last of ``--partitions-metadata-versions``: v12) from a raw
  socket, one at a time (a fifth as many at 100,000 partitions); measured: the proxy process's CPU per request (its kernel CPU clock), the client's
  round trip, and the proxy's RSS growth (its largest RSS while they ran, sampled every 20 ms,
  less its RSS before the first), without and with a quota file that never binds.
* **Fetch and Produce naming 1,000 partitions** - a real Tansu broker (in memory) with 10
  topics of ``--partitions-per-request`` / 10 partitions each behind a ``kthrottle proxy``;
  ``--partitions-requests`` Produce requests naming every partition (one record of 100 bytes
  each, acks=1) and as many Fetch requests naming every partition from offset 0, in raw frames
  at the versions aiokafka (Produce v7, Fetch v11) and the newer clients use (Produce v9,
  Fetch v12, and Produce v10 / Fetch v16 where the broker offers them: their responses' tail
  names brokers, KIP-951; Fetch v16 names the topics by id, read from the broker), without
  and with a quota file that never binds. Measured: the proxy process's CPU per request. The
  broker keeps what is produced, so the Fetch answers grow over a run (each partition's
  answer is capped at 1 KiB); both configurations see the same sequence.

Not measured end to end: the ACL rows (the fake broker does not answer DescribeAcls); in
process they are.

Writes ``scale_partitions.md``, ``.json`` and ``.png`` into ``--output-dir`` (default: a new
directory under ``benchmarks/runs/``) when run alone. Every server is on 127.0.0.1 and free
ports, started through the run's processes and stopped by its PID.

Example (about 10 minutes on the 2-core project VM)::

    python benchmarks/scale_partitions.py --partitions 1000,10000,100000

A quick one::

    python benchmarks/scale_partitions.py --partitions 1000,10000 --partitions-requests 5
"""
import gc
import socket
import statistics
import struct
import sys
import threading
import time
import tracemalloc
import uuid
import warnings

from kthrottle_testkit import harness
from kthrottle_testkit.harness import (NON_BINDING_QUOTAS, TANSU_NODE_ID, Run, create_topic,
                                       process_cpu_seconds, tree_rss)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest
    from kafka.protocol.metadata import (ApiVersionsRequest, ApiVersionsResponse,
                                         MetadataRequest, MetadataResponse)
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

TARGET_MS = 100.0  # issue 48: a Metadata of 100,000 partitions is rewritten in under 100 ms
TARGET_PARTITIONS = 100_000
READ = 65536  # bytes per read fed to the in-process pipeline
BROKER_IDS = (TANSU_NODE_ID, TANSU_NODE_ID + 1, TANSU_NODE_ID + 2)
INPROC_CONFIGS = ("default", "quota file", "quota callback", "topic quotas", "acls")
E2E_CONFIGS = ("no quota file", "quota file")
API_VERSIONS, METADATA = 18, 3


def add_arguments(p):
    g = p.add_argument_group("partitions curve (benchmarks/scale_partitions.py)")
    g.add_argument("--partitions", type=harness.int_list, default=[1000, 10000, 100000],
                   help="partitions in the Metadata responses, comma-separated")
    g.add_argument("--partitions-per-topic", type=harness.int_list, default=[100, 1000],
                   help="partitions of each topic in them (the topics: partitions / this)")
    g.add_argument("--partitions-metadata-versions", type=harness.int_list, default=[1, 12],
                   help="Metadata versions measured in process (end to end: the last)")
    g.add_argument("--partitions-repeats", type=int, default=5,
                   help="in-process runs of each response (median)")
    g.add_argument("--partitions-requests", type=int, default=20,
                   help="requests per end-to-end measurement (Metadata: a fifth of it at "
                   "100,000 partitions or more, at least 5)")
    g.add_argument("--partitions-per-request", type=int, default=1000,
                   help="partitions each Fetch and Produce names (over 10 topics)")
    g.add_argument("--partitions-parts", type=harness.names,
                   default=["inproc", "metadata", "fetch-produce"],
                   help="which measurements: inproc, metadata, fetch-produce")


# --------------------------------------------------------------------------- frames


def topic_name(t):
    return ("alice-%05d" if t % 2 else "bob-%05d") % t  # half of them alice's (the acls rows)


def metadata_response(version, partitions, per_topic, correlation_id=0, topics=True,
                      port=9092):
    """A framed Metadata response of ``version``: three brokers at 127.0.0.1:``port`` and
    ``partitions`` partitions in topics of ``per_topic`` (none when not ``topics``)."""
    M = MetadataResponse
    T = M.MetadataResponseTopic
    P = T.MetadataResponsePartition
    body = []
    if topics:
        count = max(partitions // per_topic, 1)
        body = [T(error_code=0, name=topic_name(t), topic_id=uuid.UUID(int=t + 1),
                  is_internal=False, authorized_operations=None,
                  partitions=[P(error_code=0, partition_index=i,
                                leader_id=BROKER_IDS[i % 3], leader_epoch=3,
                                replica_nodes=list(BROKER_IDS), isr_nodes=list(BROKER_IDS),
                                offline_replicas=[])
                              for i in range(min(per_topic, partitions))])
                for t in range(count)]
    brokers = [M.MetadataResponseBroker(node_id=n, host="127.0.0.1", port=port,
                                        rack="rack-%d" % i) for i, n in enumerate(BROKER_IDS)]
    response = M[version](throttle_time_ms=0, brokers=brokers, cluster_id="scale-partitions",
                          controller_id=BROKER_IDS[0], topics=body, authorized_operations=None,
                          error_code=0)
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def metadata_request(version, correlation_id, client_id="scale-partitions"):
    """A framed Metadata request for every topic (v0: an empty list; v1+: null)."""
    request = MetadataRequest[version](
        topics=[] if version == 0 else None, allow_auto_topic_creation=False,
        include_cluster_authorized_operations=False, include_topic_authorized_operations=False)
    return harness.frame_of(request, correlation_id, client_id)


# --------------------------------------------------------------------------- in process


def _table(config):
    """(FilterTable, QuotaManager or None, principal or None) of an in-process config."""
    from kthrottle.policy.acls import Operation, PatternType, Permission, ResourceType
    from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
    from kthrottle.policy.quota_callback import LeaderProportional
    from kthrottle.policy.quotas import QuotaManager
    from kthrottle.proxy.filters import REGISTERED, standard_filters
    from kthrottle.proxy.filters.authorization import AclView, Authorization
    from kthrottle.proxy.filters.partition_leaders import PartitionLeadersSeen
    from kthrottle.proxy.pipeline import FilterTable
    from kthrottle.sources.acls import AclSnapshot

    quotas = {"clients/<default>": {PRODUCER_BYTE_RATE: 1e10, CONSUMER_BYTE_RATE: 1e10,
                                    REQUEST_RATE: 1e9}}
    manager, extra, principal = None, [], None
    if config == "quota file":
        manager = QuotaManager(quotas)
    elif config == "topic quotas":
        manager = QuotaManager(dict(quotas, **{"topics/<default>": {PRODUCER_BYTE_RATE: 1e10}}))
    elif config == "quota callback":
        callback = LeaderProportional()
        callback.configure({"topics": {"*": ["*"]}})
        manager = QuotaManager(quotas, callback=callback)
        extra = [PartitionLeadersSeen(manager)]
    elif config == "acls":  # alice may describe the topics prefixed alice- (half of them)
        view = AclView()
        view.update(AclSnapshot(True, ((int(ResourceType.TOPIC), "alice-",
                                        int(PatternType.PREFIXED), "User:alice", "*",
                                        int(Operation.DESCRIBE), int(Permission.ALLOW)),),
                                frozenset(), False))
        extra, principal = [Authorization(view)], "alice"
    filters = standard_filters(lambda node: ("proxy.example", 30000 + node), manager) + extra
    order = {cls: i for i, cls in enumerate(REGISTERED)}
    filters.sort(key=lambda f: order[type(f)])
    return FilterTable(filters), manager, principal


def _exchange(table, manager, principal, request, reads):
    """One Metadata exchange through a new pipeline: (CPU seconds of the calls that take the
    response, bytes sent to the client)."""
    from kthrottle.proxy.pipeline import Close, Connection, SendToClient

    conn = Connection(table, 100 * 1024 * 1024, manager)
    if principal:
        conn.client_host = "10.0.0.1"
        conn.client_accepted(0.0, principal=principal)
    conn.broker_connected(0.0)
    conn.client_data(request, 0.001)
    sent = 0
    start = time.thread_time()
    for data in reads:
        if conn.pass_response(data):
            sent += len(data)
            continue
        for action in conn.broker_data(data, 0.002):
            if isinstance(action, SendToClient):
                sent += sum(len(c) for c in action.chunks)
            elif isinstance(action, Close):
                raise RuntimeError("the pipeline closed: %s" % action.reason)
    return time.thread_time() - start, sent


def measure_inproc(args, frames, say):
    rows = []
    for partitions in args.partitions:
        for per_topic in args.partitions_per_topic:
            if per_topic > partitions:
                continue
            for version in args.partitions_metadata_versions:
                frame = frames(version, partitions, per_topic)
                reads = [frame[i:i + READ] for i in range(0, len(frame), READ)]
                request = metadata_request(version, 0)
                for config in INPROC_CONFIGS:
                    if config == "topic quotas" and version < 10:
                        continue  # no topic ids to read before v10
                    table, manager, principal = _table(config)
                    times = []
                    for _ in range(args.partitions_repeats):
                        gc.collect()
                        seconds, sent = _exchange(table, manager, principal, request, reads)
                        times.append(seconds)
                    gc.collect()
                    tracemalloc.start()
                    try:
                        _exchange(table, manager, principal, request, reads)
                        peak = tracemalloc.get_traced_memory()[1]
                    finally:
                        tracemalloc.stop()
                    row = {"part": "metadata, in process", "partitions": partitions,
                           "topics": partitions // per_topic, "version": version,
                           "config": config, "frame_mib": len(frame) / harness.MIB,
                           "cpu_ms": statistics.median(times) * 1000,
                           "peak_mib": peak / harness.MIB, "sent_mib": sent / harness.MIB}
                    rows.append(row)
                    say("  in process: v%d %d partitions in %d topics, %s: %.1f ms CPU, "
                        "peak %.1f MiB (frame %.1f MiB)" % (
                            version, partitions, row["topics"], config, row["cpu_ms"],
                            row["peak_mib"], row["frame_mib"]))
    return rows


# --------------------------------------------------------------------------- fake upstream


def _api_versions_answer(version, correlation_id):
    A = ApiVersionsResponse
    response = A[version](error_code=0, throttle_time_ms=0, api_keys=[
        A.ApiVersion(api_key=METADATA, min_version=0, max_version=12),
        A.ApiVersion(api_key=API_VERSIONS, min_version=0, max_version=3)])
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def _metadata_asks_topics(frame, version):
    """Whether a framed Metadata request (size prefix included) asks for topics (every one,
    or some), not just the brokers (an empty list, which the proxy's discovery sends)."""
    pos = 12
    n = struct.unpack_from(">h", frame, pos)[0]  # client_id
    pos += 2 + max(n, 0)
    if version >= 9:  # request header v2: tagged fields (none, or skipped by count)
        pos += 1
        return frame[pos] != 1  # compact: N+1; 1 is empty
    if version == 0:
        return True  # v0: an empty list asks for every topic
    return struct.unpack_from(">i", frame, pos)[0] != 0


class FakeUpstream:
    """A broker that answers ApiVersions and Metadata only, from prebuilt frames: a
    Metadata asking for topics gets ``big(version)``, one asking for none the brokers only.
    Listens on 127.0.0.1, a free port; one thread per connection; ``stop`` closes all."""

    def __init__(self, big):
        self.big = big
        self.small = {}
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.bootstrap = "127.0.0.1:%d" % self.port
        self.stopped = threading.Event()
        self.conns = []
        self.unknown = []  # (api_key, version) of requests it could not answer
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped.set()
        self.sock.close()
        for conn in list(self.conns):
            try:
                conn.close()
            except OSError:
                pass

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            while True:
                head = harness._recv_exact(conn, 4)
                frame = head + harness._recv_exact(conn, struct.unpack(">i", head)[0])
                api_key, version, cid = struct.unpack_from(">hhi", frame, 4)
                if api_key == API_VERSIONS:
                    conn.sendall(_api_versions_answer(min(version, 3), cid))
                elif api_key == METADATA and version <= 12:
                    if _metadata_asks_topics(frame, version):
                        answer = self.big(version)
                    else:
                        answer = self.small.get(version)
                        if answer is None:
                            answer = self.small[version] = metadata_response(
                                version, 0, 1, topics=False, port=self.port)
                    conn.sendall(answer[:4] + struct.pack(">i", cid))
                    conn.sendall(memoryview(answer)[8:])
                else:
                    self.unknown.append((api_key, version))
                    return
        except (OSError, EOFError, ConnectionError):
            return
        finally:
            conn.close()
            if conn in self.conns:
                self.conns.remove(conn)


class RssPeak:
    """The largest RSS of a process while it runs, sampled every ``every`` seconds."""

    def __init__(self, pid, every=0.02):
        self.pid, self.every, self.peak = pid, every, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self.done.is_set():
            rss = tree_rss(self.pid)
            if rss is not None and rss > self.peak:
                self.peak = rss
            self.done.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def _read_response(sock, buf):
    """One response frame into ``buf`` (a bytearray, grown as needed); its size."""
    view = memoryview(buf)
    got = 0
    while got < 4:
        n = sock.recv_into(view[got:4])
        if not n:
            raise ConnectionError("the proxy closed the connection")
        got += n
    size = struct.unpack_from(">i", buf)[0] + 4
    if size > len(buf):
        view.release()
        buf.extend(bytes(size - len(buf)))
        view = memoryview(buf)
    while got < size:
        n = sock.recv_into(view[got:size])
        if not n:
            raise ConnectionError("the proxy closed the connection")
        got += n
    return size


def _connect(host, port):
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _topic_ids(bootstrap, topics):
    """{name: topic id} of ``topics``, from a Metadata v12 answer of the broker."""
    host, port = bootstrap.rsplit(":", 1)
    T = MetadataRequest.MetadataRequestTopic
    request = MetadataRequest[12](topics=[T(name=n, topic_id=uuid.UUID(int=0)) for n in topics],
                                  allow_auto_topic_creation=False,
                                  include_topic_authorized_operations=False)
    with _connect(host, port) as sock:
        sock.sendall(harness.frame_of(request, 1, "scale-partitions"))
        size = struct.unpack(">i", harness._recv_exact(sock, 4))[0]
        frame = struct.pack(">i", size) + harness._recv_exact(sock, size)
    answer = MetadataResponse[12].decode(frame[4:], header=True)
    return {t.name: t.topic_id for t in answer.topics}


def _quota_args(run, config):
    if config != "quota file":
        return ()
    path = run.path("non-binding-quotas.toml")
    path.write_text(NON_BINDING_QUOTAS)
    return ("--quota-file", str(path))


def measure_metadata_e2e(args, run, frames, say):
    rows = []
    version = args.partitions_metadata_versions[-1]
    per_topic = args.partitions_per_topic[0]
    for partitions in args.partitions:
        if _out_of_time(args):
            say("  out of time: end-to-end Metadata of %d partitions skipped" % partitions)
            continue
        port_box = {}
        cache = {}

        def big(v, partitions=partitions, cache=cache):
            if v not in cache:
                cache[v] = metadata_response(v, partitions, min(per_topic, partitions),
                                             port=port_box["port"])
            return cache[v]

        upstream = FakeUpstream(big)
        port_box["port"] = upstream.port
        run.procs.on_stop(upstream.stop)
        upstream.start()
        big(version)  # built before the proxy starts
        requests = args.partitions_requests
        if partitions >= 100_000:
            requests = max(5, requests // 5)
        try:
            for config in E2E_CONFIGS:
                endpoint = run.kthrottle(upstream.bootstrap, _quota_args(run, config),
                                         name="kthrottle-metadata", probe=False)
                try:
                    rows.append(_metadata_rounds(endpoint, version, partitions, per_topic,
                                                 config, requests, len(big(version)), say))
                finally:
                    run.procs.stop(endpoint.proc)
        finally:
            upstream.stop()
        if upstream.unknown:
            say("  ! the fake upstream was sent requests it does not answer: %s"
                % sorted(set(upstream.unknown)))
    return rows


def _metadata_rounds(endpoint, version, partitions, per_topic, config, requests, frame_len,
                     say):
    pid = endpoint.proc.pid
    host, port = endpoint.bootstrap.rsplit(":", 1)
    buf = bytearray(frame_len + 65536)
    with _connect(host, port) as sock:
        for cid in range(2):  # warm up: the first opens the broker connection
            sock.sendall(metadata_request(version, cid))
            _read_response(sock, buf)
        time.sleep(0.5)
        rss_before = tree_rss(pid)
        cpu, trips = [], []
        with RssPeak(pid) as peak:
            for cid in range(2, 2 + requests):
                before, t0 = process_cpu_seconds(pid), time.perf_counter()
                sock.sendall(metadata_request(version, cid))
                size = _read_response(sock, buf)
                t1 = time.perf_counter()
                time.sleep(0.01)  # the proxy done with what follows the last write
                after = process_cpu_seconds(pid)
                if size != frame_len:
                    raise RuntimeError("a Metadata answer of %d bytes through the proxy, %d "
                                       "expected" % (size, frame_len))
                cpu.append(after - before)
                trips.append(t1 - t0)
    row = {"part": "metadata, end to end", "partitions": partitions,
           "topics": partitions // min(per_topic, partitions), "version": version,
           "config": config, "frame_mib": frame_len / harness.MIB,
           "cpu_ms": statistics.median(cpu) * 1000,
           "round_trip_ms": statistics.median(trips) * 1000,
           "rss_growth_mib": max(peak.peak - rss_before, 0) / harness.MIB,
           "requests": requests}
    say("  end to end: v%d %d partitions, %s: proxy CPU %.1f ms per Metadata, round trip "
        "%.1f ms, RSS +%.1f MiB" % (version, partitions, config, row["cpu_ms"],
                                    row["round_trip_ms"], row["rss_growth_mib"]))
    return row


# --------------------------------------------------------------------------- fetch, produce


def _broker_versions(bootstrap):
    """{api_key: max version} the broker at ``bootstrap`` offers (ApiVersions v0)."""
    host, port = bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(harness.frame_of(ApiVersionsRequest[0](), 1, "scale-partitions"))
        size = struct.unpack(">i", harness._recv_exact(sock, 4))[0]
        answer = ApiVersionsResponse[0].decode(harness._recv_exact(sock, size)[4:])
    return {int(k[0]): int(k[2]) for k in answer.api_keys}


def _records():
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
    builder.append(timestamp=None, key=None, value=b"x" * 100, headers=[])
    builder.close()
    return bytes(builder.buffer())


def produce_request(version, correlation_id, topics, per_topic, records):
    D = ProduceRequest.TopicProduceData
    return harness.frame_of(ProduceRequest[version](
        transactional_id=None, acks=1, timeout_ms=30000,
        topic_data=[D(name=name, partition_data=[D.PartitionProduceData(index=p, records=records)
                                                  for p in range(per_topic)])
                    for name in topics]), correlation_id, "scale-partitions")


def fetch_request(version, correlation_id, topics, per_topic, topic_ids=None):
    """Every partition from offset 0 (max_wait_ms 100: Tansu answers a wait of 0 with no
    topics; the records are there, so it answers at once); v13+ names the topics by the ids
    in ``topic_ids``."""
    F = FetchRequest
    P = F.FetchTopic.FetchPartition
    ids = topic_ids or {}
    return harness.frame_of(F[version](
        replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=50 << 20, isolation_level=0,
        session_id=0, session_epoch=-1, rack_id="", forgotten_topics_data=[],
        topics=[F.FetchTopic(topic=name, topic_id=ids.get(name), partitions=[
            P(partition=p, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
              log_start_offset=-1, partition_max_bytes=1024) for p in range(per_topic)])
            for name in topics]), correlation_id, "scale-partitions")


def measure_fetch_produce(args, run, say):
    rows = []
    per_topic = max(args.partitions_per_request // 10, 1)
    broker = run.broker()
    topics = ["scale-%d" % t for t in range(10)]
    for name in topics:
        create_topic(broker.bootstrap, name, per_topic)
    offered = _broker_versions(broker.bootstrap)
    produce = [v for v in (7, 9, 10) if v <= offered.get(0, -1)]
    fetch = [v for v in (11, 12, 16) if v <= offered.get(1, -1)]
    topic_ids = _topic_ids(broker.bootstrap, topics) if 16 in fetch else None
    records = _records()
    for config in E2E_CONFIGS:
        if _out_of_time(args):
            say("  out of time: Fetch and Produce with %s skipped" % config)
            continue
        endpoint = run.kthrottle(broker, _quota_args(run, config), name="kthrottle-fp")
        try:
            host, port = endpoint.bootstrap.rsplit(":", 1)
            buf = bytearray(1 << 20)
            with _connect(host, port) as sock:
                cid = 0
                for api, versions in (("Produce", produce), ("Fetch", fetch)):
                    for version in versions:
                        def frame(cid, api=api, version=version):
                            if api == "Produce":
                                return produce_request(version, cid, topics, per_topic,
                                                       records)
                            return fetch_request(version, cid, topics, per_topic, topic_ids)
                        for _ in range(2):  # warm up
                            sock.sendall(frame(cid))
                            _read_response(sock, buf)
                            cid += 1
                        frames = [frame(cid + k) for k in range(args.partitions_requests)]
                        cpu, sizes = [], []
                        for request in frames:
                            before = process_cpu_seconds(endpoint.proc.pid)
                            sock.sendall(request)
                            sizes.append(_read_response(sock, buf))
                            time.sleep(0.005)
                            cpu.append(process_cpu_seconds(endpoint.proc.pid) - before)
                            cid += 1
                        row = {"part": "%s, end to end" % api, "partitions": 10 * per_topic,
                               "topics": 10, "version": version, "config": config,
                               "request_kib": len(frames[0]) / 1024,
                               "response_kib": statistics.median(sizes) / 1024,
                               "cpu_ms": statistics.median(cpu) * 1000,
                               "requests": len(frames)}
                        rows.append(row)
                        say("  %s v%d naming %d partitions, %s: proxy CPU %.3f ms per request "
                            "(request %.0f KiB, response %.0f KiB)" % (
                                api, version, row["partitions"], config, row["cpu_ms"],
                                row["request_kib"], row["response_kib"]))
        finally:
            run.procs.stop(endpoint.proc)
    return rows


# --------------------------------------------------------------------------- the curve


def _out_of_time(args):
    deadline = getattr(args, "deadline", None)
    return deadline is not None and time.monotonic() > deadline


COLUMNS = [("part", "measurement"), ("partitions", "partitions"), ("topics", "topics"),
           ("version", "version"), ("config", "proxy"), ("frame_mib", "Metadata MiB"),
           ("cpu_ms", "CPU ms"), ("peak_mib", "peak MiB (in process)"),
           ("round_trip_ms", "round trip ms"), ("rss_growth_mib", "RSS growth MiB"),
           ("request_kib", "request KiB"), ("response_kib", "response KiB")]


def measure(args, run):
    say = lambda line: print(line, flush=True)  # noqa: E731
    cache = {}

    def frames(version, partitions, per_topic):
        key = (version, partitions, per_topic)
        if key not in cache:
            cache[key] = metadata_response(version, partitions, per_topic)
        return cache[key]

    rows, notes = [], []
    parts = args.partitions_parts
    if "inproc" in parts:
        rows += measure_inproc(args, frames, say)
    cache.clear()
    if "metadata" in parts:
        rows += measure_metadata_e2e(args, run, frames, say)
    if "fetch-produce" in parts:
        rows += measure_fetch_produce(args, run, say)
    targets = []
    judged = [r for r in rows if r["part"] == "metadata, in process"
              and r["partitions"] >= TARGET_PARTITIONS and r["config"] in ("default",
                                                                           "quota file")]
    text = ("a Metadata of 100,000 partitions is rewritten in under %d ms (in process, the "
            "default filters and a quota file, every version and shape measured)" % TARGET_MS)
    targets.append((text, all(r["cpu_ms"] < TARGET_MS for r in judged) if judged else None))
    notes.append("CPU ms: in process, the thread's CPU time to take the whole response "
                 "through the pipeline; end to end, the proxy process's CPU per request. "
                 "Peak MiB: tracemalloc's peak of those calls (the frame as gathered "
                 "included). RSS growth: the proxy's largest RSS while the requests ran less "
                 "its RSS before them.")
    return {"rows": rows, "columns": COLUMNS, "targets": targets, "notes": notes,
            "plot": _plot(rows)}


def _plot(rows):
    lines = {}
    for r in rows:
        if r["part"] == "metadata, in process":
            label = "in process, v%d, %s" % (r["version"], r["config"])
            if r["topics"] * 100 != r["partitions"]:
                continue  # one shape on the plot: topics of 100 partitions
        elif r["part"] == "metadata, end to end":
            label = "end to end (proxy process), v%d, %s" % (r["version"], r["config"])
        else:
            continue
        lines.setdefault(label, []).append((r["partitions"], r["cpu_ms"]))
    if not lines:
        return None

    def draw(ax):
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([p for p, _ in points], [c for _, c in points], marker="o", label=label)
        ax.axhline(TARGET_MS, color="grey", linestyle="--", label="target: %d ms" % TARGET_MS)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("partitions in the Metadata response")
        ax.set_ylabel("CPU ms per Metadata response")
        ax.legend(fontsize=6)
    return draw


def main(argv=None):
    p = harness.parser(__doc__.split("\n\n")[0])
    add_arguments(p)
    harness.add_output_dir(p)
    args = p.parse_args(argv)
    bad = set(args.partitions_parts) - {"inproc", "metadata", "fetch-produce"}
    if bad:
        p.error("--partitions-parts: of inproc, metadata, fetch-produce (not %s)"
                % ", ".join(sorted(bad)))
    if min(args.partitions + args.partitions_per_topic) < 1 or args.partitions_requests < 1:
        p.error("counts must be >= 1")
    if any(not 0 <= v <= 12 for v in args.partitions_metadata_versions):
        p.error("--partitions-metadata-versions: 0 to 12")
    out = harness.output_dir(args, "scale_partitions")
    result = None
    with Run("scale_partitions") as run:
        result = measure(args, run)
    if result is None:
        return run.finish(True)
    keys = [k for k, _ in COLUMNS if any(k in r for r in result["rows"])]
    headers = [h for k, h in COLUMNS if k in keys]
    lines = ["# Partitions: Metadata, Fetch and Produce naming many partitions", "",
             "Command: `%s`" % harness.command_line("scale_partitions", argv), ""]
    lines += harness.markdown_table(headers, [[_cell(r.get(k)) for k in keys]
                                              for r in result["rows"]])
    lines.append("")
    for text, met in result["targets"]:
        lines.append("- Target: %s - **%s**" % (text, "not judged at these sizes" if met is None
                                               else "met" if met else "NOT met"))
    lines += [""] + result["notes"] + [""]
    draw = None
    if result["plot"] is not None:
        def draw(plt):
            fig, ax = plt.subplots(figsize=(7.5, 4.2))
            result["plot"](ax)
            ax.set_title("kthrottle: CPU per Metadata response by partitions", fontsize=10)
            fig.tight_layout()
            return fig
    harness.write_results(out, "scale_partitions", "\n".join(lines),
                          {"settings": harness.settings_of(args), "rows": result["rows"],
                           "targets": result["targets"], "machine": harness.machine_facts()},
                          draw)
    return run.finish()


def _cell(value):
    if value is None:
        return None
    if isinstance(value, float):
        return "%.3f" % value if value < 1 else "%.1f" % value
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
