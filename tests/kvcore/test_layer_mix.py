"""A target of two layer groups (a per-layer window mix: its full-attention layers in
"target", its sliding ones in "target_sliding", both REQUIRED) beside the drafter's, with
the exact page ids after each step.

4 tokens per page; both target groups 2 layers, the sliding one window 8 (it feeds the
drafter, so it keeps W + 1 positions); the draft group window 8 (1 layer); K = 2 so the
headroom is 3 tokens; 32 pages per group.
"""

from __future__ import annotations

import dataclasses

from kvcore import CacheConfig, KVCacheManager, LayerGroupSpec, TransferPages
from kvcore.capacity import split_capacity
from tests.kvcore.conftest import N, assert_empty, draft_spec, run_request, target_spec
from tests.kvcore.test_target_window import tree

GROUPS = ("target", "target_sliding", "draft")


def sliding_spec() -> LayerGroupSpec:
    return dataclasses.replace(target_spec(8), name="target_sliding", layer_ids=(1, 3))


def mix_config(**kwargs) -> CacheConfig:
    full = dataclasses.replace(target_spec(), layer_ids=(0, 2))
    groups = (full, sliding_spec(), draft_spec(8, 1, "float32"))
    options = dict(tokens_per_page=4, num_pages=(32, 32, 32), num_spec_tokens=2)
    return CacheConfig(groups=groups, **{**options, **kwargs})


def make_mix() -> KVCacheManager:
    return KVCacheManager(mix_config())


def moved(pages: dict[str, TransferPages]) -> dict[str, tuple[int, list[int]]]:
    """Per group, (first block-table index, page ids) of a transfer."""
    return {g: (p.first_page, p.page_ids) for g, p in pages.items()}


def rows(m: KVCacheManager, rid: str) -> list[list[int]]:
    return [m.block_table(rid, g) for g in GROUPS]


def test_the_sliding_group_releases_out_of_its_window_and_the_full_one_keeps_every_page():
    m = make_mix()
    m.allocate("a", 10)
    m.advance("a", 10)
    m.extend("a", 14)
    m.advance("a", 14)  # sliding keeps 6..13 (W + 1), the draft 7..13: page 0 goes in both
    assert rows(m, "a") == [[0, 1, 2, 3, 4], [N, 1, 2, 3, 4], [N, 1, 2, 3, 4]]
    m.advance("a", 19)  # sliding keeps 11..18 -> from page 2; draft 12..18 -> from page 3
    assert rows(m, "a") == [[0, 1, 2, 3, 4], [N, N, 2, 3, 4], [N, N, N, 3, 4]]
    assert m.num_request_pages("a") == {"target": 5, "target_sliding": 3, "draft": 2}
    m.free("a")
    assert_empty(m)


def test_a_continuation_reuses_every_target_group():
    m = make_mix()
    a = list(range(24))
    run_request(m, "a", a)
    assert tree(m)[1] == (
        24,
        {"target": [0, 1, 2, 3, 4, 5], "target_sliding": [N, N, N, N, 4, 5], "draft": [N, N, N, N, 4, 5]},
    )
    match = m.match_prefix(a + [100, 101])
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "target_sliding": 24, "draft": 24}
    assert match.reused_pages == {
        "target": [0, 1, 2, 3, 4, 5],
        "target_sliding": [N, N, N, N, 4, 5],
        "draft": [N, N, N, N, 4, 5],
    }
    m.allocate("b", 26, match)
    assert m.held_pages("b") == {"target": 6, "target_sliding": 6, "draft": 6}
    m.advance("b", 26)
    m.free("b", a + [100, 101])
    assert_empty(m)


def test_a_branch_whose_sliding_window_was_released_is_reused_by_no_target_group():
    """The full group holds every page of the branch point, the sliding one not its
    window: the target groups decide the match together, so it is 0 for all."""
    m = make_mix()
    a = list(range(24))
    run_request(m, "a", a)
    match = m.match_prefix(a[:20] + [200, 201, 202, 203, 204])
    assert match.num_tokens == 0
    assert match.compute_start == {"target": 0, "target_sliding": 0, "draft": 0}
    assert_empty(m)


def test_a_transfer_moves_the_pages_of_every_group():
    sender, receiver = make_mix(), make_mix()
    sender.allocate("r", 22)
    sender.advance("r", 22)
    # the windows at 22 read 15..21: pages 3..5
    assert moved(sender.transfer_pages("r", 22)) == {
        "target": (0, [0, 1, 2, 3, 4, 5]),
        "target_sliding": (3, [3, 4, 5]),
        "draft": (3, [3, 4, 5]),
    }
    reservation = receiver.reserve_for_transfer("r", 22)
    assert reservation.block_tables == {
        "target": [0, 1, 2, 3, 4, 5, 6],
        "target_sliding": [N, N, N, 0, 1, 2, 3],
        "draft": [N, N, N, 0, 1, 2, 3],
    }
    assert moved(receiver.transfer_pages("r", 22)) == {
        "target": (0, [0, 1, 2, 3, 4, 5]),
        "target_sliding": (3, [0, 1, 2]),
        "draft": (3, [0, 1, 2]),
    }
    sender.free("r")
    receiver.free("r")
    assert_empty(sender)
    assert_empty(receiver)


def test_a_byte_budget_gives_both_target_groups_the_shared_page_count():
    config = mix_config(num_pages=(), memory_bytes=1_000_000)
    target, sliding, draft = split_capacity(config)
    # per sequence: cdiv(8 - 1 + 3, 4) + 1 = 4 draft pages; plus a 2048-token chunk: 512
    assert draft == 64 * 4 + 512
    assert target == sliding == (1_000_000 - draft * 128) // (512 + 512)
