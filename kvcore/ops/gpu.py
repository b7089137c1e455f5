"""GPU paged-KV ops: the reference's functions, same names and arguments, on Triton kernels.

Importing this module fails without Triton; kvcore.ops then keeps the reference.
decode_attention and verify_attention never synchronize with the host (their query
length is static, and the kernel derives each sequence's query rows from it: no start
table is built), so they can be captured in a CUDA graph; paged_attention reads the
longest query length back once per call.
"""

from __future__ import annotations

import torch

from kvcore.ops.checks import (
    check_attention,
    check_packed,
    check_page_ids,
    check_pool,
    check_write,
    check_write_rotated,
    fail,
)
from kvcore.ops.triton_attention import launch_attention
from kvcore.ops.triton_pages import launch_pack, launch_unpack
from kvcore.ops.triton_write import launch_write_kv, launch_write_rotated_kv


def _require_contiguous_pool(kv_pool: torch.Tensor) -> None:
    if not kv_pool.is_contiguous():
        fail("kv_pool", "must be contiguous")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(
    kv_pool: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_write(kv_pool, layer, key, value, slot_mapping)
    _require_contiguous_pool(kv_pool)
    launch_write_kv(kv_pool, layer, _unit_last_stride(key), _unit_last_stride(value), slot_mapping)


def write_rotated_kv(
    kv_pool: torch.Tensor,
    layer: int,
    qkv: torch.Tensor,
    num_q_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    check_write_rotated(kv_pool, layer, qkv, num_q_heads, cos, sin, slot_mapping)
    _require_contiguous_pool(kv_pool)
    n, head_dim = qkv.shape[0], qkv.shape[2]
    cos, sin = cos.reshape(n, head_dim), sin.reshape(n, head_dim)  # halves repeat: read the first
    qkv = _unit_last_stride(qkv)
    return launch_write_rotated_kv(kv_pool, layer, qkv, num_q_heads, cos, sin, slot_mapping)


def _attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    max_q_len: int,
    key_start: int = 0,
) -> torch.Tensor:
    """``query_start_loc`` None: exactly ``max_q_len`` queries per sequence."""
    check_attention(query, kv_pool, layer, block_table, query_start_loc, seq_lens, window, key_start)
    if query_start_loc is None and query.shape[0] != seq_lens.shape[0] * max_q_len:
        fail("query", f"{query.shape[0]} tokens for {seq_lens.shape[0]} sequences of {max_q_len}")
    _require_contiguous_pool(kv_pool)
    query = _unit_last_stride(query)
    block_table = _unit_last_stride(block_table)
    out = torch.empty_like(query)
    return launch_attention(
        out,
        query,
        kv_pool,
        layer,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        window,
        max_q_len,
        key_start=key_start,
    )


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    key_start: int = 0,
) -> torch.Tensor:
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_q_len = int(q_lens.max()) if q_lens.numel() else 0
    return _attention(
        query, kv_pool, layer, block_table, query_start_loc, seq_lens, scale, window, max_q_len, key_start
    )


def decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    key_start: int = 0,
) -> torch.Tensor:
    return _attention(query, kv_pool, layer, block_table, None, seq_lens, scale, window, 1, key_start)


def verify_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    key_start: int = 0,
) -> torch.Tensor:
    if query.dim() != 4:
        fail("query", f"expected [batch, q_len, num_q_heads, head_dim], got {tuple(query.shape)}")
    batch, q_len = query.shape[:2]
    flat = query.reshape(batch * q_len, *query.shape[2:])
    out = _attention(flat, kv_pool, layer, block_table, None, seq_lens, scale, window, q_len, key_start)
    return out.view(query.shape)


def pack_pages(kv_pool: torch.Tensor, page_ids: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    check_pool(kv_pool)
    check_page_ids(kv_pool, page_ids, "page_ids")
    _require_contiguous_pool(kv_pool)
    num_heads = len(range(*heads.indices(kv_pool.shape[3]))) if heads else kv_pool.shape[3]
    shape = (page_ids.shape[0], kv_pool.shape[1], 2, num_heads, *kv_pool.shape[4:])
    packed = kv_pool.new_empty(shape)
    launch_pack(kv_pool, page_ids, packed, heads)
    return packed


def unpack_pages(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None = None
) -> None:
    check_pool(kv_pool)
    check_page_ids(kv_pool, page_ids, "page_ids")
    check_packed(kv_pool, page_ids, packed, heads)
    _require_contiguous_pool(kv_pool)
    if packed.device != kv_pool.device:
        fail("packed", f"on {packed.device}, kv_pool on {kv_pool.device}")
    launch_unpack(kv_pool, page_ids, packed.contiguous(), heads)


def copy_pages(kv_pool: torch.Tensor, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
    """Two launches (gather, then scatter), so every source is read before any write."""
    check_page_ids(kv_pool, dst_page_ids, "dst_page_ids")
    if src_page_ids.shape != dst_page_ids.shape:
        fail("dst_page_ids", f"has {dst_page_ids.shape[0]} ids for {src_page_ids.shape[0]} sources")
    unpack_pages(kv_pool, dst_page_ids, pack_pages(kv_pool, src_page_ids))
