"""A real standalone ZooKeeper (Debian's package) for the tests, on 127.0.0.1
and a free port, stopped by its own PID. ``scripts/test`` installs the package."""
import os
import subprocess
import time
from pathlib import Path

from kthrottle.embedded import _die_with_parent, free_port, stop_process, wait_for_port

JARS = ["/usr/share/java/zookeeper.jar", "/usr/share/java/slf4j-log4j12.jar",
        "/usr/share/java/log4j-1.2.jar"]
MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"


def available():
    return all(os.path.exists(j) for j in JARS)


class ZooKeeperServer:
    def __init__(self, workdir, heap="128m"):
        self.dir = Path(workdir)
        self.heap = heap  # -Xmx: a benchmark writing megabytes a cycle needs more
        self.port = free_port()
        self.proc = None

    @property
    def hosts(self):
        return "127.0.0.1:%d" % self.port

    def start(self):
        """Start (or start again, on the same port and data)."""
        data = self.dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "zoo.cfg"
        cfg.write_text(
            "tickTime=500\ninitLimit=10\nsyncLimit=5\n"
            "dataDir=%s\nclientPort=%d\nclientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\nmaxSessionTimeout=60000\n" % (data, self.port)
        )
        with open(self.dir / "zookeeper.log", "ab") as log:
            self.proc = subprocess.Popen(
                ["java", "-Xmx%s" % self.heap, "-Dzookeeper.log.dir=%s" % self.dir,
                 "-Dzookeeper.root.logger=WARN,CONSOLE",
                 "-cp", ":".join(["/etc/zookeeper/conf"] + JARS), MAIN, str(cfg)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        wait_for_port("127.0.0.1", self.port, timeout=30, proc=self.proc)
        self._wait_serving()
        return self

    def _wait_serving(self, timeout=20):
        """The port opens before the server takes sessions: ask it ("ruok"
        is not whitelisted by default, so connect a client)."""
        from kazoo.client import KazooClient

        deadline = time.monotonic() + timeout
        while True:
            zk = KazooClient(hosts=self.hosts, timeout=5)
            try:
                zk.start(timeout=5)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            finally:
                zk.stop()
                zk.close()

    def stop(self):
        stop_process(self.proc, grace=10.0)
        self.proc = None
