"""Every ``quantization_config`` Tandem does not load is refused by name: the key and its
value (``quant_config.py``); the FP8 layouts read to their schemes."""

from __future__ import annotations

import pytest

from services.engine.models.config import EagleConfig, LlamaConfig
from services.engine.models.quant_config import Fp8Scheme, read_quantization
from tests.services.engine.models.fp8_folders import args, quantization_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def ct(group: dict | None = None, **top) -> dict:
    """compressed-tensors FP8-Dynamic with ``group``'s keys and ``top``'s replaced."""
    q = quantization_config("dynamic")
    q["config_groups"]["group_0"].update(group or {})
    return {**q, **top}


REFUSED = [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method", "'awq'", "int4"),
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method", "'gptq'", "GPTQ"),
    (
        {"quant_method": "modelopt", "quant_algo": "NVFP4"},
        "quantization_config.quant_method",
        "'modelopt'",
        "",
    ),
    ({"quant_method": "mxfp4"}, "quantization_config.quant_method", "'mxfp4'", "gpt-oss"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method", "'bitsandbytes'", ""),
    (
        {"quant_method": "fp8", "weight_block_size": [64, 64]},
        "quantization_config.weight_block_size",
        "[64, 64]",
        "[128, 128]",
    ),
    ({"quant_method": "fp8"}, "quantization_config.weight_block_size", "None", "[128, 128]"),
    (
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
        "quantization_config.activation_scheme",
        "'static'",
        "dynamic",
    ),
    (
        {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"},
        "quantization_config.fmt",
        "'e5m2'",
        "e4m3",
    ),
    (ct(format="pack-quantized"), "quantization_config.format", "'pack-quantized'", "float-quantized"),
    (ct(format="int-quantized"), "quantization_config.format", "'int-quantized'", ""),
    (ct(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme", "num_bits", "null"),
    (ct(unknown_key=1), "quantization_config.unknown_key", "1", "config_groups"),
    (
        ct({"weights": args(strategy="channel", dynamic=False, num_bits=4)}),
        "quantization_config.config_groups.group_0.weights.num_bits",
        "4",
        "8",
    ),
    (
        ct({"weights": args(strategy="channel", dynamic=False, type="int")}),
        "quantization_config.config_groups.group_0.weights.type",
        "'int'",
        "float",
    ),
    (
        ct({"weights": args(strategy="group", dynamic=False, group_size=128)}),
        "quantization_config.config_groups.group_0.weights.strategy",
        "'group'",
        "channel",
    ),
    (
        ct({"weights": args(strategy="block", dynamic=False, block_structure=[64, 64])}),
        "quantization_config.config_groups.group_0.weights.block_structure",
        "[64, 64]",
        "[128, 128]",
    ),
    (
        ct({"input_activations": args(strategy="tensor", dynamic=True)}),
        "quantization_config.config_groups.group_0.input_activations.dynamic",
        "True",
        "static",
    ),
    (
        ct({"input_activations": args(strategy="token", dynamic=True, num_bits=4)}),
        "quantization_config.config_groups.group_0.input_activations.num_bits",
        "4",
        "8",
    ),
    (
        ct({"weights": args(strategy="channel", dynamic=False, actorder="group")}),
        "quantization_config.config_groups.group_0.weights.actorder",
        "'group'",
        "null",
    ),
    (
        ct({"output_activations": args(strategy="token", dynamic=True)}),
        "quantization_config.config_groups.group_0.output_activations",
        "num_bits",
        "null",
    ),
    (
        ct({"format": "nvfp4-pack-quantized"}),
        "quantization_config.config_groups.group_0.format",
        "'nvfp4-pack-quantized'",
        "float-quantized",
    ),
]


@pytest.mark.parametrize("q,field,value,supported", REFUSED, ids=[f"{c[1]}={c[2]}" for c in REFUSED])
@pytest.mark.parametrize("parse", [LlamaConfig.from_dict, EagleConfig.from_dict], ids=["target", "drafter"])
def test_refusal_names_key_and_value(parse, q, field, value, supported):
    d = {**BASE, "quantization_config": q}
    if parse == EagleConfig.from_dict:
        d = {**d, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    with pytest.raises(ValueError) as e:
        parse(d)
    message = str(e.value)
    assert message.startswith(f"{field}: "), message
    assert value in message and "is not supported; supported: " in message and supported in message, message


def test_layouts_read_to_their_schemes():
    dynamic = read_quantization({"quantization_config": quantization_config("dynamic")})
    assert dynamic.scheme_of("model.layers.0.self_attn.q_proj") == Fp8Scheme("channel", "token")
    assert dynamic.scheme_of("lm_head") is None
    assert dynamic.scheme_of("model.layers.0.mlp.gate") is None  # ignore's regex
    static = read_quantization({"quantization_config": quantization_config("static")})
    assert static.scheme_of("model.layers.1.mlp.down_proj") == Fp8Scheme("tensor", "static")
    block = read_quantization({"quantization_config": quantization_config("block")})
    assert block.scheme_of("model.layers.0.mlp.up_proj") == Fp8Scheme(
        "block", "group", 128, "weight_scale_inv"
    )
    skipped = {**quantization_config("block"), "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    assert read_quantization({"quantization_config": skipped}).scheme_of("model.layers.0.mlp.gate") is None
    ct_block = read_quantization({"quantization_config": quantization_config("ct_block")})
    assert ct_block.scheme_of("model.layers.0.mlp.up_proj") == Fp8Scheme("block", "group", 128)
    weight_only = read_quantization({"quantization_config": quantization_config("weight_only")})
    assert weight_only.scheme_of("model.layers.0.mlp.up_proj") == Fp8Scheme("channel", "none")
    assert LlamaConfig.from_dict({**BASE, "quantization_config": quantization_config("dynamic")})
