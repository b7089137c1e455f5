"""Throughput of one request's page transfer (kvcore.transfer.TransferAgent) between two processes.

An 8B-shaped target group (32 layers, 8 KV heads, head dim 128, bf16, 16-token pages: 2 MiB
a page) and a 1-layer draft group with a 512-token window; a prompt of N tokens is pushed
from a "prefill" process into pages a "decode" process reserved: pack, UCX send, unpack,
aux state, acknowledgement. Compare with ``bench/ucx_raw.py`` on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import os
import statistics
import time

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def make_manager(num_tokens: int):
    """The manager and its pools (``KVPools``)."""
    from kvcore import CacheConfig, KVCacheManager, KVPools, LayerGroupSpec, Lifecycle, Owner

    target = LayerGroupSpec("target", Owner.TARGET, 32, 8, 128, dtype="bfloat16")
    draft = LayerGroupSpec(
        "draft", Owner.DRAFT, 1, 8, 128, dtype="bfloat16", window=512, lifecycle=Lifecycle.OPTIONAL
    )
    pages = num_tokens // 16 + 8
    config = CacheConfig(
        groups=(target, draft), tokens_per_page=16, num_pages=(pages, pages), num_spec_tokens=4
    )
    pools = KVPools.allocate(config)
    return KVCacheManager(config, pools), pools


def _child(role: str, num_tokens: int, iters: int, direct: bool, conn) -> None:
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(_session(role, num_tokens, iters, direct, conn))


async def _session(role: str, num_tokens: int, iters: int, direct: bool, conn) -> None:
    import torch

    from kvcore import AuxState
    from kvcore.transfer import EndpointInfo, PeerRank, TransferAgent

    manager, pools = make_manager(num_tokens)
    agent = TransferAgent(manager, pools, hidden_size=4096)
    await agent.start()
    conn.send(dataclasses.astuple(agent.endpoint()))
    peer = "decode" if role == "prefill" else "prefill"
    info = EndpointInfo(*await asyncio.to_thread(conn.recv))
    await agent.connect(peer, info)
    agent.pair(peer, [PeerRank(peer, info)])
    times, moved = [], {}
    for i in range(iters):
        rid = f"bench-{i}"
        if role == "prefill":
            manager.allocate(rid, num_tokens)
            manager.advance(rid, num_tokens)
            dest = await asyncio.to_thread(conn.recv) if direct else None
            aux = AuxState(num_tokens, 1, torch.zeros(4096), "prefill")
            start = time.perf_counter()
            usage = await agent.send_request(rid, num_tokens, "decode", aux, 60.0, dest)
            times.append(time.perf_counter() - start)
            moved = usage.bytes
        else:
            manager.allocate(rid, num_tokens, num_computed=num_tokens)
            conn.send({g: manager.block_table(rid, g) for g in manager.groups})
            await agent.receive_request(rid, num_tokens, 60.0)
        manager.free(rid)
    conn.send({"times": times, "bytes": moved})
    await agent.close()


def run(num_tokens: int, iters: int, direct: bool) -> dict:
    ctx = mp.get_context("spawn")
    pipes = {r: ctx.Pipe() for r in ("prefill", "decode")}
    procs = [
        ctx.Process(target=_child, args=(r, num_tokens, iters, direct, pipes[r][1]), daemon=True)
        for r in pipes
    ]
    for p in procs:
        p.start()
    infos = {r: pipes[r][0].recv() for r in pipes}
    pipes["prefill"][0].send(infos["decode"])
    pipes["decode"][0].send(infos["prefill"])
    for _ in range(iters):
        rows = pipes["decode"][0].recv()
        if direct:
            pipes["prefill"][0].send(rows)
    result = pipes["prefill"][0].recv()
    pipes["decode"][0].recv()
    for p in procs:
        p.join(timeout=30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--iters", type=int, default=5, help="transfers per size (first dropped)")
    args = parser.parse_args()
    print("| prompt tokens | path | target MB | draft MB | median s | GB/s (incl. aux + ack) |")
    print("|---|---|---|---|---|---|")
    for n in args.tokens:
        for direct in (True, False):
            r = run(n, args.iters, direct)
            t = statistics.median(r["times"][1:] or r["times"])
            total = sum(r["bytes"].values())
            path = "pool to pool" if direct else "packed"
            print(
                f"| {n} | {path} | {r['bytes']['target'] / 1e6:.1f} | "
                f"{r['bytes']['draft'] / 1e6:.2f} | {t:.4f} | {total / t / 1e9:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
