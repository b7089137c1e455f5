"""HostCache: a bounded host-memory tier under the prefix cache.

Pages the radix tree evicts from device memory are copied here instead of dropped (with
the "through" write policy, as they enter the prefix cache instead; eviction then copies
nothing), keyed by the chained hash of their token prefix (page i's key covers tokens
[0, (i + 1) * P)), one entry per page holding that page of every group (NULL_PAGE where an
OPTIONAL group had none). A prefix match that ends in the device tree continues here; the manager recalls the
hits into fresh device pages.

Invariants: an entry owns one host page per non-NULL group entry; entries are evicted least
recently used first; a host page is free exactly when no entry holds it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvcore.page_allocator import PageAllocator
from kvcore.pools import KVPools
from kvcore.spec import NULL_PAGE


def chain_hashes(tokens: tuple[int, ...], tokens_per_page: int) -> list[int]:
    """Key of every whole page of ``tokens``: a hash chained over the pages before it."""
    out, h = [], 0
    for start in range(0, len(tokens) - tokens_per_page + 1, tokens_per_page):
        h = hash((h, tokens[start : start + tokens_per_page]))
        out.append(h)
    return out


@dataclass(slots=True)
class HostStats:
    """Counters of the tier, in pages and bytes, per group."""

    stored_pages: dict[str, int] = field(default_factory=dict)
    recalled_pages: dict[str, int] = field(default_factory=dict)
    bytes_to_host: int = 0
    bytes_to_device: int = 0


class HostCache:
    def __init__(self, pools: KVPools, groups: list[str], num_pages: int, tokens_per_page: int) -> None:
        """``pools``: the device pools, of which the tier keeps ``groups``, mirroring their
        page shapes. Host pools are pinned when the device pools are on CUDA. Its copies
        into device pages are not in the pools' write log: a tensor-parallel group runs
        without a host tier."""
        self.device_pools = {g: pools.tensor(g) for g in groups}
        pin = any(p.is_cuda for p in self.device_pools.values())
        device = next((p.device for p in self.device_pools.values() if p.is_cuda), None)
        self.stream = torch.cuda.Stream(device) if device is not None else None  # copies out
        self._copied: torch.cuda.Event | None = None  # the last copy out still in flight
        self.host_pools = {
            g: torch.empty((num_pages, *p.shape[1:]), dtype=p.dtype, pin_memory=pin)
            for g, p in self.device_pools.items()
        }
        self.allocators = {g: PageAllocator(num_pages) for g in groups}
        self.page = tokens_per_page
        self.entries: OrderedDict[int, dict[str, int]] = OrderedDict()
        self.stats = HostStats({g: 0 for g in groups}, {g: 0 for g in groups})

    def store(self, keys: list[int], pages: dict[str, list[int]]) -> None:
        """Copy device pages (one per key, per group) into host pages; a key held already
        is touched, and takes the groups it lacked (NULL) where free host pages allow.
        On CUDA the copies run on a side stream: call :meth:`fence` before the device pages
        are written again."""
        with self._copy_stream():
            for i, key in enumerate(keys):
                row = {g: ps[i] for g, ps in pages.items()}
                if key in self.entries:
                    self.entries.move_to_end(key)
                    self._fill(self.entries[key], row)
                    continue
                needed = {g: int(p != NULL_PAGE) for g, p in row.items()}
                if not self._make_room(needed):
                    return
                self.entries[key] = {
                    g: self._copy_out(g, p) if p != NULL_PAGE else NULL_PAGE for g, p in row.items()
                }

    def fence(self) -> None:
        """Make the current stream wait for copies out still in flight: before it writes
        device pages they read (a page freed by eviction) or reads host pages they write."""
        if self._copied is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._copied)
            self._copied = None

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """Copies out on the side stream, after the work queued so far (which may still be
        writing the pages), recording when they are done."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self._copied = self.stream.record_event()

    def lookup(self, keys: list[int]) -> list[dict[str, int]]:
        """Entries of the longest run of ``keys`` held here, in order (touched as used)."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            self.entries.move_to_end(key)
            out.append(entry)
        return out

    def recall(self, group: str, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (same order), one copy per run of pages
        consecutive on both sides: slices of the pinned pool copy asynchronously, where a
        gathered (pageable) copy would not."""
        self.fence()
        pool, host = self.device_pools[group], self.host_pools[group]
        for h, d, n in _common_runs(host_pages, device_pages):
            pool[d : d + n].copy_(host[h : h + n], non_blocking=pool.is_cuda)
        self.stats.recalled_pages[group] += len(host_pages)
        self.stats.bytes_to_device += len(host_pages) * host[0].numel() * host.element_size()

    def usage(self) -> dict[str, tuple[int, int]]:
        """(pages used, pages total) per group."""
        return {g: (a.num_used, a.num_pages) for g, a in self.allocators.items()}

    def clear(self) -> None:
        while self.entries:
            self._drop_oldest()

    def _fill(self, entry: dict[str, int], row: dict[str, int]) -> None:
        for g, p in row.items():
            if entry.get(g, NULL_PAGE) == NULL_PAGE and p != NULL_PAGE and self.allocators[g].can_allocate(1):
                entry[g] = self._copy_out(g, p)

    def _copy_out(self, group: str, device_page: int) -> int:
        (host_page,) = self.allocators[group].allocate(1)
        page = self.device_pools[group][device_page]
        self.host_pools[group][host_page].copy_(page, non_blocking=page.is_cuda)
        self.stats.stored_pages[group] += 1
        self.stats.bytes_to_host += page.numel() * page.element_size()
        return host_page

    def _make_room(self, needed: dict[str, int]) -> bool:
        while any(not self.allocators[g].can_allocate(n) for g, n in needed.items()):
            if not self.entries:
                return False
            self._drop_oldest()
        return True

    def _drop_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        for g, p in entry.items():
            if p != NULL_PAGE:
                self.allocators[g].decref([p])


def _common_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, length) of each run consecutive in both."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if runs and (h := runs[-1])[0] + h[2] == a and h[1] + h[2] == b:
            runs[-1] = (h[0], h[1], h[2] + 1)
        else:
            runs.append((a, b, 1))
    return runs
