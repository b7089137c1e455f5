"""One request's block-table rows inside the manager, and the padded table of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvcore.radix import TreeNode
from kvcore.spec import NULL_PAGE


@dataclass(slots=True)
class RequestRows:
    """Invariants: NULL entries of a row form a leading run, ending at ``first_held``; the
    request owns one reference of every other entry's page. Once made, a row changes only
    by growing at its end (``extend``) and by its NULL run growing (``release_stale``,
    which moves ``first_held``): ``table_row`` keeps an int32 copy in step by those two."""

    rows: dict[str, list[int]]  # per group, one entry per page of the extent
    num_computed: int = 0  # positions [0, num_computed) hold valid KV
    node: TreeNode | None = None  # the prefix-cache node it reused, locked while it runs
    first_held: dict[str, int] = field(default_factory=dict)  # per group: entries below are NULL
    num_held: dict[str, int] = field(default_factory=dict)  # per group: entries valid at allocate
    _copies: dict[str, RowCopy] = field(default_factory=dict)  # per group, table_row's

    @classmethod
    def new(
        cls, rows: dict[str, list[int]], num_computed: int, node: TreeNode | None, num_held: dict[str, int]
    ) -> RequestRows:
        first = {
            g: next((i for i, p in enumerate(row) if p != NULL_PAGE), len(row)) for g, row in rows.items()
        }
        return cls(rows, num_computed, node, first, num_held)

    def table_row(self, group: str) -> np.ndarray:
        """rows[group] as int32 [len(row)], without converting the whole row each call (a
        decode step reads every running request's rows: at 32K tokens, 2,048 entries
        each). A view of a copy kept across calls: read it before the row changes again."""
        copy = self._copies.get(group)
        if copy is None:
            copy = self._copies[group] = RowCopy()
        return copy.sync(self.rows[group], self.first_held.get(group, 0))

    def num_valid(self) -> dict[str, int]:
        """Held entries per group."""
        return {g: sum(p != NULL_PAGE for p in row) for g, row in self.rows.items()}


@dataclass(slots=True)
class RowCopy:
    """An int32 copy of one row: ``synced`` entries copied when NULL entries ended at
    ``first_held``; capacity grows by doubling."""

    values: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    synced: int = 0
    first_held: int = 0

    def sync(self, row: list[int], first_held: int) -> np.ndarray:
        """Bring the copy to ``row`` (grown at its end, its NULL run now ending at
        ``first_held``) and return it [len(row)]."""
        n = len(row)
        if n > len(self.values):
            grown = np.empty(max(n, 2 * len(self.values)), dtype=np.int32)
            grown[: self.synced] = self.values[: self.synced]
            self.values = grown
        if first_held > self.first_held:  # released since: NULL in the row
            self.values[self.first_held : min(first_held, self.synced)] = NULL_PAGE
        if n > self.synced:
            self.values[self.synced : n] = row[self.synced :]
        self.synced, self.first_held = n, first_held
        return self.values[:n]


def padded_table(rows: list[list[int] | np.ndarray], device: str | torch.device) -> torch.Tensor:
    """[len(rows), longest row] int32, padded with NULL_PAGE."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), NULL_PAGE, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out).to(device)
