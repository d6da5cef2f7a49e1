#!/usr/bin/env python3
"""Where the proxy's CPU goes on the TLS path, per Kafka frame.

Each configuration is a proxy process in front of a local Tansu broker (in memory); the
clients (aiokafka, confluent-kafka) produce ``--records`` records of ``--record-size``
bytes through it and then consume them back:

* ``kthrottle`` / ``kthrottle-ssl`` - ``python -m kthrottle proxy`` from each ``--src``
  tree, plaintext or ``--security-protocol SSL`` towards the clients (the broker side
  stays plaintext); ``kthrottle-quota`` is ``kthrottle`` with a quota file giving every
  client-id quotas that never bind, so that every request takes the quota path;
* ``relay`` / ``relay-ssl`` - ``benchmarks/bare_relay.py``, a uvloop relay: one
  ``transport.write(data)`` per ``data_received``, parsing nothing, with TLS terminated
  like kthrottle's (same certificate, same context defaults). It forwards to a second Tansu
  broker that advertises the relay's port, so the clients stay behind it.

For every (round, configuration, client, phase) it reports the proxy process's CPU per MB
(the scheduler's run time of its threads, MB = 10^6 bytes of record values) and the
phase's throughput. Then,
each optional in its own pass so that it does not weigh on the CPU figures:

* ``--counts``: the proxy runs under a probe (installed by this file before the proxy's
  own code is imported) that counts, per request the clients sent: ``data_received`` calls
  and their sizes on both sides, the writes towards the client and the broker (one
  ``writelines`` per SendToClient/SendToBroker action, its number of chunks and their
  sizes; one write of the bytes read for a read the pipeline passes the short way), ``SSLObject.read``/``write`` calls, the ``SSLWantReadError`` raised, and the TLS
  records written (``ceil(n / 16384)`` per SSL write of n bytes: OpenSSL never joins two
  writes into one record). It also prints the negotiated protocol and cipher, and the
  pipeline's own time per call in the running proxy (``pass_request``, ``pass_response``,
  ``client_data``, ``broker_data``; wall clock around each call), to set against what
  ``frame_cost.py`` measures of the same calls in process.
* ``--strace``: ``strace -c -f`` attached to the proxy during each phase: syscalls per
  request.
* ``--py-spy DIR``: a ``py-spy record --format raw`` (``--native`` with ``--native``)
  profile of the proxy per phase into DIR, and a summary of where its samples sit;
* ``--perf DIR``: ``perf record -e cpu-clock`` of the proxy per phase into DIR (a software
  clock: works where the VM has no hardware counters), and its split by shared object
  (libcrypto, libssl, the interpreter, uvloop, the kernel) and top symbols;
* ``--callgrind DIR``: every proxy runs under ``valgrind --tool=callgrind``, its counts
  zeroed before each phase and dumped after it into DIR: the instructions it ran in user
  space per MB. They do not move with the machine's load as CPU time does, so two trees
  compare in one pass; ``callgrind_annotate DIR/FILE`` says where they went. The proxy
  runs some 50 times slower there, so read sizes and batching differ from the CPU passes.

Hardware counters are not available on every VM (``perf stat -e instructions`` says
"not supported" here), so CPU is process time: use several ``--rounds`` on a shared
machine and compare medians.

Examples::

    .venv/bin/python benchmarks/tls_path.py                     # small defaults
    .venv/bin/python benchmarks/tls_path.py --rounds 5 --records 50000 --counts \\
        --src main=. --src joined=/tmp/tree-with-a-fix --configs kthrottle,kthrottle-ssl,relay-ssl
    .venv/bin/python benchmarks/tls_path.py --rounds 1 --py-spy /tmp/prof --native

Every server binds 127.0.0.1 on a free port and is stopped by its PID at the end.
"""
import glob
import json
import math
import os
import signal
import sys
import time

# --------------------------------------------------------------------------- probe
# (runs inside the proxy process: kept free of the benchmark's imports)

_HIST = (64, 512, 4096, 16384, 65536, 262144)
TLS_RECORD = 16384  # a TLS record's most plaintext


def _bucket(n):
    for edge in _HIST:
        if n <= edge:
            return "<=%d" % edge
    return ">%d" % _HIST[-1]


class _Counts:
    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = {}
        self.bytes = {}
        self.hist = {}
        self.requests_base = None

    def add(self, name, n, size=None, hist=False):
        self.calls[name] = self.calls.get(name, 0) + n
        if size is not None:
            self.bytes[name] = self.bytes.get(name, 0) + size
            if hist:
                h = self.hist.setdefault(name, {})
                b = _bucket(size)
                h[b] = h.get(b, 0) + 1


COUNTS = _Counts()
_CONNECTIONS = []  # every client connection seen (the probe runs only for short benchmarks)
_TLS_SEEN = {}


def _install_ssl_probe():
    import ssl

    class CountingSSLObject(ssl.SSLObject):
        def read(self, len=1024, buffer=None):
            try:
                data = super().read(len, buffer)
            except ssl.SSLWantReadError:
                COUNTS.add("ssl_read_want_read", 1)
                raise
            n = data if buffer is not None else builtins_len(data)
            COUNTS.add("ssl_read", 1, n, hist=True)
            return data

        def write(self, data):
            n = super().write(data)
            COUNTS.add("ssl_write", 1, n, hist=True)
            COUNTS.add("tls_records_written", max(1, math.ceil(n / TLS_RECORD)))
            if not _TLS_SEEN:
                _TLS_SEEN["version"] = self.version()
                _TLS_SEEN["cipher"] = self.cipher()
            return n

    import builtins
    builtins_len = builtins.len
    ssl.SSLContext.sslobject_class = CountingSSLObject


def _count_actions(actions):
    for action in actions:
        name = action.__class__.__name__
        if name == "SendToClient":
            side = "to_client"
        elif name == "SendToBroker":
            side = "to_broker"
        else:
            continue
        chunks = action.chunks
        COUNTS.add(side + "_writes", 1, sum(len(c) for c in chunks))
        for c in chunks:
            COUNTS.add(side + "_chunks", 1, len(c), hist=True)


def _install_kthrottle_probe():
    from kthrottle.proxy import connection, pipeline

    short = pipeline.Connection
    pass_request, pass_response = short.pass_request, short.pass_response
    clock = time.perf_counter_ns

    def timed(method, name):
        # the pipeline's own time per call, in the running proxy (wall clock)
        def wrapper(self, *args):
            t = clock()
            out = method(self, *args)
            COUNTS.add(name, 1, clock() - t)
            return out
        return wrapper

    def counted(passes, side):
        passes = timed(passes, "pipeline_" + passes.__name__)

        def wrapper(self, data, *now):
            passed = passes(self, data, *now)
            if passed:
                COUNTS.add(side + "_short", 1, len(data))
                # the adapter writes ``data`` itself; for a response, nothing
                # yet (held until whole) or the chunks of one made whole (a list);
                # for requests a list is actions, counted where they are run
                chunks = [data]
                if passed is not True:
                    chunks = [] if side == "to_broker" or passed.__class__ is str else passed
                if chunks:
                    COUNTS.add(side + "_writes", 1, sum(map(len, chunks)))
                for c in chunks:
                    COUNTS.add(side + "_chunks", 1, len(c), hist=True)
            return passed
        return wrapper

    short.pass_request = counted(pass_request, "to_broker")
    short.pass_response = counted(pass_response, "to_client")
    short.client_data = timed(short.client_data, "pipeline_client_data")
    short.broker_data = timed(short.broker_data, "pipeline_broker_data")
    cls = connection.ClientConnection
    init, run, client_data, upstream_data = (cls.__init__, cls._run, cls.data_received,
                                             cls.upstream_data)

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        _CONNECTIONS.append(self)

    def _run(self, actions):
        _count_actions(actions)
        return run(self, actions)

    def data_received(self, data):
        COUNTS.add("client_recv", 1, len(data), hist=True)
        return client_data(self, data)

    def upstream(self, data):
        COUNTS.add("broker_recv", 1, len(data), hist=True)
        return upstream_data(self, data)

    cls.__init__, cls._run, cls.data_received, cls.upstream_data = (
        __init__, _run, data_received, upstream)


def _requests_so_far():
    return sum(c.pipeline.requests for c in _CONNECTIONS)


def _dump(signum, frame):
    """SIGUSR2: write the counts since the last dump to $TLS_PATH_PROBE_OUT, start again."""
    requests = _requests_so_far()
    out = {"calls": COUNTS.calls, "bytes": COUNTS.bytes, "hist": COUNTS.hist,
           "requests": requests - (COUNTS.requests_base or 0), "tls": dict(_TLS_SEEN)}
    if "tls" in out and out["tls"].get("cipher"):
        out["tls"]["cipher"] = list(out["tls"]["cipher"])
    path = os.environ["TLS_PATH_PROBE_OUT"]
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    COUNTS.reset()
    COUNTS.requests_base = requests


def run_probed_kthrottle(argv):
    """``python tls_path.py --probed-kthrottle ARGS``: kthrottle's CLI with the probe."""
    _install_ssl_probe()
    _install_kthrottle_probe()
    signal.signal(signal.SIGUSR2, _dump)
    from kthrottle.cli import main

    sys.argv = ["kthrottle"] + argv
    sys.exit(main())


# --------------------------------------------------------------------------- bare relay

def run_relay(argv):
    """``python tls_path.py --relay LISTEN_PORT UPSTREAM_PORT [CERT KEY] [--probe]``:
    benchmarks/bare_relay.py, with the probe's counts around its reads when asked."""
    import bare_relay  # next to this file, first on sys.path

    probe = "--probe" in argv
    argv = [a for a in argv if a != "--probe"]
    relay_argv = ["--listen", "127.0.0.1:%s" % argv[0], "--upstream", "127.0.0.1:%s" % argv[1]]
    if len(argv) > 2:
        relay_argv += ["--ssl-cert", argv[2], "--ssl-key", argv[3]]
    if probe:
        _install_ssl_probe()
        signal.signal(signal.SIGUSR2, _dump)
        from_client = bare_relay.ClientHalf.data_received
        from_broker = bare_relay.Half.data_received  # ClientHalf has its own

        def client_recv(self, data):
            COUNTS.add("client_recv", 1, len(data), hist=True)
            COUNTS.add("to_broker_writes", 1, len(data))
            COUNTS.add("to_broker_chunks", 1, len(data), hist=True)
            from_client(self, data)

        def broker_recv(self, data):
            COUNTS.add("broker_recv", 1, len(data), hist=True)
            COUNTS.add("to_client_writes", 1, len(data))
            COUNTS.add("to_client_chunks", 1, len(data), hist=True)
            from_broker(self, data)

        bare_relay.ClientHalf.data_received = client_recv
        bare_relay.Half.data_received = broker_recv
    sys.exit(bare_relay.main(relay_argv))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--probed-kthrottle":
    run_probed_kthrottle(sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--relay":
    run_relay(sys.argv[2:])

# --------------------------------------------------------------------------- benchmark

import asyncio  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from kthrottle_testkit.harness import (  # noqa: E402
    CLIENT_TLS,
    MB,
    NON_BINDING_QUOTAS,
    REPO,
    TANSU_NODE_ID,
    Endpoint,
    Run,
    SourceTree,
    add_proxy_cpus,
    aio_consume_throughput,
    aio_produce_throughput,
    ck_consume_throughput,
    ck_produce_throughput,
    create_topic,
    free_port,
    in_thread,
    markdown_table,
    metadata_probe,
    parser,
    split_cpus,
    tansu_binary,
    tls_files,
    wait_for_port,
)

CONFIGS = ("kthrottle", "kthrottle-ssl", "kthrottle-quota", "relay", "relay-ssl")
# kthrottle-quota: every client-id under quotas that never bind (the per-request quota path)
CLIENTS = ("aiokafka", "confluent")
PHASES = ("produce", "consume")
HERE = Path(__file__).resolve()
PROXY_ENV = {}  # --proxy-env: the proxies' environment on top of this one
CALLGRIND = {}  # --callgrind: {"dir": DIR} while its pass runs
STARTUP_TIMEOUT = 20.0  # seconds for a proxy to listen (more under valgrind)


def under_callgrind(argv, label):
    """``argv`` run under valgrind's callgrind in the --callgrind pass: it counts the
    instructions the process runs in user space (the kernel's work is not counted), the
    same for the same work whatever else the machine is doing."""
    if not CALLGRIND:
        return argv
    out = os.path.join(CALLGRIND["dir"], "%s.callgrind" % label)
    return ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out, *argv]


def callgrind_zero(pid):
    """Start counting afresh (the phase to come)."""
    subprocess.run(["callgrind_control", "--zero", str(pid)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL)


def callgrind_dump(pid, label):
    """Dump what was counted since callgrind_zero; (instructions, the dump's path)."""
    out = os.path.join(CALLGRIND["dir"], "%s.callgrind" % label)
    before = set(glob.glob(out + ".*"))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        new = sorted(set(glob.glob(out + ".*")) - before, key=os.path.getmtime)
        if new:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("callgrind wrote no dump for %s" % label)
        time.sleep(0.2)
    path = new[-1]
    for _ in range(50):  # the file is written whole before "totals:" / "summary:"
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1]), path
        time.sleep(0.2)
    raise RuntimeError("no instruction total in %s" % path)


@dataclass
class Load:
    records: int
    record_size: int
    partitions: int = 3
    linger_ms: int = 5
    batch_size: int = 64 * 1024
    max_in_flight: int = 10_000


def start_kthrottle(run, broker, tree, tls, files, probe, label, quota=False):
    """kthrottle from ``tree`` in front of ``broker`` (optionally under the probe)."""
    for attempt in range(3):
        listen, node_port = free_port(), free_port()
        if listen == node_port or node_port - TANSU_NODE_ID < 1024:
            continue
        args = ["proxy", "--bootstrap-server", broker.bootstrap,
                "--listen", "127.0.0.1:%d" % listen,
                "--node-port-base", str(node_port - TANSU_NODE_ID), "--log-level", "WARNING"]
        if tls:
            args += ["--security-protocol", "SSL", "--ssl-cert", files["cert"],
                     "--ssl-key", files["key"]]
        if quota:
            quota_file = run.path("non-binding-quotas.toml")
            quota_file.write_text(NON_BINDING_QUOTAS)
            args += ["--quota-file", str(quota_file)]
        env = dict(tree.env, **PROXY_ENV)
        if probe:
            env["TLS_PATH_PROBE_OUT"] = str(run.path("%s.counts.json" % label))
            argv = [sys.executable, str(HERE), "--probed-kthrottle", *args]
        else:
            argv = [sys.executable, "-m", "kthrottle", *args]
        argv = under_callgrind(argv, label)
        proc = run.procs.spawn(label, argv, env=env, cwd=tree.src, proxy=True)
        try:
            wait_for_port("127.0.0.1", listen, timeout=STARTUP_TIMEOUT * (15 if CALLGRIND else 1),
                          proc=proc)
            metadata_probe("127.0.0.1", listen, timeout=60 if CALLGRIND else 10,
                           cafile=files["ca"] if tls else None)
            wait_for_port("127.0.0.1", node_port, timeout=5, proc=proc)
        except Exception as exc:
            run.procs.stop(proc)
            print("    %s start attempt %d failed: %s" % (label, attempt + 1, exc))
            continue
        bootstrap = "127.0.0.1:%d" % listen
        if tls:
            CLIENT_TLS[bootstrap] = files["ca"]
        else:
            CLIENT_TLS.pop(bootstrap, None)
        return Endpoint(label, bootstrap, proc)
    raise RuntimeError("%s did not start (logs in %s)" % (label, run.log_dir))


def start_relay(run, tls, files, probe, label):
    """The bare relay in front of a Tansu broker of its own that advertises the relay."""
    relay_port, broker_port = free_port(), free_port()
    broker = run.procs.spawn(label + "-tansu", [
        tansu_binary(), "broker", "--listener-url", "tcp://127.0.0.1:%d" % broker_port,
        "--advertised-listener-url", "tcp://127.0.0.1:%d" % relay_port,
        "--storage-engine", "memory://tansu/"], env=dict(os.environ, RUST_LOG="warn"))
    wait_for_port("127.0.0.1", broker_port, timeout=20, proc=broker)
    argv = [sys.executable, str(HERE), "--relay", str(relay_port), str(broker_port)]
    if tls:
        argv += [files["cert"], files["key"]]
    env = dict(os.environ, **PROXY_ENV)
    if probe:
        argv.append("--probe")
        env["TLS_PATH_PROBE_OUT"] = str(run.path("%s.counts.json" % label))
    proc = run.procs.spawn(label, under_callgrind(argv, label), env=env, proxy=True)
    wait_for_port("127.0.0.1", relay_port, timeout=STARTUP_TIMEOUT * (15 if CALLGRIND else 1),
                  proc=proc)
    bootstrap = "127.0.0.1:%d" % relay_port
    if tls:
        CLIENT_TLS[bootstrap] = files["ca"]
    return Endpoint(label, bootstrap, proc), "127.0.0.1:%d" % broker_port, broker


def cpu_ns(pid):
    """CPU time of every thread of ``pid`` in ns (/proc/PID/task/*/schedstat: exact, where
    psutil's user+system come in 10 ms ticks)."""
    total = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread gone since listed
    return total


def minor_faults(pid):
    """Minor page faults of the whole process so far (/proc/PID/stat)."""
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def probe_counts(endpoint, path):
    """Ask the probed proxy for its counts since the last call."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    endpoint.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("no counts from %s" % endpoint.config)
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


class Attached:
    """strace -c or py-spy attached to the proxy for one phase (stopped by its PID)."""

    def __init__(self, kind, pid, out, native=False):
        self.kind, self.out = kind, out
        if kind == "strace":
            argv = ["strace", "-c", "-f", "-p", str(pid), "-o", out]
        elif kind == "perf":
            argv = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(pid),
                    "-o", out]
        else:
            argv = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                    "--format", "raw", "--rate", "250", "-o", out]
            # --native needs the process paused while sampled
            argv.append("--native" if native else "--nonblocking")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the load starts

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=5)
        if not os.path.exists(self.out):
            print("    %s wrote nothing: %s" % (self.kind, err.decode(errors="replace")[-300:]))


def strace_calls(path):
    """{syscall: calls} from strace -c output."""
    calls = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                try:
                    calls[parts[-1]] = int(parts[3])
                except ValueError:
                    pass
    return calls


def _perf_report(path, sort):
    """perf report's rows for a perf.data file: (share of samples, the other columns)."""
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--sort", sort, "-q"],
                         capture_output=True, text=True, timeout=120).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("%"):
            yield float(parts[0].rstrip("%")) / 100, parts[1:]


def perf_dsos(path, top=8):
    """[(shared object, share of samples)] from a perf.data file (perf report --sort dso)."""
    return [(" ".join(cols), share) for share, cols in _perf_report(path, "dso")][:top]


def perf_symbols(path, top=15):
    """[(symbol, shared object, share)] from a perf.data file."""
    return [(" ".join(cols[2:]), cols[0], share)
            for share, cols in _perf_report(path, "dso,sym") if len(cols) >= 3][:top]


def py_spy_summary(path, top=12):
    """(samples, [(leaf frame, share)], {marker: share of samples with it in the stack})."""
    leaves = collections.Counter()
    markers = {"ssl (any frame)": ("ssl", "SSL", "crypto"), "sslproto": ("sslproto",),
               "data_received": ("data_received",), "_run (actions)": ("_run ",),
               "writelines/write": ("write",)}
    marked = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n)
            total += n
            frames = stack.split(";")
            leaves[re.sub(r" \(.*", "", frames[-1])] += n
            for name, keys in markers.items():
                if any(k in stack for k in keys):
                    marked[name] += n
    if not total:
        return 0, [], {}
    return (total, [(f, n / total) for f, n in leaves.most_common(top)],
            {k: marked[k] / total for k in markers})


async def run_phase(client, phase, bootstrap, topic, load):
    expected = load.records + load.partitions  # the warm-up's record per partition
    if client == "aiokafka":
        if phase == "produce":
            return await aio_produce_throughput(bootstrap, topic, load)
        return (await aio_consume_throughput(bootstrap, topic, load, expected))[2]
    if phase == "produce":
        return await in_thread(ck_produce_throughput, bootstrap, topic, load)
    return (await in_thread(ck_consume_throughput, bootstrap, topic, load, expected))[2]


async def measure_cell(run, args, load, broker, files, config, tree_label, tree, mode):
    """One configuration and source tree, both clients, both phases: a list of rows."""
    tls = config.endswith("-ssl")
    label = "%s-%s-%s" % (config, tree_label, mode) if config.startswith("kthrottle") else \
        "%s-%s" % (config, mode)
    probe = mode == "counts"
    relay_broker = None
    if config.startswith("relay"):
        endpoint, topic_at, relay_broker = start_relay(run, tls, files, probe, label)
    else:
        endpoint = start_kthrottle(run, broker, tree, tls, files, probe, label,
                                   quota=config.endswith("-quota"))
        topic_at = broker.bootstrap
    counts_path = str(run.path("%s.counts.json" % label))
    rows = []
    try:
        proc = psutil.Process(endpoint.proc.pid)
        for client in args.clients:
            topic = "tls-path-%s" % uuid.uuid4().hex[:12]
            create_topic(topic_at, topic, load.partitions)
            for phase in PHASES:
                if probe:
                    probe_counts(endpoint, counts_path)  # reset
                attached = None
                if mode in ("strace", "py-spy", "perf"):
                    out = {"strace": str(run.path("%s-%s-%s.strace" % (label, client, phase))),
                           "perf": str(Path(args.perf or ".") / ("%s-%s-%s.perf.data"
                                                                 % (label, client, phase))),
                           "py-spy": str(Path(args.py_spy or ".") / ("%s-%s-%s.txt"
                                                                     % (label, client, phase)))
                           }[mode]
                    attached = Attached(mode, endpoint.proc.pid, out, args.native)
                if mode == "callgrind":
                    callgrind_zero(proc.pid)
                cpu0, faults0 = cpu_ns(proc.pid), minor_faults(proc.pid)
                try:
                    seconds = await asyncio.wait_for(
                        run_phase(client, phase, endpoint.bootstrap, topic, load),
                        args.phase_timeout)
                finally:
                    cpu1, faults1 = cpu_ns(proc.pid), minor_faults(proc.pid)
                    if attached is not None:
                        attached.stop()
                mb = load.records * load.record_size / MB
                row = {"config": config, "src": tree_label if config.startswith("kthrottle")
                       else "-", "client": client, "phase": phase, "mode": mode,
                       "seconds": seconds, "mb": mb, "cpu_ms_per_mb": (cpu1 - cpu0) / 1e6 / mb,
                       "mb_per_s": mb / seconds, "faults_per_mb": (faults1 - faults0) / mb}
                if probe:
                    row["counts"] = probe_counts(endpoint, counts_path)
                if mode == "strace":
                    row["syscalls"] = strace_calls(attached.out)
                if mode in ("py-spy", "perf"):
                    row["profile"] = attached.out
                if mode == "callgrind":
                    row["instructions"], row["profile"] = callgrind_dump(proc.pid, label)
                    print("    %s: %.2f million instructions per MB in user space"
                          % (Path(row["profile"]).name, row["instructions"] / 1e6 / mb))
                rows.append(row)
                print("    %-14s %-8s %-10s %-8s %-6s %6.2f ms/MB  %6.1f MB/s  %5.0f faults/MB"
                      % (config, row["src"], client, phase, mode, row["cpu_ms_per_mb"],
                         row["mb_per_s"], row["faults_per_mb"]), flush=True)
    finally:
        run.procs.stop(endpoint.proc)
        if relay_broker is not None:
            run.procs.stop(relay_broker)
    return rows


def per_request(row):
    """The probe's counts of one phase divided by the requests the clients sent."""
    c = row["counts"]
    req = max(1, c["requests"]) if row["config"].startswith("kthrottle") else None
    calls, nbytes = c["calls"], c["bytes"]
    out = {"requests": c["requests"]}
    for name in ("client_recv", "to_broker_writes", "to_broker_chunks", "broker_recv",
                 "to_client_writes", "to_client_chunks", "ssl_read", "ssl_read_want_read",
                 "ssl_write", "tls_records_written"):
        n = calls.get(name, 0)
        out[name] = n / req if req else n
        if name in nbytes and n:
            out[name + "_avg_bytes"] = nbytes[name] / n
    return out


def report(rows, args):
    lines = []
    cpu = collections.defaultdict(list)
    rate = collections.defaultdict(list)
    faults = collections.defaultdict(list)
    for r in rows:
        if r["mode"] == "cpu":
            key = (r["client"], r["phase"], r["config"], r["src"])
            cpu[key].append(r["cpu_ms_per_mb"])
            rate[key].append(r["mb_per_s"])
            faults[key].append(r["faults_per_mb"])
    if cpu:
        table = []
        for key in sorted(cpu):
            v = cpu[key]
            table.append([*key, "%.2f" % statistics.median(v),
                          "%.2f-%.2f" % (min(v), max(v)),
                          "%.1f" % statistics.median(rate[key]),
                          "%.0f" % statistics.median(faults[key]), str(len(v))])
        if args.pinned:
            lines.append("CPUs (--proxy-cpus): %s.\n" % args.pinned)
        lines.append("Proxy CPU per MB (median of rounds) and throughput:\n")
        lines.extend(markdown_table(["client", "phase", "config", "src", "ms/MB", "range",
                                     "MB/s", "faults/MB", "n"], table))
    counted = [r for r in rows if r["mode"] == "counts"]
    if counted:
        names = ("client_recv", "to_broker_chunks", "broker_recv", "to_client_writes",
                 "to_client_chunks", "ssl_read", "ssl_read_want_read", "ssl_write",
                 "tls_records_written")
        table = []
        for r in counted:
            p = per_request(r)
            cells = []
            for n in names:
                avg = p.get(n + "_avg_bytes")
                cells.append("%.2f" % p[n] + (" (%d B)" % avg if avg else ""))
            table.append([r["client"], r["phase"], r["config"], r["src"], str(p["requests"]),
                          *cells])
        lines.append("\nPer request the clients sent (relay rows: totals, it does not parse "
                     "frames); (N B): average size:\n")
        lines.extend(markdown_table(["client", "phase", "config", "src", "requests", *names],
                                    table))
        timed = [r for r in counted
                 if any(k.startswith("pipeline_") for k in r["counts"]["calls"])]
        if timed:
            names = ("pipeline_pass_request", "pipeline_client_data", "pipeline_pass_response",
                     "pipeline_broker_data")
            table = []
            for r in timed:
                calls, ns = r["counts"]["calls"], r["counts"]["bytes"]
                table.append([r["client"], r["phase"], r["config"], r["src"], *(
                    "%.2f us x %d" % (ns[n] / calls[n] / 1000, calls[n]) if calls.get(n) else "-"
                    for n in names)])
            lines.append("\nThe pipeline's own time in the running proxy, per call and calls "
                         "(wall clock around each call, probe included; pass_request and "
                         "pass_response are the short way, client_data and broker_data the "
                         "long way):\n")
            lines.extend(markdown_table(["client", "phase", "config", "src", "pass_request",
                                         "client_data", "pass_response", "broker_data"], table))
        for r in counted:
            if r["counts"].get("tls"):
                lines.append("\nnegotiated: %s %s" % (r["counts"]["tls"].get("version"),
                                                      r["counts"]["tls"].get("cipher")))
                break
        lines.append("\nSize histograms (calls per size bucket):")
        for r in counted:
            for name in ("client_recv", "to_client_chunks", "ssl_read", "ssl_write"):
                h = r["counts"]["hist"].get(name)
                if h:
                    lines.append("  %s %s %s %s %s: %s" % (
                        r["client"], r["phase"], r["config"], r["src"], name,
                        ", ".join("%s:%d" % (k, h[k]) for k in sorted(
                            h, key=lambda k: (k[0] == ">", int(k.lstrip("<=>")))))))
    straced = [r for r in rows if r["mode"] == "strace"]
    if straced:
        lines.append("\nSyscalls during the phase (strace -c -f), per MB:\n")
        table = []
        for r in straced:
            s = r["syscalls"]
            top = sorted(s.items(), key=lambda kv: -kv[1])[:6]
            table.append([r["client"], r["phase"], r["config"], r["src"],
                          ", ".join("%s %.0f" % (k, v / r["mb"]) for k, v in top)])
        lines.extend(markdown_table(["client", "phase", "config", "src", "calls per MB"],
                                    table))
    for r in rows:
        if r["mode"] != "perf" or not os.path.exists(r["profile"]):
            continue
        lines.append("\nperf (cpu-clock) %s %s %s %s, %.2f ms/MB: by shared object: %s" % (
            r["client"], r["phase"], r["config"], r["src"], r["cpu_ms_per_mb"],
            ", ".join("%s %.0f%%" % (d, v * 100) for d, v in perf_dsos(r["profile"]))))
        for sym, dso, share in perf_symbols(r["profile"]):
            lines.append("  %5.1f%%  %-40s %s" % (share * 100, sym, dso))
    ground = [r for r in rows if r["mode"] == "callgrind"]
    if ground:
        lines.append("\nUser-space instructions per MB (valgrind --tool=callgrind; the kernel's "
                     "work is not counted):\n")
        table = []
        for r in ground:
            table.append([r["client"], r["phase"], r["config"], r["src"],
                          "%.2f M" % (r["instructions"] / 1e6 / r["mb"]),
                          os.path.basename(r["profile"])])
        lines.extend(markdown_table(["client", "phase", "config", "src", "instructions/MB",
                                     "dump (callgrind_annotate)"], table))
    spied = [r for r in rows if r["mode"] == "py-spy"]
    for r in spied:
        if not os.path.exists(r["profile"]):
            continue
        total, leaves, marked = py_spy_summary(r["profile"])
        lines.append("\npy-spy %s %s %s %s: %d samples (%s)" % (
            r["client"], r["phase"], r["config"], r["src"], total, r["profile"]))
        lines.append("  stacks with: " + ", ".join("%s %.0f%%" % (k, v * 100)
                                                   for k, v in marked.items()))
        for frame, share in leaves:
            lines.append("  %5.1f%%  %s" % (share * 100, frame))
    return "\n".join(lines)


async def main(args):
    load = Load(args.records, args.record_size)
    trees = [(label, SourceTree(path, label)) for label, path in args.src]
    rows = []
    with Run("tls_path") as run:
        if args.proxy_cpus is not None:  # before the brokers start: they take the others
            args.pinned = run.procs.pin_proxies(args.proxy_cpus)
            print(args.pinned, flush=True)
        files = tls_files(run.log_dir)
        broker = run.broker()
        modes = ["cpu"] * args.rounds
        if args.counts:
            modes.append("counts")
        if args.strace:
            modes.append("strace")
        if args.py_spy:
            Path(args.py_spy).mkdir(parents=True, exist_ok=True)
            modes.append("py-spy")
        if args.perf:
            Path(args.perf).mkdir(parents=True, exist_ok=True)
            modes.append("perf")
        if args.callgrind:
            Path(args.callgrind).mkdir(parents=True, exist_ok=True)
            modes.append("callgrind")
        cells = [(c, label, tree) for c in args.configs
                 for label, tree in (trees if c.startswith("kthrottle") else trees[:1])]
        for i, mode in enumerate(modes):
            print("pass %d/%d: %s" % (i + 1, len(modes), mode), flush=True)
            order = cells[i % len(cells):] + cells[:i % len(cells)]  # rotated
            CALLGRIND.clear()
            if mode == "callgrind":
                CALLGRIND["dir"] = str(Path(args.callgrind).resolve())
            for config, label, tree in order:
                rows.extend(await measure_cell(run, args, load, broker, files, config, label,
                                               tree, mode))
        failed = run.stopped
        status = run.finish(bool(failed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    text = report(rows, args)
    print("\n" + text)
    return status


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, of %s" % ", ".join(CONFIGS))
    p.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated")
    p.add_argument("--src", action="append", default=None, metavar="LABEL=DIR",
                   help="a kthrottle source tree to measure (repeatable; default this "
                        "checkout as 'main')")
    p.add_argument("--rounds", type=int, default=2, help="CPU passes (no probe attached)")
    p.add_argument("--records", type=int, default=20_000)
    p.add_argument("--record-size", type=int, default=1024)
    p.add_argument("--counts", action="store_true", help="a pass with the counting probe")
    p.add_argument("--strace", action="store_true", help="a pass under strace -c")
    p.add_argument("--py-spy", metavar="DIR", help="a pass under py-spy, profiles into DIR")
    p.add_argument("--native", action="store_true", help="py-spy --native")
    p.add_argument("--perf", metavar="DIR", help="a pass under perf record -e cpu-clock "
                   "(native: OpenSSL, the interpreter, the kernel), perf.data files into DIR")
    p.add_argument("--callgrind", metavar="DIR", help="a pass with every proxy under "
                   "valgrind --tool=callgrind: instructions per MB in user space (repeatable "
                   "from run to run, unlike CPU time), callgrind.out files into DIR for "
                   "callgrind_annotate; runs some 50 times slower, so keep --records small")
    p.add_argument("--phase-timeout", type=float, default=120.0)
    p.add_argument("--proxy-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every proxy's (and relay's) environment, e.g. "
                        "GLIBC_TUNABLES=glibc.malloc.trim_threshold=67108864 (repeatable)")
    add_proxy_cpus(p)
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    args.pinned = None
    if args.proxy_cpus is not None:
        try:
            split_cpus(args.proxy_cpus)
        except ValueError as exc:
            p.error(str(exc))
    args.configs = [c for c in args.configs.split(",") if c]
    args.clients = [c for c in args.clients.split(",") if c]
    for c in args.configs:
        if c not in CONFIGS:
            p.error("unknown configuration %s" % c)
    src = args.src or ["main=%s" % REPO]
    args.src = []
    for item in src:
        label, _, path = item.partition("=")
        if not path:
            p.error("--src LABEL=DIR")
        args.src.append((label, str(Path(path).resolve())))
    for item in args.proxy_env:
        name, _, value = item.partition("=")
        PROXY_ENV[name] = value
    if args.callgrind and not shutil.which("valgrind"):
        p.error("--callgrind: valgrind is not installed")
    if args.strace and not shutil.which("strace"):
        p.error("--strace: strace is not installed")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
