"""Prefix matching across layer groups: how much of a prompt a request can reuse.

Rules (design.md §3):
- the target's (REQUIRED) groups alone decide the match length: one group, or one per
  window of a per-layer mix, which all reuse the match or none;
- an OPTIONAL group is reused only where the cache holds what a query at the match end
  reads (a windowed group: its window there); otherwise the match says from which
  position it is recomputed (:meth:`FullAttentionRows.compute_start`);
- a windowed target group may hold NULL pages in the tree. A match ending at m is usable
  only if every page the prefill reads of every target group is held: from the window of
  the first position the target runs, up to m. The target runs from m, or, when an
  OPTIONAL group is fed from it, from ``recompute_start - 1`` (a drafter's slot j reads
  the target's features at j - 1), writing nothing below m. Otherwise the match shortens to
  the longest page boundary where it holds (0 at worst): released target pages are never
  recomputed;
- the host tier continues a device match by whole pages (then no partial page), and only
  by at least ``host_recall_min_pages`` pages;
- a match for a transfer's reservation is of whole pages: the transfer rewrites every page
  after the held ones, so a partial page copied on write would be wasted work, and under
  tensor parallelism a copy replayed on the other ranks after the pages landed would
  overwrite them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from kvcore.group_rows import FullAttentionRows
from kvcore.page_store import PageStore
from kvcore.radix import TreeNode
from kvcore.spec import NULL_PAGE, Lifecycle
from kvcore.stats import GroupStats


@dataclass(slots=True)
class PrefixMatch:
    """What a request can reuse: ``num_tokens`` cached target tokens (full pages plus a
    partial page). Per group:

    - ``compute_start``: the first position whose KV the prefill must compute;
    - ``reused_pages``: the block-table prefix taken from the device cache (``NULL_PAGE``
      where the group holds nothing);
    - ``recall_pages``: host-tier pages right after ``reused_pages``;
    - ``cow_pages``: the source of the partial page, copied on write.
    """

    num_tokens: int = 0
    compute_start: dict[str, int] = field(default_factory=dict)
    reused_pages: dict[str, list[int]] = field(default_factory=dict)
    cow_pages: dict[str, int] = field(default_factory=dict)
    node: TreeNode | None = None
    recall_pages: dict[str, list[int]] = field(default_factory=dict)

    @property
    def recompute_start(self) -> int:
        """First position any group must recompute (the target may need to re-run from
        here, without writing its shared pages, to feed another group)."""
        return min(self.compute_start.values(), default=0)

    def num_held(self, tokens_per_page: int) -> dict[str, int]:
        """Whole pages per group whose KV the match gives (0-entry groups left out)."""
        m = self.num_tokens
        return {g: m // tokens_per_page for g, start in self.compute_start.items() if m and start == m}

    def count(self, stats: dict[str, GroupStats], query_tokens: int, tokens_per_page: int) -> None:
        """Record this match, taken by a request of ``query_tokens`` tokens, per group."""
        m = self.num_tokens
        for g, s in stats.items():
            hit = m if self.compute_start[g] == m else 0
            recalled = tokens_per_page * len(self.recall_pages.get(g, [])) if hit else 0
            s.record(query_tokens, hit, m - self.compute_start[g], recalled)


class PrefixMatcher:
    """Matches prompts against ``store``'s tree and host tier under ``rows``' rules
    (one per group, the target's first)."""

    def __init__(self, store: PageStore, rows: dict[str, FullAttentionRows]) -> None:
        self.store, self.rows, self.page = store, rows, store.page
        self.required = [g for g, r in rows.items() if r.spec.lifecycle == Lifecycle.REQUIRED]
        self.target = self.required[0]
        self.fed = len(self.required) < len(rows)  # an OPTIONAL group reads the target's features

    def match(self, token_ids: list[int], whole_pages: bool = False) -> PrefixMatch:
        """Reusable prefix of a prompt, leaving at least its last token to compute;
        ``whole_pages``: no partial page (nothing copied on write)."""
        match = PrefixMatch(compute_start={g: 0 for g in self.rows}, reused_pages={g: [] for g in self.rows})
        tree = self.store.tree
        if tree is None or len(token_ids) < 2:
            return match
        tokens, p = token_ids[:-1], self.page
        radix = tree.match_prefix(tokens)
        recalled = self.store.host_hits(tokens, radix.num_tokens)
        if recalled or whole_pages:  # the host tier extends the match by whole pages: no partial page
            radix.partial_tokens, radix.partial_pages = 0, {}
        device = radix.num_tokens // p
        entries = {
            g: [*radix.pages[g], *(e.get(g, NULL_PAGE) for e in recalled)] for g in self.store.cached_groups
        }
        if radix.partial_tokens:
            for g, row in entries.items():
                row.append(radix.partial_pages.get(g, NULL_PAGE))
        m, starts = self._usable_end(
            radix.num_tokens + p * len(recalled) + radix.partial_tokens, entries, device
        )
        if m < radix.num_tokens:  # shortened inside the device tree: lock the node ending at m
            radix, device = tree.match_prefix(tokens[:m]), m // p
        match.num_tokens, match.node, match.compute_start = m, radix.node, starts
        for g, row in entries.items():
            if starts[g] == m:
                self._reuse(match, g, row, device)
        return match

    def _reuse(self, match: PrefixMatch, group: str, row: list[int], device: int) -> None:
        """Take ``row``'s cached entries up to the match end for ``group``: device pages,
        then host pages, NULL below the first page the prefill reads; the partial page
        is copied on write."""
        m, p = match.num_tokens, self.page
        full, first = m // p, self._first_needed(group, match.compute_start)
        match.reused_pages[group] = [
            NULL_PAGE if i < first else q for i, q in enumerate(row[: min(full, device)])
        ]
        match.recall_pages[group] = [NULL_PAGE if i < first else row[i] for i in range(device, full)]
        if m % p:
            match.cow_pages[group] = row[full]

    def _usable_end(
        self, longest: int, entries: dict[str, list[int]], device_pages: int
    ) -> tuple[int, dict[str, int]]:
        """The longest match end m <= ``longest`` (itself, else a page boundary) at which
        every page of every target group from :meth:`_first_needed` up to m is held, and
        each group's ``compute_start`` there.

        - ``entries``: the cached pages per group in position order (device, then host,
          then the partial page);
        - a shortened match keeps no partial page, and recalls at least
          ``host_recall_min_pages`` host pages or none.
        """
        p, min_recall = self.page, self.store.config.host_recall_min_pages
        nulls = {g: list(accumulate((q == NULL_PAGE for q in row), initial=0)) for g, row in entries.items()}
        ends = [(longest, len(entries[self.target]))]
        ends += [(k * p, k) for k in range(longest // p, -1, -1) if k * p < longest]
        for m, hi in ends:
            host = max(0, hi - device_pages) if m % p == 0 else 0
            if 0 < host < min_recall:
                continue
            starts = self._starts_at(m, hi, nulls)
            if all(_all_held(nulls[g], self._first_needed(g, starts), hi) for g in self.required):
                return m, starts
        raise AssertionError("a match of length 0 is always usable")

    def _starts_at(self, m: int, hi: int, nulls: dict[str, list[int]]) -> dict[str, int]:
        """compute_start per group for a match ending at m whose cached entries [0, hi)
        cover it. The target groups' is m (whether their pages are held is the caller's)."""
        starts = {}
        for name, rows in self.rows.items():
            held = name in nulls and _all_held(nulls[name], rows.first_read_page(m), hi)
            starts[name] = m if name in self.required else rows.compute_start(m, held)
        return starts

    def _first_needed(self, group: str, starts: dict[str, int]) -> int:
        """First page of ``group`` a match with these ``compute_start`` values reads.

        - an OPTIONAL group reads its window at the match end m;
        - the target re-runs from ``recompute_start - 1`` when an OPTIONAL group is fed
          from it (a drafter's slot j reads the target's features at j - 1), else from m,
          and that first query reads each target group's window.
        """
        m = starts[self.target]
        if group not in self.required:
            return self.rows[group].first_read_page(m)
        rerun = max(0, min(starts.values()) - 1) if self.fed else m
        return self.rows[group].first_read_page(rerun)


def _all_held(nulls: list[int], lo: int, hi: int) -> bool:
    """Whether entries [lo, hi) are all real pages (``nulls[i]``: NULLs among the first i)."""
    return lo >= hi or nulls[hi] == nulls[lo]
