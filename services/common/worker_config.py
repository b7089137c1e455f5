"""WorkerConfig: what one worker process is told at start, rank 0 and the other ranks alike.

Plain data (it crosses to the other ranks' processes pickled); ``__post_init__`` checks
every field and names the bad one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.common.security import TlsConfig
from services.engine.config import EngineConfig

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
    token: str = ""  # bearer token every RPC must carry; "" = none
    tls: TlsConfig | None = None  # mutual TLS on every gRPC hop; None = plaintext

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {sorted(ROLES)}, got {self.role!r}")
        if not self.instance_id:
            self.instance_id = f"{self.role}-{uuid.uuid4().hex[:8]}"
        for name in ("transfer_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    @property
    def moves_pages(self) -> bool:
        """Whether this worker transfers pages (not aggregated): it runs a UCX worker."""
        return self.role != "both"
