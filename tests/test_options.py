"""Options declared once: a component's option becomes a flag, a TOML key and
a ProxyConfig attribute; the security options are one group with one set of
messages for every command that talks to Kafka or ZooKeeper."""
import argparse

import pytest

from kthrottle import cli, config
from kthrottle.config import ConfigError, ProxyConfig, build_config, load_toml
from kthrottle.options import INTEGER, NAMES, Option, OptionGroup, arg_type
from kthrottle.security import ClientSecurityOptions, KafkaClientSecurity

pytestmark = pytest.mark.unit


class Example:
    """A component reading two options of its own."""

    options_title = "example component"
    options = (
        Option("example-api-keys", NAMES, default=[], metavar="LIST",
               help="API keys answered with an error, never forwarded"),
        Option("example-answer-delay-ms", INTEGER, attr="example_delay", default=25,
               metavar="MS", help="how long before the refusal is sent"),
    )


@pytest.fixture
def component(monkeypatch):
    monkeypatch.setattr(config, "COMPONENTS", [Example])
    return Example


def test_a_components_option_is_a_flag_a_toml_key_and_an_attribute(component, tmp_path, capsys):
    defaults = ProxyConfig()
    assert defaults.example_api_keys == [] and defaults.example_delay == 25
    assert ProxyConfig().example_api_keys is not defaults.example_api_keys  # one's own list

    parser = cli.make_parser()
    args = parser.parse_args(["proxy", "--bootstrap-server", "k:9092",
                              "--example-api-keys", "CreateTopics, DeleteTopics",
                              "--example-answer-delay-ms", "40"])
    flags = cli._flag_values(args)
    assert flags["example_api_keys"] == ["CreateTopics", "DeleteTopics"]
    assert flags["example_delay"] == 40

    path = tmp_path / "proxy.toml"
    path.write_text('bootstrap-server = "k:9092"\nexample-api-keys = ["AlterConfigs"]\n')
    file_values = load_toml(path)
    assert file_values["example_api_keys"] == ["AlterConfigs"]
    built = build_config(file_values, {"example_delay": None})
    assert built.example_api_keys == ["AlterConfigs"] and built.example_delay == 25
    assert build_config(file_values, flags).example_api_keys == ["CreateTopics", "DeleteTopics"]

    path.write_text('bootstrap-server = "k:9092"\nexample-answer-delay-ms = "soon"\n')
    with pytest.raises(ConfigError, match="example-answer-delay-ms must be an integer"):
        load_toml(path)

    with pytest.raises(SystemExit):
        parser.parse_args(["proxy", "--help"])
    help_text = capsys.readouterr().out
    assert "example component:" in help_text and "--example-api-keys LIST" in help_text


def test_without_the_component_its_option_is_unknown(tmp_path):
    path = tmp_path / "proxy.toml"
    path.write_text('bootstrap-server = "k:9092"\nexample-api-keys = ["AlterConfigs"]\n')
    with pytest.raises(ConfigError, match="unknown key 'example-api-keys'"):
        load_toml(path)
    with pytest.raises(TypeError):
        ProxyConfig(example_api_keys=[])


def test_every_declared_option_has_one_flag_one_key_and_one_attribute():
    options = [o for g in config.option_groups() for o in g.options]
    assert len({o.name for o in options}) == len(options)
    assert len({o.attr for o in options}) == len(options)
    parser = argparse.ArgumentParser()
    for group in config.option_groups():
        group.add_to(parser)  # argparse refuses a flag or dest twice
    assert {o.name: o.attr for o in options}["usage-interval"] == "usage_interval_ms"
    assert {o.name: o.attr for o in options}["bootstrap-server"] == "bootstrap_servers"


def test_an_option_group_reads_a_namespace_and_a_toml_table():
    group = OptionGroup("g", None, (Option("a-b", INTEGER, default=3), Option("names", NAMES)))
    parser = argparse.ArgumentParser()
    group.add_to(parser)
    assert group.from_args(parser.parse_args(["--a-b", "7"])) == {"a_b": 7, "names": None}
    assert group.from_toml({"names": "x, y", "other": 1}) == {"names": ["x", "y"]}
    assert group.defaults() == {"a_b": 3, "names": None}
    with pytest.raises(ConfigError, match="names must be a list of names"):
        group.from_toml({"names": 5})


def test_arg_type_turns_a_value_error_into_argparses_message(capsys):
    def even(text):
        if int(text) % 2:
            raise ValueError("%s is odd" % text)
        return int(text)

    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--n", type=arg_type(even))
    assert parser.parse_args(["--n", "4"]).n == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "5"])
    assert "argument --n: 5 is odd" in capsys.readouterr().err


# the Kafka-client security group -----------------------------------------------------

AGENTISH = ClientSecurityOptions(who="the tool", password_env="TOOL_PW", title="security")
PROXYISH = ClientSecurityOptions("upstream-", who="the proxy", password_env="UP_PW",
                                 title="towards the brokers", protocol_default=None)


def parse(options, *argv):
    parser = argparse.ArgumentParser(prog="t")
    options.add_to(parser)
    return vars(parser.parse_args(list(argv)))


def test_one_group_under_two_prefixes_gives_one_kind_of_settings(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    plain = AGENTISH.resolve(parse(AGENTISH))
    assert plain == KafkaClientSecurity("PLAINTEXT")
    assert plain.kafka_python() == {"security_protocol": "PLAINTEXT"}

    tool = AGENTISH.resolve(parse(AGENTISH, "--security-protocol", "sasl_ssl", "--ssl-ca", str(ca),
                                  "--sasl-username", "u", "--sasl-password-file", str(pw)))
    up = PROXYISH.resolve(parse(PROXYISH, "--upstream-security-protocol", "SASL_SSL",
                                "--upstream-ssl-ca", str(ca), "--upstream-sasl-username", "u",
                                "--upstream-sasl-password-file", str(pw)))
    assert tool == up
    assert tool.kafka_python() == {
        "security_protocol": "SASL_SSL", "ssl_cafile": str(ca), "ssl_certfile": None,
        "ssl_keyfile": None, "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
        "sasl_plain_password": "s3cret"}
    assert tool.data_source_options()["ssl_ca_pem"] == "-----BEGIN CERTIFICATE-----\n"
    assert "s3cret" not in repr(tool) and "BEGIN" not in repr(tool)
    from_env = AGENTISH.resolve(parse(AGENTISH, "--security-protocol", "SASL_PLAINTEXT",
                                      "--sasl-mechanism", "plain", "--sasl-username", "u"),
                                environ={"TOOL_PW": "from-env"})
    assert (from_env.sasl_mechanism, from_env.sasl_password) == ("PLAIN", "from-env")


@pytest.mark.parametrize("argv, message", [
    (["--ssl-ca", "/x.pem"],
     "--upstream-ssl-ca is for TLS: give --upstream-security-protocol SSL or SASL_SSL "
     "(it is PLAINTEXT)"),
    (["--security-protocol", "SSL", "--ssl-key", "/k.pem"],
     "--upstream-ssl-cert and --upstream-ssl-key go together"),
    (["--security-protocol", "SSL", "--ssl-ca", "/nonexistent.pem"],
     "cannot read --upstream-ssl-ca /nonexistent.pem: No such file or directory"),
    (["--security-protocol", "SASL_SSL"],
     "--upstream-security-protocol SASL_SSL needs --upstream-sasl-username"),
    (["--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "u"],
     "security protocol SASL_PLAINTEXT needs the password: --upstream-sasl-password-file PATH "
     "or the environment variable UP_PW"),
    (["--sasl-username", "u", "--sasl-mechanism", "PLAIN"],
     "--upstream-sasl-mechanism, --upstream-sasl-username are for SASL: give "
     "--upstream-security-protocol SASL_PLAINTEXT or SASL_SSL (it is PLAINTEXT)"),
])
def test_the_messages_name_each_commands_own_flags(argv, message):
    argv = [a.replace("--", "--upstream-", 1) if a.startswith("--") else a for a in argv]
    with pytest.raises(ConfigError) as exc:
        PROXYISH.resolve(parse(PROXYISH, *argv), environ={})
    assert message in str(exc.value)
    unprefixed = message.replace("--upstream-", "--").replace("UP_PW", "TOOL_PW")
    argv = [a.replace("--upstream-", "--") for a in argv]
    with pytest.raises(ConfigError) as exc:
        AGENTISH.resolve(parse(AGENTISH, *argv), environ={})
    assert unprefixed in str(exc.value)


def test_a_bad_protocol_or_mechanism_is_refused_where_it_is_read(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse(AGENTISH, "--security-protocol", "TLS")
    assert ("argument --security-protocol: --security-protocol must be one of PLAINTEXT, SSL, "
            "SASL_PLAINTEXT, SASL_SSL, got 'TLS'") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(PROXYISH, "--upstream-sasl-mechanism", "GSSAPI")
    assert "--upstream-sasl-mechanism must be one of PLAIN" in capsys.readouterr().err
    path = tmp_path / "proxy.toml"
    path.write_text('bootstrap-server = "k:9092"\nupstream-security-protocol = "TLS"\n')
    with pytest.raises(ConfigError, match="upstream-security-protocol must be one of PLAINTEXT"):
        load_toml(path)


def test_in_passthrough_the_proxy_asks_for_no_sasl_identity_of_its_own():
    values = parse(PROXYISH, "--upstream-security-protocol", "SASL_SSL")
    security = PROXYISH.resolve(values, environ={}, own_sasl=False)
    assert security.sasl and security.sasl_username is None and security.sasl_password is None
    proxy = ProxyConfig(bootstrap_servers=[("k", 1)], security_protocol="SASL_PLAINTEXT",
                        sasl_mode="passthrough").validate()
    assert proxy.upstream_security().security_protocol == "SASL_PLAINTEXT"


def test_zookeeper_is_checked_alike_by_every_command_that_takes_it(capsys):
    for argv in (["proxy", "--bootstrap-server", "k:1", "--zookeeper", "zk:2181/"],
                 ["quotas", "describe", "--zookeeper", "zk:2181/"],
                 ["spark-sync", "--bootstrap-server", "k:1", "--zookeeper", "zk:2181/"]):
        with pytest.raises(SystemExit):
            cli.make_parser().parse_args(argv)
        assert "argument --zookeeper: --zookeeper has a bad chroot '/' (like /kafka)" \
            in capsys.readouterr().err
    args = cli.make_parser().parse_args(["quotas", "describe", "--zookeeper", "zk:1,zk2:2/k"])
    assert args.zookeeper == "zk:1,zk2:2/k"


def test_the_proxy_refuses_upstream_settings_its_protocol_does_not_use(tmp_path):
    """What the volume agent and the Spark job refuse, the proxy refuses too."""
    base = dict(bootstrap_servers=[("k", 1)])
    with pytest.raises(ConfigError, match="--upstream-sasl-username is for SASL: give "
                       "--upstream-security-protocol SASL_PLAINTEXT or SASL_SSL"):
        ProxyConfig(**base, upstream_sasl_username="p").validate()
    with pytest.raises(ConfigError, match="--upstream-ssl-ca is for TLS"):
        ProxyConfig(**base, upstream_ssl_ca=str(tmp_path)).validate()
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    config = ProxyConfig(**base, upstream_security_protocol="SASL_PLAINTEXT",
                         upstream_sasl_username="p", upstream_sasl_password_file=str(pw)).validate()
    assert config.upstream_sasl_password() == "secret"
    assert config.upstream_security().kafka_python()["sasl_plain_username"] == "p"
