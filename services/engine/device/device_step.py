"""A speculative decode step with one host read, for requests the device can sample alone.

Device work, in stream order, with no read back in between:
1. the drafter's catch-up forward over each request's pending slots (g_n);
2. the draft chain (``draft_chain.py``): K drafts [batch, K], and for a sampled batch the
   drafter's q [batch, K, vocab];
3. the target's verify forward over [t_n, drafts] (``chain_verify.py``);
4. the target head and the verdict: for a greedy batch, inside the same graph
   (``rejection.greedy_verdict``), a = the length of the longest run of drafts equal to the
   target's argmax, next = the target's argmax at position a (the bonus token when a = K);
   for a sampled one, the target's p over the K + 1 rows and ``rejection_sample`` with the
   draws keyed by position (``noise.py``);
1 to 4 are one graph replay when every pending span fits the chain's catch-up stage (at
most K + 1 slots, the usual case), else an eager catch-up and one replay; a step without
drafts replays the target's one-token graph. Then one ``tolist`` per step: of the verdict
(greedy), or of [drafts | a | next] (sampled).

For greedy rows the argmax rule is exactly what ``verify`` + ``rejection_sample`` give (p
and q one-hot), so greedy speculation stays token-for-token equal to target-only. A sampled
batch runs the same transforms and draws as the general path (``speculative.draft``,
``verify``), so its tokens are the general path's. With forced acceptance (benchmarks only)
a = min(N, K) instead.

A request is on the device when nothing but its temperature, top-k, top-p, min-p and seed
picks its tokens: no penalties, min_tokens reached (no stop token banned), no grammar
(structured outputs mask on the host), and it verifies the batch's K drafts. Other batches
take the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore import DRAFT_GROUP
from services.engine.batch import Span, StepResult
from services.engine.device.chain_catch_up import PendingSpans
from services.engine.device.cuda_graphs import DecodeGraphs
from services.engine.device.draft_chain import ChainRows, ChainSampling
from services.engine.request import Request
from services.engine.runner import ModelRunner
from services.engine.sampling.row_sampling import request_seeds, row_params, to_device
from services.engine.sampling.sampler import probs_for_rows
from services.engine.speculation.rejection import (
    Draws,
    Verdict,
    forced_verdict,
    greedy_tokens,
    rejection_sample,
)
from services.engine.speculation.speculative import catch_up
from services.engine.speculation.verify import emitted_logprobs


def on_device(req: Request, k: int) -> bool:
    """Whether ``req``'s own transforms and seed alone pick its tokens in a step of ``k``
    drafts (the chain's K, which ``req`` must verify in full, or 0: a step without drafts)."""
    sp = req.sampling
    uniform = k == 0 or req.num_spec_tokens == k
    return not sp.penalized and len(req.output_ids) >= sp.min_tokens and uniform and req.grammar is None


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """A device-resident step's graphs and its batch's block tables (host), asked of the
    manager once a step: its rows do not change between scheduling and the step's end."""

    graphs: DecodeGraphs
    target_tables: tuple[torch.Tensor, ...]  # per target group (the runner's order) [batch, width] int32
    draft_table: torch.Tensor | None  # [batch, width] int32; None in a step without drafts


def device_step_fits(runner: ModelRunner, decode: list[Request], k: int) -> DevicePlan | None:
    """The plan of a device-resident step of ``decode`` with ``k`` drafts (the chain's K,
    or 0), or None when it must take the general path (no graphs or no drafter, another K,
    a request not on the device, a batch or block table past the captured shapes). Without
    a drafter, k is 0: the target alone, sampled on the device."""
    graphs = runner.graphs
    if not isinstance(graphs, DecodeGraphs) or not all(on_device(r, k) for r in decode):
        return None
    if k and any(r.target_write_start > r.num_computed for r in decode):
        return None  # the chain's verify stage writes the target's KV from n on
    ids = [r.request_id for r in decode]
    targets = tuple(runner.manager.block_tables(ids, g.name) for g in runner.target_groups)
    draft = runner.manager.block_tables(ids, DRAFT_GROUP) if k else None
    widths = (targets[0].shape[1], draft.shape[1] if draft is not None else 0)  # rows share the extent
    return DevicePlan(graphs, targets, draft) if graphs.fits_verify(len(decode), k, widths) else None


@torch.inference_mode()
def device_step(
    runner: ModelRunner, plan: DevicePlan, decode: list[Request], k: int, forced: int = -1
) -> StepResult | None:
    """The step's results, as the general path gives them, for a step of ``k`` drafts
    each (the chain's K, or 0); ``forced``: forced acceptance (benchmarks only), -1 = off.
    None when a graph refused the batch (``device_step_fits`` said it would not): only
    drafter forwards ran then, whose KV writes the general path repeats with the same
    values. Requests that ask for logprobs add their own read of them."""
    graphs = plan.graphs
    greedy = all(r.sampling.greedy for r in decode)
    graphs.force_acceptance(forced)  # the verify graph's greedy verdict reads it
    lagging = not k and lags_catch_up(graphs, decode)
    q = None
    if k:
        pending = pending_spans(decode)
        first = pending if graphs.chain.catch.fits(pending) else catch_up(runner, decode)  # or g_n
        rows = ChainRows(
            [r.num_computed for r in decode],
            [r.last_token for r in decode],
            plan.draft_table,
            plan.target_tables,
        )
        chained = graphs.chain.run(rows, first, chain_sampling(decode, greedy))
        if chained is None:
            return None
        drafts, q = chained  # [batch, K] int64 (and [batch, K, vocab] float32) on the device
        run = graphs.verified(len(decode))
    else:  # a step without drafts: the catch-up (now or later) keeps the drafter's KV exact
        if runner.drafter is not None and not lagging:
            catch_up(runner, decode)
        drafts = torch.zeros(len(decode), 0, dtype=torch.long, device=runner.device)
        spans = [Span(r.request_id, r.num_computed, [r.last_token], r.target_write_start) for r in decode]
        run = graphs.run_verify(spans, plan.target_tables)
        if run is None:
            return None
    if greedy:
        emitted = greedy_tokens(run.verdict.tolist(), k + 1)  # the one host read
    else:
        logits = run.logits.float()  # [batch * (K + 1), V]
        verdict = sampled_verdict(decode, logits, drafts, q, forced)
        accepted, nexts = verdict.num_accepted, verdict.next_tokens
        packed = torch.cat([drafts, accepted[:, None], nexts[:, None]], dim=1).tolist()  # the one host read
        emitted = [row[: row[k]] + [row[k + 1]] for row in packed]
    offsets = [i * (k + 1) for i in range(len(decode) + 1)]
    logprobs = emitted_logprobs(run.logits, emitted, decode, offsets)
    return StepResult(emitted, logprobs, run, offsets, not lagging)


def lags_catch_up(graphs: DecodeGraphs, decode: list[Request]) -> bool:
    """Whether a step without drafts may leave the drafter's catch-up for later: its
    pending slots, one more after this step, still fit the longest graphed catch-up, so
    the step that drafts next catches all of them up in one replay. The drafter's KV is
    exact again then; until then only its cacheable prefix lags (``draft_valid``)."""
    return graphs.chain is not None and all(len(r.pending_tokens) + 1 <= graphs.lag_tokens for r in decode)


def pending_spans(decode: list[Request]) -> PendingSpans:
    """The requests' pending slots and features, for the chain's catch-up stage."""
    pieces = [f for r in decode for f in r.pending_features]
    return PendingSpans(
        [r.pending_start for r in decode],
        [r.pending_tokens for r in decode],
        pieces[0] if len(pieces) == 1 else torch.cat(pieces),  # one piece: no copy to launch
    )


def chain_sampling(decode: list[Request], greedy: bool) -> ChainSampling | None:
    """The sampled chain's per-request inputs, or None for a greedy batch."""
    if greedy:
        return None
    sp = [r.sampling for r in decode]
    return ChainSampling(
        [r.seed or 0 for r in decode],
        [s.temperature for s in sp],
        [s.top_k for s in sp],
        [s.top_p for s in sp],
        [s.min_p for s in sp],
    )


def sampled_verdict(
    decode: list[Request],
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    forced: int,
) -> Verdict:
    """The general path's verdict (``verify.verify``) from logits [batch * (K + 1), V] and
    the chain's drafts [batch, K] and q [batch, K, V], without a host read."""
    draws = position_draws(decode, [r.num_computed for r in decode], logits.device)
    return drawn_verdict(verify_probs(decode, logits, drafts.shape[1]), q, drafts, draws, forced)


def drawn_verdict(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, draws: Draws, forced: int
) -> Verdict:
    """The verdict over p [batch, K + 1, V], the drafts [batch, K] and their q [batch, K,
    V] (None: no drafts), drawn with ``draws``; ``forced`` >= 0: forced acceptance."""
    if forced >= 0:
        return forced_verdict(p, drafts, draws, forced)
    return rejection_sample(p, q if q is not None else p[:, :0], drafts, draws)


def sampled_next(decode: list[Request], logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """A step without drafts: each request's sampled token [batch] int64 from logits
    [batch, V], as :func:`sampled_verdict` draws it, for the positions ``starts`` (past
    num_computed in a step launched before its predecessor was read, ``overlap.py``)."""
    p = verify_probs(decode, logits, 0)
    drafts = torch.zeros(len(decode), 0, dtype=torch.long, device=logits.device)
    return rejection_sample(p, p[:, :0], drafts, position_draws(decode, starts, logits.device)).next_tokens


def verify_probs(decode: list[Request], logits: torch.Tensor, k: int) -> torch.Tensor:
    """[batch, K + 1, V] float32: each row's probabilities under its request's transforms."""
    extras = [[[]] * (k + 1) for _ in decode]  # no penalties: no earlier drafts to count
    params = row_params(decode, extras, logits.shape[-1], frozenset(), logits.device)
    return probs_for_rows(logits, params).view(len(decode), k + 1, -1)


def position_draws(decode: list[Request], starts: list[int] | torch.Tensor, device: torch.device) -> Draws:
    """The requests' draws for a step verifying from positions ``starts`` (host values, or
    [batch] int64 on the device)."""
    if not isinstance(starts, torch.Tensor):
        starts = to_device(torch.tensor(starts), device)
    return Draws(request_seeds(decode, device), starts)
