"""Logprobs of an overlapped step's tokens: computed on the device before the successor's
replay overwrites the step's logits, copied to the host with its verdict, read with it.

The values are the synchronous path's (``verify.emitted_logprobs``): ``logprobs_of`` over
the same logits rows and tokens, the top N of the largest N any request of the step asks,
each request keeping its own N. A step verifies Q rows per request (1 without drafts, K + 1
drafting); the rows past a request's emitted tokens are computed and not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.request import Request, TokenLogprob
from services.engine.sampling.row_sampling import to_device
from services.engine.sampling.sampler import logprobs_of


@dataclass(slots=True)
class QueuedLogprobs:
    """The logprobs of the requests that ask for them (batch rows ``asking``), on the host
    once the step's event is reached: chosen [R, Q], top [R, Q, N] and their ids [R, Q, N]."""

    asking: list[int]
    chosen: torch.Tensor
    top: torch.Tensor
    top_ids: torch.Tensor


def queue_logprobs(
    decode: list[Request], logits: torch.Tensor, chosen: torch.Tensor
) -> QueuedLogprobs | None:
    """Queue the logprobs of ``chosen`` [batch, Q] (device) under ``logits`` [batch, Q, V] for
    the requests that ask for them, and their host copies (the caller's event follows);
    None when none asks."""
    asking = [i for i, r in enumerate(decode) if r.sampling.logprobs is not None]
    if not asking:
        return None
    top_n = max(decode[i].sampling.logprobs for i in asking)
    index = to_device(torch.tensor(asking), logits.device)
    rows = logits.index_select(0, index)  # [R, Q, V]
    r, q = rows.shape[:2]
    values = logprobs_of(rows.reshape(r * q, -1), chosen.index_select(0, index).reshape(-1), top_n)
    lp, top, top_ids = (pinned_copy(v.reshape(r, q, *v.shape[1:])) for v in values)
    return QueuedLogprobs(asking, lp, top, top_ids)


def step_logprobs(
    queued: QueuedLogprobs | None, decode: list[Request], emitted: list[list[int]]
) -> list[list[TokenLogprob]]:
    """Per request, the logprobs of its emitted tokens (empty unless it asked), from the
    host copies (read after the step's event)."""
    out: list[list[TokenLogprob]] = [[] for _ in emitted]
    if queued is None:
        return out
    lp, top, top_ids = queued.chosen.tolist(), queued.top.tolist(), queued.top_ids.tolist()
    for r, i in enumerate(queued.asking):
        n = decode[i].sampling.logprobs
        at = zip(emitted[i], lp[r], top_ids[r], top[r], strict=False)  # rows past the emitted: unread
        out[i] = [TokenLogprob(t, v, ids[:n], values[:n]) for t, v, ids, values in at]
    return out


def pinned_copy(values: torch.Tensor) -> torch.Tensor:
    """A host copy of ``values`` queued in stream order (pinned, not waited for, on CUDA)."""
    cuda = values.device.type == "cuda"
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=cuda)
    host.copy_(values, non_blocking=cuda)
    return host
