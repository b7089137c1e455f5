"""gpt-oss's routed MLP: a router with a bias whose top k logits are softmaxed, and experts
stored as transformers saves them (grouped, gate and up columns interleaved, with biases),
run by :func:`kernels.moe_experts` with the clamped SwiGLU.

Checkpoint layout (per layer, ``mlp.``): ``router.weight`` [E, H], ``router.bias`` [E],
``experts.gate_up_proj`` [E, H, 2I] (column 2i is gate i, 2i + 1 is up i),
``experts.gate_up_proj_bias`` [E, 2I], ``experts.down_proj`` [E, I, H],
``experts.down_proj_bias`` [E, H]. Under tensor parallelism a rank holds the intermediate
columns of its slice and the down bias is added by rank 0 only (the ranks' sum adds it once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import kernels
from services.engine.kernels import Experts
from services.engine.parallel import SINGLE, TensorParallel, split


def route_top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, k] int64, weights [T, k] float32): the k largest logits
    (ties broken as ``torch.topk`` breaks them) softmaxed among themselves, in the logits'
    dtype as transformers computes them."""
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top, dim=-1).float()


class GptOssExperts(nn.Module):
    """The experts' tensors in the checkpoint's layout (this rank's intermediate slice)."""

    SHARDED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def __init__(self, hidden_size: int, num_experts: int, rows: range, tp: TensorParallel) -> None:
        super().__init__()
        inter = len(rows)
        self.rows, self.tp = rows, tp
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, inter, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of gate_up (interleaved pairs 2i, 2i + 1 for i in rows), rows
        of down; the down bias whole on rank 0 and zero elsewhere."""
        lo, hi = self.rows.start, self.rows.stop
        if name == "gate_up_proj":
            return full[:, :, 2 * lo : 2 * hi]
        if name == "gate_up_proj_bias":
            return full[:, 2 * lo : 2 * hi]
        if name == "down_proj":
            return full[:, lo:hi]
        return full if self.tp.rank == 0 else torch.zeros_like(full)

    def grouped(self, limit: float) -> Experts:
        """The kernel's layout: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]."""
        gate_up, bias = self.gate_up_proj, self.gate_up_proj_bias
        w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        b13 = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1).contiguous()
        w2 = self.down_proj.transpose(1, 2).contiguous()
        return Experts(w13, w2, b13, self.down_proj_bias, "clamped_swiglu", limit)


class GptOssMlp(nn.Module):
    """``router`` (whole on every rank) and ``experts``; the ranks' partial sums reduced once."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: tuple[int, int, float],
        tp: TensorParallel = SINGLE,
    ) -> None:
        """``routing``: (experts E, experts per token k, the SwiGLU's clamp limit)."""
        super().__init__()
        num_experts, self.top_k, self.limit = routing
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        rows = split(intermediate_size, tp, "intermediate_size")
        self.experts = GptOssExperts(hidden_size, num_experts, rows, tp)
        self.tp = tp
        self.converted: Experts | None = None

    def merge(self) -> None:
        """The kernel's layout from now on; the checkpoint-layout weights are freed (the
        model no longer saves), the biases kept (the down bias is the kernel's own)."""
        self.converted = self.experts.grouped(self.limit)
        for p in (self.experts.gate_up_proj, self.experts.down_proj):
            p.data = p.data.new_empty(0)

    def quantize_fp8(self, mode: object = None) -> None:
        """``--quantization fp8``: the experts keep their weights (published as MXFP4,
        dequantized at load); only the attention's linears go fp8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size], whole on every rank."""
        ids, weights = route_top_logits(F.linear(x, self.router.weight, self.router.bias), self.top_k)
        experts = self.converted if self.converted is not None else self.experts.grouped(self.limit)
        return self.tp.all_reduce(kernels.moe_experts(x, experts, ids, weights))
