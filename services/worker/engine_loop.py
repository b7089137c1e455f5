"""EngineLoop: the engine's steps on a thread of their own, their outputs fanned out on
the event loop.

The engine thread steps back to back while the engine has work: it never waits for the
event loop, so gRPC streams, the relay and transfers run beside the step's GPU work, not
between two steps (the served-speed issue's overlap of the path around the engine).

Invariant: the engine and its cache manager are mutated only by the engine thread: its
steps, and between two steps the functions queued with ``call``. Page transfers read and
write pages of parked or reserved requests, which no step touches, so they run on the
event loop at any time. Outputs, call results and failures cross to the event loop with
``call_soon_threadsafe``, in the order the engine thread made them: a request's outputs
come after the result of the ``call`` that submitted it.

Token counts for the stats line (services/worker/stats_log.py): ``generated_tokens`` adds
every output's new tokens; ``prompt_tokens`` adds a request's prompt at its first output,
when ``count_prompts`` (a worker that runs prompts: not a decode worker, whose prompts
came prefilled).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from services.common.faults import delay

if TYPE_CHECKING:
    from services.worker.step_profile import StepProfiler

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
"""The GIL switch interval a worker process sets (``run_worker``; Python's default is 5 ms).
When the engine thread comes back from a GPU wait or a kernel launch (both release the GIL)
while the event loop runs Python, it asks for the GIL after this long, unless the loop
released and retook it meanwhile (a loop spinning turn by turn does, so transfers waiting
on the loop give the GIL up while a step runs: ``kvcore.transfer.pacing``)."""

IDLE_WAIT_S = 0.001
"""How long the engine thread sleeps after a step that ran nothing (every waiting request
is blocked, e.g. on pages), unless a call or a stop wakes it sooner."""

_Call = tuple[Callable[[], Any], asyncio.Future]


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        on_step: Callable[[str, float], None] | None = None,
        count_prompts: bool = True,
        profiler: StepProfiler | None = None,
    ) -> None:
        """``on_step(kind, seconds)``: told each step's forwards (``engine.last_step``) and
        wall time, on the event-loop thread. ``profiler``: runs each step in place of
        ``engine.step()`` on the engine thread, profiling a window of them
        (services/worker/step_profile.py); what it holds is written when the thread stops."""
        self.engine = engine
        self.on_step = on_step
        self.count_prompts = count_prompts
        self.profiler = profiler
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._started: set[str] = set()  # requests whose first output came and that run on
        self._streams: dict[str, Callable[[Any], None]] = {}  # takes a request's outputs, errors (loop only)
        self._calls: deque[_Call] = deque()  # appended by the event loop, taken by the engine thread
        self._wake = threading.Condition()  # guards _calls and _stopping
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.stepping = False  # the engine thread is inside a step: it wants the GIL back often
        self.on_fatal: Callable[[BaseException], None] = _exit_process

    def start(self) -> None:
        """Start the engine thread (from the event loop the outputs go to)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread, while started."""
        return self._thread

    async def stop(self) -> None:
        """Stop the engine thread after its current step; calls it never ran are cancelled."""
        if self._thread is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        while self._calls:
            self._calls.popleft()[1].cancel()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread between two steps; returns its result.
        RuntimeError once the loop has stopped (nothing would run it)."""
        future = asyncio.get_running_loop().create_future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine loop stopped")
            self._calls.append((lambda: fn(*args), future))
            self._wake.notify()
        return await future

    async def outputs(
        self, request_id: str, submit: Callable[[], Any], merge: Callable[[Any, Any], Any] | None = None
    ) -> AsyncIterator[Any]:
        """Submit a request (``submit`` runs between steps) and yield its outputs until the
        finished one. Cancelling the iteration aborts the request in the engine. With
        ``merge``, outputs that queued while the reader was away come as one,
        ``merge(earlier, later)``: a reader that falls behind the engine (a busy event loop)
        writes once for several steps instead of once a step; none waits for a merge."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue.put_nowait
        finished, pending = False, None
        try:
            await self.call(submit)
            while True:
                out = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(out, BaseException):
                    raise out
                while merge is not None and not out.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later  # raised once the outputs before it are out
                        break
                    out = merge(out, later)
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            await self._forget(request_id, finished)

    async def delivered(self, request_id: str, submit: Callable[[], Any], sink: Callable[[Any], None]) -> Any:
        """Submit a request and call ``sink(output)`` with each of its outputs as the step's
        outputs come (in the callback that delivers them, with no task woken per output);
        returns the finished output. An exception from ``sink`` or the step ends the request
        and is raised here; so does cancelling the wait. Either aborts it in the engine."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def take(out: Any) -> None:
            if done.done():
                return
            if isinstance(out, BaseException):
                done.set_exception(out)
                return
            try:
                sink(out)
            except Exception as e:
                done.set_exception(e)
                return
            if out.finished:
                done.set_result(out)

        self._streams[request_id] = take
        finished = False
        try:
            await self.call(submit)
            out = await done
            finished = True
            return out
        finally:
            await self._forget(request_id, finished)

    async def _forget(self, request_id: str, finished: bool) -> None:
        """A reader is done with a request: no more outputs go to it, and an unfinished
        request is aborted in the engine (shielded: a second cancel must not skip it)."""
        self._streams.pop(request_id, None)
        self._started.discard(request_id)
        if not finished:
            await asyncio.shield(self.call(self.engine.abort, request_id))

    async def fail_all(self, error: Exception) -> None:
        """End every request streaming now with ``error`` (raised from its ``outputs``) and
        abort it in the engine."""
        request_ids = self._raise_in_streams(list(self._streams), error)
        await self.call(self._abort, request_ids)

    # ------------------------------------------------------------ the engine thread

    def _main(self) -> None:
        """The thread's body. A step's or a call's exception fails only its requests; any
        other escapes nothing can serve past, so it ends the process (``on_fatal``), as a
        broken tensor-parallel step does: the router sees the worker gone and retries its
        requests elsewhere, instead of a worker that answers Health and serves nothing."""
        try:
            self._serve()
        except BaseException as e:
            log.critical("the engine thread failed; the worker exits", exc_info=True)
            self.on_fatal(e)

    def _serve(self) -> None:
        while True:
            calls = self._next_calls()
            if calls is None:
                if self.profiler is not None:  # stopped inside its window: keep what it profiled
                    self.profiler.finish()
                return
            self._run_calls(calls)
            if self.engine.has_unfinished():
                self._step()

    def _next_calls(self) -> list[_Call] | None:
        """The calls queued since the last step, once there is work; None when stopping."""
        with self._wake:
            while not (self._stopping or self._calls or self.engine.has_unfinished()):
                self._wake.wait()
            if self._stopping:
                return None
            calls = list(self._calls)
            self._calls.clear()
            return calls

    def _run_calls(self, calls: list[_Call]) -> None:
        for fn, future in calls:
            if future.cancelled():
                continue
            try:
                self._post(_settle, future, fn(), None)
            except Exception as e:
                self._post(_settle, future, None, e)

    def _step(self) -> None:
        start = time.perf_counter()
        self.stepping = True
        try:
            outputs = self.engine.step() if self.profiler is None else self.profiler.run(self.engine)
        except Exception as e:  # a broken step fails its requests, not the server
            request_ids = list(self._streams)  # one C-level copy: atomic under the GIL
            log.exception("engine step failed; failing its %d requests", len(request_ids))
            self._abort(request_ids)
            self._post(self._raise_in_streams, request_ids, RuntimeError(f"engine step failed: {e}"))
            return
        finally:
            self.stepping = False
        seconds = time.perf_counter() - start
        if self.profiler is not None:  # the step alone: not the profiler's start or its files
            seconds = self.profiler.step_seconds
        self._stall(delay("engine.step"))
        self._post(self._deliver, outputs, self.engine.last_step, seconds)
        if not outputs and not self.engine.last_step:  # nothing could run: do not spin
            with self._wake:  # until a call or a stop comes, at most IDLE_WAIT_S
                if not (self._stopping or self._calls):
                    self._wake.wait(IDLE_WAIT_S)

    def _stall(self, seconds: float) -> None:
        """The ``engine.step`` fault: the step takes ``seconds`` longer, whatever calls come
        meanwhile; only a stop ends it early."""
        deadline = time.monotonic() + seconds
        with self._wake:
            while not self._stopping and (left := deadline - time.monotonic()) > 0:
                self._wake.wait(left)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            try:
                self.engine.abort(rid)
            except KeyError:
                pass

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop, after what was posted before it."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed under a stopping worker
            pass

    # ------------------------------------------------------------ the event loop

    def _deliver(self, outputs: list[Any], kind: str, seconds: float) -> None:
        if self.on_step is not None:
            self.on_step(kind, seconds)
        for out in outputs:
            self._count(out)
            take = self._streams.get(out.request_id)
            if take is not None:
                take(out)

    def _raise_in_streams(self, request_ids: list[str], error: Exception) -> list[str]:
        for rid in request_ids:
            take = self._streams.get(rid)
            if take is not None:
                take(error)
        return request_ids

    def _count(self, out: Any) -> None:
        self.generated_tokens += len(out.new_token_ids)
        first = out.request_id not in self._started
        if out.finished:
            self._started.discard(out.request_id)
        else:
            self._started.add(out.request_id)
        if first and self.count_prompts:
            self.prompt_tokens += out.usage.prompt_tokens


def _exit_process(error: BaseException) -> None:
    logging.shutdown()
    os._exit(1)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():  # its caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
