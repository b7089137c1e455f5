"""gpt-oss's MXFP4 experts: blocks and scales written by the test in the published layout
dequantize to the values they encode, and a gpt-oss folder whose experts are stored so gives
the logits of the same weights stored in bf16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.models import load_target
from services.engine.models.mxfp4 import FP4_VALUES, dequantize, dequantize_state
from tests.services.engine.models.hf_models import MOE, hf_checkpoint, prompt, tandem_logits


def encoded(experts: int, rows: int, cols: int, seed: int = 0):
    """(blocks, scales, the [E, cols, rows] values they encode): random nibbles and exponents."""
    g = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=g)
    scales = torch.randint(120, 131, (experts, rows, cols // 32), generator=g).to(torch.uint8)
    values = torch.tensor(FP4_VALUES)[nibbles] * 2.0 ** (scales.float()[..., None] - 127)
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return blocks, scales, values.reshape(experts, rows, cols).transpose(1, 2)


def test_blocks_dequantize_to_the_values_they_encode():
    blocks, scales, values = encoded(3, 5, 64)
    assert torch.equal(dequantize(blocks, scales, torch.float32), values)


def test_a_lone_half_or_a_bad_shape_is_refused_by_name():
    blocks, scales, _ = encoded(1, 2, 32)
    with pytest.raises(ValueError, match="w_scales"):
        dequantize_state({"w_blocks": blocks})
    with pytest.raises(ValueError, match="w_blocks"):
        dequantize_state({"w_scales": scales})
    with pytest.raises(ValueError, match="mxfp4"):
        dequantize(blocks[..., :8], scales)


def test_an_mxfp4_folder_gives_the_logits_of_its_bf16_weights(tmp_path):
    bf16, fp4 = tmp_path / "bf16", tmp_path / "fp4"
    hf_checkpoint(bf16, "gpt_oss", **MOE["gpt_oss"])
    state = load_file(str(bf16 / "model.safetensors"))
    quantized = dict(state)
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = t.shape  # [E, C, R]: R rows of C columns each, stored
            blocks, scales, values = encoded(experts, rows, cols, seed=len(name))
            state[name] = values.to(t.dtype).contiguous()
            del quantized[name]
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    save_file(state, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    fp4.mkdir()
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (fp4 / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(fp4 / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt(24)
    assert torch.equal(tandem_logits(load_target(fp4), ids), tandem_logits(load_target(bf16), ids))


def test_mxfp4_is_gpt_oss_only(tmp_path):
    hf_checkpoint(tmp_path, "qwen3_moe", **MOE["qwen3_moe"])
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        load_target(tmp_path)
