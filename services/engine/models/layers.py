"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU.

Tensors are flat over tokens: ``[num_tokens, ...]``; positions are absolute token indices.
The pointwise math runs through :mod:`services.engine.kernels` (fused Triton kernels on
CUDA, their torch reference elsewhere). :func:`merge_linears` gives a block one matmul
where the checkpoint has several (q/k/v, gate/up), keeping the checkpoint's names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import kernels
from services.engine.models.fp8 import (
    DRAFT,
    Fp8Linear,
    Fp8Mode,
    Fp8Weight,
    fp8_linear_of,
    fp8_merged,
    linear,
    merge_fp8,
)
from services.engine.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    split,
)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and returned in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size] -> the same shape."""
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm step: (norm(x + residual), x + residual); residual None is zeros."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def merge_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of out_features, in_features] weight (and bias) whose row blocks become the
    linears' own weights, as views: the memory is not doubled. Call it once the model has
    its final device and dtype (a later ``.to`` copies the views apart)."""
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight.data = weight[rows]
        if has_bias:
            lin.bias.data = bias[rows]
        start = rows.stop
    return weight, bias


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); under tensor parallelism this rank holds a slice of
    the intermediate size and down sums the slices."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        rows = split(intermediate_size, tp, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden_size, rows)
        self.up_proj = ColumnParallelLinear(hidden_size, rows)
        self.down_proj = RowParallelLinear(rows, hidden_size, tp)
        self.gate_up: torch.Tensor | Fp8Weight | None = None  # [2 * rows, hidden_size] once merged

    def merge(self) -> None:
        """Run gate and up as one matmul from now on (fp8 ones, an fp8 checkpoint's, too)."""
        parts = [self.gate_proj, self.up_proj]
        merge = merge_fp8 if all(isinstance(p, Fp8Linear) for p in parts) else merge_linears
        self.gate_up, _ = merge(parts)

    def quantize_fp8(self, mode: Fp8Mode = DRAFT) -> None:
        """Every projection's weight in fp8 from now on, as ``mode`` says (``fp8.py``); those
        already fp8 stay as they are."""
        if self.gate_up is not None:
            self.gate_up, (self.gate_proj, self.up_proj) = fp8_merged(
                self.gate_up, [self.gate_proj, self.up_proj], mode
            )
        else:
            self.gate_proj = fp8_linear_of(self.gate_proj, mode=mode)
            self.up_proj = fp8_linear_of(self.up_proj, mode=mode)
        self.down_proj = fp8_linear_of(self.down_proj, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(kernels.silu_mul(linear(x, self.gate_up)))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies, after ``linear`` or ``llama3`` scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "yarn":
        return _yarn_scaled(head_dim, theta, scaling)
    return inv_freq.float()


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's ``attention_factor`` (given, or from
    ``mscale`` / ``mscale_all_dim``, or 0.1 ln(factor) + 1); 1 for every other type."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaled(head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are divided by ``factor``, those turning more than ``beta_fast`` times kept, a linear
    ramp between (over dimension indices, floored/ceiled unless ``truncate`` is false);
    float32 as transformers computes them."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, smooth
    interpolation between ``low_freq_factor`` and ``high_freq_factor``."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(is_mid, mid, out)


class Rotary(nn.Module):
    """Rotate-half RoPE (the HF Llama convention): pairs (i, i + head_dim / 2)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", torch.cat([inv_freq, inv_freq]), persistent=False)  # [head_dim]
        self.attention_factor = rope_attention_factor(scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] float32, whose two
        halves repeat (the position, made float32, times each frequency), times the scaling's
        attention factor (YaRN's; 1 otherwise)."""
        angles = positions[:, None, None] * self.inv_freq.float()  # [num_tokens, 1, head_dim]
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
