"""The served-load sweep's arithmetic: per-request latencies, a point's summary, goodput.

Definitions (as the field states them, ../shared/reference/serving-2026-12.md):
- TTFT: client clock, from sending the request to the first chunk that carries a token
  (queueing and, disaggregated, the KV transfer included);
- TPOT: (e2e - TTFT) / (tokens - 1) per request, e2e ending at the ``complete`` message;
  undefined (NaN) for a one-token request;
- ITL: the gap between consecutive token-carrying chunks of a request (under speculation
  a chunk carries one verify step's tokens, so gaps are per step, not per token);
- output tok/s: tokens of the requests that succeeded over the point's span (first send to
  last end); requests/s likewise; goodput: requests/s that succeeded and met both SLOs
  (TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms``; a one-token request needs the TTFT only);
- AL: tokens per decode step over every request's steps (Usage.acceptance_length weighted
  by Usage.num_drafts, the decode steps).
Percentiles interpolate linearly between ranks (numpy's default). Times are seconds unless a
name ends in ``_ms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(slots=True)
class Transfer:
    """One layer group's KV transfer of one request (Usage.transfers)."""

    group: str
    num_bytes: int
    seconds: float


@dataclass(slots=True)
class RequestRecord:
    """One request as its client saw it. Times are ``time.monotonic()`` seconds (one clock
    for every process of the host); ``chunk_times``: arrival of each chunk that carried
    tokens, the first included; ``end``: the complete message, or the failure."""

    sent: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = math.nan
    error: str = ""  # "" = succeeded with exactly the tokens asked for
    usage_prompt_tokens: int = 0
    usage_completion_tokens: int = 0
    acceptance_length: float = 0.0
    decode_steps: int = 0
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent if self.chunk_times else math.nan

    @property
    def tpot_s(self) -> float:
        if self.tokens < 2 or not self.chunk_times:
            return math.nan
        return (self.end - self.chunk_times[0]) / (self.tokens - 1)

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)]


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 500.0
    tpot_ms: float = 25.0


@dataclass(slots=True)
class Quantiles:
    p50: float
    p90: float
    p99: float


@dataclass(slots=True)
class GroupTransfers:
    """A layer group's transfers over a point: per request, mean and p99 ms, mean bytes."""

    ms_mean: float
    ms_p99: float
    bytes_mean: float


@dataclass(slots=True)
class PointStats:
    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    output_tok_s_per_gpu: float
    requests_per_s: float
    ttft_ms: Quantiles
    tpot_ms: Quantiles
    itl_p99_ms: float
    acceptance_length: float
    goodput_req_s: float
    slo_attainment: float  # fraction of all requests that met both SLOs
    transfers: dict[str, GroupTransfers] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)  # up to 3, for the report


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def quantiles_ms(values_s: list[float]) -> Quantiles:
    """p50/p90/p99 in ms of the finite values (seconds)."""
    ms = [1e3 * v for v in values_s if math.isfinite(v)]
    return Quantiles(percentile(ms, 0.5), percentile(ms, 0.9), percentile(ms, 0.99))


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    if r.error or not 1e3 * r.ttft_s <= slo.ttft_ms:
        return False
    return r.tokens < 2 or 1e3 * r.tpot_s <= slo.tpot_ms


def weighted_al(records: list[RequestRecord]) -> float:
    """Tokens per decode step over every request's steps; NaN when none ran."""
    steps = sum(r.decode_steps for r in records)
    if steps == 0:
        return math.nan
    return sum(r.acceptance_length * r.decode_steps for r in records) / steps


def group_transfers(records: list[RequestRecord]) -> dict[str, GroupTransfers]:
    """Per layer group, over the requests that transferred it (none when aggregated)."""
    by_group: dict[str, list[Transfer]] = {}
    for r in records:
        for t in r.transfers:
            by_group.setdefault(t.group, []).append(t)
    return {
        g: GroupTransfers(
            ms_mean=1e3 * sum(t.seconds for t in ts) / len(ts),
            ms_p99=1e3 * percentile([t.seconds for t in ts], 0.99),
            bytes_mean=sum(t.num_bytes for t in ts) / len(ts),
        )
        for g, ts in sorted(by_group.items())
    }


def summarize(records: list[RequestRecord], slo: Slo, gpus: int = 1) -> PointStats:
    """One point of the sweep; ``gpus``: devices the configuration occupies (>= 1)."""
    ok = [r for r in records if not r.error]
    span = max(r.end for r in records) - min(r.sent for r in records) if records else math.nan
    rate = (lambda n: n / span) if span > 0 else (lambda n: math.nan)
    tokens = sum(r.tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in records)
    return PointStats(
        requests=len(records),
        errors=len(records) - len(ok),
        duration_s=span,
        output_tokens=tokens,
        output_tok_s=rate(tokens),
        output_tok_s_per_gpu=rate(tokens) / gpus,
        requests_per_s=rate(len(ok)),
        ttft_ms=quantiles_ms([r.ttft_s for r in ok]),
        tpot_ms=quantiles_ms([r.tpot_s for r in ok]),
        itl_p99_ms=1e3 * percentile([g for r in ok for g in r.gaps_s], 0.99),
        acceptance_length=weighted_al(ok),
        goodput_req_s=rate(good),
        slo_attainment=good / len(records) if records else math.nan,
        transfers=group_transfers(ok),
        first_errors=[r.error for r in records if r.error][:3],
    )
