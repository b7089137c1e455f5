"""Decode step of an 8B-shaped, random-weight Llama target, eager and from CUDA graphs,
beside its memory roofline.

    python bench/decode_step.py [--batches 1,8,32,64] [--context 2048] [--vocab 128256]
                                [--out results.json] [--small]

Model: 32 layers, hidden 4096, 32 query / 8 KV heads (head dim 128), intermediate 14336,
vocab 128256 (untied head), bf16, random weights built on the GPU through the engine's
model classes. KV: one bf16 pool of 16-token pages, scattered at random, every sequence
at ``context`` tokens (random K/V). One step = the target over one new token per sequence
(its K/V written at position context - 1, attention over all ``context`` keys), the LM
head and a greedy argmax, run through the engine's graph path (``GraphedForward``).

Columns (medians of CUDA-event timings, L2 flushed before each run):
- eager paged: the engine's eager path (``PagedContext``: ``paged_attention`` over a varlen
  batch, which reads a start table);
- eager uniform: the graph path's forward launched from Python (``decode_attention``);
- graph: the captured step replayed;
- matmuls: a graph of the step's linear layers alone (every weight read once), the part
  of the step that the roofline's weight bytes stand for;
- roofline: (weight bytes + KV bytes read) / the device copy rate (read + write) measured
  in the same run.
Each figure is taken twice: "unfused" (separate q/k/v and gate/up matmuls, RMSNorm, RoPE
and SiLU x up as torch ops) and "fused" (merged projections and the Triton kernels of
``services.engine.kernels``: residual add + RMSNorm, q and k RoPE in one launch, SiLU x up).
``--small`` runs a 2-layer toy on the CPU (a smoke test of the script, no figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_inputs import build_target, llama_8b, make_pool, step_batch, toy  # noqa: E402
from kvcore.ops import PagedBatch  # noqa: E402
from services.engine import kernels  # noqa: E402
from services.engine.device.cuda_graphs import GraphedForward, PagedGroup  # noqa: E402
from services.engine.models import LlamaConfig, LlamaForCausalLM, PagedContext  # noqa: E402
from services.engine.sampling.sampler import argmax_rows  # noqa: E402


def weight_bytes_per_step(model: LlamaForCausalLM, batch: int) -> int:
    """Every weight once, except the embedding table, of which only ``batch`` rows are
    read (unless it is also the LM head)."""
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and model.lm_head is not None:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(config: LlamaConfig, batch: int, context: int, itemsize: int) -> int:
    return (
        batch
        * context
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * 2
        * itemsize
    )


def greedy_step(model: LlamaForCausalLM):
    def forward(input_ids, positions, hidden, ctx):
        logits = model.head(model(input_ids, positions, ctx).hidden).float()
        return (argmax_rows(logits),)  # the engine's greedy argmax

    return forward


def matmuls_only(model: LlamaForCausalLM, batch: int):
    """The step's linear layers over random activations: every weight read once."""
    c, dev, dt = model.config, model.head_weight.device, model.head_weight.dtype
    x = torch.randn(batch, c.hidden_size, device=dev, dtype=dt)
    inter = torch.randn(batch, c.intermediate_size, device=dev, dtype=dt)

    def run() -> None:
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            if a.qkv is None:
                a.q_proj(x), a.k_proj(x), a.v_proj(x)
                m.gate_proj(x), m.up_proj(x)
            else:
                F.linear(x, *a.qkv), F.linear(x, m.gate_up)
            a.o_proj(x), m.down_proj(inter)
        F.linear(x, model.head_weight)

    return run


def time_ms(fn, device: torch.device, graph: bool = False) -> float:
    """Median time of ``fn`` (CUDA events, L2 flushed; or host clock on the CPU)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton

    if graph:
        fn()
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")


def copy_rate_gbps(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    from bench.gpu_timing import copy_rate_gbps as measured

    return measured()


def run_batch(
    model, graphed: GraphedForward, pool, table, batch: int, context: int, device: torch.device
) -> dict:
    host = step_batch(table, batch, context, model.config.vocab_size)
    graphed.load(host)
    tokens = {}

    def graph_step():
        graphed.replay(batch)

    def uniform_step():
        graphed.run_forward(batch)

    timings = {"graph": time_ms(graph_step, device), "eager_uniform": time_ms(uniform_step, device)}
    for name, fn in (("graph", graph_step), ("eager_uniform", uniform_step)):
        fn()
        tokens[name] = graphed.outputs[0][:batch].tolist()
    first = tokens["graph"]
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    paged_batch = PagedBatch(host.block_tables[0].to(device), host.seq_lens.to(device), 1, starts)
    ctx = PagedContext(pool, paged_batch, host.slot_mappings[0].to(device))
    ids, positions = host.input_ids.to(device), host.positions.to(device)
    paged = greedy_step(model)
    timings["eager_paged"] = time_ms(lambda: paged(ids, positions, None, ctx), device)
    tokens["eager_paged"] = paged(ids, positions, None, ctx)[0].tolist()
    timings["matmuls"] = time_ms(matmuls_only(model, batch), device, graph=device.type == "cuda")
    equal = len({tuple(t) for t in tokens.values()}) == 1
    return {"ms": timings, "tokens_equal": equal, "tokens": first}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default="")
    p.add_argument("--small", action="store_true", help="2-layer toy on the CPU")
    a = p.parse_args(argv)
    batches = sorted(int(b) for b in a.batches.split(","))
    device = torch.device("cpu" if a.small else "cuda")
    dtype = torch.float32 if a.small else torch.bfloat16
    config = toy(a.vocab) if a.small else llama_8b(a.vocab)
    with torch.inference_mode():
        model = build_target(config, device, dtype)
        pool, table = make_pool(config, batches[-1], a.context, device, dtype)
        copy = copy_rate_gbps(device)
        results = {}
        for variant in ("unfused", "fused"):
            kernels.use_kernels(variant == "fused")
            if variant == "fused":
                model.merge_projections()
            results[variant] = run_variant(model, pool, table, batches, a.context, device, copy)
        kernels.use_kernels(True)
    for variant, rows in results.items():
        print_table(variant, rows, copy, a, config)
    same = [r["tokens"] == u["tokens"] for r, u in zip(results["fused"], results["unfused"], strict=True)]
    print(f"\nfused greedy tokens equal to unfused: {sum(same)} of {len(same)} batches")
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_gbps": copy, "variants": results}, indent=1))


def run_variant(model, pool, table, batches: list[int], context: int, device, copy: float) -> list[dict]:
    target = PagedGroup("target", tuple(range(model.config.num_hidden_layers)), pool)
    graphed = GraphedForward(
        greedy_step(model),
        [target],
        q_len=1,
        buckets=batches,
        max_pages=table.shape[1],
        capture=device.type == "cuda",
    )
    if device.type == "cuda":
        graphed.capture(torch.cuda.graph_pool_handle())
    rows = []
    for batch in batches:
        r = run_batch(model, graphed, pool, table, batch, context, device)
        weights = weight_bytes_per_step(model, batch)
        kv = kv_bytes_per_step(model.config, batch, context, pool.element_size())
        r.update(batch=batch, weight_bytes=weights, kv_bytes=kv, roofline_ms=(weights + kv) / (copy * 1e6))
        rows.append(r)
    return rows


def print_table(variant: str, rows: list[dict], copy: float, a, config: LlamaConfig) -> None:
    print(
        f"\n{variant} decode step, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}, context {a.context}; copy {copy:,.0f} GB/s (read + write)"
    )
    print(
        "| B | weights GB | KV GB | roofline ms | eager paged ms | eager uniform ms | graph ms "
        "| graph / roofline | matmuls ms | graph GB/s | tokens equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["ms"]
        gbs = (r["weight_bytes"] + r["kv_bytes"]) / (t["graph"] * 1e6)
        print(
            f"| {r['batch']} | {r['weight_bytes'] / 1e9:.2f} | {r['kv_bytes'] / 1e9:.2f} "
            f"| {r['roofline_ms']:.2f} | {t['eager_paged']:.2f} | {t['eager_uniform']:.2f} "
            f"| {t['graph']:.2f} | {t['graph'] / r['roofline_ms']:.2f} | {t['matmuls']:.2f} "
            f"| {gbs:,.0f} | {'yes' if r['tokens_equal'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
