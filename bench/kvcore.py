"""CPU cost of kvcore's bookkeeping: the cache manager per scheduler step.

Figures (bookkeeping only; no KV tensors are allocated):
1. one decode step of B requests, each extended by K + 1 tokens (all drafts accepted),
   with sliding-window releases in the draft group, plus one prefix match, allocate and
   cached free (insert) of a 4K-token prompt sharing a 3K prefix;
2. allocate + free per request, over 10k requests, with and without caching;
3. host memory of the prefix cache's bookkeeping per million cached tokens.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from kvcore import CacheConfig, KVCacheManager, KVPools, LayerGroupSpec, Lifecycle, Owner


def make_manager(num_pages: int, page: int, window: int, k: int) -> KVCacheManager:
    target = LayerGroupSpec("target", Owner.TARGET, num_layers=32, num_kv_heads=8, head_dim=128)
    draft = LayerGroupSpec(
        "draft",
        Owner.DRAFT,
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        window=window,
        lifecycle=Lifecycle.OPTIONAL,
    )
    config = CacheConfig(
        groups=(target, draft),
        tokens_per_page=page,
        num_pages=(num_pages, num_pages),
        num_spec_tokens=k,
        max_num_seqs=512,
    )
    return KVCacheManager(config, KVPools.allocate(config, tensors=False))


def bench_step(batch: int, page: int, window: int, k: int, steps: int) -> dict[str, float]:
    rng = random.Random(0)
    m = make_manager(num_pages=batch * 400 + 4096, page=page, window=window, k=k)
    ids = [f"r{i}" for i in range(batch)]
    lengths = [rng.randint(1024, 3072) for _ in ids]
    for rid, n in zip(ids, lengths, strict=True):
        m.allocate(rid, n)
        m.advance(rid, n)
    shared = [rng.randrange(256) for _ in range(3072)]
    seed = shared + [rng.randrange(256) for _ in range(1024)]
    m.allocate("seed", len(seed))
    m.advance("seed", len(seed))
    m.free("seed", seed)
    step_times, prefix_times, table_times = [], [], []
    for s in range(steps):
        prompt = shared + [rng.randrange(256) for _ in range(1024)]
        t0 = time.perf_counter()
        m.can_extend_batch(ids, lengths)
        m.extend_batch(ids, lengths)
        lengths = [n + k + 1 for n in lengths]
        m.advance_batch(ids, lengths)
        t1 = time.perf_counter()
        match = m.match_prefix(prompt)
        m.allocate("p", len(prompt), match)
        m.advance("p", len(prompt))
        m.free("p", prompt)
        t2 = time.perf_counter()
        m.block_tables(ids, "target")
        m.block_tables(ids, "draft")
        t3 = time.perf_counter()
        if s >= 3:
            step_times.append(t1 - t0)
            prefix_times.append(t2 - t1)
            table_times.append(t3 - t2)
    return {
        "decode_ms": 1e3 * statistics.median(step_times),
        "prefix_ms": 1e3 * statistics.median(prefix_times),
        "tables_ms": 1e3 * statistics.median(table_times),
    }


def bench_allocate_free(num_requests: int, cache: bool) -> float:
    rng = random.Random(1)
    m = make_manager(num_pages=8192, page=16, window=512, k=4)
    docs = [[rng.randrange(256) for _ in range(2048)] for _ in range(8)]
    prompts = [docs[i % 8][: rng.randint(256, 2048)] + [i % 256] for i in range(num_requests)]
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"q{i}"
        match = m.match_prefix(prompt) if cache else None
        if not m.can_allocate(len(prompt), match):
            m.reset_prefix_cache()
        m.allocate(rid, len(prompt), match)
        m.advance(rid, len(prompt))
        m.free(rid, prompt if cache else None)
    return 1e6 * (time.perf_counter() - t0) / num_requests


def bench_memory(num_tokens: int, page: int) -> float:
    rng = random.Random(2)
    m = make_manager(num_pages=num_tokens // page + 1024, page=page, window=512, k=4)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cached, i = 0, 0
    while cached < num_tokens:
        prompt = [rng.randrange(256) for _ in range(4096)]
        m.allocate(f"m{i}", len(prompt))
        m.advance(f"m{i}", len(prompt))
        m.free(f"m{i}", prompt)
        cached += len(prompt)
        i += 1
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / (cached / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--page", type=int, default=16, help="tokens per page")
    parser.add_argument("--window", type=int, default=512, help="draft window, tokens")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step")
    args = parser.parse_args()
    print(f"page {args.page} tokens, draft window {args.window}, K {args.k}")
    print("| batch | decode step (ms) | 4K prefix match+insert (ms) | block tables (ms) |")
    print("|---|---|---|---|")
    for batch in args.batch:
        r = bench_step(batch, args.page, args.window, args.k, args.steps)
        print(f"| {batch} | {r['decode_ms']:.3f} | {r['prefix_ms']:.3f} | {r['tables_ms']:.3f} |")
    for cache in (False, True):
        us = bench_allocate_free(args.requests, cache)
        print(
            f"allocate+free per request ({'with' if cache else 'without'} prefix cache, "
            f"{args.requests} requests): {us:.1f} us"
        )
    mem = bench_memory(1_000_000, args.page)
    print(f"prefix-cache bookkeeping: {mem / 2**20:.1f} MiB per million cached tokens")


if __name__ == "__main__":
    main()
