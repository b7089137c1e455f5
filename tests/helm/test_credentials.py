"""Credentials from existing Secrets: the client token and the service secret as environment
from secretKeyRef (never in arguments), a role's own worker token, mutual TLS from mounted
files (the flags, exec probes), the `helm test` pod carrying both, and the combinations the
services would refuse."""

from __future__ import annotations

import json

import pytest

from tests.helm.chart import FULLNAME, container, deployment, flag, one, render, render_refusal
from tests.helm.test_value_sets import WORKERS

COMPONENTS = ("router", *WORKERS)
TOKENS = {
    "auth": {
        "clientToken": {"existingSecret": "tandem-client", "key": "api-token"},
        "serviceToken": {"existingSecret": "tandem-service"},
    }
}
TLS = {"tls": {"enabled": True, "existingSecret": "tandem-tls", "clientSecret": "tandem-client-tls"}}
TOKEN_OVER_TLS = {"auth": {"clientToken": {"existingSecret": "tandem-client"}}, **TLS}
CSI = {
    "driver": "csi.cert-manager.io",
    "readOnly": True,
    "volumeAttributes": {"csi.cert-manager.io/issuer-name": "ca"},
}
NAMED = {"tls": {**TLS["tls"], "serverName": "tandem.llm.svc"}}
TLS_CSI = {"tls": {"enabled": True, "volume": {"csi": CSI}, "clientSecret": "tandem-client-tls"}}
WORKER_TOKEN = {
    "auth": {"serviceToken": {"existingSecret": "tandem-service"}},
    "decode": {"workerToken": {"existingSecret": "decode-0-token"}},
}
TLS_FLAGS = ["--tls-cert", "/etc/tandem/tls/tls.crt", "--tls-key", "/etc/tandem/tls/tls.key"]
TLS_FLAGS += ["--tls-ca", "/etc/tandem/tls/ca.crt"]
TLS_ITEMS = [
    {"key": "tls.crt", "path": "tls.crt"},
    {"key": "tls.key", "path": "tls.key"},
    {"key": "ca.crt", "path": "ca.crt"},
]


def secret_env(c: dict) -> dict[str, dict]:
    """Environment variable -> its secretKeyRef, for the variables read from Secrets."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_no_credentials_by_default():
    m = render()
    for component in COMPONENTS:
        c = container(m, component)
        assert secret_env(c) == {}
        assert "--tls-cert" not in c["args"]
        assert "tls" not in [v["name"] for v in c.get("volumeMounts", [])]
    (test,) = one(m, "Pod", f"{FULLNAME}-test-generate")["spec"]["containers"]
    assert secret_env(test) == {}


def test_the_client_token_reaches_the_router_and_the_service_secret_every_role():
    m = render(TOKENS)
    service = {"name": "tandem-service", "key": "service-token"}
    assert secret_env(container(m, "router")) == {
        "TANDEM_TOKEN": {"name": "tandem-client", "key": "api-token"},
        "TANDEM_SERVICE_TOKEN": service,
    }
    for role in WORKERS:
        assert secret_env(container(m, role)) == {"TANDEM_SERVICE_TOKEN": service}
        assert flag(container(m, role)["args"], "--instance-id") == "$(POD_NAME)"


def test_no_token_is_in_any_argument_or_the_pod_spec():
    m = render(TOKENS)
    for component in COMPONENTS:
        c = container(m, component)
        assert not {"--token", "--service-token", "--worker-token"} & set(c["args"])
        assert [e for e in c["env"] if e["name"].startswith("TANDEM_") and "value" in e] == []


def test_a_worker_token_replaces_the_service_secret_in_its_role_and_names_the_instance():
    m = render(WORKER_TOKEN)
    decode = container(m, "decode")
    assert secret_env(decode) == {"TANDEM_WORKER_TOKEN": {"name": "decode-0-token", "key": "token"}}
    assert "--instance-id" not in decode["args"]  # the token names it; a pod name would differ
    prefill = container(m, "prefill")
    assert secret_env(prefill) == {"TANDEM_SERVICE_TOKEN": {"name": "tandem-service", "key": "service-token"}}
    assert flag(prefill["args"], "--instance-id") == "$(POD_NAME)"


def test_tls_mounts_the_secret_and_passes_its_files_to_every_role():
    m = render(TLS)
    for component in COMPONENTS:
        c = container(m, component)
        assert c["args"][-6:] == TLS_FLAGS
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
        volumes = deployment(m, component)["spec"]["template"]["spec"]["volumes"]
        (tls,) = [v for v in volumes if v["name"] == "tls"]
        assert tls == {"name": "tls", "secret": {"secretName": "tandem-tls", "items": TLS_ITEMS}}


def test_tls_secret_keys_and_mount_path_are_values():
    values = {"tls": {**TLS["tls"], "certKey": "cert.pem", "keyKey": "key.pem", "caKey": "ca.pem"}}
    values["tls"]["mountPath"] = "/run/tls"
    m = render(values)
    (tls,) = [v for v in deployment(m, "decode")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["items"] == [
        {"key": "cert.pem", "path": "tls.crt"},
        {"key": "key.pem", "path": "tls.key"},
        {"key": "ca.pem", "path": "ca.crt"},
    ]
    assert flag(container(m, "decode")["args"], "--tls-ca") == "/run/tls/ca.crt"


def test_a_tls_volume_source_replaces_the_secret():
    m = render(TLS_CSI)
    for component in COMPONENTS:
        volumes = deployment(m, component)["spec"]["template"]["spec"]["volumes"]
        (tls,) = [v for v in volumes if v["name"] == "tls"]
        assert tls == {"name": "tls", "csi": CSI}
        assert container(m, component)["args"][-6:] == TLS_FLAGS


def test_the_server_name_reaches_every_role_after_the_tls_files():
    m = render(NAMED)
    for component in COMPONENTS:
        assert container(m, component)["args"][-8:] == [*TLS_FLAGS, "--tls-server-name", "tandem.llm.svc"]
    for component in COMPONENTS:  # and only with it
        assert "--tls-server-name" not in container(render(TLS), component)["args"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_the_tls_probes_check_the_server_name(component):
    c = container(render(NAMED), component)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        script = c[probe]["exec"]["command"][2]
        assert 'n = "tandem.llm.svc"\no = [("grpc.ssl_target_name_override", n)] if n else []' in script
        assert "c, options=o) as ch:" in script
    assert 'n = ""\n' in container(render(TLS), component)["readinessProbe"]["exec"]["command"][2]


def test_the_helm_test_pod_checks_the_server_name():
    (c,) = one(render(NAMED), "Pod", f"{FULLNAME}-test-generate")["spec"]["containers"]
    assert {e["name"]: e["value"] for e in c["env"] if "value" in e}["TLS_SERVER_NAME"] == "tandem.llm.svc"
    script = c["command"][2]
    assert 'options = [("grpc.ssl_target_name_override", name)] if name else []' in script
    assert 'grpc.secure_channel(os.environ["ROUTER"], credentials, options=options)' in script
    (c,) = one(render(TLS), "Pod", f"{FULLNAME}-test-generate")["spec"]["containers"]
    assert "TLS_SERVER_NAME" not in [e["name"] for e in c["env"]]


@pytest.mark.parametrize("component, port", [("router", 50051), ("decode", 50061)])
def test_under_tls_the_probes_exec_a_health_check_over_mutual_tls(component, port):
    c = container(render(TLS), component)
    services = {"startupProbe": "", "readinessProbe": "tandem.ready", "livenessProbe": ""}
    for probe, service in services.items():
        assert "grpc" not in c[probe]
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"] and command[3:] == [str(port), service]
        assert c[probe]["timeoutSeconds"] == 5
        compile(command[2], probe, "exec")
    script = c["readinessProbe"]["exec"]["command"][2]
    assert 'd = "/etc/tandem/tls"' in script
    assert 'os.environ["POD_IP"] + ":" + sys.argv[1]' in script


def test_helm_test_pod_carries_the_client_token_and_a_client_certificate():
    pod = one(render(TOKEN_OVER_TLS), "Pod", f"{FULLNAME}-test-generate")["spec"]
    (c,) = pod["containers"]
    assert secret_env(c) == {"TANDEM_TOKEN": {"name": "tandem-client", "key": "token"}}
    assert {e["name"]: e["value"] for e in c["env"] if "value" in e}["TLS_DIR"] == "/etc/tandem/tls"
    assert c["volumeMounts"] == [{"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True}]
    assert pod["volumes"] == [
        {"name": "tls", "secret": {"secretName": "tandem-client-tls", "items": TLS_ITEMS}}
    ]
    script = c["command"][2]
    assert 'metadata = [("authorization", f"Bearer {token}")] if token else None' in script
    assert "Generate(request, timeout=120, metadata=metadata)" in script
    compile(script, "helm-test", "exec")


def test_helm_test_pod_can_be_left_out():
    m = render({"test": {"enabled": False}})
    assert [x for x in m if x["kind"] == "Pod"] == []


@pytest.mark.parametrize(
    "values, reason",
    [
        (
            {"auth": {"clientToken": {"existingSecret": "tandem-client"}}},
            "auth.clientToken.existingSecret: the router refuses a client token without the service "
            "secret or mutual TLS (service_secret: required with a client token): set "
            "auth.serviceToken.existingSecret or tls.enabled too",
        ),
        (
            {"tls": {"enabled": True, "clientSecret": "c"}},
            "tls.existingSecret: required when tls.enabled is true",
        ),
        (
            {"tls": {"enabled": True, "existingSecret": "tandem-tls"}},
            "tls.clientSecret: the helm test pod calls the router's client API, which under mutual TLS "
            "needs an OU=client certificate: give a Secret holding one, or set test.enabled false",
        ),
        (
            {"tls": {"serverName": "tandem.llm.svc"}},
            "tls.serverName: names the certificate the mutual-TLS channels check, and the services "
            "refuse --tls-server-name without mutual TLS (tls_server_name: needs mutual TLS): set "
            "tls.enabled too, or leave tls.serverName empty",
        ),
        (
            {"decode": {"workerToken": {"existingSecret": "decode-0-token"}}},
            "decode.workerToken.existingSecret: the router checks worker tokens with the service "
            "secret: set auth.serviceToken.existingSecret too",
        ),
        (
            {**WORKER_TOKEN, "decode": {"replicas": 2, "workerToken": {"existingSecret": "t"}}},
            "decode.workerToken.existingSecret: a worker token names one instance id, and 2 replicas "
            "would all register as it; use replicas 1, or the service secret alone",
        ),
    ],
    ids=[
        "client token alone",
        "tls without files",
        "tls test without cert",
        "server name without tls",
        "worker token alone",
        "2 replicas",
    ],
)
def test_templates_refuse_credentials_the_services_would_refuse(values, reason):
    assert reason in render_refusal(values)


def test_tls_without_a_test_pod_needs_no_client_certificate():
    m = render({"tls": {"enabled": True, "existingSecret": "tandem-tls"}, "test": {"enabled": False}})
    assert container(m, "router")["args"][-6:] == TLS_FLAGS


def test_a_client_token_over_tls_alone_is_accepted():
    m = render(TOKEN_OVER_TLS)
    assert secret_env(container(m, "router")) == {"TANDEM_TOKEN": {"name": "tandem-client", "key": "token"}}
    assert json.dumps(m).count("tandem-client-tls") == 1  # the test pod's certificate only
