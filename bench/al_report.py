"""The AL ladder's report: per prompt length, each mode's acceptance length, the
disaggregated/aggregated ratios with a 95% confidence interval over prompts, outputs
compared token for token, TTFT and transfer bytes per layer group; and an SVG plot.

A run is ``{mode: {length: [Record, ...]}}`` with the same prompts in the same order in
every mode; "aggregated" is the reference.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

MODES = ("aggregated", "unified", "separate")
COLORS = {"aggregated": "#4c78a8", "unified": "#54a24b", "separate": "#e45756"}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
"""Student's t, two-sided 95%, by degrees of freedom (1.96 past 10)."""


@dataclass(slots=True)
class Record:
    tokens: list[int]
    al: float  # tokens per verify step of the request
    ttft_s: float = 0.0  # request to first token, at the client (0: not measured, in process)
    transfer_bytes: dict[str, int] = field(default_factory=dict)  # per layer group
    transfer_s: float = 0.0  # the groups' transfer wall times, summed (the decode side's report)


def ratio_ci(values: list[float], reference: list[float]) -> tuple[float, float]:
    """Mean of per-prompt ratios and the half-width of its 95% t-interval (0 for one prompt)."""
    ratios = [v / r for v, r in zip(values, reference, strict=True) if r]
    if not ratios:
        return math.nan, 0.0
    if len(ratios) == 1:
        return ratios[0], 0.0
    t = T95.get(len(ratios) - 1, 1.96)
    return statistics.mean(ratios), t * statistics.stdev(ratios) / math.sqrt(len(ratios))


def rows(run: dict[str, dict[int, list[Record]]]) -> list[dict]:
    """One summary per prompt length."""
    out = []
    for n, reference in run["aggregated"].items():
        row = {"length": n, "al": {m: statistics.mean(r.al for r in run[m][n]) for m in MODES if m in run}}
        agg = [r.al for r in reference]
        for mode in ("unified", "separate"):
            if mode not in run:
                continue
            records = run[mode][n]
            row[f"{mode}_ratio"] = ratio_ci([r.al for r in records], agg)
            row[f"{mode}_equal"] = all(r.tokens == a.tokens for r, a in zip(records, reference, strict=True))
            row[f"{mode}_ttft_ms"] = 1000 * statistics.median(r.ttft_s for r in records)
            row[f"{mode}_transfer_ms"] = 1000 * statistics.median(r.transfer_s for r in records)
            groups = sorted({g for r in records for g in r.transfer_bytes})
            row[f"{mode}_bytes"] = {
                g: statistics.mean(r.transfer_bytes.get(g, 0) for r in records) for g in groups
            }
        out.append(row)
    return out


def markdown(summary: list[dict]) -> str:
    lines = [
        "| prompt tokens | AL aggregated | AL unified | unified / aggregated (95% CI) | AL separate | "
        "separate / aggregated (95% CI) | outputs equal | TTFT unified / separate (ms, median) | "
        "of which transfer (ms, median) | transfer per request, unified | transfer per request, separate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        al = row["al"]
        lines.append(
            f"| {row['length']} | {al['aggregated']:.2f} | {al.get('unified', math.nan):.2f} | "
            f"{_ratio(row, 'unified')} | {al.get('separate', math.nan):.2f} | {_ratio(row, 'separate')} | "
            f"{_equal(row)} | {_ttft(row)} | {_ttft(row, 'transfer')} | "
            f"{_bytes(row.get('unified_bytes', {}))} | {_bytes(row.get('separate_bytes', {}))} |"
        )
    return "\n".join(lines)


def _ratio(row: dict, mode: str) -> str:
    mean, half = row.get(f"{mode}_ratio", (math.nan, 0.0))
    return f"{mean:.3f} ± {half:.3f}"


def _ttft(row: dict, what: str = "ttft") -> str:
    return f"{row.get(f'unified_{what}_ms', math.nan):.0f} / {row.get(f'separate_{what}_ms', math.nan):.0f}"


def _equal(row: dict) -> str:
    checks = [row[k] for k in ("unified_equal", "separate_equal") if k in row]
    return "yes" if all(checks) else "NO"


def _bytes(per_group: dict[str, float]) -> str:
    return ", ".join(f"{g} {v / 1024:.0f} KiB" for g, v in per_group.items()) or "-"


@dataclass(frozen=True, slots=True)
class _Plot:
    """Pixel positions of a plot of AL (linear) against prompt length (log 2)."""

    lengths: list[int]
    top_al: float
    width: int = 640
    height: int = 360
    left: int = 60
    right: int = 150
    top: int = 40
    bottom: int = 50

    def x(self, n: int) -> float:
        lo, hi = math.log2(min(self.lengths)), math.log2(max(self.lengths))
        return self.left + (math.log2(n) - lo) / ((hi - lo) or 1.0) * (self.width - self.left - self.right)

    def y(self, al: float) -> float:
        return self.top + (1 - al / self.top_al) * (self.height - self.top - self.bottom)


def svg(summary: list[dict], title: str) -> str:
    """AL against prompt length for each mode, as a self-contained SVG."""
    lengths = [row["length"] for row in summary]
    plot = _Plot(lengths, max(max(row["al"].values()) for row in summary) * 1.1 or 1.0)
    w, h = plot.width, plot.height
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">']
    parts += _axes(plot, title)
    for j, mode in enumerate(m for m in MODES if m in summary[0]["al"]):
        parts += _series(plot, summary, mode, j)
    parts.append("</svg>")
    return "\n".join(parts)


def _axes(p: _Plot, title: str) -> list[str]:
    mid_x, mid_y, base = (p.left + p.width - p.right) / 2, (p.top + p.height - p.bottom) / 2, p.y(0)
    parts = [
        f'<text x="{p.width / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{p.left}" y1="{base}" x2="{p.width - p.right}" y2="{base}" stroke="#333"/>',
        f'<line x1="{p.left}" y1="{p.top}" x2="{p.left}" y2="{base}" stroke="#333"/>',
        f'<text x="{mid_x}" y="{p.height - 10}" text-anchor="middle" font-size="11">prompt tokens</text>',
        f'<text x="15" y="{mid_y}" font-size="11" transform="rotate(-90 15 {mid_y})" '
        'text-anchor="middle">acceptance length</text>',
    ]
    for n in p.lengths:
        parts.append(
            f'<text x="{p.x(n):.1f}" y="{base + 15:.1f}" text-anchor="middle" font-size="10">{n}</text>'
        )
    for i in range(5):
        al = p.top_al * i / 4
        parts.append(
            f'<text x="{p.left - 6}" y="{p.y(al) + 4:.1f}" text-anchor="end" font-size="10">{al:.1f}</text>'
        )
    return parts


def _series(p: _Plot, summary: list[dict], mode: str, j: int) -> list[str]:
    color, points = COLORS[mode], [(p.x(row["length"]), p.y(row["al"][mode])) for row in summary]
    line = " ".join(f"{a:.1f},{b:.1f}" for a, b in points)
    parts = [f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>']
    parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>' for a, b in points]
    ly, lx = p.top + 15 + 18 * j, p.width - p.right + 15
    parts.append(f'<rect x="{lx}" y="{ly - 9}" width="12" height="3" fill="{color}"/>')
    parts.append(f'<text x="{lx + 17}" y="{ly - 5}" font-size="11">{mode}</text>')
    return parts
