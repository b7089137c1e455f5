"""check_peer across tensor-parallel sizes: the KV heads must split (or replicate, for GQA)
over both sides' tp, each rank holding its share; refusals name the heads per rank."""

import pytest

from proto.tandem.v1 import rank_info_pb2 as pb
from services.common.peer_check import Mismatch, check_peer, heads_per_rank
from tests.services.common.peer_samples import make_info


def test_tp_1_and_2_with_8_heads_are_accepted():
    local = make_info(pb.ROLE_PREFILL, tp_size=1, heads=8)
    peer = make_info(pb.ROLE_DECODE, tp_size=2, heads=4)
    assert check_peer(local, peer) == []
    assert check_peer(peer, local) == []


def test_unset_tp_size_reads_as_1():
    local = make_info(pb.ROLE_PREFILL, tp_size=0, heads=8)
    assert check_peer(local, make_info(pb.ROLE_DECODE, tp_size=2, heads=4)) == []


def test_tp_3_and_2_with_8_heads_are_refused_naming_the_heads():
    local = make_info(pb.ROLE_PREFILL, tp_size=3, heads=3)
    peer = make_info(pb.ROLE_DECODE, tp_size=2, heads=4)
    assert check_peer(local, peer) == [
        Mismatch(
            f"groups[{name}].num_kv_heads",
            "3 of 8 heads per rank at tp 3",
            "4 of 8 heads per rank at tp 2",
            "local: 8 KV heads do not split over tp 3",
        )
        for name in ("target", "draft")
    ]


def test_gqa_replication_is_accepted():
    # 2 KV heads over tp 4: each head lives on 2 ranks, 1 head per rank.
    unsharded = make_info(pb.ROLE_PREFILL, tp_size=1, heads=2, total_heads=2)
    replicated_4 = make_info(pb.ROLE_DECODE, tp_size=4, heads=1, total_heads=2)
    assert check_peer(unsharded, replicated_4) == []
    replicated_8 = make_info(pb.ROLE_PREFILL, tp_size=8, heads=1, total_heads=2)
    assert check_peer(replicated_8, replicated_4) == []


def test_gqa_replication_needs_heads_dividing_tp():
    local = make_info(pb.ROLE_PREFILL, tp_size=1, heads=3, total_heads=3)
    peer = make_info(pb.ROLE_DECODE, tp_size=4, heads=1, total_heads=3)
    assert check_peer(local, peer)[0] == Mismatch(
        "groups[target].num_kv_heads",
        "3 of 3 heads per rank at tp 1",
        "1 of 3 heads per rank at tp 4",
        "peer: 3 KV heads do not split over tp 4",
    )


def test_wrong_heads_per_rank_is_refused():
    local = make_info(pb.ROLE_PREFILL, tp_size=1, heads=8)
    peer = make_info(pb.ROLE_DECODE, tp_size=2, heads=8)  # should hold 4 per rank
    assert check_peer(local, peer)[0] == Mismatch(
        "groups[target].num_kv_heads",
        "8 of 8 heads per rank at tp 1",
        "8 of 8 heads per rank at tp 2",
        "peer: tp 2 holds 4 of 8 KV heads per rank, not 8",
    )


@pytest.mark.parametrize(
    "total, tp, expected",
    [
        (8, 1, 8),
        (8, 2, 4),
        (8, 8, 1),
        (8, 3, None),
        (8, 16, 1),
        (2, 4, 1),
        (3, 4, None),
        (6, 4, None),
        (1, 8, 1),
        (0, 2, None),
        (8, 0, None),
    ],
)
def test_heads_per_rank(total, tp, expected):
    assert heads_per_rank(total, tp) == expected
