"""What every worker role shares: the engine, the transfer agent, RankInfo, registration
with the router, Stats, and request conversions (the config: services/worker/worker_config.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable

from kvcore import GroupStats, GroupUsage, KVLayout
from kvcore.transfer import TransferAgent, yield_while
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.faults import delay
from services.common.metrics import Metrics
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from services.grammar import constraint_from_proto
from services.worker.engine_loop import EngineLoop
from services.worker.rank_info import engine_kv_heads, engine_rank_info
from services.worker.router_links import RouterLinks
from services.worker.step_profile import StepProfiler
from services.worker.tp_group import RankGroup
from services.worker.worker_config import ROLES, WorkerConfig, served_engine

DEFAULT_MAX_TOKENS = 128
log = logging.getLogger(__name__)


class WorkerBase:
    """Engine, loop, transfer agent and identity of one worker process: rank 0 of the
    worker when it runs tensor-parallel (``engine.tp_size`` > 1), which starts the other
    ranks (services/worker/tp_group.py) and speaks for all of them."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.group = RankGroup.spawn(config) if config.engine.tp_size > 1 else None
        self.engine = Engine(served_engine(config.engine))
        if self.group is not None:
            self.engine.step = _exit_on_failure(self.engine.step)
        self.metrics = Metrics(config.role)
        self.metrics.start_groups(self.engine.manager.groups)
        self.loop = EngineLoop(
            self.engine,
            self.metrics.observe_step,
            count_prompts=config.role != "decode",
            profiler=_step_profiler(config, self.engine),
        )
        e = self.engine
        self.agent = TransferAgent(
            e.manager,
            e.kv_pools,
            e.aux_hidden_size,
            links=self.group,
            total_heads=engine_kv_heads(e),
        )
        self.grpc_address = ""
        self._rank_info: rpb.RankInfo | None = None  # rank_info()'s, for its grpc_address
        self.peers = None  # the PeerRegistry, once serving
        self.links: RouterLinks | None = None  # its registrations, once registering
        self.draining = ""  # why new requests are refused (shutting down); "" = taking them
        self.in_flight = 0  # request RPCs being served (services/worker/request_rpc.py)
        # what a shutdown that timed out runs, after the engine's requests failed (a decode
        # worker drops its reservations that no Decode took)
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []
        self._spec_seen: dict[str, tuple[int, int, int, list[int]]] = {}
        self._prefix_seen: dict[str, tuple[int, int]] = {}  # group -> (query, hit) tokens exported

    async def start(self) -> None:
        if self.config.moves_pages:
            await self.agent.start()
        if self.group is not None:
            await self.group.join(self.rank_info())
        self.loop.start()
        yield_while(lambda: self.loop.stepping)  # transfers give the GIL up while a step runs
        self.metrics.thread_cpu.watch("event_loop")  # start runs on the event loop's thread
        self.metrics.thread_cpu.watch("engine", self.loop.thread)

    async def stop(self) -> None:
        await self.loop.stop()
        yield_while(None)
        if self.config.moves_pages:
            await self.agent.close()
        if self.group is not None:
            for link in self.group.links.values():
                link.close()
            await asyncio.sleep(0)  # the loop closes the links' sockets: the other ranks see EOF and exit
            self.group.close()

    def rank_info(self) -> rpb.RankInfo:
        """Rank 0's RankInfo (the worker's, as the router knows it): built once its gRPC
        address is known (every Stats answer carries it), a fresh copy each call."""
        if self._rank_info is None or self._rank_info.grpc_address != self.grpc_address:
            endpoint = self.agent.endpoint() if self.config.moves_pages else None
            info = engine_rank_info(self.engine, self.config.role, self.config.instance_id, endpoint)
            info.grpc_address = self.grpc_address
            self._rank_info = info
        copy = rpb.RankInfo()
        copy.CopyFrom(self._rank_info)
        return copy

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
        """The Stats answer; refreshes the page, queue and prefix-cache metrics too."""
        cache = self.engine.cache_stats()
        groups = [_group_stats(name, usage, cache.prefix[name]) for name, usage in cache.usage.items()]
        running, waiting = self.engine.num_requests()
        self._export_cache(cache, running, waiting)
        return wpb.StatsResponse(
            instance_id=self.config.instance_id,
            role=ROLES[self.config.role],
            groups=groups,
            num_running=running,
            num_waiting=waiting,
            rank_info=self.rank_info(),
        )

    async def register_forever(self, ready: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """Register with every router (services/worker/router_links.py), forever. ``ready(flag)``
        reports whether some router knows this worker and, unless aggregated, it is in at
        least one pair that passed its test transfer (``paired``)."""
        if not self.config.router:
            return
        links = self.links = RouterLinks(
            self.config.router, self.rank_info, self.config.tls, self.config.own_token
        )

        async def changed() -> None:
            if ready is not None:
                await ready(bool(links.registered) and (self.config.role == "both" or self.paired()))

        await links.run(changed)

    def paired(self) -> bool:
        return bool(self.peers is not None and self.peers.peers)

    def refresh_metrics(self) -> None:
        cache = self.engine.cache_stats()
        self._export_cache(cache, *self.engine.num_requests())

    def _export_cache(self, cache, running: int, waiting: int) -> None:
        """Pages by state, running/waiting, and the prefix cache's token counters (totals
        exported as the growth since the last export)."""
        m, role = self.metrics, self.config.role
        m.set_pages(cache.usage)
        m.running.labels(role).set(running)
        m.waiting.labels(role).set(waiting)
        for name, prefix in cache.prefix.items():
            queried, hit = self._prefix_seen.get(name, (0, 0))
            m.prefix_queries.labels(role, name).inc(max(prefix.query_tokens - queried, 0))
            m.prefix_hits.labels(role, name).inc(max(prefix.hit_tokens - hit, 0))
            self._prefix_seen[name] = (prefix.query_tokens, prefix.hit_tokens)

    def busy_pages(self) -> int:
        """Pages that requests (running, or reservations) hold, every group together: 0
        once every request is gone (the prefix cache's pages are not counted)."""
        return sum(u.used - u.cached for u in self.engine.cache_stats().usage.values())

    def record_finished(self, out, status: str, generated: int) -> None:
        """A finished request: its count by status, prompt tokens, the ``generated`` tokens
        this worker produced, and its engine queue time; then the cache metrics. Its INFO
        line unless ``--disable-log-requests`` (the request id is the bound one)."""
        m, role = self.metrics, self.config.role
        if self.config.process.log_requests and out is not None:
            u = out.usage
            cached = max(u.cached_tokens.values(), default=0)
            fields = {
                "status": status,
                "prompt_tokens": u.prompt_tokens,
                "cached_tokens": cached,
                "generated_tokens": generated,
                "queue_s": round(u.queue_s, 4),
                "acceptance_length": round(u.acceptance_length, 3),
            }
            log.info(
                "%s request %s: prompt %d (cached %d), generated %d tokens here, queued %.3f s, AL %.2f",
                role,
                *fields.values(),
                extra={"fields": fields},
            )
        m.requests.labels(role, status).inc()
        if out is not None:
            m.prompt_tokens.labels(role).inc(out.usage.prompt_tokens)
            m.queue.labels(role).observe(out.usage.queue_s)
        m.generation_tokens.labels(role).inc(generated)
        self.refresh_metrics()

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


def _group_stats(name: str, usage: GroupUsage, prefix: GroupStats) -> wpb.GroupStats:
    return wpb.GroupStats(
        group=name,
        num_pages_used=usage.used,
        num_pages_total=usage.total,
        num_pages_cached=usage.cached,
        prefix_cache=wpb.PrefixCacheStats(
            num_queries=prefix.queries,
            num_hits=prefix.hits,
            num_query_tokens=prefix.query_tokens,
            num_hit_tokens=prefix.hit_tokens,
        ),
    )


def _step_profiler(config: WorkerConfig, engine: Engine) -> StepProfiler | None:
    """The profiler of ``config.step_profile``'s window of engine steps; None when off."""
    if config.step_profile is None:
        return None
    return StepProfiler(config.step_profile, config.instance_id, engine.device)


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


def sampling_from_proto(params: cpb.SamplingParams) -> SamplingParams:
    """Proto defaults: max_tokens 0 = the server default, temperature 0 = greedy, top_p 0 = 1,
    repetition_penalty 0 = 1; logprobs unset = none; structured unset = unconstrained.
    Raises ValueError naming the field."""
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
        structured=constraint_from_proto(params.structured),
    )


def spec_tokens_from_proto(options: cpb.SpeculativeOptions) -> int | None:
    """speculative.num_spec_tokens: unset = the server's K (None)."""
    return options.num_spec_tokens if options.HasField("num_spec_tokens") else None


def layout_of(name: str) -> KVLayout:
    try:
        return KVLayout(name)
    except ValueError:
        raise ValueError(f"layout: must be 'unified' or 'separate', got {name!r}") from None
