"""An FP8 checkpoint's tensors (``quant_config.py`` reads its layout) into the model.

A linear ``X`` is quantized iff its ``X.weight`` is float8_e4m3fn; then the layout's scale
is ``X.weight_scale`` ([N, 1] per channel, one value per tensor, or [ceil(N/128),
ceil(K/128)] per block) or ``X.weight_scale_inv`` (the fp8 method's blocks), with
``X.input_scale`` (one value) for static activations. Scales are read as float32 and kept
per output row (:class:`Fp8Weight`): a tensor scale repeated, block scales repeated over
their block's 128 rows. An fp8 weight the layout does not cover, a missing scale or a scale
without its weight is refused by name.

Attention and dense-MLP projections and the drafter's ``fc`` run fp8 (:class:`Fp8Linear`,
placed on the device at load; a model-wide ``.to`` does not move or cast them). Linears
with no fp8 path get their weight dequantized to float32 here and load as any other: routed
experts (the fused MoE kernel has none: they run the dequantized values on unquantized
activations), MoE routers and LM heads. Linears that read one input (q/k/v, gate/up) share
the largest of their static input scales, as one merged matmul must.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from services.engine.models.fp8 import Fp8Linear, Fp8Weight
from services.engine.models.quant_config import Fp8Layout
from services.engine.parallel import ColumnParallelLinear, RowParallelLinear

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")
DEQUANTIZED_UNDER = ("SparseMoe", "GptOssMlp")  # module classes whose linears have no fp8 path
DEQUANTIZED_NAMES = ("lm_head",)
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def split_fp8(
    state: dict[str, torch.Tensor], layout: Fp8Layout | None, model: nn.Module
) -> tuple[dict[str, Fp8Weight], dict[str, torch.Tensor]]:
    """(the linears ``model`` runs in fp8, by module name, whole; the rest of ``state``, with
    the fp8 weights of linears that have no fp8 path dequantized to float32)."""
    out, quantized = dict(state), {}
    for key in [k for k, v in state.items() if v.dtype in FP8_DTYPES]:
        if not key.endswith(".weight") or state[key].dtype != torch.float8_e4m3fn or state[key].dim() != 2:
            raise ValueError(f"{key}: a {state[key].dtype} tensor; only linear weights in float8_e4m3fn load")
        if layout is None:
            raise ValueError(f"{key}: float8_e4m3fn, but config.json has no quantization_config")
        module = key[: -len(".weight")]
        weight = read_fp8(out, module, layout)
        if runs_fp8(model, module):
            quantized[module] = weight
        else:
            out[key] = weight.dequantized()
    lone = [k for k in out if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES]
    if lone:
        raise ValueError(f"{lone[0]}: a quantization scale without a float8_e4m3fn weight")
    return quantized, out


def read_fp8(state: dict[str, torch.Tensor], module: str, layout: Fp8Layout) -> Fp8Weight:
    """Linear ``module``'s fp8 weight, its scales per row; its tensors leave ``state``."""
    scheme = layout.scheme_of(module)
    if scheme is None:
        raise ValueError(
            f"{module}.weight: float8_e4m3fn, but quantization_config leaves {module} unquantized"
        )
    data = state.pop(f"{module}.weight")
    n, k = data.shape
    scale_key = f"{module}.{scheme.scale_name}"
    if scale_key not in state:
        raise ValueError(f"{module}.weight: an fp8 weight without {scale_key}")
    scale = state.pop(scale_key).float()
    b = scheme.block
    want = {"channel": [(n, 1), (n,)], "tensor": [(), (1,)]}
    want = want.get(scheme.weights) or [(-(-n // b), -(-k // b))]
    if tuple(scale.shape) not in want:
        raise ValueError(
            f"{scale_key}: shape {tuple(scale.shape)}, expected {want[0]} "
            f"for {scheme.weights} scales of a [{n}, {k}] weight"
        )
    if scheme.weights == "block":
        scale = scale.repeat_interleave(b, dim=0)[:n]  # [N, ceil(K / b)]
    else:
        scale = scale.reshape(-1).expand(n)  # [N]
    input_key = f"{module}.input_scale"
    input_scale = state.pop(input_key, None)
    if (input_scale is not None) != (scheme.act == "static"):
        what = "a static input_scale" if scheme.act == "static" else "no input_scale (dynamic activations)"
        raise ValueError(f"{input_key}: the layout of {module} has {what}")
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise ValueError(f"{input_key}: shape {tuple(input_scale.shape)}, expected one value")
        input_scale = input_scale.float().reshape(())
    return Fp8Weight(data, scale.contiguous(), None, b, scheme.act, input_scale)


def runs_fp8(model: nn.Module, module: str) -> bool:
    """Whether linear ``module`` of ``model`` has an fp8 path (module docstring)."""
    parts = module.split(".")
    if parts[-1] in DEQUANTIZED_NAMES:
        return False
    try:
        owners = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    except AttributeError:
        return False  # not the model's: the state dict check names it
    if not isinstance(owners[-1], nn.Linear):
        return False
    return not any(type(m).__name__ in DEQUANTIZED_UNDER for m in owners)


def install_fp8(model: nn.Module, quantized: dict[str, Fp8Weight], device: str | torch.device) -> None:
    """Each linear of ``quantized`` replaced by an Fp8Linear over this rank's share of its
    weight, on ``device``; the bias (still to load) carried over."""
    for name, weight in quantized.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, attr)
        own = shard_fp8(lin, weight)
        if tuple(own.data.shape) != tuple(lin.weight.shape):
            raise ValueError(
                f"model_path: tensor {name}.weight has shape {tuple(weight.data.shape)}, "
                f"expected {tuple(lin.weight.shape)}"
            )
        own = placed(own, device)
        setattr(
            parent, attr, Fp8Linear(own, lin.bias, lin.tp if isinstance(lin, RowParallelLinear) else None)
        )
    share_input_scales(model)


def shard_fp8(lin: nn.Linear, w: Fp8Weight) -> Fp8Weight:
    """This rank's share: a column-parallel linear's output rows, a row-parallel one's input
    columns (with their block scales: the share must start on a block)."""
    if isinstance(lin, ColumnParallelLinear):
        return w.rows(lin.rows.start, lin.rows.stop)
    if not isinstance(lin, RowParallelLinear):
        return w
    lo, hi = lin.cols.start, lin.cols.stop
    scale = w.scale
    if w.block:
        if lo % w.block:
            raise ValueError(
                f"tp: a rank's input columns {lo}..{hi - 1} split the checkpoint's {w.block}-column "
                "scale blocks; use a tensor-parallel size that keeps them whole"
            )
        scale = scale[:, lo // w.block : -(-hi // w.block)]
    return replace(w, data=w.data[:, lo:hi], scale=scale)


def placed(w: Fp8Weight, device: str | torch.device) -> Fp8Weight:
    """``w``'s tensors contiguous on ``device``."""
    move = lambda t: None if t is None else t.to(device).contiguous()
    return replace(w, data=move(w.data), scale=move(w.scale), input_scale=move(w.input_scale))


def share_input_scales(model: nn.Module) -> None:
    """Static fp8 linears of one input (q/k/v, gate/up) take the largest of their scales."""
    for module in model.modules():
        for names in SHARED_INPUTS:
            parts = [getattr(module, n, None) for n in names]
            if not all(isinstance(p, Fp8Linear) and p.weight.act == "static" for p in parts):
                continue
            top = torch.stack([p.weight.input_scale for p in parts]).amax()
            for p in parts:
                p.weight = replace(p.weight, input_scale=top)
