"""The mixture-of-experts MLP: a router scores every expert per token, the top k run, and
their outputs are summed with the router's weights (Qwen3-MoE, Mixtral).

The checkpoint keeps one SwiGLU per expert under the family's names
(``experts.3.gate_proj.weight`` for Qwen3-MoE, ``experts.3.w1.weight`` for Mixtral), so a
published folder loads and shards (TP over each expert's intermediate size) as the dense MLP
does. The forward runs every expert at once through :func:`kernels.moe_experts` over grouped
weights [E, 2I, H] and [E, H, I]: stacked once by :meth:`SparseMoe.merge` with every expert's
weight a view of them (no second copy), or stacked per call until then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import kernels
from services.engine.kernels import Experts
from services.engine.models.fp8 import Fp8Mode, quantize_fp8
from services.engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, split

QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT = ("w1", "w3", "w2")  # gate, up, down


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, k] int64, weights [T, k] float32): the k experts of largest
    softmax probability (computed in float32, ties broken as ``torch.topk`` breaks them) and
    those probabilities, divided by their sum when ``renormalize`` (Mixtral always,
    Qwen3-MoE when ``norm_topk_prob``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class Expert(nn.Module):
    """One expert's SwiGLU under the checkpoint's names ``names`` = (gate, up, down); this
    rank holds the intermediate rows ``rows``."""

    def __init__(
        self, hidden_size: int, rows: range, tp: TensorParallel, names: tuple[str, str, str]
    ) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, ColumnParallelLinear(hidden_size, rows))
        setattr(self, up, ColumnParallelLinear(hidden_size, rows))
        setattr(self, down, RowParallelLinear(rows, hidden_size, tp))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down)."""
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]


class SparseMoe(nn.Module):
    """The routed MLP of one layer: ``gate`` [E, H] is the router (whole on every rank), the
    experts are sharded over the intermediate size and their sum is reduced once."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: tuple[int, int, bool],
        tp: TensorParallel = SINGLE,
        names: tuple[str, str, str] = QWEN_EXPERT,
    ) -> None:
        """``routing``: (experts E, experts per token k, renormalize the k weights)."""
        super().__init__()
        num_experts, self.top_k, self.renormalize = routing
        rows = split(intermediate_size, tp, "moe_intermediate_size")
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, rows, tp, names) for _ in range(num_experts))
        self.tp = tp
        self.grouped: Experts | None = None

    def merge(self) -> None:
        """Grouped weights from now on, each expert's weights views of them. Call it once
        the model has its final device and dtype (a later ``.to`` copies the views apart)."""
        w13, w2 = self._stacked()
        for e, expert in enumerate(self.experts):
            gate, up, down = expert.linears()
            rows = gate.out_features
            gate.weight.data, up.weight.data = w13[e, :rows], w13[e, rows:]
            down.weight.data = w2[e]
        self.grouped = Experts(w13, w2)

    def quantize_fp8(self, mode: Fp8Mode | None = None) -> None:
        """``--quantization fp8``: every expert's weights rounded to e4m3 with a scale per
        row and kept in the model's dtype (in place: the grouped weights see it). The fused
        MoE kernel has no fp8 path, so the experts run as an fp8 checkpoint's do
        (``fp8_checkpoint``): the same values, dequantized, on unquantized activations."""
        with torch.no_grad():
            for expert in self.experts:
                for lin in expert.linears():
                    lin.weight.copy_(quantize_fp8(lin.weight).dequantized())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size], whole on every rank."""
        ids, weights = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        experts = self.grouped if self.grouped is not None else Experts(*self._stacked())
        return self.tp.all_reduce(kernels.moe_experts(x, experts, ids, weights))

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) copied from the experts' own weights."""
        linears = [e.linears() for e in self.experts]
        w13 = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in linears])
        return w13, torch.stack([d.weight for _, _, d in linears])
