"""RankLinks over a pipe, for tests: rank 0's jobs reach rank 1 as they are (pickled between
processes, by reference in one: :mod:`tests.kvcore.transfer.conns`).

The services carry jobs over their JSON control channel; here a pipe carries the same
dataclasses, so the tests run the real agent, fan-out and per-rank code without the
services. Messages, rank 0 -> rank 1: ``("job", id, key, op, job)``,
``("cancel", id)``, ``("stop",)``; rank 1 -> rank 0: ``("done", id, ok, value)``, and
``("done", None, True, None)`` last, answering the stop: rank 0's reader thread has a
receive pending, and a process waits for its threads before it exits. ``key`` picks one of
several RankTransfers the rank-1 process serves (one per scenario).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from kvcore.transfer import LinkTest, RankTransfer, RecvJob, SendJob, TransferError, TransferUsage


class PipeClient:
    """Rank 0's end of the pipe: calls by id, answered by a reader thread's messages."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def call(self, key: Any, op: str, job: Any) -> Any:
        n = next(self._ids)
        future = self._waiting[n] = asyncio.get_running_loop().create_future()
        self.conn.send(("job", n, key, op, job))
        try:
            ok, value = await future
        except asyncio.CancelledError:
            self.conn.send(("cancel", n))
            raise
        finally:
            self._waiting.pop(n, None)
        if not ok:
            raise TransferError(f"rank 1: {op}: {value}")
        return value

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._waiting)

    def stop(self) -> None:
        self.conn.send(("stop",))
        self._reader.cancel()

    async def _read(self) -> None:
        while True:
            _, n, ok, value = await self.conn.recv()
            future = self._waiting.get(n)
            if future is not None and not future.done():
                future.set_result((ok, value))


class PipeLinks:
    """The RankLinks of a TP 2 worker whose rank 1 serves ``key`` at the pipe's far end."""

    size = 2

    def __init__(self, client: PipeClient, key: Any) -> None:
        self.client, self.key = client, key

    async def send(self, rank: int, job: SendJob) -> TransferUsage:
        return await self.client.call(self.key, "send", job)

    async def recv(self, rank: int, job: RecvJob) -> TransferUsage:
        return await self.client.call(self.key, "recv", job)

    async def test(self, rank: int, job: LinkTest) -> None:
        await self.client.call(self.key, "test", job)

    async def disconnect(self, rank: int, peer_id: str) -> None:
        await self.client.call(self.key, "disconnect", peer_id)


async def serve_pipe(conn, ranks: dict[Any, RankTransfer]) -> dict[str, int]:
    """Rank 1: run rank 0's jobs until it says stop; how many jobs ran to each outcome
    (counted once every job cancelled before the stop has ended)."""
    running: dict[int, asyncio.Task] = {}
    cancelled: list[asyncio.Task] = []
    outcomes = {"ok": 0, "failed": 0, "cancelled": 0}

    async def run(n: int, key: Any, op: str, job: Any) -> None:
        try:
            reply = (True, await getattr(ranks[key], op)(job))
            outcomes["ok"] += 1
        except asyncio.CancelledError:
            reply = (False, "cancelled")
            outcomes["cancelled"] += 1
        except Exception as e:  # the answer names it; rank 0 raises it as a TransferError
            reply = (False, f"{type(e).__name__}: {e}")
            outcomes["failed"] += 1
        running.pop(n, None)
        conn.send(("done", n, *reply))

    while (message := await conn.recv())[0] != "stop":
        if message[0] == "cancel":
            task = running.get(message[1])
            if task is not None:
                task.cancel()
                cancelled.append(task)
            continue
        _, n, key, op, job = message
        running[n] = asyncio.ensure_future(run(n, key, op, job))
    await asyncio.gather(*cancelled, return_exceptions=True)
    conn.send(("done", None, True, None))  # ends rank 0's pending receive (else its exit waits)
    return outcomes
