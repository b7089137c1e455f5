"""Block-table conversions: token positions -> pool slots, query positions.

A slot is ``page_id * tokens_per_page + offset``; -1 marks a write to skip (a position
whose page is NULL, or past the block table's width).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvcore.ops.checks import fail
from kvcore.spec import NULL_PAGE

IntsLike = int | Sequence[int] | torch.Tensor
ArrayLike = np.ndarray | torch.Tensor


def _as_longs(x: IntsLike, batch: int, field: str, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int64, device=device).reshape(-1)
    if t.shape[0] != batch:
        fail(field, f"has {t.shape[0]} entries for batch {batch}")
    return t


def slot_mapping_for(
    block_table: torch.Tensor, start_positions: IntsLike, lengths: IntsLike, tokens_per_page: int
) -> torch.Tensor:
    """Slots of positions ``start_b .. start_b + length_b - 1`` of every row b, concatenated.

    block_table: [batch, max_pages] or one row [max_pages]. Returns [sum(lengths)] int64.
    """
    if tokens_per_page <= 0:
        fail("tokens_per_page", f"must be > 0, got {tokens_per_page}")
    table = block_table if block_table.dim() == 2 else block_table.reshape(1, -1)
    if table.dim() != 2:
        fail("block_table", f"expected [batch, max_pages], got {tuple(block_table.shape)}")
    batch, max_pages = table.shape
    starts = _as_longs(start_positions, batch, "start_positions", table.device)
    lens = _as_longs(lengths, batch, "lengths", table.device)
    if table.device.type == "cpu":  # numpy: the same arithmetic at a tenth of torch's per-op cost
        return torch.from_numpy(_host_slots(table.numpy(), starts.numpy(), lens.numpy(), tokens_per_page))
    if bool((starts < 0).any()) or bool((lens < 0).any()):
        fail("start_positions", "starts and lengths must be >= 0")
    row = torch.repeat_interleave(torch.arange(batch, device=table.device), lens)
    offsets = torch.arange(row.shape[0], device=table.device) - (torch.cumsum(lens, 0) - lens)[row]
    positions = starts[row] + offsets  # [num_tokens]
    return slots_at(table, row, positions, tokens_per_page)


def query_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Position of every query token: query i of sequence b is at ``seq_lens[b] - q_len_b + i``.
    Returns [num_tokens] int64 (num_tokens = query_start_loc[-1])."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    batch = seq_lens.shape[0]
    row = torch.repeat_interleave(torch.arange(batch, device=seq_lens.device), q_lens)
    index_in_seq = torch.arange(row.shape[0], device=seq_lens.device) - query_start_loc[row]
    return seq_lens.long()[row] - q_lens[row] + index_in_seq


def uniform_query_start_loc(seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """query_start_loc [batch + 1] int32 of a batch whose sequences all have q_len tokens."""
    batch = seq_lens.shape[0]
    return torch.arange(batch + 1, dtype=torch.int32, device=seq_lens.device) * q_len


def uniform_slots(table: np.ndarray, starts: np.ndarray, q_len: int, tokens_per_page: int) -> np.ndarray:
    """Slots [batch, q_len] int64 of positions starts[b] .. starts[b] + q_len - 1 of every
    row b of a host table [batch, max_pages] (-1: a NULL page or past the table): what
    slot_mapping_for gives spans of one length, in a fixed handful of numpy calls."""
    if (starts < 0).any() or q_len < 0:
        fail("start_positions", "starts and lengths must be >= 0")
    positions = starts[:, None] + np.arange(q_len)  # [batch, q_len]
    return slots_at(table, np.arange(table.shape[0])[:, None], positions, tokens_per_page)


def _host_slots(table: np.ndarray, starts: np.ndarray, lens: np.ndarray, tokens_per_page: int) -> np.ndarray:
    """slot_mapping_for over host arrays: table [batch, max_pages], starts and lens [batch]."""
    if (starts < 0).any() or (lens < 0).any():
        fail("start_positions", "starts and lengths must be >= 0")
    if lens.shape[0] and (lens == lens[0]).all():
        return uniform_slots(table, starts, int(lens[0]), tokens_per_page).reshape(-1)
    row = np.repeat(np.arange(table.shape[0]), lens)
    positions = starts[row] + np.arange(row.shape[0]) - (np.cumsum(lens) - lens)[row]  # [num_tokens]
    return slots_at(table, row, positions, tokens_per_page)


def slots_at(table: ArrayLike, rows: ArrayLike, positions: ArrayLike, tokens_per_page: int) -> ArrayLike:
    """The slot of each position in its row of ``table`` [batch, width] (``rows`` broadcasts
    against ``positions``), -1 on a NULL page or past the width. numpy arrays or tensors
    alike; on tensors nothing is read back, so a CUDA graph can hold it."""
    width = table.shape[1]
    if width == 0:
        return positions * 0 - 1
    page_index = positions // tokens_per_page
    page_ids = table[rows, page_index.clip(max=width - 1)]
    held = (page_index < width) & (page_ids != NULL_PAGE)
    return held * (page_ids * tokens_per_page + positions % tokens_per_page + 1) - 1
