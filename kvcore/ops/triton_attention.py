"""Triton paged attention: one kernel for decode, verify and prefill over a cached prefix.

A program owns (sequence, block of BLOCK_Q query tokens, kv head, context split). Its
rows are every (query token, q head) pair of that kv head, so each K/V page is read once
for all GROUP query heads that share it (GQA packing); row r is query token
r // GROUP_PAD and head r % GROUP_PAD of the group. Keys are walked BLOCK_N positions
at a time, each position resolved through the block table to (page, offset), so any
page size works and a block may span pages. Loads are masked to positions inside
[first visible, last query] of the split: a NULL page or a slot past the context is
never read. With NUM_SPLITS > 1 each split writes a normalized partial output and its
log2-sum-exp, and a second kernel combines them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore.ops.batch import AttentionParams, PagedBatch

LOG2E = 1.4426950408889634
TINY = tl.constexpr(1e-30)
NEG_BIG = tl.constexpr(-1e30)  # initial running max: finite, so masked rows stay NaN-free


@triton.jit
def _attention_kernel(  # noqa: PLR0913 (a kernel takes its pointers, strides and constants flat)
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    kv_ptr,
    sinks_ptr,
    block_table_ptr,
    starts_ptr,
    seq_lens_ptr,
    layer_offset,
    num_q_blocks,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_page,
    stride_kv,
    stride_head,
    stride_bt,
    scale_log2,
    window,
    key_start,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_CLAMP: tl.constexpr,
    UNIFORM_Q: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_blocks
    first_q = (tl.program_id(0) % num_q_blocks) * BLOCK_Q
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if UNIFORM_Q > 0:  # every sequence has UNIFORM_Q queries: no start table to read
        q_start = seq * UNIFORM_Q
        q_len = UNIFORM_Q
    else:
        q_start = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if first_q >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    row_q = first_q + rows // GROUP_PAD  # query index inside the sequence
    row_head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (row_q < q_len) & (rows % GROUP_PAD < GROUP) & (rows < BLOCK_Q * GROUP_PAD)
    row_pos = seq_len - q_len + row_q  # [BLOCK_M] position of each row's query
    row_token = (q_start + row_q).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if Q_CLAMP > 0:  # a bf16/fp32 query narrowed to fp16 saturates instead of overflowing
        q = tl.clamp(q.to(tl.float32), -Q_CLAMP, Q_CLAMP)
    q = q.to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    # keys this block can see: [kv_lo, kv_hi); split s takes one BLOCK_N-aligned chunk
    kv_hi = seq_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_lo = key_start
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + first_q - window + 1, key_start)
    aligned_lo = (kv_lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - aligned_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = aligned_lo + split * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_hi)

    kv_base = kv_ptr + layer_offset + kv_head * stride_head
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the head's sink logit starts the first split's softmax: one exp(sink)
        sink = tl.load(sinks_ptr + row_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        first = (tl.zeros([BLOCK_M], tl.int32) + split) == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(split_lo, split_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        in_range = (pos >= kv_lo) & (pos < split_hi)
        page = tl.load(table_row + pos // PAGE, mask=in_range, other=-1)
        key_ok = in_range & (page >= 0)
        slot = page.to(tl.int64) * stride_page + (pos % PAGE) * HEAD_DIM
        kv_off = slot[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_base + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(kv_base + stride_kv + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = key_ok[None, :] & (pos[None, :] <= row_pos[:, None])
        if HAS_WINDOW:
            visible &= pos[None, :] > row_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.maximum(l_i, TINY)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out_off = row_token[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part_row = (row_token * tl.num_programs(1) * GROUP + row_head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, TINY)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


@triton.jit
def _combine_kernel(  # noqa: PLR0913 (a kernel takes its pointers, strides and constants flat)
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_heads + head
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(
        part_lse_ptr + row * NUM_SPLITS + splits, mask=splits < NUM_SPLITS, other=float("-inf")
    )  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(
        part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=(w > 0)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )  # [SPLITS_PAD, BLOCK_D]
    out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), TINY)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _dot_dtype(pool_dtype: torch.dtype):
    """Operand dtype of the two matmuls: the pool's if 16/32-bit; fp8 K/V widen exactly to
    fp16 (e4m3 fits fp16; the fp8 -> fp16 conversion is native on sm89+, -> bf16 is not)."""
    return _DOT_DTYPES.get(pool_dtype, tl.float16)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(num_programs: int, device: torch.device, waves: int = 2, max_splits: int = 64) -> int:
    """Context splits so that a small batch still fills the chip (``waves`` programs per
    SM); 1 once the batch alone does."""
    num_sms = _num_sms(device.index or 0) if device.type == "cuda" else 1
    return max(1, min(max_splits, triton.cdiv(waves * num_sms, num_programs)))


@dataclass(slots=True)
class AttentionConfig:
    """Launch shape of one attention call; rows per program = block_m >= block_q * group_pad."""

    group: int  # q heads per kv head
    group_pad: int
    block_q: int  # query tokens per program
    block_m: int
    num_q_blocks: int
    num_splits: int
    block_n: int  # key positions per loop step
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class LaunchOverrides:
    """Launch settings a benchmark or a test fixes instead of the defaults; None: chosen."""

    num_splits: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def choose_config(
    query: torch.Tensor, layer_kv: torch.Tensor, batch: PagedBatch, given: LaunchOverrides
) -> AttentionConfig:
    """Defaults from H200 sweeps (docs/performance.md); any setting ``given`` wins."""
    num_q_heads, num_kv_heads, max_q_len = query.shape[1], layer_kv.shape[2], batch.max_q_len
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    decode_like = max_q_len <= 16  # decode / verify: one query block, context splits
    block_q = triton.next_power_of_2(max_q_len) if decode_like else max(1, 128 // group_pad)
    block_m = max(16, block_q * group_pad)
    num_q_blocks = triton.cdiv(max_q_len, block_q)
    num_splits = given.num_splits
    if num_splits is None:
        programs = batch.size * num_q_blocks * num_kv_heads
        num_splits = default_splits(programs, query.device) if decode_like else 1
    fp8_decode = layer_kv.element_size() == 1 and decode_like
    wide = fp8_decode or num_splits >= 8 or (block_m == 32 and num_splits == 1)
    return AttentionConfig(
        group,
        group_pad,
        block_q,
        block_m,
        num_q_blocks,
        num_splits,
        block_n=given.block_n or (128 if wide else 64),
        num_warps=given.num_warps or (4 if block_m <= 64 else 8),
        num_stages=given.num_stages or (3 if fp8_decode else 2),
    )


def launch_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    layer_kv: torch.Tensor,
    batch: PagedBatch,
    params: AttentionParams,
    **overrides: int,
) -> torch.Tensor:
    """Fill ``out`` [num_tokens, num_q_heads, head_dim] (query layout). ``layer_kv``: one
    layer of a contiguous pool, ``kv_pool[:, layer]`` [num_pages, 2, num_kv_heads, P,
    head_dim] (the kernel reads it through its strides). ``batch.max_q_len`` bounds every
    sequence's query length; a uniform batch (no ``query_start_loc``) has exactly that
    many (decode, verify), and the kernel reads no start table. ``overrides``: the fields
    of :class:`LaunchOverrides`."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, max_q_len = layer_kv.shape[2], batch.max_q_len
    if num_tokens == 0 or batch.size == 0 or max_q_len == 0:
        return out.zero_()
    cfg = choose_config(query, layer_kv, batch, LaunchOverrides(**overrides))
    part_out = part_lse = out  # unused placeholders when there is one split
    if cfg.num_splits > 1:
        part_out = query.new_empty((num_tokens, num_q_heads, cfg.num_splits, head_dim), dtype=torch.float32)
        part_lse = query.new_empty((num_tokens, num_q_heads, cfg.num_splits), dtype=torch.float32)
    dot_dtype = _dot_dtype(layer_kv.dtype)
    q_clamp = 65504.0 if dot_dtype == tl.float16 and query.dtype != torch.float16 else 0.0
    uniform = batch.query_start_loc is None
    grid = (batch.size * cfg.num_q_blocks, num_kv_heads, cfg.num_splits)
    _attention_kernel[grid](
        out,
        part_out,
        part_lse,
        query,
        layer_kv,
        query if params.sinks is None else params.sinks,  # placeholder without sinks
        batch.block_table,
        batch.seq_lens if uniform else batch.query_start_loc,  # placeholder when uniform
        batch.seq_lens,
        0,  # layer_offset: layer_kv already starts at its layer
        cfg.num_q_blocks,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        layer_kv.stride(0),
        layer_kv.stride(1),
        layer_kv.stride(2),
        batch.block_table.stride(0),
        params.scale * LOG2E,
        batch.window,
        batch.key_start,
        NUM_SPLITS=cfg.num_splits,
        GROUP=cfg.group,
        GROUP_PAD=cfg.group_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PAGE=layer_kv.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_WINDOW=batch.window > 0,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        Q_CLAMP=q_clamp,
        UNIFORM_Q=max_q_len if uniform else 0,
        HAS_SINKS=params.sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _combine_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            NUM_SPLITS=cfg.num_splits,
            SPLITS_PAD=triton.next_power_of_2(cfg.num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out
