"""The router's end of its workers' Steps streams (``tandem.v1.WorkerStreams``): one
stream per worker that streams tokens (decode and aggregated), carrying every request's
chunks of an engine step in one message, instead of one message per request per step.

A ``StepsLink`` keeps its worker's stream open for as long as the worker is connected,
opening a new one (a new ``stream_id``) RETRY_S after one ends. A flow ``attach``es its
attempt before sending its call; while the link is ready it gets a ``Mailbox`` and the
metadata that binds the call to the stream, and the link puts the attempt's chunks in
that mailbox as they come. When the stream ends, every attached mailbox gets
``LINK_DOWN`` and is detached: chunks still in flight on it are lost, and the flow's call
ends UNAVAILABLE on the worker's side (services/worker/step_streams.py).

A worker that does not serve the stream (UNIMPLEMENTED) is asked no more: its calls stream
their chunks themselves, as they do whenever the link is not ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable

import grpc

from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.steps_metadata import STEPS_METADATA

log = logging.getLogger(__name__)

RETRY_S = 0.5  # between a stream's end and the next one's opening
LINK_DOWN = object()  # put in an attached mailbox when its stream ended

CallMetadata = tuple[tuple[str, str], ...] | None
Attached = tuple["Mailbox | None", CallMetadata]
"""A call's mailbox and metadata; (None, None): the call streams its chunks itself."""


class Mailbox:
    """Items for one reader, in the order put; ``take`` returns all there are."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._wake = asyncio.Event()

    def put(self, item: object) -> None:
        self._items.append(item)
        self._wake.set()

    async def take(self) -> list:
        """Every item put since the last take, once there is one."""
        while not self._items:
            self._wake.clear()
            await self._wake.wait()
        items = list(self._items)
        self._items.clear()
        return items


class StepsLink:
    """One worker's Steps stream, opened again whenever it ends, until ``close``."""

    _ids = itertools.count(1)
    _salt = secrets.token_hex(3)

    def __init__(
        self, channel: grpc.aio.Channel, worker_id: str, count: Callable[[int], None] = lambda n: None
    ) -> None:
        """``count(n)``: told the chunks of each message (the router's metric)."""
        self.worker_id = worker_id
        self.count = count
        self.stub = wpb_grpc.WorkerStreamsStub(channel)
        self.stream_id = ""  # of the stream open now; "" while none is
        self.call: grpc.aio.UnaryStreamCall | None = None  # the stream's call, once opened
        self.ready = False  # the worker holds the stream: calls may name it
        self.mailboxes: dict[str, Mailbox] = {}
        self._task = asyncio.ensure_future(self._run())

    def attach(self, attempt: str) -> Attached:
        """A mailbox for ``attempt``'s chunks and its call's metadata, or (None, None)
        while the link is not ready (the call then streams its chunks itself)."""
        if not self.ready:
            return None, None
        box = self.mailboxes[attempt] = Mailbox()
        return box, ((STEPS_METADATA, self.stream_id),)

    def detach(self, attempt: str) -> None:
        self.mailboxes.pop(attempt, None)

    def close(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        """Open streams one after another. An end is logged once per stream that opened (a
        worker that is down is retried quietly: its health poll reports it)."""
        while True:
            self.stream_id = f"{self._salt}.{next(self._ids)}"
            try:
                why = await self._serve()
            finally:
                opened = self.ready
                self._down()
            if why is None:
                return
            if opened:
                log.info("the steps stream of worker %s ended (%s); opening another", self.worker_id, why)
            await asyncio.sleep(RETRY_S)

    async def _serve(self) -> str | None:
        """Read one stream to its end; returns why it ended, None: do not open another."""
        self.call = self.stub.Steps(wpb.StepsRequest(stream_id=self.stream_id))
        try:
            async for message in self.call:
                self.ready = True
                self.count(len(message.chunks))
                for item in message.chunks:
                    if (box := self.mailboxes.get(item.request_id)) is not None:
                        box.put(item.chunk)
            return "the worker closed it"
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # close(): the link itself ends
                raise
            return "its call was cancelled"
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("worker %s serves no steps stream: its calls carry their chunks", self.worker_id)
                return None
            return f"{e.code().name}: {e.details()}"

    def _down(self) -> None:
        self.ready, self.stream_id = False, ""
        boxes, self.mailboxes = self.mailboxes, {}
        for box in boxes.values():
            box.put(LINK_DOWN)
