"""Host cost of one eager call of each fused decoder op: Triton kernel against the torch
reference, at decode-sized shapes (the drafter's LM-head norm runs eagerly every chain step).

    python -m bench.launch_cost [--rows 1,16] [--hidden 256,4096] [--calls 2000]

Per call: host microseconds (calls issued back to back, then one synchronize; at these
sizes the GPU work is far shorter than the launch, so this is the launch cost) and device
microseconds (CUDA events around a CUDA graph of the same calls).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from services.engine.kernels import reference, triton_fused

OPS = ("rms_norm", "add_rms_norm", "silu_mul")


def op_inputs(name: str, rows: int, hidden: int) -> tuple:
    """Random bf16 inputs of ``name`` for ``rows`` tokens of width ``hidden``."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda", dtype=torch.float32)
    if name == "rms_norm":
        return x, w, 1e-5
    if name == "add_rms_norm":
        return x, torch.randn_like(x), w, 1e-5
    return (torch.randn(rows, 6 * hidden, device="cuda", dtype=torch.bfloat16),)


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Mean host microseconds per call, issued back to back."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * took / calls


def device_us(fn: Callable[[], object], calls: int) -> float:
    """Mean device microseconds per call, from a graph of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16")
    p.add_argument("--hidden", default="256,4096")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    print("| op | rows | hidden | triton host us | torch host us | triton device us | torch device us |")
    print("|---|---|---|---|---|---|---|")
    for hidden in (int(h) for h in a.hidden.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            for name in OPS:
                args = op_inputs(name, rows, hidden)
                fns = [functools.partial(getattr(m, name), *args) for m in (triton_fused, reference)]
                h = [host_us(f, a.calls) for f in fns]
                d = [device_us(f, 200) for f in fns]
                print(f"| {name} | {rows} | {hidden} | {h[0]:.1f} | {h[1]:.1f} | {d[0]:.2f} | {d[1]:.2f} |")


if __name__ == "__main__":
    main()
