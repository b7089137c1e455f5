"""How a transfer in flight waits for the event loop's next turn: at once while no other
thread of the process needs the GIL, or after giving the GIL up for ``YIELD_S`` while one
does.

A send or receive in flight progresses its transport, or polls a copy's CUDA event, every
loop turn (docs/transfer.md, "Progress and the event loop"). Each turn the loop releases the
GIL in its selector and takes it straight back. A thread that gives the GIL up often (the
engine thread: every Triton launch and every GPU wait) then loses the race for it on nearly
every turn. CPython's switch interval does not help: the waiting thread asks the holder
to drop the GIL only when no switch happened within the interval, and the spinning loop
switches on every turn. Measured on the CPU (``python -m bench.gil_contention``,
docs/performance.md, 2026-12-06): a thread of small matmuls ran 4.1-4.3x slower beside a
loop spinning ``asyncio.sleep(0)``, and 1.2-1.27x slower beside a paced one, which still
turned about 9 times a millisecond. On an H100 the 1P+1D tiny pair served 1.20x the tokens.

So a process registers what says its GIL is wanted (:func:`yield_while`: the worker's
engine thread is inside a step); while it says so, :func:`next_turn` blocks the loop's
thread in ``time.sleep(YIELD_S)`` (which releases the GIL) once per loop turn, however
many transfers wait in that turn. While it does not, transfers spin as before: an idle
worker's transfer (a prompt at C=1) keeps its latency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

YIELD_S = 2e-5
"""Seconds the loop's thread sleeps, GIL released, once per loop turn in which a transfer
waits while the GIL is wanted."""


class OncePerTurn:
    """Says yes to the first asker of each event-loop turn, no to the rest of that turn: for
    work that one waiter does for all (a yield of the GIL, a progress of the UCX worker)."""

    def __init__(self) -> None:
        self._in: asyncio.AbstractEventLoop | None = None  # the loop whose current turn asked

    def first(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._in is loop:
            return False
        self._in = loop
        loop.call_soon(self._new_turn)  # queued before the asking waiter's own resumption
        return True

    def _new_turn(self) -> None:
        self._in = None


_wanted: Callable[[], bool] | None = None
_yield_turn = OncePerTurn()


def yield_while(wanted: Callable[[], bool] | None) -> None:
    """Register the process's test of whether another thread wants the GIL now (None: no
    thread does). Called on the loop's thread; the test is called there every turn a
    transfer waits, so it must be cheap and must not block."""
    global _wanted
    _wanted = wanted


async def next_turn() -> None:
    """Wait for the event loop's next turn, first giving the GIL up for ``YIELD_S`` if it
    is wanted and no other waiter gave it up in this turn."""
    if _wanted is not None and _wanted() and _yield_turn.first():
        time.sleep(YIELD_S)
    await asyncio.sleep(0)
