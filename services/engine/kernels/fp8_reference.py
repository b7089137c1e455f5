"""FP8 (e4m3) linear layers: the weight's form and the torch definition of its matmul.

A quantized weight w [N, K] is ``data`` [N, K] float8_e4m3fn and float32 ``scale``:
- [N], one scale per output row (a per-tensor scale is stored repeated per row):
  w ~ data * scale[:, None];
- [N, ceil(K / block)] with ``block`` > 0, one scale per row and run of ``block`` input
  columns (a 128 x 128 block-scaled checkpoint's scales, repeated over each block's rows):
  w[n, k] ~ data[n, k] * scale[n, k // block].
Its activations (``act``) are left as they are ("none": weight-only), or quantized to e4m3
before the matmul: "token" per row (scale = the row's max |x| / 448, computed at run time),
"group" per row and run of ``block`` columns likewise, "static" with the checkpoint's one
``input_scale``. A quantized activation is x ~ round_e4m3(x / s) * s, clamped to +-448.

The reference computes exactly that in float32: the activations quantized and dequantized,
the weight dequantized, one ``F.linear``. The CUDA paths (``fp8_cuda.py``) compute the same
products with float32 accumulation (equal up to float32 summation order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
ACTIVATIONS = ("none", "token", "group", "static")


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32, or [N, ceil(K / block)] when block > 0
    dense: torch.Tensor | None = None  # [N, K] the weight as loaded, for more than FP8_ROWS rows
    block: int = 0  # input columns per scale column; 0 = one scale per row
    act: str = "none"  # how activations are quantized (module docstring)
    input_scale: torch.Tensor | None = None  # [] float32, for act "static"

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Output rows start..stop - 1, as views."""
        dense = self.dense[start:stop] if self.dense is not None else None
        return replace(self, data=self.data[start:stop], scale=self.scale[start:stop], dense=dense)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32."""
        return self.data.float() * self.column_scales()

    def column_scales(self) -> torch.Tensor:
        """The scale of every element, broadcastable to [N, K] float32."""
        if not self.block:
            return self.scale[:, None]
        return self.scale.repeat_interleave(self.block, dim=1)[:, : self.data.shape[1]]


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations quantized per row: x ~ data * scale[:, None]; ``dtype`` is x's own (the
    matmul's output dtype)."""

    data: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] float32
    dtype: torch.dtype


def absmax_scale(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of values whose largest magnitude is ``amax`` (float32): amax / 448,
    1 where amax is 0 (an all-zero row quantizes to zeros)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest even), clamped to +-448; scale broadcasts to x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (data [M, K] e4m3, scale [M] float32),
    one scale per row; with ``group``, scale [M, ceil(K / group)], one per row and run of
    ``group`` columns."""
    if not group:
        scale = absmax_scale(x.abs().amax(dim=-1))  # [M]
        return to_fp8(x, scale[:, None]), scale
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x, (0, groups * group - k)).view(m, groups, group)
    scale = absmax_scale(padded.abs().amax(dim=-1))  # [M, G]
    return to_fp8(x, scale.repeat_interleave(group, dim=1)[:, :k]), scale


def fake_quantized(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] as ``w``'s matmul reads it, in float32: quantized and dequantized as
    ``w.act`` says (itself for "none")."""
    if w.act == "none":
        return x.float()
    if w.act == "static":
        return to_fp8(x, w.input_scale).float() * w.input_scale
    group = w.block if w.act == "group" else 0
    data, scale = quantize_rows(x, group)
    if group:
        return data.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]
    return data.float() * scale[:, None]


def fp8_scaled_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: fake_quantized(x) @ w.dequantized().T in float32."""
    return F.linear(fake_quantized(x, w), w.dequantized()).to(x.dtype)
