"""The dashboard's rows and panels: titles, descriptions, queries and units.

Queries read the metrics of ``services/common/metrics.py`` only; ``dashboard.py`` lays the
rows out on the grid in this order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.grafana.promql import JOB, quantiles, rate, ratio


@dataclass(frozen=True, slots=True)
class Panel:
    """One timeseries panel: 8 grid units high, ``width`` of the grid's 24 wide."""

    title: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    width: int = 8


@dataclass(frozen=True, slots=True)
class Row:
    """A row header and its panels, placed left to right and wrapped at the grid's width."""

    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


ROWS = (
    Row(
        "Traffic",
        (
            Panel(
                "Requests/s at the router, by status",
                "Finished client requests per second; status is the finish reason, or error / unavailable.",
                ((rate("tandem_requests_total", "status", 'role="router"'), "{{status}}"),),
                unit="reqps",
            ),
            Panel(
                "Requests/s per worker role",
                "Requests finished by prefill, decode and aggregated workers.",
                ((rate("tandem_requests_total", "role", 'role!="router"'), "{{role}}"),),
                unit="reqps",
            ),
            Panel(
                "Tokens/s at the router",
                "Prompt and generated tokens of finished client requests per second.",
                (
                    (rate("tandem_prompt_tokens_total", "role", 'role="router"'), "prompt"),
                    (rate("tandem_generation_tokens_total", "role", 'role="router"'), "generated"),
                ),
            ),
            Panel(
                "Ready pairs",
                "Prefill/decode pairs the router can send requests to (an aggregated worker counts "
                "one), per router. 0: every request fails (the router's Health is NOT_SERVING).",
                (("sum by (instance) (tandem_ready_pairs{" + JOB + "})", "{{instance}}"),),
            ),
            Panel(
                "Peer registrations",
                "Registrations accepted and refused. A refused pair gets no traffic: the router's "
                "Health message names the field that differs.",
                ((rate("tandem_peer_registrations_total", "result"), "{{result}}"),),
                unit="ops",
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "At the router: from the request to its first streamed token.",
                quantiles("tandem_time_to_first_token_seconds", selector='role="router"'),
                unit="s",
            ),
            Panel(
                "Inter-token latency",
                "At the router: time per output token after the first (a chunk's gap over its tokens).",
                quantiles("tandem_inter_token_latency_seconds", selector='role="router"'),
                unit="s",
            ),
            Panel(
                "Inter-chunk latency",
                "At the router: time between streamed chunks; a chunk carries one verify step's "
                "tokens (about the acceptance length).",
                quantiles("tandem_inter_chunk_latency_seconds", selector='role="router"'),
                unit="s",
            ),
            Panel(
                "End-to-end latency",
                "At the router: the whole request.",
                quantiles("tandem_e2e_request_latency_seconds", selector='role="router"'),
                unit="s",
            ),
        ),
    ),
    Row(
        "Speculative decoding",
        (
            Panel(
                "Acceptance length by draft-state origin",
                "Tokens emitted per verify step (accepted + 1). transferred: the drafter started "
                "from the prompt window the prefill worker sent; local: from its own prefill; "
                "cold: with no prompt window (the separate layout).",
                (
                    (
                        ratio(
                            "tandem_spec_acceptance_length_sum",
                            "tandem_spec_acceptance_length_count",
                            "origin",
                        ),
                        "{{origin}}",
                    ),
                ),
            ),
            Panel(
                "Draft acceptance rate by origin",
                "Accepted draft tokens / proposed draft tokens.",
                (
                    (
                        ratio(
                            "tandem_spec_accepted_tokens_total", "tandem_spec_draft_tokens_total", "origin"
                        ),
                        "{{origin}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Acceptance by draft position and origin",
                "Share of verify steps whose draft token at this position was accepted, per "
                "draft-state origin.",
                (
                    (
                        f"{rate('tandem_spec_accepted_tokens_per_position_total', 'position, origin')} / "
                        f"on (origin) group_left {rate('tandem_spec_drafts_total', 'origin')}",
                        "{{origin}} position {{position}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Verify steps/s by origin",
                "How much decoding starts from transferred, local or cold draft state.",
                ((rate("tandem_spec_drafts_total", "origin"), "{{origin}}"),),
                unit="ops",
                width=24,
            ),
        ),
    ),
    Row(
        "KV cache pages",
        (
            Panel(
                "KV pages by state",
                "Pages held by requests, cached by the prefix cache (unlocked, evictable) and free, "
                "across workers, per group. Pages held with no request running are a leak.",
                (
                    (f"sum by (group, state) (tandem_kv_pages{{{JOB}}})", "{{group}} {{state}}"),
                    (f"sum by (group) (tandem_kv_pages_total{{{JOB}}})", "{{group}} pool"),
                ),
                width=12,
            ),
            Panel(
                "KV cache usage per worker and group",
                "Fraction of each worker's pool held by requests (as vLLM's kv_cache_usage_perc).",
                ((f"tandem_kv_cache_usage_ratio{{{JOB}}}", "{{instance}} {{group}}"),),
                unit="percentunit",
                width=12,
            ),
        ),
    ),
    Row(
        "Prefix cache",
        (
            Panel(
                "Prefix hit rate by group",
                "Prompt tokens reused / prompt tokens looked up, by worker role. The "
                "target decides the match; the draft group hits only where its window is complete.",
                (
                    (
                        ratio(
                            "tandem_prefix_cache_hits_total",
                            "tandem_prefix_cache_queries_total",
                            "role, group",
                        ),
                        "{{role}} {{group}}",
                    ),
                ),
                unit="percentunit",
                width=12,
            ),
            Panel(
                "Prompt tokens looked up and reused",
                "Per second, by worker role and group (a decode worker looks up the prompts it "
                "reserves for, a prefill worker the prompts it runs: never summed over roles).",
                (
                    (
                        rate("tandem_prefix_cache_queries_total", "role, group"),
                        "looked up {{role}} {{group}}",
                    ),
                    (rate("tandem_prefix_cache_hits_total", "role, group"), "reused {{role}} {{group}}"),
                ),
                unit="short",
                width=12,
            ),
        ),
    ),
    Row(
        "KV transfer",
        (
            Panel(
                "Transfer bytes/s by group",
                "KV pages pushed from prefill to decode workers; the "
                "draft group moves only in the unified layout.",
                ((rate("tandem_kv_transfer_bytes_total", "group"), "{{group}}"),),
                unit="Bps",
            ),
            Panel(
                "Transfer latency",
                "Wall time of one request's transfer (every group, aux state and the acknowledgement).",
                quantiles("tandem_kv_transfer_seconds"),
                unit="s",
            ),
            Panel(
                "Transfer failures by group",
                "Failed transfers per second.",
                ((rate("tandem_kv_transfer_failures_total", "group"), "{{group}}"),),
                unit="ops",
            ),
            Panel(
                "Transfer pages sent and skipped",
                "Pages per second the transfer sent, and "
                "pages it skipped because the decode worker held them already (its prefix cache).",
                ((rate("tandem_kv_transfer_pages_total", "group, kind"), "{{kind}} {{group}}"),),
                width=24,
            ),
        ),
    ),
    Row(
        "Queues",
        (
            Panel(
                "Requests running and waiting",
                "Per role.",
                (
                    (f"sum by (role) (tandem_requests_running{{{JOB}}})", "running {{role}}"),
                    (f"sum by (role) (tandem_requests_waiting{{{JOB}}})", "waiting {{role}}"),
                ),
                width=12,
            ),
            Panel(
                "Queue time",
                "From arrival to being scheduled, per role.",
                quantiles("tandem_request_queue_seconds", by="role"),
                unit="s",
                width=12,
            ),
            Panel(
                "Expired deadlines",
                "lease: reserved pages freed unused; transfer: pages that "
                "did not land or were not acknowledged in time.",
                ((rate("tandem_timeouts_total", "kind"), "{{kind}}"),),
                unit="ops",
                width=12,
            ),
            Panel(
                "Engine step time",
                "Wall time of one engine step by the forwards it ran: decode, prefill, mixed (one "
                "forward of both), decode+prefill (two) or overlapped (a decode step read while "
                "its successor runs, --overlap-decode).",
                quantiles("tandem_engine_step_seconds", by="kind"),
                unit="s",
                width=12,
            ),
            Panel(
                "Engine busy",
                "Fraction of the time each worker's engine spends in steps (1 = it never waits for work).",
                ((rate("tandem_engine_step_seconds_sum", "instance"), "{{instance}}"),),
                unit="percentunit",
                width=12,
            ),
            Panel(
                "Event loop lag",
                "How late each process's event loop ran a 0.25 s timer: a second or more means a "
                "call blocked the loop (every gRPC answer and UCX message waited); logged too.",
                quantiles("tandem_event_loop_lag_seconds", by="instance"),
                unit="s",
                width=12,
            ),
            Panel(
                "Thread CPU",
                "CPU each process's threads use (1 = a core): a worker's event loop (gRPC streams, "
                "relay, transfers) and its engine thread need the same GIL, so the loop's share "
                "is time the engine's steps may wait for it.",
                ((rate("tandem_thread_cpu_seconds_total", "instance, thread"), "{{instance}} {{thread}}"),),
                unit="percentunit",
                width=12,
            ),
            Panel(
                "Steps streams",
                "Per router: the Steps streams open from decode and aggregated workers (one each; "
                "0 with --no-step-streams), and the request chunks per second they carry, every "
                "request's chunks of an engine step in one message.",
                (
                    (f"sum by (instance) (tandem_step_streams{{{JOB}}})", "open {{instance}}"),
                    (rate("tandem_step_stream_chunks_total", "instance"), "chunks/s {{instance}}"),
                ),
                width=12,
            ),
        ),
    ),
)
