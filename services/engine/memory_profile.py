"""The readings behind ``--gpu-memory-utilization`` (services/engine/memory_budget.py does
the arithmetic): the loaded weights, and the activations of a profile forward at the step's
widest token count, run over a throwaway KV cache before the real one is sized.

The profile runs what a step runs at its widest: the target over ``profile_tokens`` tokens
(split into sequences the context allows), the drafter over the same positions, and the
target's head and a softmax over the rows a decode step verifies. Every rank of a
tensor-parallel group runs it (their forwards' all-reduces pair up), and the group takes the
smallest KV budget, so every rank's pools have the same page counts.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

import torch

from kvcore import CacheConfig, KVCacheManager
from services.engine.batch import Span
from services.engine.config import EngineConfig
from services.engine.memory_budget import (
    MemoryReadings,
    check_free,
    describe_budget,
    kv_budget_bytes,
    profile_lengths,
    profile_tokens,
)
from services.engine.parallel import TensorParallel
from services.engine.runner import ModelRunner
from services.engine.setup import build_cache

log = logging.getLogger(__name__)
PROFILE_ID = "memory-profile-{}"


class LoadedEngine(Protocol):
    """An engine whose models are loaded and whose cache is not built yet (``Engine`` in
    its constructor): what the profile reads of it."""

    config: EngineConfig
    device: torch.device
    tp: TensorParallel
    k: int  # drafts per step
    max_model_len: int
    target: Any
    drafter: Any


def derive_kv_bytes(engine: LoadedEngine, cache: CacheConfig) -> tuple[int, MemoryReadings]:
    """The KV cache's bytes on ``engine``'s CUDA device under its config's
    ``gpu_memory_utilization``, and the readings they come from. ``engine``: models loaded,
    cache not built yet; ``cache``: the cache it will build. ValueError naming
    gpu_memory_utilization when nothing is left or the device has too little free memory.
    Logs the arithmetic."""
    device, fraction = engine.device, engine.config.gpu_memory_utilization
    r = readings(engine, cache)
    kv = engine.tp.min_over_ranks(kv_budget_bytes(r, fraction))
    check_free(kv, r, torch.cuda.mem_get_info(device)[0], fraction)
    log.info("KV memory on %s: %s", device, describe_budget(r, fraction, kv))
    return kv, r


def profile_step(engine: LoadedEngine, cache: CacheConfig) -> int:
    """Run the profile forward over a throwaway KV cache of its own (any device) and drop
    it: no page, request or cached prefix of it outlives the call. Returns the peak bytes
    the forward added on a CUDA device (0 elsewhere)."""
    c = engine.config
    width = profile_tokens(c.max_num_batched_tokens, c.max_num_seqs, engine.k)
    lengths = profile_lengths(width, engine.max_model_len)
    pages = sum(-(-(n + cache.headroom_tokens) // cache.tokens_per_page) + 1 for n in lengths)
    temp = replace(cache, num_pages=(pages,) * len(cache.groups), enable_prefix_cache=False, host_num_pages=0)
    manager, pools = build_cache(temp, engine.target, engine.drafter, engine.device, engine.tp)
    runner = ModelRunner(engine.target, engine.drafter, manager, pools, engine.device)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        before = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    _forward(runner, manager, lengths, min(width, c.max_num_seqs * (engine.k + 1)))
    if not cuda:
        return 0
    torch.cuda.synchronize(engine.device)
    return max(0, torch.cuda.max_memory_allocated(engine.device) - before)


def graphs_taken(device: torch.device, reserved_before: int, estimate: int) -> None:
    """Log what the CUDA graphs took (the growth of reserved memory since ``reserved_before``)
    next to the estimate the KV budget kept for them; WARNING when they took more."""
    taken = torch.cuda.memory_reserved(device) - reserved_before
    level = logging.WARNING if taken > estimate else logging.INFO
    log.log(
        level,
        "CUDA graphs took %d MiB on %s (the KV budget kept %d MiB for them)",
        taken >> 20,
        device,
        estimate >> 20,
    )


def readings(engine: LoadedEngine, cache: CacheConfig) -> MemoryReadings:
    """This rank's readings on its CUDA device (see memory_budget.py)."""
    device = engine.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    activations = profile_step(engine, cache)
    torch.cuda.empty_cache()  # the throwaway pools and the forward's blocks go back
    total = torch.cuda.mem_get_info(device)[1]
    graphs = activations if engine.config.cuda_graphs else 0
    return MemoryReadings(total=total, weights=weights, activations=activations, graphs=graphs)


@torch.inference_mode()
def _forward(runner: ModelRunner, manager: KVCacheManager, lengths: list[int], head_rows: int) -> None:
    """The target over every sequence, the drafter over the same positions, then the head
    and a softmax over ``head_rows`` rows (a decode step's verify)."""
    ids = [PROFILE_ID.format(i) for i in range(len(lengths))]
    for rid, n in zip(ids, lengths, strict=True):
        manager.allocate(rid, n)
    spans = [Span(rid, 0, [0] * n, 0) for rid, n in zip(ids, lengths, strict=True)]
    run = runner.run_target(spans)
    if runner.drafter is not None:
        runner.run_drafter(spans, run.features)
    torch.softmax(runner.target_logits(run.hidden[:head_rows]), dim=-1)
    for rid in ids:
        manager.free(rid)
