"""Where a served point's time goes inside each worker: its engine steps, by kind.

Each worker exports ``tandem_engine_step_seconds{kind}`` (the step's wall time on the engine
thread: scheduling, forwards, host read, outputs). Scraped before and after a point, the
difference gives the point's steps per worker and kind: how many ran and their mean. At
C=1 a request's TTFT less its prefill step is what the path around the engine costs; at
C=64 the decode (or mixed) step's mean against the served TPOT says the same of decoding.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STEP_METRIC = "tandem_engine_step_seconds"
Totals = dict[str, dict[str, tuple[float, float]]]  # worker -> kind -> (seconds, steps)


def scrape(workers: dict[str, str]) -> Totals:
    """``workers``: name -> /metrics URL; each one's step totals by kind ({} if unreachable)."""
    return {name: _step_totals(url) for name, url in workers.items()}


def step_means(before: Totals, after: Totals) -> dict[str, dict[str, dict[str, float]]]:
    """Per worker and kind, the steps that ran between two scrapes: {"steps", "mean_ms"}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, kinds in after.items():
        for kind, (seconds, steps) in kinds.items():
            s0, n0 = before.get(name, {}).get(kind, (0.0, 0.0))
            if steps > n0:
                mean_ms = (seconds - s0) / (steps - n0) * 1000
                out.setdefault(name, {})[kind] = {"steps": int(steps - n0), "mean_ms": round(mean_ms, 3)}
    return out


def describe(means: dict[str, dict[str, dict[str, float]]]) -> str:
    """One line: worker kind mean x steps, ..."""
    parts = [
        f"{name} {kind} {m['mean_ms']:.2f} ms x{m['steps']}"
        for name, kinds in means.items()
        for kind, m in sorted(kinds.items())
    ]
    return "; ".join(parts)


def _step_totals(url: str) -> dict[str, tuple[float, float]]:
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            if sample.name == f"{STEP_METRIC}_sum":
                sums[kind] = sample.value
            elif sample.name == f"{STEP_METRIC}_count":
                counts[kind] = sample.value
    return {kind: (sums.get(kind, 0.0), n) for kind, n in counts.items()}
