"""What every benchmark in this directory shares, so that a benchmark file states only what
it measures.

* a run: a temporary log directory, every process started (stopped by its own PID at the
  end, in reverse order), Ctrl-C and SIGTERM turned into one clean stop (``Run``);
* servers on 127.0.0.1 and free ports: a Tansu broker (optionally advertising another
  address, for a relay in front of it), ZooKeeper, a local S3 server,
  ``python -m kthrottle proxy`` from this checkout or from another source tree
  (``SourceTree``: ``--baseline-src`` / ``--proxy-src``), ``tansu proxy``, the bare relay
  (``benchmarks/bare_relay.py``);
* measuring: process, process-tree and machine CPU, latency percentiles, the proxy's
  /metrics;
* client runners: aiokafka and confluent-kafka produce / consume / fixed-rate latency
  loops, raw Kafka frames and SASL logins, forked load-generator processes;
* reporting: Markdown tables, JSON, plots (skipped with a message when matplotlib is not
  installed), machine facts, common flags.

Benchmarks run as ``python benchmarks/NAME.py`` and import this module from the test kit
(``from kthrottle_testkit.harness import ...``), as the tests import the rest of the kit.
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from kthrottle.embedded import (
    MotoS3Server,
    TansuBroker,
    _die_with_parent,
    free_port,
    tansu_binary,
    wait_for_port,
)
from kthrottle_testkit import BENCHMARKS, ROOT

REPO = ROOT  # this checkout: the source tree measured unless told otherwise (SourceTree)

# where a run writes unless told: a new directory of its own under RUNS, which git ignores
# (fresh_run_dir, output_dir). benchmarks/results holds the committed results: a run writes
# there only when told to (--output-dir benchmarks/results), never by default.
RUNS = BENCHMARKS / "runs"

# quotas that never bind, for every client-id: the per-request quota path without a throttle
# (10 GB/s produce and fetch, 10^9 requests/s)
NON_BINDING_QUOTAS = """\
[clients."<default>"]
producer_byte_rate = 10000000000
consumer_byte_rate = 10000000000
request_rate = 1000000000
"""
TANSU_NODE_ID = 111  # every Tansu broker reports this node id
MB = 1_000_000
MIB = 1024 * 1024
MP = multiprocessing.get_context("fork")
# bootstrap address -> CA file, for the endpoints clients reach over TLS
CLIENT_TLS = {}


# --------------------------------------------------------------------------- processes


def cpu_list(cpus):
    """{0, 2, 3} -> "0,2,3" (taskset's --cpu-list form)."""
    return ",".join(str(c) for c in sorted(cpus))


def parse_cpu_list(text):
    """"1", "1,3" or "2-3" -> a set of CPU numbers (argparse type of --proxy-cpus)."""
    cpus = set()
    try:
        for part in text.split(","):
            low, sep, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high if sep else low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError("expected CPU numbers such as 1, 1,3 or 2-3, got %r"
                                         % text) from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError("expected CPU numbers such as 1, 1,3 or 2-3, got %r"
                                         % text)
    return cpus


def split_cpus(cpus):
    """(``cpus``, the other CPUs this process may use); ValueError when ``cpus`` are not
    all allowed or leave none."""
    allowed = os.sched_getaffinity(0)
    cpus = set(cpus)
    if not cpus <= allowed:
        raise ValueError("--proxy-cpus %s: this process may use CPUs %s only"
                         % (cpu_list(cpus), cpu_list(allowed)))
    if not allowed - cpus:
        raise ValueError("--proxy-cpus %s leaves no CPU for the clients and the brokers"
                         % cpu_list(cpus))
    return cpus, allowed - cpus


def add_proxy_cpus(p):
    p.add_argument("--proxy-cpus", type=parse_cpu_list, metavar="LIST",
                   help="pin the proxies under test (kthrottle, its workers, the relays, "
                   "tansu proxy, the peer proxies) to these CPUs (e.g. 1) and the clients "
                   "and brokers to the others, as a proxy deployed on cores of its own; by "
                   "default every process shares every CPU")


class Processes:
    """Every child process (and other server) a run starts, so that each is stopped by its
    own PID; ``stop_all`` stops them newest first."""

    def __init__(self, log_dir):
        self.log_dir = Path(log_dir)
        self._items = []  # Popen objects and stop callables, in start order
        self.proxy_cpus = None  # pin_proxies: the CPUs of the proxies under test

    def pin_proxies(self, cpus):
        """``--proxy-cpus``: the proxies under test (spawned with ``proxy=True``) run on
        ``cpus`` alone, and this process, its threads (the clients) and everything else it
        starts from now on (the brokers) on the other CPUs it may use, as a proxy deployed
        on cores of its own. Returns a line saying so."""
        cpus, others = split_cpus(cpus)
        os.sched_setaffinity(0, others)  # inherited by the threads and children made next
        self.proxy_cpus = cpus
        return ("proxies pinned to CPU %s; this process, its clients and the brokers to CPU %s"
                % (cpu_list(cpus), cpu_list(others)))

    def spawn(self, name, argv, env=None, cwd=None, proxy=False):
        """Start ``argv`` with stdout and stderr in ``log_dir/NAME.log``; a proxy under test
        (``proxy``) on the CPUs of ``pin_proxies``, if any (``taskset``, so that its
        threads and workers are pinned from their start)."""
        if proxy and self.proxy_cpus:
            argv = ["taskset", "--cpu-list", cpu_list(self.proxy_cpus), *argv]
        with open(self.log_dir / ("%s.log" % name), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    start_new_session=True)  # Ctrl-C reaches only us
        self._items.append(proc)
        return proc

    def on_stop(self, stop):
        """Call ``stop()`` in ``stop_all`` (servers started by their own classes)."""
        self._items.append(stop)
        return stop

    def stop(self, proc, timeout=5.0, sig=signal.SIGTERM):
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc in self._items:
            self._items.remove(proc)

    def stop_all(self):
        for item in reversed(list(self._items)):
            try:
                if isinstance(item, subprocess.Popen):
                    self.stop(item)
                else:
                    self._items.remove(item)
                    item()
            except Exception as exc:  # keep going: the others must be stopped too
                print("! stopping: %s: %s" % (type(exc).__name__, exc), file=sys.stderr)


def _sigterm_to_interrupt(signum, frame):
    """SIGTERM as Ctrl-C: while an asyncio.Runner runs, its SIGINT handler cancels the
    running task cleanly; otherwise this raises KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def handle_signals():
    """Ctrl-C and SIGTERM take the same cleanup path (KeyboardInterrupt), even when a shell
    started us in the background with SIGINT ignored."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)


class Run:
    """One benchmark run. ``with Run("name") as run:`` makes a log directory, takes Ctrl-C
    and SIGTERM, and at the end stops every process and server started through it. A
    KeyboardInterrupt (and, with ``catch``, any other exception) is recorded in
    ``interrupted`` / ``failure`` and not raised further, so that what was measured can
    still be written; ``finish`` then removes the logs or says where they are kept."""

    def __init__(self, name, catch=True, log_dir=None):
        self.name = name
        self.catch = catch
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=name + "-"))
        self.procs = Processes(self.log_dir)
        self.started = time.monotonic()
        self.interrupted = False
        self.failure = None

    def __enter__(self):
        handle_signals()
        return self

    def __exit__(self, exc_type, exc, tb):
        stop_threads()
        self.procs.stop_all()
        if exc_type is None:
            return False
        if issubclass(exc_type, KeyboardInterrupt):
            self.interrupted = True
            print("\ninterrupted; processes stopped, writing what was measured", file=sys.stderr)
            return True
        if self.catch and issubclass(exc_type, Exception):
            self.failure = "%s: %s" % (exc_type.__name__, exc)
            print("\nfailed: %s (logs in %s)" % (self.failure, self.log_dir), file=sys.stderr)
            return True
        return False

    @property
    def elapsed(self):
        return time.monotonic() - self.started

    @property
    def stopped(self):
        """Why the run ended early ("interrupted", the failure), or None."""
        return "interrupted" if self.interrupted else self.failure

    def path(self, name):
        return self.log_dir / name

    def broker(self, name="tansu-broker", advertised_port=None, **kwargs):
        """A started Tansu broker (in memory unless ``storage_url``/``env`` say otherwise);
        with ``advertised_port`` it tells clients to connect to 127.0.0.1 on that port."""
        if advertised_port is not None:
            broker = AdvertisingTansuBroker(advertised_port, log_path=str(self.path(name + ".log")),
                                            **kwargs)
        else:
            broker = TansuBroker(log_path=str(self.path(name + ".log")), **kwargs)
        self.procs.on_stop(broker.stop)
        return broker.start()

    def zookeeper(self, name="zookeeper"):
        from kthrottle_testkit.zookeeper import ZooKeeperServer, available

        if not available():
            raise RuntimeError("ZooKeeper is not installed (scripts/test installs Debian's "
                               "zookeeper package)")
        server = ZooKeeperServer(self.path(name))
        self.procs.on_stop(server.stop)
        return server.start()

    def s3(self, name="moto-s3"):
        server = MotoS3Server(log_path=str(self.path(name + ".log")))
        self.procs.on_stop(server.stop)
        return server.start()

    def kthrottle(self, upstream, extra_args=(), **kwargs):
        """``start_kthrottle`` with this run's processes."""
        return start_kthrottle(upstream, self.procs, extra_args, **kwargs)

    def tansu_proxy(self, broker):
        return start_tansu_proxy(broker, self.procs)

    def bare_relay(self, port, upstream, name="bare-relay", tls=None):
        """``start_bare_relay`` with this run's processes."""
        return start_bare_relay(port, upstream, self.procs, name, tls)

    def finish(self, failed=False):
        """Exit status: 1 if ``failed``, interrupted or failed; the logs are kept then."""
        failed = bool(failed or self.interrupted or self.failure)
        if failed:
            print("process logs kept in %s" % self.log_dir, file=sys.stderr)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return 1 if failed else 0


# --------------------------------------------------------------------------- source trees


class SourceTree:
    """A kthrottle source tree (this checkout, or a worktree given by ``--baseline-src`` /
    ``--proxy-src``): ``python -m kthrottle`` runs with cwd and PYTHONPATH set to it, both
    of which come before the virtualenv's editable install."""

    def __init__(self, src=REPO, label=None):
        self.src = Path(src).resolve()
        self.label = label
        path = os.environ.get("PYTHONPATH")
        self.env = dict(os.environ, PYTHONPATH=str(self.src) + (os.pathsep + path if path
                                                                    else ""))
        self._commit = None

    @property
    def commit(self):
        if self._commit is None:
            self._commit = git_describe(self.src)
        return self._commit

    def imported_from(self):
        """``kthrottle.__file__`` as a spawned interpreter sees it; raises if that is not
        the package inside this tree."""
        out = subprocess.run([sys.executable, "-c", "import kthrottle; print(kthrottle.__file__)"],
                             env=self.env, cwd=self.src, capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise RuntimeError("cannot import kthrottle from %s: %s" % (self.src,
                                                                        out.stderr.strip()))
        path = Path(out.stdout.strip()).resolve()
        if self.src / "kthrottle" not in path.parents:
            raise RuntimeError("with %s first on the path kthrottle is imported from %s"
                               % (self.src, path))
        return str(path)

    def cli(self, *argv, timeout=60):
        """``python -m kthrottle ARGV`` from this tree; raises if it fails."""
        return subprocess.run([sys.executable, "-m", "kthrottle", *argv], env=self.env,
                              cwd=self.src, check=True, capture_output=True, text=True,
                              timeout=timeout)

    def write_credentials(self, path, users, iterations,
                          mechanisms=("SCRAM-SHA-256", "SCRAM-SHA-512")):
        """SCRAM credentials of ``users`` ({name: password}) into a credentials file."""
        for user, password in users.items():
            config = ",".join("%s=[iterations=%d,password=%s]" % (m, iterations, password)
                              for m in mechanisms)
            self.cli("quotas", "alter", "--credentials-file", str(path), "--entity-type",
                     "users", "--entity-name", user, "--add-config", config)


def check_src(parser, flag, src):
    """``src`` resolved, or a usage error if it holds no kthrottle package."""
    src = Path(src).resolve()
    if not (src / "kthrottle" / "__init__.py").is_file():
        parser.error("%s: %s has no kthrottle/ package" % (flag, src))
    return src


# --------------------------------------------------------------------------- proxies


@dataclass
class Endpoint:
    """Where clients connect for one configuration, and the proxy process if any."""

    config: str
    bootstrap: str
    proc: Optional[subprocess.Popen] = None
    admin_port: Optional[int] = None  # kthrottle's /metrics and /quotas, when asked for
    node_port: Optional[int] = None  # kthrottle's listener for node 111

    @property
    def port(self):
        return int(self.bootstrap.rsplit(":", 1)[1])

    def metrics(self):
        return admin_get(self.admin_port)


def start_kthrottle(upstream, procs, extra_args=(), admin=False, name="kthrottle", attempts=3,
                    src=None, cafile=None, probe=True, log_level="WARNING"):
    """``python -m kthrottle proxy`` from ``src`` (a path or SourceTree; this checkout by
    default) in front of ``upstream`` (a broker or a "host:port"), on free ports, with an
    admin endpoint if asked. With ``probe`` it is ready once a Metadata request through it
    has opened its node listener; without, once it listens."""
    tree = src if isinstance(src, SourceTree) else SourceTree(src or REPO)
    bootstrap_upstream = getattr(upstream, "bootstrap", upstream)
    last_error = None
    for attempt in range(attempts):
        listen, node_port = free_port(), free_port()
        admin_port = free_port() if admin else None
        if len({listen, node_port, admin_port}) < 3 or node_port - TANSU_NODE_ID < 1024:
            continue
        argv = [
            sys.executable, "-m", "kthrottle", "proxy",
            "--bootstrap-server", bootstrap_upstream,
            "--listen", "127.0.0.1:%d" % listen,
            "--node-port-base", str(node_port - TANSU_NODE_ID),  # Tansu is node 111
            "--log-level", log_level, *extra_args,
        ]
        if admin_port:
            argv += ["--admin-listen", "127.0.0.1:%d" % admin_port]
        proc = procs.spawn(name, argv, env=tree.env, cwd=tree.src, proxy=True)
        try:
            wait_for_port("127.0.0.1", listen, timeout=20, proc=proc)
            if probe:
                metadata_probe("127.0.0.1", listen, cafile=cafile)  # opens node 111's listener
                wait_for_port("127.0.0.1", node_port, timeout=5, proc=proc)
            if admin_port:
                wait_for_port("127.0.0.1", admin_port, timeout=5, proc=proc)
            bootstrap = "127.0.0.1:%d" % listen
            if cafile is not None:
                CLIENT_TLS[bootstrap] = cafile
            return Endpoint(name, bootstrap, proc, admin_port, node_port)
        except Exception as exc:  # most likely a port taken in between: try other ports
            last_error = exc
            procs.stop(proc)
            print("    %s start attempt %d failed: %s" % (name, attempt + 1, exc), flush=True)
            said = last_log_line(procs.log_dir / (name + ".log"))
            if said:
                last_error = "%s; its log ends with: %s" % (exc, said)
                print("      its log ends with: %s" % said, flush=True)
    raise RuntimeError("%s did not start: %s (log in %s)" % (name, last_error, procs.log_dir))


def last_log_line(path):
    """The last line of a process's log that is not blank, or None."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in reversed(lines) if line.strip()), None)


class AdvertisingTansuBroker(TansuBroker):
    """A Tansu broker that advertises 127.0.0.1:``advertised_port`` instead of its own
    listener: a relay there, which rewrites nothing, keeps the clients behind it."""

    def __init__(self, advertised_port, **kwargs):
        super().__init__(**kwargs)
        self.advertised_port = advertised_port

    def start(self):
        url = "tcp://%s:%d" % (self.host, self.port)
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        env.update(self.env)
        with open(self.log_path or os.devnull, "ab") as out:
            self.proc = subprocess.Popen(
                [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url",
                 "tcp://%s:%d" % (self.host, self.advertised_port),
                 "--storage-engine", self.storage_url],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_die_with_parent)  # as TansuBroker starts its process
        wait_for_port(self.host, self.port, proc=self.proc)
        return self


def start_bare_relay(port, upstream, procs, name="bare-relay", tls=None):
    """``benchmarks/bare_relay.py`` on 127.0.0.1:``port`` in front of ``upstream`` (an
    AdvertisingTansuBroker advertising that port), with TLS towards the clients if ``tls``
    (``tls_files``) is given. Checks that a Metadata answer through it names the relay's own
    address, so that clients stay behind it."""
    argv = [sys.executable, str(BENCHMARKS / "bare_relay.py"),
            "--listen", "127.0.0.1:%d" % port, "--upstream", upstream.bootstrap]
    if tls is not None:
        argv += ["--ssl-cert", tls["cert"], "--ssl-key", tls["key"]]
    proc = procs.spawn(name, argv, proxy=True)
    bootstrap = "127.0.0.1:%d" % port
    try:
        wait_for_port("127.0.0.1", port, timeout=20, proc=proc)
        cafile = tls["ca"] if tls is not None else None
        seen = node_address("127.0.0.1", port, cafile=cafile)
        if seen != ("127.0.0.1", port):
            raise RuntimeError("Metadata through the relay on port %d names node %d at %s:%d: "
                               "clients would leave the relay" % (port, TANSU_NODE_ID, *seen))
    except Exception as exc:
        procs.stop(proc)
        said = last_log_line(procs.log_dir / (name + ".log"))
        raise RuntimeError("%s did not start on port %d: %s%s" % (
            name, port, exc, "; its log ends with: %s" % said if said else "")) from None
    # the plain and the TLS relay take turns on one port
    if tls is not None:
        CLIENT_TLS[bootstrap] = tls["ca"]
    else:
        CLIENT_TLS.pop(bootstrap, None)
    return Endpoint(name, bootstrap, proc)


def start_tansu_proxy(broker, procs):
    """``tansu proxy``, a pass-through proxy written in Rust, in front of ``broker``."""
    port = free_port()
    url = "tcp://127.0.0.1:%d" % port
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    proc = procs.spawn("tansu-proxy", [
        tansu_binary(), "proxy", "--listener-url", url, "--advertised-listener-url", url,
        "--origin-url", "tcp://%s" % broker.bootstrap,
    ], env=env, proxy=True)
    wait_for_port("127.0.0.1", port, timeout=20, proc=proc)
    metadata_probe("127.0.0.1", port)
    return Endpoint("tansu-proxy", "127.0.0.1:%d" % port, proc)


def tls_files(directory):
    """A CA and a certificate for 127.0.0.1 signed by it (PEM files in ``directory``),
    made once per directory: {"ca", "cert", "key"}."""
    directory = Path(directory)
    files = {"ca": str(directory / "ca.pem"), "cert": str(directory / "server.pem"),
             "key": str(directory / "server-key.pem")}
    if not Path(files["ca"]).exists():
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1")
        ca.cert_pem.write_to_path(files["ca"])
        server.private_key_pem.write_to_path(files["key"])
        server.cert_chain_pems[0].write_to_path(files["cert"])
        for pem in server.cert_chain_pems[1:]:
            pem.write_to_path(files["cert"], append=True)
    return files


def create_topic(bootstrap, name, partitions=1):
    """A topic on the Tansu broker at ``bootstrap``."""
    subprocess.run([tansu_binary(), "topic", "create", "--broker", "tcp://%s" % bootstrap,
                    "--partitions", str(partitions), name], check=True, capture_output=True,
                   timeout=30)


def delete_topic(bootstrap, name):
    """Delete a topic (keeps an in-memory broker small); errors are ignored."""
    subprocess.run([tansu_binary(), "topic", "delete", "--broker", "tcp://%s" % bootstrap,
                    name], capture_output=True, timeout=10)


def admin_get(port, path="/metrics", timeout=5):
    """The text kthrottle's admin endpoint on ``port`` answers for ``path``."""
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
        return r.read().decode()


def metric_sum(text, name):
    """Sum of every sample of metric ``name`` (with or without labels) in a Prometheus text
    page; a full ``name{labels}`` matches that one sample. None if absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


# --------------------------------------------------------------------------- raw Kafka


class LoginFailed(Exception):
    """A SASL exchange refused, or answered out of order."""


def _recv_exact(sock, n):
    from kthrottle.kafka_kit import _read_exactly

    return _read_exactly(sock, n)


def metadata_probe(host, port, timeout=10.0, cafile=None, all_topics=True,
                   client_id=b"kthrottle-bench"):
    """Send one Metadata v1 request and return the response (correlation id first).

    kthrottle opens its per-node listener only once a Metadata response has passed through
    it; this makes that happen before the clients under test connect."""
    body = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id
    body += struct.pack(">i", -1 if all_topics else 0)
    with socket.create_connection((host, port), timeout=timeout) as plain:
        sock = plain
        if cafile is not None:
            sock = ssl.create_default_context(cafile=cafile).wrap_socket(
                plain, server_hostname=host)
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv_exact(sock, 4))[0]
        return _recv_exact(sock, size)


def node_address(host, port, node_id=TANSU_NODE_ID, timeout=10.0, cafile=None):
    """The (host, port) that a Metadata answer from host:port (over TLS with ``cafile``)
    gives node ``node_id``."""
    from kafka.protocol.metadata import MetadataResponse

    answer = MetadataResponse[1].decode(metadata_probe(host, port, timeout, cafile=cafile,
                                                       all_topics=False)[4:])
    for b in answer.brokers:
        if b.node_id == node_id:
            return b.host, b.port
    raise RuntimeError("no node %d in the Metadata answer of %s:%d" % (node_id, host, port))


def frame_of(request, correlation_id, client_id):
    """A kafka-python request object as one framed request (header v1)."""
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


async def read_frame(reader):
    """One response frame (correlation id first); IncompleteReadError on a close."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    return await reader.readexactly(size)


async def call(reader, writer, request, correlation_id, response_type,
               client_id="kthrottle-bench"):
    """Send ``request`` and decode its answer (response header v0: the correlation id)."""
    writer.write(frame_of(request, correlation_id, client_id))
    frame = await read_frame(reader)
    got = int.from_bytes(frame[:4], "big")
    if got != correlation_id:
        raise LoginFailed("correlation id %d, expected %d" % (got, correlation_id))
    return response_type.decode(frame[4:])


def sasl_types():
    """kafka-python's (SaslHandshakeRequest, SaslHandshakeResponse, SaslAuthenticateRequest,
    SaslAuthenticateResponse)."""
    import warnings

    with warnings.catch_warnings():  # kafka.protocol warns about its own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from kafka.protocol.sasl import (SaslAuthenticateRequest, SaslAuthenticateResponse,
                                         SaslHandshakeRequest, SaslHandshakeResponse)
    return SaslHandshakeRequest, SaslHandshakeResponse, SaslAuthenticateRequest, \
        SaslAuthenticateResponse


async def sasl_login(reader, writer, mechanism, user, password, first_correlation=1,
                     client_id="kthrottle-bench"):
    """SaslHandshake v1 and SaslAuthenticate v1 on an open connection: one round for PLAIN,
    two for SCRAM (the server's signature is checked). Raises LoginFailed if refused."""
    from scramp import ScramClient

    hs_req, hs_resp, auth_req, auth_resp = sasl_types()
    answer = await call(reader, writer, hs_req[1](mechanism=mechanism), first_correlation,
                        hs_resp[1], client_id)
    if answer.error_code:
        raise LoginFailed("SaslHandshake error %d" % answer.error_code)

    async def authenticate(token, correlation_id):
        answer = await call(reader, writer, auth_req[1](auth_bytes=token), correlation_id,
                            auth_resp[1], client_id)
        if answer.error_code:
            raise LoginFailed("SaslAuthenticate error %d: %s" % (answer.error_code,
                                                                 answer.error_message))
        return bytes(answer.auth_bytes).decode()

    if mechanism == "PLAIN":
        await authenticate(b"\0%s\0%s" % (user.encode(), password.encode()),
                           first_correlation + 1)
        return
    scram = ScramClient([mechanism], user, password)
    scram.set_server_first(await authenticate(scram.get_client_first().encode(),
                                              first_correlation + 1))
    scram.set_server_final(await authenticate(scram.get_client_final().encode(),
                                              first_correlation + 2))


def cache_client_pbkdf2():
    """Let SCRAM clients of this process run their PBKDF2 once per (password, salt,
    iterations), as a client keeping its salted password does."""
    from functools import lru_cache

    import scramp.core

    pbkdf2 = lru_cache(maxsize=16)(scramp.core.hi)
    scramp.core.hi = lambda hf, password, salt, i: pbkdf2(hf, password, salt, int(i))


# --------------------------------------------------------------------------- event loops


def loop_factory():
    """uvloop's loop factory, or None (asyncio's default) when it is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def new_runner():
    return asyncio.Runner(loop_factory=loop_factory())


def worker_signals():
    """In a forked worker: the parent handles Ctrl-C and stops us with SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Workers:
    """Forked load-generator processes. ``add(target, *args)`` calls
    ``target(*args, go, results)`` in a new process, which puts "ready" on ``results``,
    takes its start times from ``go`` and puts its result on ``results``."""

    def __init__(self):
        self.go, self.results = MP.Queue(), MP.Queue()
        self.procs = []

    def add(self, target, *args):
        proc = MP.Process(target=target, args=(*args, self.go, self.results), daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        for _ in self.procs:
            got = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
            if got != "ready":
                raise RuntimeError("a worker failed before it was ready: %r" % (got,))

    def start(self, *times):
        for _ in self.procs:
            self.go.put(times)

    def collect(self, timeout):
        """One result per worker, in the order they arrive."""
        deadline = time.monotonic() + timeout
        return [self.results.get(timeout=max(1.0, deadline - time.monotonic()))
                for _ in self.procs]

    def stop(self):
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


# --------------------------------------------------------------------------- CPU and memory


def cpu_seconds(proc, children=False):
    """User + system CPU seconds of a psutil.Process (or PID), None if it is gone."""
    try:
        if not isinstance(proc, psutil.Process):
            proc = psutil.Process(proc)
        t = proc.cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)


def process_cpu_seconds(proc):
    """User + system CPU seconds of a whole process (every thread, those gone included), to
    the nanosecond where the kernel allows (Linux: the process's CPU clock) rather than in
    the 10 ms ticks of /proc/PID/stat; None if it is gone. Children are not included."""
    pid = proc.pid if isinstance(proc, psutil.Process) else proc
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # clock_getcpuclockid(pid): CPUCLOCK_SCHED
    except OSError:
        pass
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def tree_cpu_seconds(proc):
    """CPU seconds of a process and all its descendants (a supervisor and its workers),
    None if the process is gone. Each live process counts its own time and that of the
    children it has reaped (in ticks), so a worker that exits between two readings is still
    counted, by whoever reaped it (unless it is reaped during this reading)."""
    try:
        if not isinstance(proc, psutil.Process):
            proc = psutil.Process(proc)
        tree = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for p in tree:
        own = process_cpu_seconds(p)
        try:
            t = p.cpu_times()
            reaped = t.children_user + t.children_system
        except psutil.Error:
            own = None
        if own is None:
            if p is proc:
                return None
            continue  # gone since it was listed: its reaper has its time
        total += own + reaped
    return total


def tree_rss(proc):
    """Resident bytes of a process and its descendants (pages they share count once per
    process), None if the process is gone."""
    try:
        if not isinstance(proc, psutil.Process):
            proc = psutil.Process(proc)
        tree = [proc] + proc.children(recursive=True)
        total = proc.memory_info().rss
    except psutil.Error:
        return None
    for p in tree[1:]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class CpuSampler:
    """psutil readings of named processes ({name: pid})."""

    def __init__(self, pids):
        self.procs = {}
        for name, pid in pids.items():
            try:
                self.procs[name] = psutil.Process(pid)
            except psutil.Error:
                pass
        self.last = {name: (cpu_seconds(p), time.monotonic()) for name, p in self.procs.items()}

    def cpu_seconds(self):
        return {name: cpu_seconds(p) for name, p in self.procs.items()}

    def cpu_percent(self):
        """CPU % of each process since the previous call."""
        out, now = {}, time.monotonic()
        for name, p in self.procs.items():
            cpu = cpu_seconds(p)
            before, t0 = self.last[name]
            if cpu is not None and before is not None and now > t0:
                out[name] = (cpu - before) / (now - t0) * 100
            self.last[name] = (cpu, now)
        return out

    def memory(self, name="proxy"):
        """(RSS bytes, open file descriptors) of one process."""
        p = self.procs[name]
        return p.memory_info().rss, p.num_fds()


def machine_cpu():
    """(busy, total) CPU seconds of all cores since boot; idle and iowait are not busy."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle, sum(t)


def busy_percent(before, after):
    """% of all cores' time busy between two machine_cpu() readings."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else None


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values, q):
    """Linear-interpolated percentile, q in [0, 100], of an already sorted list."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def rank_percentile(sorted_values, q):
    """The value at rank int(q/100 * n) of an already sorted list (no interpolation)."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q / 100.0 * len(sorted_values)))]


def median(values):
    """Median of the values that are not None, or None."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values, spec, unit=""):
    """'0.97x (0.95x to 1.01x)': median and range of already sorted values."""
    if not values:
        return None
    text = format(statistics.median(values), spec) + unit
    if len(values) > 1:
        text += " (%s%s to %s%s)" % (format(values[0], spec), unit, format(values[-1], spec), unit)
    return text


# --------------------------------------------------------------------------- reporting


def fmt(value, spec=".1f", missing="-"):
    return missing if value is None else format(value, spec)


def markdown_table(headers, rows, align=None):
    """Lines of a Markdown table; ``align`` has one "l" or "r" per column (default: the
    first column left, the others right). A None cell shows as "-"."""
    align = align or "l" + "r" * (len(headers) - 1)
    lines = ["| %s |" % " | ".join(headers),
             "|%s|" % "|".join("---:" if a == "r" else "---" for a in align)]
    for row in rows:
        lines.append("| %s |" % " | ".join("-" if c is None else str(c) for c in row))
    return lines


def command_line(script, argv=None):
    """How this run was started: "python benchmarks/SCRIPT.py ARGS"."""
    argv = sys.argv[1:] if argv is None else argv
    return "python benchmarks/%s.py%s" % (script, " " + shlex.join(argv) if argv else "")


def settings_of(args, drop=()):
    """The parsed flags as JSON-ready values (paths as text)."""
    return {k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v)
            for k, v in vars(args).items() if k not in drop}


def write_json(path, data):
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def plot(path, draw):
    """Draw a figure with ``draw(plt)`` (it returns the figure) and save it as ``path``.
    Without matplotlib (the bench extra) this says so and returns False."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (the bench extra): no %s" % Path(path).name)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(output_dir, name, markdown=None, data=None, draw=None):
    """NAME.md, NAME.json and NAME.png (from ``draw``, see ``plot``) in ``output_dir``,
    each only if given; prints and returns the names written."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if markdown is not None:
        (out / (name + ".md")).write_text(markdown)
        written.append(name + ".md")
    if data is not None:
        write_json(out / (name + ".json"), data)
        written.append(name + ".json")
    if draw is not None and plot(out / (name + ".png"), draw):
        written.append(name + ".png")
    print("wrote %s in %s" % (", ".join(written) or "nothing", out))
    return written


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def git_describe(repo=REPO):
    """HEAD of the checkout ``repo``, with "-dirty" if its kthrottle/ has local edits."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kthrottle"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def machine_facts():
    """The machine, the code and the versions a result depends on."""
    try:
        tansu = subprocess.run([tansu_binary(), "--version"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except Exception:
        tansu = "unknown"
    try:
        import uvloop
        loop_name = "uvloop " + uvloop.__version__
    except ImportError:
        loop_name = "asyncio default loop"
    import aiokafka
    try:
        import confluent_kafka
        ck_version, librdkafka = confluent_kafka.__version__, confluent_kafka.libversion()[0]
    except ImportError:
        ck_version = librdkafka = None
    return {
        "kthrottle_commit": git_describe(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "aiokafka": aiokafka.__version__,
        "confluent_kafka": ck_version,
        "librdkafka": librdkafka,
        "client_loop": loop_name,
        "tansu": tansu,
    }


# --------------------------------------------------------------------------- flags


def parser(description, raw=False):
    """An ArgumentParser showing defaults (``raw``: keeping the description's layout)."""
    return argparse.ArgumentParser(
        description=description,
        formatter_class=(argparse.RawDescriptionHelpFormatter if raw
                         else argparse.ArgumentDefaultsHelpFormatter))


def add_flags(p, flags):
    """``flags``: (flag, type, default, help) each, as a table."""
    for flag, kind, default, text in flags:
        p.add_argument(flag, type=kind, default=default, help=text)


def fresh_run_dir(name, base=None):
    """A new, empty directory for one run's results: RUNS/NAME-DATE-TIME (-2, -3, ...
    when that is taken)."""
    base = Path(base or RUNS)
    base.mkdir(parents=True, exist_ok=True)
    stem = "%s-%s" % (name, time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 1000):
        path = base / (stem if n == 1 else "%s-%d" % (stem, n))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError("no fresh directory under %s" % base)


def add_output_dir(p, help="where the results are written"):
    """--output-dir; not given, the script writes into a new directory under
    benchmarks/runs/ (``output_dir``), never over the committed results."""
    p.add_argument("--output-dir", type=Path, default=argparse.SUPPRESS,  # no "(default: None)"
                   help="%s (default: a new directory under benchmarks/runs/, which git "
                   "ignores; --output-dir benchmarks/results replaces the committed results)"
                   % help)


def output_dir(args, name):
    """Where this run writes: ``args.output_dir`` (--output-dir) if given, else a fresh
    run directory for ``name`` (``fresh_run_dir``); made, said, and set as
    ``args.output_dir``."""
    given = getattr(args, "output_dir", None)
    out = Path(given) if given is not None else fresh_run_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    print("results will be written in %s" % out, flush=True)
    args.output_dir = out
    return out


def add_rounds(p, default=3, help="how many times every measurement is made"):
    p.add_argument("--rounds", type=int, default=default, help=help)


def add_seed(p, default=1, help="seed of the random choices, for repeatable runs"):
    p.add_argument("--seed", type=int, default=default, help=help)


def names(text):
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [c.strip() for c in text.split(",") if c.strip()]


# --------------------------------------------------------------------------- client runners
#
# The produce/consume loops below take ``load``, any object with: records, record_size,
# partitions, linger_ms, batch_size, max_in_flight (throughput); rate, latency_seconds
# (fixed-rate latency). aiokafka's are coroutines; confluent-kafka's are blocking, take a
# threading.Event ``stop`` last, and are awaited through ``in_thread``.


def aiokafka_security(bootstrap):
    cafile = CLIENT_TLS.get(bootstrap)
    if cafile is None:
        return {}
    from aiokafka.helpers import create_ssl_context

    return {"security_protocol": "SSL", "ssl_context": create_ssl_context(cafile=cafile)}


def ck_security(bootstrap):
    cafile = CLIENT_TLS.get(bootstrap)
    if cafile is None:
        return {}
    return {"security.protocol": "SSL", "ssl.ca.location": cafile}


def aio_producer(bootstrap, load, linger_ms, **extra):
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=linger_ms,
        max_batch_size=load.batch_size, request_timeout_ms=30000,
        **aiokafka_security(bootstrap), **extra)


def aio_consumer(bootstrap, **extra):
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", fetch_max_wait_ms=100,
        fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=8 * 1024 * 1024,
        request_timeout_ms=30000, **aiokafka_security(bootstrap), **extra)


async def aio_warm_up(producer, topic, value, partitions):
    """One acknowledged record per partition: connections and metadata are in place."""
    futures = [await producer.send(topic, value, partition=p) for p in range(partitions)]
    await asyncio.gather(*futures)


async def aio_produce_throughput(bootstrap, topic, load):
    """``load.records`` records as fast as possible. Returns seconds."""
    value = os.urandom(load.record_size)
    producer = aio_producer(bootstrap, load, load.linger_ms)
    await producer.start()
    try:
        await aio_warm_up(producer, topic, value, load.partitions)
        in_flight = deque()
        start = time.perf_counter()
        for _ in range(load.records):
            in_flight.append(await producer.send(topic, value))
            if len(in_flight) >= load.max_in_flight:
                await in_flight.popleft()
        await asyncio.gather(*in_flight)
        return time.perf_counter() - start
    finally:
        await producer.stop()


async def aio_read_from_start(consumer, topic, partitions, expected):
    """Read ``expected`` records of ``topic`` from offset 0. Returns (records, bytes)."""
    from aiokafka import TopicPartition

    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    records = nbytes = 0
    while records < expected:
        batches = await consumer.getmany(timeout_ms=1000, max_records=50_000)
        for batch in batches.values():
            records += len(batch)
            nbytes += sum(len(r.value) for r in batch)
    return records, nbytes


async def aio_consume_throughput(bootstrap, topic, load, expected):
    """Read ``expected`` records from the beginning. Returns (records, bytes, seconds)."""
    consumer = aio_consumer(bootstrap)
    await consumer.start()
    try:
        start = time.perf_counter()
        records, nbytes = await aio_read_from_start(consumer, topic, load.partitions, expected)
        return records, nbytes, time.perf_counter() - start
    finally:
        await consumer.stop()


async def aio_produce_latency(bootstrap, topic, load):
    """``load.rate`` records/s for ``load.latency_seconds``, linger 0.

    Returns (sorted latencies in ms, achieved send rate, sends more than 5 ms late)."""
    value = os.urandom(load.record_size)
    producer = aio_producer(bootstrap, load, linger_ms=0)
    await producer.start()
    latencies = []

    def on_ack(sent_at, fut):
        if not fut.cancelled() and fut.exception() is None:
            latencies.append((time.perf_counter() - sent_at) * 1000.0)

    try:
        await aio_warm_up(producer, topic, value, load.partitions)
        loop = asyncio.get_running_loop()
        total = int(load.rate * load.latency_seconds)
        interval = 1.0 / load.rate
        futures = []
        late = 0
        t0 = loop.time()
        for i in range(total):
            delay = t0 + i * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1
            sent_at = time.perf_counter()
            fut = await producer.send(topic, value)
            fut.add_done_callback(lambda f, t=sent_at: on_ack(t, f))
            futures.append(fut)
        send_seconds = loop.time() - t0
        await asyncio.gather(*futures)
        await asyncio.sleep(0)  # let the last done-callbacks run
        return sorted(latencies), total / send_seconds, late
    finally:
        await producer.stop()


class Abandoned(Exception):
    """A blocking phase's thread was told to stop (timeout or Ctrl-C)."""


_THREADS = {}  # thread -> its stop event, while a phase runs in it


async def in_thread(fn, *args):
    """Run blocking ``fn(*args, stop)`` in a thread. If this is cancelled (phase timeout,
    Ctrl-C), ``stop`` is set and the thread is waited for, so no load outlives its phase."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    stop = threading.Event()
    box = {}

    def target():
        try:
            box["value"] = fn(*args, stop)
        except BaseException as exc:
            # the traceback's frames would keep the librdkafka client (and its threads) alive
            traceback.clear_frames(exc.__traceback__)
            box["error"] = exc
        finally:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:  # loop already closed
                pass

    thread = threading.Thread(target=target, name=getattr(fn, "__name__", "phase"), daemon=True)
    _THREADS[thread] = stop
    thread.start()
    try:
        await done.wait()
    except BaseException:
        stop_threads()
        raise
    finally:
        _THREADS.pop(thread, None)
    if "error" in box:
        raise box["error"]
    return box["value"]


def stop_threads(timeout=15.0):
    """Tell every phase thread still running to stop, and wait for them."""
    for stop in list(_THREADS.values()):
        stop.set()
    for thread in list(_THREADS):
        thread.join(timeout)


def check_stop(stop):
    if stop.is_set():
        raise Abandoned("stopped")


def ck_common(bootstrap, errors, debug_logger=None):
    conf = {
        "bootstrap.servers": bootstrap,
        "socket.nagle.disable": True,  # asyncio (aiokafka) sets TCP_NODELAY too
        "log.connection.close": False,  # idle connections closed by Tansu are not news
        "error_cb": errors.append,
        **ck_security(bootstrap),
    }
    if debug_logger is not None:
        conf.update({"debug": "protocol,feature", "logger": debug_logger})
    return conf


def ck_producer(bootstrap, load, linger_ms, errors, debug_logger=None, conf=None):
    """acks=1, no idempotence, no compression; ``conf`` overrides any setting."""
    from confluent_kafka import Producer
    return Producer({
        **ck_common(bootstrap, errors, debug_logger),
        "acks": 1, "linger.ms": linger_ms, "batch.size": load.batch_size,
        "queue.buffering.max.messages": load.max_in_flight,  # BufferError beyond that
        "enable.idempotence": False, "compression.type": "none",
        "request.timeout.ms": 30000, **(conf or {}),
    })


def ck_consumer(bootstrap, errors, debug_logger=None):
    """A fresh group (nothing committed), to be assign()ed: subscribe() would wait ~20 s
    for Tansu's rebalance."""
    from confluent_kafka import Consumer
    return Consumer({
        **ck_common(bootstrap, errors, debug_logger),
        "group.id": "kthrottle-bench-%s" % uuid.uuid4().hex,
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "fetch.wait.max.ms": 100, "fetch.max.bytes": 64 * 1024 * 1024,
        "max.partition.fetch.bytes": 8 * 1024 * 1024,
    })


class Acks:
    """Delivery callback counting acknowledgements and failures."""

    def __init__(self):
        self.ok = 0
        self.failed = []

    def __call__(self, err, msg):
        if err is None:
            self.ok += 1
        else:
            self.failed.append(err)

    def check(self, expected, errors):
        if self.failed or self.ok != expected:
            raise RuntimeError("%d of %d records acknowledged; failures %s; client errors %s"
                               % (self.ok, expected, self.failed[:3], errors[:3]))


def ck_flush(producer, stop):
    """Wait until every message is acknowledged and its delivery callback has run."""
    while len(producer):
        check_stop(stop)
        producer.flush(0.2)


def ck_close(producer):
    if len(producer):  # abandoned: drop what is left, wait only for requests in transit
        producer.purge()
        producer.flush(2)


def ck_warm_up(producer, topic, value, partitions, stop, errors):
    acks = Acks()
    for p in range(partitions):
        producer.produce(topic, value, partition=p, on_delivery=acks)
    ck_flush(producer, stop)
    acks.check(partitions, errors)


def ck_read_from_start(consumer, topic, partitions, expected, stop):
    from confluent_kafka import KafkaException
    from confluent_kafka import TopicPartition
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    records = nbytes = 0
    while records < expected:
        check_stop(stop)
        # asks for exactly what is missing, so the last call returns as soon as it is there
        for msg in consumer.consume(min(expected - records, 10_000), 0.5):
            if msg.error() is not None:
                raise KafkaException(msg.error())
            records += 1
            nbytes += len(msg.value())
    return records, nbytes


def ck_produce_throughput(bootstrap, topic, load, stop):
    """``load.records`` records as fast as possible. Returns seconds."""
    errors = []
    value = os.urandom(load.record_size)
    producer = ck_producer(bootstrap, load, load.linger_ms, errors)
    try:
        ck_warm_up(producer, topic, value, load.partitions, stop, errors)
        acks = Acks()
        start = time.perf_counter()
        for i in range(load.records):
            while True:
                try:
                    producer.produce(topic, value, on_delivery=acks)
                    break
                except BufferError:  # max_in_flight unacknowledged: serve callbacks
                    check_stop(stop)
                    producer.poll(0.05)
            if i % 1000 == 999:
                producer.poll(0)
        ck_flush(producer, stop)
        seconds = time.perf_counter() - start
        acks.check(load.records, errors)
        return seconds
    finally:
        ck_close(producer)


def ck_consume_throughput(bootstrap, topic, load, expected, stop):
    """Read ``expected`` records from the beginning. Returns (records, bytes, seconds)."""
    errors = []
    consumer = ck_consumer(bootstrap, errors)
    try:
        start = time.perf_counter()
        records, nbytes = ck_read_from_start(consumer, topic, load.partitions, expected, stop)
        return records, nbytes, time.perf_counter() - start
    finally:
        consumer.close()


def ck_produce_latency(bootstrap, topic, load, stop, conf=None):
    """Fixed-rate sends from this thread (``load.rate`` records/s for
    ``load.latency_seconds``, linger 0); a second thread polls, so that delivery callbacks
    run as soon as librdkafka has the acknowledgement. ``conf`` overrides producer settings.

    Returns (sorted latencies in ms, achieved send rate, sends more than 5 ms late)."""
    errors = []
    value = os.urandom(load.record_size)
    producer = ck_producer(bootstrap, load, 0, errors, conf=conf)
    latencies, failed = [], []
    polling = threading.Event()

    def on_ack(sent_at):
        def callback(err, msg):
            if err is None:
                latencies.append((time.perf_counter() - sent_at) * 1000.0)
            else:
                failed.append(err)
        return callback

    def poller():
        while polling.is_set():
            producer.poll(0.05)

    poll_thread = threading.Thread(target=poller, name="ck-poller", daemon=True)
    try:
        ck_warm_up(producer, topic, value, load.partitions, stop, errors)
        total = int(load.rate * load.latency_seconds)
        interval = 1.0 / load.rate
        late = 0
        polling.set()
        poll_thread.start()
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -0.005:
                late += 1
            if i % 100 == 0:
                check_stop(stop)
            sent_at = time.perf_counter()
            producer.produce(topic, value, on_delivery=on_ack(sent_at))
        send_seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while len(producer) and time.monotonic() < deadline:  # the poller drains it
            check_stop(stop)
            time.sleep(0.01)
        polling.clear()
        poll_thread.join(5)
        ck_flush(producer, stop)
        if failed:
            raise RuntimeError("%d records failed, first %s" % (len(failed), failed[0]))
        return sorted(latencies), total / send_seconds, late
    finally:
        polling.clear()
        if poll_thread.is_alive():
            poll_thread.join(5)
        ck_close(producer)


# --- added for B2's benchmarks ---


class gc_paused:
    """``with gc_paused():`` collects once, then keeps the garbage collector off, so that a
    timed loop does not pay for garbage made elsewhere."""

    def __enter__(self):
        import gc

        gc.collect()
        gc.disable()
        return self

    def __exit__(self, *exc):
        import gc

        gc.enable()
        return False


def zk_client(procs, hosts, timeout=10):
    """A started kazoo client of ``hosts``, stopped and closed with ``procs``."""
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=hosts)
    zk.start(timeout=timeout)
    procs.on_stop(lambda: (zk.stop(), zk.close()))
    return zk


def write_znode(zk, path, data):
    """Set ``path`` to ``data``, creating it (and its parents) if it does not exist."""
    if zk.exists(path):
        zk.set(path, data)
    else:
        zk.create(path, data, makepath=True)


def storage_snapshot(consumed_gb, node_id=TANSU_NODE_ID):
    """A cluster-state snapshot as the Spark job writes it (JSON bytes): one broker with one
    100 GB volume holding ``consumed_gb``, soft limit 40% free, hard limit 20% free (so 10 GB
    is OPEN, 85 GB is past the hard limit)."""
    from kthrottle.policy.storage import BrokerReport, VolumeReport, cluster_snapshot, parse_limit

    now = time.time()
    report = BrokerReport(node_id, now, parse_limit("MinFreePercentage:40"),
                          parse_limit("MinFreePercentage:20"),
                          (VolumeReport("sda1", 100 * 10 ** 9, int(consumed_gb * 10 ** 9)),))
    return json.dumps(cluster_snapshot({node_id: report}, [node_id], {}, now, 60)).encode()


def spawn_kthrottle(procs, name, *argv, src=None):
    """``python -m kthrottle ARGV`` (a command other than ``proxy``, e.g. ``spark-sync``) from
    ``src`` (this checkout by default), started through ``procs``."""
    tree = src if isinstance(src, SourceTree) else SourceTree(src or REPO)
    return procs.spawn(name, [sys.executable, "-m", "kthrottle", *argv], env=tree.env,
                       cwd=tree.src)


def line_chart(lines, xlabel, ylabel, title=None, log_x=False, band=None, marker=None,
               figsize=(6.5, 3.5)):
    """A ``draw`` (for ``plot`` / ``write_results``) of one chart of ``lines``, each
    (label, xs, ys); ``band`` (low, high, label) shades that range of y."""
    def draw(plt):
        fig, ax = plt.subplots(figsize=figsize)
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker=marker, label=label)
        if band is not None:
            ax.axhspan(band[0], band[1], color="grey", alpha=0.2, label=band[2])
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        return fig
    return draw


def flag_parser(description, flags, raw=False, output_help="where the results are written"):
    """``parser(description, raw)`` with ``flags``, each (flag, type, default, help) (type
    None: the text as given), and --output-dir."""
    p = parser(description, raw)
    add_flags(p, flags)
    add_output_dir(p, help=output_help)
    return p


def int_list(text):
    """A flag's "1,2,3" as [1, 2, 3] (an argparse type)."""
    return [int(x) for x in text.split(",") if x.strip()]


def spark_standalone(procs, workers=2, worker_cores=1, worker_memory="1g", work_dir=None):
    """A Spark standalone master and ``workers`` workers from the PySpark install
    (``spark-class``), bound to 127.0.0.1 on free ports, each stopped by its PID with the
    run's processes; returns the master's URL once every worker has registered."""
    import pyspark

    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="spark-standalone-"))
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(work_dir),
               SPARK_WORKER_DIR=str(work_dir / "work"), PYSPARK_PYTHON=sys.executable,
               SPARK_NO_DAEMONIZE="1")
    port, ui = free_port(), free_port()
    procs.spawn("spark-master", [spark_class, "org.apache.spark.deploy.master.Master",
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--webui-port", str(ui)], env=env)
    wait_for_port("127.0.0.1", port, timeout=60)
    wait_for_port("127.0.0.1", ui, timeout=60)
    url = "spark://127.0.0.1:%d" % port
    for n in range(workers):
        procs.spawn("spark-worker-%d" % n, [
            spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
            "--port", str(free_port()), "--webui-port", str(free_port()),
            "--cores", str(worker_cores), "--memory", worker_memory,
            "--work-dir", str(work_dir / ("worker-%d" % n)), url], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/json/" % ui, timeout=5) as answer:
                state = json.load(answer)
            if sum(w.get("state") == "ALIVE" for w in state.get("workers", ())) >= workers:
                return url
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the Spark workers did not register with %s within 60 s" % url)
