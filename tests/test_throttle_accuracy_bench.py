"""benchmarks/throttle_accuracy.py: its flags (Tansu by default, --broker kafka with the Java
clients and both enforcers), the side-by-side table and the Java consumer's line counter (no
broker), and a smoke run on Tansu of a few seconds. Nothing here asserts on how close to its
quota a client is held: that is what the benchmark reports."""
import subprocess
import sys
import threading
import time

import pytest

from kthrottle_testkit import ROOT, load_benchmark

pytestmark = pytest.mark.integration

ta = load_benchmark("throttle_accuracy")


def test_tansu_stays_the_default_and_kafka_brings_the_java_clients_and_its_own_quotas():
    args = ta.parse_args([])
    assert (args.broker, args.enforcers, args.clients) == ("tansu", ["kthrottle"],
                                                           list(ta.PY_CLIENTS))
    assert args.reference_seconds == 65  # the Kafka 2.2 reference's windows, as before
    assert [s.label for s in ta.setups(args)] == ["kthrottle token-bucket", "kthrottle window"]
    args = ta.parse_args(["--broker", "kafka"])
    assert args.enforcers == ["kthrottle", "kafka"] and args.kafka_nodes == 3
    assert args.clients == list(ta.CLIENTS) and args.reference_seconds == 0
    assert [s.label for s in ta.setups(args)][-1] == "Kafka's quotas"
    args = ta.parse_args(["--broker", "kafka", "--enforcer", "kafka", "--clients",
                          "java-consumer,aio-producer"])
    assert args.clients == ["aio-producer", "java-consumer"]  # the tables' order
    assert ta.setups(args) == [ta.Setup("kafka", None)]


@pytest.mark.parametrize("argv", [
    ["--enforcer", "kafka"],  # Tansu enforces no quotas
    ["--clients", "java-producer"],  # the jars come with --broker kafka
    ["--broker", "kafka", "--enforcers", "zookeeper"],
    ["--broker", "kafka", "--clients", "kcat"],
    ["--broker", "kafka", "--kafka-nodes", "0"],
])
def test_it_refuses(argv):
    with pytest.raises(SystemExit):
        ta.parse_args(argv)


def test_kafkas_quotas_are_on_client_ids_of_their_own():
    kthrottle, kafka = ta.Setup("kthrottle", "window"), ta.Setup("kafka", None)
    assert kthrottle.client_id("java-producer", 200_000) == "java-producer-200k"
    assert kafka.client_id("java-producer", 200_000) == "java-producer-200k-kafka"


def _run(setup, kind, quota, per_second, seconds=10, leaders=(1, 2, 3)):
    run = ta.ClientRun(setup.mode, quota, kind, setup.client_id(kind, quota), "t",
                       enforcer=setup.enforcer, partitions=3, leaders=leaders)
    run.t0, run.seconds = 100.0, seconds
    run.events = [(100.5 + s, rate * quota) for s, rate in enumerate(per_second)]
    if setup.enforcer == "kthrottle":
        run.proxy = {"kthrottle_produce_byte_rate": quota}
    return run


def test_the_one_table_puts_the_enforcers_side_by_side():
    args = ta.parse_args(["--broker", "kafka", "--seconds", "10", "--quotas", "100000",
                          "--modes", "token-bucket", "--clients", "java-producer"])
    runs = [_run(ta.Setup("kthrottle", "token-bucket"), "java-producer", 100_000, [2] + [1] * 9),
            _run(ta.Setup("kafka", None), "java-producer", 100_000, [10] * 3 + [3] * 7)]
    lines = ta.side_by_side_lines(runs, args)
    assert lines[0] == ("| quota | client | brokers it uses | kthrottle token-bucket: burst 0-5 s"
                        " | kthrottle token-bucket: steady 5-10 s | Kafka's quotas: burst 0-5 s"
                        " | Kafka's quotas: steady 5-10 s |")
    assert lines[2] == "| 100,000 B/s | java-producer | 3 | 1.20x | 1.00x | 7.20x | 3.00x |"
    report = ta.markdown_report(runs, _facts(), args, 42.0, "python x", False,
                                {"leaders_by_topic": {"t": (1, 2, 3)}})
    assert lines[2] in report and "each led by another broker (all 1 topics)" in report


def _facts():
    return {k: "?" for k in ("nproc", "cpu_model", "python", "aiokafka", "confluent_kafka",
                             "librdkafka", "client_loop", "tansu", "kthrottle_commit")}


def test_the_java_consumer_is_timed_by_the_lines_it_prints(tmp_path):
    run = ta.ClientRun(None, 100_000, "java-consumer", "c", "t", enforcer="kafka")
    args = ta.parse_args(["--broker", "kafka"])
    java = ta.JavaClient(run, None, "127.0.0.1:1", args, records=5, name="c")
    java.log = tmp_path / "c.log"
    java.log.write_text("[2026] WARN something (org.apache.kafka)\n")
    thread = threading.Thread(target=java._lines)
    thread.start()
    time.sleep(0.2)
    assert not java.first.is_set()
    with open(java.log, "a") as log:
        log.write("Partition:0\nPartition:2\nPart")  # the last line not whole yet
    assert java.first.wait(5)
    time.sleep(0.2)
    with open(java.log, "a") as log:
        log.write("ition:1\n")
    time.sleep(0.2)
    java.done.set()
    thread.join(5)
    assert [n for _, n in run.events] == [2 * 1024, 1024]
    assert run.t0 == run.events[0][0] and not run.ran_out


def test_a_smoke_run_on_tansu_writes_the_report(tmp_path):
    pytest.importorskip("confluent_kafka")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throttle_accuracy.py"), "--seconds", "3",
         "--quotas", "100000", "--modes", "token-bucket", "--output-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "throttle_accuracy.md").read_text()
    for kind in ta.PY_CLIENTS:
        assert "| token-bucket | 100,000 B/s | %s |" % kind in report
