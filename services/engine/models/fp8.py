"""fp8 weights: e4m3 values with one float32 scale per output row (weight-only: activations
stay in the model's dtype).

A quantized weight w [N, K] is ``data`` [N, K] float8_e4m3fn and ``scale`` [N] float32 with
w ~ data * scale[:, None]; scale[n] = max |w[n]| / 448 (e4m3's largest finite value), so
each row keeps its own range and rounds to e4m3's 3 mantissa bits. Used for the drafter
(``--draft-quantization fp8``): its layer and head are read once per draft, K times a step,
and fp8 halves those bytes. The target stays in its own dtype, so verification, and with
it greedy output, is unchanged.

Only one-row matmuls (``FP8_ROWS``: a chain step at batch 1) stream fp8: there the
weight read is the whole cost, and the kernel takes 0.54-0.66x cuBLAS's time on the bf16
weight. It runs one program per row, so each row reads the weight again: at 5 rows it took
1.6-1.8x cuBLAS's time, at 64 rows 1.8x. So the layers keep the weight as loaded too
(``dense``) and use it for more rows: the drafter takes 1.5x its memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import kernels
from services.engine.parallel import RowParallelLinear, TensorParallel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
FP8_ROWS = 1  # matmuls of at most this many rows read the fp8 weight, larger ones ``dense``


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32
    dense: torch.Tensor | None = None  # [N, K] the weight as loaded, for more than FP8_ROWS rows

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Output rows start..stop - 1, as views."""
        dense = self.dense[start:stop] if self.dense is not None else None
        return Fp8Weight(self.data[start:stop], self.scale[start:stop], dense)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32."""
        return self.data.float() * self.scale[:, None]


def quantize_fp8(weight: torch.Tensor, keep_dense: bool = False) -> Fp8Weight:
    """weight [N, K] -> its per-row-scaled e4m3 form (a zero row gets scale 1); with
    ``keep_dense``, ``weight`` itself too, for matmuls of more than FP8_ROWS rows."""
    amax = weight.detach().float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)  # [N]
    data = (weight.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data.contiguous(), scale.contiguous(), weight.detach() if keep_dense else None)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` over a plain or an fp8 weight; x [num_tokens, K] -> [num_tokens, N].
    An fp8 weight with a dense copy serves more than FP8_ROWS rows from that copy."""
    if isinstance(weight, torch.Tensor):
        return kernels.linear(x, weight, bias)
    if weight.dense is not None and x.shape[0] > FP8_ROWS:
        return F.linear(x, weight.dense, bias)
    y = kernels.fp8_linear(x, weight.data, weight.scale)
    return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """A linear layer over an fp8 weight. ``tp`` set: a row-parallel layer's share (this
    rank's input columns, quantized with this rank's own row scales), summed over the ranks
    before the bias, as ``RowParallelLinear`` does."""

    def __init__(
        self, weight: Fp8Weight, bias: torch.Tensor | None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.tp = weight, bias, tp
        self.out_features, self.in_features = weight.data.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype."""
        if self.tp is None or self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def fp8_linear_of(lin: nn.Linear, weight: Fp8Weight | None = None) -> Fp8Linear:
    """``lin`` with its weight in fp8, its dense copy kept (``weight``: its already quantized
    rows, e.g. a view of a merged weight's)."""
    tp = lin.tp if isinstance(lin, RowParallelLinear) else None
    return Fp8Linear(weight if weight is not None else quantize_fp8(lin.weight, True), lin.bias, tp)


def fp8_merged(merged: torch.Tensor, parts: list[nn.Linear]) -> tuple[Fp8Weight, list[Fp8Linear]]:
    """A merged weight (``layers.merge_linears``) in fp8, and its parts as Fp8Linears over
    views of its rows: the parts keep their names and share the merged memory."""
    weight = quantize_fp8(merged, keep_dense=True)
    out, start = [], 0
    for lin in parts:
        out.append(fp8_linear_of(lin, weight.rows(start, start + lin.out_features)))
        start += lin.out_features
    return weight, out
