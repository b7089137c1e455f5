"""GPU timing for the kernel benchmarks: medians of CUDA-event timings with the L2 flushed
between runs (``triton.testing.do_bench``), optionally of CUDA-graph replays, and the
device copy rate the figures are set beside."""

from __future__ import annotations

import torch
import triton


def time_us(fn, graph: bool = False) -> float:
    """Median GPU time. With ``graph``, fn is captured once in a CUDA graph and its replays
    are timed, so host-side launch cost (which a graph-captured decode step does not pay)
    stays out of small shapes' figures."""
    if graph:
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def gbps(num_bytes: float, us: float) -> float:
    return num_bytes / us / 1e3


def copy_rate_gbps(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return gbps(2 * num_bytes, us)


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]
