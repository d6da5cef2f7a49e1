"""Shared capacity: one byte rate shared by the buckets in use by weighted
max-min fairness, as pure policy (no I/O, a fake clock)."""
import math

import pytest

from kthrottle.policy.capacity import ACTIVE_SECONDS, SharedCapacity, water_level
from kthrottle.policy.entities import OBSERVE_ONLY, PRODUCER_BYTE_RATE as PRODUCE
from kthrottle.policy.quotas import CAPACITY_USER, QuotaManager, capacity_sharing_key

pytestmark = pytest.mark.unit

MB = 1e6
STEP = 0.01  # the fake clock's tick
REQUEST = 50_000  # a greedy producer's request size
TRICKLE = 1_000  # a trickle's request size: 100 KB/s at one per tick

EVEN = {"users/<default>": {PRODUCE: 1e6}}


# -- the water level -------------------------------------------------------------


def test_unbounded_equal_weights_share_the_capacity_evenly():
    assert water_level(3e6, [(1, None)] * 3) == pytest.approx(1e6)
    assert water_level(10.0, [(1.0, None)] * 4) == pytest.approx(2.5)


def test_a_small_bounded_demand_is_met_and_the_rest_goes_to_the_others():
    level = water_level(3e6, [(1, None), (1, None), (1, 0.1e6)])
    assert level == pytest.approx(1.45e6)
    # the two unbounded take what the small one leaves
    assert 2 * level + 0.1e6 == pytest.approx(3e6)


def test_a_bounded_demand_above_its_part_is_not_met_in_full():
    # 2e6 wants more than a third: every part is a third
    assert water_level(3e6, [(1, None), (1, None), (1, 2e6)]) == pytest.approx(1e6)
    # demands met in order of demand per weight
    assert water_level(10.0, [(1, 1.0), (1, 3.0), (1, 8.0)]) == pytest.approx(6.0)


def test_weights_split_the_capacity_in_their_proportion():
    level = water_level(3e6, [(2e6, None), (1e6, None)])
    assert (2e6 * level, 1e6 * level) == pytest.approx((2e6, 1e6))
    level = water_level(1.5e6, [(2e6, None), (1e6, None)])
    assert (2e6 * level, 1e6 * level) == pytest.approx((1e6, 0.5e6))


def test_demands_that_all_fit_need_no_level():
    assert water_level(3e6, [(1, 0.5e6), (1, 1e6)]) == math.inf
    assert water_level(3e6, [(1, 1.5e6), (1, 1.5e6)]) == math.inf  # exactly full
    assert water_level(3e6, []) == math.inf


@pytest.mark.parametrize("capacity", [0, 0.0, -1, -3e6])
def test_a_capacity_that_is_not_positive_is_refused(capacity):
    with pytest.raises(ValueError, match="positive"):
        water_level(capacity, [(1, None)])


@pytest.mark.parametrize("capacity", [None, 0, -5])
def test_a_shared_capacity_must_be_a_positive_rate(capacity):
    with pytest.raises(ValueError, match="positive byte rate"):
        SharedCapacity(capacity)


def test_before_the_first_look_a_bucket_gets_its_quota_never_more_than_the_capacity():
    shared = SharedCapacity(3e6)
    assert shared.first_limit(1e6) == 1e6
    assert shared.first_limit(5e6) == 3e6


# -- producers on a fake clock --------------------------------------------------------


def simulate(manager, users, end, active=None, trickle=()):
    """Greedy producers (``users``; each client "app") on a fake clock from 0 to
    ``end``: each sends a REQUEST whenever not muted and is muted for the delay
    it earns; a user in ``trickle`` sends TRICKLE every tick and ignores delays
    (it earns none). ``active(user, t)`` says whether it sends at t.
    apply_capacity runs every whole second. Returns {user: [(t, bytes)]}."""
    clients = {u: manager.client(u, "app") for u in users}
    muted_until = dict.fromkeys(users, 0.0)
    sent = {u: [] for u in users}
    per_second = round(1 / STEP)
    for i in range(round(end / STEP) + 1):
        now = round(i * STEP, 6)
        for user, client in clients.items():
            if active is not None and not active(user, now):
                continue
            if user in trickle:
                assert client.on_produce(TRICKLE, now) is None
                sent[user].append((now, TRICKLE))
            elif now >= muted_until[user]:
                decision = client.on_produce(REQUEST, now)
                sent[user].append((now, REQUEST))
                if decision is not None:
                    muted_until[user] = now + decision.delay_ms / 1000
        if i % per_second == 0:
            manager.apply_capacity(now)
    return sent


def rate(sent, start, end):
    """Bytes per second sent in [start, end)."""
    return sum(n for t, n in sent if start <= t < end) / (end - start)


def manager_sharing(snapshot, capacity):
    manager = QuotaManager(snapshot)
    manager.set_capacity(PRODUCE, capacity)
    return manager


def test_three_greedy_producers_each_get_a_third_of_the_capacity():
    manager = manager_sharing(EVEN, 3e6)
    sent = simulate(manager, "abc", 10)
    for user in "abc":
        assert rate(sent[user], 5, 10) == pytest.approx(1 * MB, rel=0.05), user
        assert manager.buckets[(PRODUCE, user, "")].limit == pytest.approx(1e6)
    assert manager.capacity[PRODUCE].level == pytest.approx(1.0)


def test_when_one_stops_the_two_left_share_its_part():
    manager = manager_sharing(EVEN, 3e6)
    stop = 10.0
    sent = simulate(manager, "abc", 18, active=lambda user, t: user != "c" or t < stop)
    for user in "abc":
        assert rate(sent[user], 5, 10) == pytest.approx(1 * MB, rel=0.05), user
    for user in "ab":
        assert rate(sent[user], stop + 3, stop + 8) == pytest.approx(1.5 * MB, rel=0.05), user
        assert manager.buckets[(PRODUCE, user, "")].limit == pytest.approx(1.5e6)
    assert rate(sent["c"], stop, 18) == 0
    # a bucket out of use keeps its limit until it is used again
    assert manager.buckets[(PRODUCE, "c", "")].limit == pytest.approx(1e6)


def test_a_producer_back_in_use_is_held_to_its_part_again():
    manager = manager_sharing(EVEN, 3e6)
    sent = simulate(manager, "abc", 22,
                    active=lambda user, t: user != "c" or not 6 <= t < 12)
    for user in "ab":
        assert rate(sent[user], 9, 12) == pytest.approx(1.5 * MB, rel=0.05), user
    for user in "abc":
        assert rate(sent[user], 17, 22) == pytest.approx(1 * MB, rel=0.05), user


def test_weights_two_to_one_give_rates_two_to_one():
    manager = manager_sharing({"users/a": {PRODUCE: 2e6}, "users/b": {PRODUCE: 1e6}}, 3e6)
    sent = simulate(manager, "ab", 10)
    a, b = rate(sent["a"], 5, 10), rate(sent["b"], 5, 10)
    assert a == pytest.approx(2 * MB, rel=0.05)
    assert b == pytest.approx(1 * MB, rel=0.05)
    assert a / b == pytest.approx(2, rel=0.05)


def test_weights_split_a_capacity_smaller_than_the_quotas():
    manager = manager_sharing({"users/a": {PRODUCE: 2e6}, "users/b": {PRODUCE: 1e6}}, 1.5e6)
    sent = simulate(manager, "ab", 10)
    assert rate(sent["a"], 5, 10) == pytest.approx(1 * MB, rel=0.05)
    assert rate(sent["b"], 5, 10) == pytest.approx(0.5 * MB, rel=0.05)


def test_a_trickle_leaves_the_rest_to_the_busy_producers():
    manager = manager_sharing(EVEN, 3e6)
    sent = simulate(manager, "abc", 15, trickle="c")
    assert rate(sent["c"], 8, 13) == pytest.approx(0.1 * MB, rel=0.01)
    for user in "ab":
        # 3 MB/s less the trickle's 100 KB/s with headroom (120 KB/s), halved
        assert rate(sent[user], 8, 13) == pytest.approx(1.45 * MB, rel=0.05), user
        assert manager.buckets[(PRODUCE, user, "")].limit == pytest.approx(1.44e6, rel=0.01)
    assert manager.buckets[(PRODUCE, "c", "")].throttled == 0


def test_observe_only_buckets_are_left_out_of_the_sharing():
    snapshot = dict(EVEN, **{"users/c": {PRODUCE: 1e6, OBSERVE_ONLY: 1}})
    manager = manager_sharing(snapshot, 3e6)
    sent = simulate(manager, "abc", 10)
    for user in "ab":
        assert rate(sent[user], 5, 10) == pytest.approx(1.5 * MB, rel=0.05), user
    observed = manager.buckets[(PRODUCE, "c", "")]
    assert observed.limit == 1e6  # its quota, as configured
    assert observed.throttled == 0 and observed.observed > 0
    assert rate(sent["c"], 5, 10) == pytest.approx(REQUEST / STEP)  # never delayed


def test_without_a_capacity_the_buckets_go_back_to_their_quotas():
    manager = manager_sharing(EVEN, 3e6)
    simulate(manager, "ab", 5)
    buckets = [manager.buckets[(PRODUCE, user, "")] for user in "ab"]
    assert [b.limit for b in buckets] == pytest.approx([1.5e6, 1.5e6])
    manager.set_capacity(PRODUCE, None)
    assert manager.capacity == {}
    assert [(b.limit, b.quota) for b in buckets] == [(1e6, 1e6), (1e6, 1e6)]
    assert [b.tokens.limit for b in buckets] == [1e6, 1e6]
    manager.apply_capacity(6.0)  # nothing to share: nothing changes
    assert [b.limit for b in buckets] == [1e6, 1e6]


def test_a_bucket_made_between_two_looks_gets_its_part_at_the_last_level():
    manager = manager_sharing(EVEN, 3e6)
    simulate(manager, "ab", 5)
    assert manager.capacity[PRODUCE].level == pytest.approx(1.5)
    late = manager.bucket(PRODUCE, "z", "app")
    assert late.limit == pytest.approx(1.5e6)
    assert late.quota == 1e6


def test_buckets_idle_past_the_active_span_get_no_part():
    manager = manager_sharing(EVEN, 3e6)
    a = manager.bucket(PRODUCE, "a", "app")
    b = manager.bucket(PRODUCE, "b", "app")
    a.record(1000, 0.0)
    b.record(1000, 0.0)
    shared = manager.capacity[PRODUCE]
    assert set(shared.limits([a, b], ACTIVE_SECONDS)) == {a, b}
    assert shared.limits([a, b], ACTIVE_SECONDS + 0.5) == {}
    assert shared.limits([manager.bucket(PRODUCE, "c", "app")], 1.0) == {}  # never used


# -- a fleet of proxies: the capacity is split among them as a bucket of its own ----------


def test_in_a_fleet_a_proxy_shares_its_part_of_the_capacity_among_its_buckets():
    manager = manager_sharing(EVEN, 3e6)
    key = capacity_sharing_key(PRODUCE)
    # the fleet gave this proxy a third of the capacity (the other proxies are busier)
    manager.apply_shares({key: 1e6}, prior=0.5, fleet_size=2)
    assert manager.capacity_in_force(PRODUCE) == 1e6
    sent = simulate(manager, ("a", "b"), 12.0)
    for user in ("a", "b"):
        assert rate(sent[user], 6.0, 11.0) == pytest.approx(0.5e6, rel=0.05)
    # not listed in the shares yet: the prior's part; the fail-safes as for any quota
    manager.apply_shares({}, prior=0.25, fleet_size=4)
    assert manager.capacity_in_force(PRODUCE) == 0.75e6
    manager.apply_equal(3)
    assert manager.capacity_in_force(PRODUCE) == 1e6
    manager.apply_whole()
    assert manager.capacity_in_force(PRODUCE) == 3e6


def test_the_capacity_is_reported_to_the_fleet_as_one_bucket_of_its_buckets_sum():
    from kthrottle.policy.fleet import fleet_shares
    from kthrottle.proxy.fleet import UsageTracker

    reports = {}
    for proxy, users in (("p1", ("a", "b")), ("p2", ("c",))):
        manager = manager_sharing(EVEN, 3e6)
        tracker = UsageTracker(manager, proxy, 12.0, 0.0)
        simulate(manager, users, 12.0)
        report = tracker.report(12.0, 1000.0)
        (capacity,) = [b for b in report.buckets if b.user == CAPACITY_USER]
        own = [b for b in report.buckets if b.user != CAPACITY_USER]
        assert (capacity.key, capacity.client_id, capacity.entity, capacity.quota) == (
            PRODUCE, "", "capacity", 3e6)
        assert capacity.rate == pytest.approx(sum(b.rate for b in own))
        assert capacity.demand >= capacity.rate  # its buckets were held to their parts
        reports[proxy] = report
    # the fleet splits the capacity between the two proxies as it splits any quota
    shares = fleet_shares(reports, 1000.0, 60.0)
    split = {p: [s for s in shares[p].shares if s[1] == CAPACITY_USER] for p in reports}
    total = sum(s[0][3] for s in split.values())
    assert total == pytest.approx(3e6, rel=0.01)
    assert all(0 < s[0][3] < 3e6 for s in split.values()), split
