"""fp8 weights in the model: e4m3 values with float32 scales (:class:`Fp8Weight`, defined
with its matmul in ``kernels/fp8_reference.py``), the layers over them, and quantizing a
loaded weight.

Three sources: a checkpoint that ships fp8 weights (``fp8_checkpoint.py``: per-row,
per-tensor or 128 x 128 block scales, activations as its ``quantization_config`` says);
``--quantization fp8`` (:data:`SERVE`: each target linear quantized at load with a scale per
output row, activations quantized per token at run time, as a published FP8-Dynamic folder
of the same weights); ``--draft-quantization fp8`` (:data:`DRAFT`: the drafter's own
linears, weight-only). A quantized weight w [N, K] keeps ``scale[n] = max |w[n]| / 448``
(e4m3's largest finite value), so each row keeps its own range.

The drafter's layers are read once per draft, K times a step: only its one-row matmuls
(``FP8_ROWS``: a chain step at batch 1) stream fp8. The weight-only kernel runs one program
per row, so each row reads the weight again: at 5 rows it took 1.6-1.8x cuBLAS's time, at
64 rows 1.8x. So the drafter keeps the weight as loaded too (``dense``) and uses it for more
rows: it takes 1.5x its memory. The target's fp8 linears keep no dense copy: their large
matmuls run cuBLASLt's FP8 GEMM (``kernels/fp8_cuda.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import kernels
from services.engine.kernels.fp8_reference import FP8, FP8_MAX, Fp8Weight, absmax_scale, to_fp8
from services.engine.parallel import RowParallelLinear, TensorParallel

FP8_ROWS = 1  # a drafter's matmuls of at most this many rows read the fp8 weight, larger ``dense``
__all__ = ["FP8", "FP8_MAX", "FP8_ROWS", "Fp8Linear", "Fp8Mode", "Fp8Weight", "linear", "quantize_fp8"]


@dataclass(frozen=True, slots=True)
class Fp8Mode:
    """How a loaded weight is quantized: ``keep_dense`` keeps the weight as loaded for
    matmuls of more than FP8_ROWS rows; ``act`` quantizes activations ("none" or "token")."""

    keep_dense: bool
    act: str


DRAFT = Fp8Mode(keep_dense=True, act="none")  # --draft-quantization fp8
SERVE = Fp8Mode(keep_dense=False, act="token")  # --quantization fp8 (FP8-Dynamic)


def quantize_fp8(weight: torch.Tensor, keep_dense: bool = False, act: str = "none") -> Fp8Weight:
    """weight [N, K] -> its per-row-scaled e4m3 form (a zero row gets scale 1); with
    ``keep_dense``, ``weight`` itself too, for matmuls of more than FP8_ROWS rows; ``act``:
    how its activations are quantized (``kernels/fp8_reference.py``)."""
    w = weight.detach()
    scale = absmax_scale(w.float().abs().amax(dim=1))  # [N]
    data = to_fp8(w, scale[:, None])
    return Fp8Weight(data.contiguous(), scale.contiguous(), w if keep_dense else None, act=act)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` over a plain or an fp8 weight; x [num_tokens, K] -> [num_tokens, N].
    An fp8 weight with a dense copy serves more than FP8_ROWS rows from that copy."""
    if isinstance(weight, torch.Tensor):
        return kernels.linear(x, weight, bias)
    if weight.dense is not None and x.shape[0] > FP8_ROWS:
        return F.linear(x, weight.dense, bias)
    if weight.act == "none" and not weight.block:
        y = kernels.fp8_linear(x, weight.data, weight.scale)
    else:
        y = kernels.fp8_scaled_linear(x, weight)
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


def fp8_linear_of(
    lin: nn.Linear | Fp8Linear, weight: Fp8Weight | None = None, mode: Fp8Mode = DRAFT
) -> Fp8Linear:
    """``lin`` with its weight in fp8 as ``mode`` says (``weight``: its already quantized
    rows, e.g. a view of a merged weight's); an Fp8Linear (an fp8 checkpoint's) as it is."""
    if isinstance(lin, Fp8Linear):
        return lin
    tp = lin.tp if isinstance(lin, RowParallelLinear) else None
    if weight is None:
        weight = quantize_fp8(lin.weight, mode.keep_dense, mode.act)
    return Fp8Linear(weight, lin.bias, tp)


def fp8_merged(
    merged: torch.Tensor | Fp8Weight, parts: list[nn.Linear], mode: Fp8Mode = DRAFT
) -> tuple[Fp8Weight, list[Fp8Linear]]:
    """A merged weight (``layers.merge_linears``) in fp8, and its parts as Fp8Linears over
    views of its rows: the parts keep their names and share the merged memory. Already fp8
    (an fp8 checkpoint's): as it is."""
    if isinstance(merged, Fp8Weight):
        return merged, parts
    weight = quantize_fp8(merged, mode.keep_dense, mode.act)
    out, start = [], 0
    for lin in parts:
        out.append(fp8_linear_of(lin, weight.rows(start, start + lin.out_features)))
        start += lin.out_features
    return weight, out


def merge_fp8(parts: list[Fp8Linear]) -> tuple[Fp8Weight, torch.Tensor | None]:
    """:func:`layers.merge_linears` for fp8 linears of one input (q/k/v, gate/up): one
    weight whose row blocks become the parts' weights, as views, and the merged bias. Their
    block size and activation scheme must agree; a static input scale is the parts' largest
    (``fp8_checkpoint`` makes them equal at load, so merging changes nothing)."""
    first = parts[0].weight
    if any((p.weight.block, p.weight.act) != (first.block, first.act) for p in parts):
        raise ValueError("fp8: the merged projections are quantized differently")
    input_scale = first.input_scale
    if input_scale is not None:
        input_scale = torch.stack([p.weight.input_scale for p in parts]).amax()
    weight = replace(
        first,
        data=torch.cat([p.weight.data for p in parts]),
        scale=torch.cat([p.weight.scale for p in parts]),
        dense=None,
        input_scale=input_scale,
    )
    has_bias = parts[0].bias is not None
    bias = torch.cat([p.bias.data for p in parts]) if has_bias else None
    start = 0
    for p in parts:
        stop = start + p.out_features
        p.weight = weight.rows(start, stop)
        if has_bias:
            p.bias.data = bias[start:stop]
        start = stop
    return weight, bias
