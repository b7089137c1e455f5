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

from services.engine.request import Request
from services.engine.runner import ModelRunner, Span
from services.engine.sampler import probs_from_logits, sample


@dataclass(slots=True)
class Drafts:
    token_ids: torch.Tensor  # [batch, K] int64
    probs: torch.Tensor  # [batch, K, vocab] float32: the drafter's q at each draft


def sampling_tensors(requests: list[Request], device: torch.device,
                     repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(temperature, top_p) [len(requests) * repeat], each request's value repeated."""
    t = torch.tensor([r.sampling.temperature for r in requests], dtype=torch.float32)
    p = torch.tensor([r.sampling.top_p for r in requests], dtype=torch.float32)
    return t.repeat_interleave(repeat).to(device), p.repeat_interleave(repeat).to(device)


def draft(runner: ModelRunner, requests: list[Request], k: int) -> Drafts:
    device = runner.device
    spans = [Span(r.request_id, r.pending_start, r.pending_tokens) for r in requests]
    hidden = torch.cat([r.pending_features for r in requests]).to(device)
    g = runner.run_drafter(spans, hidden)  # [num_pending, hidden]
    last_rows = torch.tensor([len(s.token_ids) for s in spans]).cumsum(0) - 1
    g = g[last_rows.to(device)]  # [batch, hidden]
    temperature, top_p = sampling_tensors(requests, device)
    generators = [r.generator for r in requests]
    tokens, probs = [], []
    for step in range(k):
        q = probs_from_logits(runner.draft_logits(g), temperature, top_p)  # [batch, vocab]
        d = sample(q, generators)
        tokens.append(d)
        probs.append(q)
        if step + 1 < k:
            ids = d.tolist()
            spans = [Span(r.request_id, r.num_computed + step + 1, [ids[i]])
                     for i, r in enumerate(requests)]
            g = runner.run_drafter(spans, g)
    return Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1))


def verify_spans(requests: list[Request], drafts: Drafts | None) -> list[Span]:
    """[t_n, d_1..d_K] at positions n..n + K for each request."""
    ids = drafts.token_ids.tolist() if drafts is not None else [[] for _ in requests]
    return [Span(r.request_id, r.num_computed, [r.tokens[-1], *ids[i]], r.target_write_start)
            for i, r in enumerate(requests)]
