"""KVPools: page writes outside a forward, and the log other tensor-parallel ranks replay."""

from __future__ import annotations

import torch

from kvcore import KVPools, PoolWrite
from tests.kvcore.conftest import make_cache, make_config, run_request


def seeded(pools: KVPools, seed: int) -> KVPools:
    g = torch.Generator().manual_seed(seed)
    for tensor in pools.tensors().values():
        tensor.copy_(torch.randn(tensor.shape, generator=g))
    return pools


def test_copies_and_zeros_touch_exactly_their_pages_and_are_logged_in_order():
    pools = seeded(KVPools.allocate(make_config(target_pages=8, draft_pages=8), record=True), 1)
    before = {g: t.clone() for g, t in pools.tensors().items()}
    pools.copy_pages("target", [2, 3], [5, 6])
    pools.zero_pages("draft", [1, 4])
    target, draft = pools.tensor("target"), pools.tensor("draft")
    assert torch.equal(target[[5, 6]], before["target"][[2, 3]])
    assert torch.equal(target[[0, 1, 2, 3, 4, 7]], before["target"][[0, 1, 2, 3, 4, 7]])
    assert torch.count_nonzero(draft[[1, 4]]) == 0
    assert torch.equal(draft[[0, 2, 3, 5, 6, 7]], before["draft"][[0, 2, 3, 5, 6, 7]])
    assert pools.take_writes() == [PoolWrite("target", (5, 6), (2, 3)), PoolWrite("draft", (1, 4))]
    assert pools.take_writes() == []


def test_another_rank_replaying_the_log_ends_with_the_same_pages():
    config = make_config(target_pages=8, draft_pages=8)
    rank0, rank1 = seeded(KVPools.allocate(config, record=True), 2), seeded(KVPools.allocate(config), 2)
    rank0.zero_pages("target", [3])
    rank0.copy_pages("target", [3], [1])  # order matters: page 1 gets the zeros
    rank0.copy_pages("draft", [6], [0])
    rank1.apply(rank0.take_writes())
    for g in ("target", "draft"):
        assert torch.equal(rank0.tensor(g), rank1.tensor(g))
    assert rank1.take_writes() == []  # a replaying rank records nothing


def test_writes_are_logged_only_when_recording_and_pools_without_memory_only_log():
    quiet = KVPools.allocate(make_config())
    quiet.zero_pages("target", [0])
    assert quiet.take_writes() == []
    empty = KVPools.allocate(make_config(), record=True, tensors=False)
    empty.copy_pages("draft", [1], [2])
    assert not empty.has_tensors and empty.take_writes() == [PoolWrite("draft", (2,), (1,))]


def test_a_partial_page_hit_is_copied_through_the_pools_and_logged():
    manager, pools = make_cache(record=True, window=16)
    a = list(range(12))
    run_request(manager, "a", a)
    assert pools.take_writes() == []
    b = a[:10] + [50, 51, 52]
    match = manager.match_prefix(b)
    manager.allocate("b", len(b), match)
    assert manager.block_table("b", "target") == [0, 1, 4, 5]
    assert pools.take_writes() == [PoolWrite("target", (4,), (2,)), PoolWrite("draft", (4,), (2,))]
    manager.free("b")
