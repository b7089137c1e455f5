"""TransferAgent: moves one request's pages of every layer group between two workers.

The one agent the servers run, for any TP size on either side. Per request (tags from
:mod:`kvcore.transfer.tags`, base = the reservation's ``transfer_tag``, fresh per
reservation from :meth:`TransferAgent.transfer_tag`):

    sender (prefill)                              receiver (decode)
    rank 0: aux state  -> send (AUX, 0)  ----->   rank 0: recv (AUX, 0): sender, tokens
    every rank: pages  -> send (g', 0..) ----->   every rank: recv into reserved pages
    rank 0: recv (ACK, 0)                <-----   rank 0: send (ACK, 0) once all landed,
                                                  or a refusal naming why they did not

- Both sides take the pages from ``KVCacheManager.transfer_pages(request_id, num_tokens,
  held)``: the same block-table indices (windowed groups only inside the window, the
  SEPARATE layout's draft group not at all, none of the receiver's held leading pages),
  so only the page ids differ.
- The aux state goes first, so a receiver learns its sender, hence the sender's ranks,
  before it posts the page receives.
- The pages of each rank pair go along head routes (:mod:`kvcore.transfer.fanout`);
  ``g'`` is the group's index offset by the sender's rank (:mod:`kvcore.transfer.rank`).
- Every receive and the sender's wait for the ack have a timeout: a transport need not
  report a dead peer (UCX's fast path does not). Cancelling a transfer cancels every rank's part of it.
- A receiver that knows its sender and fails (a page timed out, an aux state it cannot
  take, its reservation released) answers the ack with a refusal and its reason; the
  sender listens for it from the start, so it fails at once rather than at its deadline,
  even while a page send waits for a receive that will never be posted.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import struct
from collections.abc import Mapping

from kvcore import AuxState, KVCacheManager, TransferPages
from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.errors import TransferError, TransferTimeout
from kvcore.transfer.fanout import Fanout, NoLinks, RankLinks
from kvcore.transfer.jobs import PeerRank, TransferKey, TransferUsage
from kvcore.transfer.pages import MAX_MESSAGE_BYTES
from kvcore.transfer.rank import PagePools, RankTransfer
from kvcore.transfer.tags import ACK_GROUP, AUX_GROUP, message_tag, request_tag
from kvcore.transfer.target import TransferTarget
from kvcore.transfer.transport import POLL_S, Transport

_ACK = struct.Struct("<q256s")  # tokens acknowledged (REFUSED: none), the refusal's reason (UTF-8)
REFUSED = -1
REFUSAL_TIMEOUT_S = 1.0  # a refusal is a courtesy: the sender's own deadline bounds it anyway
NO_DEADLINE_S = 1e9  # the ack listener's: the sends' deadlines and the final wait bound it


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
        transport: Transport | None = None,
        links: RankLinks | None = None,
        total_heads: Mapping[str, int] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """``pools``: the tensors ``manager``'s page ids index (the engine's KVPools);
        ``hidden_size``: the hidden values an aux state carries (the drafter's input
        features; 0 when no drafter runs); ``transport``: rank 0's (None = a new one of the
        default backend); ``max_message_bytes``: the cap of one page message rank 0 sends
        (ranks 1.. keep their own :class:`RankTransfer`'s)."""
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
        self._refusals: set[asyncio.Future] = set()  # refusals sent as a receive was cancelled

    async def start(self) -> None:
        await self.rank0.start()

    async def close(self) -> None:
        await self.rank0.close()

    def endpoint(self) -> EndpointInfo:
        return self.rank0.endpoint()

    @property
    def backend(self) -> str:
        """The name of rank 0's transfer backend, as its endpoint publishes it."""
        return self.rank0.transport.backend

    def check_target(self, target: TransferTarget) -> None:
        """ValueError when ``target``'s endpoint names another backend than this agent's."""
        named = target.endpoint.backend if target.endpoint is not None else self.backend
        if named != self.backend:
            raise ValueError(f"endpoint.backend: {named!r}, but this worker's transport is {self.backend!r}")

    def transfer_tag(self, request_id: str) -> int:
        """A fresh base tag for one transfer of ``request_id``, as a reservation publishes
        it: never the same twice from one agent (a per-agent salt and counter), so a
        retried request's messages cannot match a stalled earlier attempt's."""
        return request_tag(f"{request_id}\x00{self._salt}:{next(self._reserves)}")

    async def connect(self, peer_id: str, info: EndpointInfo) -> None:
        """Open the send direction to a peer worker's rank 0 (kept if open to that address)."""
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

    async def test_pages(self, peer_id: str, nonce: str, lead: bool) -> None:
        """Rank 0's page test with the peer's rank 0 (after the side channel's ping):
        page-sized messages from and into device memory, echoed; ``lead`` on the sender."""
        await self.rank0.test_pages(peer_id, nonce, lead)

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
        self._check_aux(request_id, aux)
        pages = self.manager.transfer_pages(request_id, num_tokens, held)
        answer = asyncio.ensure_future(self._answer(key, num_tokens))  # a refusal may come any time
        sends: asyncio.Future | None = None
        try:
            await self.rank0.transport.send(
                peer_id, aux.to_bytes(), message_tag(key.tag, AUX_GROUP, 0), timeout_s
            )
            sends = asyncio.ensure_future(self.fanout.send(key, pages, peer, timeout_s, dest))
            await asyncio.wait((sends, answer), return_when=asyncio.FIRST_COMPLETED)
            if answer.done() and not sends.done():
                answer.result()  # a refusal raises here; an early ack cannot be (nothing landed)
            usage = await sends
            await _within(answer, timeout_s, f"request {request_id!r}: acknowledgement from {peer_id!r}")
        finally:
            for task in (answer, sends):
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        return _counted(usage, pages, held)

    async def send_to(
        self, target: TransferTarget, request_id: str, num_tokens: int, aux: AuxState, timeout_s: float
    ) -> TransferUsage:
        """:meth:`send_request` into ``target``'s reservation (checked: :meth:`check_target`)."""
        self.check_target(target)
        return await self.send_request(
            request_id, num_tokens, target.peer_id, aux, timeout_s, target.dest, target.held, target.tag
        )

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
        aux = await self._receive_aux(key, wait_s or timeout_s)
        try:
            _check_prompt_len(request_id, aux, num_tokens)
            self._check_aux(request_id, aux)
            peer = self._peer(aux.sender_id)
            held = self.manager.held_pages(request_id)
            pages = self.manager.transfer_pages(request_id, num_tokens, held)
            usage = await self.fanout.recv(key, pages, len(peer), timeout_s)
        except TransferError as e:
            await self._refuse(aux.sender_id, key, str(e))
            raise
        except asyncio.CancelledError:  # the reservation was released: tell the sender now
            refusal = asyncio.ensure_future(self._refuse(aux.sender_id, key, "the reservation was released"))
            self._refusals.add(refusal)
            refusal.add_done_callback(self._refusals.discard)
            raise
        ack = message_tag(key.tag, ACK_GROUP, 0)
        await self.rank0.transport.send(aux.sender_id, _ACK.pack(num_tokens, b""), ack, timeout_s)
        return aux, _counted(usage, pages, held)

    async def _receive_aux(self, key: TransferKey, timeout_s: float) -> AuxState:
        """The aux state, whatever hidden width it carries (checked by the caller, who can
        then refuse it to its sender)."""
        tag, most = message_tag(key.tag, AUX_GROUP, 0), AuxState.wire_size(max(self.hidden_size, MAX_HIDDEN))
        data = await self.rank0.transport.recv_message(tag, most, timeout_s)
        try:
            return AuxState.from_bytes(data)
        except (ValueError, struct.error) as e:
            raise TransferError(f"request {key.request_id!r}: {e}") from e

    def _check_aux(self, request_id: str, aux: AuxState) -> None:
        """The aux state carries this pair's hidden width (the drafter's features, or none)."""
        if aux.hidden.numel() != self.hidden_size:
            raise TransferError(
                f"request {request_id!r}: aux state carries {aux.hidden.numel()} hidden values, "
                f"this worker takes {self.hidden_size}"
            )

    async def _answer(self, key: TransferKey, num_tokens: int) -> None:
        """The receiver's answer: returns on its ack of ``num_tokens``, raises TransferError
        on its refusal (with its reason) or another count. Bounded by the caller."""
        data = bytearray(_ACK.size)
        tag = message_tag(key.tag, ACK_GROUP, 0)
        await self.rank0.transport.recv(data, tag, NO_DEADLINE_S, spin_s=POLL_S)
        acked, reason = _ACK.unpack(data)
        if acked == REFUSED:
            why = reason.rstrip(b"\0").decode(errors="replace")
            raise TransferError(f"the receiver refused the transfer: {why}")
        if acked != num_tokens:
            raise TransferError(
                f"request {key.request_id!r}: peer acknowledged {acked} tokens, sent {num_tokens}"
            )

    async def _refuse(self, sender_id: str, key: TransferKey, reason: str) -> None:
        """Tell the sender this transfer failed here (best effort: it has its own deadline)."""
        message = _ACK.pack(REFUSED, reason.encode()[: _ACK.size - 8])
        tag = message_tag(key.tag, ACK_GROUP, 0)
        try:
            await self.rank0.transport.send(sender_id, message, tag, REFUSAL_TIMEOUT_S)
        except (TransferError, ValueError):
            pass

    def _peer(self, peer_id: str) -> list[PeerRank]:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"peer {peer_id!r}: not paired (its ranks are unknown)")
        return peer


MAX_HIDDEN = 1 << 16  # the widest aux state a receiver reads before refusing it


def _check_prompt_len(request_id: str, aux: AuxState, num_tokens: int) -> None:
    if aux.prompt_len != num_tokens:
        raise TransferError(
            f"request {request_id!r}: aux state is for {aux.prompt_len} tokens, reserved {num_tokens}"
        )


async def _within(answer: asyncio.Future, timeout_s: float, what: str) -> None:
    """``answer``'s outcome within ``timeout_s``; TransferTimeout naming ``what`` after."""
    try:
        await asyncio.wait_for(asyncio.shield(answer), timeout_s)
    except TimeoutError:
        raise TransferTimeout(f"{what}: nothing within {timeout_s} s") from None


def _counted(
    usage: TransferUsage, pages: dict[str, TransferPages], held: dict[str, int] | None
) -> TransferUsage:
    """``usage`` with each group's pages (once, not once per rank) and held pages."""
    usage.pages = {g: len(p.page_ids) for g, p in pages.items() if g in usage.bytes}
    usage.held = {g: (held or {}).get(g, 0) for g in usage.bytes}
    return usage
