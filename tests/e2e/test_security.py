"""Mutual TLS between every service and a bearer token on every API.

A cluster runs with certificates from a test CA and a token. A client with its certificate
and the token is served; without the token it is refused (gRPC UNAUTHENTICATED, HTTP 401);
a client or a worker whose certificate another CA signed cannot connect at all."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
ROOT = Path(__file__).resolve().parents[2]


def make_certs(folder: Path, *names: str) -> Path:
    subprocess.run(
        ["bash", str(ROOT / "deploy/tls/make_certs.sh"), str(folder), *names], check=True, capture_output=True
    )
    return folder


def tls_args(folder: Path, name: str) -> list[str]:
    return [
        "--tls-cert",
        str(folder / f"{name}.crt"),
        "--tls-key",
        str(folder / f"{name}.key"),
        "--tls-ca",
        str(folder / "ca.crt"),
        "--token",
        TOKEN,
    ]


def credentials(folder: Path, name: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (folder / "ca.crt").read_bytes(),
        (folder / f"{name}.key").read_bytes(),
        (folder / f"{name}.crt").read_bytes(),
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good = make_certs(tmp_path_factory.mktemp("ca"), "router", "prefill", "decode", "client")
    rogue = make_certs(tmp_path_factory.mktemp("rogue-ca"), "decode", "client")
    return good, rogue


@pytest.fixture(scope="module")
def secure(tiny_pair, certs):
    good, rogue = certs
    roles = [
        ("prefill", tls_args(good, "prefill")),
        ("decode", tls_args(good, "decode")),
        ("decode", tls_args(rogue, "decode")),
    ]  # signed by another CA: never registers
    cluster = start_cluster(
        tiny_pair,
        roles,
        router_extra=tls_args(good, "router"),
        expected_pairs=1,
        credentials=credentials(good, "client"),
    )
    yield cluster
    cluster.stop()


def generate(channel: grpc.Channel, metadata=()) -> list[int]:
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=list(range(1, 12))), sampling=cpb.SamplingParams(max_tokens=4)
    )
    tokens = []
    for message in cpb_grpc.TandemStub(channel).Generate(request, metadata=metadata, timeout=30):
        tokens += list(message.chunk.token_ids)
    return tokens


def test_a_client_with_its_certificate_and_the_token_is_served(secure):
    with secure.channel() as channel:
        assert len(generate(channel, [("authorization", f"Bearer {TOKEN}")])) == 4


def test_a_client_without_the_token_is_refused(secure):
    with secure.channel() as channel:
        with pytest.raises(grpc.RpcError) as raised:
            generate(channel)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as raised:
            generate(channel, [("authorization", "Bearer wrong")])
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_with_a_certificate_from_another_ca_cannot_connect(secure, certs):
    _, rogue = certs
    with grpc.secure_channel(secure.router_address, credentials(rogue, "client")) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            generate(channel, [("authorization", f"Bearer {TOKEN}")])
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secure.router_address) as channel:  # plaintext
        with pytest.raises(grpc.RpcError) as raised:
            generate(channel, [("authorization", f"Bearer {TOKEN}")])
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_worker_with_a_certificate_from_another_ca_never_joins(secure):
    time.sleep(2)  # several of its registration attempts
    with secure.channel() as channel:
        health = cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)
    assert health.num_decode_workers == 1
    assert health.num_ready_pairs == 1


def test_the_http_api_needs_the_token(secure):
    if not secure.http_address:
        pytest.skip("the router runs no HTTP server")
    url = f"{secure.http_address}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(url, timeout=10)
    assert raised.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert urllib.request.urlopen(request, timeout=10).status == 200
