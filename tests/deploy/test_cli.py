"""The ``tandem`` command line as a user types it: whole flag names only, defaults in
``--help`` (never a secret's), ``--version``, and ``up --token``'s credentials."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from deploy import cli
from deploy.cli import build_parser
from deploy.local import LocalCluster, Process, _pump


def _help(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *command, "--help"], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize(
    "argv",
    [["up", "--tok", "x"], ["router", "--tokens", "8"], ["worker", "--role", "decode", "--instance", "x"]],
)
def test_an_abbreviated_flag_is_refused_not_matched_to_a_longer_one(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_help_shows_defaults_but_not_secrets(monkeypatch):
    monkeypatch.setenv("TANDEM_SERVICE_TOKEN", "do-not-print")
    text = " ".join(_help("router").split())
    assert "(default: 16)" in text and "(default: 50051)" in text
    assert "do-not-print" not in text and "do-not-print" not in _help("worker")


def test_help_shows_no_default_on_a_switch():
    """``--no-prefix-cache``'s dest defaults to True: the setting, not what the switch gives."""
    text = " ".join(_help("up").split())
    assert "--no-prefix-cache turn the radix prefix cache off --enforce-eager" in text
    assert "(default: True)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("command", [["router"], ["up", "--prefill", "2"], ["ray", "up", "--config", "c"]])
def test_an_unknown_flag_is_reported_by_its_subcommand_with_its_usage(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--bogus"])
    err = capsys.readouterr().err
    name = " ".join(c for c in command if c in ("router", "up", "ray"))
    assert err.startswith(f"usage: tandem {name} [-h]")
    assert err.splitlines()[-1] == f"tandem {name}: error: unrecognized arguments: --bogus"


def test_version():
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "tandem 0.1.0"


def test_version_of_a_source_tree_that_was_never_installed(monkeypatch):
    def not_installed(name):
        raise cli.PackageNotFoundError(name)

    monkeypatch.setattr(cli, "version", not_installed)
    assert cli.tandem_version() == "0.1.0 (source tree)"


def test_up_with_a_client_token_gives_the_router_it_and_every_process_a_fresh_service_secret():
    args = build_parser().parse_args(["up", "--token", "client-secret"])
    first, second = LocalCluster.from_args(args), LocalCluster.from_args(args)
    assert first.env["TANDEM_TOKEN"] == "client-secret"
    assert len(first.env["TANDEM_SERVICE_TOKEN"]) == 32
    assert first.env["TANDEM_SERVICE_TOKEN"] != second.env["TANDEM_SERVICE_TOKEN"]
    assert "client-secret" not in first.router_args + first.worker_args


@pytest.mark.parametrize("flags, named", [(["--token", "t"], "token"), (["--tls-ca", "ca.pem"], "tls_ca")])
def test_offline_generate_refuses_the_client_options(flags, named, monkeypatch):
    monkeypatch.delenv("TANDEM_TOKEN", raising=False)
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--offline", "--prompt", "x", *flags],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and f"tandem: {named}: a client option, for --endpoint only" in out.stderr


def test_up_gives_prompt_special_tokens_to_the_router_only():
    cluster = LocalCluster.from_args(build_parser().parse_args(["up", "--prompt-special-tokens", "parse"]))
    assert cluster.router_args[-2:] == ["--prompt-special-tokens", "parse"]
    assert "--prompt-special-tokens" not in cluster.worker_args
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--prompt-special-tokens", "maybe"])


def test_the_router_takes_a_default_max_tokens():
    args = build_parser().parse_args(["router", "--default-max-tokens", "256"])
    assert args.default_max_tokens == 256
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--default-max-tokens", "-1"])


def test_up_echoes_its_processes_warnings_and_errors_only(capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_ECHO_LOGS", raising=False)
    lines = [
        "prefill prefill-0 grpc=127.0.0.1:1 metrics=http://127.0.0.1:2/metrics\n",
        "2026-12-04 10:15:02,118 INFO prefill-0 services.engine: kv cache: 100 pages\n",
        "2026-12-04 10:15:03,118 WARNING prefill-0 services.prefill.server: transfer of request r failed\n",
        "2026-12-04 10:15:04,118 ERROR prefill-0 services.worker.serve: stopping\n",
    ]
    process = Process("prefill-0", SimpleNamespace(stdout=iter(lines)))
    _pump(process, echo_warnings=True)
    assert capsys.readouterr().err.splitlines() == [f"[prefill-0] {line.rstrip()}" for line in lines[2:]]
    assert process.log == lines and process.grpc == "127.0.0.1:1"
    assert LocalCluster.from_args(build_parser().parse_args(["up"])).echo_warnings
