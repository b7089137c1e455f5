"""Triton launches without Triton's per-call bookkeeping: a compiled kernel's own launcher,
called directly once the call's specialization has been compiled.

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run``. On every call it
binds the arguments, builds its cache key as a string, checks the kernel's globals, reads
the current device and stream through Triton's driver, builds launch metadata for the
launch hooks, and hands the launcher two hook chains to call even when they are empty. On
an H100's host that is 13.7 us a launch; the compiled launcher alone takes 5.2
(docs/performance.md, "Host costs of single calls"). A prompt step of an eager model
launches 110-160 kernels.

:func:`fast_launch` wraps a ``@triton.jit`` function so that ``kernel[grid](...)`` keeps its
meaning and its cost falls to the launcher's and Triton's own binder (which computes the
specialization: dtypes, 16-byte alignment of pointers, integers equal to 1 or multiples of
16, the constexprs):

- a call whose specialization this wrapper has not seen goes through ``JITFunction.run``
  (compiling if Triton must), and the compiled kernel it returns is kept under the
  specialization and the launch options;
- a call whose specialization it has seen calls that kernel's launcher with the grid, the
  current stream of the current device and the bound arguments;
- while a launch hook is registered (a profiler such as proton), every call goes through
  ``JITFunction.run``, which calls the hooks;
- a Triton whose internals differ from those this was written against (3.2-3.6:
  ``device_caches`` entries ending in the binder, ``CompiledKernel.run``'s argument order)
  gets the plain ``JITFunction`` back: no change in behaviour, only in cost.

Invariant: every launch runs the kernel ``JITFunction.run`` would have run for the same
arguments, on the same stream, with the same grid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

Grid = tuple[int, ...]


def _supported() -> bool:
    runtime = getattr(knobs, "runtime", None)
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return hasattr(JITFunction, "create_binder") and all(hasattr(h, "calls") for h in hooks)


SUPPORTED = _supported()


def _hooked() -> bool:
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` over a ``JITFunction``'s compiled launchers."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self._compiled: dict[tuple, Any] = {}  # (device, specialization, options) -> CompiledKernel

    def __getitem__(self, grid: Grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Grid, args: tuple, kwargs: dict[str, Any]) -> Any:
        device = torch.cuda.current_device()
        params, specialization, options = self.fn.device_caches[device][-1](*args, **kwargs)
        try:
            key = (device, tuple(specialization), tuple(options.items()))
            kernel = self._compiled.get(key)
        except TypeError:  # an unhashable specialization value: Triton's path, uncached
            return self.fn[grid](*args, **kwargs)
        if kernel is None or _hooked():
            kernel = self.fn[grid](*args, **kwargs)
            self._compiled.setdefault(key, kernel)
            return kernel
        stream = torch._C._cuda_getCurrentRawStream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(
            grid[0],
            g1,
            g2,
            stream,
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *params.values(),
        )
        return kernel


def fast_launch(fn: JITFunction) -> JITFunction | FastLaunch:
    """``fn`` launched through :class:`FastLaunch` where this Triton's internals are the
    known ones; ``fn`` itself otherwise."""
    return FastLaunch(fn) if SUPPORTED and isinstance(fn, JITFunction) else fn
