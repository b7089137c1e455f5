"""Inputs of the paged-attention benchmarks: pools of scattered pages, the launch closure,
KV byte counts and the verify mask, at 32 query heads, 8 kv heads and head dim 128."""

from __future__ import annotations

import torch

from kvcore.ops import AttentionParams, PagedBatch
from kvcore.ops.slots import uniform_query_start_loc
from kvcore.ops.triton_attention import launch_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def make_pool(batch: int, length: int, page: int, dtype: torch.dtype):
    """Pool of exactly batch * length tokens and a block table of scattered pages."""
    pages_per_seq = length // page
    num_pages = batch * pages_per_seq
    pool = torch.randn((num_pages, 1, 2, KV_HEADS, page, HEAD_DIM), device="cuda", dtype=torch.bfloat16).to(
        dtype
    )
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32)
    return pool, table.view(batch, pages_per_seq)


def attention_fn(pool, table, batch, length, q_len, **launch):
    query = torch.randn((batch * q_len, Q_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    starts = uniform_query_start_loc(seq_lens, q_len)
    paged = PagedBatch(table, seq_lens, q_len, starts)
    params = AttentionParams(HEAD_DIM**-0.5)
    return lambda: launch_attention(out, query, pool[:, 0], paged, params, **launch)


def kv_bytes(batch: int, length: int, dtype: torch.dtype) -> int:
    return batch * length * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize


def verify_mask(q_len: int, length: int) -> torch.Tensor | None:
    """Bottom-right causal mask [q_len, length] (None for q_len 1)."""
    if q_len == 1:
        return None
    pos = torch.arange(length, device="cuda")
    return pos[None, :] <= (length - q_len + torch.arange(q_len, device="cuda"))[:, None]
