"""Running a function every few seconds on the event loop (the stats lines)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


async def every(interval_s: float, tick: Callable[[], None]) -> None:
    """Call ``tick()`` every ``interval_s`` seconds, forever (cancel to stop); 0 = never.
    A tick that raises is logged once per distinct error and the next one runs."""
    if interval_s <= 0:
        return
    last_error = ""
    while True:
        await asyncio.sleep(interval_s)
        try:
            tick()
        except Exception as e:  # a broken stats line must not stop the process
            if repr(e) != last_error:
                log.exception("periodic %s failed", getattr(tick, "__qualname__", tick))
            last_error = repr(e)
