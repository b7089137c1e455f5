"""Each supported family: a random checkpoint saved by ``transformers`` loads with
``load_target`` and gives transformers' float32 logits within 1e-4 over a prompt longer
than any window; both config dialects read to the same model."""

from __future__ import annotations

import pytest

from services.engine.models import LlamaConfig, load_target
from services.engine.models.config import read_config_json
from tests.services.engine.models.hf_models import (
    hf_checkpoint,
    hf_logits,
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
