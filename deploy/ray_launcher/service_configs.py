"""What each Ray actor runs, from cluster.yaml: the router's settings and a worker's
WorkerConfig, the same objects ``tandem router`` and ``tandem worker`` build from their flags.

Pure functions of the ClusterConfig and the actor's placement (no Ray): the actors call them
on their node, where the TLS files are checked to exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deploy.engine_config import engine_config
from deploy.ray_launcher.config import TANDEM_WORKER_ROLE, ClusterConfig
from services.common.security import TlsConfig, tls_from
from services.router.api import RouterSettings

if TYPE_CHECKING:
    from services.worker.worker_config import WorkerConfig


@dataclass(frozen=True, slots=True)
class Listen:
    """Where an actor's service listens: its node's address, its gRPC and metrics ports."""

    host: str
    port: int
    metrics_port: int


def tls_config(cluster: ClusterConfig) -> TlsConfig | None:
    """Mutual TLS of every hop, from the security section's files; None without them.
    ValueError naming the missing file."""
    s = cluster.security
    return tls_from(s.tls_cert, s.tls_key, s.tls_ca, s.tls_server_name)


def router_settings(cluster: ClusterConfig) -> RouterSettings:
    """The router's settings: the workers' page size and model, and the credentials."""
    engine, s = cluster.model.engine_options(), cluster.security
    return RouterSettings(
        tokens_per_page=engine.tokens_per_page,
        model_id=os.path.basename(os.path.normpath(engine.model)),
        token=s.client_token,
        service_secret=s.service_token,
        tls=tls_config(cluster),
    )


def worker_config(
    cluster: ClusterConfig, role: str, instance_id: str, router: str, listen: Listen
) -> WorkerConfig:
    """The config of a worker of cluster.yaml's ``role`` section, as ``tandem worker --role``
    builds it (the aggregated section's runs ``--role both``): its role's engine options (its
    own tp and KV sizing over the model section's), deadlines, the service secret and TLS;
    it registers with ``router`` (host:port) and serves at ``listen``; its step profile from
    the actor's environment (``ray.env``), as ``tandem worker`` reads it. Loads torch (the
    engine's config)."""
    from services.worker.step_profile import profile_from_env  # noqa: PLC0415 (torch, as below)
    from services.worker.worker_config import WorkerConfig  # noqa: PLC0415 (torch: the router stays light)

    options = getattr(cluster, role)
    return WorkerConfig(
        role=TANDEM_WORKER_ROLE[role],
        engine=engine_config(cluster.worker_engine_options(role)),
        host=listen.host,
        port=listen.port,
        metrics_port=listen.metrics_port,
        router=router,
        instance_id=instance_id,
        transfer_timeout_s=options.transfer_timeout_s,
        lease_s=options.lease_s,
        log_level=cluster.log_level,
        log_format=cluster.log_format,
        process=cluster.process_settings(),
        service_secret=cluster.security.service_token,
        tls=tls_config(cluster),
        step_profile=profile_from_env(os.environ),
    )
