"""examples/kthrottle.toml and the README's configuration reference, held to
the option registry (config.option_groups(): the core's and the filters'):
every option is in both, nothing else is, and the file loads."""
import re
import runpy
import subprocess
import sys
import tomllib

import pytest

from kthrottle.config import build_config, load_toml, option_groups
from kthrottle_testkit import ROOT

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "kthrottle.toml"
REFERENCE = runpy.run_path(str(ROOT / "scripts" / "config-reference"))
OPTIONS = {o.name: o for g in option_groups() for o in g.options}
# a key set, or shown commented out: "# key = value" (prose never has that shape)
SETTING = re.compile(r"^(# )?([A-Za-z0-9_.-]+) = (.*)$")


def example_lines():
    """[(line number, key, the line without "# ", commented)] of every key line."""
    out = []
    for number, line in enumerate(EXAMPLE.read_text().splitlines(), 1):
        m = SETTING.match(line)
        if m:
            out.append((number, m.group(2), line[len(m.group(1) or ""):], bool(m.group(1))))
    return out


def test_the_example_names_every_option_and_nothing_else():
    named = {key for _, key, _, _ in example_lines()}
    assert sorted(set(OPTIONS) - named) == [], "options missing from examples/kthrottle.toml"
    assert sorted(named - set(OPTIONS)) == [], "keys that are not options"
    active = tomllib.loads(EXAMPLE.read_text())
    assert set(active) <= set(OPTIONS)  # no table: every key at the top level


def test_the_example_loads_as_a_configuration():
    config = build_config(load_toml(EXAMPLE), {})
    assert config.bootstrap_servers and config.quota_file and config.admin_listen


@pytest.mark.parametrize("number,key,text", [(n, k, t) for n, k, t, c in example_lines() if c],
                         ids=lambda v: str(v) if isinstance(v, int) else None)
def test_each_commented_out_key_parses_when_uncommented(number, key, text):
    value = tomllib.loads(text)[key]
    OPTIONS[key].from_toml(value)  # ConfigError names the key if it does not


def test_commented_out_defaults_are_the_defaults():
    """A commented line showing a value equal in TOML form to a default must
    be that default (no stale default left behind)."""
    for number, key, text, commented in example_lines():
        option = OPTIONS[key]
        if commented and option.default not in (None, [], {}, frozenset()):
            shown = option.from_toml(tomllib.loads(text)[key])
            literal = REFERENCE["toml_literal"](option, option.default)
            if type(shown) is type(option.default) and not isinstance(shown, (str, bool)):
                continue  # an example value of a number (max-connections = 10000)
            if text.split(" = ", 1)[1] == literal:
                assert shown == option.default, (number, key)


def test_the_reference_renders_each_default_as_toml_that_reads_back_as_it():
    for option in OPTIONS.values():
        if option.default is not None:
            literal = REFERENCE["toml_literal"](option, option.default)
            assert option.from_toml(tomllib.loads("v = " + literal)["v"]) == option.default, (
                option.name, literal)


def test_the_readme_configuration_reference_lists_every_option_and_is_current():
    readme = (ROOT / "docs" / "reference" / "configuration.md").read_text()  # the site's page
    start, end = readme.index(REFERENCE["BEGIN"]), readme.index(REFERENCE["END"])
    section = readme[start:end]
    for name in OPTIONS:
        assert "| `--%s` / `%s` |" % (name, name) in section, name
    listed = set(re.findall(r"^\| `--([a-z0-9-]+)` / `", section, re.M))
    assert listed == set(OPTIONS)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "config-reference"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
