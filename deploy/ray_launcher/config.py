"""cluster.yaml for ``tandem ray up``: which Ray cluster, the model, and where each service runs.

Every section and key is optional; ``cluster.example.yaml`` documents them all. Unknown keys
are refused with their path, so a typo does not silently fall back to a default.

Invariants:
- A worker role's engine options are the model section's, with the role's own ``tp``,
  ``gpu_memory_utilization`` and ``kv_cache_mb`` where it gives them (None = the model's):
  prefill and decode may differ in TP where the heads divide (registration checks it).
- The worker roles are prefill, decode and aggregated (``tandem worker --role both``).
  Prefill and decode run one replica each unless told otherwise, aggregated none, so a
  file without the aggregated section places what it always did. Prefill and decode are
  given together or not at all (neither serves without the other), and at least one worker
  is placed; aggregated workers may run alone or beside the pairs.
- Secrets never sit in the file: the security section names the launcher's environment
  variables that hold the client token and the service secret, read once at parse time
  (an unset one is refused); TLS files are paths as every node sees them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, replace

import yaml

from deploy.option_check import check
from deploy.option_rules import is_cuda
from deploy.options import (
    DEFAULT_DRAFTER,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MODEL,
    HERE,
    PROMPT_SPECIAL_TOKENS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    EngineOptions,
    TransferOptions,
)
from services.common.log_setup import DEFAULT_LOG_LEVEL, LOG_LEVELS
from services.common.process_settings import ProcessSettings


class ConfigError(ValueError):
    """cluster.yaml is invalid; the message starts with the key's path."""


@dataclass(slots=True)
class RayOptions:
    address: str = "auto"  # "auto", a GCS "host:port", or "ray://host:10001"
    namespace: str = "tandem"  # holds the named, detached actors
    start_local: bool = False  # start a Ray instance here instead of joining one
    num_cpus: int | None = None  # start_local only; None = every CPU
    num_gpus: int | None = None  # start_local only; None = every GPU
    env: dict[str, str] = field(default_factory=dict)  # environment of every actor


@dataclass(slots=True)
class ModelOptions(EngineOptions):
    """Every engine option of ``tandem worker`` (deploy/options.py), under its own name,
    and the router's serving options. Paths: "" = the bundled tiny pair (or the model
    folder's own tokenizer and template), relative ones are taken from the Tandem tree."""

    model: str = ""
    drafter: str = ""  # "none" = no drafter
    served_model_name: str = ""  # the API's model name and metrics label; "" = folder name
    chat_template: str = ""  # a Jinja file for chat; "" = the tokenizer's
    prompt_special_tokens: str = "text"  # "parse": clients' text may hold special tokens
    generation_config: str = "auto"  # sampling defaults: auto (the model's file), vllm (none), a folder
    reasoning_parser: str = "none"  # none, qwen3 or deepseek_r1: <think> text -> reasoning_content
    tool_call_parser: str = "none"  # none, hermes, llama3_json or mistral: calls -> tool_calls

    def engine_options(self) -> EngineOptions:
        """The engine options with the paths resolved."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)}
        values["model"] = os.path.join(HERE, self.model or DEFAULT_MODEL)
        values["drafter"] = (
            "none" if self.drafter == "none" else os.path.join(HERE, self.drafter or DEFAULT_DRAFTER)
        )
        values["tokenizer"] = _from_tree(self.tokenizer)
        return EngineOptions(**values)

    @property
    def chat_template_path(self) -> str:
        return _from_tree(self.chat_template)

    @property
    def generation_config_path(self) -> str:
        """``generation_config`` with a folder taken from the Tandem tree when relative."""
        return (
            self.generation_config
            if self.generation_config in ("auto", "vllm")
            else _from_tree(self.generation_config)
        )


@dataclass(slots=True)
class RouterPlacement:
    port: int = 50051  # gRPC; 0 = any free port
    http_port: int = 8000  # OpenAI-compatible HTTP; 0 = any free port, -1 = off
    metrics_port: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources


@dataclass(slots=True)
class WorkerOptions(TransferOptions):
    replicas: int = 1
    port: int = 0  # gRPC; 0 = any free port
    metrics_port: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 1.0  # per replica; the engine's device is then that GPU
    resources: dict[str, float] = field(default_factory=dict)
    # the role's own engine sizing; None = the model section's
    tp: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_mb: int | None = None


@dataclass(slots=True)
class AggregatedOptions(WorkerOptions):
    """An aggregated worker's placement and sizing: a prefill/decode worker's keys (its
    transfer deadlines are unused: it moves no pages), but none is placed unless asked."""

    replicas: int = 0


WORKER_SECTIONS = ("prefill", "decode", "aggregated")
"""The worker roles of cluster.yaml, in the order ``up`` places them."""

TANDEM_WORKER_ROLE = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}
"""The ``tandem worker --role`` each worker section's actors run."""

ROLE_ENGINE_KEYS = ("tp", "gpu_memory_utilization", "kv_cache_mb")
"""Engine options a worker role may set for itself, over the model section's."""

RESOLVED = {"resolved": True}
"""Metadata of a field parse_config fills in; cluster.yaml may not set it."""


@dataclass(slots=True)
class SecurityOptions:
    """Credentials of every gRPC hop (docs/reliability.md): the client token clients must
    send, the service secret workers' tokens derive from, and mutual TLS."""

    client_token_env: str = ""  # the launcher's environment variable holding the client token; "" = none
    service_token_env: str = ""  # ... holding the service secret; "" = none
    tls_cert: str = ""  # PEM files as every node sees them; all three or none
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""  # the name servers' certificates must carry; "" = the address
    client_token: str = field(default="", repr=False, metadata=RESOLVED)
    service_token: str = field(default="", repr=False, metadata=RESOLVED)

    @property
    def tls_files(self) -> tuple[str, str, str]:
        return self.tls_cert, self.tls_key, self.tls_ca


@dataclass(slots=True)
class ClusterConfig:
    ray: RayOptions = field(default_factory=RayOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    router: RouterPlacement = field(default_factory=RouterPlacement)
    prefill: WorkerOptions = field(default_factory=WorkerOptions)
    decode: WorkerOptions = field(default_factory=WorkerOptions)
    aggregated: AggregatedOptions = field(default_factory=AggregatedOptions)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    ready_timeout_s: float = 300.0  # seconds to wait for every pair to be READY and every aggregated worker
    log_level: str = DEFAULT_LOG_LEVEL  # every actor's Python logging (tandem --log-level)
    log_format: str = "text"  # text or json (tandem --log-format)
    log_requests: bool = True  # a line per finished request (tandem --disable-log-requests)
    log_stats_interval_s: float = 10.0  # a stats line per process; 0 = none
    shutdown_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may take

    def process_settings(self) -> ProcessSettings:
        """Every actor's request lines, stats interval and shutdown drain."""
        return ProcessSettings(self.log_requests, self.log_stats_interval_s, self.shutdown_timeout_s)

    @property
    def expected_pairs(self) -> int:
        return self.prefill.replicas * self.decode.replicas

    def worker_engine_options(self, role: str) -> EngineOptions:
        """The engine options of a ``role`` worker: the model section's with the role's own
        sizing (:meth:`role_engine_options`), and, when neither gpu_memory_utilization nor
        kv_cache_mb is given, on CUDA, the default fraction times the share of a GPU each of
        its ranks reserves (``num_gpus`` / ``tp`` below 1: actors that share a GPU split its
        memory, as `tandem up` does)."""
        engine = self.role_engine_options(role)
        share = getattr(self, role).num_gpus / engine.tp
        sized = engine.gpu_memory_utilization or engine.kv_cache_mb
        if sized or not is_cuda(engine.device) or not 0 < share < 1:
            return engine
        engine.gpu_memory_utilization = math.floor(DEFAULT_GPU_MEMORY_UTILIZATION * share * 10_000) / 10_000
        return engine

    def role_engine_options(self, role: str) -> EngineOptions:
        """The model section's engine options with ``role``'s own tp and KV sizing. A role
        that sizes its KV one way drops the model section's other way (a role's
        ``kv_cache_mb`` replaces the model's ``gpu_memory_utilization``, and back)."""
        options, engine = getattr(self, role), self.model.engine_options()
        own = {k: getattr(options, k) for k in ROLE_ENGINE_KEYS if getattr(options, k) is not None}
        if "kv_cache_mb" in own and "gpu_memory_utilization" not in own:
            own["gpu_memory_utilization"] = 0.0
        if "gpu_memory_utilization" in own and "kv_cache_mb" not in own:
            own["kv_cache_mb"] = 0
        return replace(engine, **own)


def load_config(path: str) -> ClusterConfig:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return parse_config(data)


def parse_config(data: dict) -> ClusterConfig:
    """Build a ClusterConfig from parsed YAML; raises ConfigError naming the key."""
    if not isinstance(data, dict):
        raise ConfigError("cluster.yaml: must be a mapping of sections")
    _refuse_unknown(data, ClusterConfig, "")
    top = (
        "ready_timeout_s",
        "log_level",
        "log_format",
        "log_requests",
        "log_stats_interval_s",
        "shutdown_timeout_s",
    )
    config = ClusterConfig(**{k: v for k, v in data.items() if k in top})
    for name in ("ray", "model", "router", *WORKER_SECTIONS, "security"):
        section = {} if data.get(name) is None else data[name]
        if not isinstance(section, dict):
            raise ConfigError(f"{name}: must be a mapping")
        kind = type(getattr(config, name))
        _refuse_unknown(section, kind, name + ".")
        setattr(config, name, kind(**section))
    _check(config)
    config.security = _resolve_secrets(config.security)
    return config


def _refuse_unknown(section: dict, kind: type, prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(kind) if not f.metadata.get("resolved")}
    for key in section:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(known))})")


def _check(config: ClusterConfig) -> None:
    _check_replicas(config)
    for path, value in _resources(config):
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{path}: must be a number >= 0, got {value!r}")
    if not config.ray.start_local and not config.ray.address:
        raise ConfigError("ray.address: empty; give a cluster address or set ray.start_local")
    sections = [("model", config.model.engine_options())]
    sections += [(role, getattr(config, role)) for role in WORKER_SECTIONS]
    sections += [(role, config.role_engine_options(role)) for role in WORKER_SECTIONS]
    for section, options in sections:
        try:
            check(options)
        except ValueError as e:
            raise ConfigError(f"{section}.{e}") from None
    _check_security(config.security)
    if config.model.prompt_special_tokens not in PROMPT_SPECIAL_TOKENS:
        raise ConfigError(
            f"model.prompt_special_tokens: must be text or parse, got {config.model.prompt_special_tokens!r}"
        )
    if config.model.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(
            f"model.reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, "
            f"got {config.model.reasoning_parser!r}"
        )
    if config.model.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"model.tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, "
            f"got {config.model.tool_call_parser!r}"
        )
    if not isinstance(config.ray.env, dict):
        raise ConfigError("ray.env: must be a mapping of variable names to values")
    if config.ready_timeout_s <= 0:
        raise ConfigError(f"ready_timeout_s: must be > 0, got {config.ready_timeout_s}")
    try:
        config.process_settings()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.log_format not in ("text", "json"):
        raise ConfigError(f"log_format: must be text or json, got {config.log_format!r}")
    if config.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"log_level: must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, got {config.log_level!r}"
        )


def _check_replicas(config: ClusterConfig) -> None:
    """Every role's replicas an integer >= 0; prefill and decode both or neither (a lone
    role never becomes ready: ``up`` would hold its GPUs and time out); some worker at all."""
    for role in WORKER_SECTIONS:
        replicas = getattr(config, role).replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ConfigError(f"{role}.replicas: must be an integer >= 0, got {replicas!r}")
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        given = getattr(config, role).replicas
        if given and not getattr(config, peer).replicas:
            raise ConfigError(
                f"{peer}.replicas: 0 with {role}.replicas {given}: a {role} worker serves only "
                f"paired with a {peer} worker; give {peer}.replicas too, or run no {role} worker "
                "and serve with aggregated.replicas"
            )
    if not any(getattr(config, role).replicas for role in WORKER_SECTIONS):
        raise ConfigError(
            "prefill.replicas, decode.replicas, aggregated.replicas: all 0, so `up` would place no "
            "worker; give prefill.replicas and decode.replicas, or aggregated.replicas"
        )


def _check_security(security: SecurityOptions) -> None:
    """Every key a string; TLS files all three or none, a server name only with them; a
    client token only with the service secret or TLS (the router refuses it alone)."""
    for f in dataclasses.fields(security):
        if not isinstance(getattr(security, f.name), str):
            raise ConfigError(f"security.{f.name}: must be a string, got {getattr(security, f.name)!r}")
    given = [bool(path) for path in security.tls_files]
    if any(given) and not all(given):
        raise ConfigError("security.tls_cert: mutual TLS needs tls_cert, tls_key and tls_ca")
    if security.tls_server_name and not any(given):
        raise ConfigError("security.tls_server_name: needs mutual TLS (tls_cert, tls_key and tls_ca)")
    if security.client_token_env and not (security.service_token_env or any(given)):
        raise ConfigError(
            "security.client_token_env: a client token needs the service secret (service_token_env) "
            "or mutual TLS: clients and workers hold separate credentials"
        )


def _resolve_secrets(security: SecurityOptions) -> SecurityOptions:
    """``security`` with the tokens read from the launcher's environment; a named variable
    that is unset or empty is refused."""
    values = {}
    for key, target in (("client_token_env", "client_token"), ("service_token_env", "service_token")):
        name = getattr(security, key)
        if name:
            if not os.environ.get(name):
                raise ConfigError(f"security.{key}: ${name} is not set in the launcher's environment")
            values[target] = os.environ[name]
    return replace(security, **values)


def _from_tree(path: str) -> str:
    """A path of cluster.yaml: a relative one is taken from the Tandem tree; "" stays ""."""
    return os.path.join(HERE, path) if path else ""


def _resources(config: ClusterConfig):
    for role in ("router", *WORKER_SECTIONS):
        options = getattr(config, role)
        yield f"{role}.num_cpus", options.num_cpus
        yield f"{role}.num_gpus", options.num_gpus
        for name, amount in options.resources.items():
            yield f"{role}.resources.{name}", amount
