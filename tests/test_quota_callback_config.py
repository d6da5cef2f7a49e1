"""--quota-callback and the shared capacities as options: a flag, a TOML string
or a [quota-callback] table with its config; what is refused, and why (a proxy that cannot
load its callback: test_cli.py)."""
import pytest

from kthrottle.config import ConfigError, build_config, load_toml

pytestmark = pytest.mark.unit

BOOT = {"bootstrap_servers": [("127.0.0.1", 9092)]}


def _file(tmp_path, text):
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["127.0.0.1:9092"]\n' + text)
    return load_toml(path)


def test_a_table_gives_the_class_and_its_config(tmp_path):
    values = _file(tmp_path, '[quota-callback]\nclass = "pkg.mod:Cls"\n'
                             '[quota-callback.config]\nbudgets = "/x"\nlimit = 3\n')
    config = build_config(values, {})
    assert config.quota_callback == {"class": "pkg.mod:Cls",
                                     "config": {"budgets": "/x", "limit": 3}}


def test_a_string_is_a_class_without_config(tmp_path):
    config = build_config(_file(tmp_path, 'quota-callback = "pkg.mod:Cls"\n'), {})
    assert config.quota_callback == {"class": "pkg.mod:Cls", "config": {}}


def test_the_flag_names_the_class_and_the_files_config_still_configures_it(tmp_path):
    values = _file(tmp_path, '[quota-callback]\nclass = "pkg.mod:Old"\n'
                             '[quota-callback.config]\nbudgets = "/x"\n')
    config = build_config(values, {"quota_callback": {"class": "pkg.mod:New", "config": None}})
    assert config.quota_callback == {"class": "pkg.mod:New", "config": {"budgets": "/x"}}
    alone = build_config({"bootstrap_servers": BOOT["bootstrap_servers"]},
                         {"quota_callback": {"class": "pkg.mod:New", "config": None}})
    assert alone.quota_callback == {"class": "pkg.mod:New", "config": {}}


@pytest.mark.parametrize("text, message", [
    ('[quota-callback]\nconfig = {}\n', 'class must be "module:Class"'),
    ('[quota-callback]\nclass = "a:B"\nrate = 1\n', "unknown key 'rate'"),
    ('[quota-callback]\nclass = "a:B"\nconfig = 3\n', "[quota-callback.config] must be a table"),
    ('quota-callback = 3\n', 'quota-callback must be "module:Class" or a table'),
])
def test_a_bad_table_is_refused_saying_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        _file(tmp_path, text)
    assert message in str(err.value)


def test_a_shared_capacity_needs_quotas_to_weigh_by_and_a_positive_rate(tmp_path):
    with pytest.raises(ConfigError, match="split by the clients' quotas"):
        build_config(dict(BOOT), {"shared_produce_capacity": 1000.0})
    with pytest.raises(ConfigError, match="shared-fetch-capacity must be a positive"):
        build_config(dict(BOOT), {"shared_fetch_capacity": -1.0,
                                  "quota_file": str(tmp_path / "q.toml")})
    config = build_config(dict(BOOT), {"shared_produce_capacity": 3e6,
                                       "quota_file": str(tmp_path / "q.toml")})
    assert config.shared_produce_capacity == 3e6 and config.shared_fetch_capacity is None
