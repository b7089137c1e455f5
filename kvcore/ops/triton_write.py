"""Triton KV write: one program per token stores its K and V (all kv heads of one layer)
at ``slot = page * P + offset``; slot -1 (padding, discarded write) stores nothing, so
padded CUDA-graph batches need no host-side filtering."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    kv_ptr,
    key_ptr,
    value_ptr,
    slot_ptr,
    layer_offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_page,
    stride_kv,
    stride_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (
        kv_ptr
        + layer_offset
        + (slot // PAGE) * stride_page
        + (slot % PAGE) * HEAD_DIM
        + heads[:, None] * stride_head
        + dims[None, :]
    )  # [BLOCK_H, BLOCK_D]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8_MAX > 0:  # saturate instead of overflowing to NaN
        key = tl.clamp(key.to(tl.float32), -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


def launch_write_kv(
    kv_pool: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] with unit stride on head_dim."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8_max = torch.finfo(kv_pool.dtype).max if kv_pool.element_size() == 1 else 0.0
    _write_kv_kernel[(num_tokens,)](
        kv_pool,
        key,
        value,
        slot_mapping,
        layer * kv_pool.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_pool.stride(0),
        kv_pool.stride(2),
        kv_pool.stride(3),
        NUM_HEADS=num_heads,
        BLOCK_H=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=kv_pool.shape[4],
        FP8_MAX=fp8_max,
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
