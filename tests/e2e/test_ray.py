"""``tandem ray up`` / ``down`` on a local Ray cluster (2 CPUs, tiny random pair).

Ray binds to the machine's network address whatever it is told, so the scenario runs in a
private network namespace whose only interface is loopback: the test re-executes this
module (``scenario``) under ``unshare -n`` and reads the JSON report it prints last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploy.ray_launcher.config import ConfigError, parse_config
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "tandem-test"
PROMPT = list(range(1, 21))
MAX_TOKENS = 8
REPORT = "RAY-TEST-REPORT "


# ---------------------------------------------------------------------- cluster.yaml


def test_the_example_config_parses_with_its_documented_defaults():
    from deploy.ray_launcher.config import load_config

    config = load_config(str(ROOT / "deploy" / "ray" / "cluster.example.yaml"))
    assert (config.ray.address, config.ray.namespace, config.ray.start_local) == ("auto", "tandem", False)
    assert (config.router.port, config.router.http_port) == (50051, 8000)
    assert (config.prefill.replicas, config.decode.num_gpus, config.expected_pairs) == (1, 1, 1)
    assert (config.aggregated.replicas, config.aggregated.num_gpus) == (0, 1)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"router": {"prot": 1}}, "router.prot: unknown key"),
        ({"routr": {}}, "routr: unknown key"),
        ({"decode": {"replicas": 0}}, "decode.replicas: 0 with prefill.replicas 1: a prefill worker"),
        ({"prefill": {"num_gpus": -1}}, "prefill.num_gpus: must be a number >= 0"),
        ({"prefill": {"resources": {"tpu": "x"}}}, "prefill.resources.tpu: must be a number"),
        ({"model": {"layout": "mixed"}}, "model.layout: must be auto, unified or separate"),
        ({"ray": {"address": ""}}, "ray.address: empty"),
        ({"model": []}, "model: must be a mapping"),
    ],
)
def test_a_bad_config_names_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert str(e.value).startswith(message)


# ---------------------------------------------------------------------- the Ray scenario


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_ray_up_serves_a_request_and_down_stops_every_actor(tiny_pair, tmp_path):
    if not _can_unshare():
        pytest.skip(
            "unshare -n is not permitted here (needs root or user namespaces); the Ray "
            "test must not use the machine's network"
        )
    target, drafter = map(str, tiny_pair)
    command = (
        f"ip link set lo up && exec {sys.executable} -m tests.e2e.test_ray {target} {drafter} {tmp_path}"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        ["unshare", "-n", "bash", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(REPORT)]
    assert done.returncode == 0 and lines, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(lines[-1][len(REPORT) :])
    assert report["up_rc"] == 0, report["up_output"]
    assert report["node_ip"] == "127.0.0.1"
    assert report["endpoint"].startswith("127.0.0.1:")
    assert report["actors_up"] == ["tandem-decode-0", "tandem-prefill-0", "tandem-router"]
    assert len(report["tokens"]) == MAX_TOKENS
    assert report["finish_reason"] == "FINISH_REASON_LENGTH"
    assert report["http_completion_tokens"] == MAX_TOKENS
    assert report["max_model_len"] == 256  # model.max_model_len reached the router
    assert report["worker_log_lines"] == 1  # the decode actor logs as `decode-0` at log_level INFO
    assert report["down_rc"] == 0 and "stopped 3 actors" in report["down_output"]
    assert report["actors_down"] == []
    aggregated = report["aggregated"]  # the second `up`: one aggregated worker, no pair
    assert aggregated["up_rc"] == 0, aggregated["up_output"]
    assert "): 1 aggregated\n" in aggregated["up_output"]
    assert re.search(r"^aggregated-0 grpc=127\.0\.0\.1:\d+", aggregated["up_output"], re.M)
    assert aggregated["actors_up"] == ["tandem-aggregated-0", "tandem-router"]
    assert len(aggregated["tokens"]) == MAX_TOKENS
    assert aggregated["finish_reason"] == "FINISH_REASON_LENGTH"
    assert aggregated["down_rc"] == 0 and "stopped 2 actors" in aggregated["down_output"]
    assert aggregated["actors_down"] == []


def scenario(target: str, drafter: str, workdir: Path) -> dict:
    """Start Ray, `tandem ray up` a prefill/decode pair, serve one request over gRPC and one
    over HTTP, `tandem ray down`; then the same with one aggregated worker only, serving one
    request over gRPC. Runs inside the private network namespace."""
    import ray
    import yaml

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = workdir / "cluster.yaml"
    settings = _config(ray.get_runtime_context().gcs_address, target, drafter)
    config.write_text(yaml.safe_dump(settings))
    report = {"node_ip": ray.util.get_node_ip_address()}
    up = _tandem("up", config)
    report.update(up_rc=up.returncode, up_output=up.stdout + up.stderr, actors_up=_actors(ray))
    if up.returncode == 0:
        report["endpoint"] = re.search(r"router endpoint: (\S+)", up.stdout).group(1)
        tokens, complete = _generate(report["endpoint"])
        report.update(tokens=tokens, finish_reason=cpb.FinishReason.Name(complete.finish_reason))
        http = re.search(r"\(OpenAI-compatible: (\S+)/v1\)", up.stdout).group(1)
        report["http_completion_tokens"] = _retried(report["endpoint"], lambda: _http_completion(http))
        report["max_model_len"] = _model_info(report["endpoint"]).max_model_len
        report["worker_log_lines"] = _worker_log_lines(
            ray, "INFO decode-0 services.engine.setup: KV cache group target:"
        )
    down = _tandem("down", config)
    report.update(down_rc=down.returncode, down_output=down.stdout + down.stderr, actors_down=_actors(ray))
    aggregated = workdir / "aggregated.yaml"
    aggregated.write_text(yaml.safe_dump(_aggregated_only(settings)))
    report["aggregated"] = _aggregated_scenario(ray, aggregated)
    return report


def _aggregated_scenario(ray, config: Path) -> dict:
    """`tandem ray up` with one aggregated worker and no pair, one request over gRPC, `down`."""
    up = _tandem("up", config)
    report = {"up_rc": up.returncode, "up_output": up.stdout + up.stderr, "actors_up": _actors(ray)}
    if up.returncode == 0:
        endpoint = re.search(r"router endpoint: (\S+)", up.stdout).group(1)
        tokens, complete = _generate(endpoint)
        report.update(tokens=tokens, finish_reason=cpb.FinishReason.Name(complete.finish_reason))
    down = _tandem("down", config)
    report.update(down_rc=down.returncode, down_output=down.stdout + down.stderr, actors_down=_actors(ray))
    return report


def _config(address: str, target: str, drafter: str) -> dict:
    worker = {"replicas": 1, "num_cpus": 1, "num_gpus": 0}
    return {
        "ray": {
            "address": address,
            "namespace": NAMESPACE,
            "env": {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"},
        },
        "model": {
            "model": target,
            "drafter": drafter,
            "num_spec_tokens": 3,
            "tokens_per_page": 4,
            "kv_cache_mb": 8,
            "max_num_seqs": 16,
            "max_model_len": 256,
        },
        "router": {"port": 0, "http_port": 0, "num_cpus": 0},
        "prefill": worker,
        "decode": worker,
        "ready_timeout_s": 90,
        "log_level": "INFO",
    }


def _aggregated_only(settings: dict) -> dict:
    """``settings`` with the pair replaced by one aggregated worker (`--role both`)."""
    worker = settings["decode"]
    none = worker | {"replicas": 0}
    return settings | {"prefill": none, "decode": none, "aggregated": worker}


def _generate(endpoint: str):
    """One greedy request over gRPC."""
    from tests.e2e.conftest import generate

    return _retried(endpoint, lambda: generate(endpoint, PROMPT, MAX_TOKENS, temperature=0, ignore_eos=True))


def _retried(endpoint: str, request, attempts: int = 3):
    """On this 2-CPU machine a worker can miss the router's Stats poll for a moment and
    count as unhealthy: a request refused for want of a ready pair is sent again once the
    router reports SERVING."""
    import grpc

    for attempt in range(attempts):
        try:
            return request()
        except (AssertionError, urllib.error.HTTPError) as e:
            unavailable = "no ready prefill/decode pair" in str(e) or getattr(e, "code", 0) == 503
            if not unavailable or attempt == attempts - 1:
                raise
        with grpc.insecure_channel(endpoint) as channel:
            stub = cpb_grpc.TandemStub(channel)
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline
                and stub.Health(cpb.HealthRequest(), timeout=10).status != cpb.SERVING_STATUS_SERVING
            ):
                time.sleep(0.2)


def _model_info(endpoint: str) -> cpb.ModelInfoResponse:
    import grpc

    with grpc.insecure_channel(endpoint) as channel:
        return cpb_grpc.TandemStub(channel).ModelInfo(cpb.ModelInfoRequest(), timeout=10)


def _worker_log_lines(ray, text: str) -> int:
    """Lines holding ``text`` in the stderr files of this Ray session's workers (the actors)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return sum(line.count(text) for f in logs.glob("worker-*.err") for line in f.read_text().splitlines())


def _tandem(command: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", "ray", command, "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )


def _actors(ray) -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
    )


def _http_completion(base_url: str) -> int:
    body = json.dumps(
        {"model": "target", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


if __name__ == "__main__":
    result = scenario(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    print(REPORT + json.dumps(result), flush=True)
