"""Quota callbacks (KIP-257's shape) and quota groups, as pure policy: no I/O
but the callback files a test writes, no brokers, a fake clock."""
import math
import os
import sys
from pathlib import Path

import pytest

from kthrottle.policy.entities import (
    CONSUMER_BYTE_RATE as FETCH,
    CONTROLLER_MUTATION_RATE as MUTATION,
    OBSERVE_ONLY,
    PRODUCER_BYTE_RATE as PRODUCE,
    REQUEST_RATE,
)
from kthrottle.policy.quota_callback import (
    NO_SHARE_FRACTION,
    ClientQuotaCallback,
    ClientQuotaEntity,
    ClientQuotaType,
    Cluster,
    ConfigEntity,
    ConfigEntityType,
    DefaultQuotaCallback,
    KafkaPrincipal,
    LeaderProportional,
    QuotaCallbackError,
    load_callback,
    tags_identity,
    takes_broker,
)
from kthrottle.policy.quotas import (
    CLIENT_BUCKETS,
    QuotaConfig,
    QuotaManager,
    member_pattern,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "quota_callback.py"

# A callback's source, for the loading tests: tenants by principal, limits by tenant.
TENANTS_SOURCE = '''
class Tenants:
    def configure(self, config):
        self.config = config
        self.tenant_of = dict(config.get("tenants", {}))

    def quota_metric_tags(self, quota_type, principal, client_id):
        tenant = self.tenant_of.get(principal.name)
        return None if tenant is None else {"tenant": tenant}

    def quota_limit(self, quota_type, metric_tags):
        return 1000.0

    def update_quota(self, quota_type, entity, new_value):
        pass

    def remove_quota(self, quota_type, entity):
        pass

    def quota_reset_required(self, quota_type):
        return False

    def update_cluster_metadata(self, cluster):
        return False

    def close(self):
        pass
'''


@pytest.fixture
def fresh_modules():
    """Modules a test imports are forgotten after it (each test's tmp_path
    module is its own)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


class Tenants:
    """A callback for the manager tests: principals in tenants share a bucket
    per tenant; everything it is told is recorded."""

    def __init__(self, tenant_of=None, limits=None):
        self.tenant_of = dict(tenant_of or {})
        self.limits = dict(limits or {})  # (quota type, tenant) or tenant -> limit
        self.calls = []
        self.reset = False
        self.cluster_changed = False
        self.closed = 0

    def configure(self, config):
        pass

    def quota_metric_tags(self, quota_type, principal, client_id):
        tenant = self.tenant_of.get(principal.name)
        return None if tenant is None else {"tenant": tenant}

    def quota_limit(self, quota_type, metric_tags):
        tenant = metric_tags["tenant"]
        return self.limits.get((quota_type, tenant), self.limits.get(tenant))

    def update_quota(self, quota_type, entity, new_value):
        self.calls.append(("update", quota_type, entity, new_value))

    def remove_quota(self, quota_type, entity):
        self.calls.append(("remove", quota_type, entity))

    def quota_reset_required(self, quota_type):
        return self.reset

    def update_cluster_metadata(self, cluster):
        self.calls.append(("cluster", cluster))
        return self.cluster_changed

    def close(self):
        self.closed += 1


# -- loading ------------------------------------------------------------------


def test_a_callback_on_the_import_path_loads_as_module_colon_class(tmp_path, monkeypatch,
                                                                   fresh_modules):
    (tmp_path / "kt_tenants_on_path.py").write_text(TENANTS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cb = load_callback("kt_tenants_on_path:Tenants", {"tenants": {"alice": "acme"}})
    assert type(cb).__name__ == "Tenants"
    assert isinstance(cb, ClientQuotaCallback)
    assert cb.config == {"tenants": {"alice": "acme"}}  # configure was given the table
    assert cb.quota_metric_tags(ClientQuotaType.PRODUCE, KafkaPrincipal("User", "alice"),
                                "app") == {"tenant": "acme"}


def test_a_callback_with_no_config_is_configured_with_an_empty_table(tmp_path, monkeypatch,
                                                                     fresh_modules):
    (tmp_path / "kt_tenants_no_config.py").write_text(TENANTS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_callback("kt_tenants_no_config:Tenants").config == {}


def test_a_callback_file_loads_as_path_colon_class(tmp_path, fresh_modules):
    path = tmp_path / "tenants_file.py"
    path.write_text(TENANTS_SOURCE)
    cb = load_callback("%s:Tenants" % path, {"tenants": {"bob": "initech"}})
    assert type(cb).__name__ == "Tenants"
    assert cb.tenant_of == {"bob": "initech"}


def test_a_built_in_callback_loads_by_its_module_path():
    cb = load_callback("kthrottle.policy.quota_callback:LeaderProportional",
                       {"topics": {"alice": ["orders*"]}})
    assert isinstance(cb, LeaderProportional)
    assert cb.topics == {"alice": ("orders*",)}


@pytest.mark.parametrize("spec", ["Tenants", "kt_mod:", ":Tenants", ""])
def test_a_spec_that_is_not_module_colon_class_is_refused(spec):
    with pytest.raises(QuotaCallbackError, match="is not module:Class"):
        load_callback(spec)


def test_a_module_that_does_not_exist_is_refused_saying_so():
    with pytest.raises(QuotaCallbackError,
                       match="cannot import kt_no_such_module_at_all: ModuleNotFoundError"):
        load_callback("kt_no_such_module_at_all:Tenants")


def test_a_file_that_does_not_exist_is_refused_saying_so(tmp_path):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(QuotaCallbackError, match="no such file: .*nowhere.py"):
        load_callback("%s:Tenants" % missing)


def test_a_module_that_fails_to_import_is_refused_with_its_error(tmp_path, fresh_modules):
    path = tmp_path / "broken_cb.py"
    path.write_text("raise RuntimeError('no budgets here')\n")
    with pytest.raises(QuotaCallbackError,
                       match="cannot import .*broken_cb.py: RuntimeError: no budgets here"):
        load_callback("%s:Tenants" % path)


def test_a_class_the_module_lacks_is_refused_naming_it(tmp_path, fresh_modules):
    path = tmp_path / "tenants_no_class.py"
    path.write_text(TENANTS_SOURCE)
    with pytest.raises(QuotaCallbackError, match="has no Teams$"):
        load_callback("%s:Teams" % path)


def test_a_class_missing_methods_is_refused_naming_each_one(tmp_path, fresh_modules):
    path = tmp_path / "tenants_partial.py"
    path.write_text(TENANTS_SOURCE.replace("def quota_reset_required", "def _unused_reset")
                    + "\nTenants.close = None\n")  # not callable: as good as missing
    with pytest.raises(QuotaCallbackError) as info:
        load_callback("%s:Tenants" % path)
    message = str(info.value)
    assert "lacks quota_reset_required, close" in message
    assert "update_quota" not in message


def test_a_configure_that_raises_is_refused_as_a_failed_configure(tmp_path, fresh_modules):
    path = tmp_path / "tenants_bad_config.py"
    path.write_text(TENANTS_SOURCE.replace(
        "self.config = config", "raise KeyError('budgets')"))
    with pytest.raises(QuotaCallbackError, match="configure failed: KeyError: 'budgets'"):
        load_callback("%s:Tenants" % path)


def test_leader_proportional_refuses_a_topics_table_of_the_wrong_shape():
    with pytest.raises(QuotaCallbackError, match="configure failed: ValueError: topics must"):
        load_callback("kthrottle.policy.quota_callback:LeaderProportional",
                      {"topics": {"alice": "orders"}})


def test_takes_broker_tells_a_callback_that_tags_by_broker_apart():
    assert takes_broker(LeaderProportional())
    assert not takes_broker(DefaultQuotaCallback())
    assert not takes_broker(Tenants())


def names(manager):
    """The (key, user tag, client tag) of every client bucket, sorted."""
    return sorted((b.key, b.user_tag, b.client_tag) for b in manager.buckets.values())


# -- tags and entities --------------------------------------------------------


def test_kip55_tags_name_buckets_as_they_always_have():
    assert tags_identity({"user": "alice", "client-id": "app"}) == ("alice", "app")
    assert tags_identity({"user": "alice", "client-id": ""}) == ("alice", "")
    assert tags_identity({"user": "", "client-id": "app"}) == ("", "app")
    assert tags_identity({}) == ("", "")


def test_other_tags_are_named_urlencoded_and_sorted_in_the_user_tag():
    tags = {"zone": "eu 1", "tenant": "acme&co"}
    assert tags_identity(tags) == ("tenant=acme%26co&zone=eu+1", "")
    with_client = {"tenant": "acme", "client-id": "app"}
    assert tags_identity(with_client) == ("tenant=acme", "app")


@pytest.mark.parametrize("path, entities", [
    ("users/alice", (ConfigEntity("alice", ConfigEntityType.USER),)),
    ("users/<default>", (ConfigEntity("", ConfigEntityType.DEFAULT_USER),)),
    ("clients/app%2F1", (ConfigEntity("app/1", ConfigEntityType.CLIENT_ID),)),
    ("clients/<default>", (ConfigEntity("", ConfigEntityType.DEFAULT_CLIENT_ID),)),
    ("users/a%40b/clients/<default>", (ConfigEntity("a@b", ConfigEntityType.USER),
                                       ConfigEntity("", ConfigEntityType.DEFAULT_CLIENT_ID))),
    ("users/<default>/clients/app", (ConfigEntity("", ConfigEntityType.DEFAULT_USER),
                                     ConfigEntity("app", ConfigEntityType.CLIENT_ID))),
])
def test_client_quota_entities_follow_their_config_path(path, entities):
    assert ClientQuotaEntity.from_path(path) == ClientQuotaEntity(entities, path)


@pytest.mark.parametrize("path", ["ips/10.0.0.1", "ips/<default>", "topics/orders", "static",
                                  "groups", "groups/etl"])
def test_paths_other_than_client_quotas_have_no_client_quota_entity(path):
    assert ClientQuotaEntity.from_path(path) is None


# -- a user callback behind the manager ----------------------------------------


def test_principals_a_callback_tags_alike_share_one_bucket():
    cb = Tenants({"alice": "acme", "bob": "acme", "carol": "initech"},
                 {"acme": 5000.0, "initech": 7000})
    manager = QuotaManager(callback=cb)
    alice = manager.bucket(PRODUCE, "alice", "app-1")
    bob = manager.bucket(PRODUCE, "bob", "app-2")
    carol = manager.bucket(PRODUCE, "carol", "app-1")
    assert alice is bob
    assert carol is not alice
    assert (alice.user_tag, alice.client_tag, alice.entity) == ("tenant=acme", "", "callback")
    assert (alice.quota, alice.limit) == (5000.0, 5000.0)
    assert (carol.user_tag, carol.limit) == ("tenant=initech", 7000.0)
    assert isinstance(carol.limit, float)
    assert names(manager) == [(PRODUCE, "tenant=acme", ""), (PRODUCE, "tenant=initech", "")]
    # what one records, the other is held by
    assert alice.record(20000, 0.0) > 0
    assert bob.debt_seconds(0.0) > 0


def test_no_tags_no_bucket_and_no_limit_no_bucket():
    cb = Tenants({"alice": "acme"}, {(ClientQuotaType.PRODUCE, "acme"): 5000.0})
    manager = QuotaManager(callback=cb)
    assert manager.bucket(PRODUCE, "mallory", "app") is None  # tags None
    assert manager.bucket(FETCH, "alice", "app") is None  # limit None: unlimited
    client = manager.client("alice", "app")
    assert client.produce.limit == 5000.0
    assert (client.fetch, client.request, client.mutation) == (None, None, None)
    assert names(manager) == [(PRODUCE, "tenant=acme", "")]


def test_the_manager_asks_a_callback_with_the_quota_type_principal_and_client_id():
    asked = []

    class Asking(Tenants):
        def quota_metric_tags(self, quota_type, principal, client_id):
            asked.append((quota_type, principal, client_id))
            return {"tenant": "acme"}

    manager = QuotaManager(callback=Asking(limits={"acme": 1.0}))
    manager.client("alice", None)
    assert asked == [(t, KafkaPrincipal("User", "alice"), "") for t in (
        ClientQuotaType.PRODUCE, ClientQuotaType.FETCH, ClientQuotaType.REQUEST,
        ClientQuotaType.CONTROLLER_MUTATION)]
    assert str(asked[0][1]) == "User:alice"


@pytest.mark.parametrize("bad", [0, 0.0, -1, "x", True, math.nan, math.inf, [1000]])
def test_a_limit_that_is_not_a_positive_number_is_a_callback_error(bad):
    manager = QuotaManager(callback=Tenants({"alice": "acme"}, {"acme": bad}))
    with pytest.raises(QuotaCallbackError, match="Tenants.quota_limit returned .*not a positive"):
        manager.bucket(PRODUCE, "alice", "app")
    with pytest.raises(QuotaCallbackError, match="Tenants.quota_limit returned"):
        manager.client("alice", "app")
    assert manager.buckets == {}


@pytest.mark.parametrize("bad", [["tenant", "acme"], {"tenant": 1}, {1: "acme"}, "tenant=acme"])
def test_tags_that_are_not_a_mapping_of_str_to_str_are_a_callback_error(bad):
    class BadTags(Tenants):
        def quota_metric_tags(self, quota_type, principal, client_id):
            return bad

    manager = QuotaManager(callback=BadTags(limits={"acme": 1.0}))
    with pytest.raises(QuotaCallbackError, match="BadTags.quota_metric_tags returned"):
        manager.bucket(PRODUCE, "alice", "app")


def test_a_callback_that_raises_is_a_callback_error_naming_the_method():
    class Failing(Tenants):
        def quota_metric_tags(self, quota_type, principal, client_id):
            raise LookupError("directory down")

    manager = QuotaManager(callback=Failing())
    with pytest.raises(QuotaCallbackError) as info:
        manager.client("alice", "app")
    assert str(info.value) == ("quota callback Failing.quota_metric_tags failed: "
                               "LookupError: directory down")
    assert isinstance(info.value.__cause__, LookupError)

    class FailingLimit(Tenants):
        def quota_limit(self, quota_type, metric_tags):
            raise ZeroDivisionError("oops")

    manager = QuotaManager(callback=FailingLimit({"alice": "acme"}))
    with pytest.raises(QuotaCallbackError, match=r"FailingLimit\.quota_limit failed: "
                                                 "ZeroDivisionError: oops"):
        manager.bucket(PRODUCE, "alice", "app")


def test_the_callback_is_told_the_quotas_a_source_sets_and_removes():
    cb = Tenants()
    manager = QuotaManager({
        "users/alice": {PRODUCE: 100, FETCH: 200.0},
        "users/<default>/clients/app%2F1": {REQUEST_RATE: 5.0},
        "ips/10.0.0.1": {"connection_creation_rate": 3.0},
        "topics/orders": {PRODUCE: 1000.0},
        "static": {PRODUCE: 50.0},
    }, callback=cb)
    alice = ClientQuotaEntity((ConfigEntity("alice", ConfigEntityType.USER),), "users/alice")
    app = ClientQuotaEntity((ConfigEntity("", ConfigEntityType.DEFAULT_USER),
                             ConfigEntity("app/1", ConfigEntityType.CLIENT_ID)),
                            "users/<default>/clients/app%2F1")
    # the initial snapshot, client entities only (no ips, topics or static)
    # (in a stable order: by path, then produce, fetch, request, mutation)
    assert cb.calls == [
        ("update", ClientQuotaType.REQUEST, app, 5.0),
        ("update", ClientQuotaType.PRODUCE, alice, 100.0),
        ("update", ClientQuotaType.FETCH, alice, 200.0),
    ]
    assert isinstance(cb.calls[0][3], float)
    cb.calls.clear()
    manager.update({
        "users/alice": {PRODUCE: 100.0, MUTATION: 2.0},  # produce unchanged, fetch gone
        "clients/<default>": {FETCH: 300.0, OBSERVE_ONLY: 1},
        "ips/10.0.0.1": {"connection_creation_rate": 9.0},  # changed, not a client quota
        "topics/orders": {PRODUCE: 2000.0},
        "topics/audit": {FETCH: 10.0},
    })
    default_client = ClientQuotaEntity((ConfigEntity("", ConfigEntityType.DEFAULT_CLIENT_ID),),
                                       "clients/<default>")
    assert cb.calls == [
        ("update", ClientQuotaType.FETCH, default_client, 300.0),
        ("remove", ClientQuotaType.REQUEST, app),
        ("remove", ClientQuotaType.FETCH, alice),
        ("update", ClientQuotaType.CONTROLLER_MUTATION, alice, 2.0),
    ]
    cb.calls.clear()
    manager.update(manager.config.snapshot)  # nothing changed: nothing told
    assert cb.calls == []


def test_a_quota_source_change_has_callback_buckets_limited_again():
    cb = Tenants({"alice": "acme"}, {"acme": 1000.0})
    manager = QuotaManager(callback=cb)
    client = manager.client("alice", "app")
    bucket = client.produce
    cb.limits["acme"] = 4000.0
    generation = manager.generation
    manager.update({"users/alice": {PRODUCE: 1.0}})
    assert manager.generation == generation + 1
    assert bucket.limit == 4000.0  # asked again at the update, same bucket
    assert client.current().produce is bucket
    cb.limits.pop("acme")
    manager.update({})
    assert manager.buckets == {}  # no limit any more: dropped
    assert client.current().produce is None


def test_no_reset_required_leaves_everything_as_it_is():
    cb = Tenants({"alice": "acme"}, {"acme": 1000.0})
    manager = QuotaManager(callback=cb)
    bucket = manager.bucket(PRODUCE, "alice", "app")
    cb.limits["acme"] = 2000.0  # not asked for until a reset
    assert manager.poll_callback() is False
    assert manager.generation == 0
    assert bucket.limit == 1000.0


def test_a_reset_asks_every_limit_again_and_drops_buckets_without_one():
    cb = Tenants({"alice": "acme", "carol": "initech"},
                 {(ClientQuotaType.PRODUCE, "acme"): 1000.0,
                  (ClientQuotaType.PRODUCE, "initech"): 3000.0})
    manager = QuotaManager(callback=cb)
    alice = manager.client("alice", "app")
    carol = manager.client("carol", "app")
    acme = alice.produce
    assert carol.produce.limit == 3000.0
    cb.limits = {(ClientQuotaType.PRODUCE, "acme"): 2500.0}  # initech has no quota any more
    cb.reset = True
    assert manager.poll_callback() is True
    assert manager.generation == 1
    assert acme.limit == acme.quota == 2500.0
    assert acme.tokens.limit == 2500.0
    assert names(manager) == [(PRODUCE, "tenant=acme", "")]
    assert alice.current().produce is acme
    assert carol.current().produce is None


def test_a_limit_that_fails_at_a_reset_drops_that_bucket():
    cb = Tenants({"alice": "acme"}, {"acme": 1000.0})
    manager = QuotaManager(callback=cb)
    manager.bucket(PRODUCE, "alice", "app")
    cb.limits["acme"] = -5.0
    cb.reset = True
    assert manager.poll_callback() is True
    assert manager.buckets == {}


def test_a_callback_failing_its_reset_poll_leaves_the_quotas_as_they_are():
    class Failing(Tenants):
        def quota_reset_required(self, quota_type):
            raise OSError("budget file unreadable")

    cb = Failing({"alice": "acme"}, {"acme": 1000.0})
    manager = QuotaManager(callback=cb)
    bucket = manager.bucket(PRODUCE, "alice", "app")
    cb.limits["acme"] = 9.0
    assert manager.poll_callback() is False
    assert manager.generation == 0
    assert bucket.limit == 1000.0
    assert list(manager.buckets.values()) == [bucket]


def test_without_a_callback_polling_and_cluster_updates_do_nothing():
    manager = QuotaManager({"users/alice": {PRODUCE: 10.0}})
    assert manager.poll_callback() is False
    assert manager.update_cluster(Cluster(frozenset({1}), {("t", 0): 1})) is False
    assert manager.generation == 0


def test_new_cluster_metadata_the_callback_acts_on_bumps_the_generation():
    cb = Tenants({"alice": "acme"}, {"acme": 1000.0})
    manager = QuotaManager(callback=cb)
    cluster = Cluster(frozenset({1, 2}), {("orders", 0): 1})
    assert manager.update_cluster(cluster) is False  # the callback did not care
    assert manager.generation == 0
    cb.cluster_changed = True
    assert manager.update_cluster(cluster) is True
    assert manager.generation == 1
    assert cb.calls == [("cluster", cluster), ("cluster", cluster)]


def test_a_callback_failing_on_cluster_metadata_leaves_the_quotas():
    class Failing(Tenants):
        def update_cluster_metadata(self, cluster):
            raise RuntimeError("no")

    manager = QuotaManager(callback=Failing())
    assert manager.update_cluster(Cluster()) is False
    assert manager.generation == 0


def test_another_workers_callback_bucket_is_made_here_with_the_callbacks_limit():
    cb = Tenants({"alice": "acme"}, {"acme": 1000.0})
    other = QuotaManager(callback=Tenants({"alice": "acme"}, {"acme": 1000.0}))
    told = other.bucket(PRODUCE, "alice", "app").exchanged_entity  # what its worker sends
    manager = QuotaManager(callback=cb)
    bucket = manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "tenant=acme", "", told)
    assert (bucket.limit, bucket.entity, bucket.user_tag) == (1000.0, "callback", "tenant=acme")
    assert manager.bucket(PRODUCE, "alice", "app") is bucket  # the client finds it
    assert manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "tenant=gone", "",
                                     told.replace("acme", "gone")) is None
    cb.limits["bad"] = "fast"
    assert manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "tenant=bad", "",
                                     told.replace("acme", "bad")) is None
    # a principal's own bucket of the same names is another bucket
    assert manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "tenant=acme", "",
                                     "users/tenant=acme") is None


def test_closing_the_callback_closes_it_once_and_survives_a_failing_close():
    cb = Tenants()
    manager = QuotaManager(callback=cb)
    manager.close_callback()
    manager.close_callback()
    assert cb.closed == 1 and manager.callback is None

    class FailingClose(Tenants):
        def close(self):
            raise RuntimeError("already closed")

    manager = QuotaManager(callback=FailingClose())
    manager.close_callback()  # logged, not raised
    assert manager.callback is None


# -- DefaultQuotaCallback ------------------------------------------------------

LEVELS = [
    "users/u/clients/c", "users/u/clients/<default>", "users/u",
    "users/<default>/clients/c", "users/<default>/clients/<default>", "users/<default>",
    "clients/c", "clients/<default>",
]


@pytest.mark.parametrize("level", range(len(LEVELS)))
def test_the_default_callback_resolves_each_kip55_level_as_the_proxy_does(level):
    snapshot = {path: {PRODUCE: float(i + 1), FETCH: 100.0 + i}
                for i, path in enumerate(LEVELS) if i >= level}
    expected = QuotaConfig(snapshot).resolve("u", "c", PRODUCE)
    assert expected.entity == LEVELS[level]
    cb = DefaultQuotaCallback()
    manager = QuotaManager(snapshot, callback=cb)
    tags = cb.quota_metric_tags(ClientQuotaType.PRODUCE, KafkaPrincipal("User", "u"), "c")
    assert set(tags) == {"user", "client-id"}
    assert (tags["user"], tags["client-id"]) == (expected.user_tag, expected.client_tag)
    assert cb.quota_limit(ClientQuotaType.PRODUCE, tags) == expected.limit
    bucket = manager.bucket(PRODUCE, "u", "c")
    assert (bucket.limit, bucket.user_tag, bucket.client_tag) == (
        expected.limit, expected.user_tag, expected.client_tag)
    assert manager.bucket(FETCH, "u", "c").limit == 100.0 + level


def test_the_default_callback_follows_updates_and_removals():
    cb = DefaultQuotaCallback()
    manager = QuotaManager({"users/u": {PRODUCE: 10.0}}, callback=cb)
    client = manager.client("u", "c")
    bucket = client.produce
    manager.update({"users/u": {PRODUCE: 20.0}})
    assert bucket.limit == 20.0
    manager.update({"users/u": {PRODUCE: 20.0}, "users/u/clients/c": {PRODUCE: 5.0}})
    assert client.current().produce.limit == 5.0
    assert client.produce.client_tag == "c"
    manager.update({})
    assert manager.buckets == {}
    assert client.current().produce is None
    assert cb.quota_metric_tags(ClientQuotaType.PRODUCE, KafkaPrincipal("User", "u"), "c") is None


# The default callback is handed the whole snapshot (quota_snapshot), so the static
# quota.producer.default / quota.consumer.default (level 9) holds through it too.
def test_the_default_callback_resolves_the_static_default_as_the_proxy_does():
    snapshot = {"static": {PRODUCE: 99.0}}
    expected = QuotaConfig(snapshot).resolve("u", "c", PRODUCE)
    assert (expected.limit, expected.entity) == (99.0, "static")
    manager = QuotaManager(snapshot, callback=DefaultQuotaCallback())
    bucket = manager.bucket(PRODUCE, "u", "c")
    assert bucket is not None and bucket.limit == 99.0
    assert (bucket.user_tag, bucket.client_tag) == ("", "c")


# ... and so do quota groups.
def test_the_default_callback_resolves_quota_groups_as_the_proxy_does():
    snapshot = {"groups": {"etl": {"members": ["User:a", "User:b"], PRODUCE: 5.0}}}
    expected = QuotaConfig(snapshot).resolve("a", "c", PRODUCE)
    assert (expected.limit, expected.user_tag) == (5.0, "group=etl")
    manager = QuotaManager(snapshot, callback=DefaultQuotaCallback())
    a = manager.bucket(PRODUCE, "a", "c")
    assert a is not None and a.limit == 5.0
    assert manager.bucket(PRODUCE, "b", "d") is a


# A TLS principal is a "CN=...,O=..." name: under the default callback it keeps its
# own quota (a callback's tags are never read back out of a bucket's names).
def test_the_default_callback_keeps_the_quota_of_a_tls_principal():
    snapshot = {"users/CN%3Dalice%2CO%3DExample": {PRODUCE: 100.0},
                "users/<default>": {PRODUCE: 7.0}}
    assert QuotaConfig(snapshot).resolve("CN=alice,O=Example", "c", PRODUCE).limit == 100.0
    manager = QuotaManager(snapshot, callback=DefaultQuotaCallback())
    dn = manager.bucket(PRODUCE, "CN=alice,O=Example", "c")
    assert dn is not None and dn.limit == 100.0


# A principal named "user=bob" does not count in bob's bucket under the default callback.
def test_the_default_callback_keeps_a_principal_named_like_a_tag_out_of_anothers_bucket():
    manager = QuotaManager({"users/<default>": {PRODUCE: 7.0}}, callback=DefaultQuotaCallback())
    assert manager.bucket(PRODUCE, "user=bob", "c") is not manager.bucket(PRODUCE, "bob", "c")


# A principal named "group=etl" is not read as quota group etl's tags under the
# default callback: users/<default> applies to it.
def test_the_default_callback_gives_a_principal_named_like_a_group_its_own_quota():
    snapshot = {"users/<default>": {PRODUCE: 7.0},
                "groups": {"etl": {"members": ["User:etl-*"], PRODUCE: 5.0}}}
    assert QuotaConfig(snapshot).resolve("group=etl", "c", PRODUCE).limit == 7.0
    manager = QuotaManager(snapshot, callback=DefaultQuotaCallback())
    bucket = manager.bucket(PRODUCE, "group=etl", "c")
    assert bucket is not None and bucket.limit == 7.0


# -- LeaderProportional --------------------------------------------------------

ALICE_QUOTAS = {"users/alice": {PRODUCE: 1e6, FETCH: 2e6, REQUEST_RATE: 100.0}}


def orders_cluster(leaders_of_orders, others=None):
    """Partition p of "orders" led by leaders_of_orders[p]; ``others`` more."""
    leaders = {("orders", p): n for p, n in enumerate(leaders_of_orders)}
    leaders.update(others or {})
    return Cluster(frozenset({1, 2, 3}), leaders)


def leader_proportional(snapshot=ALICE_QUOTAS, topics=None):
    cb = load_callback("kthrottle.policy.quota_callback:LeaderProportional",
                       {"topics": topics or {"alice": ["orders*"]}})
    return cb, QuotaManager(snapshot, callback=cb)


def test_before_leaders_are_known_every_broker_gets_the_whole_quota():
    _, manager = leader_proportional()
    one, two = manager.client("alice", "app", broker=1), manager.client("alice", "app", broker=2)
    assert one.produce is two.produce
    assert (one.produce.limit, one.produce.user_tag) == (1e6, "alice")  # no broker tag
    assert manager.client("alice", "app", broker=None).produce is one.produce


def test_each_broker_gets_the_share_of_the_partitions_it_leads():
    _, manager = leader_proportional()
    clients = {b: manager.client("alice", "app", broker=b) for b in (1, 2, 3)}
    # broker 1 leads 3 of 4 orders partitions, broker 2 one, broker 3 none of them
    # ("audit" is not alice's, "orders-eu" is: no partitions of it here though)
    cluster = orders_cluster([1, 1, 2, 1], {("audit", 0): 3, ("audit", 1): 3})
    assert manager.update_cluster(cluster) is True
    assert manager.generation == 1
    one, two, three = (clients[b].current() for b in (1, 2, 3))
    assert one.produce.limit == pytest.approx(0.75e6)
    assert two.produce.limit == pytest.approx(0.25e6)
    assert three.produce.limit == pytest.approx(NO_SHARE_FRACTION * 1e6) == pytest.approx(1000.0)
    assert one.fetch.limit == pytest.approx(1.5e6)
    assert two.fetch.limit == pytest.approx(0.5e6)
    assert one.produce.user_tag == "broker=1&user=alice"
    assert len({id(one.produce), id(two.produce), id(three.produce)}) == 3
    # the request quota is not split: one bucket for every broker, whole
    assert one.request is two.request is three.request
    assert (one.request.limit, one.request.user_tag) == (100.0, "alice")


def test_once_leaders_are_known_a_connection_to_no_known_broker_gets_a_sliver():
    _, manager = leader_proportional()
    manager.update_cluster(orders_cluster([1, 1, 2, 1]))
    unplaced = manager.bucket(PRODUCE, "alice", "app", broker=None)
    assert unplaced.limit == pytest.approx(NO_SHARE_FRACTION * 1e6)
    assert unplaced is not manager.bucket(PRODUCE, "alice", "app", broker=1)


def test_partitions_without_a_leader_count_for_no_broker():
    _, manager = leader_proportional()
    manager.update_cluster(orders_cluster([1, 2, None, -1]))
    assert manager.bucket(PRODUCE, "alice", "app", broker=1).limit == pytest.approx(0.5e6)
    assert manager.bucket(PRODUCE, "alice", "app", broker=2).limit == pytest.approx(0.5e6)


def test_limits_follow_the_leaders_as_they_move():
    cb, manager = leader_proportional()
    one, two = manager.client("alice", "app", broker=1), manager.client("alice", "app", broker=2)
    manager.update_cluster(orders_cluster([1, 1, 2, 1]))
    before = one.current().produce
    assert before.limit == pytest.approx(0.75e6)
    # the same leaders again: nothing to do
    assert manager.update_cluster(orders_cluster([1, 1, 2, 1])) is False
    assert manager.generation == 1
    assert manager.update_cluster(orders_cluster([2, 2, 2, 1])) is True
    assert one.current().produce.limit == pytest.approx(0.25e6)
    assert two.current().produce.limit == pytest.approx(0.75e6)
    assert one.produce is before  # the same bucket, limited again
    assert manager.update_cluster(orders_cluster([2, 2, 2, 2])) is True
    assert one.current().produce.limit == pytest.approx(1000.0)
    assert two.current().produce.limit == pytest.approx(1e6)
    assert cb.share("alice", 2) == 1.0


def test_a_principal_with_no_partitions_or_no_topics_gets_the_whole_quota_everywhere():
    snapshot = {"users/<default>": {PRODUCE: 1e6}}
    _, manager = leader_proportional(snapshot, {"alice": ["payments"], "*": ["shared"]})
    manager.update_cluster(orders_cluster([1, 2], {("shared", 0): 1, ("shared", 1): 1}))
    # alice's topic has no partitions here: whole quota, no broker tag
    alice = manager.bucket(PRODUCE, "alice", "app", broker=2)
    assert (alice.limit, alice.user_tag) == (1e6, "alice")
    # anyone else goes by "*": all of "shared" is on broker 1
    assert manager.bucket(PRODUCE, "bob", "app", broker=1).limit == pytest.approx(1e6)
    assert manager.bucket(PRODUCE, "bob", "app", broker=2).limit == pytest.approx(1000.0)


def test_a_client_id_quota_shared_by_principals_is_split_per_principal():
    snapshot = {"clients/app": {PRODUCE: 1e6}}
    _, manager = leader_proportional(snapshot, {"alice": ["orders"], "bob": ["audit"]})
    manager.update_cluster(orders_cluster([1, 1, 1, 2], {("audit", 0): 2}))
    alice = manager.bucket(PRODUCE, "alice", "app", broker=1)
    bob = manager.bucket(PRODUCE, "bob", "app", broker=1)
    assert alice is not bob
    assert alice.limit == pytest.approx(0.75e6)
    assert bob.limit == pytest.approx(1000.0)
    assert (alice.user_tag, alice.client_tag) == ("broker=1&principal=alice&user=", "app")
    assert manager.bucket(PRODUCE, "bob", "app", broker=2).limit == pytest.approx(1e6)


# -- Cluster -------------------------------------------------------------------


def test_a_cluster_goes_to_json_and_back():
    cluster = Cluster(frozenset({3, 1, 2}), {("orders", 1): 2, ("orders", 0): 1,
                                            ("audit", 0): None, ("audit", 1): -1})
    data = cluster.to_json()
    assert isinstance(data, bytes)
    again = Cluster.from_json(data)
    assert again == cluster
    assert again.partitions_led(["orders", "audit"]) == {1: 1, 2: 1}
    assert Cluster.from_json(Cluster().to_json()) == Cluster()


@pytest.mark.parametrize("garbage", [
    b"", b"not json", b"[]", b"null", b'"leaders"', b"\xff\xfe",
    b'{"brokers": [1]}',
    b'{"leaders": []}',
    b'{"brokers": 5, "leaders": []}',
    b'{"brokers": ["one"], "leaders": []}',
    b'{"brokers": [1], "leaders": 5}',
    b'{"brokers": [1], "leaders": [["orders", 0]]}',
    b'{"brokers": [1], "leaders": [["orders", "zero", 1]]}',
    b'{"brokers": [1], "leaders": [["orders", 0, {}]]}',
])
def test_from_json_refuses_what_is_not_partition_leaders(garbage):
    with pytest.raises(ValueError):
        Cluster.from_json(garbage)


# -- the example callback (examples/quota_callback.py) --------------------------

TEAMS = """
[teams.analytics]
members = ["alice", "bob"]
producer_byte_rate = %d
"""


def test_the_example_team_callback_shares_a_budget_and_follows_its_file(tmp_path,
                                                                       fresh_modules):
    budgets = tmp_path / "teams.toml"
    budgets.write_text(TEAMS % 1048576)
    cb = load_callback("%s:TeamQuotas" % EXAMPLE, {"budgets": str(budgets)})
    manager = QuotaManager(callback=cb)
    alice = manager.client("alice", "app-1")
    bob = manager.client("bob", "app-2")
    carol = manager.client("carol", "app-1")
    assert alice.produce is bob.produce
    assert (alice.produce.limit, alice.produce.user_tag) == (1048576.0, "team=analytics")
    assert alice.fetch is None  # the team has no fetch budget
    assert (carol.produce, carol.fetch, carol.request) == (None, None, None)
    assert manager.poll_callback() is False  # the file has not changed
    # a new budget, and carol joins
    before = os.stat(budgets)
    budgets.write_text(TEAMS.replace('"bob"', '"bob", "carol"') % 2097152)
    os.utime(budgets, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))
    assert manager.poll_callback() is True
    assert manager.poll_callback() is False  # read once
    assert alice.current().produce.limit == 2097152.0
    assert carol.current().produce is alice.produce


def test_the_example_team_callback_keeps_its_budgets_while_the_file_is_gone(tmp_path,
                                                                           fresh_modules):
    budgets = tmp_path / "teams.toml"
    budgets.write_text(TEAMS % 1000)
    manager = QuotaManager(callback=load_callback("%s:TeamQuotas" % EXAMPLE,
                                                  {"budgets": str(budgets)}))
    bucket = manager.bucket(PRODUCE, "alice", "app")
    budgets.unlink()
    assert manager.poll_callback() is False
    assert bucket.limit == 1000.0


# -- quota groups (no callback) --------------------------------------------------


def test_the_users_of_a_group_share_one_bucket():
    manager = QuotaManager({"groups": {"etl": {
        "members": ["User:a", "User:b", "User:c"], PRODUCE: 3e6}}})
    a = manager.bucket(PRODUCE, "a", "x")
    assert manager.bucket(PRODUCE, "b", "y") is a
    assert manager.bucket(PRODUCE, "c", "x") is a
    assert (a.entity, a.user_tag, a.client_tag, a.limit) == ("groups/etl", "group=etl", "", 3e6)
    assert manager.bucket(PRODUCE, "d", "x") is None
    assert manager.bucket(FETCH, "a", "x") is None  # the group has no fetch quota


def test_a_user_member_beats_every_kip55_level():
    snapshot = {path: {PRODUCE: 1.0} for path in LEVELS}
    snapshot["static"] = {PRODUCE: 1.0}
    snapshot["groups"] = {"etl": {"members": ["User:u"], PRODUCE: 42.0}}
    r = QuotaConfig(snapshot).resolve("u", "c", PRODUCE)
    assert (r.limit, r.entity) == (42.0, "groups/etl")


@pytest.mark.parametrize("level", LEVELS[:6])
def test_a_client_id_member_does_not_beat_a_level_naming_the_user(level):
    snapshot = {level: {PRODUCE: 1.0}, "clients/c": {PRODUCE: 2.0},
                "groups": {"apps": {"members": ["client-id:c"], PRODUCE: 42.0}}}
    r = QuotaConfig(snapshot).resolve("u", "c", PRODUCE)
    assert (r.limit, r.entity) == (1.0, level)


@pytest.mark.parametrize("level", ["clients/c", "clients/<default>", "static"])
def test_a_client_id_member_beats_the_client_levels_and_the_static_default(level):
    snapshot = {level: {PRODUCE: 1.0},
                "groups": {"apps": {"members": ["client-id:c"], PRODUCE: 42.0}}}
    manager = QuotaManager(snapshot)
    bucket = manager.bucket(PRODUCE, "u", "c")
    assert (bucket.limit, bucket.entity, bucket.user_tag) == (42.0, "groups/apps", "group=apps")
    assert manager.bucket(PRODUCE, "v", "c") is bucket  # across users
    other = manager.bucket(PRODUCE, "u", "d")
    assert (other is None) == (level == "clients/c")


def test_the_first_group_with_the_member_and_the_key_wins():
    snapshot = {"groups": {
        "first": {"members": ["User:a"], FETCH: 1.0},
        "second": {"members": ["User:a*"], PRODUCE: 2.0, FETCH: 20.0},
        "third": {"members": ["User:a"], PRODUCE: 3.0},
    }}
    config = QuotaConfig(snapshot)
    assert config.resolve("a", "c", FETCH).entity == "groups/first"
    assert config.resolve("a", "c", PRODUCE).entity == "groups/second"  # first lacks produce
    assert config.resolve("ab", "c", FETCH).entity == "groups/second"


def test_wildcard_members_match_any_run_of_characters_and_nothing_else_is_special():
    config = QuotaConfig({"groups": {
        "teams": {"members": ["User:team-*"], PRODUCE: 1.0},
        "etl": {"members": ["client-id:etl-*-job"], PRODUCE: 2.0},
        "dotted": {"members": ["User:a.c", "User:x?z"], PRODUCE: 3.0},
        "everyone": {"members": ["User:*"], FETCH: 4.0},
    }})
    assert config.resolve("team-red", "c", PRODUCE).entity == "groups/teams"
    assert config.resolve("team-", "c", PRODUCE).entity == "groups/teams"
    assert config.resolve("team", "c", PRODUCE).entity is None
    assert config.resolve("my-team-red", "c", PRODUCE).entity is None
    assert config.resolve("u", "etl-nightly-job", PRODUCE).entity == "groups/etl"
    assert config.resolve("u", "etl-nightly-job2", PRODUCE).entity is None
    assert config.resolve("a.c", "c", PRODUCE).entity == "groups/dotted"
    assert config.resolve("abc", "c", PRODUCE).entity is None
    assert config.resolve("xyz", "c", PRODUCE).entity is None
    assert config.resolve("x?z", "c", PRODUCE).entity == "groups/dotted"
    assert config.resolve("anyone at all", "", FETCH).entity == "groups/everyone"


@pytest.mark.parametrize("member, parsed", [
    ("User:alice", ("User:", "alice")),
    ("User:team-*", ("User:", "team-*")),
    ("client-id:etl-*", ("client-id:", "etl-*")),
])
def test_member_patterns_name_a_user_or_a_client_id(member, parsed):
    assert member_pattern(member) == parsed


@pytest.mark.parametrize("member", ["alice", "User:", "client-id:", "Group:etl", "user:alice",
                                    None, 5])
def test_member_patterns_of_any_other_kind_are_refused(member):
    with pytest.raises(ValueError, match="a group member is"):
        member_pattern(member)
    with pytest.raises(ValueError):
        QuotaConfig({"groups": {"g": {"members": [member], PRODUCE: 1.0}}})


def test_an_observe_only_group_measures_and_delays_no_one():
    manager = QuotaManager({"groups": {"etl": {
        "members": ["User:a"], PRODUCE: 1000.0, OBSERVE_ONLY: 1}}})
    bucket = manager.bucket(PRODUCE, "a", "x")
    assert bucket.observe_only
    assert bucket.record(50000, 0.0) == 0
    assert bucket.observed == 1 and bucket.throttled == 0


def test_group_buckets_stay_while_the_group_does_and_go_with_it():
    group = {"members": ["User:a", "User:b"], PRODUCE: 1000.0}
    manager = QuotaManager({"groups": {"etl": group}, "users/z": {PRODUCE: 1.0}})
    client = manager.client("a", "x")
    bucket = client.produce
    bucket.record(100, 0.0)
    manager.update({"groups": {"etl": dict(group, **{PRODUCE: 2000.0})},
                    "users/z": {PRODUCE: 1.0}})
    assert manager.buckets[(PRODUCE, "group=etl", "", "groups/etl")] is bucket
    assert client.current().produce is bucket
    assert bucket.limit == 2000.0 and bucket.total == 100
    manager.update({"users/z": {PRODUCE: 1.0}})
    assert names(manager) == []
    assert client.current().produce is None


def test_another_workers_group_bucket_is_made_here_from_the_group():
    manager = QuotaManager({"groups": {"etl": {
        "members": ["User:a"], PRODUCE: 1000.0, OBSERVE_ONLY: 1}}})
    bucket = manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "group=etl", "", "groups/etl")
    assert (bucket.limit, bucket.entity, bucket.observe_only) == (1000.0, "groups/etl", True)
    assert manager.bucket(PRODUCE, "a", "x") is bucket
    assert manager.bucket_for_others(CLIENT_BUCKETS, FETCH, "group=etl", "",
                                     "groups/etl") is None  # no such key
    assert manager.bucket_for_others(CLIENT_BUCKETS, PRODUCE, "group=gone", "",
                                     "groups/gone") is None


# A group's bucket key has a fourth part (its scope), so a principal named
# "group=etl" at a user level does not count in group etl's bucket.
def test_a_principal_named_like_a_group_tag_does_not_share_the_groups_bucket():
    manager = QuotaManager({"users/<default>": {PRODUCE: 7.0},
                            "groups": {"etl": {"members": ["User:a"], PRODUCE: 5.0}}})
    group = manager.bucket(PRODUCE, "a", "c")
    assert (group.limit, group.entity) == (5.0, "groups/etl")
    impostor = manager.bucket(PRODUCE, "group=etl", "c")
    assert impostor.limit == 7.0
    assert impostor is not group
    assert (group.limit, group.entity) == (5.0, "groups/etl")


def test_leaders_a_metadata_answer_names_reach_the_callback_merged_with_those_known():
    cb = LeaderProportional()
    cb.configure({"topics": {"alice": ["orders"]}})
    manager = QuotaManager({"users/alice": {PRODUCE: 900.0}}, callback=cb)
    manager.update_cluster(Cluster(frozenset({1, 2, 3}),
                                   {("orders", 0): 1, ("orders", 1): 1, ("orders", 2): 2}))
    on3 = manager.client("alice", "app", 3)
    assert on3.produce.limit == pytest.approx(0.9)  # leads none: a sliver
    generation = manager.generation
    # nothing moved: nothing asked again
    assert manager.note_leaders({("orders", 0): 1}) is False
    assert manager.generation == generation
    # a client's Metadata answer says partition 2 moved to node 3
    assert manager.note_leaders({("orders", 2): 3}) is True
    assert manager.generation > generation
    assert manager.cluster.leaders == {("orders", 0): 1, ("orders", 1): 1, ("orders", 2): 3}
    assert on3.current().produce.limit == pytest.approx(300.0)
    assert manager.client("alice", "app", 2).produce.limit == pytest.approx(0.9)


def test_a_groups_bucket_takes_its_fleet_share_and_is_reported_like_any_other():
    from kthrottle.proxy.fleet import UsageTracker

    manager = QuotaManager({"groups": {"etl": {"members": ["User:a", "User:b"],
                                               PRODUCE: 3000.0}},
                            "users/a": {PRODUCE: 50.0}})
    reporter = UsageTracker(manager, "proxy-1", 1.0, 0.0)
    bucket = manager.bucket(PRODUCE, "a", "x")
    bucket.record(100, 0.5)
    # the fleet names a bucket by its tags: the group's share applies to the group's bucket
    manager.apply_shares({(PRODUCE, "group=etl", ""): 1000.0}, prior=0.5, fleet_size=3)
    assert bucket.limit == 1000.0
    report = reporter.report(1.0, 1_000_000.0)
    (usage,) = report.buckets
    assert (usage.key, usage.user, usage.client_id, usage.entity, usage.quota) == (
        PRODUCE, "group=etl", "", "groups/etl", 3000.0)
