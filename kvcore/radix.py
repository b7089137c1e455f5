"""Radix prefix cache keyed by page-sized token runs, holding pages of every layer group.

Five calls: ``match_prefix``, ``insert``, ``evict``, ``lock``, ``unlock``.

Invariants:
- every node's key is a whole number of pages (``len(key) % tokens_per_page == 0``) and
  it holds, per group, one entry per page of its key: a real page, or ``NULL_PAGE`` where
  a windowed group (the target too) had released it out of its window or an OPTIONAL
  group's page was dropped; a later insert of the same tokens fills NULL entries;
- the tree owns one reference of every page it holds (``PageAllocator.incref``);
- a node with ``lock_ref > 0`` is in use by a request, and so are all its ancestors;
  only unlocked leaves are evicted, least recently used first;
- when only OPTIONAL groups are short, their pages are dropped from unlocked nodes (least
  recently used first) before any node is evicted: the REQUIRED groups' pages stay cached;
- ``evictable[group]`` counts the real pages held by unlocked nodes, ``cached[group]`` those
  held by every node;
- nothing on a request's path walks the whole tree: eviction and drops pop the least
  recently used candidates from heaps (``radix_lru.py``), and a partial-page match looks
  only at the children that start with the same token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcore.page_allocator import PageAllocator
from kvcore.radix_lru import AccessHeap
from kvcore.spec import NULL_PAGE


@dataclass(eq=False, slots=True)
class TreeNode:
    key: tuple[int, ...]
    pages: dict[str, list[int]]  # per group, one entry per page of key
    parent: TreeNode | None = field(default=None, repr=False)
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)  # by first page
    by_first: dict[int, dict[tuple[int, ...], TreeNode]] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0

    def num_pages(self) -> int:
        return len(next(iter(self.pages.values()))) if self.pages else 0

    def num_held(self) -> dict[str, int]:
        """Real (non-NULL) pages per group."""
        return {g: len(ps) - ps.count(NULL_PAGE) for g, ps in self.pages.items()}


@dataclass(slots=True)
class RadixMatch:
    """Full pages matched, and optionally one partially matched page after them."""

    node: TreeNode  # deepest node of the full-page match (root if none)
    num_tokens: int  # full-page tokens matched
    pages: dict[str, list[int]]  # per group, the matched pages in position order
    partial_tokens: int = 0  # tokens matched inside the next page (0 < n < tokens_per_page)
    partial_pages: dict[str, int] = field(default_factory=dict)  # per group, source page


class RadixCache:
    def __init__(
        self,
        allocators: dict[str, PageAllocator],
        tokens_per_page: int,
        on_evict: Callable[[TreeNode], None] | None = None,
        optional: frozenset[str] = frozenset(),
    ) -> None:
        """``on_evict(node)`` sees each node just before its pages are released (a whole
        node: not when only ``optional`` groups' pages are dropped from it)."""
        self.allocators = allocators
        self.optional = optional
        self.on_evict = on_evict
        self.page = tokens_per_page
        self.root = TreeNode(key=(), pages={g: [] for g in allocators})
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable = {g: 0 for g in allocators}
        self.cached = {g: 0 for g in allocators}
        self._clock = 0
        self._num_nodes = 1
        count = lambda: self._num_nodes  # noqa: E731
        self._leaves: AccessHeap[TreeNode] = AccessHeap(self._is_evictable_leaf, self.nodes, count)
        self._holders: AccessHeap[TreeNode] = AccessHeap(self._holds_optional, self.nodes, count)

    # ---------------------------------------------------------------- public API

    def match_prefix(self, tokens: list[int] | tuple[int, ...]) -> RadixMatch:
        """Longest cached prefix of ``tokens``: whole pages, then a partial page.
        The node ending the full-page match is split so it ends exactly there."""
        tokens = tuple(tokens)
        node, n = self.root, 0
        pages: dict[str, list[int]] = {g: [] for g in self.allocators}
        self._touch(node)
        while n + self.page <= len(tokens):
            child = node.children.get(tokens[n : n + self.page])
            if child is None:
                break
            k = self._match_pages(child.key, tokens, n)
            if k < child.num_pages():
                child = self._split(child, k)
            for g, ps in child.pages.items():
                pages[g].extend(ps)
            node, n = child, n + len(child.key)
            self._touch(node)
        match = RadixMatch(node=node, num_tokens=n, pages=pages)
        self._match_partial(match, tokens)
        return match

    def insert(self, tokens: list[int] | tuple[int, ...], pages: dict[str, list[int]]) -> int:
        """Cache the whole pages of ``tokens``; the tree takes its own references.
        Returns the number of tokens that were already cached (pages not taken)."""
        tokens = tuple(tokens[: len(tokens) // self.page * self.page])
        node, n = self.root, 0
        self._touch(node)
        while n < len(tokens):
            child = node.children.get(tokens[n : n + self.page])
            if child is None:
                self._add_leaf(
                    node,
                    tokens[n:],
                    {g: ps[n // self.page : len(tokens) // self.page] for g, ps in pages.items()},
                )
                return n
            k = self._match_pages(child.key, tokens, n)
            if k < child.num_pages():
                child = self._split(child, k)
            self._fill_missing(child, pages, n // self.page)
            node, n = child, n + len(child.key)
            self._touch(node)
        return n

    def evict(self, needed: dict[str, int]) -> dict[str, int]:
        """Free ``needed[group]`` pages per group, or all that is evictable. When every short
        group is optional, only those groups' pages are dropped from unlocked nodes (evicting
        nodes could free no more of them); else unlocked leaves are evicted, least recently
        used first. Returns pages freed per group."""
        freed = {g: 0 for g in self.allocators}
        short = {g for g, n in needed.items() if n > 0}
        if short and short <= self.optional:
            self._drop_optional(needed, freed)
            return freed
        while any(freed[g] < needed.get(g, 0) for g in freed) and (node := self._leaves.pop()) is not None:
            if self.on_evict is not None:
                self.on_evict(node)
            for g, ps in node.pages.items():
                real = [p for p in ps if p != NULL_PAGE]
                self.allocators[g].decref(real)
                self.evictable[g] -= len(real)
                self.cached[g] -= len(real)
                freed[g] += len(real)
            parent = node.parent
            self._unlink(parent, node)
            node.parent = None  # detached: its heap entries are stale
            self._num_nodes -= 1
            if not parent.children:
                self._leaves.push(parent)  # a leaf now; a candidate unless locked or the root
        return freed

    def _drop_optional(self, needed: dict[str, int], freed: dict[str, int]) -> None:
        """Drop whole runs of optional groups' pages from unlocked nodes, least recently
        used first, until ``freed`` covers ``needed``: a group's window in a node is useful
        only whole, and later matches recompute it."""
        kept = []  # nodes that still hold pages of another optional group, pushed again after
        while short := [g for g in needed if freed[g] < needed[g]]:
            node = self._holders.pop()
            if node is None:
                break
            for g in short:
                real = [p for p in node.pages[g] if p != NULL_PAGE]
                if real:
                    self.allocators[g].decref(real)
                    node.pages[g] = [NULL_PAGE] * len(node.pages[g])
                    self.evictable[g] -= len(real)
                    self.cached[g] -= len(real)
                    freed[g] += len(real)
            if self._holds_optional(node):
                kept.append(node)
        for node in kept:
            self._holders.push(node)

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one lock per request)."""
        while node is not None:
            if node.lock_ref == 0:
                self._count_evictable(node, -1)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError("unlock of an unlocked node")
            if node.lock_ref == 0:
                self._count_evictable(node, +1)
                self._became_candidate(node)
            node = node.parent

    # ---------------------------------------------------------------- helpers

    def num_cached_pages(self) -> dict[str, int]:
        """Real pages the tree holds, per group (kept as they change: no walk)."""
        return dict(self.cached)

    @staticmethod
    def prefix_of(node: TreeNode) -> tuple[int, ...]:
        """The tokens from the root to the end of ``node``."""
        keys = []
        while node is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(t for key in reversed(keys) for t in key)

    def nodes(self) -> list[TreeNode]:
        """Every node, the root first: a walk of the whole tree (tests, heap rebuilds)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _holds_optional(self, node: TreeNode) -> bool:
        """Unlocked, in the tree, and holding a real page of an optional group."""
        if node.parent is None or node.lock_ref:
            return False
        return any(p != NULL_PAGE for g in self.optional for p in node.pages.get(g, ()))

    def _became_candidate(self, node: TreeNode) -> None:
        """``node``'s last access or lock changed: it may be a candidate of either heap."""
        if node.parent is None:
            return  # the root, or detached
        if not node.children:
            self._leaves.push(node)
        if self.optional:
            self._holders.push(node)

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        node.last_access = self._clock
        if node.lock_ref == 0:
            self._became_candidate(node)

    def _match_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Number of whole pages of ``key`` equal to ``tokens[start:]``."""
        if tokens[start : start + len(key)] == key:
            return len(key) // self.page
        k = 0
        for i in range(0, len(key), self.page):
            if key[i : i + self.page] != tokens[start + i : start + i + self.page]:
                break
            k += 1
        return k

    def _match_partial(self, match: RadixMatch, tokens: tuple[int, ...]) -> None:
        rest = tokens[match.num_tokens : match.num_tokens + self.page - 1]
        if not rest:
            return
        best, best_len = None, 0
        for child in match.node.by_first.get(rest[0], {}).values():
            n = _common_prefix_len(child.key[: self.page], rest)
            if n > best_len:
                best, best_len = child, n
        if best is not None:
            match.partial_tokens = best_len
            match.partial_pages = {g: ps[0] for g, ps in best.pages.items()}
            self._touch(best)

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split ``node`` after ``num_pages`` pages; returns the new upper node."""
        cut = num_pages * self.page
        upper = TreeNode(
            key=node.key[:cut],
            pages={g: ps[:num_pages] for g, ps in node.pages.items()},
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        self._link(node.parent, upper)  # in node's place: the same first page
        node.key = node.key[cut:]
        node.pages = {g: ps[num_pages:] for g, ps in node.pages.items()}
        node.parent = upper
        self._link(upper, node)
        self._num_nodes += 1
        return upper  # the caller touches it, which enters it in the heaps

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: dict[str, list[int]]) -> None:
        node = TreeNode(key=key, pages={g: list(ps) for g, ps in pages.items()}, parent=parent)
        for g, ps in node.pages.items():
            real = [p for p in ps if p != NULL_PAGE]
            self.allocators[g].incref(real)
            self.cached[g] += len(real)
        self._link(parent, node)
        self._num_nodes += 1
        self._touch(node)
        self._count_evictable(node, +1)

    def _link(self, parent: TreeNode, child: TreeNode) -> None:
        """Hang ``child`` under ``parent`` by its first page (replacing a node of the same)."""
        first = child.key[: self.page]
        parent.children[first] = child
        parent.by_first.setdefault(first[0], {})[first] = child

    def _unlink(self, parent: TreeNode, child: TreeNode) -> None:
        first = child.key[: self.page]
        del parent.children[first]
        same = parent.by_first[first[0]]
        del same[first]
        if not same:
            del parent.by_first[first[0]]

    def _fill_missing(self, node: TreeNode, pages: dict[str, list[int]], first: int) -> None:
        """Take pages the node lacks (NULL, any group) where the inserted sequence has them."""
        for g, held in node.pages.items():
            new = pages[g][first : first + len(held)]
            for i, p in enumerate(new):
                if held[i] == NULL_PAGE and p != NULL_PAGE:
                    held[i] = p
                    self.allocators[g].incref([p])
                    self.cached[g] += 1
                    if node.lock_ref == 0:
                        self.evictable[g] += 1

    def _count_evictable(self, node: TreeNode, sign: int) -> None:
        for g, n in node.num_held().items():
            self.evictable[g] += sign * n


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
