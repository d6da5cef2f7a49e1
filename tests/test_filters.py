"""The filter structure: the registry, the narrow context a filter sees, and
``--forbidden-api-keys`` (the smallest registered filter) in the pipeline
and through a real proxy with real clients."""
import ast
import asyncio
import warnings
from pathlib import Path

import pytest

from kthrottle.codecs import apis
from kthrottle.config import ConfigError, build_config, load_toml
from kthrottle.options import Option
from kthrottle.proxy import filters as registry
from kthrottle.proxy.filter import Filter, FilterContext
from kthrottle.proxy.filters.forbidden_api_keys import ForbiddenApiKeys, parse_api_keys
from kthrottle.proxy.pipeline import HEAD, Phase
from kthrottle_testkit.frames import api_versions, frame_response
from test_pipeline import (
    Harness,
    advertise,
    api_versions_req,
    cids,
    metadata_req,
    metadata_resp,
    produce_req,
    produce_resp,
    raw_request,
    req_cids,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import CreateTopicsRequest

pytestmark = pytest.mark.integration

FILTERS_DIR = Path(registry.__file__).parent


# the registry ---------------------------------------------------------------

def test_every_registered_filter_has_a_name_options_and_a_builder():
    names = [cls.name for cls in registry.REGISTERED]
    assert len(set(names)) == len(names), names
    for cls in registry.REGISTERED:
        assert issubclass(cls, Filter)
        # built from the configuration: by its own build, or by Filter's as ``built`` says
        assert cls.build.__func__ is not Filter.build.__func__ or cls.built is not None, cls
        assert all(isinstance(o, Option) for o in cls.options), cls


def test_the_configuration_builds_only_what_it_names():
    from kthrottle.proxy.filter import Services

    services = Services()
    services.advertise = advertise
    plain = build_config({}, {"bootstrap_servers": [("127.0.0.1", 9)]})
    assert [f.name for f in registry.build_filters(plain, services)] == [
        "unknown-api-keys", "broker-only-apis", "version-gate", "address-rewrite"]
    config = build_config({}, {"bootstrap_servers": [("127.0.0.1", 9)],
                               "forbidden_api_keys": frozenset({19})})
    built = registry.build_filters(config, services)
    assert [f.name for f in built] == ["unknown-api-keys", "forbidden-api-keys",
                                       "broker-only-apis", "version-gate", "address-rewrite"]
    assert built[1].api_keys == {19}


def test_no_filter_module_reaches_into_the_pipeline_or_the_adapter():
    """A filter is read without the connection class: it imports the filter
    API (proxy/filter.py), never pipeline.py or connection.py."""
    for path in FILTERS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert not module.endswith(("pipeline", "connection", "server")), (path, module)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "ctx":
                assert not node.attr.startswith("_"), (path.name, node.lineno, node.attr)


def test_a_context_offers_no_way_to_set_the_principal_or_the_phase():
    h = Harness(filters=[Filter()])
    ctx = h.conn.contexts[0]
    assert isinstance(ctx, FilterContext) and ctx.principal == "ANONYMOUS"
    with pytest.raises(AttributeError):
        ctx.principal = "admin"
    with pytest.raises(AttributeError):
        ctx.phase = Phase.READY


class _Impostor(Filter):
    """Names a principal without holding the connection for authentication."""

    name = "impostor"

    def request_need(self, api_key, api_version):
        return HEAD

    def on_request(self, ctx, head, inflight):
        ctx.authenticated("admin")


class _Authenticator(Filter):
    name = "authenticator"

    def on_accept(self, ctx):
        ctx.begin_authentication()

    def authenticating_need(self, api_key, api_version):
        return HEAD

    def on_request(self, ctx, head, inflight):
        ctx.authenticated("alice")
        ctx.authenticated("admin")  # a second verdict: refused


def test_only_the_filter_holding_authentication_names_the_principal_and_only_once():
    h = Harness(filters=[_Impostor()])
    with pytest.raises(RuntimeError, match="without holding the connection"):
        h.client(metadata_req(1))
    assert h.conn.principal == "ANONYMOUS"
    h = Harness(filters=[_Authenticator()])
    with pytest.raises(RuntimeError, match="without holding the connection"):
        h.client(metadata_req(1))
    assert h.conn.principal == "alice"


def test_each_filter_has_its_own_state_per_connection():
    class Counting(Filter):
        name = "counting"

        def new_state(self):
            return [0]

        def request_need(self, api_key, api_version):
            return HEAD

        def on_request(self, ctx, head, inflight):
            ctx.state[0] += 1

    f = Counting()
    a, b = Harness(filters=[f]), Harness(filters=[f])
    a.client(metadata_req(1) + metadata_req(2))
    b.client(metadata_req(1))
    assert a.conn.contexts[0].state == [2] and b.conn.contexts[0].state == [1]


# --forbidden-api-keys ----------------------------------------------------------

def create_topics_req(cid, version=3):
    request = CreateTopicsRequest[version](topics=[], timeout_ms=1000,
                                           validate_only=False)
    request.with_header(correlation_id=cid, client_id="admin-tool")
    return bytes(request.encode(header=True, framed=True))


def test_api_keys_are_read_by_number_or_by_kafkas_name():
    assert parse_api_keys("CreateTopics, 20,alterconfigs") == {19, 20, 33}
    assert parse_api_keys(["DeleteTopics", 37]) == {20, 37}
    assert parse_api_keys("") == frozenset()
    with pytest.raises(ConfigError, match="'Nonsense' is not an API key"):
        parse_api_keys("Nonsense")
    with pytest.raises(ConfigError, match="ApiVersions .* cannot be forbidden"):
        parse_api_keys("18")


def test_a_forbidden_request_closes_its_connection_and_reaches_no_broker():
    h = Harness(filters=registry.standard_filters(advertise) + [ForbiddenApiKeys({19, 20})])
    h.client(produce_req(1) + metadata_req(2))
    assert req_cids(h.take_broker()) == [1, 2]  # other APIs go on
    h.broker(produce_resp(1) + metadata_resp(2))
    assert cids(h.take_client()) == [1, 2]
    h.client(create_topics_req(3) + metadata_req(4))
    assert h.take_broker() == b""  # neither it nor what follows it
    assert "api key 19 v3 is forbidden" in h.closed and "principal ANONYMOUS" in h.closed
    assert h.refused == "forbidden_api_key"


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_a_forbidden_api_is_left_out_of_every_api_versions_answer(version):
    """A client reading ApiVersions (every Kafka client) never sends what it
    would be refused for: the broker's answer loses the forbidden keys, and
    so do the ranges the proxy answers with itself before authentication."""
    from kafka.protocol.metadata import ApiVersionsResponse

    f = ForbiddenApiKeys({19, 20})
    h = Harness(filters=registry.standard_filters(advertise) + [f])
    h.client(api_versions_req(1, version))
    body = api_versions(version, [(apis.PRODUCE, 0, 9), (19, 0, 7), (20, 0, 6),
                                  (apis.METADATA, 0, 12)])
    h.broker(frame_response(apis.API_VERSIONS, version, body, 1))
    decoded = ApiVersionsResponse[version].decode(h.take_client()[8:])
    assert decoded.error_code == 0
    assert sorted(k[0] for k in decoded.api_keys) == [apis.PRODUCE, apis.METADATA]
    assert f.api_ranges(((0, 0, 9), (19, 0, 7), (20, 0, 6))) == ((0, 0, 9),)
    assert h.closed is None


def test_an_api_not_listed_is_not_even_looked_at():
    f = ForbiddenApiKeys({19})
    h = Harness(filters=[f])
    table = h.conn.table
    assert table.lookup(apis.PRODUCE, 8).request_filters == ()
    assert table.lookup(19, 3).request_filters == ((f, 0),)
    h.client(raw_request(5, 20, 4, b"\x00\x00\x00\x00\x00\x00\x03\xe8"))  # DeleteTopics
    assert req_cids(h.take_broker()) == [5] and h.closed is None


def test_the_option_is_a_flag_and_a_toml_key(tmp_path):
    from kthrottle.cli import make_parser

    args = make_parser().parse_args(["proxy", "--forbidden-api-keys", "CreateTopics,20"])
    assert args.forbidden_api_keys == {19, 20}
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["127.0.0.1:9092"]\n'
                    'forbidden-api-keys = ["DeleteTopics", "AlterConfigs"]\n')
    assert build_config(load_toml(path), {}).forbidden_api_keys == {20, 33}
    path.write_text('bootstrap-server = ["127.0.0.1:9092"]\nforbidden-api-keys = "Oops"\n')
    with pytest.raises(ConfigError, match="forbidden-api-keys: 'Oops' is not an API key"):
        load_toml(path)


def test_through_the_proxy_admin_calls_are_refused_and_records_still_flow(broker, tmp_path):
    """Real clients: the proxy does not offer CreateTopics and DeleteTopics, so
    kafka-python's admin client cannot create a topic through it, and a raw
    CreateTopics sent all the same closes its connection; an aiokafka producer and
    consumer carry on through the same proxy."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError

    from kthrottle_testkit.proxy import ProxyProcess
    from test_api_sweep import CLOSED, api_ranges, exchange

    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--forbidden-api-keys", "CreateTopics,DeleteTopics"]).start()
    try:
        # not offered: the broker offers both, the proxy neither
        offered, direct = api_ranges(proxy.bootstrap), api_ranges(broker.bootstrap)
        assert {19, 20} <= set(direct) and not {19, 20} & set(offered)
        assert set(offered) >= set(direct) - {19, 20} - set(apis.BROKER_ONLY_APIS)
        admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, request_timeout_ms=3000,
                                 client_id="admin-tool")
        try:
            with pytest.raises(KafkaError):
                admin.create_topics([NewTopic("forbidden-topic", 1, 1)])
        finally:
            admin.close()
        # a client that sends it anyway is closed, and the refusal names the API
        assert exchange(proxy.bootstrap, create_topics_req(3)) == CLOSED
        proxy.wait_for_log("api key 19")
        assert "forbidden_api_key" in proxy.log()

        async def round_trip():
            producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
            await producer.start()
            try:
                await producer.send_and_wait("allowed-topic", b"still flows")
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer("allowed-topic", bootstrap_servers=proxy.bootstrap,
                                        auto_offset_reset="earliest")
            await consumer.start()
            try:
                record = await asyncio.wait_for(consumer.getone(), 20)
            finally:
                await consumer.stop()
            return record.value

        assert asyncio.run(round_trip()) == b"still flows"
    finally:
        proxy.stop()


class _Recording:
    """A configuration that records which of its attributes are read."""

    def __init__(self, config):
        self._config = config
        self.read = set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._config, name)


def test_each_filter_reads_only_the_options_it_declares(tmp_path):
    """Every attribute a filter's build() reads is one of its own options or
    named in its ``reads``; and what it names, it reads."""
    from kthrottle.proxy.filter import Services

    password = tmp_path / "password"
    password.write_text("secret\n")
    credentials = tmp_path / "credentials.toml"
    credentials.write_text("")
    base = {"bootstrap_servers": [("127.0.0.1", 9)]}
    configurations = [
        base,
        dict(base, forbidden_api_keys=frozenset({19})),
        dict(base, security_protocol="SASL_PLAINTEXT", credentials_file=str(credentials)),
        dict(base, security_protocol="SASL_PLAINTEXT", sasl_mode="passthrough"),
        dict(base, upstream_security_protocol="SASL_PLAINTEXT", upstream_sasl_username="proxy",
             upstream_sasl_password_file=str(password)),
        dict(base, zookeeper="127.0.0.1:2181", storage_scope="cluster"),
        dict(base, admin_principals=frozenset({"admin"})),
        dict(base, client_id_required=True),
    ]
    read = {cls: set() for cls in registry.REGISTERED}
    built = set()
    for values in configurations:
        config = build_config({}, values)
        services = Services()
        services.advertise = advertise
        for cls in registry.REGISTERED:
            recording = _Recording(config)
            if cls.build(recording, services) is not None:
                built.add(cls)
            read[cls] |= recording.read
    assert built >= set(registry.REGISTERED) - {registry.quotas.QuotaAccounting,
                                                registry.quotas.FetchCap,
                                                registry.topic_quotas.TopicQuotas,
                                                registry.controller_mutation.ControllerMutationQuota,
                                                # built with a quota callback (services.quotas)
                                                registry.partition_leaders.PartitionLeadersSeen,
                                                # built when the app has read ACLs
                                                registry.authorization.Authorization}
    for cls, names in read.items():
        declared = {o.attr for o in cls.options} | set(cls.reads)
        assert names <= declared, (cls.name, names - declared)
        assert set(cls.reads) <= names, (cls.name, set(cls.reads) - names)
