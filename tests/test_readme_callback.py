"""The README's example quota callback is the one the tests load
(examples/quota_callback.py), word for word, and it loads as a callback."""
import re

import pytest

from kthrottle.policy.quota_callback import ClientQuotaCallback, load_callback
from kthrottle_testkit import ROOT

pytestmark = pytest.mark.unit

EXAMPLE = ROOT / "examples" / "quota_callback.py"


def _readme_callback():
    readme = (ROOT / "docs" / "guide" / "quota-callbacks.md").read_text()  # the site's page
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    found = [b for b in blocks if "class TeamQuotas" in b]
    assert len(found) == 1, "docs/guide/quota-callbacks.md shows TeamQuotas once"
    return found[0]


def test_the_readme_shows_the_example_callback_as_it_is():
    code = EXAMPLE.read_text()
    shown = _readme_callback()
    # the file's docstring aside, its code is the README's
    assert code[code.index("import os"):] == shown


def test_the_example_callback_has_every_method_the_proxy_calls(tmp_path):
    budgets = tmp_path / "teams.toml"
    budgets.write_text('[teams.analytics]\nmembers = ["alice"]\nproducer_byte_rate = 1024\n')
    callback = load_callback("%s:TeamQuotas" % EXAMPLE, {"budgets": str(budgets)})
    assert isinstance(callback, ClientQuotaCallback)
