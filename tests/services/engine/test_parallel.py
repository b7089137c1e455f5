"""services/engine/parallel.py: what a tensor-parallel group agrees on (two gloo processes)."""

from __future__ import annotations

import multiprocessing as mp

from services.engine.parallel import SINGLE, init_tensor_parallel
from tests.services.engine.test_tp import TIMEOUT_S, free_address

BUDGETS = [7 << 30, 5 << 30]  # what each rank's own device would give its KV cache


def _rank(rank: int, address: str, queue) -> None:
    tp = init_tensor_parallel(2, rank, address, "gloo")
    queue.put((rank, tp.min_over_ranks(BUDGETS[rank])))


def test_every_rank_takes_the_smallest_kv_budget():
    ctx = mp.get_context("spawn")
    queue, address = ctx.Queue(), free_address()
    procs = [ctx.Process(target=_rank, args=(r, address, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=TIMEOUT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            p.kill()
    assert got == {0: 5 << 30, 1: 5 << 30}
    assert SINGLE.min_over_ranks(3) == 3  # alone: its own
