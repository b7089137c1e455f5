"""ThreadCPU: a named thread's CPU seconds, read at scrape time, kept once it ends."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.thread_cpu import ThreadCPU

pytestmark = pytest.mark.skipif(not ThreadCPU.available(), reason="no per-thread CPU clock here")


def samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.labels["thread"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tandem_thread_cpu_seconds_total"
    }


def spin(started: threading.Event, done: threading.Event) -> None:
    """Use CPU (not sleep) until ``done``."""
    started.set()
    while not done.is_set():
        sum(range(20_000))


def test_a_busy_thread_counts_up_and_keeps_its_last_reading_once_ended():
    registry, cpu = CollectorRegistry(), ThreadCPU()
    registry.register(cpu)
    assert samples(registry) == {}  # nothing watched: no series
    started, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=spin, args=(started, done))
    worker.start()
    started.wait()
    cpu.watch("engine", worker)
    cpu.watch("event_loop")  # the calling thread
    first = samples(registry)
    threading.Event().wait(0.2)
    second = samples(registry)
    assert set(first) == {"engine", "event_loop"}
    assert second["engine"] > first["engine"] > 0
    done.set()
    worker.join()
    assert samples(registry)["engine"] >= second["engine"]  # ended: its last reading stays


def test_a_thread_not_started_is_refused_by_name():
    with pytest.raises(ValueError, match="thread 'engine': not started"):
        ThreadCPU().watch("engine", threading.Thread(target=lambda: None))
