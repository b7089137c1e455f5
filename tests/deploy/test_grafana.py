"""The Grafana dashboard reads only metrics and labels the services export."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.metrics import MetricWrapperBase

from deploy.grafana import dashboard
from services.common.metrics import Metrics
from services.common.thread_cpu import NAME as THREAD_CPU

ROWS = [
    "Traffic",
    "Latency",
    "Speculative decoding",
    "KV cache pages",
    "Prefix cache",
    "KV transfer",
    "Queues",
]
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "scalar"}
TARGET_LABELS = {"job", "instance"}  # Prometheus adds these to every scraped series
_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"[^\"]*\"")
_BY = re.compile(r"\b(?:by|on|ignoring)\s*\(([^)]*)\)")  # grouping and vector matching
_KEYWORDS = re.compile(r"\bgroup_(?:left|right)\b")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][\w:]*+)(?!\s*\()")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def exported() -> dict[str, set[str]]:
    """Every series name a service exports -> its label names (``le`` on buckets)."""
    metrics = Metrics("router", "tiny-target")  # the registry adds model_name to every sample
    metrics.thread_cpu.watch("event_loop")  # a collector's series exist once it watches a thread
    labels = {
        m._name: set(m._labelnames) | {"model_name"}
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    }
    labels[THREAD_CPU] = {"thread", "model_name"}
    names = {}
    for family in metrics.registry.collect():
        if family.name.startswith("process_"):  # prometheus_client's ProcessCollector: not ours
            continue
        for suffix in SUFFIXES[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            names[family.name + suffix] = labels[family.name] | extra
    return names


def parse(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names in selectors, label names in by clauses) of a query."""
    selectors = set()
    for body in _SELECTOR.findall(expr):
        selectors |= set(_MATCHER.findall(body))
    by = {label.strip() for clause in _BY.findall(expr) for label in clause.split(",")}
    bare = re.sub(r"\[[^\]]*\]", "", _KEYWORDS.sub("", _BY.sub("", _SELECTOR.sub("", expr))))
    return set(_IDENTIFIER.findall(bare)), selectors, by


def panels() -> list[dict]:
    with open(dashboard.PATH) as f:
        return [p for p in json.load(f)["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str, str]]:
    return [(p["title"], t["expr"], t["legendFormat"]) for p in panels() for t in p["targets"]]


def test_committed_json_is_what_the_builder_writes():
    with open(dashboard.PATH) as f:
        assert f.read() == dashboard.render()


def test_rows_are_the_ones_the_issue_lists():
    with open(dashboard.PATH) as f:
        board = json.load(f)
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ROWS


def test_every_panel_has_a_query_and_fits_the_grid():
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)) == 29
    for p in panels():
        assert p["targets"], p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_parse_reads_names_selectors_and_by_clauses():
    expr = (
        'histogram_quantile(0.9, sum by (le, role) (rate(tandem_x_bucket{job=~"$job", '
        'role!="router"}[$__rate_interval]))) / scalar(sum(rate(tandem_y_total[5m])))'
    )
    assert parse(expr) == ({"tandem_x_bucket", "tandem_y_total"}, {"job", "role"}, {"le", "role"})


@pytest.mark.parametrize("title, expr, legend", queries(), ids=[q[0] for q in queries()])
def test_every_query_names_exported_metrics_and_labels(title, expr, legend):
    series = exported()
    names, selector_labels, by_labels = parse(expr)
    assert names, f"{title}: no metric in {expr}"
    assert names - FUNCTIONS <= series.keys(), f"{title}: not exported: {names - series.keys()}"
    labels = set().union(*(series[n] for n in names)) | TARGET_LABELS
    assert selector_labels <= labels, f"{title}: {selector_labels - labels}"
    assert by_labels <= labels, f"{title}: {by_labels - labels}"
    shown = set(_LEGEND.findall(legend))
    assert shown <= (by_labels if by_labels else labels), f"{title}: legend {legend!r}"


def test_the_metrics_the_design_fixes_are_all_on_the_dashboard():
    used = set().union(*(parse(expr)[0] for _, expr, _ in queries()))
    base = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported()} == base
