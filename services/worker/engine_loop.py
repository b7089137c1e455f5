"""EngineLoop: runs an engine's steps off the event loop and fans out their outputs.

Invariant: the engine and its cache manager are mutated only by the engine thread
while a step runs, and only by the event-loop thread between steps (``call``). Page
transfers read and write pages of parked or reserved requests, which no step touches,
so they run on the event loop at any time.

Token counts for the stats line (services/worker/stats_log.py): ``generated_tokens`` adds
every output's new tokens; ``prompt_tokens`` adds a request's prompt at its first output,
when ``count_prompts`` (a worker that runs prompts: not a decode worker, whose prompts
came prefilled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common.faults import delay

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self, engine: Any, on_step: Callable[[str, float], None] | None = None, count_prompts: bool = True
    ) -> None:
        """``on_step(kind, seconds)``: told each step's forwards (``engine.last_step``) and
        wall time, on the event-loop thread."""
        self.engine = engine
        self.on_step = on_step
        self.count_prompts = count_prompts
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._started: set[str] = set()  # requests whose first output came and that run on
        self._calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the event-loop thread between two steps; returns its result."""
        future = asyncio.get_running_loop().create_future()
        self._calls.append((lambda: fn(*args), future))
        self._wake.set()
        return await future

    async def outputs(self, request_id: str, submit: Callable[[], Any]) -> AsyncIterator[Any]:
        """Submit a request (``submit`` runs between steps) and yield its outputs until the
        finished one. Cancelling the iteration aborts the request in the engine."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self.call(submit)
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            self._started.discard(request_id)
            if not finished:
                await asyncio.shield(self.call(self.engine.abort, request_id))

    async def _run(self) -> None:
        while True:
            self._run_calls()
            if self.engine.has_unfinished():
                try:
                    start = time.perf_counter()
                    outputs = await asyncio.to_thread(self.engine.step)
                    if self.on_step is not None:
                        self.on_step(self.engine.last_step, time.perf_counter() - start)
                    if delay("engine.step"):
                        await asyncio.sleep(delay("engine.step"))
                except Exception as e:  # a broken step fails its requests, not the server
                    log.exception("engine step failed; failing its %d requests", len(self._streams))
                    self._fail_all(e)
                    continue
                for out in outputs:
                    self._count(out)
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            elif not self._calls:
                self._wake.clear()
                await self._wake.wait()

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.cancelled():
                continue
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _count(self, out: Any) -> None:
        self.generated_tokens += len(out.new_token_ids)
        first = out.request_id not in self._started
        if out.finished:
            self._started.discard(out.request_id)
        else:
            self._started.add(out.request_id)
        if first and self.count_prompts:
            self.prompt_tokens += out.usage.prompt_tokens

    def _fail_all(self, error: Exception) -> None:
        self.fail_all(RuntimeError(f"engine step failed: {error}"))

    def fail_all(self, error: Exception) -> None:
        """End every request streaming now with ``error`` (raised from its ``outputs``) and
        abort it in the engine. Between steps only (through ``call``, or after a failed step)."""
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(error)
            try:
                self.engine.abort(rid)
            except KeyError:
                pass
