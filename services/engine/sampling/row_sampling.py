"""The sampling state of each row of a logits batch, and the logprobs of emitted tokens.

A row is one request at one position. ``extra`` are the tokens between the request's
last output token and that position: the drafts d_1..d_j before verify position j, or the
drafter's own earlier drafts in its chain. Penalties and ``min_tokens`` read prompt +
output + extra, so the target at verify position j sees exactly the state target-only
decoding has there once d_1..d_j are accepted, which keeps greedy speculation lossless.
The drafter's q takes the same transforms (a q closer to p accepts more drafts; any q
whose draws it reports exactly keeps sampling lossless). A request with a grammar bans, at
each row, what its grammar refuses after output + extra (``grammar/matcher.py``): the
target's rows and the drafter's alike, so no draft breaks the grammar.
"""

from __future__ import annotations

import torch

from services.engine.request import Request, TokenLogprob
from services.engine.sampling.sampler import Penalties, RowParams, logprobs_of

Row = tuple[Request, list[int]]  # (request, extra tokens before the row's position)


def row_params(
    requests: list[Request],
    extras: list[list[list[int]]],
    vocab: int,
    eos_ids: frozenset[int],
    device: torch.device,
) -> RowParams:
    """RowParams for request i's rows, one per entry of extras[i] (its extra tokens), in
    request order. Per-request values are expanded to rows on the tensor side; the tensors
    of a transform no request uses are left None."""
    sp = [r.sampling for r in requests]
    counts = [len(e) for e in extras]
    repeat = torch.tensor(counts) if any(n != 1 for n in counts) else None

    def per_row(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return to_device(t.repeat_interleave(repeat) if repeat is not None else t, device)

    top_k = per_row([s.top_k for s in sp], torch.long) if any(s.top_k > 0 for s in sp) else None
    min_p = per_row([s.min_p for s in sp]) if any(s.min_p > 0 for s in sp) else None
    penalties = banned = None
    any_grammar = any(r.grammar is not None for r in requests)
    if any(s.penalized or s.min_tokens for s in sp) or any_grammar:
        rows = [(r, x) for r, e in zip(requests, extras, strict=True) for x in e]
        penalties = _penalties(rows, vocab, device)
        banned = _banned(rows, vocab, eos_ids)
        if any_grammar:
            banned = with_grammar(banned, requests, extras, vocab)
        banned = banned.to(device) if banned is not None else None
    return RowParams(
        per_row([s.temperature for s in sp]),
        per_row([s.top_p for s in sp]),
        top_k,
        min_p,
        penalties,
        banned,
        top_k_max=max((s.top_k for s in sp), default=0),
        any_greedy=any(s.greedy for s in sp),
        any_top_p=any(s.top_p < 1 for s in sp),
        any_grammar=any_grammar,
    )


def request_seeds(requests: list[Request], device: torch.device) -> torch.Tensor:
    """[batch] int64: each request's seed (0 for greedy ones, whose draws are one-hot)."""
    return to_device(torch.tensor([r.seed or 0 for r in requests], dtype=torch.int64), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device: a blocking copy
    (``.to(device)``) synchronizes the stream first, so the host would wait for the
    forward queued before it (a device step's sampling, an overlapped step's successor)."""
    return t.to(device, non_blocking=True)


def _penalties(rows: list[Row], vocab: int, device: torch.device) -> Penalties | None:
    idx = [i for i, (r, _) in enumerate(rows) if r.sampling.penalized]
    if not idx:
        return None
    seen = torch.zeros(len(idx), vocab, dtype=torch.bool)
    counts = torch.zeros(len(idx), vocab)
    base: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per request: (seen, counts)
    for m, i in enumerate(idx):
        req, extra = rows[i]
        if id(req) not in base:
            s, c = torch.zeros(vocab, dtype=torch.bool), torch.zeros(vocab)
            s[torch.tensor(req.prompt_ids + req.output_ids, dtype=torch.long)] = True
            c.index_add_(0, torch.tensor(req.output_ids, dtype=torch.long), torch.ones(len(req.output_ids)))
            base[id(req)] = (s, c)
        s, c = base[id(req)]
        seen[m], counts[m] = s, c
        if extra:
            ids = torch.tensor(extra, dtype=torch.long)
            seen[m, ids] = True
            counts[m].index_add_(0, ids, torch.ones(len(extra)))
    sp = [rows[i][0].sampling for i in idx]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
    return Penalties(
        torch.tensor(idx, device=device),
        as_tensor([s.repetition_penalty for s in sp]),
        as_tensor([s.presence_penalty for s in sp]),
        as_tensor([s.frequency_penalty for s in sp]),
        seen.to(device),
        counts.to(device),
    )


def with_grammar(
    banned: torch.Tensor | None, requests: list[Request], extras: list[list[list[int]]], vocab: int
) -> torch.Tensor:
    """[rows, vocab] bool on the host: ``banned`` (min_tokens' stop tokens, or None) and
    what each request's grammar refuses at its rows. Where the two leave nothing (the
    grammar complete, min_tokens not reached), the grammar wins."""
    parts = []
    for req, e in zip(requests, extras, strict=True):
        if req.grammar is None:
            parts.append(torch.zeros(len(e), vocab, dtype=torch.bool))
        else:
            parts.append(req.grammar.banned(e))
    grammar = torch.cat(parts)
    if banned is None:
        return grammar
    both = banned | grammar
    return torch.where(both.all(dim=-1, keepdim=True), grammar, both)


def _banned(rows: list[Row], vocab: int, eos_ids: frozenset[int]) -> torch.Tensor | None:
    """[rows, vocab] bool: the stop tokens (EOS unless ignored, stop_token_ids) of rows whose
    request has generated fewer than min_tokens tokens before that row."""
    banned = None
    for i, (req, extra) in enumerate(rows):
        sp = req.sampling
        if len(req.output_ids) + len(extra) >= sp.min_tokens:
            continue
        ids = [t for t in (*(() if sp.ignore_eos else eos_ids), *sp.stop_token_ids) if 0 <= t < vocab]
        if ids:
            if banned is None:
                banned = torch.zeros(len(rows), vocab, dtype=torch.bool)
            banned[i, ids] = True
    return banned


def token_logprobs(logits: torch.Tensor, chosen: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """logits [rows, vocab] raw; chosen and top_n per row -> one TokenLogprob per row."""
    if not chosen:
        return []
    ids = torch.tensor(chosen, dtype=torch.long, device=logits.device)
    lp, top_lp, top_ids = logprobs_of(logits, ids, max(top_n))
    lp, top_lp, top_ids = lp.tolist(), top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, lp[i], top_ids[i][:n], top_lp[i][:n])
        for i, (t, n) in enumerate(zip(chosen, top_n, strict=True))
    ]
