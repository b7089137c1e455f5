"""KVTransferAgent: moves one request's pages of every layer group between workers.

The facade the services use for transfers; they never see pools or UCX handles.

Per request (tags from :mod:`kvcore.transfer.tags`, base = ``request_tag(request_id)``):

    sender (prefill)                              receiver (decode)
    group g: pack pages -> send (g, 0)    ---->   recv (g, 0) -> unpack into reserved pages
    aux state           -> send (AUX, 0)  ---->   recv (AUX, 0)
    recv (ACK, 0)                         <----   send (ACK, 0)

Both sides take the pages from ``KVCacheManager.transfer_pages(request_id, num_tokens)``:
the same block-table indices on both sides (windowed groups only inside the window;
the SEPARATE layout's draft group not at all), so only the page ids differ. Every
receive and the sender's wait for the ack have a timeout: the fast UCX path reports no
dead peer.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import torch

from kvcore.manager import KVCacheManager, TransferPages
from kvcore.ops import pack_pages, unpack_pages
from kvcore.transfer.tags import MAX_GROUPS, message_tag, request_tag
from kvcore.transfer.ucx import TransferError, UcxEndpointInfo, UcxTransport

AUX_GROUP = MAX_GROUPS - 1  # tag group index of the aux-state message
ACK_GROUP = MAX_GROUPS - 2  # tag group index of the receiver's acknowledgement
PING_GROUP = MAX_GROUPS - 3  # tag group index of the pairing test transfer
_AUX_HEADER = struct.Struct("<qqq128s")  # prompt length, first token, hidden values, sender id
_ACK = struct.Struct("<q")


@dataclass(slots=True)
class AuxState:
    """What a decode-side drafter starts from: the first sampled token, the target's hidden
    features at the last prompt position, and the prompt length (tokens). ``sender_id``
    names the sending worker (at most 128 bytes), whom the receiver acknowledges."""

    prompt_len: int
    first_token: int
    hidden: torch.Tensor  # [hidden_size], float32 on the wire
    sender_id: str = ""

    def to_bytes(self) -> bytes:
        values = self.hidden.detach().to("cpu", torch.float32).contiguous()
        sender = self.sender_id.encode()
        if len(sender) > 128:
            raise ValueError(f"sender_id: at most 128 bytes, got {len(sender)}")
        return _AUX_HEADER.pack(self.prompt_len, self.first_token, values.numel(), sender) + \
            values.numpy().tobytes()

    @staticmethod
    def from_bytes(data: bytes | bytearray) -> AuxState:
        prompt_len, first_token, n, sender = _AUX_HEADER.unpack_from(data)
        hidden = torch.frombuffer(bytearray(data[_AUX_HEADER.size:]), dtype=torch.float32)
        if hidden.numel() != n:
            raise TransferError(f"aux state: {hidden.numel()} hidden values, header says {n}")
        return AuxState(prompt_len, first_token, hidden, sender.rstrip(b"\0").decode())

    @staticmethod
    def wire_size(hidden_size: int) -> int:
        return _AUX_HEADER.size + 4 * hidden_size


@dataclass(slots=True)
class TransferUsage:
    """Bytes and seconds per group of one request's transfer."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


class KVTransferAgent:
    def __init__(self, manager: KVCacheManager, hidden_size: int,
                 transport: UcxTransport | None = None) -> None:
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

    async def send_request(self, request_id: str, num_tokens: int, peer_id: str, aux: AuxState,
                           timeout_s: float) -> TransferUsage:
        """Push the pages holding positions [0, num_tokens) and the aux state to the peer,
        then wait for its acknowledgement. Raises TransferError/TransferTimeout."""
        base, usage = request_tag(request_id), TransferUsage()
        for group, pages in self.manager.transfer_pages(request_id, num_tokens).items():
            start = time.perf_counter()
            tag = message_tag(base, self.group_index[group], 0)
            if pages.page_ids:
                packed = self._pack(group, pages)
                await self.transport.send(peer_id, packed, tag, timeout_s)
                usage.bytes[group] = packed.numel() * packed.element_size()
            else:
                usage.bytes[group] = 0
            usage.seconds[group] = time.perf_counter() - start
        await self.transport.send(peer_id, aux.to_bytes(), message_tag(base, AUX_GROUP, 0), timeout_s)
        ack = bytearray(_ACK.size)
        await self.transport.recv(ack, message_tag(base, ACK_GROUP, 0), timeout_s)
        if _ACK.unpack(ack)[0] != num_tokens:
            raise TransferError(f"request {request_id!r}: peer acknowledged "
                                f"{_ACK.unpack(ack)[0]} tokens, sent {num_tokens}")
        return usage

    def _pack(self, group: str, pages: TransferPages) -> torch.Tensor:
        pool = self.manager.pools[group]
        ids = torch.tensor(pages.page_ids, dtype=torch.int64, device=pool.device)
        return pack_pages(pool, ids)

    # ------------------------------------------------------------------ receiver

    async def receive_request(self, request_id: str, num_tokens: int,
                              timeout_s: float) -> tuple[AuxState, TransferUsage]:
        """Receive into the pages reserved by ``manager.allocate(request_id, num_tokens,
        num_computed=num_tokens)``, then acknowledge to the sender the aux state names
        (which must be connected)."""
        base, usage = request_tag(request_id), TransferUsage()
        for group, pages in self.manager.transfer_pages(request_id, num_tokens).items():
            start = time.perf_counter()
            if pages.page_ids:
                pool = self.manager.pools[group]
                packed = torch.empty((len(pages.page_ids), *pool.shape[1:]), dtype=pool.dtype,
                                     device=pool.device)
                await self.transport.recv(packed, message_tag(base, self.group_index[group], 0),
                                          timeout_s)
                ids = torch.tensor(pages.page_ids, dtype=torch.int64, device=pool.device)
                unpack_pages(pool, ids, packed)
                usage.bytes[group] = packed.numel() * packed.element_size()
            else:
                usage.bytes[group] = 0
            usage.seconds[group] = time.perf_counter() - start
        data = bytearray(AuxState.wire_size(self.hidden_size))
        await self.transport.recv(data, message_tag(base, AUX_GROUP, 0), timeout_s)
        aux = AuxState.from_bytes(data)
        if aux.prompt_len != num_tokens:
            raise TransferError(f"request {request_id!r}: aux state is for {aux.prompt_len} "
                                f"tokens, reserved {num_tokens}")
        await self.transport.send(aux.sender_id, _ACK.pack(num_tokens),
                                  message_tag(base, ACK_GROUP, 0), timeout_s)
        return aux, usage

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


def _ping_payload(nonce: str) -> bytes:
    """64 KiB derived from the nonce, so a stale or crossed echo cannot pass."""
    seed = nonce.encode()
    return (seed * (65536 // max(len(seed), 1) + 1))[:65536]
