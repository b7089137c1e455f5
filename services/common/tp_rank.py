"""Ranks 1..n-1 of a tensor-parallel worker: one process each, started by rank 0.

A rank loads its shards of the target and drafter and pools of its own KV heads, then
does two things at once: a thread follows rank 0's forwards (services/engine/lockstep.py),
and the event loop runs rank 0's transfer and pairing commands over the control channel
with the rank's own UCX worker (:class:`services.common.tp_ops.RankOps`). It serves no
gRPC and decides nothing; it exits with rank 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from services.common.tp_control import encode_bytes, serve_rank


def run_rank(config, rank: int, dist_address: str, control_port: int) -> None:
    """Process entry: ``config`` is the worker's WorkerConfig."""
    from services.common.tp_group import backend_for
    from services.engine.engine import Engine
    from services.engine.parallel import init_tensor_parallel

    tp = init_tensor_parallel(
        config.engine.tp_size, rank, dist_address, backend_for(config.engine.device), config.engine.device
    )
    engine = Engine(config.engine)
    threading.Thread(target=_follow, args=(engine, tp), daemon=True).start()
    asyncio.run(_serve(config, rank, engine, control_port))


def _follow(engine, tp) -> None:
    from services.engine.lockstep import follow

    try:
        follow(engine.runner, tp)
    except Exception as e:  # rank 0 gone mid-collective, or a broken forward: no way on
        print(f"tensor-parallel rank {tp.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)


async def _serve(config, rank: int, engine, control_port: int) -> None:
    from kvcore.transfer.kv_transfer import KVTransferAgent
    from services.common.tp_check import rank_instance_id
    from services.common.tp_ops import RankOps
    from services.common.worker import engine_rank_info

    agent = KVTransferAgent(engine.manager, hidden_size=engine.target.config.hidden_size)
    moves_pages = config.role != "both"
    if moves_pages:
        await agent.start()
    info = engine_rank_info(
        engine,
        config.role,
        rank_instance_id(config.instance_id, rank),
        agent.endpoint().worker_address if moves_pages else b"",
    )
    hello = {"rank": rank, "rank_info": encode_bytes(info.SerializeToString())}
    await serve_rank(control_port, hello, RankOps(agent).handlers())
