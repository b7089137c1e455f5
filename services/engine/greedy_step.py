"""A speculative decode step of plain-greedy requests with one host read.

Device work, in stream order, with no read back in between:
1. the drafter's catch-up forward over each request's pending slots (g_n);
2. the draft chain, one graph replay (``draft_chain.py``): K greedy drafts [batch, K];
3. the target's verify forward (its graph), the drafts copied into its input ids on the
   device;
4. the target head, argmax per row, acceptance: a = the length of the longest run of drafts
   equal to the target's argmax, next = the target's argmax at position a (the bonus
   token when a = K);
then one ``tolist`` of [drafts | a | next] per step.

That is exactly what ``verify`` + ``rejection_sample`` give greedy rows: their p and q are
one-hot, so a draft is kept iff it equals the target's argmax, and the recovered or bonus
token is that argmax; so greedy speculation stays token-for-token equal to target-only.
With forced acceptance (benchmarks only) a = min(N, K) instead.

A request is plain greedy when nothing but the argmax of its raw logits picks its tokens:
temperature 0, no penalties, min_tokens reached (no stop token banned), and it verifies
the batch's K drafts. Other batches take the general path (``speculative.draft``, ``verify``).
"""

from __future__ import annotations

import torch

from kvcore import DRAFT_GROUP, TARGET_GROUP
from services.engine.batch import Span, TargetRun
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.request import Request, TokenLogprob
from services.engine.runner import ModelRunner
from services.engine.speculative import catch_up
from services.engine.verify import emitted_logprobs

StepResult = tuple[list[list[int]], list[list[TokenLogprob]], TargetRun, list[int]]


def plain_greedy(req: Request, k: int) -> bool:
    """Whether the argmax of the raw logits alone picks ``req``'s tokens in a step of ``k``
    drafts (the chain's K, which ``req`` must verify in full, or 0: a step without drafts)."""
    sp = req.sampling
    uniform = k == 0 or req.num_spec_tokens == k
    return sp.greedy and not sp.penalized and len(req.output_ids) >= sp.min_tokens and uniform


def greedy_step_fits(runner: ModelRunner, decode: list[Request], k: int) -> DecodeGraphs | None:
    """The graphs a device-resident step of ``decode`` with ``k`` drafts (the chain's K, or
    0) runs through, or None when it must take the general path (no graphs or no drafter,
    another K, a request not plain greedy, a batch or block table past the captured shapes)."""
    graphs = runner.graphs
    if not isinstance(graphs, DecodeGraphs) or graphs.chain is None or k not in (0, graphs.chain.k):
        return None
    if not all(plain_greedy(r, k) for r in decode):
        return None
    ids = [r.request_id for r in decode]
    target_width = runner.manager.block_tables(ids, TARGET_GROUP).shape[1]
    draft_width = runner.manager.block_tables(ids, DRAFT_GROUP).shape[1]
    return graphs if graphs.fits_verify(len(decode), k, (target_width, draft_width)) else None


@torch.inference_mode()
def greedy_step(
    runner: ModelRunner, graphs: DecodeGraphs, decode: list[Request], k: int, forced: int = -1
) -> StepResult | None:
    """(emitted tokens, their logprobs, the target's run, row offsets) per request, as
    ``verify`` returns them, for a step of ``k`` drafts each (the chain's K, or 0);
    ``forced``: forced acceptance (benchmarks only), -1 = off. None when a graph refused
    the batch (``greedy_step_fits`` said it would not): only drafter forwards ran then,
    whose KV writes the general path repeats with the same values. Requests that ask for
    logprobs add their own read of them."""
    g0 = catch_up(runner, decode)  # [batch, hidden]
    if k:
        table = runner.manager.block_tables([r.request_id for r in decode], DRAFT_GROUP)
        drafts = graphs.chain.run([r.num_computed for r in decode], table, g0)  # [batch, K] on the device
        if drafts is None:
            return None
    else:  # a step without drafts: the catch-up keeps the drafter's KV exact
        drafts = torch.zeros(len(decode), 0, dtype=torch.long, device=g0.device)
    spans = [
        Span(r.request_id, r.num_computed, [r.tokens[-1], *[0] * k], r.target_write_start) for r in decode
    ]
    run = graphs.run_verify(spans, drafts)
    if run is None:
        return None
    logits = runner.target_logits(run.hidden)  # [batch * (K + 1), V] float32
    best = logits.argmax(dim=-1).view(len(decode), k + 1)
    accepted = greedy_accepted(drafts, best, forced)  # [batch]
    nexts = best.gather(1, accepted[:, None])  # [batch, 1]
    packed = torch.cat([drafts, accepted[:, None], nexts], dim=1).tolist()  # the one host read
    emitted = [row[: row[k]] + [row[k + 1]] for row in packed]
    offsets = [i * (k + 1) for i in range(len(decode) + 1)]
    return emitted, emitted_logprobs(logits, emitted, decode, offsets), run, offsets


def greedy_accepted(drafts: torch.Tensor, best: torch.Tensor, forced: int = -1) -> torch.Tensor:
    """drafts [batch, K], best [batch, K + 1] (the target's argmax per verified position) ->
    accepted [batch] int64: the leading drafts equal to best; min(forced, K) when forced >= 0."""
    k = drafts.shape[1]
    if forced >= 0:
        return torch.full((drafts.shape[0],), min(forced, k), dtype=torch.long, device=drafts.device)
    return (drafts == best[:, :k]).long().cumprod(dim=-1).sum(dim=-1)
