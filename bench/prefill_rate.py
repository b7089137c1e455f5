"""The target's prefill forward against the device's bf16 GEMM rate, measured in one run.

    python -m bench.prefill_rate --model DIR --device cuda --lengths 512,2048,4096,8192

One ``Engine`` (no drafter, prefix cache off, a step's token budget as large as the longest
prompt, so one step prefills one whole prompt): for each length L it times ``engine.step()``
on a single request of L random ids and ``max_tokens`` 1 (the prefill forward, the first
token's sampling and the step's host work), the fastest of ``--repeats`` after one warm-up.
The GEMM rate is ``torch.mm`` of [L, hidden] x [hidden, intermediate] in the model's dtype,
timed the same way. The forward's FLOPs are 2 x (non-embedding parameters) x L for the
linear layers plus 2 x 2 x L^2 / 2 x (heads x head_dim) x layers for causal attention;
``of_gemm`` = (FLOPs / forward time) / GEMM rate. Prints a table and, last, one JSON list.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.serve_workload import parse_numbers, prompts
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams


def forward_flops(engine: Engine, length: int) -> float:
    """Linear-layer and causal-attention FLOPs of one prefill of ``length`` tokens."""
    cfg = engine.target.config
    params = sum(p.numel() for n, p in engine.target.named_parameters() if "embed" not in n)
    width = cfg.num_attention_heads * cfg.head_dim
    attention = 2 * 2 * length * length / 2 * width * cfg.num_hidden_layers
    return 2.0 * params * length + attention


def best_seconds(fn, repeats: int, sync) -> float:
    fn()  # warm-up: kernels compile at this shape
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_rate(engine: Engine, length: int, repeats: int, sync) -> float:
    """FLOP/s of [length, hidden] x [hidden, intermediate] in the engine's dtype."""
    cfg = engine.target.config
    a = torch.randn(length, cfg.hidden_size, device=engine.device, dtype=engine.config.torch_dtype)
    b = torch.randn(cfg.hidden_size, cfg.intermediate_size, device=engine.device, dtype=a.dtype)
    seconds = best_seconds(lambda: torch.mm(a, b), repeats, sync)
    return 2.0 * length * cfg.hidden_size * cfg.intermediate_size / seconds


def prefill_seconds(engine: Engine, ids: list[int], repeats: int, sync) -> float:
    def one() -> None:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    return best_seconds(one, repeats, sync)


def measure(model: str, device: str, lengths: list[int], repeats: int, kv_mb: int) -> list[dict]:
    longest = max(lengths)
    engine = Engine(
        EngineConfig(
            model=model,
            drafter=None,
            num_spec_tokens=0,
            device=device,
            enable_prefix_cache=False,
            max_num_seqs=4,
            kv_cache_bytes=kv_mb << 20,
            max_num_batched_tokens=longest,
            max_prefill_chunk=longest,
        )
    )
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    vocab = engine.target.config.vocab_size
    rows = []
    for length in lengths:
        seconds = prefill_seconds(engine, prompts(1, length, vocab, length)[0], repeats, sync)
        rate = gemm_rate(engine, length, repeats, sync)
        flops = forward_flops(engine, length)
        rows.append(
            {
                "tokens": length,
                "forward_ms": 1e3 * seconds,
                "tok_s": length / seconds,
                "tflops": flops / seconds / 1e12,
                "gemm_tflops": rate / 1e12,
                "of_gemm": flops / seconds / rate,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_rate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target model folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="512,2048,4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-mb", type=int, default=4096, help="KV cache MiB (one prompt of the longest length)")
    args = p.parse_args(argv)
    rows = measure(
        args.model, args.device, parse_numbers(args.lengths, "--lengths"), args.repeats, args.kv_mb
    )
    print(f"{'tokens':>7} {'forward ms':>11} {'tok/s':>9} {'TFLOP/s':>8} {'GEMM TFLOP/s':>13} {'of GEMM':>8}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['forward_ms']:>11.2f} {r['tok_s']:>9.0f} {r['tflops']:>8.1f} "
            f"{r['gemm_tflops']:>13.1f} {r['of_gemm']:>8.2f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
