"""The engine alone under the served sweep's closed-loop workload: the ceiling a served
point is compared with when its prompts cost GPU time too.

    python -m bench.loop_ceiling --model DIR [--drafter DIR -k 4 --forced-accept 3]
        --device cuda --grid 512/128 --concurrency 64 --requests 192
        [--policy mixed,decode-first] [--max-num-batched-tokens 512,2048]

``bench.serve_ceiling`` times decode-only steps; a closed loop of C clients also prefills
every new request's prompt, on the same GPU. Here one ``Engine`` in this process (no
router, RPC or transfer) keeps C requests in flight: a finished request is replaced by the
next prompt before the next step, until ``--requests`` have finished. Output tokens / wall
seconds is the point's ceiling. Each step's time is split, with the device synchronized
around them, into its decode phase, its prefill phase and the rest (scheduling, outputs:
host work); TTFT is from a request's add to its first token. Prints a table, last one
JSON list. Every (policy, budget) pair runs on one engine (``bench.serve_ceiling``'s, loaded once); a
prompt's chunk may take the whole budget, as served workers' does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench import serve_ceiling
from bench.serve_ceiling_spec import CeilingSpec
from bench.serve_workload import Lengths, parse_grid, parse_numbers, point_seed, prompts
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams

PHASES = ("_decode", "_prefill", "_mixed")


def device_sync(engine: Engine) -> Callable[[], None]:
    return torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)


def timed_phases(engine: Engine, sync: Callable[[], None]) -> dict[str, float]:
    """Wrap the engine's step phases (those it has) with synchronized timers: seconds per phase."""
    spent: dict[str, float] = defaultdict(float)
    for name in PHASES:
        fn = getattr(engine, name, None)
        if fn is None:
            continue

        def call(*args, _fn=fn, _name=name):
            sync()
            start = time.perf_counter()
            out = _fn(*args)
            sync()
            spent[_name] += time.perf_counter() - start
            return out

        setattr(engine, name, call)
    return spent


def closed_loop(engine: Engine, lengths: Lengths, concurrency: int, total: int, seed: int) -> dict:
    """C requests in flight until ``total`` finished; tok/s, TTFT and the phase split."""
    sync = device_sync(engine)
    vocab = engine.target.config.vocab_size
    queue = prompts(total, lengths.isl, vocab, seed)
    params = SamplingParams(temperature=0, max_tokens=lengths.osl, ignore_eos=True)
    added: dict[str, float] = {}
    ttft: list[float] = []
    spent = timed_phases(engine, sync)
    done = tokens = steps = 0

    def add() -> None:
        rid = engine.add_request(queue.pop(), params)
        added[rid] = time.perf_counter()

    for _ in range(min(concurrency, total)):
        add()
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outputs:
            tokens += len(o.new_token_ids)
            if o.request_id in added and o.token_ids:
                ttft.append(now - added.pop(o.request_id))
            if o.finished:
                done += 1
                if queue:
                    add()
    sync()
    wall = time.perf_counter() - start
    phases = {name.strip("_"): 1e3 * s / steps for name, s in spent.items()}
    phases["rest"] = 1e3 * wall / steps - sum(phases.values())
    return {
        "isl": lengths.isl,
        "osl": lengths.osl,
        "concurrency": concurrency,
        "requests": done,
        "tok_s": tokens / wall,
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "phases_ms": phases,
    }


def make_engine(args: argparse.Namespace) -> Engine:
    """The sweep's ceiling engine (``bench.serve_ceiling``): prefix cache off, the workers' K."""
    spec = CeilingSpec(
        args.model, args.drafter, args.k, args.forced_accept, args.device, args.max_num_seqs, args.kv_mb
    )
    return serve_ceiling.make_engine(spec)


def set_variant(engine: Engine, policy: str, budget: int) -> None:
    """This benchmark's variants on one loaded engine: its policy and its step budget."""
    engine.config.scheduling_policy = policy
    engine.scheduler.max_num_batched_tokens = engine.scheduler.max_prefill_chunk = budget


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loop_ceiling", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", default="")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--forced-accept", type=int, default=0, help="drafts kept per step, 0 = off")
    p.add_argument("--device", default="cuda")
    p.add_argument("--grid", default="512/128")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--requests", type=int, default=192, help="requests finished per point")
    p.add_argument("--policy", default="mixed,decode-first", help="scheduling policies, comma-separated")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", default="2048", help="step budgets, comma-separated")
    p.add_argument("--kv-mb", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    budgets = parse_numbers(args.max_num_batched_tokens, "--max-num-batched-tokens")
    engine = make_engine(args)
    rows = []
    for policy in args.policy.split(","):
        for budget in budgets:
            set_variant(engine, policy, budget)
            for lengths in parse_grid(args.grid):
                for c in parse_numbers(args.concurrency, "--concurrency"):
                    closed_loop(engine, Lengths(16, 8), c, c, args.seed)  # warm-up at this batch
                    seed = point_seed(args.seed, lengths, f"loop{c}")
                    row = closed_loop(engine, lengths, c, max(args.requests, c), seed)
                    rows.append({"policy": policy, "budget": budget, **row})
    print_rows(rows)
    print(json.dumps(rows))


def print_rows(rows: list[dict]) -> None:
    head = f"{'policy':>13} {'budget':>6} {'ISL/OSL':>9} {'C':>4} {'tok/s':>8} {'ms/step':>8} {'TTFT':>7}"
    print(head + "  phases, ms a step")
    for r in rows:
        split = " ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
        point = f"{r['isl']:>4}/{r['osl']:<4} {r['concurrency']:>4}"
        print(
            f"{r['policy']:>13} {r['budget']:>6} {point} {r['tok_s']:>8.1f} "
            f"{r['ms_per_step']:>8.2f} {r['ttft_p50_ms']:>7.1f}  {split}"
        )


if __name__ == "__main__":
    main()
