"""The flags several ``tandem`` commands share that are no options dataclass: credentials
(``--token``, ``--service-token``, ``--worker-token``, ``--tls-*``, read from the environment
by default) and the router's HTTP port, whose default depends on the command."""

from __future__ import annotations

import argparse
import os

from deploy.local import DEFAULT_HTTP_PORT
from services.common.security import TlsConfig, tls_from


def add_client_token_arg(p: argparse.ArgumentParser, meaning: str) -> None:
    """``--token``, the client token (default: $TANDEM_TOKEN); ``meaning``: its role here."""
    p.add_argument(
        "--token", default=os.environ.get("TANDEM_TOKEN", ""), help=f"{meaning} (default: $TANDEM_TOKEN)"
    )


def add_security_args(p: argparse.ArgumentParser, role: str) -> None:
    """Credentials (docs/reliability.md, "Who holds what"): ``role`` "router" or "worker"."""
    if role == "router":
        add_client_token_arg(
            p,
            "client token: every client call (gRPC and HTTP) must carry it as a bearer token; it "
            "cannot call workers or register one; empty = none",
        )
    p.add_argument(
        "--service-token",
        default=os.environ.get("TANDEM_SERVICE_TOKEN", ""),
        help="the cluster's service secret: each worker's token derives from it and its instance id "
        "(default: $TANDEM_SERVICE_TOKEN; empty = none)",
    )
    if role == "worker":
        p.add_argument(
            "--worker-token",
            default=os.environ.get("TANDEM_WORKER_TOKEN", ""),
            help="this worker's own token instead of the service secret (`tandem worker-token ID`); "
            "it names the instance id (default: $TANDEM_WORKER_TOKEN)",
        )
    p.add_argument(
        "--tls-cert",
        default="",
        help="PEM certificate: turns on mutual TLS; its OU is its role (OU=service for the router "
        "and workers, OU=client for clients)",
    )
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA that signs every peer's certificate")
    p.add_argument(
        "--tls-server-name",
        default="",
        help="the name every server's certificate must carry, whatever address it is reached at "
        "(pods: their IPs are in no certificate); empty = the address's host",
    )


def add_http_port_arg(p: argparse.ArgumentParser, default: int | None) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=default,
        help="router's OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, "
        f"/v1/models, /health, /metrics); 0 = any free port, -1 = off; default {DEFAULT_HTTP_PORT}"
        + ("" if default is not None else ", or any free port when --port is 0"),
    )


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return tls_from(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None
