"""Builds deploy/grafana/prefixserve.json, the Grafana dashboard of prefixserve's metrics.

Owns the dashboard's panels and PromQL. Run ``python deploy/grafana/build_dashboard.py``
after changing it; tests/deploy/test_grafana.py fails when the committed JSON is stale or a
contract metric (docs/design.md, engine metrics ``prefixserve:*``) has no panel. Router panels
match ``prefixserve:router_*`` names by regex, so they keep working whatever the exact
series names the cluster layer exports; a panel whose series are absent shows "No data"
rather than failing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DASHBOARD_PATH = Path(__file__).with_name("prefixserve.json")
DASHBOARD_UID = "prefixserve-overview"
# Grafana's `$__rate_interval` adapts the window to the scrape interval (>= 4 scrapes).
RATE = "[$__rate_interval]"
SEL = '{model_name=~"$model_name", replica=~"$replica"}'
GRID_WIDTH = 24
PANEL_HEIGHT = 8


def _q(metric: str, extra: str = "") -> str:
    """A selector of an engine metric, filtered by the dashboard's variables."""
    return f"prefixserve:{metric}{SEL[:-1]}{extra}}}"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (
            f"p{int(q * 100)}",
            f"histogram_quantile({q}, sum by (le) (rate({_q(metric + '_bucket')}{RATE})))",
        )
        for q in (0.5, 0.99)
    ]


def _router(pattern: str, by: str = "", extra: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f'sum{grouping} (rate({{__name__=~"prefixserve:router_{pattern}"{extra}}}{RATE}))'


# (title, unit, [(legend, expr)]), laid out two per row.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Time to first token", "s", _quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("inter_token_latency_seconds")),
    ("End-to-end request latency", "s", _quantiles("e2e_request_latency_seconds")),
    (
        "Prefix cache hit rate",
        "percentunit",
        [
            (
                "all replicas",
                f"sum(rate({_q('prefix_cache_hits_total')}{RATE})) / "
                f"sum(rate({_q('prefix_cache_queries_total')}{RATE}))",
            ),
            (
                "{{replica}}",
                f"sum by (replica) (rate({_q('prefix_cache_hits_total')}{RATE})) / "
                f"sum by (replica) (rate({_q('prefix_cache_queries_total')}{RATE}))",
            ),
        ],
    ),
    (
        "KV cache usage",
        "percentunit",
        [("{{replica}}", f"max by (replica) ({_q('kv_cache_usage_perc')})")],
    ),
    (
        "Requests running / waiting",
        "short",
        [
            ("running {{replica}}", f"sum by (replica) ({_q('num_requests_running')})"),
            ("waiting {{replica}}", f"sum by (replica) ({_q('num_requests_waiting')})"),
        ],
    ),
    (
        "Tokens per second",
        "short",
        [
            ("prompt", f"sum(rate({_q('prompt_tokens_total')}{RATE}))"),
            ("generation", f"sum(rate({_q('generation_tokens_total')}{RATE}))"),
        ],
    ),
    (
        "Preemptions per second",
        "short",
        [("{{replica}}", f"sum by (replica) (rate({_q('num_preemptions_total')}{RATE}))")],
    ),
    (
        "Router decisions per second",
        "short",
        [
            (
                "{{policy}} / {{reason}}",
                _router(".*decision.*_total", by="policy, reason", extra=', policy!=""'),
            )
        ],
    ),
    (
        "Router fallbacks and index errors per second",
        "short",
        [
            ("fallback (reason label)", _router(".*decision.*_total", extra=', reason="fallback"')),
            ("fallback (counter)", _router(".*fallback.*_total")),
            ("index errors", _router(".*index_error.*_total")),
        ],
    ),
    (
        "Router matched-block ratio",
        "percentunit",
        [
            (
                "matched / prompt blocks",
                f"{_router('.*matched_blocks.*_total')} / {_router('.*prompt_blocks.*_total')}",
            )
        ],
    ),
    (
        "Router index lookup latency",
        "s",
        [
            (
                "p99",
                f"histogram_quantile(0.99, {_router('.*lookup.*_seconds_bucket', by='le')})",
            )
        ],
    ),
]


def _variable(name: str, label: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {
            "query": f"label_values(prefixserve:num_requests_running, {name})",
            "refId": name,
        },
        "definition": f"label_values(prefixserve:num_requests_running, {name})",
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def build() -> dict:
    panels = []
    width = GRID_WIDTH // 2
    for index, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {
                    "x": (index % 2) * width,
                    "y": (index // 2) * PANEL_HEIGHT,
                    "w": width,
                    "h": PANEL_HEIGHT,
                },
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": DASHBOARD_UID,
        "title": "prefixserve",
        "tags": ["prefixserve", "llm", "ray-serve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                _variable("model_name", "Model"),
                _variable("replica", "Replica"),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    DASHBOARD_PATH.write_text(render())
    sys.stdout.write(f"wrote {DASHBOARD_PATH}\n")
