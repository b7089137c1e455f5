"""The cost of a grammar on the bundled tiny pair: tokens/s and acceptance length (AL) with
and without a JSON schema, the target alone (K = 0) and with the drafter.

    python bench/grammar_cost.py [--k 3] [--batch 1,4] [--max-tokens 192] [--repeats 3] [--device cuda]

Each row is one batch of ``B`` prompts run to completion, greedy (a constrained request
ends where its JSON does, so tokens/s counts the tokens each run emitted over its wall
time, prefill included). ``speedup`` is tokens/s over the same row's K = 0 run, and
``kept`` the schema's speedup over the unconstrained one (issue target: >= 0.9). The
masks are computed on the host per verified and drafted row (llguidance), and constrained
requests take the engine's general step (on CUDA the unconstrained ones take the
device-resident, graph-captured step). The constrained text is JSON, the unconstrained
one Python: their ALs differ with the text, not only with the masks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.al_ladder import DRAFTER, MODEL  # noqa: E402
from services.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from services.grammar import Constraint  # noqa: E402

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "module": {"enum": ["os", "sys", "re", "json", "typing"]},
            "name": {"type": "string", "maxLength": 16},
            "line": {"type": "integer", "minimum": 0, "maximum": 9999},
            "public": {"type": "boolean"},
        },
        "required": ["module", "name", "line", "public"],
        "additionalProperties": False,
    },
    "minItems": 4,
    "maxItems": 8,
}
PROMPTS = ["import json\nconfig = ", "data = json.loads(", "# settings\nsettings = ", "    result = "]


def run(engine: Engine, batch: int, k: int, max_tokens: int, constraint: Constraint | None) -> dict:
    """Tokens/s and AL of one batch run to completion."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=constraint)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    ids = [engine.add_request(p, params, num_spec_tokens=k) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    seconds = time.perf_counter() - start
    outs = [final[i] for i in ids]
    tokens = sum(len(o.token_ids) for o in outs)
    al = sum(o.usage.acceptance_length for o in outs) / len(outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "al": al}


def measure(engine: Engine, batch: int, k: int, a, constraint: Constraint | None) -> dict:
    """The median (by tokens/s) of ``a.repeats`` runs, after one warm-up."""
    run(engine, batch, k, a.max_tokens, constraint)
    runs = sorted(
        (run(engine, batch, k, a.max_tokens, constraint) for _ in range(a.repeats)), key=lambda r: r["tok_s"]
    )
    return runs[len(runs) // 2]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny models: 1)")
    p.add_argument("--json", default="", help="write the rows to this file too")
    p.add_argument("--device", default="cpu", help="where the engine runs (cpu, cuda)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engine = Engine(
        EngineConfig(
            model=MODEL,
            drafter=DRAFTER,
            num_spec_tokens=a.k,
            enable_prefix_cache=False,
            max_num_seqs=max(16, *(int(b) for b in a.batch.split(","))),
            device=a.device,
        )
    )
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    rows = []
    print("| B | constraint | K | AL | tokens | tok/s | speedup | kept |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in a.batch.split(",")]:
        speedups = {}
        for name, constraint in (("none", None), ("json_schema", schema)):
            base = measure(engine, batch, 0, a, constraint)
            spec = measure(engine, batch, a.k, a, constraint)
            speedups[name] = spec["tok_s"] / base["tok_s"]
            kept = f"{speedups[name] / speedups['none']:.2f}" if name != "none" else ""
            for k, r in ((0, base), (a.k, spec)):
                rows.append({"batch": batch, "constraint": name, "k": k, **r})
                speedup = f"{speedups[name]:.2f}x" if k else ""
                print(
                    f"| {batch} | {name} | {k} | {r['al']:.2f} | {r['tokens']} | {r['tok_s']:.0f} "
                    f"| {speedup} | {kept if k else ''} |"
                )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
