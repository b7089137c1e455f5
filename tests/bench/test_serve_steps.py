"""bench.serve_steps against a real worker metrics page over HTTP: the steps of a point by
kind, and each thread's CPU per step."""

from __future__ import annotations

import pytest

from bench import serve_steps
from services.common.metrics import Metrics, serve_metrics
from services.common.thread_cpu import ThreadCPU


@pytest.fixture
def worker():
    metrics = Metrics("both", "tiny-target")
    port = serve_metrics(metrics, "127.0.0.1", 0)
    return metrics, {"both-0": f"http://127.0.0.1:{port}/metrics"}


def test_a_points_steps_by_kind_are_the_difference_of_two_scrapes(worker):
    metrics, urls = worker
    metrics.observe_step("decode", 0.004)
    before = serve_steps.scrape(urls)
    for seconds in (0.010, 0.020):
        metrics.observe_step("decode", seconds)
    metrics.observe_step("mixed", 0.050)
    means = serve_steps.step_means(before, serve_steps.scrape(urls))
    decode, mixed = {"steps": 2, "mean_ms": 15.0}, {"steps": 1, "mean_ms": 50.0}
    assert means == {"both-0": {"decode": decode, "mixed": mixed}}
    assert serve_steps.describe(means) == "both-0 decode 15.00 ms x2; both-0 mixed 50.00 ms x1"


def test_unreachable_workers_give_nothing():
    assert serve_steps.scrape({"gone": "http://127.0.0.1:1/metrics"}) == {"gone": {}}


@pytest.mark.skipif(not ThreadCPU.available(), reason="no per-thread CPU clock here")
def test_thread_cpu_per_step_divides_each_threads_cpu_by_the_steps_of_every_kind(worker):
    metrics, urls = worker
    metrics.thread_cpu.watch("event_loop")
    before = serve_steps.scrape(urls)
    sum(range(3_000_000))  # this thread's CPU
    for kind in ("decode", "decode", "prefill", "mixed"):
        metrics.observe_step(kind, 0.001)
    after = serve_steps.scrape(urls)
    cpu = serve_steps.thread_cpu_per_step(before, after)
    spent = after["both-0"]["cpu:event_loop"][0] - before["both-0"]["cpu:event_loop"][0]
    assert spent > 0
    assert cpu == {"both-0": {"event_loop": round(spent / 4 * 1000, 3)}}
    assert "cpu:event_loop" not in serve_steps.step_means(before, after)["both-0"]
    line = serve_steps.describe({}, cpu)
    assert line == f"both-0 CPU a step: event_loop {cpu['both-0']['event_loop']:.2f} ms"


@pytest.mark.skipif(not ThreadCPU.available(), reason="no per-thread CPU clock here")
def test_a_routers_event_loop_is_its_cpu_over_the_wall_time():
    metrics = Metrics("router", "tiny-target")
    urls = {"router": f"http://127.0.0.1:{serve_metrics(metrics, '127.0.0.1', 0)}/metrics"}
    metrics.thread_cpu.watch("event_loop")
    before = serve_steps.scrape(urls)
    sum(range(3_000_000))
    after = serve_steps.scrape(urls)
    spent = after["router"]["cpu:event_loop"][0] - before["router"]["cpu:event_loop"][0]
    share = serve_steps.loop_share(before, after, 2.0)
    assert spent > 0 and share == {"router": round(spent / 2.0, 3)}
    assert serve_steps.describe({}, None, {"router": 0.874}) == "router event loop 87% of a core"
