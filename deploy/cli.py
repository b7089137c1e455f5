"""The ``tandem`` command line: ``up`` (a local cluster), ``router``, ``worker``."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from deploy.local import DEFAULT_HTTP_PORT, LocalCluster

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(HERE, "models", "tiny-target")
DEFAULT_DRAFTER = os.path.join(HERE, "models", "tiny-drafter")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="target model folder (config.json + *.safetensors); default: the bundled tiny target",
    )
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter folder; 'none' = no drafter")
    add_tokenizer_arg(p)
    p.add_argument("-k", "--num-spec-tokens", type=int, default=4, help="draft tokens per step (K)")
    p.add_argument(
        "--layout",
        choices=["auto", "unified", "separate"],
        default="auto",
        help="unified: the drafter's KV lives and moves with the target's; separate: "
        "the baseline (draft KV neither cached nor transferred); auto: unified when "
        "there is a drafter",
    )
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", default="", help="KV/model dtype; default float32 on CPU, bf16 on CUDA")
    p.add_argument("--tokens-per-page", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV memory per worker, MiB")
    p.add_argument(
        "--host-kv-cache-mb",
        type=int,
        default=0,
        help="host-memory tier under the "
        "prefix cache, MiB (evicted pages are kept there and recalled); 0 = none",
    )
    p.add_argument(
        "--host-kv-write-policy",
        choices=["evict", "through"],
        default="evict",
        help="when a cached page is copied to the host tier: evict = as it leaves "
        "device memory (write-back); through = as it enters the prefix cache "
        "(write-through: evictions copy nothing)",
    )
    p.add_argument(
        "--host-kv-recall-min-pages",
        type=int,
        default=1,
        help="recall a host-tier hit only if it is at least this many pages; shorter ones are recomputed",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per worker, one "
        "process each (gloo on CPU, NCCL on GPU: rank r takes GPU r of --device)",
    )


def engine_config(args: argparse.Namespace):
    from kvcore import KVLayout
    from services.engine.config import EngineConfig

    drafter = None if args.drafter in ("", "none") else args.drafter
    speculative = drafter is not None and args.num_spec_tokens > 0
    if args.layout == "unified" and not speculative:
        raise SystemExit(
            "tandem: --layout unified keeps the drafter's KV pages in the target's "
            "cache manager and transfer, but no drafter runs here (--drafter "
            f"{args.drafter!r}, -k {args.num_spec_tokens}); use --layout separate "
            "or auto, or give a drafter and K > 0"
        )
    layout = "unified" if args.layout == "auto" else args.layout
    return EngineConfig(
        model=args.model,
        drafter=drafter,
        tokenizer=args.tokenizer,
        num_spec_tokens=args.num_spec_tokens,
        device=args.device,
        dtype=args.dtype,
        tokens_per_page=args.tokens_per_page,
        kv_cache_bytes=args.kv_cache_mb << 20,
        host_kv_cache_bytes=args.host_kv_cache_mb << 20,
        host_kv_write_policy=args.host_kv_write_policy,
        host_kv_recall_min_pages=args.host_kv_recall_min_pages,
        max_num_seqs=args.max_num_seqs,
        layout=KVLayout(layout),
        enable_prefix_cache=not args.no_prefix_cache,
        tp_size=getattr(args, "tp", 1),
    )


def add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default="",
        help="Hugging Face tokenizer: a folder with "
        "tokenizer.json (and tokenizer_config.json), or a tokenizer.json; default: "
        "the model folder's own",
    )


def add_serving_name_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        default="",
        help="the model's name in the API "
        "(/v1/models, the model field, ModelInfo) and the model_name label of "
        "metrics; default: the model folder's name",
    )
    p.add_argument(
        "--chat-template",
        default="",
        help="Jinja chat template file for "
        "/v1/chat/completions; default: the tokenizer's (chat_template.jinja or "
        "tokenizer_config.json's chat_template); without one, chat is refused",
    )


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def add_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token",
        default=os.environ.get("TANDEM_TOKEN", ""),
        help="bearer token every client and service call must carry (default: $TANDEM_TOKEN; empty = none)",
    )
    p.add_argument("--tls-cert", default="", help="PEM certificate: turns on mutual TLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA that signs every peer's certificate")


def tls_config(args: argparse.Namespace):
    from services.common.security import tls_from

    try:
        return tls_from(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None


def add_http_port_arg(p: argparse.ArgumentParser, default: int | None) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=default,
        help="router's OpenAI-compatible "
        "HTTP port (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        f"/metrics); 0 = any free port, -1 = off; default {DEFAULT_HTTP_PORT}"
        + ("" if default is not None else ", or any free port when --port is 0"),
    )


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: disaggregated LLM "
        "serving with speculative decoding over a unified "
        "target+draft KV cache",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up", help="run a local cluster (router, prefill and decode processes) on 127.0.0.1 until interrupted"
    )
    add_engine_args(up)
    add_serving_name_args(up)
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
        help="tensor-parallel ranks per decode worker (default: --tp); may differ "
        "from the prefill workers': transfers re-slice KV heads",
    )
    up.add_argument("--port", type=int, default=50051, help="router gRPC port (0 = any)")
    add_http_port_arg(up, None)
    router = sub.add_parser("router", help="run the router")
    router.add_argument("--model", default=DEFAULT_MODEL, help="target folder (for its limits and tokenizer)")
    add_tokenizer_arg(router)
    add_serving_name_args(router)
    router.add_argument("-k", "--num-spec-tokens", type=int, default=4)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=50051)
    router.add_argument("--metrics-port", type=int, default=0)
    router.add_argument("--tokens-per-page", type=int, default=16)
    router.add_argument(
        "--health-timeout-s",
        type=positive_float,
        default=2.0,
        help="deadline of each Stats poll of a worker (every 0.5 s)",
    )
    router.add_argument(
        "--health-misses",
        type=positive_int,
        default=2,
        help="timed-out polls in a row after which a worker gets no traffic "
        "(a refused connection counts at once)",
    )
    add_security_args(router)
    add_http_port_arg(router, DEFAULT_HTTP_PORT)
    add_ray_parser(sub)
    generate = sub.add_parser(
        "generate", help="run prompts through one in-process engine (aggregated, no cluster)"
    )
    add_engine_args(generate)
    from services.engine.cli import add_generate_args

    add_generate_args(generate)
    worker = sub.add_parser("worker", help="run one worker")
    worker.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    add_engine_args(worker)
    worker.add_argument(
        "--served-model-name",
        default="",
        help="the model_name label of metrics; default: the model folder's name",
    )
    worker.add_argument("--router", default="", help="router host:port to register with")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=0)
    worker.add_argument("--metrics-port", type=int, default=0)
    worker.add_argument("--instance-id", default="")
    worker.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=30.0,
        help="deadline of a page transfer and its acknowledgement",
    )
    worker.add_argument(
        "--lease-s",
        type=float,
        default=60.0,
        help="reserved pages are freed if their transfer and Decode have not come by then",
    )
    add_security_args(worker)
    return parser


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "router":
        from services.router.main import model_limits, router_text, run_router

        limits = model_limits(args.model, args.num_spec_tokens, served_model_name=served_model_name(args))
        tokenizer, chat = router_text(args.model, args.tokenizer, args.chat_template)
        asyncio.run(
            run_router(
                limits,
                args.host,
                args.port,
                args.metrics_port,
                args.tokens_per_page,
                token=args.token,
                http_port=None if args.http_port < 0 else args.http_port,
                tls=tls_config(args),
                health_timeout_s=args.health_timeout_s,
                health_misses=args.health_misses,
                tokenizer=tokenizer,
                chat=chat,
            )
        )
    elif args.command == "generate":
        from services.engine.cli import run_generate

        return run_generate(args, engine_config(args))
    elif args.command == "ray":
        from deploy.ray_launcher.launcher import main as ray_main

        return ray_main(args)
    elif args.command == "worker":
        from services.common.serve import run_worker
        from services.common.worker import WorkerConfig
        from services.worker_roles import WORKER_ROLES

        config = WorkerConfig(
            role=args.role,
            engine=engine_config(args),
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            router=args.router,
            instance_id=args.instance_id,
            token=args.token,
            tls=tls_config(args),
            transfer_timeout_s=args.transfer_timeout_s,
            lease_s=args.lease_s,
        )
        asyncio.run(run_worker(config, WORKER_ROLES[config.role], model_name=served_model_name(args)))
    else:
        return run_up(args)
    return 0


def run_up(args: argparse.Namespace) -> int:
    from services.router.main import router_text

    engine_config(args)  # refuse a configuration the workers would refuse, before starting any
    router_text(args.model, args.tokenizer, args.chat_template)
    cluster = LocalCluster.from_args(args)
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        while cluster.alive():
            time.sleep(0.5)
        print("a process exited; stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, subprocess.SubprocessError) as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
