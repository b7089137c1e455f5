"""The host tier: evicted pages of every group are kept on the host and recalled bit-exactly,
under the same lifecycle rules as the device prefix cache."""

from __future__ import annotations

import torch

from kvcore import KVLayout
from tests.kvcore.conftest import N, assert_empty, make_manager, pool, rows, store


def fill(manager, request_id: str, seed: int) -> None:
    """Random bits in every page the request holds, in every group."""
    g = torch.Generator().manual_seed(seed)
    for group in manager.groups:
        for p in manager.block_table(request_id, group):
            if p != N:
                bits = pool(manager, group)[p].view(torch.uint8)
                bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=g))


def pages_bits(manager, request_id: str, group: str, upto: int) -> list[bytes]:
    return [
        pool(manager, group)[p].view(torch.uint8).numpy().tobytes() if p != N else b""
        for p in manager.block_table(request_id, group)[:upto]
    ]


def run(manager, rid: str, tokens: list[int], seed: int) -> None:
    match = manager.match_prefix(tokens)
    manager.allocate(rid, len(tokens), match)
    fill(manager, rid, seed)
    manager.advance(rid, len(tokens))


def test_evicted_pages_come_back_bit_identical_in_every_group():
    m = make_manager(window=16, target_pages=8, draft_pages=8, host_pages=16)
    a = list(range(100, 124))  # 6 pages; window 16 keeps its last 4 draft pages
    run(m, "a", a, seed=1)
    before = {g: pages_bits(m, "a", g, 6) for g in m.groups}
    m.free("a", a)
    m.allocate("b", 26)  # 8 pages in each group: a's cached pages go to the host tier
    assert m.usage()["target"].cached == 0
    assert m.usage()["target"].host_used == 6 and m.usage()["draft"].host_used == 4
    m.free("b")
    match = m.match_prefix(a + [7])
    assert match.num_tokens == 24
    assert match.compute_start == {"target": 24, "draft": 24}
    assert [p != N for p in match.recall_pages["draft"]] == [False, False, True, True, True, True]
    m.allocate("c", 25, match)
    after = {g: pages_bits(m, "c", g, 6) for g in m.groups}
    assert after["target"] == before["target"]
    assert after["draft"][2:] == before["draft"][2:]
    assert rows(m, "c")[1][:2] == [N, N]
    assert m.stats().prefix["target"].recalled_tokens == 24
    assert m.held_pages("c") == {"target": 6, "draft": 6}  # a transfer into c skips them
    m.free("c")
    assert_empty(m)


def test_the_draft_is_recalled_only_where_its_window_is_complete():
    m = make_manager(window=8, target_pages=8, draft_pages=8, host_pages=16)
    a = list(range(24))
    run(m, "a", a, seed=2)  # draft keeps pages 4, 5 (positions 16..23) at the end
    m.free("a", a)
    m.allocate("b", 26)  # evicts a to the host
    m.free("b")
    match = m.match_prefix(a[:20] + [9, 9, 9, 9, 9])  # window at 20 needs page 3: released
    assert match.num_tokens == 20
    assert match.compute_start == {"target": 20, "draft": 13}
    assert match.recall_pages["target"] == match.recall_pages["target"][:5]
    assert "draft" not in match.recall_pages
    m.allocate("c", 25, match)
    assert rows(m, "c")[1][:3] == [N, N, N]
    m.free("c")
    assert_empty(m)


def test_separate_layout_keeps_only_the_target_on_the_host():
    m = make_manager(layout=KVLayout.SEPARATE, target_pages=8, draft_pages=8, host_pages=16)
    a = list(range(24))
    run(m, "a", a, seed=3)
    m.free("a", a)
    m.allocate("b", 26)
    assert m.usage()["target"].host_used == 6 and m.usage()["draft"].host_used == 0
    m.free("b")
    assert m.match_prefix(a + [1]).num_tokens == 24
    assert_empty(m)


def test_a_full_host_tier_drops_its_oldest_entries():
    m = make_manager(target_pages=8, draft_pages=8, host_pages=4)
    first, second = list(range(100, 116)), list(range(200, 216))
    for rid, tokens in (("x", first), ("y", second)):
        run(m, rid, tokens, seed=4)
        m.free(rid, tokens)
        m.allocate("z", 26)  # pushes the cached pages out to the host
        m.free("z")
    assert m.match_prefix(second + [1]).num_tokens == 16
    assert m.match_prefix(first + [1]).num_tokens == 0
    assert_empty(m)


def test_write_through_copies_as_pages_are_cached_so_eviction_copies_nothing():
    m = make_manager(window=16, target_pages=8, draft_pages=8, host_pages=16, host_write="through")
    a = list(range(100, 124))
    run(m, "a", a, seed=1)
    before = {g: pages_bits(m, "a", g, 6) for g in m.groups}
    m.free("a", a)
    stored = dict(store(m).host.stats.stored_pages)
    assert stored == {"target": 6, "draft": 4}  # at once, while the pages stay on the device
    assert m.usage()["target"].cached == 6
    m.allocate("b", 26)  # evicts a's node: its pages are on the host already
    assert store(m).host.stats.stored_pages == stored
    m.free("b")
    match = m.match_prefix(a + [7])
    assert match.compute_start == {"target": 24, "draft": 24}
    m.allocate("c", 25, match)
    after = {g: pages_bits(m, "c", g, 6) for g in m.groups}
    assert after["target"] == before["target"] and after["draft"][2:] == before["draft"][2:]
    m.free("c")
    assert_empty(m)


def test_a_host_hit_shorter_than_the_recall_minimum_is_recomputed():
    m = make_manager(window=16, target_pages=8, draft_pages=8, host_pages=16, host_recall_min=7)
    a = list(range(100, 124))
    run(m, "a", a, seed=1)
    m.free("a", a)
    m.allocate("b", 26)  # a's 6 pages go to the host tier
    m.free("b")
    assert m.usage()["target"].host_used == 6
    match = m.match_prefix(a + [7])  # 6 host pages < 7: not worth a recall
    assert (match.num_tokens, match.recall_pages) == (0, {"target": [], "draft": []})
    assert_empty(m)
