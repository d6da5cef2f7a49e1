"""How the proxy process asks glibc's malloc to treat the buffers it churns.

Every read of a busy connection is a new bytes object of up to 256 KiB, freed
once written on. With glibc's defaults a block that size may be served by
mmap(2) and given back by munmap(2), or carved from the top of the heap that
free() then trims back to the kernel: either way the next read faults its
pages in anew (tens of page faults per read, several percent of the proxy's
CPU). Raising the two thresholds keeps such blocks on the heap and the freed
heap in the process, for the next read to reuse.

Nothing is changed when ``GLIBC_TUNABLES`` already sets a malloc tunable (the
operator's choice wins) or when the C library has no ``mallopt`` (musl has a
stub, macOS none).
"""
import ctypes
import logging
import os

log = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# blocks below this come from the heap (the reads, a gathered response)
MMAP_THRESHOLD = 4 * 1024 * 1024
# freed heap kept for reuse before it is given back to the kernel
TRIM_THRESHOLD = 64 * 1024 * 1024


def tune_allocator(environ=None):
    """Set the thresholds above; True when they were set."""
    environ = os.environ if environ is None else environ
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        log.debug("allocator: GLIBC_TUNABLES sets malloc itself; left as it says")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return False
    log.debug("allocator: blocks under %d MiB from the heap, up to %d MiB of freed heap kept",
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
