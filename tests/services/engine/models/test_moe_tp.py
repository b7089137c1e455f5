"""Tensor parallelism of the routed MLPs: each rank's shard of a published checkpoint, run
by the rank's own experts, sums over the ranks to the one-rank output (the all-reduce's
job), and gpt-oss's per-head sinks split with the query heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import kernels
from services.engine.kernels import Experts
from services.engine.models import LlamaForCausalLM, load_target
from services.engine.models.gpt_oss import GptOssMlp, route_top_logits
from services.engine.models.loader import read_state_dict
from services.engine.models.moe import SparseMoe, route
from services.engine.parallel import TensorParallel, shard_state_dict
from tests.services.engine.models.hf_models import MOE, hf_checkpoint

RANKS = 2


def partial_output(mlp, x: torch.Tensor) -> torch.Tensor:
    """One rank's share of the layer's output: its experts' slice, before the all-reduce."""
    if isinstance(mlp, GptOssMlp):
        ids, weights = route_top_logits(F.linear(x, mlp.router.weight, mlp.router.bias), mlp.top_k)
        return kernels.moe_experts(x, mlp.experts.grouped(mlp.limit), ids, weights)
    ids, weights = route(F.linear(x, mlp.gate.weight), mlp.top_k, mlp.renormalize)
    return kernels.moe_experts(x, Experts(*mlp._stacked()), ids, weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_rank_shards_sum_to_the_whole_layer(tmp_path, family):
    hf_checkpoint(tmp_path, family, **MOE[family])
    whole = load_target(tmp_path)
    state = read_state_dict(tmp_path)
    x = torch.randn(7, whole.config.hidden_size)
    layer = 0
    want = whole.model.layers[layer].feed_forward(x)
    got = torch.zeros_like(want)
    for rank in range(RANKS):
        model = LlamaForCausalLM(whole.config, TensorParallel(RANKS, rank))
        model.load_state_dict(shard_state_dict(model, state))
        mlp = model.model.layers[layer].feed_forward
        assert isinstance(mlp, SparseMoe | GptOssMlp)
        got += partial_output(mlp, x)
    assert torch.allclose(got, want, atol=1e-5)


def test_gpt_oss_sinks_split_with_the_query_heads(tmp_path):
    hf_checkpoint(tmp_path, "gpt_oss", **MOE["gpt_oss"])
    config = load_target(tmp_path).config
    state = read_state_dict(tmp_path)
    name = "model.layers.1.self_attn.sinks"
    shards = [
        shard_state_dict(LlamaForCausalLM(config, TensorParallel(RANKS, r)), state)[name]
        for r in range(RANKS)
    ]
    assert torch.equal(torch.cat(shards), state[name])
