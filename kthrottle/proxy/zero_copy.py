"""--zero-copy: the rest of a large passed-through frame goes from one socket
to the other through a pipe with splice(2), without becoming Python bytes.

The adapter (``connection.py``) stops reading the source, waits until the
destination's write buffer is empty (nothing already written may be
overtaken), then hands a ``Splice`` the two sockets and the frame's remaining
length. The bytes move socket -> pipe -> socket in the kernel; the loop only
says when a socket is readable or writable, watched on duplicated descriptors
(an event loop refuses to watch a descriptor one of its transports owns).
"""
import errno
import fcntl
import logging
import os
import struct
import termios

log = logging.getLogger("kthrottle.proxy")

# Smallest remainder worth a splice: below this the usual read and write cost
# less than the pipe and the descriptors a splice needs.
MIN_BYTES = 64 * 1024

# Pipe capacity asked for (Linux's default pipe-max-size, the most an
# unprivileged process may ask): fewer splice calls per frame than the
# default 64 KiB.
PIPE_SIZE = 1 << 20

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_INT = struct.Struct("i")
_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)

# errors that say splice cannot join these descriptors (kernel, socket type)
_UNSUPPORTED = frozenset((errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF))

TO_BROKER = "to_broker"
TO_CLIENT = "to_client"


class ZeroCopy:
    """Per proxy: whether splice is used, and what it moved
    (kthrottle_zero_copy_bytes_total)."""

    def __init__(self, min_bytes=MIN_BYTES):
        self.min_bytes = min_bytes
        self.enabled = hasattr(os, "splice")
        self.bytes = {TO_BROKER: 0, TO_CLIENT: 0}  # moved so far, by direction
        if not self.enabled:
            log.info("--zero-copy: os.splice is not available here (Linux only, Python 3.10 "
                     "or later); every byte goes through the usual reads and writes")

    @classmethod
    def configured(cls, config):
        """The proxy's ZeroCopy, or None without --zero-copy."""
        if not getattr(config, "zero_copy", False):
            return None
        if config.tls_enabled:
            log.info("--zero-copy: clients connect with TLS, whose bytes must be decrypted "
                     "here; it applies to plaintext connections only")
        return cls()

    def unsupported(self, exc):
        """splice refused these descriptors: off for this process, said once."""
        if self.enabled:
            self.enabled = False
            log.info("--zero-copy: splice(2) refused the sockets (%s); every byte goes "
                     "through the usual reads and writes from now on", exc)


class Splice:
    """Moves ``nbytes`` from socket ``src_fd`` to socket ``dst_fd`` through a
    pipe; calls ``done(splice, error)`` once, when they are all written or
    on the first error (None: done). ``taken`` says how many left the
    source, ``moved`` how many reached the destination, ``failed`` which
    side an error came from ("source" or "destination").

    ``filled``: the bytes are first all taken into the pipe (a frame the
    destination may only see once whole), then ``filled(splice)`` is called
    and nothing is written until ``drain()``. Should the pipe fill up first
    (its pages hold less than their size), what it holds is read back:
    ``done`` is called with ``spilled`` set to those bytes, for the usual
    path to take on from. ``counts[key]`` grows by what is written, as it is
    (kthrottle_zero_copy_bytes_total)."""

    __slots__ = ("loop", "nbytes", "taken", "moved", "done", "failed", "filled", "spilled",
                 "counts", "key", "_src", "_dst", "_r", "_w", "_watching", "_writing")

    def __init__(self, loop, src_fd, dst_fd, nbytes, done, filled=None, counts=None, key=None):
        self.loop = loop
        self.counts = counts if counts is not None else {key: 0}
        self.key = key
        self.nbytes = nbytes
        self.taken = 0
        self.moved = 0
        self.done = done
        self.failed = None
        self.filled = filled
        self.spilled = None
        self._writing = filled is None
        self._watching = None  # the descriptor watched, its reader or writer
        fds = []
        try:
            self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            fds += (self._r, self._w)
            try:
                fcntl.fcntl(self._w, _F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:  # over the user's pipe pages: the default size works too
                if filled is not None:
                    raise
            if filled is not None and fcntl.fcntl(self._w, _F_GETPIPE_SZ) < nbytes:
                raise OSError(errno.EMSGSIZE, "the pipe cannot hold the whole frame")
            self._src = os.dup(src_fd)
            fds.append(self._src)
            self._dst = os.dup(dst_fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def start(self):
        self._step()

    def drain(self):
        """``filled``: now write them."""
        self._writing = True
        self._step()

    def cancel(self):
        """The connection is closing: stop, no callback."""
        if self.done is not None:
            self.done = None
            self._release()

    def _step(self):
        if self.done is None:
            return
        try:
            while True:
                in_pipe = self.taken - self.moved if self._writing else 0
                self.failed = "destination"
                while in_pipe:  # the pipe first: the source is read only into an empty pipe
                    try:
                        n = os.splice(self._r, self._dst, in_pipe, flags=_FLAGS)
                    except BlockingIOError:
                        self._watch(self._dst, False)
                        return
                    self.moved += n
                    self.counts[self.key] += n
                    in_pipe -= n
                left = self.nbytes - self.taken
                if not left:
                    if not self._writing:
                        self._unwatch()
                        self.filled(self)
                        return
                    self.failed = None
                    self._finish(None)
                    return
                self.failed = "source"
                try:
                    n = os.splice(self._src, self._w, left, flags=_FLAGS)
                except BlockingIOError:
                    if not self._writing and self._readable():
                        self._spill()  # the pipe is full, the socket is not empty
                        return
                    self._watch(self._src, True)
                    return
                if not n:
                    raise ConnectionResetError(errno.ECONNRESET, "closed with %d bytes of the "
                                               "frame still to come" % left)
                self.taken += n
        except OSError as exc:
            self._finish(exc)

    def _readable(self):
        got = fcntl.ioctl(self._src, termios.FIONREAD, b"\0\0\0\0")
        return _INT.unpack(got)[0] > 0

    def _spill(self):
        chunks = []
        left = self.taken
        while left:
            chunk = os.read(self._r, left)
            chunks.append(chunk)
            left -= len(chunk)
        self.spilled = b"".join(chunks)
        self._finish(None)

    def _watch(self, fd, reading):
        watching = (fd, reading)
        if self._watching == watching:
            return
        self._unwatch()
        if reading:
            self.loop.add_reader(fd, self._step)
        else:
            self.loop.add_writer(fd, self._step)
        self._watching = watching

    def _unwatch(self):
        if self._watching is not None:
            fd, reading = self._watching
            self._watching = None
            if reading:
                self.loop.remove_reader(fd)
            else:
                self.loop.remove_writer(fd)

    def _finish(self, error):
        done, self.done = self.done, None
        self._release()
        done(self, error)

    def _release(self):
        # no longer watched before closed: a closed duplicate would stay in
        # the loop's epoll set while the socket lives on
        self._unwatch()
        for fd in (self._src, self._dst, self._r, self._w):
            os.close(fd)


def unsupported_error(exc):
    """True when ``exc`` says splice cannot be used on these descriptors."""
    return isinstance(exc, OSError) and exc.errno in _UNSUPPORTED
