"""The proxy and its open-files limit. Each client connection holds two descriptors (its own
and its broker connection's), so the proxy raises its soft limit to the hard one at start;
and a client whose broker connection finds no descriptor left is refused for that reason
alone (``open_files``), while the listener goes on serving: the brokers are not at fault."""
import os
import resource
import socket
import struct
import time
import urllib.request

import pytest

from kthrottle.processes import free_port
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

SOFT, HARD = 64, 120


def limited():  # in the proxy's child process, before it runs
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))


def limits_of(pid):
    for line in open("/proc/%d/limits" % pid):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line in /proc/%d/limits" % pid)


def open_files(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def api_versions(sock):
    """One ApiVersions v0 exchange; the error code of the answer."""
    body = struct.pack(">hhih", 18, 0, 7, 4) + b"test"
    sock.sendall(struct.pack(">i", len(body)) + body)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed by the proxy")
        head += chunk
    size = struct.unpack(">i", head)[0]
    got = b""
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        if not chunk:
            raise ConnectionError("closed by the proxy")
        got += chunk
    return struct.unpack(">h", got[4:6])[0]


def refused(admin, reason):
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin, timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith("kthrottle_connections_refused_total{") and \
                'reason="%s"' % reason in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_without_a_descriptor_left_is_refused_and_the_listener_serves_on(
        broker, tmp_path):
    admin = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--admin-listen", "127.0.0.1:%d" % admin], preexec_fn=limited)
    proxy.start()
    clients = []
    try:
        pid = proxy.proc.pid
        assert limits_of(pid) == (HARD, HARD)  # raised at start
        first = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        clients.append(first)
        assert api_versions(first) == 0
        # clients until one descriptor is left: the next one's accept takes it, and its
        # broker connection finds none
        deadline = time.monotonic() + 60
        while open_files(pid) < HARD - 1:
            assert time.monotonic() < deadline, "the proxy holds %d files" % open_files(pid)
            c = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            clients.append(c)
            assert api_versions(c) == 0
        last = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        clients.append(last)
        with pytest.raises(OSError):  # closed: refused, never left hanging
            api_versions(last)
        # descriptors free again (the admin endpoint needs one too)
        for c in clients[1:6]:
            c.close()
        time.sleep(0.5)
        assert refused(admin, "open_files") >= 1
        assert refused(admin, "broker_unreachable") == 0
        assert "no file descriptor left for its broker connection" in proxy.log()
        # the listener still serves: a new client gets its answer
        again = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        clients.append(again)
        assert api_versions(again) == 0
        assert api_versions(first) == 0  # and the connections held meanwhile were kept
        assert proxy.alive()
    finally:
        for c in clients:
            c.close()
        proxy.stop()


def test_a_limit_with_no_room_for_max_connections_is_said_at_start():
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from kthrottle.proxy.limits import raise_open_files_limit\n"
            "print(raise_open_files_limit(%s))\n")
    for max_connections, warned in ((1000, True), (10, False), (None, False)):
        done = subprocess.run([sys.executable, "-c", code % max_connections], env=dict(
            os.environ, PYTHONPATH=os.getcwd()), preexec_fn=limited, capture_output=True,
            text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(HARD)
        assert ("leaves room for about 28 client connections, not max-connections=%s"
                % max_connections in done.stderr) is warned, done.stderr
        assert ("leaves room" in done.stderr) is warned, done.stderr
