"""benchmarks/quota_escapes.py: its counting relay's frame cutter and its meter (fed bytes, no
I/O), and a smoke run of a few techniques for a couple of seconds each against a real Tansu
broker and proxy. Nothing here asserts on how fast anything is, nor on what the proxy lets
through: that is what the benchmark reports."""
import json
import subprocess
import sys

import pytest

from kthrottle_testkit import ROOT, load_benchmark

pytestmark = pytest.mark.integration

qe = load_benchmark("quota_escapes")


def _requests():
    """(frames, expected (client_id, api_key, correlation, size) per frame)."""
    fetch = qe.with_correlation(qe.fetch_template(11, "t", "qe-a"), 5)
    produce = qe.with_correlation(qe.produce_template("t", "qe-b", acks=0), 6)
    cluster = qe.with_correlation(qe.raw_template(4, "qe-c"), 7)
    anonymous = qe.with_correlation(qe.raw_template(18, ""), 8)
    frames = [fetch, produce, cluster, anonymous]
    return frames, [("qe-a", 1, 5, len(fetch)), ("qe-b", 0, 6, len(produce)),
                    ("qe-c", 4, 7, len(cluster)), ("", 18, 8, len(anonymous))]


def _response(correlation, body_size):
    body = correlation.to_bytes(4, "big") + b"\x00" * body_size
    return len(body).to_bytes(4, "big") + body


def _totals(stats):
    out = {}
    for (client_id, api_key, _bin), cell in stats.items():
        got = out.setdefault((client_id, api_key), [0, 0, 0])
        for i in range(3):
            got[i] += cell[i]
    return out


@pytest.mark.parametrize("chunk", [1, 3, 7, 14, 1000])
def test_the_relay_counts_each_request_and_its_response_however_the_bytes_are_cut(chunk):
    frames, expected = _requests()
    stream = b"".join(frames)
    counter = qe.FrameCounter({})
    for i in range(0, len(stream), chunk):
        counter.requests(stream[i:i + chunk])
    # the acks=0 Produce (6) gets no response; the others come back in order
    answers = _response(5, 70000) + _response(7, 10) + _response(8, 0)
    for i in range(0, len(answers), chunk):
        counter.responses(answers[i:i + chunk])
    totals = _totals(counter.stats)
    assert totals == {
        ("qe-a", 1): [1, expected[0][3], 4 + 4 + 70000],
        ("qe-b", 0): [1, expected[1][3], 0],
        ("qe-c", 4): [1, expected[2][3], 4 + 4 + 10],
        ("", 18): [1, expected[3][3], 4 + 4],
    }
    assert set(counter.pending) == {6}  # only the unanswered acks=0 request


def test_the_meter_keeps_what_falls_in_its_period_and_takes_windows_of_it():
    meter = qe.Meter(31)
    meter.add(5, 100.0)  # before the clock starts: nothing
    meter.t0 = 100.0
    meter.add(1000, 100.5)  # the first second
    for s in range(1, 31):
        meter.add(10, 100.0 + s + 0.5)
    meter.add(7, 131.5)  # after the end
    assert meter.outside == 7
    (steady, burst) = qe.windows(31)
    assert (steady, burst) == ((1.0, 31.0), (0.0, 20.0))
    assert qe.ratio(meter, steady, 10) == pytest.approx(1.0)
    assert qe.ratio(meter, burst, 10) == pytest.approx((1000 + 19 * 10) / 200)
    assert meter.per_second()[:3] == [1000, 10, 10]


def test_it_refuses_unknown_techniques_and_an_address_without_a_kafka_broker(capsys):
    with pytest.raises(SystemExit):
        qe.parse_args(["--only", "no-such-thing"])
    with pytest.raises(SystemExit):
        qe.parse_args(["--bootstrap", "127.0.0.1:9092"])
    args = qe.parse_args(["--only", "acks0-produce", "--proxy-args=--quota-mode window"])
    assert args.only == ["acks0-produce"] and args.proxy_args == ["--quota-mode", "window"]
    # --broker kafka alone starts a node of its own
    assert qe.parse_args(["--broker", "kafka"]).bootstrap is None


def _flexible_response(correlation, body):
    """A response payload (what follows the size) with header v1: no tagged fields."""
    return correlation.to_bytes(4, "big") + qe.NO_TAGS + body


def test_the_share_frames_follow_kafkas_schemas():
    """ShareGroupHeartbeat v1 and ShareFetch v1 requests, as Kafka 4.4's schemas lay them
    out, and their responses read back (the bytes built here by hand)."""
    frame = qe.flexible_frame(76, 1, 9, "qe-x", qe.share_heartbeat_body("g", "m", 0, ["t"]))
    assert frame[4:] == (b"\x00\x4c\x00\x01\x00\x00\x00\x09\x00\x04qe-x\x00"
                         b"\x02g\x02m\x00\x00\x00\x00\x00\x02\x02t\x00")
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    topic_id = bytes(range(16))
    body = qe.share_fetch_body("g", "m", 3, topic_id, [(5, 7)], max_records=500)
    assert body == (b"\x02g\x02m" + (3).to_bytes(4, "big") + (500).to_bytes(4, "big")
                    + (1).to_bytes(4, "big") + qe.FETCH_MAX_BYTES.to_bytes(4, "big")
                    + (500).to_bytes(4, "big") * 2
                    + b"\x02" + topic_id + b"\x02" + b"\x00\x00\x00\x00" + b"\x02"
                    + (5).to_bytes(8, "big") + (7).to_bytes(8, "big") + b"\x02\x01\x00"
                    + b"\x00" + b"\x00" + b"\x01" + b"\x00")
    heartbeat = _flexible_response(9, (
        b"\x00\x00\x00\x00" + b"\x00\x00" + b"\x00" + b"\x02m" + (4).to_bytes(4, "big")
        + (5000).to_bytes(4, "big") + b"\x01" + b"\x02" + topic_id + b"\x02" + b"\x00" * 4
        + b"\x00" + b"\x00" + b"\x00"))
    answer = qe.parse_share_heartbeat(heartbeat)
    assert (answer["error"], answer["member_id"], answer["epoch"], answer["interval_ms"],
            answer["assignment"]) == (0, "m", 4, 5000, {topic_id: [0]})
    records = b"r" * 300
    fetch = _flexible_response(10, (
        (7).to_bytes(4, "big") + b"\x00\x00" + b"\x00" + (30000).to_bytes(4, "big")
        + b"\x02" + topic_id + b"\x02" + b"\x00" * 4 + b"\x00\x00\x00" + b"\x00\x00\x00"
        + b"\x00\x00\x00\x01" + b"\x00\x00\x00\x02" + b"\x00" + qe.uvarint(301) + records
        + b"\x02" + (5).to_bytes(8, "big") + (7).to_bytes(8, "big") + b"\x00\x01\x00"
        + b"\x00" + b"\x00" + b"\x01" + b"\x00"))
    answer = qe.parse_share_fetch(fetch)
    assert (answer["throttle_ms"], answer["error"], answer["record_bytes"], answer["acquired"],
            answer["partition_errors"]) == (7, 0, 300, [(5, 7)], [])
    coordinator = _flexible_response(11, (
        b"\x00\x00\x00\x00" + b"\x02" + b"\x02g" + (1).to_bytes(4, "big") + b"\x0a127.0.0.1"
        + (9093).to_bytes(4, "big") + b"\x00\x00" + b"\x00" + b"\x00" + b"\x00"))
    assert qe.parse_find_coordinator(coordinator) == (1, "127.0.0.1", 9093, 0)


def test_a_smoke_run_writes_a_row_per_technique(tmp_path):
    pytest.importorskip("confluent_kafka")
    only = ["fetch-reconnect", "follower-fetch", "acks0-produce", "share-fetch"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quota_escapes.py"), "--seconds", "2",
         "--only", ",".join(only), "--fill-mb", "3", "--output-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "quota_escapes.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == only
    assert "needs Apache Kafka 4" in rows["share-fetch"]["skipped"]
    for name in only[:3]:
        row = rows[name]
        assert row["proxy_alive"], row
        assert row["steady"] is not None and row["burst"] is not None, row
        assert row["broker_steady"] is not None, row
        assert row["stats"]["connections"] >= 1, row
    # the relay saw the consumer's fetch and the acks=0 requests under their client-ids
    assert rows["fetch-reconnect"]["broker_totals"].get("requests api 1", 0) >= 1
    assert rows["acks0-produce"]["broker_totals"].get("requests api 0", 0) >= 1
    assert rows["fetch-reconnect"]["stats"].get("responses", 0) >= 1
    report = (tmp_path / "quota_escapes.md").read_text()
    for name in only:
        assert "| %s |" % name in report
