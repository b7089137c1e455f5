"""The routed experts of one MoE layer (``kernels.moe_experts``) at the expert shapes of
Qwen3-30B-A3B, Mixtral-8x7B (intermediate scaled down to 3584) and gpt-oss-20b, bf16, over
token counts: the fused Triton kernel against the torch reference.

Per row: kernel and reference ms; the weight-read rate (bytes of the experts the routing
actually touches, w13 + w2 + biases, over the kernel's time: the figure for small T, where
the layer only streams weights) and TFLOP/s (6 * T * k * H * I over the kernel's time: the
figure for large T). Kernel times are medians of CUDA-graph replays with the L2 flushed
between runs; the reference (not capturable: it reads the routing on the host) is timed
eagerly. Routing is a softmax top k over random logits.

    python -m bench.moe_kernel --device cuda [--shapes qwen3-30b-a3b] [--tokens 1,8,64]
                               [--tiles "16,32,64,128,4,4;16,16,32,256,4,3"]

``--tiles``: time the kernel at each of these tile choices (``triton_moe.MoeTiles``: BLOCK_M,
BLOCK_N of gate/up, BLOCK_N of down, BLOCK_K, warps, stages) instead of ``tiles_for``'s.

``--device cpu`` runs tiny shapes through the reference on both sides: a check that the
script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple

import torch

from services.engine import kernels
from services.engine.kernels import reference
from services.engine.kernels.reference import Experts

SHAPES = {  # name: (experts, top k, hidden, intermediate, gpt-oss style: biases, clamped SwiGLU)
    "qwen3-30b-a3b": (128, 8, 2048, 768, False),
    "mixtral-8x7b-small": (8, 2, 4096, 3584, False),
    "gpt-oss-20b": (32, 4, 2880, 2880, True),
}
TINY_SHAPES = {"tiny": (8, 2, 64, 32, False), "tiny-gpt-oss": (4, 2, 48, 40, True)}
TOKENS = (1, 8, 64, 256, 2048)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", default="", help="comma-separated, of " + ", ".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--tiles", default="", help="';'-separated tile choices, each m,n1,n2,k,warps,stages")
    return p


def parse_tiles(text: str) -> list:
    """--tiles -> MoeTiles (CUDA only); [] = the kernel's own choice. ValueError names it."""
    specs = [spec.split(",") for spec in text.split(";")] if text else []
    for fields in specs:
        if len(fields) != 6 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
            raise ValueError(
                f"--tiles: {','.join(fields)!r} is not six positive integers m,n1,n2,k,warps,stages"
            )
    if not specs:
        return []
    from services.engine.kernels.triton_moe import MoeTiles  # noqa: PLC0415 (imports triton)

    return [MoeTiles(*map(int, fields)) for fields in specs]


def make_layer(dims: tuple, num_tokens: int, device: str) -> tuple[Experts, tuple[torch.Tensor, ...]]:
    """Random bf16 experts of ``dims`` and one routed batch (x, topk_ids, topk_weights)."""
    e, k, h, i, gpt_oss = dims
    w13 = (torch.randn(e, 2 * i, h, device=device) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device=device) * i**-0.5).to(torch.bfloat16)
    if gpt_oss:
        b13 = torch.randn(e, 2 * i, device=device).to(torch.bfloat16)
        b2 = torch.randn(e, h, device=device).to(torch.bfloat16)
        experts = Experts(w13, w2, b13, b2, activation="clamped_swiglu", limit=7.0)
    else:
        experts = Experts(w13, w2)
    x = torch.randn(num_tokens, h, device=device).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(num_tokens, e, device=device), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return experts, (x, ids, weights / weights.sum(-1, keepdim=True))


def touched_bytes(experts: Experts, topk_ids: torch.Tensor) -> int:
    """Bytes of the weights (and biases) of the experts that the routing reaches."""
    per_expert = sum(
        t[0].numel() * t.element_size()
        for t in (experts.w13, experts.w2, experts.b13, experts.b2)
        if t is not None
    )
    return per_expert * int(torch.unique(topk_ids).numel())


def time_ms(fn: Callable[[], object], device: str, graph: bool) -> float:
    """Median ms of fn: GPU events (graph replays when ``graph``) on CUDA, a host clock on
    the CPU."""
    if device == "cuda":
        from bench.gpu_timing import time_us  # noqa: PLC0415 (imports triton: CUDA only)

        return time_us(fn, graph=graph) / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name: str, dims: tuple, num_tokens: int, device: str, tiles=None) -> dict:
    """One row: kernel and reference ms, GB/s of touched weights and TFLOP/s of the kernel
    (at ``tiles``, a MoeTiles, when given; else the kernel's choice)."""
    experts, (x, ids, weights) = make_layer(dims, num_tokens, device)
    _, k, h, i, _ = dims
    if tiles is None:
        kernel = lambda: kernels.moe_experts(x, experts, ids, weights)  # noqa: E731
    else:
        from services.engine.kernels.triton_moe import moe_experts_tiled  # noqa: PLC0415

        kernel = lambda: moe_experts_tiled(x, experts, ids, weights, tiles)  # noqa: E731
    kernel_ms = time_ms(kernel, device, graph=True)
    reference_ms = time_ms(lambda: reference.moe_experts(x, experts, ids, weights), device, graph=False)
    return dict(
        shape=name,
        tokens=num_tokens,
        tiles=",".join(map(str, astuple(tiles))) if tiles is not None else "auto",
        kernel_ms=kernel_ms,
        reference_ms=reference_ms,
        gbps=touched_bytes(experts, ids) / kernel_ms / 1e6,
        tflops=6 * num_tokens * k * h * i / kernel_ms / 1e9,
    )


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| shape | T | tiles | kernel ms | reference ms | speedup | touched weights GB/s | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['tiles']} | {r['kernel_ms']:.4f} | {r['reference_ms']:.4f} "
            f"| {r['reference_ms'] / r['kernel_ms']:.1f}x | {r['gbps']:,.0f} | {r['tflops']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    a = parser().parse_args(argv)
    shapes = SHAPES if a.device == "cuda" else TINY_SHAPES
    names = a.shapes.split(",") if a.shapes else list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        parser().error(f"--shapes: {', '.join(unknown)} unknown on {a.device}; known: {', '.join(shapes)}")
    if a.tiles and a.device != "cuda":
        parser().error("--tiles: the Triton kernel's tiles, CUDA only")
    try:
        choices = parse_tiles(a.tiles) or [None]
    except ValueError as e:
        parser().error(str(e))
    torch.manual_seed(0)
    rows = [
        measure(name, shapes[name], int(t), a.device, tiles)
        for name in names
        for t in a.tokens.split(",")
        for tiles in choices
    ]
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
