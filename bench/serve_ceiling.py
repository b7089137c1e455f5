"""The engine's own decode ceiling at a served point's batch: the denominator of the
served-load sweep's "served / ceiling" column.

    python -m bench.serve_ceiling --model DIR [--drafter DIR|none] [-k 4] [--forced-accept N]
        --device cuda|cpu --max-num-seqs 128 [--kv-mb MiB] --grid 512/128 --batches 1,8

One ``Engine`` in this process (the served workers' engine, with their K, forced acceptance
and batch limit; prefix cache off), no router, no RPC, no transfer: for each ISL/OSL and
batch B it decodes the served point's first B prompts at C = B (same seed: ISL random ids)
for OSL tokens each, greedy with EOS ignored,
through ``bench.decode_run.decode_run`` (bench.spec_speedup's), whose tokens/s counts only the
steps where every request decodes: B x AL / step time. B is capped at ``--max-num-seqs`` and
at the requests of ISL + OSL tokens the KV memory holds at once (both also bound the served
batch); the cap is reported as ``ceiling_batch``. Prints one JSON list on its last line of
stdout. The sweep runs it as a subprocess (``bench.serve_ceiling_spec.run_ceiling``) before
it starts a cluster, so its device memory is free again when the workers start.
"""

from __future__ import annotations

import argparse
import json
import math

from bench.decode_run import decode_run
from bench.serve_ceiling_spec import CeilingSpec
from bench.serve_workload import Lengths, parse_grid, parse_numbers, point_seed, prompts
from kvcore.spec import cdiv
from services.engine.config import EngineConfig
from services.engine.engine import Engine

CHUNK = 4096  # tokens per prefill chunk and step: the prompts' prefill only, not the decode timed
GPU_FRACTION = 0.9  # --kv-mb 0 (CUDA): the KV cache is what this fraction of the GPU leaves, as a worker's


def make_engine(spec: CeilingSpec) -> Engine:
    k = spec.k if spec.drafter else 0
    memory = {"kv_cache_bytes": spec.kv_mb << 20} if spec.kv_mb else {"gpu_memory_utilization": GPU_FRACTION}
    return Engine(
        EngineConfig(
            model=spec.model,
            drafter=spec.drafter or None,
            num_spec_tokens=k,
            device=spec.device,
            enable_prefix_cache=False,
            max_num_seqs=spec.max_num_seqs,
            **memory,
            max_num_batched_tokens=CHUNK,
            max_prefill_chunk=CHUNK,
            forced_acceptance=spec.forced if k and spec.forced else -1,
            unsafe_forced_acceptance=bool(k and spec.forced),
            quantization=spec.quantization,
        )
    )


def fitting_batch(engine: Engine, lengths: Lengths) -> int:
    """Requests of ISL + OSL tokens every full-attention group holds at once."""
    manager = engine.manager
    per_request = cdiv(lengths.isl + lengths.osl + manager.config.headroom_tokens, manager.tokens_per_page)
    full = [name for name, spec in manager.groups.items() if spec.window == 0]
    return min(manager.num_pages(name) // per_request for name in full)


def measure(spec: CeilingSpec, grid: list[Lengths], batches: list[int]) -> list[dict]:
    """One row per (ISL/OSL, B): ``tok_s`` (NaN if no step decoded every request),
    ``ms_per_step``, ``al`` and ``ceiling_batch``; a capped B measured once (the fastest of
    ``spec.repeats`` runs), after a short unmeasured run at the same batch (its shapes
    compile there)."""
    engine = make_engine(spec)
    vocab = engine.target.config.vocab_size
    rows, done = [], {}
    for lengths in grid:
        for batch in batches:
            capped = min(batch, spec.max_num_seqs, fitting_batch(engine, lengths))
            if (lengths, capped) not in done and capped > 0:
                decode_run(engine, prompts(capped, 16, vocab, spec.seed), 8)
                ids = prompts(capped, lengths.isl, vocab, point_seed(spec.seed, lengths, f"closed{batch}"))
                runs = [timed(decode_run(engine, ids, lengths.osl)) for _ in range(spec.repeats)]
                done[lengths, capped] = fastest(runs)
            row = done.get((lengths, capped), timed({"steps": 0, "al": math.nan}))
            rows.append(
                {"isl": lengths.isl, "osl": lengths.osl, "batch": batch, "ceiling_batch": capped, **row}
            )
    return rows


def fastest(runs: list[dict]) -> dict:
    """The run of most tokens/s (a NaN one only when all are)."""
    return max(runs, key=lambda r: -math.inf if math.isnan(r["tok_s"]) else r["tok_s"])


def timed(run: dict) -> dict:
    """A decode_run's tok/s, ms per step and AL; NaN where no step decoded every request."""
    fine = run["steps"] > 0
    return {
        "tok_s": run["tok_s"] if fine else math.nan,
        "ms_per_step": run["ms_per_step"] if fine else math.nan,
        "al": run["al"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", default="none", help="'none' = the target alone")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--forced-accept", type=int, default=0, help="drafts kept per step; 0 = natural")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument(
        "--kv-mb", type=int, default=0, help=f"KV cache MiB; 0 = what {GPU_FRACTION} of the GPU leaves"
    )
    p.add_argument("--grid", required=True, help="ISL/OSL,...")
    p.add_argument("--batches", required=True, help="B,...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per batch; the fastest is kept")
    p.add_argument(
        "--quantization", default="none", help="the target's, as the workers' flag; 'none' = as loaded"
    )
    a = p.parse_args(argv)
    if a.kv_mb <= 0 and not a.device.startswith("cuda"):
        p.error(f"--kv-mb: 0 sizes the KV cache from a GPU's memory; on {a.device} give MiB")
    drafter = "" if a.drafter == "none" else a.drafter
    spec = CeilingSpec(
        a.model,
        drafter,
        a.k,
        a.forced_accept,
        a.device,
        a.max_num_seqs,
        a.kv_mb,
        a.seed,
        a.repeats,
        "" if a.quantization == "none" else a.quantization,
    )
    rows = measure(spec, parse_grid(a.grid), parse_numbers(a.batches, "--batches"))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
