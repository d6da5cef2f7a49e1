"""confluent-kafka's produce latency at a fixed rate over TLS, with librdkafka's
``socket.nagle.disable`` off (its default) and on, through:

* ``direct``         - a local Tansu broker, plaintext (reference)
* ``kthrottle``      - kthrottle in front of it, plaintext
* ``kthrottle-ssl``  - kthrottle with ``--security-protocol SSL`` (broker side plaintext)
* ``socat-ssl``      - a generic TLS terminator instead of kthrottle: socat (OpenSSL,
  TCP_NODELAY on both sides) in front of a second Tansu broker that advertises
  socat's port; needs ``socat`` on PATH (Debian package ``socat``), else skipped

Tansu cannot serve TLS itself, so ``socat-ssl`` stands for "the same client over
TLS without kthrottle". Each cell sends ``--rate`` records/s for ``--seconds``
(acks=1, linger 0, 1 KiB) on a new producer and reports p50/p99/p99.9/max of the
time from produce() to the delivery callback, and how many records took over
20 ms. "others" is the CPU (in cores) used meanwhile by processes this script did
not start: latency tails on a shared machine follow it.

    python benchmarks/tls_tail.py --runs 3
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402

from kthrottle.embedded import TansuBroker, free_port, tansu_binary, wait_for_port  # noqa: E402

CONFIGS = ("direct", "kthrottle", "kthrottle-ssl", "socat-ssl")
SLOW_MS = 20.0


class Args:
    baseline_src = None


def start_socat_ssl(procs, files):
    """socat terminating TLS in front of a second Tansu that advertises socat's port."""
    broker_port, tls_port = free_port(), free_port()
    broker = procs.spawn("tansu-behind-socat", [
        tansu_binary(), "broker", "--listener-url", "tcp://127.0.0.1:%d" % broker_port,
        "--advertised-listener-url", "tcp://127.0.0.1:%d" % tls_port,
        "--storage-engine", "memory://tansu/"])
    wait_for_port("127.0.0.1", broker_port, timeout=20, proc=broker)
    socat = procs.spawn("socat", [
        "socat", "OPENSSL-LISTEN:%d,bind=127.0.0.1,reuseaddr,fork,nodelay,verify=0,cert=%s,key=%s"
        % (tls_port, files["cert"], files["key"]), "TCP:127.0.0.1:%d,nodelay" % broker_port])
    wait_for_port("127.0.0.1", tls_port, timeout=20, proc=socat)
    bootstrap = "127.0.0.1:%d" % tls_port
    po.CLIENT_TLS[bootstrap] = files["ca"]
    return po.Endpoint("socat-ssl", bootstrap, socat), "127.0.0.1:%d" % broker_port, [broker]


def create_topic(broker_address, name, partitions):
    import subprocess

    subprocess.run([tansu_binary(), "topic", "create", "--broker", "tcp://%s" % broker_address,
                    "--partitions", str(partitions), name], check=True, capture_output=True,
                   timeout=10)


def produce_latency(bootstrap, topic, args, nagle_disable):
    """Fixed-rate sends from this thread, delivery callbacks served by a second one."""
    from confluent_kafka import Producer

    errors = []
    producer = Producer({
        **po.ck_common(bootstrap, errors), "socket.nagle.disable": nagle_disable,
        "acks": 1, "linger.ms": 0, "enable.idempotence": False, "compression.type": "none",
        "queue.buffering.max.messages": 100_000, "request.timeout.ms": 30000,
    })
    value = os.urandom(1024)
    for p in range(args.partitions):  # connections and metadata ready before timing
        producer.produce(topic, value, partition=p)
    if producer.flush(30):
        raise RuntimeError("warm-up not acknowledged: %s" % errors[:3])
    latencies, failed = [], []
    polling = threading.Event()
    polling.set()

    def poller():
        while polling.is_set():
            producer.poll(0.05)

    def on_ack(sent_at):
        def callback(err, msg):
            if err is None:
                latencies.append((time.perf_counter() - sent_at) * 1000.0)
            else:
                failed.append(err)
        return callback

    thread = threading.Thread(target=poller, daemon=True)
    thread.start()
    try:
        total, interval = int(args.rate * args.seconds), 1.0 / args.rate
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            producer.produce(topic, value, on_delivery=on_ack(time.perf_counter()))
        deadline = time.monotonic() + 30
        while len(producer) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        polling.clear()
        thread.join(5)
        producer.flush(5)
    if failed or len(latencies) != total:
        raise RuntimeError("%d of %d acknowledged, failures %s, client errors %s"
                           % (len(latencies), total, failed[:3], errors[:3]))
    return sorted(latencies)


def cpu_seconds(processes):
    total = 0.0
    for proc in processes:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def machine_busy_seconds():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="times every cell is measured")
    p.add_argument("--rate", type=int, default=2000, help="records per second")
    p.add_argument("--seconds", type=float, default=8.0, help="duration of each cell")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: %s" % ", ".join(CONFIGS))
    p.add_argument("--nagle-disable", default="false,true",
                   help="librdkafka socket.nagle.disable values to measure")
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    if set(args.configs) - set(CONFIGS):
        p.error("unknown configuration(s): %s" % ", ".join(set(args.configs) - set(CONFIGS)))
    args.nagle = [v.strip().lower() == "true" for v in args.nagle_disable.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    if "socat-ssl" in args.configs and shutil.which("socat") is None:
        print("socat not on PATH: socat-ssl skipped", file=sys.stderr)
        args.configs.remove("socat-ssl")
    log_dir = Path(tempfile.mkdtemp(prefix="tls_tail-"))
    procs = po.Processes(log_dir)
    broker = TansuBroker(log_path=str(log_dir / "tansu-broker.log"))
    results = {}  # (config, nagle_disable) -> [(p50, p99, p99.9, max, slow, others)]
    try:
        broker.start()
        files = po.tls_files(log_dir)
        endpoints, brokers, extra = {}, {}, []
        for config in args.configs:
            if config == "socat-ssl":
                endpoints[config], brokers[config], more = start_socat_ssl(procs, files)
                extra += more
            else:
                endpoints[config] = po.start_endpoint(config, broker, procs, Args)
                brokers[config] = broker.bootstrap
        ours = [psutil.Process(), psutil.Process(broker.proc.pid)] + [
            psutil.Process(p.pid) for p in [e.proc for e in endpoints.values() if e.proc] + extra]
        cells = [(c, n) for n in args.nagle for c in args.configs]
        for run in range(args.runs):
            shift = run % len(cells)
            for config, nagle in cells[shift:] + cells[:shift]:
                topic = "tls-tail-%s" % uuid.uuid4().hex[:12]
                create_topic(brokers[config], topic, args.partitions)
                ours0, busy0, t0 = cpu_seconds(ours), machine_busy_seconds(), time.monotonic()
                lat = produce_latency(endpoints[config].bootstrap, topic, args, nagle)
                elapsed = time.monotonic() - t0
                others = ((machine_busy_seconds() - busy0) - (cpu_seconds(ours) - ours0)) / elapsed
                row = (po.percentile(lat, 50), po.percentile(lat, 99), po.percentile(lat, 99.9),
                       lat[-1], sum(1 for x in lat if x > SLOW_MS), max(others, 0.0))
                results.setdefault((config, nagle), []).append(row)
                print("run %d  %-13s socket.nagle.disable=%-5s p50 %6.2f  p99 %6.2f  p99.9 %6.2f"
                      "  max %6.1f ms  over %g ms: %5d  others %.2f cores"
                      % ((run + 1, config, str(nagle).lower()) + row[:4] + (SLOW_MS,) + row[4:]),
                      flush=True)
    finally:
        po.stop_threads()
        procs.stop_all()
        broker.stop()
    print()
    print("| path | socket.nagle.disable | p50 ms | p99 ms | p99.9 ms | max ms "
          "| records over %g ms | others (cores) |" % SLOW_MS)
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for nagle in args.nagle:
        for config in args.configs:
            rows = results.get((config, nagle), [])
            if not rows:
                continue
            cols = zip(*rows)
            fmt = ("%.2f", "%.2f", "%.2f", "%.1f", "%d", "%.2f")
            print("| %s | %s | %s |" % (config, str(nagle).lower(), " | ".join(
                "/".join(f % v for v in col) for f, col in zip(fmt, cols))))
    print("\n(one value per run, in run order; %d records per cell at %d/s)"
          % (int(args.rate * args.seconds), args.rate))
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
