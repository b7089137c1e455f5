"""The pipes the sides of a transfer session talk over: ``send(obj)`` and ``await recv()``.

A :class:`ProcessConn` wraps one end of a multiprocessing pipe (the sides are processes,
over UCX); a :func:`local_pipe` joins two coroutines of one event loop (the sides share it,
over the fake transport). The sessions (sessions.py, pair_session.py) and the rank links
(rank_pipe.py) run unchanged over either.
"""

from __future__ import annotations

import asyncio
from typing import Any


class ProcessConn:
    """One end of a multiprocessing pipe; ``timeout_s`` bounds each receive (None: none)."""

    def __init__(self, conn: Any, timeout_s: float | None = None) -> None:
        self.conn, self.timeout_s = conn, timeout_s

    def send(self, message: Any) -> None:
        self.conn.send(message)

    async def recv(self) -> Any:
        return await asyncio.to_thread(self._recv)

    def _recv(self) -> Any:
        if self.timeout_s is not None and not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the other process did not answer within {self.timeout_s} s")
        return self.conn.recv()


class LocalConn:
    """One end of an in-process pipe: messages go by reference, in order."""

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, message: Any) -> None:
        self.outbox.put_nowait(message)

    async def recv(self) -> Any:
        return await self.inbox.get()


def local_pipe() -> tuple[LocalConn, LocalConn]:
    one, other = asyncio.Queue(), asyncio.Queue()
    return LocalConn(one, other), LocalConn(other, one)
