"""What the metrics say about pages and streamed tokens, as a scrape reads them."""

from __future__ import annotations

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
