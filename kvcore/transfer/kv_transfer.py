"""KVTransferAgent: moves one request's pages of every layer group between workers.

The facade the services use for transfers; they never see pools or UCX handles.

Per request (tags from :mod:`kvcore.transfer.tags`, base = ``request_tag(request_id)``):

    sender (prefill)                              receiver (decode)
    aux state           -> send (AUX, 0)  ---->   recv (AUX, 0): who sends, how many tokens
    group g: pack pages -> send (g, 0..)  ---->   recv (g, 0..) -> unpack into reserved pages
    recv (ACK, 0)                         <----   send (ACK, 0)

Both sides take the pages from ``KVCacheManager.transfer_pages(request_id, num_tokens)``:
the same block-table indices on both sides (windowed groups only inside the window;
the SEPARATE layout's draft group not at all), so only the page ids differ. Every
receive and the sender's wait for the ack have a timeout: the fast UCX path reports no
dead peer. The aux state goes first, so a receiver learns its sender (and, under tensor
parallelism, the sender's TP size) before it posts the page receives.

Tensor parallelism: :meth:`send_pages` / :meth:`receive_pages` move one rank's share
along a :class:`~kvcore.transfer.head_routes.HeadRoute` per group. A whole-pool route moves
pages as they are (contiguous runs pool to pool); a head-sliced one packs the route's
heads of every page into one message. Messages of sender rank s use tag group index
``group index + number of groups * s``, so a receiver told by several sender ranks
(prefill TP > decode TP) tells them apart; rank 0 alone uses the plain indices.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import torch

from kvcore.aux_state import AuxState
from kvcore.manager import KVCacheManager, TransferPages
from kvcore.ops import pack_pages, unpack_pages
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.tags import MAX_GROUPS, message_tag, request_tag
from kvcore.transfer.ucx import TransferError, UcxEndpointInfo, UcxTransport

AUX_GROUP = MAX_GROUPS - 1  # tag group index of the aux-state message
ACK_GROUP = MAX_GROUPS - 2  # tag group index of the receiver's acknowledgement
PING_GROUP = MAX_GROUPS - 3  # tag group index of the pairing test transfer
_ACK = struct.Struct("<q")
_LENGTH = struct.Struct("<q")


@dataclass(slots=True)
class TransferUsage:
    """Per group of one request's transfer: bytes and seconds, pages sent, and leading
    pages not sent because the receiver held them."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


class KVTransferAgent:
    def __init__(
        self, manager: KVCacheManager, hidden_size: int, transport: UcxTransport | None = None
    ) -> None:
        self.manager = manager
        self.hidden_size = hidden_size
        self.transport = transport or UcxTransport()
        self.group_index = {g.name: i for i, g in enumerate(manager.config.groups)}

    async def start(self) -> None:
        await self.transport.start()

    async def close(self) -> None:
        await self.transport.close()

    def endpoint(self) -> UcxEndpointInfo:
        return self.transport.local_info()

    async def connect(self, peer_id: str, info: UcxEndpointInfo) -> None:
        if not self.transport.is_connected(peer_id):
            await self.transport.connect(peer_id, info)

    async def disconnect(self, peer_id: str) -> None:
        await self.transport.disconnect(peer_id)

    # ------------------------------------------------------------------ sender

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
        """Push the aux state and the pages holding positions [0, num_tokens) to the peer,
        then wait for its acknowledgement. Raises TransferError/TransferTimeout.

        ``dest``: the receiver's block-table rows (from its reservation). Where a run of
        pages is contiguous on both sides it moves straight from pool to pool; without
        ``dest`` every group is packed into one message. ``held``: per group, leading
        entries the receiver already holds (its reservation's), which are not sent."""
        await self.send_aux(request_id, peer_id, aux, timeout_s)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        usage = await self.send_pages(request_id, pages, peer_id, timeout_s, dest)
        await self.wait_ack(request_id, num_tokens, timeout_s)
        return with_held(usage, held)

    async def send_aux(self, request_id: str, peer_id: str, aux: AuxState, timeout_s: float) -> None:
        tag = message_tag(request_tag(request_id), AUX_GROUP, 0)
        await self.transport.send(peer_id, aux.to_bytes(), tag, timeout_s)

    async def send_pages(
        self,
        request_id: str,
        pages: dict[str, TransferPages],
        peer_id: str,
        timeout_s: float,
        dest: dict[str, list[int]] | None = None,
        routes: dict[str, HeadRoute] | None = None,
        src_rank: int = 0,
    ) -> TransferUsage:
        """Send ``pages`` of each group to ``peer_id``: whole, or along ``routes[group]``
        (groups without a route are skipped) as sender rank ``src_rank``."""
        base, usage = request_tag(request_id), TransferUsage()
        for group, sent in pages.items():
            route = routes.get(group) if routes is not None else None
            if routes is not None and route is None:
                continue
            start = time.perf_counter()
            index = self._tag_index(group, src_rank)
            sliced = route is not None and not route.whole
            runs = (
                [(0, 0, len(sent.page_ids))]
                if sliced and sent.page_ids
                else _common_runs(sent, dest.get(group) if dest else None)
            )
            await self.transport.send(
                peer_id, _runs_header(runs, len(sent.page_ids)), message_tag(base, index, 0), timeout_s
            )
            usage.bytes[group], usage.pages[group] = 0, len(sent.page_ids)
            for chunk, (first, _dst, n) in enumerate(runs, start=1):
                heads = route.src_heads if sliced else None
                buffer = self._source(group, sent.page_ids, first, n, heads)
                await self.transport.send(peer_id, buffer, message_tag(base, index, chunk), timeout_s)
                usage.bytes[group] += buffer.numel() * buffer.element_size()
            usage.seconds[group] = time.perf_counter() - start
        return usage

    async def wait_ack(self, request_id: str, num_tokens: int, timeout_s: float) -> None:
        ack = bytearray(_ACK.size)
        await self.transport.recv(ack, message_tag(request_tag(request_id), ACK_GROUP, 0), timeout_s)
        if _ACK.unpack(ack)[0] != num_tokens:
            raise TransferError(
                f"request {request_id!r}: peer acknowledged {_ACK.unpack(ack)[0]} tokens, sent {num_tokens}"
            )

    def _source(
        self, group: str, page_ids: list[int], first: int, n: int, heads: slice | None = None
    ) -> torch.Tensor:
        """Pages page_ids[first:first+n] (only ``heads`` when given): a view of the pool
        when they are whole and contiguous, else packed."""
        pool = self.manager.pools[group]
        ids = page_ids[first : first + n]
        if heads is None and ids == list(range(ids[0], ids[0] + n)):
            return pool[ids[0] : ids[0] + n]
        return pack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), heads)

    def _tag_index(self, group: str, src_rank: int) -> int:
        index = self.group_index[group] + len(self.group_index) * src_rank
        if index >= PING_GROUP:
            raise TransferError(f"src_rank: {src_rank} leaves no tag for group {group!r}")
        return index

    # ------------------------------------------------------------------ receiver

    async def receive_request(
        self, request_id: str, num_tokens: int, timeout_s: float
    ) -> tuple[AuxState, TransferUsage]:
        """Receive into the pages reserved by ``manager.allocate(request_id, num_tokens,
        match, num_computed=num_tokens)`` (all but its ``held_pages``), then acknowledge to
        the sender the aux state names (which must be connected)."""
        aux = await self.receive_aux(request_id, num_tokens, timeout_s)
        held = self.manager.held_pages(request_id)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        usage = await self.receive_pages(request_id, pages, timeout_s)
        await self.acknowledge(request_id, aux.sender_id, num_tokens, timeout_s)
        return aux, with_held(usage, held)

    async def receive_aux(self, request_id: str, num_tokens: int, timeout_s: float) -> AuxState:
        data = bytearray(AuxState.wire_size(self.hidden_size))
        await self.transport.recv(data, message_tag(request_tag(request_id), AUX_GROUP, 0), timeout_s)
        try:
            aux = AuxState.from_bytes(data)
        except ValueError as e:
            raise TransferError(f"request {request_id!r}: {e}") from e
        if aux.prompt_len != num_tokens:
            raise TransferError(
                f"request {request_id!r}: aux state is for {aux.prompt_len} tokens, reserved {num_tokens}"
            )
        return aux

    async def receive_pages(
        self,
        request_id: str,
        pages: dict[str, TransferPages],
        timeout_s: float,
        routes: dict[str, HeadRoute] | None = None,
        src_rank: int = 0,
    ) -> TransferUsage:
        """Receive what :meth:`send_pages` sends with the same pages, routes and rank."""
        base, usage = request_tag(request_id), TransferUsage()
        for group, landing in pages.items():
            route = routes.get(group) if routes is not None else None
            if routes is not None and route is None:
                continue
            start = time.perf_counter()
            index = self._tag_index(group, src_rank)
            header = torch.zeros(len(landing.page_ids) + 1, dtype=torch.int32)
            await self.transport.recv(header, message_tag(base, index, 0), timeout_s)
            heads = route.dst_heads if route is not None and not route.whole else None
            usage.bytes[group], usage.pages[group] = 0, len(landing.page_ids)
            for chunk, (first, n) in enumerate(_header_runs(header), start=1):
                usage.bytes[group] += await self._receive_run(
                    group,
                    landing.page_ids[first : first + n],
                    message_tag(base, index, chunk),
                    timeout_s,
                    heads,
                )
            usage.seconds[group] = time.perf_counter() - start
        return usage

    async def acknowledge(self, request_id: str, sender_id: str, num_tokens: int, timeout_s: float) -> None:
        await self.transport.send(
            sender_id, _ACK.pack(num_tokens), message_tag(request_tag(request_id), ACK_GROUP, 0), timeout_s
        )

    async def _receive_run(
        self, group: str, ids: list[int], tag: int, timeout_s: float, heads: slice | None = None
    ) -> int:
        """Receive one run: straight into the pool when its pages are whole and contiguous
        here, else packed and scattered (into ``heads`` only, when given)."""
        pool = self.manager.pools[group]
        n = len(ids)
        if heads is None and ids == list(range(ids[0], ids[0] + n)):
            await self.transport.recv(pool[ids[0] : ids[0] + n], tag, timeout_s)
            return n * pool[0].numel() * pool.element_size()
        shape = list(pool.shape)
        shape[0] = n
        if heads is not None:
            shape[3] = heads.stop - heads.start
        packed = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        await self.transport.recv(packed, tag, timeout_s)
        unpack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), packed, heads)
        return packed.numel() * packed.element_size()

    # ------------------------------------------------------------------ small messages

    async def send_message(self, peer_id: str, nonce: str, chunk: int, data: bytes, timeout_s: float) -> None:
        """A length-prefixed message on the ``nonce``'s side channel (chunks ``chunk`` and
        ``chunk + 1``), e.g. a TP group's RankInfos at pairing."""
        base = request_tag(nonce)
        await self.transport.send(
            peer_id, _LENGTH.pack(len(data)), message_tag(base, PING_GROUP, chunk), timeout_s
        )
        await self.transport.send(
            peer_id, bytes(data) or b"\0", message_tag(base, PING_GROUP, chunk + 1), timeout_s
        )

    async def receive_message(self, nonce: str, chunk: int, timeout_s: float) -> bytes:
        base = request_tag(nonce)
        length = bytearray(_LENGTH.size)
        await self.transport.recv(length, message_tag(base, PING_GROUP, chunk), timeout_s)
        n = _LENGTH.unpack(length)[0]
        data = bytearray(max(n, 1))
        await self.transport.recv(data, message_tag(base, PING_GROUP, chunk + 1), timeout_s)
        return bytes(data[:n])

    # ------------------------------------------------------------------ pairing test

    async def ping(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        """The pairing test transfer, sender side: send a small buffer, await its echo."""
        payload = _ping_payload(nonce)
        base = request_tag(nonce)
        await self.transport.send(peer_id, payload, message_tag(base, PING_GROUP, 0), timeout_s)
        echo = bytearray(len(payload))
        await self.transport.recv(echo, message_tag(base, PING_GROUP, 1), timeout_s)
        if bytes(echo) != payload:
            raise TransferError(f"pairing test with {peer_id!r}: echo differs from what was sent")

    async def pong(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        """The pairing test transfer, receiver side: receive the buffer and echo it."""
        payload = bytearray(len(_ping_payload(nonce)))
        base = request_tag(nonce)
        await self.transport.recv(payload, message_tag(base, PING_GROUP, 0), timeout_s)
        await self.transport.send(peer_id, bytes(payload), message_tag(base, PING_GROUP, 1), timeout_s)


def with_held(usage: TransferUsage, held: dict[str, int] | None) -> TransferUsage:
    """``usage`` with the held pages of each group it moved recorded."""
    usage.held = {g: (held or {}).get(g, 0) for g in usage.bytes}
    return usage


def _ping_payload(nonce: str) -> bytes:
    """64 KiB derived from the nonce, so a stale or crossed echo cannot pass."""
    seed = nonce.encode()
    return (seed * (65536 // max(len(seed), 1) + 1))[:65536]


def _common_runs(pages: TransferPages, dest: list[int] | None) -> list[tuple[int, int, int]]:
    """Split the sent pages into runs contiguous on both sides: (first index, first index,
    length). Without the receiver's ids, one run of everything (packed)."""
    src = pages.page_ids
    if not src:
        return []
    if dest is None:
        return [(0, 0, len(src))]
    dst = dest[pages.first_page : pages.first_page + len(src)]
    if len(dst) != len(src) or any(p < 0 for p in dst):
        raise TransferError(f"dest: {len(dst)} receiver pages for {len(src)} sent pages")
    runs, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((start, start, i - start))
            start = i
    return runs


def _runs_header(runs: list[tuple[int, int, int]], num_pages: int) -> torch.Tensor:
    """[num_pages + 1] int32: entry i is 1 where a run starts at page i (last entry unused)."""
    header = torch.zeros(num_pages + 1, dtype=torch.int32)
    for first, _, _ in runs:
        header[first] = 1
    header[num_pages] = len(runs)
    return header


def _header_runs(header: torch.Tensor) -> list[tuple[int, int]]:
    starts = torch.nonzero(header[:-1]).flatten().tolist()
    ends = [*starts[1:], header.numel() - 1]
    if len(starts) != int(header[-1]):
        raise TransferError(f"run header: {len(starts)} starts, {int(header[-1])} runs announced")
    return [(a, b - a) for a, b in zip(starts, ends, strict=True)]
