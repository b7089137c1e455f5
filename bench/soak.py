"""Soak: many concurrent streams with random cancellations against a local cluster.

Reports completions, cancellations and errors (anything else), the pages still held by
requests at the end (must be 0), and each process's resident memory over time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from bench.progress import clock
from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc

TEXTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self",
    "for i in range(10):\n    ",
    "# Copyright (c) Python Software Foundation\n",
    "return {",
]


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int = 0


async def one_stream(stub, rng: random.Random, tally: Tally, cancel_rate: float) -> None:
    text = rng.choice(TEXTS) * rng.randint(1, 8)  # under 400 tokens
    request = cpb.GenerateRequest(
        text=text,
        sampling=cpb.SamplingParams(
            max_tokens=rng.randint(8, 64), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30)
        ),
    )
    call = stub.Generate(request, timeout=120)
    cancel_after = rng.randint(0, 20) if rng.random() < cancel_rate else None
    try:
        chunks = 0
        async for message in call:
            if message.HasField("chunk"):
                chunks += 1
                tally.tokens += len(message.chunk.token_ids)
                if cancel_after is not None and chunks > cancel_after:
                    call.cancel()
                    tally.cancelled += 1
                    return
            elif message.HasField("error"):
                tally.errors.append(message.error.message)
        tally.completed += 1
    except asyncio.CancelledError:
        tally.cancelled += 1
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            tally.cancelled += 1
        else:
            tally.errors.append(f"{e.code().name}: {e.details()}")


async def client(address: str, streams: int, seconds: float, cancel_rate: float, tally: Tally) -> Tally:
    """``streams`` concurrent request loops for ``seconds`` (stream i seeded i); counts into
    ``tally``, so a caller can watch it grow."""
    seed, deadline = 1, time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cpb_grpc.TandemStub(channel)

        async def loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_stream(stub, rng, tally, cancel_rate)

        await asyncio.gather(*(loop(i) for i in range(streams)))
    return tally


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def held_pages(cluster: LocalCluster) -> dict[str, int]:
    out = {}
    for p in cluster.processes[1:]:
        with grpc.insecure_channel(p.grpc) as channel:
            stub = (wpb_grpc.DecodeWorkerStub if p.name.startswith("decode") else wpb_grpc.PrefillWorkerStub)(
                channel
            )
            stats = stub.Stats(wpb.StatsRequest(), timeout=10)
        out[p.name] = sum(g.num_pages_used - g.num_pages_cached for g in stats.groups)
    return out


async def soak(
    cluster: LocalCluster, streams: int, seconds: float, cancel_rate: float, sample_s: float
) -> tuple[Tally, list[tuple[float, dict[str, float]]]]:
    samples, start, next_sample = [], time.monotonic(), 0.0
    tally = Tally()
    task = asyncio.ensure_future(client(cluster.router_address, streams, seconds, cancel_rate, tally))
    bar = clock(seconds, f"soak, {streams} streams")
    while not task.done():
        elapsed = time.monotonic() - start
        if elapsed >= next_sample:
            samples.append((elapsed, {p.name: rss_mib(p.popen.pid) for p in cluster.processes}))
            next_sample += sample_s
        bar.update_to(elapsed)
        bar.set_postfix(
            done=tally.completed, cancelled=tally.cancelled, errors=len(tally.errors), refresh=False
        )
        await asyncio.wait([task], timeout=min(1.0, sample_s))
    bar.close()
    return task.result(), samples


def run(
    cluster: LocalCluster, streams: int, seconds: float, cancel_rate: float = 0.2, sample_s: float = 10.0
) -> dict:
    tally, samples = asyncio.run(soak(cluster, streams, seconds, cancel_rate, sample_s))
    deadline = time.monotonic() + 10
    held = held_pages(cluster)
    while any(held.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        held = held_pages(cluster)
    return {"tally": tally, "samples": samples, "held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--cancel-rate", type=float, default=0.2)
    parser.add_argument("--sample", type=float, default=30, help="seconds between RSS samples")
    args = parser.parse_args()
    model, drafter = "models/tiny-target", "models/tiny-drafter"
    cluster = LocalCluster(
        ["--model", model, "--drafter", drafter, "-k", "4"],
        ["--model", model, "-k", "4"],
        ["prefill", "decode"],
    )
    cluster.start()
    try:
        result = run(cluster, args.streams, args.seconds, args.cancel_rate, args.sample)
    finally:
        cluster.stop()
    t = result["tally"]
    print(
        f"{args.streams} streams, {args.seconds:.0f} s: {t.completed} completed, {t.cancelled} "
        f"cancelled, {len(t.errors)} errors, {t.tokens} tokens ({t.tokens / args.seconds:.1f}/s)"
    )
    for e in t.errors[:10]:
        print("  error:", e)
    print("pages held by requests at the end:", result["held"])
    names = list(result["samples"][0][1])
    print("| t (s) | " + " | ".join(f"{n} RSS (MiB)" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for t_s, rss in result["samples"]:
        print(f"| {t_s:.0f} | " + " | ".join(f"{rss[n]:.0f}" for n in names) + " |")


if __name__ == "__main__":
    main()
