"""The decoder's fused ops: Triton kernels for CUDA tensors, the torch reference
(:mod:`services.engine.kernels.reference`) otherwise.

Both paths compute the same function up to float32 reduction order. ``use_kernels(False)``
makes CUDA tensors take the reference too (the unfused baseline of the benchmarks). The
kernels have no backward: a tensor autograd is recording (training, ``models/train_tiny.py``)
always takes the reference, so gradients flow through every op.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from services.engine.kernels import fp8_reference, reference
from services.engine.kernels.fp8_reference import Fp8Weight
from services.engine.kernels.reference import Experts

_enabled = True


def use_kernels(enabled: bool) -> None:
    """Route CUDA tensors to the Triton kernels (True, the default) or the reference."""
    global _enabled
    _enabled = enabled


@functools.cache
def _triton(module: str = "triton_fused") -> ModuleType | None:
    """``services.engine.kernels.<module>``, or None where Triton is missing (CPU-only
    installs run the reference)."""
    try:
        return importlib.import_module(f"services.engine.kernels.{module}")
    except ImportError:
        return None


def _impl(t: torch.Tensor) -> ModuleType:
    if not (t.is_cuda and _enabled) or (t.requires_grad and torch.is_grad_enabled()):
        return reference
    return _triton() or reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, size] -> rms-normed x times weight, in x's dtype."""
    return _impl(x).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); residual None means zeros."""
    return _impl(x).add_rms_norm(x, residual, weight, eps)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] (any row/head strides) -> rotated copy."""
    return _impl(x).rotate_heads(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * inter] -> silu(gate) * up [num_tokens, inter]."""
    return _impl(gate_up).silu_mul(gate_up)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, K], weight [N, K] float8_e4m3fn, scale [N] float32 -> x @ (weight *
    scale[:, None]).T in x's dtype: the fp8 weight-streaming kernel for bf16/fp16 CUDA
    activations, the reference otherwise."""
    gemv = _triton("triton_gemv") if _impl(x) is not reference and x.dtype != torch.float32 else None
    if gemv is None:
        return reference.fp8_linear(x, weight, scale)
    return gemv.fp8_gemv(x, weight, scale)


def fp8_scaled_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [num_tokens, K] -> x @ w.T [num_tokens, N] in x's dtype over an fp8 weight, its
    activations quantized as ``weight.act`` says (:func:`fp8_reference.fp8_scaled_linear`
    defines it): ``fp8_cuda``'s paths for bf16/fp16 CUDA activations, the reference
    otherwise."""
    cuda = _triton("fp8_cuda") if _impl(x) is not reference and x.dtype != torch.float32 else None
    return (fp8_reference if cuda is None else cuda).fp8_scaled_linear(x, weight)


def moe_experts(
    x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """The routed experts summed per token (:func:`reference.moe_experts` defines it):
    x [T, H] -> [T, H]; the fused Triton MoE kernel on CUDA where it is built."""
    moe = _triton("triton_moe") if _impl(x) is not reference else None
    impl = reference if moe is None else moe
    return impl.moe_experts(x, experts, topk_ids, topk_weights)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: x [num_tokens, K], weight [N, K] -> [num_tokens, N]. A CUDA bf16/fp16
    matmul of 1 to ``DENSE_ROWS`` rows over a weight shape in ``triton_gemv.DENSE_TILES``
    (those where the weight-streaming kernel measured faster than cuBLAS) runs that kernel."""
    tiles = _dense_tiles(x, weight)
    if tiles is None:
        return F.linear(x, weight, bias)
    y = _triton("triton_gemv").gemv(x, weight, *tiles)
    return y if bias is None else y + bias


def _dense_tiles(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...] | None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return None
    gemv = _triton("triton_gemv") if _impl(x) is not reference and weight.stride(-1) == 1 else None
    if gemv is None or not 0 < x.shape[0] <= gemv.DENSE_ROWS:
        return None
    return gemv.DENSE_TILES.get(tuple(weight.shape))
