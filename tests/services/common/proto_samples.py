"""tandem.v1 messages with every field set to a non-default value, for round-trip tests."""

from proto.tandem.v1 import client_pb2, rank_info_pb2, worker_pb2


def full_rank_info() -> rank_info_pb2.RankInfo:
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
        groups=[full_target_group(), full_draft_group()],
        num_draft_layers=1,
        num_spec_tokens=3,
        draft_block_width=4,
        max_model_len=4096,
        max_request_tokens=8000,
        transfer_endpoint=rank_info_pb2.TransferEndpoint(
            backend="ucx", address=b"\x00\x01ucx\xff", host="127.0.0.1", port=13337
        ),
    )


def full_target_group() -> rank_info_pb2.LayerGroupInfo:
    """The target's group: layers 0-2, bfloat16, full attention, required."""
    return rank_info_pb2.LayerGroupInfo(
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


def full_draft_group() -> rank_info_pb2.LayerGroupInfo:
    """The drafter's group: layer 3, float8_e4m3fn, window 256, optional."""
    return rank_info_pb2.LayerGroupInfo(
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


def full_reservation() -> worker_pb2.Reservation:
    """Seven pages of each group; the draft's first two are -1 (wholly out of its window)."""
    return worker_pb2.Reservation(
        request_id="r",
        decode_instance_id="decode-0",
        num_tokens=104,
        groups=[
            worker_pb2.GroupPages(group="target", page_ids=list(range(7))),
            worker_pb2.GroupPages(group="draft", page_ids=[-1, -1, 5, 9, 2, 3, 4]),
        ],
        lease_deadline_unix_ms=1_900_000_000_000,
        transfer_tag=2**63,
        endpoint=full_rank_info().transfer_endpoint,
    )


def full_stats_response() -> worker_pb2.StatsResponse:
    return worker_pb2.StatsResponse(
        instance_id="decode-0",
        role=rank_info_pb2.ROLE_DECODE,
        num_running=3,
        num_waiting=1,
        groups=[
            worker_pb2.GroupStats(
                group="draft",
                num_pages_used=10,
                num_pages_total=64,
                prefix_cache=worker_pb2.PrefixCacheStats(
                    num_queries=5, num_hits=2, num_query_tokens=500, num_hit_tokens=128
                ),
            )
        ],
    )
