"""Torch definitions of the decoder's fused ops: what the GPU kernels must compute.

Rounding follows the unfused model exactly: sums and products of activations are rounded
to the activation dtype where the unfused code rounds them; norms, RoPE and SiLU are
computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, size] -> x / rms(x) * weight, in x's dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm step: residual' = x + residual (in x's dtype; x alone when residual is
    None), returned with rms_norm(residual')."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, 1,
    head_dim] float32 -> rotated x in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * inter] (gate rows first) -> silu(gate) * up [num_tokens,
    inter], each rounded to the input dtype as the unfused SwiGLU rounds it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, K], weight [N, K] float8_e4m3fn, scale [N] float32 -> x @ (weight *
    scale[:, None]).T [num_tokens, N] in x's dtype, accumulated in float32."""
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)
