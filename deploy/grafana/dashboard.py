"""The Grafana dashboard ``tandem.json``, built from the rows of ``panels.py``.

``python -m deploy.grafana.dashboard`` rewrites ``tandem.json`` next to this file; a test
checks that the committed JSON is what this produces. Queries read the metrics of
``services/common/metrics.py`` only, filtered by the ``$job`` variable.
"""

from __future__ import annotations

import json
import os

from deploy.grafana.panels import ROWS, Panel

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tandem.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24


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
