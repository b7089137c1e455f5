"""Tensor parallelism (Megatron style) for the target and the drafter.

Every rank holds a slice of each attention and MLP block, and the residual stream whole:
- q/k/v and gate/up are column-parallel: rank r keeps the output rows of its query heads,
  its KV heads and its slice of the intermediate size; no communication;
- o and down are row-parallel: rank r keeps the matching input columns, and the partial
  outputs are summed over the ranks by one all-reduce per block (a bias is added after);
- KV heads split like query heads; with fewer KV heads than ranks a rank holds the one KV
  head its query heads read, replicated on tp / num_kv_heads ranks
  (:func:`kvcore.transfer.heads_of_rank`, the rule the transfer uses too);
- embeddings, norms, the drafter's ``fc`` and every LM head are replicated. Logits are
  computed on rank 0 only (it samples), so the head costs no communication.
A checkpoint loads whole on every rank, which then keeps the slices it owns
(:func:`shard_state_dict`). Size 1 is the plain model, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvcore.spec import CacheConfig
from kvcore.transfer import heads_of_rank
from services.engine import kernels

IDLE_TIMEOUT = timedelta(days=365)
"""Collectives wait this long: followers block on the next step for as long as the
worker is idle. A dead rank 0 is noticed through the control channel instead."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its tensor-parallel group. ``group`` reduces activations
    (NCCL on GPU, gloo on CPU); ``object_group`` (gloo) carries step plans."""

    size: int = 1
    rank: int = 0
    group: Any = None
    object_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank must call it): what the whole
        group can agree on, e.g. a KV budget that gives every rank the same page counts."""
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.object_group)
        return int(x.item())


SINGLE = TensorParallel()
_current: TensorParallel = SINGLE


def backend_for(device: str) -> str:
    """The collective backend of a group on ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(
    size: int, rank: int, address: str, backend: str, device: str = "cpu"
) -> TensorParallel:
    """Join the group of ``size`` ranks rendezvousing at ``address`` (host:port, rank 0
    listens). Blocks until every rank has joined. On CUDA the rank's GPU (see
    :func:`rank_device`) becomes its current device, which NCCL uses."""
    global _current
    own = rank_device(device, TensorParallel(size, rank))
    if own.type == "cuda":
        torch.cuda.set_device(own)
    dist.init_process_group(
        backend, init_method=f"tcp://{address}", world_size=size, rank=rank, timeout=IDLE_TIMEOUT
    )
    objects = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    _current = TensorParallel(size, rank, dist.group.WORLD, objects)
    return _current


def tensor_parallel(size: int) -> TensorParallel:
    """The group this process joined, checked against the configured size."""
    if size == 1:
        return SINGLE
    if _current.size != size:
        raise ValueError(
            f"tp_size: {size} configured, but this process joined a group of "
            f"{_current.size} (call init_tensor_parallel first)"
        )
    return _current


def rank_device(device: str, tp: TensorParallel) -> torch.device:
    """The device of this rank: rank r of a group on ``cuda`` (or ``cuda:i``) takes
    GPU r (i + r); CPU ranks share the CPU."""
    base = torch.device(device)
    if base.type != "cuda" or tp.size == 1:
        return base
    return torch.device("cuda", (base.index or 0) + tp.rank)


def split(total: int, tp: TensorParallel, field_name: str) -> range:
    """Rank ``tp.rank``'s contiguous share of ``total`` (which tp must divide)."""
    if total % tp.size:
        raise ValueError(f"{field_name}: {total} does not split over tp {tp.size}")
    per = total // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def head_rows(heads: range, head_dim: int) -> range:
    """Rows of a q/k/v weight (columns of o) that hold ``heads``."""
    return range(heads.start * head_dim, heads.stop * head_dim)


def kv_heads(total: int, tp: TensorParallel) -> range:
    return heads_of_rank(total, tp.size, tp.rank)


class ColumnParallelLinear(nn.Linear):
    """Output rows ``rows`` of a full ``in_features -> out`` linear: input replicated,
    output sharded, no communication."""

    def __init__(self, in_features: int, rows: range, bias: bool = False) -> None:
        super().__init__(in_features, len(rows), bias=bias)
        self.rows = rows

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.rows.start : self.rows.stop]


class RowParallelLinear(nn.Linear):
    """Input columns ``cols`` of a full linear: input sharded, the partial products
    summed over the ranks; the (replicated) bias is added once, after the sum."""

    def __init__(self, cols: range, out_features: int, tp: TensorParallel, bias: bool = False) -> None:
        super().__init__(len(cols), out_features, bias=bias)
        self.cols, self.tp = cols, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, len(cols)] -> [num_tokens, out_features], whole on every rank."""
        if self.tp.size == 1:
            return kernels.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(kernels.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.cols.start : self.cols.stop] if name == "weight" else full


def shard_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors cut to what this rank's model holds (others unchanged): every
    module with a ``shard(name, full)`` cuts its ``SHARDED`` tensors (a linear's weight and
    bias when it names none)."""
    out = dict(state)
    for prefix, module in model.named_modules():
        if not hasattr(module, "shard"):
            continue
        for name in getattr(module, "SHARDED", ("weight", "bias")):
            key = f"{prefix}.{name}" if prefix else name
            if key in out:
                out[key] = module.shard(name, out[key]).contiguous()
    return out


def shard_cache_config(
    config: CacheConfig, total_kv_heads: dict[str, int], tp: TensorParallel
) -> CacheConfig:
    """Each group's pools hold only this rank's KV heads."""
    if tp.size == 1:
        return config
    groups = tuple(replace(g, num_kv_heads=len(kv_heads(total_kv_heads[g.name], tp))) for g in config.groups)
    return replace(config, groups=groups)
