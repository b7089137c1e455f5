"""Packs and unpacks that run beside the event loop, so a page transfer overlaps them
with its messages (:mod:`kvcore.transfer.pages`).

:class:`Stager` starts a copy (a ``pack_pages`` gather or an ``unpack_pages`` scatter)
and returns an asyncio future of its result:

- CUDA pool: the copy is launched on a side stream that first waits for the current one
  (so it sees every write the caller queued before it); the future completes when the
  stream's event has fired, polled once per loop turn (``polled.POLLER``). The result
  tensor is held until then, so its memory cannot be reused while the GPU still reads or
  writes it.
- CPU pool: the copy runs in the loop's default thread pool (torch releases the GIL), so
  the loop keeps driving the transport meanwhile.

A started copy cannot be cancelled: a caller that gives up on a transfer awaits it with
:func:`settle` before the pages it touches may be reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import torch

from kvcore.transfer.polled import POLLER

T = TypeVar("T")

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per CUDA device


class Stager:
    """Starts copies on ``device``'s side stream (CUDA) or a worker thread (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self._stream = _side_stream(device) if device.type == "cuda" else None
        self.device = self._stream.device if self._stream is not None else device

    def start(self, copy: Callable[[], T]) -> asyncio.Future[T]:
        """Begin ``copy()`` now; the future holds its result once the copy is done."""
        loop = asyncio.get_running_loop()
        if self._stream is None:
            return loop.run_in_executor(None, copy)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            result = copy()
            done = torch.cuda.Event()
            done.record(self._stream)
        return asyncio.ensure_future(_when_fired(done, result))


def ready(value: T) -> asyncio.Future[T]:
    """A future already holding ``value`` (a buffer that needs no copy)."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def settle(future: asyncio.Future | None) -> None:
    """Wait for a started copy to finish, ignoring its outcome (the caller is failing
    already); None is nothing to wait for."""
    if future is not None:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: never reported as unhandled


async def _when_fired(done: torch.cuda.Event, result: T) -> T:
    if not done.query():
        await POLLER.until(done.query)
    return result


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's side stream of ``device`` (a bare "cuda" is the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
