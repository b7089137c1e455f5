"""What a config asks for that Tandem does not implement is refused, the message naming
the field and the value."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from models.byte_tokenizer import write_byte_tokenizer
from services.engine.models import Eagle3Drafter, EagleConfig, LlamaConfig, LlamaForCausalLM, save_model
from tests.services.engine.helpers import drafter_config, make_engine, target_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8}
DRAFTER = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "draft_vocab_size": 16,
    "rope_theta": 10000.0,
}
FULL, SLIDING = "full_attention", "sliding_attention"
LONGROPE = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32}

TARGET_CASES = [  # (config, field in the message, value in the message)
    ({**BASE, "architectures": ["GemmaForCausalLM"]}, "architectures", "'GemmaForCausalLM'"),
    (
        {**BASE, "architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]},
        "architectures",
        "'Qwen2ForCausalLM'",
    ),
    ({**BASE, "architectures": None, "model_type": "gemma"}, "model_type", "'gemma'"),
    ({**BASE, "model_type": "qwen2"}, "model_type", "'qwen2'"),
    ({**BASE, "hidden_act": "gelu"}, "hidden_act", "'gelu'"),
    ({**BASE, "mlp_bias": True}, "mlp_bias", "True"),
    ({**BASE, "partial_rotary_factor": 0.5}, "partial_rotary_factor", "0.5"),
    ({**BASE, "quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method", "awq"),
    ({**BASE, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "50.0"),
    ({**BASE, "final_logit_softcapping": 30.0}, "final_logit_softcapping", "30.0"),
    ({**BASE, "rope_parameters": {**LONGROPE, "rope_theta": 1e4}}, "rope_parameters.rope_type", "'longrope'"),
    (
        {**BASE, "rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "rope_scaling.rope_type",
        "'dynamic'",
    ),
    (
        {**BASE, "rope_parameters": None, "rope_scaling": {"rope_type": "longrope"}},
        "rope_scaling.rope_type",
        "'longrope'",
    ),
    (
        {**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}},
        "rope_parameters.attention_factor",
        "0.5",
    ),
    (
        {**BASE, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
        "rope_parameters.low_freq_factor",
        "required",
    ),
    (
        {**BASE, "rope_parameters": {"sliding_attention": {"rope_type": "default"}}},
        "rope_parameters",
        "'sliding_attention'",
    ),
    ({**BASE, "sliding_window": 4096}, "sliding_window", "4096"),
    (
        {**QWEN2, "use_sliding_window": True, "sliding_window": None, "layer_types": [FULL, SLIDING]},
        "sliding_window",
        "None",
    ),
    (
        {
            **QWEN2,
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": [FULL, "chunked_attention"],
        },
        "layer_types",
        "'chunked_attention'",
    ),
    ({**QWEN2, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types", "'sliding_attention'"),
    ({**QWEN2, "attention_bias": True}, "attention_bias", "True"),
    ({**MISTRAL, "attention_bias": True}, "attention_bias", "True"),
    ({**MISTRAL, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types", "'full_attention'"),
]
DRAFTER_CASES = [
    ({**DRAFTER, "architectures": ["LlamaForCausalLM"]}, "architectures", "'LlamaForCausalLM'"),
    ({**DRAFTER, "model_type": "qwen3"}, "model_type", "'qwen3'"),
    ({**DRAFTER, "hidden_act": "gelu"}, "hidden_act", "'gelu'"),
    ({**DRAFTER, "attention_bias": True}, "attention_bias", "True"),
    ({**DRAFTER, "tie_word_embeddings": True}, "tie_word_embeddings", "True"),
    ({**DRAFTER, "num_aux_hidden_states": 4}, "num_aux_hidden_states", "4"),
    ({**DRAFTER, "rope_scaling": LONGROPE}, "rope_scaling.rope_type", "'longrope'"),
    ({**DRAFTER, "eagle_config": {"use_mtp_layernorm": True}}, "eagle_config.use_mtp_layernorm", "True"),
    (
        {**DRAFTER, "eagle_config": {"use_aux_hidden_state": False}},
        "eagle_config.use_aux_hidden_state",
        "False",
    ),
    (
        {
            **DRAFTER,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                "eagle_aux_hidden_state_layer_convention": "before",
            },
        },
        "eagle_config.eagle_aux_hidden_state_layer_convention",
        "'before'",
    ),
]


def assert_refused(parse, d: dict, field: str, value: str) -> None:
    with pytest.raises(ValueError) as e:
        parse(d)
    message = str(e.value)
    assert message.startswith(f"{field}: "), message
    assert value in message, message


@pytest.mark.parametrize("d,field,value", TARGET_CASES, ids=[c[1] for c in TARGET_CASES])
def test_target_refusal_names_field_and_value(d, field, value):
    assert_refused(LlamaConfig.from_dict, d, field, value)


@pytest.mark.parametrize("d,field,value", DRAFTER_CASES, ids=[c[1] for c in DRAFTER_CASES])
def test_drafter_refusal_names_field_and_value(d, field, value):
    assert_refused(EagleConfig.from_dict, d, field, value)


def test_unsupported_values_list_what_is_supported():
    with pytest.raises(ValueError, match=re.escape("supported: default, linear, llama3, yarn")):
        LlamaConfig.from_dict({**BASE, "rope_parameters": {**LONGROPE}})
    with pytest.raises(ValueError, match="supported: silu"):
        LlamaConfig.from_dict({**BASE, "hidden_act": "gelu_pytorch_tanh"})


def test_window_needs_the_mistral_family():
    with pytest.raises(ValueError, match="sliding_window: 8 .*'mistral'"):
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            sliding_window=8,
        )


def test_drafter_target_hidden_size_must_match_the_target():
    target = LlamaConfig.from_dict({**BASE, "num_hidden_layers": 8})
    drafter = EagleConfig.from_dict({**DRAFTER, "target_hidden_size": 48})
    with pytest.raises(ValueError, match="target_hidden_size: drafter reads 48, target has 32"):
        drafter.check_target(target)


def test_a_drafter_narrower_than_the_target_is_refused_by_name():
    """Not a tensor-shape error in the first draft: the width is checked first, whether the
    drafter names the target's width (``target_hidden_size``) or not."""
    target = LlamaConfig.from_dict({**BASE, "num_hidden_layers": 8})
    narrow = {**DRAFTER, "hidden_size": 16, "intermediate_size": 32}
    for drafter in (narrow, {**narrow, "target_hidden_size": 32}):
        with pytest.raises(ValueError, match="drafter: hidden_size 16 differs from the target's 32"):
            EagleConfig.from_dict(drafter).check_target(target)


def test_an_engine_over_a_narrower_random_drafter_refuses_it_by_name(tmp_path):
    save_model(LlamaForCausalLM(target_config()), tmp_path / "target", dtype=torch.float32)
    write_byte_tokenizer(tmp_path / "target")
    narrow = replace(drafter_config(), hidden_size=32, target_hidden_size=64)
    save_model(Eagle3Drafter(narrow), tmp_path / "drafter", dtype=torch.float32)
    with pytest.raises(ValueError, match="drafter: hidden_size 32 differs from the target's 64"):
        make_engine((tmp_path / "target", tmp_path / "drafter"))


def test_aux_layers_outside_the_target_are_refused():
    """Ids [0, 1, 2] with no marker read as "input to layer" ids: layer -1 does not exist;
    an 8-layer target's defaults need no refusal, a 3-layer target's do (n - 4 < 0)."""
    target = LlamaConfig.from_dict({**BASE, "num_hidden_layers": 8})
    d = {**DRAFTER, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with pytest.raises(ValueError, match="aux_layer_ids: layer -1"):
        EagleConfig.from_dict(d).check_target(target)
    with pytest.raises(ValueError, match="aux_layer_ids: layer -1"):
        EagleConfig.from_dict(DRAFTER).check_target(LlamaConfig.from_dict({**BASE, "num_hidden_layers": 3}))
