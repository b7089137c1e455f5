"""Build a rank's RankInfo from its kvcore CacheConfig (:func:`build_rank_info`), or from
the engine it runs (:func:`engine_rank_info`).

The proto mirrors ``kvcore.spec``: one LayerGroupInfo per LayerGroupSpec, in the
config's group order (the target's REQUIRED groups first: one per window of a per-layer
mix, each naming its layer ids). Page bytes and element bytes come from the spec, so both
sides of a transfer compute them the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from kvcore.spec import CacheConfig, KVLayout, LayerGroupSpec, Lifecycle, Owner, dtype_name
from kvcore.transfer import EndpointInfo
from proto.tandem.v1 import rank_info_pb2
from services.common.peer_check import heads_per_rank
from services.engine.checks import longest_fitting
from services.engine.engine import Engine
from services.engine.setup import group_kv_heads
from services.worker.transfer_proto import endpoint_to_proto

SCHEMA_VERSION = 1
"""Bumped whenever a change to RankInfo changes what a field means."""

_ROLES = {
    "prefill": rank_info_pb2.ROLE_PREFILL,
    "decode": rank_info_pb2.ROLE_DECODE,
    "both": rank_info_pb2.ROLE_BOTH,
}
_LAYOUTS = {
    KVLayout.UNIFIED: rank_info_pb2.KV_LAYOUT_UNIFIED,
    KVLayout.SEPARATE: rank_info_pb2.KV_LAYOUT_SEPARATE,
}
_OWNERS = {Owner.TARGET: rank_info_pb2.GROUP_OWNER_TARGET, Owner.DRAFT: rank_info_pb2.GROUP_OWNER_DRAFT}
_LIFECYCLES = {
    Lifecycle.REQUIRED: rank_info_pb2.LIFECYCLE_REQUIRED,
    Lifecycle.OPTIONAL: rank_info_pb2.LIFECYCLE_OPTIONAL,
}
_DTYPES = {
    "bfloat16": rank_info_pb2.KV_DTYPE_BF16,
    "float16": rank_info_pb2.KV_DTYPE_FP16,
    "float32": rank_info_pb2.KV_DTYPE_FP32,
    "float8_e4m3fn": rank_info_pb2.KV_DTYPE_FP8_E4M3,
}


def build_rank_info(
    cache_config: CacheConfig,
    *,
    role: str,
    instance_id: str,
    model_id: str,
    drafter_id: str = "",
    drafter_kind: str = "",
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    endpoint: EndpointInfo | None = None,
    total_kv_heads: Mapping[str, int] | None = None,
    num_pages: Sequence[int] = (),
) -> rank_info_pb2.RankInfo:
    """RankInfo of one rank. ``role`` is "prefill", "decode" or "both".

    ``total_kv_heads`` maps group name -> KV heads of the whole layer; a group not in it
    is taken as unreplicated (``num_kv_heads * tp_size``). Pass it when heads are
    replicated over TP (fewer heads than ranks). ``num_pages`` gives the pool sizes when
    the config holds a byte budget instead; pages are 0 (not sized yet) when neither does.
    ``endpoint``: the rank's transport's; None = it moves no pages (an aggregated worker).
    """
    _check_ranks(tp_size, tp_rank, "tp_size", "tp_rank")
    _check_ranks(pp_size, pp_rank, "pp_size", "pp_rank")
    identity = _identity(role, instance_id, model_id, drafter_id, drafter_kind)
    groups = _groups(cache_config, tp_size, total_kv_heads or {}, num_pages)
    return rank_info_pb2.RankInfo(
        schema_version=SCHEMA_VERSION,
        **identity,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        **_cache_fields(cache_config),
        groups=groups,
        transfer_endpoint=endpoint_to_proto(endpoint) if endpoint is not None else None,
    )


def _identity(role: str, instance_id: str, model_id: str, drafter_id: str, drafter_kind: str) -> dict:
    """The RankInfo fields that name the rank and its models. Refuses a role outside
    ``_ROLES`` and an empty instance or model id, in that order."""
    if role not in _ROLES:
        raise ValueError(f"role: must be one of {sorted(_ROLES)}, got {role!r}")
    if not instance_id:
        raise ValueError("instance_id: must be non-empty")
    if not model_id:
        raise ValueError("model_id: must be non-empty")
    return {
        "instance_id": instance_id,
        "role": _ROLES[role],
        "model_id": model_id,
        "drafter_id": drafter_id,
        "drafter_kind": drafter_kind,
    }


def _cache_fields(cache_config: CacheConfig) -> dict:
    """The RankInfo fields the cache config gives besides its groups: page size, layout and
    the speculation geometry."""
    return {
        "tokens_per_page": cache_config.tokens_per_page,
        "kv_layout": _LAYOUTS[cache_config.layout],
        "num_draft_layers": num_draft_layers(cache_config),
        "num_spec_tokens": cache_config.num_spec_tokens,
        "draft_block_width": cache_config.draft_block_width,
    }


def engine_kv_heads(engine: Engine) -> dict[str, int]:
    """KV heads of the whole layer of each of the target's groups and of the drafter's
    (when one runs): the models' counts, which every rank of a TP group shares."""
    return group_kv_heads(engine.target, engine.drafter)


def engine_rank_info(
    engine: Engine, role: str, instance_id: str, endpoint: EndpointInfo | None
) -> rank_info_pb2.RankInfo:
    """The RankInfo of the rank running ``engine``: its own pools' heads, TP size and rank,
    and the longest request it serves (its context and what its empty KV cache holds)."""
    e = engine
    info = build_rank_info(
        e.manager.config,
        role=role,
        instance_id=instance_id,
        model_id=os.path.basename(os.path.normpath(e.config.model)),
        drafter_id=os.path.basename(os.path.normpath(e.config.drafter)) if e.drafter else "",
        drafter_kind="eagle3" if e.drafter else "",
        tp_size=e.tp.size,
        tp_rank=e.tp.rank,
        endpoint=endpoint,
        total_kv_heads=engine_kv_heads(e),
        num_pages=tuple(e.manager.num_pages(g) for g in e.manager.groups),
    )
    info.max_model_len = e.max_model_len
    info.max_request_tokens = longest_fitting(e.manager)
    if e.config.forced_acceptance >= 0:  # benchmarks only: say so to every peer and the router
        info.unsafe_forced_acceptance = e.config.forced_acceptance
    return info


def num_draft_layers(cache_config: CacheConfig) -> int:
    return sum(g.num_layers for g in cache_config.groups if g.owner == Owner.DRAFT)


def _groups(
    cache_config: CacheConfig, tp_size: int, total_kv_heads: Mapping[str, int], num_pages: Sequence[int]
) -> list[rank_info_pb2.LayerGroupInfo]:
    """One LayerGroupInfo per group, in the config's order."""
    pages = _pool_sizes(cache_config, num_pages)
    return [
        _group_info(
            spec,
            cache_config.tokens_per_page,
            tp_size,
            pages[i],
            total_kv_heads.get(spec.name, spec.num_kv_heads * tp_size),
        )
        for i, spec in enumerate(cache_config.groups)
    ]


def _group_info(
    spec: LayerGroupSpec, tokens_per_page: int, tp_size: int, num_pages: int, total_kv_heads: int
) -> rank_info_pb2.LayerGroupInfo:
    if heads_per_rank(total_kv_heads, tp_size) != spec.num_kv_heads:
        raise ValueError(
            f"total_kv_heads: group {spec.name!r} has {spec.num_kv_heads} KV "
            f"heads per rank, which {total_kv_heads} heads over tp {tp_size} "
            f"do not give"
        )
    name = dtype_name(spec.torch_dtype)
    return rank_info_pb2.LayerGroupInfo(
        name=spec.name,
        owner=_OWNERS[spec.owner],
        layer_ids=spec.layer_ids,
        num_kv_heads=spec.num_kv_heads,
        total_num_kv_heads=total_kv_heads,
        head_dim=spec.head_dim,
        dtype=_DTYPES[name],
        dtype_name=name,
        element_bytes=spec.element_bytes,
        window=spec.window,
        lifecycle=_LIFECYCLES[spec.lifecycle],
        page_bytes=spec.page_bytes(tokens_per_page),
        num_pages=num_pages,
    )


def _pool_sizes(cache_config: CacheConfig, num_pages: Sequence[int]) -> tuple[int, ...]:
    """Pages per group: the config's counts, else ``num_pages``, else zeros."""
    num_groups = len(cache_config.groups)
    if cache_config.num_pages:
        if num_pages and tuple(num_pages) != cache_config.num_pages:
            raise ValueError(
                f"num_pages: {tuple(num_pages)} contradicts the config's {cache_config.num_pages}"
            )
        return cache_config.num_pages
    if not num_pages:
        return (0,) * num_groups
    if len(num_pages) != num_groups or min(num_pages) < 0:
        raise ValueError(f"num_pages: need {num_groups} counts >= 0, got {tuple(num_pages)}")
    return tuple(num_pages)


def _check_ranks(size: int, rank: int, size_name: str, rank_name: str) -> None:
    if size < 1:
        raise ValueError(f"{size_name}: must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name}: must be in [0, {size}), got {rank}")
