"""The pairing side channel: small messages between two workers' rank 0s, keyed by a nonce.

Pairing runs over the same transports as the pages, before any request does, under tags
of group index ``PING_GROUP`` and base ``request_tag(nonce)``:

- the test transfer: 64 KiB derived from the nonce on chunk 0, echoed back on chunk 1,
  so a stale or crossed echo cannot pass;
- typed messages (:class:`PairingMessage`): a length on chunk ``kind``, then the
  payload on chunk ``kind + 1`` (one zero byte when empty);
- the page test: the sizes of real page messages (one per layer group) as the
  ``PAGE_SIZES`` message, then each message from the sender's device memory on chunk
  ``PAGE_CHUNK + 2i``, received into the receiver's device memory and echoed back on
  ``PAGE_CHUNK + 2i + 1``: the paths, sizes and protocols (rendezvous, cuda_ipc) that the
  pages will take, so a pair that passes can move a request's pages.

Every receive has a timeout (a transport need not report a dead peer; UCX's fast path
does not).
"""

from __future__ import annotations

import enum
import hashlib
import struct

import torch

from kvcore.transfer.errors import TransferError
from kvcore.transfer.tags import PING_GROUP, message_tag, request_tag
from kvcore.transfer.transport import Transport

PING_BYTES = 64 << 10
PAGE_CHUNK = 12  # the page test's first message chunk; chunks before it are the typed messages'
MAX_TEST_MESSAGES = 64  # page messages one test may carry (one per layer group)
MAX_TEST_BYTES = 1 << 30  # the largest page message a receiver allocates for a test
_LENGTH = struct.Struct("<q")


class PairingMessage(enum.IntEnum):
    """The messages of the pairing handshake, in the order they travel. The value is the
    message's first chunk (chunks 0 and 1 are the test transfer's)."""

    SENDER_RANKS = 2  # the page sender's (prefill) TP group
    RECEIVER_RANKS = 4  # the page receiver's (decode) TP group
    RECEIVER_VERDICT = 6  # the receiver's verdict on the sender's group
    SENDER_VERDICT = 8  # the sender's final verdict (once the receiver accepted)
    PAGE_SIZES = 10  # the page test's message sizes (int64 bytes each)


class SideChannel:
    """Ping/pong and typed messages over ``transport`` (started by its owner)."""

    def __init__(self, transport: Transport) -> None:
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

    async def ping_pages(
        self, peer_id: str, nonce: str, messages: list[torch.Tensor], timeout_s: float
    ) -> None:
        """The page test, sender side: each of ``messages`` (uint8 tensors, as large as a
        page message, where the pages live) sent and its echo compared."""
        sizes = struct.pack(f"<{len(messages)}q", *(m.numel() for m in messages))
        await self.send_message(peer_id, nonce, PairingMessage.PAGE_SIZES, sizes, timeout_s)
        for i, message in enumerate(messages):
            await self.transport.send(peer_id, message, _tag(nonce, PAGE_CHUNK + 2 * i), timeout_s)
            echo = torch.empty_like(message)
            await self.transport.recv(echo, _tag(nonce, PAGE_CHUNK + 2 * i + 1), timeout_s)
            if not torch.equal(echo, message):
                raise TransferError(f"page test with {peer_id!r}: message {i} came back changed")

    async def pong_pages(self, peer_id: str, nonce: str, device: torch.device, timeout_s: float) -> None:
        """The page test, receiver side: each message received into ``device`` memory
        and echoed from there."""
        sizes = page_sizes(await self.receive_message(nonce, PairingMessage.PAGE_SIZES, timeout_s))
        for i, n in enumerate(sizes):
            message = torch.empty(n, dtype=torch.uint8, device=device)
            await self.transport.recv(message, _tag(nonce, PAGE_CHUNK + 2 * i), timeout_s)
            await self.transport.send(peer_id, message, _tag(nonce, PAGE_CHUNK + 2 * i + 1), timeout_s)


def page_sizes(payload: bytes) -> list[int]:
    """The PAGE_SIZES message's sizes; TransferError for one no test needs."""
    count = len(payload) // _LENGTH.size
    if len(payload) % _LENGTH.size or not 0 < count <= MAX_TEST_MESSAGES:
        raise TransferError(f"page test: {len(payload)} bytes of sizes")
    sizes = list(struct.unpack(f"<{count}q", payload))
    if any(not 0 < n <= MAX_TEST_BYTES for n in sizes):
        raise TransferError(f"page test: message sizes {sizes} outside (0, {MAX_TEST_BYTES}]")
    return sizes


def probe_message(nonce: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` uint8 values drawn from ``nonce`` on ``device``: a stale or crossed
    echo differs."""
    seed = int.from_bytes(hashlib.blake2b(nonce.encode(), digest_size=8).digest(), "little") >> 1
    values = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return values.to(device)


def ping_payload(nonce: str) -> bytes:
    """PING_BYTES derived from the nonce."""
    seed = nonce.encode()
    return (seed * (PING_BYTES // max(len(seed), 1) + 1))[:PING_BYTES]


def _tag(nonce: str, chunk: int) -> int:
    return message_tag(request_tag(nonce), PING_GROUP, chunk)
