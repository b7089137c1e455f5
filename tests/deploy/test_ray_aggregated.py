"""cluster.yaml's aggregated role for ``tandem ray up``: its section and defaults, the worker
sets refused because they could never serve, what an aggregated actor runs and how Ray places
it, and when ``up`` counts it ready."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deploy.ray_launcher.config import AggregatedOptions, ConfigError, parse_config
from deploy.ray_launcher.launcher import actor_options, describe, is_ready, readiness, worker_instances
from deploy.ray_launcher.service_configs import Listen, worker_config
from services.common.security import worker_token

LISTEN = Listen("10.0.0.7", 50061, 9100)
ROUTER = "10.0.0.1:50051"
AGGREGATED_ONLY = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 2}}


def _health(pairs: int, aggregated: int, serving: bool = True) -> dict:
    return {"serving": serving, "num_ready_pairs": pairs, "num_aggregated_workers": aggregated, "message": ""}


def test_without_the_section_no_aggregated_worker_is_placed_and_the_pair_stays():
    config = parse_config({})
    assert config.aggregated == AggregatedOptions()
    assert (config.prefill.replicas, config.decode.replicas, config.aggregated.replicas) == (1, 1, 0)
    assert (config.aggregated.num_cpus, config.aggregated.num_gpus, config.aggregated.tp) == (1.0, 1.0, None)
    assert worker_instances(config) == [("prefill", "prefill-0"), ("decode", "decode-0")]


def test_aggregated_workers_run_alone_or_beside_the_pairs():
    alone = parse_config(AGGREGATED_ONLY)
    assert alone.expected_pairs == 0
    assert worker_instances(alone) == [("aggregated", "aggregated-0"), ("aggregated", "aggregated-1")]
    beside = parse_config({"prefill": {"replicas": 2}, "aggregated": {"replicas": 1}})
    assert beside.expected_pairs == 2
    assert worker_instances(beside) == [
        ("prefill", "prefill-0"),
        ("prefill", "prefill-1"),
        ("decode", "decode-0"),
        ("aggregated", "aggregated-0"),
    ]


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"decode": {"replicas": 0}},
            "decode.replicas: 0 with prefill.replicas 1: a prefill worker serves only paired with a decode "
            "worker; give decode.replicas too, or run no prefill worker and serve with aggregated.replicas",
        ),
        (
            {"prefill": {"replicas": 0}, "decode": {"replicas": 2}, "aggregated": {"replicas": 1}},
            "prefill.replicas: 0 with decode.replicas 2: a decode worker serves only paired with a prefill "
            "worker; give prefill.replicas too, or run no decode worker and serve with aggregated.replicas",
        ),
        (
            {"prefill": {"replicas": 0}, "decode": {"replicas": 0}},
            "prefill.replicas, decode.replicas, aggregated.replicas: all 0, so `up` would place no worker; "
            "give prefill.replicas and decode.replicas, or aggregated.replicas",
        ),
        ({"aggregated": {"replicas": -1}}, "aggregated.replicas: must be an integer >= 0, got -1"),
        ({"aggregated": {"replicas": True}}, "aggregated.replicas: must be an integer >= 0, got True"),
        ({"prefill": {"replicas": 1.5}}, "prefill.replicas: must be an integer >= 0, got 1.5"),
        (
            {"aggregated": {"replica": 1}},
            "aggregated.replica: unknown key (known: gpu_memory_utilization, kv_cache_mb, lease_s, "
            "metrics_port, num_cpus, num_gpus, port, replicas, resources, tp, transfer_timeout_s)",
        ),
        ({"aggregated": []}, "aggregated: must be a mapping"),
        ({"aggregated": {"num_gpus": -1}}, "aggregated.num_gpus: must be a number >= 0, got -1"),
        (
            {"aggregated": {"resources": {"gpu-node": "x"}}},
            "aggregated.resources.gpu-node: must be a number >= 0, got 'x'",
        ),
    ],
)
def test_worker_sets_that_never_serve_are_refused_naming_the_fields(data, message):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "data, message",
    [
        ({"aggregated": {"tp": 0}}, r"^aggregated\.tp: "),
        ({"aggregated": {"kv_cache_mb": -1}}, r"^aggregated\.kv_cache_mb: "),
        ({"aggregated": {"lease_s": 0}}, r"^aggregated\.lease_s: "),
        ({"aggregated": {"gpu_memory_utilization": 0.5}}, r"^aggregated\.gpu_memory_utilization: .*CUDA"),
    ],
)
def test_the_aggregated_roles_own_options_are_checked_like_the_others(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_an_aggregated_actor_runs_the_decode_workers_config_with_role_both():
    sizing = {"tp": 2, "num_gpus": 2, "kv_cache_mb": 256}
    aggregated_section = sizing | {"replicas": 1}
    config = parse_config({"model": {"kv_cache_mb": 64}, "decode": sizing, "aggregated": aggregated_section})
    aggregated = worker_config(config, "aggregated", "aggregated-0", ROUTER, LISTEN)
    decode = worker_config(config, "decode", "decode-0", ROUTER, LISTEN)
    assert (aggregated.role, aggregated.instance_id, aggregated.router) == ("both", "aggregated-0", ROUTER)
    assert (aggregated.engine.tp_size, aggregated.engine.kv_cache_bytes) == (2, 256 << 20)
    assert not aggregated.moves_pages
    assert replace(aggregated, role="decode", instance_id="decode-0") == decode


def test_aggregated_actors_share_a_gpu_and_get_the_credentials_like_the_others(monkeypatch):
    monkeypatch.setenv("LLM_SERVICE_TOKEN", "service-secret")
    config = parse_config(
        {
            "model": {"device": "cuda"},
            "aggregated": {"replicas": 2, "num_gpus": 0.5},
            "security": {"service_token_env": "LLM_SERVICE_TOKEN"},
        }
    )
    assert config.worker_engine_options("aggregated").gpu_memory_utilization == 0.45
    worker = worker_config(config, "aggregated", "aggregated-1", ROUTER, LISTEN)
    assert worker.service_secret == "service-secret"
    assert worker.own_token == worker_token("service-secret", "aggregated-1")  # what the router checks


def test_ray_places_an_aggregated_actor_with_its_sections_resources_in_the_namespace():
    config = parse_config(
        {
            "ray": {"namespace": "serving", "env": {"UCX_NET_DEVICES": "lo", "N": 2}},
            "aggregated": {"replicas": 1, "num_cpus": 4, "num_gpus": 1, "resources": {"gpu-node": 1}},
        }
    )
    assert actor_options(config, config.aggregated, "tandem-aggregated-0") == {
        "name": "tandem-aggregated-0",
        "namespace": "serving",
        "lifetime": "detached",
        "max_restarts": 0,
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"gpu-node": 1},
        "runtime_env": {"env_vars": {"UCX_NET_DEVICES": "lo", "N": "2"}},
    }


def test_up_waits_for_every_pair_and_every_aggregated_worker():
    alone = parse_config(AGGREGATED_ONLY)
    assert not is_ready(alone, _health(0, 1))
    assert is_ready(alone, _health(0, 2))
    assert not is_ready(alone, _health(0, 2, serving=False))
    assert readiness(alone, _health(0, 1)) == "1/2 aggregated workers"
    beside = parse_config({"aggregated": {"replicas": 1}})
    assert not is_ready(beside, _health(1, 0)) and not is_ready(beside, _health(0, 1))
    assert is_ready(beside, _health(1, 1))
    assert readiness(beside, _health(1, 0)) == "1/1 pairs ready, 0/1 aggregated workers"
    assert readiness(parse_config({}), _health(0, 0)) == "0/1 pairs ready"


def test_the_summary_names_the_aggregated_workers():
    config = parse_config(AGGREGATED_ONLY | {"aggregated": {"replicas": 1}})
    endpoints = [
        {"name": "router", "grpc": "h:1", "metrics": "http://h:2/metrics", "http": "http://h:3", "node": "h"},
        {"name": "aggregated-0", "grpc": "h:4", "metrics": "http://h:5/metrics", "http": "", "node": "h"},
    ]
    assert describe(config, endpoints).splitlines() == [
        "tandem on Ray (namespace 'tandem'): 1 aggregated",
        "router       grpc=h:1  metrics=http://h:2/metrics  http=http://h:3  node=h",
        "aggregated-0 grpc=h:4  metrics=http://h:5/metrics  node=h",
        "router endpoint: h:1  (OpenAI-compatible: http://h:3/v1)",
    ]
    both = parse_config({"prefill": {"replicas": 2}, "aggregated": {"replicas": 1}})
    assert describe(both, endpoints[:1]).splitlines()[0] == (
        "tandem on Ray (namespace 'tandem'): 2 prefill x 1 decode (2 pairs), 1 aggregated"
    )
