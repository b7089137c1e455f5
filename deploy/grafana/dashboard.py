"""The Grafana dashboard ``tandem.json``, built from the rows below.

``python -m deploy.grafana.dashboard`` rewrites ``tandem.json`` next to this file; a test
checks that the committed JSON is what this produces. Queries read the metrics of
``services/common/metrics.py`` only, filtered by the ``$job`` variable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tandem.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job=~"$job"'
RATE = "[$__rate_interval]"
WIDTH = 24


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    width: int = 8


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def rate(metric: str, by: str, selector: str = "") -> str:
    labels = ", ".join(s for s in (JOB, selector) if s)
    return f"sum by ({by}) (rate({metric}{{{labels}}}{RATE}))"


def ratio(numerator: str, denominator: str, by: str) -> str:
    return f"{rate(numerator, by)} / {rate(denominator, by)}"


def quantiles(histogram: str, by: str = "", selector: str = "") -> tuple[tuple[str, str], ...]:
    """p50, p90 and p99 of a histogram, per ``by`` label when given."""
    keys = f"le, {by}" if by else "le"
    legend = f" {{{{{by}}}}}" if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, {rate(histogram + '_bucket', keys, selector)})",
            f"p{round(q * 100)}{legend}",
        )
        for q in (0.5, 0.9, 0.99)
    )


ROWS = (
    Row(
        "Traffic",
        (
            Panel(
                "Requests/s at the router, by status",
                "Finished client requests per second; status is the finish reason, or error / unavailable.",
                ((rate("tandem_requests_total", "status", 'role="router"'), "{{status}}"),),
                unit="reqps",
            ),
            Panel(
                "Requests/s per worker role",
                "Requests finished by prefill, decode and aggregated workers.",
                ((rate("tandem_requests_total", "role", 'role!="router"'), "{{role}}"),),
                unit="reqps",
            ),
            Panel(
                "Peer registrations",
                "Registrations accepted and refused. A refused pair gets no traffic: the router's "
                "Health message names the field that differs.",
                ((rate("tandem_peer_registrations_total", "result"), "{{result}}"),),
                unit="ops",
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "At the router: from the request to its first streamed token.",
                quantiles("tandem_time_to_first_token_seconds", selector='role="router"'),
                unit="s",
            ),
            Panel(
                "Inter-token latency",
                "At the router: time between streamed tokens.",
                quantiles("tandem_inter_token_latency_seconds", selector='role="router"'),
                unit="s",
            ),
            Panel(
                "End-to-end latency",
                "At the router: the whole request.",
                quantiles("tandem_e2e_request_latency_seconds", selector='role="router"'),
                unit="s",
            ),
        ),
    ),
    Row(
        "Speculative decoding",
        (
            Panel(
                "Acceptance length by draft-state origin",
                "Tokens emitted per verify step (accepted + 1). transferred: the drafter started "
                "from the prompt window the prefill worker sent; local: from its own prefill; "
                "cold: with no prompt window (the separate layout).",
                (
                    (
                        ratio(
                            "tandem_spec_acceptance_length_sum",
                            "tandem_spec_acceptance_length_count",
                            "origin",
                        ),
                        "{{origin}}",
                    ),
                ),
            ),
            Panel(
                "Draft acceptance rate by origin",
                "Accepted draft tokens / proposed draft tokens.",
                (
                    (
                        ratio(
                            "tandem_spec_accepted_tokens_total", "tandem_spec_draft_tokens_total", "origin"
                        ),
                        "{{origin}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Acceptance by draft position and origin",
                "Share of verify steps whose draft token at this position was accepted, per "
                "draft-state origin.",
                (
                    (
                        f"{rate('tandem_spec_accepted_tokens_per_position_total', 'position, origin')} / "
                        f"on (origin) group_left {rate('tandem_spec_drafts_total', 'origin')}",
                        "{{origin}} position {{position}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Verify steps/s by origin",
                "How much decoding starts from transferred, local or cold draft state.",
                ((rate("tandem_spec_drafts_total", "origin"), "{{origin}}"),),
                unit="ops",
                width=24,
            ),
        ),
    ),
    Row(
        "KV cache pages",
        (
            Panel(
                "KV pages used by group",
                "Pages held across workers, target and draft groups.",
                ((f"sum by (group) (tandem_kv_pages_used{{{JOB}}})", "{{group}}"),),
                width=12,
            ),
            Panel(
                "KV page utilization per worker and group",
                "Used / total pages of each worker's pools.",
                (
                    (
                        f"tandem_kv_pages_used{{{JOB}}} / tandem_kv_pages_total{{{JOB}}}",
                        "{{instance}} {{group}}",
                    ),
                ),
                unit="percentunit",
                width=12,
            ),
        ),
    ),
    Row(
        "Prefix cache",
        (
            Panel(
                "Prefix hit rate by group",
                "Prompt tokens reused / prompt tokens looked up. The "
                "target decides the match; the draft group hits only where its window is complete.",
                (
                    (
                        ratio("tandem_prefix_cache_hits_total", "tandem_prefix_cache_queries_total", "group"),
                        "{{group}}",
                    ),
                ),
                unit="percentunit",
                width=12,
            ),
            Panel(
                "Prompt tokens looked up and reused",
                "Per second, by group.",
                (
                    (rate("tandem_prefix_cache_queries_total", "group"), "looked up {{group}}"),
                    (rate("tandem_prefix_cache_hits_total", "group"), "reused {{group}}"),
                ),
                unit="short",
                width=12,
            ),
        ),
    ),
    Row(
        "KV transfer",
        (
            Panel(
                "Transfer bytes/s by group",
                "KV pages pushed from prefill to decode workers; the "
                "draft group moves only in the unified layout.",
                ((rate("tandem_kv_transfer_bytes_total", "group"), "{{group}}"),),
                unit="Bps",
            ),
            Panel(
                "Transfer latency",
                "Wall time of one request's transfer (every group, aux state and the acknowledgement).",
                quantiles("tandem_kv_transfer_seconds"),
                unit="s",
            ),
            Panel(
                "Transfer failures by group",
                "Failed transfers per second.",
                ((rate("tandem_kv_transfer_failures_total", "group"), "{{group}}"),),
                unit="ops",
            ),
            Panel(
                "Transfer pages sent and skipped",
                "Pages per second the transfer sent, and "
                "pages it skipped because the decode worker held them already (its prefix cache).",
                ((rate("tandem_kv_transfer_pages_total", "group, kind"), "{{kind}} {{group}}"),),
                width=24,
            ),
        ),
    ),
    Row(
        "Queues",
        (
            Panel(
                "Requests running and waiting",
                "Per role.",
                (
                    (f"sum by (role) (tandem_requests_running{{{JOB}}})", "running {{role}}"),
                    (f"sum by (role) (tandem_requests_waiting{{{JOB}}})", "waiting {{role}}"),
                ),
                width=12,
            ),
            Panel(
                "Queue time",
                "From arrival to being scheduled, per role.",
                quantiles("tandem_request_queue_seconds", by="role"),
                unit="s",
                width=12,
            ),
            Panel(
                "Expired deadlines",
                "lease: reserved pages freed unused; transfer: pages that "
                "did not land or were not acknowledged in time.",
                ((rate("tandem_timeouts_total", "kind"), "{{kind}}"),),
                unit="ops",
                width=24,
            ),
        ),
    ),
)


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def build() -> dict:
    return {
        "uid": "tandem",
        "title": "Tandem: disaggregated serving and speculative decoding",
        "description": "Router, prefill and decode workers: traffic, latency, acceptance by "
        "draft-state origin, KV pages, prefix reuse and transfers per layer group.",
        "tags": ["tandem", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": _variables()},
        "panels": _panels(),
    }


def _panels() -> list[dict]:
    """Each row's header, then its panels left to right, wrapping at WIDTH (8 units high)."""
    panels, panel_id, y = [], 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > WIDTH:
                x, y = 0, y + 8
            panels.append(panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return panels


def _variables() -> list[dict]:
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        },
        {
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": "label_values(tandem_peer_registrations_total, job)", "refId": "job"},
            "definition": "label_values(tandem_peer_registrations_total, job)",
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "refresh": 2,
            "sort": 1,
            "hide": 0,
        },
    ]


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> None:
    with open(PATH, "w") as f:
        f.write(render())
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
