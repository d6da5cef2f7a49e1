#!/usr/bin/env python3
"""Nothing lost: every record a producer saw acknowledged through kthrottle is there to read,
once, in order, after the producer was throttled, paused for storage and the broker restarted.

Everything runs on 127.0.0.1 and free ports, started here and stopped by PID at the end:

* a local S3 server (moto's server mode) holding the broker's data, so that it outlives the
  broker process (Tansu's ``memory://`` engine keeps nothing across a restart);
* a Tansu broker on ``s3://tansu/`` against it; or, with ``--broker kafka``, instead of
  both, one Apache Kafka node (KRaft, node id 111, ``broker.session.timeout.ms`` 4000 so that
  it registers again soon after a kill -9) keeping its data on local disk;
* a ZooKeeper holding the client quota (Kafka's ``/config/clients/<client-id>`` layout, written
  with ``kthrottle quotas alter --zookeeper``) and the cluster-state snapshot, which this script
  writes and refreshes as ``kthrottle spark-sync`` would;
* one ``kthrottle proxy --zookeeper ...`` in front of the broker, never restarted.

A confluent-kafka (librdkafka) producer, ``enable.idempotence=true`` and ``acks=all``, writes
``--records`` records through the proxy, as fast as the proxy lets it: its client-id has a
``producer_byte_rate`` quota (``--quota``) below what it offers, so it is throttled from start to
end. The key of record ``i`` is ``i`` (a sequence over the whole run, whatever the partition) and
its value ``i:`` padded to ``--record-size`` bytes. aiokafka's idempotent producer cannot be used
against Tansu 0.6: it sends InitProducerId v0, which Tansu answers with UNKNOWN_SERVER_ERROR.

On the way, when ``--pause-at`` of the records are acknowledged, the cluster state goes to
PAUSE (a volume past its hard limit): the proxy holds the producer's Produce requests; at least
``--pause-seconds`` after the proxy applied it the state goes back under the soft limit (OPEN)
and the held requests go on. The broker is killed (SIGKILL, as a crash: Tansu given SIGTERM goes
on serving its open connections for seconds) and started again on the same port after
``--down-seconds``:

* ``--restart-during pause`` (default): a second into the pause, once the requests the broker
  had when it began are answered, so that no write is in flight at the broker; the pause is
  released after the broker is back. Connections through the proxy break and are made again,
  with Produce requests held in the proxy, fetches going on.
* ``--restart-during flow``: when ``--restart-at`` of the records are acknowledged, after the
  pause, whatever is in flight. Tansu 0.6's s3:// engine loses or misnumbers acknowledged
  records when it is killed while it writes (the retried batch is answered
  DUPLICATE_SEQUENCE_NUMBER though it cannot be read afterwards, and the partition's next
  records are acknowledged at offsets other records already hold): ``--direct`` shows the same
  with no proxy in the path (benchmarks/results/nothing_lost.md). With ``--broker kafka``
  the flow variant holds too (a kill -9 of the process keeps what it wrote in the page cache).

``--direct``: the clients talk straight to the broker (no proxy, so no quota and no pause; the
restart happens during flow): what the broker does on its own.

An aiokafka consumer reads the topic through the same proxy meanwhile, from the start, until
every partition is read past the end offset the broker reports once the producer has flushed
and past the last offset acknowledged there; then a fresh consumer reads it all again from the
start (what is stored, not only what could be read at some moment). For each reading: every
acknowledged record must have been read (missing), none twice (duplicates), the keys must rise
within each partition (out of order), and each record must sit at the partition and offset its
acknowledgement named; and no offset may have been acknowledged for two records. The last line
printed, with the final reading's counts, is::

    produced P acknowledged A consumed C missing M duplicates D

and the exit status is non-zero if anything is missing, duplicated, out of order or misplaced,
a delivery failed, or the run did not complete. Writes ``nothing_lost.md`` into
``--output-dir`` (default: a new directory under ``benchmarks/runs/``, which git ignores;
``--output-dir benchmarks/results`` replaces the committed report; ``--report-name`` changes
the name); a failed run keeps its logs and a ``details.txt`` of the records not read back.

The scenario itself (what runs and what is checked) is the test kit's
(``kthrottle_testkit/nothing_lost.py``), which ``tests/test_nothing_lost.py`` runs at a small
size; this file is its command line and its report.

Examples::

    python benchmarks/nothing_lost.py --records 100000
    python benchmarks/nothing_lost.py            # 1,000,000 records, about 2 minutes
    python benchmarks/nothing_lost.py --records 200000 --direct --report-name direct.md
    python benchmarks/nothing_lost.py --broker kafka --records 100000 --report-name kafka.md
"""
import sys

from kthrottle_testkit.harness import (
    Run,
    add_output_dir,
    command_line,
    machine_facts,
    new_runner,
    output_dir,
    parser,
)
from kthrottle_testkit.nothing_lost import Scenario, describe, run_scenario


# --------------------------------------------------------------------------- report


def broker_text(s):
    """What the broker was, for the report."""
    if s.broker == "kafka":
        from kthrottle.kafka_kit import KAFKA_VERSION

        return ("one Apache Kafka %s node (KRaft, broker and controller in one JVM; its data on "
                "local disk, kept across the kill)" % KAFKA_VERSION)
    return "Tansu on s3:// (moto)"


def broker_version(s, facts):
    if s.broker == "kafka":
        from kthrottle.kafka_kit import KAFKA_VERSION

        return "Apache Kafka %s" % KAFKA_VERSION
    return facts.get("tansu")


def setup_text(s, elapsed):
    """One paragraph: what this run did."""
    if s.direct:
        path = ("straight to the broker (no proxy: no quota, no pause); broker SIGKILL at %d%% "
                "acknowledged, down %g s" % (s.restart_at * 100, s.down_seconds))
    else:
        restart = ("broker SIGKILL a second into the pause (no write in flight at the broker), "
                   "down %g s, the pause released after it is back" % s.down_seconds
                   if s.restart_during == "pause" else
                   "broker SIGKILL at %d%% acknowledged, while records flow, down %g s"
                   % (s.restart_at * 100, s.down_seconds))
        path = ("through one kthrottle proxy with a producer_byte_rate quota of %s B/s; PAUSE "
                "at %d%% acknowledged for at least %g s; %s" % (
                    format(s.quota, ","), s.pause_at * 100, s.pause_seconds, restart))
    return ("%s records of %d B, %d partitions; idempotent confluent-kafka producer, acks=all, "
            "%s; %s; aiokafka consumer on the same path. Whole run %.0f s."
            % (format(s.records, ","), s.record_size, s.partitions, path, broker_text(s),
               elapsed))


def markdown(out, facts, command, elapsed):
    lines = [
        "# Nothing lost: throttled, paused for storage, broker restarted",
        "",
        "`%s` (%s, %d cores, %s; %s; confluent-kafka %s / librdkafka %s, aiokafka %s)" % (
            command, facts.get("kthrottle_commit"), facts.get("nproc") or 0,
            facts.get("cpu_model"), broker_version(out.scenario, facts),
            facts.get("confluent_kafka"),
            facts.get("librdkafka"), facts.get("aiokafka")),
        "",
        setup_text(out.scenario, elapsed),
        "",
        "```",
        *describe(out),
        out.summary(),
        "```",
        "",
        "Result: %s." % ("nothing lost, nothing duplicated, in order" if out.ok() else "FAILED"),
        "",
        "Record i has key i and value `i:` padded to the record size. Missing: acknowledged "
        "but never read; duplicates: read more than once; out of order: a key not above the "
        "one before it in its partition; at another partition/offset: read elsewhere than its "
        "delivery report named. The pause and a flow-time restart are triggered by the number "
        "of acknowledged records; the waits are the longest gaps between acknowledgements "
        "(producer) or fetched records (consumer). %s; neither client nor the proxy is "
        "restarted or reconfigured." % (
            "The Kafka node is killed with SIGKILL and started again on its own data directory "
            "(a process kill keeps what it wrote in the OS page cache)"
            if out.scenario.broker == "kafka" else
            "Tansu's data lives in moto's S3 server, which is never restarted"),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = parser(
        "Produce sequence-numbered records through kthrottle (idempotent, acks=all) while the "
        "producer is throttled, paused for storage once and the broker restarts once; check "
        "every acknowledged record is consumed back once, in order.")
    d = Scenario()
    p.add_argument("--records", type=int, default=d.records, help="records to produce")
    p.add_argument("--record-size", type=int, default=d.record_size,
                   help="value bytes per record (the sequence number, then padding)")
    p.add_argument("--partitions", type=int, default=d.partitions,
                   help="partitions of the topic (the producer's default partitioner by key)")
    p.add_argument("--quota", type=int, default=d.quota,
                   help="producer_byte_rate of the producer's client-id, bytes/s; the "
                   "producer's queue holds about a second of it (with --direct too)")
    p.add_argument("--pause-at", type=float, default=d.pause_at,
                   help="fraction of the records acknowledged when the storage PAUSE starts")
    p.add_argument("--pause-seconds", type=float, default=d.pause_seconds,
                   help="how long PAUSE stays in force at least (at most 20: under the "
                   "clients' request.timeout.ms)")
    p.add_argument("--restart-during", choices=("pause", "flow"), default=d.restart_during,
                   help="pause: kill the broker while PAUSE holds the producer, no write in "
                   "flight at the broker; flow: at --restart-at, whatever is in flight")
    p.add_argument("--restart-at", type=float, default=d.restart_at,
                   help="--restart-during flow (and --direct): fraction acknowledged when the "
                   "broker is killed")
    p.add_argument("--down-seconds", type=float, default=d.down_seconds,
                   help="how long the broker stays down")
    p.add_argument("--direct", action="store_true",
                   help="no proxy: the clients talk straight to the broker, which restarts "
                   "during flow (no quota, no pause): what the broker does on its own")
    p.add_argument("--broker", choices=("tansu", "kafka"), default=d.broker,
                   help="tansu: Tansu with its data on a local S3 server (moto); kafka: one "
                   "Apache Kafka node (KRaft), its data on local disk")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up after this many seconds (default: from records and quota)")
    add_output_dir(p, help="where the report is written")
    p.add_argument("--report-name", default="nothing_lost.md", help="the report's file name")
    args = p.parse_args(argv)
    if args.records < 10 or args.record_size < 16 or args.partitions < 1 or args.quota < 1000:
        p.error("need --records >= 10, --record-size >= 16, --partitions >= 1, --quota >= 1000")
    if not 0 < args.pause_at < 1 or not 0 < args.restart_at < 1:
        p.error("need --pause-at and --restart-at between 0 and 1")
    if args.restart_during == "flow" and not args.direct and args.restart_at <= args.pause_at:
        p.error("--restart-during flow restarts after the pause: need --restart-at > --pause-at")
    if not 0 < args.pause_seconds <= 20 or not 0 <= args.down_seconds <= 15:
        p.error("need 0 < --pause-seconds <= 20 and 0 <= --down-seconds <= 15")
    return args


def main(argv=None):
    args = parse_args(argv)
    output_dir(args, "nothing_lost")
    command = command_line("nothing_lost", argv)
    scenario = Scenario(records=args.records, record_size=args.record_size,
                        partitions=args.partitions, quota=args.quota, pause_at=args.pause_at,
                        pause_seconds=args.pause_seconds, restart_during=args.restart_during,
                        restart_at=args.restart_at, down_seconds=args.down_seconds,
                        direct=args.direct, timeout=args.timeout, broker=args.broker)
    if scenario.broker == "kafka":
        from kthrottle import kafka_kit

        kafka_kit.fetch_kafka_lib()  # scripts/kafka-jars: quick once the jars are there
    facts = machine_facts()
    with Run("nothing_lost", catch=False) as run:  # run_scenario stops what it starts
        with new_runner() as runner:
            out = runner.run(run_scenario(scenario, run.log_dir))
    if run.interrupted:
        return run.finish()
    for line in describe(out):
        print(line)
    print("whole run: %.1f s" % run.elapsed)
    print(out.summary(), flush=True)
    (args.output_dir / args.report_name).write_text(markdown(out, facts, command, run.elapsed))
    print("wrote %s" % (args.output_dir / args.report_name))
    return run.finish(not out.ok())


if __name__ == "__main__":
    sys.exit(main())
