"""Who may call what, over real gRPC sockets: a router's client and service calls, and a
worker's (every method a service call), with tokens; certificates in tests/e2e/test_security.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.access import router_policy, worker_policy
from services.common.grpc_server import start_server
from services.common.security import aio_channel, token_worker, worker_token
from services.router.server import add_router_servicers
from tests.services.router.helpers import rank_info, router

CLIENT, SECRET = "client-token", "service-secret"


def test_a_worker_token_proves_its_instance_id_and_no_other():
    token = worker_token(SECRET, "decode.0")
    assert token.startswith("decode.0.") and token_worker(SECRET, token) == "decode.0"
    assert token_worker("another-secret", token) is None
    assert token_worker(SECRET, "decode.1." + token.rpartition(".")[2]) is None
    assert token_worker(SECRET, CLIENT) is None


def _calls(policy, calls):
    """Serve a router under ``policy`` and run ``calls(port)``; returns what it returns."""
    api = router()

    async def scenario():
        server, _, port = await start_server(
            lambda s: add_router_servicers(s, api), "127.0.0.1", 0, None, policy
        )
        try:
            return await calls(port)
        finally:
            await server.stop(None)
            await api.close()

    return asyncio.run(scenario())


async def _status(call) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def test_the_router_takes_client_calls_with_the_client_token_and_registrations_with_worker_tokens():
    d0 = rank_info("d0", rpb.ROLE_DECODE)

    async def calls(port):
        address, results = f"127.0.0.1:{port}", {}
        for name, token in (("none", ""), ("client", CLIENT), ("d0", worker_token(SECRET, "d0"))):
            async with aio_channel(address, token=token) as channel:
                tandem, registry = cpb_grpc.TandemStub(channel), reg_grpc.RegistrationStub(channel)
                results[name] = (
                    await _status(tandem.Health(cpb.HealthRequest(), timeout=5)),
                    await _status(tandem.ModelInfo(cpb.ModelInfoRequest(), timeout=5)),
                    await _status(registry.Register(reg.RegisterRequest(rank_info=d0), timeout=5)),
                    await _status(
                        registry.Register(reg.RegisterRequest(rank_info=rank_info("d1", 2)), timeout=5)
                    ),
                )
        return results

    results = _calls(router_policy(CLIENT, SECRET, certificates=False), calls)
    unauthenticated = "UNAUTHENTICATED: authorization: missing or wrong bearer token"
    assert results["none"] == ("OK", unauthenticated, unauthenticated, unauthenticated)
    refused = (
        "PERMISSION_DENIED: authorization: the client token cannot call /tandem.v1.Registration/Register "
        "(service calls need a worker token)"
    )
    assert results["client"] == ("OK", "OK", refused, refused)
    assert results["d0"] == (
        "OK",
        "PERMISSION_DENIED: authorization: a worker token cannot call /tandem.v1.Tandem/ModelInfo "
        "(client calls need the client token)",
        "OK",
        "PERMISSION_DENIED: rank_info.instance_id: 'd1' is not this credential's ('d0')",
    )


@pytest.mark.parametrize("token", ["", CLIENT, "d1", "d0"])
def test_a_worker_takes_every_call_only_with_its_own_token(token):
    own = worker_token(SECRET, "d0")
    sent = worker_token(SECRET, token) if token in ("d0", "d1") else token

    async def calls(port):
        async with aio_channel(f"127.0.0.1:{port}", token=sent) as channel:
            stub = cpb_grpc.TandemStub(channel)
            return (
                await _status(stub.Health(cpb.HealthRequest(), timeout=5)),
                await _status(stub.ModelInfo(cpb.ModelInfoRequest(), timeout=5)),
            )

    health, info = _calls(worker_policy(own, certificates=False), calls)
    assert health == "OK"
    expected = "OK" if token == "d0" else "UNAUTHENTICATED: authorization: missing or wrong bearer token"
    assert info == expected
