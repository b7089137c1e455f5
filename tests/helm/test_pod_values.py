"""What production pods add: extra environment and volumes, PodDisruptionBudgets, the
ServiceAccount, the router's rolling update and its replicas."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import FULLNAME, container, deployment, names, one, render
from tests.helm.test_value_sets import WORKERS

COMPONENTS = ("router", *WORKERS)
EXTRA_ENV = [
    {"name": "GRPC_VERBOSITY", "value": "debug"},
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
]
EXTRA_VOLUMES = [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}]
EXTRA_MOUNTS = [{"name": "cache", "mountPath": "/var/cache/tandem"}]
EXTRAS = {
    c: {"extraEnv": EXTRA_ENV, "extraVolumes": EXTRA_VOLUMES, "extraVolumeMounts": EXTRA_MOUNTS}
    for c in COMPONENTS
}
PDBS = {
    "router": {"replicas": 2, "podDisruptionBudget": {"enabled": True}},
    "prefill": {"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}},
    "decode": {"podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": 1}},
}
EXISTING_ACCOUNT = {"serviceAccount": {"create": False, "name": "gpu-workloads"}}


def pod(manifests: list[dict], component: str) -> dict:
    return deployment(manifests, component)["spec"]["template"]["spec"]


def test_extra_env_comes_after_the_pods_own_and_before_the_configmap():
    m = render(EXTRAS)
    for component in COMPONENTS:
        c = container(m, component)
        assert [e["name"] for e in c["env"]] == ["POD_IP", "POD_NAME", "GRPC_VERBOSITY", "HF_TOKEN"]
        assert c["env"][2:] == EXTRA_ENV
        assert c["envFrom"] == [{"configMapRef": {"name": f"{FULLNAME}-config"}}]


def test_extra_volumes_and_mounts_follow_the_charts_own():
    m = render(EXTRAS)
    assert pod(m, "router")["volumes"] == EXTRA_VOLUMES
    assert container(m, "router")["volumeMounts"] == EXTRA_MOUNTS
    for role in WORKERS:
        assert [v["name"] for v in pod(m, role)["volumes"]] == ["shm", "cache"]
        assert pod(m, role)["volumes"][1:] == EXTRA_VOLUMES
        assert container(m, role)["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}, *EXTRA_MOUNTS]


def test_extras_of_one_component_stay_in_it():
    m = render({"decode": EXTRAS["decode"]})
    assert [e["name"] for e in container(m, "prefill")["env"]] == ["POD_IP", "POD_NAME"]
    assert "volumes" not in pod(m, "router")
    assert [v["name"] for v in pod(m, "prefill")["volumes"]] == ["shm"]


def test_extra_mounts_follow_the_model_and_tls_mounts():
    values = {
        "model": {"source": "pvc", "pvc": {"claimName": "weights"}},
        "tls": {"enabled": True, "existingSecret": "tandem-tls", "clientSecret": "c"},
        "router": EXTRAS["router"],
    }
    m = render(values)
    assert [v["name"] for v in container(m, "router")["volumeMounts"]] == ["model", "tls", "cache"]
    assert [v["name"] for v in pod(m, "router")["volumes"]] == ["model", "tls", "cache"]


def test_no_disruption_budget_by_default():
    assert names(render(), "PodDisruptionBudget") == []


def test_a_disruption_budget_per_component_selects_its_pods():
    m = render(PDBS)
    assert names(m, "PodDisruptionBudget") == [f"{FULLNAME}-{c}" for c in ("decode", "prefill", "router")]
    budget = {c: one(m, "PodDisruptionBudget", f"{FULLNAME}-{c}") for c in COMPONENTS}
    assert budget["router"]["apiVersion"] == "policy/v1"
    assert {c: {k: v for k, v in b["spec"].items() if k != "selector"} for c, b in budget.items()} == {
        "router": {"minAvailable": 1},
        "prefill": {"minAvailable": "50%"},
        "decode": {"maxUnavailable": 1},
    }
    for component, b in budget.items():
        assert b["spec"]["selector"] == deployment(m, component)["spec"]["selector"]
        assert b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component


def test_a_disruption_budget_takes_min_available_or_max_unavailable_not_both():
    with pytest.raises(helm_python.HelmRenderError) as e:
        render({"decode": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}})
    assert (
        "decode.podDisruptionBudget: give minAvailable or maxUnavailable, not both (set the other null)"
        in str(e.value)
    )


def test_every_pod_runs_as_the_charts_service_account_without_an_api_token():
    m = render()
    account = one(m, "ServiceAccount", FULLNAME)
    assert account["automountServiceAccountToken"] is False
    specs = [pod(m, c) for c in COMPONENTS] + [one(m, "Pod", f"{FULLNAME}-test-generate")["spec"]]
    for spec in specs:
        assert (spec["serviceAccountName"], spec["automountServiceAccountToken"]) == (FULLNAME, False)


def test_an_existing_service_account_is_used_and_none_is_created():
    m = render(EXISTING_ACCOUNT)
    assert names(m, "ServiceAccount") == []
    assert [pod(m, c)["serviceAccountName"] for c in COMPONENTS] == ["gpu-workloads"] * 3
    assert pod(render({"serviceAccount": {"create": False}}), "router")["serviceAccountName"] == "default"


def test_a_created_service_account_takes_a_name_and_annotations():
    values = {"serviceAccount": {"name": "tandem-sa", "annotations": {"team": "llm"}}}
    account = one(render(values), "ServiceAccount", "tandem-sa")
    assert account["metadata"]["annotations"] == {"team": "llm"}
    assert pod(render(values), "decode")["serviceAccountName"] == "tandem-sa"


def test_the_router_rolls_one_pod_at_a_time_without_a_surge_pod():
    m = render()
    assert deployment(m, "router")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    for role in WORKERS:  # unchanged: a surge worker would wait for GPUs its predecessor holds
        assert deployment(m, role)["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 0,
            "maxUnavailable": 1,
        }


def test_router_strategy_and_replicas_are_values():
    m = render(
        {"router": {"replicas": 3, "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}}
    )
    router = deployment(m, "router")["spec"]
    assert router["replicas"] == 3
    assert router["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    recreate = deployment(render({"router": {"strategy": {"type": "Recreate"}}}), "router")
    assert recreate["spec"]["strategy"] == {"type": "Recreate"}  # the default rollingUpdate left out
