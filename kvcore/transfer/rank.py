"""One rank's share of every transfer: its transport, its pools, its jobs.

Every rank of a worker runs one :class:`RankTransfer`: rank 0 inside its
:class:`~kvcore.transfer.agent.TransferAgent`, ranks 1.. on rank 0's word through the
services' control channel. A job names rank 0's page ids; this rank moves its own heads
of them, from and into its own pools.

Tag group index of a group's messages from sender rank s: ``group index + number of
groups * s`` (rank 0 alone uses the plain indices), so a receiver gathering from several
sender ranks tells them apart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kvcore.transfer.backends import new_transport
from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.errors import TransferError
from kvcore.transfer.jobs import LinkTest, RecvJob, SendJob, TransferUsage
from kvcore.transfer.pages import MAX_MESSAGE_BYTES, receive_group, send_group
from kvcore.transfer.side_channel import SideChannel, probe_message
from kvcore.transfer.tags import PING_GROUP, request_tag
from kvcore.transfer.transport import SPIN_S, STREAM_SPIN_S, Transport

LINK_TEST_TIMEOUT_S = 10.0


class PagePools(Protocol):
    """The KV pools a rank's transfers read and write, by layer group."""

    def tensor(self, group: str) -> torch.Tensor:
        """``[pages, layers, 2, heads, tokens_per_page, head_dim]`` pool of ``group``."""
        ...


class RankTransfer:
    """Runs this rank's :class:`SendJob`, :class:`RecvJob` and :class:`LinkTest`.

    - ``groups``: the cache config's group names, in its order (they index the tags);
    - ``max_message_bytes``: the cap of one page message this rank sends (bytes); a
      receiver follows the sender's split, so ranks need not agree on it.
    """

    def __init__(
        self,
        pools: PagePools,
        groups: Sequence[str],
        transport: Transport | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """``transport``: None = a new one of the default backend (:func:`new_transport`)."""
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes: must be > 0, got {max_message_bytes}")
        self.pools, self.max_message_bytes = pools, max_message_bytes
        self.transport = transport or new_transport()
        self.side_channel = SideChannel(self.transport)
        self._index = {g: i for i, g in enumerate(groups)}

    async def start(self) -> None:
        await self.transport.start()

    async def close(self) -> None:
        await self.transport.close()

    def endpoint(self) -> EndpointInfo:
        return self.transport.local_info()

    async def connect(self, peer_id: str, info: EndpointInfo) -> None:
        """Open the send direction to ``peer_id`` (kept when open to that address already)."""
        await self.transport.connect(peer_id, info)

    async def disconnect(self, peer_id: str) -> None:
        await self.transport.disconnect(peer_id)

    async def send(self, job: SendJob) -> TransferUsage:
        """Every routed group of ``job``, one after the other."""
        base, usage = job.tag or request_tag(job.request_id), TransferUsage()
        for group, sent in job.pages.items():
            route = job.routes.get(group)
            if route is None:
                continue
            start = time.perf_counter()
            dest = job.dest.get(group) if job.dest else None
            tag = (base, self.tag_index(group, job.src_rank))
            pool, cap = self.pools.tensor(group), self.max_message_bytes
            with _naming(group, len(sent.page_ids), pool, start):
                usage.bytes[group] = await send_group(
                    self.transport, pool, job.peer_id, tag, sent, route, dest, job.timeout_s, cap
                )
            usage.seconds[group] = time.perf_counter() - start
        return usage

    async def recv(self, job: RecvJob) -> TransferUsage:
        """Every sender rank's routed groups, in ascending sender rank."""
        total = TransferUsage()
        for src_rank in sorted(job.sources):
            total.add(await self._recv_from(job, src_rank))
        return total

    async def test(self, job: LinkTest) -> None:
        """Connect to the peer rank (anew if it registered again at a new address), then
        ping it or echo its ping, then the page test."""
        await self.connect(job.peer.instance_id, job.peer.endpoint)
        run = self.side_channel.ping if job.lead else self.side_channel.pong
        await run(job.peer.instance_id, job.nonce, LINK_TEST_TIMEOUT_S)
        await self.test_pages(job.peer.instance_id, job.nonce, job.lead)

    async def test_pages(self, peer_id: str, nonce: str, lead: bool) -> None:
        """The side channel's page test with a connected peer rank: one message of a
        whole page (at most the message cap) per layer group, from and into memory on
        this rank's pool device; ``lead`` on the page sender."""
        side, t = self.side_channel, LINK_TEST_TIMEOUT_S
        if not lead:
            await side.pong_pages(peer_id, nonce, self.device, t)
            return
        messages = [
            probe_message(
                f"{nonce}/{group}", min(self._page_bytes(group), self.max_message_bytes), self.device
            )
            for group in self._index
        ]
        await side.ping_pages(peer_id, nonce, messages, t)

    @property
    def device(self) -> torch.device:
        return self.pools.tensor(next(iter(self._index))).device

    def _page_bytes(self, group: str) -> int:
        pool = self.pools.tensor(group)
        return pool[0].numel() * pool.element_size()

    def tag_index(self, group: str, src_rank: int) -> int:
        """Tag group index of ``group``'s messages from sender rank ``src_rank``."""
        index = self._index[group] + len(self._index) * src_rank
        if index >= PING_GROUP:
            raise TransferError(f"src_rank: {src_rank} leaves no tag for group {group!r}")
        return index

    async def _recv_from(self, job: RecvJob, src_rank: int) -> TransferUsage:
        base, usage = job.tag or request_tag(job.request_id), TransferUsage()
        routes, header_spin = job.sources[src_rank], SPIN_S  # the first group may wait on a prefill
        for group, landing in job.pages.items():
            route = routes.get(group)
            if route is None:
                continue
            start = time.perf_counter()
            tag, pool = (base, self.tag_index(group, src_rank)), self.pools.tensor(group)
            with _naming(group, len(landing.page_ids), pool, start):
                usage.bytes[group] = await receive_group(
                    self.transport, pool, tag, landing, route, job.timeout_s, header_spin
                )
            header_spin = STREAM_SPIN_S  # the next group follows this one at once
            usage.seconds[group] = time.perf_counter() - start
        return usage


@contextlib.contextmanager
def _naming(group: str, num_pages: int, pool: torch.Tensor, start: float):
    """A TransferError inside names the group, its pages and bytes, and the seconds spent
    on it (the same error type: a timeout stays a TransferTimeout)."""
    try:
        yield
    except TransferError as e:
        nbytes = num_pages * pool[0].numel() * pool.element_size()
        spent = time.perf_counter() - start
        raise type(e)(f"group {group!r} ({num_pages} pages, {nbytes} bytes, {spent:.2f} s in): {e}") from e
