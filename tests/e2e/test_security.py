"""Mutual TLS between every service, a client token and workers' own tokens.

A cluster runs with certificates from a test CA (OU=client for clients, OU=service for the
router and workers), a client token and a service secret. A client with its certificate and
the token is served; without the token it is refused (gRPC UNAUTHENTICATED, HTTP 401); a
client or a worker whose certificate another CA signed cannot connect at all. A client's
credentials call no worker and register nothing; a worker's token takes no other worker's
instance id, nor a live one from another address; a peer off the model contract is refused."""

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
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.security import worker_token
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
SECRET = "service-s3cret"
ROOT = Path(__file__).resolve().parents[2]


def make_certs(folder: Path, *names: str) -> Path:
    subprocess.run(
        ["bash", str(ROOT / "deploy/tls/make_certs.sh"), str(folder), *names], check=True, capture_output=True
    )
    return folder


def tls_args(folder: Path, name: str) -> list[str]:
    """A worker's (a router's: with ``+ ["--token", TOKEN]``) certificate and service secret."""
    return [
        "--tls-cert",
        str(folder / f"{name}.crt"),
        "--tls-key",
        str(folder / f"{name}.key"),
        "--tls-ca",
        str(folder / "ca.crt"),
        "--service-token",
        SECRET,
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
        router_extra=tls_args(good, "router") + ["--token", TOKEN],
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


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_the_http_api_needs_the_token(secure, path):
    if not secure.http_address:
        pytest.skip("the router runs no HTTP server")
    url = f"{secure.http_address}{path}"
    for wrong in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"bearer {TOKEN}x"}):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(urllib.request.Request(url, headers=wrong), timeout=10)
        assert raised.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert urllib.request.urlopen(request, timeout=10).status == 200


def _code(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name, e.details()
    return "OK", ""


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_a_client_cannot_call_a_worker_or_register_one(secure, certs):
    good, _ = certs
    decode = next(p for p in secure.processes if p.name == "decode-1")
    reserve = wpb.ReserveRequest(request_id="pin", prompt_len=8, lease_ms=2**32 - 1)
    with grpc.secure_channel(decode.grpc, credentials(good, "client")) as channel:
        worker = wpb_grpc.DecodeWorkerStub(channel)
        as_client = _code(lambda: worker.Reserve(reserve, metadata=_bearer(TOKEN), timeout=10))
        forged = worker_token(SECRET, "decode-1")  # even a worker's token: the certificate is a client's
        as_client_cert = _code(lambda: worker.Reserve(reserve, metadata=_bearer(forged), timeout=10))
    with secure.channel() as channel:
        registry = reg_grpc.RegistrationStub(channel)
        info = rpb.RankInfo(instance_id="decode-1", role=rpb.ROLE_DECODE, grpc_address="127.0.0.1:1")
        register = _code(
            lambda: registry.Register(reg.RegisterRequest(rank_info=info), metadata=_bearer(TOKEN))
        )
    assert as_client[0] == as_client_cert[0] == register[0] == "PERMISSION_DENIED"
    assert "certificate: OU=client cannot call /tandem.v1.DecodeWorker/Reserve" in as_client[1]
    assert "/tandem.v1.Registration/Register (needs OU=service)" in register[1]


def test_a_service_certificate_cannot_call_the_client_api(secure, certs):
    good, _ = certs
    with grpc.secure_channel(secure.router_address, credentials(good, "prefill")) as channel:
        code, details = _code(lambda: generate(channel, _bearer(TOKEN)))
    assert code == "PERMISSION_DENIED" and "(needs OU=client)" in details


def test_a_worker_token_takes_no_other_id_nor_a_live_one_from_another_address(secure, certs):
    good, _ = certs
    takeover = rpb.RankInfo(
        schema_version=1, instance_id="decode-1", role=rpb.ROLE_DECODE, grpc_address="127.0.0.1:1"
    )
    with grpc.secure_channel(secure.router_address, credentials(good, "decode")) as channel:
        registry = reg_grpc.RegistrationStub(channel)
        request = reg.RegisterRequest(rank_info=takeover)
        others = _code(lambda: registry.Register(request, metadata=_bearer(worker_token(SECRET, "proxy"))))
        own = _code(lambda: registry.Register(request, metadata=_bearer(worker_token(SECRET, "decode-1"))))
        forget = reg.DeregisterRequest(instance_id="decode-1")
        deregister = _code(
            lambda: registry.Deregister(forget, metadata=_bearer(worker_token(SECRET, "proxy")))
        )
    assert others == (
        "PERMISSION_DENIED",
        "rank_info.instance_id: 'decode-1' is not this credential's ('proxy')",
    )
    assert own[0] == "ALREADY_EXISTS" and "is registered to a live worker at" in own[1]
    assert deregister == ("PERMISSION_DENIED", "instance_id: 'decode-1' has another credential")
    with secure.channel() as channel:
        health = cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)
    assert (health.num_decode_workers, health.num_ready_pairs) == (1, 1)


def test_an_aggregated_peer_of_another_model_and_page_size_is_refused(secure, certs):
    good, _ = certs
    rogue = rpb.RankInfo(
        schema_version=1,
        instance_id="both-rogue",
        role=rpb.ROLE_BOTH,
        grpc_address="127.0.0.1:1",
        model_id="another-model",
        tokens_per_page=16,
    )
    with grpc.secure_channel(secure.router_address, credentials(good, "decode")) as channel:
        registry = reg_grpc.RegistrationStub(channel)
        answer = registry.Register(
            reg.RegisterRequest(rank_info=rogue),
            metadata=_bearer(worker_token(SECRET, "both-rogue")),
            timeout=10,
        )
    target = Path(secure.worker_args[secure.worker_args.index("--model") + 1]).name
    assert not answer.accepted
    assert [(m.field, m.local_value, m.peer_value) for m in answer.mismatches] == [
        ("model_id", repr(target), "'another-model'"),
        ("tokens_per_page", "4", "16"),
    ]
    with secure.channel() as channel:
        info = cpb_grpc.TandemStub(channel).ModelInfo(
            cpb.ModelInfoRequest(), metadata=_bearer(TOKEN), timeout=5
        )
    assert "both-rogue" not in [w.instance_id for w in info.workers]


def test_a_reserve_lease_over_the_workers_cap_is_refused(secure, certs):
    good, _ = certs
    decode = next(p for p in secure.processes if p.name == "decode-1")
    reserve = wpb.ReserveRequest(request_id="pin", prompt_len=8, lease_ms=2**32 - 1)
    with grpc.secure_channel(decode.grpc, credentials(good, "router")) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        code = _code(
            lambda: stub.Reserve(reserve, metadata=_bearer(worker_token(SECRET, "decode-1")), timeout=10)
        )
    assert code == (
        "INVALID_ARGUMENT",
        "lease_ms: 4294967295 is over this worker's cap of 60000 ms (--lease-s)",
    )
