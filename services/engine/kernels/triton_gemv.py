"""Weight-streaming matmul for decode-sized batches: y = x @ w.T with x [M, K], M <= 64;
and its fp8 variant (``fp8_gemv``: e4m3 weights, one float32 scale per output row).

At M of a few rows a decode step's linear layers only stream their weights, so the
kernel is laid out for the copy rate: program ``n`` owns ``BLOCK_N`` output columns
and walks K once, reading each weight element exactly once; x is tiny and stays in L1/L2.
Rows are padded to BLOCK_M (16, 32 or 64: the smallest that holds M) for the dot.
With ``split_k`` > 1 program (n, s) covers the s-th K range and writes float32 partials
that one sum reduces in a fixed order (no atomics): results are deterministic run to run.
The reference is ``F.linear`` (``reference.fp8_linear`` for the fp8 variant).

The fp8 variant has no dot: program (m, n, s) sums row m's products with its weight tile
in float32 registers (e4m3 widened exactly), then multiplies by the row scales. Each row
is computed alone, in the same order whatever M is, so a row's output does not depend on
the batch around it (a graphed and an eager forward at other row counts agree). The M
programs of one weight tile are adjacent in launch order: one of them reads it from
memory, the others from L2. Rows may come quantized (``Fp8Rows``: e4m3 with a scale per
row, ``models/fp8.py``'s activation quantization): then each product is of two e4m3 values,
summed in float32 and times both scales. Meant for a few rows (``models/fp8.py`` uses it up to 16):
past that the matmul is compute-bound and cuBLAS on bf16 weights is faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.fp8_reference import FP8_MAX, Fp8Rows
from services.engine.kernels.triton_fp8_quant import row_scale, to_e4m3

MAX_ROWS = 64
GemvTiles = tuple[int, int, int, int, int]  # BLOCK_N, BLOCK_K, warps, stages, split_k

# bf16 weights [N, K] whose few-row matmuls this kernel ran faster than cuBLAS (one call's
# share of a graph over distinct weights, H200, 2026-12-01 and 2026-12-02): the 8B o
# projection (12.0 against 13.8 us at one row), the Llama-3 LM head (241.8 against 252.0)
# and the EAGLE-3 drafter's head. Every other shape stays with cuBLAS.
DENSE_TILES: dict[tuple[int, int], GemvTiles] = {
    (4096, 4096): (32, 256, 4, 4, 1),
    (128256, 4096): (64, 128, 4, 3, 1),
    (32000, 4096): (64, 128, 4, 3, 1),
}
DENSE_ROWS = 16  # up to one padded dot block: a row's result does not depend on the others


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
            mask=(rn[:, None] < N) & (rk[None, :] < K),
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + split * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    split_k: int = 1,
) -> torch.Tensor:
    """x [M, K] (M <= 64), weight [N, K] with unit stride along K -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"x: {m} rows, at most {MAX_ROWS}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    dtype = x.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, m, n), dtype=dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(1),
        out.stride(0),
        k_per_split,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)


@triton.jit
def _fp8_row_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_SCALED: tl.constexpr,
    X_QUANT: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    if X_QUANT:  # the whole row's scale, whichever K range this program sums
        x_scale = row_scale(x_ptr + row.to(tl.int64) * stride_xm, K, BLOCK_K, FP8_LIMIT)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
            mask=(rn[:, None] < N) & (rk[None, :] < K),
            other=0.0,
        )  # [BLOCK_N, BLOCK_K] e4m3
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + rk, mask=rk < K, other=0.0)  # [BLOCK_K]
        if X_QUANT:
            x = to_e4m3(x, x_scale, FP8_LIMIT)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    y = tl.sum(acc, axis=1) * scale  # [BLOCK_N]
    if X_SCALED:  # e4m3 activations: times the row's scale
        y = y * tl.load(xs_ptr + row)
    if X_QUANT:
        y = y * x_scale
    out = out_ptr + split * stride_os + row.to(tl.int64) * stride_om + rn
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=rn < N)


Fp8Tiles = tuple[int, int, int, int, int]  # BLOCK_N, BLOCK_K, warps, stages, split_k


def fp8_tiles(n: int, k: int) -> Fp8Tiles:
    """Tiles for a [N, K] weight, from the one-row sweeps of ``bench.gemv --fp8`` (three runs,
    2026-12-02, EAGLE-3 drafter shapes at 8B): long rows over few columns split K in two;
    few columns take 16 x 512 tiles, many 16 x 256, a vocabulary-sized head 32 x 256 (38.3
    against 42.6 us at 32,000 x 4,096)."""
    if n <= 8192 and k >= 12288:
        return (32, 512, 8, 4, 2)
    if n <= 8192:
        return (16, 512, 8, 4, 1)
    if n >= 32000:
        return (32, 256, 4, 4, 1)
    return (16, 256, 4, 4, 1)


def fp8_gemv(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    scale: torch.Tensor,
    tiles: Fp8Tiles | None = None,
    quantize: bool = False,
) -> torch.Tensor:
    """x [M, K] bf16 or fp16 (or e4m3 rows with their scales), weight [N, K] float8_e4m3fn
    row-major, scale [N] float32 -> [M, N] = x @ (weight * scale[:, None]).T in x's dtype
    (``Fp8Rows.dtype`` for quantized rows); ``tiles`` None: ``fp8_tiles``. ``quantize``: x's
    rows quantized per token inside the kernel first (each program finds its row's scale,
    then rounds x to e4m3 as it streams: ``quantize_rows``'s bytes, no launch of its own)."""
    block_n, block_k, num_warps, num_stages, split_k = tiles or fp8_tiles(*weight.shape)
    rows, x_dtype = (x, None) if isinstance(x, Fp8Rows) else (None, x.dtype)
    x = rows.data if rows is not None else x
    x_dtype = rows.dtype if rows is not None else x_dtype
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    dtype = x_dtype if splits == 1 else torch.float32
    out = torch.empty((splits, m, n), dtype=dtype, device=x.device)
    if m == 0:
        return out.sum(0).to(x_dtype)
    _fp8_row_kernel[(m, triton.cdiv(n, block_n), splits)](
        x,
        rows.scale if rows is not None else scale,
        weight,
        scale,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(1),
        out.stride(0),
        k_per_split,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        X_SCALED=rows is not None,
        X_QUANT=quantize and rows is None,
        FP8_LIMIT=FP8_MAX,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out[0] if splits == 1 else out.sum(0).to(x_dtype)
