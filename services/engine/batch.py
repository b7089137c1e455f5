"""What the model runner takes and returns: plain data.

A span is one request's query block: positions [start, start + len(token_ids)). KV is
written only at positions >= ``write_start``: below it the pages are shared prefix-cache
pages (or pages whose KV is already exact) and the span runs only to produce hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class Span:
    request_id: str
    start: int  # position of token_ids[0]
    token_ids: list[int]
    write_start: int = 0


@dataclass(slots=True)
class TargetRun:
    """A target forward's outputs. A graphed verify forward also gives its head's logits
    and greedy verdict (``cuda_graphs.DecodeGraphs``): views of the graph's static
    outputs, valid until that graph's next replay."""

    hidden: torch.Tensor  # [num_tokens, hidden_size], final-normed
    features: torch.Tensor | None  # [num_tokens, hidden_size]: f = fc(aux), or None
    logits: torch.Tensor | None = None  # [num_tokens, vocab_size] in the model's dtype
    verdict: torch.Tensor | None = None  # [num_tokens, 3] int64: see rejection.greedy_verdict


@dataclass(slots=True)
class StepResult:
    """What a decode step gives ``RequestProgress.advance_decode``, per request i: its
    emitted tokens and their logprobs, and its rows offsets[i]:offsets[i + 1] of ``run``.
    ``caught_up`` False: the drafter's catch-up was left for a later step (a step without
    drafts; see ``device_step.lags_catch_up``)."""

    emitted: list[list[int]]
    logprobs: list[list]  # [request][token] TokenLogprob
    run: TargetRun
    offsets: list[int]
    caught_up: bool = True


class GraphedForwards(Protocol):
    """Decode-step forwards the runner hands over when they fit (``cuda_graphs.py``);
    each returns None when the spans do not fit a captured shape."""

    def run_target(self, spans: list[Span]) -> TargetRun | None: ...

    def run_drafter(self, spans: list[Span], hidden: torch.Tensor) -> torch.Tensor | None: ...
