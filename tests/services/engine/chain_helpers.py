"""Drafts of the eager chain and the graphed chain (with and without its catch-up stage)
from the same engine state."""

from __future__ import annotations

import torch

from kvcore import DRAFT_GROUP
from services.engine.device.device_step import chain_sampling, pending_spans
from services.engine.device.draft_chain import ChainRows
from services.engine.engine import Engine
from services.engine.speculation.speculative import catch_up, draft


@torch.inference_mode()
def both_chains(engine: Engine) -> tuple[list[list[int]], ...] | None:
    """(eager drafts, graphed-chain drafts from a separate catch-up, graphed-chain drafts
    with its own catch-up stage, or None where a pending span does not fit it) [batch][K]
    of the next step's decode batch, or None when the next step decodes nothing. All write
    the same drafter KV (same inputs, same values), and the graphed chains' verify stage
    writes the target's KV at n .. n + K, which the step's own verify writes again before
    anything reads it, so running one after the other leaves the engine's state as one
    would."""
    decode = engine.scheduler.schedule().decode  # pages for the step are held from here
    if not decode:
        return None
    runner, chain = engine.runner, engine.runner.graphs.chain
    eager = draft(runner, decode, engine.k, engine.out.eos_ids).token_ids.tolist()
    ids = [r.request_id for r in decode]
    draft_table = runner.manager.block_tables(ids, DRAFT_GROUP)
    targets = tuple(runner.manager.block_tables(ids, g.name) for g in runner.target_groups)
    rows = ChainRows([r.num_computed for r in decode], [r.tokens[-1] for r in decode], draft_table, targets)
    sampling = chain_sampling(decode, all(r.sampling.greedy for r in decode))
    graphed, _ = chain.run(rows, catch_up(runner, decode), sampling)
    graphed = graphed.tolist()
    pending = pending_spans(decode)
    fused = chain.run(rows, pending, sampling)[0].tolist() if chain.catch.fits(pending) else None
    return eager, graphed, fused


def compare_chains(engine: Engine, prompts: list, params, steps: int = 40, stage: bool = True) -> int:
    """Add ``prompts``, then step the engine, checking eager == graphed drafts before
    every decode step (``stage``: the graphed chain with its catch-up stage too); returns
    how many steps were compared."""
    for p in prompts:
        engine.add_request(p, params)
    compared = 0
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        drafts = both_chains(engine)
        if drafts is not None:
            eager, graphed, fused = drafts
            assert eager == graphed and (fused in (None, eager) or not stage), f"step {compared}"
            compared += 1
        engine.step()
    return compared
