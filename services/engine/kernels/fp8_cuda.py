"""FP8 matmuls on CUDA (bf16/fp16 activations): what :func:`fp8_reference.fp8_scaled_linear`
defines, computed from the e4m3 bytes.

- Quantized activations ("token", "static") over a per-row-scaled weight: up to
  ``GEMV_ROWS`` rows the weight-streaming kernel (``triton_gemv.fp8_gemv``, e4m3 times e4m3
  products summed in float32, each row alone; per-token rows quantized inside it); above,
  cuBLASLt's FP8 GEMM (``torch._scaled_mm`` with a scale per activation row and per weight
  row) over rows quantized by one launch (``triton_fp8_quant``).
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

from services.engine.kernels.fp8_reference import Fp8Rows, Fp8Weight, fake_quantized, to_fp8
from services.engine.kernels.triton_fp8_quant import quantize_rows_cuda
from services.engine.kernels.triton_gemv import fp8_gemv

# Matmuls of at most this many rows stream the weight. bench.gemv --fp8 on an H100
# (2026-12-05), 8B shapes qkv / o / gate_up / down, us: M 1 streaming 11.5 / 9.3 / 44.5 /
# 27.6 against torch._scaled_mm 19.6 / 15.2 / 50.9 / 48.1; M 2 15.2 / 13.3 / 54.6 / 33.6
# against 20.0 / 15.1 / 51.1 / 46.6 (a layer 117 against 133); M 4 and up _scaled_mm wins.
GEMV_ROWS = 2
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
    if x.shape[0] <= GEMV_ROWS:
        if w.act == "token":
            return fp8_gemv(x, w.data, w.scale, quantize=True)
        return fp8_gemv(quantized_rows(x, w), w.data, w.scale)
    rows = quantized_rows(x, w)
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
    data, scale = quantize_rows_cuda(x)
    return Fp8Rows(data, scale, x.dtype)
