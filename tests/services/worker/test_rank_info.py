"""build_rank_info maps kvcore's CacheConfig onto RankInfo field for field."""

import pytest

from kvcore.spec import CacheConfig, KVLayout, LayerGroupSpec, Lifecycle, Owner
from kvcore.transfer import EndpointInfo
from proto.tandem.v1 import rank_info_pb2 as pb
from services.common.peer_check import check_peer
from services.worker.rank_info import SCHEMA_VERSION, build_rank_info, engine_rank_info
from tests.services.engine.helpers import make_engine, write_pair

TARGET = LayerGroupSpec("target", Owner.TARGET, num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16")
DRAFT = LayerGroupSpec(
    "draft",
    Owner.DRAFT,
    num_layers=1,
    num_kv_heads=4,
    head_dim=64,
    dtype="fp8",
    window=128,
    lifecycle=Lifecycle.OPTIONAL,
    layer_ids=(4,),
)


def make_config(**overrides) -> CacheConfig:
    fields = dict(
        groups=(TARGET, DRAFT),
        tokens_per_page=16,
        num_pages=(500, 40),
        num_spec_tokens=3,
        draft_block_width=2,
    )
    return CacheConfig(**(fields | overrides))


def build(config: CacheConfig | None = None, **overrides) -> pb.RankInfo:
    kwargs = dict(
        role="decode",
        instance_id="decode-0",
        model_id="tiny-llama",
        drafter_id="tiny-eagle",
        drafter_kind="eagle3",
        tp_size=2,
        tp_rank=1,
        endpoint=EndpointInfo("ucx", b"\x01\x02", "127.0.0.1", 7000),
    )
    return build_rank_info(config or make_config(), **(kwargs | overrides))


def expected_target() -> pb.LayerGroupInfo:
    """TARGET of make_config() at tp 2: 4 of 8 heads per rank, 500 pages."""
    return pb.LayerGroupInfo(
        name="target",
        owner=pb.GROUP_OWNER_TARGET,
        layer_ids=[0, 1, 2, 3],
        num_kv_heads=4,
        total_num_kv_heads=8,
        head_dim=64,
        dtype=pb.KV_DTYPE_BF16,
        dtype_name="bfloat16",
        element_bytes=2,
        window=0,
        lifecycle=pb.LIFECYCLE_REQUIRED,
        page_bytes=4 * 2 * 4 * 16 * 64 * 2,
        num_pages=500,
    )


def expected_draft() -> pb.LayerGroupInfo:
    """DRAFT of make_config() at tp 2: fp8, window 128, 40 pages."""
    return pb.LayerGroupInfo(
        name="draft",
        owner=pb.GROUP_OWNER_DRAFT,
        layer_ids=[4],
        num_kv_heads=4,
        total_num_kv_heads=8,
        head_dim=64,
        dtype=pb.KV_DTYPE_FP8_E4M3,
        dtype_name="float8_e4m3fn",
        element_bytes=1,
        window=128,
        lifecycle=pb.LIFECYCLE_OPTIONAL,
        page_bytes=1 * 2 * 4 * 16 * 64 * 1,
        num_pages=40,
    )


def test_target_and_windowed_fp8_draft():
    assert build() == pb.RankInfo(
        schema_version=SCHEMA_VERSION,
        instance_id="decode-0",
        role=pb.ROLE_DECODE,
        model_id="tiny-llama",
        drafter_id="tiny-eagle",
        drafter_kind="eagle3",
        tp_size=2,
        tp_rank=1,
        pp_size=1,
        pp_rank=0,
        tokens_per_page=16,
        kv_layout=pb.KV_LAYOUT_UNIFIED,
        groups=[expected_target(), expected_draft()],
        num_draft_layers=1,
        num_spec_tokens=3,
        draft_block_width=2,
        transfer_endpoint=pb.TransferEndpoint(
            backend="ucx", address=b"\x01\x02", host="127.0.0.1", port=7000
        ),
    )
    assert SCHEMA_VERSION == 1


def test_page_bytes_come_from_the_spec():
    info = build()
    assert [g.page_bytes for g in info.groups] == [TARGET.page_bytes(16), DRAFT.page_bytes(16)]
    assert [g.page_bytes for g in info.groups] == [65536, 8192]


def test_separate_layout_and_roles():
    info = build(make_config(layout=KVLayout.SEPARATE), role="both")
    assert (info.kv_layout, info.role) == (pb.KV_LAYOUT_SEPARATE, pb.ROLE_BOTH)
    assert build(role="prefill").role == pb.ROLE_PREFILL


def test_target_only_config_has_no_draft_layers():
    info = build(CacheConfig(groups=(TARGET,), num_pages=(10,)), drafter_id="", drafter_kind="")
    assert [g.name for g in info.groups] == ["target"]
    assert info.num_draft_layers == 0


def test_pool_sizes_from_a_byte_budget_config():
    config = make_config(num_pages=(), memory_bytes=1 << 30)
    assert [g.num_pages for g in build(config).groups] == [0, 0]
    assert [g.num_pages for g in build(config, num_pages=(300, 20)).groups] == [300, 20]


def test_replicated_heads_need_the_total():
    config = CacheConfig(groups=(LayerGroupSpec("target", Owner.TARGET, 2, 1, 64),), num_pages=(10,))
    info = build(config, tp_size=4, tp_rank=3, total_kv_heads={"target": 2})
    assert (info.groups[0].num_kv_heads, info.groups[0].total_num_kv_heads) == (1, 2)


def test_built_prefill_and_decode_infos_are_peers():
    decode = build()
    prefill_config = make_config(
        groups=(
            LayerGroupSpec("target", Owner.TARGET, 4, 8, 64),
            LayerGroupSpec(
                "draft",
                Owner.DRAFT,
                1,
                8,
                64,
                dtype="fp8",
                window=128,
                lifecycle=Lifecycle.OPTIONAL,
                layer_ids=(4,),
            ),
        ),
        num_pages=(900, 80),
    )
    prefill = build(prefill_config, role="prefill", instance_id="prefill-0", tp_size=1, tp_rank=0)
    assert check_peer(prefill, decode) == []


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(role="router"), "role"),
        (dict(instance_id=""), "instance_id"),
        (dict(model_id=""), "model_id"),
        (dict(tp_size=0, tp_rank=0), "tp_size"),
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(pp_size=0), "pp_size"),
        (dict(pp_size=2, pp_rank=-1), "pp_rank"),
        (dict(total_kv_heads={"target": 6}), "total_kv_heads"),
        (dict(num_pages=(1, 2)), "num_pages"),
    ],
)
def test_bad_input_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        build(**overrides)


@pytest.mark.parametrize("num_pages", [(1,), (10, -1)])
def test_bad_pool_sizes_name_the_field(num_pages):
    config = make_config(num_pages=(), memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="^num_pages: "):
        build(config, num_pages=num_pages)


def test_an_engine_forcing_acceptance_publishes_it_and_a_lossless_one_does_not(tmp_path):
    pair = write_pair(tmp_path)
    forced = make_engine(pair, k=2, forced_acceptance=1, unsafe_forced_acceptance=True)
    info = engine_rank_info(forced, "decode", "decode-0", None)
    assert info.HasField("unsafe_forced_acceptance") and info.unsafe_forced_acceptance == 1
    lossless = engine_rank_info(make_engine(pair, k=2), "prefill", "prefill-0", None)
    assert not lossless.HasField("unsafe_forced_acceptance")
    assert [m.field for m in check_peer(info, lossless)] == ["unsafe_forced_acceptance"]


def test_an_engine_publishes_its_context_and_what_its_kv_holds(tmp_path):
    """max_model_len is the engine's context; max_request_tokens the longest request its
    empty cache takes (the target's 256 pages of 4 tokens less the headroom)."""
    pair = write_pair(tmp_path)
    engine = make_engine(pair, k=2, max_model_len=512)
    info = engine_rank_info(engine, "decode", "decode-0", None)
    assert info.max_model_len == 512
    assert info.max_request_tokens == 256 * 4 - engine.manager.config.headroom_tokens
    assert build(make_config()).max_model_len == 0  # a bare config publishes none
