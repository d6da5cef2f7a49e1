"""Nothing lost, at a small size: the scenario of benchmarks/nothing_lost.py (the test kit's
kthrottle_testkit.nothing_lost, which the benchmark runs too). Sequence-numbered records go
through one kthrottle proxy from an idempotent confluent-kafka producer (acks=all) while its
client-id is held to a produce quota below what it offers, a storage PAUSE holds it, the
broker (one Apache Kafka node, the benchmark's --broker kafka) is killed with SIGKILL and
started again on its data while it does, and the pause is released; an aiokafka consumer
reads through the same proxy meanwhile. Neither client nor the proxy is restarted: they must
recover on their own."""
import asyncio

import pytest

from kthrottle_testkit import nothing_lost
from kthrottle_testkit import zookeeper as zk_server

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zk_server.available(),
                                 reason="scripts/test installs ZooKeeper"),
              pytest.mark.kafka]  # an Apache Kafka node of its own
pytest.importorskip("confluent_kafka")


def test_every_acknowledged_record_is_read_back_once_in_order_through_throttle_pause_and_restart(
        tmp_path):
    scenario = nothing_lost.Scenario(
        records=3000, record_size=100, partitions=3,
        quota=50_000,  # about 8 s of Produce requests: throttled all along
        pause_at=0.3, pause_seconds=2.0, restart_during="pause", down_seconds=1.0,
        timeout=50.0, broker="kafka")
    out = asyncio.run(nothing_lost.run_scenario(scenario, tmp_path))
    report = "\n".join(nothing_lost.describe(out) + [out.summary()])

    assert out.complete and not out.errors, report
    assert out.produced == out.acknowledged == scenario.records, report
    assert out.failed == 0, report
    assert out.missing == 0 and out.duplicates == 0, report
    assert out.out_of_order == 0 and out.misplaced == 0 and out.unreadable == 0, report
    assert out.consumed == scenario.records, report  # the final read, from the start
    assert out.live.clean() and out.live.consumed == scenario.records, report  # during faults
    assert out.ok(), report
    # each fault really happened, the restart inside the pause (no write in flight at the
    # broker), and the proxy rode through all of them
    t = out.timings
    assert (t["pause_applied"] < t["broker_killed"] < t["broker_listening"]
            < t["release_written"] < t["produced"]), report
    assert t["broker_listening"] - t["broker_killed"] >= scenario.down_seconds, report
    assert len(out.broker_pids) == 2 and out.broker_pids[0] != out.broker_pids[1], report
    assert out.proxy_alive, report
    m = out.proxy_metrics
    assert m.get("kthrottle_produce_throttled_responses_total", 0) > 0, report
    assert m.get("kthrottle_storage_deferred_requests_total", 0) > 0, report
    # the pause held the producer across the restart: nothing acknowledged from the broker's
    # return (the clients reconnecting through the proxy) until the release
    assert any(a <= t["broker_listening"] and b >= t["release_written"]
               for a, b in out.producer_stalls), report
