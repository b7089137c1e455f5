"""An in-memory :class:`~kvcore.transfer.Transport` for tests: the transports of one
:class:`FakeNetwork`, all on one event loop, hand each other copies of their messages.

It keeps the protocol's rules without a wire: a message waits in its receiver's queue of
its tag until a receive of that tag takes it (a receive names no peer), a receive that
times out leaves nothing behind, a message of another size than the buffer is refused
naming both, a send needs a connected peer, an endpoint of another backend is refused,
and after ``close`` every call raises TransportClosed. A send returns at once: its bytes
are copied as it is made.
"""

from __future__ import annotations

import asyncio
import itertools

import torch

from kvcore.transfer import EndpointInfo, TransferError, TransferTimeout, TransportClosed
from kvcore.transfer.tags import check_tag
from kvcore.transfer.transport import SPIN_S, Buffer

_CLOSED = None  # what a closing transport puts in its queues: their waiting receives raise


class FakeNetwork:
    """The transports one test connects, by address."""

    def __init__(self) -> None:
        self.transports: dict[bytes, FakeTransport] = {}
        self._names = itertools.count()

    def transport(self) -> FakeTransport:
        return FakeTransport(self, f"fake-{next(self._names)}".encode())


class FakeTransport:
    """Tagged messages between transports of one network and one event loop."""

    backend = "fake"

    def __init__(self, network: FakeNetwork, address: bytes) -> None:
        self.network, self.address = network, address
        self._queues: dict[int, asyncio.Queue[bytes | None]] = {}  # tag -> messages not received
        self._peers: dict[str, bytes] = {}  # peer id -> its address
        self._started = self._closed = False

    async def start(self) -> None:
        self._check(started=False)
        self.network.transports[self.address] = self
        self._started = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.network.transports.pop(self.address, None)
        for queue in self._queues.values():
            queue.put_nowait(_CLOSED)

    def local_info(self) -> EndpointInfo:
        self._check()
        return EndpointInfo(self.backend, self.address)

    async def connect(self, peer_id: str, info: EndpointInfo) -> None:
        self._check()
        if not peer_id:
            raise ValueError("peer_id: must be non-empty")
        if info.backend != self.backend:
            raise ValueError(f"info.backend: {info.backend!r} is not this transport's {self.backend!r}")
        if info.address not in self.network.transports:
            raise TransferError(f"connect failed: no transport at {info.address!r}")
        self._peers[peer_id] = info.address

    async def disconnect(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    async def send(self, peer_id: str, buffer: Buffer, tag: int, timeout_s: float | None = None) -> None:
        self._check()
        address = self._peers.get(peer_id)
        if address is None:
            raise ValueError(f"peer_id: {peer_id!r} is not connected")
        peer = self.network.transports.get(address)
        if peer is None:
            raise TransferError(f"send of tag {tag:#x} to {peer_id!r} failed: the peer is closed")
        peer._queue(check_tag(tag)).put_nowait(_bytes_of(buffer))
        await asyncio.sleep(0)

    async def recv(self, buffer: Buffer, tag: int, timeout_s: float, spin_s: float = SPIN_S) -> None:
        landing = _landing(buffer)
        data = await self._take(tag, timeout_s)
        if len(data) != landing.numel():
            raise TransferError(
                f"recv of tag {tag:#x}: message has {len(data)} bytes, buffer has {landing.numel()}"
            )
        if data:
            landing.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    async def recv_message(
        self, tag: int, max_bytes: int, timeout_s: float, spin_s: float = SPIN_S
    ) -> bytearray:
        data = await self._take(tag, timeout_s)
        if len(data) > max_bytes:
            raise TransferError(f"recv of tag {tag:#x}: message has {len(data)} bytes, at most {max_bytes}")
        return bytearray(data)

    async def _take(self, tag: int, timeout_s: float) -> bytes:
        """The next message of ``tag`` within ``timeout_s``; a timeout takes none."""
        self._check()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        queue = self._queue(check_tag(tag))
        try:
            data = await asyncio.wait_for(queue.get(), timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"recv of tag {tag:#x}: no message within {timeout_s} s") from None
        if data is _CLOSED:
            queue.put_nowait(_CLOSED)  # for the next receive waiting on it
            raise TransportClosed("transport: closed")
        return data

    def _queue(self, tag: int) -> asyncio.Queue[bytes | None]:
        return self._queues.setdefault(tag, asyncio.Queue())

    def _check(self, started: bool = True) -> None:
        if self._closed:
            raise TransportClosed("transport: closed")
        if started and not self._started:
            raise TransportClosed("transport: not started; call start() first")


def _bytes_of(buffer: Buffer) -> bytes:
    """A copy of ``buffer``'s bytes (a tensor's on its device, copied to the host)."""
    if isinstance(buffer, torch.Tensor):
        return _tensor_bytes(buffer).cpu().numpy().tobytes()
    return bytes(buffer)


def _landing(buffer: Buffer) -> torch.Tensor:
    """``buffer`` as a writable uint8 tensor sharing its memory; ValueError naming ``buffer``."""
    if isinstance(buffer, bytearray):
        return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(
            f"buffer: must be a tensor or a bytearray to receive into, got {type(buffer).__name__}"
        )
    return _tensor_bytes(buffer)


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"buffer: tensor must be contiguous, got strides {tensor.stride()}")
    return tensor.detach().reshape(-1).view(torch.uint8)  # [nbytes]
