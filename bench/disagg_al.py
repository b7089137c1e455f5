"""Acceptance length: aggregated vs disaggregated (unified layout) vs disaggregated (separate).

The bundled tiny pair (drafter window 256 tokens) serves held-out standard-library code over
a ladder of prompt lengths. Aggregated runs in-process; each disaggregated layout runs a real
local cluster (router + prefill + decode processes, pages over UCX). Greedy decoding, so the
three must emit the same tokens; only the drafter's starting state differs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc

from bench.progress import steps
from deploy.local import LocalCluster
from models.byte_tokenizer import byte_ids
from models.data import split_files
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling import SamplingParams

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"


def ladder_prompts(lengths: list[int], per_length: int) -> dict[int, list[list[int]]]:
    """``per_length`` prompts of exactly n tokens per n, from held-out files long enough."""
    _, held = split_files()
    docs = [byte_ids(p.read_bytes()) for p in sorted(held)]
    out = {}
    for n in lengths:
        long_enough = [d for d in docs if len(d) >= n + 1]
        if len(long_enough) < per_length:
            raise SystemExit(f"only {len(long_enough)} held-out files reach {n} tokens")
        out[n] = [d[:n] for d in long_enough[:per_length]]
    return out


def run_aggregated(prompts: dict[int, list[list[int]]], k: int, max_tokens: int) -> dict:
    engine = Engine(EngineConfig(model=MODEL, drafter=DRAFTER, num_spec_tokens=k))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return {
        n: [(o.token_ids, o.usage.acceptance_length) for o in (engine.generate([p], greedy)[0] for p in ps)]
        for n, ps in prompts.items()
    }


def run_cluster(layout: str, prompts: dict[int, list[list[int]]], k: int, max_tokens: int) -> dict:
    worker = ["--model", MODEL, "--drafter", DRAFTER, "-k", str(k), "--layout", layout]
    cluster = LocalCluster(worker, ["--model", MODEL, "-k", str(k)], ["prefill", "decode"])
    cluster.start()
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            return {n: [_generate(stub, p, max_tokens) for p in ps] for n, ps in prompts.items()}
    finally:
        cluster.stop()


def _generate(stub, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    tokens, al = [], 0.0
    for message in stub.Generate(request, timeout=600):
        if message.HasField("chunk"):
            tokens += list(message.chunk.token_ids)
        elif message.HasField("complete"):
            al = message.complete.usage.acceptance_length
        else:
            raise RuntimeError(message.error.message)
    return tokens, al


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 3584])
    parser.add_argument("--per-length", type=int, default=4, help="prompts per length")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = ladder_prompts(args.lengths, args.per_length)
    start = time.time()
    results = {}
    for layout in steps(("aggregated", "unified", "separate"), 3, "AL, aggregated vs disaggregated"):
        if layout == "aggregated":
            results[layout] = run_aggregated(prompts, args.k, args.max_tokens)
        else:
            results[layout] = run_cluster(layout, prompts, args.k, args.max_tokens)
    print(
        f"K = {args.k}, {args.per_length} held-out prompts per length, {args.max_tokens} "
        f"tokens each, greedy ({time.time() - start:.0f} s)"
    )
    print(
        "| prompt tokens | AL aggregated | AL disaggregated, unified | AL disaggregated, "
        "separate | outputs equal |"
    )
    print("|---|---|---|---|---|")
    for n in args.lengths:
        al = {name: statistics.mean(a for _, a in r[n]) for name, r in results.items()}
        same = all(
            results[x][n][i][0] == results["aggregated"][n][i][0]
            for x in ("unified", "separate")
            for i in range(len(prompts[n]))
        )
        print(
            f"| {n} | {al['aggregated']:.2f} | {al['unified']:.2f} | {al['separate']:.2f} | "
            f"{'yes' if same else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
