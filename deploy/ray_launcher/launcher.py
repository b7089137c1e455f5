"""``tandem ray up`` / ``tandem ray down``: Tandem's services as named, detached Ray actors.

``up`` joins the Ray cluster of cluster.yaml (or starts a local one), places the router,
then the prefill and decode workers, waits until the router reports every prefill/decode
pair READY (registered, checked, test-transferred), and prints the endpoints. The actors
are detached and named ``tandem-<service>`` in ``ray.namespace``, so they outlive ``up``
and ``down`` (from any process) finds and stops them.
"""

from __future__ import annotations

import signal
import sys
import time

import ray

from deploy.ray_launcher.actors import ServiceActor
from deploy.ray_launcher.config import ClusterConfig, ConfigError, load_config

NAME_PREFIX = "tandem-"
ROUTER = NAME_PREFIX + "router"
HEALTH_POLL_S = 0.5
STOP_TIMEOUT_S = 20.0


def connect(config: ClusterConfig, address: str = "") -> None:
    """Join the configured cluster (``address`` overrides it), or start a local one."""
    options = config.ray
    if ray.is_initialized():
        return
    if options.start_local and not address:
        ray.init(
            address="local",
            num_cpus=options.num_cpus,
            num_gpus=options.num_gpus,
            namespace=options.namespace,
            include_dashboard=False,
            log_to_driver=False,
        )
    else:
        ray.init(address=address or options.address, namespace=options.namespace, log_to_driver=False)


def up(config: ClusterConfig) -> list[dict]:
    """Place every service and wait for registration; returns their endpoints, router first.
    On failure, whatever was placed is stopped again."""
    taken = _running(config.ray.namespace)
    if taken:
        raise RuntimeError(
            f"already running in namespace {config.ray.namespace!r}: "
            f"{', '.join(taken)}; run `tandem ray down` first"
        )
    try:
        router = _place(config, config.router, ROUTER)
        endpoint = ray.get(router.start_router.remote(config))
        started = [
            _start_worker(config, role, i, endpoint["grpc"])
            for role in ("prefill", "decode")
            for i in range(getattr(config, role).replicas)
        ]
        endpoints = [endpoint] + ray.get(started)
        _wait_ready(router, config)
        return endpoints
    except BaseException:
        down(config)
        raise


def down(config: ClusterConfig) -> list[str]:
    """Stop every Tandem actor of the namespace (workers first); returns their names."""
    names = _running(config.ray.namespace)
    ordered = sorted(names, key=lambda n: (n == ROUTER, n))
    for name in ordered:
        actor = ray.get_actor(name, namespace=config.ray.namespace)
        try:
            ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # killed below either way
        ray.kill(actor, no_restart=True)
    return ordered


def describe(config: ClusterConfig, endpoints: list[dict]) -> str:
    lines = [f"tandem on Ray (namespace {config.ray.namespace!r}):"]
    for e in endpoints:
        http = f"  http={e['http']}" if e["http"] else ""
        lines.append(f"{e['name']:<12} grpc={e['grpc']}  metrics={e['metrics']}{http}  node={e['node']}")
    router = endpoints[0]
    lines.append(
        f"router endpoint: {router['grpc']}"
        + (f"  (OpenAI-compatible: {router['http']}/v1)" if router["http"] else "")
    )
    return "\n".join(lines)


def serve_foreground(config: ClusterConfig) -> None:
    """Keep a local Ray instance (and so the services) alive until Ctrl-C / SIGTERM, or
    until ``tandem ray down`` removed the router."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while ROUTER in _running(config.ray.namespace):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        down(config)


def main(args) -> int:
    """``tandem ray up|down`` (see deploy.cli)."""
    try:
        config = load_config(args.config)
    except (OSError, ConfigError) as e:
        print(f"tandem ray: {args.config}: {e}", file=sys.stderr)
        return 2
    connect(config, args.address)
    if args.ray_command == "down":
        stopped = down(config)
        print(
            f"stopped {len(stopped)} actors in namespace {config.ray.namespace!r}"
            + (f": {', '.join(stopped)}" if stopped else ""),
            flush=True,
        )
        return 0
    try:
        endpoints = up(config)
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        reason = getattr(e, "cause", None) or e  # an actor's own exception, not Ray's wrapper
        print(f"tandem ray up: {type(reason).__name__}: {reason}", file=sys.stderr)
        return 1
    print(describe(config, endpoints), flush=True)
    if config.ray.start_local and not args.address:
        print(
            f"the local Ray instance ({ray.get_runtime_context().gcs_address}) lives as long "
            "as this process (Ctrl-C stops it)",
            flush=True,
        )
        serve_foreground(config)
    return 0


# ---------------------------------------------------------------------- internals


def _running(namespace: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(NAME_PREFIX)
    )


_actor_class = None


def _place(config: ClusterConfig, options, name: str):
    """A detached, named actor with the service's resources and the configured env."""
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(ServiceActor)
    return _actor_class.options(
        name=name,
        namespace=config.ray.namespace,
        lifetime="detached",
        max_restarts=0,
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus,
        resources=dict(options.resources),
        runtime_env={"env_vars": {k: str(v) for k, v in config.ray.env.items()}},
    ).remote()


def _start_worker(config: ClusterConfig, role: str, index: int, router: str):
    instance_id = f"{role}-{index}"
    actor = _place(config, getattr(config, role), NAME_PREFIX + instance_id)
    return actor.start_worker.remote(config, role, instance_id, router)


def _wait_ready(router, config: ClusterConfig) -> None:
    """Until the router reports every prefill/decode pair READY."""
    deadline = time.monotonic() + config.ready_timeout_s
    health: dict = {}
    while time.monotonic() < deadline:
        health = ray.get(router.health.remote())
        if health["serving"] and health["num_ready_pairs"] >= config.expected_pairs:
            return
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(
        f"not serving after {config.ready_timeout_s} s: "
        f"{health.get('num_ready_pairs', 0)}/{config.expected_pairs} pairs ready; "
        f"{health.get('message', '')}"
    )
