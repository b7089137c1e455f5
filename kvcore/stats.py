"""Per-group counters and usage: plain data."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(slots=True)
class GroupStats:
    """Prefix-cache counters of one group, in requests and tokens. A group *hits* when it
    reuses the whole match; a windowed group whose window is incomplete misses and
    recomputes ``recomputed_tokens`` positions that the target reuses."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0
    recalled_tokens: int = 0  # of hit_tokens, recalled from the host tier

    def record(
        self, query_tokens: int, hit_tokens: int, recomputed_tokens: int, recalled_tokens: int = 0
    ) -> None:
        self.queries += 1
        self.hits += hit_tokens > 0
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        self.recomputed_tokens += recomputed_tokens
        self.recalled_tokens += recalled_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def copy(self) -> GroupStats:
        return replace(self)


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """Pages of one group: ``used`` held by anyone (requests or the prefix cache) out of
    ``total``; ``cached`` held by the prefix cache, ``evictable`` of those unlocked."""

    used: int
    total: int
    cached: int
    evictable: int
    host_used: int = 0  # host-tier pages (0 without a host tier)
    host_total: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache, per group: prefix-cache counters (copies, so later
    requests do not change them) and page usage."""

    prefix: dict[str, GroupStats]
    usage: dict[str, GroupUsage]
