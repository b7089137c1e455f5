"""The router's graceful shutdown (on SIGTERM or SIGINT), before its servers close.

1. Stop admitting, at once: gRPC health ("" and readiness) NOT_SERVING, so load balancers
   drain it; Tandem.Health and HTTP /health answer NOT_SERVING / 503 naming the reason; a
   new request is refused with UNAVAILABLE (HTTP 503) saying the router is shutting down.
   Worker registrations and heartbeats are still served: the requests in flight need
   their workers.
2. Wait for the requests in flight to end, up to ``timeout_s``.
3. Cut the rest short: each ends with an error naming the timeout (RequestFlow.cut_short),
   its calls to workers cancelled, so the workers free their pages.

The caller then closes the HTTP server, the worker channels and the gRPC server.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.grpc_server import NOT_SERVING, READY_SERVICE, ServiceHealth
from services.router.api import RouterAPI

log = logging.getLogger(__name__)

POLL_S = 0.05
CUT_WAIT_S = 5.0  # how long the cut requests get to send their error and end
REFUSAL = "router is shutting down: it admits no new requests; send them to another replica"


async def shut_down(router: RouterAPI, health: ServiceHealth, timeout_s: float) -> int:
    """Stop admitting, let the requests in flight finish within ``timeout_s`` seconds, cut
    the rest short; returns how many were cut."""
    router.refusing = REFUSAL
    router.health_monitor.readiness = None  # its polls must not report the router ready again
    await health.set(READY_SERVICE, NOT_SERVING)
    await health.set("", NOT_SERVING)
    running = len(router.flows)
    log.info("shutting down: admitting no new requests; %d in flight, waiting up to %g s", running, timeout_s)
    start = time.monotonic()
    await _until_empty(router, start + timeout_s)
    cut = list(router.flows.values())
    if cut:
        cause = (
            f"router shut down: the request did not finish within the shutdown timeout "
            f"({timeout_s:g} s, --shutdown-timeout-s)"
        )
        log.warning("shutdown timeout: cutting %d requests short", len(cut))
        for flow in cut:
            flow.cut_short(cause)
        await _until_empty(router, time.monotonic() + CUT_WAIT_S)
    log.info(
        "shutdown: %d requests finished, %d cut short, in %.2f s",
        running - len(cut),
        len(cut),
        time.monotonic() - start,
    )
    return len(cut)


async def _until_empty(router: RouterAPI, deadline: float) -> None:
    while router.flows and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
