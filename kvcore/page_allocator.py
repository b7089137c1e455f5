"""Page ids of one layer group: a free queue plus reference counts.

Invariants: a page is in the free queue iff its reference count is 0; every holder
(a request's block-table row, a radix-tree node) owns exactly one reference.
Freed pages go to the back of the queue, so recently freed pages are reused last.
"""

from __future__ import annotations

from collections import deque


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages: must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_queue: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with one reference. The caller checked can_allocate."""
        if n > len(self.free_queue):
            raise RuntimeError(
                f"allocate({n}) with {len(self.free_queue)} free pages: call can_allocate first"
            )
        pages = [self.free_queue.popleft() for _ in range(n)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref_counts[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.ref_counts[p] += 1

    def decref(self, pages: list[int]) -> None:
        """Drop one reference of each page; pages reaching 0 return to the free queue."""
        for p in pages:
            count = self.ref_counts[p] - 1
            if count < 0:
                raise RuntimeError(f"decref of free page {p}")
            self.ref_counts[p] = count
            if count == 0:
                self.free_queue.append(p)
