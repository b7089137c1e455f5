"""Drafts of the eager chain and the graphed chain from the same engine state."""

from __future__ import annotations

import torch

from kvcore import DRAFT_GROUP
from services.engine.device_step import chain_sampling
from services.engine.engine import Engine
from services.engine.speculative import catch_up, draft


@torch.inference_mode()
def both_chains(engine: Engine) -> tuple[list[list[int]], list[list[int]]] | None:
    """(eager drafts, graphed-chain drafts) [batch][K] of the next step's decode batch, or
    None when the next step decodes nothing. Both write the same drafter KV (same inputs,
    same values), so running one after the other leaves the engine's state as one would."""
    decode = engine.scheduler.schedule().decode  # pages for the step are held from here
    if not decode:
        return None
    runner = engine.runner
    eager = draft(runner, decode, engine.k, engine.out.eos_ids).token_ids.tolist()
    g0 = catch_up(runner, decode)
    table = runner.manager.block_tables([r.request_id for r in decode], DRAFT_GROUP)
    sampling = chain_sampling(decode, all(r.sampling.greedy for r in decode))
    graphed, _ = runner.graphs.chain.run([r.num_computed for r in decode], table, g0, sampling)
    return eager, graphed.tolist()


def compare_chains(engine: Engine, prompts: list, params, steps: int = 40) -> int:
    """Add ``prompts``, then step the engine, checking eager == graphed drafts before
    every decode step; returns how many steps were compared."""
    for p in prompts:
        engine.add_request(p, params)
    compared = 0
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        both = both_chains(engine)
        if both is not None:
            assert both[0] == both[1], f"step {compared}"
            compared += 1
        engine.step()
    return compared
