"""Specs reject bad values naming the field; the capacity split sizes groups as documented."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcore import CacheConfig, KVLayout, LayerGroupSpec, Lifecycle, Owner
from kvcore.capacity import split_capacity
from kvcore.spec import dtype_from_name

TARGET = LayerGroupSpec(
    "target", Owner.TARGET, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32"
)  # page of 4 tokens: 2*2*2*4*4*4 = 512 bytes
DRAFT = LayerGroupSpec(
    "draft",
    Owner.DRAFT,
    num_layers=1,
    num_kv_heads=1,
    head_dim=4,
    dtype="float32",
    window=8,
    lifecycle=Lifecycle.OPTIONAL,
)  # 128 bytes


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("num_layers", 0),
        ("num_kv_heads", 0),
        ("head_dim", -1),
        ("window", -2),
        ("dtype", "int7"),
        ("name", ""),
        ("layer_ids", (0, 1, 2)),
    ],
)
def test_bad_group_spec_names_the_field(field_name, value):
    with pytest.raises(ValueError, match=f"^{field_name}:"):
        dataclasses.replace(TARGET, **{field_name: value})


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        (dict(tokens_per_page=0), "tokens_per_page"),
        (dict(num_spec_tokens=-1), "num_spec_tokens"),
        (dict(draft_block_width=0), "draft_block_width"),
        (dict(num_pages=(4,)), "num_pages"),
        (dict(num_pages=(4, 0)), "num_pages"),
        (dict(num_pages=(), memory_bytes=0), "memory_bytes"),
        (dict(groups=()), "groups"),
        (dict(groups=(DRAFT, TARGET)), "groups"),
        (dict(groups=(TARGET, TARGET)), "groups"),
    ],
)
def test_bad_cache_config_names_the_field(kwargs, field_name):
    base = dict(groups=(TARGET, DRAFT), tokens_per_page=4, num_pages=(8, 8))
    with pytest.raises(ValueError, match=f"^{field_name}:"):
        CacheConfig(**{**base, **kwargs})


def test_dtype_names_and_aliases():
    assert dtype_from_name("bf16") == torch.bfloat16
    assert dtype_from_name("fp8") == torch.float8_e4m3fn
    assert dataclasses.replace(TARGET, dtype="fp8").element_bytes == 1
    assert TARGET.page_bytes(4) == 512


def test_headroom_is_k_plus_one_or_the_drafter_block():
    config = CacheConfig(groups=(TARGET, DRAFT), num_pages=(8, 8), num_spec_tokens=4)
    assert config.headroom_tokens == 5
    assert dataclasses.replace(config, draft_block_width=8).headroom_tokens == 8


def test_windowed_draft_is_sized_by_what_it_can_hold():
    config = CacheConfig(
        groups=(TARGET, DRAFT),
        tokens_per_page=4,
        memory_bytes=1_000_000,
        num_spec_tokens=2,
        max_num_seqs=64,
        max_prefill_chunk=2048,
    )
    # per sequence: cdiv(8 - 1 + 3, 4) + 1 = 4 pages; plus a 2048-token chunk: 512 pages
    draft_pages = 64 * 4 + 512
    assert split_capacity(config) == ((1_000_000 - draft_pages * 128) // 512, draft_pages)


def test_full_attention_groups_get_equal_page_counts():
    full = dataclasses.replace(DRAFT, window=0)
    config = CacheConfig(groups=(TARGET, full), tokens_per_page=4, memory_bytes=1_000_000)
    assert split_capacity(config) == (1_000_000 // 640, 1_000_000 // 640)
    separate = dataclasses.replace(config, groups=(TARGET, DRAFT), layout=KVLayout.SEPARATE)
    assert split_capacity(separate) == (1_000_000 // 640, 1_000_000 // 640)


def test_a_budget_too_small_for_the_window_is_refused():
    config = CacheConfig(groups=(TARGET, DRAFT), tokens_per_page=4, memory_bytes=10_000)
    with pytest.raises(ValueError, match="^memory_bytes:"):
        split_capacity(config)
