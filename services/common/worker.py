"""What every worker role shares: config, the engine, the UCX agent, RankInfo, registration
with the router, Stats, and request conversions."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from kvcore import KVLayout
from kvcore.transfer.kv_transfer import KVTransferAgent
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.engine_loop import EngineLoop
from services.common.metrics import Metrics
from services.common.rank_info import build_rank_info
from services.common.security import TlsConfig, aio_channel
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling import SamplingParams

ROLES = {"prefill": rpb.ROLE_PREFILL, "decode": rpb.ROLE_DECODE, "both": rpb.ROLE_BOTH}
DEFAULT_MAX_TOKENS = 128
HEARTBEAT_S = 1.0


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


class WorkerBase:
    """Engine, loop, transfer agent and identity of one worker process."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.loop = EngineLoop(self.engine)
        self.metrics = Metrics(config.role)
        hidden = self.engine.target.config.hidden_size
        self.agent = KVTransferAgent(self.engine.manager, hidden_size=hidden)
        self.grpc_address = ""
        self.peers = None  # the PeerRegistry, once serving
        self._spec_seen: dict[str, tuple[int, int, int, list[int]]] = {}

    async def start(self) -> None:
        if self.config.role != "both":
            await self.agent.start()
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self.config.role != "both":
            await self.agent.close()

    def rank_info(self) -> rpb.RankInfo:
        e = self.engine
        ucx = self.agent.endpoint() if self.config.role != "both" else None
        info = build_rank_info(
            e.manager.config, role=self.config.role, instance_id=self.config.instance_id,
            model_id=os.path.basename(os.path.normpath(e.config.model)),
            drafter_id=os.path.basename(os.path.normpath(e.config.drafter)) if e.drafter else "",
            drafter_kind="eagle3" if e.drafter else "",
            ucx_address=ucx.worker_address if ucx else b"",
            num_pages=tuple(a.num_pages for a in e.manager.allocators.values()))
        info.grpc_address = self.grpc_address
        return info

    def stats(self) -> wpb.StatsResponse:
        m = self.engine.manager
        groups = []
        for name, usage in m.usage().items():
            s = m.stats[name]
            groups.append(wpb.GroupStats(group=name, num_pages_used=usage.used,
                                         num_pages_total=usage.total,
                                         num_pages_cached=usage.cached,
                                         prefix_cache=wpb.PrefixCacheStats(
                                             num_queries=s.queries, num_hits=s.hits,
                                             num_query_tokens=s.query_tokens,
                                             num_hit_tokens=s.hit_tokens)))
            self.metrics.pages_used.labels(name).set(usage.used)
            self.metrics.pages_total.labels(name).set(usage.total)
        sched = self.engine.scheduler
        return wpb.StatsResponse(instance_id=self.config.instance_id,
                                 role=ROLES[self.config.role], groups=groups,
                                 num_running=len(sched.running), num_waiting=len(sched.waiting))

    async def register_forever(self, ready: Callable[[bool], Awaitable[None]] | None = None
                               ) -> None:
        """Register with the router, then heartbeat; register again whenever it forgets us.
        ``ready(flag)`` reports whether this worker is registered and, unless aggregated, in
        at least one pair that passed its test transfer (``paired``)."""
        if not self.config.router:
            return
        async with aio_channel(self.config.router, self.config.tls, self.config.token) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            registered = False
            while True:
                try:
                    if not registered:
                        await stub.Register(reg.RegisterRequest(rank_info=self.rank_info(),
                                                                token=self.config.token), timeout=5)
                        registered = True
                    beat = await stub.Heartbeat(reg.HeartbeatRequest(
                        instance_id=self.config.instance_id, token=self.config.token), timeout=5)
                    registered = beat.registered
                except grpc.aio.AioRpcError:
                    registered = False
                if ready is not None:
                    await ready(registered and (self.config.role == "both" or self.paired()))
                await asyncio.sleep(HEARTBEAT_S)

    def paired(self) -> bool:
        return bool(self.peers is not None and self.peers.peers)

    def record_spec_metrics(self) -> None:
        """Export the engine's speculative counters (per origin) as Prometheus totals."""
        for origin, s in self.engine.stats.items():
            steps, drafts, accepted, per_pos = self._spec_seen.get(origin, (0, 0, 0, []))
            m = self.metrics
            m.spec_drafts.labels(origin).inc(s.num_steps - steps)
            m.spec_draft_tokens.labels(origin).inc(s.num_draft_tokens - drafts)
            m.spec_accepted.labels(origin).inc(s.num_accepted - accepted)
            for i, n in enumerate(s.accepted_per_position):
                m.spec_accepted_per_position.labels(str(i), origin).inc(n - (per_pos[i] if i < len(per_pos)
                                                                     else 0))
            if s.num_steps > steps:  # mean tokens per verify step since the last export
                m.spec_al.labels(origin).observe(
                    (s.num_accepted - accepted + s.num_steps - steps) / (s.num_steps - steps))
            self._spec_seen[origin] = (s.num_steps, s.num_draft_tokens, s.num_accepted,
                                       list(s.accepted_per_position))


def sampling_from_proto(params: cpb.SamplingParams) -> SamplingParams:
    """Proto defaults: max_tokens 0 = the server default, temperature 0 = greedy, top_p 0 = 1."""
    return SamplingParams(temperature=float(params.temperature),
                          top_p=float(params.top_p) if params.top_p > 0 else 1.0,
                          max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS,
                          seed=params.seed if params.HasField("seed") else None,
                          stop=tuple(params.stop), ignore_eos=params.ignore_eos)


FINISH_REASONS = {"stop": cpb.FINISH_REASON_STOP, "length": cpb.FINISH_REASON_LENGTH,
                  "abort": cpb.FINISH_REASON_ABORT, None: cpb.FINISH_REASON_UNSPECIFIED,
                  "prefilled": cpb.FINISH_REASON_UNSPECIFIED}


def layout_of(name: str) -> KVLayout:
    try:
        return KVLayout(name)
    except ValueError:
        raise ValueError(f"layout: must be 'unified' or 'separate', got {name!r}") from None
