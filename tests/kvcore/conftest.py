"""Builders for small caches whose page ids can be followed by hand."""

from __future__ import annotations

import pytest
import torch

from kvcore import CacheConfig, KVCacheManager, KVLayout, KVPools, LayerGroupSpec, Lifecycle, Owner
from kvcore.page_store import PageStore
from kvcore.request_rows import RequestRows

N = -1  # NULL_PAGE, short for expected rows


def make_config(
    *,
    page: int = 4,
    window: int = 8,
    k: int = 2,
    target_pages: int = 32,
    draft_pages: int = 32,
    layout: KVLayout = KVLayout.UNIFIED,
    draft_layers: int = 1,
    draft_dtype: str = "float32",
    prefix_cache: bool = True,
    host_pages: int = 0,
    host_write: str = "evict",
    host_recall_min: int = 1,
    target_window: int = 0,
    draft: bool = True,
) -> CacheConfig:
    """``target_window`` > 0 windows the target group too; ``draft=False`` leaves only it."""
    groups = [target_spec(target_window)] + ([draft_spec(window, draft_layers, draft_dtype)] if draft else [])
    return CacheConfig(
        groups=tuple(groups),
        tokens_per_page=page,
        num_pages=(target_pages, draft_pages)[: len(groups)],
        num_spec_tokens=k,
        layout=layout,
        enable_prefix_cache=prefix_cache,
        host_num_pages=host_pages,
        host_write_policy=host_write,
        host_recall_min_pages=host_recall_min,
    )


def target_spec(window: int = 0) -> LayerGroupSpec:
    """The target group: 2 layers of 2 float32 KV heads of dim 4, windowed when ``window`` > 0."""
    return LayerGroupSpec(
        "target",
        Owner.TARGET,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        dtype="float32",
        window=window,
    )


def draft_spec(window: int, num_layers: int, dtype: str) -> LayerGroupSpec:
    """The draft group: one KV head of dim 4 per layer, windowed, optional."""
    return LayerGroupSpec(
        "draft",
        Owner.DRAFT,
        num_layers=num_layers,
        num_kv_heads=1,
        head_dim=4,
        dtype=dtype,
        window=window,
        lifecycle=Lifecycle.OPTIONAL,
    )


def make_cache(record: bool = False, **kwargs) -> tuple[KVCacheManager, KVPools]:
    """A manager over CPU pools of :func:`make_config`, and the pools (logging their
    writes with ``record``)."""
    config = make_config(**kwargs)
    pools = KVPools.allocate(config, record=record)
    return KVCacheManager(config, pools), pools


def make_manager(**kwargs) -> KVCacheManager:
    return make_cache(**kwargs)[0]


def store(manager: KVCacheManager) -> PageStore:
    """Test-visible: the manager's page store (allocators, radix tree, host tier)."""
    return manager._store


def request_rows(manager: KVCacheManager) -> dict[str, RequestRows]:
    """Test-visible: the manager's request table."""
    return manager._requests


def pool(manager: KVCacheManager, group: str) -> torch.Tensor:
    """Test-visible: the pool tensor ``manager``'s pages of ``group`` index."""
    return manager._pools.tensor(group)


def free_queue(manager: KVCacheManager, group: str) -> list[int]:
    """Test-visible: ``group``'s free pages in the order they are handed out."""
    return list(store(manager).allocators[group].free_queue)


def ref_count(manager: KVCacheManager, group: str, page: int) -> int:
    return store(manager).allocators[group].ref_counts[page]


def rows(manager: KVCacheManager, request_id: str) -> tuple[list[int], list[int]]:
    return manager.block_table(request_id, "target"), manager.block_table(request_id, "draft")


def run_request(manager: KVCacheManager, request_id: str, tokens: list[int], cache: bool = True) -> None:
    """Prefill ``tokens`` in one step with whatever prefix matches, then free (and cache)."""
    match = manager.match_prefix(tokens)
    assert manager.can_allocate(len(tokens), match)
    manager.allocate(request_id, len(tokens), match)
    manager.advance(request_id, len(tokens))
    manager.free(request_id, tokens if cache else None)


def assert_empty(manager: KVCacheManager) -> None:
    """No request holds pages; after dropping the prefix cache every page is free."""
    assert not request_rows(manager)
    manager.reset_prefix_cache()
    for name, usage in manager.usage().items():
        assert usage.used == 0, name
        assert usage.host_used == 0, name
        assert sorted(free_queue(manager, name)) == list(range(usage.total))


@pytest.fixture
def manager() -> KVCacheManager:
    return make_manager()
