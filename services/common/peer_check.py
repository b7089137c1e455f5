"""Registration check: may two ranks exchange KV pages?

``check_peer`` compares two RankInfos and lists every field that would make a page
pushed by one side unreadable, or read wrongly, by the other. It is pure: no I/O,
no state. An empty list means the peer is accepted.

Fields are named by their path in RankInfo (``tokens_per_page``,
``groups[draft].window``) and values are shown as text (enum value names, lists
as ``[0, 1]``), so an error message can be built from them alone.

Tensor parallelism may differ: the transfer re-slices KV heads, which works when
each side splits a group's heads evenly (see :func:`heads_per_rank`). The transfer
backends must not: pages move only between transports of one backend
(``transfer_endpoint.backend``).

A pair whose test transfer fails is refused under :data:`TRANSFER_FIELD`: the one mismatch
that is a transient failure (the router tries the pair again), not a geometry that differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from proto.tandem.v1 import rank_info_pb2, registration_pb2

_FIELDS = (
    "schema_version",
    "model_id",
    "drafter_id",
    "drafter_kind",
    "tokens_per_page",
    "kv_layout",
    "num_draft_layers",
    "num_spec_tokens",
    "draft_block_width",
    "unsafe_forced_acceptance",
)
"""RankInfo fields that must be equal (an unset optional field differs from any set value)."""

_GROUP_FIELDS = (
    "owner",
    "lifecycle",
    "layer_ids",
    "dtype",
    "dtype_name",
    "element_bytes",
    "head_dim",
    "window",
    "total_num_kv_heads",
)
"""LayerGroupInfo fields that must be equal, per group name."""

TRANSFER_FIELD = "transfer_endpoint"
"""The field a failed test transfer (or connect) refuses a pair under."""

_CONTRACT_FIELDS = ("schema_version", "model_id", "tokens_per_page")
"""RankInfo fields a router's model contract may set: every worker, of any role, must match."""

_PREFILL_SIDES = (rank_info_pb2.ROLE_PREFILL, rank_info_pb2.ROLE_BOTH)
_DECODE_SIDES = (rank_info_pb2.ROLE_DECODE, rank_info_pb2.ROLE_BOTH)


@dataclass(slots=True, frozen=True)
class Mismatch:
    """One refused field. ``local``/``peer`` are the two values as text; ``reason``
    says why when inequality alone does not (e.g. indivisible heads), else ""."""

    field: str
    local: str
    peer: str
    reason: str = ""


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int | None:
    """KV heads one rank holds when ``total_kv_heads`` are split over ``tp_size`` ranks:
    ``total / tp`` when tp divides the heads, 1 (each head replicated on
    ``tp / total`` ranks, GQA) when the heads divide tp, None when neither."""
    if total_kv_heads <= 0 or tp_size <= 0:
        return None
    if total_kv_heads % tp_size == 0:
        return total_kv_heads // tp_size
    if tp_size % total_kv_heads == 0:
        return 1
    return None


def check_peer(local: rank_info_pb2.RankInfo, peer: rank_info_pb2.RankInfo) -> list[Mismatch]:
    """Every reason to refuse ``peer`` as a KV peer of ``local``; [] = accept."""
    mismatches = _check_role(local, peer)
    mismatches += _check_backend(local, peer)
    mismatches += _diff(local, peer, _FIELDS, prefix="")
    mismatches += _check_groups(local, peer)
    return mismatches


def check_contract(contract: rank_info_pb2.RankInfo, peer: rank_info_pb2.RankInfo) -> list[Mismatch]:
    """Every field the router's ``contract`` sets (non-zero) that ``peer`` differs in; [] = accept."""
    return [m for m in _diff(contract, peer, _CONTRACT_FIELDS, prefix="") if field_value(contract, m.field)]


def format_mismatches(mismatches: list[Mismatch]) -> str:
    """One line naming each field with both values, e.g.
    ``tokens_per_page: local 16, peer 32; groups[draft].window: local 64, peer 0``."""
    parts = []
    for m in mismatches:
        text = f"{m.field}: local {m.local}, peer {m.peer}"
        parts.append(f"{text} ({m.reason})" if m.reason else text)
    return "; ".join(parts)


def mismatches_to_proto(mismatches: list[Mismatch]) -> list[registration_pb2.Mismatch]:
    return [
        registration_pb2.Mismatch(field=m.field, local_value=m.local, peer_value=m.peer, reason=m.reason)
        for m in mismatches
    ]


def _check_role(local: rank_info_pb2.RankInfo, peer: rank_info_pb2.RankInfo) -> list[Mismatch]:
    """Roles must be complementary: one side prefills, the other decodes (BOTH does both)."""
    complementary = (local.role in _PREFILL_SIDES and peer.role in _DECODE_SIDES) or (
        local.role in _DECODE_SIDES and peer.role in _PREFILL_SIDES
    )
    if complementary:
        return []
    return [
        Mismatch(
            "role",
            field_text(local, "role"),
            field_text(peer, "role"),
            "roles must be complementary: prefill with decode, or both",
        )
    ]


def _check_backend(local: rank_info_pb2.RankInfo, peer: rank_info_pb2.RankInfo) -> list[Mismatch]:
    """Pages move only between transports of one backend."""
    ours, theirs = local.transfer_endpoint.backend, peer.transfer_endpoint.backend
    if ours == theirs:
        return []
    why = "pages move only between transports of one backend"
    return [Mismatch(f"{TRANSFER_FIELD}.backend", repr(ours), repr(theirs), why)]


def _check_groups(local: rank_info_pb2.RankInfo, peer: rank_info_pb2.RankInfo) -> list[Mismatch]:
    local_groups, peer_groups = _by_name(local), _by_name(peer)
    if local_groups is None or peer_groups is None:
        return [Mismatch("groups", _group_names(local), _group_names(peer), "group names must be unique")]
    mismatches = []
    for name in _union(local.groups, peer.groups):
        path = f"groups[{name}]"
        if name not in local_groups or name not in peer_groups:
            mismatches.append(Mismatch(path, _presence(name, local_groups), _presence(name, peer_groups)))
            continue
        lg, pg = local_groups[name], peer_groups[name]
        mismatches += _diff(lg, pg, _GROUP_FIELDS, prefix=f"{path}.")
        if lg.total_num_kv_heads == pg.total_num_kv_heads:
            mismatches += _check_heads(path, lg, local.tp_size or 1, pg, peer.tp_size or 1)
    return mismatches


def _check_heads(
    path: str,
    local: rank_info_pb2.LayerGroupInfo,
    local_tp: int,
    peer: rank_info_pb2.LayerGroupInfo,
    peer_tp: int,
) -> list[Mismatch]:
    """Both sides must split the group's heads evenly and publish the per-rank count
    that split implies; then the transfer can re-slice heads between any two TP sizes."""
    reasons = [
        f"{side}: {reason}"
        for side, reason in (
            ("local", _heads_problem(local, local_tp)),
            ("peer", _heads_problem(peer, peer_tp)),
        )
        if reason
    ]
    if not reasons:
        return []
    return [
        Mismatch(
            f"{path}.num_kv_heads",
            _heads_text(local, local_tp),
            _heads_text(peer, peer_tp),
            "; ".join(reasons),
        )
    ]


def _heads_problem(group: rank_info_pb2.LayerGroupInfo, tp_size: int) -> str:
    expected = heads_per_rank(group.total_num_kv_heads, tp_size)
    if expected is None:
        return f"{group.total_num_kv_heads} KV heads do not split over tp {tp_size}"
    if expected != group.num_kv_heads:
        return (
            f"tp {tp_size} holds {expected} of {group.total_num_kv_heads} KV heads "
            f"per rank, not {group.num_kv_heads}"
        )
    return ""


def _heads_text(group: rank_info_pb2.LayerGroupInfo, tp_size: int) -> str:
    return f"{group.num_kv_heads} of {group.total_num_kv_heads} heads per rank at tp {tp_size}"


def _diff(local: Message, peer: Message, fields: tuple[str, ...], prefix: str) -> list[Mismatch]:
    return [
        Mismatch(prefix + name, field_text(local, name), field_text(peer, name))
        for name in fields
        if field_value(local, name) != field_value(peer, name)
    ]


def field_value(message: Message, name: str) -> object:
    """A field's value to compare: a list for a repeated field, None for an unset optional."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    if descriptor.has_presence and not message.HasField(name):
        return None
    value = getattr(message, name)
    return list(value) if descriptor.is_repeated else value


def field_text(message: Message, name: str) -> str:
    """A field's value as text: enum value names, lists as [a, b], strings quoted, an unset
    optional field as ``unset``."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    value = field_value(message, name)
    if value is None:
        return "unset"
    if descriptor.enum_type is not None:
        known = descriptor.enum_type.values_by_number.get(value)
        return known.name if known is not None else str(value)
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _by_name(info: rank_info_pb2.RankInfo) -> dict[str, rank_info_pb2.LayerGroupInfo] | None:
    """Groups keyed by name; None when a name repeats."""
    groups = {g.name: g for g in info.groups}
    return groups if len(groups) == len(info.groups) else None


def _union(*group_lists) -> list[str]:
    """Group names in first-seen order, local side first."""
    return list(dict.fromkeys(g.name for groups in group_lists for g in groups))


def _group_names(info: rank_info_pb2.RankInfo) -> str:
    return str([g.name for g in info.groups])


def _presence(name: str, groups: dict) -> str:
    return "present" if name in groups else "absent"
