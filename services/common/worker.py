"""What every worker role shares: config, the engine, the UCX agent, RankInfo, registration
with the router, Stats, and request conversions."""

from __future__ import annotations

import asyncio
import os
import sys
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
from services.common.faults import delay
from services.common.metrics import Metrics
from services.common.rank_info import build_rank_info
from services.common.security import TlsConfig, aio_channel
from services.common.tp_group import GroupTransferAgent, RankGroup
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import TokenLogprob
from services.engine.runner import DRAFT_GROUP, TARGET_GROUP
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
    """Engine, loop, transfer agent and identity of one worker process: rank 0 of the
    worker when it runs tensor-parallel (``engine.tp_size`` > 1), which starts the other
    ranks (services/common/tp_group.py) and speaks for all of them."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.group = RankGroup.spawn(config) if config.engine.tp_size > 1 else None
        self.engine = Engine(config.engine)
        if self.group is not None:
            self.engine.step = _exit_on_failure(self.engine.step)
        self.loop = EngineLoop(self.engine)
        self.metrics = Metrics(config.role)
        hidden = self.engine.target.config.hidden_size
        self.agent = GroupTransferAgent(KVTransferAgent(self.engine.manager, hidden_size=hidden), self.group)
        self.grpc_address = ""
        self.peers = None  # the PeerRegistry, once serving
        self._spec_seen: dict[str, tuple[int, int, int, list[int]]] = {}

    async def start(self) -> None:
        if self.config.role != "both":
            await self.agent.start()
        if self.group is not None:
            await self.group.join(self.rank_info())
        self.agent.total_heads = {g.name: g.total_num_kv_heads for g in self.rank_info().groups}
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self.config.role != "both":
            await self.agent.close()
        if self.group is not None:
            self.group.close()

    def rank_info(self) -> rpb.RankInfo:
        """Rank 0's RankInfo (the worker's, as the router knows it)."""
        ucx = self.agent.endpoint() if self.config.role != "both" else None
        info = engine_rank_info(
            self.engine, self.config.role, self.config.instance_id, ucx.worker_address if ucx else b""
        )
        info.grpc_address = self.grpc_address
        return info

    def rank_infos(self) -> list[rpb.RankInfo]:
        """Every rank's RankInfo, rank 0 first."""
        rank0 = self.rank_info()
        return self.group.rank_infos(rank0) if self.group is not None else [rank0]

    async def stats_reply(self) -> wpb.StatsResponse:
        """The Stats RPC's answer (late by the ``worker.stats`` fault delay, for tests)."""
        if delay("worker.stats"):
            await asyncio.sleep(delay("worker.stats"))
        return self.stats()

    def stats(self) -> wpb.StatsResponse:
        m = self.engine.manager
        groups = []
        for name, usage in m.usage().items():
            s = m.stats[name]
            groups.append(
                wpb.GroupStats(
                    group=name,
                    num_pages_used=usage.used,
                    num_pages_total=usage.total,
                    num_pages_cached=usage.cached,
                    prefix_cache=wpb.PrefixCacheStats(
                        num_queries=s.queries,
                        num_hits=s.hits,
                        num_query_tokens=s.query_tokens,
                        num_hit_tokens=s.hit_tokens,
                    ),
                )
            )
            self.metrics.pages_used.labels(name).set(usage.used)
            self.metrics.pages_total.labels(name).set(usage.total)
        sched = self.engine.scheduler
        return wpb.StatsResponse(
            instance_id=self.config.instance_id,
            role=ROLES[self.config.role],
            groups=groups,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
        )

    async def register_forever(self, ready: Callable[[bool], Awaitable[None]] | None = None) -> None:
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
                        await stub.Register(
                            reg.RegisterRequest(rank_info=self.rank_info(), token=self.config.token),
                            timeout=5,
                        )
                        registered = True
                    beat = await stub.Heartbeat(
                        reg.HeartbeatRequest(instance_id=self.config.instance_id, token=self.config.token),
                        timeout=5,
                    )
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
                m.spec_accepted_per_position.labels(str(i), origin).inc(
                    n - (per_pos[i] if i < len(per_pos) else 0)
                )
            if s.num_steps > steps:  # mean tokens per verify step since the last export
                m.spec_al.labels(origin).observe(
                    (s.num_accepted - accepted + s.num_steps - steps) / (s.num_steps - steps)
                )
            self._spec_seen[origin] = (
                s.num_steps,
                s.num_draft_tokens,
                s.num_accepted,
                list(s.accepted_per_position),
            )


def _exit_on_failure(step: Callable[[], list]) -> Callable[[], list]:
    """Under tensor parallelism a step that raises may leave the other ranks inside a
    forward's collectives: the group cannot go on, so the worker exits (the router then
    sees it gone and retries its requests elsewhere) rather than hang."""

    def guarded() -> list:
        try:
            return step()
        except Exception as e:
            print(
                f"tensor-parallel step failed, the worker exits: {type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    return guarded


def engine_rank_info(engine: Engine, role: str, instance_id: str, ucx_address: bytes) -> rpb.RankInfo:
    """The RankInfo of the rank running ``engine``: its own pools' heads, tp size/rank."""
    e = engine
    totals = {TARGET_GROUP: e.target.config.num_key_value_heads}
    if e.drafter is not None:
        totals[DRAFT_GROUP] = e.drafter.config.num_key_value_heads
    return build_rank_info(
        e.manager.config,
        role=role,
        instance_id=instance_id,
        model_id=os.path.basename(os.path.normpath(e.config.model)),
        drafter_id=os.path.basename(os.path.normpath(e.config.drafter)) if e.drafter else "",
        drafter_kind="eagle3" if e.drafter else "",
        tp_size=e.tp.size,
        tp_rank=e.tp.rank,
        ucx_address=ucx_address,
        total_kv_heads=totals,
        num_pages=tuple(a.num_pages for a in e.manager.allocators.values()),
    )


def sampling_from_proto(params: cpb.SamplingParams) -> SamplingParams:
    """Proto defaults: max_tokens 0 = the server default, temperature 0 = greedy, top_p 0 = 1,
    repetition_penalty 0 = 1; logprobs unset = none. Raises ValueError naming the field."""
    return SamplingParams(
        temperature=float(params.temperature),
        top_p=float(params.top_p) if params.top_p > 0 else 1.0,
        max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        ignore_eos=params.ignore_eos,
        top_k=params.top_k,
        min_p=float(params.min_p),
        repetition_penalty=float(params.repetition_penalty or 1.0),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        min_tokens=params.min_tokens,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
    )


def spec_tokens_from_proto(options: cpb.SpeculativeOptions) -> int | None:
    """speculative.num_spec_tokens: unset = the server's K (None)."""
    return options.num_spec_tokens if options.HasField("num_spec_tokens") else None


def logprobs_to_proto(entries: list[TokenLogprob | None] | None) -> list[cpb.TokenLogprobs]:
    """Engine logprobs -> Chunk.logprobs (None entries, computed elsewhere, are skipped)."""
    return [
        cpb.TokenLogprobs(
            token_id=e.token_id, logprob=e.logprob, top_token_ids=e.top_ids, top_logprobs=e.top_logprobs
        )
        for e in entries or ()
        if e is not None
    ]


FINISH_REASONS = {
    "stop": cpb.FINISH_REASON_STOP,
    "length": cpb.FINISH_REASON_LENGTH,
    "abort": cpb.FINISH_REASON_ABORT,
    None: cpb.FINISH_REASON_UNSPECIFIED,
    "prefilled": cpb.FINISH_REASON_UNSPECIFIED,
}


def layout_of(name: str) -> KVLayout:
    try:
        return KVLayout(name)
    except ValueError:
        raise ValueError(f"layout: must be 'unified' or 'separate', got {name!r}") from None
