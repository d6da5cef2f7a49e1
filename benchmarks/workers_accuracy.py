#!/usr/bin/env python3
"""Is one quota held as one across the workers of ``kthrottle proxy --workers N``?

A local Tansu broker and, per cell, a fresh ``kthrottle proxy --workers N`` with a quota file
giving client-id ``shared`` a ``producer_byte_rate``. ``--producers`` aiokafka producers with
that client-id produce 1 KiB records as fast as the proxy lets them; with several workers,
producers are opened until every worker carries at least one (each worker's log lines name it,
``[worker N]``). The rate delivered from ``--steady-from`` to ``--seconds``, in record bytes,
is compared with the quota: 1.0 is the quota held exactly (the proxy counts whole frames, a few
percent more than the record bytes); N workers each holding the quota alone would give about
N times it. Window mode re-bursts every ~11 s (Kafka's sampled windows), so measure it over
several windows (``--seconds 66``).

Writes ``workers_accuracy.md`` into ``--output-dir`` (default: a new directory under
``benchmarks/runs/``). Every process it starts is on 127.0.0.1, on free ports, and stopped by
its PID.

Example (about 3 minutes)::

    python benchmarks/workers_accuracy.py --workers 1,2 --modes token-bucket
"""
import argparse
import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from kthrottle.embedded import TansuBroker, free_port, wait_for_port  # noqa: E402

RECORD = b"x" * 1024
OPENED = re.compile(r"\[worker (\d+)\] kthrottle\.proxy: connection \d+ opened: client \S+ "
                    r"-> node \d+ listener")


def producer(bootstrap):
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="shared", acks=1,
                            linger_ms=5, max_batch_size=16384)


async def producers_on_every_worker(bootstrap, log, topic, count, workers):
    """(worker, started producer) pairs: ``count`` or more, every worker carrying one."""
    out = []
    while len(out) < count or len({w for w, _ in out}) < workers:
        if len(out) >= 8 * max(count, workers):
            raise RuntimeError("the kernel put %d connections on workers %s only"
                               % (len(out), sorted({w for w, _ in out})))
        before = len(OPENED.findall(log.read_text()))
        p = producer(bootstrap)
        await p.start()
        await p.send_and_wait(topic, RECORD, partition=0)  # opens its node connection
        opened = OPENED.findall(log.read_text())[before:]
        out.append((int(opened[-1]) if opened else 0, p))
    return out


async def produce(p, topic, delivered, start, stop_at):
    loop = asyncio.get_running_loop()
    pending = set()
    while loop.time() < stop_at:
        fut = await p.send(topic, RECORD, partition=0)
        fut.add_done_callback(lambda f: delivered.append(loop.time() - start))
        pending.add(fut)
        if len(pending) > 100:
            _, pending = await asyncio.wait(pending, timeout=0.2,
                                            return_when=asyncio.FIRST_COMPLETED)


async def measure(bootstrap, log, topic, args, workers):
    placed = await producers_on_every_worker(bootstrap, log, topic, args.producers, workers)
    loop = asyncio.get_running_loop()
    start = loop.time()
    delivered = [[] for _ in placed]
    try:
        await asyncio.gather(*(produce(p, topic, delivered[i], start, start + args.seconds)
                               for i, (_, p) in enumerate(placed)))
    finally:
        for _, p in placed:
            try:
                await asyncio.wait_for(p.stop(), 10)
            except asyncio.TimeoutError:
                pass
    records = sum(1 for times in delivered for t in times if args.steady_from <= t < args.seconds)
    rate = records * len(RECORD) / (args.seconds - args.steady_from)
    return rate, [w for w, _ in placed]


def cell(broker, workdir, workers, mode, quota, args):
    quotas = workdir / ("quotas-%s.toml" % uuid.uuid4().hex[:6])
    quotas.write_text("[clients.shared]\nproducer_byte_rate = %d\n" % quota)
    log = workdir / ("proxy-%d-%s-%d.log" % (workers, mode, quota))
    port, node = free_port(), free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", broker.bootstrap,
             "--listen", "127.0.0.1:%d" % port, "--node-port-base", str(node - 111),
             "--workers", str(workers), "--quota-file", str(quotas), "--quota-mode", mode],
            stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        wait_for_port("127.0.0.1", port, proc=proc)
        deadline = time.time() + 30
        while workers > 1 and "workers serving" not in log.read_text():
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("the workers did not start (log: %s)" % log)
            time.sleep(0.1)
        topic = "accuracy-%s" % uuid.uuid4().hex[:8]
        broker.create_topic(topic)
        rate, placed = asyncio.run(measure("127.0.0.1:%d" % port, log, topic, args, workers))
        return rate / quota, placed
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--modes", default="token-bucket,window", help="--quota-mode values")
    p.add_argument("--quotas", default="100000,1000000", help="producer_byte_rate values, B/s")
    p.add_argument("--producers", type=int, default=4, help="producers of the one client-id")
    p.add_argument("--seconds", type=float, default=35.0, help="how long each cell produces")
    p.add_argument("--steady-from", type=float, default=5.0,
                   help="seconds left out at the start (the burst allowance)")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="workers-accuracy-") as tmp:
        workdir = Path(tmp)
        broker = TansuBroker(log_path=str(workdir / "tansu.log")).start()
        try:
            for workers in [int(w) for w in args.workers.split(",")]:
                for mode in args.modes.split(","):
                    for quota in [int(q) for q in args.quotas.split(",")]:
                        ratio, placed = cell(broker, workdir, workers, mode, quota, args)
                        spread = " ".join("worker %d: %d" % (w, placed.count(w))
                                          for w in sorted(set(placed)))
                        rows.append("| %d | %s | %d | %s | %.3f |" % (workers, mode, quota,
                                                                      spread, ratio))
                        print(rows[-1], flush=True)
        finally:
            broker.stop()
    table = "\n".join(["| workers | mode | quota (B/s) | producers | delivered / quota |",
                       "|---|---|---:|---|---:|"] + rows)
    out_dir = args.output_dir or REPO / "benchmarks" / "runs" / time.strftime(
        "workers_accuracy-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/workers_accuracy.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    (out_dir / "workers_accuracy.md").write_text(
        "# One quota across workers\n\n`%s`: record bytes delivered per second from %g s to "
        "%g s, against client-id `shared`'s producer_byte_rate.\n\n%s\n"
        % (command, args.steady_from, args.seconds, table))
    print("wrote workers_accuracy.md in %s" % out_dir)


if __name__ == "__main__":
    main()
