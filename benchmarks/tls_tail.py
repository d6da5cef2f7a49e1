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
import shutil
import sys
import threading
import time
import uuid

import psutil

from kthrottle_testkit.harness import (
    CLIENT_TLS,
    Endpoint,
    Run,
    ck_produce_latency,
    cpu_seconds,
    create_topic,
    free_port,
    machine_cpu,
    markdown_table,
    parser,
    percentile,
    tansu_binary,
    tls_files,
    wait_for_port,
)

CONFIGS = ("direct", "kthrottle", "kthrottle-ssl", "socat-ssl")
SLOW_MS = 20.0


def start_socat_ssl(run, files):
    """socat terminating TLS in front of a second Tansu that advertises socat's port."""
    broker_port, tls_port = free_port(), free_port()
    broker = run.procs.spawn("tansu-behind-socat", [
        tansu_binary(), "broker", "--listener-url", "tcp://127.0.0.1:%d" % broker_port,
        "--advertised-listener-url", "tcp://127.0.0.1:%d" % tls_port,
        "--storage-engine", "memory://tansu/"])
    wait_for_port("127.0.0.1", broker_port, timeout=20, proc=broker)
    socat = run.procs.spawn("socat", [
        "socat", "OPENSSL-LISTEN:%d,bind=127.0.0.1,reuseaddr,fork,nodelay,verify=0,cert=%s,key=%s"
        % (tls_port, files["cert"], files["key"]), "TCP:127.0.0.1:%d,nodelay" % broker_port])
    wait_for_port("127.0.0.1", tls_port, timeout=20, proc=socat)
    bootstrap = "127.0.0.1:%d" % tls_port
    CLIENT_TLS[bootstrap] = files["ca"]
    return Endpoint("socat-ssl", bootstrap, socat), "127.0.0.1:%d" % broker_port, [broker]


def start_endpoint(config, run, broker, files):
    """(endpoint, the broker address topics are created on, extra processes)."""
    if config == "socat-ssl":
        return start_socat_ssl(run, files)
    if config == "direct":
        return Endpoint("direct", broker.bootstrap), broker.bootstrap, []
    ssl = ("--security-protocol", "SSL", "--ssl-cert", files["cert"], "--ssl-key", files["key"])
    endpoint = run.kthrottle(broker, ssl if config == "kthrottle-ssl" else (), name=config,
                             cafile=files["ca"] if config == "kthrottle-ssl" else None)
    return endpoint, broker.bootstrap, []


def produce_latency(bootstrap, topic, args, nagle_disable):
    """Fixed-rate sends of 1 KiB records (linger 0), delivery callbacks served by a second
    thread; every record must be acknowledged."""
    load = argparse.Namespace(record_size=1024, partitions=args.partitions, batch_size=16384,
                              max_in_flight=100_000, rate=args.rate,
                              latency_seconds=args.seconds)
    latencies, _, _ = ck_produce_latency(bootstrap, topic, load, threading.Event(),
                                         {"socket.nagle.disable": nagle_disable})
    total = int(args.rate * args.seconds)
    if len(latencies) != total:
        raise RuntimeError("%d of %d acknowledged" % (len(latencies), total))
    return latencies


def cpu_of(processes):
    return sum(cpu_seconds(p, children=True) or 0.0 for p in processes)


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0])
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
    results = {}  # (config, nagle_disable) -> [(p50, p99, p99.9, max, slow, others)]
    with Run("tls_tail", catch=False) as run:
        broker = run.broker()
        files = tls_files(run.log_dir)
        endpoints, brokers, extra = {}, {}, []
        for config in args.configs:
            endpoints[config], brokers[config], more = start_endpoint(config, run, broker, files)
            extra += more
        ours = [psutil.Process(), psutil.Process(broker.proc.pid)] + [
            psutil.Process(p.pid) for p in [e.proc for e in endpoints.values() if e.proc] + extra]
        cells = [(c, n) for n in args.nagle for c in args.configs]
        for rnd in range(args.runs):
            shift = rnd % len(cells)
            for config, nagle in cells[shift:] + cells[:shift]:
                topic = "tls-tail-%s" % uuid.uuid4().hex[:12]
                create_topic(brokers[config], topic, args.partitions)
                ours0, busy0, t0 = cpu_of(ours), machine_cpu()[0], time.monotonic()
                lat = produce_latency(endpoints[config].bootstrap, topic, args, nagle)
                elapsed = time.monotonic() - t0
                others = ((machine_cpu()[0] - busy0) - (cpu_of(ours) - ours0)) / elapsed
                row = (percentile(lat, 50), percentile(lat, 99), percentile(lat, 99.9),
                       lat[-1], sum(1 for x in lat if x > SLOW_MS), max(others, 0.0))
                results.setdefault((config, nagle), []).append(row)
                print("run %d  %-13s socket.nagle.disable=%-5s p50 %6.2f  p99 %6.2f  p99.9 %6.2f"
                      "  max %6.1f ms  over %g ms: %5d  others %.2f cores"
                      % ((rnd + 1, config, str(nagle).lower()) + row[:4] + (SLOW_MS,) + row[4:]),
                      flush=True)
    rows = []
    for nagle in args.nagle:
        for config in args.configs:
            if results.get((config, nagle)):
                cols = zip(*results[(config, nagle)])
                fmt = ("%.2f", "%.2f", "%.2f", "%.1f", "%d", "%.2f")
                rows.append([config, str(nagle).lower()] + [
                    "/".join(f % v for v in col) for f, col in zip(fmt, cols)])
    print()
    print("\n".join(markdown_table(
        ("path", "socket.nagle.disable", "p50 ms", "p99 ms", "p99.9 ms", "max ms",
         "records over %g ms" % SLOW_MS, "others (cores)"), rows, align="ll" + "r" * 6)))
    print("\n(one value per run, in run order; %d records per cell at %d/s)"
          % (int(args.rate * args.seconds), args.rate))
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
