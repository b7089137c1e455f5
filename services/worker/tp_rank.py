"""Ranks 1..n-1 of a tensor-parallel worker: one process each, started by rank 0.

A rank loads its shards of the target and drafter and pools of its own KV heads, then
does two things at once:

- a thread follows rank 0's forwards (services/engine/lockstep.py);
- the event loop runs rank 0's transfer jobs and pairing tests over the control channel
  with the rank's own transport (:class:`kvcore.transfer.RankTransfer`).

It serves no gRPC and decides nothing; it exits with rank 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from kvcore.transfer import RankTransfer, yield_while
from services.common.log_setup import configure_logging
from services.engine.engine import Engine
from services.engine.lockstep import Following, follow
from services.engine.parallel import TensorParallel, backend_for, init_tensor_parallel
from services.worker.rank_info import engine_rank_info
from services.worker.tp_check import rank_instance_id
from services.worker.tp_control import encode_bytes, rank_handlers, serve_rank
from services.worker.worker_config import WorkerConfig, served_engine


def run_rank(config: WorkerConfig, rank: int, dist_address: str, control_port: int) -> None:
    """Process entry of rank ``rank`` of the worker ``config`` describes."""
    configure_logging(config.log_level, rank_instance_id(config.instance_id, rank), config.log_format)
    device = config.engine.device
    tp = init_tensor_parallel(config.engine.tp_size, rank, dist_address, backend_for(device), device)
    engine = Engine(served_engine(config.engine))
    following = Following()
    threading.Thread(target=_follow, args=(engine, tp, following), daemon=True).start()
    yield_while(lambda: following.replaying)  # transfers give the GIL up while a forward runs
    asyncio.run(_serve(config, rank, engine, control_port))


def _follow(engine: Engine, tp: TensorParallel, following: Following) -> None:
    try:
        follow(engine.runner, tp, following)
    except Exception as e:  # rank 0 gone mid-collective, or a broken forward: no way on
        print(f"tensor-parallel rank {tp.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)


async def _serve(config: WorkerConfig, rank: int, engine: Engine, control_port: int) -> None:
    transfer = RankTransfer(engine.kv_pools, list(engine.manager.groups))
    if config.moves_pages:
        await transfer.start()
    endpoint = transfer.endpoint() if config.moves_pages else None
    info = engine_rank_info(engine, config.role, rank_instance_id(config.instance_id, rank), endpoint)
    hello = {"rank": rank, "rank_info": encode_bytes(info.SerializeToString())}
    await serve_rank(control_port, hello, rank_handlers(transfer))
