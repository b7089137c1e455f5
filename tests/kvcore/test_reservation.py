"""KVCacheManager.reserve_for_transfer: pages for a prompt whose KV arrives by transfer."""

from __future__ import annotations

import pytest
import torch

from kvcore import KVLayout, PoolWrite, Reservation
from tests.kvcore.conftest import N, assert_empty, make_cache, make_manager, run_request


def test_a_reservation_without_tokens_takes_new_pages_out_of_the_window():
    manager = make_manager()
    res = manager.reserve_for_transfer("r", 22)
    assert res == Reservation(
        "r",
        22,
        25,
        {"target": [0, 1, 2, 3, 4, 5, 6], "draft": [N, N, N, 0, 1, 2, 3]},
        {"target": 0, "draft": 0},
    )
    assert manager.held_pages("r") == {}
    manager.free("r")
    assert_empty(manager)


def test_a_reservation_reuses_the_cached_prefix_and_names_it_held(manager):
    a = list(range(24))
    run_request(manager, "a", a)  # cached: target pages 0..5, draft 4..5 (its window)
    b = a + [100, 101, 102]
    res = manager.reserve_for_transfer("b", 27, b)
    assert res.block_tables == {"target": [0, 1, 2, 3, 4, 5, 7, 8], "draft": [N, N, N, N, N, 5, 7, 8]}
    assert res.num_held == {"target": 6, "draft": 6}
    assert (res.prompt_len, res.num_tokens) == (27, 30)
    assert manager.stats().prefix["target"].hit_tokens == 24
    manager.free("b")
    assert_empty(manager)


def test_a_reservation_reuses_whole_pages_only_and_copies_no_partial_page():
    """The transfer rewrites every page after the held ones: a partial page copied on write
    would be wasted, and under TP a copy replayed on the other ranks after the pages
    landed would overwrite them. Whole pages also lock less of the cached path."""
    manager, pools = make_cache(record=True, target_pages=8, draft_pages=8)
    a = list(range(24))
    run_request(manager, "a", a)  # target: 6 cached pages, 2 free
    pools.take_writes()
    b = a[:22] + [99, 98, 97, 96]  # matches 22 tokens: 5 whole pages + a partial one
    match = manager.match_prefix(b)
    assert (match.num_tokens, match.cow_pages) == (22, {"target": 5})
    assert not manager.can_allocate(26, match, num_computed=26)  # 6 locked pages + 3 new > 8
    res = manager.reserve_for_transfer("b", 26, b)  # 5 whole pages: page 5 is evicted for room
    assert res.block_tables == {"target": [0, 1, 2, 3, 4, 7, 6, 5], "draft": [N, N, N, N, 7, 0, 1, 2]}
    assert res.num_held == {"target": 5, "draft": 0}
    assert manager.usage()["target"].cached == 5
    assert pools.take_writes() == []  # nothing copied on write
    manager.free("b")
    assert_empty(manager)


def test_no_reservation_when_the_pages_do_not_fit():
    manager = make_manager(target_pages=4, draft_pages=4)
    assert manager.reserve_for_transfer("r", 14) is None  # 17 tokens -> 5 pages
    assert manager.usage()["target"].used == 0
    assert not manager.has_request("r")


def test_a_reserved_id_cannot_be_reserved_again(manager):
    manager.reserve_for_transfer("r", 8)
    with pytest.raises(ValueError, match="^request_id:"):
        manager.reserve_for_transfer("r", 8)
    manager.free("r")


def test_separate_layout_zeroes_the_draft_pages_and_logs_it_for_other_ranks():
    manager, pools = make_cache(record=True, layout=KVLayout.SEPARATE)
    for tensor in pools.tensors().values():
        tensor.fill_(1.0)
    res = manager.reserve_for_transfer("r", 22)
    assert res.block_tables["draft"] == [N, N, N, 0, 1, 2, 3]
    assert pools.take_writes() == [PoolWrite("draft", (0, 1, 2, 3))]
    draft = pools.tensor("draft")
    assert torch.count_nonzero(draft[:4]) == 0
    assert torch.all(draft[4:] == 1.0) and torch.all(pools.tensor("target") == 1.0)
    manager.free("r")
    assert_empty(manager)


def test_unified_layout_transfers_every_group_so_nothing_is_zeroed():
    manager, pools = make_cache(record=True)
    manager.reserve_for_transfer("r", 22)
    assert pools.take_writes() == []
    manager.free("r")
