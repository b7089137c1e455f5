"""Mixture-of-experts targets (Qwen3-MoE, Mixtral): a random checkpoint saved by
``transformers`` in the published per-expert layout loads with ``load_target`` and gives
transformers' float32 logits within 1e-4; the routing equals transformers' router."""

from __future__ import annotations

import pytest
import torch

from services.engine.models import LlamaConfig, load_target
from services.engine.models.moe import SparseMoe, route
from tests.services.engine.models.hf_models import MOE, hf_checkpoint, hf_logits, prompt, tandem_logits

TOL = 1e-4
CASES = {
    "qwen3_moe": ("qwen3_moe", MOE["qwen3_moe"]),
    "qwen3_moe-no-renorm": ("qwen3_moe", {**MOE["qwen3_moe"], "norm_topk_prob": False}),
    "qwen3_moe-dense-layer": ("qwen3_moe", {**MOE["qwen3_moe"], "mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step-2": ("qwen3_moe", {**MOE["qwen3_moe"], "decoder_sparse_step": 2}),
    "mixtral": ("mixtral", MOE["mixtral"]),
    "mixtral-window-8": ("mixtral", {**MOE["mixtral"], "sliding_window": 8}),
    "gpt_oss": ("gpt_oss", MOE["gpt_oss"]),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    reference = hf_checkpoint(tmp_path, family, **overrides)
    model = load_target(tmp_path)
    ids = prompt(40)
    assert (tandem_logits(model, ids) - hf_logits(reference, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_grouped_weights_are_views_of_the_experts(tmp_path, case):
    """merge() stacks the experts once, each expert's weights views of the stack."""
    family, overrides = CASES[case]
    hf_checkpoint(tmp_path, family, **overrides)
    model = load_target(tmp_path)
    before = tandem_logits(model, prompt(24))
    model.merge_projections()
    moe = [m for m in model.modules() if isinstance(m, SparseMoe)]
    assert moe and all(m.grouped is not None for m in moe)
    gate = moe[0].experts[1].linears()[0].weight
    assert gate.data_ptr() == moe[0].grouped.w13[1].data_ptr()
    assert torch.equal(tandem_logits(model, prompt(24)), before)


def test_gpt_oss_merged_experts_give_the_same_logits(tmp_path):
    hf_checkpoint(tmp_path, "gpt_oss", **MOE["gpt_oss"])
    model = load_target(tmp_path)
    before = tandem_logits(model, prompt(24))
    model.merge_projections()
    assert torch.equal(tandem_logits(model, prompt(24)), before)


def test_gpt_oss_layers_form_a_sliding_and_a_full_group(tmp_path):
    hf_checkpoint(tmp_path, "gpt_oss", **MOE["gpt_oss"])
    groups = {g.name: (g.layer_ids, g.window) for g in load_target(tmp_path).kv_layer_groups()}
    assert groups == {"target": ((1, 3), 0), "target_sliding": ((0, 2), 16)}


def test_which_layers_route_is_what_transformers_builds(tmp_path):
    reference = hf_checkpoint(
        tmp_path, "qwen3_moe", num_hidden_layers=4, **MOE["qwen3_moe"], mlp_only_layers=[3]
    )
    routed = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in reference.model.layers]
    config = load_target(tmp_path).config
    assert [config.routed(i) for i in range(4)] == routed == [True, True, True, False]


def test_route_is_transformers_router(tmp_path):
    reference = hf_checkpoint(tmp_path, "qwen3_moe", **MOE["qwen3_moe"])
    router = reference.model.layers[0].mlp.gate
    x = torch.randn(9, 64)
    _, weights, ids = router(x)
    got_ids, got_weights = route(torch.nn.functional.linear(x, router.weight), 2, True)
    assert torch.equal(got_ids, ids)
    assert torch.allclose(got_weights, weights.float(), atol=0, rtol=0)


def test_route_ties_keep_topk_order():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    ids, weights = route(logits, 2, renormalize=True)
    assert torch.equal(ids, torch.topk(torch.softmax(logits, -1), 2).indices)
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def test_moe_configs_round_trip():
    for family, extra in [
        (
            "qwen3_moe",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,)),
        ),
        (
            "mixtral",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True),
        ),
    ]:
        config = LlamaConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            model_type=family,
            **extra,
        )
        assert LlamaConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "keys, field",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ],
)
def test_bad_moe_geometry_is_refused_by_name(keys, field):
    d = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        **keys,
    }
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_dict(d)
