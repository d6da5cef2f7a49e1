"""What the core asks of every filter alike (proxy/filter.py's lifecycle:
start and stop, metrics, status, degraded, api_ranges, declared
capabilities), and what a client connection is given of the server (its
ConnectionEnv), without I/O."""
import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest

from kthrottle.policy.storage import StoragePolicy
from kthrottle.proxy import connection
from kthrottle.proxy.admin import METRICS, filter_metrics
from kthrottle.proxy.discovery import ApiVersionsCache
from kthrottle.proxy.filter import Filter, Services
from kthrottle.proxy.filters import REGISTERED
from kthrottle.proxy.filters.sasl_passthrough import SaslPassthrough
from kthrottle.proxy.filters.sasl_terminate import SaslTerminate
from kthrottle.proxy.filters.storage import StorageThrottle
from kthrottle.proxy.status import filters_report

pytestmark = pytest.mark.unit

BY_NAME = {m.name: m for m in METRICS}


def storage():
    return StorageThrottle(StoragePolicy("cluster", "PAUSE", 120.0, "cluster"))


def test_a_filter_that_declares_nothing_changes_nothing():
    f = Filter()
    assert asyncio.run(f.start(Services())) is None and asyncio.run(f.stop()) is None
    ranges = ((0, 0, 11), (18, 0, 4))
    assert f.api_ranges(ranges) is ranges
    assert list(f.metrics(None)) == [] and f.status() is None and list(f.degraded()) == []
    assert not f.authenticates_clients and not f.follows_cluster_state


def test_capabilities_are_declared_by_the_filters_that_have_them():
    assert [cls.name for cls in REGISTERED if cls.authenticates_clients] == ["sasl-terminate"]
    assert [cls.name for cls in REGISTERED if cls.follows_cluster_state] == ["storage"]


def test_the_advertised_api_ranges_are_each_filters_in_turn():
    class Without(Filter):
        def __init__(self, key):
            self.key = key

        def api_ranges(self, ranges):
            return tuple(r for r in ranges if r[0] != self.key)

    cache = ApiVersionsCache(config=None)
    cache.filters = (Filter(), Without(19), Without(20))
    assert cache.advertised(((18, 0, 4), (19, 0, 7), (20, 0, 6))) == ((18, 0, 4),)


def test_metric_families_of_one_name_from_several_filters_are_merged():
    terminate = SaslTerminate(["PLAIN"], lambda: None)
    passthrough = SaslPassthrough(["SCRAM-SHA-256"], 0)
    terminate.count_login("PLAIN", True)
    passthrough.count_login(None, False)
    families = {f.name: f for f in filter_metrics([terminate, passthrough, storage()])}
    successful = families["kthrottle_successful_authentication"]
    assert {(s.labels["mechanism"], s.value) for s in successful.samples} == {
        ("PLAIN", 1), ("SCRAM-SHA-256", 0)}
    for f in families.values():  # each as METRICS lists it
        name = f.name + "_total" if f.type == "counter" else f.name
        assert f.documentation == BY_NAME[name].help, name
        for sample in f.samples:
            assert set(sample.labels) == set(BY_NAME[name].labels), name


def test_the_status_page_shows_each_registered_filter_under_its_name():
    assert filters_report(()) == {"storage": {"configured": False}}

    class Hand(Filter):  # made by hand, not registered
        name = "hand"

        def status(self):
            return {"hand": True}

    report = filters_report((storage(), Hand()))
    assert report["storage"]["configured"] and report["storage"]["state"] == "OPEN"
    assert report["hand"] == {"hand": True}


def test_the_storage_filter_refreshes_itself_between_start_and_stop():
    f = storage()

    async def run():
        await f.start(Services())
        assert f._refreshing is not None and not f._refreshing.done()
        task = f._refreshing
        await f.stop()
        return task

    assert asyncio.run(run()).cancelled()
    assert list(f.degraded()) == []  # no cluster state yet: unknown, not yet stale


def test_the_connection_env_holds_exactly_what_a_connection_reads():
    """Every ``env.X`` that connection.py reads is a field, and every field
    is read; the environment is frozen."""
    tree = ast.parse(Path(connection.__file__).read_text())
    read = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name))
            and (getattr(node.value, "attr", None) == "env" or getattr(node.value, "id", None)
                 == "env")}
    fields = {f.name for f in dataclasses.fields(connection.ConnectionEnv)}
    assert read == fields
    env = connection.ConnectionEnv(**dict.fromkeys(fields))
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.loop = None
