"""Agentic multi-turn replay: prefix reuse under KV pressure, unified vs separate layout,
with and without the host KV tier.

Generates a deterministic workload (``bench.agentic_workload``), replays it against a router
(``bench.agentic_replay``) and reports, per configuration, prefilled vs cached tokens and hit
rate per layer group, TTFT of first and continuation turns, inter-token latency, AL by origin
and output tok/s. With ``--router`` it replays against a running cluster; otherwise it starts
one local cluster per configuration (``bench.agentic_cluster``: router + prefill + decode on
127.0.0.1, the bundled tiny pair, a deliberately small prefill KV), prints a markdown table and
writes a bar chart (SVG).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from bench import agentic_svg
from bench.agentic_cluster import (
    HOST_TIER_FLAG,
    ClusterConfig,
    Geometry,
    geometry,
    host_tier_supported,
    start_cluster,
)
from bench.agentic_replay import ReplayResult, replay
from bench.agentic_report import Summary, markdown_table, summarize
from bench.agentic_workload import Workload, WorkloadConfig, generate
from bench.progress import steps

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"


def run_config(
    config: ClusterConfig, workload: Workload, args: argparse.Namespace
) -> tuple[ReplayResult, Geometry]:
    cluster = start_cluster(config, args)
    try:
        shape = geometry(cluster.router_address)
        result = replay(cluster.router_address, workload, args.concurrency, shape.tokens_per_page)
    finally:
        cluster.stop()
    return result, shape


def save_records(path: str, name: str, result: ReplayResult) -> None:
    """Append one JSON line per turn, tagged with the configuration's name."""
    if path:
        with open(path, "a") as f:
            for record in result.records:
                f.write(json.dumps({"configuration": name, **asdict(record)}) + "\n")


def matrix(args: argparse.Namespace, host_tier: bool) -> tuple[list[ClusterConfig], dict[str, str]]:
    """The configurations to run, and those skipped with the reason."""
    tiers = [0] + ([args.host_kv_mb] if args.host_kv_mb else [])
    configs, skipped = [], {}
    for layout in args.layouts:
        for mb in tiers if layout != "aggregated" else [0]:
            config = ClusterConfig(layout, mb)
            if mb and not host_tier:
                skipped[config.name] = f"`tandem worker` has no {HOST_TIER_FLAG} yet; re-run"
            else:
                configs.append(config)
    return configs, skipped


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        seed=args.seed,
        conversations=args.conversations,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        answer_tokens=args.answer_tokens,
        preamble_tokens=args.preamble_tokens,
        branch_probability=args.branch_probability,
        max_context=args.max_context,
    )


def describe(workload: Workload, args: argparse.Namespace) -> str:
    threads = workload.threads
    branches = sum(t.is_branch for t in threads)
    return (
        f"workload: seed {args.seed}, {len(threads) - branches} conversations + {branches} "
        f"subagent branches, {workload.num_requests()} requests, {args.answer_tokens}-token "
        f"answers, concurrency {args.concurrency}; K = {args.k}, greedy; prefill KV "
        f"{args.prefill_kv_mb} MiB, decode KV {args.decode_kv_mb} MiB"
    )


def report(
    summaries: list[Summary],
    shapes: dict[str, Geometry],
    skipped: dict[str, str],
    args: argparse.Namespace,
    header: str,
) -> None:
    print(header)
    print(markdown_table(summaries, skipped))
    for name, shape in shapes.items():
        pages = "; ".join(
            f"{worker} " + ", ".join(f"{g} {n}" for g, n in groups.items())
            for worker, groups in shape.pages.items()
        )
        print(f"- {name}: device pages: {pages}; draft window rebuild {shape.rebuild_tokens} tokens")
    for s in summaries:
        print(
            f"- {s.name}: an unbounded prompt cache would prefill {s.floor_prefilled / 1000:.1f}K "
            "target tokens (the floor)"
        )
        if s.over_cached:
            print(
                f"- {s.name}: {s.over_cached} requests reported more cached than prompt "
                "tokens (re-admitted after preemption); counted as fully cached"
            )
        for error in s.first_errors:
            print(f"- {s.name}: error: {error}")
    if args.svg and summaries:
        agentic_svg.write(args.svg, summaries, f"agentic replay ({header.split(';')[0]})")
        print(f"plot: {args.svg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in summaries], f, indent=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--router",
        default="",
        help="replay against this running router (host:port) instead of starting clusters",
    )
    p.add_argument("--origin", default="transferred", help="AL origin label with --router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument(
        "--concurrency", type=int, default=4, help="threads (conversations or subagent branches) in flight"
    )
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--preamble-tokens", type=int, default=1024)
    p.add_argument(
        "--max-context",
        type=int,
        default=4096,
        help="tokens a conversation grows to (prompt + answer; at most the model's context)",
    )
    p.add_argument("--branch-probability", type=float, default=0.5)
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["unified", "separate", "aggregated"],
        choices=["unified", "separate", "aggregated"],
    )
    p.add_argument(
        "--host-kv-mb",
        type=int,
        default=64,
        help="host tier size of the 'with' column, MiB per worker (0 = run only without)",
    )
    p.add_argument(
        "--host-write-policy",
        choices=["evict", "through"],
        default="evict",
        help="the host tier's write policy (tandem worker --host-kv-write-policy)",
    )
    p.add_argument("--prefill-kv-mb", type=int, default=32)
    p.add_argument("--decode-kv-mb", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--device", default="cpu", help="the workers' torch device (on one GPU both share it)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker process (1: prefill and decode each keep one core of two)",
    )
    p.add_argument("--model", default=MODEL)
    p.add_argument("--drafter", default=DRAFTER)
    p.add_argument("--svg", default="docs/agentic.svg", help="plot path ('' = none)")
    p.add_argument("--json", default="", help="also write the summaries here")
    p.add_argument("--records", default="", help="append every turn's record here (JSON lines)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = generate(workload_config(args))
    header = describe(workload, args)
    start = time.time()
    if args.router:
        shape = geometry(args.router)
        result = replay(args.router, workload, args.concurrency, shape.tokens_per_page)
        save_records(args.records, args.router, result)
        summary = summarize(f"router {args.router}", args.origin, result, shape.rebuild_tokens)
        report([summary], {summary.name: shape}, {}, args, header)
        return
    configs, skipped = matrix(args, host_tier_supported())
    summaries, shapes = [], {}
    for config in steps(configs, len(configs), "agentic replay (layout x host tier)"):
        result, shapes[config.name] = run_config(config, workload, args)
        save_records(args.records, config.name, result)
        summary = summarize(config.name, config.origin, result, shapes[config.name].rebuild_tokens)
        summaries.append(summary)
        print(f"{config.name}: {summary.requests} requests in {summary.wall_s:.0f} s", flush=True)
    report(summaries, shapes, skipped, args, f"{header}; {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
