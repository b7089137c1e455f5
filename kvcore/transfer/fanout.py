"""The rank fan-out: which rank of a worker moves which heads to which peer rank.

A request's pages move along head routes (:mod:`kvcore.transfer.head_routes`): prefill
rank p sends decode rank d the heads they share, each rank from and into its own pools.
:class:`Fanout` plans one job per rank (pair) and runs them all at once: rank 0's
in-process on its :class:`~kvcore.transfer.rank.RankTransfer`, ranks 1..'s through the
injected :class:`RankLinks`. A worker of TP 1 has no links: nothing leaves the process
but the transport's messages themselves.

Invariants:
- the first job that fails cancels the others and its error is raised;
- a cancelled fan-out cancels every job it started (links pass the cancel on);
- usage adds bytes over ranks and keeps the slowest rank's seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping
from typing import Protocol

from kvcore import TransferPages
from kvcore.transfer.head_routes import HeadRoute, head_routes, routes_between
from kvcore.transfer.jobs import LinkTest, PeerRank, RecvJob, SendJob, TransferKey, TransferUsage
from kvcore.transfer.rank import RankTransfer

Routes = dict[str, list[HeadRoute]]  # per group, every route between two TP groups


class RankLinks(Protocol):
    """How rank 0 reaches ranks 1..size-1 of its worker. Each call runs one job on that
    rank and raises TransferError when the rank fails it or is gone."""

    size: int  # the worker's TP size, rank 0 included

    async def send(self, rank: int, job: SendJob) -> TransferUsage: ...

    async def recv(self, rank: int, job: RecvJob) -> TransferUsage: ...

    async def test(self, rank: int, job: LinkTest) -> None: ...

    async def disconnect(self, rank: int, peer_id: str) -> None: ...


class NoLinks:
    """The links of a TP 1 worker: there are no other ranks."""

    size = 1

    async def send(self, rank: int, job: SendJob) -> TransferUsage:
        raise ValueError(f"rank: {rank} of a TP 1 worker")

    async def recv(self, rank: int, job: RecvJob) -> TransferUsage:
        raise ValueError(f"rank: {rank} of a TP 1 worker")

    async def test(self, rank: int, job: LinkTest) -> None:
        raise ValueError(f"rank: {rank} of a TP 1 worker")

    async def disconnect(self, rank: int, peer_id: str) -> None:
        raise ValueError(f"rank: {rank} of a TP 1 worker")


class Fanout:
    """Rank 0's view of its worker's ranks: itself in-process, the others by ``links``.

    ``total_heads``: per layer group, the KV heads of the whole layer (every rank's).
    """

    def __init__(self, rank0: RankTransfer, links: RankLinks, total_heads: Mapping[str, int]) -> None:
        self.rank0, self.links = rank0, links
        self.total_heads = dict(total_heads)

    @property
    def size(self) -> int:
        return self.links.size

    def routes(self, src_tp: int, dst_tp: int, groups: Iterable[str]) -> Routes:
        """Per group of ``groups``, every route from ``src_tp`` ranks to ``dst_tp``."""
        return {g: head_routes(self.total_heads[g], src_tp, dst_tp) for g in groups}

    async def send(
        self,
        key: TransferKey,
        pages: dict[str, TransferPages],
        peer: list[PeerRank],
        timeout_s: float,
        dest: dict[str, list[int]] | None,
    ) -> TransferUsage:
        """Every rank here sends every peer rank the heads they share."""
        routes = self.routes(self.size, len(peer), pages)
        jobs = []
        for src in range(self.size):
            for dst, info in enumerate(peer):
                mine = between(routes, src, dst)
                if mine:
                    job = SendJob(
                        key.request_id, info.instance_id, src, pages, mine, timeout_s, dest, key.tag
                    )
                    jobs.append(self.rank0.send(job) if src == 0 else self.links.send(src, job))
        return await run_all(jobs)

    async def recv(
        self, key: TransferKey, pages: dict[str, TransferPages], src_tp: int, timeout_s: float
    ) -> TransferUsage:
        """Every rank here gathers its heads from the ``src_tp`` peer ranks holding them."""
        routes = self.routes(src_tp, self.size, pages)
        jobs = []
        for dst in range(self.size):
            sources = {src: m for src in range(src_tp) if (m := between(routes, src, dst))}
            if sources:
                job = RecvJob(key.request_id, pages, sources, timeout_s, key.tag)
                jobs.append(self.rank0.recv(job) if dst == 0 else self.links.recv(dst, job))
        return await run_all(jobs)

    async def test_links(self, peer: list[PeerRank], lead: bool, nonce: str) -> None:
        """The pairing test between every rank pair that will exchange pages, but the
        rank-0 pair (tested already): the page sender (``lead``) pings, the receiver echoes."""
        src_tp, dst_tp = (self.size, len(peer)) if lead else (len(peer), self.size)
        routes = self.routes(src_tp, dst_tp, self.total_heads)
        pairs = sorted({(r.src_rank, r.dst_rank) for rs in routes.values() for r in rs} - {(0, 0)})
        jobs = []
        for src, dst in pairs:
            mine, theirs = (src, peer[dst]) if lead else (dst, peer[src])
            job = LinkTest(theirs, f"{nonce}/{src}->{dst}", lead)
            jobs.append(self.rank0.test(job) if mine == 0 else self.links.test(mine, job))
        await run_all(jobs)

    async def disconnect(self, peer: list[PeerRank]) -> None:
        """Forget every endpoint a rank here holds to a rank of ``peer``, but rank 0's to
        its rank 0 (the agent's own)."""
        jobs = [
            self.rank0.disconnect(p.instance_id) if r == 0 else self.links.disconnect(r, p.instance_id)
            for p_rank, p in enumerate(peer)
            for r in range(self.size)
            if (r, p_rank) != (0, 0)
        ]
        await asyncio.gather(*jobs, return_exceptions=True)


def between(routes: Routes, src: int, dst: int) -> dict[str, HeadRoute]:
    """Per group, the route from ``src`` to ``dst`` (groups they exchange nothing of left out)."""
    return {g: r for g, rs in routes.items() if (r := routes_between(rs, src, dst))}


async def run_all(jobs: list[Awaitable[TransferUsage | None]]) -> TransferUsage:
    """Run every job at once; their usage added up. The first failure cancels the rest
    and is raised as it is; a cancel of this call cancels them all."""
    tasks = [asyncio.ensure_future(j) for j in jobs]
    try:
        replies = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    total = TransferUsage()
    for reply in replies:
        if reply is not None:
            total.add(reply)
    return total
