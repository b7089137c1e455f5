"""The workers' health as the router sees it: Stats polls, losing a worker, readiness.

Invariants:
- Every registered worker is polled every STATS_INTERVAL_S, all of them concurrently; an
  answer refreshes its free and busy target-group pages and marks it healthy.
- A refused connection (UNAVAILABLE) is a dead process: the worker is lost at once; a
  slow answer may be a busy one: only ``misses`` timed-out polls in a row lose it.
- Losing a worker marks it unhealthy (its pairs get no traffic) and cancels every call
  that depends on it: requests that emitted nothing are retried elsewhere, the others fail
  UNAVAILABLE (dispatch.py).
- A DEGRADED pair (a transfer on it failed) or FAILED pair (its pairing failed for a
  transient reason) of healthy workers is re-paired in the background (``heal``), one
  attempt per pair at a time, once its retry delay is over (registry.retry_delay), until
  it is READY.
- The readiness service (``READY_SERVICE``) is SERVING exactly while a request can be
  served: a READY pair of healthy workers, or a healthy aggregated worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.grpc_server import NOT_SERVING, READY_SERVICE, SERVING, ServiceHealth
from services.router.cluster import Cluster
from services.router.dispatch import RequestFlow
from services.router.registry import PairState, Registry, Worker

STATS_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 2.0
STATS_MISSES = 2  # Stats polls a worker may miss (time out) before it counts as unhealthy
log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        cluster: Cluster,
        flows: Mapping[str, RequestFlow],
        timeout_s: float = STATS_TIMEOUT_S,
        misses: int = STATS_MISSES,
        heal: Callable[[str, str], Awaitable[bool]] | None = None,
    ) -> None:
        """``flows``: the requests in flight, by id; ``timeout_s``: each poll's deadline;
        ``heal``: re-runs a degraded pair's pairing (Registration.heal)."""
        self.cluster = cluster
        self.flows = flows
        self.timeout_s = timeout_s
        self.misses = misses
        self.heal = heal
        self.healing: set[tuple[str, str]] = set()  # degraded pairs being re-paired now
        self.readiness: ServiceHealth | None = None  # grpc.health.v1, if served

    async def poll_forever(self) -> None:
        """Poll every worker, then report readiness, every STATS_INTERVAL_S, forever."""
        while True:
            await self.poll()
            await asyncio.sleep(STATS_INTERVAL_S)

    async def poll(self) -> None:
        """One round: every registered worker's Stats, all at once (a stalled worker delays
        no other's poll), then readiness."""
        workers = [w for w in self.cluster.registry.workers.values() if w.id in self.cluster.channels]
        await asyncio.gather(*(self._poll(w) for w in workers))
        self._retry_pairs()
        if self.readiness is not None:
            serving = self.cluster.registry.is_serving()
            await self.readiness.set(READY_SERVICE, SERVING if serving else NOT_SERVING)

    def _retry_pairs(self) -> None:
        """Start re-pairing every due DEGRADED or FAILED pair of healthy workers not being
        re-paired."""
        registry = self.cluster.registry
        for key in registry.due_pairs(time.monotonic()):
            if self.heal is None or key in self.healing:
                continue
            if all(registry.workers[w].healthy for w in key):
                self.healing.add(key)
                self.cluster.spawn(self._heal(key))

    async def _heal(self, key: tuple[str, str]) -> None:
        try:
            await self.heal(*key)
        finally:
            self.healing.discard(key)

    def lose(self, worker_id: str) -> None:
        """``worker_id`` failed its health poll: cancel every call that depends on it."""
        for flow in self.flows.values():
            flow.lose(worker_id)

    async def _poll(self, worker: Worker) -> None:
        try:
            stats = await self.cluster.stats_stub(worker).Stats(wpb.StatsRequest(), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, AttributeError) as e:
            worker.missed += 1
            gone = isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
            if worker.healthy and (gone or worker.missed >= self.misses):
                why = "its process is gone" if gone else f"{worker.missed} Stats polls timed out"
                cause = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                log.warning("lost worker %s: %s (%s)", worker.id, why, cause)
                self.lose(worker.id)
                worker.healthy = False
            return
        if not worker.healthy:
            log.warning("worker %s answers again", worker.id)
        if stats.groups:
            target = stats.groups[0]
            busy = target.num_pages_used - target.num_pages_cached
            worker.free_pages = target.num_pages_total - busy
            worker.busy_pages = busy
        worker.healthy = True
        worker.missed = 0


def health_response(registry: Registry) -> cpb.HealthResponse:
    """The router's Health: serving or not, the live workers (those the health check has not
    lost) and ready pairs (degraded ones not counted), and every refused, failed or degraded
    pair with its reason."""
    serving = registry.is_serving()
    both = len(registry.live_ids(rpb.ROLE_BOTH))
    refused = [
        f"{p}->{d}: " + ("degraded: " if pair.state == PairState.DEGRADED else "") + pair.describe()
        for (p, d), pair in registry.pairs.items()
        if pair.state in (PairState.REFUSED, PairState.FAILED, PairState.DEGRADED)
    ]
    return cpb.HealthResponse(
        status=cpb.SERVING_STATUS_SERVING if serving else cpb.SERVING_STATUS_NOT_SERVING,
        num_prefill_workers=len(registry.live_ids(rpb.ROLE_PREFILL)) + both,
        num_decode_workers=len(registry.live_ids(rpb.ROLE_DECODE)) + both,
        num_ready_pairs=len(registry.ready_pairs()),
        num_aggregated_workers=both,
        message=("" if serving else "no ready prefill/decode pair. ") + "; ".join(refused),
        pairs=pair_statuses(registry),
    )


def pair_statuses(registry: Registry) -> list[cpb.PairStatus]:
    """Every prefill/decode pair with its state and reason, as Health and ModelInfo report."""
    return [
        cpb.PairStatus(
            prefill_instance_id=p, decode_instance_id=d, state=pair.state.value, reason=pair.describe()
        )
        for (p, d), pair in registry.pairs.items()
    ]
