"""tandem.v1 messages with every field set to a non-default value, for round-trip tests."""

from proto.tandem.v1 import client_pb2, rank_info_pb2


def full_rank_info() -> rank_info_pb2.RankInfo:
    target = rank_info_pb2.LayerGroupInfo(
        name="target",
        owner=rank_info_pb2.GROUP_OWNER_TARGET,
        layer_ids=[0, 1, 2],
        num_kv_heads=4,
        total_num_kv_heads=8,
        head_dim=128,
        dtype=rank_info_pb2.KV_DTYPE_BF16,
        dtype_name="bfloat16",
        element_bytes=2,
        window=0,
        lifecycle=rank_info_pb2.LIFECYCLE_REQUIRED,
        page_bytes=3 * 2 * 4 * 16 * 128 * 2,
        num_pages=1000,
    )
    draft = rank_info_pb2.LayerGroupInfo(
        name="draft",
        owner=rank_info_pb2.GROUP_OWNER_DRAFT,
        layer_ids=[3],
        num_kv_heads=4,
        total_num_kv_heads=8,
        head_dim=128,
        dtype=rank_info_pb2.KV_DTYPE_FP8_E4M3,
        dtype_name="float8_e4m3fn",
        element_bytes=1,
        window=256,
        lifecycle=rank_info_pb2.LIFECYCLE_OPTIONAL,
        page_bytes=2 * 4 * 16 * 128,
        num_pages=64,
    )
    return rank_info_pb2.RankInfo(
        schema_version=1,
        instance_id="decode-0",
        role=rank_info_pb2.ROLE_DECODE,
        model_id="tiny-llama",
        drafter_id="tiny-eagle",
        drafter_kind="eagle3",
        tp_size=2,
        tp_rank=1,
        pp_size=1,
        pp_rank=0,
        tokens_per_page=16,
        kv_layout=rank_info_pb2.KV_LAYOUT_SEPARATE,
        groups=[target, draft],
        num_draft_layers=1,
        num_spec_tokens=3,
        draft_block_width=4,
        ucx=rank_info_pb2.UcxEndpoint(worker_address=b"\x00\x01ucx\xff", host="127.0.0.1", port=13337),
    )


def full_usage() -> client_pb2.Usage:
    return client_pb2.Usage(
        prompt_tokens=100,
        cached_tokens=64,
        cached_tokens_per_group=[
            client_pb2.GroupTokens(group="target", num_tokens=64),
            client_pb2.GroupTokens(group="draft", num_tokens=48),
        ],
        completion_tokens=20,
        acceptance_length=2.5,
        num_drafts=8,
        num_draft_tokens=24,
        num_accepted_tokens=12,
        transfers=[
            client_pb2.GroupTransfer(group="target", num_bytes=1 << 33, seconds=0.25),
            client_pb2.GroupTransfer(group="draft", num_bytes=4096, seconds=0.5),
        ],
    )
