"""A blocked event loop is measured and logged once, with how long it was blocked."""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.loop_watch import watch_loop


def test_a_blocked_loop_is_observed_and_logged(caplog):
    lags: list[float] = []

    async def scenario() -> None:
        watch = asyncio.ensure_future(watch_loop(lags.append, tick_s=0.05, blocked_s=0.5))
        await asyncio.sleep(0.2)  # a few free turns
        time.sleep(0.8)  # a call that does not yield
        await asyncio.sleep(0.2)
        watch.cancel()

    with caplog.at_level(logging.WARNING, logger="services.common.loop_watch"):
        asyncio.run(scenario())
    assert max(lags) >= 0.7  # the tick that waited on the blocking call
    blocked = [r.getMessage() for r in caplog.records]
    assert len(blocked) == 1 and blocked[0].startswith("event loop blocked for 0.")
