"""PageStore: who holds which page ids, per layer group.

One :class:`PageAllocator` per group, the radix prefix cache over the cached groups (all
but the SEPARATE layout's draft), and the host tier under it. The manager decides what a
request's rows hold; the store hands out, pins and takes back the pages.

Invariants:
- a page is held by request rows and tree nodes only, one reference per holder;
- ``available(g)`` is what :meth:`make_room` can reach: free pages plus the pages of
  unlocked tree nodes;
- a page freed by eviction is written again only after the copies out to the host tier
  that read it (:meth:`HostCache.fence`).
"""

from __future__ import annotations

from kvcore.capacity import split_capacity
from kvcore.host_cache import HostCache, chain_hashes
from kvcore.page_allocator import PageAllocator
from kvcore.pools import KVPools
from kvcore.radix import RadixCache, TreeNode
from kvcore.spec import NULL_PAGE, CacheConfig, KVLayout, Lifecycle
from kvcore.stats import GroupUsage


class PageStore:
    def __init__(self, config: CacheConfig, pools: KVPools) -> None:
        self.config, self.page = config, config.tokens_per_page
        self.allocators = {
            g.name: PageAllocator(n) for g, n in zip(config.groups, split_capacity(config), strict=True)
        }
        separate = config.layout == KVLayout.SEPARATE
        self.cached_groups = [
            g.name for g in config.groups if not (separate and g.lifecycle == Lifecycle.OPTIONAL)
        ]
        self.host = None
        if config.host_num_pages and config.enable_prefix_cache and pools.has_tensors:
            self.host = HostCache(pools, self.cached_groups, config.host_num_pages, self.page)
        self.tree = None
        if config.enable_prefix_cache:
            optional = frozenset(g.name for g in config.groups if g.lifecycle == Lifecycle.OPTIONAL)
            self.tree = RadixCache(
                {g: self.allocators[g] for g in self.cached_groups},
                self.page,
                on_evict=self._to_host if self.host else None,
                optional=optional & frozenset(self.cached_groups),
            )

    # ------------------------------------------------------------ capacity

    def available(self, group: str) -> int:
        """Pages ``make_room`` can give: free, or held only by unlocked tree nodes."""
        evictable = self.tree.evictable.get(group, 0) if self.tree else 0
        return self.allocators[group].num_free + evictable

    def path_evictable(self, node: TreeNode | None) -> dict[str, int]:
        """Pages of unlocked nodes on the path to ``node``: locking it makes them unevictable."""
        out: dict[str, int] = {}
        while node is not None and node.lock_ref == 0:
            for g, n in node.num_held().items():
                out[g] = out.get(g, 0) + n
            node = node.parent
        return out

    def make_room(self, needs: dict[str, int]) -> None:
        """Evict until every group has ``needs[g]`` free pages (the caller checked)."""
        free = {g: self.allocators[g].num_free for g in needs}
        short = {g: n - free[g] for g, n in needs.items() if n > free[g]}
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

    def fill(self, rows: dict[str, list[int | None]]) -> None:
        """Put a new page at every None entry of ``rows``, evicting to make room."""
        needs = {g: row.count(None) for g, row in rows.items()}
        self.make_room(needs)
        for g, row in rows.items():
            fresh = iter(self.allocators[g].allocate(needs[g]))
            row[:] = [next(fresh) if p is None else p for p in row]

    def grow(self, group: str, n: int) -> list[int]:
        """``n`` new pages of ``group`` (room made by the caller)."""
        return self.allocators[group].allocate(n)

    # ------------------------------------------------------------ holding

    def hold(self, rows: dict[str, list[int | None]], node: TreeNode | None) -> None:
        """Take a reference of every real page in ``rows``, and lock ``node``'s path."""
        if node is not None:
            self.tree.lock(node)
        for g, row in rows.items():
            self.allocators[g].incref([p for p in row if p is not None and p != NULL_PAGE])

    def pin(self, pages: dict[str, int]) -> None:
        for g, p in pages.items():
            self.allocators[g].incref([p])

    def unpin(self, pages: dict[str, int]) -> None:
        for g, p in pages.items():
            self.allocators[g].decref([p])

    def release(self, rows: dict[str, list[int]], first_held: dict[str, int], node: TreeNode | None) -> None:
        """Drop a request's references (tail pages return to the free queue last) and unlock."""
        for g, row in rows.items():
            self.allocators[g].decref(row[first_held[g] :][::-1])
        if node is not None:
            self.tree.unlock(node)

    def cache(self, tokens: list[int], rows: dict[str, list[int]]) -> None:
        """Offer the whole pages of ``tokens`` (positions [0, len)) to the prefix cache,
        and with the "through" policy copy the ones it took to the host tier."""
        if self.tree is None:
            return
        known = self.tree.insert(tokens, {g: rows[g] for g in self.cached_groups})
        if self.host is not None and self.config.host_write_policy == "through":
            first = known // self.page
            keys = chain_hashes(tuple(tokens), self.page)[first:]
            self.host.store(keys, {g: rows[g][first : first + len(keys)] for g in self.cached_groups})

    # ------------------------------------------------------------ host tier

    def host_hits(self, tokens: list[int], device_tokens: int) -> list[dict[str, int]]:
        """Host entries continuing a device match of ``device_tokens`` tokens, page by
        page; none when fewer than ``host_recall_min_pages``."""
        if self.host is None:
            return []
        keys = chain_hashes(tuple(tokens), self.page)
        hits = self.host.lookup(keys[device_tokens // self.page :])
        return hits if len(hits) >= self.config.host_recall_min_pages else []

    def recall(self, group: str, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (NULL host entries skipped)."""
        pairs = [(h, d) for h, d in zip(host_pages, device_pages, strict=True) if h != NULL_PAGE]
        self.host.recall(group, [h for h, _ in pairs], [d for _, d in pairs])

    def _to_host(self, node: TreeNode) -> None:
        """Radix eviction hook: keep the node's pages of every group on the host tier."""
        keys = chain_hashes(RadixCache.prefix_of(node), self.page)[-node.num_pages() :]
        self.host.store(keys, node.pages)

    # ------------------------------------------------------------ views

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

    def reset(self) -> None:
        """Evict everything unlocked from the prefix cache, host tier included."""
        if self.tree is not None:
            hook, self.tree.on_evict = self.tree.on_evict, None
            self.tree.evict({g: self.allocators[g].num_pages for g in self.cached_groups})
            self.tree.on_evict = hook
            if self.host is not None:
                self.host.fence()
        if self.host is not None:
            self.host.clear()
