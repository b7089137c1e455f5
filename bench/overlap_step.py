"""Overlapped decode steps against synchronous ones, on one engine: decoding B requests,
each step launched before the previous one is read (``--overlap-decode``,
``services/engine/overlapped_steps.py``) or read at once.

    python -m bench.overlap_step --model DIR [--drafter DIR -k 4 --forced-accept 3]
        --device cuda --batches 1,8,64 --isl 512 --osl 256

One ``Engine`` (CUDA graphs, prefix cache off, a fixed K when drafting) decodes the same B prompts of
ISL random ids for OSL tokens each, greedy with EOS ignored, through ``bench.decode_run``
(time counts only the steps where every request decodes), switching ``config.overlap``
between runs: "off" then "on", ``--repeats`` times, the fastest run of each kept. The
tokens of every run must be equal (it exits 1 otherwise); "repeatable" says whether the runs
of one mode agreed with each other, which tells a mode's difference from run-to-run
nondeterminism. On the CPU the uncaptured graph
path runs (the code path, not a speed: CPU work does not overlap itself). Prints a table,
last one JSON list.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.decode_run import decode_run
from bench.serve_workload import parse_numbers, prompts
from services.engine.config import EngineConfig
from services.engine.device.cuda_graphs import capture_decode_graphs
from services.engine.engine import Engine

MODES = ("off", "on")


def make_engine(args: argparse.Namespace) -> Engine:
    k = args.k if args.drafter else 0
    forced = args.forced_accept if k and args.forced_accept else -1
    engine = Engine(
        EngineConfig(
            model=args.model,
            drafter=args.drafter or None,
            num_spec_tokens=k,
            adaptive_k=False,  # every step drafts K: the two modes run the same steps
            forced_acceptance=forced,
            unsafe_forced_acceptance=forced >= 0,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_cache=False,
            max_num_seqs=max(args.batches),
            kv_cache_bytes=args.kv_mb << 20,
            max_num_batched_tokens=4096,
            max_prefill_chunk=4096,
        )
    )
    if engine.runner.graphs is None:  # the CPU: the same static-buffer path, uncaptured
        engine.runner.graphs = capture_decode_graphs(
            engine.runner, engine.k + 1, max(args.batches), engine.max_model_len, capture=False
        )
    return engine


def measure(engine: Engine, batch: int, args: argparse.Namespace) -> dict:
    """The fastest run of each mode at ``batch``: ms per step, tok/s; whether tokens agreed."""
    vocab = engine.target.config.vocab_size
    ids = prompts(batch, args.isl, vocab, args.seed + batch)
    engine.config.overlap = False
    decode_run(engine, prompts(batch, 16, vocab, args.seed), 8)  # shapes compile here
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            engine.config.overlap = mode == "on"
            runs[mode].append(decode_run(engine, ids, args.osl))
            ms = runs[mode][-1]["ms_per_step"]
            print(f"B{batch} overlap {mode}: {ms:.3f} ms/step", file=sys.stderr, flush=True)
    best = {m: min(rs, key=lambda r: r["ms_per_step"]) for m, rs in runs.items()}
    tokens = [r["token_ids"] for rs in runs.values() for r in rs]
    row = {"batch": batch, "isl": args.isl, "osl": args.osl, "equal": all(t == tokens[0] for t in tokens)}
    for m in MODES:  # run to run within a mode: tells a mode's difference from nondeterminism
        row[f"repeatable_{m}"] = all(r["token_ids"] == runs[m][0]["token_ids"] for r in runs[m])
    row["first_difference"] = first_difference(runs["off"][0]["token_ids"], runs["on"][0]["token_ids"])
    row["al"] = best["on"]["al"]
    for m in MODES:
        row[f"ms_per_step_{m}"] = best[m]["ms_per_step"]
        row[f"tok_s_{m}"] = best[m]["tok_s"]
    row["speedup"] = row["ms_per_step_off"] / row["ms_per_step_on"]
    return row


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """[request, position] of the earliest output position where two runs' tokens differ
    (the lowest request at that position); None when equal."""
    found = [(p, i) for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in range(len(x)) if x[p] != y[p]]
    if not found:
        return None
    position, request = min(found)
    return [request, position]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overlap_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target folder")
    p.add_argument("--drafter", default="", help="EAGLE-3 folder; '' = the target alone")
    p.add_argument("-k", type=int, default=4, help="drafts per step, with a drafter")
    p.add_argument("--forced-accept", type=int, default=0, help="drafts kept per step, 0 = natural")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="", help="'' = the device's default (bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--batches", default="1,8,64", help="B,...")
    p.add_argument("--isl", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--osl", type=int, default=256, help="tokens decoded per request")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the fastest is kept")
    p.add_argument("--kv-mb", type=int, default=16384, help="KV cache memory, MiB")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.batches = parse_numbers(args.batches, "--batches")
    engine = make_engine(args)
    print(f"engine ready ({args.model})", file=sys.stderr, flush=True)  # a cut-short run says how far it came
    rows = [measure(engine, b, args) for b in args.batches]
    head = f"{'B':>4} {'ms/step off':>12} {'ms/step on':>11} {'tok/s off':>10} {'tok/s on':>9} {'x':>6}"
    print(f"{head} {'AL':>5} equal  repeatable off/on  first difference [request, position]")
    for r in rows:
        print(
            f"{r['batch']:>4} {r['ms_per_step_off']:>12.3f} {r['ms_per_step_on']:>11.3f} "
            f"{r['tok_s_off']:>10.0f} {r['tok_s_on']:>9.0f} {r['speedup']:>6.3f} {r['al']:>5.2f} "
            f"{r['equal']!s:>5} {r['repeatable_off']}/{r['repeatable_on']} {r['first_difference'] or ''}"
        )
    print(json.dumps(rows))
    if not all(r["equal"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
