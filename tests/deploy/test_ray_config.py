"""cluster.yaml for ``tandem ray`` down to what each actor runs: per-role tensor parallelism
and KV sizing over the model section's, credentials from the launcher's environment, and
the documented example listing every key the launcher accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from deploy.ray_launcher.config import ClusterConfig, ConfigError, parse_config
from deploy.ray_launcher.service_configs import Listen, router_settings, worker_config
from services.common.process_settings import ProcessSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "ray" / "cluster.example.yaml"
LISTEN = Listen("10.0.0.7", 50061, 9100)


def _worker(config: ClusterConfig, role: str):
    return worker_config(config, role, f"{role}-0", "10.0.0.1:50051", LISTEN)


def test_prefill_and_decode_run_their_own_tp_and_kv_size():
    config = parse_config(
        {
            "model": {"tp": 1, "kv_cache_mb": 64},
            "prefill": {"tp": 2, "num_gpus": 2},
            "decode": {"kv_cache_mb": 512},
        }
    )
    prefill, decode = _worker(config, "prefill"), _worker(config, "decode")
    assert (prefill.engine.tp_size, decode.engine.tp_size) == (2, 1)
    assert (prefill.engine.kv_cache_bytes, decode.engine.kv_cache_bytes) == (64 << 20, 512 << 20)
    assert (prefill.role, prefill.instance_id, prefill.router) == ("prefill", "prefill-0", "10.0.0.1:50051")
    assert (decode.host, decode.port, decode.metrics_port) == ("10.0.0.7", 50061, 9100)
    assert (prefill.transfer_timeout_s, decode.lease_s) == (30.0, 60.0)


def test_a_roles_own_kv_sizing_replaces_the_model_sections_other_way():
    cuda = {"device": "cuda", "gpu_memory_utilization": 0.8}
    roles = {"prefill": {"kv_cache_mb": 2048}, "decode": {"gpu_memory_utilization": 0.6}}
    config = parse_config({"model": cuda, **roles})
    prefill, decode = _worker(config, "prefill").engine, _worker(config, "decode").engine
    assert (prefill.kv_cache_bytes, prefill.gpu_memory_utilization) == (2048 << 20, 0.0)
    assert decode.gpu_memory_utilization == 0.6
    model = {"device": "cuda", "kv_cache_mb": 1024}
    sized = parse_config({"model": model, "decode": {"gpu_memory_utilization": 0.5}})
    assert _worker(sized, "decode").engine.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(
    "data, message",
    [
        ({"prefill": {"tp": 0}}, r"^prefill\.tp: "),
        ({"decode": {"tp": "two"}}, r"^decode\.tp: "),
        ({"decode": {"kv_cache_mb": -1}}, r"^decode\.kv_cache_mb: "),
        (
            {"model": {"device": "cuda"}, "decode": {"kv_cache_mb": 64, "gpu_memory_utilization": 0.5}},
            r"^decode\.gpu_memory_utilization: ",
        ),
        ({"prefill": {"gpu_memory_utilization": 0.5}}, r"^prefill\.gpu_memory_utilization: .*CUDA"),
        ({"security": {"token": "x"}}, r"^security\.token: unknown key"),
        ({"security": {"client_token": "x"}}, r"^security\.client_token: unknown key"),  # never in the file
        ({"security": {"tls_cert": "/c.pem"}}, r"^security\.tls_cert: mutual TLS needs tls_cert, tls_key"),
        ({"security": {"tls_server_name": "service"}}, r"^security\.tls_server_name: needs mutual TLS"),
        ({"security": {"client_token_env": "T"}}, r"^security\.client_token_env: a client token needs"),
        ({"security": {"service_token_env": "TANDEM_TEST_UNSET"}}, r"TANDEM_TEST_UNSET is not set"),
    ],
)
def test_role_sizing_and_credentials_are_refused_by_key(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_credentials_come_from_the_launchers_environment_to_every_actor(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_CLIENT_TOKEN", "client-secret")
    monkeypatch.setenv("LLM_SERVICE_TOKEN", "service-secret")
    files = {}
    for name in ("cert", "key", "ca"):
        files[f"tls_{name}"] = str(tmp_path / f"{name}.pem")
        Path(files[f"tls_{name}"]).write_text("pem")
    security = {"client_token_env": "LLM_CLIENT_TOKEN", "service_token_env": "LLM_SERVICE_TOKEN"}
    config = parse_config({"security": security | files | {"tls_server_name": "service"}})
    assert "client-secret" not in repr(config)
    router = router_settings(config)
    assert (router.token, router.service_secret) == ("client-secret", "service-secret")
    assert router.tls.server_name == "service"
    worker = _worker(config, "decode")
    assert (worker.service_secret, worker.tls.ca) == ("service-secret", files["tls_ca"])
    plain = parse_config({})
    assert router_settings(plain).tls is None and _worker(plain, "prefill").service_secret == ""


def test_a_tls_file_missing_on_the_node_is_named_when_the_actor_starts(tmp_path):
    paths = {f"tls_{n}": str(tmp_path / f"{n}.pem") for n in ("cert", "key", "ca")}
    config = parse_config({"security": paths})  # the files are the nodes', not the launcher's
    with pytest.raises(ValueError, match=r"^tls_cert: no such file"):
        router_settings(config)


def _keys(value, prefix: str = "") -> set[str]:
    if not isinstance(value, dict):
        return set()
    return {f"{prefix}{k}" for k in value} | {
        name
        for k, v in value.items()
        if not isinstance(v, dict) or k not in ("env", "resources")
        for name in _keys(v, f"{prefix}{k}.")
    }


def _accepted(kind: type = ClusterConfig, prefix: str = "") -> set[str]:
    names = set()
    defaults = kind()
    for f in dataclasses.fields(kind):
        if f.metadata.get("resolved"):
            continue
        names.add(prefix + f.name)
        if dataclasses.is_dataclass(getattr(defaults, f.name)):
            names |= _accepted(type(getattr(defaults, f.name)), f"{prefix}{f.name}.")
    return names


def test_the_example_lists_every_accepted_key_and_parses():
    example = yaml.safe_load(EXAMPLE.read_text())
    assert _keys(example) == _accepted()
    parse_config(example)


def test_the_log_format_is_read_and_checked():
    assert parse_config({"log_format": "json"}).log_format == "json"
    assert parse_config({}).log_format == "text"
    with pytest.raises(ConfigError, match="^log_format: must be text or json"):
        parse_config({"log_format": "xml"})


def test_the_process_settings_reach_every_worker():
    cluster = parse_config({"log_requests": False, "log_stats_interval_s": 0, "shutdown_timeout_s": 5})
    assert cluster.process_settings() == ProcessSettings(False, 0.0, 5.0)
    with pytest.raises(ConfigError, match="shutdown_timeout_s"):
        parse_config({"shutdown_timeout_s": -1})
