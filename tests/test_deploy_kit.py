"""The deployment kit names only what exists. No Docker engine here, so the
Dockerfile and docker-compose.yml are read, not built: every path they copy or
mount is in the repository, every command they run parses with kthrottle's
own parser (or Tansu's, for the broker), the stages, extras, ports and
services they name agree. The systemd units' commands parse too, and are run
here against a real broker: the reload signal re-reads, the stop signal
drains and exits 0 within TimeoutStopSec."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from kthrottle.cli import _flag_values, make_parser
from kthrottle.config import DEFAULT_DRAIN_TIMEOUT_MS, DEFAULT_LISTEN, build_config, load_toml
from kthrottle.embedded import free_port, tansu_binary, wait_for_port
from kthrottle_testkit import ROOT, TANSU_NODE_ID

pytestmark = pytest.mark.integration

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSOLE_SCRIPT = "kthrottle"
TARGETS = ("runtime", "spark", "local")
COMPILERS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cargo|rustc)\b")
UNITS = ROOT / "deploy" / "systemd"


# the Dockerfile ---------------------------------------------------------------------

def dockerfile_stages():
    """[{"name", "base", "lines": [(instruction, arguments)]}] in order, with
    continuation lines joined, comments dropped and global ARGs expanded."""
    logical, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue  # Docker drops comment lines, inside a continuation too
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(current)
            current = ""
    assert not current, "the Dockerfile ends inside a continuation"
    args, stages = {}, []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        if instruction == "FROM":
            rest = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest)
            parts = rest.split()
            assert len(parts) in (1, 3) and (len(parts) == 1 or parts[1].upper() == "AS"), line
            stages.append({"name": parts[2] if len(parts) == 3 else None, "base": parts[0],
                           "lines": []})
            continue
        assert stages, "%s before the first FROM" % instruction
        stages[-1]["lines"].append((instruction, rest))
    return stages


STAGES = dockerfile_stages()
BY_NAME = {s["name"]: s for s in STAGES}


def chain(name):
    """The stage and the stages it is built FROM, the stage itself first."""
    out = []
    while name in BY_NAME:
        out.append(BY_NAME[name])
        name = BY_NAME[name]["base"]
    return out


def last(name, instruction):
    """The arguments of the last ``instruction`` in the image of stage
    ``name`` (inherited from the stages it is built from), or None."""
    for stage in chain(name):
        for found, rest in reversed(stage["lines"]):
            if found == instruction:
                return rest
    return None


def test_the_dockerfile_has_the_targets_and_a_slim_python_base():
    names = [s["name"] for s in STAGES]
    assert len(names) == len(set(names)), names
    assert set(TARGETS) <= set(names)
    assert STAGES[-1]["name"] == "runtime", "the default target (the last stage) is the proxy's"
    for stage in STAGES:
        if stage["base"] not in BY_NAME:  # an image, not an earlier stage
            assert re.fullmatch(r"python:3\.(1[1-9])-slim(-\w+)?", stage["base"]), stage["base"]
            minimum = PYPROJECT["project"]["requires-python"].lstrip(">=")
            assert tuple(map(int, stage["base"][7:].split("-")[0].split("."))) >= tuple(
                map(int, minimum.split(".")))
        else:
            assert names.index(stage["base"]) < names.index(stage["name"])


def test_every_path_the_dockerfile_copies_exists_and_every_stage_it_copies_from_is_earlier():
    copied = 0
    names = [s["name"] for s in STAGES]
    for index, stage in enumerate(STAGES):
        for instruction, rest in stage["lines"]:
            if instruction in ("ADD", "COPY"):
                words = shlex.split(rest)
                flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
                sources = [w for w in words if not w.startswith("--")][:-1]
                assert sources, rest
                if "from" in flags:
                    assert flags["from"] in names[:index], rest
                    continue
                for source in sources:
                    assert (ROOT / source).exists(), "COPY %s: not in the repository" % source
                    copied += 1
    assert copied >= 3  # pyproject.toml, README.md (its readme) and the package


def test_no_compiler_in_a_target_image_and_none_runs_as_root():
    for target in TARGETS:
        for stage in chain(target):
            for instruction, rest in stage["lines"]:
                if instruction == "RUN":
                    assert not COMPILERS.search(rest), "%s installs a compiler: %s" % (target, rest)
        user = last(target, "USER")
        assert user is not None and user.split(":")[0] not in ("root", "0"), target
    # the compilers are in the stage that builds the virtualenvs, and only there
    assert any(COMPILERS.search(rest) for s in STAGES if s["name"] not in
               {st["name"] for t in TARGETS for st in chain(t)}
               for i, rest in s["lines"] if i == "RUN")


def test_the_extras_the_dockerfile_installs_exist_and_spark_gets_java_17_or_later():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    installed = set()
    for stage in STAGES:
        for instruction, rest in stage["lines"]:
            if instruction == "RUN" and "pip install" in rest:
                installed.update(re.findall(r"\.\[([a-z,]+)\]", rest))
    assert installed == {"spark", "local"}
    assert {e for group in installed for e in group.split(",")} <= extras
    for target, extra in (("spark", "spark"), ("local", "local")):
        copied = [rest for i, rest in BY_NAME[target]["lines"] if i == "COPY"]
        source = re.search(r"--from=(\S+)", copied[0]).group(1)
        assert any('".[%s]"' % extra in rest for i, rest in BY_NAME[source]["lines"]), target
    java = [int(v) for i, rest in BY_NAME["spark"]["lines"] if i == "RUN"
            for v in re.findall(r"openjdk-(\d+)-jre", rest)]
    assert java and min(java) >= 17  # PySpark 4 needs Java 17+


def test_the_images_run_the_console_script_with_arguments_its_parser_takes():
    assert PYPROJECT["project"]["scripts"][CONSOLE_SCRIPT] == "kthrottle.cli:main"
    parser = make_parser()
    for target in TARGETS:
        entrypoint = json.loads(last(target, "ENTRYPOINT"))
        cmd = json.loads(last(target, "CMD"))
        assert entrypoint == [CONSOLE_SCRIPT], target
        try:
            args = parser.parse_args(cmd)
        except SystemExit as exc:  # --help
            assert exc.code == 0 and "--help" in cmd, (target, cmd)
            continue
        assert args.command == {"runtime": "proxy", "local": "local"}[target]
    assert "--bootstrap-server" not in json.loads(last("local", "CMD"))


def test_the_local_image_links_the_tansu_binary_that_the_local_extra_carries():
    [command] = [rest for i, rest in BY_NAME["local"]["lines"] if i == "RUN"]
    code = re.search(r"python -c '([^']+)'", command).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert os.access(out.stdout.strip(), os.X_OK)


# docker-compose.yml ---------------------------------------------------------------------

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def proxy_config(command):
    args = make_parser().parse_args(command)
    assert args.command == "proxy"
    return build_config(load_toml(args.config) if args.config else {}, _flag_values(args))


def test_compose_builds_dockerfile_targets_and_depends_only_on_its_services():
    services = COMPOSE["services"]
    assert {"broker", "kthrottle"} <= set(services)
    for name, service in services.items():
        build = service["build"]
        assert (ROOT / build["context"]).resolve() == ROOT
        assert build["target"] in BY_NAME, name
        for other in service.get("depends_on", []):
            assert other in services, (name, other)
    assert services["kthrottle"]["build"]["target"] == "runtime"


def test_compose_mounts_what_exists_and_the_proxy_reads_the_quota_file_through_it():
    service = COMPOSE["services"]["kthrottle"]
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        assert (ROOT / source).exists(), volume
        mounts[target] = ROOT / source
    config = proxy_config(service["command"])
    quota_file = Path(config.quota_file)
    [(inside, outside)] = [(t, s) for t, s in mounts.items() if quota_file.is_relative_to(t)]
    assert (outside / quota_file.relative_to(inside)).is_file()


def test_compose_ports_are_the_ones_the_proxy_listens_on_and_advertises():
    service = COMPOSE["services"]["kthrottle"]
    config = proxy_config(service["command"])
    published = {}
    for mapping in service["ports"]:
        host, container = (int(p) for p in str(mapping).split(":"))
        # the proxy advertises the port it listens on: the same number outside
        assert host == container, mapping
        published[container] = host
    node_port = config.node_ports.get(TANSU_NODE_ID) or (
        config.effective_node_port_base + TANSU_NODE_ID)
    assert set(published) == {config.listen[1], node_port, config.admin_listen[1]}
    assert config.listen[0] == "0.0.0.0" and config.admin_listen[0] == "0.0.0.0"
    assert config.effective_advertised_host == "localhost"
    exposed = {int(p) for rest in [last("runtime", "EXPOSE")] for p in rest.split()}
    assert set(published) <= exposed
    assert int(DEFAULT_LISTEN.rsplit(":", 1)[1]) in exposed
    health = " ".join(service["healthcheck"]["test"])
    assert ":%d/" % config.admin_listen[1] in health
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"]).group(1)
    assert int(grace) * 1000 > config.drain_timeout_ms


def test_compose_broker_runs_tansu_with_flags_it_takes_and_where_the_proxy_looks():
    broker = COMPOSE["services"]["broker"]
    entrypoint = broker["entrypoint"]
    assert entrypoint[:2] == ["tansu", "broker"]
    help_text = subprocess.run([tansu_binary(), "broker", "--help"], capture_output=True,
                               text=True, timeout=30).stdout
    flags = [w for w in entrypoint[2:] if w.startswith("--")]
    assert flags and all(re.search(r"(?m)^\s+%s\b" % re.escape(f), help_text) for f in flags)
    settings = dict(zip(entrypoint[2::2], entrypoint[3::2]))
    assert settings["--storage-engine"].startswith("memory://")  # the demo keeps nothing
    advertised = settings["--advertised-listener-url"].removeprefix("tcp://")
    config = proxy_config(COMPOSE["services"]["kthrottle"]["command"])
    assert config.bootstrap_servers == [("broker", int(advertised.split(":")[1]))]
    assert advertised.split(":")[0] == "broker"
    listener = settings["--listener-url"].removeprefix("tcp://")
    assert listener.split(":")[1] == advertised.split(":")[1]


# the systemd units ----------------------------------------------------------------------

def read_unit(path):
    """{section: {key: [values]}} (a key may repeat), continuation lines joined."""
    sections, section, pending = {}, None, ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit, key):
    [value] = unit["Service"][key]
    return value


def exec_argv(unit, key="ExecStart"):
    argv = shlex.split(one(unit, key).lstrip("-@:+!"))
    assert os.path.basename(argv[0]) == CONSOLE_SCRIPT, argv
    return argv[1:]


def local_argv(argv, replace):
    """The unit's command as this test runs it: this checkout's kthrottle,
    with ``replace`` {flag: value} for the values that name this machine."""
    out, i = [sys.executable, "-m", "kthrottle"], 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in replace:
            out.append(str(replace[argv[i]]))
            i += 1
        i += 1
    return out


def signal_of(unit, key, default):
    value = unit["Service"].get(key, [default])[-1]
    return signal.Signals[value if value.startswith("SIG") else "SIG" + value]


def reload_signal(unit):
    """The signal ExecReload sends: ``kill -HUP $MAINPID``."""
    argv = shlex.split(one(unit, "ExecReload"))
    assert os.path.basename(argv[0]) == "kill" and argv[-1] == "$MAINPID", argv
    return signal.Signals["SIG" + argv[1].lstrip("-").removeprefix("SIG")]


def timeout_stop_seconds(unit):
    return float(re.fullmatch(r"(\d+)s?", one(unit, "TimeoutStopSec")).group(1))


@pytest.mark.parametrize("name", ["kthrottle.service", "kthrottle-volume-agent.service"])
def test_units_run_as_a_dedicated_user_restart_on_failure_and_are_hardened(name):
    unit = read_unit(UNITS / name)
    assert one(unit, "User") not in ("root", "0", "nobody")
    assert one(unit, "Restart") == "on-failure"
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes")):
        assert one(unit, key) == value, (name, key)
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("name", ["kthrottle.service", "kthrottle-volume-agent.service"])
def test_systemd_reads_every_line_of_the_units(name, tmp_path):
    """systemd-analyze verify: no unknown key, no value it cannot parse (the
    command's path made this checkout's, which exists)."""
    text = (UNITS / name).read_text().replace("/opt/kthrottle/bin/kthrottle",
                                               str(Path(sys.executable).parent / "kthrottle"))
    (tmp_path / name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)],
                         capture_output=True, text=True, timeout=60)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if name in line]
    assert not complaints, complaints


def test_the_proxy_unit_reloads_with_sighup_and_stops_with_a_drain_within_its_timeout(
        broker, tmp_path):
    unit = read_unit(UNITS / "kthrottle.service")
    argv = exec_argv(unit)
    args = make_parser().parse_args(argv)
    assert args.command == "proxy" and args.config == "/etc/kthrottle/kthrottle.toml"
    # the unit's configuration is examples/kthrottle.toml installed; its drain fits the timeout
    example = build_config(load_toml(ROOT / "examples" / "kthrottle.toml"), {})
    stop_after = timeout_stop_seconds(unit)
    assert stop_after * 1000 > max(example.drain_timeout_ms, DEFAULT_DRAIN_TIMEOUT_MS)
    assert reload_signal(unit) == signal.SIGHUP
    assert signal_of(unit, "KillSignal", "SIGTERM") == signal.SIGTERM

    listen, node_port, admin = free_port(), free_port(), free_port()
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[clients.unit-test]\nproducer_byte_rate = 1048576\n")
    config = tmp_path / "kthrottle.toml"
    config.write_text('bootstrap-server = ["%s"]\nlisten = "127.0.0.1:%d"\nnode-port-base = %d\n'
                      'quota-file = "%s"\nadmin-listen = "127.0.0.1:%d"\n'
                      % (broker.bootstrap, listen, node_port - TANSU_NODE_ID, quotas, admin))
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(local_argv(argv, {"--config": config}), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        wait_for_port("127.0.0.1", admin, proc=proc)
        # docker-compose.yml's health check, against this proxy's admin port
        health = COMPOSE["services"]["kthrottle"]["healthcheck"]["test"]
        assert health[0] == "CMD" and health[1] == "python"
        code = re.sub(r"127\.0\.0\.1:\d+/", "127.0.0.1:%d/" % admin, health[-1])
        checked = subprocess.run([sys.executable, *health[2:-1], code], capture_output=True,
                                 text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        os.kill(proc.pid, reload_signal(unit))
        deadline = time.monotonic() + 10
        while "SIGHUP: re-reading quota file %s" % quotas not in log_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        assert proc.poll() is None  # SIGHUP's default would have ended it
        urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin, timeout=5).read()
        os.kill(proc.pid, signal_of(unit, "KillSignal", "SIGTERM"))
        assert proc.wait(stop_after) == 0, log_path.read_text()[-3000:]
        assert "drained" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_the_volume_agent_unit_runs_and_stops_on_its_kill_signal(broker, tmp_path):
    unit = read_unit(UNITS / "kthrottle-volume-agent.service")
    argv = exec_argv(unit)
    args = make_parser().parse_args(argv)
    assert args.command == "volume-agent" and args.log_dirs and args.bootstrap_servers
    # nothing to re-read: SIGHUP's default would end the agent
    assert "ExecReload" not in unit["Service"]
    assert signal_of(unit, "KillSignal", "SIGTERM") in (signal.SIGTERM, signal.SIGINT)
    metrics = free_port()
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            local_argv(argv, {"--log-dir": tmp_path, "--bootstrap-server": broker.bootstrap,
                              "--metrics-listen": "127.0.0.1:%d" % metrics}),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        wait_for_port("127.0.0.1", metrics, proc=proc)
        deadline = time.monotonic() + 20
        while True:
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics,
                                          timeout=5).read().decode()
            if re.search(r"(?m)^kthrottle_volume_agent_publications_total [1-9]", text):
                break
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        os.kill(proc.pid, signal_of(unit, "KillSignal", "SIGTERM"))
        assert proc.wait(timeout_stop_seconds(unit)) == 0, log_path.read_text()[-3000:]
        assert "stopping (SIGTERM)" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_the_installed_package_holds_every_file_it_reads_besides_its_modules():
    """The images install kthrottle from a wheel (not a checkout): every other
    file in the package must be named by package-data to be in it."""
    import fnmatch

    patterns = PYPROJECT["tool"]["setuptools"].get("package-data", {})
    for path in (ROOT / "kthrottle").rglob("*"):
        if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(ROOT)
        covered = any(
            relative.parent.as_posix().startswith(package.replace(".", "/"))
            and fnmatch.fnmatch(relative.relative_to(package.replace(".", "/")).as_posix(),
                                pattern)
            for package, globs in patterns.items() for pattern in globs)
        assert covered, "%s is not in [tool.setuptools.package-data]" % relative


def dockerignored(path):
    """Whether .dockerignore keeps ``path`` (relative, a file or directory)
    out of the build context: the last pattern matching it or a directory
    holding it decides, as Docker reads the file."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            pattern = line.lstrip("!").strip("/")
            regex = "".join(".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*")
                            for part in re.split(r"(\*\*)", pattern))
            rules.append((negate, re.compile(regex)))
    parts = Path(path).parts
    excluded = False
    for negate, regex in rules:
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_the_build_context_holds_what_the_dockerfile_copies_and_not_the_checkout():
    for stage in STAGES:
        for instruction, rest in stage["lines"]:
            if instruction == "COPY" and "--from=" not in rest:
                for source in shlex.split(rest)[:-1]:
                    assert not dockerignored(source), source
                    for path in (ROOT / source).rglob("*") if (ROOT / source).is_dir() else ():
                        if "__pycache__" not in path.parts:
                            assert not dockerignored(path.relative_to(ROOT)), path
    for kept_out in (".venv/bin/python", ".git/HEAD", "benchmarks/results/proxy_overhead.md",
                     "kthrottle/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(kept_out), kept_out
