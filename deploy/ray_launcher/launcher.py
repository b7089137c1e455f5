"""``tandem ray up`` / ``tandem ray down``: Tandem's services as named, detached Ray actors.

``up`` joins the Ray cluster of cluster.yaml (or starts a local one), places the router,
then the prefill, decode and aggregated (``tandem worker --role both``) workers, waits until
the router reports every prefill/decode pair READY (registered, checked, test-transferred)
and every aggregated worker live, and prints the endpoints. The actors are detached and
named ``tandem-<service>`` (``tandem-router``, ``tandem-<role>-<i>``) in ``ray.namespace``,
so they outlive ``up`` and ``down`` (from any process) finds and stops them.
"""

from __future__ import annotations

import signal
import sys
import time

import ray

from deploy.ray_launcher.actors import ServiceActor
from deploy.ray_launcher.config import WORKER_SECTIONS, ClusterConfig, ConfigError, load_config

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
            _start_worker(config, role, instance_id, endpoint["grpc"])
            for role, instance_id in worker_instances(config)
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


def worker_instances(config: ClusterConfig) -> list[tuple[str, str]]:
    """(role section, instance id) of every worker ``up`` places, prefill, decode then
    aggregated; the actor of each is named ``tandem-<instance id>``."""
    return [(role, f"{role}-{i}") for role in WORKER_SECTIONS for i in range(getattr(config, role).replicas)]


def actor_options(config: ClusterConfig, placement, name: str) -> dict:
    """Ray's options of the detached actor ``name``: its section's (``placement``: the
    router's or a worker role's) CPUs, GPUs and custom resources, the namespace ``down``
    looks in, no restart (a failed service is reported, not retried), and ray.env."""
    return {
        "name": name,
        "namespace": config.ray.namespace,
        "lifetime": "detached",
        "max_restarts": 0,
        "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus,
        "resources": dict(placement.resources),
        "runtime_env": {"env_vars": {k: str(v) for k, v in config.ray.env.items()}},
    }


def is_ready(config: ClusterConfig, health: dict) -> bool:
    """Whether the router (its actor's ``health``) serves through every worker ``up``
    placed: each prefill/decode pair READY and each aggregated worker live. An
    aggregated-only cluster expects no pair."""
    return (
        health["serving"]
        and health["num_ready_pairs"] >= config.expected_pairs
        and health["num_aggregated_workers"] >= config.aggregated.replicas
    )


def readiness(config: ClusterConfig, health: dict) -> str:
    """What is ready of what ``up`` waits for, e.g. ``1/1 pairs ready, 0/1 aggregated workers``."""
    parts = []
    if config.expected_pairs:
        parts.append(f"{health.get('num_ready_pairs', 0)}/{config.expected_pairs} pairs ready")
    if config.aggregated.replicas:
        parts.append(
            f"{health.get('num_aggregated_workers', 0)}/{config.aggregated.replicas} aggregated workers"
        )
    return ", ".join(parts)


def describe(config: ClusterConfig, endpoints: list[dict]) -> str:
    lines = [f"tandem on Ray (namespace {config.ray.namespace!r}): {_serving_through(config)}"]
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


def _place(config: ClusterConfig, placement, name: str):
    """A detached, named actor with the service's resources and the configured env."""
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(ServiceActor)
    return _actor_class.options(**actor_options(config, placement, name)).remote()


def _start_worker(config: ClusterConfig, role: str, instance_id: str, router: str):
    actor = _place(config, getattr(config, role), NAME_PREFIX + instance_id)
    return actor.start_worker.remote(config, role, instance_id, router)


def _wait_ready(router, config: ClusterConfig) -> None:
    """Until the router serves through every worker placed (:func:`is_ready`)."""
    deadline = time.monotonic() + config.ready_timeout_s
    health: dict = {}
    while time.monotonic() < deadline:
        health = ray.get(router.health.remote())
        if is_ready(config, health):
            return
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(
        f"not serving after {config.ready_timeout_s} s: {readiness(config, health)}; "
        f"{health.get('message', '')}"
    )


def _serving_through(config: ClusterConfig) -> str:
    """The workers placed, e.g. ``1 prefill x 1 decode (1 pair), 1 aggregated``."""
    parts = []
    if config.expected_pairs:
        pairs = config.expected_pairs
        parts.append(
            f"{config.prefill.replicas} prefill x {config.decode.replicas} decode "
            f"({pairs} pair{'s' if pairs > 1 else ''})"
        )
    if config.aggregated.replicas:
        parts.append(f"{config.aggregated.replicas} aggregated")
    return ", ".join(parts)
