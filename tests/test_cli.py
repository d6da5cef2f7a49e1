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

from conftest import ROOT, TANSU_NODE_ID
from kthrottle.config import ConfigError, ProxyConfig, build_config, load_toml
from kthrottle.embedded import free_port


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


def test_local_runs_broker_and_proxy_and_stops_both_on_ctrl_c():
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    listen = free_port()
    node_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kthrottle", "local", "--listen", "127.0.0.1:%d" % listen,
         "--node-port-base", str(node_port - TANSU_NODE_ID)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        banner = ""
        deadline = time.monotonic() + 30
        while "Point clients at" not in banner and time.monotonic() < deadline:
            banner += proc.stdout.readline()
        match = re.search(r"Tansu broker \(pid (\d+)\) on 127.0.0.1:(\d+)", banner)
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
        assert proc.wait(20) == 0
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
