"""The Grafana dashboard (deploy/grafana/kthrottle-dashboard.json) and the
Prometheus alert rules (deploy/prometheus/kthrottle-alerts.yml) query only
metrics the proxy exports (kthrottle.proxy.admin.METRICS, the names as
/metrics exposes them), with labels those metrics carry; and both files have
the structure Grafana and Prometheus load."""
import json
import re

import pytest
import yaml  # PyYAML: Prometheus rule files are YAML

from kthrottle.proxy.admin import METRICS
from kthrottle_testkit import ROOT

pytestmark = pytest.mark.unit

DASHBOARD = ROOT / "deploy" / "grafana" / "kthrottle-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kthrottle-alerts.yml"

# what Prometheus adds to every series it scrapes, and the one series it makes
# for each target itself (a proxy that is down exports nothing)
TARGET_LABELS = {"job", "instance"}
PROMETHEUS_OWN = {"up": ()}

# families the dashboard leaves out, and why; every other one has a panel
NOT_ON_THE_DASHBOARD = {
    # the same as kthrottle_throttle_seconds_total (by key), in Kafka's unit
    "kthrottle_produce_throttle_time_ms_total",
    "kthrottle_fetch_throttle_time_ms_total",
    "kthrottle_request_throttle_time_ms_total",
    # an experiment behind --zero-copy, off by default
    "kthrottle_zero_copy_bytes_total",
    # facts rather than series to watch
    "process_virtual_memory_bytes",
    "process_start_time_seconds",
    "python_info",
}


# -- PromQL: the metric names and label names an expression uses ---------------------

# identifiers that are not metric names when not followed by "("
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "atan2", "inf", "nan", "start", "end"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")  # Grafana's
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"S(\d+)"')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count"), "info": ("",)}


def exported():
    """{series name: labels} of what /metrics exposes (and Prometheus adds)."""
    out = dict(PROMETHEUS_OWN)
    for m in METRICS:
        extra = ("le",) if m.type == "histogram" else ("quantile",) if m.type == "summary" else ()
        for suffix in _SUFFIXES[m.type]:
            out[m.name + suffix] = tuple(m.labels) + extra
    return out


class Parsed:
    def __init__(self, metrics, labels, name_patterns):
        self.metrics = metrics  # the names written in the expression
        self.labels = labels  # the label names it matches on or groups by
        self.name_patterns = name_patterns  # __name__ matchers: (operator, value)


def parse_promql(expr):
    """The metric names and label names ``expr`` uses, found without a full
    parser: strings, selectors' braces, ranges and label lists are taken out
    first, so that what is left of the identifiers not followed by "(" (a
    function or an aggregation) and not a keyword are metric names."""
    text = _VARIABLE.sub("", expr)
    strings = []

    def keep(m):
        strings.append(m.group(0)[1:-1])
        return '"S%d"' % (len(strings) - 1)

    text = _STRING.sub(keep, text)
    labels, patterns = set(), []
    for selector in re.findall(r"\{([^{}]*)\}", text):
        for label, op, n in _MATCHER.findall(selector):
            labels.add(label)
            if label == "__name__":
                patterns.append((op, strings[int(n)]))
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges, subqueries
    for _, names in _LABEL_LIST.findall(text):
        labels.update(n.strip() for n in names.split(",") if n.strip())
    text = _LABEL_LIST.sub(" ", text)
    text = re.sub(r'"S\d+"', " ", text)  # e.g. label_replace's arguments
    metrics = {name for name in _IDENTIFIER.findall(text) if name not in KEYWORDS}
    return Parsed(metrics, labels - {"__name__"}, patterns)


def parse_grafana_variable(query):
    """A Prometheus variable query: label_values([selector,] label) or an
    expression (query_result(...))."""
    m = re.fullmatch(r"\s*label_values\(\s*(?:(.*?)\s*,\s*)?(\w+)\s*\)\s*", query)
    if m:
        selector, label = m.groups()
        parsed = parse_promql(selector or "")
        parsed.labels.add(label)
        return parsed
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query)
    return parse_promql(m.group(1) if m else query)


def problems_of(parsed, series, where, extra_labels=()):
    """What is wrong with the names ``parsed`` uses, against ``series``
    ({name: labels}); [] when nothing."""
    out = []
    names = set()
    for name in sorted(parsed.metrics):
        if name in series:
            names.add(name)
        else:
            out.append("%s: %s is not a metric the proxy exports" % (where, name))
    for op, value in parsed.name_patterns:
        if op == "=":
            matched = {value} & set(series)
        elif op == "=~":
            matched = {n for n in series if re.fullmatch(value, n)}
        else:
            continue
        if not matched:
            out.append("%s: __name__%s%r matches no exported metric" % (where, op, value))
        names |= matched
    if not names and not out:
        out.append("%s: names no metric" % where)
    known = set(TARGET_LABELS)
    for name in names:
        known.update(series[name])
    for label in sorted((set(parsed.labels) | set(extra_labels)) - known):
        out.append("%s: label %s is on none of %s" % (where, label, ", ".join(sorted(names))))
    return out


@pytest.mark.parametrize("expr,metrics,labels", [
    ('sum by (user, client_id) (rate(kthrottle_requests_total{job=~"$job"}'
     '[$__rate_interval]))', {"kthrottle_requests_total"}, {"user", "client_id", "job"}),
    ("rate(x_total[5m] offset 1h) > 1e3 and on (instance) group_left (zone) y",
     {"x_total", "y"}, {"instance", "zone"}),
    ("histogram_quantile(0.99, sum(rate(h_bucket[5m])) by (le))", {"h_bucket"}, {"le"}),
    ('max without (listener) (kthrottle_broker_reachable{reason="too_many, by (x)"}) == bool 0',
     {"kthrottle_broker_reachable"}, {"listener", "reason"}),
    ('label_replace(up, "host", "$1", "instance", "(.*):.*") or vector(1)', {"up"}, set()),
    ('{__name__=~"kthrottle_.*_quota", user!=""}', set(), {"user"}),
    ("sum(a:recorded:rate5m) / scalar(b)", {"a:recorded:rate5m", "b"}, set()),
])
def test_metric_and_label_names_are_found_in_promql(expr, metrics, labels):
    parsed = parse_promql(expr)
    assert parsed.metrics == metrics
    assert parsed.labels == labels


def test_what_the_checks_refuse():
    series = exported()
    assert problems_of(parse_promql("rate(kthrottle_requests_total[1m])"), series, "q") == []
    # a misspelt name, a counter without its _total, a label the metric lacks
    assert problems_of(parse_promql("kthrottle_conections"), series, "q") == [
        "q: kthrottle_conections is not a metric the proxy exports"]
    assert problems_of(parse_promql("rate(kthrottle_requests[1m])"), series, "q")
    assert problems_of(parse_promql("sum by (topic) (kthrottle_request_rate)"), series, "q") == [
        "q: label topic is on none of kthrottle_request_rate"]
    assert problems_of(parse_promql('{__name__=~"kthrottle_nope_.*"}'), series, "q")
    assert problems_of(parse_promql("vector(1)"), series, "q") == ["q: names no metric"]


# -- the dashboard ----------------------------------------------------------------------

def _panels(items):
    for panel in items:
        yield panel
        yield from _panels(panel.get("panels") or ())


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_queries_only_exported_metrics_and_their_labels(dashboard):
    series = exported()
    problems, used = [], set()
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets") or ():
            expr = target["expr"]
            where = "panel %r, query %s" % (panel["title"], target["refId"])
            if re.fullmatch(r"\s*vector\([\d.]+\)\s*", expr):
                continue  # a constant line (a limit drawn on the chart)
            parsed = parse_promql(expr)
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            problems += problems_of(parsed, series, where, legend)
            used |= parsed.metrics
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            parsed = parse_grafana_variable(query)
            problems += problems_of(parsed, series, "variable $%s" % variable["name"])
    assert problems == []
    # every family has a panel, but for the few left out on purpose
    families = {m.name for m in METRICS}
    assert NOT_ON_THE_DASHBOARD <= families
    assert sorted(families - used - NOT_ON_THE_DASHBOARD) == []


def test_the_dashboard_is_a_grafana_dashboard(dashboard):
    assert dashboard["title"] == "kthrottle" and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    # the data source is picked when the dashboard is imported or provisioned
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    names = set(variables)
    ids, titles, cells = set(), [], set()
    for panel in _panels(dashboard["panels"]):
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        titles.append(panel["title"])
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) and pos[k] >= 0 for k in "hwxy"), panel["title"]
        assert 0 < pos["w"] and pos["x"] + pos["w"] <= 24, panel["title"]
        overlap = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not overlap & cells, "panel %r overlaps another" % panel["title"]
        cells |= overlap
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat", "state-timeline", "table"), panel["type"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip()
            used = {v.strip("${}") for v in re.findall(r"\$\{?\w+\}?", target["expr"])}
            assert used - {"__rate_interval", "__interval", "__range"} <= names, used
    assert len(titles) == len(set(titles)), "panel titles repeat"


# -- the alert rules ----------------------------------------------------------------------

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")  # Prometheus's duration
RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}


@pytest.fixture(scope="module")
def rules():
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    groups = document["groups"]
    assert isinstance(groups, list) and groups
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names)) and all(isinstance(n, str) and n for n in names)
    out = []
    for group in groups:
        assert set(group) <= {"name", "interval", "limit", "rules"}, group["name"]
        assert isinstance(group["rules"], list) and group["rules"], group["name"]
        out += group["rules"]
    return out


def test_the_alert_rules_are_prometheus_rules(rules):
    alerts = [r["alert"] for r in rules]
    assert len(alerts) == len(set(alerts))
    for rule in rules:
        name = rule.get("alert")
        assert isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), rule
        assert set(rule) <= RULE_KEYS, (name, set(rule) - RULE_KEYS)
        assert isinstance(rule["expr"], str) and rule["expr"].strip(), name
        for key in ("for", "keep_firing_for"):
            if key in rule:
                assert isinstance(rule[key], str) and _DURATION.match(rule[key]), (name, key)
        labels, annotations = rule["labels"], rule["annotations"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()), name
        assert labels["severity"] in ("critical", "warning", "info"), name
        assert all(isinstance(k, str) and isinstance(v, str)
                   for k, v in annotations.items()), name
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        text = annotations["summary"] + annotations["description"]
        assert text.count("{{") == text.count("}}"), name


def test_the_alert_rules_query_only_exported_metrics(rules):
    series = exported()
    problems = []
    for rule in rules:
        parsed = parse_promql(rule["expr"])
        text = " ".join(rule["annotations"].values())
        templated = set(re.findall(r"\$labels\.(\w+)", text))
        problems += problems_of(parsed, series, "alert %s" % rule["alert"], templated)
    assert problems == []


@pytest.mark.parametrize("metric", [
    "kthrottle_storage_fail_safe",  # stale cluster state
    "kthrottle_fleet_fail_safe",  # stale fleet shares
    "kthrottle_quota_source_healthy",  # quota source down
    "kthrottle_credentials_source_healthy",  # credentials store down
    "kthrottle_zookeeper_connected",  # a ZooKeeper session lost (the cluster state's too)
    "kthrottle_broker_reachable",  # no broker reachable
    "kthrottle_ready",  # readiness: a bootstrap broker answers
])
def test_every_fail_safe_has_an_alert(rules, metric):
    assert [r["alert"] for r in rules if metric in parse_promql(r["expr"]).metrics]
