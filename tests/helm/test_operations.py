"""What operating the chart adds, all off by default: autoscalers on a metric the router
exports, an Ingress, topology spread, priority classes, per-role security contexts, the
preStop hook and grace period, and a PrometheusRule whose alerts read exported metrics and
fire (checked by promtool where it is installed)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.test_grafana import exported, parse
from tests.helm.chart import (
    FULLNAME,
    NAMESPACE,
    container,
    deployment,
    names,
    one,
    render,
    render_refusal,
    schema_refusal,
)

COMPONENTS = ("router", "prefill", "decode")
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
OWN_SPREAD = {**SPREAD, "labelSelector": {"matchLabels": {"team": "llm"}}}
OPERATIONS = {
    "router": {
        "autoscaling": {"enabled": True, "maxReplicas": 3},
        "priorityClassName": "llm-frontend",
        "securityContext": {"readOnlyRootFilesystem": True},
    },
    "prefill": {"topologySpreadConstraints": [SPREAD], "podSecurityContext": {"fsGroup": 1000}},
    "decode": {
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8},
        "priorityClassName": "llm-gpu",
        "topologySpreadConstraints": [OWN_SPREAD],
    },
    "securityContext": {"runAsNonRoot": True},
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "host": "llm.example.com",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
    },
    "alerts": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "shutdown": {"preStopSleepSeconds": 10, "drainSeconds": 60},
}


def pod(manifests: list[dict], component: str) -> dict:
    return deployment(manifests, component)["spec"]["template"]["spec"]


def test_nothing_is_added_by_default_but_the_prestop_hook_and_its_grace_period():
    m = render()
    assert names(m, "HorizontalPodAutoscaler") == names(m, "Ingress") == names(m, "PrometheusRule") == []
    for component in COMPONENTS:
        spec = pod(m, component)
        assert "priorityClassName" not in spec and "topologySpreadConstraints" not in spec
        assert "securityContext" not in spec and "securityContext" not in container(m, component)
        assert deployment(m, component)["spec"]["replicas"] == 1
        assert container(m, component)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
        assert spec["terminationGracePeriodSeconds"] == 5 + 30 + 10


def test_an_autoscaler_owns_its_roles_replicas_on_the_routers_waiting_requests():
    m = render(OPERATIONS)
    assert names(m, "HorizontalPodAutoscaler") == [f"{FULLNAME}-decode", f"{FULLNAME}-router"]
    decode = one(m, "HorizontalPodAutoscaler", f"{FULLNAME}-decode")["spec"]
    assert decode["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-decode",
    }
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    assert decode["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "name": "tandem_requests_waiting",
                    "selector": {"matchLabels": {"role": "router"}},
                },
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]
    router = one(m, "HorizontalPodAutoscaler", f"{FULLNAME}-router")["spec"]["metrics"][0]
    assert router["type"] == "Pods" and router["pods"]["metric"]["name"] == "tandem_requests_running"
    assert (
        "replicas" not in deployment(m, "decode")["spec"]
        and "replicas" not in deployment(m, "router")["spec"]
    )
    assert deployment(m, "prefill")["spec"]["replicas"] == 1
    series = exported()
    for hpa in (decode["metrics"][0]["external"], router["pods"]):
        assert hpa["metric"]["name"] in series
        assert set(hpa["metric"]["selector"]["matchLabels"]) <= series[hpa["metric"]["name"]]


def test_the_ingress_routes_to_the_routers_http_port():
    m = render(OPERATIONS)
    spec = one(m, "Ingress", f"{FULLNAME}-router")["spec"]
    assert spec["ingressClassName"] == "nginx" and spec["tls"] == OPERATIONS["ingress"]["tls"]
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{FULLNAME}-router", "port": {"name": "http"}}
    ports = one(m, "Service", f"{FULLNAME}-router")["spec"]["ports"]
    assert "http" in [p["name"] for p in ports]


def test_placement_and_security_are_per_role_over_the_chart_wide_ones():
    m = render(OPERATIONS)
    assert pod(m, "router")["priorityClassName"] == "llm-frontend"
    assert pod(m, "decode")["priorityClassName"] == "llm-gpu"
    assert "priorityClassName" not in pod(m, "prefill")
    (spread,) = pod(m, "prefill")["topologySpreadConstraints"]
    assert spread == {
        **SPREAD,
        "labelSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "tandem",
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/component": "prefill",
            }
        },
    }
    assert pod(m, "decode")["topologySpreadConstraints"] == [OWN_SPREAD]
    assert container(m, "router")["securityContext"] == {"readOnlyRootFilesystem": True}
    assert container(m, "decode")["securityContext"] == {"runAsNonRoot": True}  # the chart-wide one
    assert pod(m, "prefill")["securityContext"] == {"fsGroup": 1000}
    assert "securityContext" not in pod(m, "decode")


def test_the_grace_period_covers_the_prestop_sleep_and_the_drain():
    m = render(OPERATIONS)
    for component in COMPONENTS:
        assert pod(m, component)["terminationGracePeriodSeconds"] == 10 + 60 + 10
        assert container(m, component)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    m = render(
        {"shutdown": {"preStopSleepSeconds": 0, "drainSeconds": 30}, "terminationGracePeriodSeconds": 120}
    )
    assert pod(m, "decode")["terminationGracePeriodSeconds"] == 120
    assert "lifecycle" not in container(m, "decode")


@pytest.mark.parametrize(
    "values, reason",
    [
        (
            {"terminationGracePeriodSeconds": 20},
            "terminationGracePeriodSeconds: 20 is shorter than shutdown.preStopSleepSeconds + "
            "shutdown.drainSeconds (35)",
        ),
        ({"ingress": {"enabled": True}, "router": {"httpPort": None}}, "ingress.enabled: the Ingress routes"),
        (
            {"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            "decode.autoscaling: minReplicas 5 is above maxReplicas 2",
        ),
        (
            {
                "auth": {"serviceToken": {"existingSecret": "svc"}},
                "prefill": {"workerToken": {"existingSecret": "w"}, "autoscaling": {"enabled": True}},
            },
            "prefill.autoscaling.enabled: a worker token names one instance id",
        ),
    ],
)
def test_templates_refuse_operations_values_that_would_not_work(values, reason):
    assert reason in render_refusal(values)


@pytest.mark.parametrize(
    "values, where, problem",
    [
        (
            {"decode": {"autoscaling": {"metric": {"type": "Object"}}}},
            "/decode/autoscaling/metric/type",
            "value must be one of",
        ),
        (
            {"router": {"autoscaling": {"minReplicas": 0}}},
            "/router/autoscaling/minReplicas",
            "minimum: got 0, want 1",
        ),
        (
            {"alerts": {"kvCacheUsage": {"ratio": 95}}},
            "/alerts/kvCacheUsage/ratio",
            "maximum: got 95, want 1",
        ),
        (
            {"alerts": {"ttftP99": {"for": "ten minutes"}}},
            "/alerts/ttftP99/for",
            "'ten minutes' does not match pattern",
        ),
        ({"ingress": {"pathType": "Glob"}}, "/ingress/pathType", "value must be one of"),
        ({"shutdown": {"drainSeconds": -1}}, "/shutdown/drainSeconds", "minimum: got -1, want 0"),
        ({"prefill": {"priorityClassName": 3}}, "/prefill/priorityClassName", "got number, want string"),
    ],
)
def test_schema_refuses_operations_values_naming_the_key(values, where, problem):
    assert f"at '{where}': {problem}" in schema_refusal(values)


def _rules(values: dict | None = None) -> list[dict]:
    rule = one(render({**OPERATIONS, **(values or {})}), "PrometheusRule", FULLNAME)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (group,) = rule["spec"]["groups"]
    return group["rules"]


def test_the_alerts_read_only_exported_metrics_and_labels_of_this_release():
    rules = _rules()
    assert [r["alert"] for r in rules] == [
        "TandemNoReadyPair",
        "TandemKVTransferFailures",
        "TandemKVCacheFull",
        "TandemTTFTHigh",
    ]
    series = exported()
    pod_labels = {"namespace", "pod"}  # the Prometheus Operator's target labels
    for r in rules:
        metrics, selectors, by = parse(r["expr"])
        assert metrics - {"histogram_quantile", "max", "sum", "rate"} <= series.keys(), r["alert"]
        labels = set().union(*(series[n] for n in metrics if n in series)) | pod_labels
        assert selectors <= labels and by <= labels, r["alert"]
        assert (
            f'namespace="{NAMESPACE}"' in r["expr"]
            and f'pod=~"{FULLNAME}-(router|prefill|decode|aggregated)-.*"' in r["expr"]
        )
    kv = next(r for r in rules if r["alert"] == "TandemKVCacheFull")
    assert kv["expr"].endswith("> 0.95") and kv["for"] == "5m"


def test_an_alert_can_be_left_out_and_its_threshold_set():
    rules = _rules(
        {
            "alerts": {
                "enabled": True,
                "labels": {"release": "kube-prometheus-stack"},
                "noReadyPair": {"enabled": False},
                "ttftP99": {"seconds": 1.5},
            }
        }
    )
    assert "TandemNoReadyPair" not in [r["alert"] for r in rules]
    assert next(r for r in rules if r["alert"] == "TandemTTFTHigh")["expr"].endswith("> 1.5")


POD = f"{FULLNAME}-decode-5d8f-abcde"
AGGREGATED_POD = f"{FULLNAME}-aggregated-6b7c-klmno"
ROUTER_POD = f"{FULLNAME}-router-7c9b-fghij"


def _series(name: str, pod: str, values: str, **labels: str) -> dict:
    text = ", ".join([f'namespace="{NAMESPACE}"', f'pod="{pod}"', *(f'{k}="{v}"' for k, v in labels.items())])
    return {"series": f"{name}{{{text}}}", "values": values}


def _expected(rule: dict, **labels: str) -> dict:
    """The alert ``rule`` raises for a series of ``labels``: its labels and its annotations
    with the templates filled in."""
    annotations = dict(rule["annotations"])
    for key, value in labels.items():
        annotations = {k: v.replace(f"{{{{ $labels.{key} }}}}", value) for k, v in annotations.items()}
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": annotations}


def _promtool_test(rules: dict[str, dict]) -> dict:
    """Synthetic series over 12 minutes: a decode and an aggregated worker's pools held at 0.97,
    a router whose pairs go at minute 2, transfers failing 6 a minute; nothing slow enough for
    the TTFT alert."""
    kv, pairs, failures = (
        rules["TandemKVCacheFull"],
        rules["TandemNoReadyPair"],
        rules["TandemKVTransferFailures"],
    )
    return {
        "interval": "1m",
        "input_series": [
            _series("tandem_kv_cache_usage_ratio", POD, "0.97x12", group="target"),
            _series("tandem_kv_cache_usage_ratio", AGGREGATED_POD, "0.97x12", group="target"),
            _series("tandem_ready_pairs", ROUTER_POD, "1 1 0x10"),
            _series("tandem_kv_transfer_failures_total", POD, "0+6x12", group="target"),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "TandemKVCacheFull", "exp_alerts": []},
            {
                "eval_time": "6m",
                "alertname": "TandemKVCacheFull",
                "exp_alerts": [
                    _expected(kv, namespace=NAMESPACE, pod=pod, group="target")
                    for pod in (POD, AGGREGATED_POD)
                ],
            },
            {"eval_time": "3m", "alertname": "TandemNoReadyPair", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "TandemNoReadyPair",
                "exp_alerts": [_expected(pairs, namespace=NAMESPACE, pod=ROUTER_POD)],
            },
            {
                "eval_time": "11m",
                "alertname": "TandemKVTransferFailures",
                "exp_alerts": [_expected(failures, namespace=NAMESPACE, pod=POD)],
            },
            {"eval_time": "11m", "alertname": "TandemTTFTHigh", "exp_alerts": []},
        ],
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_promtool_checks_the_rules_and_they_fire_as_documented(tmp_path):
    spec = one(render(OPERATIONS), "PrometheusRule", FULLNAME)["spec"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(spec))
    check = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    by_name = {r["alert"]: r for r in spec["groups"][0]["rules"]}
    test = tmp_path / "test.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "tests": [_promtool_test(by_name)]}))
    run = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
