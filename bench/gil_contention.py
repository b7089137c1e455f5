"""How an event loop waiting on a transfer slows a thread that gives the GIL up often.

    python -m bench.gil_contention [--ops 100000] [--size 40]

A worker's engine thread releases the GIL at every kernel launch and GPU wait; its event
loop, while a transfer is in flight, checks the transfer every turn. This measures the
first beside three kinds of the second (``kvcore.transfer.pacing``):

- ``alone``: the thread with no loop beside it;
- ``poll_1ms``: the loop sleeps 1 ms a turn (a transfer past its spin);
- ``spin``: the loop turns back to back (``asyncio.sleep(0)``), as transfers did;
- ``paced``: each turn first gives the GIL up for ``pacing.YIELD_S`` (``next_turn`` with the
  GIL wanted), as transfers do while the engine steps.

The thread runs ``--ops`` matmuls of two [size, size] float64 arrays (numpy releases the
GIL inside each: a few microseconds at the default size, like a launch). Prints the
thread's wall time and the loop's turns per ms for each, then one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import numpy as np

from kvcore.transfer import pacing

MODES = ("alone", "poll_1ms", "spin", "paced")


def thread_seconds(ops: int, size: int, mode: str) -> tuple[float, float]:
    """(the thread's wall seconds, the loop's turns per ms) with the loop in ``mode``."""
    a = np.random.default_rng(0).random((size, size))
    done, wall, turns = threading.Event(), [0.0], [0]

    def work() -> None:
        start = time.perf_counter()
        for _ in range(ops):
            a @ a
        wall[0] = time.perf_counter() - start
        done.set()

    async def loop_beside() -> None:
        pacing.yield_while(lambda: not done.is_set() if mode == "paced" else False)
        thread = threading.Thread(target=work)
        thread.start()
        while not done.is_set():
            turns[0] += 1
            await (asyncio.sleep(1e-3) if mode == "poll_1ms" else pacing.next_turn())
        pacing.yield_while(None)
        thread.join()

    if mode == "alone":
        work()
    else:
        asyncio.run(loop_beside())
    return wall[0], turns[0] / (wall[0] * 1e3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=100_000, help="matmuls the thread runs")
    p.add_argument("--size", type=int, default=40, help="side of the square matrices")
    args = p.parse_args(argv)
    results = {}
    print("| loop beside the thread | thread wall ms | x alone | loop turns per ms |\n|---|---|---|---|")
    for mode in MODES:
        seconds, per_ms = thread_seconds(args.ops, args.size, mode)
        results[mode] = {"thread_ms": round(seconds * 1e3, 1), "turns_per_ms": round(per_ms, 1)}
        ratio = seconds * 1e3 / results["alone"]["thread_ms"]
        print(f"| {mode} | {seconds * 1e3:,.1f} | {ratio:.2f} | {per_ms:.1f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
