"""The routed experts of an MoE MLP as three Triton kernels over expert-sorted tokens
(:func:`reference.moe_experts` defines the function; bf16/fp16 CUDA tensors).

1. ``moe_align.align`` sorts the T * k (token, slot) pairs by expert into blocks of
   BLOCK_M rows of one expert (padded; blocks of padding alone name expert E); one token's
   k slots, of distinct experts, take a block each with no sort (ONE_TOKEN: the kernels
   make ``moe_align.one_token_blocks``'s ids in registers).
2. ``_gate_up_kernel``: program (block, n) gathers its block's token rows of x and
   multiplies them by the expert's gate rows n and up rows I + n of w13 (two float32
   accumulators), adds b13, rounds both to x's dtype as the reference's linear does, and
   applies the activation in its epilogue, rounding where the reference's bf16 ops round.
   It writes act [B * BLOCK_M, I] in sorted order (padding rows too, never read back).
3. ``_down_kernel``: program (block, n) multiplies its act rows by w2[e] rows n, adds b2,
   rounds, multiplies by the slot's routing weight (in x's dtype, rounded) and stores the
   product at row ``token * k + slot`` of slots [T * k, H]: each row is written once.
4. ``_sum_slots_kernel`` sums each token's k rows in float32 in slot order and rounds.

No float atomics: the result is deterministic run to run. Every size depends on (T, k, E)
and the tile choice alone and nothing is read back to the host, so a CUDA graph captures
it. The tile rule (``tiles_for``) is by rows per expert: a decode step's few rows stream
the touched experts' weights once (BLOCK_M 16, narrow N tiles for many programs), a
prefill's many rows run as tensor-core GEMM tiles (written for sm_90, the H100/H200).
Float32 inputs run the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.kernels import reference
from services.engine.kernels.moe_align import align
from services.engine.kernels.reference import Experts

ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """One launch's tile sizes: rows per block (``block_m``), output columns per program
    of the gate/up kernel (``block_n1``, for each of gate and up) and of the down kernel
    (``block_n2``), the reduction step ``block_k``, warps and pipeline stages."""

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


DECODE = MoeTiles(16, 32, 64, 128, 4, 4)  # few rows per expert: stream the weights
MIDDLE = MoeTiles(64, 64, 128, 64, 4, 4)
PREFILL = MoeTiles(128, 64, 128, 64, 8, 3)  # many rows per expert: tensor-core tiles


def tiles_for(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """The tile choice by mean rows per expert (T * k / E)."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return DECODE
    return MIDDLE if rows <= 128 else PREFILL


@triton.jit
def _round(v, dtype: tl.constexpr):
    """v float32 rounded to dtype and widened back: where the reference's ops round."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _slot_ids(sorted_ids_ptr, rm, block, num_slots, ONE_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The slot ids of a block's rows: sorted_ids[rm], or for one token slot ``block`` in
    row 0 and padding (num_slots) after it."""
    if ONE_TOKEN:
        return tl.where(tl.arange(0, BLOCK_M) == 0, block, num_slots)
    return tl.load(sorted_ids_ptr + rm)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    b13_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_slots,
    H,
    INTER,
    stride_xt,
    stride_we,
    stride_wn,
    stride_be,
    stride_am,
    limit,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:  # a block of padding alone
        return
    rm = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of act
    sid = _slot_ids(sorted_ids_ptr, rm, block, num_slots, ONE_TOKEN, BLOCK_M)  # [BM], num_slots: padding
    valid = sid < num_slots
    token = sid // TOP_K
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of act
    n_ok = rn < INTER
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    up_ptrs = w_base + (rn[None, :] + INTER).to(tl.int64) * stride_wn  # [1, BN]
    x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xt  # [BM, 1]
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        a = tl.load(x_ptrs + rk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(gate_ptrs + rk[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        w_up = tl.load(up_ptrs + rk[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        acc_gate = tl.dot(a, w_gate, acc_gate)
        acc_up = tl.dot(a, w_up, acc_up)
    if HAS_BIAS:
        b_base = b13_ptr + expert.to(tl.int64) * stride_be
        acc_gate += tl.load(b_base + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + INTER + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = act_ptr.dtype.element_ty
    gate = _round(acc_gate, dtype)
    up = _round(acc_up, dtype)
    if ACTIVATION == 0:  # silu(gate) * up, silu rounded as torch's bf16 silu rounds it
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype) * up
    else:  # (clamp(up) + 1) * (clamp(gate) * sigmoid(1.702 * clamp(gate)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = _round(tl.sigmoid(_round(gate * 1.702, dtype)), dtype)
        act = _round(up + 1.0, dtype) * _round(gate * sig, dtype)
    out = act_ptr + rm[:, None].to(tl.int64) * stride_am + rn[None, :]
    tl.store(out, act.to(dtype), mask=n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    b2_ptr,
    weights_ptr,
    slots_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_slots,
    H,
    INTER,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_st,
    NUM_EXPERTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    rm = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of act
    sid = _slot_ids(sorted_ids_ptr, rm, block, num_slots, ONE_TOKEN, BLOCK_M)  # [BM]
    valid = sid < num_slots
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of the output
    n_ok = rn < H
    a_ptrs = act_ptr + rm[:, None].to(tl.int64) * stride_am  # [BM, 1]
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < INTER
        a = tl.load(a_ptrs + rk[None, :], mask=k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptrs + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        b = tl.load(b2_ptr + expert.to(tl.int64) * stride_be + rn, mask=n_ok, other=0.0)
        acc += b.to(tl.float32)[None, :]
    dtype = slots_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + sid, mask=valid, other=0.0).to(tl.float32)  # [BM] in x's dtype
    product = _round(acc, dtype) * weight[:, None]
    out = slots_ptr + sid[:, None].to(tl.int64) * stride_st + rn[None, :]
    tl.store(out, product.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _sum_slots_kernel(slots_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rh < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):  # slot order, as the reference's docstring sums
        acc += tl.load(slots_ptr + (token * TOP_K + s) * H + rh, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + rh, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_experts(
    x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """x [T, H] bf16/fp16 CUDA, topk_ids [T, k], topk_weights [T, k] -> [T, H] in x's
    dtype (float32 x: the reference)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return reference.moe_experts(x, experts, topk_ids, topk_weights)
    return moe_experts_tiled(x, experts, topk_ids, topk_weights, None)


def moe_experts_tiled(
    x: torch.Tensor,
    experts: Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: MoeTiles | None,
) -> torch.Tensor:
    """:func:`moe_experts` with the tile sizes given (None: ``tiles_for``'s choice)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = experts.w13.shape
    inter = two_inter // 2
    if experts.activation not in ACTIVATIONS:
        raise ValueError(
            f"activation: {experts.activation!r} is not supported; supported: silu, clamped_swiglu"
        )
    if num_tokens == 0:
        return torch.empty_like(x)
    t = tiles or tiles_for(num_tokens, top_k, num_experts)
    x = _unit_last(x)
    w13, w2 = _unit_last(experts.w13), _unit_last(experts.w2)
    b13 = w13 if experts.b13 is None else experts.b13.contiguous()  # unused pointer when None
    b2 = w2 if experts.b2 is None else experts.b2.contiguous()
    one_token = num_tokens == 1  # k distinct experts: block b is slot b's (one_token_blocks)
    if one_token:
        block_expert = topk_ids.reshape(-1).to(torch.int32)
        sorted_ids = block_expert  # not read
    else:
        sorted_ids, block_expert = align(topk_ids, num_experts, t.block_m)
    blocks = block_expert.shape[0]
    num_slots = num_tokens * top_k
    weights = topk_weights.to(x.dtype).reshape(-1)  # [S] as the reference rounds them
    act = torch.empty((blocks * t.block_m, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, t.block_n1))](
        x,
        w13,
        b13,
        act,
        sorted_ids,
        block_expert,
        num_slots,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        b13.stride(0),
        act.stride(0),
        float(experts.limit),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HAS_BIAS=experts.b13 is not None,
        ACTIVATION=ACTIVATIONS[experts.activation],
        ONE_TOKEN=one_token,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n1,
        BLOCK_K=t.block_k,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    slots = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)  # [T * k, H]
    _down_kernel[(blocks, triton.cdiv(hidden, t.block_n2))](
        act,
        w2,
        b2,
        weights,
        slots,
        sorted_ids,
        block_expert,
        num_slots,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        b2.stride(0),
        slots.stride(0),
        NUM_EXPERTS=num_experts,
        HAS_BIAS=experts.b2 is not None,
        ONE_TOKEN=one_token,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n2,
        BLOCK_K=t.block_k,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    out = torch.empty_like(x)
    block = 1024
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](slots, out, hidden, TOP_K=top_k, BLOCK=block)
    return out


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
