"""Summaries of an agentic replay: tokens per group, latencies, AL, throughput; markdown rows.

Per layer group: cached = the prompt tokens that group reused (``Usage.cached_tokens_per_group``),
prefilled = prompt - cached, hit rate = cached / prompt, over the replay's successful turns.
Prefill forward = the prompt positions the prefill's forward actually runs over, from the
reuse rule (docs/kvcore.md): after a hit of m tokens it starts at m - 1 (the drafter needs the
target's features there) when the draft group reused its window, else L * (W - 1) + 1 tokens
earlier, to rebuild that window. Latencies are in milliseconds in the table, seconds in the
records. Transfer: pages the KV transfer sent, and pages it skipped because the decode
worker held them already (its prefix cache or host tier), per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.agentic_replay import ReplayResult, TurnRecord

GROUPS = ("target", "draft")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def weighted_al(records: list[TurnRecord]) -> float:
    """AL over every decode step of ``records`` (each request's AL weighted by its steps)."""
    steps = sum(r.num_drafts for r in records)
    if steps == 0:
        return float("nan")
    return sum(r.acceptance_length * r.num_drafts for r in records) / steps


@dataclass(slots=True)
class Summary:
    """One configuration's replay. Token counts are totals; latencies in seconds."""

    name: str
    origin: str  # the AL origin label: transferred, cold or local
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    forward_tokens: int = 0  # prefill forward positions, from the reuse rule
    floor_prefilled: int = 0  # target tokens an unbounded prompt cache would still prefill
    ttft_first: tuple[float, float] = (float("nan"), float("nan"))  # p50, p90
    ttft_continuation: tuple[float, float] = (float("nan"), float("nan"))
    itl: tuple[float, float] = (float("nan"), float("nan"))
    al: float = float("nan")
    al_continuation: float = float("nan")
    output_tokens: int = 0
    wall_s: float = 0.0
    first_errors: list[str] = field(default_factory=list)
    over_cached: int = 0  # requests reporting more cached than prompt tokens (clamped)
    sent_pages: dict[str, int] = field(default_factory=dict)  # KV transfer, per group
    held_pages: dict[str, int] = field(default_factory=dict)  # skipped: the decode held them
    transfer_bytes: int = 0

    def prefilled(self, group: str) -> int:
        return self.prompt_tokens - self.cached.get(group, 0)

    def hit_rate(self, group: str) -> float:
        return self.cached.get(group, 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def forward_tokens(record: TurnRecord, rebuild_tokens: int) -> int:
    """Prompt positions the prefill forward ran over; ``rebuild_tokens`` = L * (W - 1) of the
    windowed draft group (0: none, the forward starts at the hit)."""
    hit = _cached(record, "target")
    if hit == 0:
        return record.prompt_tokens
    if rebuild_tokens == 0:
        return record.prompt_tokens - hit
    if _cached(record, "draft") >= hit:
        return record.prompt_tokens - hit + 1
    return record.prompt_tokens - max(0, hit - rebuild_tokens - 1)


def summarize(name: str, origin: str, result: ReplayResult, rebuild_tokens: int = 0) -> Summary:
    ok = [r for r in result.records if not r.error]
    first = [r for r in ok if r.is_first]
    later = [r for r in ok if not r.is_first]
    gaps = [g for r in ok for g in r.itl_s]
    return Summary(
        name=name,
        origin=origin,
        requests=len(result.records),
        errors=len(result.records) - len(ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached={g: sum(_cached(r, g) for r in ok) for g in GROUPS},
        forward_tokens=sum(forward_tokens(r, rebuild_tokens) for r in ok),
        floor_prefilled=sum(r.prompt_tokens - r.floor_cached for r in ok),
        ttft_first=_p50_p90([r.ttft_s for r in first]),
        ttft_continuation=_p50_p90([r.ttft_s for r in later]),
        itl=_p50_p90(gaps),
        al=weighted_al(ok),
        al_continuation=weighted_al(later),
        output_tokens=sum(r.completion_tokens for r in ok),
        wall_s=result.wall_s,
        first_errors=[r.error for r in result.records if r.error][:3],
        over_cached=sum(any(n > r.prompt_tokens for n in r.cached_per_group.values()) for r in ok),
        sent_pages={g: sum(r.sent_pages.get(g, 0) for r in ok) for g in GROUPS},
        held_pages={g: sum(r.held_pages.get(g, 0) for r in ok) for g in GROUPS},
        transfer_bytes=sum(r.transfer_bytes for r in ok),
    )


def _cached(record: TurnRecord, group: str) -> int:
    """Cached prompt tokens of ``group``, at most the prompt: a request preempted and
    admitted again reports the match over its prompt and the tokens it had generated."""
    return min(record.cached_per_group.get(group, 0), record.prompt_tokens)


def _p50_p90(values: list[float]) -> tuple[float, float]:
    return percentile(values, 0.5), percentile(values, 0.9)


HEADER = (
    "| configuration | requests (errors) | prefilled target / draft | prefill forward "
    "| cached target / draft "
    "| hit rate target / draft | TTFT p50 / p90 first turns (ms) | TTFT p50 / p90 "
    "continuations (ms) | ITL p50 / p90 (ms) | AL (origin) | AL continuations | "
    "output tok/s | transfer pages sent / skipped target; draft (MiB sent) |"
)


def markdown_table(summaries: list[Summary], skipped: dict[str, str] | None = None) -> str:
    """The table; ``skipped``: configuration -> why it has no numbers (a row saying so)."""
    lines = [HEADER, "|---" * HEADER.count(" | ") + "|---|"]
    lines += [markdown_row(s) for s in summaries]
    lines += [
        f"| {name} | not run: {why} |" + " |" * (HEADER.count(" | ") - 1)
        for name, why in (skipped or {}).items()
    ]
    return "\n".join(lines)


def markdown_row(s: Summary) -> str:
    cells = [
        s.name,
        f"{s.requests} ({s.errors})",
        f"{_k(s.prefilled('target'))} / {_k(s.prefilled('draft'))}",
        _k(s.forward_tokens),
        f"{_k(s.cached['target'])} / {_k(s.cached['draft'])}",
        f"{s.hit_rate('target'):.1%} / {s.hit_rate('draft'):.1%}",
        _ms_pair(s.ttft_first),
        _ms_pair(s.ttft_continuation),
        _ms_pair(s.itl),
        f"{s.al:.2f} ({s.origin})",
        f"{s.al_continuation:.2f}",
        f"{s.output_tok_s:.1f}",
        _transfer_cell(s),
    ]
    return "| " + " | ".join(cells) + " |"


def _transfer_cell(s: Summary) -> str:
    if not any(s.sent_pages.values()):
        return "none (aggregated)"
    groups = [f"{s.sent_pages[g]} / {s.held_pages[g]}" for g in GROUPS if s.sent_pages.get(g)]
    return "; ".join(groups) + f" ({s.transfer_bytes / 2**20:.0f})"


def _k(tokens: int) -> str:
    return f"{tokens / 1000:.1f}K"


def _ms_pair(pair: tuple[float, float]) -> str:
    return f"{pair[0] * 1000:.0f} / {pair[1] * 1000:.0f}"
