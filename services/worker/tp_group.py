"""A tensor-parallel worker as rank 0 sees it: its other ranks, as processes and as links.

- ``RankGroup.spawn`` starts ranks 1..n-1 as processes (:func:`services.worker.tp_rank.run_rank`)
  and joins the torch.distributed group with them (gloo on CPU, NCCL on GPU);
- ``join`` waits for their hellos and checks their RankInfos against rank 0's;
- from then on rank 0 alone serves gRPC, schedules and samples; the ranks follow its
  forwards (services/engine/lockstep.py) and run their share of every transfer: the group
  is the :class:`kvcore.transfer.RankLinks` of rank 0's TransferAgent, which carries each
  job over the control channel (:mod:`services.worker.tp_control`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
from typing import Any

from kvcore.transfer import LinkTest, RecvJob, SendJob, TransferError, TransferUsage
from proto.tandem.v1 import rank_info_pb2 as rpb
from services.engine.parallel import backend_for, init_tensor_parallel
from services.worker.tp_check import check_group
from services.worker.tp_control import (
    RankError,
    RankLink,
    accept_ranks,
    decode_bytes,
    listen_socket,
    recv_to_json,
    send_to_json,
    test_to_json,
    usage_from_json,
)
from services.worker.tp_rank import run_rank
from services.worker.worker_config import WorkerConfig

JOIN_TIMEOUT_S = 300.0


class RankGroup:
    """Rank 0's handle on ranks 1..n-1 of its worker, and its RankLinks to them."""

    def __init__(self, size: int, processes: list, sock, joined: threading.Event) -> None:
        self.size, self.processes, self._sock, self._joined = size, processes, sock, joined
        self.links: dict[int, RankLink] = {}
        self.closing = False

    @classmethod
    def spawn(cls, config: WorkerConfig) -> RankGroup:
        """Start ranks 1.. of ``config`` and join torch.distributed with them; blocks until
        every rank has joined."""
        size = config.engine.tp_size
        sock = listen_socket()
        with listen_socket() as probe:  # a free port for torch.distributed's rendezvous
            dist_address = "{}:{}".format(*probe.getsockname())
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(target=run_rank, args=(config, r, dist_address, sock.getsockname()[1]), daemon=True)
            for r in range(1, size)
        ]
        for p in processes:
            p.start()
        joined = threading.Event()
        threading.Thread(target=_exit_if_one_dies, args=(processes, joined), daemon=True).start()
        init_tensor_parallel(size, 0, dist_address, backend_for(config.engine.device), config.engine.device)
        return cls(size, processes, sock, joined)

    async def join(self, rank0: rpb.RankInfo, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Wait for every rank's hello; refuse (RuntimeError) a group that does not agree."""
        self.links = await accept_ranks(self._sock, range(1, self.size), timeout_s, self._lost)
        self._joined.set()  # from here on a lost rank is noticed on its control connection
        mismatches = check_group(self.rank_infos(rank0))
        if mismatches:
            raise RuntimeError(
                "tensor-parallel ranks disagree: "
                + "; ".join(f"{m.field}: rank 0 {m.local}, rank {m.peer} ({m.reason})" for m in mismatches)
            )

    def rank_infos(self, rank0: rpb.RankInfo) -> list[rpb.RankInfo]:
        return [rank0] + [
            rpb.RankInfo.FromString(decode_bytes(self.links[r].hello["rank_info"]))
            for r in range(1, self.size)
        ]

    async def send(self, rank: int, job: SendJob) -> TransferUsage:
        return usage_from_json(await self._call(rank, "send", send_to_json(job)))

    async def recv(self, rank: int, job: RecvJob) -> TransferUsage:
        return usage_from_json(await self._call(rank, "recv", recv_to_json(job)))

    async def test(self, rank: int, job: LinkTest) -> None:
        await self._call(rank, "test", test_to_json(job))

    async def disconnect(self, rank: int, peer_id: str) -> None:
        await self._call(rank, "disconnect", {"peer": peer_id})

    async def _call(self, rank: int, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run ``op`` on ``rank``; a failed or lost rank is a TransferError."""
        try:
            return await self.links[rank].call(op, **args)
        except RankError as e:
            raise TransferError(str(e)) from e

    def close(self) -> None:
        self.closing = True
        for link in self.links.values():
            link.close()
        for p in self.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

    def _lost(self, rank: int) -> None:
        if not self.closing:  # the group cannot run a forward without it
            print(f"tensor-parallel rank {rank} is gone; the worker exits", file=sys.stderr, flush=True)
            os._exit(1)


def _exit_if_one_dies(processes: list, joined: threading.Event) -> None:
    """Until every rank has said hello: a rank process that exits (a bad configuration,
    no memory) ends the start instead of leaving rank 0 waiting for it."""
    while not joined.wait(0.5):
        for p in processes:
            if p.exitcode is not None:
                print(
                    f"tensor-parallel rank process exited with {p.exitcode} while starting; the worker exits",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
