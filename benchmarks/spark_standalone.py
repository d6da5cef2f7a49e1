#!/usr/bin/env python3
"""``kthrottle spark-sync`` submitted with ``spark-submit`` to a Spark standalone cluster.

Started here, all on 127.0.0.1 and stopped by their PIDs: a Spark standalone master and
``--workers`` workers (``spark-class`` from the PySpark install, ``--worker-cores`` and
``--worker-memory`` each), a Tansu broker and ZooKeeper. Volume reports (broker 111, one
volume past its soft limit holding a partition of a data topic) and the usage reports of two
fleet proxies sharing a quota bucket (demand 3:1) are published to the job's default topics.
The job is submitted as users submit it::

  spark-submit --master spark://HOST:PORT --conf spark.pyspark.python=EXECUTOR_PYTHON \\
      .../kthrottle/spark_sync/submit.py --bootstrap-server ... --zookeeper ... --once

with the executors' Python a virtualenv holding only pyarrow and kafka-python (no kthrottle,
no PySpark: executors take PySpark from the Spark installation). Runs:

1. ``--once``: exit status 0, and in ZooKeeper the cluster THROTTLE 0.5, the data partition
   THROTTLE 0.5, the two proxies' shares adding up to the bucket's quota, the larger to the
   proxy with the larger demand; the Kafka partitions were read by executors on the workers
   (their logs);
2. ``--interval``: ``--cycles`` cycles, a new report (the volume full: PAUSE) published after
   the first, seen by a later cycle; then SIGTERM to spark-submit alone (its JVM): the job's
   Python and everything spark-submit started end, and the application is FINISHED;
3. what the executors need: ``--once`` again with executor Pythons lacking one thing each
   (nothing installed; pyarrow only; kafka-python only; another minor version of Python),
   and with the complete one shipped as an archive (``--archives``, Spark's way) with and
   without the same environment in spark-submit's directory: each run's exit status and
   error line;
4. for comparison, the same ``--once`` as ``kthrottle spark-sync --master local[2]``.

Reported: wall time of each submission, SparkSession start, cycle seconds, tasks per
worker; written to ``spark_standalone.md`` in ``--output-dir``. About 6 minutes on 2 cores.
Needs the spark and bench extras (``scripts/setup spark,bench``), Java 17 and Debian's
zookeeper package.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from kthrottle.policy.fleet import BucketUsage, UsageReport, parse_shares_document
from kthrottle.policy.storage import (
    PAUSE,
    THROTTLE,
    BrokerReport,
    ClusterState,
    State,
    VolumeReport,
    parse_limit,
)
from kthrottle.spark_sync import job as job_module
from kthrottle_testkit import harness

SUBMIT_FILE = str(Path(job_module.__file__).with_name("submit.py"))
SOFT, HARD = parse_limit("ConsumedSpace:500"), parse_limit("ConsumedSpace:1000")
DATA_TOPIC = "orders"
QUOTA = 1000.0

FLAGS = (
    ("--workers", int, 2, "Spark workers"),
    ("--worker-cores", int, 1, "cores each worker offers"),
    ("--worker-memory", None, "1g", "memory each worker offers"),
    ("--executor-memory", None, "512m", None),
    ("--cycles", int, 3, "cycles of the --interval run"),
    ("--interval", float, 10.0, "seconds between cycles in the --interval run"),
    ("--other-python", None, None, "a Python of another minor version, for the executors "
     "(default: python3.X on PATH or under ~/.pyenv; the check is skipped without one)"),
    ("--checks", lambda t: t.split(","),
     "bare,pyarrow,kafka-python,other-python,archive,archive-driver",
     "executor Pythons to try besides the complete one (empty: none)"),
)


# the inputs -------------------------------------------------------------------------------

def volume_report(consumed):
    return BrokerReport(harness.TANSU_NODE_ID, time.time(), SOFT, HARD, (
        VolumeReport("sda", 2000, consumed, "/var/lib/kafka", ((DATA_TOPIC, 1),)),)).to_json()


def usage_report(proxy, rate, demand):
    return UsageReport(proxy, time.time(), 5.0, (harness.TANSU_NODE_ID,), (
        BucketUsage("producer_byte_rate", "", "app", "clients/app", QUOTA, rate, demand),
    )).to_json()


def publish(bootstrap, topic, records):
    """``records``: [(key, value)], sent in order."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1)
    try:
        for key, value in records:
            producer.send(topic, key=key.encode(), value=value.encode())
        producer.flush(30)
    finally:
        producer.close()


def publish_inputs(broker, consumed):
    publish(broker.bootstrap, job_module.DEFAULT_TOPIC,
            [(str(harness.TANSU_NODE_ID), volume_report(consumed))])
    publish(broker.bootstrap, job_module.DEFAULT_USAGE_TOPIC,
            [("a", usage_report("a", 600.0, 3000.0)), ("b", usage_report("b", 400.0, 1000.0))])


# the executors' Pythons -------------------------------------------------------------------

def python_env(where, base, modules=()):
    """A virtualenv of ``base`` at ``where`` with only ``modules`` (packages of this Python,
    linked in: the same versions as the driver's); returns its python."""
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = str(Path(where) / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    for name in modules:
        module = __import__(name)
        os.symlink(os.path.dirname(module.__file__), os.path.join(site, name))
    return python


def other_python(given):
    """A Python whose minor version differs from this one's (one that runs), or None."""
    if given:
        return given
    mine = sys.version_info[1]
    near = sorted(range(8, 15), key=lambda minor: (abs(minor - mine), -minor))
    for minor in near:
        if minor == mine:
            continue
        found = [shutil.which("python3.%d" % minor)] + sorted(glob.glob(os.path.expanduser(
            "~/.pyenv/versions/3.%d.*/bin/python3.%d" % (minor, minor))))
        for path in filter(None, found):
            try:
                python_version(path)
            except (OSError, subprocess.SubprocessError):
                continue  # e.g. a pyenv shim of a version not selected
            return path
    return None


def python_version(python):
    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          check=True, capture_output=True, text=True, timeout=30).stdout.strip()


def packed(python_dir, archive):
    """``python_dir`` (a virtualenv) as a .tar.gz for ``--archives``. Its links point into
    this machine's Python, which is where the archive is unpacked here; for other hosts
    pack a relocatable environment (venv-pack, conda-pack)."""
    import tarfile

    with tarfile.open(archive, "w:gz") as tar:
        tar.add(str(python_dir), arcname=".")
    return str(archive)


# running the job --------------------------------------------------------------------------

def spark_submit():
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")


def submit_argv(master, executor_python, args, job_args):
    return [spark_submit(), "--master", master, "--name", "kthrottle-spark-sync",
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.executor.memory=%s" % args.executor_memory,
            "--conf", "spark.executor.cores=%d" % args.worker_cores,
            "--conf", "spark.cores.max=%d" % (args.workers * args.worker_cores),
            "--conf", "spark.pyspark.python=%s" % executor_python,
            "--conf", "spark.pyspark.driver.python=%s" % sys.executable,
            SUBMIT_FILE, *job_args]


def job_env():
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_GATEWAY_PORT"):
        env.pop(name, None)
    return env


def run_to_end(run, name, argv, timeout=300, cwd=None):
    """(exit status, seconds, log text) of ``argv``, started through the run's processes."""
    started = time.perf_counter()
    proc = run.procs.spawn(name, argv, env=job_env(), cwd=str(cwd or run.log_dir))
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        run.procs.stop(proc)
        raise RuntimeError("%s did not end within %d s (log %s)" % (name, timeout,
                                                                     run.path(name + ".log")))
    seconds = time.perf_counter() - started
    run.procs.stop(proc)
    return proc.returncode, seconds, run.path(name + ".log").read_text()


def session_seconds(text):
    m = re.search(r"Spark session started \(master (\S+)\) in ([\d.]+) s", text)
    return (m.group(1), float(m.group(2))) if m else (None, None)


def cycle_seconds(text):
    """[(cycle number, seconds)] from the job's log lines."""
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(
        r"cycle (\d+): .* written to \S+ in ([\d.]+) s", text)]


def error_line(text):
    """The job's last error line (without its "cycle failed, ... not written: ")."""
    lines = [ln for ln in text.splitlines() if " ERROR kthrottle" in ln]
    if lines:
        line = lines[-1].split(": ", 1)[-1]
        return line.split(" not written: ", 1)[-1]
    lines = [ln for ln in text.splitlines() if "Error" in ln or "Exception" in ln]
    return lines[-1].strip() if lines else "(no error line)"


def read_state(hosts, chroot):
    """(ClusterState, the snapshot dict, {proxy: SharesDocument}) under ``chroot``."""
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=hosts + chroot, timeout=10)
    zk.start(timeout=10)
    try:
        data, _ = zk.get(job_module.DEFAULT_ZNODE)
        shares_node = job_module.DEFAULT_ZNODE + "/shares"
        shares = {p: parse_shares_document(zk.get("%s/%s" % (shares_node, p))[0])
                  for p in zk.get_children(shares_node)}
    finally:
        zk.stop()
        zk.close()
    return ClusterState.from_json(data), json.loads(data), shares


def check_state(hosts, chroot, expected):
    """Raises unless the cluster state under ``chroot`` is ``expected`` (a State) for the
    cluster and the data partition, and the shares split the quota 3:1-ward."""
    state, snap, shares = read_state(hosts, chroot)
    problems = []
    if state.cluster != expected:
        problems.append("cluster %s, expected %s" % (state.cluster, expected))
    if state.partitions.get((DATA_TOPIC, 1)) != expected:
        problems.append("%s-1 %s, expected %s" % (DATA_TOPIC, state.partitions.get(
            (DATA_TOPIC, 1)), expected))
    if sorted(shares) != ["a", "b"]:
        problems.append("shares for %s, expected a and b" % sorted(shares))
    else:
        a, b = (shares[p].shares["producer_byte_rate", "", "app"].share for p in ("a", "b"))
        if abs(a + b - QUOTA) > 1e-6 or not a > b:
            problems.append("shares a %.1f, b %.1f of %.0f" % (a, b, QUOTA))
        if shares["a"].cycle != snap["cycle"]:
            problems.append("shares of cycle %s, snapshot of cycle %s" % (shares["a"].cycle,
                                                                          snap["cycle"]))
    if problems:
        raise AssertionError("cluster state under %s: %s" % (chroot, "; ".join(problems)))
    return snap


def tasks_per_worker(work_dir, workers):
    """{worker: tasks its executors ran} from the executors' logs (every application)."""
    out = {}
    for n in range(workers):
        logs = glob.glob(str(Path(work_dir) / ("worker-%d" % n) / "app-*" / "*" / "stderr"))
        out[n] = sum(Path(p).read_text(errors="replace").count("Running task ") for p in logs)
    return out


def master_state(master_ui):
    with urllib.request.urlopen("http://127.0.0.1:%d/json/" % master_ui, timeout=5) as answer:
        return json.load(answer)


def job_args(broker, zk, chroot, state_dir, *extra):
    return ["--bootstrap-server", broker.bootstrap, "--zookeeper", zk.hosts + chroot,
            "--state-dir", str(state_dir), "--freshness", "10m", "--usage-freshness", "10m",
            *extra]


# the runs ---------------------------------------------------------------------------------

def run_once(run, args, out, master, env_python, broker, zk):
    code, seconds, text = run_to_end(run, "submit-once", submit_argv(
        master, env_python, args, job_args(broker, zk, "/once", run.path("state-once"),
                                           "--once")))
    if code != 0:
        raise RuntimeError("spark-submit --once: exit status %d: %s" % (code, error_line(text)))
    snap = check_state(zk.hosts, "/once", State(THROTTLE, 0.5))
    session_master, session = session_seconds(text)
    if session_master != master:
        raise AssertionError("the job ran on %s, not %s" % (session_master, master))
    out["once"] = {"seconds": seconds, "session": session, "cycle": snap["cycle_seconds"]}
    print("--once: %.1f s in all, session %.1f s, cycle %.2f s; state checked" % (
        seconds, session, snap["cycle_seconds"]), flush=True)


def run_interval(run, args, out, master, env_python, broker, zk, master_ui):
    """``--cycles`` cycles; PAUSE published after the first; SIGTERM after the last."""
    name = "submit-interval"
    argv = submit_argv(master, env_python, args, job_args(
        broker, zk, "/interval", run.path("state-interval"), "--interval",
        "%gs" % args.interval))
    started = time.perf_counter()
    proc = run.procs.spawn(name, argv, env=job_env(), cwd=str(run.log_dir))
    log = run.path(name + ".log")
    deadline = time.monotonic() + 120 + args.cycles * (args.interval + 60)
    published = paused = None
    while True:
        cycles = cycle_seconds(log.read_text())
        if cycles and published is None:
            check_state(zk.hosts, "/interval", State(THROTTLE, 0.5))
            publish(broker.bootstrap, job_module.DEFAULT_TOPIC,
                    [(str(harness.TANSU_NODE_ID), volume_report(1000))])  # the volume is full
            published = len(cycles)
        elif published is not None and paused is None and len(cycles) > published:
            state, snap, _ = read_state(zk.hosts, "/interval")
            if state.cluster.state == PAUSE:  # from the cycle that listed the offsets after it
                paused = snap["cycle"]
        if len(cycles) >= args.cycles and paused is not None:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("--interval: %d cycle(s) of %d%s (exit status %s): %s" % (
                len(cycles), args.cycles, "" if paused else ", PAUSE not seen", proc.poll(),
                error_line(log.read_text())))
        time.sleep(0.5)
    check_state(zk.hosts, "/interval", State(PAUSE, 0.0))
    app_running = [a["id"] for a in master_state(master_ui).get("activeapps", ())]
    tree = psutil.Process(proc.pid).children(recursive=True)  # the job's Python among them
    stop_at = time.perf_counter()
    proc.send_signal(signal.SIGTERM)  # spark-submit's JVM alone, as `kill PID` would
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        raise RuntimeError("spark-submit did not stop within 60 s of SIGTERM") from None
    left = [p for p in tree if _alive(p, 20)]
    stopped_in = time.perf_counter() - stop_at
    run.procs.stop(proc)
    for p in left:  # reported below; not left running
        p.kill()
    text = log.read_text()
    deadline = time.monotonic() + 30
    while True:
        finished = {a["id"]: a.get("state")
                    for a in master_state(master_ui).get("completedapps", ())}
        if all(a in finished for a in app_running) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out["interval"] = {
        "seconds": stop_at - started, "session": session_seconds(text)[1],
        "cycles": cycle_seconds(text), "paused_from": paused, "published_after": published,
        "exit": code, "stopped_in": stopped_in, "left": [p.name() for p in left],
        "apps": {a: finished.get(a) for a in app_running}}
    print("--interval: cycles %s; exit status %d, every process of the job gone %.1f s after "
          "SIGTERM; application %s" % (
              ", ".join("%d: %.2f s" % c for c in out["interval"]["cycles"]), code, stopped_in,
              out["interval"]["apps"]), flush=True)
    if left or not all(state == "FINISHED" for state in out["interval"]["apps"].values()):
        raise AssertionError("after SIGTERM: %d process(es) of the job left, application %s" % (
            len(left), out["interval"]["apps"]))


def _alive(proc, timeout):
    """Whether ``proc`` (psutil) still runs ``timeout`` seconds from now at the latest."""
    try:
        proc.wait(timeout)
        return False
    except psutil.TimeoutExpired:
        return True
    except psutil.NoSuchProcess:
        return False


def run_checks(run, args, out, master, broker, zk, base, env_python):
    """``--once`` with executor Pythons that each lack something, and with the complete one
    shipped as an archive (``--archives``)."""
    candidates = {
        "bare": ("Python %s, nothing installed", []),
        "pyarrow": ("Python %s, pyarrow only", ["pyarrow"]),
        "kafka-python": ("Python %s, kafka-python only", ["kafka"]),
    }
    out["checks"] = []
    for check in args.checks:
        submit, cwd = [], run.path("cwd-" + check)
        cwd.mkdir()
        if check == "other-python":
            other = other_python(args.other_python)
            if other is None:
                print("no Python of another minor version found: that check is skipped")
                continue
            python = python_env(run.path("python-other"), other)
            label = "Python %s (the driver's is %s), nothing installed" % (
                python_version(other), python_version(sys.executable))
        elif check in ("archive", "archive-driver"):
            # Spark's way to ship an environment (Python package management in its docs):
            # unpacked as ./environment in every executor's directory
            archive = packed(Path(env_python).parent.parent, run.path("environment.tar.gz"))
            submit = ["--archives", archive + "#environment"]
            python = "./environment/bin/python"
            label = "`--archives env.tar.gz#environment`, `./environment/bin/python`"
            if check == "archive-driver":
                os.symlink(Path(env_python).parent.parent, cwd / "environment")
                label += ", the same in spark-submit's directory"
        else:
            what, modules = candidates[check]
            python = python_env(run.path("python-" + check), base, modules)
            label = what % python_version(python)
        argv = submit_argv(master, python, args, job_args(
            broker, zk, "/" + check, run.path("state-" + check), "--once", "--kafka-timeout",
            "10s"))
        argv[1:1] = submit
        code, seconds, text = run_to_end(run, "submit-" + check, argv, timeout=180, cwd=cwd)
        line = "" if code == 0 else error_line(text)
        if code == 0:
            check_state(zk.hosts, "/" + check, State(THROTTLE, 0.5))
        out["checks"].append((label, code, seconds, line))
        print("  %s: exit status %d in %.1f s%s" % (label, code, seconds,
                                                    ": " + line if line else ""), flush=True)


def run_local(run, out, broker, zk):
    argv = [sys.executable, "-m", "kthrottle", "spark-sync", "--master", "local[2]",
            *job_args(broker, zk, "/local", run.path("state-local"), "--once")]
    code, seconds, text = run_to_end(run, "local-once", argv)
    if code != 0:
        raise RuntimeError("local[2] --once: exit status %d: %s" % (code, error_line(text)))
    snap = check_state(zk.hosts, "/local", State(THROTTLE, 0.5))
    out["local"] = {"seconds": seconds, "session": session_seconds(text)[1],
                    "cycle": snap["cycle_seconds"]}
    print("local[2] --once: %.1f s in all, session %.1f s, cycle %.2f s" % (
        seconds, out["local"]["session"], snap["cycle_seconds"]), flush=True)


def report(args, out):
    facts = out["facts"]
    lines = ["# kthrottle spark-sync under spark-submit, Spark standalone", "",
             "`%s`, PySpark %s, Python %s, %d cores. A standalone master and %d workers "
             "(%d core and %s each) on 127.0.0.1, a Tansu broker, ZooKeeper; executors of "
             "%s each; the executors' Python: a virtualenv holding only pyarrow and "
             "kafka-python." % (args.command, facts["pyspark"], facts["python"], facts["nproc"],
                               args.workers, args.worker_cores, args.worker_memory,
                               args.executor_memory), ""]
    rows = []
    once = out.get("once")
    if once:
        rows.append(("spark-submit, --once", "%.1f" % once["seconds"], "%.1f" % once["session"],
                     "%.2f" % once["cycle"], "-"))
    interval = out.get("interval")
    if interval:
        rows.append(("spark-submit, --interval %gs" % args.interval,
                     "%.1f" % interval["seconds"], "%.1f" % interval["session"],
                     "%.2f" % interval["cycles"][0][1],
                     ", ".join("%.2f" % s for _, s in interval["cycles"][1:]) or "-"))
    local = out.get("local")
    if local:
        rows.append(("kthrottle spark-sync --master local[2], --once", "%.1f" % local["seconds"],
                     "%.1f" % local["session"], "%.2f" % local["cycle"], "-"))
    lines += harness.markdown_table(
        ["run", "wall s", "session s", "first cycle s (with the session)", "next cycles s"],
        rows, align="lrrrl")
    lines += ["", "wall: from the command's start to its exit (to SIGTERM for --interval)."]
    lines += [""]
    if once:
        lines.append("--once: exit status 0; in ZooKeeper the cluster and %s-1 THROTTLE 0.5, "
                     "the shares of proxies a and b adding up to the quota, a's the larger."
                     % DATA_TOPIC)
    if interval:
        lines.append("--interval: the full volume published after cycle %d was PAUSE by cycle "
                     "%d; SIGTERM to spark-submit (its JVM) alone: exit status %d, the job's "
                     "Python and every process spark-submit started gone %.1f s later; the "
                     "application %s." % (
                         interval["published_after"], interval["paused_from"], interval["exit"],
                         interval["stopped_in"],
                         ", ".join("%s %s" % kv for kv in interval["apps"].items())))
    tasks = out.get("tasks")
    if tasks:
        lines.append("Tasks run by the executors of each worker (all runs): %s." % ", ".join(
            "worker %d: %d" % kv for kv in tasks.items()))
    if out.get("checks"):
        lines += ["", "What the executors need: `--once` with other executor Pythons "
                  "(`--conf spark.pyspark.python=...`):", ""]
        checks = list(out["checks"])
        if once:
            checks.insert(0, ("Python %s, pyarrow and kafka-python (the runs above)"
                              % facts["python"], 0, once["seconds"], ""))
        lines += harness.markdown_table(
            ["executors' Python", "exit status", "wall s", "the job's error line"],
            [(label, code, "%.1f" % seconds, ("`%s`" % line.replace("|", "\\|")) if line
              else "-") for label, code, seconds, line in checks], align="lrrl")
    if out.get("stopped"):
        lines += ["", "Stopped early (%s)." % out["stopped"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = harness.flag_parser(__doc__.split("\n\n")[0], FLAGS, raw=True)
    args = p.parse_args(argv)
    args.command = harness.command_line("spark_standalone", argv)
    args.checks = [c for c in args.checks if c]
    if args.cycles < 2:
        p.error("--cycles must be 2 or more: a report is published after the first")
    harness.output_dir(args, "spark_standalone")
    import pyspark

    out = {"facts": {"pyspark": pyspark.__version__, "python": python_version(sys.executable),
                     "nproc": os.cpu_count()}}
    with harness.Run("spark_standalone") as run:
        zk = run.zookeeper()
        broker = run.broker()
        for topic, partitions in ((job_module.DEFAULT_TOPIC, 2),
                                  (job_module.DEFAULT_USAGE_TOPIC, 2), (DATA_TOPIC, 3)):
            broker.create_topic(topic, partitions=partitions)
        publish_inputs(broker, 750)
        work_dir = run.path("spark-standalone")
        master = harness.spark_standalone(run.procs, workers=args.workers,
                                          worker_cores=args.worker_cores,
                                          worker_memory=args.worker_memory, work_dir=work_dir)
        master_ui = int(re.search(r"MasterWebUI to \S+ and started at http://[^:/]+:(\d+)",
                                  run.path("spark-master.log").read_text()).group(1))
        print("Spark master %s with %d workers" % (master, args.workers), flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        env_python = python_env(run.path("python-executors"), base, ["pyarrow", "kafka"])
        run_once(run, args, out, master, env_python, broker, zk)
        run_interval(run, args, out, master, env_python, broker, zk, master_ui)
        out["tasks"] = tasks_per_worker(work_dir, args.workers)
        if not all(out["tasks"].values()):
            raise AssertionError("tasks per worker: %s (every worker should have run some)"
                                 % out["tasks"])
        publish_inputs(broker, 750)  # THROTTLE again, as for the first run
        run_checks(run, args, out, master, broker, zk, base, env_python)
        run_local(run, out, broker, zk)
    if not out.get("once"):
        return run.finish(failed=True)
    out["stopped"] = run.stopped
    text = report(args, out)
    print(text)
    harness.write_results(args.output_dir, "spark_standalone", markdown=text)
    return run.finish(failed=bool(run.stopped))


if __name__ == "__main__":
    sys.exit(main())
