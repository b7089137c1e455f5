"""A tensor-parallel worker as rank 0 sees it: its other ranks, and the group's transfers.

``RankGroup.spawn`` starts ranks 1..n-1 as processes (``services.common.tp_rank``) and joins
the torch.distributed group with them (gloo on CPU, NCCL on GPU); ``join`` waits for
their hellos and checks their RankInfos against rank 0's. From then on rank 0 alone
serves gRPC, schedules and samples; the ranks follow its forwards (services/engine/
lockstep.py) and do their share of every transfer on its word.

``GroupTransferAgent`` is the transfer agent the servers use, for any TP size (TP 1 is a
group of one). A request's pages move along head routes
(:mod:`kvcore.transfer.head_routes`): prefill rank p sends decode rank d the heads they
share, each rank from and into its own pools; the aux state goes rank 0 to rank 0 first,
and decode rank 0 acknowledges once every decode rank holds its heads.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import threading
from typing import Any

import torch

from kvcore.manager import TransferPages
from kvcore.transfer.head_routes import HeadRoute, head_routes, routes_between
from kvcore.transfer.kv_transfer import AuxState, KVTransferAgent, TransferUsage, with_held
from kvcore.transfer.ucx import TransferError, UcxEndpointInfo
from proto.tandem.v1 import rank_info_pb2 as rpb
from services.common.tp_check import check_group
from services.common.tp_control import (
    RankError,
    RankLink,
    accept_ranks,
    decode_bytes,
    listen_socket,
)
from services.common.tp_ops import (
    RankOps,
    address_of,
    merge_usage,
    pages_to_json,
    routes_to_json,
)
from services.engine.parallel import init_tensor_parallel

JOIN_TIMEOUT_S = 300.0


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class RankGroup:
    """Rank 0's handle on ranks 1..n-1 of its worker."""

    def __init__(self, size: int, processes: list, sock, joined: threading.Event) -> None:
        self.size, self.processes, self._sock, self._joined = size, processes, sock, joined
        self.links: dict[int, RankLink] = {}
        self.closing = False

    @classmethod
    def spawn(cls, config) -> RankGroup:
        """Start ranks 1.. of ``config`` (a WorkerConfig) and join torch.distributed with
        them; blocks until every rank has joined."""
        from services.common.tp_rank import run_rank

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

    async def call(self, rank: int, op: str, **args: Any) -> dict[str, Any]:
        return await self.links[rank].call(op, **args)

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


class GroupTransferAgent:
    """The transfer agent of a whole TP group, with KVTransferAgent's interface for the
    servers. ``peer_ranks`` (every paired peer's RankInfos, rank 0 first) is filled at
    pairing; ``local_ranks`` gives this group's."""

    def __init__(self, agent: KVTransferAgent, group: RankGroup | None) -> None:
        self.agent, self.group = agent, group
        self.manager = agent.manager
        self.ops = RankOps(agent)
        self.tp_size = group.size if group is not None else 1
        self.peer_ranks: dict[str, list[rpb.RankInfo]] = {}
        self.total_heads: dict[str, int] = {}  # per layer group: KV heads of the whole layer

    # ------------------------------------------------------------------ rank 0's agent

    async def start(self) -> None:
        await self.agent.start()

    async def close(self) -> None:
        await self.agent.close()

    def endpoint(self) -> UcxEndpointInfo:
        return self.agent.endpoint()

    async def connect(self, peer_id: str, info: UcxEndpointInfo) -> None:
        await self.agent.connect(peer_id, info)

    async def disconnect(self, peer_id: str) -> None:
        """Forget a peer worker: rank 0's endpoint to its rank 0, and every other rank
        pair's."""
        await self.agent.disconnect(peer_id)
        ranks = self.peer_ranks.pop(peer_id, [])
        await asyncio.gather(
            *(
                self._on(r, "disconnect", peer=info.instance_id)
                for info in ranks
                for r in range(self.tp_size)
                if (r, info.tp_rank) != (0, 0)
            ),
            return_exceptions=True,
        )

    async def ping(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        await self.agent.ping(peer_id, nonce, timeout_s)

    async def pong(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        await self.agent.pong(peer_id, nonce, timeout_s)

    async def send_message(self, peer_id: str, nonce: str, chunk: int, data: bytes, timeout_s: float) -> None:
        await self.agent.send_message(peer_id, nonce, chunk, data, timeout_s)

    async def receive_message(self, nonce: str, chunk: int, timeout_s: float) -> bytes:
        return await self.agent.receive_message(nonce, chunk, timeout_s)

    # ------------------------------------------------------------------ transfers

    async def send_request(
        self,
        request_id: str,
        num_tokens: int,
        peer_id: str,
        aux: AuxState,
        timeout_s: float,
        dest: dict[str, list[int]] | None = None,
        held: dict[str, int] | None = None,
    ) -> TransferUsage:
        """Every prefill rank sends every decode rank the heads they share (none of the
        ``held`` leading pages); then rank 0 waits for decode rank 0's acknowledgement."""
        peer = self._peer(peer_id)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        routes = self._routes(self.tp_size, len(peer), pages)
        await self.agent.send_aux(request_id, peer_id, aux, timeout_s)
        jobs = []
        for src in range(self.tp_size):
            for dst, info in enumerate(peer):
                mine = _between(routes, src, dst)
                if mine:
                    jobs.append(
                        self._on(
                            src,
                            "send",
                            request_id=request_id,
                            pages=pages_to_json(pages),
                            peer=info.instance_id,
                            routes=routes_to_json(mine),
                            timeout_s=timeout_s,
                            dest=dest,
                        )
                    )
        usage = await self._all(jobs)
        await self.agent.wait_ack(request_id, num_tokens, timeout_s)
        return _counted(usage, pages, held)

    async def receive_request(
        self, request_id: str, num_tokens: int, timeout_s: float
    ) -> tuple[AuxState, TransferUsage]:
        """The aux state names the sender, hence its TP size; every decode rank then
        gathers its heads from the prefill ranks that hold them."""
        aux = await self.agent.receive_aux(request_id, num_tokens, timeout_s)
        peer = self._peer(aux.sender_id)
        held = self.manager.held_pages(request_id)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        routes = self._routes(len(peer), self.tp_size, pages)
        stay = {
            g: [p for p in self.manager.block_table(request_id, g) if p >= 0]
            for g in self.manager.groups
            if g not in pages
        }  # the separate layout's draft
        jobs = []
        for dst in range(self.tp_size):
            sources = [routes_to_json(m) for src in range(len(peer)) if (m := _between(routes, src, dst))]
            jobs.append(
                self._on(
                    dst,
                    "recv",
                    request_id=request_id,
                    pages=pages_to_json(pages),
                    sources=sources,
                    timeout_s=timeout_s,
                    zero=stay if dst > 0 else None,
                )
            )
        usage = await self._all(jobs)
        await self.agent.acknowledge(request_id, aux.sender_id, num_tokens, timeout_s)
        return aux, _counted(usage, pages, held)

    # ------------------------------------------------------------------ pairing

    async def test_links(self, peer: list[rpb.RankInfo], sender: bool, nonce: str) -> None:
        """The pairing test between every rank pair that will exchange pages, but the
        rank-0 pair (tested already): the sending side pings, the receiving side echoes."""
        src_tp, dst_tp = (self.tp_size, len(peer)) if sender else (len(peer), self.tp_size)
        routes = self._routes(src_tp, dst_tp, self.total_heads)
        pairs = sorted({(r.src_rank, r.dst_rank) for rs in routes.values() for r in rs} - {(0, 0)})
        jobs = []
        for src, dst in pairs:
            mine, theirs = (src, peer[dst]) if sender else (dst, peer[src])
            jobs.append(
                self._on(
                    mine,
                    "ping" if sender else "pong",
                    peer=theirs.instance_id,
                    address=address_of(theirs),
                    nonce=f"{nonce}/{src}->{dst}",
                )
            )
        await self._all(jobs)

    # ------------------------------------------------------------------ internals

    def _peer(self, peer_id: str) -> list[rpb.RankInfo]:
        peer = self.peer_ranks.get(peer_id)
        if peer is None:
            raise TransferError(f"peer {peer_id!r}: not paired (its ranks are unknown)")
        return peer

    def _routes(self, src_tp: int, dst_tp: int, groups) -> dict[str, list[HeadRoute]]:
        return {g: head_routes(self.total_heads[g], src_tp, dst_tp) for g in groups}

    async def _on(self, rank: int, op: str, **args: Any) -> dict[str, Any]:
        if rank == 0:
            return await getattr(self.ops, op)(**args)
        return await self.group.call(rank, op, **args)

    async def _all(self, jobs: list) -> TransferUsage:
        """Run every rank's job; the first failure cancels the rest and raises
        TransferError."""
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            replies = await asyncio.gather(*tasks)
        except (TransferError, RankError) as e:
            for t in tasks:
                t.cancel()
            raise TransferError(str(e)) from e
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        total = TransferUsage()
        for reply in replies:
            if "bytes" in reply:
                merge_usage(total, reply)
        return total


def _counted(
    usage: TransferUsage, pages: dict[str, TransferPages], held: dict[str, int] | None
) -> TransferUsage:
    """``usage`` with each group's pages (once, not once per rank) and held pages."""
    usage.pages = {g: len(p.page_ids) for g, p in pages.items() if g in usage.bytes}
    return with_held(usage, held)


def _between(routes: dict[str, list[HeadRoute]], src: int, dst: int) -> dict[str, HeadRoute]:
    return {g: r for g, rs in routes.items() if (r := routes_between(rs, src, dst))}
