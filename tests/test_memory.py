"""The malloc thresholds the proxy process sets (kthrottle/proxy/memory.py)."""
import os
import subprocess
import sys
import textwrap

import pytest

from kthrottle_testkit import ROOT
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

# a fresh interpreter allocates a 1 MiB block and says how much of the
# memory malloc holds is mmapped (glibc's mallinfo2().hblkhd). memory.py is
# loaded on its own: importing the whole proxy first would leave free heap
# chunks a 1 MiB block could be cut from whatever the thresholds say.
PROBE = textwrap.dedent("""
    import ctypes, importlib.util, sys
    spec = importlib.util.spec_from_file_location("memory", sys.argv[2])
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    tune_allocator = memory.tune_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    tuned = tune_allocator() if sys.argv[1] == "tune" else None
    block = bytes(1 << 20)
    print(tuned, libc.mallinfo2().hblkhd)
""")


def probe(mode, **env):
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    environ.pop("GLIBC_TUNABLES", None)
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE, mode,
                          str(ROOT / "kthrottle" / "proxy" / "memory.py")], env=environ, check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    return out[0], int(out[1])


glibc = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                           reason="mallopt and mallinfo2 are glibc's")


@glibc
def test_a_block_the_size_of_a_large_read_comes_from_the_heap_once_tuned():
    tuned, mmapped = probe("leave")
    assert mmapped >= 1 << 20  # glibc's default: a fresh 1 MiB block is mmapped
    tuned, mmapped = probe("tune")
    assert tuned == "True"
    assert mmapped < 1 << 20


@glibc
def test_a_malloc_setting_in_glibc_tunables_is_left_as_it_is():
    tuned, mmapped = probe("tune", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert tuned == "False"
    assert mmapped >= 1 << 20


@glibc
def test_the_proxy_process_sets_them(broker, tmp_path):
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--log-level", "debug"]).start()
    try:
        proxy.wait_for_log("allocator: blocks under 4 MiB from the heap")
    finally:
        proxy.stop()
    assert not proxy.alive()
