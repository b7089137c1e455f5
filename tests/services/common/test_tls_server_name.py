"""Mutual TLS to servers reached at addresses no certificate names (pod IPs): with
``server_name`` a channel checks the certificate against that name instead."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import SERVING, start_server
from services.common.security import TlsConfig, aio_channel, tls_from

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["bash", str(ROOT / "deploy/tls/make_certs.sh"), str(folder), "tandem-internal"],
        check=True,
        capture_output=True,
    )
    return folder


def _tls(folder: Path, server_name: str = "") -> TlsConfig:
    name = folder / "tandem-internal"
    return TlsConfig(f"{name}.crt", f"{name}.key", str(folder / "ca.crt"), server_name)


def _check(folder: Path, server_name: str) -> str:
    """Health over mutual TLS to a server on 127.0.0.2, which its certificate does not name."""

    async def scenario():
        server, statuses, port = await start_server(lambda s: None, "127.0.0.2", 0, _tls(folder))
        await statuses.set("", SERVING)
        try:
            async with aio_channel(f"127.0.0.2:{port}", _tls(folder, server_name)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        finally:
            await server.stop(None)

    return asyncio.run(scenario())


def test_a_server_name_lets_one_certificate_serve_any_address(certs):
    assert _check(certs, "") == "UNAVAILABLE"  # 127.0.0.2 is not in the certificate
    assert _check(certs, "tandem-internal") == "SERVING"
    assert _check(certs, "someone-else") == "UNAVAILABLE"


def test_a_server_name_without_tls_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="^tls_server_name: needs mutual TLS"):
        tls_from(server_name="tandem-internal")
