"""The smallest argument checks, shared by kvcore.ops.batch (its values' own invariants)
and kvcore.ops.checks (how an op's arguments relate to them): a failure is a ValueError
naming the field; nothing reads tensor values."""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def fail(field: str, msg: str) -> None:
    raise ValueError(f"{field}: {msg}")


def check_index(t: torch.Tensor, field: str, rank: int, device: torch.device) -> None:
    if t.dim() != rank:
        fail(field, f"expected rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        fail(field, f"expected int32 or int64, got {t.dtype}")
    if t.device != device:
        fail(field, f"on {t.device}, expected {device}")
