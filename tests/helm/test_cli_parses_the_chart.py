"""The rendered command lines and credential environment, read by the real `tandem` parser:
every token arrives through the variable the CLI reads, the TLS flags name the mounted files."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from tests.helm.chart import container, effective_args, render
from tests.helm.test_credentials import NAMED, TLS, TOKENS, WORKER_TOKEN

CREDENTIALS = ("TANDEM_TOKEN", "TANDEM_SERVICE_TOKEN", "TANDEM_WORKER_TOKEN")
POD = {"$(POD_IP)": "10.0.0.7", "$(POD_NAME)": "demo-tandem-decode-7d9f-x2x"}


def parse(manifests: list[dict], component: str, monkeypatch):
    """The component's args parsed with its secretKeyRef variables set to "<secret>/<key>", as
    the kubelet would from those Secrets, and no other credential in the environment."""
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    for e in container(manifests, component)["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            monkeypatch.setenv(e["name"], f"{ref['name']}/{ref['key']}")
    args = [POD.get(a, a) for a in effective_args(manifests, component)]
    return build_parser().parse_args(args)


def test_the_router_reads_both_tokens_from_their_secrets(monkeypatch):
    args = parse(render(TOKENS), "router", monkeypatch)
    assert (args.token, args.service_token) == ("tandem-client/api-token", "tandem-service/service-token")
    assert (args.tls_cert, args.tls_key, args.tls_ca) == ("", "", "")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_read_the_service_secret_and_name_themselves_by_pod(role, monkeypatch):
    args = parse(render(TOKENS), role, monkeypatch)
    assert (args.service_token, args.worker_token) == ("tandem-service/service-token", "")
    assert args.instance_id == POD["$(POD_NAME)"]


def test_a_worker_token_role_reads_only_its_own_token(monkeypatch):
    args = parse(render(WORKER_TOKEN), "decode", monkeypatch)
    assert (args.service_token, args.worker_token) == ("", "decode-0-token/token")
    assert not args.instance_id  # the token names it


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
def test_tls_flags_name_the_mounted_files(component, monkeypatch):
    args = parse(render(TLS), component, monkeypatch)
    assert (args.tls_cert, args.tls_key, args.tls_ca) == (
        "/etc/tandem/tls/tls.crt",
        "/etc/tandem/tls/tls.key",
        "/etc/tandem/tls/ca.crt",
    )
    assert args.tls_server_name == ""


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
def test_the_server_name_is_the_tls_server_name_flag(component, monkeypatch):
    args = parse(render(NAMED), component, monkeypatch)
    assert (args.tls_ca, args.tls_server_name) == ("/etc/tandem/tls/ca.crt", "tandem.llm.svc")


def test_without_credentials_nothing_is_set(monkeypatch):
    m = render()
    router = parse(m, "router", monkeypatch)
    assert (router.token, router.service_token) == ("", "")
    decode = parse(m, "decode", monkeypatch)
    assert (decode.service_token, decode.worker_token) == ("", "")


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
def test_the_log_and_drain_values_reach_every_process(component, monkeypatch):
    values = {
        "logFormat": "json",
        "logRequests": False,
        "logStatsIntervalS": 0,
        "shutdown": {"drainSeconds": 12},
    }
    args = parse(render(values), component, monkeypatch)
    assert (args.log_format, args.disable_log_requests, args.log_stats_interval_s) == ("json", True, 0.0)
    assert args.shutdown_timeout_s == 12.0
    default = parse(render(), component, monkeypatch)
    assert (default.log_format, default.disable_log_requests, default.shutdown_timeout_s) == (
        "text",
        False,
        30.0,
    )
