"""Engine setup: the KV cache the loaded models need, its pools and the manager over them."""

from __future__ import annotations

import logging

import torch

from kvcore import (
    DRAFT_GROUP,
    CacheConfig,
    KVCacheManager,
    KVPools,
    LayerGroupSpec,
    Lifecycle,
    Owner,
)
from services.engine.config import EngineConfig
from services.engine.memory_budget import group_line
from services.engine.models import Eagle3Drafter, TargetModel
from services.engine.parallel import TensorParallel, shard_cache_config

log = logging.getLogger(__name__)


def layer_groups(dtype: str, target: TargetModel, drafter: Eagle3Drafter | None) -> list[LayerGroupSpec]:
    """The target's groups as the model declares them (``kv_layer_groups``: each with its
    layers and window), plus the drafter's (OPTIONAL, windowed) group when it runs."""
    groups = [
        LayerGroupSpec(
            g.name,
            Owner.TARGET,
            len(g.layer_ids),
            g.num_kv_heads,
            g.head_dim,
            dtype=dtype,
            window=g.window,
            layer_ids=g.layer_ids,
        )
        for g in target.kv_layer_groups()
    ]
    if drafter is not None:
        d = drafter.config
        groups.append(
            LayerGroupSpec(
                DRAFT_GROUP,
                Owner.DRAFT,
                d.num_hidden_layers,
                d.num_key_value_heads,
                d.head_dim,
                dtype=dtype,
                window=d.sliding_window,
                lifecycle=Lifecycle.OPTIONAL,
            )
        )
    return groups


def cache_config(c: EngineConfig, target: TargetModel, drafter: Eagle3Drafter | None, k: int) -> CacheConfig:
    """The engine's cache over :func:`layer_groups`, sized by its options."""
    groups = layer_groups(c.dtype, target, drafter)
    host_pages = c.host_kv_cache_bytes // sum(g.page_bytes(c.tokens_per_page) for g in groups)
    return CacheConfig(
        groups=tuple(groups),
        tokens_per_page=c.tokens_per_page,
        num_pages=tuple(c.num_pages[: len(groups)]),
        memory_bytes=c.kv_cache_bytes,
        max_num_seqs=c.max_num_seqs,
        max_prefill_chunk=c.max_prefill_chunk,
        num_spec_tokens=k,
        draft_block_width=1,
        layout=c.layout,
        enable_prefix_cache=c.enable_prefix_cache,
        host_num_pages=host_pages,
        host_write_policy=c.host_kv_write_policy,
        host_recall_min_pages=c.host_kv_recall_min_pages,
    )


def build_cache(
    config: CacheConfig,
    target: TargetModel,
    drafter: Eagle3Drafter | None,
    device: torch.device,
    tp: TensorParallel,
) -> tuple[KVCacheManager, KVPools]:
    """This rank's cache manager and the pools it indexes, of its own KV heads. Rank 0 of
    a tensor-parallel group records its pool writes for the other ranks to replay."""
    config = shard_cache_config(config, group_kv_heads(target, drafter), tp)
    pools = KVPools.allocate(config, device, record=tp.size > 1 and tp.rank == 0)
    return KVCacheManager(config, pools), pools


def group_kv_heads(target: TargetModel, drafter: Eagle3Drafter | None) -> dict[str, int]:
    """KV heads of the whole layer per layer group: each target group's (as the model
    declares it) and the drafter's, when one runs."""
    totals = {g.name: g.num_kv_heads for g in target.kv_layer_groups()}
    if drafter is not None:
        totals[DRAFT_GROUP] = drafter.config.num_key_value_heads
    return totals


def log_scheduling(
    policy: str, max_num_batched_tokens: int, max_num_seqs: int, derived: bool = False
) -> None:
    """One INFO line: the scheduling policy the engine runs (``auto`` resolved) and its limits
    (``derived``: the step's tokens were derived from the model, ``step_budget.py``)."""
    how = " (derived from the model)" if derived else ""
    log.info(
        "scheduling: %s steps, %d tokens a step%s, %d sequences",
        policy,
        max_num_batched_tokens,
        how,
        max_num_seqs,
    )


def log_groups(manager: KVCacheManager) -> None:
    """One INFO line per layer group: its pages, the tokens they hold, their MiB (this rank's)."""
    p = manager.tokens_per_page
    for name, spec in manager.groups.items():
        log.info("%s", group_line(name, manager.num_pages(name), p, spec.page_bytes(p)))
