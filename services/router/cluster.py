"""The router's reach into the workers: who is registered, and the channel to each.

Invariants:
- ``channels`` has one open channel per registered worker id (``connect`` replaces an
  older one, ``disconnect`` closes it); a worker absent from ``channels`` gets no calls.
- ``links`` has a Steps stream (step_links.py) per registered decode or aggregated worker,
  closed with its channel, unless ``step_streams`` is off.
- Background work (pair tests, releases) runs as tasks ``spawn`` keeps alive until they
  end; ``close`` cancels them and closes every channel.
- Every unary call to a worker has a deadline from ``deadlines`` (set from the router's
  flags), and a Decode stream an idle deadline between its messages; an aggregated worker's
  Generate (whose first message waits for that worker's own queue) ends with the health
  check losing its worker or the client's cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc

from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.security import TlsConfig, aio_channel, worker_token
from services.router.registry import Registry, Worker
from services.router.step_links import Attached, StepsLink

CALL_TIMEOUT_S = 10.0
PREFILL_TIMEOUT_S = 120.0
PREFILL_PER_1K_TOKENS_S = 10.0  # a slow CPU prefills a 32K-token prompt of the tiny pair in minutes
STREAM_IDLE_TIMEOUT_S = 300.0  # a queued or preempted request sends nothing meanwhile: generous
MIN_RENEW_S = 0.5  # the shortest wait between two renewals of a lease


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds the router waits on each call to a worker before it retries elsewhere."""

    call_s: float = CALL_TIMEOUT_S  # Reserve, Release, Renew: a live worker answers between two steps
    prefill_s: float = PREFILL_TIMEOUT_S  # Prefill: its queue, the prompt's run and the page transfer
    stream_idle_s: float = STREAM_IDLE_TIMEOUT_S  # Decode: from one message to the next
    prefill_per_1k_s: float = PREFILL_PER_1K_TOKENS_S  # added to prefill_s per 1,000 prompt tokens

    def prefill_for(self, num_tokens: int) -> float:
        """The Prefill deadline of a prompt of ``num_tokens``: it grows with the prompt."""
        return self.prefill_s + self.prefill_per_1k_s * num_tokens / 1000

    def describe_prefill(self, num_tokens: int) -> str:
        return (
            f"{self.prefill_for(num_tokens):.3g} s (--prefill-timeout-s {self.prefill_s:g} plus "
            f"--prefill-timeout-per-1k-tokens-s {self.prefill_per_1k_s:g} per 1,000 tokens)"
        )


class Cluster:
    def __init__(self, registry: Registry, tls: TlsConfig | None = None, service_secret: str = "") -> None:
        self.registry = registry
        self.deadlines = Deadlines()  # replaced by the router's flags (services/router/main.py)
        self.tls = tls
        self.service_secret = service_secret  # calls to worker X carry X's worker token
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.step_streams = True  # chunks come on Steps streams (off: the router's --no-step-streams)
        self.links: dict[str, StepsLink] = {}  # worker id -> its Steps stream
        self.count_step_chunks: Callable[[int], None] = lambda n: None  # chunks that came on them
        self._tasks: set[asyncio.Task] = set()
        self._salt, self._serials = secrets.token_hex(3), itertools.count(1)
        self.started = time.monotonic()  # requests may wait a while for the first workers
        self.startup_wait_s = 0.0  # how long: RouterSettings.startup_wait_s

    def next_serial(self) -> str:
        """A request flow's serial: never the same twice in this process, nor (a random
        salt) in a restarted router's, whose workers may still hold the old one's attempts."""
        return f"{self._salt}{next(self._serials)}"

    async def connect(self, info: rpb.RankInfo) -> None:
        """Open the channel to a (re-)registering worker, closing the one it had, and its
        Steps stream when it streams tokens (a decode or aggregated worker)."""
        await self.disconnect(info.instance_id)
        token = worker_token(self.service_secret, info.instance_id) if self.service_secret else ""
        channel = self.channels[info.instance_id] = aio_channel(info.grpc_address, self.tls, token)
        if self.step_streams and info.role in (rpb.ROLE_DECODE, rpb.ROLE_BOTH):
            self.links[info.instance_id] = StepsLink(channel, info.instance_id, self.count_step_chunks)

    async def disconnect(self, worker_id: str) -> None:
        link = self.links.pop(worker_id, None)
        if link is not None:
            link.close()
        channel = self.channels.pop(worker_id, None)
        if channel is not None:
            await channel.close()

    def attach_steps(self, worker_id: str, attempt: str) -> Attached:
        """Where ``attempt``'s chunks from ``worker_id`` will come, and its call's metadata:
        (None, None) when they come on the call itself (no Steps stream ready)."""
        link = self.links.get(worker_id)
        return link.attach(attempt) if link is not None else (None, None)

    def detach_steps(self, worker_id: str, attempt: str) -> None:
        if (link := self.links.get(worker_id)) is not None:
            link.detach(attempt)

    def decode_stub(self, worker_id: str) -> wpb_grpc.DecodeWorkerStub:
        return wpb_grpc.DecodeWorkerStub(self.channels[worker_id])

    def prefill_stub(self, worker_id: str) -> wpb_grpc.PrefillWorkerStub:
        return wpb_grpc.PrefillWorkerStub(self.channels[worker_id])

    def stats_stub(self, worker: Worker) -> wpb_grpc.DecodeWorkerStub | wpb_grpc.PrefillWorkerStub:
        """Where ``worker`` answers Stats: DecodeWorker on decode workers, PrefillWorker on
        prefill and aggregated ones."""
        if worker.role == rpb.ROLE_DECODE:
            return self.decode_stub(worker.id)
        return self.prefill_stub(worker.id)

    def tandem_stub(self, worker_id: str) -> cpb_grpc.TandemStub:
        """An aggregated worker's client API."""
        return cpb_grpc.TandemStub(self.channels[worker_id])

    async def release(self, decode_id: str, request_id: str) -> None:
        """Free a reservation on a decode worker; a gone worker or lease holds nothing.
        Shielded: a caller cancelled meanwhile does not cancel the Release it sent."""
        if decode_id not in self.channels:
            return
        release = wpb.ReleaseRequest(request_id=request_id)
        call = self.decode_stub(decode_id).Release(release, timeout=self.deadlines.call_s)
        await asyncio.shield(self.spawn(_quietly(call)))

    async def keep_reserved(self, decode_id: str, request_id: str, lease_deadline_unix_ms: int) -> None:
        """Renew a reservation's lease on ``decode_id`` a third of the way into each lease,
        until cancelled (its Prefill answered) or the worker says it is gone. A router that
        dies stops renewing, so the lease still frees what it held."""
        left_s = max(lease_deadline_unix_ms / 1000 - time.time(), MIN_RENEW_S * 3)
        renew = wpb.RenewRequest(request_id=request_id)
        while decode_id in self.channels:
            await asyncio.sleep(left_s / 3)
            try:
                answer = await self.decode_stub(decode_id).Renew(renew, timeout=self.deadlines.call_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return
                continue  # slow or briefly unreachable: the lease left covers the next try
            left_s = max(answer.lease_deadline_unix_ms / 1000 - time.time(), MIN_RENEW_S * 3)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` in the background, kept alive until it ends or ``close``."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for link in self.links.values():
            link.close()
        self.links.clear()
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()


async def _quietly(call: grpc.aio.UnaryUnaryCall) -> None:
    """Await a Release. On an error (the worker gone, stalled past the deadline, or its
    lease already expired) the worker's lease frees whatever it still holds."""
    try:
        await call
    except grpc.aio.AioRpcError:
        pass
