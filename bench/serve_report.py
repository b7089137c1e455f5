"""The served-load sweep's outputs: a markdown table per ISL/OSL and the JSON of every point.

A point is a plain dict (the JSON's ``points`` entries): the configuration (``config``,
``label``, ``layout``, ``spec``, ``forced_al``), the load (``isl``, ``osl``, ``mode``
"closed" with ``concurrency`` or "poisson" with ``rate`` in requests/s), the fields of
``bench.serve_stats.PointStats`` and the engine's ceiling (``ceiling_tok_s`` at
``ceiling_batch`` with its own AL ``ceiling_al``, ``served_over_ceiling``; NaN for Poisson
points and where none was measured). NaN is written to JSON as null.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.serve_stats import PointStats

COLUMNS = (
    "configuration", "load", "requests", "errors", "output tok/s per GPU", "requests/s",
    "TTFT p50 / p90 / p99 ms", "TPOT p50 / p90 / p99 ms", "ITL p99 ms", "AL",
    "transfer per request (ms, MB)", "goodput req/s (SLO met)", "ceiling tok/s (B, AL)", "served / ceiling",
)  # fmt: skip


def point(base: dict, stats: PointStats, ceiling: dict | None) -> dict:
    """``base`` (configuration and load) + the stats + the ceiling row (None: not measured)."""
    out = {**base, **asdict(stats)}
    tok_s = ceiling["tok_s"] if ceiling else math.nan
    out["ceiling_tok_s"] = tok_s
    out["ceiling_batch"] = ceiling["ceiling_batch"] if ceiling else 0
    out["ceiling_al"] = ceiling["al"] if ceiling else math.nan
    out["served_over_ceiling"] = stats.output_tok_s / tok_s if tok_s and math.isfinite(tok_s) else math.nan
    return out


def number(value: float, digits: int = 1) -> str:
    """``value`` with thousands separators; "–" for NaN or None."""
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:,.{digits}f}"


def load_cell(p: dict) -> str:
    return f"C={p['concurrency']}" if p["mode"] == "closed" else f"Poisson {number(p['rate'], 2)} req/s"


def transfer_cell(p: dict) -> str:
    parts = [
        f"{g} {number(t['ms_mean'], 2)} ms {number(t['bytes_mean'] / 1e6, 2)} MB"
        for g, t in p["transfers"].items()
    ]
    return "; ".join(parts) or "–"


def quantile_cell(q: dict) -> str:
    return " / ".join(number(q[k]) for k in ("p50", "p90", "p99"))


def ceiling_cell(p: dict) -> str:
    if p["ceiling_tok_s"] is None or not math.isfinite(p["ceiling_tok_s"]):
        return "–"
    return f"{number(p['ceiling_tok_s'], 0)} (B {p['ceiling_batch']}, AL {number(p['ceiling_al'], 2)})"


def row(p: dict) -> str:
    cells = (
        p["label"], load_cell(p), str(p["requests"]), str(p["errors"]), number(p["output_tok_s_per_gpu"]),
        number(p["requests_per_s"], 2), quantile_cell(p["ttft_ms"]), quantile_cell(p["tpot_ms"]),
        number(p["itl_p99_ms"]), number(p["acceptance_length"], 2), transfer_cell(p),
        f"{number(p['goodput_req_s'], 2)} ({number(100 * p['slo_attainment'], 0)}%)", ceiling_cell(p),
        number(p["served_over_ceiling"], 2),
    )  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def tables(points: list[dict], slo: tuple[float, float]) -> str:
    """One markdown table per ISL/OSL, in the order the points came."""
    out = []
    for isl, osl in dict.fromkeys((p["isl"], p["osl"]) for p in points):
        out.append(f"\nISL {isl} / OSL {osl} (goodput: TTFT <= {slo[0]:g} ms and TPOT <= {slo[1]:g} ms)\n")
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        out += [row(p) for p in points if (p["isl"], p["osl"]) == (isl, osl)]
    return "\n".join(out) + "\n"


def _plain(value):
    """NaN -> None, recursively, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(_plain(payload), indent=1, allow_nan=False) + "\n")
