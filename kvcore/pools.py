"""KVPools: the device page pools of every layer group, and the writes made outside a forward.

One tensor per group (its pages, in its own dtype):

    pool: [num_pages, num_layers, 2 (K/V), num_kv_heads, tokens_per_page, head_dim]

Forwards write pools through their slot mappings; everything else that writes a page goes
through :meth:`KVPools.copy_pages` or :meth:`KVPools.zero_pages`: a partial prefix page
copied on write, the SEPARATE layout's draft pages blanked for a transfer. With
``record=True`` (rank 0 of a tensor-parallel group) those writes are also logged as
:class:`PoolWrite` values, in order, for the other ranks to replay on their own pools
(:meth:`take_writes`, :meth:`apply`) before the next forward reads them. Page ids are the
same on every rank; only the heads differ.

A KVPools built with ``tensors=False`` holds no memory: its writes do nothing (and are
still logged), for the bookkeeping alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.capacity import split_capacity
from kvcore.spec import CacheConfig


@dataclass(frozen=True, slots=True)
class PoolWrite:
    """One write into a pool outside a forward: pages ``dst`` of ``group`` take a copy of
    pages ``src`` (same order), or zeros when ``src`` is None."""

    group: str
    dst: tuple[int, ...]
    src: tuple[int, ...] | None = None


class KVPools:
    def __init__(self, tensors: dict[str, torch.Tensor], record: bool = False) -> None:
        """``tensors``: group -> pool (may be empty: no memory). ``record``: log every write
        for :meth:`take_writes`."""
        self._tensors = tensors
        self._record = record
        self._writes: list[PoolWrite] = []

    @classmethod
    def allocate(
        cls,
        config: CacheConfig,
        device: str | torch.device = "cpu",
        record: bool = False,
        tensors: bool = True,
    ) -> KVPools:
        """Zeroed pools of ``config``'s groups, sized by :func:`split_capacity`."""
        if not tensors:
            return cls({}, record)
        p = config.tokens_per_page
        sizes = split_capacity(config)
        return cls(
            {
                g.name: torch.zeros((n, *g.page_shape(p)), dtype=g.torch_dtype, device=device)
                for g, n in zip(config.groups, sizes, strict=True)
            },
            record,
        )

    @property
    def has_tensors(self) -> bool:
        return bool(self._tensors)

    def tensor(self, group: str) -> torch.Tensor:
        """The pool of ``group``: [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]."""
        return self._tensors[group]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every group's pool (a new dict; the tensors are the pools themselves)."""
        return dict(self._tensors)

    def copy_pages(self, group: str, src: Sequence[int], dst: Sequence[int]) -> None:
        """Pages ``dst`` of ``group`` take the contents of pages ``src`` (same order)."""
        if len(src) != len(dst):
            raise ValueError(f"src: {len(src)} pages for {len(dst)} destination pages")
        if not dst:
            return
        if self._tensors:
            pool = self._tensors[group]
            for s, d in zip(src, dst, strict=True):
                pool[d].copy_(pool[s])
        self._log(PoolWrite(group, tuple(dst), tuple(src)))

    def zero_pages(self, group: str, pages: Sequence[int]) -> None:
        """Pages ``pages`` of ``group`` hold zeros."""
        if not pages:
            return
        if self._tensors:
            self._tensors[group][list(pages)] = 0
        self._log(PoolWrite(group, tuple(pages)))

    def take_writes(self) -> list[PoolWrite]:
        """The writes logged since the last call, oldest first (empty unless ``record``)."""
        writes, self._writes = self._writes, []
        return writes

    def apply(self, writes: Sequence[PoolWrite]) -> None:
        """Replay another rank's writes on these pools, in order."""
        for w in writes:
            if w.src is None:
                self.zero_pages(w.group, w.dst)
            else:
                self.copy_pages(w.group, w.src, w.dst)

    def _log(self, write: PoolWrite) -> None:
        if self._record:
            self._writes.append(write)
