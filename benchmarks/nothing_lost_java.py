#!/usr/bin/env python3
"""Nothing lost, Java client, broker killed: Kafka's own VerifiableProducer (acks=all,
enable.idempotence=true) and VerifiableConsumer, the tools of Kafka's system tests, on a
topic of 3 partitions with 3 replicas and min.insync.replicas 2 of a three-node KRaft cluster
(Apache Kafka 4.4.0). Once ``--kill-after`` records are acknowledged the leader of partition 0
is killed (kill -9), started again on its data and, once every replica is in sync, given its
leadership back by a preferred election (KIP-460); the producer is stopped ``--after`` seconds
later and the consumer reads until it has every acknowledged record. The scenario is the
kit's (``kthrottle.kafka_kit.VerifiableRun``), the one tests/test_verifiable.py runs.

Each of ``--rounds`` rounds runs it through a kthrottle proxy in front of the three brokers
(a port per node, --node-ports) with a quota on each tool's client-id: 10 MB/s, which never
binds, or with ``--quota BYTES`` a producer_byte_rate that does, so that the producer is
throttled throughout; with ``--direct`` each round runs it once more straight against the
brokers (what Kafka does on its own). Every round has a topic (and a proxy) of its own.

From the tools' JSON lines: records sent and acknowledged (the producer's summary), consumed
(distinct partition and offset), lost (acknowledged, never consumed), changed (consumed with
another value than acknowledged), duplicated (a value in the log twice: what idempotence,
KIP-98, rules out), send errors; kill -> new leader (from the killed process's end to Metadata
naming another leader, polled every 0.2 s) and elapsed (the producer's start to the consumer's
catching up). Exit status 1 if any round lost, changed or doubled a record, had a send error,
or did not complete.

Everything runs on 127.0.0.1 and free ports and is stopped by its own PID at the end, on
errors and on Ctrl-C too. Writes ``nothing_lost_java.md`` and ``.json`` into a new directory
under ``benchmarks/runs/`` (or ``--output-dir``). Examples::

    python benchmarks/nothing_lost_java.py                    # 3 proxy rounds, ~2.5 minutes
    python benchmarks/nothing_lost_java.py --direct           # and 3 direct ones, ~4 minutes
    python benchmarks/nothing_lost_java.py --rounds 1 --quota 20000   # the producer throttled
"""
import argparse
import os
import subprocess
import sys
import time

from kthrottle_testkit import harness
from kthrottle_testkit.cluster_proxy import start_cluster_proxy
from kthrottle_testkit.harness import (
    Run,
    add_output_dir,
    add_rounds,
    command_line,
    fmt,
    git_describe,
    markdown_table,
    output_dir,
    parser,
    settings_of,
    write_results,
)
from kthrottle import kafka_kit

NAME = "nothing_lost_java"
PRODUCER_ID, CONSUMER_ID = "verifiable-producer", "verifiable-consumer"
NON_BINDING = 10_000_000  # bytes a second: far above what either tool moves
PARTITIONS = 3
HEADERS = ["round", "path", "records sent", "acknowledged", "consumed", "lost", "changed",
           "duplicated", "send errors", "kill → new leader (s)", "elapsed (s)",
           "producer responses throttled"]
ALIGN = "ll" + "r" * (len(HEADERS) - 2)


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0])
    add_rounds(p, 3, "rounds through the proxy (and as many direct ones with --direct)")
    p.add_argument("--direct", action="store_true",
                   help="also run each round straight against the cluster, no proxy")
    # the records only bound the producer: it is stopped --after s after the election; enough
    # for a slow restart on a loaded machine (the election must come while it still sends)
    p.add_argument("--records", type=int, default=100_000,
                   help="the most records the producer sends")
    p.add_argument("--throughput", type=int, default=2_000, help="records a second")
    p.add_argument("--kill-after", type=int, default=2_000,
                   help="records acknowledged before the leader is killed")
    p.add_argument("--after", type=float, default=3.0,
                   help="seconds the producer goes on after the preferred election")
    p.add_argument("--quota", type=int, default=argparse.SUPPRESS, metavar="BYTES",
                   help="the producer's producer_byte_rate at the proxy, one that binds: it "
                   "offers about 16 B a record (32,000 B/s at 2,000 records/s), so e.g. "
                   "20000 (not given: %d, which never does)" % NON_BINDING)
    add_output_dir(p)
    args = p.parse_args(argv)
    args.quota = getattr(args, "quota", None)
    if args.rounds < 1 or args.records < 1 or args.throughput < 1:
        p.error("--rounds, --records and --throughput must be positive")
    if args.kill_after >= args.records:
        p.error("--kill-after must be below --records")
    return args


def java_description():
    """`java -version`'s first two lines, e.g. 'openjdk version "17.0.15" 2025-04-15; OpenJDK
    Runtime Environment (build 17.0.15+6-...)'."""
    out = subprocess.run([kafka_kit.java_binary(), "-version"], capture_output=True,
                         text=True, timeout=30).stderr
    return "; ".join(out.strip().splitlines()[:2])


def start_proxy(run, cluster, quota_file, name):
    """A proxy in front of every node (a port of its own for each node id), checked to name
    only its own ports in Metadata, so that the tools stay behind it."""
    return start_cluster_proxy(run, cluster, ["--quota-file", str(quota_file)], name)


def client_metric(text, name, client_id):
    """``name``'s value for ``client_id``'s bucket in the proxy's /metrics (0: no series)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and 'client_id="%s"' % client_id in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def one_round(run, cluster, args, number, path):
    """The scenario through a fresh proxy ("proxy") or straight to the brokers ("direct"):
    a row of the table, as a dict."""
    workdir = run.path("round-%d-%s" % (number, path))
    workdir.mkdir(parents=True, exist_ok=True)
    proxy = None
    if path == "proxy":
        quota_file = workdir / "quotas.toml"
        quota_file.write_text('[clients."%s"]\nproducer_byte_rate = %d\n'
                              '[clients."%s"]\nconsumer_byte_rate = %d\n'
                              % (PRODUCER_ID, args.quota or NON_BINDING,
                                 CONSUMER_ID, NON_BINDING))
        proxy = start_proxy(run, cluster, quota_file, "kthrottle-round-%d" % number)
        bootstrap = proxy.bootstrap
    else:
        bootstrap = cluster.bootstrap
    print("round %d, %s: bootstrap %s" % (number, path, bootstrap), flush=True)
    scenario = kafka_kit.VerifiableRun(
        cluster, bootstrap, workdir, records=args.records, throughput=args.throughput,
        kill_after=args.kill_after, after=args.after, partitions=PARTITIONS,
        producer_id=PRODUCER_ID, consumer_id=CONSUMER_ID, log=lambda s: print(s, flush=True),
        # a throttled producer's close drains what it holds at the quota's pace; nothing stays
        # longer than delivery.timeout.ms (120 s) in it
        producer_grace=130.0 if args.quota and path == "proxy" else 30.0)
    metrics = None
    try:
        result = scenario.run()
        if proxy is not None:
            metrics = harness.admin_get(proxy.admin_port)
    finally:
        if proxy is not None:
            run.procs.stop(proxy.proc)
    row = {
        "round": number, "path": path, "topic": result.topic, "sent": result.sent,
        "acked": result.acked, "consumed": result.consumed, "lost": len(result.lost),
        "changed": len(result.changed), "duplicated": len(result.duplicated),
        "send_errors": len(result.send_errors), "failover_s": result.failover,
        "elapsed_s": result.elapsed, "ok": result.ok, "caught_up": result.caught_up,
        "election_acked": result.election_acked, "victim": result.victim,
        "new_leader": result.new_leader,
        "election": {p: None if e is None else str(e) for p, e in result.election.items()},
        "timeline": result.timeline, "lost_sample": result.lost[:10],
        "changed_sample": result.changed[:10],
        "duplicated_sample": list(result.duplicated.items())[:10],
        "send_error_sample": result.send_errors[:3],
    }
    if metrics is not None:
        row.update({
            "produce_bytes": client_metric(metrics, "kthrottle_produce_bytes_total",
                                           PRODUCER_ID),
            "fetch_bytes": client_metric(metrics, "kthrottle_fetch_bytes_total", CONSUMER_ID),
            "produce_throttled": client_metric(
                metrics, "kthrottle_produce_throttled_responses_total", PRODUCER_ID),
            "fetch_throttled": client_metric(
                metrics, "kthrottle_fetch_throttled_responses_total", CONSUMER_ID),
            "proxy_traceback": "Traceback" in run.path("kthrottle-round-%d.log"
                                                       % number).read_text(errors="replace"),
        })
    print("round %d, %s: sent %s acked %s consumed %d lost %d changed %d duplicated %d send "
          "errors %d; kill -> new leader %.1f s; %.1f s%s" % (
              number, path, result.sent, result.acked, result.consumed, len(result.lost),
              len(result.changed), len(result.duplicated), len(result.send_errors),
              result.failover, result.elapsed, "" if result.ok else "  NOT OK"), flush=True)
    return row


def table_row(row):
    integer = lambda v: None if v is None else format(int(v), ",")  # noqa: E731
    return [row["round"], row["path"], integer(row["sent"]), integer(row["acked"]),
            integer(row["consumed"]), integer(row["lost"]), integer(row["changed"]),
            integer(row["duplicated"]), integer(row["send_errors"]),
            fmt(row["failover_s"]), fmt(row["elapsed_s"]),
            integer(row.get("produce_throttled"))]


def markdown(args, rows, facts, command, elapsed, stopped):
    quota = ("producer_byte_rate %s B/s on the producer (binding: it is throttled "
             "throughout), consumer_byte_rate %s on the consumer"
             % (format(args.quota, ","), format(NON_BINDING, ","))
             if args.quota else "%s B/s on each (never binds)" % format(NON_BINDING, ","))
    lines = [
        "# Nothing lost: Java client, broker killed", "",
        "Kafka's VerifiableProducer (acks=all, enable.idempotence=true, at most %s records at "
        "%s a second) and VerifiableConsumer on a topic of %d partitions with 3 replicas and "
        "min.insync.replicas 2, on a three-node KRaft cluster (Apache Kafka %s). After %s "
        "acknowledged records the leader of partition 0 is killed (kill -9), started again on "
        "its data and, once every replica is in sync, given its leadership back by a preferred "
        "election; the producer is stopped %g s later and the consumer reads until it has "
        "every acknowledged record. *proxy*: both tools through a kthrottle proxy in front of "
        "the three brokers, with a quota on each client-id: %s. *direct*: straight to the "
        "brokers." % (format(args.records, ","), format(args.throughput, ","), PARTITIONS,
                      kafka_kit.KAFKA_VERSION, format(args.kill_after, ","), args.after,
                      quota), "",
    ]
    lines += markdown_table(HEADERS, [table_row(row) for row in rows], ALIGN)
    lines += [
        "",
        "From the tools' JSON lines: sent and acknowledged as the producer's summary counts "
        "them; consumed: distinct (partition, offset) read; lost: acknowledged, never "
        "consumed; changed: consumed with another value than acknowledged; duplicated: values "
        "in the log more than once; kill → new leader: from the killed process's end to "
        "Metadata naming another leader of partition 0 (polled every 0.2 s); elapsed: the "
        "producer's start to the consumer's catching up. Throttled responses: what the proxy "
        "answered the producer with a throttle time (- : no proxy).", "",
    ]
    bad = [row for row in rows if not row["ok"]]
    if stopped:
        lines.append("**The run did not complete: %s.**" % stopped)
    if bad:
        lines.append("**Not nothing-lost in round(s) %s.**" % ", ".join(
            "%d %s" % (row["round"], row["path"]) for row in bad))
    elif rows:
        lines.append("Every round: every acknowledged record consumed, with its value, none "
                     "twice; no send error; the kill and the election both while the producer "
                     "sent.")
    lines += ["", "## Timelines", ""]
    for row in rows:
        lines.append("Round %d, %s (topic %s; seconds since the producer started, records "
                     "acknowledged by then)%s:" % (
                         row["round"], row["path"], row["topic"],
                         "; the proxy counted %s bytes of Produce from the producer, %s of "
                         "Fetch to the consumer" % (format(int(row["produce_bytes"]), ","),
                                                    format(int(row["fetch_bytes"]), ","))
                         if "produce_bytes" in row else ""))
        lines.append("")
        lines += ["    %5.1f s  %-55s %s" % (at, what, format(acked, ","))
                  for at, what, acked in row["timeline"]]
        lines.append("")
    lines += [
        "## Setup", "",
        "- command: `%s`" % command,
        "- whole run: %.0f s" % elapsed,
        "- Apache Kafka %s (Maven jars, scripts/kafka-jars), 3 KRaft nodes, each broker and "
        "controller, broker.session.timeout.ms 4000" % kafka_kit.KAFKA_VERSION,
        "- Java: %s" % facts.get("java", "unknown"),
        "- kthrottle %s, Python %s" % (facts["kthrottle_commit"], facts["python"]),
        "- machine: %d CPUs (%s), load average %s at the start" % (
            facts["nproc"], facts["cpu_model"], facts["load_at_start"]),
        "- date: %s" % facts["date"], "",
    ]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    command = command_line(NAME, argv)
    out = output_dir(args, NAME)
    facts = {
        "kthrottle_commit": git_describe(), "python": sys.version.split()[0],
        "nproc": os.cpu_count(), "cpu_model": harness.cpu_model(),
        "load_at_start": " ".join("%.1f" % x for x in os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "kafka": kafka_kit.KAFKA_VERSION,
    }
    rows = []
    paths = ["proxy", "direct"] if args.direct else ["proxy"]
    with Run(NAME) as run:
        facts["java"] = java_description()
        lib = kafka_kit.fetch_kafka_lib()
        cluster = kafka_kit.KafkaCluster(run.path("kafka"), n=3, lib=lib, log_dir=run.log_dir)
        run.procs.on_stop(lambda: cluster.stop(keep=False))  # start stops it if it fails
        cluster.start()
        print("Apache Kafka %s: 3 nodes (pids %s) on %s, up in %.1f s; logs in %s" % (
            cluster.version, ", ".join(str(n.proc.pid) for n in cluster.nodes.values()),
            cluster.bootstrap, cluster.started_in, run.log_dir), flush=True)
        for number in range(1, args.rounds + 1):
            for path in paths:
                rows.append(one_round(run, cluster, args, number, path))
    markdown_text = markdown(args, rows, facts, command, run.elapsed, run.stopped)
    write_results(out, NAME, markdown_text, {
        "settings": settings_of(args), "facts": facts, "command": command,
        "elapsed_s": run.elapsed, "stopped": run.stopped, "rounds": rows})
    print("\n".join(markdown_table(HEADERS, [table_row(row) for row in rows], ALIGN)))
    print("whole run: %.0f s" % run.elapsed)
    return run.finish(failed=not rows or not all(row["ok"] for row in rows))


if __name__ == "__main__":
    sys.exit(main())
