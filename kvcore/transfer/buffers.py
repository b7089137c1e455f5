"""Views of tensors and arrays as UCX message buffers (never copies).

A message is the raw bytes of one contiguous buffer. Accepted:

- torch tensors of any dtype (bf16 and fp8 included): viewed as uint8, then as a
  numpy array on CPU or through ``__cuda_array_interface__`` on CUDA;
- numpy arrays and anything else with the buffer protocol;
- objects with ``__cuda_array_interface__`` (CuPy, Numba, ...).

Every buffer must be C-contiguous, and writable when it is received into.
"""

from __future__ import annotations

from typing import Any

import torch


def as_ucx_array(obj: Any, *, writable: bool) -> Any:
    """Return a ``ucxx`` Array sharing ``obj``'s memory; ValueError naming ``buffer``."""
    from ucxx._lib.arr import Array  # noqa: PLC0415 (after ucx.py has imported ucxx with its environment set)

    if isinstance(obj, torch.Tensor):
        obj = _tensor_bytes(obj)
    try:
        array = Array(obj)
    except (TypeError, ValueError) as e:
        raise ValueError(f"buffer: {type(obj).__name__} is not a tensor, array or buffer ({e})") from e
    if not array.c_contiguous:
        raise ValueError("buffer: must be C-contiguous")
    if writable and array.readonly:
        raise ValueError("buffer: must be writable to receive into")
    return array


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a uint8 vector object ucxx accepts, sharing memory."""
    if not tensor.is_contiguous():
        raise ValueError(f"buffer: tensor must be contiguous, got strides {tensor.stride()}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"buffer: tensor must be on cpu or cuda, got {tensor.device}")
    flat = tensor.detach().reshape(-1).view(torch.uint8)  # [nbytes]
    return flat if flat.is_cuda else flat.numpy()
