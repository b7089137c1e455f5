"""The pairing side channel: small messages between two workers' rank 0s, keyed by a nonce.

Pairing runs over the same UCX workers as the pages, before any request does, under tags
of group index ``PING_GROUP`` and base ``request_tag(nonce)``:

- the test transfer: 64 KiB derived from the nonce on chunk 0, echoed back on chunk 1,
  so a stale or crossed echo cannot pass;
- typed messages (:class:`PairingMessage`): a length on chunk ``kind``, then the
  payload on chunk ``kind + 1`` (one zero byte when empty).

Every receive has a timeout (the worker-address path reports no dead peer).
"""

from __future__ import annotations

import enum
import struct

from kvcore.transfer.tags import PING_GROUP, message_tag, request_tag
from kvcore.transfer.ucx import TransferError, UcxTransport

PING_BYTES = 64 << 10
_LENGTH = struct.Struct("<q")


class PairingMessage(enum.IntEnum):
    """The messages of the pairing handshake, in the order they travel. The value is the
    message's first chunk (chunks 0 and 1 are the test transfer's)."""

    SENDER_RANKS = 2  # the page sender's (prefill) TP group
    RECEIVER_RANKS = 4  # the page receiver's (decode) TP group
    RECEIVER_VERDICT = 6  # the receiver's verdict on the sender's group
    SENDER_VERDICT = 8  # the sender's final verdict (once the receiver accepted)


class SideChannel:
    """Ping/pong and typed messages over ``transport`` (started by its owner)."""

    def __init__(self, transport: UcxTransport) -> None:
        self.transport = transport

    async def ping(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        """The test transfer, sender side: send the nonce's payload, await its echo."""
        payload = ping_payload(nonce)
        await self.transport.send(peer_id, payload, _tag(nonce, 0), timeout_s)
        echo = bytearray(len(payload))
        await self.transport.recv(echo, _tag(nonce, 1), timeout_s)
        if bytes(echo) != payload:
            raise TransferError(f"pairing test with {peer_id!r}: echo differs from what was sent")

    async def pong(self, peer_id: str, nonce: str, timeout_s: float) -> None:
        """The test transfer, receiver side: receive the payload and echo it."""
        payload = bytearray(PING_BYTES)
        await self.transport.recv(payload, _tag(nonce, 0), timeout_s)
        await self.transport.send(peer_id, bytes(payload), _tag(nonce, 1), timeout_s)

    async def send_message(
        self, peer_id: str, nonce: str, kind: PairingMessage, payload: bytes, timeout_s: float
    ) -> None:
        """Send ``payload`` (any length) as the nonce's message ``kind``."""
        await self.transport.send(peer_id, _LENGTH.pack(len(payload)), _tag(nonce, kind), timeout_s)
        await self.transport.send(peer_id, bytes(payload) or b"\0", _tag(nonce, kind + 1), timeout_s)

    async def receive_message(self, nonce: str, kind: PairingMessage, timeout_s: float) -> bytes:
        """The payload of the nonce's message ``kind``."""
        length = bytearray(_LENGTH.size)
        await self.transport.recv(length, _tag(nonce, kind), timeout_s)
        n = _LENGTH.unpack(length)[0]
        data = bytearray(max(n, 1))
        await self.transport.recv(data, _tag(nonce, kind + 1), timeout_s)
        return bytes(data[:n])


def ping_payload(nonce: str) -> bytes:
    """PING_BYTES derived from the nonce."""
    seed = nonce.encode()
    return (seed * (PING_BYTES // max(len(seed), 1) + 1))[:PING_BYTES]


def _tag(nonce: str, chunk: int) -> int:
    return message_tag(request_tag(nonce), PING_GROUP, chunk)
