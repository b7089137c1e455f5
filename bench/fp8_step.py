"""The 8B-shaped target's decode step and prefill, bf16 against FP8 per channel
(``--quantization fp8``: e4m3 weights with a scale per output row, activations per token).

    python bench/fp8_step.py [--batches 1,64] [--context 2048] [--prefill 2048]
                             [--vocab 128256] [--out results.json] [--small]

Model, KV pool and step as ``bench/decode_step.py`` (random weights, 16-token pages, every
sequence at ``context`` tokens), merged projections and the fused kernels; the FP8 variant is
the same model after ``quantize_fp8()``. Columns (medians of CUDA-event timings):
- graph ms: the captured decode step (target, LM head, greedy argmax) replayed;
- roofline ms: (weight bytes + KV bytes read) / the device copy rate measured in the run;
  the FP8 weights count one byte per element plus their float32 scales;
- prefill ms: one forward of ``prefill`` tokens (dense causal attention) and the head on its
  last row.
``--small`` runs a 2-layer toy on the CPU (a smoke test of the script, no figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_inputs import build_target, llama_8b, make_pool, step_batch, toy  # noqa: E402
from bench.decode_step import copy_rate_gbps, greedy_step, kv_bytes_per_step, time_ms  # noqa: E402
from services.engine.device.cuda_graphs import GraphedForward, PagedGroup  # noqa: E402
from services.engine.models import LlamaForCausalLM, dense_contexts  # noqa: E402
from services.engine.models.fp8 import Fp8Linear  # noqa: E402

VARIANTS = ("bf16", "fp8")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=2048, help="tokens of context per sequence")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill timing")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--small", action="store_true", help="2-layer toy on the CPU")
    a = p.parse_args(argv)
    a.batches = sorted(int(b) for b in a.batches.split(","))
    if not a.batches or a.batches[0] < 1:
        p.error(f"--batches: positive sizes, got {a.batches}")
    return a


def weight_bytes(model: LlamaForCausalLM, batch: int) -> int:
    """Bytes of weights a decode step reads: every parameter (of the embedding, ``batch``
    rows) and every fp8 linear's e4m3 data and float32 scales."""
    total = 0
    for name, p in model.named_parameters():
        rows = batch if name.endswith("embed_tokens.weight") and model.lm_head is not None else p.shape[0]
        total += rows * (p.numel() // p.shape[0]) * p.element_size() if p.dim() else p.element_size()
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            total += m.weight.data.numel() + m.weight.scale.numel() * 4
    return total


def decode_rows(
    model: LlamaForCausalLM, a: argparse.Namespace, device: torch.device, copy: float
) -> list[dict]:
    dtype = model.head_weight.dtype
    pool, table = make_pool(model.config, a.batches[-1], a.context, device, dtype)
    group = PagedGroup("target", tuple(range(model.config.num_hidden_layers)), pool)
    graphed = GraphedForward(
        greedy_step(model),
        [group],
        q_len=1,
        buckets=a.batches,
        max_pages=table.shape[1],
        capture=device.type == "cuda",
    )
    if device.type == "cuda":
        graphed.capture(torch.cuda.graph_pool_handle())
    rows = []
    for batch in a.batches:
        graphed.load(step_batch(table, batch, a.context, model.config.vocab_size))
        ms = time_ms(lambda b=batch: graphed.replay(b), device)
        moved = weight_bytes(model, batch) + kv_bytes_per_step(
            model.config, batch, a.context, pool.element_size()
        )
        rows.append({"batch": batch, "graph_ms": ms, "roofline_ms": moved / (copy * 1e6), "bytes": moved})

    return rows


def prefill_ms(model: LlamaForCausalLM, n: int, device: torch.device) -> float:
    ids = torch.randint(0, model.config.vocab_size, (n,), device=device)
    positions = torch.arange(n, device=device)
    ctx = dense_contexts(model.kv_layer_groups(), batch=1, seq_len=n)
    return time_ms(lambda: model.head(model(ids, positions, ctx).hidden[-1:]), device)


def table(results: dict[str, dict]) -> str:
    """The markdown table of ``results`` (variant -> {"decode": rows, "prefill_ms": ms})."""
    base, fp8 = results["bf16"], results["fp8"]
    lines = [
        "| step | bf16 ms | fp8 ms | fp8 / bf16 | fp8 roofline ms | fp8 / roofline |",
        "|---|---|---|---|---|---|",
    ]
    for b, f in zip(base["decode"], fp8["decode"], strict=True):
        lines.append(
            f"| decode B{f['batch']} | {b['graph_ms']:.3f} | {f['graph_ms']:.3f} | "
            f"{f['graph_ms'] / b['graph_ms']:.2f} | {f['roofline_ms']:.3f} | "
            f"{f['graph_ms'] / f['roofline_ms']:.2f} |"
        )
    p, q = base["prefill_ms"], fp8["prefill_ms"]
    lines.append(f"| prefill {results['prefill']} | {p:.2f} | {q:.2f} | {q / p:.2f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    device = torch.device("cpu" if a.small else "cuda")
    dtype = torch.float32 if a.small else torch.bfloat16
    config = toy(a.vocab) if a.small else llama_8b(a.vocab)
    copy = copy_rate_gbps(device)
    results: dict = {"prefill": a.prefill, "copy_gbps": copy}
    with torch.inference_mode():
        for variant in VARIANTS:
            model = build_target(config, device, dtype)
            if device.type == "cuda":
                model.merge_projections()
            if variant == "fp8":
                model.quantize_fp8()
            results[variant] = {
                "decode": decode_rows(model, a, device, copy),
                "prefill_ms": prefill_ms(model, a.prefill, device),
            }
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"8B-shaped target, context {a.context}, copy {copy:,.0f} GB/s\n" + table(results))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
