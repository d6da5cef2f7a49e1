"""What a fresh machine gets: `pip install .` with no extras gives a `kthrottle`
whose every command starts (its --help at least), and `scripts/run-local` in a
fresh copy of the repository installs what it needs, serves, and stops.

Both install from the package index into folders of their own (pip's cache
makes a second run quick); nothing here uses the test virtual environment's
packages for the commands under test."""
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit import ROOT, TANSU_NODE_ID
from test_first_contact import confluent_roundtrip

pytestmark = pytest.mark.integration

INSTALL_TIMEOUT = 900  # seconds: a cold pip cache on a slow link


def fresh_copy(dest):
    """The files a clone of this checkout has (tracked, and new ones git
    does not ignore), as they are in the work tree: what CI's clone holds."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if not source.is_file():  # deleted in the work tree
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dest


def clean_env():
    """The environment without the test run's Python settings, so that the
    commands see only what their own install put in place."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def subcommands(kthrottle):
    """Every subcommand (and `kthrottle quotas` action) that --help lists."""
    def listed(*args):
        out = subprocess.run([kthrottle, *args, "--help"], capture_output=True, text=True,
                             timeout=120, env=clean_env())
        assert out.returncode == 0 and "Traceback" not in out.stderr, out
        block = re.search(r"(?ms)^positional arguments:\n(.*?)(?:\n\S|\Z)", out.stdout)
        return re.findall(r"(?m)^ {4}(\w[\w-]*)", block.group(1)) if block else [], out

    commands, top = listed()
    return commands, {c: listed(c)[0] for c in commands}, top


@pytest.fixture(scope="module")
def base_install(tmp_path_factory):
    work = tmp_path_factory.mktemp("base")
    source = fresh_copy(work / "src")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", str(source)],
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                          env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_the_base_install_runs_every_command(base_install):
    kthrottle = str(base_install / "bin" / "kthrottle")
    commands, actions, top = subcommands(kthrottle)
    assert {"proxy", "local", "quotas", "volume-agent", "spark-sync"} <= set(commands), top
    assert {"alter", "describe", "delete", "recommend"} <= set(actions["quotas"])
    for command in commands:
        for args in [[command]] + [[command, a] for a in actions[command]]:
            out = subprocess.run([kthrottle, *args, "--help"], capture_output=True, text=True,
                                 timeout=120, env=clean_env())
            assert out.returncode == 0, (args, out.stderr[-2000:])
            assert "Traceback" not in out.stderr and "usage: kthrottle " + " ".join(args) \
                in out.stdout, (args, out)


def test_the_base_install_names_the_extra_a_command_needs(base_install):
    """spark-sync needs the spark extra; without it, one clear line."""
    out = subprocess.run([str(base_install / "bin" / "kthrottle"), "spark-sync",
                          "--bootstrap-server", "127.0.0.1:9", "--zookeeper", "127.0.0.1:9",
                          "--once"], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert out.returncode != 0 and "Traceback" not in out.stderr, out
    assert "kthrottle[spark]" in out.stderr, out.stderr


def _read_until(proc, marker, timeout):
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + timeout
    try:
        while marker not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise AssertionError("no %r from scripts/run-local:\n%s" % (marker, seen[-3000:]))
            if selector.select(left):
                chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
                seen += chunk
    finally:
        selector.close()
    return seen


def test_run_local_from_a_fresh_copy_serves_and_stops(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    listen, node_port, admin = free_port(), free_port(), free_port()
    log_path = tmp_path / "run-local.log"
    with open(log_path, "wb") as log:
        # run-local execs kthrottle once it has installed: this PID is the proxy's
        proc = subprocess.Popen(
            ["scripts/run-local", "--listen", "127.0.0.1:%d" % listen,
             "--node-port-base", str(node_port - TANSU_NODE_ID),
             "--admin-listen", "127.0.0.1:%d" % admin],
            cwd=clone, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            env=clean_env())
    try:
        try:
            banner = _read_until(proc, "Ctrl-C stops both", INSTALL_TIMEOUT)
        except AssertionError as exc:
            raise AssertionError("%s\n%s" % (exc, log_path.read_text()[-3000:])) from None
        assert (clone / ".venv" / "bin" / "kthrottle").exists()
        bootstrap = re.search(r"bootstrap\.servers=(\S+)", banner).group(1)
        assert bootstrap == "127.0.0.1:%d" % listen
        assert confluent_roundtrip({"bootstrap.servers": bootstrap}, "fresh-copy")
        with urllib.request.urlopen("http://127.0.0.1:%d/" % admin, timeout=10) as page:
            assert page.status == 200 and b"kthrottle" in page.read()
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, log_path.read_text()[-3000:]
