"""The aggregated worker role (`tandem worker --role both`): off by default, rendered by the
worker template as `<fullname>-aggregated` once it runs pods, alone or beside prefill/decode
pairs; the role value sets that could never serve are refused, naming the fields."""

from __future__ import annotations

import pytest

from tests.helm.chart import (
    FULLNAME,
    container,
    deployment,
    effective_args,
    flag,
    names,
    one,
    render,
    render_files,
    render_refusal,
    schema_refusal,
)
from tests.helm.test_cli_parses_the_chart import POD, parse

AGGREGATED = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 2}}
BESIDE_PAIRS = {"aggregated": {"replicas": 1}}  # one prefill and one decode worker by default
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def aggregated_objects(manifests: list[dict]) -> list[str]:
    return sorted(
        f"{m['kind']}/{m['metadata']['name']}" for m in manifests if "aggregated" in m["metadata"]["name"]
    )


def test_nothing_aggregated_is_rendered_by_default():
    assert aggregated_objects(render()) == []
    budget = {"aggregated": {"podDisruptionBudget": {"enabled": True}}}  # over no pods: none
    assert aggregated_objects(render(budget)) == []


def test_aggregated_only_renders_the_router_and_the_aggregated_workers():
    m = render(AGGREGATED)
    assert names(m, "Deployment") == [f"{FULLNAME}-aggregated", f"{FULLNAME}-router"]
    assert names(m, "Service") == [f"{FULLNAME}-{s}" for s in ("aggregated", "router", "router-internal")]
    d = deployment(m, "aggregated")
    assert d["spec"]["replicas"] == 2
    assert d["metadata"]["labels"]["app.kubernetes.io/component"] == "aggregated"
    assert d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "aggregated"
    pod = d["spec"]["template"]["spec"]
    assert pod["tolerations"] == [GPU_TOLERATION]
    assert [v["name"] for v in pod["volumes"]] == ["shm"]
    c = container(m, "aggregated")
    assert c["name"] == "aggregated"
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    assert c["readinessProbe"]["grpc"] == {"port": 50061, "service": "tandem.ready"}
    service = one(m, "Service", f"{FULLNAME}-aggregated")
    assert service["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("grpc", 50061), ("metrics", 9100)]


def test_aggregated_workers_run_role_both_with_the_other_workers_arguments():
    """Beside a pair, with equal role values: the decode worker's command line but --role."""
    m = render(BESIDE_PAIRS)
    assert names(m, "Deployment") == [
        f"{FULLNAME}-{c}" for c in ("aggregated", "decode", "prefill", "router")
    ]
    args = effective_args(m, "aggregated")
    assert args[:3] == ["worker", "--role", "both"]
    assert args[3:] == effective_args(m, "decode")[3:]
    assert flag(args, "--router") == f"{FULLNAME}-router-internal:50051"
    assert flag(args, "--model") == "/opt/tandem/models/tiny-target"
    assert flag(args, "--drafter") == "/opt/tandem/models/tiny-drafter"
    assert flag(args, "--instance-id") == "$(POD_NAME)"
    assert container(m, "aggregated")["envFrom"] == container(m, "decode")["envFrom"]


def test_the_cli_parses_the_aggregated_command_line_as_role_both(monkeypatch):
    args = parse(render(AGGREGATED), "aggregated", monkeypatch)
    assert (args.role, args.host, args.port) == ("both", POD["$(POD_IP)"], 50061)
    assert args.instance_id == POD["$(POD_NAME)"]


def test_the_aggregated_values_reach_only_the_aggregated_workers():
    values = {
        **AGGREGATED,
        "aggregated": {
            "replicas": 1,
            "tp": 2,
            "kvCacheMb": 4096,
            "port": 50071,
            "metricsPort": 9200,
            "nodeSelector": {"pool": "h200"},
            "podAnnotations": {"team": "llm"},
            "extraArgs": ["--enforce-eager"],
        },
    }
    m = render(values)
    args = effective_args(m, "aggregated")
    assert [flag(args, f) for f in ("--tp", "--kv-cache-mb", "--port", "--metrics-port")] == [
        "2",
        "4096",
        "50071",
        "9200",
    ]
    assert args[-1] == "--enforce-eager"
    c = container(m, "aggregated")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("grpc", 50071), ("metrics", 9200)]
    template = deployment(m, "aggregated")["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "h200"}
    assert template["metadata"]["annotations"]["team"] == "llm"
    assert "--tp" not in effective_args(m, "router")


def test_an_autoscaled_aggregated_role_at_0_replicas_renders_its_deployment_and_autoscaler():
    values = {**AGGREGATED, "aggregated": {"replicas": 0, "autoscaling": {"enabled": True, "maxReplicas": 6}}}
    m = render(values)
    assert "replicas" not in deployment(m, "aggregated")["spec"]  # the autoscaler owns it
    hpa = one(m, "HorizontalPodAutoscaler", f"{FULLNAME}-aggregated")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-aggregated",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 6)
    assert hpa["metrics"][0]["external"]["metric"]["name"] == "tandem_requests_waiting"


def test_a_disruption_budget_and_a_worker_token_of_the_aggregated_role():
    values = {
        **AGGREGATED,
        "auth": {"serviceToken": {"existingSecret": "tandem-service"}},
        "aggregated": {
            "replicas": 1,
            "podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": 1},
            "workerToken": {"existingSecret": "aggregated-0-token"},
        },
    }
    m = render(values)
    budget = one(m, "PodDisruptionBudget", f"{FULLNAME}-aggregated")["spec"]
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget
    assert budget["selector"]["matchLabels"]["app.kubernetes.io/component"] == "aggregated"
    c = container(m, "aggregated")
    assert [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})] == [
        {
            "name": "TANDEM_WORKER_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "aggregated-0-token", "key": "token"}},
        }
    ]
    assert "--instance-id" not in c["args"]  # the token names it


def test_every_worker_role_at_0_is_a_parked_release_of_the_router_alone():
    m = render({"prefill": {"replicas": 0}, "decode": {"replicas": 0}})
    assert names(m, "Deployment") == [f"{FULLNAME}-router"]
    assert names(m, "Service") == [f"{FULLNAME}-router", f"{FULLNAME}-router-internal"]


UNPAIRED_PREFILL = (
    "decode.replicas: 0 (and decode.autoscaling off) with prefill.replicas {n}: a prefill worker serves "
    "only paired with a decode worker, so the prefill pods would never become ready; give "
    "decode.replicas too, or run no prefill worker and serve with aggregated.replicas"
)
UNPAIRED_DECODE = (
    "prefill.replicas: 0 (and prefill.autoscaling off) with decode.replicas {n}: a decode worker serves "
    "only paired with a prefill worker, so the decode pods would never become ready; give "
    "prefill.replicas too, or run no decode worker and serve with aggregated.replicas"
)


@pytest.mark.parametrize(
    "values, reason",
    [
        ({"decode": {"replicas": 0}}, UNPAIRED_PREFILL.format(n=1)),
        ({"prefill": {"replicas": 0}, "decode": {"replicas": 3}}, UNPAIRED_DECODE.format(n=3)),
        (  # aggregated workers serve, but the prefill pods would still hold GPUs and never be ready
            {"prefill": {"replicas": 2}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1}},
            UNPAIRED_PREFILL.format(n=2),
        ),
        (
            {"prefill": {"replicas": 0, "autoscaling": {"enabled": True}}, "decode": {"replicas": 0}},
            UNPAIRED_PREFILL.replace("prefill.replicas {n}", "prefill.autoscaling on"),
        ),
        (
            {**AGGREGATED, "aggregated": {"replicas": 1, "extraArgs": ["--unsafe-forced-acceptance=2"]}},
            "aggregated.extraArgs: --unsafe-forced-acceptance is for benchmarks only",
        ),
        (
            {**AGGREGATED, "engine": {"tp": 2}, "aggregated": {"replicas": 1, "hostKvCache": {"mb": 64}}},
            "aggregated.hostKvCache.mb: the host KV tier's page copies are not mirrored to tensor-parallel "
            "ranks; use it with tp 1, not 2",
        ),
        (
            {**AGGREGATED, "engine": {"device": "cpu"}, "aggregated": {"gpuMemoryUtilization": 0.5}},
            "aggregated.gpuMemoryUtilization: sizes the KV cache from a GPU's memory, and engine.device "
            "is cpu: give aggregated.kvCacheMb",
        ),
        (
            {
                **AGGREGATED,
                "auth": {"serviceToken": {"existingSecret": "s"}},
                "aggregated": {"replicas": 2, "workerToken": {"existingSecret": "t"}},
            },
            "aggregated.workerToken.existingSecret: a worker token names one instance id, and 2 replicas "
            "would all register as it",
        ),
        (
            {
                **AGGREGATED,
                "auth": {"serviceToken": {"existingSecret": "s"}},
                "aggregated": {"workerToken": {"existingSecret": "t"}, "autoscaling": {"enabled": True}},
            },
            "aggregated.autoscaling.enabled: a worker token names one instance id",
        ),
        (
            {**AGGREGATED, "aggregated": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}},
            "aggregated.podDisruptionBudget: give minAvailable or maxUnavailable, not both",
        ),
    ],
)
def test_the_templates_refuse_role_values_naming_the_fields(values, reason):
    assert reason in render_refusal(values)


@pytest.mark.parametrize(
    "values, where, problem",
    [
        ({"aggregated": {"replica": 2}}, "/aggregated", "additional properties 'replica' not allowed"),
        ({"aggregated": {"replicas": -1}}, "/aggregated/replicas", "minimum: got -1, want 0"),
        ({"aggregated": {"replicas": "2"}}, "/aggregated/replicas", "got string, want integer"),
        (
            {"aggregated": {"hostKvCache": {"writePolicy": "back"}}},
            "/aggregated/hostKvCache/writePolicy",
            "value must be one of",
        ),
    ],
)
def test_the_schema_refuses_aggregated_values_naming_the_key(values, where, problem):
    assert f"at '{where}': {problem}" in schema_refusal(values)


def test_notes_count_the_aggregated_workers_when_there_are_any():
    notes = render_files(AGGREGATED)["tandem/templates/NOTES.txt"]
    assert notes.startswith(
        "Tandem 0.1.0: 1 router(s), 0 prefill and 0 decode worker(s), 2 aggregated worker(s) "
        "(prefill and decode in one, no KV transfer)\n"
    )
