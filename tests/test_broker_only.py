"""Requests only brokers and controllers send are refused from clients: the
connection closes and nothing reaches the broker (as a feeding pipeline, and
through a running proxy with a raw socket)."""
import socket
import struct

import pytest

from kthrottle.codecs import apis
from kthrottle.config import build_config
from kthrottle.proxy.filters import REGISTERED, build_filters, standard_filters
from kthrottle.proxy.filters.broker_only import BROKER_ONLY_APIS, BrokerOnlyApis
from kthrottle_testkit.frames import advertise
from test_pipeline import (
    Harness,
    cids,
    fetch_req,
    fetch_resp,
    metadata_req,
    metadata_resp,
    produce_req,
    raw_request,
    req_cids,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("api_key", sorted(BROKER_ONLY_APIS))
def test_a_broker_only_request_closes_its_connection_and_reaches_no_broker(api_key):
    h = Harness(filters=standard_filters(advertise))
    h.client(metadata_req(1))
    assert req_cids(h.take_broker()) == [1]
    h.broker(metadata_resp(1))
    h.client(raw_request(2, api_key, 0, b"\x00" * 16) + produce_req(3))
    assert h.take_broker() == b""  # neither it nor what follows it
    assert h.refused == "broker_only_api"
    assert "%s (api key %d v0) is sent by brokers and controllers only" % (
        BROKER_ONLY_APIS[api_key], api_key) in h.closed
    assert "principal ANONYMOUS" in h.closed


def test_it_is_always_on_and_looks_at_nothing_else():
    from kthrottle.proxy.filter import Services

    config = build_config({}, {"bootstrap_servers": [("127.0.0.1", 9)]})
    services = Services()
    services.advertise = advertise
    assert any(isinstance(f, BrokerOnlyApis) for f in build_filters(config, services))
    assert BrokerOnlyApis in REGISTERED
    f = BrokerOnlyApis()
    h = Harness(filters=[f])
    for api_key in (apis.PRODUCE, apis.METADATA, 24, 27, 55, 64, 80, 81):
        assert h.conn.table.lookup(api_key, 0).request_filters == ()
    assert h.conn.table.lookup(4, 7).request_filters == ((f, 0),)
    # a Fetch's head (replica_id up to v14, the ReplicaState tag at its end from v15),
    # on the short way
    assert h.conn.table.lookup(apis.FETCH, 15).request_filters == ((f, 0),)
    for version in (11, 15, 17):
        assert (apis.FETCH, version) in h.conn.table.quick
        assert (apis.FETCH, version) not in h.conn.table.plain


@pytest.mark.parametrize("version", [0, 4, 11, 12, 14])
def test_a_follower_fetch_is_refused_and_a_consumers_goes_on_the_short_way(version):
    h = Harness(filters=standard_filters(advertise))
    h.client(fetch_req(1, version=version) + fetch_req(2, version=version))
    assert req_cids(h.take_broker()) == [1, 2]
    assert h.long_heads["request"] <= 1  # the head read once, then compared
    h.broker(fetch_resp(1, version=version) + fetch_resp(2, version=version))
    assert cids(h.take_client()) == [1, 2]
    h.client(fetch_req(3, version=version, replica_id=0, client_id="broker-0"))
    assert h.take_broker() == b"" and h.refused == "broker_only_api"
    assert "a follower's Fetch (v%d, replica_id 0) is sent by brokers only" % version in h.closed


def fetch_v15(cid, version=17, replica_id=None, partitions=3, client_id="app-1"):
    """A Fetch v15+ as kafka-python writes it; ``replica_id``: a ReplicaState tag
    (KIP-903), which only a follower sets."""
    import uuid

    from kthrottle.codecs import acl_requests as wire

    Q = wire.request_class(apis.FETCH)
    T = Q.fields["topics"].data_class
    P = T.fields["partitions"].data_class
    F = Q.fields["forgotten_topics_data"].data_class
    fields = dict(
        max_wait_ms=500, min_bytes=1, max_bytes=1 << 20, isolation_level=0, session_id=0,
        session_epoch=-1, topics=[T(topic_id=uuid.UUID(int=7), partitions=[
            P(partition=i, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
              log_start_offset=-1, partition_max_bytes=1 << 20) for i in range(partitions)])],
        forgotten_topics_data=[F(topic_id=uuid.UUID(int=8), partitions=[4])], rack_id="r")
    if replica_id is not None:
        fields["replica_state"] = Q.fields["replica_state"].data_class(replica_id=replica_id,
                                                                      replica_epoch=5)
    request = Q[version](**fields)
    request.with_header(correlation_id=cid, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


@pytest.mark.parametrize("version", [15, 16, 17])
@pytest.mark.parametrize("how", ["first", "after-a-consumers", "pipelined", "in-pieces"])
def test_a_follower_fetch_v15_naming_itself_in_its_tag_is_refused(version, how):
    """From v15 a follower names itself in a tag at the request's end, which the
    head does not show: each Fetch's end is read, on the short way too."""
    h = Harness(filters=standard_filters(advertise))
    hostile = fetch_v15(3, version, replica_id=1, partitions=40)
    if how == "first":
        h.client(hostile)
    elif how == "after-a-consumers":
        h.client(fetch_v15(1, version) + fetch_v15(2, version))
        assert req_cids(h.take_broker()) == [1, 2]
        assert h.long_heads["request"] <= 1  # its head read once: the short way
        h.client(hostile)
    elif how == "pipelined":
        h.client(fetch_v15(1, version) + fetch_v15(2, version))
        h.take_broker()
        h.client(fetch_v15(4, version) + hostile)
    else:
        h.client(hostile, chunk=97)
    assert 3 not in req_cids(h.take_broker())  # (the connection closes: 4 may not go either)
    assert h.refused == "broker_only_api"
    assert "a follower's Fetch (v%d, replica_id 1) is sent by brokers only" % version in h.closed


def test_a_consumers_fetch_v15_with_tags_of_its_own_goes_on():
    """A ReplicaState naming no replica (-1), as a consumer may send it, is no follower's."""
    h = Harness(filters=standard_filters(advertise))
    request = fetch_v15(1, 17, replica_id=-1)
    h.client(request + fetch_v15(2, 17, replica_id=-1))
    assert req_cids(h.take_broker()) == [1, 2] and h.closed is None


def _raw(port, frame):
    """Send ``frame`` on a fresh connection to the proxy; what comes back
    before it closes (b"" when it closes without an answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk


def test_through_the_proxy_leader_and_isr_is_refused_and_clients_carry_on(broker, tmp_path):
    import asyncio

    from aiokafka import AIOKafkaProducer

    from kthrottle_testkit.proxy import ProxyProcess

    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log").start()
    try:
        # a LeaderAndIsr v0 (controller id 1, epoch 1, no partitions, no leaders)
        body = struct.pack(">iiii", 1, 1, 0, 0)
        assert _raw(proxy.port, raw_request(7, 4, 0, body, client_id=b"probe")) == b""
        proxy.wait_for_log("LeaderAndIsr (api key 4 v0) is sent by brokers and controllers only")
        assert "broker_only_api" in proxy.log()
        # a Fetch claiming to be follower 0's: refused before it reaches the broker
        assert _raw(proxy.port, fetch_req(8, version=11, replica_id=0, client_id="fake")) == b""
        proxy.wait_for_log("a follower's Fetch (v11, replica_id 0) is sent by brokers only")
        # and one naming its replica in the tag of Fetch v15+ (KIP-903)
        assert _raw(proxy.port, fetch_v15(9, 17, replica_id=0, client_id="fake")) == b""
        proxy.wait_for_log("a follower's Fetch (v17, replica_id 0) is sent by brokers only")

        async def produce():
            producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
            await producer.start()
            try:
                return await producer.send_and_wait("broker-only-topic", b"still flows")
            finally:
                await producer.stop()

        assert asyncio.run(produce()).offset >= 0
        assert proxy.alive()
    finally:
        proxy.stop()
