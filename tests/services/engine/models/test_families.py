"""Each supported family: a random checkpoint saved by ``transformers`` loads with
``load_target`` and gives transformers' float32 logits within 1e-4 over a prompt longer
than any window (a Qwen2/3 per-layer window mix too); both config dialects read to the
same model."""

from __future__ import annotations

import pytest
import torch

from services.engine.models import DenseContext, LlamaConfig, layer_contexts, load_target
from services.engine.models.config import read_config_json
from tests.services.engine.models.hf_models import (
    CLASSES,
    GEOMETRY,
    hf_checkpoint,
    hf_logits,
    layer_mix,
    prompt,
    read_config,
    tandem_logits,
    to_transformers4,
    write_config,
)

TOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "mistral-window-8": ("mistral", {"sliding_window": 8}),
    "qwen3-yarn-rope": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
}


def assert_matches(folder, reference, ids) -> None:
    got = tandem_logits(load_target(folder), ids)
    want = hf_logits(reference, ids)
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    reference = hf_checkpoint(tmp_path, family, **overrides)
    assert_matches(tmp_path, reference, prompt(40))


@pytest.mark.parametrize("case", ["llama", "llama-llama3-rope"])
def test_transformers4_spelling_reads_to_the_same_model(tmp_path, case):
    family, overrides = CASES[case]
    reference = hf_checkpoint(tmp_path, family, **overrides)
    saved = read_config(tmp_path)
    assert "rope_parameters" in saved and "rope_theta" not in saved  # transformers 5 wrote it
    v5 = LlamaConfig.from_dict(saved)
    write_config(tmp_path, to_transformers4(saved))
    assert LlamaConfig.from_dict(read_config_json(tmp_path)) == v5
    assert_matches(tmp_path, reference, prompt(40))


def test_llama3_scaling_is_read(tmp_path):
    hf_checkpoint(tmp_path, "llama", rope_parameters=LLAMA3)
    config = load_target(tmp_path).config
    assert config.rope_theta == 50000.0
    assert config.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}


def test_family_variants_have_their_tensors(tmp_path):
    hf_checkpoint(tmp_path / "qwen2", "qwen2")
    hf_checkpoint(tmp_path / "qwen3", "qwen3")
    qwen2 = load_target(tmp_path / "qwen2").model.layers[0].self_attn
    qwen3 = load_target(tmp_path / "qwen3").model.layers[0].self_attn
    assert qwen2.q_proj.bias is not None and qwen2.o_proj.bias is None
    assert qwen3.q_proj.bias is None and qwen3.q_norm.weight.shape == (qwen3.head_dim,)


def test_mistral_window_is_the_config_window(tmp_path):
    hf_checkpoint(tmp_path, "mistral", sliding_window=8)
    assert load_target(tmp_path).config.sliding_window == 8
    hf_checkpoint(tmp_path, "mistral", sliding_window=None)
    assert load_target(tmp_path).config.sliding_window == 0


def test_qwen_window_fields_are_off_unless_use_sliding_window(tmp_path):
    """Qwen2.5 ships sliding_window 131072 with use_sliding_window false: full attention."""
    hf_checkpoint(tmp_path, "qwen2")
    config = LlamaConfig.from_dict(
        {
            **read_config(tmp_path),
            "sliding_window": 131072,
            "use_sliding_window": False,
            "max_window_layers": 21,
        }
    )
    assert config.sliding_window == 0


def test_eos_list_and_harmless_keys_are_accepted(tmp_path):
    hf_checkpoint(tmp_path, "llama")
    d = {
        **read_config(tmp_path),
        "eos_token_id": [2, 7],
        "pad_token_id": 0,
        "dtype": "bfloat16",
        "attention_dropout": 0.1,
        "pretraining_tp": 1,
        "initializer_range": 0.5,
    }
    assert LlamaConfig.from_dict(d).eos_token_id == [2, 7]


def test_per_layer_type_rope_parameters_read_the_layers_entry(tmp_path):
    hf_checkpoint(tmp_path, "llama")
    d = read_config(tmp_path)
    keyed = {**d, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 777.0}}}
    assert LlamaConfig.from_dict(keyed).rope_theta == 777.0


def test_tandem_configs_round_trip_for_every_family():
    for family, extra in [
        ("llama", {"attention_bias": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 8}),
    ]:
        config = LlamaConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            model_type=family,
            rope_scaling={"type": "linear", "factor": 2.0},
            **extra,
        )
        assert LlamaConfig.from_dict(config.to_dict()) == config


SLIDING, FULL = "sliding_attention", "full_attention"
MIX = layer_mix(64)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_per_layer_window_mix_matches_transformers(tmp_path, family):
    """Layers alternating a 64-token window and full attention: two layer groups, and
    transformers' logits over a prompt longer than the window (where the window matters)."""
    extra = {"head_dim": 24} if family == "qwen3" else {}
    reference = hf_checkpoint(tmp_path, family, **MIX, **extra)
    model = load_target(tmp_path)
    groups = [(g.name, g.layer_ids, g.window) for g in model.kv_layer_groups()]
    assert groups == [("target", (1, 3), 0), ("target_sliding", (0, 2), 64)]
    ids = prompt(150)
    got, want = tandem_logits(model, ids), hf_logits(reference, ids)
    assert (got - want).abs().max().item() < TOL
    full = layer_contexts(model.kv_layer_groups(), [DenseContext(1, 150)] * 2)
    with torch.no_grad():
        unwindowed = model.head(model(ids, torch.arange(150), full).hidden).float()
    assert (unwindowed - want)[64:].abs().max().item() > 100 * TOL


@pytest.mark.parametrize(
    "keys",
    [
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": 8},  # max_window_layers 28: no layer slides
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},  # all slide
        {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": [FULL, SLIDING, SLIDING, FULL]},
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1},
    ],
)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_which_layers_slide_is_what_transformers_computes(family, keys):
    """From a hand-written config.json (no layer_types unless given), as transformers
    reads it: each layer's window in tokens."""
    d = {**GEOMETRY, "num_hidden_layers": 4, "architectures": [f"{family.title()}ForCausalLM"], **keys}
    d["model_type"] = family
    hf = CLASSES[family][0](**{k: v for k, v in d.items() if k != "architectures"})
    want = tuple((hf.sliding_window or 0) if t == SLIDING else 0 for t in hf.layer_types)
    config = LlamaConfig.from_dict(d)
    assert config.layer_windows() == want
    assert LlamaConfig.from_dict(config.to_dict()) == config
    if config.layer_types:  # the written config reads back in transformers too
        assert CLASSES[family][0](**config.to_dict()).layer_types == list(config.layer_types)
