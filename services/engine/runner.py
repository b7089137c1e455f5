"""Runs the target and the drafter over batches of contiguous position spans.

A span is one request's query block: positions [start, start + len(token_ids)). Spans of
one forward are concatenated (varlen); each attends its own block-table row. KV is
written only at positions >= ``write_start``: below it the pages are shared prefix-cache
pages (or pages whose KV is already exact) and the span runs only to produce hidden
states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore import KVCacheManager
from kvcore.ops import slot_mapping_for
from services.engine.models import Eagle3Drafter, LlamaForCausalLM, PagedContext
from services.engine.models.eagle import DRAFT_KEY_START

TARGET_GROUP = "target"
DRAFT_GROUP = "draft"


@dataclass(slots=True)
class Span:
    request_id: str
    start: int  # position of token_ids[0]
    token_ids: list[int]
    write_start: int = 0


@dataclass(slots=True)
class TargetRun:
    hidden: torch.Tensor  # [num_tokens, hidden_size], final-normed
    features: torch.Tensor | None  # [num_tokens, hidden_size]: f = fc(aux), or None


class ModelRunner:
    def __init__(
        self,
        target: LlamaForCausalLM,
        drafter: Eagle3Drafter | None,
        manager: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.target, self.drafter, self.manager, self.device = target, drafter, manager, device
        self.target_window = target.config.sliding_window
        self.draft_window = drafter.config.sliding_window if drafter is not None else 0
        self.graphs = None  # DecodeGraphs once capture_cuda_graphs ran
        self.lockstep = None  # rank 0 of a tensor-parallel group: publishes each forward

    @torch.inference_mode()
    def capture_cuda_graphs(
        self, verify_len: int, max_batch: int, max_model_len: int, capture: bool = True
    ) -> None:
        """Route uniform decode-step forwards through CUDA graphs (services/engine/
        cuda_graphs.py); ``capture=False`` runs the same static-buffer path eagerly."""
        from services.engine.cuda_graphs import DecodeGraphs  # it imports this module

        self.graphs = DecodeGraphs(self, verify_len, max_batch, max_model_len, capture)
        self.graphs.capture()

    @torch.inference_mode()
    def run_target(self, spans: list[Span]) -> TargetRun:
        if self.graphs is not None and (run := self.graphs.run_target(spans)) is not None:
            return run
        ctx = self.context(TARGET_GROUP, spans, window=self.target_window)
        ids, positions = self._inputs(spans)
        aux_ids = self.drafter.config.aux_layer_ids if self.drafter is not None else ()
        if self.lockstep is not None:
            self.lockstep.publish("target", ids, positions, ctx, TARGET_GROUP, aux_ids)
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
            self.lockstep.publish("draft", ids, positions, ctx, DRAFT_GROUP, hidden=hidden)
        return self.drafter(ids, hidden, positions, ctx, self.target)

    @torch.inference_mode()
    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    @torch.inference_mode()
    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.drafter.compute_logits(g, self.target)

    def context(self, group: str, spans: list[Span], window: int, key_start: int = 0) -> PagedContext:
        lengths = [len(s.token_ids) for s in spans]
        starts = [s.start for s in spans]
        block_table = self.manager.block_tables([s.request_id for s in spans], group, self.device)
        slots = slot_mapping_for(block_table, starts, lengths, self.manager.page)
        write_start = torch.tensor([s.write_start for s in spans], device=self.device)
        lens = torch.tensor(lengths, device=self.device)
        positions = self._positions(spans)
        slots = torch.where(positions >= write_start.repeat_interleave(lens), slots, -1)
        qsl = torch.zeros(len(spans) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lengths).cumsum(0)
        seq_lens = torch.tensor([s.start + n for s, n in zip(spans, lengths, strict=True)], dtype=torch.int32)
        return PagedContext(
            self.manager.pools[group],
            block_table,
            qsl.to(self.device),
            seq_lens.to(self.device),
            slots,
            window,
            key_start,
        )

    def _inputs(self, spans: list[Span]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.long)
        return ids.to(self.device), self._positions(spans)

    def _positions(self, spans: list[Span]) -> torch.Tensor:
        pos = [p for s in spans for p in range(s.start, s.start + len(s.token_ids))]
        return torch.tensor(pos, dtype=torch.long, device=self.device)
