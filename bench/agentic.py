"""Agentic multi-turn replay: prefix reuse under KV pressure, unified vs separate layout,
with and without the host KV tier.

Generates a deterministic workload (``bench.agentic_workload``), replays it against a router
(``bench.agentic_replay``) and reports, per configuration, prefilled vs cached tokens and hit
rate per layer group, TTFT of first and continuation turns, inter-token latency, AL by origin
and output tok/s. With ``--router`` it replays against a running cluster; otherwise it starts
one local cluster per configuration (router + prefill + decode on 127.0.0.1, the bundled tiny
pair), prints a markdown table and writes a bar chart (SVG).

The prefill worker's device KV memory is deliberately small (``--prefill-kv-mb``): it holds
about one long conversation, so continuation turns find their prefix only where it survived
the other conversations' turns. The decode worker gets enough for every request in flight.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import grpc

from bench import agentic_svg
from bench.agentic_replay import replay
from bench.agentic_report import Summary, markdown_table, summarize
from bench.agentic_workload import Workload, WorkloadConfig, generate
from deploy.local import LocalCluster
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"
HOST_TIER_FLAG = "--host-kv-cache-mb"
ORIGINS = {"unified": "transferred", "separate": "cold", "aggregated": "local"}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One column of the matrix. ``layout`` is unified, separate or aggregated (one worker
    doing both roles, unified layout); ``host_kv_mb`` 0 = no host tier."""

    layout: str
    host_kv_mb: int = 0

    @property
    def name(self) -> str:
        tier = f"host tier {self.host_kv_mb} MiB" if self.host_kv_mb else "no host tier"
        return f"{self.layout}, {tier}"

    @property
    def origin(self) -> str:
        return ORIGINS[self.layout]


def host_tier_supported() -> bool:
    """Whether ``tandem worker`` accepts the host KV tier's size flag."""
    help_text = subprocess.run([sys.executable, "-m", "deploy.cli", "worker", "--help"],
                               capture_output=True, text=True, check=False).stdout
    return HOST_TIER_FLAG in help_text


def worker_args(config: ClusterConfig, args: argparse.Namespace) -> list[str]:
    layout = "unified" if config.layout == "aggregated" else config.layout
    out = ["--model", args.model, "--drafter", args.drafter, "-k", str(args.k), "--layout", layout,
           "--max-num-seqs", str(args.max_num_seqs)]
    if config.host_kv_mb:
        out += [HOST_TIER_FLAG, str(config.host_kv_mb)]
    return out


def start_cluster(config: ClusterConfig, args: argparse.Namespace) -> LocalCluster:
    """Prefill with the small KV, decode with room for every request in flight; an
    aggregated worker gets both amounts (it holds both roles' pages)."""
    prefill = ["--kv-cache-mb", str(args.prefill_kv_mb)]
    decode = ["--kv-cache-mb", str(args.decode_kv_mb)]
    both = ["--kv-cache-mb", str(args.prefill_kv_mb + args.decode_kv_mb)]
    roles = ([("both", both)] if config.layout == "aggregated"
             else [("prefill", prefill), ("decode", decode)])
    cluster = LocalCluster(worker_args(config, args), ["--model", args.model, "-k", str(args.k)],
                           roles, start_timeout_s=180, env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        cluster.start()
    except Exception:
        print(cluster.logs(), file=sys.stderr)
        cluster.stop()
        raise
    return cluster


def prefill_capacity(cluster: LocalCluster) -> dict[str, int]:
    """Device pages per group of the first prefill worker ({} for an aggregated cluster)."""
    for p in cluster.processes[1:]:
        if p.name.startswith("prefill"):
            with grpc.insecure_channel(p.grpc) as channel:
                stats = wpb_grpc.PrefillWorkerStub(channel).Stats(wpb.StatsRequest(), timeout=10)
            return {g.group: g.num_pages_total for g in stats.groups}
    return {}


def client_address(cluster: LocalCluster, config: ClusterConfig) -> str:
    """The router; for an aggregated cluster the worker itself, which serves the same client
    API: the router polls an aggregated worker's health with a Stats call that worker does not
    serve, and stops routing to it after two polls."""
    return cluster.processes[1].grpc if config.layout == "aggregated" else cluster.router_address


def run_config(config: ClusterConfig, workload: Workload, args: argparse.Namespace
               ) -> tuple[Summary, dict[str, int]]:
    cluster = start_cluster(config, args)
    try:
        capacity = prefill_capacity(cluster)
        result = replay(client_address(cluster, config), workload, args.concurrency)
    finally:
        cluster.stop()
    return summarize(config.name, config.origin, result), capacity


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
    return WorkloadConfig(seed=args.seed, conversations=args.conversations,
                          min_turns=args.min_turns, max_turns=args.max_turns,
                          answer_tokens=args.answer_tokens, preamble_tokens=args.preamble_tokens,
                          branch_probability=args.branch_probability)


def describe(workload: Workload, args: argparse.Namespace) -> str:
    threads = workload.threads
    branches = sum(t.is_branch for t in threads)
    return (f"workload: seed {args.seed}, {len(threads) - branches} conversations + {branches} "
            f"subagent branches, {workload.num_requests()} requests, {args.answer_tokens}-token "
            f"answers, concurrency {args.concurrency}; K = {args.k}, greedy; prefill KV "
            f"{args.prefill_kv_mb} MiB, decode KV {args.decode_kv_mb} MiB")


def report(summaries: list[Summary], capacities: dict[str, dict[str, int]],
           skipped: dict[str, str], args: argparse.Namespace, header: str) -> None:
    print(header)
    print(markdown_table(summaries, skipped))
    for name, pages in capacities.items():
        print(f"- {name}: prefill device pages " + ", ".join(f"{g} {n}" for g, n in pages.items()))
    for s in summaries:
        if s.over_cached:
            print(f"- {s.name}: {s.over_cached} requests reported more cached than prompt "
                  "tokens (re-admitted after preemption); counted as fully cached")
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
    p.add_argument("--router", default="", help="replay against this running router "
                   "(host:port) instead of starting clusters")
    p.add_argument("--origin", default="transferred", help="AL origin label with --router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="threads (conversations or "
                   "subagent branches) in flight")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--preamble-tokens", type=int, default=1024)
    p.add_argument("--branch-probability", type=float, default=0.5)
    p.add_argument("--layouts", nargs="+", default=["unified", "separate"],
                   choices=["unified", "separate", "aggregated"])
    p.add_argument("--host-kv-mb", type=int, default=64, help="host tier size of the 'with' "
                   "column, MiB per worker (0 = run only without)")
    p.add_argument("--prefill-kv-mb", type=int, default=32)
    p.add_argument("--decode-kv-mb", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process "
                   "(1: prefill and decode each keep one core of two)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--drafter", default=DRAFTER)
    p.add_argument("--svg", default="docs/agentic.svg", help="plot path ('' = none)")
    p.add_argument("--json", default="", help="also write the summaries here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = generate(workload_config(args))
    header = describe(workload, args)
    start = time.time()
    if args.router:
        summary = summarize(f"router {args.router}", args.origin,
                            replay(args.router, workload, args.concurrency))
        report([summary], {}, {}, args, header)
        return
    configs, skipped = matrix(args, host_tier_supported())
    summaries, capacities = [], {}
    for config in configs:
        summary, capacities[config.name] = run_config(config, workload, args)
        summaries.append(summary)
        print(f"{config.name}: {summary.requests} requests in {summary.wall_s:.0f} s", flush=True)
    report(summaries, capacities, skipped, args, f"{header}; {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
