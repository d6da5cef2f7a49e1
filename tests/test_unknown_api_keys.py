"""API keys the proxy does not know are refused, and never advertised (issue 43): as a
feeding pipeline, and through a running proxy in front of Tansu with a raw socket and a real
client.

The keys below are written out from Kafka's own message specs (4.4:
clients/src/main/resources/common/message/*Request.json, "apiKey" and "listeners"), not
taken from kthrottle, so that the tests say what Kafka says."""
import asyncio
import re
import socket
import struct
import time
import urllib.request
import warnings

import pytest

from kthrottle.codecs import apis
from kthrottle.codecs.versions import api_versions_answer
from kthrottle.codecs.wire import write_uvarint
from kthrottle.proxy.filters import standard_filters
from kthrottle_testkit.frames import advertise, api_versions, frame_response
from test_pipeline import (
    Harness,
    api_versions_req,
    cids,
    metadata_req,
    metadata_resp,
    produce_req,
    raw_request,
    req_cids,
)
from test_sasl import SaslHarness, Versions

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.metadata import ApiVersionsResponse

pytestmark = pytest.mark.integration

# Client APIs of Kafka 4.4 (a listener "broker"), by key
KAFKA_CLIENT_APIS = set(range(0, 4)) | set(range(8, 52)) | {
    55, 57, 60, 61, 64, 65, 66, 68, 69, 71, 72, 74, 75, 76, 77, 78, 79, 80, 81,
    88, 89, 90, 91, 92, 93, 94}
# Sent by brokers and controllers only (ClusterAction): the ZooKeeper-mode controller's,
# the KRaft quorum's, brokers' to the controllers, share partition leaders' to the share
# coordinator (83-87, KIP-932)
KAFKA_BROKER_ONLY_APIS = {4, 5, 6, 7, 52, 53, 54, 56, 58, 59, 62, 63, 67, 70, 73, 82,
                          83, 84, 85, 86, 87}
# no Kafka API has these numbers (yet)
UNKNOWN = [95, 96, 200, 999, 32767]
# the client APIs kafka-python has no schema for, which the proxy passes through
NO_KAFKA_PYTHON_SCHEMA = [38, 39, 40, 41, 64, 68, 69, 71, 72, 76, 77, 78, 79, 80, 81,
                          88, 89, 90, 91, 92, 93, 94]
REFUSED = "unknown_api_key"


def flexible_request(cid, api_key, version, body=b"\x00", client_id=b"app-1"):
    """A request with header v2 (KIP-482: tagged fields after the client-id)."""
    payload = (struct.pack(">hhih", api_key, version, cid, len(client_id)) + client_id
               + b"\x00" + body)
    return struct.pack(">i", len(payload)) + payload


def ranges_of(frame, version):
    decoded = ApiVersionsResponse[version].decode(frame[8:])
    assert decoded.error_code == 0
    return {k.api_key: (k.min_version, k.max_version) for k in decoded.api_keys}


# -- refused ------------------------------------------------------------------------------


@pytest.mark.parametrize("api_key", UNKNOWN)
def test_an_unknown_api_key_closes_its_connection_and_reaches_no_broker(api_key):
    h = Harness(filters=standard_filters(advertise))
    h.client(metadata_req(1))
    assert req_cids(h.take_broker()) == [1]
    h.broker(metadata_resp(1))
    assert cids(h.take_client()) == [1]
    h.client(raw_request(2, api_key, 0, b"\x00" * 16) + produce_req(3))
    assert h.take_broker() == b""  # neither it nor what follows it
    assert h.refused == REFUSED
    assert "api key %d (v0) is not one the proxy knows" % api_key in h.closed
    assert "principal ANONYMOUS" in h.closed


def test_only_unknown_keys_are_refused_and_known_ones_cost_no_more_than_before():
    """Every key Kafka's clients send is forwarded as it came (those kafka-python has no
    schema for too); every key Kafka does not have is refused; a broker-only key stays
    broker_only_api. A known API nothing else reads keeps its place in the table of APIs
    no filter reads (one dict lookup)."""
    for api_key in sorted(KAFKA_CLIENT_APIS):
        h = Harness(filters=standard_filters(advertise))
        frame = flexible_request(5, api_key, 1, b"\x00" * 8)
        h.client(frame)
        # (zeros are no valid body of most: what other filters make of it is theirs)
        assert h.refused != REFUSED, api_key
        if api_key in NO_KAFKA_PYTHON_SCHEMA:
            assert h.closed is None, (api_key, h.closed)
            assert h.take_broker() == frame, api_key
    for api_key in sorted(KAFKA_BROKER_ONLY_APIS):
        h = Harness(filters=standard_filters(advertise))
        h.client(raw_request(5, api_key, 0, b"\x00" * 8))
        assert h.refused == "broker_only_api", api_key
    known = KAFKA_CLIENT_APIS | KAFKA_BROKER_ONLY_APIS
    for api_key in [k for k in range(0, 300) if k not in known]:
        h = Harness(filters=standard_filters(advertise))
        h.client(raw_request(5, api_key, 0, b"\x00" * 8))
        assert h.take_broker() == b"" and h.refused == REFUSED, api_key
    table = Harness(filters=standard_filters(advertise)).conn.table
    for api_key, version in [(apis.METADATA, 8), (9, 3), (12, 4), (75, 0)]:
        assert (api_key, version) in table.plain
    # every Fetch is read for a follower's replica id (its head, or from v15 the
    # ReplicaState tag at its end), on the short way
    assert (apis.FETCH, 15) in table.quick


def test_an_unknown_key_is_refused_as_that_before_authentication_too():
    h = SaslHarness()
    h.client(raw_request(1, 200, 0))
    assert h.take_broker() == b"" and h.take_client() == b""
    assert h.refused == REFUSED
    assert "api key 200 (v0) is not one the proxy knows" in h.closed
    # a known API before authentication is still the authenticator's to refuse
    h = SaslHarness()
    h.client(metadata_req(1))
    assert h.refused == "unauthenticated_request"


# -- never advertised ---------------------------------------------------------------------


def _broker_ranges():
    """What a broker might list: every client API (ShareFetch and ShareAcknowledge at
    Kafka 4.4's 1-2), broker-only ones, and keys no Kafka has."""
    ranges = [(k, 0, 3) for k in sorted(KAFKA_CLIENT_APIS - {78, 79})]
    ranges += [(78, 1, 2), (79, 1, 2)]
    ranges += [(k, 0, 1) for k in sorted(KAFKA_BROKER_ONLY_APIS)]
    ranges += [(k, 0, 0) for k in UNKNOWN + list(range(100, 140))]
    return sorted(ranges)


@pytest.mark.parametrize("version", range(0, 5))
def test_forwarded_api_versions_answers_list_no_key_the_proxy_refuses(version):
    h = Harness(filters=standard_filters(advertise))
    h.client(api_versions_req(1, version))
    assert req_cids(h.take_broker()) == [1]
    broker_ranges = _broker_ranges()
    assert len(broker_ranges) > 127  # the count's varint (v3+) shrinks from 2 bytes to 1
    h.broker(frame_response(apis.API_VERSIONS, version, api_versions(version, broker_ranges), 1))
    ranges = ranges_of(h.take_client(), version)
    assert set(ranges) == KAFKA_CLIENT_APIS
    assert ranges[apis.PRODUCE] == (0, 3)
    assert ranges[78] == ranges[79] == (1, 2)


def test_a_share_api_the_proxy_cannot_decode_is_not_advertised():
    """Kafka 4.0 offered ShareFetch and ShareAcknowledge v0 only (KIP-932's early access,
    whose layout the proxy does not decode): not listed. A later broker's range is
    narrowed to the versions the proxy decodes (1-2)."""
    h = Harness(filters=standard_filters(advertise))
    h.client(api_versions_req(1, 3))
    h.take_broker()
    h.broker(frame_response(apis.API_VERSIONS, 3, api_versions(
        3, [(0, 0, 11), (76, 0, 0), (78, 0, 0), (79, 0, 4)]), 1))
    ranges = ranges_of(h.take_client(), 3)
    assert ranges == {0: (0, 11), 76: (0, 0), 79: (1, 2)}
    # and a client that sends one anyway is refused before the broker sees it
    for version in (0, 3):
        h = Harness(filters=standard_filters(advertise))
        h.client(flexible_request(2, 78, version))
        assert h.take_broker() == b"" and h.closed is not None, version


def test_the_entries_kept_keep_their_own_tagged_fields_and_what_follows_them():
    # ApiVersions v3: error_code, api_keys (compact), each with a tag of its own here,
    # throttle_time_ms, then the top-level tagged fields (one unknown tag)
    entry = lambda k, lo, hi, tags=b"\x00": struct.pack(">hhh", k, lo, hi) + tags  # noqa: E731
    body = (struct.pack(">h", 0) + write_uvarint(4 + 1)
            + entry(0, 0, 11, b"\x01\x05\x02ab") + entry(95, 0, 0, b"\x01\x05\x01z")
            + entry(83, 0, 0) + entry(18, 0, 4)
            + struct.pack(">i", 250) + b"\x01\x09\x03xyz")
    h = Harness(filters=standard_filters(advertise))
    h.client(api_versions_req(1, 3))
    h.take_broker()
    h.broker(frame_response(apis.API_VERSIONS, 3, body, 1))
    out = h.take_client()
    assert out[8:] == (struct.pack(">h", 0) + write_uvarint(2 + 1)
                       + entry(0, 0, 11, b"\x01\x05\x02ab") + entry(18, 0, 4)
                       + struct.pack(">i", 250) + b"\x01\x09\x03xyz")


def test_the_proxys_own_api_versions_answers_list_no_key_it_refuses():
    """Before authentication (sasl-mode terminate) the proxy answers ApiVersions itself,
    from the ranges a broker gave it."""
    ranges = _broker_ranges()
    for version in range(0, 5):
        assert set(ranges_of(api_versions_answer(7, version, ranges), version)) \
            == KAFKA_CLIENT_APIS

    class Listed(Versions):
        RANGES = tuple(_broker_ranges())

    h = SaslHarness(versions=Listed())
    h.client(api_versions_req(1, 3))
    assert h.take_broker() == b""
    assert set(ranges_of(h.answer(), 3)) == KAFKA_CLIENT_APIS


# -- through a running proxy ----------------------------------------------------------------


def _raw(port, frame):
    """Send ``frame`` on a fresh connection to the proxy; what comes back before it
    closes (b"" when it closes without an answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk


def _refusals(admin_port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin_port, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^kthrottle_connections_refused_total\{reason="%s"\} ([0-9.e+]+)$' % REFUSED,
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def test_through_the_proxy_unknown_keys_are_refused_and_clients_see_none(broker, tmp_path):
    from aiokafka import AIOKafkaProducer
    from aiokafka.conn import create_conn

    from kthrottle_testkit.proxy import ProxyProcess
    from kthrottle.embedded import free_port

    admin_port = free_port()
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--admin-listen", "127.0.0.1:%d" % admin_port]).start()
    try:
        for n, api_key in enumerate((200, 95), 1):
            assert _raw(proxy.port, raw_request(7, api_key, 0, b"\x00" * 8,
                                                client_id=b"probe")) == b""
            line = "refused (unknown_api_key): api key %d (v0) is not one the proxy knows" % api_key
            proxy.wait_for_log(line)
            assert [entry for entry in proxy.log().splitlines() if line in entry][0].split()[2] \
                == "WARNING"
            for _ in range(100):  # counted once the connection is closed
                if _refusals(admin_port) == n:
                    break
                time.sleep(0.05)
            assert _refusals(admin_port) == n
        assert sum("refused (unknown_api_key)" in entry for entry in proxy.log().splitlines()) == 2

        # the ApiVersions a real client gets (aiokafka asks on every new connection):
        # only APIs Kafka's clients have
        async def versions():
            conn = await create_conn("127.0.0.1", proxy.port)
            try:
                return dict(conn._versions)
            finally:
                conn.close()

        listed = asyncio.run(versions())
        assert apis.PRODUCE in listed and set(listed) <= KAFKA_CLIENT_APIS, sorted(listed)

        async def produce():
            producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
            await producer.start()
            try:
                return await producer.send_and_wait("unknown-keys-topic", b"still flows")
            finally:
                await producer.stop()

        assert asyncio.run(produce()).offset >= 0
        assert proxy.alive()
    finally:
        proxy.stop()


def test_through_the_proxy_apache_kafka_offers_clients_its_client_apis_alone(apache_kafka,
                                                                             tmp_path):
    """Apache Kafka 4.4 lists, on the listener clients use, APIs only brokers send (the
    share-group state APIs a share partition's leader sends the share coordinator, KIP-932):
    a client behind the proxy is offered every client API the broker has, and none of them."""
    from aiokafka.conn import create_conn

    from kthrottle_testkit.proxy import ProxyProcess

    async def versions(host, port):
        conn = await create_conn(host, port)
        try:
            return dict(conn._versions)
        finally:
            conn.close()

    kafka = apache_kafka
    direct = asyncio.run(versions(kafka.host, kafka.port))
    assert set(direct) & KAFKA_BROKER_ONLY_APIS  # what there is to leave out
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log", node_id=kafka.node_id).start()
    try:
        offered = asyncio.run(versions("127.0.0.1", proxy.port))
    finally:
        proxy.stop()
    assert set(offered) == set(direct) & KAFKA_CLIENT_APIS
    for api_key in (78, 79):  # ShareFetch, ShareAcknowledge: the versions the proxy decodes
        low, high = direct[api_key]
        assert offered[api_key] == (max(low, 1), min(high, 2))
    assert offered[apis.PRODUCE] == direct[apis.PRODUCE]
