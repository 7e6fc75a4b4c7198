"""The Grafana dashboard is current, parses as PromQL, and charts every contract metric."""

from __future__ import annotations

import json
import runpy

import pytest

from tests.deploy import chart

GRAFANA_DIR = chart.REPO_ROOT / "deploy" / "grafana"
# docs/design.md / the engine contract: every one of these needs a panel.
ENGINE_METRICS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
)
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$replica": ".*"}


def _dashboard() -> dict:
    return json.loads((GRAFANA_DIR / "prefixserve.json").read_text())


def _exprs() -> list[str]:
    return [t["expr"] for panel in _dashboard()["panels"] for t in panel["targets"]]


def test_committed_dashboard_matches_its_builder() -> None:
    builder = runpy.run_path(str(GRAFANA_DIR / "build_dashboard.py"))
    assert (GRAFANA_DIR / "prefixserve.json").read_text() == builder["render"](), (
        "deploy/grafana/prefixserve.json is stale: run python deploy/grafana/build_dashboard.py"
    )


def test_every_query_parses_as_promql() -> None:
    promql_parser = pytest.importorskip("promql_parser", reason="pip install promql-parser")
    for expr in _exprs():
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        promql_parser.parse(expr)


def test_every_engine_metric_is_charted() -> None:
    text = "\n".join(_exprs())
    missing = [m for m in ENGINE_METRICS if f"prefixserve:{m}" not in text]
    assert not missing, f"no panel for {missing}"


def test_key_panels_compute_what_their_titles_say() -> None:
    panels = {p["title"]: p for p in _dashboard()["panels"]}
    ttft = [t["expr"] for t in panels["Time to first token"]["targets"]]
    assert any(e.startswith("histogram_quantile(0.5,") for e in ttft)
    assert any(e.startswith("histogram_quantile(0.99,") for e in ttft)
    hit_rate = panels["Prefix cache hit rate"]["targets"][0]["expr"]
    hits, queries = hit_rate.split(" / ")
    assert "prefix_cache_hits_total" in hits and "prefix_cache_queries_total" in queries
    router = "\n".join(
        t["expr"] for title, p in panels.items() if title.startswith("Router") for t in p["targets"]
    )
    assert "prefixserve:router_" in router and 'reason="fallback"' in router
