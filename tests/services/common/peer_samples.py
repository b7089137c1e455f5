"""RankInfo samples for the peer checks: a prefill and a decode rank of one geometry.

Two groups, "target" (layers 0-3, bfloat16, full attention, required) and "draft" (layer 4,
float8_e4m3fn, window 64, optional), 128-dim heads, 16 tokens per page, unified layout;
``heads`` is each rank's KV heads and ``total_heads`` the model's.
"""

from proto.tandem.v1 import rank_info_pb2 as pb


def make_group(name: str, *, heads: int = 8, total_heads: int = 8, **fields) -> pb.LayerGroupInfo:
    target = name == "target"
    group = pb.LayerGroupInfo(
        name=name,
        owner=pb.GROUP_OWNER_TARGET if target else pb.GROUP_OWNER_DRAFT,
        layer_ids=[0, 1, 2, 3] if target else [4],
        num_kv_heads=heads,
        total_num_kv_heads=total_heads,
        head_dim=128,
        dtype=pb.KV_DTYPE_BF16 if target else pb.KV_DTYPE_FP8_E4M3,
        dtype_name="bfloat16" if target else "float8_e4m3fn",
        element_bytes=2 if target else 1,
        window=0 if target else 64,
        lifecycle=pb.LIFECYCLE_REQUIRED if target else pb.LIFECYCLE_OPTIONAL,
        page_bytes=0,
        num_pages=100,
    )
    for key, value in fields.items():
        setattr(group, key, value)
    return group


def make_info(
    role: int = pb.ROLE_PREFILL, *, tp_size: int = 1, heads: int = 8, total_heads: int = 8
) -> pb.RankInfo:
    groups = [make_group(name, heads=heads, total_heads=total_heads) for name in ("target", "draft")]
    return pb.RankInfo(
        schema_version=1,
        instance_id=f"rank-{role}-{tp_size}",
        role=role,
        model_id="llama",
        drafter_id="llama-eagle",
        drafter_kind="eagle3",
        tp_size=tp_size,
        tp_rank=0,
        pp_size=1,
        tokens_per_page=16,
        kv_layout=pb.KV_LAYOUT_UNIFIED,
        groups=groups,
        num_draft_layers=1,
        num_spec_tokens=3,
        draft_block_width=1,
    )


def prefill_and_decode() -> tuple[pb.RankInfo, pb.RankInfo]:
    return make_info(pb.ROLE_PREFILL), make_info(pb.ROLE_DECODE)
