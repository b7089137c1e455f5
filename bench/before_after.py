"""A before/after figure as a standalone SVG (no plotting library): one panel per metric,
one pair of bars per configuration (before grey, after blue), each bar labelled with its
value and each pair with the after bar's ratio to the before one.

Input, a JSON file::

    {"title": "...",
     "metrics": [{"key": "tok_s", "name": "output tok/s at C=64"}, ...],
     "rows": [{"label": "tiny pair, 1P+1D", "before": {"tok_s": 8121}, "after": {"tok_s": 25716}}]}

A row without a metric's value (either side) leaves that pair's bar out.

Usage: ``python -m bench.before_after figure.json figure.svg``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from xml.sax.saxutils import escape

PANEL_W, PANEL_H, LEFT, TOP, GAP, BAR_GAP = 420, 220, 70, 80, 90, 18
BEFORE, AFTER = "#9a9a9a", "#4878a8"


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    name: str


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    before: dict[str, float]
    after: dict[str, float]


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "middle") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-family="sans-serif">{escape(text)}</text>'
    )


def _value(v: float) -> str:
    """Whole above 100, one decimal above 10, else two."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _bar(x: float, width: float, y0: float, height: float, color: str) -> str:
    y = y0 + PANEL_H - height
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{height:.1f}" fill="{color}"/>'


def _panel(x0: float, y0: float, metric: Metric, rows: list[Row]) -> list[str]:
    """One metric's panel at (x0, y0), top left: a pair of bars per row, linear y from 0."""
    out = [
        _text(x0 + PANEL_W / 2, y0 - 12, metric.name, 12),
        f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#333"/>',
    ]
    values = [v for r in rows for v in (r.before.get(metric.key), r.after.get(metric.key)) if v is not None]
    top = max(values, default=1.0) * 1.15 or 1.0
    slot = PANEL_W / max(len(rows), 1)
    width = (slot - 2 * BAR_GAP) / 2
    for i, row in enumerate(rows):
        sx = x0 + i * slot + BAR_GAP
        pair = (row.before.get(metric.key), row.after.get(metric.key))
        for j, (v, color) in enumerate(zip(pair, (BEFORE, AFTER), strict=True)):
            if v is None:
                continue
            height = PANEL_H * v / top
            out.append(_bar(sx + j * width, width - 2, y0, height, color))
            out.append(_text(sx + j * width + width / 2, y0 + PANEL_H - height - 4, _value(v), 9))
        out.append(_text(sx + width, y0 + PANEL_H + 16, row.label, 9))
        if None not in pair and pair[0]:
            out.append(_text(sx + width, y0 + PANEL_H + 30, f"after {pair[1] / pair[0]:.2f}x", 9))
    return out


def render(title: str, metrics: list[Metric], rows: list[Row]) -> str:
    """The SVG document: a title and legend, then the metrics' panels side by side."""
    width = LEFT + len(metrics) * (PANEL_W + GAP)
    height = TOP + PANEL_H + 60
    body = [_text(width / 2, 22, title, 14)]
    for i, (name, color) in enumerate((("before", BEFORE), ("after", AFTER))):
        x = LEFT + 90 * i
        body.append(f'<rect x="{x}" y="36" width="14" height="10" fill="{color}"/>')
        body.append(_text(x + 20, 45, name, 11, "start"))
    for i, metric in enumerate(metrics):
        body += _panel(LEFT + i * (PANEL_W + GAP), TOP, metric, rows)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def load(path: str) -> tuple[str, list[Metric], list[Row]]:
    """(title, metrics, rows) of a figure's JSON file (see the module's docstring)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    metrics = [Metric(m["key"], m["name"]) for m in data["metrics"]]
    rows = [Row(r["label"], r.get("before", {}), r.get("after", {})) for r in data["rows"]]
    return data["title"], metrics, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figure", help="the figure's JSON file")
    parser.add_argument("svg", help="where to write the SVG")
    args = parser.parse_args(argv)
    title, metrics, rows = load(args.figure)
    with open(args.svg, "w", encoding="utf-8") as f:
        f.write(render(title, metrics, rows))


if __name__ == "__main__":
    main()
