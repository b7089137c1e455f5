"""The radix tree's eviction order without a walk of the tree.

A heap of ``(last_access, push number, node)`` entries. The tree pushes a node whenever it
may have become a candidate (it was touched, unlocked, or left a leaf), and the
caller's ``is_candidate`` test runs only when an entry is popped.

Invariant: every node that is a candidate now has an entry stamped with its current
``last_access``. An entry whose stamp is older than its node's ``last_access`` (a newer one
was pushed), or whose node is not a candidate now, is dropped when popped; a node that
becomes a candidate again is pushed again. So :meth:`pop` yields the current candidates
least recently used first, as sorting every node by ``last_access`` would, in O(log n) an
entry instead of O(n log n) a call. When stale entries outnumber the tree's nodes, the
heap is rebuilt from the tree, so a push costs amortized O(log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar


class Stamped(Protocol):
    """What the heap reads of a node: the clock value of its last access."""

    last_access: int


Node = TypeVar("Node", bound=Stamped)


class AccessHeap(Generic[Node]):
    """Candidates of one kind (leaves to evict, nodes holding optional pages), oldest first."""

    def __init__(
        self,
        is_candidate: Callable[[Node], bool],
        all_nodes: Callable[[], Iterable[Node]],
        num_nodes: Callable[[], int],
    ) -> None:
        """``all_nodes``: every node of the tree (for a rebuild); ``num_nodes``: how many."""
        self.is_candidate, self._all_nodes, self._num_nodes = is_candidate, all_nodes, num_nodes
        self._heap: list[tuple[int, int, Node]] = []
        self._pushed = 0

    def push(self, node: Node) -> None:
        """``node`` may be a candidate from now on, at its current ``last_access``."""
        heapq.heappush(self._heap, (node.last_access, self._pushed, node))
        self._pushed += 1
        if len(self._heap) > 2 * self._num_nodes() + 64:
            self.rebuild()

    def pop(self) -> Node | None:
        """The least recently used current candidate, taken out; None when there is none."""
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp == node.last_access and self.is_candidate(node):
                return node
        return None

    def rebuild(self) -> None:
        """One entry per current candidate, from the tree."""
        self._heap = [(n.last_access, i, n) for i, n in enumerate(self._all_nodes()) if self.is_candidate(n)]
        heapq.heapify(self._heap)
        self._pushed = len(self._heap)
