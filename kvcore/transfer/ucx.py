"""UCX transport for KV pages: tagged messages between worker processes, the
:class:`~kvcore.transfer.transport.Transport` of backend ``"ucx"``.

Two ways to reach a peer, chosen per connection (docs/transfer.md compares them):

- ``UcxPath.WORKER_ADDRESS`` (default, bulk data): an endpoint from the peer's worker
  address (``RankInfo.transfer_endpoint``), error handling off, so UCX may use shared memory, cma and
  cuda_ipc; it reports no peer failure, so every receive has a timeout and every send may;
- ``UcxPath.LISTENER``: TCP to the peer's listener; a dead peer raises.

Receive semantics. UCX matches tags per worker, so a receive names only its tag
(see :mod:`kvcore.transfer.tags`), not a peer. A receive never posts a UCX request
before its message is there: it probes for the tag until the deadline, then receives
the matched message through its handle. So a receive that times out waiting leaves
nothing behind, and a late message stays queued for a later receive of its tag.
A matched message cannot be cancelled (UCX cancels only unmatched receives): if
its data has not landed by the deadline (the sender stalled or died mid-message),
the receive raises ``TransferTimeout`` and UCX may still write the buffer later.

Endpoints are never closed while the transport runs. A send that times out, fails or
is cancelled leaves its UCX request to finish in the background, on the same endpoint,
its buffer kept alive with it. Closing instead waited, in UCX's flush mode, for the peer
to take every message in flight: a stopped peer blocked the whole event loop for as long
as it stayed stopped (gRPC unanswered, the worker lost), and a closed endpoint broke the
peer's rendezvous sends back (``Request canceled``) even after both sides reconnected,
so a pair never healed. ``connect`` keeps the endpoint of a peer whose address is
unchanged; one of a peer at a new address (a restart), or one ``disconnect`` forgets, is
retired: kept referenced (ucxx's finalizer would close it, waiting) until ``close``.

One transport per process (``ucxx`` keeps one UCX worker per process), progressed in
ucxx's "blocking" mode by the event loop, and once a loop turn while a send or receive is in
flight (docs/transfer.md, "Progress and the event loop"): long compute belongs off the loop.
A request in flight is ucxx's own (``tag_send``, ``tag_recv_with_handle``), not its
coroutine: the process's poller (:mod:`kvcore.transfer.polled`) reads every request's
completion flag once a turn, where each request's coroutine resumed every turn to read its
own.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kvcore.transfer.buffers import as_ucx_array
from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.errors import TransferError, TransferTimeout, TransportClosed
from kvcore.transfer.pacing import OncePerTurn, next_turn
from kvcore.transfer.polled import POLLER
from kvcore.transfer.tags import check_tag
from kvcore.transfer.transport import POLL_S, SPIN_S
from kvcore.transfer.ucx_progress import install as install_progress
from kvcore.transfer.ucx_types import UcxPath

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
"""Environment that pins UCX to loopback (tests, benchmarks); set it before ``import ucxx``."""

PROGRESS_MODE = "blocking"  # progress in the event loop on worker events; no thread, no polling


class UcxTransport:
    """Tagged, timed send/recv of contiguous buffers to named peers.

    Invariants: ``connect(peer_id)`` opens the send direction to that peer only
    (receives need no connection); a peer id maps to at most one endpoint; a peer
    stays known (its ``EndpointInfo`` and path) from ``connect`` to ``disconnect``, so a
    send to a known peer whose endpoint a failure dropped reconnects first; after
    ``close()`` every call raises ``TransportClosed``.
    """

    backend = "ucx"

    def __init__(self, listen: bool = False, host: str = "127.0.0.1", port: int = 0):
        """``listen``: also accept TCP connections on ``port`` (0 = any free port).

        ``host`` is the address peers are told to dial; ucxx itself binds the listener
        on every interface (it takes no bind address).
        """
        if not 0 <= port < 1 << 16:
            raise ValueError(f"port: must be in [0, 65536), got {port}")
        self._listen, self._host, self._port = listen, host, port
        self._ucxx: Any = None
        self._context: Any = None  # ucxx ApplicationContext
        self._listener: Any = None
        self._endpoints: dict[str, Any] = {}  # peer id -> ucxx Endpoint (send direction)
        self._known: dict[str, tuple[EndpointInfo, UcxPath]] = {}  # peer id -> how to reach it
        self._accepted: list[Any] = []  # endpoints peers opened through the listener
        self._retired: list[Any] = []  # endpoints replaced or forgotten; never closed before close()
        self._unfinished: list[tuple[Any, Any]] = []  # (request, buffer) given up on, kept till done
        self._progress_turn = OncePerTurn()  # the worker is progressed once a loop turn
        self._started = self._closed = False

    async def start(self) -> None:
        """Create (or join) the process's UCX worker; start the listener if asked.

        Call from inside the event loop that will run the transfers.
        """
        if self._closed:
            raise TransportClosed("transport: closed; create a new one")
        if self._started:
            return
        import ucxx  # noqa: PLC0415 (UCX reads its environment once, when imported: here, not at the top)

        self._ucxx = ucxx
        if ucxx.core._ctx is None:  # first transport of this process picks the progress mode
            install_progress()
            ucxx.init(progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", PROGRESS_MODE))
        self._context = ucxx.core._get_ctx()  # the process's worker; ucxx has no public getter
        self._context.continuous_ucx_progress()
        if self._listen:
            self._listener = ucxx.create_listener(self._on_accept, port=self._port)
        self._started = True

    def local_info(self) -> EndpointInfo:
        self._check_open()
        port = self._listener.port if self._listener is not None else 0
        address = self._ucxx.get_worker_address().tobytes()
        return EndpointInfo(self.backend, address, self._host if port else "", port)

    async def close(self) -> None:
        """Stop: close every endpoint without waiting for its peer, and stop listening.
        Idempotent; receives waiting for a message raise ``TransportClosed``."""
        if self._closed:
            return
        self._closed = True
        for endpoint in [*self._endpoints.values(), *self._retired, *self._accepted]:
            _close_without_waiting(endpoint)
        self._endpoints.clear()
        self._known.clear()
        self._accepted.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def connect(self, peer_id: str, info: EndpointInfo, path: UcxPath = UcxPath.WORKER_ADDRESS) -> None:
        """Open the send direction to ``peer_id``: a no-op when it is open to the same
        address; a new address (a restarted peer) retires the old endpoint. ValueError
        naming the bad field (an endpoint of another backend names both)."""
        self._check_open()
        if not peer_id:
            raise ValueError("peer_id: must be non-empty")
        if info.backend != self.backend:
            raise ValueError(f"info.backend: {info.backend!r} is not this transport's {self.backend!r}")
        if not isinstance(path, UcxPath):
            raise ValueError(f"path: must be a UcxPath, got {path!r}")
        if self._known.get(peer_id) == (info, path) and peer_id in self._endpoints:
            return
        endpoint = await self._open(info, path)
        self._retire(peer_id)
        self._endpoints[peer_id], self._known[peer_id] = endpoint, (info, path)

    async def _open(self, info: EndpointInfo, path: UcxPath) -> Any:
        try:
            if path == UcxPath.WORKER_ADDRESS:
                endpoint = await self._connect_by_address(info)
            else:
                endpoint = await self._connect_by_listener(info)
        except (ValueError, TransferError):
            raise
        except Exception as e:  # ucxx raises its own error types
            self._check_open()
            raise TransferError(f"connect failed: {_status(e)}") from e
        if self._closed:  # closed while connecting
            _close_without_waiting(endpoint)
            raise TransportClosed("transport: closed while connecting")
        return endpoint

    def is_connected(self, peer_id: str) -> bool:
        return peer_id in self._endpoints

    def is_known(self, peer_id: str) -> bool:
        """Whether ``peer_id`` was connected and not disconnected since."""
        return peer_id in self._known

    async def disconnect(self, peer_id: str) -> None:
        """Forget ``peer_id`` (its endpoint retired, its sends in flight left to finish);
        no-op if absent."""
        self._known.pop(peer_id, None)
        self._retire(peer_id)

    def _retire(self, peer_id: str) -> None:
        endpoint = self._endpoints.pop(peer_id, None)
        if endpoint is not None:
            self._retired.append(endpoint)

    async def _connect_by_address(self, info: EndpointInfo) -> Any:
        if not info.address:
            raise ValueError("worker_address: empty; the peer has no UCX worker")
        address = self._ucxx.get_ucx_address_from_buffer(info.address)
        return await self._ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)

    async def _connect_by_listener(self, info: EndpointInfo) -> Any:
        if not info.host:
            raise ValueError("host: empty; the peer has no listener")
        if not 0 < info.port < 1 << 16:
            raise ValueError(f"port: must be in [1, 65536) for the listener path, got {info.port}")
        try:
            return await self._ucxx.create_endpoint(info.host, info.port)
        except Exception as e:  # ucxx raises its own error types
            raise TransferError(f"connect to {info.host}:{info.port} failed: {e}") from e

    async def _on_accept(self, endpoint: Any) -> None:
        """Keep peers' listener endpoints alive (dropping one closes the peer's side)."""
        if self._closed:
            _close_without_waiting(endpoint)
            return
        self._accepted = [ep for ep in self._accepted if not ep.closed]
        self._accepted.append(endpoint)

    async def send(self, peer_id: str, buffer: Any, tag: int, timeout_s: float | None = None) -> None:
        """Send ``buffer``'s bytes to ``peer_id`` under ``tag``.

        Returns once the buffer may be reused. On timeout (``timeout_s`` seconds, None =
        wait forever) raises ``TransferTimeout``, on a UCX error ``TransferError``; a send
        timed out or cancelled is left to finish in the background (the buffer stays
        referenced until it does: a pool page may still be read). ValueError for a peer
        not connected.
        """
        self._check_open()
        array = as_ucx_array(buffer, writable=False)
        tag = check_tag(tag)
        endpoint = self._endpoints.get(peer_id)
        if endpoint is None:
            raise ValueError(f"peer_id: {peer_id!r} is not connected")
        try:
            await self._drive(_tag_send(endpoint, array, tag), array, timeout_s)
        except TimeoutError:  # the request finishes in the background, if ever
            raise TransferTimeout(
                f"send of tag {tag:#x} to {peer_id!r} not taken within {timeout_s} s"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # ucxx raises its own error types (UCXXCanceledError, ...)
            self._check_open()
            raise TransferError(f"send of tag {tag:#x} to {peer_id!r} failed: {_status(e)}") from e

    async def recv(self, buffer: Any, tag: int, timeout_s: float, spin_s: float = SPIN_S) -> None:
        """Receive the message tagged ``tag`` into ``buffer``, whose size must match.

        Raises ``TransferTimeout`` if the message has not landed within ``timeout_s``
        seconds; the sender's identity plays no part (tags are per worker). The message is
        probed every loop turn for ``spin_s`` seconds, then every POLL_S.
        """
        self._check_open()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        array = as_ucx_array(buffer, writable=True)
        deadline = asyncio.get_running_loop().time() + timeout_s
        probe = await self._wait_for_message(check_tag(tag), deadline, timeout_s, spin_s)
        if probe.length != array.nbytes:
            await self._discard(probe)
            raise TransferError(
                f"recv of tag {tag:#x}: message has {probe.length} bytes, buffer has {array.nbytes}"
            )
        await self._land(array, probe, tag, deadline, timeout_s)

    async def recv_message(
        self, tag: int, max_bytes: int, timeout_s: float, spin_s: float = SPIN_S
    ) -> bytearray:
        """Receive the message tagged ``tag``, whatever its length up to ``max_bytes``, into
        host memory; as :meth:`recv` otherwise. A longer message is drained and refused
        with a TransferError naming both lengths."""
        self._check_open()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        probe = await self._wait_for_message(check_tag(tag), deadline, timeout_s, spin_s)
        if probe.length > max_bytes:
            await self._discard(probe)
            raise TransferError(
                f"recv of tag {tag:#x}: message has {probe.length} bytes, at most {max_bytes}"
            )
        data = bytearray(max(probe.length, 1))
        await self._land(as_ucx_array(data, writable=True), probe, tag, deadline, timeout_s)
        return data[: probe.length]

    async def _land(self, array: Any, probe: Any, tag: int, deadline: float, timeout_s: float) -> None:
        """Receive the matched message ``probe`` into ``array`` by ``deadline``."""
        try:
            request = self._context.worker.tag_recv_with_handle(array, probe)
            await self._drive(request, array, max(deadline - asyncio.get_running_loop().time(), 0))
        except TimeoutError:
            raise TransferTimeout(
                f"recv of tag {tag:#x}: message matched but its data did not land within {timeout_s} s"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # ucxx raises its own error types
            self._check_open()
            raise TransferError(f"recv of tag {tag:#x} failed: {_status(e)}") from e

    async def _wait_for_message(self, tag: int, deadline: float, timeout_s: float, spin_s: float) -> Any:
        """Probe (and dequeue) the message tagged ``tag``: every loop turn for ``spin_s``
        seconds, then every POLL_S seconds until ``deadline`` (event-loop time)."""
        loop = asyncio.get_running_loop()
        spin_until = loop.time() + spin_s
        while True:
            self._check_open()
            self._progress()
            probe = self._context.tag_probe(tag, remove=True)
            if probe.matched:
                return probe
            now = loop.time()
            if now >= deadline:
                raise TransferTimeout(f"recv of tag {tag:#x}: no message within {timeout_s} s")
            if now < spin_until:
                await next_turn()
            else:
                await asyncio.sleep(min(POLL_S, deadline - now))

    async def _drive(self, request: Any, buffer: Any, timeout_s: float | None) -> None:
        """Wait for the ucxx ``request`` (which reads or writes ``buffer``), progressing the
        worker once a loop turn meanwhile, then raise its failure if it failed; TimeoutError
        after ``timeout_s`` seconds (None = never). UCX's shared-memory transports raise no
        wakeup event when a message moves, so an armed worker left to its epoll descriptor
        would stall a transfer; an idle worker, driven by nobody, sleeps. Each turn yields the
        GIL first while the engine thread wants it (:mod:`kvcore.transfer.pacing`). A request
        given up on (timeout, cancellation) is kept, with its buffer, until it completes."""

        def completed() -> bool:
            self._progress()
            return request.completed

        try:
            if not request.completed:
                await asyncio.wait_for(POLLER.until(completed), timeout_s)
        except BaseException:
            self._keep_unfinished(request, buffer)
            raise
        request.check_error()

    def _keep_unfinished(self, request: Any, buffer: Any) -> None:
        self._unfinished = [(r, b) for r, b in self._unfinished if not r.completed]
        if not request.completed:
            self._unfinished.append((request, buffer))

    def _progress(self) -> None:
        """Progress the worker once per loop turn, however many transfers wait in the turn:
        one call moves every request in flight, so each waiter's own call only cost the
        loop's thread (and the GIL) more as transfers overlapped."""
        if self._progress_turn.first():
            self._context.worker.progress()

    async def _discard(self, probe: Any) -> None:
        """Drain a dequeued message that will not be delivered (UCX requires it)."""
        array = as_ucx_array(bytearray(max(probe.length, 1)), writable=True)  # a larger buffer takes it
        try:
            await self._context.recv_with_handle(array, probe)
        except Exception as e:  # ucxx raises its own error types
            self._check_open()
            raise TransferError(f"draining a refused message failed: {_status(e)}") from e

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("transport: closed")
        if not self._started:
            raise TransportClosed("transport: not started; call start() first")


def _close_without_waiting(endpoint: Any) -> None:
    """Start closing a ucxx endpoint and return at once (``abort`` waits, in UCX's flush
    mode, for the peer to take what is in flight: forever, for a stopped peer)."""
    if getattr(endpoint, "_ep", None) is not None:
        endpoint._ep.close()  # ucxx's non-blocking close; its Endpoint wrapper has none


def _status(error: BaseException) -> str:
    """A UCX failure as text: the error's type (ucxx names the UCS status by it) and message."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _tag_send(endpoint: Any, array: Any, tag: int) -> Any:
    """ucxx's ``Endpoint.send`` with ``force_tag``, less its wait: the request in flight."""
    from ucxx._lib.libucxx import UCXCloseError  # noqa: PLC0415 (as buffers.py)
    from ucxx.types import Tag  # noqa: PLC0415

    endpoint._ep.raise_on_error()
    if endpoint.closed:
        raise UCXCloseError("Endpoint closed")
    return endpoint._ep.tag_send(array, Tag(tag))
