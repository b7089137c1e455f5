"""What one rank of a TP worker does for a transfer or a pairing test, on rank 0's word.

Rank 0 runs these on itself directly and on ranks 1.. through the control channel
(:mod:`services.common.tp_control`), so every argument is plain JSON: page lists as
``{group: [first_page, [page ids]]}``, routes as ``{group: [src_lo, src_hi, dst_lo, dst_hi,
whole, src_rank, dst_rank]}``, UCX worker addresses base64. Page ids are rank 0's: every
rank's pools mirror its page decisions.
"""

from __future__ import annotations

from typing import Any

from kvcore.manager import TransferPages
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.kv_transfer import KVTransferAgent, TransferUsage
from kvcore.transfer.ucx import UcxEndpointInfo
from services.common.tp_control import decode_bytes, encode_bytes

PAIR_TEST_TIMEOUT_S = 10.0


def pages_to_json(pages: dict[str, TransferPages]) -> dict[str, list]:
    return {g: [p.first_page, list(p.page_ids)] for g, p in pages.items()}


def pages_from_json(pages: dict[str, list]) -> dict[str, TransferPages]:
    return {g: TransferPages(first, ids) for g, (first, ids) in pages.items()}


def routes_to_json(routes: dict[str, HeadRoute]) -> dict[str, list]:
    return {
        g: [
            r.src_heads.start,
            r.src_heads.stop,
            r.dst_heads.start,
            r.dst_heads.stop,
            r.whole,
            r.src_rank,
            r.dst_rank,
        ]
        for g, r in routes.items()
    }


def routes_from_json(routes: dict[str, list]) -> dict[str, HeadRoute]:
    return {
        g: HeadRoute(src, dst, slice(s0, s1), slice(d0, d1), whole)
        for g, (s0, s1, d0, d1, whole, src, dst) in routes.items()
    }


def usage_to_json(usage: TransferUsage) -> dict[str, Any]:
    return {"bytes": usage.bytes, "seconds": usage.seconds}


class RankOps:
    """One rank's transfer work, given its KVTransferAgent."""

    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent

    def handlers(self) -> dict[str, Any]:
        return {
            "connect": self.connect,
            "disconnect": self.disconnect,
            "ping": self.ping,
            "pong": self.pong,
            "send": self.send,
            "recv": self.recv,
        }

    async def connect(self, peer: str, address: str) -> dict[str, Any]:
        await self.agent.disconnect(peer)  # a re-registering peer has a new address
        await self.agent.connect(peer, UcxEndpointInfo(decode_bytes(address)))
        return {}

    async def disconnect(self, peer: str) -> dict[str, Any]:
        await self.agent.disconnect(peer)
        return {}

    async def ping(self, peer: str, address: str, nonce: str) -> dict[str, Any]:
        """Connect to a peer rank and run the pairing test transfer with it."""
        await self.connect(peer, address)
        await self.agent.ping(peer, nonce, PAIR_TEST_TIMEOUT_S)
        return {}

    async def pong(self, peer: str, address: str, nonce: str) -> dict[str, Any]:
        await self.connect(peer, address)
        await self.agent.pong(peer, nonce, PAIR_TEST_TIMEOUT_S)
        return {}

    async def send(
        self,
        request_id: str,
        pages: dict[str, list],
        peer: str,
        routes: dict[str, list],
        timeout_s: float,
        dest: dict[str, list[int]] | None = None,
    ) -> dict[str, Any]:
        """This rank's heads of ``pages`` to one peer rank, along ``routes``."""
        parsed = routes_from_json(routes)
        src_rank = next(iter(parsed.values())).src_rank
        usage = await self.agent.send_pages(
            request_id, pages_from_json(pages), peer, timeout_s, dest, parsed, src_rank
        )
        return usage_to_json(usage)

    async def recv(
        self,
        request_id: str,
        pages: dict[str, list],
        sources: list[dict[str, list]],
        timeout_s: float,
        zero: dict[str, list[int]] | None = None,
    ) -> dict[str, Any]:
        """This rank's heads of ``pages`` from each source rank (one routes map each).
        ``zero``: pages of groups that do not travel (the separate layout's draft), zeroed
        so this rank's drafter starts as blind as rank 0's."""
        pools = self.agent.manager.pools
        for group, ids in (zero or {}).items():
            pools[group][ids] = 0
        landing = pages_from_json(pages)
        total = TransferUsage()
        for routes in sources:
            parsed = routes_from_json(routes)
            src_rank = next(iter(parsed.values())).src_rank
            usage = await self.agent.receive_pages(request_id, landing, timeout_s, parsed, src_rank)
            merge_usage(total, usage)
        return usage_to_json(total)


def merge_usage(total: TransferUsage, part: TransferUsage | dict[str, Any]) -> TransferUsage:
    """Bytes add up over ranks and sources; seconds are the slowest one's."""
    parts = (
        (part.bytes, part.seconds) if isinstance(part, TransferUsage) else (part["bytes"], part["seconds"])
    )
    for group, n in parts[0].items():
        total.bytes[group] = total.bytes.get(group, 0) + n
    for group, s in parts[1].items():
        total.seconds[group] = max(total.seconds.get(group, 0.0), s)
    return total


def address_of(info) -> str:
    """A RankInfo's UCX worker address, for JSON."""
    return encode_bytes(info.ucx.worker_address)
