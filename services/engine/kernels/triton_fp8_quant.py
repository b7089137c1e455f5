"""Per-row (per-token) e4m3 quantization of activations in one launch: what
``fp8_reference.quantize_rows`` computes (group 0), for the FP8 GEMM's rows.

Program m reads row m twice: once for its largest magnitude, once to write
``clamp(x / scale, +-448)`` rounded to e4m3 (nearest even) with ``scale = amax / 448``
(1 for an all-zero row). The arithmetic is torch's on CUDA (a tensor over a Python number
is a product with its float32 reciprocal; tensor over tensor an IEEE-rounded division), so
the bytes and scales equal the reference's. The eager reference is about ten kernels a
matmul, which at 4 matmuls x 32 layers cost an 8B decode step more than FP8 saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.fp8_reference import FP8, FP8_MAX

BLOCK = 1024


def quantize_rows_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16/float32 on CUDA -> (data [M, K] float8_e4m3fn, scale [M] float32)."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    data = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](
            x, data, scale, k, x.stride(0), BLOCK=BLOCK, FP8_LIMIT=FP8_MAX, num_warps=4
        )
    return data, scale


@triton.jit
def row_scale(x_ptr, K, BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """The e4m3 scale of the K values at ``x_ptr``: max |x| / FP8_LIMIT, 1 if all are 0."""
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        rk = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    return tl.where(top > 0, top * (1.0 / FP8_LIMIT), 1.0)  # torch: amax * float32(1 / 448)


@triton.jit
def to_e4m3(x, scale, FP8_LIMIT: tl.constexpr):
    """x (any float) / scale, clamped to +-FP8_LIMIT, rounded to e4m3 (nearest even)."""
    q = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize_rows_kernel(
    x_ptr, data_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    scale = row_scale(x_row, K, BLOCK, FP8_LIMIT)
    for k in range(0, K, BLOCK):
        rk = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0)
        tl.store(data_ptr + row * K + rk, to_e4m3(x, scale, FP8_LIMIT), mask=rk < K)
    tl.store(scale_ptr + row, scale)
