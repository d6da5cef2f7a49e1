"""The quota types beyond the byte and request rates, as pure policy (no I/O,
a fake clock): ip and topic entities, controller mutations, observe-only."""
import pytest

from kthrottle.policy.entities import (
    CONNECTION_CREATION_RATE,
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    OBSERVE_ONLY,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
    entity_kind,
    ip_path,
    keys_for,
    parse_entity,
    parse_quota_value,
    path_of_entity,
    topic_path,
    validate_quota_config,
)
from kthrottle.policy.quotas import WINDOW, QuotaManager, QuotaSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("path, entity", [
    ("users/alice", {"user": "alice"}),
    ("users/a%40b/clients/<default>", {"user": "a@b", "client-id": "<default>"}),
    ("clients/app", {"client-id": "app"}),
    ("ips/<default>", {"ip": "<default>"}),
    ("ips/10.0.0.7", {"ip": "10.0.0.7"}),
    ("ips/0:0:0::1", {"ip": "::1"}),
    ("topics/orders", {"topic": "orders"}),
    ("topics/<default>", {"topic": "<default>"}),
])
def test_every_entity_kind_reads_as_the_admin_api_names_it_and_back(path, entity):
    assert parse_entity(path) == entity
    again = path_of_entity(entity)
    assert parse_entity(again) == entity
    assert entity_kind(again) == entity_kind(path)


@pytest.mark.parametrize("bad", ["ips/not-an-ip", "ips/", "topics/a/b", "topics/bad name",
                                 "topics/..", "groups/x", "ips/1.2.3.4/clients/x"])
def test_malformed_entity_paths_are_refused(bad):
    with pytest.raises(ValueError):
        parse_entity(bad)


@pytest.mark.parametrize("entity", [{"ip": "1.2.3.4", "user": "a"}, {"topic": "t", "ip": "::1"},
                                    {"group": "g"}, {}])
def test_entities_no_quota_has_are_refused(entity):
    with pytest.raises(ValueError):
        path_of_entity(entity)


def test_each_kind_holds_its_own_keys():
    assert CONNECTION_CREATION_RATE in keys_for(ip_path("1.2.3.4"))
    assert PRODUCER_BYTE_RATE not in keys_for(ip_path("1.2.3.4"))
    assert set(keys_for(topic_path("t"))) == {PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, OBSERVE_ONLY}
    assert CONTROLLER_MUTATION_RATE in keys_for("users/alice")
    with pytest.raises(ValueError, match="not a quota of ip"):
        validate_quota_config({PRODUCER_BYTE_RATE: 10}, path="ips/<default>")
    with pytest.raises(ValueError, match="not a quota of topic"):
        validate_quota_config({REQUEST_RATE: 10}, path="topics/t")
    assert validate_quota_config({CONNECTION_CREATION_RATE: "5", OBSERVE_ONLY: "true"},
                                 path="ips/<default>") == {CONNECTION_CREATION_RATE: 5.0,
                                                           OBSERVE_ONLY: 1.0}


@pytest.mark.parametrize("value, parsed", [(True, 1.0), ("true", 1.0), ("1", 1.0), (1.0, 1.0),
                                           (False, 0.0), ("false", 0.0), (0, 0.0)])
def test_observe_only_takes_booleans_as_every_source_writes_them(value, parsed):
    assert parse_quota_value(OBSERVE_ONLY, value) == parsed


def test_observe_only_refuses_other_values():
    with pytest.raises(ValueError, match="true or false"):
        parse_quota_value(OBSERVE_ONLY, "maybe")


def test_an_observe_only_quota_reports_what_it_would_do_and_delays_no_one():
    snapshot = {"clients/dry": {PRODUCER_BYTE_RATE: 1000.0, OBSERVE_ONLY: 1.0},
                "clients/real": {PRODUCER_BYTE_RATE: 1000.0}}
    m = QuotaManager(snapshot)
    dry, real = m.client("ANONYMOUS", "dry"), m.client("ANONYMOUS", "real")
    delays = {"dry": [], "real": []}
    for i in range(20):  # 5000 bytes/s against 1000: five times over
        now = i * 0.2
        delays["dry"].append(dry.on_request(0, 1000, 1, now).delay_ms)
        delays["real"].append(real.on_request(0, 1000, 1, now).delay_ms)
    assert all(d == 0 for d in delays["dry"])
    assert sum(delays["real"]) > 0
    bucket = dry.produce
    assert bucket.observe_only and bucket.throttled == 0 and bucket.throttle_ms_total == 0
    assert bucket.observed > 0 and bucket.observed_ms_total > 0
    # as if the client had waited each time: each would-be delay is one
    # request's worth (1000 bytes at 1000 bytes/s), not a debt piling up
    assert bucket.observed_last_ms <= 1000
    assert real.produce.throttled > 0 and real.produce.observed == 0


def test_a_whole_source_observe_only_and_a_fetch_cap_not_applied():
    m = QuotaManager({"clients/c": {CONSUMER_BYTE_RATE: 1000.0}},
                     QuotaSettings(observe_only=True))
    client = m.client("ANONYMOUS", "c")
    assert client.fetch.observe_only
    assert client.fetch_max_bytes() is None  # a dry run caps no fetch
    assert client.on_fetch_response(50_000, 0.0).delay_ms == 0
    assert client.fetch.observed == 1


def test_observe_only_set_and_cleared_live():
    m = QuotaManager({"clients/c": {PRODUCER_BYTE_RATE: 1000.0, OBSERVE_ONLY: 1.0}})
    client = m.client("ANONYMOUS", "c")
    assert client.on_request(0, 5000, 1, 0.0).delay_ms == 0
    m.update({"clients/c": {PRODUCER_BYTE_RATE: 1000.0}})
    assert client.on_request(0, 5000, 1, 0.1).delay_ms > 0


def test_topic_quotas_give_each_topic_its_own_bucket_shared_by_every_client():
    m = QuotaManager({"topics/orders": {PRODUCER_BYTE_RATE: 1000.0},
                      "topics/<default>": {CONSUMER_BYTE_RATE: 500.0}})
    orders = m.topic_bucket(PRODUCER_BYTE_RATE, "orders")
    assert orders is m.topic_bucket(PRODUCER_BYTE_RATE, "orders")
    assert orders.entity == "topics/orders" and orders.client_tag == "orders"
    assert m.topic_bucket(PRODUCER_BYTE_RATE, "audit") is None
    a, b = m.topic_bucket(CONSUMER_BYTE_RATE, "a"), m.topic_bucket(CONSUMER_BYTE_RATE, "b")
    assert a is not b and a.entity == b.entity == "topics/<default>"
    assert orders.record(3000, 0.0) > 0
    # a topic quota is no client's: client resolution never reaches it
    assert m.client("ANONYMOUS", "orders").produce is None
    m.update({"topics/<default>": {CONSUMER_BYTE_RATE: 500.0}})
    assert set(m.topic_buckets) == {(CONSUMER_BYTE_RATE, "a"), (CONSUMER_BYTE_RATE, "b")}


def test_connection_creation_rate_per_address_with_a_default():
    m = QuotaManager({"ips/<default>": {CONNECTION_CREATION_RATE: 2.0},
                      "ips/10.0.0.9": {CONNECTION_CREATION_RATE: 100.0}},
                     QuotaSettings(mode=WINDOW))
    one, other, big = (m.connection_bucket(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.9"))
    assert one is not other and one.limit == other.limit == 2.0 and big.limit == 100.0
    delays = [one.record(1, 0.01 * i) for i in range(40)]
    assert delays[0] == 0 and delays[-1] > 0
    assert other.record(1, 0.4) == 0


def test_controller_mutation_rate_resolves_as_the_client_quotas_and_debt_is_read_without_recording():
    m = QuotaManager({"users/alice": {CONTROLLER_MUTATION_RATE: 10.0}})
    alice = m.client("alice", "admin")
    assert alice.mutation is not None and alice.mutation.user_tag == "alice"
    assert m.client("bob", "admin").mutation is None
    bucket = alice.mutation
    assert bucket.debt_ms(0.0) == 0
    bucket.record(30, 0.0)  # 30 partitions against 10/s with a 1 s burst: 2 s in debt
    assert bucket.debt_ms(0.0) == 2000
    assert bucket.debt_ms(0.0) == 2000  # reading it records nothing
    assert bucket.debt_ms(1.5) == 500
    assert bucket.debt_ms(2.5) == 0
