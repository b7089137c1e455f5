"""Overlapped speculative steps: drafting step n + 1 launched before step n is read.

``overlap.py`` does this for target-only steps, whose successor needs only step n's
tokens. A drafting step's successor needs more of step n's verdict, all of it on the
device once step n is queued (K drafts, a accepted, the next token t; ``device_step.py``
for the step itself):
- each request's n' = n + a + 1 (the chain's n, from which the graph derives the drafter's
  and the target's positions, slots and sequence lengths) and t_{n'} = t (the verify's
  first token);
- the drafter's catch-up span: the a + 1 emitted tokens [d_1 .. d_a, t] at positions
  n + 1 .. n', with the target's features of the verify rows 0 .. a, widened at the front to
  K + 1 rows as ``chain_catch_up`` widens them (first position n' - K, K - a padding rows).
These are a few gathers on the device, written over the uploaded inputs in stream order;
the host uploads only the block tables (extended for K + 1 more tokens than step n needs)
and the draws' seeds and transforms, which do not change. Then one replay, as for any
drafting step, and the verdict into tensors of its own and to pinned host memory. Reading
step n waits on its event alone.

A request that finished (or was aborted) at step n drops its row of n + 1 and is left out of
n + 2 (its rows of the carried tensors are gathered away). A request that joined since (a
transfer landed) rides n + 1 after them, its catch-up span from the host.
Who takes part: requests on the device at the chain's K (``device_step.on_device``), at
least K - 1 tokens into their context (the widened catch-up span starts at n' - K >= 0 for
any a). Logprobs, when asked for, are computed on the device (``overlap_logprobs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.batch import StepResult, TargetRun
from services.engine.device.chain_catch_up import PendingSpans
from services.engine.device.cuda_graphs import DecodeGraphs
from services.engine.device.device_step import (
    DevicePlan,
    chain_sampling,
    drawn_verdict,
    on_device,
    pending_spans,
    position_draws,
    verify_probs,
)
from services.engine.device.draft_chain import ChainRows
from services.engine.device.overlap import host_copy
from services.engine.device.overlap_logprobs import QueuedLogprobs, queue_logprobs, step_logprobs
from services.engine.request import Request, Status
from services.engine.sampling.row_sampling import to_device


@dataclass(slots=True)
class SpecInFlight:
    """A launched drafting step not yet read; per request (row), on the device: its n, K
    drafts, accepted count a and next token t; on the host once ``ready``: [drafts | a | t]."""

    decode: list[Request]
    starts: torch.Tensor  # [batch] int64: n
    drafts: torch.Tensor  # [batch, K] int64
    accepted: torch.Tensor  # [batch] int64: a
    next_tokens: torch.Tensor  # [batch] int64: t
    host: torch.Tensor  # [batch, K + 2] int64 (pinned on CUDA), valid once `ready` is reached
    ready: torch.cuda.Event | None  # recorded after the host copies; None off CUDA
    run: TargetRun  # the verify forward's hidden rows and features (copies), K + 1 rows a request
    logprobs: QueuedLogprobs | None = None  # of the requests that ask for them

    @property
    def k(self) -> int:
        return self.drafts.shape[1]

    def going_on(self) -> list[int]:
        """The rows whose request still decodes: not finished or aborted since the launch."""
        return [i for i, r in enumerate(self.decode) if r.status is Status.DECODE]


def spec_overlaps(req: Request, k: int) -> bool:
    """Whether ``req`` may run in an overlapped drafting step of ``k`` drafts."""
    return on_device(req, k) and req.num_computed + 1 >= k


@torch.inference_mode()
def launch_spec(
    graphs: DecodeGraphs,
    plan: DevicePlan,
    decode: list[Request],
    forced: int,
    after: SpecInFlight | None = None,
) -> SpecInFlight | None:
    """Queue a drafting step of the chain's K over ``decode`` without reading it; ``forced``:
    forced acceptance (benchmarks only), -1 = off. ``after`` None: from the host's state.
    Else the step after ``after``: ``decode`` starts with ``after``'s requests that still
    decode, in its order, whose pages the caller has extended by K + 1 more tokens; the
    requests past them joined since (a transfer landed) start from the host's state. None
    when the batch does not fit, or a pending span from the host does not fit the chain's
    catch-up stage."""
    chain, batch = graphs.chain, len(decode)
    went_on = len(after.going_on()) if after is not None else 0
    joined = decode[went_on:]
    pending = pending_spans(joined) if joined else None
    if pending is not None and not chain.catch.fits(pending):
        return None
    graphs.force_acceptance(forced)
    sampling = chain_sampling(decode, all(r.sampling.greedy for r in decode))
    starts = [0] * went_on + [r.num_computed for r in joined]
    lasts = [0] * went_on + [r.last_token for r in joined]
    rows = ChainRows(starts, lasts, plan.draft_table, plan.target_tables)
    if after is None:
        chained = chain.run(rows, pending, sampling)
        n = to_device(torch.tensor(starts), graphs.runner.device)
    else:
        loaded = chain.load(rows, sampling)
        if loaded is None:
            return None
        bucket, draw = loaded
        n, last, ids, padded, hidden = carried(after)
        if pending is not None:  # the joined rows' spans from the host, the first rows' after
            chain.catch.load(with_placeholders(pending, went_on, chain.k), bucket)
        chain.go_on(n, last)
        chain.catch.load_device(ids, padded, hidden, None if pending is not None else bucket)
        chained = chain.replay(bucket, draw, True, batch)
        if joined:
            n = torch.cat([n, to_device(torch.tensor(starts[went_on:]), n.device)])
    if chained is None:
        return None
    run = graphs.verified(batch)
    accepted, next_tokens = verdict(decode, run, chained, n, forced)
    drafts = chained[0].clone()  # the chain's `out`: the next replay overwrites it
    packed = torch.cat([drafts, accepted[:, None], next_tokens[:, None]], dim=1)  # [batch, K + 2]
    chosen = emitted_rows(drafts, accepted, next_tokens)  # [batch, K + 1]
    logprobs = queue_logprobs(decode, run.logits.view(batch, chosen.shape[1], -1), chosen)
    kept = TargetRun(run.hidden, run.features)
    return SpecInFlight(decode, n, drafts, accepted, next_tokens, *host_copy(packed), kept, logprobs)


def emitted_rows(drafts: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """[batch, K + 1] int64: each request's emitted tokens [d_1 .. d_a, t] from drafts
    [batch, K], a and t [batch], then what is left of its drafts (not emitted)."""
    padded = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    return padded.scatter(1, accepted[:, None], next_tokens[:, None])


def verdict(
    decode: list[Request],
    run: TargetRun,
    chained: tuple[torch.Tensor, torch.Tensor | None],
    n: torch.Tensor,
    forced: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, t) [batch] int64 on the device, as ``device_step`` decides them from the chain's
    (drafts [batch, K], q [batch, K, V] or None): a greedy batch from the verify graph's
    verdict, a sampled one by the draws keyed at ``n``."""
    drafts, q = chained
    batch, k = drafts.shape
    if q is None and all(r.sampling.greedy for r in decode):
        rows = run.verdict.view(batch, k + 1, 3)  # per verified token: id, argmax, a
        accepted = rows[:, 0, 2].clone()  # a copy: the graph's outputs are overwritten by its next replay
        return accepted, rows[torch.arange(batch, device=rows.device), accepted, 1]
    p = verify_probs(decode, run.logits.float(), k)  # logits [batch * (K + 1), V]
    drawn = drawn_verdict(p, q, drafts, position_draws(decode, n, n.device), forced)
    return drawn.num_accepted, drawn.next_tokens


def with_placeholders(pending: PendingSpans, count: int, k: int) -> PendingSpans:
    """``pending`` after ``count`` placeholder spans (one token at position K, a zero
    feature), whose catch-up inputs the device writes over (``ChainCatchUp.load_device``)."""
    zeros = pending.features.new_zeros(count, pending.features.shape[1])
    return PendingSpans(
        [k] * count + pending.starts, [[0]] * count + pending.tokens, torch.cat([zeros, pending.features])
    )


def carried(
    after: SpecInFlight,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``after``'s going-on rows hand their next step, on the device: n' [m], t [m],
    and the catch-up stage's ids [m, K + 1], (first position, padding rows) [m, 2] and
    hidden [m * (K + 1), hidden_size] (see the module's docstring)."""
    k, keep = after.k, after.going_on()
    features = after.run.features.view(len(after.decode), k + 1, -1)  # [batch, K + 1, H]
    tensors = (after.starts, after.drafts, after.accepted, after.next_tokens, features)
    if len(keep) < len(after.decode):
        index = to_device(torch.tensor(keep), after.starts.device)
        tensors = tuple(t.index_select(0, index) for t in tensors)
    n, drafts, a, t, features = tensors
    m, span = n.shape[0], k + 1
    emitted = emitted_rows(drafts, a, t)
    pad = k - a  # [m]: front rows that only widen the span
    j = torch.arange(span, device=n.device)[None, :] - pad[:, None]  # [m, K + 1]: emitted index
    at = j.clamp(min=0)
    ids = torch.where(j >= 0, emitted.gather(1, at), 0)
    hidden = features.gather(1, at[..., None].expand(-1, -1, features.shape[-1]))
    next_n = n + a + 1
    padded = torch.stack([next_n - k, pad], dim=1)
    return next_n, t, ids, padded, hidden.reshape(m * span, -1)


def read_spec(step: SpecInFlight) -> StepResult:
    """Wait for ``step``'s verdict (not for what was queued after it) and give it as the
    general path's results: accepted drafts then t per request, and their logprobs when
    asked for."""
    if step.ready is not None:
        step.ready.synchronize()
    k = step.k
    emitted = [row[: row[k]] + [row[k + 1]] for row in step.host.tolist()]
    offsets = [i * (k + 1) for i in range(len(emitted) + 1)]
    return StepResult(emitted, step_logprobs(step.logprobs, step.decode, emitted), step.run, offsets)
