"""Choosing tokens from the target's logits: a prefill's first token, a decode step's verdict.

Verification scores request i's block [t_n, d_1..d_{k_i}]: its row j is sampled with
d_1..d_j counted by its penalties and min_tokens (``row_sampling.py``), and the rejection
sampler keeps at most k_i drafts, then one recovered or bonus token. Logprobs are computed
only for requests that ask for them.
"""

from __future__ import annotations

import torch

from services.engine.batch import TargetRun
from services.engine.request import Request, TokenLogprob
from services.engine.runner import ModelRunner
from services.engine.sampling.noise import TARGET
from services.engine.sampling.row_sampling import request_seeds, row_params, token_logprobs
from services.engine.sampling.sampler import probs_for_rows, sample
from services.engine.speculation.rejection import Draws, forced_verdict, rejection_sample
from services.engine.speculation.speculative import Drafts


def sample_first(
    runner: ModelRunner, reqs: list[Request], hidden: torch.Tensor, eos_ids: frozenset[int]
) -> tuple[list[int], list[list[TokenLogprob]]]:
    """The token after each finished prefill (``hidden`` [batch, hidden_size]: its last
    position's), and its logprobs: a request's ``forced_first`` when set, else sampled."""
    logits = runner.target_logits(hidden)  # [batch, V]
    params = row_params(reqs, [[[]] for _ in reqs], logits.shape[-1], eos_ids, runner.device)
    positions = torch.tensor([r.num_tokens for r in reqs]).to(runner.device)  # the new token's
    seeds = request_seeds(reqs, runner.device)
    sampled = not all(r.sampling.greedy for r in reqs)
    tokens = sample(probs_for_rows(logits, params), seeds, positions, TARGET, sampled).tolist()
    tokens = [t if r.forced_first is None else r.forced_first for r, t in zip(reqs, tokens, strict=True)]
    return tokens, emitted_logprobs(logits, [[t] for t in tokens], reqs)


def verify(
    runner: ModelRunner,
    decode: list[Request],
    drafts: Drafts | None,
    run: TargetRun,
    offsets: list[int],
    eos_ids: frozenset[int],
    forced_acceptance: int = -1,
) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
    """Per request, the tokens a verify step emits (accepted drafts, then one more) and
    their logprobs; request i's rows are ``run.hidden[offsets[i]:offsets[i + 1]]``.
    ``forced_acceptance`` >= 0 (benchmarks only, not lossless): keep exactly that many
    drafts (at most k_i), see :func:`~services.engine.speculation.rejection.forced_verdict`."""
    device = runner.device
    rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in range(len(decode))])
    logits = verified_logits(runner, run, rows.to(device))  # [sum(k_i + 1), V] float32
    draft_ids = (
        drafts.token_ids
        if drafts is not None
        else torch.zeros(len(decode), 0, dtype=torch.long, device=device)
    )
    ks = [min(r.num_spec_tokens, draft_ids.shape[1]) for r in decode]  # the step's K may be lower
    ids = draft_ids.tolist()
    extras = [[ids[i][:j] for j in range(ks[i] + 1)] for i in range(len(decode))]
    params = row_params(decode, extras, logits.shape[-1], eos_ids, device)
    probs = by_position(probs_for_rows(logits, params), ks, draft_ids.shape[1])
    draft_probs = drafts.probs if draft_ids.shape[1] else probs[:, :0]
    num_drafts = torch.tensor(ks, device=device) if min(ks) < draft_ids.shape[1] else None
    starts = torch.tensor([r.num_computed for r in decode]).to(device)
    draws = Draws(request_seeds(decode, device), starts, not all(r.sampling.greedy for r in decode))
    if forced_acceptance >= 0:
        verdict = forced_verdict(probs, draft_ids, draws, forced_acceptance, num_drafts)
    else:
        verdict = rejection_sample(probs, draft_probs, draft_ids, draws, num_drafts)
    accepted, nexts = verdict.num_accepted.tolist(), verdict.next_tokens.tolist()
    emitted = [ids[i][: accepted[i]] + [nexts[i]] for i in range(len(decode))]
    return emitted, emitted_logprobs(logits, emitted, decode, offsets)


def verified_logits(runner: ModelRunner, run: TargetRun, rows: torch.Tensor) -> torch.Tensor:
    """The target's float32 logits at ``rows`` of ``run``: its graph's head when it ran one."""
    if run.logits is None:
        return runner.target_logits(run.hidden[rows])
    return run.logits[rows].float()


def by_position(probs: torch.Tensor, ks: list[int], k: int) -> torch.Tensor:
    """probs [sum(k_i + 1), V] -> [batch, k + 1, V], request i's rows at 0..k_i (rows past
    k_i are zeros; rejection_sample never reads them)."""
    if all(n == k for n in ks):
        return probs.view(len(ks), k + 1, -1)
    out = probs.new_zeros(len(ks), k + 1, probs.shape[-1])
    batch = torch.tensor([i for i, n in enumerate(ks) for _ in range(n + 1)], device=probs.device)
    pos = torch.tensor([j for n in ks for j in range(n + 1)], device=probs.device)
    out[batch, pos] = probs
    return out


def emitted_logprobs(
    logits: torch.Tensor,
    emitted: list[list[int]],
    reqs: list[Request],
    offsets: list[int] | None = None,
) -> list[list[TokenLogprob]]:
    """Per request, the logprobs of its emitted tokens (empty unless sampling.logprobs):
    request i's token j was chosen at logits row offsets[i] + j (offsets None: row i);
    ``logits`` in any float dtype (its rows are read in float32)."""
    out: list[list[TokenLogprob]] = [[] for _ in reqs]
    rows, chosen, top_n, owner = [], [], [], []
    for i, req in enumerate(reqs):
        if req.sampling.logprobs is None:
            continue
        start = offsets[i] if offsets is not None else i
        rows += range(start, start + len(emitted[i]))
        chosen += emitted[i]
        top_n += [req.sampling.logprobs] * len(emitted[i])
        owner += [i] * len(emitted[i])
    if rows:
        index = torch.tensor(rows, device=logits.device)
        for i, lp in zip(owner, token_logprobs(logits[index].float(), chosen, top_n), strict=True):
            out[i].append(lp)
    return out
