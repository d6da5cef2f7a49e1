"""benchmarks/scale.py: the issue's sizes are its defaults, a curve module that is not there
is skipped with a message, and a small real run of the connections, quotas and workers curves
(a Tansu broker, proxies, raw sockets, aiokafka producers) writes a table and a plot per curve
with figures that make sense. Nothing here asserts that a target is met: that is what the
benchmark reports."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kthrottle_testkit import ROOT, load_benchmark

pytestmark = pytest.mark.integration

scale = load_benchmark("scale")


def test_the_issues_sizes_are_the_defaults():
    args = scale.parse_args([])
    assert args.curves == ["connections", "quotas", "partitions", "workers"]
    assert args.connections == [100, 1000, 10000]
    assert args.entities == [10, 1000, 100000]
    assert args.workers_list == ["1", "2", "auto"]
    assert args.quota_sources == ["file", "zookeeper"]
    assert args.broker == "tansu"
    with pytest.raises(SystemExit):
        scale.parse_args(["--curves", "topics"])
    with pytest.raises(SystemExit):
        scale.parse_args(["--quota-sources", "etcd"])


def test_a_missing_partitions_module_is_skipped_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(scale.Partitions, "path", ROOT / "benchmarks" / "no_such_module.py")
    assert scale.Partitions.measure(None, None) is None
    assert "is not there" in capsys.readouterr().out
    section = "\n".join(scale.curve_section("partitions", None, "python benchmarks/scale.py"))
    assert "Not measured" in section and "Command: `python benchmarks/scale.py`" in section


def test_the_probe_entity_comes_first_for_its_client_and_live_clients_share_the_default():
    from kthrottle.policy.quotas import QuotaConfig

    snapshot, _, _ = scale.quota_snapshot(1000, 48)
    assert len(snapshot) == 1000  # the probe's entity and the live clients' default included
    config = QuotaConfig(snapshot)
    assert config.resolve("ANONYMOUS", scale.PROBE_CLIENT, "request_rate").entity \
        == scale.PROBE_ENTITY
    assert config.resolve("nobody-configured", "app-x", "request_rate").entity \
        == scale.DEFAULT_CLIENTS


def test_a_small_run_writes_a_table_and_a_plot_per_curve(tmp_path):
    out = tmp_path / "scale"
    argv = [sys.executable, str(ROOT / "benchmarks" / "scale.py"),
            "--curves", "connections,quotas,workers", "--output-dir", str(out),
            "--max-minutes", "5",
            "--connections", "50", "--idle-client-ids", "shared", "--idle-seconds", "1",
            "--active-clients", "3", "--active-rate", "10", "--active-seconds", "2",
            "--entities", "10,100", "--quota-sources", "file", "--changes", "1",
            "--decision-rounds", "3", "--decision-calls", "2000", "--live", "20",
            "--workers-list", "1", "--tput-producers", "1", "--tput-records", "2000",
            "--shared-producers", "1", "--shared-seconds", "4", "--shared-steady-from", "2"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "scale.md").read_text()
    for title in (scale.Connections.title, scale.Quotas.title, scale.Workers.title):
        assert "## %s" % title in report
    assert report.count("Command: `python benchmarks/scale.py --curves connections,quotas") == 3
    for curve in ("connections", "quotas", "workers"):
        assert (out / ("scale-%s.png" % curve)).stat().st_size > 1000
        assert "![%s](scale-%s.png)" % (curve, curve) in report
    data = json.loads((out / "scale.json").read_text())["curves"]

    (conn,) = data["connections"]["rows"]
    assert conn["idle connections"] == conn["opened"] == 50 and conn["open errors"] == 0
    # an idle connection costs something, and not a megabyte
    assert 0 < conn["RSS per idle connection (KiB)"] < 200
    assert conn["open after"] >= 50  # the idle ones were still open after the active phase
    assert conn["broker connections held"] >= 1
    assert conn["active records"] > 0 and conn["active failed"] == 0
    assert 0 < conn["active p50 (ms)"] <= conn["active p99 (ms)"] < 5000
    assert conn["idle proxy CPU (ms/s)"] > 0

    rows = data["quotas"]["rows"]
    assert [(r["source"], r["entities"]) for r in rows] == [("file", 10), ("file", 100)]
    for r in rows:
        assert r["loaded entities"] == r["entities"]
        assert 0 < r["decision CPU (ns)"] < 1e6
        assert 0 < r["load (s)"] < 60 and 0 < r["apply (s)"] < 30
        assert r["parse file in process (ms)"] > 0
    assert data["quotas"]["targets"][0][1] is None  # 100 entities: not the target's sizes
    assert "not judged at these sizes" in report

    (w,) = data["workers"]["rows"]
    assert w["workers"] == 1 and w["throughput (MB/s)"] > 0
    assert 0.3 < w["delivered / quota"] < 3


def test_workers_multiply_the_connections_that_fit_in_the_open_files_limit():
    one = scale.connections_fit(20000, 100, 1)
    assert one == (20000 - 400 - 256) // 2  # two descriptors per client connection
    two = scale.connections_fit(20000, 100, 2)
    assert 10000 <= two < 2 * one  # 10,000 fit in two processes, less a margin for the spread
    assert scale.parse_args([]).connections_workers == 1


def test_the_connections_curve_with_two_workers_counts_every_workers_connections(tmp_path):
    out = tmp_path / "scale"
    argv = [sys.executable, str(ROOT / "benchmarks" / "scale.py"),
            "--curves", "connections", "--output-dir", str(out), "--max-minutes", "4",
            "--connections", "60", "--idle-client-ids", "shared", "--idle-seconds", "1",
            "--active-clients", "2", "--active-rate", "10", "--active-seconds", "2",
            "--connections-workers", "2"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (conn,) = json.loads((out / "scale.json").read_text())["curves"]["connections"]["rows"]
    assert conn["workers"] == 2 and conn["opened"] == 60
    # the workers' connections, not the supervisor's (it serves none): every idle client
    # connection is open and holds its broker connection, whichever worker took it
    assert conn["open after"] >= 60
    assert conn["broker connections held"] >= 60
    assert conn["proxy fds"] >= 2 * 60
    assert "--workers 2" in (out / "scale.md").read_text()
