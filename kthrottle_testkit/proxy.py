"""``kthrottle proxy`` as a separate process, as users run it, on 127.0.0.1 and free ports."""
import os
import subprocess
import sys
import time
from pathlib import Path

from kthrottle.embedded import free_port, stop_process, wait_for_port

from kthrottle_testkit import BROKER_NODE_ID, ROOT


class ProxyProcess:
    """``kthrottle proxy`` as a separate process, as users run it."""

    def __init__(self, bootstrap, log_path, extra_args=(), node_id=BROKER_NODE_ID,
                 preexec_fn=None):
        """``preexec_fn``: run in the child before the proxy (e.g. to set its limits)."""
        self.preexec_fn = preexec_fn
        self.port = free_port()
        # the broker's node (Tansu's 111; Apache Kafka's node.id) is served on
        # node_port_base + node_id: make that a free port
        self.node_port = free_port()
        self.node_port_base = self.node_port - node_id
        self.bootstrap_upstream = bootstrap
        self.log_path = Path(log_path)
        self.extra_args = list(extra_args)
        self.proc = None

    @property
    def bootstrap(self):
        return "127.0.0.1:%d" % self.port

    @property
    def ports(self):
        return {self.port, self.node_port}

    def start(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", "proxy",
                 "--bootstrap-server", self.bootstrap_upstream,
                 "--listen", self.bootstrap,
                 "--node-port-base", str(self.node_port_base), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=self.preexec_fn,
            )
        # the bootstrap port listens (connections queue in the kernel) before
        # the admin endpoint is up: a test that reads /metrics waits for both
        for port in (self.port, self._admin_port()):
            if port is not None:
                wait_for_port("127.0.0.1", port, proc=self.proc)
        return self

    def _admin_port(self):
        args = self.extra_args
        for i, arg in enumerate(args):
            if arg == "--admin-listen" and i + 1 < len(args):
                return int(str(args[i + 1]).rpartition(":")[2])
            if str(arg).startswith("--admin-listen="):
                return int(str(arg).rpartition(":")[2].rpartition("=")[2])
        return None

    def log(self):
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            time.sleep(0.05)
        raise AssertionError("%r not in proxy log:\n%s" % (text, self.log()[-3000:]))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        stop_process(self.proc, grace=10)

    @classmethod
    def for_cluster(cls, cluster, tmp_path, args):
        """A proxy in front of every node of a kthrottle.kafka_kit.KafkaCluster (node N on
        node_port_base + N, free ports in a row), ``args`` given, and an admin endpoint:
        (the proxy started, the admin port)."""
        from kthrottle.kafka_kit import free_ports_in_a_row

        admin = free_port()
        nodes = list(cluster.nodes.values())
        extra = []
        for node in nodes[1:]:
            extra += ["--bootstrap-server", node.bootstrap]
        proxy = cls(nodes[0].bootstrap, tmp_path / "proxy.log", node_id=nodes[0].node_id,
                    extra_args=extra + [str(a) for a in args]
                    + ["--admin-listen", "127.0.0.1:%d" % admin])
        low, high = min(cluster.nodes), max(cluster.nodes)
        first = free_ports_in_a_row(high - low + 1)
        proxy.node_port_base = first - low
        proxy.node_port = first
        return proxy.start(), admin
