"""Blocking-mode UCX progress that arms the worker again after every event.

ucxx's asyncio blocking mode (0.52) progresses the worker when the worker's epoll
descriptor fires, but arms the worker only once, when progress starts. After the first
message the descriptor stays readable, so the event loop runs the reader on every turn:
an idle process with a connected peer spends a whole core. :func:`install` makes the
reader start a new arm task whenever none is running; once the worker is armed again the
loop sleeps in epoll until the next event.
"""

from __future__ import annotations


def install() -> None:
    """Patch ucxx's BlockingMode reader (idempotent); call before ``ucxx.init``."""
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode  # noqa: PLC0415 (as buffers.py)

    if getattr(BlockingMode, "rearms_after_events", False):
        return

    def on_event(self) -> None:
        self.worker.progress()
        if self.event_loop.is_closed():
            return
        if self.arm_task is None or self.arm_task.done():
            self.arm_task = self.event_loop.create_task(self._arm_worker())

    BlockingMode._fd_reader_callback = on_event
    BlockingMode.rearms_after_events = True
