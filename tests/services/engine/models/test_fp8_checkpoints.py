"""FP8 checkpoints in the published layouts (``fp8_folders.py``) load and compute what they
define: the logits equal those of the same model with the weights dequantized and, where the
layout quantizes activations, the activations quantized as it says (float32, 1e-4). Routed
experts run dequantized on unquantized activations (the fused MoE kernel has no fp8 path).
``--quantization fp8`` on the float folder equals its FP8-Dynamic folder."""

from __future__ import annotations

import pytest
import torch

from services.engine.models import load_target
from services.engine.models.fp8 import Fp8Linear
from tests.services.engine.models.fp8_folders import (
    ACT,
    LAYOUTS,
    fake_quantized,
    write_dequantized,
    write_fp8,
)
from tests.services.engine.models.hf_models import MOE, hf_checkpoint, prompt, tandem_logits

BLOCKS = dict(hidden_size=192, intermediate_size=320)  # partial 128-blocks on both axes
SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
CASES = [
    *(("llama", layout) for layout in LAYOUTS),
    ("qwen2", "dynamic"),  # q/k/v biases
    ("qwen3", "block"),  # q/k norms; Qwen3's published FP8 layout
    ("qwen3_moe", "dynamic"),
    ("qwen3_moe", "block"),
    ("mixtral", "static"),
]


def folders(tmp_path, family: str, layout: str) -> dict[str, torch.Tensor]:
    """tmp_path/fp8 (``layout``) and tmp_path/ref (dequantized) of one random model."""
    overrides = {**MOE.get(family, {}), **(BLOCKS if "block" in layout else {})}
    hf_checkpoint(tmp_path / "float", family, **overrides)
    dequantized = write_fp8(tmp_path / "float", tmp_path / "fp8", layout)
    write_dequantized(tmp_path / "float", tmp_path / "ref", dequantized)
    return dequantized


def input_scale(dequantized: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    """A static module's input scale: the largest of the linears reading its input."""
    parent, _, name = module.rpartition(".")
    siblings = next((group for group in SHARED if name in group), (name,))
    found = [dequantized.get(f"{parent}.{s}.input_scale") for s in siblings]
    found = [s for s in found if s is not None]
    return torch.stack(found).amax() if found else None


def reference_logits(tmp_path, layout: str, dequantized: dict, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized folder's logits, each quantized linear but the experts reading its
    input quantized as ``layout`` says."""
    model = load_target(tmp_path / "ref")
    for name, module in model.named_modules():
        if f"{name}.weight" not in dequantized or ".experts." in name:
            continue
        scale = input_scale(dequantized, name)
        module.register_forward_pre_hook(
            lambda m, a, s=scale: (fake_quantized(a[0], ACT[layout], s),)  # noqa: B023
        )
    return tandem_logits(model, ids)


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{x}" for f, x in CASES])
def test_fp8_folder_computes_its_dequantized_model(tmp_path, family, layout):
    dequantized = folders(tmp_path, family, layout)
    model = load_target(tmp_path / "fp8")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.data.dtype == torch.float8_e4m3fn
    ids = prompt(24)
    got = tandem_logits(model, ids)
    want = reference_logits(tmp_path, layout, dequantized, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if ACT[layout]:  # the activations' rounding shows: the weights alone do not give these logits
        assert (got - tandem_logits(load_target(tmp_path / "ref"), ids)).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_quantization_flag_equals_the_fp8_dynamic_folder(tmp_path, family):
    folders(tmp_path, family, "dynamic")
    ids = prompt(24)
    flagged = load_target(tmp_path / "float", quantization="fp8")
    assert isinstance(flagged.model.layers[0].self_attn.o_proj, Fp8Linear)
    assert flagged.lm_head.weight.dtype == torch.float32  # the head stays as loaded
    want = tandem_logits(load_target(tmp_path / "fp8"), ids)
    torch.testing.assert_close(tandem_logits(flagged, ids), want, atol=1e-4, rtol=0)
    again = load_target(tmp_path / "fp8", quantization="fp8")  # an fp8 folder stays as it is
    torch.testing.assert_close(tandem_logits(again, ids), want, atol=0, rtol=0)


def test_quantization_flag_refuses_other_values(tmp_path):
    hf_checkpoint(tmp_path / "float", "llama")
    with pytest.raises(ValueError, match="^quantization: 'int8' is not supported"):
        load_target(tmp_path / "float", quantization="int8")
