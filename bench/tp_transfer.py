"""The KV transfer of bench/tp.py: 8B-shaped pages between two processes over UCX, through
the agent and per-rank jobs the servers run, against raw UCX and a device ``copy_`` of the
same bytes. Two GPUs or more: GPU 0 -> GPU 1; one GPU: both processes on cuda:0; --toy:
both on the CPU (shared memory), to check the script anywhere.

    python -m bench.tp_transfer [--prompts 4096,16384,32768] [--repeats 3] [--toy]
    python -m bench.tp transfer [--toy]   # one prompt, as JSON

For each prompt: raw UCX (the target's bytes in messages of the transfer's cap), the
device copy of those bytes, whole pages (target + draft, runs pool to pool) and one decode
rank's half of the heads (TP 1 -> 2, packed and unpacked on the GPU); a markdown table of
GB/s (median of ``--repeats`` after a warm-up) and % of raw UCX.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import torch

from kvcore.transfer.pages import MAX_MESSAGE_BYTES
from kvcore.transfer.tags import make_tag

PAGE = 16
TARGET_PAGE_BYTES = 32 * 2 * 8 * PAGE * 128 * 2  # 2 MiB: one target page at 8 heads
PROMPTS = "4096,16384,32768"
TOY_PROMPTS = "256,1024"  # the same shapes on the CPU: a few hundred MB


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


def raw_bytes_of(num_tokens: int) -> int:
    """The bytes raw UCX and the copy move for a prompt: its target pages' (8 heads)."""
    return -(-num_tokens // PAGE) * TARGET_PAGE_BYTES


def _transfer_side(
    side: str, prompts: list[int], repeats: int, devices: dict[str, str], cap: int, conn
) -> None:
    asyncio.run(_transfer_session(side, prompts, repeats, devices, cap, conn))


async def _transfer_session(
    side: str, prompts: list[int], repeats: int, devices: dict[str, str], cap: int, conn
) -> None:
    """Side A sends, side B receives, for each prompt: raw UCX, then whole pages through
    the TransferAgent (equal TP), then one decode rank's half of the heads through its
    RankTransfer jobs (TP 1 -> 2, packed on the GPU): what the servers run. Caches are
    sized once, for the longest prompt."""
    from kvcore.transfer.ucx import UcxTransport

    device = devices[side]
    transport = UcxTransport()
    await transport.start()
    conn.send(transport.local_info())
    peer = "B" if side == "A" else "A"
    info = await asyncio.to_thread(conn.recv)
    await transport.connect(peer, info)
    runs = _transfer_runs(side, max(prompts), torch.device(device), transport, peer, info, cap)
    raw = torch.ones(raw_bytes_of(max(prompts)), dtype=torch.uint8, device=device)
    report = []
    for n in prompts:
        results = {"raw": await _raw_times(side, transport, peer, raw[: raw_bytes_of(n)], repeats, n, cap)}
        for i in range(repeats + 1):
            for kind, run in runs.items():
                seconds, moved = await run(f"{kind}-{n}-{i}", n, conn)
                results.setdefault(kind, []).append(seconds)
                results[f"{kind}_bytes"] = [moved]
        if side == "A" and device != "cpu":
            results["peer_copy"] = _peer_copy_seconds(raw[: raw_bytes_of(n)], devices["B"], repeats)
        report.append(results)
    if side == "A":
        conn.send(report)
    await transport.close()


async def _raw_times(  # noqa: PLR0913
    side: str, transport, peer: str, buffer: torch.Tensor, repeats: int, n: int, cap: int
) -> list[float]:
    """Raw UCX: ``buffer`` in back-to-back messages of at most the transfer's cap, then an
    ack; seconds per repeat (side A)."""
    pieces = buffer.split(cap)
    ack, times = torch.zeros(8, dtype=torch.uint8), []
    for i in range(repeats + 1):
        tags = [make_tag(f"raw-{n}-{i}", 0, c) for c in range(len(pieces))]
        ack_tag = make_tag(f"raw-{n}-{i}", 1, 0)
        if side == "A":
            start = time.perf_counter()
            for piece, tag in zip(pieces, tags, strict=True):
                await transport.send(peer, piece, tag, 60.0)
            await transport.recv(ack, ack_tag, 60.0)
            times.append(time.perf_counter() - start)
        else:
            for piece, tag in zip(pieces, tags, strict=True):
                await transport.recv(piece, tag, 60.0)
            await transport.send(peer, ack, ack_tag, 60.0)
    return times


def _transfer_runs(  # noqa: PLR0913
    side: str, num_tokens: int, dev: torch.device, transport, peer: str, info, cap: int
) -> dict:
    """kind -> ``run(request_id, prompt tokens, conn) -> (seconds, bytes)`` for this side;
    caches hold ``num_tokens``."""
    from kvcore import KVCacheManager, KVPools
    from kvcore.transfer import HeadRoute, PeerRank, RankTransfer, TransferAgent

    def cache_of(heads: int):
        pools = KVPools.allocate(cache(num_tokens, heads), dev)
        return KVCacheManager(cache(num_tokens, heads), pools), pools

    whole_manager, whole_pools = cache_of(8)
    whole = TransferAgent(whole_manager, whole_pools, 4096, transport, max_message_bytes=cap)
    whole.pair(peer, [PeerRank(peer, info)])
    sliced_manager, sliced_pools = whole_manager, whole_pools
    if side == "B":
        sliced_manager, sliced_pools = cache_of(4)
    sliced = RankTransfer(sliced_pools, list(sliced_manager.groups), transport, cap)
    route = {g: HeadRoute(0, 1, slice(4, 8), slice(0, 4), False) for g in ("target", "draft")}
    if side == "A":
        return {
            "whole": lambda rid, n, conn: _send_whole(whole, rid, n, peer, conn),
            "sliced": lambda rid, n, conn: _send_sliced(sliced, sliced_manager, rid, n, peer, route, conn),
        }
    return {
        "whole": lambda rid, n, conn: _receive_whole(whole, rid, n, conn),
        "sliced": lambda rid, n, conn: _receive_sliced(sliced, sliced_manager, rid, n, peer, route, conn),
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


def _peer_copy_seconds(src: torch.Tensor, device: str, repeats: int) -> list[float]:
    """torch device-to-device copy of ``src`` onto ``device`` (the receiver's GPU)."""
    dst = torch.empty_like(src, device=device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst.device)
        times.append(time.perf_counter() - start)
    return times[1:]


def devices_for(toy_shapes: bool) -> dict[str, str]:
    """Side -> device: the CPU (--toy), GPU 0 -> GPU 1 (two GPUs or more), else cuda:0 twice."""
    if toy_shapes:
        return {"A": "cpu", "B": "cpu"}
    if torch.cuda.device_count() >= 2:
        return {"A": "cuda:0", "B": "cuda:1"}
    if torch.cuda.device_count() == 1:
        return {"A": "cuda:0", "B": "cuda:0"}
    raise SystemExit("tp_transfer: no CUDA device; use --toy for the CPU")


def run_prompts(
    toy_shapes: bool, prompts: list[int], repeats: int, cap: int = MAX_MESSAGE_BYTES
) -> list[dict]:
    """Both sides in spawned processes, every prompt in one run; per prompt, its figures."""
    ctx = mp.get_context("spawn")
    pipes = {s: ctx.Pipe() for s in "AB"}
    devices = devices_for(toy_shapes)
    procs = {
        s: ctx.Process(
            target=_transfer_side, args=(s, prompts, repeats, devices, cap, pipes[s][1]), daemon=True
        )
        for s in "AB"
    }
    for p in procs.values():
        p.start()
    a, b = pipes["A"][0], pipes["B"][0]
    address_a, address_b = a.recv(), b.recv()
    a.send(address_b)
    b.send(address_a)
    for _ in range(len(prompts) * 2 * (repeats + 1)):  # reservation rows, B -> A
        a.send(b.recv())
    got = a.recv()
    for p in procs.values():
        p.join(timeout=30)
    return [_figures(n, r, devices, cap) for n, r in zip(prompts, got, strict=True)]


def _figures(num_tokens: int, got: dict, devices: dict[str, str], cap: int) -> dict:
    rate = lambda n, ts: n / statistics.median(ts[1:] if len(ts) > 1 else ts) / 1e9  # noqa: E731
    raw = raw_bytes_of(num_tokens)
    out = {
        "prompt_tokens": num_tokens,
        "devices": f"{devices['A']} -> {devices['B']}",
        "cap_bytes": cap,
        "raw_ucx_bytes": raw,
        "raw_ucx_GBps": rate(raw, got["raw"]),
        "whole_pages_GBps": rate(got["whole_bytes"][0], got["whole"]),
        "whole_pages_bytes": got["whole_bytes"][0],
        "sliced_heads_GBps": rate(got["sliced_bytes"][0], got["sliced"]),
        "sliced_heads_bytes": got["sliced_bytes"][0],
    }
    if got.get("peer_copy"):
        out["device_copy_GBps"] = raw / statistics.median(got["peer_copy"]) / 1e9
    return out


def run_transfer(toy_shapes: bool, num_tokens: int, repeats: int) -> dict:
    """One prompt (bench/tp.py's ``transfer``): its figures."""
    return run_prompts(toy_shapes, [num_tokens], repeats)[0]


def markdown(rows: list[dict]) -> str:
    """The figures as a short markdown table: GB/s and % of raw UCX."""
    pct = lambda r, k: f"{100 * r[k] / r['raw_ucx_GBps']:.0f} %"  # noqa: E731
    lines = [
        f"{rows[0]['devices']}, messages of at most {rows[0]['cap_bytes'] >> 20} MiB",
        "",
        "| prompt | raw UCX GB/s | copy_ GB/s | whole pages GB/s | of raw | head-sliced GB/s | of raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        copy = f"{r['device_copy_GBps']:.1f}" if "device_copy_GBps" in r else "-"
        lines.append(
            f"| {r['prompt_tokens']} | {r['raw_ucx_GBps']:.1f} | {copy} | {r['whole_pages_GBps']:.1f} | "
            f"{pct(r, 'whole_pages_GBps')} | {r['sliced_heads_GBps']:.1f} | {pct(r, 'sliced_heads_GBps')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--prompts",
        default=None,
        help="prompt lengths in tokens, comma separated (default: 4096,16384,32768; --toy: 256,1024)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per prompt after a warm-up (default: 3)"
    )
    p.add_argument("--toy", action="store_true", help="both processes on the CPU (shared memory)")
    p.add_argument(
        "--cap-mib",
        type=int,
        default=MAX_MESSAGE_BYTES >> 20,
        help="the cap of one message, MiB (default: 64)",
    )
    a = p.parse_args(argv)
    try:
        prompts = [int(t) for t in (a.prompts or (TOY_PROMPTS if a.toy else PROMPTS)).split(",")]
    except ValueError:
        p.error(f"--prompts: expected token counts like 4096,16384, got {a.prompts!r}")
    if min(prompts) < PAGE or a.repeats < 1 or a.cap_mib < 2:
        p.error(f"--prompts must be >= {PAGE} tokens, --repeats >= 1, --cap-mib >= 2 (one target page)")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # traffic stays on this host (cuda_ipc is no net device)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    print(markdown(run_prompts(a.toy, prompts, a.repeats, a.cap_mib << 20)), flush=True)


if __name__ == "__main__":
    main()
