"""A tensor-parallel worker's ranks form one group, and every rank pair of two groups
is checked at pairing: TP sizes may differ when the KV heads split over both."""

from __future__ import annotations

from kvcore.spec import CacheConfig, LayerGroupSpec, Lifecycle, Owner
from kvcore.transfer import EndpointInfo
from proto.tandem.v1 import rank_info_pb2 as pb
from services.worker.rank_info import build_rank_info
from services.worker.tp_check import (
    check_group,
    check_peer_group,
    group_from_bytes,
    group_to_bytes,
    rank_instance_id,
)

HEADS = {"target": 4, "draft": 2}


def config(tp: int, target_pages: int = 64) -> CacheConfig:
    target = LayerGroupSpec(
        "target", Owner.TARGET, num_layers=2, num_kv_heads=max(HEADS["target"] // tp, 1), head_dim=16
    )
    draft = LayerGroupSpec(
        "draft",
        Owner.DRAFT,
        num_layers=1,
        num_kv_heads=max(HEADS["draft"] // tp, 1),
        head_dim=16,
        window=8,
        lifecycle=Lifecycle.OPTIONAL,
    )
    return CacheConfig(
        groups=(target, draft), tokens_per_page=4, num_pages=(target_pages, 32), num_spec_tokens=2
    )


def group(
    role: str, worker: str, tp: int, configs: dict[int, CacheConfig] | None = None
) -> list[pb.RankInfo]:
    return [
        build_rank_info(
            (configs or {}).get(r, config(tp)),
            role=role,
            instance_id=rank_instance_id(worker, r),
            model_id="m",
            drafter_id="d",
            drafter_kind="eagle3",
            tp_size=tp,
            tp_rank=r,
            total_kv_heads=HEADS,
            endpoint=EndpointInfo("ucx", bytes([r + 1])),
        )
        for r in range(tp)
    ]


def test_rank_ids_and_a_consistent_group():
    assert [rank_instance_id("decode-3", r) for r in range(3)] == [
        "decode-3",
        "decode-3/rank1",
        "decode-3/rank2",
    ]
    ranks = group("decode", "decode-3", 2)
    assert check_group(ranks) == []
    assert group_from_bytes(group_to_bytes(ranks)) == ranks


def test_a_rank_with_other_pools_or_a_missing_rank_is_named():
    ranks = group("decode", "decode-3", 2, {1: config(2, target_pages=63)})
    assert [m.field for m in check_group(ranks)] == ["ranks[1].groups"]
    assert [m.field for m in check_group(ranks[:1])] == ["ranks.tp_rank"]


def test_prefill_and_decode_of_different_tp_sizes_pair():
    for p, d in ((1, 2), (2, 1), (2, 2), (1, 4), (4, 2)):
        assert check_peer_group(group("prefill", "p", p), group("decode", "d", d)) == [], (p, d)


def test_heads_that_do_not_split_are_refused_with_the_reason():
    odd = []  # what ranks of a TP 3 worker would claim (no worker builds it: heads do not split)
    for r in range(3):
        info = group("decode", "d", 1)[0]
        info.tp_size, info.tp_rank, info.instance_id = 3, r, rank_instance_id("d", r)
        for g in info.groups:
            g.num_kv_heads = 1
        odd.append(info)
    mismatches = check_peer_group(group("prefill", "p", 2), odd)
    draft = [m for m in mismatches if m.field == "groups[draft].num_kv_heads"]
    assert draft and "2 KV heads do not split over tp 3" in draft[0].reason


def test_a_mismatch_of_every_rank_pair_is_named_once():
    decode = group("decode", "d", 2)
    for info in decode:
        info.num_spec_tokens = 3
    fields = [m.field for m in check_peer_group(group("prefill", "p", 2), decode)]
    assert fields.count("num_spec_tokens") == 1
    assert not [f for f in fields if f.endswith("num_spec_tokens") and f != "num_spec_tokens"]


def test_a_rank_forcing_acceptance_unlike_rank_0_is_named():
    ranks = group("decode", "d0", 2)
    ranks[1].unsafe_forced_acceptance = 0  # rank 0 leaves it unset: lossless
    assert [(m.field, m.local, m.peer) for m in check_group(ranks)] == [
        ("ranks[1].unsafe_forced_acceptance", "unset", "0")
    ]
    ranks[0].unsafe_forced_acceptance = 0
    assert check_group(ranks) == []
