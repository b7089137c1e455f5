"""Host time of a graphed decode step's input preparation, per call, on the CPU.

A replayed CUDA graph costs the host little; what it costs is filling the graph's static
inputs: ``uniform_batch`` (ids, positions, slots of spans of one length), the
``GraphedForward.load`` of those into the pinned staging buffers, and the draft chain's
``_load`` and its catch-up and verify stages' ``load``. A speculative step runs the chain's
three (one graph for catch-up, chain and verify); a step without drafts, the first two. The same
Python runs on any host, so this needs no GPU (buffers are not pinned and nothing is
uploaded here).

    python -m bench.host_step [--batches 1,16,64] [--k 4] [--calls 2000]
"""

from __future__ import annotations

import argparse
import timeit

import torch

from services.engine.batch import Span
from services.engine.device.chain_catch_up import PendingSpans
from services.engine.device.chain_verify import ChainVerify
from services.engine.device.cuda_graphs import pad_front
from services.engine.device.draft_chain import ChainShape, GraphedDraftChain
from services.engine.device.graphed_forward import GraphedForward, PagedGroup, batch_buckets, uniform_batch

PAGE, WIDTH, CONTEXT = 16, 128, 1000  # tokens per page, block-table width, first position


def per_call_us(fn, calls: int) -> float:
    fn()
    return timeit.timeit(fn, number=calls) / calls * 1e6


def measure(batch: int, k: int, calls: int) -> dict[str, float]:
    """Microseconds per call of each preparation at ``batch`` requests and K drafts."""
    pool = torch.zeros(1, 1, 2, 1, PAGE, 8)
    buckets = batch_buckets(batch)
    groups = [PagedGroup("target", (0,), pool)]
    forward = GraphedForward(lambda *a: (torch.zeros(1),), groups, k + 1, buckets, WIDTH, capture=False)
    shape = ChainShape(buckets, WIDTH, 8, torch.float32, 0, 1, PAGE, 32, capture=False)
    chain = GraphedDraftChain(None, None, pool, shape, ChainVerify(forward, PAGE))
    table = torch.randint(0, 4096, (batch, WIDTH), dtype=torch.int32)
    host_table = table.numpy()
    spans = [Span(f"r{i}", CONTEXT + 7 * i, list(range(k + 1)), CONTEXT + 7 * i) for i in range(batch)]
    short = [Span(s.request_id, s.start, s.token_ids[:2]) for s in spans]
    starts = [s.start for s in spans]
    filled = uniform_batch(spans, [table], PAGE)
    pending = PendingSpans([s.start for s in short], [s.token_ids for s in short], torch.zeros(2 * batch, 8))
    bucket = buckets[-1]
    return {
        "uniform_batch": per_call_us(lambda: uniform_batch(spans, [table], PAGE), calls),
        "GraphedForward.load": per_call_us(lambda: forward.load(filled), calls),
        "chain _load": per_call_us(lambda: chain._load(starts, host_table, bucket), calls),
        "chain catch-up stage load": per_call_us(lambda: chain.catch.load(pending, bucket), calls),
        "chain verify stage load": per_call_us(
            lambda: chain.verify.load(starts, [host_table], bucket), calls
        ),
        "pad_front": per_call_us(lambda: pad_front(short, k + 1), calls),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    rows = {b: measure(b, a.k, a.calls) for b in batches}
    names = list(next(iter(rows.values())))
    print("| us per call | " + " | ".join(f"B{b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{rows[b][name]:.0f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
