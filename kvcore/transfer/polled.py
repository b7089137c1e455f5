"""Waits that only polling can end (a UCX request's completion flag, a CUDA event), all of
one event loop's checked by one coroutine.

A transfer in flight must look at its flag every loop turn (docs/transfer.md, "Progress and
the event loop"). Done by each waiter, a loop with n transfers in flight resumed n
coroutines a turn, plus n more inside ucxx (its blocking mode waits on a request by
``await asyncio.sleep(0)`` until the flag is set), every turn, on the loop's thread and
under the GIL the engine thread wants.

:data:`POLLER` keeps one coroutine per event loop instead. Each turn it calls every
registered check (a flag read; a check may do work once a turn first, such as progressing
the UCX worker) and completes the future of each check that came true; then it waits for
the next turn (:func:`kvcore.transfer.pacing.next_turn`, which gives the GIL up while the
engine wants it). A waiter sleeps on its future; one that gives up (a timeout, a
cancellation) cancels it, and its check is dropped on the next turn.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from kvcore.transfer.pacing import next_turn

Check = Callable[[], bool]  # true once the awaited thing is done; may raise its failure


class Poller:
    """Completes futures when their checks come true, one coroutine per event loop."""

    def __init__(self) -> None:
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopChecks] = (
            weakref.WeakKeyDictionary()
        )

    def until(self, check: Check) -> asyncio.Future[None]:
        """A future completed on the first turn, from the next one on, where ``check()`` is
        true, or failed with what it raises."""
        loop = asyncio.get_running_loop()
        mine = self._loops.get(loop)
        if mine is None:
            mine = self._loops[loop] = _LoopChecks()
        future = loop.create_future()
        mine.checks.append((check, future))
        if mine.task is None or mine.task.done():
            mine.task = loop.create_task(mine.run())
        return future

    def __len__(self) -> int:
        """Checks waiting, every loop together."""
        return sum(len(mine.checks) for mine in self._loops.values())


class _LoopChecks:
    """One event loop's checks and the coroutine that runs them."""

    def __init__(self) -> None:
        self.checks: list[tuple[Check, asyncio.Future[None]]] = []
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        while self.checks:
            await next_turn()
            checks, self.checks = self.checks, []
            for check, future in checks:
                if future.done():
                    continue  # its waiter gave up
                try:
                    done = check()
                except Exception as e:  # the awaited thing failed: its waiter raises it
                    future.set_exception(e)
                    continue
                if done:
                    future.set_result(None)
                else:
                    self.checks.append((check, future))


POLLER = Poller()
"""The process's poller (one coroutine per event loop that uses it)."""
