"""Prometheus metrics of every service, with the names design.md §5 fixes.

One ``Metrics`` per process, on its own registry, served over HTTP by ``serve_metrics``.
Units: seconds and bytes; counters end in ``_total``. Every sample carries a
``model_name`` label (the served model name, as vLLM labels its metrics) once
``model_name`` is set: the registry adds it when it is scraped, so call sites pass only
their own labels.

Invariants:
- A failure counter has its series from the start, at 0 (requests ended in error, expired
  deadlines, refused registrations; failed transfers once the groups are known:
  ``start_groups``), so ``rate()`` and ``increase()`` see the first failure.
- The process's own ``process_*`` series (CPU seconds, resident memory, open files, start
  time; Linux only) are on the same registry, as vLLM exports them.
- ``tandem_ready_pairs`` is the router's alone: workers do not export it.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from services.common.metrics_http import serve_registry
from services.common.thread_cpu import ThreadCPU

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
AL_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)


class ModelRegistry(CollectorRegistry):
    """A registry that adds ``model_name="<name>"`` to every sample it exposes ("" = none)."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__()
        self.model_name = model_name

    def collect(self):
        for metric in super().collect():
            if self.model_name:
                metric.samples = [
                    s._replace(labels={**s.labels, "model_name": self.model_name}) for s in metric.samples
                ]
            yield metric


class Metrics:
    """Every metric of a service, declared by area in the order it is exposed: requests and
    their latencies, KV pages and prefix reuse, KV transfers, speculation, the cluster."""

    def __init__(self, role: str, model_name: str = "") -> None:
        """``model_name``: the served model's name, labelled on every sample ("" = none;
        settable later through ``model_name``)."""
        self.role = role
        self.registry = ModelRegistry(model_name)
        self._declare_requests(self.registry)
        self._declare_kv_cache(self.registry)
        self._declare_transfer(self.registry)
        self._declare_speculation(self.registry)
        self._declare_cluster(self.registry)
        ProcessCollector(registry=self.registry)
        self._start_failure_series()

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """Finished requests, their tokens, latencies and the queues, by role."""
        self.requests = Counter("tandem_requests", "Finished requests", ["role", "status"], registry=r)
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of finished requests", ["role"], registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens generated for finished requests", ["role"], registry=r
        )
        self.ttft = self._latency(r, "tandem_time_to_first_token_seconds", "Time to first token")
        self.itl = self._latency(
            r,
            "tandem_inter_token_latency_seconds",
            "Time per output token after the first: a chunk's gap over its tokens, once per token",
        )
        self.inter_chunk = self._latency(
            r,
            "tandem_inter_chunk_latency_seconds",
            "Time between streamed chunks (a chunk carries one verify step's tokens)",
        )
        self.e2e = self._latency(r, "tandem_e2e_request_latency_seconds", "Request latency")
        self.queue = self._latency(
            r,
            "tandem_request_queue_seconds",
            "Time from arrival to being scheduled: the router's wait for KV pages, a worker's engine queue",
        )
        self.running = Gauge("tandem_requests_running", "Requests running", ["role"], registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests waiting", ["role"], registry=r)

    @staticmethod
    def _latency(r: CollectorRegistry, name: str, text: str) -> Histogram:
        return Histogram(name, text, ["role"], buckets=LATENCY_BUCKETS, registry=r)

    def _declare_kv_cache(self, r: CollectorRegistry) -> None:
        """KV pages by who holds them, and prompt tokens looked up and reused, by group."""
        self.pages = Gauge(
            "tandem_kv_pages",
            "KV pages by state: held by requests, cached (the prefix cache's, unlocked), free",
            ["group", "state"],
            registry=r,
        )
        self.pages_total = Gauge("tandem_kv_pages_total", "KV pages in the pool", ["group"], registry=r)
        self.kv_usage = Gauge(
            "tandem_kv_cache_usage_ratio", "Fraction of the pool held by requests", ["group"], registry=r
        )
        self.prefix_queries = Counter(
            "tandem_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, by the worker role that looked",
            ["role", "group"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "tandem_prefix_cache_hits",
            "Prompt tokens reused from the prefix cache, by the worker role that reused them",
            ["role", "group"],
            registry=r,
        )

    def _declare_transfer(self, r: CollectorRegistry) -> None:
        """KV transfers from prefill to decode workers: bytes, pages, failures, wall time."""
        self.transfer_bytes = Counter("tandem_kv_transfer_bytes", "KV bytes moved", ["group"], registry=r)
        self.transfer_pages = Counter(
            "tandem_kv_transfer_pages",
            "KV pages of transfers: sent, or held already by the decode worker and skipped",
            ["group", "kind"],
            registry=r,
        )
        self.transfer_failures = Counter(
            "tandem_kv_transfer_failures", "Failed KV transfers", ["group"], registry=r
        )
        self.transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "Wall time of one request's KV transfer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _declare_speculation(self, r: CollectorRegistry) -> None:
        """Verify steps, draft tokens proposed and accepted, by draft-state origin."""
        self.spec_drafts = Counter(
            "tandem_spec_drafts", "Decode steps that verified a draft", ["origin"], registry=r
        )
        self.spec_draft_tokens = Counter(
            "tandem_spec_draft_tokens", "Draft tokens proposed", ["origin"], registry=r
        )
        self.spec_accepted = Counter(
            "tandem_spec_accepted_tokens", "Draft tokens accepted", ["origin"], registry=r
        )
        self.spec_accepted_per_position = Counter(
            "tandem_spec_accepted_tokens_per_position",
            "Accepted draft tokens by position",
            ["position", "origin"],
            registry=r,
        )
        self.spec_al = Histogram(
            "tandem_spec_acceptance_length",
            "Mean tokens emitted per verify step (accepted drafts + 1) over the steps since the "
            "last observation: one observation per finished request on a decode or aggregated "
            "worker, not one per step",
            ["origin"],
            buckets=AL_BUCKETS,
            registry=r,
        )

    def _declare_cluster(self, r: CollectorRegistry) -> None:
        """Peer registrations, and deadlines that expired."""
        self.registrations = Counter(
            "tandem_peer_registrations", "Peer registrations", ["result"], registry=r
        )
        self.timeouts = Counter(
            "tandem_timeouts",
            "Deadlines that expired, by kind: lease "
            "(reserved pages freed unused), transfer (pages did not land or "
            "were not acknowledged in time)",
            ["kind"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "tandem_engine_step_seconds",
            "Wall time of one engine step (scheduling, forwards, host read, outputs), by the "
            "forwards it ran: decode, prefill, mixed (one forward of both), decode+prefill (two) or "
            "overlapped (a decode step read while its successor runs, --overlap-decode)",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "tandem_event_loop_lag_seconds",
            "How late the process's event loop ran a 0.25 s timer: long turns (a blocking "
            "call) delay every gRPC answer and UCX progress",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.thread_cpu = ThreadCPU()  # tandem_thread_cpu_seconds_total: event_loop, engine (a worker's)
        r.register(self.thread_cpu)
        self.ready_pairs = self.step_streams = self.step_stream_chunks = None  # the router's alone
        if self.role == "router":
            self.ready_pairs = Gauge(
                "tandem_ready_pairs",
                "Prefill/decode pairs ready to take requests, an aggregated worker counting one; "
                "the router's: 0 = it serves nothing",
                registry=r,
            )
            self.step_streams = Gauge(
                "tandem_step_streams",
                "Steps streams open from decode and aggregated workers, each carrying every "
                "request's chunks of an engine step in one message (0 with --no-step-streams)",
                registry=r,
            )
            self.step_stream_chunks = Counter(
                "tandem_step_stream_chunks",
                "Request chunks that came on Steps streams (the others came on their own calls)",
                registry=r,
            )

    def _start_failure_series(self) -> None:
        """The failure counters' series at 0 (see the module's invariants)."""
        for status in ("error", "unavailable") if self.role == "router" else ("error",):
            self.requests.labels(self.role, status)
        for kind in ("lease", "transfer"):
            self.timeouts.labels(kind)
        self.registrations.labels("refused")

    def start_groups(self, groups) -> None:
        """A worker's layer groups, once its engine is built: their failed-transfer series at 0."""
        for group in groups:
            self.transfer_failures.labels(group)

    @property
    def model_name(self) -> str:
        return self.registry.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.registry.model_name = name

    def set_pages(self, usage: Mapping) -> None:
        """``usage``: group -> kvcore.GroupUsage. Held by requests: used pages less the
        prefix cache's unlocked ones; 0 on an idle worker, whatever it has cached."""
        for group, u in usage.items():
            held = u.used - u.evictable
            for state, n in (("request", held), ("cached", u.evictable), ("free", u.total - u.used)):
                self.pages.labels(group, state).set(n)
            self.pages_total.labels(group).set(u.total)
            self.kv_usage.labels(group).set(held / u.total if u.total else 0.0)

    def observe_step(self, kind: str, seconds: float) -> None:
        """An engine step that ran ``kind``'s forwards in ``seconds`` (an empty kind: none)."""
        if kind:
            self.step_seconds.labels(kind).observe(seconds)

    def observe_chunk(self, role: str, gap_s: float, num_tokens: int) -> None:
        """A streamed chunk of ``num_tokens`` that came ``gap_s`` after the previous one."""
        self.inter_chunk.labels(role).observe(gap_s)
        per_token = self.itl.labels(role)
        for _ in range(num_tokens):
            per_token.observe(gap_s / num_tokens)


def serve_metrics(metrics: Metrics, host: str, port: int) -> int:
    """Serve ``/metrics`` over HTTP on ``host:port`` (0 = any free port); returns the port."""
    return serve_registry(metrics.registry, host, port)
