"""RankInfo of an engine whose target mixes per-layer windows: one LayerGroupInfo per
target group (its layers, its window), and a peer whose groups differ is refused by name."""

from __future__ import annotations

from models.byte_tokenizer import write_byte_tokenizer
from proto.tandem.v1 import rank_info_pb2 as pb
from services.common.peer_check import check_peer
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.worker.rank_info import engine_rank_info
from tests.services.engine.models.hf_models import hf_checkpoint, layer_mix

MIX = layer_mix(16)


def engine(folder) -> Engine:
    return Engine(EngineConfig(model=str(folder), drafter=None, num_spec_tokens=0, num_pages=(64, 64)))


def test_each_target_group_is_published_with_its_layers_and_window(tmp_path):
    hf_checkpoint(tmp_path, "qwen2", **MIX)
    write_byte_tokenizer(tmp_path)
    info = engine_rank_info(engine(tmp_path), "decode", "decode-0", None)
    groups = [(g.name, g.owner, list(g.layer_ids), g.window, g.total_num_kv_heads) for g in info.groups]
    assert groups == [
        ("target", pb.GROUP_OWNER_TARGET, [1, 3], 0, 2),
        ("target_sliding", pb.GROUP_OWNER_TARGET, [0, 2], 16, 2),
    ]
    assert all(g.lifecycle == pb.LIFECYCLE_REQUIRED and g.num_pages == 64 for g in info.groups)
    peer = pb.RankInfo()
    peer.CopyFrom(info)
    peer.instance_id, peer.role = "prefill-0", pb.ROLE_PREFILL
    assert check_peer(peer, info) == []
    peer.groups[1].window = 32
    peer.groups[1].layer_ids[:] = [0, 1]
    assert [m.field for m in check_peer(peer, info)] == [
        "groups[target_sliding].layer_ids",
        "groups[target_sliding].window",
    ]
