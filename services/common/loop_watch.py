"""Watching a process's event loop: a turn that ran long means a call that should have
yielded did not (a UCX call, a step run on the loop), and every gRPC answer waited on it.

``watch_loop`` sleeps ``tick_s`` at a time and measures how late it woke: the lag, in
seconds, goes to ``observe`` every tick (the ``tandem_event_loop_lag_seconds`` histogram);
a lag of ``blocked_s`` or more is logged once, at WARNING, when the loop runs again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

TICK_S = 0.25
BLOCKED_S = 1.0
log = logging.getLogger(__name__)


async def watch_loop(
    observe: Callable[[float], None], tick_s: float = TICK_S, blocked_s: float = BLOCKED_S
) -> None:
    """Forever (until cancelled): observe each tick's lag; log a blocked loop."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(tick_s)
        lag = max(loop.time() - start - tick_s, 0.0)
        observe(lag)
        if lag >= blocked_s:
            log.warning("event loop blocked for %.2f s: every call this process serves waited", lag)
