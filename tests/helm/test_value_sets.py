"""What each value set must produce: workloads, replicas, GPUs, arguments, model volumes."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import (
    FULLNAME,
    config,
    container,
    deployment,
    effective_args,
    flag,
    names,
    one,
    render,
)

ONE_P_ONE_D = {
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "model": {
        "source": "pvc",
        "pvc": {"claimName": "weights", "subPath": "llama"},
        "target": "Llama-3.1-8B-Instruct",
        "drafter": "EAGLE3-LLaMA3.1-Instruct-8B",
    },
}
TWO_P_FOUR_D = {
    "prefill": {"replicas": 2, "nodeSelector": {"pool": "h200-prefill"}},
    "decode": {"replicas": 4, "kvCacheMb": 65536, "nodeSelector": {"pool": "h200-decode"}},
    "engine": {"numSpecTokens": 3},
}
TP_2 = {"engine": {"tp": 2}}
SEPARATE = {"engine": {"layout": "separate"}}
WORKERS = ("prefill", "decode")


def gpus(manifests: list[dict], component: str) -> int | None:
    return container(manifests, component)["resources"].get("limits", {}).get("nvidia.com/gpu")


def test_defaults_run_one_router_one_prefill_one_decode_on_one_gpu_each():
    m = render()
    assert names(m, "Deployment") == [f"{FULLNAME}-decode", f"{FULLNAME}-prefill", f"{FULLNAME}-router"]
    assert [deployment(m, c)["spec"]["replicas"] for c in ("router", *WORKERS)] == [1, 1, 1]
    assert [gpus(m, c) for c in ("router", *WORKERS)] == [None, 1, 1]
    assert container(m, "router")["image"] == "tandem:0.1.0"


def test_defaults_pass_the_cluster_config_to_every_role():
    m = render()
    assert config(m)["TANDEM_LAYOUT"] == "unified"
    for role in WORKERS:
        args = effective_args(m, role)
        assert args[:3] == ["worker", "--role", role]
        assert flag(args, "--layout") == "unified"
        assert flag(args, "-k") == "4"
        assert flag(args, "--tokens-per-page") == "16"
        assert flag(args, "--device") == "cuda"
        assert flag(args, "--model") == "/opt/tandem/models/tiny-target"
        assert flag(args, "--drafter") == "/opt/tandem/models/tiny-drafter"
        assert flag(args, "--router") == f"{FULLNAME}-router-internal:50051"
        assert flag(args, "--host") == "$(POD_IP)"
        assert flag(args, "--instance-id") == "$(POD_NAME)"
        assert flag(args, "--tp") is None
    router = effective_args(m, "router")
    assert router[0] == "router"
    assert (flag(router, "-k"), flag(router, "--tokens-per-page")) == ("4", "16")
    assert flag(router, "--model") == "/opt/tandem/models/tiny-target"


def test_downward_api_gives_each_worker_its_pod_ip_and_name():
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(render(), "decode")["env"]}
    assert env == {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"}


@pytest.mark.parametrize("component, port", [("router", 50051), ("prefill", 50061), ("decode", 50061)])
def test_probes_ask_the_grpc_health_service_on_the_grpc_port(component, port):
    c = container(render(), component)
    assert {p["name"]: p["containerPort"] for p in c["ports"] if p["name"] != "http"} == {
        "grpc": port,
        "metrics": 9100,
    }
    assert c["startupProbe"]["grpc"] == {"port": port}
    assert c["livenessProbe"]["grpc"] == {"port": port}
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": "tandem.ready"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 900


def test_readiness_service_empty_means_the_overall_status():
    c = container(render({"probes": {"readiness": {"service": ""}}}), "decode")
    assert c["readinessProbe"]["grpc"] == {"port": 50061}


def test_one_prefill_one_decode_from_a_read_only_pvc():
    m = render(ONE_P_ONE_D)
    assert [deployment(m, c)["spec"]["replicas"] for c in WORKERS] == [1, 1]
    for component in ("router", *WORKERS):
        pod = deployment(m, component)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        (mount,) = [v for v in container(m, component)["volumeMounts"] if v["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama"}
        assert "initContainers" not in pod
    args = effective_args(m, "prefill")
    assert flag(args, "--model") == "/models/Llama-3.1-8B-Instruct"
    assert flag(args, "--drafter") == "/models/EAGLE3-LLaMA3.1-Instruct-8B"


def test_two_prefill_four_decode():
    m = render(TWO_P_FOUR_D)
    assert [deployment(m, c)["spec"]["replicas"] for c in ("router", *WORKERS)] == [1, 2, 4]
    assert [gpus(m, c) for c in WORKERS] == [1, 1]
    assert [flag(effective_args(m, c), "-k") for c in ("router", *WORKERS)] == ["3", "3", "3"]
    assert flag(effective_args(m, "decode"), "--kv-cache-mb") == "65536"
    assert flag(effective_args(m, "prefill"), "--kv-cache-mb") is None  # 0.9 of its GPU, as vLLM
    for role in WORKERS:
        pod = deployment(m, role)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": f"h200-{role}"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_tp_2_requests_two_gpus_per_worker_and_passes_tp():
    m = render(TP_2)
    assert [gpus(m, c) for c in WORKERS] == [2, 2]
    assert [flag(effective_args(m, c), "--tp") for c in WORKERS] == ["2", "2"]
    assert gpus(m, "router") is None


def test_a_role_overrides_tp():
    m = render({"engine": {"tp": 2}, "decode": {"tp": 4}})
    assert [gpus(m, c) for c in WORKERS] == [2, 4]
    assert [flag(effective_args(m, c), "--tp") for c in WORKERS] == ["2", "4"]


def test_separate_layout_reaches_both_worker_roles():
    m = render(SEPARATE)
    assert [flag(effective_args(m, c), "--layout") for c in WORKERS] == ["separate", "separate"]


def test_separate_layout_without_a_drafter_runs_the_target_alone():
    m = render({"engine": {"layout": "separate"}, "model": {"drafter": ""}})
    assert flag(effective_args(m, "decode"), "--drafter") == "none"


def test_cpu_device_requests_no_gpu():
    m = render({"engine": {"device": "cpu"}})
    assert [gpus(m, c) for c in WORKERS] == [None, None]
    assert flag(effective_args(m, "decode"), "--device") == "cpu"


def test_gpu_resource_name_is_a_value():
    m = render({"gpuResource": "amd.com/gpu"})
    assert container(m, "decode")["resources"]["limits"]["amd.com/gpu"] == 1


def test_prefix_cache_off_adds_the_flag_to_workers_only():
    m = render({"engine": {"prefixCache": False}})
    assert [("--no-prefix-cache" in effective_args(m, c)) for c in ("router", *WORKERS)] == [
        False,
        True,
        True,
    ]


def test_a_host_kv_tier_reaches_its_worker_role_only():
    m = render({"decode": {"hostKvCache": {"mb": 4096, "writePolicy": "through", "recallMinPages": 2}}})
    assert [
        flag(effective_args(m, "decode"), f)
        for f in ("--host-kv-cache-mb", "--host-kv-write-policy", "--host-kv-recall-min-pages")
    ] == ["4096", "through", "2"]
    assert "--host-kv-cache-mb" not in effective_args(m, "prefill")
    assert "--host-kv-cache-mb" not in effective_args(render({}), "decode")  # 0 = none


def test_every_pod_rolls_when_the_cluster_config_changes():
    def checksums(values):
        m = render(values)
        return {
            deployment(m, c)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for c in ("router", *WORKERS)
        }

    before, after = checksums({}), checksums({"engine": {"numSpecTokens": 2}})
    assert len(before) == 1 and len(after) == 1 and before != after


def test_router_services_for_clients_and_for_registration():
    m = render()
    client = one(m, "Service", f"{FULLNAME}-router")
    assert client["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"]) for p in client["spec"]["ports"]] == [
        ("grpc", 50051),
        ("http", 8000),
        ("metrics", 9100),
    ]
    internal = one(m, "Service", f"{FULLNAME}-router-internal")
    assert internal["spec"]["clusterIP"] == "None"
    assert internal["spec"]["publishNotReadyAddresses"] is True
    assert names(m, "Service") == sorted(
        f"{FULLNAME}-{s}" for s in ("router", "router-internal", "prefill", "decode")
    )


def test_router_serves_openai_http_unless_turned_off():
    on = render()
    assert flag(effective_args(on, "router"), "--http-port") == "8000"
    off = render({"router": {"httpPort": None}})
    assert flag(effective_args(off, "router"), "--http-port") == "-1"
    assert [p["name"] for p in container(off, "router")["ports"]] == ["grpc", "metrics"]
    client = one(off, "Service", f"{FULLNAME}-router")
    assert [p["name"] for p in client["spec"]["ports"]] == ["grpc", "metrics"]


def test_monitors_are_off_by_default_and_scrape_metrics_ports_when_on():
    assert names(render(), "PodMonitor") == names(render(), "ServiceMonitor") == []
    m = render(
        {
            "metrics": {
                "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                "serviceMonitor": {"enabled": True, "interval": "30s"},
            }
        }
    )
    pod_monitor = one(m, "PodMonitor", FULLNAME)
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"
    assert pod_monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    service_monitor = one(m, "ServiceMonitor", FULLNAME)
    assert service_monitor["spec"]["endpoints"][0]["interval"] == "30s"


def test_the_kv_memory_is_the_workers_default_fraction_unless_a_role_sets_it():
    m = render({"prefill": {"gpuMemoryUtilization": 0.6}, "decode": {"kvCacheMb": 4096}})
    prefill, decode = effective_args(m, "prefill"), effective_args(m, "decode")
    assert (flag(prefill, "--gpu-memory-utilization"), flag(prefill, "--kv-cache-mb")) == ("0.6", None)
    assert (flag(decode, "--gpu-memory-utilization"), flag(decode, "--kv-cache-mb")) == (None, "4096")
    defaults = render()
    for role in WORKERS:  # neither flag: the worker takes 0.9 of its GPU
        args = effective_args(defaults, role)
        assert flag(args, "--gpu-memory-utilization") is None and flag(args, "--kv-cache-mb") is None


def test_the_sizing_values_reach_the_workers_and_the_router_its_context():
    m = render({"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096, "maxNumSeqs": 32}})
    for role in WORKERS:
        args = effective_args(m, role)
        assert [flag(args, f) for f in ("--max-model-len", "--max-num-batched-tokens", "--max-num-seqs")] == [
            "8192",
            "4096",
            "32",
        ]
    assert flag(effective_args(m, "router"), "--max-model-len") == "8192"


@pytest.mark.parametrize("level", ["DEBUG", "WARNING", "ERROR"])
def test_log_level_reaches_every_process(level):
    m = render({"logLevel": level})
    assert [flag(effective_args(m, c), "--log-level") for c in ("router", *WORKERS)] == [level] * 3
    assert config(m)["TANDEM_LOG_LEVEL"] == level


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
@pytest.mark.parametrize("args", [["--unsafe-forced-acceptance", "2"], ["--unsafe-forced-acceptance=0"]])
def test_forced_acceptance_is_refused_through_extra_args(component, args):
    with pytest.raises(helm_python.HelmRenderError) as e:
        render({component: {"extraArgs": ["--enforce-eager", *args]}})
    assert (
        f"{component}.extraArgs: --unsafe-forced-acceptance is for benchmarks only (the outputs are not "
        "the target model's); the chart refuses it" in str(e.value)
    )
