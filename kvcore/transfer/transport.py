"""The seam between the KV transfer and the backend that moves its bytes: :class:`Transport`.

What the page groups (:mod:`kvcore.transfer.pages`), the pairing side channel and the
agent ask of a backend, and all they ask:

- two-sided tagged messages: ``send(peer_id, buffer, tag)`` is matched by a
  ``recv(buffer, tag)`` on the peer. A 64-bit tag alone tells apart every message a
  transport can receive (:mod:`kvcore.transfer.tags`), so a receive names no peer;
- buffers are contiguous host or device memory (:data:`Buffer`): a page message goes from
  one rank's pool into another's, device to device where the backend can;
- every receive has a deadline. One that times out waiting leaves nothing behind: a
  message that comes later stays for a later receive of its tag. A message of another
  size than the buffer is refused (TransferError naming both sizes);
- a send returns once its buffer may be reused; one that times out or is cancelled may
  still complete in the background, its buffer kept alive until it does;
- peers are named by id: ``connect(peer_id, endpoint)`` opens the send direction (a no-op
  when open to that endpoint already; receives need none), ``disconnect`` forgets it. An
  endpoint of another backend is refused (ValueError naming both);
- failures raise :class:`~kvcore.transfer.errors.TransferError` (a deadline
  :class:`~kvcore.transfer.errors.TransferTimeout`); after ``close`` every call raises
  :class:`~kvcore.transfer.errors.TransportClosed`.

A backend is one class implementing this protocol and one line in
:mod:`kvcore.transfer.backends` (docs/architecture.md, "Adding a transfer backend").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvcore.transfer.endpoint import EndpointInfo

Buffer = torch.Tensor | bytes | bytearray
"""A message's memory: a contiguous tensor (any dtype, host or device) or host bytes; a
receive's buffer must be writable (a tensor or a bytearray)."""

SPIN_S = 2e-4
"""Receive hint: seconds a receive re-checks for its message every loop turn before it
backs off to every POLL_S (a backend woken by arrivals may ignore the hints)."""
POLL_S = 1e-3  # seconds between checks after the spin
STREAM_SPIN_S = 5e-3
"""Spin of a receive whose message is the next of a stream already flowing (a page group's
messages after the first): a back-off to POLL_S there cost about 1 ms a message, half the
rate of 64 MiB page messages on one H200 (docs/performance.md, 2026-12-02)."""


class Transport(Protocol):
    """Tagged, timed send/recv of contiguous buffers to named peers (the module's rules)."""

    backend: str  # the name its endpoints publish, e.g. "ucx"

    async def start(self) -> None:
        """Open the transport; call from the event loop that will run the transfers."""
        ...

    async def close(self) -> None:
        """Stop without waiting for peers; idempotent. Receives waiting raise TransportClosed."""
        ...

    def local_info(self) -> EndpointInfo:
        """How peers reach this transport (published in the rank's RankInfo)."""
        ...

    async def connect(self, peer_id: str, info: EndpointInfo) -> None: ...

    async def disconnect(self, peer_id: str) -> None: ...

    async def send(self, peer_id: str, buffer: Buffer, tag: int, timeout_s: float | None = None) -> None:
        """Send ``buffer``'s bytes to a connected peer under ``tag``; None = no deadline."""
        ...

    async def recv(self, buffer: Buffer, tag: int, timeout_s: float, spin_s: float = SPIN_S) -> None:
        """Receive the message tagged ``tag`` into ``buffer``, whose size must match."""
        ...

    async def recv_message(
        self, tag: int, max_bytes: int, timeout_s: float, spin_s: float = SPIN_S
    ) -> bytearray:
        """Receive the message tagged ``tag``, of any length up to ``max_bytes``, into host memory."""
        ...


TransportFactory = Callable[[], Transport]
"""Makes a transport, not yet started (a backend's class is one)."""
