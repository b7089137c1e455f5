"""WorkerConfig: what one worker process is told at start, rank 0 and the other ranks alike.

Plain data (it crosses to the other ranks' processes pickled); ``__post_init__`` checks
every field and names the bad one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.common.log_setup import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, check_log_options
from services.common.process_settings import ProcessSettings
from services.common.security import TlsConfig, worker_token
from services.engine.config import EngineConfig
from services.worker.step_profile import StepProfile

ROLES = {"prefill": rpb.ROLE_PREFILL, "decode": rpb.ROLE_DECODE, "both": rpb.ROLE_BOTH}


@dataclass(slots=True)
class WorkerConfig:
    role: str  # "prefill", "decode" or "both"
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0 = any free port
    metrics_port: int = 0  # HTTP /metrics; 0 = any free port
    router: str = ""  # host:port of the router to register with; "" = none
    instance_id: str = ""  # "" = <role>-<random>
    transfer_timeout_s: float = 30.0
    lease_s: float = 60.0  # reserved pages are freed if Decode has not started by then
    service_secret: str = ""  # the cluster's service secret; this worker derives its token from it
    worker_token: str = ""  # or this worker's own token (``tandem worker-token``); "" = none
    tls: TlsConfig | None = None  # mutual TLS on every gRPC hop; None = plaintext
    # the logging level of the process's entry point, which configures it (the CLI, the Ray
    # actor); the other TP ranks' processes configure theirs from it (tp_rank.py)
    log_level: str = DEFAULT_LOG_LEVEL
    log_format: str = DEFAULT_LOG_FORMAT  # text or json, as log_level
    # request lines, the stats line's interval, the shutdown timeout (process_settings.py)
    process: ProcessSettings = field(default_factory=ProcessSettings)
    # profile a window of rank 0's engine steps (TANDEM_TORCH_PROFILER_DIR, read by the entry
    # point: services/worker/step_profile.py); None = off. The other ranks ignore it
    step_profile: StepProfile | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {sorted(ROLES)}, got {self.role!r}")
        self._check_worker_token()
        if not self.instance_id:
            self.instance_id = f"{self.role}-{uuid.uuid4().hex[:8]}"
        for name in ("transfer_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        check_log_options(self.log_level, self.log_format)

    def _check_worker_token(self) -> None:
        """A worker token names its instance id: it sets an empty one, and must match a given one."""
        if not self.worker_token:
            return
        if self.service_secret:
            raise ValueError("worker_token: give the service secret or a worker token, not both")
        named = self.worker_token.rpartition(".")[0]
        if not named:
            raise ValueError("worker_token: not <instance id>.<digits> (see `tandem worker-token`)")
        if self.instance_id and self.instance_id != named:
            raise ValueError(f"worker_token: is {named!r}'s, but instance_id is {self.instance_id!r}")
        self.instance_id = named

    @property
    def own_token(self) -> str:
        """The token this worker sends to the router and accepts from it; "" = none."""
        if self.service_secret:
            return worker_token(self.service_secret, self.instance_id)
        return self.worker_token

    @property
    def moves_pages(self) -> bool:
        """Whether this worker transfers pages (not aggregated): it runs a transport."""
        return self.role != "both"


def served_engine(config: EngineConfig) -> EngineConfig:
    """A worker's engine config: "delta" outputs (a step's new tokens, no text: its chunks
    carry token ids and the router detokenizes), so no step copies a whole output or makes
    text nobody reads."""
    return replace(config, output_kind="delta")
