"""FP8 matmuls on CUDA (bf16/fp16 activations): what :func:`fp8_reference.fp8_scaled_linear`
defines, computed from the e4m3 bytes.

- Quantized activations ("token", "static") over a per-row-scaled weight: up to
  ``GEMV_ROWS`` rows the weight-streaming kernel (``triton_gemv.fp8_gemv``, e4m3 times e4m3
  products summed in float32, each row alone); above, cuBLASLt's FP8 GEMM
  (``torch._scaled_mm`` with a scale per activation row and per weight row).
- Weight-only ("none"): the streaming kernel up to ``GEMV_ROWS`` rows, above it the weight
  dequantized to the activations' dtype for one ``F.linear``.
- Block-scaled weights and shapes cuBLASLt's FP8 GEMM does not take (K or N not a multiple
  of 16): the activations quantized and dequantized, the weight dequantized, one
  ``F.linear`` in the activations' dtype (correct first; it reads the weight twice).
Every path is device-only (no host synchronisation), so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.kernels.fp8_reference import Fp8Rows, Fp8Weight, fake_quantized, quantize_rows, to_fp8
from services.engine.kernels.triton_gemv import fp8_gemv

GEMV_ROWS = 1  # matmuls of at most this many rows stream the weight (models/fp8.py's FP8_ROWS)
MM_ALIGN = 16  # cuBLASLt's FP8 GEMM wants K and N multiples of 16


def fp8_scaled_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] bf16/fp16 on CUDA -> [M, N] in x's dtype."""
    n, k = w.data.shape
    if w.block or k % MM_ALIGN or n % MM_ALIGN:
        return F.linear(fake_quantized(x, w).to(x.dtype), w.dequantized().to(x.dtype))
    if w.act == "none":
        if x.shape[0] <= GEMV_ROWS:
            return fp8_gemv(x, w.data, w.scale)
        return F.linear(x, w.dequantized().to(x.dtype))
    rows = quantized_rows(x, w)
    if x.shape[0] <= GEMV_ROWS:
        return fp8_gemv(rows, w.data, w.scale)
    return torch._scaled_mm(
        rows.data,
        w.data.t(),
        scale_a=rows.scale[:, None],
        scale_b=w.scale[None, :],
        out_dtype=x.dtype,
    )


def quantized_rows(x: torch.Tensor, w: Fp8Weight) -> Fp8Rows:
    """x [M, K] quantized as ``w.act`` ("token" or "static") says, a scale per row."""
    if w.act == "static":
        scale = w.input_scale.reshape(1).expand(x.shape[0]).contiguous()  # [M]
        return Fp8Rows(to_fp8(x, w.input_scale).contiguous(), scale, x.dtype)
    data, scale = quantize_rows(x)
    return Fp8Rows(data.contiguous(), scale.contiguous(), x.dtype)
