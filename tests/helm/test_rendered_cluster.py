"""The chart's own command lines, run: the rendered router and worker args and environment
(ConfigMap, credentials from their Secrets; then mounted TLS files too) start a cluster on loopback,
the rendered readiness probe reports it ready, and the `helm test` pod's request is served
with the client token and a client certificate. Only what a cluster supplies is replaced:
pod IPs and names, the router Service's address, ports (each pod has its own), the image's
/opt/tandem (this checkout). Every process holds the one certificate a Secret would give, with
SAN DNS:service, DNS:localhost and IP:127.0.0.1. At 127.0.0.1 that address lets the router reach
the workers; the pods at 127.0.0.2 (an address the certificate does not name, as it names no pod
IP in a cluster) connect only through tls.serverName: service (docs/deploy.md, Credentials).
An aggregated-only cluster (the router and one `--role both` worker) serves the same request."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import worker_token
from tests.helm.chart import FULLNAME, ROOT, config, container, one, render
from tests.helm.test_credentials import TOKENS
from tests.helm.test_pod_scripts import cert_folder

pytestmark = pytest.mark.slow
SERVICE_SECRET = "service-s3cret"
SECRETS = {
    ("tandem-client", "api-token"): "client-t0ken",
    ("tandem-service", "service-token"): SERVICE_SECRET,
    ("decode-0-token", "token"): worker_token(SERVICE_SECRET, "decode-0"),  # `tandem worker-token decode-0`
}
TANDEM = os.path.join(os.path.dirname(sys.executable), "tandem")
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(tls_dir: Path | None, server_name: str = "") -> dict:
    """TOKENS from Secrets and a worker token for the decode role (or, with ``tls_dir``, TLS,
    checking ``server_name`` when given), on CPU with small caches (and a context they hold:
    the bundled target's 32768 tokens would not fit 8 MiB) and UCX over loopback."""
    small = {"kvCacheMb": 8}
    chosen = {
        **TOKENS,
        "engine": {"device": "cpu", "maxNumSeqs": 8, "maxModelLen": 512},
        "ucx": {"env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}},
        "prefill": small,
        "decode": small,
    }
    if tls_dir is None:  # the decode role with its own worker token, the prefill role the secret's
        chosen["decode"] = {**small, "workerToken": {"existingSecret": "decode-0-token"}}
    else:
        chosen["tls"] = {
            "enabled": True,
            "existingSecret": "tls",
            "clientSecret": "c",
            "mountPath": str(tls_dir),
            "serverName": server_name,
        }
    return chosen


def aggregated_values() -> dict:
    """values(None) with one aggregated worker (the service secret's) instead of the prefill and
    decode roles: the chart's aggregated serving."""
    none = {"replicas": 0}
    return {**values(None), "prefill": none, "decode": none, "aggregated": {"replicas": 1, "kvCacheMb": 8}}


def pod_env(manifests: list[dict], component: str, pod: dict[str, str]) -> dict[str, str]:
    """What the kubelet gives the container: the ConfigMap, then its env (Secrets resolved)."""
    env = {k: v.replace("/opt/tandem/", f"{ROOT}/") for k, v in config(manifests).items()}
    for e in container(manifests, component)["env"]:
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in ref:
            env[e["name"]] = SECRETS[(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])]
        else:
            env[e["name"]] = pod[ref["fieldRef"]["fieldPath"]]
    return env


def pod_args(manifests: list[dict], component: str, env: dict[str, str], ports: dict[str, int]) -> list[str]:
    args = [_REFERENCE.sub(lambda m: env[m.group(1)], a) for a in container(manifests, component)["args"]]
    for i, a in enumerate(args[:-1]):
        if a in ports:
            args[i + 1] = str(ports[a])
    return args


class Cluster:
    def __init__(self, chosen: dict, logs: Path, client_tls: Path | None, host: str) -> None:
        """The chart rendered with ``chosen`` values, every pod at IP ``host``."""
        self.values, self.manifests = chosen, render(chosen)
        self.logs, self.client_tls, self.host = logs, client_tls, host
        self.processes: list[subprocess.Popen] = []
        self.port = free_port()

    def start(self, component: str, name: str) -> None:
        pod = {"status.podIP": self.host, "metadata.name": name}
        env = pod_env(self.manifests, component, pod)
        env["TANDEM_ROUTER"] = f"{self.host}:{self.port}"  # what <fullname>-router-internal resolves to
        ports = {"--metrics-port": free_port(), "--http-port": -1}
        ports["--port"] = self.port if component == "router" else free_port()
        args = pod_args(self.manifests, component, env, ports)
        base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        with open(self.logs / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            self.processes.append(
                subprocess.Popen([TANDEM, *args], env={**base, **env}, stdout=log, stderr=log)
            )

    def probe(self, probe: str, manifests: list[dict] | None = None) -> tuple[bool, str]:
        """The router's rendered ``probe`` (from ``manifests``, by default the cluster's own), run
        as the kubelet would: (passed, why not)."""
        spec = container(manifests or self.manifests, "router")[probe]
        if "grpc" in spec:  # kubelet's own gRPC health check, plaintext
            with grpc.insecure_channel(f"{self.host}:{self.port}") as channel:
                request = health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", ""))
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
                except grpc.RpcError as e:
                    return False, str(e)
            return status == health_pb2.HealthCheckResponse.SERVING, f"status {status}"
        command = spec["exec"]["command"]
        env = {"POD_IP": self.host, "PATH": os.environ["PATH"], "PYTHONPATH": ROOT}
        argv = [sys.executable, *command[1:3], str(self.port), command[4]]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        return done.returncode == 0, done.stderr

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.wait(timeout=30)

    def log_text(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.logs.iterdir()))


CLUSTERS = {  # pod IP, TLS, tls.serverName
    "tokens": ("127.0.0.1", False, ""),
    "tokens over TLS": ("127.0.0.1", True, ""),
    "TLS at 127.0.0.2 by serverName": ("127.0.0.2", True, "service"),
}
BY_NAME = "TLS at 127.0.0.2 by serverName"
AGGREGATED_POD = f"{FULLNAME}-aggregated-5c6d-a1"


@pytest.fixture(scope="module", params=CLUSTERS.values(), ids=CLUSTERS.keys())
def cluster(request, tmp_path_factory):
    host, on, server_name = request.param
    tls = client = None
    if on:
        ca = tmp_path_factory.mktemp("ca")
        script = os.path.join(ROOT, "deploy", "tls", "make_certs.sh")
        subprocess.run(["bash", script, str(ca), "service", "client"], check=True, capture_output=True)
        tls = cert_folder(ca, "service", tmp_path_factory.mktemp("mount") / "tls")
        client = cert_folder(ca, "client", tmp_path_factory.mktemp("client") / "tls")
    c = Cluster(values(tls, server_name), tmp_path_factory.mktemp("logs"), client, host)
    c.start("router", f"{FULLNAME}-router-5d8c-r1")
    c.start("prefill", f"{FULLNAME}-prefill-6f7b-p1")
    c.start("decode", f"{FULLNAME}-decode-7d9f-d1")
    yield from ready(c)


@pytest.fixture(scope="module")
def aggregated_cluster(tmp_path_factory):
    """The router and one aggregated worker, from aggregated_values(), on 127.0.0.1."""
    c = Cluster(aggregated_values(), tmp_path_factory.mktemp("aggregated-logs"), None, "127.0.0.1")
    c.start("router", f"{FULLNAME}-router-5d8c-r1")
    c.start("aggregated", AGGREGATED_POD)
    yield from ready(c)


def ready(c: Cluster):
    """Yields ``c`` once its router's rendered readiness probe passes; stops it afterwards."""
    try:
        deadline = time.monotonic() + 180
        while not c.probe("readinessProbe")[0]:
            assert time.monotonic() < deadline, f"the router never became ready\n{c.log_text()}"
            assert all(p.poll() is None for p in c.processes), f"a process exited\n{c.log_text()}"
            time.sleep(1)
        yield c
    finally:
        c.stop()


def helm_test(c: Cluster, token: str) -> subprocess.CompletedProcess:
    (pod,) = one(c.manifests, "Pod", f"{FULLNAME}-test-generate")["spec"]["containers"]
    env = {e["name"]: e["value"] for e in pod["env"] if "value" in e}
    # the router at localhost, a name the certificate carries, or at 127.0.0.2, which it does not
    router = "localhost" if c.host == "127.0.0.1" else c.host
    env |= {"ROUTER": f"{router}:{c.port}", "TANDEM_TOKEN": token}
    if c.client_tls is not None:
        env["TLS_DIR"] = str(c.client_tls)
    env |= {"PATH": os.environ["PATH"], "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *pod["command"][1:]], env=env, capture_output=True, text=True, timeout=180
    )


def test_the_rendered_probes_pass_on_the_running_router(cluster):
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        passed, why = cluster.probe(probe)
        assert passed, why


def test_helm_test_is_served_with_the_token_from_the_secret(cluster):
    done = helm_test(cluster, SECRETS[("tandem-client", "api-token")])
    assert done.returncode == 0, f"{done.stderr}\n{cluster.log_text()}"
    assert done.stdout.startswith("['chunk'") and done.stdout.endswith("'complete']\n")


def test_helm_test_without_the_token_is_refused(cluster):
    done = helm_test(cluster, "")
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr


def test_each_worker_registers_under_the_id_its_credential_names(cluster):
    logs = {f.name: f.read_text() for f in cluster.logs.iterdir()}
    assert re.search(
        rf"^prefill {FULLNAME}-prefill-6f7b-p1 grpc=", logs[f"{FULLNAME}-prefill-6f7b-p1.log"], re.M
    )
    own_token = cluster.client_tls is None  # the tokens-only cluster's decode role has its own
    decode_id = "decode-0" if own_token else f"{FULLNAME}-decode-7d9f-d1"
    assert re.search(rf"^decode {decode_id} grpc=", logs[f"{FULLNAME}-decode-7d9f-d1.log"], re.M)


@pytest.mark.parametrize("cluster", [CLUSTERS[BY_NAME]], ids=[BY_NAME], indirect=True)
def test_at_an_address_the_certificate_does_not_name_only_the_server_name_connects(cluster):
    """The same probe rendered without tls.serverName fails at 127.0.0.2, on the name."""
    unnamed = {**cluster.values, "tls": {**cluster.values["tls"], "serverName": ""}}
    passed, why = cluster.probe("readinessProbe", render(unnamed))
    assert not passed and "Hostname Verification Check failed" in why, why
    passed, why = cluster.probe("readinessProbe")
    assert passed, why


def test_an_aggregated_only_cluster_is_ready_and_serves_helm_test(aggregated_cluster):
    """No prefill or decode worker: the router is ready on the aggregated worker alone, which
    registers as role both under its pod name and serves the whole request."""
    c = aggregated_cluster
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        passed, why = c.probe(probe)
        assert passed, why
    done = helm_test(c, SECRETS[("tandem-client", "api-token")])
    assert done.returncode == 0, f"{done.stderr}\n{c.log_text()}"
    assert done.stdout.startswith("['chunk'") and done.stdout.endswith("'complete']\n")
    logs = {f.name: f.read_text() for f in c.logs.iterdir()}
    assert sorted(logs) == [f"{AGGREGATED_POD}.log", f"{FULLNAME}-router-5d8c-r1.log"]
    assert re.search(rf"^both {AGGREGATED_POD} grpc=", logs[f"{AGGREGATED_POD}.log"], re.M)
    served = re.findall(
        r"request \S+ (?:stop|length): .*, AL [0-9.]+, (\S+)$", logs[f"{FULLNAME}-router-5d8c-r1.log"], re.M
    )
    assert served == [AGGREGATED_POD]
