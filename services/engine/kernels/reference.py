"""Torch definitions of the decoder's fused ops: what the GPU kernels must compute.

Rounding follows the unfused model exactly: sums and products of activations are rounded
to the activation dtype where the unfused code rounds them; norms, RoPE and SiLU are
computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Experts:
    """One MoE layer's experts as grouped weights. w13 [E, 2I, H]: each expert's gate rows,
    then its up rows; w2 [E, H, I]; b13 [E, 2I] and b2 [E, H] or None; ``activation`` as
    :func:`expert_activation` names it, ``limit`` its clamp (clamped_swiglu only)."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    activation: str = "silu"
    limit: float = 7.0


def expert_activation(gate_up: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (gate columns first) -> [rows, inter] in its dtype.
    "silu": silu(gate) * up (Qwen3-MoE, Mixtral). "clamped_swiglu" (gpt-oss): gate clamped
    above at ``limit``, up to [-limit, limit], then (up + 1) * gate * sigmoid(1.702 * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation != "clamped_swiglu":
        raise ValueError(f"activation: {activation!r} is not supported; supported: silu, clamped_swiglu")
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


def moe_experts(
    x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts MLP, summed per token.

    x [T, H]; ``experts`` of E experts; topk_ids [T, k] int (distinct per row, each in
    [0, E)); topk_weights [T, k]. Returns [T, H] in x's dtype: for each token, the sum
    over its k slots of weight * w2[e] @ act(w13[e] @ x + b13[e]) (+ b2[e]), where every
    expert's output is rounded to x's dtype, multiplied by its weight in x's dtype and
    summed in float32, here expert by expert (the Triton kernel sums slot by slot: equal
    but for float32 rounding; transformers rounds each product the same way, then sums in
    x's dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = topk_weights.to(x.dtype)
    w, b13, b2 = experts, experts.b13, experts.b2
    for e in torch.unique(topk_ids).tolist():
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        h = F.linear(x[rows], w.w13[e], None if b13 is None else b13[e])  # [n, 2I]
        y = F.linear(expert_activation(h, w.activation, w.limit), w.w2[e], None if b2 is None else b2[e])
        out.index_add_(0, rows, (y * weights[rows, slots, None]).float())
    return out.to(x.dtype)
