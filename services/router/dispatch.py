"""One request through the cluster: a ``RequestFlow`` runs reserve() -> prefill() -> decode(),
or forward() to an aggregated worker when no prefill/decode pair serves.

1. ``run`` picks a READY pair (``Registry.choose_pair``), ``reserve``s the prompt's pages on
   its decode worker, has its prefill worker ``prefill`` the prompt (which answers with the
   first token, streamed to the client at once, then pushes the pages over UCX and ends
   when they landed), then streams the rest from ``decode``.
2. A failed Reserve or Prefill is classified (failures.py): Busy queues the request
   (backoff 20 ms doubling to 0.5 s) until pages free up, ``queue_timeout_s`` passes or it
   is aborted; Retry tries the next pair, at most MAX_ATTEMPTS workers excluded in all;
   Abort and Fail end it; a failed transfer degrades its pair (step_failures.py). A
   Prefill that fails after its first token went out is retried the same way, the retry
   told that token (``first_token_id``), so the text goes on from it; such a request is
   not forwarded to an aggregated worker. After decode tokens streamed, a decode worker
   found dead ends the request with ``RouterError(UNAVAILABLE)``; any other error is an
   error message.

Invariants:
- The messages are chunks, at most one error, then one complete (unless RouterError is
  raised). Chunk text comes from one StreamText across the first token and the decode
  worker's chunks; its held-back tail is sent just before the complete.
- ``reserved_on`` names the decode worker holding a reservation that no completed Decode
  owns, set before Reserve is sent (a cancel may land after it reserved); ``finish``
  releases it.
- ``call`` is the RPC in flight (Reserve, Prefill, Decode or Generate) and ``workers`` the
  workers it depends on: ``abort`` and ``lose`` cancel it. Reserve and Prefill have the
  deadlines of ``Cluster.deadlines``, a Decode stream its idle deadline.
- Workers know an attempt, not the request: every attempt (a pair tried, or an aggregated
  worker) sends its own id, ``<request id>#<serial>.<n>`` (``serial`` unique to the flow in
  this router process, and to the process), so a retry that lands on a worker still
  holding an earlier attempt (a transfer stalled, a prefill parked) never meets its state,
  nor do two clients' requests under one id, nor a restarted router's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.metrics import Metrics
from services.router import messages as msg
from services.router.cluster import Cluster
from services.router.failures import Abort, Busy, Fail, Retry
from services.router.messages import Usage
from services.router.registry import Worker
from services.router.step_failures import (
    decode_failure,
    ending_of,
    forward_failure,
    may_heal,
    prefill_failure,
    reserve_failure,
)
from services.router.step_links import Mailbox
from services.router.stream_text import StreamText
from services.router.streams import StreamStalled, idle_bounded, steps_relayed

MAX_ATTEMPTS = 3  # workers excluded after failing before a request gives up
QUEUE_TIMEOUT_S = 120.0  # how long a request waits for free pages
QUEUE_BACKOFF_S, QUEUE_BACKOFF_MAX_S = 0.02, 0.5
NO_PAIR = "no ready prefill/decode pair"

Messages = AsyncIterator[cpb.GenerateResponse]


def _decode_chunk(chunk: cpb.Chunk) -> wpb.DecodeResponse:
    return wpb.DecodeResponse(chunk=chunk)


@dataclass(eq=False)
class RequestFlow:
    """One request's state from admission to its complete message."""

    rid: str
    token_ids: list[int]  # the prompt's
    request: cpb.GenerateRequest
    text: StreamText | None  # None: chunks carry no text
    cluster: Cluster
    metrics: Metrics
    queue_timeout_s: float = QUEUE_TIMEOUT_S
    start: float = field(default_factory=time.monotonic)
    usage: Usage = field(default_factory=Usage)
    first: wpb.PrefillResponse | None = None  # the prefill's answer: first token, usage
    call: grpc.aio.Call | None = None
    workers: tuple[str, ...] = ()  # the workers ``call`` depends on
    lost: str = ""  # a worker of ``workers`` found dead; its call was cancelled
    aborted: bool = False
    scheduled: bool = False  # a Reserve succeeded: its wait is in tandem_request_queue_seconds
    reserved_on: str = ""
    prefilled_by: str = ""  # the prefill worker whose transfer fed the decode worker
    attempts: int = 0  # attempts begun: Reserves sent, or forwards to an aggregated worker
    serial: str = "0"  # unique to this flow in this router process (Cluster.next_serial)
    first_token_at: float = 0.0  # monotonic: when its first token came; 0 = none yet
    decoded_by: str = ""  # the decode worker of the pair that served it
    served_by: str = ""  # the aggregated worker that served it
    cut: str = ""  # why the router cut it short (a shutdown): it ends with this error

    @property
    def attempt(self) -> str:
        """The id the workers know the current attempt by."""
        return f"{self.rid}#{self.serial}.{self.attempts}"

    # ------------------------------------------------------------------ control

    def abort(self) -> None:
        """The client gave up: cancel the call in flight; the flow ends with ABORT."""
        self.aborted = True
        if self.call is not None:
            self.call.cancel()

    def cut_short(self, cause: str) -> None:
        """The router cannot wait for it (it is shutting down): abort it; it ends with an
        error naming ``cause`` rather than as a client's abort (api.py)."""
        self.cut = cause
        self.abort()

    @property
    def placed_on(self) -> str:
        """Where it ran, for its log line: ``prefill -> decode``, the aggregated worker, or ""."""
        if self.served_by:
            return self.served_by
        if self.decoded_by:
            return f"{self.prefilled_by or '?'} -> {self.decoded_by}"
        return ""

    def lose(self, worker_id: str) -> None:
        """``worker_id`` failed its health poll: cancel the call if it depends on it."""
        if worker_id in self.workers and self.call is not None:
            self.lost = worker_id
            self.call.cancel()

    def finish(self) -> None:
        """The flow ended: release, in the background, a reservation no Decode completed."""
        if self.reserved_on and self.reserved_on in self.cluster.channels:
            self.cluster.spawn(self.cluster.release(self.reserved_on, self.attempt))

    # ------------------------------------------------------------------ the steps

    async def run(self) -> Messages:
        """The request's messages: chunks, maybe an error, then the complete."""
        async for message in self._attempts():
            if message.WhichOneof("payload") == "complete" and self.text is not None:
                if rest := self.text.flush():  # held-back text that began no stop string
                    yield msg.chunk(self.rid, [], rest)
            yield message

    async def _attempts(self) -> Messages:
        excluded: set[str] = set()
        backoff = QUEUE_BACKOFF_S
        while len(excluded) < MAX_ATTEMPTS:
            pair = self.cluster.registry.choose_pair(self.token_ids, excluded)
            if pair is None and not may_heal(self.cluster, self.start, excluded):
                break
            try:
                if pair is None:  # only a degraded pair may serve it: wait for it as for pages
                    raise Busy("")
                prefill, decode = pair
                async for message in self.prefill(prefill, decode, await self.reserve(decode)):
                    yield message
            except Busy:  # no free pages yet: queue, as an engine queues its admissions
                if ending := self._queue_ending():
                    for message in ending:
                        yield message
                    return
                backoff = await self._wait_queued(backoff)
                continue
            except Retry as e:
                excluded.add(e.worker_id)
                continue
            except (Abort, Fail) as e:
                for message in ending_of(self.rid, e, self._usage_so_far()):
                    yield message
                return
            async for message in self.decode(decode):
                yield message
            return
        async for message in self._without_pair(excluded):
            yield message

    async def reserve(self, decode: Worker) -> wpb.Reservation:
        """Reserve pages for the prompt (plus headroom) on ``decode``, within the call
        deadline; ``lose`` and ``abort`` cancel it (reserve_failure says what follows)."""
        self.reserved_on = decode.id  # before the call: a cancel may land after it reserved
        self.attempts += 1
        stub, self.workers, self.lost = self.cluster.decode_stub(decode.id), (decode.id,), ""
        try:
            self.call = stub.Reserve(
                msg.reserve_request(self.attempt, self.token_ids), timeout=self.cluster.deadlines.call_s
            )
            reserved = await self.call
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            raise reserve_failure(self, e, decode.id) from None
        finally:
            self.call, self.workers = None, ()
        if reserved.reservation.groups:  # until the next poll says better
            decode.busy_pages += len(reserved.reservation.groups[0].page_ids)
        self._mark_scheduled()
        return reserved.reservation

    async def prefill(self, prefill: Worker, decode: Worker, reservation: wpb.Reservation) -> Messages:
        """Prefill the prompt on ``prefill`` into ``decode``'s reservation: the first token's
        chunk as soon as the prefill worker sends it (not again on a retry, which is given
        that token), then the wait for the pages to land; sets ``first``. On failure the
        reservation is released before the failure is classified (in the background when
        ``decode`` was lost)."""
        prefill.inflight += 1
        decode.inflight += 1
        self.workers, self.lost = (prefill.id, decode.id), ""
        lease = self.cluster.spawn(
            self.cluster.keep_reserved(decode.id, self.attempt, reservation.lease_deadline_unix_ms)
        )
        forced = self.first.first_token_id if self.first is not None else None
        try:
            self.call = self.cluster.prefill_stub(prefill.id).Prefill(
                msg.prefill_request(self.attempt, self.token_ids, self.request, reservation, forced),
                timeout=self.cluster.deadlines.prefill_for(len(self.token_ids)),
            )
            received = 0
            async for message in self.call:  # the first token, then the usage once the pages landed
                received += 1
                self.usage.prefill = message.usage
                if received == 1 and self.first is None:
                    self.first = message
                    yield self._first_chunk()
            if received != 2:
                raise Fail(f"prefill worker {prefill.id} sent {received} Prefill messages, not 2")
            self.prefilled_by = prefill.id
            if self.usage.prefill.transfers:
                self.cluster.registry.transfer_ok(prefill.id, decode.id)
            self.cluster.registry.index.record(prefill.id, self.token_ids)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            release = self.cluster.release(decode.id, self.attempt)
            if self.lost == decode.id:  # a stalled worker's Release would hold up the retry
                self.cluster.spawn(release)
            else:
                await release
            self.reserved_on = ""
            raise prefill_failure(self, e, prefill.id, decode.id) from None
        finally:  # a client gone at the first chunk leaves the call running: cancel it
            if self.call is not None and not self.call.done():
                self.call.cancel()
            lease.cancel()
            self.call, self.workers = None, ()
            prefill.inflight -= 1
            decode.inflight -= 1

    async def decode(self, decode: Worker) -> Messages:
        """``decode``'s stream of the tokens after the first (which went out with the
        prefill), unless the first ended the request or the client aborted meanwhile: then
        the reservation is released and no Decode sent."""
        self.decoded_by = decode.id
        if self.aborted or self.first.finish_reason != cpb.FINISH_REASON_UNSPECIFIED:
            await self.cluster.release(decode.id, self.attempt)
            self.reserved_on = ""
            reason = cpb.FINISH_REASON_ABORT if self.aborted else self.first.finish_reason
            yield msg.complete(self.rid, reason, self.usage.merged())
            return
        decode.inflight += 1
        box, metadata = self.cluster.attach_steps(decode.id, self.attempt)
        call = self.cluster.decode_stub(decode.id).Decode(
            msg.decode_request(self.attempt, self.token_ids, self.request, self.first.first_token_id),
            metadata=metadata,
        )
        # reserved_on stays set until the stream completes: a Decode call cancelled before the
        # worker saw it would otherwise orphan the reservation until its lease ran out
        self.call, self.workers = call, (decode.id,)
        try:
            async for message in self._relay(self._messages(call, box, decode.id, _decode_chunk), decode):
                yield message
        except (grpc.aio.AioRpcError, asyncio.CancelledError, StreamStalled) as e:
            for message in decode_failure(self, e, decode.id):
                yield message
        finally:
            self.cluster.detach_steps(decode.id, self.attempt)
            self.call, self.workers = None, ()
            decode.inflight -= 1
            if not call.done():
                call.cancel()

    async def forward(self, worker: Worker) -> Messages:
        """Aggregated serving: the worker runs the whole request behind its own client API."""
        self._mark_scheduled()  # the worker's engine queues it from here
        self.attempts += 1
        self.served_by = worker.id
        box, metadata = self.cluster.attach_steps(worker.id, self.attempt)
        call = self.cluster.tandem_stub(worker.id).Generate(
            msg.forward_request(self.attempt, self.token_ids, self.request), metadata=metadata
        )
        self.call, self.workers, self.lost = call, (worker.id,), ""
        worker.inflight += 1
        attempt = self.attempt
        as_message = lambda chunk: cpb.GenerateResponse(request_id=attempt, chunk=chunk)  # noqa: E731
        try:
            async for message in self._forwarded(self._messages(call, box, worker.id, as_message)):
                yield message
            self.cluster.registry.index.record(worker.id, self.token_ids)
        except (grpc.aio.AioRpcError, asyncio.CancelledError, StreamStalled) as e:
            for message in forward_failure(self, e, worker.id):
                yield message
        finally:
            self.cluster.detach_steps(worker.id, attempt)
            self.call, self.workers = None, ()
            worker.inflight -= 1

    # ------------------------------------------------------------------ helpers

    async def _without_pair(self, excluded: set[str]) -> Messages:
        """No pair left: an aggregated worker serves it, or the request fails naming why. Not
        once the client has a first token: an aggregated worker would sample its own."""
        registry = self.cluster.registry
        worker = None if self.first is not None else registry.choose_aggregated(self.token_ids, excluded)
        if worker is not None:
            async for message in self.forward(worker):
                yield message
            return
        why = NO_PAIR + (f" (tried {sorted(excluded)})" if excluded else "")
        for message in msg.failed(self.rid, why, self._usage_so_far()):
            yield message

    def _mark_scheduled(self) -> None:
        """Observe the router's queue time once: from admission to its first placement."""
        if not self.scheduled:
            self.scheduled = True
            self.metrics.queue.labels("router").observe(time.monotonic() - self.start)

    def _queue_ending(self) -> list[cpb.GenerateResponse]:
        """How a queued request ends now (aborted, or waited too long); [] = keep waiting."""
        if self.aborted:
            return msg.aborted(self.rid, self._usage_so_far())
        if time.monotonic() - self.start > self.queue_timeout_s:
            why = f"no free KV pages within {self.queue_timeout_s} s"
            return msg.failed(self.rid, why, self._usage_so_far())
        return []

    def _usage_so_far(self) -> cpb.Usage | None:
        """The usage of a request that ends before Decode: its first token's, once sent."""
        return self.usage.merged() if self.first is not None else None

    async def _wait_queued(self, backoff: float) -> float:
        """Wait ``backoff`` seconds, counted as waiting; returns the next backoff."""
        waiting = self.metrics.waiting.labels("router")
        waiting.inc()
        try:
            await asyncio.sleep(backoff)
        finally:
            waiting.dec()
        return min(2 * backoff, QUEUE_BACKOFF_MAX_S)

    def _messages(self, call, box: Mailbox | None, worker_id: str, as_message) -> AsyncIterator:
        """A worker's stream under its idle deadline, its chunks from the worker's Steps
        stream when ``box`` is attached to it (``as_message``: a chunk as the call's message)."""
        idle_s = self.cluster.deadlines.stream_idle_s
        if box is None:
            return idle_bounded(call, idle_s)
        return steps_relayed(call, box, idle_s, as_message, worker_id)

    async def _relay(self, messages: AsyncIterator, decode: Worker) -> Messages:
        """Decode's messages as this request's; at its complete, what decode now caches."""
        last = time.monotonic()
        tokens = [*self.token_ids, self.first.first_token_id]  # what decode's cache will hold
        async for message in messages:
            kind = message.WhichOneof("payload")
            if kind == "chunk":
                ids = list(message.chunk.token_ids)
                tokens += ids
                now = time.monotonic()
                self.metrics.observe_chunk("router", now - last, len(ids))
                last = now
                yield msg.chunk(self.rid, ids, self._text(ids), message.chunk.logprobs)
            elif kind == "error":
                yield cpb.GenerateResponse(request_id=self.rid, error=message.error)
            else:
                self.usage.decode = message.complete.usage
                self.reserved_on = ""
                self.cluster.registry.index.record(decode.id, tokens)
                yield msg.complete(self.rid, message.complete.finish_reason, self.usage.merged())
                return

    async def _forwarded(self, messages: AsyncIterator) -> Messages:
        """An aggregated worker's messages, their chunks given text."""
        first, last = True, time.monotonic()
        async for message in messages:
            if message.WhichOneof("payload") == "chunk":
                now = time.monotonic()
                if first:
                    self.first_token_at = now
                    self.metrics.ttft.labels("router").observe(now - self.start)
                    first = False
                elif n := len(message.chunk.token_ids):
                    self.metrics.observe_chunk("router", now - last, n)
                last = now
                message.chunk.text = self._text(message.chunk.token_ids)
            yield message

    def _first_chunk(self) -> cpb.GenerateResponse:
        """The prefill's first token as this request's first chunk (its TTFT observed)."""
        self.first_token_at = time.monotonic()
        self.metrics.ttft.labels("router").observe(self.first_token_at - self.start)
        first = self.first
        logprobs = [first.first_token_logprobs] if first.HasField("first_token_logprobs") else []
        ids = [first.first_token_id]
        return msg.chunk(self.rid, ids, self._text(ids), logprobs)

    def _text(self, token_ids) -> str:
        return self.text.push(list(token_ids)) if self.text is not None else ""
