"""Fleet-wide quotas on the proxy's side, without I/O: buckets applying their
share of a quota (QuotaManager.apply_shares and the fail-safes), the shares
followed with their age (SharesFollower), the usage reports (UsageTracker),
and the flags. The clock is passed in everywhere."""
import json
import logging

import pytest

from kthrottle.config import ConfigError, build_config, load_toml
from kthrottle.policy.fleet import (
    ProxyShares,
    estimate_demand,
    parse_shares_document,
    parse_usage_report,
    shares_document,
)
from kthrottle.policy.quotas import TOKEN_BUCKET, WINDOW, QuotaManager, QuotaSettings
from kthrottle.proxy.fleet import SharesFollower, UsageTracker
from kthrottle.sources.cluster_state import shares_znode

pytestmark = pytest.mark.unit

PRODUCE = 0  # API key
P = "producer_byte_rate"
F = "consumer_byte_rate"
QUOTA = 100_000.0
MODES = [TOKEN_BUCKET, WINDOW]


def manager(mode=TOKEN_BUCKET, quota=QUOTA, **more):
    snapshot = {"clients/app": {P: quota}, "clients/<default>": {P: quota}}
    snapshot.update(more)
    return QuotaManager(snapshot, QuotaSettings(mode=mode))


def steady_rate(quotas, start, seconds=60.0, size=4096):
    """A client that produces as fast as it is let, waiting out each throttle
    (2 ms round trip); its rate over the last 40 of ``seconds`` from ``start``."""
    now, sent = start, []
    while now < start + seconds:
        delay_ms = quotas.on_request(PRODUCE, size, 1, now).delay_ms
        sent.append((now, size))
        now += 0.002 + delay_ms / 1000.0
    t0 = start + seconds - 40.0
    return sum(n for t, n in sent if t >= t0) / 40.0, now


def near(rate, limit, mode):
    # the token bucket settles on the limit; Kafka's windows ~10% over it
    return 0.97 * limit <= rate <= (1.03 if mode == TOKEN_BUCKET else 1.16) * limit


# QuotaManager: shares applied live ---------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_buckets_limit_follows_its_share_live(mode):
    m = manager(mode)
    quotas = m.client("ANONYMOUS", "app")
    rate, now = steady_rate(quotas, 0.0)
    assert near(rate, QUOTA, mode)
    bucket = quotas.produce
    generation = m.generation

    m.apply_shares({(P, "", "app"): QUOTA / 4}, 0.5, 2)
    assert quotas.produce is bucket  # the same bucket, its rate kept
    assert (bucket.quota, bucket.limit) == (QUOTA, QUOTA / 4)
    assert m.generation == generation  # no connection has to look again
    rate, now = steady_rate(quotas, now)
    assert near(rate, QUOTA / 4, mode)
    if mode == TOKEN_BUCKET:
        assert bucket.tokens.limit == QUOTA / 4
    assert quotas.fetch_max_bytes() is None  # no fetch quota: no bucket, no share

    m.apply_shares({(P, "", "app"): QUOTA * 0.75}, 0.5, 2)
    rate, _ = steady_rate(quotas, now)
    assert near(rate, QUOTA * 0.75, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_new_bucket_gets_the_prior_fraction_of_its_quota(mode):
    m = manager(mode)
    m.apply_shares({(P, "", "app"): QUOTA / 4}, 0.2, 3)
    fresh = m.client("ANONYMOUS", "new-client")  # clients/<default>: a bucket of its own
    assert (fresh.produce.quota, fresh.produce.limit) == (QUOTA, pytest.approx(0.2 * QUOTA))
    rate, _ = steady_rate(fresh, 0.0)
    assert near(rate, 0.2 * QUOTA, mode)
    # the listed one is made with its share, not the prior
    assert m.client("ANONYMOUS", "app").produce.limit == QUOTA / 4


@pytest.mark.parametrize("mode", MODES)
def test_a_configuration_update_keeps_the_shares_applied(mode):
    m = manager(mode)
    quotas = m.client("ANONYMOUS", "app")
    other = m.client("ANONYMOUS", "other")
    _, now = steady_rate(quotas, 0.0, seconds=5.0)
    bucket = quotas.produce
    # shares computed against the fleet quota: the fraction is kept on a new quota
    m.apply_shares({(P, "", "app"): QUOTA / 4}, 0.5, 2, {(P, "", "app"): QUOTA})
    m.update({"clients/app": {P: 2 * QUOTA}, "clients/<default>": {P: 3 * QUOTA}})
    assert quotas.current().produce is bucket
    assert (bucket.quota, bucket.limit) == (2 * QUOTA, QUOTA / 2)
    assert other.current().produce.limit == pytest.approx(1.5 * QUOTA)  # prior x new quota
    rate, now = steady_rate(quotas, now)
    assert near(rate, QUOTA / 2, mode)
    # a share given without its fleet quota stays, never above the quota
    m.apply_shares({(P, "", "app"): QUOTA / 4}, 0.5, 2)
    m.update({"clients/app": {P: QUOTA / 10}, "clients/<default>": {P: QUOTA}})
    assert (quotas.current().produce.quota, bucket.limit) == (QUOTA / 10, QUOTA / 10)
    # an entity that goes away drops its bucket as before; a new one gets its share
    m.update({"users/ANONYMOUS": {P: QUOTA}})
    assert quotas.current().produce is not bucket
    assert quotas.produce.limit == QUOTA / 2  # not listed: prior x quota


def test_equal_and_whole_fail_safes_and_clearing_the_shares():
    m = manager()
    app = m.client("ANONYMOUS", "app").produce
    m.apply_shares({(P, "", "app"): QUOTA / 10}, 0.1, 4)
    assert app.limit == QUOTA / 10
    m.apply_equal()  # the proxies last seen
    assert app.limit == QUOTA / 4
    assert m.client("ANONYMOUS", "later").produce.limit == QUOTA / 4  # new buckets too
    m.apply_equal(2)
    assert app.limit == QUOTA / 2
    m.apply_equal(0)  # nobody known: the whole quota
    assert app.limit == QUOTA
    m.apply_whole()
    assert app.limit == QUOTA
    assert m.client("ANONYMOUS", "later2").produce.limit == QUOTA
    m.apply_shares({(P, "", "app"): QUOTA / 10}, 0.1, 2)
    assert app.limit == QUOTA / 10
    m.clear_shares()
    assert app.limit == QUOTA and m.shares == {}
    assert m.client("ANONYMOUS", "later3").produce.limit == QUOTA


def test_a_share_stays_within_the_quota_and_above_nothing():
    m = manager()
    app = m.client("ANONYMOUS", "app").produce
    m.apply_shares({(P, "", "app"): 0.0}, 0.0, 2)
    assert 0 < app.limit <= QUOTA / 100  # a limit of 0 would divide by zero
    assert app.record(4096, 0.0) >= 0
    m.apply_shares({(P, "", "app"): 5 * QUOTA}, 1.0, 1)
    assert app.limit == QUOTA


# SharesFollower: fresh shares, the fail-safe when they age ----------------------------

def document(generated_at, shares, proxies=("a", "b"), prior=0.5, cycle=3, proxy="a"):
    doc = shares_document(ProxyShares(proxy, tuple(proxies), prior,
                                      [(P, "", c, s, QUOTA) for c, s in shares]),
                          generated_at, cycle)
    return parse_shares_document(json.dumps(doc).encode())


@pytest.mark.parametrize("fail_safe,expected", [("last", QUOTA / 4), ("equal", QUOTA / 3),
                                                ("whole", QUOTA)])
def test_old_shares_take_the_fail_safe_and_fresh_ones_end_it(fail_safe, expected, caplog):
    caplog.set_level(logging.INFO, "kthrottle.fleet")
    m = manager()
    app = m.client("ANONYMOUS", "app").produce
    f = SharesFollower(m, "a", max_age=60.0, fail_safe=fail_safe, znode="/z/shares/a")
    f.check(1000.0)  # nothing read yet: the fail-safe, with the configured quotas at most
    assert f.fail_safe_active and f.age(1000.0) is None
    assert "no quota shares for proxy a in /z/shares/a yet; the fail-safe applies" in caplog.text
    assert app.limit == QUOTA

    f.update(document(1000.0, [("app", QUOTA / 4)], proxies=("a", "b", "c")), 1001.0)
    assert not f.fail_safe_active and app.limit == QUOTA / 4
    assert "the fail-safe is over" in caplog.text
    f.check(1060.0)
    assert not f.fail_safe_active and f.age(1060.0) == 60.0
    caplog.clear()
    f.check(1061.0)
    assert f.fail_safe_active and app.limit == pytest.approx(expected)
    assert "the quota shares (cycle 3) are 61 s old, more than --share-max-age-ms 60000; " \
           "the fail-safe applies (%s" % fail_safe in caplog.text
    caplog.clear()
    f.check(1070.0)  # still: not logged again
    assert caplog.text == "" and app.limit == pytest.approx(expected)
    changes = f.changes

    f.update(document(1065.0, [("app", QUOTA / 5)]), 1070.0)
    assert not f.fail_safe_active and app.limit == QUOTA / 5
    assert "fresh quota shares (cycle 3, 2 proxies): the fail-safe is over" in caplog.text
    assert f.changes == changes + 1


def test_a_document_already_old_when_read_applies_the_fail_safe():
    m = manager()
    app = m.client("ANONYMOUS", "app").produce
    f = SharesFollower(m, "a", max_age=60.0, fail_safe="equal")
    f.update(document(0.0, [("app", QUOTA / 10)], proxies=("a", "b", "c", "d")), 600.0)
    assert f.fail_safe_active and app.limit == QUOTA / 4
    assert "600 s old" in f.reason


def test_no_shares_within_the_max_age_of_start_is_a_warning(caplog):
    """None read yet at start is usual (INFO); none --share-max-age-ms later
    is a WARNING, once: the fail-safe it keeps in force does not make the
    proxy unready, so the log and kthrottle_fleet_fail_safe say it."""
    caplog.set_level(logging.INFO, "kthrottle.fleet")
    f = SharesFollower(manager(), "a", max_age=60.0, znode="/z/shares/a")
    f.check(1000.0)
    f.check(1060.0)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    f.check(1061.0)
    f.check(1100.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["fleet: still no quota shares for proxy a after 61 s (more than "
                      "--share-max-age-ms 60000); the fail-safe still applies (last: the "
                      "configured quotas until shares are read)"]
    assert f.fail_safe_active


# UsageTracker: what a report holds --------------------------------------------------

def test_the_usage_report_lists_the_buckets_used_in_the_interval_with_their_demand():
    m = manager(**{"clients/reader": {F: 50_000.0}})
    tracker = UsageTracker(m, "a", 5.0, now=100.0)
    app = m.client("ANONYMOUS", "app")
    idle = m.client("ANONYMOUS", "idle")
    reader = m.client("ANONYMOUS", "reader")
    idle.on_request(PRODUCE, 100, 1, 99.0)  # before the interval
    # app: throttled, waits out its delays, for the 5 s of the interval
    now = 100.0
    while now < 105.0:
        now += 0.002 + app.on_request(PRODUCE, 4096, 1, now).delay_ms / 1000.0
    reader.on_fetch_response(1000, 101.0)
    report = tracker.report(105.0, 1_800_000_000.0, {111: ("h", 1), 7: ("h", 2)})
    assert report.proxy_id == "a" and report.interval_s == 5.0
    assert report.fronted_brokers == (7, 111)
    assert [b.sharing_key for b in report.buckets] == [(F, "", "reader"), (P, "", "app")]
    usage = report.buckets[1]
    assert (usage.entity, usage.quota) == ("clients/app", QUOTA)
    assert usage.rate == pytest.approx(app.produce.measure(105.0))
    throttled = app.produce.throttle_ms_total
    assert throttled > 0
    assert usage.demand == pytest.approx(estimate_demand(usage.rate, throttled, 5.0))
    assert usage.demand > usage.quota  # it asked for more than it got
    assert report.buckets[0].demand == report.buckets[0].rate  # never throttled
    # the JSON the Spark job reads back
    again = parse_usage_report(report.to_json().encode())
    assert again == report._replace(reported_at=again.reported_at)

    # the next interval: only what grew since counts; unused buckets are left out
    before = app.produce.throttle_ms_total
    app.on_request(PRODUCE, 4096, 1, 106.0)
    report = tracker.report(110.0, 1_800_000_005.0)
    (usage,) = report.buckets
    assert usage.sharing_key == (P, "", "app")
    grown = app.produce.throttle_ms_total - before
    assert usage.demand == pytest.approx(estimate_demand(usage.rate, grown, 5.0))
    assert tracker.report(115.0, 1_800_000_010.0).buckets == ()


def test_a_bucket_made_again_counts_its_throttle_time_from_zero():
    m = manager()
    tracker = UsageTracker(m, "a", 1.0, now=0.0)
    quotas = m.client("ANONYMOUS", "app")
    now = 0.0
    while now < 1.0:
        now += 0.002 + quotas.on_request(PRODUCE, 8192, 1, now).delay_ms / 1000.0
    tracker.report(1.0, 1.0)
    m.expire(1.0, idle=0.0)  # dropped, made again on the next request
    quotas.on_request(PRODUCE, 8192, 1, 1.5)
    total = quotas.produce.throttle_ms_total
    (usage,) = tracker.report(2.0, 2.0).buckets
    assert usage.demand == pytest.approx(estimate_demand(usage.rate, total, 1.0))


# flags and TOML keys -----------------------------------------------------------------

BASE = {"bootstrap_servers": [("k1", 9092)]}


def test_a_proxy_id_needs_zookeeper():
    with pytest.raises(ConfigError, match="proxy-id a makes this proxy a member of a fleet "
                       "sharing its quotas: give --zookeeper"):
        build_config({}, dict(BASE, proxy_id="a"))
    with pytest.raises(ConfigError, match="give --zookeeper"):
        build_config({}, dict(BASE, proxy_id="a", quota_file="q.toml"))


@pytest.mark.parametrize("flags,message", [
    ({"proxy_id": "a/b"}, "proxy-id must be 1-255 characters"),
    ({"usage_interval_ms": 0}, "usage-interval must be a positive number of ms"),
    ({"usage_topic": "bad topic"}, "usage-topic must be a Kafka topic name"),
    ({"share_max_age_ms": -1}, "share-max-age-ms must be a positive"),
    ({"share_fail_safe": "PAUSE"}, "share-fail-safe must be one of last, equal, whole"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mode": "passthrough"},
     "in sasl-mode passthrough the proxy has no SASL identity of its own"),
])
def test_bad_fleet_settings_are_refused(flags, message):
    values = dict(BASE, proxy_id="a", zookeeper="127.0.0.1:2181")
    values.update(flags)
    with pytest.raises(ConfigError, match=message):
        build_config({}, values)


def test_fleet_settings_from_flags_or_the_config_file(tmp_path):
    config = build_config({}, dict(BASE, zookeeper="127.0.0.1:2181"))
    assert not config.fleet_enabled  # no proxy id: nothing changes
    assert (config.usage_interval_ms, config.usage_topic, config.share_max_age_ms,
            config.share_fail_safe) == (5000, "__kthrottle_proxy_usage", 60000, "last")
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["k1:9092"]\nzookeeper = "127.0.0.1:2181/kafka"\n'
                    'proxy-id = "proxy-a"\nusage-interval = 1000\nusage-topic = "usage"\n'
                    'share-max-age-ms = 30000\nshare-fail-safe = "equal"\n')
    config = build_config(load_toml(path), {"share_fail_safe": "whole"})
    assert config.fleet_enabled
    assert (config.proxy_id, config.usage_interval_ms, config.usage_topic,
            config.share_max_age_ms, config.share_fail_safe) == (
        "proxy-a", 1000, "usage", 30000, "whole")
    path.write_text('bootstrap-server = ["k1:9092"]\nusage-interval = "5s"\n')
    with pytest.raises(ConfigError, match="usage-interval must be an integer"):
        load_toml(path)


def test_the_shares_znode_is_under_the_cluster_state_znode():
    assert shares_znode("proxy-a") == "/kthrottle/cluster-state/shares/proxy-a"
    assert shares_znode("b", "/other/state") == "/other/state/shares/b"


def test_help_has_a_fleet_group():
    from kthrottle.cli import make_parser

    parser = make_parser()
    proxy = parser._subparsers._group_actions[0].choices["proxy"]
    text = proxy.format_help()
    assert "fleet-wide quotas" in text
    for flag in ("--proxy-id", "--usage-interval", "--usage-topic", "--share-max-age-ms",
                 "--share-fail-safe"):
        assert flag in text
