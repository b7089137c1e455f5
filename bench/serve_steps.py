"""Where a served point's time goes inside each worker: its engine steps, by kind.

Each worker exports ``tandem_engine_step_seconds{kind}`` (the step's wall time on the engine
thread: scheduling, forwards, host read, outputs). Scraped before and after a point, the
difference gives the point's steps per worker and kind: how many ran and their mean. At
C=1 a request's TTFT less its prefill step is what the path around the engine costs; at
C=64 the decode (or mixed) step's mean against the served TPOT says the same of decoding.

Each worker also exports ``tandem_thread_cpu_seconds_total{thread}``: over the same
interval, its event loop's and its engine thread's CPU ms per step (all kinds) say how much
of a step the loop's Python (streams, relay, transfers) took from the GIL the engine needs.
A router's event loop, over the point's wall time, says whether the router bounds it.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STEP_METRIC = "tandem_engine_step_seconds"
THREAD_METRIC = "tandem_thread_cpu_seconds_total"
CPU = "cpu:"  # Totals' key prefix of a thread's CPU seconds (steps 0): cpu:event_loop, cpu:engine
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


def thread_cpu_per_step(before: Totals, after: Totals) -> dict[str, dict[str, float]]:
    """Per worker, each thread's CPU ms per engine step (of any kind) between two scrapes."""
    out: dict[str, dict[str, float]] = {}
    for name, kinds in after.items():
        earlier = before.get(name, {})
        steps = sum(n - earlier.get(k, (0.0, 0.0))[1] for k, (_, n) in kinds.items() if not k.startswith(CPU))
        for key, (seconds, _) in kinds.items():
            if key.startswith(CPU) and steps > 0:
                ms = (seconds - earlier.get(key, (0.0, 0.0))[0]) / steps * 1000
                out.setdefault(name, {})[key.removeprefix(CPU)] = round(ms, 3)
    return out


def loop_share(before: Totals, after: Totals, seconds: float) -> dict[str, float]:
    """Per process (a router: no engine steps), its event loop's CPU over ``seconds`` of
    wall time: 1.0 is a core, which one Python event loop cannot pass (the router then
    bounds the point)."""
    out: dict[str, float] = {}
    key = CPU + "event_loop"
    for name, totals in after.items():
        if key in totals and seconds > 0:
            spent = totals[key][0] - before.get(name, {}).get(key, (0.0, 0.0))[0]
            out[name] = round(spent / seconds, 3)
    return out


Means = dict[str, dict[str, dict[str, float]]]  # worker -> kind -> {"steps", "mean_ms"}


def describe(
    means: Means, cpu: dict[str, dict[str, float]] | None = None, loops: dict[str, float] | None = None
) -> str:
    """One line: worker kind mean x steps, ...; each worker's threads' CPU ms a step; then
    each router's event loop as a share of a core."""
    parts = [
        f"{name} {kind} {m['mean_ms']:.2f} ms x{m['steps']}"
        for name, kinds in means.items()
        for kind, m in sorted(kinds.items())
    ]
    parts += [
        f"{name} CPU a step: " + ", ".join(f"{thread} {ms:.2f} ms" for thread, ms in sorted(threads.items()))
        for name, threads in (cpu or {}).items()
    ]
    parts += [f"{name} event loop {share:.0%} of a core" for name, share in (loops or {}).items()]
    return "; ".join(parts)


def _step_totals(url: str) -> dict[str, tuple[float, float]]:
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    threads: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            if sample.name == f"{STEP_METRIC}_sum":
                sums[kind] = sample.value
            elif sample.name == f"{STEP_METRIC}_count":
                counts[kind] = sample.value
            elif sample.name == THREAD_METRIC:
                threads[CPU + sample.labels["thread"]] = (sample.value, 0.0)
    return {kind: (sums.get(kind, 0.0), n) for kind, n in counts.items()} | threads
