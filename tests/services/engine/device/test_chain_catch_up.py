"""The chain's catch-up stage: exact static inputs of widened pending spans."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.device.chain_catch_up import ChainCatchUp, PendingSpans, pad_fits


def test_pad_fits():
    assert pad_fits([3, 9], [1, 4], 4)
    assert not pad_fits([2], [1], 4)  # would start before position 0
    assert not pad_fits([9], [5], 4)  # longer than the stage


def test_load_widens_spans_at_the_front():
    stage = ChainCatchUp(3, torch.zeros(4 * 3, 2), pinned=False)  # L = 3, max_batch 4
    features = torch.tensor([[1.0, 1], [2, 2], [3, 3]])  # request 0: one slot, request 1: two
    pending = PendingSpans([5, 8], [[50], [80, 81]], features)
    table = np.array([[7, 3, 9], [2, 6, 1]], dtype=np.int32)  # pages of 4 tokens
    stage.load(pending, 4)
    padded_table = torch.full((4, 3), -1, dtype=torch.int32)  # padding requests: NULL rows
    padded_table[:2] = torch.from_numpy(table)
    ids, positions, slots, seq_lens, hidden = stage.inputs(4, padded_table, 4)
    assert ids.view(4, 3).tolist() == [[0, 0, 50], [0, 80, 81], [0, 0, 0], [0, 0, 0]]
    assert positions.view(4, 3).tolist() == [[3, 4, 5], [7, 8, 9], [0, 1, 2], [0, 1, 2]]
    # request 0 writes only slot 5 (page 3, offset 1); request 1 slots 8, 9 (page 1)
    assert slots.view(4, 3).tolist() == [[-1, -1, 13], [-1, 4, 5], [-1] * 3, [-1] * 3]
    assert seq_lens.tolist() == [6, 10, 0, 0]
    assert hidden[[2, 4, 5]].tolist() == features.tolist()
    assert hidden[[0, 1, 3]].abs().sum() == 0
