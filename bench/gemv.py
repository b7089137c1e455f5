"""Decode-sized matmuls of an 8B-shaped Llama (M = 1..64 rows) as cuBLAS runs them
(``F.linear``) and as the weight-streaming Triton kernel runs them, over a sweep of its
tile sizes; weight read rate in GB/s.

Each figure is one call's share of a CUDA graph that runs the matmul back to back over
distinct copies of the weight (at least 512 MB in all, so nothing is served from L2), the
way a captured decode step runs its layers: no launch cost is counted.

    python -m bench.gemv [--rows 1,8,32,64] [--shapes qkv,o] [--fp8] [--out results.json]

``--fp8``: the fp8 kernel (``fp8_gemv``: e4m3 weights, a scale per row) over the same
shapes instead, against cuBLAS on the bf16 weights and cuBLASLt's FP8 GEMM
(``torch._scaled_mm``, the activations quantized per row beforehand, as
``kernels/fp8_cuda.py`` calls it); its GB/s count the fp8 bytes. ``--no-tune``: the kernel's
default tiles only.
``draft_qkv``, ``draft_head`` and ``fc`` are the EAGLE-3 drafter's own shapes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K) of Llama-3.1-8B's merged projections and head
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
    "draft_qkv": (6144, 8192),
    "draft_head": (32000, 4096),
    "fc": (4096, 12288),
}
CONFIGS = list(
    itertools.product((16, 32, 64), (128, 256), (4,), (3, 4), (1, 2, 4, 8))
)  # n, k, warps, stages, split
FP8_CONFIGS = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4), (1, 2)))  # as CONFIGS
MIN_BYTES = 512 * 2**20


def graphed_ms(fn, weights: list[torch.Tensor]) -> float:
    """Median ms of one ``fn(w)`` inside a graph over every weight in turn."""
    import triton

    for w in weights:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=100, return_mode="median") / len(weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    p.add_argument("--fp8", action="store_true", help="the fp8 kernel instead of the bf16 one")
    p.add_argument("--no-tune", action="store_true", help="--fp8: the default tiles only, no tile sweep")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from services.engine.kernels.triton_gemv import fp8_gemv, gemv

    results = []
    print("| matmul | M | N x K | cuBLAS us | cuBLAS GB/s | Triton us | Triton GB/s | tiles |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = {name: SHAPES[name] for name in a.shapes.split(",")}
    for (name, (n, k)), m in itertools.product(shapes.items(), [int(r) for r in a.rows.split(",")]):
        row = (
            measure_fp8(fp8_gemv, name, (m, n, k), not a.no_tune) if a.fp8 else measure(gemv, name, (m, n, k))
        )
        results.append(row)
        if a.fp8:
            print(
                f"  {name} M {m}: fp8_tiles' choice takes {row['default_ms'] * 1e3:.1f} us, "
                f"torch._scaled_mm {row['scaled_mm_ms'] * 1e3:.1f} us",
                flush=True,
            )
        print(
            f"| {name} | {m} | {n}x{k} | {row['cublas_ms'] * 1e3:.1f} | {row['cublas_gbps']:,.0f} "
            f"| {row['triton_ms'] * 1e3:.1f} | {row['triton_gbps']:,.0f} | {row['config']} |",
            flush=True,
        )
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


def measure(gemv, name: str, mnk: tuple[int, int, int]) -> dict:
    """cuBLAS and the fastest Triton tile setting (of those within 2**-7 of cuBLAS) for one
    [M, K] x [N, K]^T matmul, over enough weight copies to exceed ``MIN_BYTES``."""
    m, n, k = mnk
    size = n * k * 2
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, -(-MIN_BYTES // size)))
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    cublas = graphed_ms(functools.partial(F.linear, x), weights)
    best = (float("inf"), None)
    for config in CONFIGS:
        run = functools.partial(lambda w, x, c: gemv(x, w, *c), x=x, c=config)
        try:
            out = run(weights[0])
        except Exception:  # a tile size Triton cannot build (shared memory): skip it
            continue
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        ms = graphed_ms(run, weights)
        if ms < best[0] and err < 2**-7:
            best = (ms, config)
    return dict(
        name=name,
        rows=m,
        n=n,
        k=k,
        cublas_ms=cublas,
        cublas_gbps=size / cublas / 1e6,
        triton_ms=best[0],
        triton_gbps=size / best[0] / 1e6,
        config=best[1],
    )


def measure_fp8(fp8_gemv, name: str, mnk: tuple[int, int, int], tune: bool = True) -> dict:
    """As :func:`measure`, for the fp8 kernel over quantized copies of the weights (and
    ``torch._scaled_mm`` on the same bytes); its GB/s count its own (fp8) bytes, cuBLAS's the
    bf16 ones."""
    from services.engine.kernels.fp8_reference import quantize_rows
    from services.engine.models.fp8 import quantize_fp8

    m, n, k = mnk
    copies = max(2, -(-MIN_BYTES // (n * k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    cublas = graphed_ms(functools.partial(F.linear, x), bf16)
    fp8 = [quantize_fp8(torch.randn(n, k, device="cuda")) for _ in range(copies)]
    ref = (F.linear(x.float(), fp8[0].data.float()) * fp8[0].scale).float()
    best = (float("inf"), None)
    for config in FP8_CONFIGS if tune else ():
        run = functools.partial(lambda w, x, c: fp8_gemv(x, w.data, w.scale, c), x=x, c=config)
        try:
            out = run(fp8[0])
        except Exception:  # a tile size Triton cannot build (shared memory): skip it
            continue
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        ms = graphed_ms(run, fp8)
        if ms < best[0] and err < 2**-7:
            best = (ms, config)
    default_ms = graphed_ms(lambda w: fp8_gemv(x, w.data, w.scale), fp8)
    rows, scales = quantize_rows(x)
    rows = rows.contiguous()

    def scaled_mm(w) -> torch.Tensor:
        return torch._scaled_mm(
            rows, w.data.t(), scale_a=scales[:, None], scale_b=w.scale[None, :], out_dtype=x.dtype
        )

    try:
        scaled_mm_ms = graphed_ms(scaled_mm, fp8)
    except RuntimeError as e:  # a shape cuBLASLt's FP8 GEMM refuses
        print(f"  {name} M {m}: torch._scaled_mm refused: {str(e).splitlines()[0]}", flush=True)
        scaled_mm_ms = float("nan")
    if not tune:
        best = (default_ms, "default")
    return dict(
        name=name,
        rows=m,
        n=n,
        k=k,
        default_ms=default_ms,
        scaled_mm_ms=scaled_mm_ms,
        cublas_ms=cublas,
        cublas_gbps=2 * n * k / cublas / 1e6,
        triton_ms=best[0],
        triton_gbps=n * k / best[0] / 1e6,
        config=best[1],
    )


if __name__ == "__main__":
    main()
