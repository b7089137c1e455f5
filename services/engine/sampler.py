"""Logits -> probabilities -> tokens, per request.

Rows of a batch may mix greedy and sampled requests. A greedy row's distribution is the
one-hot of its argmax, so the same rejection rule serves both. Sampling draws through
each request's own ``torch.Generator``: a seeded request reproduces its tokens whatever
else shares the batch.
"""

from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], top_p [rows] -> renormalized probs keeping, per row, the most
    likely tokens until their mass reaches top_p (at least one token)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32; temperature, top_p [rows] -> probs [rows, vocab].
    Rows with temperature 0 are one-hot at the argmax."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        probs = torch.where((top_p < 1)[:, None], top_p_filter(probs, top_p), probs)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [rows, vocab] -> tokens [rows] int64. A row whose generator is None takes the
    argmax (greedy rows are one-hot, so this is exact for them)."""
    noise = torch.ones_like(probs)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    # argmax(p / E) with E ~ Exp(1) draws from p (exponential race)
    return (probs / noise).argmax(dim=-1)


def uniforms(rows: int, count: int, generators: list[torch.Generator | None],
             device: torch.device) -> torch.Tensor:
    """[rows, count] U[0, 1) draws; rows without a generator get zeros."""
    out = torch.zeros(rows, count, device=device)
    for i, g in enumerate(generators):
        if g is not None and count:
            out[i].uniform_(generator=g)
    return out
