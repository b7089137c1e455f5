"""Registration checks of tensor-parallel groups: every rank's RankInfo.

A worker of TP size n is n ranks, each with its own RankInfo (own ``tp_rank``, own transfer
endpoint, own instance id ``<worker>/rank<r>`` past rank 0). Rank 0 registers the group with
the router; at pairing the two rank-0s exchange their groups' RankInfos, and each side
checks (a) that the peer's ranks form one consistent group and (b) every rank of its own
group against every rank of the peer's with :func:`check_peer`, which accepts different
TP sizes when the heads divide. Nothing is refused twice: a mismatch every rank pair
shares is named once, by the rank-0 pair.
"""

from __future__ import annotations

from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from services.common.peer_check import Mismatch, check_peer, field_text, field_value

_SAME_IN_GROUP = (
    "schema_version",
    "role",
    "model_id",
    "drafter_id",
    "drafter_kind",
    "tp_size",
    "pp_size",
    "tokens_per_page",
    "kv_layout",
    "num_draft_layers",
    "num_spec_tokens",
    "draft_block_width",
    "unsafe_forced_acceptance",
)
"""RankInfo fields every rank of a group shares with its rank 0."""


def rank_instance_id(worker_id: str, rank: int) -> str:
    """Rank 0 carries the worker's id (what the router knows); rank r > 0 ``id/rank<r>``."""
    return worker_id if rank == 0 else f"{worker_id}/rank{rank}"


def group_to_bytes(ranks: list[rpb.RankInfo]) -> bytes:
    return reg.ListPeersResponse(peers=ranks).SerializeToString()


def group_from_bytes(data: bytes) -> list[rpb.RankInfo]:
    return list(reg.ListPeersResponse.FromString(data).peers)


def check_group(ranks: list[rpb.RankInfo]) -> list[Mismatch]:
    """Does ``ranks`` (rank 0 first) form one worker's TP group?"""
    if not ranks:
        return [Mismatch("ranks", "", "none", "a group has at least rank 0")]
    first, out = ranks[0], []
    size = first.tp_size or 1
    if [r.tp_rank for r in ranks] != list(range(size)):
        out.append(
            Mismatch(
                "ranks.tp_rank",
                str(list(range(size))),
                str([r.tp_rank for r in ranks]),
                f"tp_size {size} needs ranks 0.. once each, in order",
            )
        )
    for r in ranks[1:]:
        out.extend(_rank_mismatches(first, r))
    return out


def _rank_mismatches(first: rpb.RankInfo, r: rpb.RankInfo) -> list[Mismatch]:
    """Where rank ``r`` disagrees with its rank 0 ``first``."""
    path, out = f"ranks[{r.tp_rank}]", []
    for name in _SAME_IN_GROUP:
        if field_value(r, name) != field_value(first, name):
            mine, theirs = field_text(first, name), field_text(r, name)
            out.append(Mismatch(f"{path}.{name}", mine, theirs, "differs from rank 0"))
    if _geometry(r) != _geometry(first):
        out.append(
            Mismatch(
                f"{path}.groups",
                str(_geometry(first)),
                str(_geometry(r)),
                "layer groups differ from rank 0's",
            )
        )
    expected_id = rank_instance_id(first.instance_id, r.tp_rank)
    if r.instance_id != expected_id:
        out.append(Mismatch(f"{path}.instance_id", repr(expected_id), repr(r.instance_id)))
    return out


def check_peer_group(local: list[rpb.RankInfo], peer: list[rpb.RankInfo]) -> list[Mismatch]:
    """Every reason to refuse the peer group: its own consistency, then every rank pair."""
    out = [Mismatch(f"peer.{m.field}", m.local, m.peer, m.reason) for m in check_group(peer)]
    seen: set[tuple[str, str, str]] = set()
    for mine in local:
        for theirs in peer:
            for m in check_peer(mine, theirs):
                key = (m.field, m.local, m.peer)
                if key in seen:
                    continue
                seen.add(key)
                prefix = (
                    "" if mine.tp_rank == theirs.tp_rank == 0 else f"ranks[{mine.tp_rank}/{theirs.tp_rank}]."
                )
                out.append(Mismatch(prefix + m.field, m.local, m.peer, m.reason))
    return out


def _geometry(info: rpb.RankInfo) -> list[tuple]:
    return [
        (
            g.name,
            g.num_kv_heads,
            g.total_num_kv_heads,
            g.head_dim,
            g.dtype_name,
            g.window,
            list(g.layer_ids),
            g.page_bytes,
            g.num_pages,
        )
        for g in info.groups
    ]
