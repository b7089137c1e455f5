"""A worker's Steps streams: each router's chunks of one engine step in one message.

Without them a worker writes one gRPC message per request per step, and each write costs
the event loop tens of microseconds that the engine thread waits for (the GIL). A router
opens one ``WorkerStreams.Steps`` stream per worker and names it in its calls' metadata
(``STEPS_METADATA``); those calls ``put`` their chunks in the stream's ``Outbox``, whose
writer sends everything put since its last write as one ``StepChunks``.

Invariants:
- One write per event-loop turn at most (more only past MESSAGE_BYTES): the engine thread
  delivers a step's outputs in one callback, which puts every bound request's chunk, and
  the writer (woken by the first put) runs after it. A writer still busy with the last
  write takes everything put meanwhile in its next one.
- A request's chunks leave in the order it put them. A closed outbox (its stream ended,
  or another stream took its id) refuses puts with ``StepsClosed``: a request bound to it
  ends UNAVAILABLE, since its remaining chunks have no way to the router.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.steps_metadata import STEPS_METADATA

log = logging.getLogger(__name__)

MESSAGE_BYTES = 1 << 20
"""A StepChunks message holds chunks up to about this size (one larger chunk goes alone):
a router's default limit on a received message is 4 MiB, and a stream that fell behind
(a busy router) may have many steps of many requests, with logprobs, to send at once."""


class StepsClosed(RuntimeError):
    """The Steps stream a request's chunks go to has ended."""


class Outbox:
    """One Steps stream's chunks not yet written, in the order they were put."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.closed = ""  # why it closed; "" while open
        self._chunks: list[wpb.RequestChunk] = []
        self._wake = asyncio.Event()

    def put(self, request_id: str, chunk: cpb.Chunk) -> None:
        """Queue ``chunk`` of ``request_id`` for the next write; StepsClosed once closed."""
        if self.closed:
            raise StepsClosed(f"the router's steps stream {self.stream_id!r} {self.closed}")
        self._chunks.append(wpb.RequestChunk(request_id=request_id, chunk=chunk))
        self._wake.set()

    async def take(self) -> list[wpb.RequestChunk]:
        """Everything put since the last take, once there is something."""
        await self._wake.wait()
        self._wake.clear()
        chunks, self._chunks = self._chunks, []
        return chunks

    def close(self, why: str) -> None:
        self.closed = why
        self._wake.set()


class StepStreams(wpb_grpc.WorkerStreamsServicer):
    """The Steps streams a worker holds, by stream id."""

    def __init__(self) -> None:
        self.outboxes: dict[str, Outbox] = {}

    def bound(self, context: grpc.aio.ServicerContext) -> Outbox | None:
        """The outbox a call's chunks go to: the one its metadata names, if held; None: the
        call streams its chunks itself."""
        for key, value in context.invocation_metadata() or ():
            if key == STEPS_METADATA:
                return self.outboxes.get(value)
        return None

    async def Steps(self, request: wpb.StepsRequest, context) -> None:
        if not request.stream_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream_id: empty")
        outbox = Outbox(request.stream_id)
        if (older := self.outboxes.get(outbox.stream_id)) is not None:
            older.close("was replaced by a new stream of that id")
        self.outboxes[outbox.stream_id] = outbox
        try:
            await context.write(wpb.StepChunks())
            while not outbox.closed:
                for batch in batches(await outbox.take()):
                    await context.write(wpb.StepChunks(chunks=batch))
        finally:
            if not outbox.closed:
                outbox.close("ended")
            if self.outboxes.get(outbox.stream_id) is outbox:
                del self.outboxes[outbox.stream_id]
            log.info("steps stream %r %s", outbox.stream_id, outbox.closed)


def batches(chunks: list[wpb.RequestChunk], limit: int = MESSAGE_BYTES) -> list[list[wpb.RequestChunk]]:
    """``chunks`` in order, cut into runs of at most ``limit`` serialized bytes (a chunk
    larger than that alone); [] for none."""
    out: list[list[wpb.RequestChunk]] = []
    size = limit
    for chunk in chunks:
        n = chunk.ByteSize()
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append(chunk)
        size += n
    return out
