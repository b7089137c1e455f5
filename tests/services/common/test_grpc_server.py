"""A Tandem gRPC server as grpcurl and Kubernetes probes meet it: server reflection lists
and describes every service without the .proto files, and grpc.health.v1 answers per
service name (Registration as liveness, the rest as readiness)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common.grpc_server import NOT_SERVING, READY_SERVICE, SERVING, start_server
from services.common.ports import PortInUse
from services.router.server import add_router_servicers
from tests.services.router.helpers import router


def _served(check):
    """Run ``check(port, statuses)`` in a thread against a router's server (live, not ready)."""
    api = router()

    async def scenario():
        server, statuses, port = await start_server(lambda s: add_router_servicers(s, api), "127.0.0.1", 0)
        await statuses.set("", SERVING)
        try:
            return await asyncio.to_thread(check, port, statuses, asyncio.get_running_loop())
        finally:
            await server.stop(None)
            await api.close()

    return asyncio.run(scenario())


def test_reflection_lists_and_describes_every_service_without_the_protos():
    def check(port, statuses, loop):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = sorted(database.get_services())
            pool = descriptor_pool.DescriptorPool(database)
            generate = pool.FindServiceByName("tandem.v1.Tandem").methods_by_name["Generate"]
            return services, generate.output_type.full_name, generate.server_streaming

    services, output, streaming = _served(check)
    assert services == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "tandem.v1.Registration",
        "tandem.v1.Tandem",
    ]
    assert (output, streaming) == ("tandem.v1.GenerateResponse", True)


def test_health_answers_by_service_name():
    def check(port, statuses, loop):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(name):
                try:
                    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                except grpc.RpcError as e:
                    return e.code().name

            names = ("", "tandem.v1.Registration", "tandem.v1.Tandem", READY_SERVICE, "no.such.Service")
            before = [status(n) for n in names]
            asyncio.run_coroutine_threadsafe(statuses.set(READY_SERVICE, SERVING), loop).result(5)
            return before, [status(n) for n in names]

    before, after = _served(check)
    assert before == [SERVING, SERVING, NOT_SERVING, NOT_SERVING, "NOT_FOUND"]
    assert after == [SERVING, SERVING, SERVING, SERVING, "NOT_FOUND"]


def test_a_second_server_on_the_same_port_is_refused_naming_it():
    """No SO_REUSEPORT: the second bind fails instead of sharing the port's clients."""

    async def scenario():
        first, _, port = await start_server(lambda s: None, "127.0.0.1", 0)
        try:
            with pytest.raises(PortInUse, match=f"gRPC port 127.0.0.1:{port} is in use"):
                await start_server(lambda s: None, "127.0.0.1", port)
        finally:
            await first.stop(None)
        second, _, again = await start_server(lambda s: None, "127.0.0.1", port)  # free again
        await second.stop(None)
        return again == port

    assert asyncio.run(scenario())
