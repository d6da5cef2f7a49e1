"""The asyncio adapter around the pipeline, in-process against a real
Tansu broker: a bug in a timer's or a job's handling closes that one
connection instead of leaving a paused client and two sockets open."""
import asyncio
import logging

import pytest

from kthrottle.config import ProxyConfig
from kthrottle.embedded import free_port
from kthrottle.proxy.server import ProxyServer
from test_pipeline import api_versions_req

pytestmark = pytest.mark.integration


async def _one_connection(broker, body):
    host, port = broker.bootstrap.split(":")
    node_port = free_port()  # Tansu's node 111 gets this port
    config = ProxyConfig(bootstrap_servers=[(host, int(port))], listen=("127.0.0.1", free_port()),
                         node_port_base=node_port - 111).validate()
    server = ProxyServer(config)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection(*server.bootstrap_address)
        writer.write(api_versions_req(1))
        size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 10), "big")
        await reader.readexactly(size)
        (conn,) = server.connections
        await body(conn)
        # the client sees the connection closed, and the proxy let it go
        assert await asyncio.wait_for(reader.read(), 10) == b""
        assert conn.closed and conn not in server.connections
        assert conn.upstream.transport.is_closing()
        writer.close()
    finally:
        await server.close()


def test_an_exception_from_a_timer_closes_the_connection(broker, caplog):
    caplog.set_level(logging.INFO, "kthrottle")
    async def body(conn):
        def broken_tick(now):
            raise RuntimeError("a bug in a filter")

        conn.pipeline.tick = broken_tick
        conn.client.pause("throttled")  # as a throttle leaves it
        conn._client_timer = conn.loop.call_later(0.01, conn._tick)
        await asyncio.sleep(0.2)

    asyncio.run(_one_connection(broker, body))
    assert "a timer failed" in caplog.text
    assert "internal error after a timer: a bug in a filter" in caplog.text


def test_an_exception_handling_a_job_answer_closes_the_connection(broker, caplog):
    caplog.set_level(logging.INFO, "kthrottle")
    async def body(conn):
        def broken(token, result, error, now):
            raise KeyError("no such job")

        conn.pipeline.job_done = broken
        conn._job_done(1, None, None)
        await asyncio.sleep(0.05)

    asyncio.run(_one_connection(broker, body))
    assert "internal error: 'no such job'" in caplog.text
