"""The speculative step's two model phases: draft K tokens (chain), verify K + 1.

Drafting for a request whose target has valid KV [0, n) (its last token t_n has none):
1. one drafter forward over its pending slots, the last being slot n (t_n with f_{n-1});
   the earlier ones are the catch-up of the previous step's accepted tokens, recomputed
   from true target features. The output at slot n gives draft d_1;
2. K - 1 single-slot forwards: slot n + k - 1 reads (d_{k-1}, g_{n+k-2}) and gives d_k.
Verification runs the target over [t_n, d_1..d_K] at positions n..n + K in the same
forward as the step's prefill chunks. Rejected positions are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.batch import Span, TargetRun
from services.engine.request import PrefillSpan, Request
from services.engine.runner import ModelRunner
from services.engine.sampling.noise import DRAFT
from services.engine.sampling.row_sampling import request_seeds, row_params
from services.engine.sampling.sampler import probs_for_rows, sample


@dataclass(slots=True)
class Drafts:
    token_ids: torch.Tensor  # [batch, K] int64
    probs: torch.Tensor  # [batch, K, vocab] float32: the drafter's q at each draft


def draft(runner: ModelRunner, requests: list[Request], k: int, eos_ids: frozenset[int]) -> Drafts:
    """K drafts for every request (K = the largest num_spec_tokens of the batch; a request
    verifies only its own first num_spec_tokens). q at chain step s takes the request's
    transforms with d_1..d_s counted (row_sampling.py), and d_s is drawn in lane DRAFT at
    its position n + s (noise.py). K = 0 runs the catch-up forward
    alone, so the drafter's KV stays exact for later steps."""
    device = runner.device
    g = catch_up(runner, requests)  # [batch, hidden]
    seeds = request_seeds(requests, device)
    sampled = not all(r.sampling.greedy for r in requests)
    starts = torch.tensor([r.num_computed for r in requests]).to(device)  # n: d_s sits at n + s
    drafted: list[list[int]] = [[] for _ in requests]
    tokens, probs = [], []
    for step in range(k):
        logits = runner.draft_logits(g)  # [batch, vocab]
        params = row_params(requests, [[d] for d in drafted], logits.shape[-1], eos_ids, device)
        q = probs_for_rows(logits, params)
        d = sample(q, seeds, starts + step + 1, DRAFT, sampled)
        tokens.append(d)
        probs.append(q)
        ids = d.tolist()
        drafted = [prev + [t] for prev, t in zip(drafted, ids, strict=True)]
        if step + 1 < k:
            spans = [Span(r.request_id, r.num_computed + step + 1, [ids[i]]) for i, r in enumerate(requests)]
            g = runner.run_drafter(spans, g)
    if not k:
        empty = torch.zeros(len(requests), 0, dtype=torch.long, device=device)
        return Drafts(empty, torch.zeros(len(requests), 0, 0, device=device))
    return Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1))


def catch_up(runner: ModelRunner, requests: list[Request]) -> torch.Tensor:
    """The drafter's forward over each request's pending slots (the last is slot n);
    returns g at slot n, [batch, hidden_size] on the device."""
    spans = [Span(r.request_id, r.pending_start, r.pending_tokens) for r in requests]
    last_rows = (torch.tensor([len(s.token_ids) for s in spans]).cumsum(0) - 1).to(runner.device)
    hidden = torch.cat([f for r in requests for f in r.pending_features]).to(runner.device)
    return runner.run_drafter(spans, hidden)[last_rows]  # [num_pending, hidden] -> [batch, hidden]


def verify_spans(requests: list[Request], drafts: Drafts | None) -> list[Span]:
    """[t_n, d_1..d_k] at positions n..n + k for each request, k its num_spec_tokens."""
    ids = drafts.token_ids.tolist() if drafts is not None else [[] for _ in requests]
    return [
        Span(r.request_id, r.num_computed, [r.last_token, *ids[i][: r.num_spec_tokens]], r.target_write_start)
        for i, r in enumerate(requests)
    ]


def draft_prefill(
    runner: ModelRunner, prefill: list[tuple[Request, PrefillSpan]], run: TargetRun, offsets: list[int]
) -> None:
    """Drafter slots of the prefill chunks' positions: slot j reads t_j and f_{j-1}
    (request i's target rows are ``run.features[offsets[i]:offsets[i + 1]]``)."""
    spans, hidden = [], []
    for i, (req, span) in enumerate(prefill):
        first = (
            req.last_feature
            if req.last_feature is not None and span.start > 0
            else torch.zeros_like(run.features[0])
        )
        hidden += [first[None], run.features[offsets[i] : offsets[i + 1] - 1]]
        spans.append(
            Span(req.request_id, span.start, req.token_range(span.start, span.end), req.draft_write_start)
        )
    runner.run_drafter(spans, torch.cat(hidden))
