"""Every rendered manifest against the Kubernetes schemas; values the chart refuses; the
dashboard ConfigMap, the `helm test` pod and NOTES."""

from __future__ import annotations

import json
import os
from collections import Counter

import helm_python
import kubernetes_validate
import pytest

from tests.helm.chart import (
    CHART,
    FULLNAME,
    NAMESPACE,
    ROOT,
    one,
    render,
    render_files,
    render_refusal,
    schema_refusal,
)
from tests.helm.test_aggregated import AGGREGATED, BESIDE_PAIRS
from tests.helm.test_credentials import NAMED, TLS, TLS_CSI, TOKEN_OVER_TLS, TOKENS, WORKER_TOKEN
from tests.helm.test_operations import OPERATIONS
from tests.helm.test_pod_values import EXISTING_ACCOUNT, EXTRAS, PDBS
from tests.helm.test_value_sets import ONE_P_ONE_D, SEPARATE, TP_2, TWO_P_FOUR_D

# The chart's kubeVersion floor (gRPC probes are GA in 1.27) and the newest schemas we have.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# Prometheus Operator CRDs: no schema for them ships with kubernetes-validate.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
MONITORS = {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
IMAGE_MODEL = {"model": {"source": "image", "image": {"repository": "registry.example/llama"}}}
VALUE_SETS = {
    "defaults": {},
    "1P1D": ONE_P_ONE_D,
    "2P4D": TWO_P_FOUR_D,
    "TP 2": TP_2,
    "separate layout": SEPARATE,
    "model image": IMAGE_MODEL,
    "monitors": MONITORS,
    "tokens": TOKENS,
    "worker token": WORKER_TOKEN,
    "TLS": TLS,
    "TLS from CSI": TLS_CSI,
    "TLS by server name": NAMED,
    "token over TLS": TOKEN_OVER_TLS,
    "extra env and volumes": EXTRAS,
    "disruption budgets": PDBS,
    "existing service account": EXISTING_ACCOUNT,
    "operations": OPERATIONS,
    "aggregated": AGGREGATED,
    "aggregated beside pairs": BESIDE_PAIRS,
}
# ConfigMap x2 (config, dashboard), Deployment x3, Service x4, the ServiceAccount, the test Pod
KINDS = Counter({"ConfigMap": 2, "Deployment": 3, "Service": 4, "ServiceAccount": 1, "Pod": 1})
EXPECTED_KINDS = {
    "disruption budgets": KINDS + Counter({"PodDisruptionBudget": 3}),
    "existing service account": KINDS - Counter({"ServiceAccount": 1}),
    "operations": KINDS + Counter({"HorizontalPodAutoscaler": 2, "Ingress": 1}),
    "aggregated": KINDS - Counter({"Deployment": 1, "Service": 1}),  # no prefill, no decode: aggregated
    "aggregated beside pairs": KINDS + Counter({"Deployment": 1, "Service": 1}),
}


_validated: set[str] = set()  # manifests already validated under another value set


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_validates_strictly(name):
    values = VALUE_SETS[name]
    manifests = render(values)
    checked = Counter()
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CUSTOM_KINDS:
            continue
        checked[manifest["kind"]] += 1
        key = json.dumps(manifest, sort_keys=True)
        if key in _validated:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                pytest.fail(
                    f"{manifest['kind']}/{manifest['metadata']['name']} on {version}: {path}: {e.message}"
                )
        _validated.add(key)
    assert checked == EXPECTED_KINDS.get(name, KINDS)
    assert len(manifests) - checked.total() == {"monitors": 2, "operations": 1}.get(name, 0)


@pytest.mark.parametrize(
    "values",
    [
        {},
        TP_2,
        MONITORS,
        TOKEN_OVER_TLS,
        TLS_CSI,
        WORKER_TOKEN,
        {**TOKENS, **{c: {**EXTRAS[c], **PDBS[c]} for c in PDBS}},
        EXISTING_ACCOUNT,
        OPERATIONS,
        AGGREGATED,
    ],
    ids=[
        "defaults",
        "TP 2",
        "monitors",
        "token over TLS",
        "TLS from CSI",
        "worker token",
        "tokens, extras, budgets",
        "existing service account",
        "operations",
        "aggregated",
    ],
)
def test_helm_lint_strict_finds_nothing_above_info(values):
    report = helm_python.lint(CHART, values, strict=True, kube_version="v1.27.0")
    assert report["errors"] == []
    assert [(m["path"], m["error"]) for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize(
    "values, where, problem",
    [
        ({"engine": {"layout": "fused"}}, "/engine/layout", "value must be one of"),
        ({"router": {"replicas": -1}}, "/router/replicas", "minimum: got -1, want 0"),
        (
            {"auth": {"clientToken": {"secret": "x"}}},
            "/auth/clientToken",
            "additional properties 'secret' not allowed",
        ),
        ({"auth": {"serviceToken": {"key": ""}}}, "/auth/serviceToken/key", "minLength: got 0, want 1"),
        ({"tls": {"enabled": "yes"}}, "/tls/enabled", "got string, want boolean"),
        ({"tls": {"serverName": "a b"}}, "/tls/serverName", "'a b' does not match pattern"),
        ({"router": {"extraEnv": {"A": "b"}}}, "/router/extraEnv", "got object, want array"),
        ({"decode": {"extraVolumes": ["cache"]}}, "/decode/extraVolumes/0", "got string, want object"),
        (
            {"prefill": {"podDisruptionBudget": {"minAvailable": "half"}}},
            "/prefill/podDisruptionBudget/minAvailable",
            "'half' does not match pattern '^[0-9]+%$'",
        ),
        ({"router": {"strategy": {"type": "Blue"}}}, "/router/strategy/type", "value must be one of"),
        ({"serviceAccount": {"create": "true"}}, "/serviceAccount/create", "got string, want boolean"),
        ({"engine": {"tp": 0}}, "/engine/tp", "minimum: got 0, want 1"),
        ({"decode": {"replica": 4}}, "/decode", "additional properties 'replica' not allowed"),
        ({"model": {"source": "s3"}}, "/model/source", "value must be one of"),
        (
            {"decode": {"hostKvCache": {"writePolicy": "back"}}},
            "/decode/hostKvCache/writePolicy",
            "value must be one of",
        ),
        ({"decode": {"gpuMemoryUtilization": 0}}, "/decode/gpuMemoryUtilization", "exclusiveMinimum: got 0"),
        ({"prefill": {"gpuMemoryUtilization": 1.5}}, "/prefill/gpuMemoryUtilization", "maximum: got 1.5"),
        ({"prefill": {"kvCacheMb": -1}}, "/prefill/kvCacheMb", "minimum: got -1, want 0"),
        ({"engine": {"maxNumBatchedTokens": -1}}, "/engine/maxNumBatchedTokens", "minimum: got -1, want 0"),
        ({"engine": {"maxModelLen": -1}}, "/engine/maxModelLen", "minimum: got -1, want 0"),
        ({"logLevel": "LOUD"}, "/logLevel", "value must be one of"),
        (  # benchmarks only: no value of the chart turns it on
            {"engine": {"unsafeForcedAcceptance": 2}},
            "/engine",
            "additional properties 'unsafeForcedAcceptance' not allowed",
        ),
    ],
)
def test_schema_refuses_values_naming_the_key(values, where, problem):
    assert f"at '{where}': {problem}" in schema_refusal(values)


@pytest.mark.parametrize(
    "values, reason",
    [
        (
            {"model": {"drafter": ""}},
            "engine.layout: unified keeps the drafter's KV pages in the "
            'target\'s cache manager and transfer, but no drafter runs (model.drafter "", '
            "engine.numSpecTokens 4)",
        ),
        (
            {"engine": {"numSpecTokens": 0}},
            'no drafter runs (model.drafter "tiny-drafter", engine.numSpecTokens 0)',
        ),
        ({"model": {"source": "pvc"}}, "model.pvc.claimName: required when model.source is pvc"),
        ({"model": {"source": "image"}}, "model.image.repository: required when model.source is image"),
        (
            {"engine": {"tp": 2}, "decode": {"hostKvCache": {"mb": 64}}},
            "decode.hostKvCache.mb: the host KV tier's page copies are not mirrored to tensor-parallel "
            "ranks; use it with tp 1, not 2",
        ),
        (
            {"decode": {"gpuMemoryUtilization": 0.5, "kvCacheMb": 4096}},
            "decode.gpuMemoryUtilization: 0.5 sizes the KV cache from the GPU's memory, and "
            "decode.kvCacheMb 4096 sizes it already; give one of them",
        ),
        (
            {"engine": {"device": "cpu"}, "prefill": {"gpuMemoryUtilization": 0.5}},
            "prefill.gpuMemoryUtilization: sizes the KV cache from a GPU's memory, and engine.device "
            "is cpu: give prefill.kvCacheMb",
        ),
    ],
)
def test_templates_refuse_what_the_services_would_refuse(values, reason):
    assert reason in render_refusal(values)


def test_dashboard_configmap_carries_the_sidecar_label_and_the_dashboard():
    m = render({"grafana": {"dashboard": {"annotations": {"grafana_folder": "Tandem"}}}})
    dashboard = one(m, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Tandem"}
    assert dashboard["metadata"]["namespace"] == NAMESPACE
    with open(os.path.join(ROOT, "deploy", "grafana", "tandem.json")) as f:
        assert json.loads(dashboard["data"]["tandem.json"]) == json.load(f)


def test_dashboard_can_go_to_grafanas_namespace_or_be_left_out():
    moved = render({"grafana": {"dashboard": {"namespace": "monitoring"}}})
    assert one(moved, "ConfigMap", f"{FULLNAME}-dashboard")["metadata"]["namespace"] == "monitoring"
    left_out = render({"grafana": {"dashboard": {"enabled": False}}})
    assert [m for m in left_out if m["metadata"]["name"] == f"{FULLNAME}-dashboard"] == []


def test_helm_test_pod_sends_a_request_to_the_router_service():
    pod = one(render(), "Pod", f"{FULLNAME}-test-generate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert {e["name"]: e["value"] for e in c["env"]} == {
        "ROUTER": f"{FULLNAME}-router:50051",
        "PROMPT": "def fibonacci(n):",
        "MAX_TOKENS": "8",
    }
    assert c["command"][:2] == ["python", "-c"]
    compile(c["command"][2], "helm-test", "exec")


def test_notes_name_the_router_service_and_the_client_tokens_secret():
    notes = render_files()["tandem/templates/NOTES.txt"]
    assert notes.startswith("Tandem 0.1.0: 1 router(s), 1 prefill and 1 decode worker(s)\n")
    assert f"port-forward svc/{FULLNAME}-router 50051 8000" in notes
    assert "--tp" not in render_files(TP_2)["tandem/templates/NOTES.txt"]  # tandem worker takes it
    assert "client token" not in notes
    with_token = render_files(TOKENS)["tandem/templates/NOTES.txt"]
    assert (
        'Clients send the client token (Secret tandem-client, key api-token) as "authorization: Bearer'
        in with_token
    )
