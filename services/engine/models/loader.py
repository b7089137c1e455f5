"""Load and save Hugging Face-style model folders: ``config.json`` + ``*.safetensors``
(one file, or shards listed by ``model.safetensors.index.json``).

Every tensor of the checkpoint must map to a parameter and every parameter must be
present: a mismatch raises ValueError naming the tensors. Under tensor parallelism each
rank reads the whole checkpoint and keeps the slices it owns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from services.engine.models.config import EagleConfig, read_config_json, write_config_json
from services.engine.models.eagle import Eagle3Drafter
from services.engine.models.fp8_checkpoint import install_fp8, split_fp8
from services.engine.models.mxfp4 import dequantize_state
from services.engine.models.quant_config import Fp8Layout, read_quantization
from services.engine.models.registry import family_of
from services.engine.models.target import TargetModel
from services.engine.parallel import SINGLE, TensorParallel, shard_state_dict

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX = "model.safetensors.index.json"
QUANTIZATIONS = ("", "fp8")  # --quantization: "" = the weights as the checkpoint has them
UNSUPPORTED_TENSORS = {"fc_norm.": "a norm on the drafter's fc input"}


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index's ``weight_map`` names when
    ``model.safetensors.index.json`` exists (each must exist), else every ``*.safetensors``."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"model_path: {folder / INDEX} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model_path: {folder} lacks {missing}, listed in {INDEX}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path: no *.safetensors in {folder}")
    return files


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(folder):
        state.update(load_file(str(f)))
    return {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}


def load_target(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tp: TensorParallel = SINGLE,
    quantization: str = "",
) -> TargetModel:
    """The target of the family its config.json names (``registry.py``). A tied config's
    stored ``lm_head.weight`` is skipped (as vLLM does): the head is the embedding. FP8
    weights load as the config's layout says (``fp8_checkpoint.py``); ``quantization``
    "fp8" quantizes the other linears at load (``--quantization fp8``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {quantization!r} is not supported; supported: {QUANTIZATIONS}")
    d = read_config_json(folder)
    family = family_of(d)
    config = family.read_config(d)
    with default_dtype(dtype):
        model = family.model(config, tp)
    state = read_state_dict(folder)
    if (d.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # gpt-oss's experts
        state = dequantize_state(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _load_quantized(model, state, read_quantization(d, family.model_type), (folder, device))
    model = _placed(model, device, dtype)
    if quantization == "fp8":
        model.quantize_fp8()
    return model


def load_drafter(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tp: TensorParallel = SINGLE,
) -> Eagle3Drafter:
    """Its aux layers may still be the defaults: resolve them with
    ``config.check_target(target.config)``."""
    config = EagleConfig.from_dict(read_config_json(folder))
    state = read_state_dict(folder)
    for name in state:
        for prefix, what in UNSUPPORTED_TENSORS.items():
            if name.startswith(prefix):
                raise ValueError(f"{name}: {what} is not supported")
    with default_dtype(dtype):
        model = Eagle3Drafter(
            config, own_head="lm_head.weight" in state, own_embed="embed_tokens.weight" in state, tp=tp
        )
    _load_quantized(model, state, read_quantization(read_config_json(folder)), (folder, device))
    return _placed(model, device, dtype)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside take ``dtype`` for their parameters: a model is built on the
    host in the dtype it will run in, not in float32 and cast (a 21 B-parameter target built
    in float32 beside its loaded bf16 tensors outgrew a 128 GiB host)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _load_quantized(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    layout: Fp8Layout | None,
    where: tuple[str | Path, str | torch.device],
) -> None:
    """``state`` into ``model``: its fp8 linears installed on the device (``where``: the
    folder, the device), every other tensor through :func:`_load_into`."""
    folder, device = where
    quantized, state = split_fp8(state, layout, model)
    state = shard_state_dict(model, state)
    install_fp8(model, quantized, device)
    _load_into(model, state, folder)


def _placed(model: TargetModel | Eagle3Drafter, device: str | torch.device, dtype: torch.dtype):
    """On ``device`` in ``dtype``, in eval mode; on a GPU with merged q/k/v and gate/up."""
    model = model.to(device=device, dtype=dtype).eval()
    if torch.device(device).type == "cuda":
        model.merge_projections()
    return model


def save_model(
    model: TargetModel | Eagle3Drafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write config.json and model.safetensors (floating tensors cast to ``dtype``)."""
    write_config_json(folder, model.config)
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def _load_into(model: nn.Module, state: dict[str, torch.Tensor], folder: str | Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"model_path: {folder} does not match the architecture: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"model_path: tensor {name} has shape {tuple(t.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
