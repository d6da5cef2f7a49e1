"""What the proxy asks a bootstrap broker itself: the API version ranges a
terminating proxy answers ApiVersions with before a client has
authenticated (ApiVersionsCache), and the cluster's nodes, whose listeners
open at start (NodeDiscovery)."""
import asyncio
import logging

from ..codecs import ProtocolError
from ..codecs.frames import MIN_RESPONSE_SIZE
from ..codecs.versions import (
    api_versions_request,
    metadata_request,
    parse_api_versions,
    parse_metadata_brokers,
)
from ..codecs.wire import INT32

log = logging.getLogger("kthrottle.proxy")


class ApiVersionsCache:
    """The API version ranges a broker offers, for a proxy that answers
    ApiVersions itself before a client has authenticated (and so before it
    has a broker connection). Asked of a bootstrap broker with ApiVersions,
    which a broker answers before any SASL exchange (KIP-511), over the
    upstream TLS settings; asked again when older than REFRESH_SECONDS."""

    REFRESH_SECONDS = 300.0
    MAX_ANSWER = 1 << 20  # an ApiVersions answer is a few hundred bytes

    def __init__(self, config, upstream_tls=None):
        """``upstream_tls``: the SSLContext towards the brokers (None:
        plaintext). The ranges are given as the filters in ``filters``
        advertise them (set once they are built)."""
        self.config = config
        self.upstream_tls = upstream_tls
        self.filters = ()
        self._ranges = None
        self._at = None
        self._fetching = None

    @property
    def current(self):
        """The ranges (None while unknown); an old answer is refreshed in the
        background while it goes on being used."""
        if self._at is not None and (asyncio.get_running_loop().time() - self._at
                                     > self.REFRESH_SECONDS):
            self.refresh()
        return self._ranges

    def refresh(self):
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.get_running_loop().create_task(self._ask())
            self._fetching.add_done_callback(_retrieved)
        return self._fetching

    def fetch(self):
        """An awaitable of the ranges, asked for now if none are known."""
        return asyncio.shield(self.refresh())

    def close(self):
        if self._fetching is not None:
            self._fetching.cancel()

    async def _ask(self):
        try:
            ranges = await ask_bootstrap(self.config, self.upstream_tls, api_versions_request(1),
                                         parse_api_versions, "ApiVersions")
        except ConnectionError as exc:
            log.warning("no broker answered ApiVersions: %s", exc)
            raise
        ranges = self.advertised(ranges)
        self._ranges, self._at = ranges, asyncio.get_running_loop().time()
        return ranges

    def advertised(self, ranges):
        """The broker's ranges as the proxy's filters advertise them
        (``Filter.api_ranges``: the admin API lists what it answers itself)."""
        for f in self.filters:
            ranges = f.api_ranges(ranges)
        return ranges


async def ask_bootstrap(config, tls, request, parse, what):
    """Send one request to the first bootstrap broker that takes a
    connection (over ``tls``, the upstream TLS context, or None), and return
    ``parse`` of its answer; ConnectionError, saying why, when none answers."""
    timeout = config.upstream_connect_timeout_ms / 1000.0
    errors = []
    for host, port in config.bootstrap_servers:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls else None), timeout)
            writer.write(request)
            size = INT32.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))[0]
            if not MIN_RESPONSE_SIZE <= size <= ApiVersionsCache.MAX_ANSWER:
                raise ProtocolError("a %s answer of %d bytes" % (what, size))
            body = await asyncio.wait_for(reader.readexactly(size), timeout)
            return parse(INT32.pack(size) + body)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                ProtocolError) as exc:
            errors.append("%s:%s %s" % (host, port, exc or type(exc).__name__))
        finally:
            if writer is not None:
                writer.close()
    raise ConnectionError("; ".join(errors) or "no broker address")


class NodeDiscovery:
    """Opens the node listeners at start, from a Metadata request of the
    proxy's own to a bootstrap broker, and again every REFRESH_SECONDS: a
    proxy restarted under running clients has their node listeners before
    any of them asks for metadata again (a client with the cluster's
    metadata cached reconnects to the node ports it knows, and some, such as
    aiokafka, never fall back to the bootstrap address). Not possible
    towards brokers that require SASL (Metadata needs authentication there):
    then the listeners open with the first Metadata a client gets."""

    REFRESH_SECONDS = 300.0
    RETRY_SECONDS = 2.0

    def __init__(self, config, upstream_tls, unmapped, learn_nodes):
        """``unmapped(nodes)``: the UnmappedNode errors of nodes without a
        port; ``learn_nodes(nodes)``: route them and open their listeners."""
        self.config = config
        self.upstream_tls = upstream_tls
        self.unmapped = unmapped
        self.learn_nodes = learn_nodes
        self._task = None
        self._first = None  # the first ask's nodes (None if it failed), while start waits

    def start(self):
        loop = asyncio.get_running_loop()
        self._first = loop.create_future()
        self._task = loop.create_task(self._run())

    async def first_answer(self, timeout):
        """The nodes the first ask named (None when it failed or took longer
        than ``timeout``: the listeners then open as the answers come). With
        nodes that have no port it does not go on: the caller refuses to
        start."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._first), timeout)
        except asyncio.TimeoutError:
            self._first.cancel()  # an answer from now on is learned as any later one
            return None

    async def _run(self):
        failing = None  # why the last ask failed: logged once, not at every retry
        while True:
            try:
                nodes = await ask_bootstrap(self.config, self.upstream_tls, metadata_request(1),
                                            parse_metadata_brokers, "Metadata")
            except ConnectionError as exc:
                if not self._first.done():
                    self._first.set_result(None)
                if failing is None:
                    log.warning("cannot ask a bootstrap broker for its nodes (%s): their "
                                "listeners open with the first Metadata a client gets; "
                                "asking again every %g s", exc, self.RETRY_SECONDS)
                failing = exc
                await asyncio.sleep(self.RETRY_SECONDS)
                continue
            if failing is not None:
                log.info("a bootstrap broker named its nodes: %s",
                         ", ".join("%d" % n.node_id for n in nodes) or "none")
                failing = None
            if not self._first.done():
                self._first.set_result(nodes)
                if self.unmapped(nodes):
                    return  # the proxy does not start
            self.learn_nodes(nodes)
            await asyncio.sleep(self.REFRESH_SECONDS)

    def close(self):
        if self._task is not None:
            self._task.cancel()


def _retrieved(task):
    if not task.cancelled():
        task.exception()  # seen: a failed refresh is logged, not an unretrieved error
