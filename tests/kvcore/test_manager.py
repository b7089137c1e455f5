"""The design.md §3 scenarios, with the exact page ids after each step.

Unless a test says otherwise: 4 tokens per page, draft window 8 (1 layer), K = 2 so the
headroom is 3 tokens, 32 pages per group.
"""

from __future__ import annotations

import pytest
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
)


def test_window_release_keeps_the_extent(manager):
    manager.allocate("a", 10)
    assert rows(manager, "a") == ([0, 1, 2, 3], [0, 1, 2, 3])
    manager.advance("a", 10)  # window covers positions 3..9: nothing stale
    manager.extend("a", 14)  # extent covers 14 + 3 headroom = 17 tokens -> 5 pages
    assert rows(manager, "a") == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    manager.advance("a", 14)  # next query at 14 reads 7..14: page 0 is stale
    assert rows(manager, "a") == ([0, 1, 2, 3, 4], [N, 1, 2, 3, 4])
    assert manager.num_request_pages("a") == {"target": 5, "draft": 4}
    manager.advance("a", 19)
    assert rows(manager, "a") == ([0, 1, 2, 3, 4], [N, N, N, 3, 4])
    assert manager.block_tables(["a"], "draft").tolist() == [[N, N, N, 3, 4]]
    manager.free("a")
    assert free_queue(manager, "target") == [*range(5, 32), 4, 3, 2, 1, 0]
    assert free_queue(manager, "draft") == [*range(5, 32), 0, 1, 2, 4, 3]
    assert_empty(manager)


def test_headroom_on_a_page_boundary_when_every_draft_is_accepted():
    manager = make_manager(k=3)  # headroom 4 = K + 1 verify positions
    manager.allocate("a", 12)
    manager.advance("a", 12)  # the window at 12 reads 5..12: page 0 is stale
    assert rows(manager, "a") == ([0, 1, 2, 3], [N, 1, 2, 3])
    # verify writes positions 12..15: the last page of the extent, no extension needed
    assert len(manager.block_table("a", "target")) * 4 > 15
    manager.advance("a", 16)  # all 3 drafts + the bonus accepted
    assert manager.can_extend("a", 16)
    manager.extend("a", 16)  # next verify writes 16..19: one new page
    assert rows(manager, "a") == ([0, 1, 2, 3, 4], [N, N, 2, 3, 4])
    manager.free("a")
    assert_empty(manager)


def test_branch_within_the_window_reuses_the_draft_pages(manager):
    a = list(range(24))
    run_request(manager, "a", a)  # extent 7 pages; draft keeps pages 4..6 at the end
    b = a + [100, 101]
    match = manager.match_prefix(b)
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "draft": 24}
    assert match.reused_pages == {"target": [0, 1, 2, 3, 4, 5], "draft": [N, N, N, N, 4, 5]}
    manager.allocate("b", len(b), match)
    assert rows(manager, "b") == ([0, 1, 2, 3, 4, 5, 7, 8], [N, N, N, N, 4, 5, 7, 8])
    assert manager.stats().prefix["draft"].hit_tokens == 24
    manager.advance("b", len(b))
    manager.free("b", b)
    assert_empty(manager)


def test_incomplete_draft_window_is_recomputed(manager):
    a = list(range(24))
    run_request(manager, "a", a)
    c = a[:20] + [200, 201, 202, 203, 204]
    match = manager.match_prefix(c)
    # the target matches 20 tokens; the draft's window at 20 needs positions 13..19, but
    # page 3 (12..15) was released while "a" ran, so the draft recomputes from 13
    assert match.num_tokens == 20
    assert match.compute_start == {"target": 20, "draft": 13}
    assert match.recompute_start == 13
    manager.allocate("c", len(c), match)
    assert rows(manager, "c") == ([0, 1, 2, 3, 4, 7, 8], [N, N, N, 7, 8, 9, 10])
    assert manager.stats().prefix["draft"].hit_tokens == 0
    assert manager.stats().prefix["draft"].recomputed_tokens == 7
    assert manager.stats().prefix["target"].hit_tokens == 20
    manager.free("c")
    assert_empty(manager)


def test_multi_layer_draft_recomputes_further_back():
    manager = make_manager(draft_layers=2)
    a = list(range(24))
    run_request(manager, "a", a)
    match = manager.match_prefix(a[:20] + [9, 9, 9, 9, 9])
    assert match.compute_start == {"target": 20, "draft": 20 - 2 * 7}


def test_partial_page_hit_copies_the_page_for_every_group():
    manager = make_manager(window=16)
    a = list(range(12))
    manager.allocate("a", 12)
    pool(manager, "target")[2] = 7.0
    pool(manager, "draft")[2] = 3.0
    manager.advance("a", 12)
    manager.free("a", a)
    b = a[:10] + [50, 51, 52]
    match = manager.match_prefix(b)
    assert match.num_tokens == 10
    assert match.cow_pages == {"target": 2, "draft": 2}
    assert match.reused_pages == {"target": [0, 1], "draft": [0, 1]}
    manager.allocate("b", len(b), match)
    assert rows(manager, "b") == ([0, 1, 4, 5], [0, 1, 4, 5])
    assert torch.equal(pool(manager, "target")[4], torch.full_like(pool(manager, "target")[4], 7.0))
    assert torch.equal(pool(manager, "draft")[4], torch.full_like(pool(manager, "draft")[4], 3.0))
    # the shared source page stays in the cache, untouched and unlocked
    assert ref_count(manager, "target", 2) == 1
    manager.free("b")
    assert_empty(manager)


def test_eviction_is_least_recently_used_first():
    manager = make_manager(target_pages=12, draft_pages=12)
    x, y, z = list(range(100, 108)), list(range(200, 208)), list(range(300, 308))
    for name, tokens in (("x", x), ("y", y), ("z", z)):
        run_request(manager, name, tokens)
    assert free_queue(manager, "target") == [9, 10, 11, 2, 5, 8]
    manager.match_prefix(x + [1])  # x becomes the most recently used
    assert manager.can_allocate(28)
    manager.allocate("w", 28)  # 8 pages, 6 free: evicts y (pages 3, 4)
    assert manager.block_table("w", "target") == [9, 10, 11, 2, 5, 8, 3, 4]
    assert manager.match_prefix(y + [1]).num_tokens == 0
    assert manager.match_prefix(x + [1]).num_tokens == 8
    manager.free("w")  # its pages return in reverse: tail pages are reused last
    assert free_queue(manager, "target") == [4, 3, 8, 5, 2, 11, 10, 9]
    manager.allocate("v", 36)  # 10 pages, 8 free: evicts z (6, 7), the older of z and x
    assert manager.block_table("v", "target") == [4, 3, 8, 5, 2, 11, 10, 9, 6, 7]
    assert manager.match_prefix(z + [1]).num_tokens == 0
    assert manager.match_prefix(x + [1]).num_tokens == 8
    manager.free("v")
    assert_empty(manager)


def test_draft_pressure_drops_only_draft_pages_and_keeps_the_target_cached():
    manager = make_manager(draft_pages=8)
    a, b = list(range(24)), list(range(100, 124))
    run_request(manager, "a", a)  # cached: target pages 0..5, draft pages of its window (2)
    run_request(manager, "b", b)  # 7 draft pages wanted, 6 free: a's draft window goes
    usage = manager.usage()
    assert (usage["target"].cached, usage["draft"].cached) == (12, 2)
    match = manager.match_prefix(a + [7, 7])
    assert match.num_tokens == 24
    assert match.reused_pages["target"] == [0, 1, 2, 3, 4, 5]
    assert match.compute_start == {"target": 24, "draft": 17}  # the window is recomputed
    assert manager.match_prefix(b + [7]).compute_start == {"target": 24, "draft": 24}
    assert_empty(manager)


def test_draft_pressure_drops_the_least_recently_used_windows_first():
    manager = make_manager(draft_pages=8)
    a, b, c, d, e = (list(range(start, start + 8)) for start in (0, 100, 200, 300, 400))
    for name, tokens in (("a", a), ("b", b), ("c", c)):
        run_request(manager, name, tokens)  # each caches 2 draft pages: 6 of 8 held
    manager.match_prefix(a + [7])  # a becomes the most recently used
    run_request(manager, "d", d)  # short of draft pages: b's go, the least recently used
    run_request(manager, "e", e)  # then c's; a's stay, touched after c was cached
    starts = [manager.match_prefix(t + [7]).compute_start for t in (a, b, c, d, e)]
    assert [s["draft"] for s in starts] == [8, 1, 1, 8, 8]
    assert [s["target"] for s in starts] == [8] * 5  # the target's pages all stay cached
    assert_empty(manager)


@pytest.mark.parametrize("target_pages", [2048, 64])  # the drafter's pool short, then the target's too
def test_a_full_cache_is_not_walked_per_request(monkeypatch, target_pages):
    """Drops, evictions and the usage counts take the least recently used candidates from
    heaps: 400 requests through a full cache walk the whole tree a few times (a heap
    rebuild), not once or twice per request as a sort of every node did."""
    walks = [0]
    walk = RadixCache.nodes

    def counted(tree):
        walks[0] += 1
        return walk(tree)

    monkeypatch.setattr(RadixCache, "nodes", counted)
    manager = make_manager(target_pages=target_pages, draft_pages=16)
    for i in range(400):
        run_request(manager, str(i), [i % 250, *range(1000 + 8 * i, 1007 + 8 * i)])
        manager.usage()
    usage = manager.usage()
    assert (usage["draft"].cached, usage["target"].cached) == (14, min(800, target_pages - 14))
    assert walks[0] <= 8
    assert_empty(manager)


def test_locked_prefix_is_not_evicted():
    manager = make_manager(target_pages=8, draft_pages=8)
    a = list(range(8))
    run_request(manager, "a", a)  # tree holds target pages 0, 1
    match = manager.match_prefix(a + [9])
    manager.allocate("b", 9, match)  # locks the prefix; extent 3 pages, 1 new
    assert manager.usage()["target"].evictable == 0
    # 5 free pages remain in each group; 6 are not available while "b" holds the prefix
    assert manager.can_allocate(20 - 3)
    assert not manager.can_allocate(24 - 3)
    manager.free("b")
    assert manager.usage()["target"].evictable == 2
    assert manager.can_allocate(24 - 3)
    assert_empty(manager)


def test_out_of_pages_is_an_answer_not_an_exception():
    manager = make_manager(target_pages=4, draft_pages=4)
    assert not manager.can_allocate(14)  # 17 tokens -> 5 pages
    with pytest.raises(RuntimeError, match="can_allocate"):
        manager.allocate("a", 14)
    assert manager.usage()["target"].used == 0
    manager.allocate("a", 13)
    assert not manager.can_extend("a", 14)
    manager.free("a")
    assert_empty(manager)


def test_transfer_pages_match_between_sender_and_receiver():
    sender, receiver = make_manager(), make_manager()
    sender.allocate("r", 22)
    sender.advance("r", 22)  # draft window at 22 reads 15..21: pages 3..5
    sent = sender.transfer_pages("r", 22)
    assert (sent["target"].first_page, sent["target"].page_ids) == (0, [0, 1, 2, 3, 4, 5])
    assert (sent["draft"].first_page, sent["draft"].page_ids) == (3, [3, 4, 5])
    assert receiver.can_allocate(22, num_computed=22)
    receiver.allocate("r", 22, num_computed=22)
    assert rows(receiver, "r") == ([0, 1, 2, 3, 4, 5, 6], [N, N, N, 0, 1, 2, 3])
    got = receiver.transfer_pages("r", 22)
    assert (got["draft"].first_page, got["draft"].page_ids) == (3, [0, 1, 2])
    assert (got["target"].first_page, got["target"].page_ids) == (0, [0, 1, 2, 3, 4, 5])
    for m in (sender, receiver):
        m.free("r")
        assert_empty(m)


def test_a_receiver_holding_a_prefix_is_sent_only_the_rest(manager):
    a = list(range(24))
    run_request(manager, "a", a)  # cached: target pages 0..5, draft 4..5 (its window)
    b = a + [100, 101, 102]  # 27 tokens: 7 pages, the draft's window at 27 reads 20..26
    match = manager.match_prefix(b)
    manager.allocate("b", 27, match, num_computed=27)
    assert manager.held_pages("b") == {"target": 6, "draft": 6}
    assert rows(manager, "b") == ([0, 1, 2, 3, 4, 5, 7, 8], [N, N, N, N, N, 5, 7, 8])
    got = manager.transfer_pages("b", 27, manager.held_pages("b"))
    assert {g: (p.first_page, p.page_ids) for g, p in got.items()} == {"target": (6, [7]), "draft": (6, [7])}
    sender = make_manager()
    sender.allocate("b", 27)
    sent = sender.transfer_pages("b", 27, manager.held_pages("b"))
    assert {g: (p.first_page, p.page_ids) for g, p in sent.items()} == {"target": (6, [6]), "draft": (6, [6])}
    assert sender.transfer_pages("b", 27)["draft"].first_page == 5  # nothing held: the window
    for m in (manager, sender):
        m.free("b")
        assert_empty(m)


def test_an_incomplete_draft_window_is_not_held_so_it_is_sent(manager):
    a = list(range(24))
    run_request(manager, "a", a)
    c = a[:20] + [200, 201, 202, 203, 204]  # target matches 20 tokens, the draft recomputes
    manager.allocate("c", 25, manager.match_prefix(c), num_computed=25)
    assert manager.held_pages("c") == {"target": 5}
    got = manager.transfer_pages("c", 25, manager.held_pages("c"))
    assert (got["target"].first_page, len(got["target"].page_ids)) == (5, 2)
    assert (got["draft"].first_page, len(got["draft"].page_ids)) == (4, 3)  # the whole window
    manager.free("c")
    assert_empty(manager)


def test_separate_layout_neither_caches_nor_transfers_the_draft():
    manager = make_manager(layout=KVLayout.SEPARATE)
    a = list(range(24))
    run_request(manager, "a", a)
    assert manager.usage()["draft"].cached == 0
    assert manager.usage()["target"].cached == 6
    match = manager.match_prefix(a + [100, 101])
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "draft": 17}
    manager.allocate("b", 26, match)
    assert manager.block_table("b", "draft") == [N, N, N, N, 7, 8, 9, 10]
    assert set(manager.transfer_pages("b", 26)) == {"target"}
    manager.free("b")
    assert_empty(manager)


def test_prefix_cache_can_be_disabled():
    manager = make_manager(prefix_cache=False)
    run_request(manager, "a", list(range(12)))
    assert manager.match_prefix(list(range(13))).num_tokens == 0
    assert manager.usage()["target"].used == 0


def test_identical_prompts_keep_one_cached_copy(manager):
    a = list(range(12))
    for name in ("p", "q"):
        manager.allocate(name, 12)  # both miss: allocated before either is cached
        manager.advance(name, 12)
    manager.free("p", a)
    manager.free("q", a)  # q's pages are duplicates: freed, not cached
    assert manager.usage()["target"].cached == 3
    assert manager.usage()["target"].used == 3
    assert_empty(manager)


def test_bad_requests_name_what_is_wrong(manager):
    with pytest.raises(KeyError, match="nope"):
        manager.free("nope")
    with pytest.raises(KeyError, match="nope"):
        manager.extend("nope", 3)
    manager.allocate("a", 4)
    with pytest.raises(ValueError, match="request_id"):
        manager.allocate("a", 4)
    manager.free("a")
