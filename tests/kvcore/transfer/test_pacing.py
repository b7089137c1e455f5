"""kvcore.transfer.pacing: while the GIL is wanted, waits give it up once per loop turn,
however many wait in that turn; while it is not, they do not sleep at all. And a UCX round
trip with the GIL wanted throughout lands bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvcore.transfer import pacing
from kvcore.transfer.tags import make_tag
from tests.kvcore.transfer.test_ucx_local import run, started


@pytest.fixture
def sleeps(monkeypatch):
    """Each ``time.sleep`` the pacing calls, with the loop turn it came in."""
    calls: list[tuple[int, float]] = []
    turn = [0]
    monkeypatch.setattr(pacing.time, "sleep", lambda s: calls.append((turn[0], s)))
    yield calls, turn
    pacing.yield_while(None)


async def waiters(n: int, turns: int, turn: list[int]) -> None:
    """``n`` tasks each waiting ``turns`` loop turns, and one counting the turns."""

    async def wait() -> None:
        for _ in range(turns):
            await pacing.next_turn()

    async def count() -> None:
        for _ in range(turns + 2):
            turn[0] += 1
            await asyncio.sleep(0)

    await asyncio.gather(count(), *(wait() for _ in range(n)))


def test_waits_yield_the_gil_once_a_turn_while_it_is_wanted(sleeps):
    calls, turn = sleeps
    pacing.yield_while(lambda: True)
    asyncio.run(waiters(5, 4, turn))
    assert [s for _, s in calls] == [pacing.YIELD_S] * 4
    assert len({t for t, _ in calls}) == 4  # one a turn, not one a waiter


def test_waits_do_not_sleep_while_nothing_wants_the_gil(sleeps):
    calls, turn = sleeps
    pacing.yield_while(lambda: False)
    asyncio.run(waiters(3, 4, turn))
    pacing.yield_while(None)
    asyncio.run(waiters(3, 4, turn))
    assert calls == []


def test_a_new_event_loop_yields_after_one_closed_mid_turn(sleeps):
    calls, turn = sleeps
    pacing.yield_while(lambda: True)

    async def one_wait() -> None:
        await pacing.next_turn()

    asyncio.run(one_wait())  # its loop closes with the turn's reset maybe still queued
    asyncio.run(one_wait())
    assert len(calls) == 2


def test_a_transfer_with_the_gil_wanted_lands_bit_for_bit():
    async def body():
        transport = await started()
        pacing.yield_while(lambda: True)
        try:
            sent = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
            got = torch.empty_like(sent)
            tag = make_tag("local-paced", 1, 3)
            await asyncio.gather(transport.send("self", sent, tag, 5), transport.recv(got, tag, 5))
        finally:
            pacing.yield_while(None)
            await transport.close()
        return torch.equal(sent, got)

    assert run(body())
