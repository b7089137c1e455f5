"""The KV transfer of bench/tp.py: 8B-shaped pages GPU 0 -> GPU 1 over UCX, through the
agent and per-rank jobs the servers run, against raw UCX and a device-to-device copy.

    python -m bench.tp transfer [--toy]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

import torch

PAGE = 16


def cache(num_tokens: int, kv_heads: int):
    """8B-shaped KV: 32 layers, ``kv_heads`` heads of 128, bf16, 16-token pages (2 MiB a
    page at 8 heads) and a 1-layer drafter with a 512-token window."""
    from kvcore import CacheConfig, LayerGroupSpec, Lifecycle, Owner

    target = LayerGroupSpec("target", Owner.TARGET, 32, kv_heads, 128, dtype="bfloat16")
    draft = LayerGroupSpec(
        "draft", Owner.DRAFT, 1, kv_heads, 128, dtype="bfloat16", window=512, lifecycle=Lifecycle.OPTIONAL
    )
    pages = num_tokens // PAGE + 8
    return CacheConfig(
        groups=(target, draft), tokens_per_page=PAGE, num_pages=(pages, pages), num_spec_tokens=4
    )


def _transfer_side(side: str, num_tokens: int, raw_bytes: int, repeats: int, device: str, conn) -> None:
    asyncio.run(_transfer_session(side, num_tokens, raw_bytes, repeats, device, conn))


async def _transfer_session(
    side: str, num_tokens: int, raw_bytes: int, repeats: int, device: str, conn
) -> None:
    """Side A sends, side B receives: raw UCX, then whole pages through the TransferAgent
    (equal TP), then one decode rank's half of the heads through its RankTransfer jobs
    (TP 1 -> 2, packed on the GPU): what the servers run."""
    from kvcore.transfer import EndpointInfo
    from kvcore.transfer.ucx import UcxTransport

    transport = UcxTransport()
    await transport.start()
    conn.send(transport.local_info().worker_address)
    peer = "B" if side == "A" else "A"
    info = EndpointInfo(await asyncio.to_thread(conn.recv))
    await transport.connect(peer, info)
    results = {"raw": await _raw_times(side, transport, peer, raw_bytes, repeats, device)}
    runs = _transfer_runs(side, num_tokens, torch.device(device), transport, peer, info)
    for i in range(repeats + 1):
        for kind, run in runs.items():
            seconds, moved = await run(f"{kind}-{i}", conn)
            results.setdefault(kind, []).append(seconds)
            results[f"{kind}_bytes"] = [moved]
    if side == "A":
        results["peer_copy"] = _peer_copy_seconds(raw_bytes, repeats) if device != "cpu" else []
        conn.send(results)
    await transport.close()


async def _raw_times(
    side: str, transport, peer: str, raw_bytes: int, repeats: int, device: str
) -> list[float]:
    """Raw UCX: one message of ``raw_bytes``, acknowledged; seconds per repeat (side A)."""
    buffer = torch.empty(raw_bytes, dtype=torch.uint8, device=device)
    ack, times = torch.zeros(8, dtype=torch.uint8), []
    for i in range(repeats + 1):
        if side == "A":
            start = time.perf_counter()
            await transport.send(peer, buffer, 1000 + i, 60.0)
            await transport.recv(ack, 2000 + i, 60.0)
            times.append(time.perf_counter() - start)
        else:
            await transport.recv(buffer, 1000 + i, 60.0)
            await transport.send(peer, ack, 2000 + i, 60.0)
    return times


def _transfer_runs(side: str, num_tokens: int, dev: torch.device, transport, peer: str, info) -> dict:
    """kind -> ``run(request_id, conn) -> (seconds, bytes)`` for this side."""
    from kvcore import KVCacheManager, KVPools
    from kvcore.transfer import HeadRoute, PeerRank, RankTransfer, TransferAgent

    def cache_of(heads: int):
        pools = KVPools.allocate(cache(num_tokens, heads), dev)
        return KVCacheManager(cache(num_tokens, heads), pools), pools

    whole_manager, whole_pools = cache_of(8)
    whole = TransferAgent(whole_manager, whole_pools, 4096, transport)
    whole.pair(peer, [PeerRank(peer, info)])
    sliced_manager, sliced_pools = whole_manager, whole_pools
    if side == "B":
        sliced_manager, sliced_pools = cache_of(4)
    sliced = RankTransfer(sliced_pools, list(sliced_manager.groups), transport)
    route = {g: HeadRoute(0, 1, slice(4, 8), slice(0, 4), False) for g in ("target", "draft")}
    if side == "A":
        return {
            "whole": lambda rid, conn: _send_whole(whole, rid, num_tokens, peer, conn),
            "sliced": lambda rid, conn: _send_sliced(
                sliced, sliced_manager, rid, num_tokens, peer, route, conn
            ),
        }
    return {
        "whole": lambda rid, conn: _receive_whole(whole, rid, num_tokens, conn),
        "sliced": lambda rid, conn: _receive_sliced(
            sliced, sliced_manager, rid, num_tokens, peer, route, conn
        ),
    }


async def _send_whole(agent, rid: str, num_tokens: int, peer: str, conn) -> tuple[float, int]:
    from kvcore import AuxState

    agent.manager.allocate(rid, num_tokens)
    agent.manager.advance(rid, num_tokens)
    dest = await asyncio.to_thread(conn.recv)
    start = time.perf_counter()
    usage = await agent.send_request(
        rid, num_tokens, peer, AuxState(num_tokens, 1, torch.zeros(4096), "A"), 60.0, dest
    )
    seconds = time.perf_counter() - start
    agent.manager.free(rid)
    return seconds, usage.total_bytes


async def _receive_whole(agent, rid: str, num_tokens: int, conn) -> tuple[float, int]:
    agent.manager.allocate(rid, num_tokens, num_computed=num_tokens)
    conn.send({g: agent.manager.block_table(rid, g) for g in agent.manager.groups})
    await agent.receive_request(rid, num_tokens, 60.0)
    agent.manager.free(rid)
    return 0.0, 0


async def _send_sliced(rank, manager, rid: str, num_tokens: int, peer: str, route, conn) -> tuple[float, int]:
    """Decode rank 1's half of the heads, acknowledged by a one-byte message."""
    from kvcore.transfer import SendJob

    manager.allocate(rid, num_tokens)
    manager.advance(rid, num_tokens)
    dest = await asyncio.to_thread(conn.recv)
    start = time.perf_counter()
    pages = manager.transfer_pages(rid, num_tokens)
    usage = await rank.send(SendJob(rid, peer, 0, pages, route, 60.0, dest))
    await rank.transport.recv(torch.zeros(1, dtype=torch.uint8), 3000, 60.0)
    seconds = time.perf_counter() - start
    manager.free(rid)
    return seconds, usage.total_bytes


async def _receive_sliced(
    rank, manager, rid: str, num_tokens: int, peer: str, route, conn
) -> tuple[float, int]:
    from kvcore.transfer import RecvJob

    manager.allocate(rid, num_tokens, num_computed=num_tokens)
    conn.send({g: manager.block_table(rid, g) for g in manager.groups})
    pages = manager.transfer_pages(rid, num_tokens)
    await rank.recv(RecvJob(rid, pages, {0: route}, 60.0))
    await rank.transport.send(peer, torch.zeros(1, dtype=torch.uint8), 3000, 60.0)
    manager.free(rid)
    return 0.0, 0


def _peer_copy_seconds(nbytes: int, repeats: int) -> list[float]:
    """torch device-to-device copy, GPU 0 -> GPU 1 (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - start)
    return times[1:]


def run_transfer(toy_shapes: bool, num_tokens: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    pipes = {s: ctx.Pipe() for s in "AB"}
    raw_bytes = 256 << 20
    devices = {"A": "cpu", "B": "cpu"} if toy_shapes else {"A": "cuda:0", "B": "cuda:1"}
    procs = {
        s: ctx.Process(
            target=_transfer_side,
            args=(s, num_tokens, raw_bytes, repeats, devices[s], pipes[s][1]),
            daemon=True,
        )
        for s in "AB"
    }
    for p in procs.values():
        p.start()
    a, b = pipes["A"][0], pipes["B"][0]
    address_a, address_b = a.recv(), b.recv()
    a.send(address_b)
    b.send(address_a)
    for _ in range(2 * (repeats + 1)):  # reservation rows, B -> A
        a.send(b.recv())
    got = a.recv()
    for p in procs.values():
        p.join(timeout=30)
    rate = lambda n, ts: n / statistics.median(ts[1:] if len(ts) > 1 else ts) / 1e9  # noqa: E731
    out = {
        "prompt_tokens": num_tokens,
        "raw_ucx_GBps": rate(raw_bytes, got["raw"]),
        "whole_pages_GBps": rate(got["whole_bytes"][0], got["whole"]),
        "whole_pages_bytes": got["whole_bytes"][0],
        "sliced_heads_GBps": rate(got["sliced_bytes"][0], got["sliced"]),
        "sliced_heads_bytes": got["sliced_bytes"][0],
    }
    if got["peer_copy"]:
        out["device_copy_GBps"] = raw_bytes / statistics.median(got["peer_copy"]) / 1e9
    return out
