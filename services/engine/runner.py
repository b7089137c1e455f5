"""Runs the target and the drafter over batches of contiguous position spans.

Spans (``services/engine/batch.py``) of one forward are concatenated (varlen); each
attends its own block-table row of every layer group the model's layers form (the
target's groups, each with its window; the drafter's one), and writes KV only from its
``write_start``. Uniform decode-step batches go through ``graphs`` when the engine set
them (CUDA graphs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from kvcore import DRAFT_GROUP, TARGET_GROUP, KVCacheManager, KVPools, Owner
from kvcore.ops import PagedBatch, slot_mapping_for
from services.engine.batch import GraphedForwards, Span, TargetRun
from services.engine.lockstep import Lockstep
from services.engine.models import (
    Eagle3Drafter,
    GroupContext,
    LayerContexts,
    PagedContext,
    TargetModel,
    layer_contexts,
)
from services.engine.models.eagle import DRAFT_KEY_START
from services.engine.sampling.sampler import argmax_rows

__all__ = ["DRAFT_GROUP", "TARGET_GROUP", "ModelRunner", "Span", "TargetRun"]


class ModelRunner:
    def __init__(
        self,
        target: TargetModel,
        drafter: Eagle3Drafter | None,
        manager: KVCacheManager,
        pools: KVPools,
        device: torch.device,
    ) -> None:
        """``pools``: the tensors ``manager``'s page ids index."""
        self.target, self.drafter, self.manager, self.device = target, drafter, manager, device
        self.kv_pools = pools
        self.target_groups = target.kv_layer_groups()  # the manager's target groups, in its order
        self.draft_window = drafter.config.sliding_window if drafter is not None else 0
        self.graphs: GraphedForwards | None = None  # set by the engine when it captures graphs
        self.lockstep: Lockstep | None = None  # rank 0 of a TP group: publishes each forward

    @torch.inference_mode()
    def run_target(self, spans: list[Span]) -> TargetRun:
        if self.graphs is not None and (run := self.graphs.run_target(spans)) is not None:
            return run
        ctx = self.target_contexts(spans)
        ids, positions = self._inputs(spans)
        aux_ids = self.drafter.config.aux_layer_ids if self.drafter is not None else ()
        if self.lockstep is not None:
            self.lockstep.publish(Owner.TARGET, ids, positions, ctx, aux_ids)
        out = self.target(ids, positions, ctx, aux_ids)
        features = self.drafter.project(out.aux) if self.drafter is not None else None
        return TargetRun(out.hidden, features)

    @torch.inference_mode()
    def run_drafter(self, spans: list[Span], hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden_size]: the h_j inputs -> g [num_tokens, hidden_size]."""
        if self.graphs is not None and (g := self.graphs.run_drafter(spans, hidden)) is not None:
            return g
        ctx = self.context(DRAFT_GROUP, spans, self.draft_window, DRAFT_KEY_START)
        ids, positions = self._inputs(spans)
        if self.lockstep is not None:
            layers = tuple(range(self.drafter.config.num_hidden_layers))
            draft = LayerContexts([GroupContext(DRAFT_GROUP, layers, ctx)])
            self.lockstep.publish(Owner.DRAFT, ids, positions, draft, hidden=hidden)
        return self.drafter(ids, hidden, positions, ctx, self.target)

    @torch.inference_mode()
    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> [n, vocab_size] float32."""
        return self.target.head(hidden).float()

    @torch.inference_mode()
    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.drafter.compute_logits(g, self.target)

    def draft_greedy(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """g [b, hidden_size] -> [b] int64, the argmax of ``draft_logits(g)``, taken over
        the drafter's own vocabulary: no full-vocabulary logits are built. None when its
        draft-to-target map is not increasing (the first maximum could then differ)."""
        ids = self.drafter.target_ids()
        if ids is not None and not bool((ids[1:] > ids[:-1]).all()):
            return None

        @torch.inference_mode()
        def greedy(g: torch.Tensor) -> torch.Tensor:
            best = argmax_rows(self.drafter.own_head(g, self.target))  # [b] draft ids
            return best if ids is None else ids[best]

        return greedy

    def target_contexts(self, spans: list[Span]) -> LayerContexts:
        """The target's contexts over ``spans``: one per layer group, with its window."""
        groups = self.target_groups
        return layer_contexts(groups, [self.context(g.name, spans, g.window) for g in groups])

    def context(self, group: str, spans: list[Span], window: int, key_start: int = 0) -> PagedContext:
        """``group``'s paged context over ``spans``. Its index tensors (block table, slots,
        sequence lengths, query starts) are computed on the host in numpy and uploaded one
        copy each: on a GPU, small device ops and the reads they need would cost an eager
        forward (a prompt's) more host time than its kernels take."""
        lengths = np.array([len(s.token_ids) for s in spans], dtype=np.int64)
        starts = np.array([s.start for s in spans], dtype=np.int64)
        table = self.manager.block_tables([s.request_id for s in spans], group)  # host [batch, width]
        slots = slot_mapping_for(table, starts, lengths, self.manager.tokens_per_page).numpy()
        positions = span_positions(starts, lengths)
        write_start = np.repeat(np.array([s.write_start for s in spans], dtype=np.int64), lengths)
        slots = np.where(positions >= write_start, slots, -1)  # [num_tokens]: before write_start, kept
        query_start_loc = np.zeros(len(spans) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(lengths)
        batch = PagedBatch(
            table.to(self.device),
            self._upload((starts + lengths).astype(np.int32)),
            int(lengths.max(initial=0)),
            self._upload(query_start_loc),
            window,
            key_start,
        )
        return PagedContext(self.kv_pools.tensor(group), batch, self._upload(slots))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device)

    def _inputs(self, spans: list[Span]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [num_tokens] int64 on the device. The ids go through numpy: a
        2,048-token prompt step's list took 130 us through ``torch.tensor``, 30 this way."""
        count = sum(len(s.token_ids) for s in spans)
        ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in spans), np.int64, count)
        return self._upload(ids), self._positions(spans)

    def _positions(self, spans: list[Span]) -> torch.Tensor:
        lengths = np.array([len(s.token_ids) for s in spans], dtype=np.int64)
        return self._upload(span_positions(np.array([s.start for s in spans], dtype=np.int64), lengths))


def span_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] int64: positions starts[b] .. starts[b] + lengths[b] - 1 of every span b,
    concatenated."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
