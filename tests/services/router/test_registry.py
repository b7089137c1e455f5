"""The router's choice of a prefill/decode pair."""

from __future__ import annotations

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.router.registry import PairState, Registry

PROMPT = list(range(40))  # 10 pages of 4 tokens


def cluster(decodes: int = 2) -> Registry:
    registry = Registry(tokens_per_page=4)
    for i in range(decodes):
        registry.add(rpb.RankInfo(instance_id=f"d{i}", role=rpb.ROLE_DECODE))
    registry.add(rpb.RankInfo(instance_id="p0", role=rpb.ROLE_PREFILL))
    for p, d in list(registry.pairs):
        registry.set_pair(p, d, PairState.READY)
    for w in registry.workers.values():
        w.free_pages = 100
    return registry


def test_the_decode_worker_holding_the_prefix_is_chosen():
    registry = cluster()
    registry.workers["d0"].busy_pages = 4  # the less busy one, without the prefix
    registry.index.record("d1", PROMPT[:32])
    _, decode = registry.choose_pair(PROMPT + [1, 2])
    assert decode.id == "d1"  # moves 3 pages, holds 0: cost 3 against 11 + 4


def test_load_outweighs_a_short_held_prefix():
    registry = cluster()
    registry.index.record("d1", PROMPT[:8])
    registry.workers["d1"].busy_pages = 50
    _, decode = registry.choose_pair(PROMPT)
    assert decode.id == "d0"


def test_a_decode_worker_without_room_is_passed_over():
    registry = cluster()
    registry.index.record("d1", PROMPT[:32])
    registry.workers["d1"].free_pages = 2  # fewer than the 3 pages left to move
    _, decode = registry.choose_pair(PROMPT + [1, 2])
    assert decode.id == "d0"
    registry.workers["d0"].free_pages = 0  # none has room: the cheapest still
    _, decode = registry.choose_pair(PROMPT + [1, 2])
    assert decode.id == "d1"


def test_equal_costs_go_to_the_freer_then_the_less_loaded_worker():
    registry = cluster(3)
    registry.workers["d1"].free_pages = 120
    assert registry.choose_pair(PROMPT)[1].id == "d1"
    registry.workers["d1"].free_pages = 100
    registry.workers["d0"].inflight = registry.workers["d1"].inflight = 1
    assert registry.choose_pair(PROMPT)[1].id == "d2"


def test_excluded_workers_are_not_chosen():
    registry = cluster()
    registry.index.record("d1", PROMPT)
    assert registry.choose_pair(PROMPT, {"d1"})[1].id == "d0"
    assert registry.choose_pair(PROMPT, {"p0"}) is None
