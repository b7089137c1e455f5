"""Speculative verification (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling").

For one request with K drafts x_1..x_K drawn from the drafter's q_i, and the target's p_i
at the K + 1 verified positions:
- *accepted*: x_i is kept while u_i < p_i(x_i) / q_i(x_i) (u_i ~ U[0, 1));
- *recovered*: at the first rejection i, one token is drawn from norm(max(0, p_i - q_i));
- *bonus*: when all K are kept, one token is drawn from p_{K+1}.
The emitted tokens then follow the target's distribution exactly. Greedy rows have
one-hot p and q, which turns the rule into "keep drafts while they equal the target's
argmax, then emit the target's argmax", whatever their draws. Draws are keyed by position
(``noise.py``): u_i by x_i's position n + i in lane ACCEPT, the recovered or bonus token by
its own position in lane TARGET. Nothing here reads the device back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.sampling.noise import ACCEPT, TARGET, uniforms
from services.engine.sampling.sampler import sample


@dataclass(slots=True)
class Draws:
    """Where a verify step's draws are keyed: per request its seed and n, the position of
    its last token t_n (draft x_i sits at n + i)."""

    seeds: torch.Tensor  # [batch] int64
    starts: torch.Tensor  # [batch] int64
    sampled: bool = True  # False: every request is greedy (one-hot p and q), no draw is read

    def accept_uniforms(self, k: int) -> torch.Tensor:
        """[batch, k] u_i for the drafts at positions n + 1 .. n + k (zeros when no request
        samples: a one-hot rule keeps x iff p(x) > 0 for any u < 1)."""
        if not self.sampled:
            return torch.zeros(self.starts.shape[0], k, device=self.starts.device)
        positions = self.starts[:, None] + torch.arange(1, k + 1, device=self.starts.device)
        return uniforms(self.seeds, positions, ACCEPT)

    def next_token(self, probs: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        """probs [batch, vocab] -> [batch]: the token at position n + a + 1."""
        return sample(probs, self.seeds, self.starts + num_accepted + 1, TARGET, self.sampled)


@dataclass(slots=True)
class Verdict:
    num_accepted: torch.Tensor  # [batch] int64, in [0, K]
    next_tokens: torch.Tensor  # [batch] int64: the recovered or bonus token


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draws: Draws,
    num_drafts: torch.Tensor | None = None,
) -> Verdict:
    """target_probs [batch, K + 1, vocab]; draft_probs [batch, K, vocab]; draft_ids
    [batch, K]. ``num_drafts`` [batch] (default K): row i verifies only its first k_i drafts; its
    target_probs past position k_i and draft_probs past k_i - 1 are never read."""
    batch, k = draft_ids.shape
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0]  # [batch, K]
    q_draft = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    u = draws.accept_uniforms(k)  # [batch, K]
    keep = u * q_draft < p_draft  # u < p / q, with q > 0 for a drawn draft
    if num_drafts is not None:
        keep &= torch.arange(k, device=keep.device) < num_drafts[:, None]
    num_accepted = keep.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    rows = torch.arange(batch, device=draft_ids.device)
    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    q_next = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)[rows, num_accepted]
    if num_drafts is not None:  # all k_i kept: the bonus token is drawn from p alone
        q_next = torch.where((num_accepted == num_drafts)[:, None], 0.0, q_next)
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual: the rejection had probability 0, fall back to p
    final = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return Verdict(num_accepted, draws.next_token(final, num_accepted))


def forced_verdict(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draws: Draws,
    accept: int,
    num_drafts: torch.Tensor | None = None,
) -> Verdict:
    """Benchmarks only, NOT lossless: keep exactly min(accept, k_i) drafts whatever p and q
    say, then draw one token from the target's p at the next position. Shapes as
    :func:`rejection_sample`; ``accept`` >= 0."""
    batch, k = draft_ids.shape
    limit = num_drafts if num_drafts is not None else torch.full((batch,), k, device=draft_ids.device)
    num_accepted = limit.clamp(max=accept).long()  # [batch]
    rows = torch.arange(batch, device=draft_ids.device)
    return Verdict(num_accepted, draws.next_token(target_probs[rows, num_accepted], num_accepted))


def greedy_accepted(
    drafts: torch.Tensor, best: torch.Tensor, forced: int | torch.Tensor = -1
) -> torch.Tensor:
    """drafts [batch, K], best [batch, K + 1] (the target's argmax per verified position) ->
    accepted [batch] int64: the leading drafts equal to best; min(forced, K) when forced >= 0
    (benchmarks only). ``forced``: an int, or [1] int64 on the device (read there, no sync)."""
    k = drafts.shape[1]
    natural = (drafts == best[:, :k]).long().cumprod(dim=-1).sum(dim=-1)
    if isinstance(forced, int):
        return natural if forced < 0 else torch.full_like(natural, min(forced, k))
    return torch.where(forced >= 0, forced.clamp(max=k), natural)


def greedy_verdict(ids: torch.Tensor, best: torch.Tensor, forced: int | torch.Tensor = -1) -> torch.Tensor:
    """ids, best [batch, K + 1] int64 (the verified tokens [t_n, d_1..d_K] and the target's
    argmax at each) -> [batch * (K + 1), 3] int64, per verified token: its id, its argmax
    and its request's accepted count a (``greedy_accepted``). Request i emits its drafts
    d_1..d_a, then best[i, a]: :func:`greedy_tokens` reads that back from the host copy."""
    accepted = greedy_accepted(ids[:, 1:], best, forced)  # [batch]
    return torch.stack([ids, best, accepted[:, None].expand_as(ids)], dim=-1).view(-1, 3)


def greedy_tokens(rows: list[list[int]], q_len: int) -> list[list[int]]:
    """The emitted tokens per request from :func:`greedy_verdict`'s rows (as a list, on
    the host), ``q_len`` = K + 1 rows per request."""
    out = []
    for start in range(0, len(rows), q_len):
        block = rows[start : start + q_len]
        a = block[0][2]
        out.append([block[j + 1][0] for j in range(a)] + [block[a][1]])
    return out
