"""GPU paged-KV ops: the reference's functions, same names and arguments, on Triton kernels.

Importing this module fails without Triton; kvcore.ops then keeps the reference (and
builds decode and verify on whichever paged_attention runs). No op here reads the device
back: the launch shape comes from the batch's host ``max_q_len``, so every op can be
captured in a CUDA graph. A uniform batch (decode, verify) has no start table: the kernel
derives each sequence's query rows from its static q_len.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcore.ops.batch import AttentionParams, PagedBatch, RotaryWrite
from kvcore.ops.checks import (
    check_attention,
    check_page_ids,
    check_pool,
    check_unpack,
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
    kv_pool: torch.Tensor, layer: int, qkv: torch.Tensor, num_q_heads: int, write: RotaryWrite
) -> torch.Tensor:
    check_write_rotated(kv_pool, layer, qkv, num_q_heads, write)
    _require_contiguous_pool(kv_pool)
    return launch_write_rotated_kv(kv_pool, layer, _unit_last_stride(qkv), num_q_heads, write)


def paged_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    check_attention(query, kv_pool, layer, batch)
    _require_contiguous_pool(kv_pool)
    if batch.block_table.stride(-1) != 1:
        batch = replace(batch, block_table=batch.block_table.contiguous())
    query = _unit_last_stride(query)
    out = torch.empty_like(query)
    return launch_attention(out, query, kv_pool[:, layer], batch, params)


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
    check_unpack(kv_pool, page_ids, packed, heads)
    _require_contiguous_pool(kv_pool)
    launch_unpack(kv_pool, page_ids, packed.contiguous(), heads)


def copy_pages(kv_pool: torch.Tensor, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
    """Two launches (gather, then scatter), so every source is read before any write."""
    check_page_ids(kv_pool, dst_page_ids, "dst_page_ids")
    if src_page_ids.shape != dst_page_ids.shape:
        fail("dst_page_ids", f"has {dst_page_ids.shape[0]} ids for {src_page_ids.shape[0]} sources")
    unpack_pages(kv_pool, dst_page_ids, pack_pages(kv_pool, src_page_ids))
