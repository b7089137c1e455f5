"""CPU seconds of a process's named threads, read when Prometheus scrapes.

A worker runs its engine on one thread and its event loop (gRPC streams, the relay's
messages, Reserve, transfers) on another, and both need the GIL for their Python: the loop's
CPU time is time the engine thread may wait. ``tandem_thread_cpu_seconds_total{thread}``
says how much each used, so that its rate per engine step shows the loop's share of a step.

Invariants:
- A thread's series is its whole CPU time (user and system) from the thread's start, read
  from the kernel's per-thread clock at scrape time: nothing runs on the hot path.
- A thread that has ended keeps its last reading (a counter never goes back).
- Where the platform has no per-thread CPU clock (``time.pthread_getcpuclockid``: Linux and
  most Unixes), no series is exported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

NAME = "tandem_thread_cpu_seconds"
HELP = (
    "CPU seconds (user + system) of the process's named threads: event_loop (gRPC, relay, "
    "transfers) and, on a worker, engine (the engine steps); both need the GIL"
)


class ThreadCPU(Collector):
    """The CPU clocks of the threads :meth:`watch` was told about, by name."""

    def __init__(self) -> None:
        self._threads: dict[str, threading.Thread] = {}
        self._last: dict[str, float] = {}  # name -> the last reading, kept once the thread ends

    @staticmethod
    def available() -> bool:
        return hasattr(time, "pthread_getcpuclockid")

    def watch(self, name: str, thread: threading.Thread | None = None) -> None:
        """Export ``thread``'s CPU seconds as ``thread=name`` (None: the calling thread)."""
        thread = thread or threading.current_thread()
        if thread.ident is None:
            raise ValueError(f"thread {name!r}: not started")
        self._threads[name] = thread

    def collect(self) -> Iterator[CounterMetricFamily]:
        if not self.available() or not self._threads:
            return
        family = CounterMetricFamily(NAME, HELP, labels=["thread"])
        for name, thread in self._threads.items():
            seconds = _cpu_seconds(thread)
            if seconds is not None:
                self._last[name] = max(seconds, self._last.get(name, 0.0))
            if name in self._last:
                family.add_metric([name], self._last[name])
        yield family


def _cpu_seconds(thread: threading.Thread) -> float | None:
    """The thread's CPU seconds; None once it has ended (its clock is asked for only while
    it runs: a finished thread's id may be reused or freed)."""
    if not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:  # it ended between the two calls
        return None
