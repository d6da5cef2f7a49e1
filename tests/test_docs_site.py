"""The documentation site (mkdocs.yml, docs/) and the README that leads to it:
the site builds in MkDocs' strict mode (a broken link or anchor, or a page
left out of the nav, fails), every page is in the nav, the README stays
short and its links land, the generated reference pages are what the code
generates, and the design pages name the filter hooks the code has. Quick:
MkDocs runs in this process (what `mkdocs build --strict` runs), with no
network and no broker."""
import inspect
import logging
import re
import runpy
from pathlib import Path

import pytest
import yaml

from kthrottle_testkit import ROOT

pytestmark = pytest.mark.unit

DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250
IMAGE_MAX_BYTES = 300 * 1024


def nav_pages(nav):
    """The Markdown files a mkdocs.yml nav names, in order."""
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += nav_pages(value)
        else:
            out.append(value)
    return out


def mkdocs_config():
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_the_site_builds_in_strict_mode(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    site = tmp_path / "site"
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=True)
    warnings = _Warnings()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(warnings)
    try:
        build(config)
    except Abort as exc:
        pytest.fail("mkdocs build --strict: %s\n%s" % (exc, "\n".join(warnings.lines)))
    finally:
        logger.removeHandler(warnings)
    assert not warnings.lines, warnings.lines
    for page in nav_pages(mkdocs_config()["nav"]):
        built = site / ("index.html" if page == "index.md" else page[:-len(".md")] + "/index.html")
        assert built.is_file(), page


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = mkdocs_config()
    assert config["strict"] is True
    assert config["theme"]["name"] == "material"
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is in the nav twice"
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, (
        "README.md has %d lines: the guide, reference and design pages are under docs/"
        % len(text.splitlines()))
    [commands] = re.findall(r"```sh\n(.*?)```", text, re.S)[:1]
    assert [line.split()[0] for line in commands.strip().splitlines()] == [
        "scripts/run-local", "scripts/test"]


def test_the_readme_links_land():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert not link.startswith(("http:", "https:")), link
        assert (ROOT / link).exists(), link
    linked = {link for link in links if link.startswith("docs/")}
    # the README leads to every page of the site
    pages = {"docs/" + p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - {"docs/index.md"} <= linked, sorted(pages - linked)


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_getting_started_shows_the_readme_client_snippets_as_they_are():
    # tests/test_first_contact.py runs the README's; the site shows the same
    readme = _python_blocks(README.read_text())
    page = _python_blocks((DOCS / "guide" / "getting-started.md").read_text())
    for marker in ("from aiokafka ", "from confluent_kafka ", "from kafka "):
        [shown] = [b for b in readme if marker in b]
        [again] = [b for b in page if marker in b]
        assert again == shown, marker


def test_the_reference_pages_are_what_the_code_generates():
    reference = runpy.run_path(str(ROOT / "scripts" / "config-reference"))
    pages = reference["pages"]()
    assert {path.relative_to(ROOT).as_posix() for path, *_ in pages} == {
        "docs/reference/configuration.md", "docs/reference/metrics.md"}
    for path, text, generated, what in pages:
        assert text == generated, (
            "%s: the %s is out of date: run scripts/config-reference --write"
            % (path.relative_to(ROOT), what))


def test_the_pictures_are_there_and_small():
    images = sorted((DOCS / "images").glob("*.png"))
    names = {p.name for p in images}
    assert "status-page.png" in names  # scripts/docs-screenshots
    for image in images:
        assert image.stat().st_size <= IMAGE_MAX_BYTES, image.name
    shown = set()
    for page in DOCS.rglob("*.md"):
        shown.update(Path(m).name for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()))
    assert names <= shown, sorted(names - shown)  # none left unused


def test_the_filters_page_names_the_hooks_the_code_has():
    from kthrottle.proxy import filter as filter_api
    from kthrottle.proxy.filters import REGISTERED

    text = (DOCS / "design" / "filters.md").read_text()
    quick = getattr(filter_api, "QuickFilter", filter_api.Filter)
    # every hook shown with its parameters, `name(a, b)`, is one a filter has, with those
    shown = re.findall(r"`((?:on|quick)_\w*|quick|stream|new_state)\(([^)`]*)\)`", text)
    assert len(shown) >= 15, shown
    for name, params in shown:
        method = getattr(quick, name, None)
        assert callable(method), "docs/design/filters.md names %s, which filters lack" % name
        expected = [p for p in inspect.signature(method).parameters if p != "self"]
        assert [p.strip() for p in params.split(",") if p.strip()] == expected, (name, expected)
    # the registered filters, in their order
    listed = text[text.index("The registered filters, in the order they see a request"):]
    modules = []
    for cls in REGISTERED:
        module = cls.__module__.rsplit(".", 1)[1]
        if module not in modules:
            modules.append(module)
    places = [listed.find("`%s`" % module) for module in modules]
    assert -1 not in places, [m for m, at in zip(modules, places) if at < 0]
    assert places == sorted(places), modules


def test_the_filters_page_shows_the_smallest_filter_as_it_is():
    source = (ROOT / "kthrottle" / "proxy" / "filters" / "forbidden_api_keys.py").read_text()
    code = source[source.index("class ForbiddenApiKeys("):]
    [shown] = [b for b in _python_blocks((DOCS / "design" / "filters.md").read_text())
               if "class ForbiddenApiKeys(" in b]
    # the module's docstring and its option's parser aside, its code is the page's
    assert shown == code
