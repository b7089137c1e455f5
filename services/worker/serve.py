"""Running one worker process: engine, gRPC server, metrics, registration.

``run_worker`` knows no role: the caller passes the function that adds the role's
servicers (services/worker_roles.py maps each role to its own), so this runtime imports
none of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable

import grpc

from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.access import worker_policy
from services.common.grpc_server import NOT_SERVING, READY_SERVICE, SERVING, start_server, wait_for_stop
from services.common.loop_watch import watch_loop
from services.common.metrics import serve_metrics
from services.common.periodic import every
from services.common.ports import PortInUse
from services.engine.config import forced_acceptance_banner
from services.worker.engine_loop import SWITCH_INTERVAL_S
from services.worker.peering import PeerRegistry
from services.worker.shutdown import shut_down
from services.worker.stats_log import WorkerStatsLine
from services.worker.worker import WorkerBase, WorkerConfig

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server, WorkerBase, PeerRegistry], None]
"""Adds a role's servicers to the worker's gRPC server, given the started worker and its
side of pairing (whose Registration servicer ``run_worker`` adds itself)."""


async def run_worker(
    config: WorkerConfig,
    add_servicers: AddServicers,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    model_name: str = "",
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT), then shut down gracefully
    (shutdown.py: deregister, finish or fail the requests in flight within
    ``config.process.shutdown_timeout_s``) and stop. Prints one line with the endpoints.
    ``add_servicers``: the role's (``WORKER_ROLES[config.role]``); ``model_name``: the
    metrics' model_name label; "" = the model folder's name. A worker forcing acceptance
    (benchmarks only) says so in a WARNING banner before anything else. A busy port (gRPC,
    metrics) stops the engine and raises PortInUse."""
    if config.engine.forced_acceptance >= 0:
        warn_forced_acceptance(config.engine.forced_acceptance)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the engine thread gets the GIL back within it
    worker = WorkerBase(config)
    worker.metrics.model_name = model_name or os.path.basename(os.path.normpath(config.engine.model))
    await worker.start()
    peers = PeerRegistry(worker.rank_info, worker.agent, worker.metrics, worker.rank_infos)
    worker.peers = peers

    def add(server: grpc.aio.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(peers, server)
        add_servicers(server, worker, peers)

    try:
        server, health, port = await start_server(
            add, config.host, config.port, config.tls, worker_policy(config.own_token, config.tls is not None)
        )
    except PortInUse:
        await worker.stop()
        raise
    worker.grpc_address = f"{config.host}:{port}"
    try:
        metrics_port = serve_metrics(worker.metrics, config.host, config.metrics_port)
    except PortInUse:
        await server.stop(grace=None)
        await worker.stop()
        raise
    await health.set("", SERVING)
    print(
        f"{config.role} {config.instance_id} grpc={worker.grpc_address} "
        f"metrics=http://{config.host}:{metrics_port}/metrics",
        flush=True,
    )

    async def report_ready(flag: bool) -> None:
        await health.set(READY_SERVICE, SERVING if flag else NOT_SERVING)

    registration = asyncio.ensure_future(worker.register_forever(report_ready))
    watch = asyncio.ensure_future(watch_loop(worker.metrics.loop_lag.observe))
    stats = asyncio.ensure_future(every(config.process.stats_interval_s, WorkerStatsLine(worker).tick))
    if ready is not None:
        ready.set()
    await wait_for_stop(stop)
    await shut_down(worker, health, registration, config.process.shutdown_timeout_s)
    watch.cancel()
    stats.cancel()
    await server.stop(grace=1)
    await worker.stop()


def warn_forced_acceptance(accept: int) -> None:
    """The banner of a process that forces acceptance: a WARNING, framed so it stands out."""
    rule = "!" * 100
    for line in (rule, forced_acceptance_banner(accept), rule):
        log.warning("%s", line)
