"""Acceptance length: aggregated vs disaggregated (unified layout) vs disaggregated (separate).

    python -m bench.disagg_al [--device cuda] [--lengths ...] [--drafters DIR ...] [--json F] [--svg F]

The bundled tiny pair serves held-out standard-library code over a ladder of prompt lengths
(windows of the held-out code at seeded offsets, as in bench/al_ladder.py) at a fixed K
(adaptive K off everywhere), once per
drafter (``--drafters``: e.g. the 256- and 2,048-token windows). Aggregated runs
in-process; each disaggregated layout runs a real local cluster (router + prefill + decode
processes, pages over UCX; on one GPU both workers share it). Greedy decoding, EOS ignored,
so the three must emit the same tokens; only the drafter's starting state differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import grpc

from bench.al_ladder import held_out_corpora, windows
from bench.al_report import MODES, Record, markdown, rows, svg
from bench.progress import steps
from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"


def ladder_prompts(lengths: list[int], per_length: int) -> dict[int, list[list[int]]]:
    """``per_length`` prompts of exactly n tokens per n: BOS + held-out code at seeded offsets."""
    code = held_out_corpora()["code"]
    return {n: windows(code, n, per_length, seed=1) for n in lengths}


def run_aggregated(prompts: dict[int, list[list[int]]], drafter: str, args) -> dict:
    config = EngineConfig(MODEL, drafter, num_spec_tokens=args.k, device=args.device, adaptive_k=False)
    engine = Engine(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return {
        n: [
            Record(o.token_ids, o.usage.acceptance_length)
            for o in (engine.generate([p], greedy)[0] for p in ps)
        ]
        for n, ps in prompts.items()
    }


def run_cluster(layout: str, prompts: dict[int, list[list[int]]], drafter: str, args) -> dict:
    k = str(args.k)
    worker = ["--model", MODEL, "--drafter", drafter, "-k", k, "--layout", layout, "--device", args.device]
    worker.append("--no-adaptive-k")  # AL at a fixed K: the per-step rule would make it timing-dependent
    cluster = LocalCluster(worker, ["--model", MODEL, "-k", k], ["prefill", "decode"])
    cluster.start()
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            return {n: [_generate(stub, p, args.max_tokens) for p in ps] for n, ps in prompts.items()}
    finally:
        cluster.stop()


def _generate(stub, prompt: list[int], max_tokens: int) -> Record:
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
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
            record.transfer_s = sum(t.seconds for t in usage.transfers)
        else:
            raise RuntimeError(message.error.message)
    return record


def ladder(prompts: dict, drafter: str, args) -> dict:
    """{mode: {length: [Record, ...]}} for one drafter."""
    run = {}
    for mode in steps(MODES, len(MODES), f"AL, {Path(drafter).name}"):
        if mode == "aggregated":
            run[mode] = run_aggregated(prompts, drafter, args)
        else:
            run[mode] = run_cluster(mode, prompts, drafter, args)
    return run


def plot_path(path: str, drafter: str, several: bool) -> str:
    """``path``, or with several drafters ``stem-<drafter folder>.svg`` beside it."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{Path(drafter).name}{p.suffix}")) if several else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--per-length", type=int, default=4, help="prompts per length")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="every engine's (the cluster's workers' too)")
    parser.add_argument("--drafters", nargs="+", default=[DRAFTER], help="one ladder per drafter folder")
    parser.add_argument("--json", default="", help="also write every record and summary here")
    parser.add_argument(
        "--svg", default="", help="also write the plot of AL against prompt length here (one per drafter)"
    )
    args = parser.parse_args()
    prompts = ladder_prompts(args.lengths, args.per_length)
    results = {}
    for drafter in args.drafters:
        start = time.time()
        run = ladder(prompts, drafter, args)
        summary = rows(run)
        print(
            f"\n{drafter}: K = {args.k}, {args.per_length} held-out prompts per length, "
            f"{args.max_tokens} tokens each, greedy, {args.device} ({time.time() - start:.0f} s)"
        )
        print(markdown(summary))
        results[drafter] = {"summary": summary, "al": _per_prompt_al(run)}
        if args.svg:
            path = plot_path(args.svg, drafter, len(args.drafters) > 1)
            with open(path, "w") as f:
                f.write(svg(summary, f"AL, K = {args.k}, {Path(drafter).name} ({args.device})"))
            print(f"plot: {path}")
        if args.json:  # after every drafter: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


def _per_prompt_al(run: dict) -> dict:
    return {mode: {n: [r.al for r in records] for n, records in per.items()} for mode, per in run.items()}


if __name__ == "__main__":
    main()
