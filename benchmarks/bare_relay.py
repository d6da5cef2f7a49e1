#!/usr/bin/env python3
"""The floor a Python Kafka proxy can reach: a uvloop relay that copies bytes both ways and
parses nothing.

One listener, one upstream; every accepted connection gets its own connection to the
upstream, and what either side sends is written to the other as it arrives. It has what a
proxy cannot do without and nothing else: kthrottle's write-buffer marks and backpressure
(a side stops being read while the other side's write buffer is over the high mark),
TCP_NODELAY, the malloc thresholds kthrottle sets, and with ``--ssl-cert``/``--ssl-key`` TLS
towards the clients (the upstream side stays plaintext), as ``kthrottle proxy
--security-protocol SSL`` does. It rewrites no addresses: the broker behind it must advertise
the relay's address itself (Tansu's ``--advertised-listener-url``) for clients to stay behind
it.

    python benchmarks/bare_relay.py --listen 127.0.0.1:9093 --upstream 127.0.0.1:9092

``benchmarks/proxy_overhead.py`` measures kthrottle against it. SIGTERM or Ctrl-C closes
the listener and every connection, and it exits with status 0.
"""
import argparse
import asyncio
import signal
import socket
import ssl
import sys
from pathlib import Path

import uvloop

# kthrottle's marks (kthrottle/proxy/connection.py): a ~1 MiB Fetch response fits below them
WRITE_HIGH_WATER = 4 * 1024 * 1024
WRITE_LOW_WATER = 1024 * 1024


class Half(asyncio.Protocol):
    """One side of a relayed connection: what it reads goes to ``other``'s transport, and
    ``other`` is not read while this side's write buffer is over the high mark."""

    def __init__(self, live):
        self.live = live  # every open Half, closed on SIGTERM
        self.transport = None
        self.other = None

    def connection_made(self, transport):
        self.transport = transport
        self.live.add(self)
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # uvloop sets it on TCP transports already; kthrottle says it again
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # already closed: connection_lost follows
                pass

    def data_received(self, data):
        self.other.transport.write(data)

    def pause_writing(self):
        self.other.transport.pause_reading()

    def resume_writing(self):
        if not self.other.transport.is_closing():
            self.other.transport.resume_reading()

    def connection_lost(self, exc):
        self.live.discard(self)
        if self.other is not None:
            self.other.transport.close()  # after what is buffered for it has been written


class ClientHalf(Half):
    """The accepted side: connects to the upstream, keeping what the client sends until then."""

    def __init__(self, live, upstream):
        super().__init__(live)
        self.upstream = upstream
        self.early = []
        self.connecting = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self.connecting = asyncio.get_running_loop().create_task(self.connect())

    async def connect(self):
        loop = asyncio.get_running_loop()
        try:
            _, broker = await loop.create_connection(lambda: Half(self.live), *self.upstream)
        except OSError as exc:
            print("cannot reach %s:%d: %s" % (*self.upstream, exc), file=sys.stderr, flush=True)
            self.transport.close()
            return
        if self.transport.is_closing():
            broker.transport.close()
            return
        self.other, broker.other = broker, self
        for data in self.early:
            broker.transport.write(data)
        self.early = None

    def data_received(self, data):
        if self.other is None:
            self.early.append(data)
        else:
            self.other.transport.write(data)


def address(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError("expected HOST:PORT, got %r" % text)
    return host, int(port)


async def serve(args):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    context = None
    if args.ssl_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.ssl_cert, args.ssl_key)
    live = set()
    server = await loop.create_server(lambda: ClientHalf(live, args.upstream), *args.listen,
                                      ssl=context)
    await stop.wait()
    server.close()
    for half in list(live):
        half.transport.close()
    await server.wait_closed()


def main(argv=None):
    p = argparse.ArgumentParser(description="A relay that copies bytes between clients and "
                                "one upstream, parsing nothing (a reference for proxy costs).")
    p.add_argument("--listen", type=address, required=True, metavar="HOST:PORT")
    p.add_argument("--upstream", type=address, required=True, metavar="HOST:PORT")
    p.add_argument("--ssl-cert", metavar="FILE", help="serve TLS to clients with this "
                   "certificate (chain); the upstream side stays plaintext")
    p.add_argument("--ssl-key", metavar="FILE", help="its private key")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="leave glibc's malloc thresholds as they are; by default the relay "
                   "sets them as kthrottle does (kthrottle/proxy/memory.py), so that the two "
                   "differ only in what they do with the bytes")
    args = p.parse_args(argv)
    if bool(args.ssl_cert) != bool(args.ssl_key):
        p.error("--ssl-cert and --ssl-key go together")
    if not args.malloc_defaults:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's
        from kthrottle.proxy.memory import tune_allocator

        tune_allocator()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
