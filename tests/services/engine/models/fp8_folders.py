"""FP8 checkpoints in the published layouts, written from a float32 folder (``hf_checkpoint``),
and the same weights dequantized: the reference's folder.

Layouts (name -> how every decoder linear is stored):
- ``dynamic``: compressed-tensors FP8-Dynamic: ``weight_scale`` [N, 1] per channel,
  activations per token at run time;
- ``weight_only``: compressed-tensors, per channel, ``input_activations`` null;
- ``static``: compressed-tensors FP8: one ``weight_scale`` [1], one ``input_scale`` [1];
- ``block``: ``quant_method: fp8``, ``weight_block_size`` [128, 128], ``weight_scale_inv``
  [ceil(N/128), ceil(K/128)] float32, activations per token and 128 columns;
- ``ct_block``: compressed-tensors FP8-Block (the same tensors under ``weight_scale``).
The LM head, the embedding, the norms and MoE routers stay as they are (``ignore``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
LAYOUTS = ("dynamic", "weight_only", "static", "block", "ct_block")
BLOCK = 128
ACT = {  # layout -> its activations: None, "token", "static", or "group"
    "dynamic": "token",
    "weight_only": None,
    "static": "static",
    "block": "group",
    "ct_block": "group",
}


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder linears' weights: 2-D ``*.weight`` of the layers, but norms and routers."""
    out = []
    for name, t in state.items():
        last = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if (
            name.endswith(".weight")
            and t.dim() == 2
            and ".layers." in name
            and last not in ("gate", "router")
        ):
            out.append(name)
    return [n for n in out if "norm" not in n]


def scales(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The stored scale of a float32 weight [N, K] in ``layout``: amax / 448 per row, per
    tensor or per 128 x 128 block."""
    if layout in ("dynamic", "weight_only"):
        return (w.abs().amax(dim=1, keepdim=True) / 448.0).float()  # [N, 1]
    if layout == "static":
        return (w.abs().amax() / 448.0).reshape(1).float()  # [1]
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    return (blocks.abs().amax(dim=(1, 3)) / 448.0).float()  # [ceil(N/128), ceil(K/128)]


def expanded(scale: torch.Tensor, shape: torch.Size, layout: str) -> torch.Tensor:
    """A stored scale spread over every element of a [N, K] weight."""
    if layout in ("block", "ct_block"):
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return full[: shape[0], : shape[1]]
    return scale.reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.reshape(1, 1).expand(shape)


def write_fp8(
    src: Path, dst: Path, layout: str, seed: int = 0, names: Callable[[dict], list[str]] = quantized_names
) -> dict[str, torch.Tensor]:
    """``dst``: ``src``'s folder with its decoder linears (``names`` of its state) in
    ``layout``; returns the dequantized weights by tensor name (float32) and, for
    ``static``, the input scales under ``<module>.input_scale``."""
    state = load_file(str(src / "model.safetensors"))
    out, dequantized = dict(state), {}
    g = torch.Generator().manual_seed(seed)
    scale_name = "weight_scale_inv" if layout == "block" else "weight_scale"
    for name in names(state):
        w = state[name].float()
        s = scales(w, layout)
        data = (w / expanded(s, w.shape, layout)).clamp(-448, 448).to(E4M3)
        module = name[: -len(".weight")]
        out[name], out[f"{module}.{scale_name}"] = data, s
        dequantized[name] = data.float() * expanded(s, w.shape, layout)
        if layout == "static":
            input_scale = (0.004 + 0.004 * torch.rand(1, generator=g)).float()  # [1]
            out[f"{module}.input_scale"] = dequantized[f"{module}.input_scale"] = input_scale
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def write_dequantized(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """``dst``: ``src``'s float32 folder with the dequantized weights in place of its own."""
    state = load_file(str(src / "model.safetensors"))
    state.update({k: v for k, v in dequantized.items() if not k.endswith("input_scale")})
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def args(**kw) -> dict:
    """compressed-tensors QuantizationArgs of 8-bit floats, as llm-compressor writes them."""
    base = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {**base, **kw}


def quantization_config(layout: str) -> dict:
    """The published ``quantization_config`` of ``layout``."""
    if layout == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    weights = {
        "dynamic": args(strategy="channel", dynamic=False),
        "weight_only": args(strategy="channel", dynamic=False),
        "static": args(strategy="tensor", dynamic=False),
        "ct_block": args(strategy="block", dynamic=False, block_structure=[128, 128]),
    }[layout]
    acts = {
        "dynamic": args(strategy="token", dynamic=True, observer=None),
        "weight_only": None,
        "static": args(strategy="tensor", dynamic=False),
        "ct_block": args(strategy="group", dynamic=True, group_size=128, observer=None),
    }[layout]
    group = {
        "format": "float-quantized",
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": acts,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": "0.10.0",
    }


def fake_quantized(x: torch.Tensor, act: str | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] quantized to e4m3 and back in float32 as the layout's activations are: per
    token (amax / 448), per token and 128 columns, or by the static ``input_scale``."""
    if act is None:
        return x
    if act == "static":
        return (x / input_scale).clamp(-448, 448).to(E4M3).float() * input_scale
    if act == "token":
        s = x.abs().amax(dim=-1, keepdim=True) / 448.0
        return (x / s).clamp(-448, 448).to(E4M3).float() * s
    out = torch.empty_like(x)
    for lo in range(0, x.shape[-1], BLOCK):
        part = x[:, lo : lo + BLOCK]
        s = part.abs().amax(dim=-1, keepdim=True) / 448.0
        out[:, lo : lo + BLOCK] = (part / s).clamp(-448, 448).to(E4M3).float() * s
    return out
