"""Fleet-wide quotas without I/O: usage reports, each proxy's share of a
bucket, the prior for buckets without history, and the shares documents the
Spark job writes for the proxies."""
import gzip
import json
import math
import random

import pytest

from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.policy.fleet import (
    BucketUsage,
    ProxyShares,
    Share,
    UsageReport,
    compute_shares,
    encode_shares_document,
    estimate_demand,
    is_held,
    fleet_shares,
    parse_shares_document,
    parse_usage_report,
    prior_fractions,
    shares_document,
)
from kthrottle.policy.storage import COMPRESS_ABOVE

pytestmark = pytest.mark.unit

Q = 1_048_576.0
NOW = 1_795_440_000.0


def total(shares):
    return math.fsum(shares.values())


# compute_shares -----------------------------------------------------------------------

def test_one_proxy_gets_the_whole_quota():
    assert compute_shares(Q, {"a": 5.0}) == {"a": Q}
    assert compute_shares(Q, {"a": 0.0}) == {"a": Q}
    assert compute_shares(Q, {"a": 10 * Q}) == {"a": Q}


def test_no_proxy_no_share():
    assert compute_shares(Q, {}) == {}


def test_two_equal_demands_split_in_half():
    shares = compute_shares(Q, {"a": 2 * Q, "b": 2 * Q})
    assert shares == pytest.approx({"a": Q / 2, "b": Q / 2}, rel=1e-12)
    assert total(shares) == pytest.approx(Q, rel=1e-12)


def test_unequal_demands_proportional_above_the_floor():
    # both want more than the quota: floor each, the rest 3:1
    shares = compute_shares(1000.0, {"a": 3000.0, "b": 1000.0}, floor_fraction=0.1)
    floor = 0.1 * 1000.0 / 2
    assert shares["a"] == pytest.approx(floor + 900.0 * 3 / 4)
    assert shares["b"] == pytest.approx(floor + 900.0 * 1 / 4)
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)
    # without a floor: exactly proportional
    shares = compute_shares(1000.0, {"a": 3000.0, "b": 1000.0}, floor_fraction=0.0)
    assert shares == pytest.approx({"a": 750.0, "b": 250.0})


def test_a_proxy_without_demand_gets_the_floor():
    shares = compute_shares(1000.0, {"a": 0.0, "b": 5000.0}, floor_fraction=0.1)
    assert shares == pytest.approx({"a": 50.0, "b": 950.0})
    assert list(shares) == ["a", "b"]


def test_water_filling_gives_unused_share_to_the_others():
    # c wants 120 (100 x 1.2); proportionally it would get 50 + 900 x 100/2100
    shares = compute_shares(1000.0, {"a": 1000.0, "b": 1000.0, "c": 100.0},
                            floor_fraction=0.3, headroom=1.2)
    floor = 100.0
    assert shares["c"] == pytest.approx(120.0)  # its want, no more
    # the rest (880) goes to a and b in proportion to demand (1:1)
    assert shares["a"] == pytest.approx(440.0)
    assert shares["b"] == pytest.approx(440.0)
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)
    # a and b by demand 3:1: 680 left above their floors (700 - c's 20), split 3:1
    shares = compute_shares(1000.0, {"a": 1500.0, "b": 500.0, "c": 100.0},
                            floor_fraction=0.3, headroom=1.2)
    assert shares["c"] == pytest.approx(120.0)
    assert shares["a"] == pytest.approx(floor + 680.0 * 3 / 4)
    assert shares["b"] == pytest.approx(floor + 680.0 * 1 / 4)
    # a demand too large for c's proportional part to reach its want: no cap
    shares = compute_shares(1000.0, {"a": 3000.0, "b": 1000.0, "c": 100.0},
                            floor_fraction=0.3, headroom=1.2)
    assert shares["c"] == pytest.approx(floor + 700.0 * 100 / 4100)


def test_water_filling_cascades():
    # floor 200 each, 400 to split by demand (2365 in all: 0.1691 per unit).
    # c wants 204 (4 above its floor): capped. Its unused part raises the
    # level to 396 / 2195 = 0.1804, which takes b past its want, 234 (34 above
    # its floor, 0.1744 per unit): capped too; a gets all the rest.
    demands = {"a": 2000.0, "b": 195.0, "c": 170.0}
    shares = compute_shares(1000.0, demands, floor_fraction=0.6, headroom=1.2)
    assert shares["c"] == pytest.approx(204.0)
    assert shares["b"] == pytest.approx(234.0)
    assert shares["a"] == pytest.approx(562.0)
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)


def test_all_wants_met_still_sums_to_the_quota():
    shares = compute_shares(1000.0, {"a": 100.0, "b": 300.0}, floor_fraction=0.1, headroom=1.2)
    # wants: 120 and 360, 520 in all; spread 1000 in proportion to them
    assert shares["a"] == pytest.approx(1000.0 * 120 / 480)
    assert shares["b"] == pytest.approx(1000.0 * 360 / 480)
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)
    # a tiny demand: the floor is the want
    shares = compute_shares(1000.0, {"a": 1.0, "b": 100.0}, floor_fraction=0.1, headroom=1.2)
    assert shares["a"] == pytest.approx(1000.0 * 50 / 170)
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)


def test_all_demands_zero_split_equally():
    shares = compute_shares(1000.0, {"c": 0.0, "a": 0.0, "b": 0})
    assert list(shares) == ["a", "b", "c"]
    assert shares == pytest.approx({"a": 1000 / 3, "b": 1000 / 3, "c": 1000 / 3})
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_many_proxies(seed):
    rng = random.Random(seed)
    demands = {"p%02d" % i: rng.choice([0.0, rng.uniform(0, 2 * Q), rng.uniform(0, Q / 20)])
               for i in range(10)}
    floor = 0.1 * Q / 10
    shares = compute_shares(Q, demands)
    assert list(shares) == sorted(demands)
    assert total(shares) == pytest.approx(Q, rel=1e-12)
    assert all(s >= floor * (1 - 1e-12) for s in shares.values())
    by_demand = sorted(demands, key=lambda p: (demands[p], shares[p]))
    for low, high in zip(by_demand, by_demand[1:]):
        assert shares[low] <= shares[high] * (1 + 1e-12)
    # no proxy above its want while some other is short of its own
    wants = {p: max(floor, d * 1.2) for p, d in demands.items()}
    if sum(wants.values()) > Q:
        assert all(shares[p] <= wants[p] * (1 + 1e-9) for p in demands)


def test_deterministic_whatever_the_order():
    demands = {"b": 10.0, "a": 30.0, "c": 5.0}
    again = dict(reversed(list(demands.items())))
    assert compute_shares(Q, demands) == compute_shares(Q, again)


@pytest.mark.parametrize("args,message", [
    ((0.0, {"a": 1.0}), "quota must be"),
    ((-5.0, {"a": 1.0}), "quota must be"),
    ((float("inf"), {"a": 1.0}), "quota must be"),
    ((Q, {"a": -1.0, "b": 1.0}), "demand of a"),
    ((Q, {"a": float("nan"), "b": 1.0}), "demand of a"),
    ((Q, {"a": "1", "b": 1.0}), "demand of a"),
    ((Q, {"a": 1.0}, 1.0), "floor_fraction"),
    ((Q, {"a": 1.0}, -0.1), "floor_fraction"),
    ((Q, {"a": 1.0}, 0.1, 0.0), "headroom"),
])
def test_compute_shares_rejects(args, message):
    with pytest.raises(ValueError, match=message):
        compute_shares(*args)


# estimate_demand ------------------------------------------------------------------------

def test_estimate_demand():
    assert estimate_demand(1000.0, 0, 5.0) == 1000.0
    assert estimate_demand(1000.0, 2500, 5.0) == pytest.approx(2000.0)  # half throttled
    assert estimate_demand(1000.0, 4500, 5.0) == pytest.approx(10_000.0)  # the cap
    # delays of several connections summing past the interval: still the cap
    assert estimate_demand(1000.0, 60_000, 5.0) == pytest.approx(10_000.0)
    assert estimate_demand(0.0, 5000, 5.0) == 0.0
    assert estimate_demand(0, 0, 1) == 0.0
    for args in ((1.0, 0, 0.0), (1.0, 0, -1.0), (-1.0, 0, 5.0), (1.0, -1, 5.0),
                 (float("nan"), 0, 5.0)):
        with pytest.raises(ValueError):
            estimate_demand(*args)


# prior_fractions --------------------------------------------------------------------------

LEADERS = {("t", 0): 1, ("t", 1): 1, ("t", 2): 2, ("t", 3): 3}


def test_prior_follows_the_leaders_a_proxy_fronts():
    prior = prior_fractions({"a": {1}, "b": {2, 3}}, LEADERS)
    assert prior == pytest.approx({"a": 0.5, "b": 0.5})
    prior = prior_fractions({"a": {1}, "b": {2}, "c": {3}}, LEADERS)
    assert prior == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    # a partition whose leader two proxies front counts for both
    prior = prior_fractions({"a": {1, 2}, "b": {2, 3}}, LEADERS)
    assert prior == pytest.approx({"a": 0.6, "b": 0.4})
    assert math.fsum(prior.values()) == pytest.approx(1.0)


def test_prior_equal_when_every_proxy_fronts_everything_or_nothing_is_known():
    everything = {1, 2, 3}
    assert prior_fractions({"a": everything, "b": everything, "c": everything}, LEADERS) \
        == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert prior_fractions({"a": {1}, "b": {2}}, None) == {"a": 0.5, "b": 0.5}
    assert prior_fractions({"a": {1}, "b": {2}}, {}) == {"a": 0.5, "b": 0.5}
    assert prior_fractions({"a": set(), "b": ()}, LEADERS) == {"a": 0.5, "b": 0.5}
    assert prior_fractions({"a": {7}, "b": {8}}, LEADERS) == {"a": 0.5, "b": 0.5}
    assert prior_fractions({}, LEADERS) == {}


def test_prior_floor_keeps_a_proxy_fronting_no_leader_above_zero():
    assert prior_fractions({"a": {1, 2, 3}, "b": {9}}, LEADERS) == {"a": 1.0, "b": 0.0}
    prior = prior_fractions({"a": {1, 2, 3}, "b": {9}}, LEADERS, floor_fraction=0.1)
    assert prior == pytest.approx({"a": 0.95, "b": 0.05})


# fleet_shares -------------------------------------------------------------------------------

def bucket(key=PRODUCER_BYTE_RATE, user="", client="app-1", quota=Q, rate=0.0, demand=0.0):
    entity = "clients/%s" % client if not user else "users/%s" % user
    return BucketUsage(key, user, client, entity, quota, rate, demand)


def report(proxy, buckets, at=NOW - 2, brokers=(111,), interval=5.0):
    return UsageReport(proxy, at, interval, tuple(brokers), tuple(buckets))


def test_fleet_shares_split_shared_buckets():
    reports = {
        "proxy-b": report("proxy-b", [bucket(demand=Q), bucket(REQUEST_RATE, quota=100.0,
                                                               demand=50.0)]),
        "proxy-a": report("proxy-a", [bucket(demand=Q), bucket(CONSUMER_BYTE_RATE, user="bob",
                                                               client="c", quota=500.0)]),
    }
    out = fleet_shares(reports, NOW, 30.0)
    assert list(out) == ["proxy-a", "proxy-b"]
    a, b = out["proxy-a"], out["proxy-b"]
    assert isinstance(a, ProxyShares)
    assert a.proxy == "proxy-a" and a.proxies == ("proxy-a", "proxy-b") == b.proxies
    assert a.prior == b.prior == 0.5
    # the shared bucket halves; a bucket one proxy reports is wholly its own
    assert a.shares == [(CONSUMER_BYTE_RATE, "bob", "c", 500.0, 500.0),
                        (PRODUCER_BYTE_RATE, "", "app-1", pytest.approx(Q / 2), Q)]
    assert b.shares == [(PRODUCER_BYTE_RATE, "", "app-1", pytest.approx(Q / 2), Q),
                        (REQUEST_RATE, "", "app-1", 100.0, 100.0)]
    assert a.shares[1][3] + b.shares[0][3] == pytest.approx(Q, rel=1e-12)


def test_fleet_shares_ignore_stale_reports():
    reports = {"a": report("a", [bucket(demand=10.0)]),
               "b": report("b", [bucket(demand=1000.0)], at=NOW - 31),
               "c": report("c", [bucket(demand=10.0)], at=NOW - 30)}  # just fresh
    out = fleet_shares(reports, NOW, 30.0)
    assert list(out) == ["a", "c"]
    assert out["a"].proxies == ("a", "c")
    assert out["a"].shares[0][3] == pytest.approx(Q / 2)
    assert fleet_shares(reports, NOW + 100, 30.0) == {}
    only_b = fleet_shares({"b": reports["b"]}, NOW, 60.0)
    assert only_b["b"].shares == [(PRODUCER_BYTE_RATE, "", "app-1", Q, Q)]
    assert only_b["b"].prior == 1.0


def test_fleet_shares_ignore_reports_dated_ahead_of_the_jobs_clock():
    """A report from a proxy whose clock is ahead would never grow stale
    (issue 14): beyond MAX_CLOCK_SKEW it is ignored as a stale one is."""
    from kthrottle.policy.storage import MAX_CLOCK_SKEW

    reports = {"a": report("a", [bucket(demand=10.0)]),
               "b": report("b", [bucket(demand=1000.0)], at=NOW + 3600),
               "c": report("c", [bucket(demand=10.0)], at=NOW + MAX_CLOCK_SKEW),  # allowed
               "d": report("d", [bucket(demand=10.0)], at=float("nan"))}
    out = fleet_shares(reports, NOW, 30.0)
    assert list(out) == ["a", "c"] and out["a"].proxies == ("a", "c")
    assert out["a"].shares[0][3] == pytest.approx(Q / 2)


def test_fleet_shares_latest_quota_wins():
    reports = {"a": report("a", [bucket(quota=1000.0, demand=1.0)], at=NOW - 1),
               "b": report("b", [bucket(quota=2000.0, demand=1.0)], at=NOW - 5)}
    out = fleet_shares(reports, NOW, 30.0)
    assert [s[4] for s in out["a"].shares + out["b"].shares] == [1000.0, 1000.0]
    assert out["a"].shares[0][3] + out["b"].shares[0][3] == pytest.approx(1000.0)
    # the latest wins whatever the order of the proxies; a tie: the greatest id
    reports = {"a": report("a", [bucket(quota=1000.0)], at=NOW - 5),
               "b": report("b", [bucket(quota=1000.0)], at=NOW - 1),
               "c": report("c", [bucket(quota=3000.0)], at=NOW - 3)}
    out = fleet_shares(reports, NOW, 30.0)
    assert {s.shares[0][4] for s in out.values()} == {1000.0}
    reports["d"] = report("d", [bucket(quota=4000.0)], at=NOW - 1)
    out = fleet_shares(reports, NOW, 30.0)
    assert {s.shares[0][4] for s in out.values()} == {4000.0}


def test_fleet_shares_prior_from_leaders():
    reports = {"a": report("a", [], brokers=(1,)), "b": report("b", [], brokers=(2, 3)),
               "c": report("c", [], brokers=(9,))}
    out = fleet_shares(reports, NOW, 30.0, floor_fraction=0.0, leaders=LEADERS)
    assert {p: s.prior for p, s in out.items()} == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.0})
    out = fleet_shares(reports, NOW, 30.0, floor_fraction=0.3, leaders=LEADERS)
    assert {p: s.prior for p, s in out.items()} == pytest.approx(
        {"a": 0.1 + 0.35, "b": 0.1 + 0.35, "c": 0.1})
    assert all(s.shares == [] for s in out.values())


def test_fleet_shares_rejects_bad_reports():
    reports = {"a": report("a", [bucket(quota=0.0)]), "b": report("b", [bucket(quota=0.0)])}
    with pytest.raises(ValueError, match="quota of bucket producer_byte_rate//app-1"):
        fleet_shares(reports, NOW, 30.0)
    reports = {"a": report("a", [bucket(demand=-1.0)]), "b": report("b", [bucket()])}
    with pytest.raises(ValueError, match="demand of bucket .* on a"):
        fleet_shares(reports, NOW, 30.0)
    with pytest.raises(ValueError, match="floor_fraction"):
        fleet_shares({}, NOW, 30.0, floor_fraction=1.5)


# the usage report -----------------------------------------------------------------------------

SPEC_REPORT = {
    "ProxyId": "proxy-a", "ReportedAt": "2026-11-23T14:00:00.000Z", "IntervalSeconds": 5.0,
    "FrontedBrokers": [111],
    "Buckets": [{"Key": "producer_byte_rate", "User": "", "ClientId": "app-1",
                 "Entity": "clients/app-1", "Quota": 1048576.0, "Rate": 523000.0,
                 "Demand": 1046000.0}],
}


def test_usage_report_as_the_spec_writes_it():
    r = parse_usage_report(json.dumps(SPEC_REPORT).encode())
    assert r == UsageReport("proxy-a", 1795442400.0, 5.0, (111,), (
        BucketUsage(PRODUCER_BYTE_RATE, "", "app-1", "clients/app-1", Q, 523000.0, 1046000.0),))
    assert r.buckets[0].sharing_key == (PRODUCER_BYTE_RATE, "", "app-1")
    assert json.loads(r.to_json()) == SPEC_REPORT
    assert r.to_json() == json.dumps(SPEC_REPORT, separators=(",", ":"))
    assert parse_usage_report(r.to_json()) == r
    assert parse_usage_report(SPEC_REPORT) == r


def test_usage_report_round_trip():
    r = report("p-1", [bucket(rate=1.5, demand=3.0),
                       bucket(REQUEST_RATE, user="alice", client="x y", quota=10, rate=2)],
               at=NOW + 0.125, brokers=(1, 2, 3), interval=2.5)
    back = parse_usage_report(r.to_json().encode("utf-8"))
    assert back == r
    assert isinstance(back.buckets[1].quota, float)
    empty = report("p-2", [], brokers=())
    assert parse_usage_report(empty.to_json()) == empty


def spec_report(**changes):
    """SPEC_REPORT with top-level ``changes`` and ``bucket`` changes to its
    bucket; a value of None removes the field."""
    data = json.loads(json.dumps(SPEC_REPORT))
    for k, v in changes.pop("bucket", {}).items():
        data["Buckets"][0][k] = v
        if v is None:
            del data["Buckets"][0][k]
    for k, v in changes.items():
        data[k] = v
        if v is None:
            del data[k]
    return data


@pytest.mark.parametrize("data,message", [
    ([], "a usage report is a JSON object"),
    (spec_report(ProxyId=""), "ProxyId"),
    (spec_report(ProxyId=None), "ProxyId"),
    (spec_report(ReportedAt="yesterday"), "ReportedAt is not an ISO 8601"),
    (spec_report(ReportedAt="2026-11-23T14:00:00"), "ReportedAt has no time zone"),
    (spec_report(IntervalSeconds=0), "IntervalSeconds must be"),
    (spec_report(IntervalSeconds="5"), "IntervalSeconds must be"),
    (spec_report(FrontedBrokers=["111"]), "FrontedBrokers"),
    (spec_report(FrontedBrokers=None), "FrontedBrokers"),
    (spec_report(Buckets={}), "Buckets must be a list"),
    (spec_report(Buckets=[1]), r"Buckets\[0\] must be an object"),
    (spec_report(bucket={"Key": "fetch_byte_rate"}), r"Buckets\[0\].Key must be one of"),
    (spec_report(bucket={"User": None}), r"Buckets\[0\].User must be a string"),
    (spec_report(bucket={"ClientId": 7}), r"Buckets\[0\].ClientId must be a string"),
    (spec_report(bucket={"Quota": 0}), r"Buckets\[0\].Quota must be a finite number > 0"),
    (spec_report(bucket={"Quota": None}), r"Buckets\[0\].Quota"),
    (spec_report(bucket={"Rate": -1}), r"Buckets\[0\].Rate must be a finite number >= 0"),
    (spec_report(bucket={"Demand": float("nan")}), r"Buckets\[0\].Demand"),
    (spec_report(bucket={"Demand": True}), r"Buckets\[0\].Demand"),
    (spec_report(Buckets=SPEC_REPORT["Buckets"] * 2), "listed twice"),
])
def test_usage_report_rejections(data, message):
    with pytest.raises(ValueError, match=message):
        parse_usage_report(data)


def test_usage_report_dated_ahead_of_the_readers_clock_is_refused():
    from kthrottle.policy.storage import MAX_CLOCK_SKEW

    at = 1795442400.0  # SPEC_REPORT's ReportedAt
    assert parse_usage_report(SPEC_REPORT, now=at - MAX_CLOCK_SKEW).reported_at == at
    with pytest.raises(ValueError, match="ReportedAt is 3600 s ahead of this machine's clock"):
        parse_usage_report(SPEC_REPORT, now=at - 3600)
    with pytest.raises(ValueError, match="NaN is not a JSON number"):
        parse_usage_report(json.dumps(spec_report(bucket={"Demand": float("nan")})))


def test_usage_report_rejects_bad_bytes():
    with pytest.raises(ValueError):
        parse_usage_report(b"\xff\xfe")
    with pytest.raises(ValueError):
        parse_usage_report(b"{not json")


def test_usage_report_entity_is_optional():
    r = parse_usage_report(spec_report(bucket={"Entity": None}))
    assert r.buckets[0].entity == ""


# the shares document -------------------------------------------------------------------------

def two_proxy_shares():
    reports = {"proxy-a": report("proxy-a", [bucket(demand=Q), bucket(REQUEST_RATE, quota=50.0)]),
               "proxy-b": report("proxy-b", [bucket(demand=Q)])}
    return fleet_shares(reports, NOW, 30.0)


def test_shares_document_as_the_spec_writes_it():
    doc = shares_document(two_proxy_shares()["proxy-a"], 1795440000.5, 12)
    assert doc == {
        "format": "kthrottle-quota-shares", "version": 2, "generated_at": 1795440000.5,
        "cycle": 12, "proxy": "proxy-a", "fleet_size": 2, "prior": 0.5,
        "shares": [["producer_byte_rate", "", "app-1", pytest.approx(524288.0), 1048576.0],
                   ["request_rate", "", "app-1", 50.0, 50.0]]}


def test_shares_document_round_trip():
    doc = shares_document(two_proxy_shares()["proxy-a"], NOW, 3)
    data = encode_shares_document(doc)
    assert data[:1] == b"{"
    for form in (data, data.decode(), doc, gzip.compress(data)):
        back = parse_shares_document(form)
        assert back.to_json() == doc
        assert back.proxy == "proxy-a" and back.cycle == 3 and back.generated_at == NOW
        assert back.fleet_size == 2 and back.prior == 0.5
        assert back.shares[PRODUCER_BYTE_RATE, "", "app-1"] == Share(pytest.approx(Q / 2), Q)
    # the proxy's limits: listed share, scaled if the quota changed; else prior x quota
    assert back.limit(PRODUCER_BYTE_RATE, "", "app-1", Q) == pytest.approx(Q / 2)
    assert back.limit(PRODUCER_BYTE_RATE, "", "app-1", 2 * Q) == pytest.approx(Q)
    assert back.limit(CONSUMER_BYTE_RATE, "", "app-1", 1000.0) == 500.0


def test_large_shares_document_is_gzipped():
    buckets = [bucket(client="app-%06d" % i, demand=float(i)) for i in range(20_000)]
    shares = fleet_shares({"a": report("a", buckets), "b": report("b", buckets)}, NOW, 30.0)
    doc = shares_document(shares["a"], NOW, 1)
    data = encode_shares_document(doc)
    assert len(json.dumps(doc)) > COMPRESS_ABOVE
    assert data[:2] == b"\x1f\x8b"
    assert parse_shares_document(data).to_json() == doc


def shares_doc(**changes):
    doc = {"format": "kthrottle-quota-shares", "version": 2, "generated_at": NOW, "cycle": 1,
           "proxy": "a", "fleet_size": 2, "prior": 0.5,
           "shares": [["producer_byte_rate", "", "app-1", 10.0, 20.0]]}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("data,message", [
    (b'{"format": "kthrottle-cluster-state", "version": 1}', "not a kthrottle-quota-shares"),
    (b"[]", "not a kthrottle-quota-shares"),
    (shares_doc(version=1), "version 1; this proxy reads version 2"),
    (shares_doc(generated_at="now"), "generated_at"),
    (shares_doc(cycle=-1), "cycle"),
    (shares_doc(cycle=1.5), "cycle"),
    (shares_doc(proxy=""), "proxy must be"),
    (shares_doc(fleet_size="2"), "fleet_size must be an integer"),
    (shares_doc(fleet_size=0), "fleet_size must be an integer >= 1"),
    (shares_doc(fleet_size=True), "fleet_size must be an integer"),
    (shares_doc(prior=1.5), "prior must be"),
    (shares_doc(shares={}), "shares must be a list"),
    (shares_doc(shares=[["producer_byte_rate", "", "app-1", 10.0]]), "a share entry is"),
    (shares_doc(shares=[["fetch", "", "app-1", 10.0, 20.0]]), "a share entry is"),
    (shares_doc(shares=[["request_rate", None, "app-1", 10.0, 20.0]]), "a share entry is"),
    (shares_doc(shares=[["request_rate", "", "app-1", -1.0, 20.0]]), "must be a finite number"),
    (shares_doc(shares=[["request_rate", "", "app-1", 1.0, 0.0]]), "quota must be"),
    (shares_doc(shares=[["request_rate", "", "app-1", 30.0, 20.0]]), "more than its quota"),
    (shares_doc(shares=[["request_rate", "", "x", 1.0, 2.0]] * 2), "listed twice"),
])
def test_shares_document_rejections(data, message):
    with pytest.raises(ValueError, match=message):
        parse_shares_document(data)


@pytest.mark.parametrize("text,message", [
    (json.dumps(shares_doc(generated_at=float("nan"))), "NaN is not a JSON number"),
    (json.dumps(shares_doc(generated_at=float("inf"))), "Infinity is not a JSON number"),
    (json.dumps(shares_doc(generated_at="1e999")).replace('"1e999"', "1e999"),
     r"generated_at must be epoch seconds \(a finite number\), got inf"),
])
def test_a_shares_document_whose_time_cannot_age_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_shares_document(text)


def test_a_shares_document_dated_beyond_the_clock_skew_is_refused():
    from kthrottle.policy.storage import MAX_CLOCK_SKEW

    ahead = parse_shares_document(shares_doc(generated_at=NOW + 3600))
    with pytest.raises(ValueError, match="generated_at is 3600 s ahead of this machine's clock"):
        ahead.check_clock(NOW)
    doc = parse_shares_document(shares_doc(generated_at=NOW + MAX_CLOCK_SKEW))
    doc.check_clock(NOW)
    with pytest.raises(ValueError, match="generated_at is 31 s ahead of this machine's clock"):
        doc.check_clock(NOW - 1)


def test_corrupt_gzip_shares_document():
    with pytest.raises(ValueError, match="corrupt"):
        parse_shares_document(gzip.compress(b"{}")[:-6])


# how long the job's driver would take ----------------------------------------------------------

def test_fleet_shares_of_many_proxies_and_buckets_name_every_entry():
    """100 proxies, 10,000 buckets each on 1-3 proxies: every proxy gets its
    shares document, with an entry for each bucket it reported. (The
    driver's time at 1,000 proxies and 100,000 buckets is measured by
    benchmarks/spark_sync_cycle.py.)"""
    rng = random.Random(7)
    proxies = ["proxy-%04d" % i for i in range(100)]
    per_proxy = {p: [] for p in proxies}
    keys = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE)
    for i in range(10_000):
        b = bucket(keys[i % 3], "", "client-%06d" % i, quota=Q)
        for p in rng.sample(proxies, rng.randint(1, 3)):
            per_proxy[p].append(b._replace(demand=rng.uniform(0, Q)))
    reports = {p: report(p, bs, brokers=(i % 20,)) for i, (p, bs) in
               enumerate(per_proxy.items())}
    leaders = {("t%d" % (i % 50), i): i % 20 for i in range(10_000)}
    out = fleet_shares(reports, NOW, 30.0, leaders=leaders)
    assert set(out) == set(proxies)
    for p, shares in out.items():
        assert len(shares.shares) == len(per_proxy[p])
        assert encode_shares_document(shares_document(shares, NOW, 1))


# a fair split: held proxies (demand at the estimate's cap) -------------------------------
#
# A proxy whose clients are held back at least 90% of an interval reports
# Demand = 10 x Rate whatever they would send: with every proxy of a bucket
# held, splitting by those demands keeps the split the fleet has (only the
# floor moves it, 10% a cycle). These tests and the simulation below hold the
# fix: held proxies split what the others do not want equally (max-min).

INTERVAL = 5.0


def usage(rate, throttled_fraction, quota=Q, client="app-1"):
    """A bucket as the proxy reports it: the demand from the throttle time."""
    ms = throttled_fraction * INTERVAL * 1000.0
    return bucket(client=client, quota=quota, rate=rate,
                  demand=estimate_demand(rate, ms, INTERVAL))


def split(reports, now=NOW):
    """{proxy: its share of the one bucket} from fleet_shares."""
    out = fleet_shares(reports, now, 30.0)
    return {p: s.shares[0][3] for p, s in out.items() if s.shares}


def test_is_held_at_the_estimates_cap_only():
    assert is_held(1000.0, estimate_demand(1000.0, 4500, 5.0))  # 90%: the cap
    assert is_held(1000.0, estimate_demand(1000.0, 60_000, 5.0))  # several connections
    assert is_held(3.3, estimate_demand(3.3, 5000, 5.0))
    assert not is_held(1000.0, estimate_demand(1000.0, 4400, 5.0))  # 88%: an estimate
    assert not is_held(1000.0, 1000.0)
    assert not is_held(0.0, 0.0)  # nothing measured
    assert usage(1000.0, 1.0).held and not usage(1000.0, 0.5).held
    # through the report's JSON: the same floats, the same answer
    r = report("a", [usage(123456.789, 0.95), usage(1.0, 0.2, client="b")])
    assert [b.held for b in parse_usage_report(r.to_json()).buckets] == [True, False]


def test_the_cause_held_demands_repeat_the_split_the_fleet_has():
    """Both proxies held at 79/21: their demands are 10 x their rates, so a
    split by demand (what fleet_shares did) gives 0.05 + 0.9 x 0.79 back."""
    a, b = usage(0.79 * Q, 1.0), usage(0.21 * Q, 1.0)
    assert a.demand / b.demand == pytest.approx(79 / 21)
    by_demand = compute_shares(Q, {"a": a.demand, "b": b.demand})
    assert by_demand["a"] == pytest.approx(0.05 * Q + 0.9 * 0.79 * Q)
    # knowing both are held: equal at once
    assert split({"a": report("a", [a]), "b": report("b", [b])}) == pytest.approx(
        {"a": Q / 2, "b": Q / 2}, rel=1e-12)
    assert compute_shares(Q, {"a": a.demand, "b": b.demand}, held={"a", "b"}) == pytest.approx(
        {"a": Q / 2, "b": Q / 2}, rel=1e-12)


def test_held_proxies_split_what_the_others_leave_equally():
    # c wants 0.12 Q (0.1 x 1.2): it gets that; a and b, held, the rest equally
    shares = compute_shares(Q, {"a": 5 * Q, "b": 0.5 * Q, "c": 0.1 * Q}, held={"a", "b"})
    assert shares["c"] == pytest.approx(0.12 * Q)
    assert shares["a"] == shares["b"] == pytest.approx(0.44 * Q)
    # c wanting more than the level gets the level, as the held ones do
    shares = compute_shares(Q, {"a": 5 * Q, "b": 0.5 * Q, "c": 0.9 * Q}, held={"a"})
    assert shares == pytest.approx({p: Q / 3 for p in "abc"})
    # a want under the floor: the floor
    shares = compute_shares(1000.0, {"a": 1.0, "b": 50.0}, held={"b"})
    assert shares == pytest.approx({"a": 50.0, "b": 950.0})
    # the cascade: an equal part is 250; c's want (120) raises the level to
    # 293, past b's want (240), which raises it to 320, short of a's (360)
    shares = compute_shares(1000.0, {"a": 300.0, "b": 200.0, "c": 100.0, "h": 1.0},
                            floor_fraction=0.0, held={"h"})
    assert shares == pytest.approx({"a": 320.0, "b": 240.0, "c": 120.0, "h": 320.0})
    assert total(shares) == pytest.approx(1000.0, rel=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_held_split_properties(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    demands = {"p%02d" % i: rng.choice([0.0, rng.uniform(0, 2 * Q), rng.uniform(0, Q / 20)])
               for i in range(n)}
    held = set(rng.sample(sorted(demands), rng.randint(1, n)))
    shares = compute_shares(Q, demands, held=held)
    floor = 0.1 * Q / n
    assert total(shares) == pytest.approx(Q, rel=1e-12)
    assert all(s >= floor * (1 - 1e-12) for s in shares.values())
    top = max(shares.values())
    # every held proxy at the level, the top; the others at their want or the level
    assert all(shares[p] == pytest.approx(top, rel=1e-9) for p in held)
    for p in set(demands) - held:
        want = max(floor, demands[p] * 1.2)
        assert shares[p] == pytest.approx(min(want, top), rel=1e-9)


def test_equal_demand_from_a_79_21_history_is_equal_within_two_cycles():
    """The history of issue 17: both held at 79/21; and the mixed history
    where the larger one is not held."""
    cycle1 = split({"a": report("a", [usage(0.79 * Q, 1.0)]),
                    "b": report("b", [usage(0.21 * Q, 1.0)])})
    assert cycle1 == pytest.approx({"a": Q / 2, "b": Q / 2}, rel=1e-9)
    # a held 30% of the interval at 0.79 (an estimate: 1.13 Q), b held at 0.21
    cycle1 = split({"a": report("a", [usage(0.79 * Q, 0.3)]),
                    "b": report("b", [usage(0.21 * Q, 1.0)])})
    assert cycle1 == pytest.approx({"a": Q / 2, "b": Q / 2}, rel=1e-9)


def test_a_late_joiner_gets_at_least_the_floor_on_its_first_cycle():
    floor = 0.1 * Q / 2
    # a has had the whole quota; b's producer came a second before b's report:
    # a small rate (Kafka's rate pads to ten windows), held 20% of the interval
    first = split({"a": report("a", [usage(Q, 1.0)]), "b": report("b", [usage(0.01 * Q, 0.2)])})
    assert first["b"] >= floor
    assert first["a"] + first["b"] == pytest.approx(Q)
    # a proxy new to the fleet altogether, its producer held from the start:
    # half at once
    first = split({"a": report("a", [usage(Q, 1.0)]), "c": report("c", [usage(0.01 * Q, 1.0)])})
    assert first == pytest.approx({"a": Q / 2, "c": Q / 2}, rel=1e-9)


def test_unequal_demand_not_held_is_proportional():
    # 3:1 wants, neither held: in proportion above the floors
    reports = {"a": report("a", [usage(0.6 * Q, 0.8)]),  # 3 Q
               "b": report("b", [usage(0.4 * Q, 0.6)])}  # 1 Q
    shares = split(reports)
    assert shares["a"] == pytest.approx(0.05 * Q + 0.9 * Q * 3 / 4)
    assert shares["b"] == pytest.approx(0.05 * Q + 0.9 * Q * 1 / 4)
    # unthrottled, 3:1 and every want met: the quota in proportion to the wants
    shares = split({"a": report("a", [usage(0.3 * Q, 0.0)]),
                    "b": report("b", [usage(0.1 * Q, 0.0)])})
    assert shares["a"] == pytest.approx(3 * shares["b"])
    assert total(shares) == pytest.approx(Q)


# the fleet over cycles, on a fake clock: each proxy's clients have a true demand
# (bytes/s they would send unthrottled); over an interval a proxy passes
# min(demand, share) and holds its clients back for the rest of the time, on
# each of its connections (closed loop: a client waits out each delay before
# sending again), so the throttle time sums over the connections.

def simulate(true, start, cycles=8, connections=None, lag=0):
    """The share of each proxy per cycle, from ``start`` ({proxy: share}),
    ``true`` {proxy: demand}; with ``lag`` the reports measure the shares
    of ``lag`` cycles before (the report interval and the job's cycle)."""
    connections = connections or {}
    history = [dict(start)]
    for k in range(1, cycles + 1):
        applied = history[max(0, len(history) - 1 - lag)]
        now = NOW + k * INTERVAL
        reports = {}
        for p, demand in true.items():
            s = applied[p]
            held = max(0.0, 1.0 - s / demand) * connections.get(p, 1)
            reports[p] = report(p, [usage(min(demand, s), held)], at=now - 1)
        history.append(split(reports, now))
    return history


def fractions(history, p):
    return [round(h[p] / Q, 3) for h in history]


@pytest.mark.parametrize("connections", [1, 4])
@pytest.mark.parametrize("lag", [0, 1])
def test_two_proxies_with_the_same_demand_converge_to_half_each(connections, lag):
    for demand in (50 * Q, 2 * Q):  # as fast as they are let; twice the quota
        true = {"a": demand, "b": demand}
        history = simulate(true, {"a": 0.79 * Q, "b": 0.21 * Q}, 6,
                           {"a": connections, "b": connections}, lag)
        for h in history[1 + lag:]:  # once the reports saw the shares
            assert h["a"] == pytest.approx(Q / 2, rel=1e-6), fractions(history, "a")


@pytest.mark.parametrize("connections", [1, 4])
def test_two_held_proxies_with_fixed_unequal_demands_converge(connections):
    conns = {"a": connections, "b": connections}
    # one as fast as it is let, one wanting 0.3 Q: 0.36 Q (its want) and the rest
    history = simulate({"a": 50 * Q, "b": 0.3 * Q}, {"a": 0.21 * Q, "b": 0.79 * Q}, 8, conns)
    assert history[-1]["b"] == pytest.approx(0.36 * Q, rel=1e-6)
    assert history[-2] == pytest.approx(history[-1], rel=1e-6)
    # 3 Q and 1 Q: proportional when the throttle time tells the demand (one
    # connection each), an equal split when it does not (four: both held)
    history = simulate({"a": 3 * Q, "b": Q}, {"a": 0.21 * Q, "b": 0.79 * Q}, 8, conns)
    a = history[-1]["a"]
    assert a == pytest.approx(0.725 * Q if connections == 1 else 0.5 * Q, rel=1e-6)
    assert history[-2] == pytest.approx(history[-1], rel=1e-6)
    for h in history:
        assert total(h) == pytest.approx(Q, rel=1e-9)


def test_a_late_joiner_converges_in_the_simulation():
    """b's producer joins an interval before b's first report; b's first
    report is diluted (a small rate, held part of the interval)."""
    first = split({"a": report("a", [usage(Q, 1.0)]), "b": report("b", [usage(0.02 * Q, 0.3)])})
    assert first["b"] >= 0.05 * Q
    history = simulate({"a": 50 * Q, "b": 50 * Q}, first, 3, {"a": 4, "b": 4})
    assert fractions(history, "b")[1:] == [0.5, 0.5, 0.5]
