"""Host KV tier copy rates on one GPU: eviction to pinned host pages and recall from them.

An 8B-shaped target group (32 layers, 8 KV heads, head dim 128, bf16, 16-token pages = 2 MiB
a page) and a 1-layer windowed draft group. A request of ``--pages`` pages is cached, then a
second request evicts it all to the host tier (write-back), then a match recalls it. Each
phase is timed around ``torch.cuda.synchronize()``; the baseline is one contiguous copy of
the same bytes between the device and pinned host memory.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcore import CacheConfig, KVCacheManager, KVPools, LayerGroupSpec, Lifecycle, Owner

P = 16


def config(pages: int, policy: str) -> CacheConfig:
    target = LayerGroupSpec(
        "target", Owner.TARGET, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    draft = LayerGroupSpec(
        "draft",
        Owner.DRAFT,
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        window=512,
        lifecycle=Lifecycle.OPTIONAL,
    )
    return CacheConfig(
        groups=(target, draft),
        tokens_per_page=P,
        num_pages=(pages + 8, pages + 8),
        num_spec_tokens=4,
        host_num_pages=pages + 8,
        host_write_policy=policy,
    )


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run(pages: int, policy: str) -> dict[str, float]:
    pools = KVPools.allocate(config(pages, policy), "cuda")
    m = KVCacheManager(config(pages, policy), pools)
    tokens = list(range(pages * P))
    page_bytes = pools.tensor("target")[0].numel() * 2
    m.allocate("a", len(tokens))
    m.advance("a", len(tokens))
    cache = timed(lambda: m.free("a", tokens))
    evict = timed(lambda: m.allocate("b", (pages + 7) * P))  # every cached page must go
    m.free("b")
    match = m.match_prefix(tokens + [1])
    recall = timed(lambda: m.allocate("c", len(tokens) + 1, match))
    m.free("c")
    moved = pages * page_bytes / 1e9
    return {"cache": cache, "evict": evict, "recall": recall, "GB": moved}


def overlap(pages: int) -> dict[str, float]:
    """Write-through copies on the side stream against compute on the current stream:
    seconds for the compute alone, the copy alone, and both issued together."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def compute() -> None:
        for _ in range(12):
            x @ x

    def cache_with(work) -> float:
        m = KVCacheManager(config(pages, "through"), KVPools.allocate(config(pages, "through"), "cuda"))
        tokens = list(range(pages * P))
        m.allocate("a", len(tokens))
        m.advance("a", len(tokens))

        def both() -> None:
            m.free("a", tokens)
            work()

        return timed(both)

    return {"copy": cache_with(lambda: None), "both": cache_with(compute), "compute": timed(compute)}


def baseline(nbytes: int) -> tuple[float, float]:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        d2h = timed(lambda: host.copy_(device, non_blocking=True))
        h2d = timed(lambda: device.copy_(host, non_blocking=True))
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=512, help="target pages cached, evicted, recalled")
    args = p.parse_args()
    for policy in ("evict", "through"):
        run(16, policy)  # warm-up
    rows = {policy: run(args.pages, policy) for policy in ("evict", "through")}
    d2h, h2d = baseline(int(rows["evict"]["GB"] * 1e9))
    gb = rows["evict"]["GB"]
    print(
        f"{args.pages} target pages ({gb:.2f} GB) on {torch.cuda.get_device_name()}; "
        f"one contiguous pinned copy: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s"
    )
    print("| policy | free + cache (ms) | evict to host (ms, GB/s) | recall (ms, GB/s) |")
    print("|---|---|---|---|")
    for policy, r in rows.items():
        print(
            f"| {policy} | {r['cache'] * 1e3:.1f} | {r['evict'] * 1e3:.1f} "
            f"({gb / r['evict']:.1f}) | {r['recall'] * 1e3:.1f} ({gb / r['recall']:.1f}) |"
        )
    overlap(16)  # warm-up
    o = overlap(args.pages)
    print(
        f"write-through copy on the side stream: copy alone {o['copy'] * 1e3:.1f} ms, "
        f"12 bf16 8K matmuls alone {o['compute'] * 1e3:.1f} ms, both issued together "
        f"{o['both'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
