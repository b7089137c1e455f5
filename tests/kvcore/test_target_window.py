"""A windowed target group (Mistral's sliding window), with the exact page ids after each step.

Unless a test says otherwise: 4 tokens per page, target window 8 (2 layers), draft window 8
(1 layer), K = 2 so the headroom is 3 tokens, 32 pages per group. A target feeding the
drafter keeps its pages for W + 1 positions (a later match at n re-runs it from n - 1).
"""

from __future__ import annotations

import torch

from kvcore import KVLayout
from kvcore.radix import RadixCache
from tests.kvcore.conftest import (
    N,
    assert_empty,
    free_queue,
    make_manager,
    pool,
    ref_count,
    rows,
    run_request,
    store,
)
from tests.kvcore.test_host_cache import fill, pages_bits


def tree(manager) -> list[tuple[int, dict[str, list[int]]]]:
    """(prefix length at the node's end, its pages) of every node, shortest first."""
    return sorted((len(RadixCache.prefix_of(n)), n.pages) for n in store(manager).tree.nodes())


def test_target_pages_below_the_window_are_released_as_the_request_advances():
    m = make_manager(target_window=8)
    m.allocate("a", 10)
    assert rows(m, "a") == ([0, 1, 2, 3], [0, 1, 2, 3])
    m.advance("a", 10)
    m.extend("a", 14)
    m.advance("a", 14)  # target keeps 6..13 (W + 1), the draft 7..13: page 0 goes in both
    assert rows(m, "a") == ([N, 1, 2, 3, 4], [N, 1, 2, 3, 4])
    m.advance("a", 19)  # target keeps 11..18 -> from page 2; draft 12..18 -> from page 3
    assert rows(m, "a") == ([N, N, 2, 3, 4], [N, N, N, 3, 4])
    assert m.num_request_pages("a") == {"target": 3, "draft": 2}
    m.free("a")
    assert free_queue(m, "target") == [*range(5, 32), 0, 1, 4, 3, 2]
    assert free_queue(m, "draft") == [*range(5, 32), 0, 1, 2, 4, 3]
    assert_empty(m)


def test_a_target_alone_releases_for_its_window_only():
    m = make_manager(target_window=8, draft=False)
    m.allocate("a", 14)
    m.advance("a", 14)  # no drafter to feed: keeps 7..13
    assert m.block_table("a", "target") == [N, 1, 2, 3, 4]
    m.free("a")
    assert_empty(m)


def test_the_tree_holds_null_target_pages_and_a_continuation_reuses_the_window():
    m = make_manager(target_window=8)
    a = list(range(24))
    run_request(m, "a", a)
    assert tree(m) == [
        (0, {"target": [], "draft": []}),
        (24, {"target": [N, N, N, N, 4, 5], "draft": [N, N, N, N, 4, 5]}),
    ]
    b = a + [100, 101]
    match = m.match_prefix(b)
    # the target re-runs from 23 for the drafter's slot 24: it reads 16..23, pages 4 and 5
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "draft": 24}
    assert match.reused_pages == {"target": [N, N, N, N, 4, 5], "draft": [N, N, N, N, 4, 5]}
    m.allocate("b", len(b), match)
    assert rows(m, "b") == ([N, N, N, N, 4, 5, 7, 8], [N, N, N, N, 4, 5, 7, 8])
    assert m.held_pages("b") == {"target": 6, "draft": 6}
    m.advance("b", len(b))
    m.free("b", b)
    assert_empty(m)


def test_a_window_that_is_one_past_a_page_still_continues():
    m = make_manager(target_window=9)  # re-running 23 reads 15..23: page 3 must be kept
    a = list(range(24))
    run_request(m, "a", a)
    assert tree(m)[1] == (24, {"target": [N, N, N, 3, 4, 5], "draft": [N, N, N, N, 4, 5]})
    match = m.match_prefix(a + [1, 2])
    assert match.num_tokens == 24
    assert match.reused_pages["target"] == [N, N, N, 3, 4, 5]
    assert_empty(m)


def test_a_branch_whose_target_window_was_released_matches_nothing():
    m = make_manager(target_window=8)
    a = list(range(24))
    run_request(m, "a", a)
    c = a[:20] + [200, 201, 202, 203, 204]
    match = m.match_prefix(c)
    # at 20 the draft recomputes from 13, so the target would re-run from 12 and read 5..:
    # released. Every earlier page boundary needs pages released too.
    assert match.num_tokens == 0
    assert match.compute_start == {"target": 0, "draft": 0}
    assert match.node is store(m).tree.root
    m.allocate("c", len(c), match)
    assert rows(m, "c") == ([7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 11, 12, 13])
    m.free("c")
    assert_empty(m)


def test_the_match_shortens_to_the_last_page_boundary_whose_window_is_held():
    m = make_manager(target_window=8, draft=False)
    x = list(range(40))
    run_request(m, "x", x)  # keeps pages 8, 9 (positions 32..39)
    y = x[:16]
    assert m.match_prefix(y).num_tokens == 0
    run_request(m, "y", y)  # its pages 13, 14 (positions 8..15) fill the tree's gap
    assert tree(m) == [
        (0, {"target": []}),
        (12, {"target": [N, N, 13]}),
        (16, {"target": [14]}),
        (40, {"target": [N, N, N, N, 8, 9]}),
    ]
    z = x[:30] + [999]
    match = m.match_prefix(z)
    # 30, 28, 24 and 20 need page 4 or 5 (released); at 16 the window 9..15 is pages 2, 3
    assert match.num_tokens == 16
    assert match.reused_pages == {"target": [N, N, 13, 14]}
    assert match.cow_pages == {}
    assert len(RadixCache.prefix_of(match.node)) == 16
    m.allocate("z", len(z), match)
    assert m.block_table("z", "target") == [N, N, 13, 14, 16, 17, 18, 19, 20]
    m.advance("z", len(z))
    m.free("z", z)
    assert tree(m)[-2:] == [(28, {"target": [N, N, 18]}), (40, {"target": [N, 8, 9]})]
    assert_empty(m)


def test_the_drafter_and_the_target_both_reuse_a_filled_gap():
    m = make_manager(target_window=8)
    x = list(range(40))
    run_request(m, "x", x)
    run_request(m, "y", x[:16])
    match = m.match_prefix(x[:20] + [7, 7, 7])  # 22 cached tokens (a partial page of 2)
    assert match.num_tokens == 16
    assert match.compute_start == {"target": 16, "draft": 16}
    assert match.reused_pages == {"target": [N, N, 13, 14], "draft": [N, N, 13, 14]}
    assert match.cow_pages == {}
    assert_empty(m)


def test_a_dropped_draft_window_costs_the_windowed_target_its_match():
    m = make_manager(target_window=8, draft_pages=8)
    y = list(range(16))
    run_request(m, "y", y)
    m.allocate("big", 24)  # the draft group is short: the node's draft pages are dropped
    assert tree(m)[1] == (16, {"target": [N, N, 2, 3], "draft": [N, N, N, N]})
    m.free("big")
    match = m.match_prefix(y + [5, 6])
    # the draft would recompute from 9, the target re-run from 8 and read 1..: released
    assert (match.num_tokens, match.compute_start) == (0, {"target": 0, "draft": 0})
    assert_empty(m)


def test_a_partial_page_hit_is_copied_and_the_shared_page_never_written():
    m = make_manager(target_window=8, draft=False)
    a = list(range(24))
    m.allocate("a", 24)
    pool(m, "target")[5] = 7.0
    m.advance("a", 24)
    m.free("a", a)
    b = a[:23] + [50, 51]
    match = m.match_prefix(b)
    assert match.num_tokens == 23  # the window at 23 reads 16..22: pages 4, 5
    assert match.reused_pages == {"target": [N, N, N, N, 4]}
    assert match.cow_pages == {"target": 5}
    m.allocate("b", len(b), match)
    assert m.block_table("b", "target") == [N, N, N, N, 4, 7, 8]
    assert torch.equal(pool(m, "target")[7], torch.full_like(pool(m, "target")[7], 7.0))
    assert ref_count(m, "target", 5) == 1  # only the tree holds the source
    m.free("b")
    assert_empty(m)


def test_transfer_pages_of_a_windowed_target_are_only_its_window():
    sender, receiver = make_manager(target_window=8), make_manager(target_window=8)
    sender.allocate("r", 22)
    sender.advance("r", 22)
    sent = sender.transfer_pages("r", 22)  # the window at 22 reads 15..21: pages 3..5
    assert {g: (p.first_page, p.page_ids) for g, p in sent.items()} == {
        "target": (3, [3, 4, 5]),
        "draft": (3, [3, 4, 5]),
    }
    receiver.allocate("r", 22, num_computed=22)
    assert rows(receiver, "r") == ([N, N, N, 0, 1, 2, 3], [N, N, N, 0, 1, 2, 3])
    got = receiver.transfer_pages("r", 22)
    assert {g: (p.first_page, p.page_ids) for g, p in got.items()} == {
        "target": (3, [0, 1, 2]),
        "draft": (3, [0, 1, 2]),
    }
    for m in (sender, receiver):
        m.free("r")
        assert_empty(m)


def test_a_receiver_holding_the_window_is_sent_only_the_rest():
    m = make_manager(target_window=8)
    a = list(range(24))
    run_request(m, "a", a)
    b = a + [100, 101, 102]
    m.allocate("b", 27, m.match_prefix(b), num_computed=27)
    assert m.held_pages("b") == {"target": 6, "draft": 6}
    assert rows(m, "b") == ([N, N, N, N, N, 5, 7, 8], [N, N, N, N, N, 5, 7, 8])
    got = m.transfer_pages("b", 27, m.held_pages("b"))
    assert {g: (p.first_page, p.page_ids) for g, p in got.items()} == {"target": (6, [7]), "draft": (6, [7])}
    m.free("b")
    assert_empty(m)


def test_separate_layout_with_a_windowed_target():
    m = make_manager(target_window=8, layout=KVLayout.SEPARATE)
    a = list(range(24))
    run_request(m, "a", a)
    assert tree(m)[1] == (24, {"target": [N, N, N, N, 4, 5]})
    match = m.match_prefix(a + [1, 2])
    # the uncached drafter recomputes from 17, so the target would re-run from 16: 9..
    assert (match.num_tokens, match.compute_start) == (0, {"target": 0, "draft": 0})
    m.allocate("b", 26, match)
    assert set(m.transfer_pages("b", 26)) == {"target"}
    m.free("b")
    assert_empty(m)


def test_the_host_tier_keeps_and_recalls_a_windowed_target_bit_exactly():
    m = make_manager(target_window=8, target_pages=8, draft_pages=8, host_pages=16)
    a = list(range(100, 124))
    match = m.match_prefix(a)
    m.allocate("a", 24, match)
    fill(m, "a", seed=5)
    m.advance("a", 24)  # both groups keep pages 4, 5
    before = {g: pages_bits(m, "a", g, 6) for g in m.groups}
    m.free("a", a)
    m.allocate("b", 26)  # 7 pages of each group: a's node goes to the host tier
    assert m.usage()["target"].host_used == 2 and m.usage()["draft"].host_used == 2
    m.free("b")
    match = m.match_prefix(a + [7])
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "draft": 24}
    assert [p != N for p in match.recall_pages["target"]] == [False] * 4 + [True] * 2
    m.allocate("c", 25, match)
    assert rows(m, "c")[0][:4] == [N, N, N, N]
    after = {g: pages_bits(m, "c", g, 6) for g in m.groups}
    assert after["target"][4:] == before["target"][4:]
    assert after["draft"][4:] == before["draft"][4:]
    assert m.stats().prefix["target"].recalled_tokens == 24
    m.free("c")
    assert_empty(m)
