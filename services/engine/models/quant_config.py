"""Reading ``config.json``'s ``quantization_config``: the FP8 layouts Tandem loads, every
other refused by name (``"quantization_config.<key>: <value> is not supported; supported:
..."``).

Two published layouts (``fp8_checkpoint.py`` reads their tensors):
- ``quant_method: compressed-tensors`` with ``format`` ``float-quantized`` (or
  ``naive-quantized``), as llm-compressor's FP8 schemes save it: ``config_groups`` each
  naming ``targets`` (``"Linear"``, a module name or ``"re:<regex>"``) and a scheme of 8-bit
  float ``weights`` (strategy ``channel``: ``weight_scale`` [N, 1]; ``tensor``: one scale;
  ``block`` with ``block_structure`` [128, 128]: [ceil(N/128), ceil(K/128)]) and
  ``input_activations`` (null: weight-only; ``token`` dynamic (FP8-Dynamic); ``tensor``
  static with an ``input_scale``; ``group`` of 128 dynamic, beside block weights); modules
  matched by ``ignore`` stay unquantized.
- ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (Qwen3, DeepSeek):
  ``weight_scale_inv`` [ceil(N/128), ceil(K/128)], activations quantized per token and
  128 columns at run time (``activation_scheme: dynamic``); ``modules_to_not_convert`` /
  ``ignored_layers`` stay unquantized.
Keys that only describe calibration (observers) or bookkeeping (status, ratios, version)
change nothing at inference. gpt-oss's MXFP4 experts are ``hf_config.check_neutral``'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.engine.models.hf_config import refuse

BLOCK = 128
FIELD = "quantization_config"
SUPPORTED = (
    "compressed-tensors (float-quantized FP8: channel, tensor or 128x128 block weights), "
    "fp8 (weight_block_size [128, 128]), mxfp4 (gpt-oss's experts only)"
)
NEEDS = {  # what an unsupported method would need
    "awq": "int4 group-quantized GEMMs (AWQ)",
    "gptq": "int4/int8 group-quantized GEMMs (GPTQ)",
    "bitsandbytes": "bitsandbytes' int8/nf4 matmuls",
    "modelopt": "NVFP4/FP8 ModelOpt tensors (per-tensor e4m3 with a global scale)",
    "mxfp4": "MXFP4 matmuls outside gpt-oss's experts",
    "fbgemm_fp8": "fbgemm's FP8 layout",
}
CT_KEYS = {
    "quant_method",
    "format",
    "config_groups",
    "ignore",
    "quantization_status",
    "kv_cache_scheme",
    "global_compression_ratio",
    "sparsity_config",
    "transform_config",
    "version",
    "provider",
}
CT_FORMATS = ("float-quantized", "naive-quantized")
GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
ARGS_KEYS = {  # compressed-tensors QuantizationArgs: read, or checked against their neutral value
    "num_bits",
    "type",
    "symmetric",
    "strategy",
    "dynamic",
    "group_size",
    "block_structure",
    "actorder",
    "observer",
    "observer_kwargs",
    "scale_dtype",
    "zp_dtype",
}
FP8_KEYS = {
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
}


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """One linear's FP8 layout: ``weights`` "channel", "tensor" or "block" (``block``
    columns and rows per scale); ``act`` "none", "token", "group" (per token and ``block``
    columns) or "static" (``input_scale``); ``scale_name``: the scale tensor's suffix."""

    weights: str
    act: str
    block: int = 0
    scale_name: str = "weight_scale"


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    """A checkpoint's FP8 layout: (targets, scheme) per config group, and the modules left
    unquantized (``ignore``: names or ``re:`` patterns; ``substrings``: the fp8 method's
    module names, matched as substrings as transformers does)."""

    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()
    substrings: tuple[str, ...] = ()

    def scheme_of(self, module: str) -> Fp8Scheme | None:
        """The scheme of linear ``module`` (its full name), None when it is not quantized."""
        if any(_matches(p, module) for p in self.ignore) or any(s in module for s in self.substrings):
            return None
        return next((s for targets, s in self.groups if any(_matches(t, module) for t in targets)), None)


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' rule: ``Linear`` (every linear), ``re:<regex>`` matched from the
    name's start, or the exact name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def read_quantization(d: dict[str, Any], family: str = "") -> Fp8Layout | None:
    """The FP8 layout ``d``'s ``quantization_config`` names; None when it has none (or it is
    gpt-oss's MXFP4, read elsewhere). Anything else is refused by name."""
    q = d.get(FIELD)
    if q is None:
        return None
    if not isinstance(q, dict):
        refuse(FIELD, q, f"a dict whose quant_method is one of {SUPPORTED}")
    method = q.get("quant_method")
    if method == "mxfp4" and family == "gpt_oss":
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _block_fp8(q)
    need = f" ({method} would need {NEEDS[method]})" if method in NEEDS else ""
    refuse(f"{FIELD}.quant_method", method, SUPPORTED + need)
    return None


def without_fp8(d: dict[str, Any], family: str = "") -> dict[str, Any]:
    """``d`` without its quantization_config when that is an FP8 layout Tandem loads
    (checked here, refused by name otherwise): what ``hf_config.check_neutral`` reads."""
    if read_quantization(d, family) is None:
        return d
    return {k: v for k, v in d.items() if k != FIELD}


def _unknown(q: dict[str, Any], known: set[str], where: str) -> None:
    for key in sorted(set(q) - known):
        refuse(f"{where}.{key}", q[key], ", ".join(sorted(known)))


def _compressed_tensors(q: dict[str, Any]) -> Fp8Layout:
    _unknown(q, CT_KEYS, FIELD)
    fmt = q.get("format")
    if fmt not in CT_FORMATS:
        refuse(f"{FIELD}.format", fmt, f"{', '.join(CT_FORMATS)} (FP8); other formats need their own kernels")
    if q.get("kv_cache_scheme") is not None:
        refuse(f"{FIELD}.kv_cache_scheme", q["kv_cache_scheme"], "null (the KV cache in the model's dtype)")
    if q.get("sparsity_config") not in (None, {}):
        refuse(f"{FIELD}.sparsity_config", q["sparsity_config"], "null (dense weights)")
    if q.get("transform_config") not in (None, {}):
        refuse(f"{FIELD}.transform_config", q["transform_config"], "null (no rotations)")
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        refuse(f"{FIELD}.quantization_status", status, "compressed, frozen")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        refuse(f"{FIELD}.config_groups", groups, "a dict of named groups")
    read = tuple(_group(name, g, fmt) for name, g in groups.items())
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        refuse(f"{FIELD}.ignore", ignore, "a list of module names or 're:' patterns")
    return Fp8Layout(read, tuple(ignore))


def _group(name: str, g: dict[str, Any], fmt: str) -> tuple[tuple[str, ...], Fp8Scheme]:
    where = f"{FIELD}.config_groups.{name}"
    if not isinstance(g, dict):
        refuse(where, g, "a dict with targets and weights")
    _unknown(g, GROUP_KEYS, where)
    if g.get("format", fmt) not in CT_FORMATS:
        refuse(f"{where}.format", g["format"], ", ".join(CT_FORMATS))
    if g.get("output_activations") is not None:
        refuse(f"{where}.output_activations", g["output_activations"], "null")
    targets = g.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        refuse(f"{where}.targets", targets, "a list of 'Linear', module names or 're:' patterns")
    weights, block = _weights(g.get("weights"), f"{where}.weights")
    act = _activations(g.get("input_activations"), f"{where}.input_activations", block)
    return tuple(targets), Fp8Scheme(weights, act, block)


def _fp8_args(a: Any, where: str) -> dict[str, Any]:
    """QuantizationArgs of 8-bit symmetric floats (e4m3) with no group order."""
    if not isinstance(a, dict):
        refuse(where, a, "8-bit float quantization args")
    _unknown(a, ARGS_KEYS, where)
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if a.get(key, want) != want:
            refuse(
                f"{where}.{key}",
                a[key],
                f"{want!r} (FP8 e4m3); other widths and types need their own kernels",
            )
    if a.get("actorder") is not None:
        refuse(f"{where}.actorder", a["actorder"], "null")
    for key in ("scale_dtype", "zp_dtype"):
        if a.get(key) is not None:
            refuse(f"{where}.{key}", a[key], "null (float32 scales, no zero point)")
    return a


def _weights(a: Any, where: str) -> tuple[str, int]:
    """(strategy, block) of the weights' args."""
    a = _fp8_args(a, where)
    strategy = a.get("strategy")
    if a.get("dynamic", False) is not False:
        refuse(f"{where}.dynamic", a["dynamic"], "false (scales stored in the checkpoint)")
    if strategy in ("channel", "tensor"):
        for key in ("group_size", "block_structure"):
            if a.get(key) is not None:
                refuse(f"{where}.{key}", a[key], f"null for strategy {strategy!r}")
        return strategy, 0
    if strategy == "block":
        if list(a.get("block_structure") or []) != [BLOCK, BLOCK]:
            refuse(f"{where}.block_structure", a.get("block_structure"), f"[{BLOCK}, {BLOCK}]")
        return strategy, BLOCK
    refuse(f"{where}.strategy", strategy, "channel, tensor, block ([128, 128])")
    return "", 0


def _activations(a: Any, where: str, block: int) -> str:
    """The activation scheme: none, token (dynamic), static (tensor), group (dynamic, 128)."""
    if a is None:
        return "none"
    a = _fp8_args(a, where)
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if a.get("block_structure") is not None:
        refuse(f"{where}.block_structure", a["block_structure"], "null")
    if strategy == "token" and dynamic is True:
        return "token"
    if strategy == "tensor" and dynamic is False:
        return "static"
    if strategy == "group" and dynamic is True and block and a.get("group_size") == block:
        return "group"
    if strategy in ("token", "tensor"):
        want = "true" if strategy == "token" else "false (a static input_scale)"
        refuse(f"{where}.dynamic", dynamic, f"{want} for strategy {strategy!r}")
    if strategy == "group":
        refuse(f"{where}.group_size", a.get("group_size"), f"{BLOCK}, dynamic, beside block weights")
    refuse(f"{where}.strategy", strategy, "token (dynamic), tensor (static), group (128, block weights)")
    return ""


def _block_fp8(q: dict[str, Any]) -> Fp8Layout:
    _unknown(q, FP8_KEYS, FIELD)
    if q.get("fmt", "e4m3") != "e4m3":
        refuse(f"{FIELD}.fmt", q["fmt"], "e4m3")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        refuse(f"{FIELD}.activation_scheme", q["activation_scheme"], "dynamic")
    if list(q.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        refuse(
            f"{FIELD}.weight_block_size",
            q.get("weight_block_size"),
            f"[{BLOCK}, {BLOCK}] (per-tensor fp8 is compressed-tensors' strategy 'tensor')",
        )
    skip = [*(q.get("modules_to_not_convert") or []), *(q.get("ignored_layers") or [])]
    scheme = Fp8Scheme("block", "group", BLOCK, "weight_scale_inv")
    return Fp8Layout(((("Linear",), scheme),), substrings=tuple(skip))
