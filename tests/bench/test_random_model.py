"""The random serving pair (bench.random_model): Llama-3.1-8B's config.json, the shard plan,
a tiny pair built on the CPU that the engine's loader reads, finite bf16 activations, and ids
past the byte tokenizer's vocabulary."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from bench.random_model import INDEX, build, shard_plan, weight_std
from bench.random_shapes import PRESETS, drafter_config, shape_from, target_config
from services.engine.models import DenseContext, dense_contexts, load_drafter, load_target
from services.engine.models.config import EagleConfig, LlamaConfig
from services.tokenization.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("random"), PRESETS["tiny"], shards=5, device="cpu")


def test_the_8b_config_is_llama_3_1_8b_with_the_byte_tokenizer_ids():
    c = target_config(PRESETS["8b"])
    expected = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    max_position_embeddings=131072, torch_dtype="bfloat16", tie_word_embeddings=False,
                    bos_token_id=256, eos_token_id=257)  # fmt: skip
    assert {k: c[k] for k in expected} == expected
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    assert c["rope_scaling"] == rope
    parsed = LlamaConfig.from_dict(c)
    assert parsed.rope_scaling["rope_type"] == "llama3" and parsed.head_dim == 128
    d = EagleConfig.from_dict(drafter_config(PRESETS["8b"])).check_target(parsed)
    assert (d.draft_vocab_size, d.aux_layer_ids, d.num_hidden_layers) == (32000, (1, 15, 28), 1)
    assert shape_from("8b", layers=2, hidden=None).layers == 2


def test_weight_scales():
    assert weight_std("model.norm.weight", (4096,), 32) == 0.0
    assert weight_std("model.embed_tokens.weight", (128256, 4096), 32) == 1.0
    assert weight_std("model.layers.0.self_attn.q_proj.weight", (4096, 4096), 32) == 1 / 64
    assert weight_std("model.layers.0.self_attn.o_proj.weight", (4096, 4096), 32) == 1 / 64 / 8
    assert weight_std("model.layers.0.mlp.down_proj.weight", (4096, 14336), 32) == 1 / math.sqrt(14336) / 8


def test_the_shard_plan_is_contiguous_cut_by_bytes_and_leaves_no_shard_empty():
    assert shard_plan([10] * 5, 5) == [0, 1, 2, 3, 4]
    assert shard_plan([100, 1, 1, 1, 1, 1], 3) == [0, 1, 2, 2, 2, 2]
    assert shard_plan([1, 1, 1, 1, 100], 2) == [0, 0, 0, 0, 1]
    assert shard_plan([1, 2, 3], 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="shards: 4 for 3 tensors"):
        shard_plan([1, 2, 3], 4)


def test_the_tiny_pair_is_five_bf16_shards_with_an_index_and_loads(pair):
    target, drafter = pair
    index = json.loads((target / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    sizes, names = 0, set()
    for name in files:
        with safe_open(str(target / name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(key)
                assert t.dtype == torch.bfloat16 and index["weight_map"][key] == name
                sizes, names = sizes + t.numel() * 2, names | {key}
    assert index["metadata"]["total_size"] == sizes and names == set(index["weight_map"])
    model = load_target(target, dtype=torch.bfloat16)
    assert set(model.state_dict()) == names
    draft = load_drafter(drafter, dtype=torch.bfloat16)
    assert draft.config.check_target(model.config).aux_layer_ids == (1, 3, 4)
    targets = torch.arange(draft.config.draft_vocab_size) + draft.d2t
    assert torch.equal(targets, draft.t2d.nonzero().flatten()) and len(set(targets.tolist())) == 256


def test_activations_stay_finite_in_bf16_and_logits_about_unit(pair):
    target, drafter = pair
    model = load_target(target, dtype=torch.bfloat16)
    draft = load_drafter(drafter, dtype=torch.bfloat16)
    aux = draft.config.check_target(model.config).aux_layer_ids
    ids = torch.randint(0, 1024, (256,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(256) * 32  # far positions too: the llama3 RoPE's long range
    with torch.inference_mode():
        out = model(ids, positions, DenseContext(1, 256), aux)
        logits = model.head(out.hidden).float()
        g = draft(ids, draft.project(out.aux), positions, DenseContext(1, 256), model)
    assert (
        torch.isfinite(out.aux.float()).all()
        and torch.isfinite(logits).all()
        and torch.isfinite(g.float()).all()
    )
    assert 0.5 < logits.std().item() < 2.0


def test_ids_past_the_tokenizer_decode_to_no_text(pair):
    tokenizer = load_tokenizer(str(pair[0]))
    assert tokenizer.vocab_size == 259  # the model's 1024 ids are a superset
    assert tokenizer.decode([104, 1000, 105, 259]) == "hi"


def test_the_gpt_oss_config_is_gpt_oss_20b():
    config = LlamaConfig.from_dict(target_config(PRESETS["gpt-oss-20b"]))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.head_dim) == (
        "gpt_oss",
        2880,
        24,
        64,
    )
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert config.layer_types[:2] == ("sliding_attention", "full_attention") and config.sliding_window == 128
    assert config.rope_scaling["rope_type"] == "yarn" and config.attention_sinks


def test_a_tiny_gpt_oss_pair_loads_and_its_bf16_activations_stay_finite(tmp_path):
    target, drafter = build(tmp_path, PRESETS["tiny-moe"], shards=2, device="cpu")
    model = load_target(target, dtype=torch.bfloat16)
    draft = load_drafter(drafter, dtype=torch.bfloat16)
    aux = draft.config.check_target(model.config).aux_layer_ids
    ids = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(0))
    ctx = dense_contexts(model.kv_layer_groups(), batch=1, seq_len=64)
    with torch.inference_mode():
        out = model(ids, torch.arange(64), ctx, aux)
        logits = model.head(out.hidden).float()
    assert torch.isfinite(out.aux.float()).all() and torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0
