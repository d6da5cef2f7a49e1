"""The kthrottle command: flags, config file, errors, and the embedded default."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kthrottle.config import ConfigError, ProxyConfig, build_config, load_toml
from kthrottle.embedded import free_port
from kthrottle_testkit import ROOT, TANSU_NODE_ID

pytestmark = pytest.mark.integration


def kthrottle(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "kthrottle", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_help_explains_the_proxy_flags():
    out = kthrottle("proxy", "--help")
    assert out.returncode == 0
    for flag in ("--bootstrap-server", "--listen", "--node-port-base", "--advertised-host",
                 "--max-frame-size", "--config", "--quota-file", "--zookeeper", "--admin-listen",
                 "--quota-mode", "--quota-window-num", "--quota-window-size-seconds",
                 "--max-throttle-ms", "--quota-burst-seconds", "--upstream-connect-timeout-ms",
                 "--security-protocol", "--sasl-mode", "--sasl-enabled-mechanisms",
                 "--credentials-file", "--failed-authentication-delay-ms"):
        assert flag in out.stdout
    top = kthrottle("--help")
    assert "proxy" in top.stdout and "local" in top.stdout and "quotas" in top.stdout
    alter = kthrottle("quotas", "alter", "--help")
    for flag in ("--quota-file", "--zookeeper", "--entity-type", "--entity-name",
                 "--entity-default", "--add-config", "--delete-config"):
        assert flag in alter.stdout


# the errors: one line naming the command, then where to read more -------------------

# enough of each command for argparse to reach the flag it does not know
COMMANDS = {
    "proxy": ["--bootstrap-server", "k:9092"],
    "local": [],
    "quotas alter": ["--quota-file", "q.toml"],
    "quotas describe": ["--quota-file", "q.toml"],
    "quotas delete": ["--quota-file", "q.toml"],
    "quotas recommend": ["--file", "r.json"],
    "volume-agent": ["--broker-id", "1", "--log-dir", "/tmp", "--soft-limit",
                     "MinFreePercentage:20", "--hard-limit", "MinFreePercentage:10",
                     "--bootstrap-server", "k:9092"],
    "spark-sync": ["--bootstrap-server", "k:9092", "--zookeeper", "zk:2181"],
}


def run_main(capsys, *argv):
    """(exit status, stderr lines) of cli.main, which exits on a bad command line."""
    from kthrottle import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    return exc.value.code, capsys.readouterr().err.splitlines()


def refused(command, message):
    """What a refused command line prints: the error first, then one line."""
    return ["kthrottle%s: error: %s" % (command and " " + command, message),
            "Try 'kthrottle%s --help' for more information." % (command and " " + command)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_flag_is_refused_by_the_command_it_was_given_to(capsys, command):
    code, err = run_main(capsys, *command.split(), *COMMANDS[command], "--no-such-flag")
    assert code == 2
    assert err == refused(command, "unrecognized arguments: --no-such-flag")


def test_unknown_arguments_before_the_command_or_after_it_as_the_user_wrote_them(capsys):
    assert run_main(capsys, "--no-such-flag", "proxy") == (
        2, refused("", "unrecognized arguments: --no-such-flag"))
    assert run_main(capsys, "proxy", "--bootstrap-server", "k:9092", "extra", "--nope") == (
        2, refused("proxy", "unrecognized arguments: extra --nope"))
    assert run_main(capsys, "prxy")[1][0].startswith(
        "kthrottle: error: argument COMMAND: invalid choice: 'prxy'")
    assert run_main(capsys, "quotas") == (
        2, refused("quotas", "the following arguments are required: ACTION"))


@pytest.mark.parametrize("argv,message", [
    (["proxy", "--bootstrap-server", "k:9092", "--listen", "nonsense"],
     "argument --listen: --listen must be HOST:PORT, got 'nonsense'"),
    (["proxy", "--bootstrap-server", "k:9092", "--workers", "abc"], "argument --workers: "),
    (["proxy", "--bootstrap-server", "k:9092", "--max-frame-size", "abc"],
     "argument --max-frame-size: invalid int value: 'abc'"),
    # refused once parsed (a ConfigError): the same form
    (["proxy", "--bootstrap-server", "k:9092", "--max-frame-size", "-3"],
     "max-frame-size must be a positive number of bytes"),
    (["proxy"], "no upstream cluster: give --bootstrap-server HOST:PORT"),
    (["proxy", "--bootstrap-server", "k:9092", "--listen", "0.0.0.0:9092"],
     "--advertised-host is required"),
    (["local", "--listen", "nonsense"], "argument --listen: "),
    (["local", "--max-frame-size", "-3"], "max-frame-size must be a positive number of bytes"),
    (["quotas", "alter", "--quota-file", "q.toml", "--entity-type", "users"],
     "name the entity: "),
    (["quotas", "describe", "--entity-type", "groups"], "argument --entity-type: invalid choice"),
    (["quotas", "recommend", "--file", "r.json", "--headroom", "0"], "argument --headroom: "),
    (["volume-agent", *COMMANDS["volume-agent"][:6], "--hard-limit", "Lots"],
     "argument --hard-limit: "),
    (["spark-sync", "--zookeeper", "zk:2181"],
     "the following arguments are required: --bootstrap-server"),
])
def test_a_bad_value_is_one_line_naming_the_command_then_where_help_is(capsys, argv, message):
    code, err = run_main(capsys, *argv)
    command = " ".join(argv[:2] if argv[0] == "quotas" else argv[:1])
    assert code == 2
    assert len(err) == 2 and err[1] == refused(command, "")[1], err
    assert err[0].startswith("kthrottle %s: error: %s" % (command, message)), err
    assert not any(line.startswith("usage:") for line in err)


def test_the_command_itself_refuses_in_that_form_and_help_is_still_the_usage():
    out = kthrottle("proxy", "--bootstrap-server", "k:9092", "--no-such-flag")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("kthrottle proxy: error: unrecognized arguments: --no-such-flag\n"
                          "Try 'kthrottle proxy --help' for more information.\n")
    out = kthrottle("proxy", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: kthrottle proxy [-h]")
    assert "--bootstrap-server" in out.stdout and out.stderr == ""


def test_the_local_banner_names_the_status_page(tmp_path):
    from kthrottle.embedded import admin_banner

    def banner(listen, **settings):
        return admin_banner(ProxyConfig(admin_listen=listen, **settings))

    assert banner(("127.0.0.1", 9464)) == (
        "Status page on http://127.0.0.1:9464/, metrics on /metrics, live connections on /quotas")
    assert banner(("127.0.0.1", 9464), admin_ssl_cert="c.pem", admin_ssl_key="k.pem").startswith(
        "Status page on https://127.0.0.1:9464/, ")
    # a wildcard address is reached at the loopback one
    assert banner(("0.0.0.0", 9464)).startswith("Status page on http://127.0.0.1:9464/, ")
    assert banner(("::", 9464)).startswith("Status page on http://[::1]:9464/, ")
    # the page takes the token from the URL fragment: where it is, never the token
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    line = banner(("127.0.0.1", 9464), admin_token_file=str(token))
    assert line == ("Status page on http://127.0.0.1:9464/ (open it as "
                    "http://127.0.0.1:9464/#token=<the token in %s>), metrics on /metrics, live "
                    "connections on /quotas" % token)
    assert "s3cret" not in line


def test_quota_settings_come_from_flags_or_the_config_file(tmp_path):
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["k1:9092"]\nquota-file = "q.toml"\nquota-mode = "window"\n'
                    'quota-window-num = 5\nquota-window-size-seconds = 2\nmax-throttle-ms = 3000\n'
                    'admin-listen = "127.0.0.1:9464"\n')
    config = build_config(load_toml(path), {"quota_window_num": 6})
    settings = config.quota_settings()
    assert (settings.mode, settings.samples, settings.window, settings.max_throttle) == (
        "window", 6, 2.0, 3.0)
    assert config.quota_file == "q.toml" and config.admin_listen == ("127.0.0.1", 9464)


def test_flags_win_over_the_config_file(tmp_path):
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["k1:9092", "k2:9093"]\nlisten = "127.0.0.1:7000"\n'
                    'advertised-host = "proxy.example"\nmax-frame-size = 1048576\n')
    config = build_config(load_toml(path), {"listen": ("127.0.0.1", 8000), "advertised_host": None})
    assert config.bootstrap_servers == [("k1", 9092), ("k2", 9093)]
    assert config.listen == ("127.0.0.1", 8000)
    assert config.effective_node_port_base == 8001
    assert config.effective_advertised_host == "proxy.example"
    assert config.max_frame_size == 1048576


def test_config_in_a_proxy_section(tmp_path):
    path = tmp_path / "kthrottle.toml"
    path.write_text('[proxy]\nbootstrap-server = "k1:9092"\nnode-port-base = 20000\n')
    config = build_config(load_toml(path), {})
    assert config.bootstrap_servers == [("k1", 9092)]
    assert config.effective_node_port_base == 20000
    assert config.effective_advertised_host == "127.0.0.1"


@pytest.mark.parametrize("text,message", [
    ('bootstrap-servers = ["k1:9092"]\n', "unknown key 'bootstrap-servers'"),
    ('bootstrap-server = ["k1"]\n', "must be HOST:PORT"),
    ('bootstrap-server = ["k1:99999"]\n', "port in 0-65535"),
    ('bootstrap-server = ["k1:9092"]\nmax-frame-size = "big"\n', "must be an integer"),
    ('bootstrap-server = ["k1:9092"\n', "not valid TOML"),
    ('bootstrap-server = ["k1:9092"]\nquota-mode = "fair"\n', "quota mode must be"),
    ('bootstrap-server = ["k1:9092"]\nquota-window-num = 1\n', "at least 2"),
    ('bootstrap-server = ["k1:9092"]\nzookeeper = "zk:2181/"\n', "bad chroot"),
    ('bootstrap-server = ["k1:9092"]\nquota-file = "q"\nzookeeper = "zk:2181"\n', "not both"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SASL_PLAIN"\n',
     "security-protocol must be one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SASL_PLAINTEXT"\n',
     "needs credentials: --credentials-file, or --zookeeper"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SASL_PLAINTEXT"\n'
     'credentials-file = "c"\nsasl-enabled-mechanisms = ["GSSAPI"]\n',
     "sasl-enabled-mechanisms must be among PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ('bootstrap-server = ["k1:9092"]\ncredentials-file = "c"\n', "give --security-protocol"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SSL"\n', "needs --ssl-cert and --ssl-key"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SSL"\nssl-cert = "c"\nssl-key = "k"\n'
     'ssl-client-auth = "required"\n', "needs --ssl-ca"),
    ('bootstrap-server = ["k1:9092"]\nsecurity-protocol = "SSL"\nssl-cert = "c"\nssl-key = "k"\n'
     'ssl-principal-mapping-rules = "RULE:x"\n', "ssl-principal-mapping-rules: "),
    ('bootstrap-server = ["k1:9092"]\nupstream-security-protocol = "SASL_SSL"\n',
     "needs --upstream-sasl-username"),
    ('bootstrap-server = ["k1:9092"]\nupstream-security-protocol = "SASL_SSL"\n'
     'upstream-sasl-username = "p"\n', "KTHROTTLE_UPSTREAM_SASL_PASSWORD"),
    ('bootstrap-server = ["k1:9092"]\nsasl-mode = "passthrough"\nsecurity-protocol = "SASL_PLAINTEXT"\n'
     'upstream-security-protocol = "SSL"\n', "upstream-security-protocol must be SASL_PLAINTEXT or SASL_SSL"),
    ('bootstrap-server = ["k1:9092"]\nsasl-mode = "passthrough"\nsecurity-protocol = "SASL_PLAINTEXT"\n'
     'credentials-file = "c"\n', "credentials-file is for sasl-mode terminate"),
    ('bootstrap-server = ["k1:9092"]\nsasl-mode = "passthrough"\nsecurity-protocol = "SASL_PLAINTEXT"\n'
     'upstream-sasl-username = "p"\n', "upstream-sasl-username and upstream-sasl-password-file are for"),
])
def test_bad_config_files_give_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = kthrottle("proxy", "--config", str(path))
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.startswith("kthrottle proxy: error: ")
    assert out.stderr.endswith("\nTry 'kthrottle proxy --help' for more information.\n")
    assert "Traceback" not in out.stderr


def test_missing_upstream_and_wildcard_listen_are_explained():
    out = kthrottle("proxy")
    assert out.returncode == 2 and "--bootstrap-server" in out.stderr
    out = kthrottle("proxy", "--bootstrap-server", "k:9092", "--listen", "0.0.0.0:9092")
    assert out.returncode == 2 and "--advertised-host is required" in out.stderr
    with pytest.raises(ConfigError):
        ProxyConfig(bootstrap_servers=[("k", 1)], max_frame_size=0).validate()


def test_passthrough_relays_to_the_client_sides_sasl_protocol_by_default():
    config = ProxyConfig(bootstrap_servers=[("k", 1)], security_protocol="SASL_SSL",
                         ssl_cert="c", ssl_key="k", sasl_mode="passthrough").validate()
    assert config.upstream_security_protocol == "SASL_SSL"
    config = ProxyConfig(bootstrap_servers=[("k", 1)], security_protocol="SASL_PLAINTEXT",
                         credentials_file="c").validate()
    assert config.upstream_security_protocol == "PLAINTEXT"  # terminate mode


@pytest.mark.parametrize("kind", ["tansu", pytest.param("kafka", marks=pytest.mark.kafka)])
def test_local_runs_broker_and_proxy_and_stops_both_on_ctrl_c(kind):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    listen = free_port()
    node_port = free_port()
    admin = free_port()
    node_id, name = (TANSU_NODE_ID, "Tansu") if kind == "tansu" else (1, "Apache Kafka [0-9.]+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kthrottle", "local", "--broker", kind,
         "--listen", "127.0.0.1:%d" % listen,
         "--node-port-base", str(node_port - node_id), "--admin-listen", str(admin)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        banner = ""
        deadline = time.monotonic() + 90  # a JVM's start on a loaded machine
        while "live connections on /quotas" not in banner and time.monotonic() < deadline:
            banner += proc.stdout.readline()
        assert ("Status page on http://127.0.0.1:%d/, metrics on /metrics, live connections "
                "on /quotas" % admin) in banner, banner
        match = re.search(r"%s broker \(pid (\d+)\) on 127.0.0.1:(\d+)" % name, banner)
        assert match and "bootstrap.servers=127.0.0.1:%d" % listen in banner, banner
        broker_pid, broker_port = int(match.group(1)), int(match.group(2))
        assert broker_port != listen

        async def roundtrip():
            bootstrap = "127.0.0.1:%d" % listen
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
            await producer.start()
            try:
                await producer.send_and_wait("local-demo", b"hello", partition=0)
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
            await consumer.start()
            try:
                consumer.assign([TopicPartition("local-demo", 0)])
                return (await asyncio.wait_for(consumer.getone(), 20)).value
            finally:
                await consumer.stop()

        assert asyncio.run(roundtrip()) == b"hello"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(40) == 0  # Kafka's controlled shutdown comes first
        assert not psutil.pid_exists(broker_pid) or psutil.Process(broker_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.terminate()  # kthrottle local stops its broker on SIGTERM too
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_taken_listen_port_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = kthrottle("proxy", "--bootstrap-server", "127.0.0.1:1", "--listen", "127.0.0.1:%d" % port)
    assert out.returncode == 1
    assert "cannot listen" in out.stderr and str(port) in out.stderr
    assert "Traceback" not in out.stderr


def test_local_with_kafka_and_no_jars_says_how_to_get_them(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kthrottle", "local", "--broker", "kafka",
         "--listen", "127.0.0.1:%d" % free_port()],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT), KTHROTTLE_KAFKA_LIB=str(tmp_path)))
    assert done.returncode == 1
    assert done.stderr.strip() == ("kthrottle local: error: KTHROTTLE_KAFKA_LIB=%s has no Kafka "
                                   "jars (kafka_2.13-*.jar)" % tmp_path), done.stderr


def test_a_callback_that_cannot_be_loaded_stops_the_start_with_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kthrottle", "proxy", "--bootstrap-server", "127.0.0.1:1",
         "--listen", "127.0.0.1:0", "--quota-callback", "no_such_module_x:Quotas"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0
    assert "quota callback no_such_module_x:Quotas: cannot import no_such_module_x" \
        in result.stderr, result.stderr
