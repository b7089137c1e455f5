"""A worker's graceful shutdown (on SIGTERM or SIGINT), before its server and engine stop.

1. Readiness NOT_SERVING; the registration loops stop (their heartbeats would register it
   again); every router is told the worker drains (Deregister, draining): it sends no new
   request, and the calls it makes in a race are refused (request_rpc.py: UNAVAILABLE, so
   the router retries them on another worker).
2. Wait, up to ``timeout_s``, until no request RPC runs and no request holds pages (a
   reservation whose Decode has not come counts).
3. If some remain: every request in the engine fails with WorkerShutdown (its RPC ends
   UNAVAILABLE naming the timeout), reservations no Decode took are dropped
   (``worker.on_shutdown``), and the calls get CUT_WAIT_S to end.
4. Every router is told the worker is gone (Deregister), and one line says how it went,
   pages still held included (0 on a clean shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.grpc_server import NOT_SERVING, READY_SERVICE, ServiceHealth
from services.worker.request_rpc import WorkerShutdown
from services.worker.worker import WorkerBase

log = logging.getLogger(__name__)

POLL_S = 0.05
CUT_WAIT_S = 5.0


async def shut_down(
    worker: WorkerBase, health: ServiceHealth, registration: asyncio.Task, timeout_s: float
) -> int:
    """Drain ``worker`` (``registration``: its register_forever task); returns how many
    request RPCs were cut short."""
    who = worker.config.instance_id
    worker.draining = f"worker {who} is shutting down: it takes no new requests"
    await health.set(READY_SERVICE, NOT_SERVING)
    registration.cancel()
    links = worker.links
    if links is not None:
        await links.deregister(draining=True)
    start = time.monotonic()
    log.info(
        "shutting down: deregistered; %d request calls in flight, %d pages held, waiting up to %g s",
        worker.in_flight,
        worker.busy_pages(),
        timeout_s,
    )
    await _until_idle(worker, start + timeout_s)
    cut = worker.in_flight
    if not _idle(worker):
        log.warning("shutdown timeout: failing %d request calls and dropping their pages", cut)
        error = WorkerShutdown(
            f"worker {who} shut down: the request did not finish within the shutdown timeout "
            f"({timeout_s:g} s, --shutdown-timeout-s)"
        )
        await worker.loop.fail_all(error)
        for hook in worker.on_shutdown:
            await hook()
        await _until_idle(worker, time.monotonic() + CUT_WAIT_S)
    if links is not None:
        await links.deregister(draining=False)
    log.info(
        "shutdown: %d request calls cut short in %.2f s; pages still held by requests: %d",
        cut,
        time.monotonic() - start,
        worker.busy_pages(),
    )
    return cut


def _idle(worker: WorkerBase) -> bool:
    return worker.in_flight == 0 and worker.busy_pages() == 0


async def _until_idle(worker: WorkerBase, deadline: float) -> None:
    while not _idle(worker) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
