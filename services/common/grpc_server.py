"""Starting a service (a grpc.aio server with the standard health service, on a host:port)
and waiting for its stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.access import AccessCheck, AccessPolicy
from services.common.ports import PortInUse, is_busy
from services.common.security import TlsConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_SERVICE = "tandem.ready"
"""Health service name of readiness: SERVING once the process can take traffic (a worker:
registered and paired; the router: at least one ready pair). "" is liveness."""


class ServiceHealth:
    """The server's grpc.health.v1 statuses: "" is liveness and READY_SERVICE readiness;
    each served service answers by its own name too: ``tandem.v1.Registration`` as
    liveness, every other one (what clients or the router call to get work done) as
    readiness. Set only "" and READY_SERVICE; the names follow."""

    def __init__(self, servicer: health.aio.HealthServicer, services: list[str]) -> None:
        self.servicer = servicer
        self.live = [n for n in services if n.endswith(".Registration")]
        self.ready = [n for n in services if n not in self.live]

    async def set(self, name: str, status) -> None:
        await self.servicer.set(name, status)
        for follower in {"": self.live, READY_SERVICE: self.ready}.get(name, []):
            await self.servicer.set(follower, status)


class _Recording:
    """Stands in for the server while servicers are added, to learn their service names."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server, self.names = server, []

    def add_registered_method_handlers(self, name: str, handlers) -> None:
        self.names.append(name)
        self.server.add_registered_method_handlers(name, handlers)

    def __getattr__(self, attribute: str):
        return getattr(self.server, attribute)


async def start_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    tls: TlsConfig | None = None,
    policy: AccessPolicy | None = None,
) -> tuple[grpc.aio.Server, ServiceHealth, int]:
    """Start a server on ``host:port`` (0 = any free port) with ``grpc.health.v1`` (every
    status NOT_SERVING at first) and server reflection, with mutual TLS and ``policy`` (who
    may call what) when given. Returns the server, its health statuses and the port. The
    port is the server's alone (no ``SO_REUSEPORT``): a busy one raises PortInUse."""
    server = grpc.aio.server(
        interceptors=[AccessCheck(policy)] if policy else None,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),  # the port is this server's alone (services/common/ports.py)
        ],
    )
    recording = _Recording(server)
    add_servicers(recording)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*recording.names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    statuses = ServiceHealth(health_servicer, recording.names)
    await statuses.set("", NOT_SERVING)
    await statuses.set(READY_SERVICE, NOT_SERVING)
    bound = _bind(server, host, port, tls)
    await server.start()
    return server, statuses, bound


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    """The port ``server`` listens on at ``host:port``; PortInUse when another socket holds
    it. A probe asks first (a failed gRPC bind logs a line of its own) and after a failed
    bind (gRPC says only that it failed)."""
    address = f"{host}:{port}"
    if port and is_busy(host, port):
        raise PortInUse("gRPC", address)
    try:
        bound = (
            server.add_secure_port(address, tls.server_credentials())
            if tls
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0 and port and is_busy(host, port):
        raise PortInUse("gRPC", address)
    if bound == 0:
        raise OSError(f"port: cannot bind {address}")
    return bound


async def write_stream(messages: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
    """Serve a response stream by writing, not yielding: a client's cancel then lands in the
    handler coroutine, and ``messages``' cleanup (freeing pages, releasing reservations) runs
    at once instead of whenever the suspended generator is collected."""
    try:
        async for message in messages:
            await context.write(message)
    finally:
        await messages.aclose()


async def invalid_argument(context: grpc.aio.ServicerContext, field: str, problem: str) -> None:
    """End the RPC with INVALID_ARGUMENT naming the field."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


async def wait_for_stop(stop: asyncio.Event | None) -> None:
    """Return once ``stop`` is set or the process gets SIGTERM/SIGINT."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
