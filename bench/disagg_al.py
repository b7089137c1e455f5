"""Acceptance length: aggregated vs disaggregated (unified layout) vs disaggregated (separate).

The bundled tiny pair (drafter window 256 tokens) serves held-out standard-library code over
a ladder of prompt lengths. Aggregated runs in-process; each disaggregated layout runs a real
local cluster (router + prefill + decode processes, pages over UCX). Greedy decoding, so the
three must emit the same tokens; only the drafter's starting state differs.
"""

from __future__ import annotations

import argparse
import time

import grpc

from bench.al_report import MODES, Record, markdown, rows, svg
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


def run_aggregated(prompts: dict[int, list[list[int]]], k: int, max_tokens: int, device: str) -> dict:
    engine = Engine(EngineConfig(model=MODEL, drafter=DRAFTER, num_spec_tokens=k, device=device))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return {
        n: [
            Record(o.token_ids, o.usage.acceptance_length)
            for o in (engine.generate([p], greedy)[0] for p in ps)
        ]
        for n, ps in prompts.items()
    }


def run_cluster(
    layout: str, prompts: dict[int, list[list[int]]], k: int, max_tokens: int, device: str
) -> dict:
    worker = ["--model", MODEL, "--drafter", DRAFTER, "-k", str(k), "--layout", layout, "--device", device]
    cluster = LocalCluster(worker, ["--model", MODEL, "-k", str(k)], ["prefill", "decode"])
    cluster.start()
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            return {n: [_generate(stub, p, max_tokens) for p in ps] for n, ps in prompts.items()}
    finally:
        cluster.stop()


def _generate(stub, prompt: list[int], max_tokens: int) -> Record:
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    record, start = Record([], 0.0), time.monotonic()
    for message in stub.Generate(request, timeout=600):
        if message.HasField("chunk"):
            if not record.tokens:
                record.ttft_s = time.monotonic() - start
            record.tokens += list(message.chunk.token_ids)
        elif message.HasField("complete"):
            usage = message.complete.usage
            record.al = usage.acceptance_length
            record.transfer_bytes = {t.group: t.num_bytes for t in usage.transfers}
        else:
            raise RuntimeError(message.error.message)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 3584])
    parser.add_argument("--per-length", type=int, default=4, help="prompts per length")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="every engine's (the cluster's workers' too)")
    parser.add_argument("--svg", default="", help="also write the plot of AL against prompt length here")
    args = parser.parse_args()
    prompts = ladder_prompts(args.lengths, args.per_length)
    start, run = time.time(), {}
    for mode in steps(MODES, len(MODES), "AL, aggregated vs disaggregated"):
        if mode == "aggregated":
            run[mode] = run_aggregated(prompts, args.k, args.max_tokens, args.device)
        else:
            run[mode] = run_cluster(mode, prompts, args.k, args.max_tokens, args.device)
    summary = rows(run)
    print(
        f"K = {args.k}, {args.per_length} held-out prompts per length, {args.max_tokens} "
        f"tokens each, greedy, {args.device} ({time.time() - start:.0f} s)"
    )
    print(markdown(summary))
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(summary, f"Acceptance length, K = {args.k} ({args.device})"))
        print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
