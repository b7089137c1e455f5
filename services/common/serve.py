"""Running one worker process: engine, gRPC server, metrics, registration."""

from __future__ import annotations

import asyncio
import os
import signal

from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import NOT_SERVING, READY_SERVICE, SERVING, start_server
from services.common.metrics import serve_metrics
from services.common.peering import PeerRegistry
from services.common.worker import WorkerBase, WorkerConfig


async def run_worker(
    config: WorkerConfig,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    model_name: str = "",
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT). Prints one line with the endpoints.
    ``model_name``: the metrics' model_name label; "" = the model folder's name."""
    worker = WorkerBase(config)
    worker.metrics.model_name = model_name or os.path.basename(os.path.normpath(config.engine.model))
    await worker.start()
    peers = PeerRegistry(worker.rank_info, worker.agent, worker.metrics, config.token, worker.rank_infos)
    worker.peers = peers

    def add(server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(peers, server)
        if config.role == "prefill":
            from services.prefill.server import PrefillServicer

            wpb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker, peers), server)
        elif config.role == "decode":
            from services.decode.server import DecodeServicer

            wpb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), server)
        else:
            from services.aggregated.server import AggregatedServicer, AggregatedStats

            cpb_grpc.add_TandemServicer_to_server(AggregatedServicer(worker), server)
            wpb_grpc.add_PrefillWorkerServicer_to_server(AggregatedStats(worker), server)

    server, health, port = await start_server(add, config.host, config.port, config.tls, config.token)
    worker.grpc_address = f"{config.host}:{port}"
    metrics_port = serve_metrics(worker.metrics, config.host, config.metrics_port)
    await health.set("", SERVING)
    print(
        f"{config.role} {config.instance_id} grpc={worker.grpc_address} "
        f"metrics=http://{config.host}:{metrics_port}/metrics",
        flush=True,
    )

    async def report_ready(flag: bool) -> None:
        await health.set(READY_SERVICE, SERVING if flag else NOT_SERVING)

    registration = asyncio.ensure_future(worker.register_forever(report_ready))
    if ready is not None:
        ready.set()
    await _wait_for_stop(stop)
    registration.cancel()
    await server.stop(grace=1)
    await worker.stop()


async def _wait_for_stop(stop: asyncio.Event | None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
