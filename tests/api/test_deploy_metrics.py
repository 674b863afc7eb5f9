"""deploy/grafana/phalanx.json and deploy/prometheus/alerts.yml name only metrics that a
controller's or an agent's `/metrics` exposes (the system test repeats this against live
processes: tests/system/test_metrics.py)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from phalanx.agent import metrics as agent_metrics
from phalanx.agent.metrics import AgentCollector, AgentFigures
from promql import alert_exprs, dashboard_exprs, exposed_names, metric_names


def test_the_tokenizer_finds_selectors_and_skips_functions_labels_and_ranges() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, route) (rate(a_seconds_bucket{route=~"/v1/.*",'
        'x="by (y)"}[$__rate_interval]))) > 1e3 and on() max(b) == 0 or c_total offset 5m'
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b", "c_total"}
    assert metric_names("sum without (instance) (x:recorded[5m:1m])") == {"x:recorded"}


def test_every_dashboard_and_alert_expression_names_exposed_metrics(client: TestClient) -> None:
    exprs = dashboard_exprs() + alert_exprs()
    assert len(exprs) >= 20
    scrape = client.get("/metrics").text
    agent = CollectorRegistry(auto_describe=False)
    agent.register(AgentCollector("n1", AgentFigures, lambda: None, dict))
    exposed = exposed_names(scrape)
    exposed |= exposed_names(
        (generate_latest(agent_metrics.REGISTRY) + generate_latest(agent)).decode()
    )
    missing = {(n, e) for e in exprs for n in metric_names(e) if n not in exposed}
    assert not missing, missing
    used = {n for e in exprs for n in metric_names(e)}
    assert {"phalanx_nodes_flagged", "phalanx_lease_takeovers_total", "phalanx_store_up"} <= used
