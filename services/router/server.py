"""The router: the client API (tandem.v1.Tandem) and the workers' registry (Registration).

A request flows: choose a READY (prefill, decode) pair -> Reserve pages on the decode
worker -> Prefill (which pushes the pages over UCX and returns the first token) ->
Decode (streams the rest). A request that has emitted nothing is retried on another
pair when a worker is unavailable; afterwards a failure ends it with an error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import NOT_SERVING, READY_SERVICE, SERVING, write_stream
from services.common.metrics import Metrics
from services.common.security import TlsConfig, aio_channel
from services.router.pairing import pair_workers
from services.router.registry import PairState, Registry
from services.router.stream_text import StreamText
from services.router.validation import RequestError, validate_generate
from tokenization.tokenizer import Tokenizer

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_ATTEMPTS = 3  # workers excluded after failing before a request gives up
QUEUE_TIMEOUT_S = 120.0  # how long a request waits for free pages
QUEUE_BACKOFF_S, QUEUE_BACKOFF_MAX_S = 0.02, 0.5
STATS_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 2.0
STATS_MISSES = 2  # Stats polls a worker may miss (time out) before it counts as unhealthy


@dataclass(slots=True)
class ModelLimits:
    model_id: str = ""  # the served model name (--served-model-name; default the folder's)
    vocab_size: int = 264
    max_model_len: int = 2048  # tokens, prompt plus completion
    default_max_tokens: int = 128
    num_spec_tokens: int = 0


@dataclass(slots=True)
class _Inflight:
    start: float = field(default_factory=time.monotonic)
    call: grpc.aio.Call | None = None
    aborted: bool = False
    workers: tuple[str, ...] = ()  # the workers the current call depends on
    lost: str = ""  # a worker of ``workers`` found dead; its call was cancelled
    reserved_on: str = ""  # decode worker holding a reservation no Decode call owns yet


@dataclass(slots=True)
class _Usage:
    prefill: cpb.Usage = field(default_factory=cpb.Usage)
    decode: cpb.Usage = field(default_factory=cpb.Usage)

    def merged(self) -> cpb.Usage:
        out = cpb.Usage()
        out.CopyFrom(self.decode)
        for name in ("prompt_tokens", "cached_tokens"):
            setattr(out, name, getattr(self.prefill, name))
        out.cached_tokens_per_group.extend(self.prefill.cached_tokens_per_group)
        out.transfers.extend(self.prefill.transfers)
        out.completion_tokens = self.decode.completion_tokens + 1  # + the prefill's first token
        return out


class Router(cpb_grpc.TandemServicer, reg_grpc.RegistrationServicer):
    def __init__(
        self,
        limits: ModelLimits,
        metrics: Metrics,
        tokens_per_page: int = 16,
        token: str = "",
        tls: TlsConfig | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``tokenizer``: the model's, for text prompts and streamed text; None = token-id
        prompts only, and chunks carry no text."""
        self.limits = limits
        self.metrics = metrics
        self.token = token
        self.tls = tls
        self.queue_timeout_s = QUEUE_TIMEOUT_S
        self.stats_timeout_s = STATS_TIMEOUT_S  # each Stats poll's deadline
        self.stats_misses = STATS_MISSES  # timed-out polls in a row before a worker is unhealthy
        self.health = None  # grpc.health.v1 servicer, for the readiness service
        self.registry = Registry(tokens_per_page)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.inflight: dict[str, _Inflight] = {}
        self.tokenizer = tokenizer
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ registration

    async def Register(self, request: reg.RegisterRequest, context) -> reg.RegisterResponse:
        info = request.rank_info
        if self.token and request.token != self.token:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "token: does not match")
        if not info.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank_info.instance_id: empty")
        if info.role == rpb.ROLE_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank_info.role: unspecified")
        if not info.grpc_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank_info.grpc_address: empty")
        old = self.channels.pop(info.instance_id, None)
        if old is not None:
            await old.close()
        self.channels[info.instance_id] = aio_channel(info.grpc_address, self.tls, self.token)
        for prefill_id, decode_id in self.registry.add(info):
            self._spawn(self._pair(prefill_id, decode_id))
        self.metrics.registrations.labels("accepted").inc()
        return reg.RegisterResponse(accepted=True)

    async def _pair(self, prefill_id: str, decode_id: str) -> None:
        workers = self.registry.workers
        if prefill_id not in workers or decode_id not in workers:
            return
        state, reason = await pair_workers(
            self.channels, workers[prefill_id].info, workers[decode_id].info, self.token
        )
        self.registry.set_pair(prefill_id, decode_id, state, reason)
        result = "accepted" if state == PairState.READY else "refused"
        self.metrics.registrations.labels(result).inc()

    async def Deregister(self, request, context) -> reg.DeregisterResponse:
        removed = self.registry.remove(request.instance_id)
        channel = self.channels.pop(request.instance_id, None)
        if channel is not None:
            await channel.close()
        return reg.DeregisterResponse(removed=removed)

    async def ListPeers(self, request, context) -> reg.ListPeersResponse:
        return reg.ListPeersResponse(
            peers=[
                w.info
                for w in self.registry.workers.values()
                if request.role in (rpb.ROLE_UNSPECIFIED, w.role)
            ]
        )

    async def Heartbeat(self, request, context) -> reg.HeartbeatResponse:
        known = request.instance_id in self.registry.workers
        return reg.HeartbeatResponse(registered=known, interval_ms=1000)

    def pair_states(self) -> dict[tuple[str, str], tuple[str, str]]:
        return {k: (p.state.value, p.reason) for k, p in self.registry.pairs.items()}

    # ------------------------------------------------------------------ client API

    async def Health(self, request, context) -> cpb.HealthResponse:
        serving = self.registry.is_serving()
        prefill = len(self.registry.ids(rpb.ROLE_PREFILL)) + len(self.registry.ids(rpb.ROLE_BOTH))
        decode = len(self.registry.ids(rpb.ROLE_DECODE)) + len(self.registry.ids(rpb.ROLE_BOTH))
        refused = [
            f"{p}->{d}: {pair.reason}"
            for (p, d), pair in self.registry.pairs.items()
            if pair.state in (PairState.REFUSED, PairState.FAILED)
        ]
        return cpb.HealthResponse(
            status=cpb.SERVING_STATUS_SERVING if serving else cpb.SERVING_STATUS_NOT_SERVING,
            num_prefill_workers=prefill,
            num_decode_workers=decode,
            num_ready_pairs=len(self.registry.ready_pairs()),
            message=("" if serving else "no ready prefill/decode pair. ") + "; ".join(refused),
        )

    async def ModelInfo(self, request, context) -> cpb.ModelInfoResponse:
        lim = self.limits
        workers = [w.info for w in self.registry.workers.values()]
        first = workers[0] if workers else rpb.RankInfo()
        return cpb.ModelInfoResponse(
            model_id=lim.model_id or first.model_id,
            drafter_id=first.drafter_id,
            drafter_kind=first.drafter_kind,
            num_spec_tokens=lim.num_spec_tokens,
            max_model_len=lim.max_model_len,
            vocab_size=lim.vocab_size,
            default_max_tokens=lim.default_max_tokens,
            workers=workers,
        )

    async def Abort(self, request, context) -> cpb.AbortResponse:
        handle = self.inflight.get(request.request_id)
        if handle is None:
            return cpb.AbortResponse(found=False)
        handle.aborted = True
        if handle.call is not None:
            handle.call.cancel()
        return cpb.AbortResponse(found=True)

    async def Generate(self, request: cpb.GenerateRequest, context) -> None:
        """gRPC streaming handler. Messages are written, not yielded, so a client's cancel
        lands inside this coroutine and the request's cleanup runs at once."""
        await write_stream(self.stream(request, context), context)

    async def stream(self, request: cpb.GenerateRequest, context):
        """The Generate messages of one request (also used in-process by the HTTP API)."""
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is running")
        try:
            token_ids = validate_generate(request, self.limits, self.tokenizer)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        handle = self.inflight[rid] = _Inflight()
        start = time.monotonic()
        self.metrics.running.labels("router").inc()
        status = "error"
        detok = (
            StreamText(self.tokenizer, list(request.sampling.stop), request.sampling.min_tokens)
            if self.tokenizer is not None
            else None
        )
        try:
            async for response in self._generate(rid, token_ids, request, handle, detok):
                kind = response.WhichOneof("payload")  # chunk text comes trimmed (StreamText)
                if kind == "complete" and detok is not None and (rest := detok.flush()):
                    yield _chunk(rid, [], rest)  # held-back text that began no stop string
                yield response
                if kind == "complete":
                    status = cpb.FinishReason.Name(response.complete.finish_reason).split("_")[-1]
        except _Unavailable as e:
            status = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            channel = self.channels.get(handle.reserved_on)
            if handle.reserved_on and channel is not None:  # ended before Decode completed
                self._spawn(self._release(wpb_grpc.DecodeWorkerStub(channel), rid))
            self.inflight.pop(rid, None)
            self.metrics.running.labels("router").dec()
            self.metrics.requests.labels("router", status.lower()).inc()
            self.metrics.e2e.labels("router").observe(time.monotonic() - start)

    async def _generate(
        self,
        rid: str,
        token_ids: list[int],
        request: cpb.GenerateRequest,
        handle: _Inflight,
        detok: StreamText | None,
    ):
        """The request's messages; chunk text comes from ``detok`` (one per request, across
        the prefill's first token and the decode worker's chunks)."""
        excluded: set[str] = set()
        backoff = QUEUE_BACKOFF_S
        while len(excluded) < MAX_ATTEMPTS:
            pair = self.registry.choose_pair(token_ids, excluded)
            if pair is None:
                break
            prefill, decode = pair
            try:
                first = await self._prefill_on(rid, token_ids, request, handle, prefill, decode)
            except _Busy:  # no free pages yet: queue, as an engine queues its admissions
                if handle.aborted:
                    yield _complete(rid, cpb.FINISH_REASON_ABORT, cpb.Usage())
                    return
                if time.monotonic() - handle.start > self.queue_timeout_s:
                    yield _error(rid, f"no free KV pages within {self.queue_timeout_s} s")
                    yield _complete(rid, cpb.FINISH_REASON_ERROR, cpb.Usage())
                    return
                await self._wait_queued(backoff)
                backoff = min(2 * backoff, QUEUE_BACKOFF_MAX_S)
                continue
            except _Retry as e:
                excluded.add(e.worker_id)
                continue
            except _Abort:
                yield _complete(rid, cpb.FINISH_REASON_ABORT, cpb.Usage())
                return
            except _Fail as e:
                yield _error(rid, e.message)
                yield _complete(rid, cpb.FINISH_REASON_ERROR, cpb.Usage())
                return
            async for response in self._stream(rid, token_ids, request, handle, first, decode, detok):
                yield response
            return
        worker = self.registry.choose_aggregated(token_ids, excluded)
        if worker is not None:
            async for response in self._forward(rid, token_ids, request, handle, worker, detok):
                yield response
            return
        message = "no ready prefill/decode pair" + (f" (tried {sorted(excluded)})" if excluded else "")
        yield _error(rid, message)
        yield _complete(rid, cpb.FINISH_REASON_ERROR, cpb.Usage())

    async def _forward(self, rid, token_ids, request, handle, worker, detok):
        """Aggregated serving: the worker runs the whole request behind its own client API."""
        forwarded = cpb.GenerateRequest(
            request_id=rid,
            token_ids=cpb.TokenIds(ids=token_ids),
            sampling=request.sampling,
            speculative=request.speculative,
        )
        call = cpb_grpc.TandemStub(self.channels[worker.id]).Generate(forwarded)
        handle.call = call
        worker.inflight += 1
        first = True
        try:
            async for message in call:
                if message.WhichOneof("payload") == "chunk":
                    if first:
                        self.metrics.ttft.labels("router").observe(time.monotonic() - handle.start)
                        first = False
                    message.chunk.text = _text(detok, message.chunk.token_ids)
                yield message
            self.registry.index.record(worker.id, token_ids)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if handle.aborted:
                yield _complete(rid, cpb.FINISH_REASON_ABORT, cpb.Usage())
                return
            if isinstance(e, asyncio.CancelledError):
                raise
            yield _error(rid, f"worker {worker.id}: {e.code().name}: {e.details()}")
            yield _complete(rid, cpb.FINISH_REASON_ERROR, cpb.Usage())
        finally:
            handle.call = None
            worker.inflight -= 1

    async def _prefill_on(self, rid, token_ids, request, handle, prefill, decode):
        """Reserve on ``decode``, prefill on ``prefill``; returns (response, usage)."""
        decode_stub = wpb_grpc.DecodeWorkerStub(self.channels[decode.id])
        prefill_stub = wpb_grpc.PrefillWorkerStub(self.channels[prefill.id])
        handle.reserved_on = decode.id  # before the call: a cancel may land after it reserved
        try:
            reserved = await decode_stub.Reserve(
                wpb.ReserveRequest(request_id=rid, prompt_len=len(token_ids), prompt_token_ids=token_ids)
            )
        except grpc.aio.AioRpcError as e:
            handle.reserved_on = ""
            raise _classify(e, decode.id) from None
        if reserved.reservation.groups:  # until the next poll says better
            decode.busy_pages += len(reserved.reservation.groups[0].page_ids)
        prefill.inflight += 1
        decode.inflight += 1
        handle.workers, handle.lost = (prefill.id, decode.id), ""
        try:
            call = prefill_stub.Prefill(
                wpb.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=token_ids,
                    sampling=request.sampling,
                    speculative=request.speculative,
                    reservation=reserved.reservation,
                )
            )
            handle.call = call
            response = await call
            self.registry.index.record(prefill.id, token_ids)
            return response
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            await self._release(decode_stub, rid)
            handle.reserved_on = ""
            if handle.aborted:
                raise _Abort() from None
            if handle.lost:
                raise _Retry(handle.lost) from None
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _classify(e, prefill.id) from None
        finally:
            handle.call, handle.workers = None, ()
            prefill.inflight -= 1
            decode.inflight -= 1

    async def _stream(self, rid, token_ids, request, handle, first, decode, detok):
        usage = _Usage(prefill=first.usage)
        yield _chunk(
            rid,
            [first.first_token_id],
            _text(detok, [first.first_token_id]),
            [first.first_token_logprobs] if first.HasField("first_token_logprobs") else [],
        )
        self.metrics.ttft.labels("router").observe(time.monotonic() - handle.start)
        decode_stub = wpb_grpc.DecodeWorkerStub(self.channels[decode.id])
        if first.finish_reason != cpb.FINISH_REASON_UNSPECIFIED:
            await self._release(decode_stub, rid)
            handle.reserved_on = ""
            yield _complete(rid, first.finish_reason, usage.merged())
            return
        decode.inflight += 1
        call = decode_stub.Decode(
            wpb.DecodeRequest(
                request_id=rid,
                prompt_token_ids=token_ids,
                first_token_id=first.first_token_id,
                sampling=request.sampling,
                speculative=request.speculative,
            )
        )
        # reserved_on stays set until the stream completes: a Decode call cancelled before the
        # worker saw it would otherwise orphan the reservation until its lease ran out
        handle.call, handle.workers = call, (decode.id,)
        last = time.monotonic()
        tokens = [*token_ids, first.first_token_id]  # what the decode worker's cache will hold
        try:
            async for message in call:
                kind = message.WhichOneof("payload")
                if kind == "chunk":
                    tokens += message.chunk.token_ids
                    now = time.monotonic()
                    self.metrics.itl.labels("router").observe(now - last)
                    last = now
                    ids = list(message.chunk.token_ids)
                    yield _chunk(rid, ids, _text(detok, ids), message.chunk.logprobs)
                elif kind == "error":
                    yield cpb.GenerateResponse(request_id=rid, error=message.error)
                else:
                    usage.decode = message.complete.usage
                    handle.reserved_on = ""
                    self.registry.index.record(decode.id, tokens)
                    yield _complete(rid, message.complete.finish_reason, usage.merged())
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if handle.aborted:
                yield _complete(rid, cpb.FINISH_REASON_ABORT, usage.merged())
                return
            if handle.lost or (
                isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
            ):
                raise _Unavailable(f"decode worker {decode.id} is unavailable") from None
            if isinstance(e, asyncio.CancelledError):
                raise
            yield _error(rid, f"decode worker {decode.id}: {e.code().name}: {e.details()}")
            yield _complete(rid, cpb.FINISH_REASON_ERROR, usage.merged())
        finally:
            handle.call, handle.workers = None, ()
            decode.inflight -= 1
            if not call.done():
                call.cancel()

    @staticmethod
    async def _release(stub, rid: str) -> None:
        try:
            await stub.Release(wpb.ReleaseRequest(request_id=rid), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the worker is gone or the lease already expired: nothing is held

    # ------------------------------------------------------------------ background

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def poll_stats(self) -> None:
        """Refresh every worker's free pages and health, forever."""
        while True:
            for worker in list(self.registry.workers.values()):
                channel = self.channels.get(worker.id)
                if channel is None:
                    continue
                stub = (
                    wpb_grpc.DecodeWorkerStub
                    if worker.role == rpb.ROLE_DECODE
                    else wpb_grpc.PrefillWorkerStub
                )(channel)
                try:
                    stats = await stub.Stats(wpb.StatsRequest(), timeout=self.stats_timeout_s)
                    target = stats.groups[0] if stats.groups else None
                    if target is not None:
                        busy = target.num_pages_used - target.num_pages_cached
                        worker.free_pages = target.num_pages_total - busy
                        worker.busy_pages = busy
                    worker.healthy = True
                    worker.missed = 0
                except (grpc.aio.AioRpcError, AttributeError) as e:
                    # a refused connection is a dead process; a slow answer may be a busy one
                    worker.missed += 1
                    gone = isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
                    if worker.healthy and (gone or worker.missed >= self.stats_misses):
                        self._lose(worker.id)
                        worker.healthy = False
            if self.health is not None:
                await self.health.set(READY_SERVICE, SERVING if self.registry.is_serving() else NOT_SERVING)
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _wait_queued(self, seconds: float) -> None:
        waiting = self.metrics.waiting.labels("router")
        waiting.inc()
        try:
            await asyncio.sleep(seconds)
        finally:
            waiting.dec()

    def _lose(self, worker_id: str) -> None:
        """A worker failed its health poll: cancel every call that depends on it; requests
        that emitted nothing are retried elsewhere, the others fail UNAVAILABLE."""
        for handle in self.inflight.values():
            if worker_id in handle.workers and handle.call is not None:
                handle.lost = worker_id
                handle.call.cancel()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for channel in self.channels.values():
            await channel.close()


class _Retry(Exception):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class _Abort(Exception):
    pass


class _Busy(Exception):
    """The decode worker has no free pages for the request now."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class _Unavailable(Exception):
    """A worker died under a request that already streamed tokens."""


class _Fail(Exception):
    def __init__(self, message: str) -> None:
        self.message = message


def _classify(error: grpc.aio.AioRpcError, worker_id: str) -> Exception:
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _Busy(worker_id)
    if error.code() in RETRYABLE:
        return _Retry(worker_id)
    return _Fail(f"worker {worker_id}: {error.code().name}: {error.details()}")


def _text(detok: StreamText | None, token_ids) -> str:
    return detok.push(list(token_ids)) if detok is not None else ""


def _chunk(rid: str, token_ids: list[int], text: str, logprobs=()) -> cpb.GenerateResponse:
    """``logprobs``: TokenLogprobs aligned with token_ids, or empty."""
    return cpb.GenerateResponse(
        request_id=rid, chunk=cpb.Chunk(token_ids=token_ids, text=text, logprobs=logprobs)
    )


def _complete(rid: str, reason: int, usage: cpb.Usage) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(request_id=rid, complete=cpb.Complete(finish_reason=reason, usage=usage))


def _error(rid: str, message: str, field_name: str = "") -> cpb.GenerateResponse:
    return cpb.GenerateResponse(request_id=rid, error=cpb.Error(message=message, field=field_name))
