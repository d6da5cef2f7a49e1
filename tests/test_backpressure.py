"""A client that stops reading must stop the proxy reading from the broker,
not make the proxy buffer everything the broker sends."""
import asyncio
import struct
import uuid
import warnings

import pytest

from kthrottle.codecs import FrameReader
from kthrottle.config import ProxyConfig
from kthrottle.embedded import free_port
from kthrottle.proxy import ProxyServer
from kthrottle.proxy.connection import WRITE_HIGH_WATER

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.consumer import FetchRequest

pytestmark = pytest.mark.integration

RECORD = b"r" * 1024
REQUESTS = 40
PARTITION_MAX_BYTES = 1024 * 1024


def fetch_request(topic, correlation_id):
    F = FetchRequest
    part = F.FetchTopic.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=PARTITION_MAX_BYTES)
    req = F[4](replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=PARTITION_MAX_BYTES,
               isolation_level=0, topics=[F.FetchTopic(topic=topic, partitions=[part])])
    req.with_header(correlation_id=correlation_id, client_id="slow-reader")
    return req.encode(header=True, framed=True)


def test_slow_client_pauses_the_broker_side_and_loses_nothing(broker):
    from aiokafka import AIOKafkaProducer

    topic = "bp-" + uuid.uuid4().hex[:8]
    broker.create_topic(topic, partitions=1)

    async def run():
        config = ProxyConfig(bootstrap_servers=[(broker.host, broker.port)],
                             listen=("127.0.0.1", free_port()), node_port_base=free_port() - 111)
        server = ProxyServer(config)
        await server.start()
        try:
            producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:%d" % config.listen[1],
                                        linger_ms=20, max_batch_size=256 * 1024)
            await producer.start()
            try:
                await asyncio.gather(*[await producer.send(topic, RECORD, partition=0) for _ in range(3000)])
            finally:
                await producer.stop()

            # A client with a 1 KiB read limit that does not read: asyncio
            # stops taking bytes off its socket almost at once.
            reader, writer = await asyncio.open_connection(*config.listen, limit=1024)
            writer.write(b"".join(fetch_request(topic, i) for i in range(REQUESTS)))
            await writer.drain()
            (conn,) = [c for c in server.connections if c.peer.endswith(":%d" % writer.get_extra_info("sockname")[1])]

            for _ in range(100):  # up to 10 s for the buffers to fill
                if "client write buffer full" in conn.upstream.reasons:
                    break
                await asyncio.sleep(0.1)
            assert "client write buffer full" in conn.upstream.reasons
            await asyncio.sleep(0.5)
            buffered = conn.client.transport.get_write_buffer_size() + conn.pipeline.responses_in.buffered
            # one response past the high-water mark at most, never all 40 MB
            assert buffered <= WRITE_HIGH_WATER + 2 * PARTITION_MAX_BYTES, buffered
            assert len(conn.pipeline.pending) > REQUESTS // 4

            # Reading again drains everything, in order, intact.
            frames = FrameReader()
            got = []
            while len(got) < REQUESTS:
                data = await asyncio.wait_for(reader.read(1 << 20), 20)
                assert data, "proxy closed the connection"
                got += [bytes(f) for f in frames.feed(data)]
            writer.close()
            return got
        finally:
            await server.close()

    responses = asyncio.run(run())
    assert [struct.unpack_from(">i", f, 4)[0] for f in responses] == list(range(REQUESTS))
    assert all(len(f) > 512 * 1024 for f in responses)  # each carried a full fetch
