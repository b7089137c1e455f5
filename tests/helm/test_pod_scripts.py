"""The Python the chart runs in its pods, run here against live gRPC servers under mutual
TLS: the exec probes (a health check with the pod's service certificate) and the `helm test`
request (the client token and an OU=client certificate), at an address the server's certificate
names and, with tls.serverName, at one it does not (127.0.0.2, as a pod IP)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.helm.chart import FULLNAME, ROOT, container, one, render
from tests.helm.test_credentials import TOKEN_OVER_TLS

TOKEN = "s3cret-client-token"


def cert_folder(ca: Path, name: str, into: Path) -> Path:
    """``into`` holding ``name``'s certificate as the chart mounts it: tls.crt, tls.key, ca.crt."""
    into.mkdir()
    shutil.copy(ca / f"{name}.crt", into / "tls.crt")
    shutil.copy(ca / f"{name}.key", into / "tls.key")
    shutil.copy(ca / "ca.crt", into / "ca.crt")
    return into


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    ca = tmp_path_factory.mktemp("ca")
    script = os.path.join(ROOT, "deploy", "tls", "make_certs.sh")
    subprocess.run(["bash", script, str(ca), "router", "client"], check=True, capture_output=True)
    return ca


class FakeRouter(cpb_grpc.TandemServicer):
    """Answers Generate with one chunk and complete, for the client token and OU=client only."""

    def Generate(self, request, context):
        if ("authorization", f"Bearer {TOKEN}") not in tuple(context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")
        subject = context.auth_context().get("x509_subject", [b""])[0].decode()
        if "OU=client" not in subject:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"certificate: {subject}")
        assert request.text == "def fibonacci(n):" and request.sampling.max_tokens == 8
        yield cpb.GenerateResponse(chunk=cpb.Chunk())
        yield cpb.GenerateResponse(complete=cpb.Complete())


def serve(certs: Path, host: str):
    """A mutual-TLS server on ``host`` with grpc.health.v1 and the fake Tandem service, holding
    the certificate `router` (SAN DNS:router, DNS:localhost, IP:127.0.0.1)."""
    key, cert, ca = ((certs / n).read_bytes() for n in ("router.key", "router.crt", "ca.crt"))
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    s = grpc.server(futures.ThreadPoolExecutor(4))
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, s)
    cpb_grpc.add_TandemServicer_to_server(FakeRouter(), s)
    port = s.add_secure_port(f"{host}:0", credentials)
    s.start()
    return s, port, checks


@pytest.fixture(scope="module")
def server(certs):
    s, port, checks = serve(certs, "127.0.0.1")
    yield port, checks
    s.stop(None)


@pytest.fixture(scope="module")
def unnamed_server(certs):
    """The same at 127.0.0.2, an address its certificate does not name, everything SERVING."""
    s, port, checks = serve(certs, "127.0.0.2")
    checks.set("tandem.ready", health_pb2.HealthCheckResponse.SERVING)
    yield port
    s.stop(None)


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """A pod's command, with the image's Python (this one) and only ``env`` set."""
    assert command[0] == "python"
    env = {**env, "PYTHONPATH": ROOT, "PATH": os.environ["PATH"]}
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=60)


def probe_command(folder: Path, probe: str, port: int, server_name: str = "") -> list[str]:
    """The router's rendered ``probe`` under TLS with its files in ``folder`` (and
    ``server_name`` as tls.serverName), at ``port``."""
    tls = {**TOKEN_OVER_TLS["tls"], "mountPath": str(folder), "serverName": server_name}
    command = container(render({**TOKEN_OVER_TLS, "tls": tls}), "router")[probe]["exec"]["command"]
    assert command[3] == "50051"
    return [*command[:3], str(port), command[4]]


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_the_tls_probe_passes_only_while_its_service_is_serving(probe, certs, server, tmp_path):
    port, checks = server
    command = probe_command(cert_folder(certs, "router", tmp_path / "tls"), probe, port)
    service = command[4]
    checks.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run(command, {"POD_IP": "127.0.0.1"}).returncode == 1
    checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    done = run(command, {"POD_IP": "127.0.0.1"})
    assert done.returncode == 0, done.stderr


def test_the_tls_probe_fails_with_a_certificate_from_another_ca(certs, server, tmp_path):
    port, checks = server
    rogue = tmp_path / "rogue-ca"
    subprocess.run(
        ["bash", os.path.join(ROOT, "deploy/tls/make_certs.sh"), str(rogue), "router"],
        check=True,
        capture_output=True,
    )
    command = probe_command(cert_folder(rogue, "router", tmp_path / "tls"), "livenessProbe", port)
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run(command, {"POD_IP": "127.0.0.1"}).returncode != 0


def helm_test_run(
    folder: Path, router: str, token: str, server_name: str = ""
) -> subprocess.CompletedProcess:
    """The rendered `helm test` pod with the certificate in ``folder`` (and ``server_name`` as
    tls.serverName) calling the router at ``router``."""
    values = {**TOKEN_OVER_TLS, "tls": {**TOKEN_OVER_TLS["tls"], "serverName": server_name}}
    (c,) = one(render(values), "Pod", f"{FULLNAME}-test-generate")["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env.pop("ROUTER") == f"{FULLNAME}-router:50051"
    env |= {"ROUTER": router, "TLS_DIR": str(folder), "TANDEM_TOKEN": token}
    return run(c["command"], env)


def test_the_helm_test_pod_sends_the_client_token_with_a_client_certificate(certs, server, tmp_path):
    done = helm_test_run(cert_folder(certs, "client", tmp_path / "tls"), f"localhost:{server[0]}", TOKEN)
    assert (done.returncode, done.stdout) == (0, "['chunk', 'complete']\n"), done.stderr


REFUSED = {
    "a wrong token": ("client", "wrong", "UNAUTHENTICATED"),
    "a service cert": ("router", TOKEN, "PERMISSION_DENIED"),
}


@pytest.mark.parametrize("refused", REFUSED.values(), ids=REFUSED.keys())
def test_the_helm_test_pod_fails_on_a_refusal(certs, server, tmp_path, refused):
    name, token, code = refused
    done = helm_test_run(cert_folder(certs, name, tmp_path / "tls"), f"localhost:{server[0]}", token)
    assert done.returncode == 1 and code in done.stderr


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe"])
def test_at_an_unnamed_address_the_tls_probe_passes_by_the_server_name(
    probe, certs, unnamed_server, tmp_path
):
    folder = cert_folder(certs, "router", tmp_path / "tls")
    pod = {"POD_IP": "127.0.0.2"}
    done = run(probe_command(folder, probe, unnamed_server), pod)
    assert done.returncode == 1 and "Hostname Verification Check failed" in done.stderr, done.stderr
    done = run(probe_command(folder, probe, unnamed_server, server_name="router"), pod)
    assert done.returncode == 0, done.stderr


def test_at_an_unnamed_address_the_helm_test_pod_connects_by_the_server_name(certs, unnamed_server, tmp_path):
    folder, router = cert_folder(certs, "client", tmp_path / "tls"), f"127.0.0.2:{unnamed_server}"
    done = helm_test_run(folder, router, TOKEN, server_name="router")
    assert (done.returncode, done.stdout) == (0, "['chunk', 'complete']\n"), done.stderr
    done = helm_test_run(folder, router, TOKEN)
    assert done.returncode == 1 and "Hostname Verification Check failed" in done.stderr, done.stderr
