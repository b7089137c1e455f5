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
    request owns one reference of every other entry's page."""

    rows: dict[str, list[int]]  # per group, one entry per page of the extent
    num_computed: int = 0  # positions [0, num_computed) hold valid KV
    node: TreeNode | None = None  # the prefix-cache node it reused, locked while it runs
    first_held: dict[str, int] = field(default_factory=dict)  # per group: entries below are NULL
    num_held: dict[str, int] = field(default_factory=dict)  # per group: entries valid at allocate

    @classmethod
    def new(
        cls, rows: dict[str, list[int]], num_computed: int, node: TreeNode | None, num_held: dict[str, int]
    ) -> RequestRows:
        first = {
            g: next((i for i, p in enumerate(row) if p != NULL_PAGE), len(row)) for g, row in rows.items()
        }
        return cls(rows, num_computed, node, first, num_held)

    def num_valid(self) -> dict[str, int]:
        """Held entries per group."""
        return {g: sum(p != NULL_PAGE for p in row) for g, row in self.rows.items()}


def padded_table(rows: list[list[int]], device: str | torch.device) -> torch.Tensor:
    """[len(rows), longest row] int32, padded with NULL_PAGE."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), NULL_PAGE, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out).to(device)
