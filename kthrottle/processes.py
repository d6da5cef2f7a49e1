"""Child processes and ports of the local brokers (``embedded``, ``kafka_kit``):
a free port, a child that dies with its parent, a stop that escalates."""
import ctypes
import socket
import subprocess


def _die_with_parent():
    """Linux: the child gets SIGTERM when the process that started it dies,
    so a broker never outlives a proxy or test that was killed outright."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except OSError:
        pass


_PORTS_GIVEN = set()


def free_port(host="127.0.0.1"):
    """A port nothing listens on now, and one this process has not handed
    out before: the kernel may give the same free port to two binds in a
    row, and two servers told to use it would collide once both start."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def stop_process(proc, grace=5.0):
    """SIGTERM, then SIGKILL if ``proc`` is still there ``grace`` seconds later."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
