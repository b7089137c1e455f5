"""Head ownership and routes between prefill and decode groups of different TP sizes."""

from __future__ import annotations

import pytest

from kvcore.transfer.head_routes import HeadRoute, head_routes, heads_of_rank, routes_between


def test_heads_split_evenly_or_replicate_below_tp():
    assert [heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="num_kv_heads: 2 KV heads do not split over tp 3"):
        heads_of_rank(2, 3, 0)


def test_equal_tp_is_page_to_page():
    assert head_routes(8, 2, 2) == [
        HeadRoute(0, 0, slice(0, 4), slice(0, 4), True),
        HeadRoute(1, 1, slice(0, 4), slice(0, 4), True),
    ]


def test_fewer_prefill_ranks_send_each_decode_rank_its_slice():
    assert head_routes(8, 1, 2) == [
        HeadRoute(0, 0, slice(0, 4), slice(0, 4), False),
        HeadRoute(0, 1, slice(4, 8), slice(0, 4), False),
    ]


def test_more_prefill_ranks_are_gathered_by_each_decode_rank():
    assert head_routes(8, 4, 2) == [
        HeadRoute(0, 0, slice(0, 2), slice(0, 2), False),
        HeadRoute(1, 0, slice(0, 2), slice(2, 4), False),
        HeadRoute(2, 1, slice(0, 2), slice(0, 2), False),
        HeadRoute(3, 1, slice(0, 2), slice(2, 4), False),
    ]


def test_a_replicated_head_is_sent_once_per_receiver_spread_over_its_holders():
    # 1 head on 2 prefill ranks (both hold it) -> 1 decode rank: prefill rank 0 alone sends
    assert head_routes(1, 2, 1) == [HeadRoute(0, 0, slice(0, 1), slice(0, 1), True)]
    # -> 2 decode ranks (both hold it): each from its own prefill rank
    assert head_routes(1, 2, 2) == [
        HeadRoute(0, 0, slice(0, 1), slice(0, 1), True),
        HeadRoute(1, 1, slice(0, 1), slice(0, 1), True),
    ]
    # 2 heads, prefill TP 4 (each head on 2 ranks) -> decode TP 1
    assert head_routes(2, 4, 1) == [
        HeadRoute(0, 0, slice(0, 1), slice(0, 1), False),
        HeadRoute(2, 0, slice(0, 1), slice(1, 2), False),
    ]


@pytest.mark.parametrize(
    "heads,src_tp,dst_tp", [(8, 1, 4), (8, 4, 1), (8, 2, 8), (4, 8, 2), (2, 2, 4), (1, 1, 4), (8, 8, 8)]
)
def test_every_receiver_gets_each_of_its_heads_exactly_once(heads, src_tp, dst_tp):
    routes = head_routes(heads, src_tp, dst_tp)
    for dst in range(dst_tp):
        held = heads_of_rank(heads, dst_tp, dst)
        landed = []
        for r in (r for r in routes if r.dst_rank == dst):
            owned = heads_of_rank(heads, src_tp, r.src_rank)
            sent = list(owned)[r.src_heads]
            assert sent == list(held)[r.dst_heads]
            landed += sent
            assert routes_between(routes, r.src_rank, dst) == r
        assert sorted(landed) == list(held)
