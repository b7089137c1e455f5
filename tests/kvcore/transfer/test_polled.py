"""kvcore.transfer.polled: one coroutine checks every waiter's flag once a loop turn and
completes the waiter's future the turn it comes true; a failing check fails its waiter
alone; a waiter that gives up is checked no more."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvcore.transfer.polled import Poller


class Flag:
    """A check that comes true on its ``after``-th call, counting its calls."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.after


def test_each_waiter_is_checked_once_a_turn_by_one_coroutine():
    poller, flags = Poller(), [Flag(after) for after in (1, 3, 5)]

    async def main() -> list[int]:
        tasks_before = len(asyncio.all_tasks())
        futures = [poller.until(f) for f in flags]
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == tasks_before + 1  # one checker for all three
        turns = []  # the slowest flag is checked once a turn: its calls count the turns
        for future in futures:
            future.add_done_callback(lambda _: turns.append(flags[-1].calls))
        await asyncio.gather(*futures)
        return turns

    assert asyncio.run(main()) == [1, 3, 5]  # each completed in the turn its flag came true
    assert [f.calls for f in flags] == [1, 3, 5]  # and never checked again
    assert len(poller) == 0


def test_a_failing_check_fails_its_waiter_alone():
    poller, flag = Poller(), Flag(2)

    def broken() -> bool:
        raise RuntimeError("request failed")

    async def main() -> None:
        failing, fine = poller.until(broken), poller.until(flag)
        with pytest.raises(RuntimeError, match="request failed"):
            await failing
        await fine

    asyncio.run(main())
    assert flag.calls == 2


def test_a_waiter_that_gives_up_is_checked_no_more():
    poller, never = Poller(), Flag(10**9)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(poller.until(never), 0.01)
        calls = never.calls
        for _ in range(5):
            await asyncio.sleep(0)
        assert never.calls == calls
        assert len(poller) == 0

    asyncio.run(main())


def test_a_new_event_loop_after_a_closed_one_is_served():
    poller = Poller()

    async def stranded() -> None:
        poller.until(Flag(10**9))  # left waiting when its loop closes

    asyncio.run(stranded())
    flag = Flag(2)

    async def main() -> None:
        await poller.until(flag)

    asyncio.run(main())
    assert flag.calls == 2


def test_two_event_loops_in_two_threads_are_polled_apart():
    poller, results = Poller(), {}

    def run(name: str, after: int) -> None:
        flag = Flag(after)

        async def main() -> None:
            await poller.until(flag)

        asyncio.run(main())
        results[name] = flag.calls

    threads = [threading.Thread(target=run, args=(n, a)) for n, a in (("a", 3), ("b", 40))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"a": 3, "b": 40}
