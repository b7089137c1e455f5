"""Reading a worker's stream under an idle deadline, its chunks on the call itself or on
the worker's Steps stream.

Invariants: ``idle_bounded`` yields the stream's messages until its end (raising its error
status as iterating the call would); a message that does not come within ``idle_s`` of the
previous one, or of the start, cancels the call and raises ``StreamStalled``.
``steps_relayed`` yields the same messages in the same order for a call bound to a Steps
stream (services/router/step_links.py): every chunk before the call's error and complete,
the chunks' tokens adding up to the complete's ``completion_tokens``, or ``StepsLost``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from services.router.step_links import LINK_DOWN, Mailbox


class StreamStalled(Exception):
    """A worker's stream sent nothing for ``idle_s`` seconds; its call was cancelled."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"nothing for {idle_s:g} s")
        self.idle_s = idle_s


async def idle_bounded(call: grpc.aio.UnaryStreamCall, idle_s: float) -> AsyncIterator:
    """``call``'s messages, each within ``idle_s`` seconds of the one before. The deadline
    is an ``asyncio.timeout`` around each read (a timer on this task), not ``wait_for``
    (a task per read): about 7 against 14 us a message on the CPU, paid per chunk."""
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await call.read()
        except TimeoutError:
            call.cancel()
            raise StreamStalled(idle_s) from None
        if message is grpc.aio.EOF:
            return
        yield message


class StepsLost(StreamStalled):
    """The Steps stream a request's chunks came on ended before all of them came."""

    def __init__(self, worker_id: str) -> None:
        Exception.__init__(self, f"no more chunks: its steps stream of worker {worker_id} ended")
        self.idle_s = 0.0


@dataclass(slots=True)
class _Called:
    """A message of the call itself (None: its end), or the error that ended it."""

    message: object = None
    error: BaseException | None = None


async def steps_relayed(
    call: grpc.aio.UnaryStreamCall,
    box: Mailbox,
    idle_s: float,
    as_message: Callable[[cpb.Chunk], object],
    worker_id: str,
) -> AsyncIterator:
    """``call``'s messages with its chunks from a Steps stream (``box``, attached to the
    call's attempt: services/router/step_links.py) in their place, as ``idle_bounded``
    gives a call's own: chunks in order, then its ``error`` and ``complete``.

    The call's ``complete`` may overtake its last chunks (two streams): it is held until
    the chunks relayed add up to its ``usage.completion_tokens``. Chunks that queued while
    the reader was away come as one (never the first: it tells the first token's time).
    Raises the call's error as iterating it would; ``StreamStalled`` (the call cancelled)
    after ``idle_s`` with nothing from either stream; ``StepsLost`` when the Steps stream
    ended with chunks of a completed call still missing."""
    reader = asyncio.ensure_future(_read_into(call, box))
    relayed, held, expected, ended, link_down = 0, [], -1, False, False
    try:
        while True:
            if (0 <= expected <= relayed) or (ended and expected < 0):
                for message in held:
                    yield message
                return
            if ended and link_down:
                raise StepsLost(worker_id)
            try:
                async with asyncio.timeout(idle_s):
                    items = await box.take()
            except TimeoutError:
                call.cancel()
                raise StreamStalled(idle_s) from None
            for item in _merged_chunks(items, first=relayed == 0):
                if item is LINK_DOWN:
                    link_down = True
                elif isinstance(item, cpb.Chunk):
                    relayed += len(item.token_ids)
                    yield as_message(item)
                elif item.error is not None:
                    raise item.error
                elif item.message is None:
                    ended = True
                elif (kind := item.message.WhichOneof("payload")) == "chunk":  # the call was not bound
                    relayed += len(item.message.chunk.token_ids)
                    yield item.message
                else:
                    held.append(item.message)
                    if kind == "complete":
                        expected = item.message.complete.usage.completion_tokens
    finally:
        reader.cancel()


async def _read_into(call: grpc.aio.UnaryStreamCall, box: Mailbox) -> None:
    """Put ``call``'s messages, its end and its error in ``box``, as ``_Called``."""
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            box.put(_Called(message))
        box.put(_Called(None))
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
        box.put(_Called(error=e))


def _merged_chunks(items: list, first: bool) -> list:
    """``items`` with each run of consecutive Steps chunks joined into one, except a
    stream's first chunk (``first``: none was relayed yet), which stays alone."""
    out: list = []
    joinable = False  # out[-1] is a chunk the next chunk may join
    for item in items:
        if not isinstance(item, cpb.Chunk):
            out.append(item)
            joinable = False
        elif joinable:
            joined = cpb.Chunk()
            joined.MergeFrom(out[-1])
            joined.MergeFrom(item)  # repeated fields append: token ids and logprobs in order
            out[-1] = joined
        else:
            out.append(item)
            joinable, first = not first, False
    return out
