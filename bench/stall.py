"""A decode worker stalled under load: many streams (a share cancelled at random) against a
router, one prefill and two decode workers; one decode worker SIGSTOPped in the middle of
the run for a while, then resumed.

Reports completed / failed (by status) / cancelled streams, the latency of completed ones
(p50, p99), when Health dropped the stopped worker's pair and took it back, the longest
stretch with no stream completing, and the pages requests hold on each worker at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from bench.soak import TEXTS, held_pages
from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"


@dataclass
class Outcomes:
    latencies: list[float] = field(default_factory=list)  # of completed streams, seconds
    done_at: list[float] = field(default_factory=list)  # when each completed, since the start
    cancelled: int = 0
    failed: Counter = field(default_factory=Counter)  # status name -> count


async def one_stream(stub, rng: random.Random, out: Outcomes, cancel_rate: float, t0: float) -> None:
    request = cpb.GenerateRequest(
        text=rng.choice(TEXTS) * rng.randint(1, 8),
        sampling=cpb.SamplingParams(max_tokens=rng.randint(8, 64), seed=rng.randrange(1 << 30)),
    )
    cancel_after = rng.randint(0, 20) if rng.random() < cancel_rate else None
    start, chunks = time.monotonic(), 0
    call = stub.Generate(request, timeout=120)
    try:
        async for message in call:
            chunks += message.HasField("chunk")
            if message.HasField("error"):
                out.failed["error message"] += 1
                return
            if cancel_after is not None and chunks > cancel_after:
                call.cancel()
                out.cancelled += 1
                return
    except grpc.aio.AioRpcError as e:
        out.failed[e.code().name] += 1
        return
    out.latencies.append(time.monotonic() - start)
    out.done_at.append(time.monotonic() - t0)


async def streams(address: str, n: int, seconds: float, cancel_rate: float, t0: float) -> Outcomes:
    out, deadline = Outcomes(), t0 + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cpb_grpc.TandemStub(channel)

        async def loop(i: int) -> None:
            rng = random.Random(1000 + i)
            while time.monotonic() < deadline:
                await one_stream(stub, rng, out, cancel_rate, t0)

        await asyncio.gather(*(loop(i) for i in range(n)))
    return out


async def ready_pairs(address: str, t0: float, stop: asyncio.Event) -> list[tuple[float, int]]:
    """(seconds since the start, ready pairs) at every change, polled every 0.1 s."""
    changes: list[tuple[float, int]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cpb_grpc.TandemStub(channel)
        while not stop.is_set():
            n = (await stub.Health(cpb.HealthRequest(), timeout=5)).num_ready_pairs
            if not changes or changes[-1][1] != n:
                changes.append((time.monotonic() - t0, n))
            await asyncio.sleep(0.1)
    return changes


async def stall(cluster: LocalCluster, args) -> tuple[Outcomes, list, float, float]:
    t0, stop = time.monotonic(), asyncio.Event()
    address = cluster.router_address
    load = asyncio.ensure_future(streams(address, args.streams, args.seconds, args.cancel_rate, t0))
    health = asyncio.ensure_future(ready_pairs(address, t0, stop))
    stalled = next(p for p in cluster.processes if p.name.startswith("decode"))
    await asyncio.sleep((args.seconds - args.stop_s) / 2)
    os.kill(stalled.popen.pid, signal.SIGSTOP)
    stopped_at = time.monotonic() - t0
    await asyncio.sleep(args.stop_s)
    os.kill(stalled.popen.pid, signal.SIGCONT)
    resumed_at = time.monotonic() - t0
    out = await load
    stop.set()
    return out, await health, stopped_at, resumed_at


def longest_gap(done_at: list[float], start: float, end: float) -> float:
    times = [start, *sorted(t for t in done_at if start <= t <= end), end]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--stop-s", type=float, default=30, help="how long the decode worker stays stopped")
    parser.add_argument("--cancel-rate", type=float, default=0.3)
    args = parser.parse_args()
    cluster = LocalCluster(
        ["--model", MODEL, "--drafter", DRAFTER, "-k", "4"],
        ["--model", MODEL, "-k", "4"],
        ["prefill", "decode", "decode"],
    )
    cluster.start()
    try:
        out, changes, stopped_at, resumed_at = asyncio.run(stall(cluster, args))
        deadline, held = time.monotonic() + 70, held_pages(cluster)  # leases are 60 s
        while any(held.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            held = held_pages(cluster)
    finally:
        cluster.stop()
    lat = sorted(out.latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"{args.streams} streams, {args.seconds:.0f} s, {args.cancel_rate:.0%} cancelled at random;")
    print(f"decode worker stopped at {stopped_at:.1f} s, resumed at {resumed_at:.1f} s")
    failed = sum(out.failed.values())
    print(f"completed {len(lat)}, cancelled {out.cancelled}, failed {failed} {dict(out.failed)}")
    print(f"latency of completed: p50 {statistics.median(lat):.2f} s, p99 {p99:.2f} s, max {lat[-1]:.2f} s")
    print("ready pairs (t s, n):", ", ".join(f"{t:.1f}: {n}" for t, n in changes))
    gap = longest_gap(out.done_at, stopped_at, resumed_at + 5)
    print(f"longest stretch with no stream completing, stop to resume + 5 s: {gap:.2f} s")
    print("pages held by requests at the end:", held)


if __name__ == "__main__":
    main()
