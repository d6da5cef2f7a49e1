"""``kthrottle volume-agent``: the report it builds from real log dirs, its
flags, and its publications to a real Apache Kafka broker (directly, through a
terminating SASL kthrottle, and while the broker goes away and comes back)."""
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from kthrottle.kafka_kit import KafkaBroker
from kthrottle.embedded import free_port
from kthrottle.policy.storage import Limit, parse_limit, parse_report, volume_state
from kthrottle.sources.kafka_publisher import _LastKafkaError
from kthrottle.spark_sync import agent
from kthrottle_testkit import BROKER_NODE_ID, ROOT
from kthrottle_testkit.clients import kthrottle_quotas, wait_until
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

SOFT, HARD = "MinFreePercentage:20", "MinFreeBytes:1GiB"
@pytest.fixture(scope="module")
def broker(own_kafka):
    """A broker of this module's own: its tests read the volume report topic by its default name."""
    return own_kafka


PARTITIONS = [("my-topic", 7), ("orders", 0), ("orders", 1)]
SLACK = 256 * 1024 * 1024  # disk usage moves while the test runs


def make_log_dir(path, partitions=PARTITIONS, junk=True):
    path.mkdir(parents=True, exist_ok=True)
    for topic, partition in partitions:
        d = path / ("%s-%d" % (topic, partition))
        d.mkdir()
        (d / "00000000000000000000.log").write_bytes(b"x" * 100)
    if junk:
        for name in (".lock", "meta.properties", "recovery-point-offset-checkpoint",
                     "cleaner-offset-checkpoint", "files-3"):  # files-3: a file, not a dir
            (path / name).write_text("junk")
        for name in ("orders-2.0f1e2d3c4b5a69788796a5b4c3d2e1f0-delete",
                     "orders-3.0f1e2d3c4b5a69788796a5b4c3d2e1f0-future",
                     "lost+found", "orders-x", "-4", "tmp"):
            (path / name).mkdir()
    return path


def statvfs_bytes(path):
    """(Capacity, Consumed) as the agent reports them: the bytes in use, plus
    what an unprivileged user may still write (f_bavail, not f_bfree)."""
    st = os.statvfs(path)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return used + st.f_bavail * st.f_frsize, used


def usage_of(f_blocks, f_bfree, f_bavail, f_frsize):
    """psutil.disk_usage's used and free from statvfs numbers, as psutil
    computes them (checked against the real file system below)."""
    return SimpleNamespace(used=(f_blocks - f_bfree) * f_frsize, free=f_bavail * f_frsize)


# the report, from real directories ------------------------------------------------------

def test_report_lists_exactly_the_partitions_and_the_volume_statvfs_gives(tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    report, problems = agent.collect_report(
        4, [str(log_dir)], parse_limit(SOFT), parse_limit(HARD), 1_700_000_000.0)
    assert problems == []
    assert report.broker_id == 4 and report.snapshot_at == 1_700_000_000.0
    (volume,) = report.volumes
    assert list(volume.partitions) == PARTITIONS
    assert volume.log_dir == str(log_dir)
    capacity, consumed = statvfs_bytes(tmp_path)
    assert volume.capacity == capacity
    assert abs(volume.consumed - consumed) < SLACK
    assert volume.name == agent.LocalVolumes()(str(tmp_path))
    assert volume.name  # a device (/dev/...) or a mount point
    # what goes on the wire, and what the Spark job reads back
    data = json.loads(report.to_json())
    assert data["BrokerId"] == 4 and data["SnapshotAt"] == "2023-11-14T22:13:20.000Z"
    assert data["SoftLimit"] == {"type": "MinFreePercentage", "level": 20}
    assert data["HardLimit"] == {"type": "MinFreeBytes", "level": 1024 ** 3}
    assert data["Volumes"][0]["Partitions"] == ["my-topic-7", "orders-0", "orders-1"]
    assert parse_report(report.to_json()) == report


def test_two_log_dirs_on_one_filesystem_are_one_volume(tmp_path):
    a = make_log_dir(tmp_path / "data-0", [("orders", 0), ("__cluster_metadata", 0)])
    b = make_log_dir(tmp_path / "data-1", [("orders", 1), ("payments", 12)], junk=False)
    report, problems = agent.collect_report(1, [str(a), str(b)], parse_limit(SOFT),
                                            parse_limit(HARD), time.time())
    assert problems == []
    (volume,) = report.volumes
    assert volume.log_dir == "%s,%s" % (a, b)
    assert list(volume.partitions) == [("__cluster_metadata", 0), ("orders", 0), ("orders", 1),
                                       ("payments", 12)]
    assert volume.capacity == statvfs_bytes(tmp_path)[0]


def test_log_dirs_on_two_filesystems_are_two_volumes(tmp_path):
    other_fs = "/dev/shm"
    if not os.path.isdir(other_fs) or os.stat(other_fs).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm)")
    a = make_log_dir(tmp_path / "data-0", [("orders", 0)])
    b = make_log_dir(tmp_path / "data-1", [("orders", 2)])
    with tempfile.TemporaryDirectory(dir=other_fs) as shm:
        c = make_log_dir(Path(shm) / "data-2", [("orders", 1)])
        report, problems = agent.collect_report(1, [str(a), str(c), str(b)], parse_limit(SOFT),
                                                parse_limit(HARD), time.time())
        assert problems == []
        by_log_dir = {v.log_dir: v for v in report.volumes}
        assert set(by_log_dir) == {"%s,%s" % (a, b), str(c)}
        assert by_log_dir[str(c)].partitions == (("orders", 1),)
        assert by_log_dir["%s,%s" % (a, b)].partitions == (("orders", 0), ("orders", 2))
        assert by_log_dir[str(c)].capacity == statvfs_bytes(shm)[0]
        assert len({v.name for v in report.volumes}) == 2


def test_a_missing_or_unlistable_log_dir_is_reported_and_the_rest_published(tmp_path):
    good = make_log_dir(tmp_path / "good")
    missing = tmp_path / "missing"
    report, problems = agent.collect_report(1, [str(missing), str(good)], parse_limit(SOFT),
                                            parse_limit(HARD), time.time())
    assert [v.log_dir for v in report.volumes] == [str(good)]
    assert problems == ["log dir %s: cannot measure its volume: No such file or directory"
                        % missing]

    def unlistable(path):
        if path == str(good):
            raise PermissionError(13, "Permission denied", path)
        return agent.list_partitions(path)

    other = make_log_dir(tmp_path / "other", [("orders", 5)])
    report, problems = agent.collect_report(1, [str(good), str(other)], parse_limit(SOFT),
                                            parse_limit(HARD), time.time(),
                                            partitions_of=unlistable)
    # the volume is still measured: its usage is what protects it
    (volume,) = report.volumes
    assert volume.partitions == (("orders", 5),) and volume.capacity > 0
    assert problems == ["log dir %s: cannot list its partitions: Permission denied" % good]

    report, problems = agent.collect_report(1, [str(missing)], parse_limit(SOFT),
                                            parse_limit(HARD), time.time())
    assert report.volumes == () and len(problems) == 1


def test_collect_report_with_a_given_usage_and_clock():
    fs = {"/a": usage_of(f_blocks=1000, f_bfree=250, f_bavail=250, f_frsize=4096),
          "/b": usage_of(f_blocks=10, f_bfree=10, f_bavail=10, f_frsize=512),
          "/c": usage_of(f_blocks=1000, f_bfree=250, f_bavail=200, f_frsize=4096)}
    names = {"/a": "/dev/sda1", "/b": "/mnt/b", "/c": "/dev/sdc1"}
    listing = {"/a": [("t", 1), ("t", 0)], "/b": [], "/c": [("u", 0)]}
    report, problems = agent.collect_report(
        9, ["/a", "/b", "/c"], Limit("ConsumedSpace", 100.0), Limit("ConsumedSpace", 200.0),
        12.5, usage=fs.__getitem__, volume_of=names.__getitem__,
        partitions_of=listing.__getitem__)
    assert problems == []
    assert [(v.name, v.capacity, v.consumed, v.partitions) for v in report.volumes] == [
        ("/dev/sda1", 4096000, 3072000, (("t", 0), ("t", 1))),
        # 50 blocks reserved for root: not part of what the broker can fill
        ("/dev/sdc1", 3891200, 3072000, (("u", 0),)), ("/mnt/b", 5120, 0, ())]


def stable_statvfs(path, measure, tries=50):
    """(statvfs, measure()) taken while the file system did not change, so
    that the two can be compared exactly on a disk other processes write to."""
    for _ in range(tries):
        before = os.statvfs(path)
        result = measure()
        if os.statvfs(path) == before:
            return before, result
    pytest.skip("the file system under %s kept changing" % path)


def test_usage_is_what_an_unprivileged_user_may_write_on_a_real_directory(tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    st, usage = stable_statvfs(log_dir, lambda: psutil.disk_usage(str(log_dir)))
    # psutil's free is f_bavail (what a non-root broker may still write), used f_blocks-f_bfree
    assert usage.free == st.f_bavail * st.f_frsize
    assert usage.used == (st.f_blocks - st.f_bfree) * st.f_frsize
    st, (report, problems) = stable_statvfs(log_dir, lambda: agent.collect_report(
        1, [str(log_dir)], parse_limit(SOFT), parse_limit(HARD), time.time()))
    assert problems == []
    (volume,) = report.volumes
    assert volume.capacity - volume.consumed == st.f_bavail * st.f_frsize
    assert volume.consumed == (st.f_blocks - st.f_bfree) * st.f_frsize
    if st.f_bfree > st.f_bavail:  # this file system reserves blocks (ext4: 5% by default)
        assert volume.capacity < st.f_blocks * st.f_frsize
        assert volume.capacity - volume.consumed < st.f_bfree * st.f_frsize


# ext4, 100 GiB in 4 KiB blocks: 5% reserved for root (mkfs.ext4 -m 5) plus the
# 4096 clusters ext4 holds back for itself (min(2%, 4096)); statfs's f_bavail
# leaves both out
EXT4_BLOCKS, EXT4_BSIZE = 26_214_400, 4096
EXT4_HELD_BACK = EXT4_BLOCKS * 5 // 100 + 4096


@pytest.mark.parametrize("avail_blocks, measured_state, f_bfree_state", [
    # the broker's user gets ENOSPC: counted right, PAUSE; f_bfree saw 5.02% free
    (0, "PAUSE", "THROTTLE"),
    # 1% of the disk left to write: past MinFreePercentage:5 already
    (EXT4_BLOCKS // 100, "PAUSE", "THROTTLE"),
    # 20% left: open either way
    (EXT4_BLOCKS // 5, "OPEN", "OPEN"),
])
def test_a_min_free_percentage_hard_limit_trips_when_the_brokers_user_runs_out(
        avail_blocks, measured_state, f_bfree_state):
    soft, hard = parse_limit("MinFreePercentage:10"), parse_limit("MinFreePercentage:5")
    bfree = avail_blocks + EXT4_HELD_BACK
    fs = {"/data": usage_of(EXT4_BLOCKS, bfree, avail_blocks, EXT4_BSIZE)}
    report, problems = agent.collect_report(
        3, ["/data"], soft, hard, 1.0, usage=fs.__getitem__, volume_of=lambda p: "/dev/sdb",
        partitions_of=lambda p: [("orders", 0)])
    assert problems == []
    ((volume, state),) = report.volume_states()
    free = volume.capacity - volume.consumed
    assert free == avail_blocks * EXT4_BSIZE
    assert state.state == measured_state
    # what counting f_bfree as free (the agent before) made of the same disk
    old = volume_state(EXT4_BLOCKS * EXT4_BSIZE, (EXT4_BLOCKS - bfree) * EXT4_BSIZE, soft, hard)
    assert old.state == f_bfree_state
    assert 100.0 * bfree / EXT4_BLOCKS > 5.0  # ~5% "free" where nothing can be written
    if avail_blocks == 0:
        assert volume.consumed == volume.capacity
        assert 100.0 * volume.consumed / volume.capacity == 100.0  # df's Use%


def test_min_free_bytes_counts_only_what_the_brokers_user_may_write():
    """MinFreeBytes:1GiB with 512 MiB left to the broker's user and 5 GiB
    more reserved for root: PAUSE (f_bfree would show 5.5 GiB free)."""
    blocks, bsize = EXT4_BLOCKS, EXT4_BSIZE
    avail = 512 * 1024 * 1024 // bsize
    reserved = 5 * 1024 ** 3 // bsize
    fs = {"/data": usage_of(blocks, avail + reserved, avail, bsize)}
    report, _ = agent.collect_report(
        3, ["/data"], parse_limit("MinFreeBytes:2GiB"), parse_limit("MinFreeBytes:1GiB"), 1.0,
        usage=fs.__getitem__, volume_of=lambda p: "/dev/sdb", partitions_of=lambda p: [])
    ((volume, state),) = report.volume_states()
    assert volume.capacity - volume.consumed == 512 * 1024 * 1024
    assert state.state == "PAUSE"


def test_volume_names_come_from_the_device_or_the_mount_point(tmp_path, monkeypatch):
    # psutil reads <PROCFS_PATH>/self/mounts when PROCFS_PATH is not /proc
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mounts").write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "tmpfs /dev/shm tmpfs rw,relatime 0 0\n"
        "/dev/sdb1 /var/lib/kafka\\040data xfs rw,relatime 0 0\n"
        "/dev/sdb1 /srv/kafka-bind xfs rw,relatime 0 0\n"  # a bind mount: its source device
        "nas:/export /mnt/nfs nfs4 rw 0 0\n"
        "tmpfs /mnt/nfs tmpfs rw 0 0\n"  # stacked: the last one is visible
        "garbage\n")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    mounts = agent.read_mounts()
    assert mounts == {"/": "/dev/vda", "/dev/shm": "tmpfs", "/var/lib/kafka data": "/dev/sdb1",
                      "/srv/kafka-bind": "/dev/sdb1", "/mnt/nfs": "tmpfs"}
    points = {"/", "/dev/shm", "/var/lib/kafka data", "/srv/kafka-bind", "/mnt/nfs"}
    ismount = points.__contains__
    assert agent.volume_name("/var/lib/kafka data/logs-0", mounts, ismount) == "/dev/sdb1"
    assert agent.volume_name("/srv/kafka-bind/logs-1", mounts, ismount) == "/dev/sdb1"
    assert agent.volume_name("/dev/shm/kafka", mounts, ismount) == "/dev/shm"
    assert agent.volume_name("/mnt/nfs/kafka", mounts, ismount) == "/mnt/nfs"
    assert agent.volume_name("/srv/kafka", mounts, ismount) == "/dev/vda"
    assert agent.volume_name("/srv/kafka", {}, ismount) == "/"


def test_this_hosts_mounts_name_a_real_log_dirs_volume(tmp_path):
    mounts = agent.read_mounts()
    point = agent.mount_point(str(tmp_path))
    assert point in mounts  # psutil lists the mount tmp_path lives on
    name = agent.LocalVolumes(mounts)(str(tmp_path))
    assert name == (mounts[point] if mounts[point].startswith("/dev/") else point)


# durations and flags ------------------------------------------------------------

def test_durations():
    assert agent.parse_duration("30s") == 30.0
    assert agent.parse_duration("5m") == 300.0
    assert agent.parse_duration("500ms") == 0.5
    assert agent.parse_duration("2") == 2.0
    assert agent.parse_duration("1.5") == 1.5
    for bad in ("0", "0s", "-1s", "abc", "5 minutes", ""):
        with pytest.raises(ValueError):
            agent.parse_duration(bad)


BASE = ["--bootstrap-server", "127.0.0.1:9092", "--broker-id", "3", "--log-dir", "/data",
        "--soft-limit", SOFT, "--hard-limit", HARD]


def test_settings_from_flags(tmp_path):
    s = agent.parse_settings(BASE + ["--log-dir", "/data", "--log-dir", "/data2"])
    assert s.bootstrap_servers == ("127.0.0.1:9092",) and s.broker_id == 3
    assert s.log_dirs == ("/data", "/data2")  # the repeat counted once
    assert s.interval == 30.0 and not s.once and s.topic == "__kthrottle_volume_usage"
    # a publication is bounded by default: 10 s to connect, create the topic and be acked
    assert s.timeout == 10.0 and s.client_config()["bootstrap_timeout_ms"] == 10000
    assert s.soft == Limit("MinFreePercentage", 20.0)
    assert s.hard == Limit("MinFreeBytes", 1024.0 ** 3)
    assert s.client_config()["security_protocol"] == "PLAINTEXT"
    assert "sasl_plain_password" not in s.client_config()

    s = agent.parse_settings(BASE + ["--interval", "5m", "--metrics-listen", "127.0.0.1:9309"])
    assert s.interval == 300.0 and s.metrics_listen == ("127.0.0.1", 9309)

    pw = tmp_path / "pw"
    pw.write_text("s3cret-from-file\n")
    s = agent.parse_settings(BASE + ["--security-protocol", "sasl_plaintext",
                                     "--sasl-username", "agent", "--sasl-password-file", str(pw)],
                             environ={})
    assert s.sasl_password == "s3cret-from-file" and s.sasl_mechanism == "SCRAM-SHA-512"
    assert "s3cret" not in repr(s) and "s3cret" not in s.describe()
    config = s.client_config()
    assert (config["security_protocol"], config["sasl_mechanism"], config["sasl_plain_username"],
            config["sasl_plain_password"]) == ("SASL_PLAINTEXT", "SCRAM-SHA-512", "agent",
                                               "s3cret-from-file")
    s = agent.parse_settings(BASE + ["--security-protocol", "SASL_SSL", "--sasl-mechanism",
                                     "PLAIN", "--sasl-username", "agent"],
                             environ={agent.PASSWORD_ENV: "from-env"})
    assert s.sasl_password == "from-env" and s.sasl_mechanism == "PLAIN"

    ca = tmp_path / "ca.pem"
    ca.write_text("pem")
    s = agent.parse_settings(BASE + ["--security-protocol", "SSL", "--ssl-ca", str(ca),
                                     "--ssl-cert", str(ca), "--ssl-key", str(ca)])
    assert {k: v for k, v in s.client_config().items() if k.startswith("ssl_")} == {
        "ssl_cafile": str(ca), "ssl_certfile": str(ca), "ssl_keyfile": str(ca)}


@pytest.mark.parametrize("extra, message", [
    (["--soft-limit", "Foo:20"], "argument --soft-limit: limit type must be one of"),
    (["--hard-limit", "MinFreePercentage:120"], "MinFreePercentage must be within 0-100"),
    (["--hard-limit", "MinFreeBytes:lots"], "not a size in bytes"),
    (["--soft-limit", "MinFreeBytes:1GiB", "--hard-limit", "MinFreeBytes:2GiB"],
     "--hard-limit MinFreeBytes:2147483648 is stricter than --soft-limit"),
    (["--interval", "soon"], "argument --interval: not a duration"),
    (["--interval", "1s", "--once"], "not allowed with argument"),
    (["--broker-id", "-1"], "a broker id is an integer >= 0"),
    (["--bootstrap-server", "nohost"], "must be HOST:PORT"),
    (["--security-protocol", "TLS"], "--security-protocol must be one of PLAINTEXT, SSL"),
    (["--sasl-username", "agent"], "--sasl-username is for SASL"),
    (["--security-protocol", "SASL_SSL"], "needs --sasl-username"),
    (["--security-protocol", "SASL_SSL", "--sasl-username", "a"],
     "--sasl-password-file PATH or the environment variable KTHROTTLE_AGENT_SASL_PASSWORD"),
    (["--security-protocol", "SASL_SSL", "--sasl-username", "a", "--sasl-password-file", "/nope"],
     "cannot read --sasl-password-file /nope"),
    (["--security-protocol", "SSL", "--ssl-cert", "/etc/hostname"], "go together"),
    (["--ssl-ca", "/etc/hostname"], "--ssl-ca is for TLS"),
    (["--topic", "bad topic"], "--topic must be a Kafka topic name"),
])
def test_bad_flags_exit_2_with_a_message(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        agent.parse_settings(BASE + extra, environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "kthrottle volume-agent: error:" in err and message in err, err


def agent_cmd(*args):
    return [sys.executable, "-m", "kthrottle", "volume-agent", *args]


def run_agent(*args, timeout=30, env=None):
    return subprocess.run(agent_cmd(*args), capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def test_the_command_rejects_bad_flags_and_explains_them():
    done = run_agent(*BASE[:-1], "MinFreeBytes:2GiB", "--soft-limit", "MinFreeBytes:1GiB",
                     "--once")
    assert done.returncode == 2
    assert done.stderr.startswith("kthrottle volume-agent: error: ")
    assert "is stricter than --soft-limit" in done.stderr
    done = run_agent("--broker-id", "1", "--soft-limit", SOFT, "--hard-limit", HARD)
    assert done.returncode == 2 and "the following arguments are required" in done.stderr
    assert "--log-dir" in done.stderr and "--bootstrap-server" in done.stderr
    help_text = run_agent("--help").stdout
    for flag in ("--bootstrap-server", "--broker-id", "--log-dir", "--soft-limit",
                 "--hard-limit", "--interval", "--once", "--topic", "--metrics-listen",
                 "--security-protocol", "--ssl-ca", "--ssl-cert", "--ssl-key",
                 "--sasl-mechanism", "--sasl-username", "--sasl-password-file",
                 agent.PASSWORD_ENV, "security (towards the cluster)", "example"):
        assert flag in help_text, flag


def test_once_with_no_readable_log_dir_exits_1_without_a_broker(tmp_path):
    done = run_agent("--bootstrap-server", "127.0.0.1:%d" % free_port(), "--broker-id", "1",
                     "--log-dir", str(tmp_path / "gone"), "--soft-limit", SOFT,
                     "--hard-limit", HARD, "--once", "--timeout", "2s")
    assert done.returncode == 1
    assert "log dir %s: cannot measure its volume" % (tmp_path / "gone") in done.stderr
    assert "kthrottle volume-agent: error: none of the log dirs could be measured" in done.stderr


# with a real broker -------------------------------------------------------------

def read_reports(bootstrap, topic, at_least=1, timeout=15.0):
    """[(key, value)] of the topic, from the beginning of every partition."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             request_timeout_ms=10000)
    try:
        partitions = wait_until(lambda: consumer.partitions_for_topic(topic), 10, 0.2)
        assert partitions, "topic %s does not exist" % topic
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < at_least and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out += [(r.key, r.value) for r in records]
        return out
    finally:
        consumer.close()


def metrics_of(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def topic_name():
    return "vu-%s" % uuid.uuid4().hex[:8]


class AgentProcess:
    def __init__(self, log_path, *args):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(agent_cmd(*args), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=ROOT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        """SIGTERM to its own PID; the exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise


def wait_for_metric(port, name, predicate, timeout, proc):
    def check():
        assert proc.poll() is None, "the agent exited with %s" % proc.returncode
        try:
            value = metrics_of(port).get(name)
        except OSError:
            return None
        return value is not None and predicate(value)

    assert wait_until(check, timeout, 0.1), "%s: %s" % (name, metrics_of(port))


def test_once_publishes_a_report_keyed_by_the_broker_id(broker, tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    topic = topic_name()
    started = time.time()
    done = run_agent("--bootstrap-server", broker.bootstrap, "--broker-id", "7",
                     "--log-dir", str(log_dir), "--soft-limit", SOFT, "--hard-limit", HARD,
                     "--topic", topic, "--once")
    assert done.returncode == 0, done.stderr
    assert ("created topic %s (cleanup.policy=compact,min.cleanable.dirty.ratio=0.1,"
            "segment.ms=3600000)" % topic) in done.stderr
    assert "published the report of broker 7 to %s-0 at offset 0" % topic in done.stderr
    ((key, value),) = read_reports(broker.bootstrap, topic)
    assert key == b"7"
    report = parse_report(value)
    assert report.broker_id == 7
    assert started - 1 <= report.snapshot_at <= time.time()
    assert (report.soft, report.hard) == (parse_limit(SOFT), parse_limit(HARD))
    (volume,) = report.volumes
    assert list(volume.partitions) == PARTITIONS and volume.log_dir == str(log_dir)
    capacity, consumed = statvfs_bytes(log_dir)
    assert volume.capacity == capacity and abs(volume.consumed - consumed) < SLACK

    # a second run finds the topic and appends the next report under the same key
    done = run_agent("--bootstrap-server", broker.bootstrap, "--broker-id", "7",
                     "--log-dir", str(log_dir), "--soft-limit", SOFT, "--hard-limit", HARD,
                     "--topic", topic, "--once")
    assert done.returncode == 0, done.stderr
    assert "created topic" not in done.stderr
    assert [k for k, _ in read_reports(broker.bootstrap, topic, at_least=2)] == [b"7", b"7"]


def test_interval_publishes_serves_metrics_and_stops_on_sigterm(broker, tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    topic, port = topic_name(), free_port()
    p = AgentProcess(tmp_path / "agent.log", "--bootstrap-server", broker.bootstrap,
                     "--broker-id", "111", "--log-dir", str(log_dir), "--soft-limit", SOFT,
                     "--hard-limit", HARD, "--topic", topic, "--interval", "1s",
                     "--metrics-listen", "127.0.0.1:%d" % port)
    try:
        wait_for_metric(port, "kthrottle_volume_agent_publications_total",
                        lambda v: v >= 2, 8, p.proc)
        m = metrics_of(port)
        assert m["kthrottle_volume_agent_connected"] == 1
        assert m["kthrottle_volume_agent_publication_errors_total"] == 0
        assert abs(m["kthrottle_volume_agent_last_publication_timestamp_seconds"]
                   - time.time()) < 5
        name = parse_report(read_reports(broker.bootstrap, topic)[0][1]).volumes[0].name
        capacity, _ = statvfs_bytes(log_dir)
        assert m['kthrottle_volume_capacity_bytes{volume="%s"}' % name] == capacity
        assert m['kthrottle_volume_consumed_bytes{volume="%s"}' % name] > 0
        assert len(read_reports(broker.bootstrap, topic, at_least=2)) >= 2
    finally:
        code = p.stop()
    assert code == 0, p.log()
    assert "stopping (SIGTERM)" in p.log()
    assert "Traceback" not in p.log()


def test_an_absent_broker_fails_once_with_exit_1_and_a_clear_error(tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    address = "127.0.0.1:%d" % free_port()  # nothing listens there
    started = time.monotonic()
    done = run_agent("--bootstrap-server", address, "--broker-id", "1", "--log-dir",
                     str(log_dir), "--soft-limit", SOFT, "--hard-limit", HARD, "--once",
                     "--timeout", "2s", timeout=25)
    assert time.monotonic() - started < 20
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kthrottle volume-agent: error: not published within 2s")
    assert address in last and "last connection error: KafkaConnectionError" in last
    assert "Traceback" not in done.stderr


def test_a_broker_that_goes_away_is_counted_and_reconnected(tmp_path):
    log_dir = make_log_dir(tmp_path / "kafka-logs")
    # an Apache Kafka node of the test's own (the default topic is its alone), killed and
    # started again on its data; after a kill -9 its controller takes the new registration
    # once the old session has expired: 4 s, not the default 9 s
    b = KafkaBroker(node_id=BROKER_NODE_ID, workdir=tmp_path / "kafka",
                    log_path=tmp_path / "kafka.log", keep=True,
                    config={"broker.session.timeout.ms": "4000",
                            "broker.heartbeat.interval.ms": "500"})
    port = free_port()
    p = None
    try:
        b.start()
        p = AgentProcess(tmp_path / "agent.log", "--bootstrap-server", b.bootstrap,
                         "--broker-id", "2", "--log-dir", str(log_dir), "--soft-limit", SOFT,
                         "--hard-limit", HARD, "--interval", "500ms", "--timeout", "1s",
                         "--metrics-listen", "127.0.0.1:%d" % port)
        # (the first publication creates the topic)
        wait_for_metric(port, "kthrottle_volume_agent_publications_total",
                        lambda v: v >= 1, 20, p.proc)
        b.kill()  # a crash: no controlled shutdown
        wait_for_metric(port, "kthrottle_volume_agent_publication_errors_total",
                        lambda v: v >= 4, 12, p.proc)
        assert metrics_of(port)["kthrottle_volume_agent_connected"] == 0
        published = metrics_of(port)["kthrottle_volume_agent_publications_total"]
        b.start()  # the same port, on its data: the topic and its reports are still there
        wait_for_metric(port, "kthrottle_volume_agent_publications_total",
                        lambda v: v > published, 30, p.proc)
        assert metrics_of(port)["kthrottle_volume_agent_connected"] == 1
        failed = metrics_of(port)["kthrottle_volume_agent_publication_errors_total"]
        reports = read_reports(b.bootstrap, agent.DEFAULT_TOPIC, at_least=int(published) + 1)
        assert len(reports) >= published + 1  # those before the kill, and after
        assert {key for key, _ in reports} == {b"2"}
    finally:
        code = p.stop() if p is not None else None
        b.stop(keep=False)
    assert code == 0, p.log()
    assert "not published within 1s" in p.log() and "ECONNREFUSED" in p.log()
    # logged when it starts failing and per new reason, not per failed publication
    errors = [line for line in p.log().splitlines() if " ERROR " in line]
    assert 1 <= len(errors) < failed, errors
    assert "published again, after %d failed publication(s)" % failed in p.log()


def test_publishes_through_a_terminating_sasl_kthrottle(broker, tmp_path):
    password = "agent-pw-%s" % uuid.uuid4().hex[:10]
    creds = tmp_path / "credentials.toml"
    done = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "users",
                            "--entity-name", "volume-agent", "--add-config",
                            "SCRAM-SHA-512=[password=%s]" % password)
    assert done.returncode == 0, done.stderr
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--security-protocol", "SASL_PLAINTEXT",
                          "--credentials-file", str(creds)]).start()
    try:
        pw_file = tmp_path / "agent-password"
        pw_file.write_text(password + "\n")
        log_dir = make_log_dir(tmp_path / "kafka-logs")
        topic = topic_name()
        common = ["--bootstrap-server", proxy.bootstrap, "--broker-id", "5", "--log-dir",
                  str(log_dir), "--soft-limit", SOFT, "--hard-limit", HARD, "--topic", topic,
                  "--once", "--log-level", "DEBUG", "--security-protocol", "SASL_PLAINTEXT",
                  "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", "volume-agent"]
        done = run_agent(*common, "--sasl-password-file", str(pw_file))
        assert done.returncode == 0, done.stderr
        assert password not in done.stdout + done.stderr
        assert "as 'volume-agent' with SCRAM-SHA-512" in done.stderr
        proxy.wait_for_log("client authenticated as 'volume-agent' with SCRAM-SHA-512")
        ((key, value),) = read_reports(broker.bootstrap, topic)
        assert key == b"5" and parse_report(value).volumes[0].partitions == tuple(PARTITIONS)

        # a wrong password (from the environment): refused, said, and not shown
        wrong = "wrong-%s" % uuid.uuid4().hex[:10]
        started = time.monotonic()
        done = run_agent(*common, "--timeout", "2s", env={agent.PASSWORD_ENV: wrong})
        assert done.returncode == 1 and time.monotonic() - started < 20
        assert wrong not in done.stdout + done.stderr
        # said in the error line itself, not only in kafka-python's DEBUG lines:
        # every attempt gets the failure answer before the proxy closes (it
        # waits for the client's close), and a later attempt the deadline cuts
        # short does not hide it
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("kthrottle volume-agent: error: not published within 2s"), last
        assert "last connection error: [Error 58] SaslAuthenticationFailedError" in last, last
        assert "socket disconnected" not in done.stderr, done.stderr[-3000:]
    finally:
        proxy.stop()


def test_an_authentication_failure_stays_the_error_told_until_the_next_publication():
    kept = _LastKafkaError()
    kafka_log = logging.getLogger("kafka.test-last-error")
    kafka_log.addHandler(kept)
    kafka_log.propagate = False
    try:
        def failed(error):
            kafka_log.warning("Bootstrap connection to bootstrap-0 failed: %s (backoff 0.05 secs)",
                              error)

        failed("KafkaConnectionError: socket disconnected")
        assert kept.last == "KafkaConnectionError: socket disconnected"
        failed("[Error 58] SaslAuthenticationFailedError: SaslAuthenticationFailedError: "
               "Authentication failed during authentication due to invalid credentials")
        # the last attempt, cut short by the publication's deadline, says less
        failed("[Error 7] RequestTimedOutError: Request timed out after 62 ms")
        failed("KafkaConnectionError: socket disconnected")
        assert kept.take() == ("[Error 58] SaslAuthenticationFailedError: Authentication "
                               "failed during authentication due to invalid credentials")
        failed("KafkaConnectionError: socket disconnected")  # the next publication: news
        assert kept.take() == "KafkaConnectionError: socket disconnected"
    finally:
        kafka_log.removeHandler(kept)


def test_publishes_over_mtls_to_a_tls_kthrottle(broker, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA(organization_name="kthrottle tests")
    ca_pem, server_pem, server_key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "s.key"
    ca.cert_pem.write_to_path(str(ca_pem))
    server = ca.issue_cert("127.0.0.1", "localhost")
    for i, pem in enumerate(server.cert_chain_pems):
        pem.write_to_path(str(server_pem), append=i > 0)
    server.private_key_pem.write_to_path(str(server_key))
    leaf = ca.issue_cert("agent@example.com", common_name="volume-agent")
    cert, key = tmp_path / "agent.pem", tmp_path / "agent.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    proxy = ProxyProcess(broker.bootstrap, tmp_path / "proxy.log",
                         ["--security-protocol", "SSL", "--ssl-cert", str(server_pem),
                          "--ssl-key", str(server_key), "--ssl-ca", str(ca_pem),
                          "--ssl-client-auth", "required"]).start()
    try:
        log_dir = make_log_dir(tmp_path / "kafka-logs")
        topic = topic_name()
        common = ["--bootstrap-server", proxy.bootstrap, "--broker-id", "6", "--log-dir",
                  str(log_dir), "--soft-limit", SOFT, "--hard-limit", HARD, "--topic", topic,
                  "--once", "--timeout", "2s", "--security-protocol", "SSL",
                  "--ssl-ca", str(ca_pem)]
        done = run_agent(*common, "--ssl-cert", str(cert), "--ssl-key", str(key))
        assert done.returncode == 0, done.stderr
        ((key_bytes, value),) = read_reports(broker.bootstrap, topic)
        assert key_bytes == b"6" and parse_report(value).broker_id == 6
        # without its certificate the listener refuses it: exit 1, said why
        done = run_agent(*common)
        assert done.returncode == 1
        assert "kthrottle volume-agent: error: not published within 2s" in done.stderr
    finally:
        proxy.stop()
