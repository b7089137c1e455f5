"""The ``tandem`` command line: ``up`` (a local cluster), ``router``, ``worker``,
``worker-token``, ``generate`` (in process, or against a router: deploy/client.py) and
``ray``. The engine and worker flags come from deploy/options.py, the shared ones from
deploy/cli_flags.py; the worker's modules, which load the engine, are imported by the
worker command alone."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from deploy.cli_flags import add_client_token_arg, add_http_port_arg, add_security_args, tls_config
from deploy.cli_parser import SubcommandParser, TandemParser
from deploy.client import add_client_args, run_remote
from deploy.engine_config import check_device_present, engine_config
from deploy.local import DEFAULT_HTTP_PORT, LocalCluster
from deploy.options import (
    ROUTER_ENGINE_OPTIONS,
    EngineOptions,
    ProcessOptions,
    RouterOptions,
    ServingOptions,
    TransferOptions,
    add_args,
    add_engine_args,
    from_args,
    positive_int,
    process_settings,
    router_deadlines,
    router_http_limits,
    served_model_name,
    to_argv,
)
from services.common.file_limit import raise_file_limit
from services.common.log_setup import configure_logging
from services.common.ports import exit_on_busy_port
from services.common.security import worker_token
from services.engine.cli import add_generate_args, run_generate
from services.router.api import RouterSettings
from services.router.main import RouterConfig, model_limits, openai_options, router_text, run_router


def add_up_parser(sub) -> None:
    up = sub.add_parser(
        "up", help="run a local cluster (router, prefill and decode processes) on 127.0.0.1 until interrupted"
    )
    add_engine_args(up)
    add_args(up, ServingOptions)
    add_args(up, RouterOptions)
    add_args(up, ProcessOptions)
    up.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    up.add_argument("--decode", type=int, default=1, help="decode worker processes")
    up.add_argument(
        "--aggregated",
        type=int,
        default=0,
        help="aggregated workers (prefill+decode in one process) instead of P/D",
    )
    up.add_argument(
        "--prefill-tp", type=int, default=0, help="tensor-parallel ranks per prefill worker (default: --tp)"
    )
    up.add_argument(
        "--decode-tp",
        type=int,
        default=0,
        help="tensor-parallel ranks per decode worker (default: --tp); may differ from the "
        "prefill workers': transfers re-slice KV heads",
    )
    up.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="GPUs to place workers on with --device cuda (each worker, or TP group, its own; "
        "deploy/placement.py); 0 = the visible ones",
    )
    up.add_argument("--port", type=int, default=50051, help="router gRPC port (0 = any)")
    up.add_argument(
        "--routers",
        type=positive_int,
        default=1,
        help="router replicas; every worker registers with each (the first takes --port and "
        "--http-port, the others any free gRPC port and no HTTP)",
    )
    add_client_token_arg(
        up,
        "client token the router requires (the processes get a fresh service secret with it); empty = none",
    )
    add_http_port_arg(up, None)


def add_router_parser(sub) -> None:
    router = sub.add_parser("router", help="run the router")
    add_engine_args(router, ROUTER_ENGINE_OPTIONS)
    add_args(router, ServingOptions)
    add_args(router, ProcessOptions)
    router.add_argument("--host", default="127.0.0.1", help="address the gRPC, HTTP and metrics ports bind")
    router.add_argument(
        "--port", type=int, default=50051, help="gRPC port (clients and workers); 0 = any free"
    )
    router.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 = any free")
    add_args(router, RouterOptions)
    add_security_args(router, "router")
    add_http_port_arg(router, DEFAULT_HTTP_PORT)


def add_worker_parser(sub) -> None:
    worker = sub.add_parser("worker", help="run one worker")
    worker.add_argument(
        "--role", choices=["prefill", "decode", "both"], required=True, help="both = aggregated (no transfer)"
    )
    add_engine_args(worker)
    add_args(worker, ServingOptions, ("served_model_name",))
    add_args(worker, ProcessOptions)
    worker.add_argument("--router", default="", help="router host:port to register with")
    worker.add_argument("--host", default="127.0.0.1", help="address the gRPC, metrics and UCX ports bind")
    worker.add_argument("--port", type=int, default=0, help="gRPC port; 0 = any free")
    worker.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 = any free")
    worker.add_argument(
        "--instance-id",
        default="",
        help="unique in the cluster; empty = <role>-<random>, or --worker-token's",
    )
    add_args(worker, TransferOptions)
    add_security_args(worker, "worker")


def add_worker_token_parser(sub) -> None:
    p = sub.add_parser(
        "worker-token",
        help="print the token of one worker instance id under the service secret (give it to that "
        "worker as --worker-token: it proves that identity and no other)",
    )
    p.add_argument("instance_id")
    p.add_argument("--service-token", default=os.environ.get("TANDEM_SERVICE_TOKEN", ""))


def add_generate_parser(sub) -> None:
    generate = sub.add_parser(
        "generate",
        help="one completion: from a running router (--endpoint HOST:PORT) or an in-process engine "
        "(--offline)",
    )
    add_engine_args(generate)
    add_generate_args(generate)
    add_client_args(generate)


def add_ray_parser(sub) -> None:
    ray = sub.add_parser("ray", help="run the services as Ray actors (see deploy/ray/cluster.example.yaml)")
    ray_sub = ray.add_subparsers(dest="ray_command", required=True)
    for name, text in (
        ("up", "place the router and workers, wait until every pair is ready, print the endpoints"),
        ("down", "stop the actors `up` placed"),
    ):
        p = ray_sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="cluster.yaml")
        p.add_argument(
            "--address",
            default="",
            help="Ray cluster address; overrides ray.address (and ray.start_local) of the config",
        )


def tandem_version() -> str:
    """The installed package's version; run from a source tree that is not installed
    (``python -m deploy.cli``), pyproject.toml's."""
    try:
        return version("tandem")
    except PackageNotFoundError:
        import tomllib  # noqa: PLC0415 (only a source tree that was never installed needs it)

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return f"{tomllib.loads(pyproject.read_text())['project']['version']} (source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = TandemParser(
        prog="tandem",
        description="Tandem: disaggregated LLM serving with speculative decoding over a "
        "unified target+draft KV cache",
    )
    parser.add_argument("--version", action="version", version=f"tandem {tandem_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for add in (
        add_up_parser,
        add_router_parser,
        add_ray_parser,
        add_generate_parser,
        add_worker_parser,
        add_worker_token_parser,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"up": run_up, "router": run_router_command, "worker": run_worker_command}
    commands |= {"generate": run_generate_command, "ray": run_ray_command, "worker-token": run_worker_token}
    return commands[args.command](args)


def checked_engine_config(args: argparse.Namespace):
    """The EngineConfig of the parsed engine flags; exits naming a refused option (a
    ``--device`` torch does not see among them)."""
    try:
        config = engine_config(from_args(EngineOptions, args))
        check_device_present(config.device)
        return config
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None


def run_router_command(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "router", args.log_format)
    raise_file_limit()
    name = served_model_name(args.model, args.served_model_name)
    router = from_args(RouterOptions, args)
    max_tokens = router.default_max_tokens
    limits = model_limits(args.model, args.num_spec_tokens, args.max_model_len, name, max_tokens)
    tokenizer, chat = router_text(args.model, args.tokenizer, args.chat_template, args.prompt_special_tokens)
    try:
        openai = openai_options(
            args.model, args.generation_config, args.reasoning_parser, args.tool_call_parser
        )
        settings = RouterSettings(
            tokens_per_page=args.tokens_per_page,
            token=args.token,
            service_secret=args.service_token,
            tls=tls_config(args),
            model_id=os.path.basename(os.path.normpath(args.model)),
            health_timeout_s=router.health_timeout_s,
            health_misses=router.health_misses,
        )
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None
    config = RouterConfig(
        limits,
        settings,
        args.host,
        args.port,
        args.metrics_port,
        None if args.http_port < 0 else args.http_port,
        tokenizer,
        chat,
        router_http_limits(router),
        router_deadlines(router),
        openai,
        process_settings(from_args(ProcessOptions, args)),
        step_streams=router.step_streams,
    )
    with exit_on_busy_port("router"):
        asyncio.run(run_router(config))
    return 0


def run_worker_command(args: argparse.Namespace) -> int:
    # the worker runs an engine: torch and its models load here, never in the router
    from services.worker.serve import run_worker  # noqa: PLC0415 (torch: `tandem router` and `up` stay light)
    from services.worker.step_profile import profile_from_env  # noqa: PLC0415
    from services.worker.worker import WorkerConfig  # noqa: PLC0415
    from services.worker_roles import WORKER_ROLES  # noqa: PLC0415

    engine = checked_engine_config(args)
    try:
        config = WorkerConfig(
            role=args.role,
            engine=engine,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            router=args.router,
            instance_id=args.instance_id,
            service_secret=args.service_token,
            worker_token=args.worker_token,
            tls=tls_config(args),
            transfer_timeout_s=args.transfer_timeout_s,
            lease_s=args.lease_s,
            log_level=args.log_level,
            log_format=args.log_format,
            process=process_settings(from_args(ProcessOptions, args)),
            step_profile=profile_from_env(os.environ),
        )
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None
    configure_logging(config.log_level, config.instance_id, config.log_format)
    name = served_model_name(args.model, args.served_model_name)
    with exit_on_busy_port(f"{config.role} worker {config.instance_id}"):
        asyncio.run(run_worker(config, WORKER_ROLES[config.role], model_name=name))
    return 0


def run_worker_token(args: argparse.Namespace) -> int:
    if not args.service_token:
        raise SystemExit("tandem: service_token: give --service-token or $TANDEM_SERVICE_TOKEN")
    print(worker_token(args.service_token, args.instance_id))
    return 0


def run_generate_command(args: argparse.Namespace) -> int:
    if not args.endpoint:
        client_flags = [f for f in ("tls_cert", "tls_key", "tls_ca", "tls_server_name") if getattr(args, f)]
        if args.token != os.environ.get("TANDEM_TOKEN", ""):  # given on the command line
            client_flags.insert(0, "token")
        if client_flags:
            raise SystemExit(f"tandem: {client_flags[0]}: a client option, for --endpoint only")
        return run_generate(args, checked_engine_config(args))
    if args.offline:
        raise SystemExit("tandem: endpoint: --offline runs the engine here; give one of them")
    engine_flags = to_argv(from_args(EngineOptions, args))
    if engine_flags:  # they would configure an engine this command does not run
        raise SystemExit(f"tandem: {engine_flags[0]}: an engine option; the router at --endpoint has its own")
    return run_remote(args, tls_config(args), args.token)


def run_ray_command(args: argparse.Namespace) -> int:
    from deploy.ray_launcher.launcher import main as ray_main  # noqa: PLC0415 (ray: an optional heavy import)

    return ray_main(args)


def run_up(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "up", args.log_format)
    checked_engine_config(args)  # refuse a configuration the workers would refuse, before starting any
    router_text(args.model, args.tokenizer, args.chat_template)
    try:
        openai_options(args.model, args.generation_config)  # a malformed generation_config.json
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None
    cluster = LocalCluster.from_args(args)
    signal.signal(signal.SIGTERM, _interrupt)  # stopped as by Ctrl-C: routers, then workers
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        while cluster.alive():
            time.sleep(0.5)
        print("a process exited; stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping: the router finishes its requests, then the workers exit", file=sys.stderr)
        return 0
    except (RuntimeError, subprocess.SubprocessError) as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
