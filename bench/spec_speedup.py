"""Speculative speedup of the bundled tiny pair: decode tokens/s with the drafter against
the target alone, with the acceptance length (AL), so speedup >= 0.8 x AL can be judged.

    python bench/spec_speedup.py [--batches 1,16] [--k 4] [--prompt-len 256]
                                 [--max-tokens 256] [--device cuda] [--modes graphs,eager]
                                 [--kernels on,off] [--json FILE]

Prompts: held-out standard-library code (bench/al_ladder.py's windows), one batch of
``B`` prompts run to completion, greedy, EOS ignored, prefix cache off. Tokens/s and
ms/step count only the engine steps where every request of the batch decodes. ``graphs``
mode replays CUDA graphs for the decode step (the engine's default on CUDA); ``eager``
sets ``enforce_eager``. ``--chain off`` turns off the device-resident step
(``EngineConfig.device_draft_chain``): every step takes the eager draft chain.
``--overlap on`` launches each graphed step before the previous one is read
(``EngineConfig.overlap``), in both engines.
``--repeats R`` times R runs of each engine, the target-only and speculative engines
taking turns so that host noise falls on both; each row keeps the median run (and the
range of ms per step). ``--temperature T`` (> 0) samples instead, request i with seed i:
outputs then differ from target-only's by design, and ``outputs_equal`` compares each
speculative run with the first variant's (the device-resident step against the general
path, say).
``--draft-quantization fp8`` runs the drafter's own weights in e4m3 (both shapes);
``none,fp8`` runs both.
``--host-profile N`` prints each engine's N costliest host functions (cProfile, own time)
over one more run.
``--kernels off`` builds the engines with the fused Triton decoder ops switched off
(``services.engine.kernels.use_kernels(False)``: the torch reference everywhere), for an
A/B against ``on``. A second, synchronized pass splits the decode step's time into the
runner's phases (drafter forwards, target forwards, LM heads) and the rest (sampling,
acceptance, scheduling and bookkeeping on the host).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.al_ladder import DRAFTER, MODEL, held_out_corpora, windows  # noqa: E402
from bench.decode_run import PHASES, decode_run, host_profile, print_phases, timed_phases  # noqa: E402
from bench.spec_shapes import main_8b  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.kernels import use_kernels  # noqa: E402


def make_engine(k: int, max_batch: int, device: str, **options) -> Engine:
    """The bundled pair (K = 0: the target alone); ``options``: more EngineConfig fields."""
    return Engine(
        EngineConfig(
            model=MODEL,
            drafter=DRAFTER if k else None,
            num_spec_tokens=k,
            device=device,
            enable_prefix_cache=False,
            max_num_seqs=max_batch,
            kv_cache_bytes=1 << 30,
            **options,
        )
    )


def measure_pair(
    engines: tuple[Engine, Engine], prompts: list[list[int]], max_tokens: int, device: str, a
) -> tuple[dict, dict]:
    """(target-only, speculative) results over ``a.repeats`` timed runs each, the two
    engines taking turns so that host noise falls on both; each keeps its median run (by
    ms per step) with the spread of ms per step, and one synchronized phase split."""
    for engine in engines:  # warm-up: every kernel shape compiles here
        decode_run(engine, prompts, max_tokens, temperature=a.temperature)
    runs: tuple[list[dict], list[dict]] = ([], [])
    for _ in range(a.repeats):
        for engine, done in zip(engines, runs, strict=True):
            plain_before = plain_steps(engine)
            r = decode_run(engine, prompts, max_tokens, temperature=a.temperature)
            r["plain_steps"] = plain_steps(engine) - plain_before  # steps the K rule ran without drafts
            done.append(r)
    results = []
    for engine, done in zip(engines, runs, strict=True):
        ms = sorted(r["ms_per_step"] for r in done)
        r = sorted(done, key=lambda r: r["ms_per_step"])[len(done) // 2]
        r["ms_per_step_range"] = (ms[0], ms[-1])
        r["phases_ms"] = phase_split(engine, prompts, max_tokens, device, a.temperature)
        if a.host_profile:
            print(f"\nhost profile, K {engine.k}, B{len(prompts)}:", flush=True)
            print(host_profile(engine, prompts, max_tokens, a.host_profile, temperature=a.temperature))
        results.append(r)
    return results[0], results[1]


def phase_split(
    engine: Engine, prompts: list[list[int]], max_tokens: int, device: str, temperature: float
) -> dict:
    """ms per decode step in each of PHASES and the rest, from one synchronized run."""
    spent, undo = timed_phases(engine, device)
    try:
        split = decode_run(engine, prompts, max_tokens, spent, temperature)
    finally:
        undo()
    phases = {n: 1e3 * spent.get(n, 0.0) / split["steps"] for n in PHASES}
    phases["rest"] = split["ms_per_step"] - sum(phases.values())
    return {n: round(v, 3) for n, v in phases.items()}


def plain_steps(engine: Engine) -> int:
    return engine.adaptive.plain_steps if engine.adaptive is not None else 0


UNUSED = {  # options the other shape's run reads, refused when given
    "tiny": ("als", "ks"),
    "8b": ("k", "device", "modes", "kernels", "chain", "temperature", "seed", "adaptive", "forced_al"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="graphs,eager")
    p.add_argument("--kernels", default="on", help="on, off or on,off: fused Triton decoder ops")
    p.add_argument("--chain", default="on", help="on, off or on,off: the device-resident step")
    p.add_argument(
        "--overlap", default="off", help="on, off or off,on: each step launched before the last is read"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, request i with seed i")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine, taking turns; medians")
    p.add_argument("--json", default="")
    p.add_argument("--adaptive", default="on", choices=("on", "off"), help="the per-step K rule")
    p.add_argument("--forced-al", type=int, default=0, help="forced acceptance length; 0 = natural")
    p.add_argument("--shape", default="tiny", choices=("tiny", "8b"), help="8b: see bench/spec_shapes.py")
    p.add_argument("--als", default="2,3,4", help="--shape 8b: forced acceptance lengths")
    p.add_argument("--ks", default="3,5", help="--shape 8b: K values")
    p.add_argument(
        "--draft-quantization",
        default="none",
        help="none, fp8 or none,fp8: the drafter's own weights as loaded or in e4m3 "
        "(EngineConfig.draft_quantization); each is a variant",
    )
    p.add_argument(
        "--host-profile", type=int, default=0, help="N > 0: print each engine's N costliest host functions"
    )
    a = p.parse_args(argv)
    unused = [f"--{n.replace('_', '-')}" for n in UNUSED[a.shape] if getattr(a, n) != p.get_default(n)]
    if unused:
        p.error(f"{', '.join(unused)}: not used with --shape {a.shape}")
    a.quantizations = [q if q != "none" else "" for q in a.draft_quantization.split(",")]
    if any(q not in ("", "fp8") for q in a.quantizations):
        p.error(f"--draft-quantization: none, fp8 or none,fp8, got {a.draft_quantization!r}")
    if a.shape == "8b":
        ints = lambda text: [int(x) for x in text.split(",")]
        batches = ints(a.batches if a.batches != "1,16" else "1,8,32,64")
        rows = main_8b(batches, ints(a.ks), ints(a.als), (a.prompt_len, a.max_tokens), a)
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
        return
    batches = [int(b) for b in a.batches.split(",")]
    code = held_out_corpora()["code"]
    rows, first_outputs = [], {}
    variants = [
        (m, kn, c, q, o)
        for m in a.modes.split(",")
        for kn in a.kernels.split(",")
        for c in a.chain.split(",")
        for q in a.quantizations
        for o in a.overlap.split(",")
    ]
    for mode, kernels, chain, quantization, overlap in variants:
        use_kernels(kernels == "on")
        eager = mode == "eager"
        options = dict(
            enforce_eager=eager,
            device_draft_chain=chain == "on",
            adaptive_k=a.adaptive == "on",
            draft_quantization=quantization,
            overlap=overlap == "on",
        )
        if a.forced_al:  # benchmarks only: the verifier keeps exactly AL - 1 drafts
            options.update(forced_acceptance=a.forced_al - 1, unsafe_forced_acceptance=True)
        base_options = dict(enforce_eager=eager, overlap=overlap == "on")
        engines = {
            k: make_engine(k, max(batches), a.device, **(options if k else base_options)) for k in (0, a.k)
        }
        for batch in batches:
            prompts = windows(code, a.prompt_len, batch, a.seed)
            base, spec = measure_pair((engines[0], engines[a.k]), prompts, a.max_tokens, a.device, a)
            reference = (
                base["token_ids"] if not a.temperature else first_outputs.setdefault(batch, spec["token_ids"])
            )
            row = {
                "mode": mode,
                "kernels": kernels,
                "chain": chain,
                "overlap": overlap,
                "adaptive": a.adaptive,
                "draft_quantization": quantization or "none",
                "forced_al": a.forced_al,
                "temperature": a.temperature,
                "plain_steps": spec["plain_steps"],
                "spec_steps": spec["steps"],
                "batch": batch,
                "k": a.k,
                "al": spec["al"],
                "base_tok_s": base["tok_s"],
                "spec_tok_s": spec["tok_s"],
                "base_ms_per_step": base["ms_per_step"],
                "spec_ms_per_step": spec["ms_per_step"],
                "base_ms_per_step_range": base["ms_per_step_range"],
                "spec_ms_per_step_range": spec["ms_per_step_range"],
                "base_phases_ms": base["phases_ms"],
                "spec_phases_ms": spec["phases_ms"],
                "outputs_equal": reference == spec["token_ids"],
            }
            row["speedup"] = row["spec_tok_s"] / row["base_tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engines
    use_kernels(True)
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


def mode_name(row: dict) -> str:
    return f"{row['mode']} overlapped" if row.get("overlap") == "on" else row["mode"]


def ms_cell(row: dict, who: str) -> str:
    """ms per step, with the range over the repeats when there were several."""
    low, high = row[f"{who}_ms_per_step_range"]
    median = f"{row[f'{who}_ms_per_step']:.2f}"
    return median if low == high else f"{median} ({low:.2f}-{high:.2f})"


def print_table(rows: list[dict]) -> None:
    print(
        "\n| mode | kernels | chain | drafter | B | K | AL | target-only tok/s | spec tok/s | speedup "
        "| speedup / AL | ms/step target-only | ms/step spec | outputs equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {mode_name(r)} | {r['kernels']} | {r['chain']} | {drafter_name(r)} | {r['batch']} "
            f"| {r['k']} | {r['al']:.2f} | {r['base_tok_s']:,.0f} "
            f"| {r['spec_tok_s']:,.0f} | {r['speedup']:.2f} | {r['speedup'] / r['al']:.2f} "
            f"| {ms_cell(r, 'base')} | {ms_cell(r, 'spec')} "
            f"| {'yes' if r['outputs_equal'] else 'no'} |"
        )
    print_phases(
        rows,
        lambda r: f"{mode_name(r)} kernels {r['kernels']} chain {r['chain']} {drafter_name(r)} B{r['batch']}",
        lambda r: f" (no-draft steps: {r['plain_steps']} of {r['spec_steps']})",
    )


def drafter_name(row: dict) -> str:
    return "bf16" if row["draft_quantization"] == "none" else row["draft_quantization"]


if __name__ == "__main__":
    main()
