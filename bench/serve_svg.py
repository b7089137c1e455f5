"""The served-load sweep's plot, a standalone SVG (no plotting library).

One row per ISL/OSL, two panels: output tok/s per GPU (linear y) against TPOT p50 (left)
and against TTFT p50 (right), both in ms on a log x axis. One line per configuration and
load mode: closed-loop points joined in order of concurrency (solid), Poisson points in
order of rate (dashed). Points without a finite, positive x and y are left out.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

PANEL_W, PANEL_H, LEFT, TOP, GAP, ROW_GAP = 380, 230, 90, 70, 110, 80
COLORS = ("#4878a8", "#e49444", "#6a9f58", "#d1605e", "#857aab", "#937860")
AXES = (("tpot_ms", "TPOT p50"), ("ttft_ms", "TTFT p50"))


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "middle") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-family="sans-serif">{escape(text)}</text>'
    )


def _vertical(x: float, y: float, text: str) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="10" text-anchor="middle" font-family="sans-serif" '
        f'transform="rotate(-90 {x:.1f} {y:.1f})">{escape(text)}</text>'
    )


def _series(points: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(label, mode) -> its points, closed loop by concurrency and Poisson by rate."""
    out: dict[tuple[str, str], list[dict]] = {}
    for p in points:
        out.setdefault((p["label"], p["mode"]), []).append(p)
    for (_, mode), ps in out.items():
        ps.sort(key=lambda p: p["concurrency"] if mode == "closed" else p["rate"])
    return out


def log_ticks(low: float, high: float) -> list[float]:
    """1, 2 and 5 times the powers of ten within [low, high] (both > 0)."""
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    return [m * 10**e for e in decades for m in (1, 2, 5) if low <= m * 10**e <= high]


def _xy(p: dict, xkey: str) -> tuple[float, float] | None:
    """(x p50 ms, output tok/s per GPU), or None unless both are finite and > 0."""
    x, y = p[xkey]["p50"], p["output_tok_s_per_gpu"]
    ok = all(v is not None and math.isfinite(v) and v > 0 for v in (x, y))
    return (x, y) if ok else None


def _frame(origin: tuple[float, float], title: str, axis: str) -> list[str]:
    x0, y0 = origin
    return [
        _text(x0 + PANEL_W / 2, y0 - 12, title, 12),
        f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#333"/>',
        _text(x0 + PANEL_W / 2, y0 + PANEL_H + 34, f"{axis} (ms, log scale)", 10),
        _vertical(x0 - 56, y0 + PANEL_H / 2, "output tok/s per GPU"),
    ]


def _panel(
    origin: tuple[float, float], axis: tuple[str, str], points: list[dict], colors: dict[str, str]
) -> list[str]:
    """One panel at ``origin`` (top left): y = output tok/s per GPU against x = the p50 of
    ``axis`` = (point key, name)."""
    (x0, y0), (key, name) = origin, axis
    isl, osl = points[0]["isl"], points[0]["osl"]
    out = _frame(origin, f"ISL {isl} / OSL {osl}: output tok/s per GPU vs {name}", name)
    finite = [xy for xy in (_xy(p, key) for p in points) if xy]
    if not finite:
        return out + [_text(x0 + PANEL_W / 2, y0 + PANEL_H / 2, "no finite points")]
    lo, hi = min(x for x, _ in finite) / 1.2, max(x for x, _ in finite) * 1.2
    top = max(y for _, y in finite) * 1.1
    fx = lambda x: x0 + PANEL_W * math.log(x / lo) / math.log(hi / lo)  # noqa: E731
    fy = lambda y: y0 + PANEL_H * (1 - y / top)  # noqa: E731
    out += [_text(fx(t), y0 + PANEL_H + 16, f"{t:g}", 9) for t in log_ticks(lo, hi)]
    out += [_text(x0 - 6, fy(top * i / 4) + 3, f"{top * i / 4:,.0f}", 9, "end") for i in range(5)]
    for (label, mode), ps in _series(points).items():
        xy = [(fx(x), fy(y)) for x, y in (xy for xy in (_xy(p, key) for p in ps) if xy)]
        if not xy:
            continue
        dash = ' stroke-dasharray="5,3"' if mode == "poisson" else ""
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        out.append(
            f'<polyline points="{line}" fill="none" stroke="{colors[label]}" stroke-width="1.6"{dash}/>'
        )
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{colors[label]}"/>' for x, y in xy]
    return out


def _legend(labels: list[str], colors: dict[str, str]) -> list[str]:
    out = []
    for i, label in enumerate(labels):
        y = 44 + 18 * i
        out.append(f'<line x1="{LEFT}" y1="{y - 4}" x2="{LEFT + 24}" y2="{y - 4}" stroke="{colors[label]}"/>')
        out.append(_text(LEFT + 30, y, label, 11, "start"))
    note = "solid: closed loop, in order of concurrency; dashed: Poisson arrivals, in order of rate"
    return out + [_text(LEFT, 44 + 18 * len(labels), note, 10, "start")]


def render(points: list[dict], title: str) -> str:
    """The SVG document: a legend, then a row of two panels per ISL/OSL."""
    labels = list(dict.fromkeys(p["label"] for p in points))
    colors = {label: COLORS[i % len(COLORS)] for i, label in enumerate(labels)}
    grids = list(dict.fromkeys((p["isl"], p["osl"]) for p in points))
    width = LEFT + 2 * PANEL_W + GAP + 30
    legend_h = 18 * (len(labels) + 1) + 10
    height = TOP + legend_h + len(grids) * (PANEL_H + ROW_GAP)
    body = [_text(width / 2, 22, title, 14), *_legend(labels, colors)]
    for r, grid in enumerate(grids):
        y0 = TOP + legend_h + r * (PANEL_H + ROW_GAP)
        mine = [p for p in points if (p["isl"], p["osl"]) == grid]
        for j, axis in enumerate(AXES):
            body += _panel((LEFT + j * (PANEL_W + GAP), y0), axis, mine, colors)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def write(path: str, points: list[dict], title: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(points, title))
