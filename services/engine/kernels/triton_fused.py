"""Triton kernels for the decoder's fused ops; :mod:`services.engine.kernels.reference`
defines what they compute.

- ``add_rms_norm``: one program per token; the sum is rounded to the activation dtype
  before it is normed, as the unfused residual add rounds it;
- ``rotate_heads``: one program per (token, head), reading strided heads (views of a merged
  q/k/v output) and writing a contiguous copy;
- ``silu_mul``: one program per (token, block of the intermediate size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    sum_ptr,
    w_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # issued with x's load
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(out_ptr + row * stride_o + cols, ((x * rstd) * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(x)
    n, size = x.shape
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    res = x if residual is None else _rows(residual)
    if n:
        _add_rms_norm_kernel[(n,)](
            x,
            res,
            out,
            summed,
            weight,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            summed.stride(0),
            size,
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(size),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


@triton.jit
def _rotate_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < HALF
    src = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * stride_ct + d, mask=m, other=0.0)
    dst = out_ptr + t * stride_ot + h * stride_oh
    tl.store(dst + d, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + d, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=m)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(n, head_dim), sin.reshape(n, head_dim)  # halves repeat: read the first
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n and heads:
        half = head_dim // 2
        _rotate_kernel[(n, heads)](
            x,
            out,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
        )
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, INTER, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < INTER
    g = tl.load(gu_ptr + t * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_g + INTER + cols, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _rows(gate_up)
    n, width = gate_up.shape
    inter = width // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out
