"""Lockstep forwards across a tensor-parallel group.

Rank 0 runs the whole engine: scheduler, sampling, and every decision of its cache
manager. Before each target or drafter forward it publishes a :class:`ForwardPlan` (token
ids, positions, per layer group the forward attends its block table and slot mapping, the
drafter's hidden inputs, and the pool writes made outside a forward since the last plan:
copied-on-write prefix pages, zeroed draft pages of a reservation); ranks 1.. receive it,
replay the writes and run the same forward on their own heads and pools (:func:`follow`),
in the same order, so each all-reduce of a row-parallel layer pairs up across the ranks.
Page ids are rank 0's: every rank's pools have the same page count and hold, page for
page, its own heads of what rank 0's pages hold. Logits and sampling stay on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvcore import KVPools, Owner, PoolWrite
from kvcore.ops import PagedBatch
from services.engine.models import GroupContext, LayerContexts, PagedContext
from services.engine.parallel import TensorParallel


@dataclass(slots=True)
class GroupPlan:
    """One layer group's part of a forward: the pool it reads and writes, and how."""

    group: str
    layer_ids: tuple[int, ...]  # the model's layers in the group, in its pool's order
    block_table: torch.Tensor  # [batch, max_pages] int32, NULL_PAGE padded
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    window: int = 0
    key_start: int = 0


@dataclass(slots=True)
class ForwardPlan:
    """One forward, as every rank runs it. Tensors travel on the CPU."""

    model: Owner  # which model runs
    groups: list[GroupPlan]  # the layer groups its layers form (the drafter's: one)
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    max_q_len: int  # the longest query: the contexts' PagedBatch.max_q_len
    aux_layer_ids: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size]: the drafter's h_j
    pool_writes: list[PoolWrite] = field(default_factory=list)  # replayed before the forward


class Lockstep:
    """Rank 0's side: publishes each forward before running it."""

    def __init__(self, tp: TensorParallel, pools: KVPools) -> None:
        """``pools``: rank 0's, recording their writes (``KVPools(record=True)``)."""
        self.tp, self.kv_pools = tp, pools

    def publish(
        self,
        model: Owner,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: LayerContexts,
        aux_layer_ids: tuple[int, ...] = (),
        hidden: torch.Tensor | None = None,
    ) -> None:
        """``ctx``: the forward's paged contexts, one per layer group."""
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        first: PagedContext = ctx.groups[0].ctx
        plan = ForwardPlan(
            model,
            [group_plan(g) for g in ctx.groups],
            cpu(input_ids),
            cpu(positions),
            cpu(first.batch.query_start_loc),
            cpu(first.batch.seq_lens),
            first.batch.max_q_len,
            tuple(aux_layer_ids),
            cpu(hidden) if hidden is not None else None,
            self.kv_pools.take_writes(),
        )
        dist.broadcast_object_list([plan], src=0, group=self.tp.object_group)


def group_plan(g: GroupContext) -> GroupPlan:
    """``g``'s paged context, on the CPU."""
    ctx: PagedContext = g.ctx
    batch = ctx.batch
    table, slots = batch.block_table.detach().cpu(), ctx.slot_mapping.detach().cpu()
    return GroupPlan(g.name, g.layer_ids, table, slots, batch.window, batch.key_start)


def attach_lockstep(runner, tp: TensorParallel) -> None:
    """Rank 0 of a group publishes every forward its runner runs."""
    if tp.size > 1 and tp.rank == 0:
        runner.lockstep = Lockstep(tp, runner.kv_pools)


def receive_plan(tp: TensorParallel) -> ForwardPlan:
    """Ranks 1..: block until rank 0 publishes the next forward."""
    box: list[ForwardPlan | None] = [None]
    dist.broadcast_object_list(box, src=0, group=tp.object_group)
    return box[0]


@torch.inference_mode()
def replay(plan: ForwardPlan, runner) -> None:
    """Run ``plan`` on this rank's models and pools (``runner``: its ModelRunner)."""
    pools, device = runner.kv_pools, runner.device
    pools.apply(plan.pool_writes)
    to = lambda t: t.to(device)  # noqa: E731
    qsl, seq_lens = to(plan.query_start_loc), to(plan.seq_lens)

    def batch(g: GroupPlan) -> PagedBatch:
        return PagedBatch(to(g.block_table), seq_lens, plan.max_q_len, qsl, g.window, g.key_start)

    ctx = LayerContexts(
        [
            GroupContext(
                g.group, g.layer_ids, PagedContext(pools.tensor(g.group), batch(g), to(g.slot_mapping))
            )
            for g in plan.groups
        ]
    )
    ids, positions = to(plan.input_ids), to(plan.positions)
    if plan.model is Owner.TARGET:
        runner.target(ids, positions, ctx, plan.aux_layer_ids)
    else:
        runner.drafter(ids, to(plan.hidden), positions, ctx.only(), runner.target)


@dataclass(slots=True)
class Following:
    """What a following thread is doing, read by the rank's event loop: ``replaying`` is
    true while it runs a forward (and so wants the GIL back often), false while it waits
    for the next plan."""

    replaying: bool = False


def follow(runner, tp: TensorParallel, state: Following | None = None) -> None:
    """Ranks 1..: run rank 0's forwards, one after another, forever (on any thread: the
    rank's GPU becomes this thread's current device, which kernels launch on); ``state``
    says when it replays one."""
    if runner.device.type == "cuda":
        torch.cuda.set_device(runner.device)
    state = state or Following()
    while True:
        plan = receive_plan(tp)
        state.replaying = True
        try:
            replay(plan, runner)
        finally:
            state.replaying = False
