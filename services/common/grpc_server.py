"""Starting a service: a grpc.aio server with the standard health service, on a host:port."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def start_server(add_servicers: Callable[[grpc.aio.Server], None], host: str, port: int,
                       ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start a server on ``host:port`` (0 = any free port) with ``grpc.health.v1``, whose
    overall status starts NOT_SERVING. Returns the server, its health servicer and the port."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", NOT_SERVING)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"port: cannot bind {host}:{port}")
    await server.start()
    return server, health_servicer, bound


async def invalid_argument(context: grpc.aio.ServicerContext, field: str, problem: str) -> None:
    """End the RPC with INVALID_ARGUMENT naming the field."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
