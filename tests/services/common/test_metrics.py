"""What the metrics say about pages and streamed tokens, as a scrape reads them."""

from __future__ import annotations

import sys

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcore import GroupUsage
from services.common.metrics import Metrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_pages_held_by_requests_are_told_apart_from_the_prefix_cache_and_free():
    metrics = Metrics("decode", "tiny")
    # 30 used: 12 cached and unlocked (evictable), 4 cached but locked by a request
    metrics.set_pages({"target": GroupUsage(used=30, total=100, cached=16, evictable=12)})
    samples = _samples(metrics)
    page = lambda state: samples[
        ("tandem_kv_pages", (("group", "target"), ("model_name", "tiny"), ("state", state)))
    ]  # noqa: E731
    assert (page("request"), page("cached"), page("free")) == (18, 12, 70)
    assert samples[("tandem_kv_cache_usage_ratio", (("group", "target"), ("model_name", "tiny")))] == 0.18


def test_a_chunk_counts_once_per_chunk_and_once_per_token_at_its_share_of_the_gap():
    metrics = Metrics("router")
    metrics.observe_chunk("router", 0.04, 4)  # one verify step's 4 tokens, 40 ms after the last
    samples = _samples(metrics)
    key = (("role", "router"),)
    assert samples[("tandem_inter_chunk_latency_seconds_count", key)] == 1
    assert samples[("tandem_inter_chunk_latency_seconds_sum", key)] == 0.04
    assert samples[("tandem_inter_token_latency_seconds_count", key)] == 4
    assert round(samples[("tandem_inter_token_latency_seconds_sum", key)], 9) == 0.04
    assert samples[("tandem_inter_token_latency_seconds_bucket", (("le", "0.01"), ("role", "router")))] == 4


def test_failure_counters_have_their_series_at_zero_from_the_start():
    worker = Metrics("prefill")
    worker.start_groups(["target", "draft"])
    samples = _samples(worker)
    for key in [
        ("tandem_requests_total", (("role", "prefill"), ("status", "error"))),
        ("tandem_timeouts_total", (("kind", "lease"),)),
        ("tandem_timeouts_total", (("kind", "transfer"),)),
        ("tandem_peer_registrations_total", (("result", "refused"),)),
        ("tandem_kv_transfer_failures_total", (("group", "target"),)),
        ("tandem_kv_transfer_failures_total", (("group", "draft"),)),
    ]:
        assert samples[key] == 0.0, key
    router = _samples(Metrics("router"))
    assert router[("tandem_requests_total", (("role", "router"), ("status", "unavailable")))] == 0.0


def test_the_process_series_are_exported_and_only_the_router_counts_ready_pairs():
    router, worker = Metrics("router"), Metrics("decode")
    names = {name for name, _ in _samples(router)}
    if sys.platform.startswith("linux"):  # prometheus_client reads /proc
        assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= names
    router.ready_pairs.set_function(lambda: 2)
    assert _samples(router)[("tandem_ready_pairs", ())] == 2.0
    assert worker.ready_pairs is None
    assert not any(name == "tandem_ready_pairs" for name, _ in _samples(worker))


def test_prefix_cache_counters_carry_the_role_so_roles_are_not_summed():
    m = Metrics("decode")
    m.prefix_queries.labels("decode", "target").inc(8)
    assert _samples(m)[("tandem_prefix_cache_queries_total", (("group", "target"), ("role", "decode")))] == 8
