"""The key-derivation worker: one thread, at the lowest priority, that runs
the PBKDF2s of SASL logins off the event loop (Services.offload)."""
import asyncio
import logging

log = logging.getLogger("kthrottle.proxy")


class KeyDerivation:
    """``offload(fn, *args)``: run a key derivation (a PBKDF2: ms of CPU,
    the GIL released) in the one worker thread, off the event loop; an
    awaitable of its result. One thread bounds what failed logins can take
    to one core, and a connection waits for its turn at no cost. The thread
    is made when first needed."""

    def __init__(self):
        self._pool = None

    def __call__(self, fn, *args):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kthrottle-kdf",
                                            initializer=_lowest_priority)
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _lowest_priority():
    """The key-derivation worker yields the CPU to everything else (Linux
    takes a thread id for a process id here): logins that fail by the
    thousand then slow down each other, not the traffic."""
    import os
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as exc:
        log.debug("key-derivation worker keeps its priority: %s", exc)
