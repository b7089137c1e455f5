"""Acceptance length (AL) of the bundled tiny pair over a ladder of prompt lengths.

    python -m bench.al_ladder [--ks 2,4,6] [--rungs 128,256,512,1024,2048,4000] [--drafter DIR] [--json FILE]

Prompts are held-out bytes of the standard library (models/data.py): code (held-out
``*.py`` files) and prose (the license and pydoc topics), windows at seeded random offsets.
Each rung runs its prompts as one batch, greedy, ``--max-tokens`` new tokens each, EOS
ignored, prefix cache off. Reports AL per rung and domain for every K, and tokens/s with
and without speculation (the same batch, K = 0), end to end and over the steps where the
whole batch decodes. Each
row counts the prompts whose greedy output equals K = 0's (every one in float32; see
``equal_prompts``). K is fixed: adaptive K is off.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.progress import steps
from models.byte_tokenizer import BOS_ID
from models.data import held_out_prose, split_files
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import Status
from services.engine.sampling.params import SamplingParams

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"


def held_out_corpora() -> dict[str, bytes]:
    _, held = split_files()
    code = b"\n".join(p.read_bytes() for p in held if not p.name == "topics.py")
    return {"code": code, "prose": held_out_prose()}


def windows(corpus: bytes, length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: BOS + length - 1 bytes at random offsets."""
    g = torch.Generator().manual_seed(seed * 7919 + length)
    starts = torch.randint(0, len(corpus) - length, (count,), generator=g).tolist()
    return [[BOS_ID, *corpus[s : s + length - 1]] for s in starts]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """AL and speed of one batch. Decode tokens/s counts only the steps where every request
    of the batch is decoding (no prefill chunk in the step)."""
    engine.stats.clear()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    final, total_s, decode_s, decode_tokens = {}, 0.0, 0.0, 0
    while engine.has_unfinished():
        decoding = all(r.status is Status.DECODE for r in engine.requests.values())
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        total_s += seconds
        if decoding:
            decode_s += seconds
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        final.update({o.request_id: o for o in outputs if o.finished})
    stats = engine.stats.get("local")
    generated = sum(len(final[i].token_ids) for i in ids)
    return {
        "al": round(stats.acceptance_length, 3) if stats else 1.0,
        "per_position": list(stats.accepted_per_position) if stats else [],
        "steps": stats.num_steps if stats else None,
        "tokens_per_s": round(generated / total_s, 1),
        "seconds": round(total_s, 2),
        "decode_tokens_per_s": round(decode_tokens / max(decode_s, 1e-9), 1),
        "token_ids": [final[i].token_ids for i in ids],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,4,6")
    p.add_argument("--rungs", default="128,256,512,1024,2048,4000")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rung and domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafter", default=DRAFTER, help="the drafter folder")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV memory of each engine")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write every figure to this file")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ks, rungs = [int(k) for k in a.ks.split(",")], [int(r) for r in a.rungs.split(",")]
    common = dict(
        model=MODEL,
        device=a.device,
        enable_prefix_cache=False,
        max_num_seqs=max(8, a.prompts),
        kv_cache_bytes=int(a.kv_cache_gib * (1 << 30)),
        adaptive_k=False,  # AL at a fixed K, not the per-step rule's timing-dependent choice
    )
    engines = {
        k: Engine(EngineConfig(drafter=a.drafter if k else None, num_spec_tokens=k, **common))
        for k in [0, *ks]
    }
    results = []
    corpora = held_out_corpora()
    cells = [(domain, corpus, rung) for domain, corpus in corpora.items() for rung in rungs]
    for domain, corpus, rung in steps(cells, len(cells), "AL ladder (domain x length)"):
        prompts = windows(corpus, rung, a.prompts, a.seed)
        row = {"domain": domain, "rung": rung}
        for k, engine in engines.items():
            row[k] = run(engine, prompts, a.max_tokens)
            row[k]["equal_to_target_only"] = equal_prompts(row[k]["token_ids"], row[0]["token_ids"])
        for k in engines:
            del row[k]["token_ids"]
        results.append(row)
        print(format_row(row, ks), flush=True)
    print(summary(results, ks))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


def equal_prompts(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """How many prompts emitted exactly the reference's tokens. float32 (CPU) gives all of
    them; in bf16 a verify pass (K + 1 query rows) and a decode step can round a near-tie
    differently, after which the two greedy outputs part."""
    return sum(t == r for t, r in zip(tokens, reference, strict=True))


def format_row(row: dict, ks: list[int]) -> str:
    """AL, then end-to-end / decode-only tokens/s."""
    speed = lambda r: f"{r['tokens_per_s']:.0f}/{r['decode_tokens_per_s']:.0f} tok/s"
    als = " | ".join(
        f"K={k}: AL {row[k]['al']:.2f} {speed(row[k])} equal {row[k]['equal_to_target_only']}" for k in ks
    )
    return f"{row['domain']:5s} {row['rung']:5d} | K=0: {speed(row[0])} | {als}"


def summary(results: list[dict], ks: list[int]) -> str:
    """AL over all rungs of a domain, weighted by verify steps (tokens / steps)."""
    lines = []
    for domain in sorted({r["domain"] for r in results}):
        rows = [r for r in results if r["domain"] == domain]
        for k in ks:
            steps = sum(r[k]["steps"] for r in rows)
            tokens = sum(r[k]["al"] * r[k]["steps"] for r in rows)
            lines.append(f"{domain} overall K={k}: AL {tokens / steps:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
