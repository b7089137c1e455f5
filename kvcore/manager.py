"""KVCacheManager: the one facade the services see.

Per request it keeps one block-table row per layer group. A row's length is the
request's *extent* in pages (context + headroom); entries below a windowed group's stale
boundary are ``NULL_PAGE``, so the count of valid entries is not the extent.

Lifecycle rules (design.md §3):
- the target (REQUIRED) group alone decides the prefix match length;
- a windowed OPTIONAL group is reused only where its window is complete at the match
  end; otherwise the match says from which position to recompute it;
- a windowed target (Mistral's sliding window) releases pages below its stale boundary
  like any windowed group, so tree nodes may hold NULL target pages. A match ending at m
  is usable only if every target page the prefill reads is held: from the window of the
  first position the target runs, up to m. The target runs from m, or, when another
  group is fed from it, from ``recompute_start - 1`` (a drafter's slot j reads the
  target's features at j - 1), writing nothing below m. Held pages are exact (a page
  depends only on its token prefix), so that re-run is exact too. Otherwise the match
  shortens to the longest page boundary where it holds (0 at worst): released target
  pages are never recomputed, as a windowed stack of L layers reaches back L * (W - 1)
  tokens, a whole context for real models;
- a match ending inside a page copies that page into a private page for every group that
  reuses it (copy-on-write), so shared pages are never written;
- with ``KVLayout.SEPARATE`` the draft group is neither cached nor transferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from kvcore import window as win
from kvcore.capacity import split_capacity
from kvcore.host_cache import HostCache, chain_hashes
from kvcore.page_allocator import PageAllocator
from kvcore.radix import RadixCache, TreeNode
from kvcore.spec import NULL_PAGE, CacheConfig, KVLayout, LayerGroupSpec, Lifecycle, cdiv
from kvcore.stats import GroupStats, GroupUsage


@dataclass(slots=True)
class PrefixMatch:
    """What a request can reuse. ``num_tokens`` cached target tokens (full pages plus a
    partial page); per group, ``compute_start`` is the first position whose KV the prefill
    must compute, ``reused_pages`` the block-table prefix taken from the cache (``NULL_PAGE``
    where the group holds nothing) and ``cow_pages`` the source of the partial page."""

    num_tokens: int = 0
    compute_start: dict[str, int] = field(default_factory=dict)
    reused_pages: dict[str, list[int]] = field(default_factory=dict)
    cow_pages: dict[str, int] = field(default_factory=dict)
    node: TreeNode | None = None
    recall_pages: dict[str, list[int]] = field(default_factory=dict)  # host pages after reused

    @property
    def recompute_start(self) -> int:
        """First position any group must recompute (the target may need to re-run from
        here, without writing its shared pages, to feed another group)."""
        return min(self.compute_start.values(), default=0)


@dataclass(slots=True)
class TransferPages:
    """Pages of one group that a transfer moves: block-table indices
    [first_page, first_page + len(page_ids)), i.e. positions from first_page * P."""

    first_page: int
    page_ids: list[int]


@dataclass(slots=True)
class _Request:
    rows: dict[str, list[int]]
    num_computed: int = 0
    node: TreeNode | None = None
    first_held: dict[str, int] = field(default_factory=dict)  # per group: entries below are NULL
    num_held: dict[str, int] = field(default_factory=dict)  # per group: entries valid at allocate


class KVCacheManager:
    def __init__(
        self, config: CacheConfig, device: str | torch.device = "cpu", allocate_tensors: bool = True
    ) -> None:
        self.config = config
        self.page = config.tokens_per_page
        self.groups: dict[str, LayerGroupSpec] = {g.name: g for g in config.groups}
        self.allocators = {
            g.name: PageAllocator(n) for g, n in zip(config.groups, split_capacity(config), strict=True)
        }
        self.pools: dict[str, torch.Tensor] = {}
        if allocate_tensors:
            self.pools = {
                g.name: torch.zeros(
                    (self.allocators[g.name].num_pages, *g.page_shape(self.page)),
                    dtype=g.torch_dtype,
                    device=device,
                )
                for g in config.groups
            }
        self.cached_groups = [g.name for g in config.groups if self._is_cached(g)]
        self.host = None
        if config.host_num_pages and config.enable_prefix_cache and self.pools:
            self.host = HostCache(
                {g: self.pools[g] for g in self.cached_groups}, config.host_num_pages, self.page
            )
        optional = frozenset(
            g.name
            for g in config.groups
            if g.lifecycle == Lifecycle.OPTIONAL and g.name in self.cached_groups
        )
        self.tree = (
            RadixCache(
                {g: self.allocators[g] for g in self.cached_groups},
                self.page,
                on_evict=self._to_host if self.host else None,
                optional=optional,
            )
            if config.enable_prefix_cache
            else None
        )
        self.stats = {g: GroupStats() for g in self.groups}
        self.requests: dict[str, _Request] = {}
        self._target = config.groups[0].name
        # (group, window its pages are kept for): a target that feeds another group keeps
        # one more position, so a later match at n may re-run it from n - 1
        fed = len(config.groups) > 1
        self._windowed = [
            (g.name, g.window + (fed and g.name == self._target)) for g in config.groups if g.window > 0
        ]

    # ------------------------------------------------------------ prefix reuse

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """Reusable prefix of a prompt, leaving at least its last token to compute: the
        longest cached run, shortened to the longest end at which the target's window is
        held (see the module docstring)."""
        match = PrefixMatch(
            compute_start={g: 0 for g in self.groups}, reused_pages={g: [] for g in self.groups}
        )
        if self.tree is None or len(token_ids) < 2:
            return match
        tokens = token_ids[:-1]
        radix = self.tree.match_prefix(tokens)
        recalled = self._host_hits(tokens, radix.num_tokens)
        if recalled:  # the host tier extends the match by whole pages; no partial page then
            radix.partial_tokens, radix.partial_pages = 0, {}
        device = radix.num_tokens // self.page
        entries = {g: [*radix.pages[g], *(e.get(g, NULL_PAGE) for e in recalled)] for g in self.cached_groups}
        if radix.partial_tokens:
            for g, row in entries.items():
                row.append(radix.partial_pages.get(g, NULL_PAGE))
        m, starts = self._usable_end(
            radix.num_tokens + self.page * len(recalled) + radix.partial_tokens, entries, device
        )
        if m < radix.num_tokens:  # shortened inside the device tree: lock the node ending at m
            radix, device = self.tree.match_prefix(tokens[:m]), m // self.page
        match.num_tokens, match.node, match.compute_start = m, radix.node, starts
        full = m // self.page
        for g, row in entries.items():
            if starts[g] != m:
                continue
            first = self._first_needed(g, starts)
            match.reused_pages[g] = [
                NULL_PAGE if i < first else p for i, p in enumerate(row[: min(full, device)])
            ]
            match.recall_pages[g] = [NULL_PAGE if i < first else row[i] for i in range(device, full)]
            if m % self.page:
                match.cow_pages[g] = row[full]
        return match

    def _host_hits(self, tokens: list[int], device_tokens: int) -> list[dict[str, int]]:
        if self.host is None:
            return []
        keys = chain_hashes(tuple(tokens), self.page)
        hits = self.host.lookup(keys[device_tokens // self.page :])
        return hits if len(hits) >= self.config.host_recall_min_pages else []

    def _usable_end(
        self, longest: int, entries: dict[str, list[int]], device_pages: int
    ) -> tuple[int, dict[str, int]]:
        """The longest match end m <= ``longest`` (itself, else a page boundary) at which
        every target page from :meth:`_first_needed` up to m is held, and each group's
        ``compute_start`` there. ``entries`` are the cached pages per group in position
        order (device, then host, then the partial page); a shortened match keeps no
        partial page and recalls at least ``host_recall_min_pages`` host pages or none."""
        nulls = {g: list(accumulate((p == NULL_PAGE for p in row), initial=0)) for g, row in entries.items()}
        ends = [(longest, len(entries[self._target]))]
        ends += [(k * self.page, k) for k in range(longest // self.page, -1, -1) if k * self.page < longest]
        for m, hi in ends:
            host = max(0, hi - device_pages) if m % self.page == 0 else 0
            if 0 < host < self.config.host_recall_min_pages:
                continue
            starts = self._starts_at(m, hi, nulls)
            if _all_held(nulls[self._target], self._first_needed(self._target, starts), hi):
                return m, starts
        raise AssertionError("a match of length 0 is always usable")

    def _starts_at(self, m: int, hi: int, nulls: dict[str, list[int]]) -> dict[str, int]:
        """compute_start per group for a match ending at m whose cached entries [0, hi)
        cover it: m where the group's window pages there are held, else where it
        recomputes from. The target's is m (whether its pages are held is the caller's)."""
        starts = {}
        for name, spec in self.groups.items():
            if name == self._target:
                starts[name] = m
            elif name in nulls and _all_held(nulls[name], win.window_start(m, spec.window) // self.page, hi):
                starts[name] = m
            else:
                starts[name] = win.recompute_start(m, spec.window, spec.num_layers)
        return starts

    def _first_needed(self, group: str, starts: dict[str, int]) -> int:
        """First page of ``group`` a match with these ``compute_start`` values reads. A
        group other than the target reads its window at the match end m. The target re-runs
        from ``recompute_start - 1`` when another group is fed from it (a drafter's slot j
        reads the target's features at j - 1), else from m, and that first query reads the
        target's window."""
        m, spec = starts[self._target], self.groups[group]
        if group != self._target:
            return win.window_start(m, spec.window) // self.page
        rerun = max(0, min(starts.values()) - 1) if len(starts) > 1 else m
        return win.window_start(rerun, spec.window) // self.page

    # ------------------------------------------------------------ allocate / free

    def can_allocate(self, num_tokens: int, match: PrefixMatch | None = None, num_computed: int = 0) -> bool:
        """Whether ``allocate`` with the same arguments would find its pages."""
        needs = self._new_pages(self._initial_rows(num_tokens, match, num_computed))
        locked = self._path_evictable(match.node if match else None)
        return all(
            needs[g] + (1 if match and g in match.cow_pages else 0) <= self._available(g) - locked.get(g, 0)
            for g in needs
        )

    def allocate(
        self, request_id: str, num_tokens: int, match: PrefixMatch | None = None, num_computed: int = 0
    ) -> None:
        """Give a new request pages for positions [0, num_tokens + headroom), taking the
        matched prefix. ``num_computed`` > 0 reserves pages whose KV arrives by transfer:
        windowed groups then skip pages already out of the window."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already allocated")
        rows = self._initial_rows(num_tokens, match, num_computed)
        node = match.node if match and match.node is not None else None
        if node is not None:
            self.tree.lock(node)
        for g, row in rows.items():
            self.allocators[g].incref([p for p in row if p is not None and p != NULL_PAGE])
        cow = match.cow_pages if match else {}
        for g, src in cow.items():  # pin copy sources: making room may evict their node
            self.allocators[g].incref([src])
        self._take_new_pages(rows)
        self._recall(match, rows)
        self._copy_partial_pages(match, rows)
        for g, src in cow.items():
            self.allocators[g].decref([src])
        if match:
            self._count_match(match, num_tokens)
        self.requests[request_id] = _Request(
            rows=rows,
            num_computed=num_computed,
            node=node,
            first_held={g: _first_held(row) for g, row in rows.items()},
            num_held=_num_held(match, self.page),
        )

    def can_extend(self, request_id: str, num_tokens: int) -> bool:
        req = self._request(request_id)
        needs = self._extension(req, num_tokens)
        return all(needs[g] <= self._available(g) for g in needs)

    def extend(self, request_id: str, num_tokens: int) -> None:
        """Grow the extent to cover positions [0, num_tokens + headroom)."""
        req = self._request(request_id)
        needs = self._extension(req, num_tokens)
        self._make_room(needs)
        for g, n in needs.items():
            req.rows[g].extend(self.allocators[g].allocate(n))

    def advance(self, request_id: str, num_computed: int) -> None:
        """Record that positions [0, num_computed) hold valid KV; release windowed pages no
        later query can read: pages [0, (n - W + 1) // P) for window W, where a target
        feeding another group counts W + 1 (a match at n re-runs it from n - 1). Rolling
        back speculative positions needs no call: they are overwritten by later writes."""
        self.advance_batch([request_id], [num_computed])

    def can_extend_batch(self, request_ids: list[str], num_tokens: list[int]) -> bool:
        """Whether ``extend_batch`` finds pages for every request at once."""
        new = sum(self._growth(request_ids, num_tokens).values())
        return all(new <= self._available(g) for g in self.groups)

    def extend_batch(self, request_ids: list[str], num_tokens: list[int]) -> None:
        """``extend`` for a whole batch, allocating every group's new pages in one call."""
        growth = self._growth(request_ids, num_tokens)
        if not growth:
            return
        total = sum(growth.values())
        self._make_room({g: total for g in self.groups})
        for g, allocator in self.allocators.items():
            fresh, i = allocator.allocate(total), 0
            for rid, k in growth.items():
                self.requests[rid].rows[g].extend(fresh[i : i + k])
                i += k

    def advance_batch(self, request_ids: list[str], num_computed: list[int]) -> None:
        """``advance`` for a whole batch (one loop: this runs every decode step)."""
        page, windowed, allocators = self.page, self._windowed, self.allocators
        for rid, n in zip(request_ids, num_computed, strict=True):
            req = self.requests.get(rid) or self._request(rid)
            req.num_computed = n
            for g, window in windowed:
                end = (n - window + 1) // page
                first = req.first_held[g]
                if end > first:
                    row = req.rows[g]
                    end = min(end, len(row))
                    allocators[g].decref(row[first:end])
                    row[first:end] = [NULL_PAGE] * (end - first)
                    req.first_held[g] = end

    def _growth(self, request_ids: list[str], num_tokens: list[int]) -> dict[str, int]:
        """New pages per request (same for every group: all rows share the extent)."""
        out, page, head, target = {}, self.page, self.config.headroom_tokens, self._target
        requests = self.requests
        for rid, n in zip(request_ids, num_tokens, strict=True):
            k = (n + head + page - 1) // page - len((requests.get(rid) or self._request(rid)).rows[target])
            if k > 0:
                out[rid] = k
        return out

    def free(self, request_id: str, token_ids: list[int] | None = None) -> None:
        """End a request. With ``token_ids`` (the tokens at positions [0, num_computed)),
        its whole pages are offered to the prefix cache first."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id {request_id!r} is not allocated")
        if token_ids is not None and self.tree is not None:
            n = min(len(token_ids), req.num_computed)
            known = self.tree.insert(token_ids[:n], {g: req.rows[g] for g in self.cached_groups})
            if self.host is not None and self.config.host_write_policy == "through":
                self._write_through(req, token_ids[:n], known // self.page)
        for g, row in req.rows.items():
            self.allocators[g].decref(row[req.first_held[g] :][::-1])  # tail pages reused last
        if req.node is not None:
            self.tree.unlock(req.node)
        del self.requests[request_id]

    # ------------------------------------------------------------ views

    def block_table(self, request_id: str, group: str) -> list[int]:
        return list(self._request(request_id).rows[group])

    def block_tables(
        self, request_ids: list[str], group: str, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """[batch, max_extent] int32, padded with NULL_PAGE."""
        rows = [self._request(r).rows[group] for r in request_ids]
        width = max((len(r) for r in rows), default=0)
        out = np.full((len(rows), width), NULL_PAGE, dtype=np.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return torch.from_numpy(out).to(device)

    def held_pages(self, request_id: str) -> dict[str, int]:
        """Per group, leading block-table entries whose KV the request had at ``allocate``
        (reused from the prefix cache or recalled from the host tier; entries out of the
        window are NULL): a transfer into the request need not move them. Whole pages only;
        the target's entry is ``match.num_tokens // P``, a draft group's the same where its
        window was complete and 0 where it must be recomputed."""
        return dict(self._request(request_id).num_held)

    def transfer_pages(
        self, request_id: str, num_tokens: int, held: dict[str, int] | None = None
    ) -> dict[str, TransferPages]:
        """Pages holding positions [0, num_tokens) that a disaggregated transfer moves, per
        group: windowed groups only inside the window, separate draft groups not at all,
        none of the receiver's ``held`` leading entries (its :meth:`held_pages`). Sender
        and receiver compute the same indices from the same ``num_tokens`` and ``held``."""
        req = self._request(request_id)
        held = held or {}
        out = {}
        for g, row in req.rows.items():
            spec = self.groups[g]
            if self.config.layout == KVLayout.SEPARATE and spec.lifecycle == Lifecycle.OPTIONAL:
                continue
            end = cdiv(num_tokens, self.page)
            first = min(max(win.stale_page_end(num_tokens, spec.window, self.page), held.get(g, 0)), end)
            out[g] = TransferPages(first, row[first:end])
        return out

    def usage(self) -> dict[str, GroupUsage]:
        cached = self.tree.num_cached_pages() if self.tree else {}
        host = self.host.usage() if self.host else {}
        return {
            g: GroupUsage(
                used=a.num_used,
                total=a.num_pages,
                cached=cached.get(g, 0),
                evictable=self.tree.evictable.get(g, 0) if self.tree else 0,
                host_used=host.get(g, (0, 0))[0],
                host_total=host.get(g, (0, 0))[1],
            )
            for g, a in self.allocators.items()
        }

    def num_request_pages(self, request_id: str) -> dict[str, int]:
        """Valid (held) entries per group; compare with len(block_table) for the extent."""
        return {g: sum(p != NULL_PAGE for p in row) for g, row in self._request(request_id).rows.items()}

    def reset_prefix_cache(self) -> None:
        """Evict everything unlocked from the prefix cache, host tier included."""
        if self.tree is not None:
            hook, self.tree.on_evict = self.tree.on_evict, None
            self.tree.evict({g: self.allocators[g].num_pages for g in self.cached_groups})
            self.tree.on_evict = hook
            if self.host is not None:
                self.host.fence()
        if self.host is not None:
            self.host.clear()

    # ------------------------------------------------------------ internals

    def _is_cached(self, spec: LayerGroupSpec) -> bool:
        return not (self.config.layout == KVLayout.SEPARATE and spec.lifecycle == Lifecycle.OPTIONAL)

    def _request(self, request_id: str) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id {request_id!r} is not allocated")
        return req

    def _extent(self, num_tokens: int) -> int:
        return cdiv(num_tokens + self.config.headroom_tokens, self.page)

    def _initial_rows(
        self, num_tokens: int, match: PrefixMatch | None, num_computed: int
    ) -> dict[str, list[int | None]]:
        """Rows with reused pages filled, NULL where nothing is held, None where a new
        page goes."""
        extent = self._extent(num_tokens)
        rows = {}
        for g, spec in self.groups.items():
            reused = list(match.reused_pages.get(g, [])) if match else []
            reused += [
                NULL_PAGE if h == NULL_PAGE else None  # a recalled page is a new page
                for h in (match.recall_pages.get(g, []) if match else [])
            ]
            compute_start = match.compute_start[g] if match else 0
            stale = min(win.stale_page_end(num_computed, spec.window, self.page), extent)
            reused[:stale] = [NULL_PAGE] * min(stale, len(reused))
            first_new = min(max(len(reused), compute_start // self.page, stale), extent)
            rows[g] = reused + [NULL_PAGE] * (first_new - len(reused)) + [None] * (extent - first_new)
        return rows

    @staticmethod
    def _new_pages(rows: dict[str, list[int | None]]) -> dict[str, int]:
        return {g: row.count(None) for g, row in rows.items()}

    def _take_new_pages(self, rows: dict[str, list[int | None]]) -> None:
        needs = self._new_pages(rows)
        self._make_room(needs)
        for g, row in rows.items():
            fresh = iter(self.allocators[g].allocate(needs[g]))
            row[:] = [next(fresh) if p is None else p for p in row]

    def _recall(self, match: PrefixMatch | None, rows: dict[str, list[int]]) -> None:
        """Copy the match's host-tier pages into the device pages just allocated for them."""
        if match is None or self.host is None:
            return
        for g, host_pages in match.recall_pages.items():
            start = len(match.reused_pages[g])
            pairs = [(h, rows[g][start + j]) for j, h in enumerate(host_pages) if h != NULL_PAGE]
            self.host.recall(g, [h for h, _ in pairs], [d for _, d in pairs])

    def _write_through(self, req: _Request, tokens: list[int], first: int) -> None:
        """Copy the whole pages the tree just took from ``req`` (from page ``first`` on) to
        the host tier. Only those: the request's other pages are freed at once, and a copy
        may still be reading when they are written again."""
        keys = chain_hashes(tuple(tokens), self.page)[first:]
        self.host.store(keys, {g: req.rows[g][first : first + len(keys)] for g in self.cached_groups})

    def _to_host(self, node: TreeNode) -> None:
        """Radix eviction hook: keep the node's pages of every group on the host tier."""
        keys = chain_hashes(RadixCache.prefix_of(node), self.page)[-node.num_pages() :]
        self.host.store(keys, node.pages)

    def _copy_partial_pages(self, match: PrefixMatch | None, rows: dict[str, list[int]]) -> None:
        if match is None:
            return
        full = match.num_tokens // self.page
        for g, src in match.cow_pages.items():
            dst = rows[g][full]
            if self.pools:
                self.pools[g][dst].copy_(self.pools[g][src])

    def _count_match(self, match: PrefixMatch, num_tokens: int) -> None:
        for g, stats in self.stats.items():
            hit = match.num_tokens if match.compute_start[g] == match.num_tokens else 0
            recalled = self.page * len(match.recall_pages.get(g, [])) if hit else 0
            stats.record(
                query_tokens=num_tokens,
                hit_tokens=hit,
                recomputed_tokens=match.num_tokens - match.compute_start[g],
                recalled_tokens=recalled,
            )

    def _extension(self, req: _Request, num_tokens: int) -> dict[str, int]:
        extent = self._extent(num_tokens)
        return {g: max(0, extent - len(row)) for g, row in req.rows.items()}

    def _available(self, group: str) -> int:
        evictable = self.tree.evictable.get(group, 0) if self.tree else 0
        return self.allocators[group].num_free + evictable

    def _path_evictable(self, node: TreeNode | None) -> dict[str, int]:
        """Pages of unlocked nodes on the path to ``node``: locking it makes them unevictable."""
        out: dict[str, int] = {}
        while node is not None and node.lock_ref == 0:
            for g, n in node.num_held().items():
                out[g] = out.get(g, 0) + n
            node = node.parent
        return out

    def _make_room(self, needs: dict[str, int]) -> None:
        short = {
            g: n - self.allocators[g].num_free for g, n in needs.items() if n > self.allocators[g].num_free
        }
        if short and self.tree is not None:
            self.tree.evict(short)
            if self.host is not None:
                self.host.fence()  # the freed pages are written next
        for g, n in needs.items():
            if not self.allocators[g].can_allocate(n):
                raise RuntimeError(
                    f"group {g}: {n} pages needed, "
                    f"{self.allocators[g].num_free} free: check can_allocate first"
                )


def _num_held(match: PrefixMatch | None, tokens_per_page: int) -> dict[str, int]:
    if match is None:
        return {}
    m = match.num_tokens
    return {g: m // tokens_per_page for g, start in match.compute_start.items() if m and start == m}


def _all_held(nulls: list[int], lo: int, hi: int) -> bool:
    """Whether entries [lo, hi) are all real pages (``nulls[i]``: NULLs among the first i)."""
    return lo >= hi or nulls[hi] == nulls[lo]


def _first_held(row: list[int]) -> int:
    """Index of the first held entry: NULL entries of a row form a leading run."""
    for i, p in enumerate(row):
        if p != NULL_PAGE:
            return i
    return len(row)
