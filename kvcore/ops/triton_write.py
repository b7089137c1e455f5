"""Triton KV writes: one program per token stores its K and V (all kv heads of one layer)
at ``slot = page * P + offset``; slot -1 (padding, discarded write) stores nothing, so
padded CUDA-graph batches need no host-side filtering. ``launch_write_rotated_kv`` takes a
merged q/k/v instead and applies rotate-half RoPE to q and k on the way (one launch for
what would be a rotation and a write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops.batch import RotaryWrite


@triton.jit
def _write_kv_kernel(  # noqa: PLR0913 (a kernel takes its pointers, strides and constants flat)
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


@triton.jit
def _write_rotated_kernel(  # noqa: PLR0913 (a kernel takes its pointers, strides and constants flat)
    kv_ptr,
    qkv_ptr,
    q_out_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    layer_offset,
    stride_t,
    stride_h,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_page,
    stride_kv,
    stride_head,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    m = d < HALF
    src = qkv_ptr + token * stride_t + head * stride_h
    x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_ct + d, mask=m, other=0.0)
    s = tl.load(sin_ptr + token * stride_ct + d, mask=m, other=0.0)
    r1 = (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty)  # rounded as a rotated q/k tensor is
    r2 = (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty)
    if head < NUM_Q:
        dst = q_out_ptr + token * stride_qt + head * stride_qh
        tl.store(dst + d, r1, mask=m)
        tl.store(dst + HALF + d, r2, mask=m)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_Q
            v_src = qkv_ptr + token * stride_t + (NUM_Q + NUM_KV + kv_head) * stride_h
            k1, k2 = r1.to(tl.float32), r2.to(tl.float32)  # new names: r1/r2 keep their type
            v1 = tl.load(v_src + d, mask=m, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + HALF + d, mask=m, other=0.0).to(tl.float32)
            if FP8_MAX > 0:  # saturate instead of overflowing to NaN
                k1, k2 = tl.clamp(k1, -FP8_MAX, FP8_MAX), tl.clamp(k2, -FP8_MAX, FP8_MAX)
                v1, v2 = tl.clamp(v1, -FP8_MAX, FP8_MAX), tl.clamp(v2, -FP8_MAX, FP8_MAX)
            dst = (
                kv_ptr
                + layer_offset
                + (slot // PAGE) * stride_page
                + (slot % PAGE) * (2 * HALF)
                + kv_head * stride_head
            )
            out_ty = kv_ptr.dtype.element_ty
            tl.store(dst + d, k1.to(out_ty), mask=m)
            tl.store(dst + HALF + d, k2.to(out_ty), mask=m)
            tl.store(dst + stride_kv + d, v1.to(out_ty), mask=m)
            tl.store(dst + stride_kv + HALF + d, v2.to(out_ty), mask=m)


def launch_write_rotated_kv(
    kv_pool: torch.Tensor, layer: int, qkv: torch.Tensor, num_q_heads: int, write: RotaryWrite
) -> torch.Tensor:
    """qkv [num_tokens, num_q_heads + 2 * num_kv_heads, head_dim] (unit stride on
    head_dim), ``write.cos``/``write.sin`` num_tokens * head_dim float32 each (read as
    [num_tokens, head_dim]: the halves repeat, the kernel reads the first) -> rotated q
    [num_tokens, num_q_heads, head_dim]; the rotated k and v stored at
    ``write.slot_mapping``. One program per (token, q or k head)."""
    num_tokens, heads, head_dim = qkv.shape
    num_kv = (heads - num_q_heads) // 2
    q = qkv.new_empty((num_tokens, num_q_heads, head_dim))
    if num_tokens == 0:
        return q
    cos, sin = (t.reshape(num_tokens, head_dim) for t in (write.cos, write.sin))
    fp8_max = torch.finfo(kv_pool.dtype).max if kv_pool.element_size() == 1 else 0.0
    _write_rotated_kernel[(num_tokens, num_q_heads + num_kv)](
        kv_pool,
        qkv,
        q,
        cos,
        sin,
        write.slot_mapping,
        layer * kv_pool.stride(1),
        qkv.stride(0),
        qkv.stride(1),
        q.stride(0),
        q.stride(1),
        cos.stride(0),
        kv_pool.stride(0),
        kv_pool.stride(2),
        kv_pool.stride(3),
        NUM_Q=num_q_heads,
        NUM_KV=num_kv,
        HALF=head_dim // 2,
        BLOCK=triton.next_power_of_2(head_dim // 2),
        PAGE=kv_pool.shape[4],
        FP8_MAX=fp8_max,
        num_warps=1,
    )
    return q
