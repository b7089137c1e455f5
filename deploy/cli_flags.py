"""The flags several ``tandem`` commands share, and the configs they become: credentials
(``--token``, ``--service-token``, ``--worker-token``, ``--tls-*``), the router's HTTP port
and limits, and its deadlines on calls to workers."""

from __future__ import annotations

import argparse
import os

from deploy.local import DEFAULT_HTTP_PORT
from deploy.option_flags import non_negative_float, non_negative_int
from deploy.options import positive_float, positive_int
from services.common.security import TlsConfig, tls_from
from services.router.cluster import Deadlines
from services.router.http import HttpLimits, ReadTimeouts


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


def add_deadline_args(parser) -> None:
    defaults = Deadlines()
    parser.add_argument(
        "--worker-call-timeout-s",
        type=positive_float,
        default=defaults.call_s,
        help="deadline of each Reserve and Release call to a decode worker (then: another pair)",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=positive_float,
        default=defaults.prefill_s,
        help="deadline of each Prefill call: its queue, the prompt's run and the page transfer",
    )
    parser.add_argument(
        "--prefill-timeout-per-1k-tokens-s",
        type=non_negative_float,
        default=defaults.prefill_per_1k_s,
        help="added to --prefill-timeout-s per 1,000 prompt tokens: a long prompt's deadline grows with it",
    )
    parser.add_argument(
        "--stream-idle-timeout-s",
        type=positive_float,
        default=defaults.stream_idle_s,
        help="longest wait between two messages of a Decode stream (then: UNAVAILABLE)",
    )


def add_http_limit_args(parser) -> None:
    defaults = HttpLimits()
    parser.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=defaults.max_connections,
        help="open HTTP connections at most (fewer if the open-file limit leaves fewer); a new one "
        "closes the longest-idle connection, else is answered 503 and closed",
    )
    parser.add_argument(
        "--http-max-connections-per-client",
        type=non_negative_int,
        default=defaults.max_per_client,
        help="open HTTP connections of one client address at most (0 = no such limit); a new one "
        "closes that client's longest-idle connection, else is answered 503",
    )
    parser.add_argument(
        "--http-header-timeout-s",
        type=positive_float,
        default=defaults.timeouts.headers_s,
        help="seconds after its request line for a request's headers (else 408)",
    )
    parser.add_argument(
        "--http-body-timeout-s",
        type=positive_float,
        default=defaults.timeouts.body_s,
        help="seconds after its headers for a request's whole body (else 408)",
    )


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return tls_from(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None


def deadlines(args: argparse.Namespace) -> Deadlines:
    """The deadlines of the router's calls to workers, from its ``--*-timeout-s`` flags."""
    return Deadlines(
        args.worker_call_timeout_s,
        args.prefill_timeout_s,
        args.stream_idle_timeout_s,
        args.prefill_timeout_per_1k_tokens_s,
    )


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The router's HTTP limits from its ``--http-*`` flags."""
    timeouts = ReadTimeouts(args.http_header_timeout_s, args.http_body_timeout_s)
    return HttpLimits(args.http_max_connections, timeouts, args.http_max_connections_per_client)
