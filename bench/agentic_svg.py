"""A two-panel bar chart of an agentic replay, as a standalone SVG (no plotting library).

Left: prefilled target tokens and prefill forward tokens per configuration. Right: TTFT p50
of first turns and of continuation turns per configuration. Configurations run along each
panel's x axis.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from bench.agentic_report import Summary

PANEL_W, PANEL_H, LEFT, TOP, GAP = 420, 260, 100, 90, 70
COLORS = ("#4878a8", "#e49444", "#6a9f58")


def _rect(x: float, y: float, w: float, h: float, color: str) -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}"/>'


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "middle", rotate: bool = False) -> str:
    transform = f' transform="rotate(-30 {x:.1f} {y:.1f})"' if rotate else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-family="sans-serif"{transform}>{escape(text)}</text>'
    )


def _panel(
    x0: float, title: str, names: list[str], series: list[tuple[str, list[float]]], unit: str
) -> list[str]:
    """Grouped bars: one group per name, one bar per series; NaN bars are left out."""
    top, bottom = TOP, TOP + PANEL_H
    finite = [v for _, values in series for v in values if math.isfinite(v)]
    peak = max(finite, default=1.0) or 1.0
    out = [
        _text(x0 + PANEL_W / 2, top - 42, title, 13),
        f'<line x1="{x0}" y1="{bottom}" x2="{x0 + PANEL_W}" y2="{bottom}" stroke="#333"/>',
    ]
    group_w = PANEL_W / max(len(names), 1)
    bar_w = group_w * 0.7 / len(series)
    for i, name in enumerate(names):
        gx = x0 + i * group_w + group_w * 0.15
        for j, (_, values) in enumerate(series):
            if not math.isfinite(values[i]):
                continue
            h = PANEL_H * values[i] / peak
            out.append(_rect(gx + j * bar_w, bottom - h, bar_w * 0.92, h, COLORS[j]))
            out.append(_text(gx + (j + 0.5) * bar_w, bottom - h - 3, f"{values[i]:.0f}", 9))
        out.append(_text(gx + group_w * 0.35, bottom + 14, name, 10, "end", rotate=True))
    for j, (label, _) in enumerate(series):
        lx = x0 + j * 210
        out += [_rect(lx, top - 28, 10, 10, COLORS[j]), _text(lx + 14, top - 19, label, 10, "start")]
    out.append(_text(x0 - 8, top + 4, unit, 10, "end"))
    return out


def render(summaries: list[Summary], title: str) -> str:
    """The SVG document for ``summaries`` (one bar group per configuration)."""
    names = [s.name + (f" ({s.errors} errors)" if s.errors else "") for s in summaries]
    width = 2 * PANEL_W + GAP + LEFT + 20
    height = TOP + PANEL_H + 120
    body = [_text(width / 2, 18, title, 14)]
    body += _panel(
        LEFT,
        "prefill tokens (lower is better)",
        names,
        [
            ("prefilled target (prompt - cached)", [float(s.prefilled("target")) for s in summaries]),
            ("prefill forward (with window rebuilds)", [float(s.forward_tokens) for s in summaries]),
        ],
        "tokens",
    )
    body += _panel(
        LEFT + PANEL_W + GAP,
        "TTFT p50 (ms, lower is better)",
        names,
        [
            ("first turns", [s.ttft_first[0] * 1000 for s in summaries]),
            ("continuation turns", [s.ttft_continuation[0] * 1000 for s in summaries]),
        ],
        "ms",
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def write(path: str, summaries: list[Summary], title: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(summaries, title))
