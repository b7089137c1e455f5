"""KVCacheManager: the one facade the services and the engine see.

Per request it keeps one block-table row per layer group. A row's length is the request's
*extent* in pages (context + headroom); entries below a windowed group's stale boundary
are ``NULL_PAGE``, so the count of valid entries is not the extent. The parts, each with
its invariants: ``page_store.py`` (page ids, radix tree, host tier), ``prefix_match.py``
(what a prompt reuses), ``group_rows.py`` (rules per kind of group) and ``pools.py`` (the
KV tensors, injected, logging their writes for the other ranks).

- a match ending inside a page copies that page into a private page for every group that
  reuses it (copy-on-write), so shared pages are never written;
- the target may be several REQUIRED groups (one per window of a per-layer mix): each
  keeps its own rows and window, they decide the match together, and a transfer moves
  the pages of each;
- with ``KVLayout.SEPARATE`` the draft group is neither cached nor transferred.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.group_rows import FullAttentionRows, rows_for
from kvcore.page_store import PageStore
from kvcore.pools import KVPools
from kvcore.prefix_match import PrefixMatch, PrefixMatcher
from kvcore.request_rows import RequestRows, padded_table
from kvcore.reservation import Reservation, TransferPages
from kvcore.spec import NULL_PAGE, CacheConfig, LayerGroupSpec, Owner, cdiv
from kvcore.stats import CacheStats, GroupStats, GroupUsage


class KVCacheManager:
    def __init__(self, config: CacheConfig, pools: KVPools | None = None) -> None:
        """``pools``: the KV tensors this manager's pages index (shared with the model
        runner and the transfer agent); None = zeroed CPU pools of ``config``."""
        self.config = config
        self.tokens_per_page = config.tokens_per_page
        self.groups: dict[str, LayerGroupSpec] = {g.name: g for g in config.groups}
        self._pools = pools if pools is not None else KVPools.allocate(config)
        self._store = PageStore(config, self._pools)
        fed = any(g.owner == Owner.DRAFT for g in config.groups)  # the target feeds a drafter
        self._rows: dict[str, FullAttentionRows] = {
            g.name: rows_for(
                g, self.tokens_per_page, g.name in self._store.cached_groups, fed and g.owner == Owner.TARGET
            )
            for g in config.groups
        }
        self._windowed = [
            (g, rows, self._store.allocators[g]) for g, rows in self._rows.items() if rows.spec.window > 0
        ]
        self._matcher = PrefixMatcher(self._store, self._rows)
        self._stats = {g: GroupStats() for g in self.groups}
        self._requests: dict[str, RequestRows] = {}

    # ------------------------------------------------------------ prefix reuse

    def match_prefix(self, token_ids: list[int], whole_pages: bool = False) -> PrefixMatch:
        """Reusable prefix of a prompt, leaving at least its last token to compute (see
        ``kvcore/prefix_match.py`` for the rules); ``whole_pages``: no partial page."""
        return self._matcher.match(token_ids, whole_pages)

    # ------------------------------------------------------------ allocate / free

    def can_allocate(self, num_tokens: int, match: PrefixMatch | None = None, num_computed: int = 0) -> bool:
        """Whether ``allocate`` with the same arguments would find its pages."""
        rows = self._initial_rows(num_tokens, match, num_computed)
        locked = self._store.path_evictable(match.node if match else None)
        cow = match.cow_pages if match else {}
        return all(
            row.count(None) + (g in cow) <= self._store.available(g) - locked.get(g, 0)
            for g, row in rows.items()
        )

    def allocate(
        self, request_id: str, num_tokens: int, match: PrefixMatch | None = None, num_computed: int = 0
    ) -> None:
        """Give a new request pages for positions [0, num_tokens + headroom), taking the
        matched prefix. ``num_computed`` > 0 reserves pages whose KV arrives by transfer:
        windowed groups then skip pages already out of the window."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already allocated")
        rows = self._initial_rows(num_tokens, match, num_computed)
        node = match.node if match and match.node is not None else None
        cow = match.cow_pages if match else {}
        self._store.hold(rows, node)
        self._store.pin(cow)  # copy sources: making room may evict their node
        self._store.fill(rows)
        if match:
            self._recall(match, rows)
            self._copy_partial_pages(match, rows)
        self._store.unpin(cow)
        if match:
            match.count(self._stats, num_tokens, self.tokens_per_page)
        held = match.num_held(self.tokens_per_page) if match else {}
        self._requests[request_id] = RequestRows.new(rows, num_computed, node, held)

    def reserve_for_transfer(
        self, request_id: str, prompt_len: int, token_ids: Sequence[int] = ()
    ) -> Reservation | None:
        """Pages for a request whose prompt KV (``prompt_len`` positions) arrives by
        transfer: ``allocate`` with ``num_computed=prompt_len``; None when they do not fit.

        - with ``token_ids`` (the prompt), the whole pages the prefix cache or host tier
          holds of it are reused and named held (no partial page: the transfer rewrites
          every page after them); without a match when the match's locked path leaves too
          few pages;
        - groups a transfer does not move (the SEPARATE layout's draft) get zeroed pages,
          not a previous request's KV, so such a drafter starts blind and deterministic.
        """
        n = prompt_len
        for match in [self.match_prefix(list(token_ids), whole_pages=True)] if token_ids else []:
            if self.can_allocate(n, match, num_computed=n):
                break
        else:
            match = None
            if not self.can_allocate(n, num_computed=n):
                return None
        self.allocate(request_id, n, match, num_computed=n)
        rows = self._requests[request_id].rows
        for g, rules in self._rows.items():
            if not rules.travels:
                self._pools.zero_pages(g, [p for p in rows[g] if p != NULL_PAGE])
        held = self.held_pages(request_id)
        tables = {g: list(row) for g, row in rows.items()}
        num_held = {g: held.get(g, 0) for g in rows}
        return Reservation(request_id, n, n + self.config.headroom_tokens, tables, num_held)

    def can_extend(self, request_id: str, num_tokens: int) -> bool:
        needs = self._extension(self._request(request_id), num_tokens)
        return all(needs[g] <= self._store.available(g) for g in needs)

    def extend(self, request_id: str, num_tokens: int) -> None:
        """Grow the extent to cover positions [0, num_tokens + headroom)."""
        req = self._request(request_id)
        needs = self._extension(req, num_tokens)
        self._store.make_room(needs)
        for g, n in needs.items():
            req.rows[g].extend(self._store.grow(g, n))

    def advance(self, request_id: str, num_computed: int) -> None:
        """Record that positions [0, num_computed) hold valid KV; release windowed pages no
        later query can read: pages [0, (n - W + 1) // P) for window W, where a target
        feeding another group counts W + 1 (a match at n re-runs it from n - 1). Rolling
        back speculative positions needs no call: they are overwritten by later writes."""
        self.advance_batch([request_id], [num_computed])

    def can_extend_batch(self, request_ids: list[str], num_tokens: list[int]) -> bool:
        """Whether ``extend_batch`` finds pages for every request at once."""
        new = sum(self._growth(request_ids, num_tokens).values())
        return all(new <= self._store.available(g) for g in self.groups)

    def extend_batch(self, request_ids: list[str], num_tokens: list[int]) -> None:
        """``extend`` for a whole batch, allocating every group's new pages in one call."""
        growth = self._growth(request_ids, num_tokens)
        if not growth:
            return
        total = sum(growth.values())
        self._store.make_room({g: total for g in self.groups})
        for g in self.groups:
            fresh, i = self._store.grow(g, total), 0
            for rid, k in growth.items():
                self._requests[rid].rows[g].extend(fresh[i : i + k])
                i += k

    def advance_batch(self, request_ids: list[str], num_computed: list[int]) -> None:
        """``advance`` for a whole batch (one loop: this runs every decode step)."""
        requests, windowed = self._requests, self._windowed
        for rid, n in zip(request_ids, num_computed, strict=True):
            req = requests.get(rid) or self._request(rid)
            req.num_computed = n
            for g, rules, pages in windowed:
                req.first_held[g] = rules.release_stale(req.rows[g], req.first_held[g], n, pages)

    def free(self, request_id: str, token_ids: list[int] | None = None) -> None:
        """End a request. With ``token_ids`` (the tokens at positions [0, num_computed)),
        its whole pages are offered to the prefix cache first."""
        req = self._request(request_id)
        if token_ids is not None:
            self._store.cache(token_ids[: min(len(token_ids), req.num_computed)], req.rows)
        self._store.release(req.rows, req.first_held, req.node)
        del self._requests[request_id]

    def reset_prefix_cache(self) -> None:
        """Evict everything unlocked from the prefix cache, host tier included."""
        self._store.reset()

    def reset_stats(self) -> None:
        """The prefix-cache counters back to zero (after work that is not traffic)."""
        self._stats = {g: GroupStats() for g in self.groups}

    # ------------------------------------------------------------ views

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds pages (allocated and not yet freed)."""
        return request_id in self._requests

    def num_pages(self, group: str) -> int:
        """Pages of ``group``'s pool."""
        return self._store.allocators[group].num_pages

    def block_table(self, request_id: str, group: str) -> list[int]:
        return list(self._request(request_id).rows[group])

    def block_tables(
        self, request_ids: list[str], group: str, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """[batch, max_extent] int32, padded with NULL_PAGE."""
        return padded_table([self._request(r).table_row(group) for r in request_ids], device)

    def held_pages(self, request_id: str) -> dict[str, int]:
        """Per group, leading block-table entries whose KV the request had at ``allocate``:
        a transfer into the request need not move them.

        - they were reused from the prefix cache or recalled from the host tier (entries
          out of the window are NULL); whole pages only;
        - the target's entry is ``match.num_tokens // P``; a draft group's is the same
          where its window was complete, and absent where it must be recomputed.
        """
        return dict(self._request(request_id).num_held)

    def transfer_pages(
        self, request_id: str, num_tokens: int, held: dict[str, int] | None = None
    ) -> dict[str, TransferPages]:
        """Pages holding positions [0, num_tokens) that a disaggregated transfer moves, per group.

        - windowed groups only inside the window; separate draft groups not at all;
        - none of the receiver's ``held`` leading entries (its :meth:`held_pages`);
        - sender and receiver compute the same indices from the same ``num_tokens`` and ``held``.
        """
        req, held = self._request(request_id), held or {}
        out = {}
        for g, row in req.rows.items():
            rules = self._rows[g]
            if rules.travels:
                first, end = rules.transfer_range(num_tokens, held.get(g, 0))
                out[g] = TransferPages(first, row[first:end])
        return out

    def usage(self) -> dict[str, GroupUsage]:
        return self._store.usage()

    def stats(self) -> CacheStats:
        """A snapshot of the prefix-cache counters and the page usage, per group."""
        return CacheStats({g: s.copy() for g, s in self._stats.items()}, self.usage())

    def num_request_pages(self, request_id: str) -> dict[str, int]:
        """Valid (held) entries per group; compare with len(block_table) for the extent."""
        return self._request(request_id).num_valid()

    # ------------------------------------------------------------ internals

    def _request(self, request_id: str) -> RequestRows:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id {request_id!r} is not allocated")
        return req

    def _extent(self, num_tokens: int) -> int:
        return cdiv(num_tokens + self.config.headroom_tokens, self.tokens_per_page)

    def _initial_rows(
        self, num_tokens: int, match: PrefixMatch | None, num_computed: int
    ) -> dict[str, list[int | None]]:
        """Rows with reused pages filled, NULL where nothing is held, None where a new page goes."""
        extent, rows = self._extent(num_tokens), {}
        for g, rules in self._rows.items():
            reused: list[int | None] = list(match.reused_pages.get(g, [])) if match else []
            recalled = match.recall_pages.get(g, []) if match else []
            reused += [NULL_PAGE if h == NULL_PAGE else None for h in recalled]  # recalled: new pages
            start = match.compute_start[g] if match else 0
            rows[g] = rules.initial_row(reused, start, num_computed, extent)
        return rows

    def _recall(self, match: PrefixMatch, rows: dict[str, list[int]]) -> None:
        """Copy the match's host-tier pages into the device pages just allocated for them."""
        if self._store.host is None:
            return
        for g, host_pages in match.recall_pages.items():
            start = len(match.reused_pages[g])
            self._store.recall(g, host_pages, rows[g][start : start + len(host_pages)])

    def _copy_partial_pages(self, match: PrefixMatch, rows: dict[str, list[int]]) -> None:
        """Copy-on-write: the partial page's source into the request's private page."""
        full = match.num_tokens // self.tokens_per_page
        for g, src in match.cow_pages.items():
            self._pools.copy_pages(g, [src], [rows[g][full]])

    def _growth(self, request_ids: list[str], num_tokens: list[int]) -> dict[str, int]:
        """New pages per request (same for every group: all rows share the extent)."""
        out, page, head = {}, self.tokens_per_page, self.config.headroom_tokens
        target, requests = self.config.groups[0].name, self._requests
        for rid, n in zip(request_ids, num_tokens, strict=True):
            k = (n + head + page - 1) // page - len((requests.get(rid) or self._request(rid)).rows[target])
            if k > 0:
                out[rid] = k
        return out

    def _extension(self, req: RequestRows, num_tokens: int) -> dict[str, int]:
        extent = self._extent(num_tokens)
        return {g: max(0, extent - len(row)) for g, row in req.rows.items()}
