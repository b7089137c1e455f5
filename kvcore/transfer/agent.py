"""TransferAgent: moves one request's pages of every layer group between two workers.

The one agent the servers run, for any TP size on either side. Per request (tags from
:mod:`kvcore.transfer.tags`, base = the reservation's ``transfer_tag``, fresh per
reservation from :meth:`TransferAgent.transfer_tag`):

    sender (prefill)                              receiver (decode)
    rank 0: aux state  -> send (AUX, 0)  ----->   rank 0: recv (AUX, 0): sender, tokens
    every rank: pages  -> send (g', 0..) ----->   every rank: recv into reserved pages
    rank 0: recv (ACK, 0)                <-----   rank 0: send (ACK, 0) once all landed

- Both sides take the pages from ``KVCacheManager.transfer_pages(request_id, num_tokens,
  held)``: the same block-table indices (windowed groups only inside the window, the
  SEPARATE layout's draft group not at all, none of the receiver's held leading pages),
  so only the page ids differ.
- The aux state goes first, so a receiver learns its sender, hence the sender's ranks,
  before it posts the page receives.
- The pages of each rank pair go along head routes (:mod:`kvcore.transfer.fanout`);
  ``g'`` is the group's index offset by the sender's rank (:mod:`kvcore.transfer.rank`).
- Every receive and the sender's wait for the ack have a timeout: the fast UCX path
  reports no dead peer. Cancelling a transfer cancels every rank's part of it.
"""

from __future__ import annotations

import itertools
import secrets
import struct
from collections.abc import Mapping

from kvcore import AuxState, KVCacheManager, TransferPages
from kvcore.transfer.fanout import Fanout, NoLinks, RankLinks
from kvcore.transfer.jobs import PeerRank, TransferKey, TransferUsage
from kvcore.transfer.pages import MAX_MESSAGE_BYTES
from kvcore.transfer.rank import PagePools, RankTransfer
from kvcore.transfer.tags import ACK_GROUP, AUX_GROUP, message_tag, request_tag
from kvcore.transfer.ucx import STREAM_SPIN_S, EndpointInfo, TransferError, UcxTransport

_ACK = struct.Struct("<q")  # the tokens acknowledged


class TransferAgent:
    """Rank 0's transfer agent of a worker of ``links.size`` ranks (TP 1: no links).

    - ``total_heads``: per layer group, KV heads of the whole layer; a group left out
      has its heads split, not replicated (``num_kv_heads * links.size``).
    - Peers are known by worker id; :meth:`pair` names the ranks of each.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        pools: PagePools,
        hidden_size: int,
        transport: UcxTransport | None = None,
        links: RankLinks | None = None,
        total_heads: Mapping[str, int] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """``pools``: the tensors ``manager``'s page ids index (the engine's KVPools);
        ``max_message_bytes``: the cap of one page message rank 0 sends (ranks 1.. keep
        their own :class:`RankTransfer`'s)."""
        self.manager, self.hidden_size = manager, hidden_size
        links = links or NoLinks()
        groups = manager.config.groups
        heads = {g.name: g.num_kv_heads * links.size for g in groups} | dict(total_heads or {})
        self.rank0 = RankTransfer(pools, [g.name for g in groups], transport, max_message_bytes)
        self.fanout = Fanout(self.rank0, links, heads)
        self.side_channel = self.rank0.side_channel
        self._peers: dict[str, list[PeerRank]] = {}
        self._salt = secrets.token_hex(8)  # this agent's, so two workers' tags differ too
        self._reserves = itertools.count()

    async def start(self) -> None:
        await self.rank0.start()

    async def close(self) -> None:
        await self.rank0.close()

    def endpoint(self) -> EndpointInfo:
        return self.rank0.endpoint()

    def transfer_tag(self, request_id: str) -> int:
        """A fresh base tag for one transfer of ``request_id``, as a reservation publishes
        it: never the same twice from one agent (a per-agent salt and counter), so a
        retried request's messages cannot match a stalled earlier attempt's."""
        return request_tag(f"{request_id}\x00{self._salt}:{next(self._reserves)}")

    async def connect(self, peer_id: str, info: EndpointInfo) -> None:
        """Open the send direction to a peer worker's rank 0 (unless open already)."""
        await self.rank0.connect(peer_id, info)

    def pair(self, peer_id: str, ranks: list[PeerRank]) -> None:
        """Know ``peer_id``'s ranks (rank 0 first): transfers with it may start."""
        self._peers[peer_id] = list(ranks)

    def unpair(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    async def disconnect(self, peer_id: str) -> None:
        """Forget a peer worker: its ranks, and every endpoint any rank here holds to one."""
        await self.rank0.disconnect(peer_id)
        await self.fanout.disconnect(self._peers.pop(peer_id, []))

    async def test_links(self, peer: list[PeerRank], lead: bool, nonce: str) -> None:
        """The pairing test of every other rank pair that will exchange pages with
        ``peer`` (rank 0's was the side channel's ping); ``lead`` on the page sender."""
        await self.fanout.test_links(peer, lead, nonce)

    async def send_request(
        self,
        request_id: str,
        num_tokens: int,
        peer_id: str,
        aux: AuxState,
        timeout_s: float,
        dest: dict[str, list[int]] | None = None,
        held: dict[str, int] | None = None,
        tag: int = 0,
    ) -> TransferUsage:
        """Push the aux state, then the pages holding positions [0, num_tokens), to a
        paired peer, and wait for its acknowledgement.

        - ``dest``: the receiver's block-table rows (from its reservation): runs contiguous
          on both sides move pool to pool; without it every group is packed.
        - ``held``: per group, leading entries the receiver holds already: not sent.
        - ``tag``: the reservation's ``transfer_tag`` (0: ``request_tag(request_id)``).
        - Raises TransferError (TransferTimeout past ``timeout_s`` on any message).
        """
        peer, key = self._peer(peer_id), TransferKey(request_id, tag or request_tag(request_id))
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        await self.rank0.transport.send(
            peer_id, aux.to_bytes(), message_tag(key.tag, AUX_GROUP, 0), timeout_s
        )
        usage = await self.fanout.send(key, pages, peer, timeout_s, dest)
        await self._wait_ack(key, num_tokens, timeout_s)
        return _counted(usage, pages, held)

    async def receive_request(
        self, request_id: str, num_tokens: int, timeout_s: float, tag: int = 0, wait_s: float | None = None
    ) -> tuple[AuxState, TransferUsage]:
        """Receive into the pages reserved by ``manager.allocate(request_id, num_tokens,
        match, num_computed=num_tokens)`` (all but its ``held_pages``) from the paired peer
        the aux state names, then acknowledge; ``tag`` as in :meth:`send_request`.

        The aux state may take ``wait_s`` (default ``timeout_s``): the sender starts only
        once its prefill is done. Every message after it has ``timeout_s``, counted from
        when the transfer started. Raises TransferError / TransferTimeout."""
        key = TransferKey(request_id, tag or request_tag(request_id))
        aux = await self._receive_aux(key, num_tokens, wait_s or timeout_s)
        peer = self._peer(aux.sender_id)
        held = self.manager.held_pages(request_id)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        usage = await self.fanout.recv(key, pages, len(peer), timeout_s)
        ack = message_tag(key.tag, ACK_GROUP, 0)
        await self.rank0.transport.send(aux.sender_id, _ACK.pack(num_tokens), ack, timeout_s)
        return aux, _counted(usage, pages, held)

    async def _receive_aux(self, key: TransferKey, num_tokens: int, timeout_s: float) -> AuxState:
        request_id = key.request_id
        data = bytearray(AuxState.wire_size(self.hidden_size))
        await self.rank0.transport.recv(data, message_tag(key.tag, AUX_GROUP, 0), timeout_s)
        try:
            aux = AuxState.from_bytes(data)
        except ValueError as e:
            raise TransferError(f"request {request_id!r}: {e}") from e
        if aux.prompt_len != num_tokens:
            raise TransferError(
                f"request {request_id!r}: aux state is for {aux.prompt_len} tokens, reserved {num_tokens}"
            )
        return aux

    async def _wait_ack(self, key: TransferKey, num_tokens: int, timeout_s: float) -> None:
        ack = bytearray(_ACK.size)
        # the ack follows the last page at once: spin, not the 1 ms back-off
        await self.rank0.transport.recv(ack, message_tag(key.tag, ACK_GROUP, 0), timeout_s, STREAM_SPIN_S)
        (acked,) = _ACK.unpack(ack)
        if acked != num_tokens:
            raise TransferError(
                f"request {key.request_id!r}: peer acknowledged {acked} tokens, sent {num_tokens}"
            )

    def _peer(self, peer_id: str) -> list[PeerRank]:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"peer {peer_id!r}: not paired (its ranks are unknown)")
        return peer


def _counted(
    usage: TransferUsage, pages: dict[str, TransferPages], held: dict[str, int] | None
) -> TransferUsage:
    """``usage`` with each group's pages (once, not once per rank) and held pages."""
    usage.pages = {g: len(p.page_ids) for g, p in pages.items() if g in usage.bytes}
    usage.held = {g: (held or {}).get(g, 0) for g in usage.bytes}
    return usage
