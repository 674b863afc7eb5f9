"""The metric names PromQL expressions use, and those a scrape exposes: for checking that the
Grafana dashboard and the alert rules under deploy/ name only metrics that exist.

A small tokenizer, not a PromQL parser: strings, label matchers `{...}`, range and subquery
brackets `[...]`, grouping lists (`by (...)`, `without`, `on`, `ignoring`, `group_left`,
`group_right`) and numbers are removed; of the identifiers left, those followed by `(` are
functions or aggregations, keywords are dropped, and the rest are metric selectors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "phalanx.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"})
KEYWORDS |= {"group_left", "group_right", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers: `name{...}` keeps `name{`
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges, subqueries, Grafana's $__rate_interval
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        before = text[: m.start()]
        if before.endswith(("$", "$__")) or re.search(r"\d$", before):  # a variable, 1e3, 5m
            continue
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    dash = json.loads(path.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def alert_exprs(path: Path = ALERTS) -> list[str]:
    doc = yaml.safe_load(path.read_text())
    return [str(r["expr"]) for g in doc["groups"] for r in g["rules"]]


def exposed_names(exposition: str) -> set[str]:
    """Every series name a scrape offers: sample names, and for families declared without
    samples yet the names their type implies (counter `_total`, histogram parts)."""
    names = set()
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("_sum", "_count"),
    }
    for fam in text_string_to_metric_families(exposition):
        names.add(fam.name)
        names.update(fam.name + s for s in suffixes.get(fam.type, ()))
        names.update(s.name for s in fam.samples)
    return names
