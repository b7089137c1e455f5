"""The decode worker: reserves pages, receives them over its transport (UCX), and decodes.

Reserve -> pages for prompt + headroom in every group, and a receive posted for them,
under a lease; with the prompt's tokens, the pages its prefix cache holds are reused and
named held in the reservation, and the sender skips them. Renew -> the lease again from
now (the router renews it while its Prefill runs: a long prompt keeps its pages, a dead
router's are freed). Decode -> waits for the pages and aux state to land, then streams
tokens; Release -> gives back a reservation that will not be decoded. A reservation whose
Decode does not come within its lease is freed; a Decode that comes later is told so.
The receive waits for the transfer's first message for as long as the reservation lives
(its lease, renewed); from that message on every message has ``transfer_timeout_s``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

import grpc

from kvcore import Reservation
from kvcore.transfer import AuxState, TransferError, TransferTimeout
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.faults import once
from services.common.grpc_server import write_stream
from services.common.transfer_failure import describe_landing
from services.engine.checks import RequestExists
from services.worker.outputs import OutputStream
from services.worker.request_rpc import request_rpc
from services.worker.step_streams import StepsClosed, StepStreams
from services.worker.transfer_proto import endpoint_to_proto
from services.worker.worker import WorkerBase, sampling_from_proto, spec_tokens_from_proto

log = logging.getLogger(__name__)


EXPIRED_KEPT = 4096  # ids of expired reservations remembered, to tell a late Decode why
NO_WAIT_LIMIT_S = 1e9  # the first message's wait: the reservation's lease bounds it (it cancels the receive)


@dataclass(slots=True)
class _Reservation:
    prompt_len: int
    deadline: float  # monotonic seconds; renewed by Renew
    receive: asyncio.Task  # -> (AuxState, TransferUsage)
    prompt: list[int]  # the reserved prompt's tokens; empty when Reserve did not send them
    lease_s: float = 0.0  # the lease it was given, for messages
    decoding: bool = False


class DecodeServicer(wpb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: WorkerBase, steps: StepStreams | None = None) -> None:
        """``steps``: the worker's Steps streams, which a Decode's metadata may name."""
        self.worker = worker
        self.steps = steps or StepStreams()
        self.reserved: dict[str, _Reservation] = {}
        self.reserving: dict[str, asyncio.Future] = {}  # Reserve calls still taking pages
        self.expired: dict[str, float] = {}  # request id -> the lease it outlived (s), latest last
        worker.on_shutdown.append(self.drop_reservations)

    async def drop_reservations(self) -> None:
        """Free every reservation no Decode took (a shutdown that timed out: their prefill
        fails and the router retries it on another pair)."""
        for rid in [rid for rid, res in self.reserved.items() if not res.decoding]:
            await self._drop(rid)

    @request_rpc(new_work=True)
    async def Reserve(self, request: wpb.ReserveRequest, context) -> wpb.ReserveResponse:
        w, rid, n = self.worker, request.request_id, request.prompt_len
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        prompt = list(request.prompt_token_ids)
        try:
            w.engine.check_reserve(rid, n, prompt)
        except RequestExists as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if rid in self.reserved:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is reserved")
        cap_ms = int(w.config.lease_s * 1000)
        if request.lease_ms > cap_ms:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms: {request.lease_ms} is over this worker's cap of {cap_ms} ms (--lease-s)",
            )
        lease_s = request.lease_ms / 1000 if request.lease_ms else w.config.lease_s
        # shielded: once pages are taken they are registered (and so releasable), even if
        # the caller gives up mid-call; a Release arriving meanwhile waits for it
        task = self.reserving[rid] = asyncio.ensure_future(self._reserve(rid, n, prompt, lease_s))
        task.add_done_callback(lambda _: self.reserving.pop(rid, None))
        try:
            reservation = await asyncio.shield(task)
        except RequestExists as e:  # a Reserve of the same id took the pages meanwhile
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if reservation is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no free pages for {n} tokens")
        return wpb.ReserveResponse(reservation=reservation)

    async def _reserve(self, rid: str, n: int, prompt: list[int], lease_s: float) -> wpb.Reservation | None:
        w = self.worker
        reservation = await w.loop.call(w.engine.reserve, rid, n, prompt)
        if reservation is None:
            return None
        tag = w.agent.transfer_tag(rid)  # fresh per Reserve: a retry never meets a stale message
        receive = asyncio.ensure_future(self._receive(rid, n, tag))
        receive.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.reserved[rid] = _Reservation(n, time.monotonic() + lease_s, receive, prompt, lease_s)
        asyncio.get_running_loop().call_later(lease_s, self._expire, rid)
        return self._reservation_proto(reservation, lease_s, tag)

    async def _receive(self, rid: str, n: int, tag: int):
        """The reservation's receive (under its tag): the transfer may start any time while
        the reservation lives (the prefill runs first; dropping the reservation cancels this
        wait); from its start, ``transfer_timeout_s`` per message.
        ``decode.before_receive_once`` stalls the first one of this process, so a test can
        make one transfer time out."""
        if stall := once("decode.before_receive_once"):
            await asyncio.sleep(stall)
        timeout_s, start = self.worker.config.transfer_timeout_s, time.monotonic()
        try:
            return await self.worker.agent.receive_request(rid, n, timeout_s, tag, wait_s=NO_WAIT_LIMIT_S)
        except (TransferError, ValueError) as e:
            log.warning(
                "transfer of request %s (%d tokens) into %s failed after %.2f s: %s",
                rid,
                n,
                self.worker.config.instance_id,
                time.monotonic() - start,
                e,
            )
            raise

    def _reservation_proto(self, res: Reservation, lease_s: float, tag: int) -> wpb.Reservation:
        w, rid = self.worker, res.request_id
        return wpb.Reservation(
            request_id=rid,
            decode_instance_id=w.config.instance_id,
            num_tokens=res.num_tokens,
            groups=[
                wpb.GroupPages(group=g, page_ids=table, num_held=res.num_held[g])
                for g, table in res.block_tables.items()
            ],
            lease_deadline_unix_ms=int((time.time() + lease_s) * 1000),
            transfer_tag=tag,
            endpoint=endpoint_to_proto(w.agent.endpoint()),
        )

    def _expire(self, rid: str) -> None:
        res = self.reserved.get(rid)
        if res is None or res.decoding:
            return
        left = res.deadline - time.monotonic()
        if left > 0:  # renewed meanwhile
            asyncio.get_running_loop().call_later(left, self._expire, rid)
            return
        log.warning("reservation of request %s expired: no Decode within its %g s lease", rid, res.lease_s)
        self.worker.metrics.timeouts.labels("lease").inc()
        self.expired[rid] = res.lease_s
        while len(self.expired) > EXPIRED_KEPT:
            self.expired.pop(next(iter(self.expired)))
        asyncio.ensure_future(self._drop(rid))

    async def Renew(self, request: wpb.RenewRequest, context) -> wpb.RenewResponse:
        rid, cap_ms = request.request_id, int(self.worker.config.lease_s * 1000)
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        if request.lease_ms > cap_ms:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms: {request.lease_ms} is over this worker's cap of {cap_ms} ms (--lease-s)",
            )
        res = self.reserved.get(rid)
        if res is None or res.decoding:
            await context.abort(grpc.StatusCode.NOT_FOUND, _not_reserved(rid, self.expired))
        lease_s = request.lease_ms / 1000 if request.lease_ms else self.worker.config.lease_s
        res.deadline = max(res.deadline, time.monotonic() + lease_s)
        left = res.deadline - time.monotonic()
        return wpb.RenewResponse(lease_deadline_unix_ms=int((time.time() + left) * 1000))

    async def _drop(self, rid: str) -> bool:
        """Free a reservation no Decode took; shielded: once it is out of ``reserved`` no
        lease would free its pages, so a cancelled Release must not skip the freeing."""
        res = self.reserved.pop(rid, None)
        if res is None:
            return False
        res.receive.cancel()
        if self.worker.engine.holds_reservation(rid):
            await asyncio.shield(self.worker.loop.call(self.worker.engine.release_reservation, rid))
        return True

    async def Release(self, request: wpb.ReleaseRequest, context) -> wpb.ReleaseResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        rid = request.request_id
        pending = self.reserving.get(rid)
        if pending is not None:  # the Reserve it overtook finishes first
            await asyncio.shield(pending)
        res = self.reserved.get(rid)
        if res is not None and res.decoding:
            return wpb.ReleaseResponse(released=False)
        return wpb.ReleaseResponse(released=await self._drop(rid))

    @request_rpc(new_work=False)
    async def Decode(self, request: wpb.DecodeRequest, context) -> None:
        """Written, not yielded: a cancel lands here and the pages are freed at once."""
        await write_stream(self._decode(request, context), context)

    async def _decode(self, request: wpb.DecodeRequest, context):
        w, rid = self.worker, request.request_id
        res = self.reserved.get(rid)
        refusal = _refusal(request, res, self.expired)
        if refusal is not None:
            await context.abort(*refusal)
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        res.decoding = True
        try:
            aux = await self._landed(res, request, context)
            prompt = list(request.prompt_token_ids)
            k = spec_tokens_from_proto(request.speculative)
            submit = lambda: w.engine.add_prefilled(rid, prompt, aux, sampling, k)  # noqa: E731
            stream = OutputStream(skip=1)  # the first token came with the prefill's answer
            outbox = self.steps.bound(context)
            try:
                if outbox is None:
                    async for chunk in stream.chunks(w.loop, rid, submit):
                        yield wpb.DecodeResponse(chunk=chunk)
                else:
                    await stream.send(w.loop, rid, submit, functools.partial(outbox.put, rid))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except StepsClosed as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            w.record_spec_metrics()
            w.record_finished(stream.last, stream.last.finish_reason or "stop", stream.streamed)
            yield wpb.DecodeResponse(complete=stream.complete(len(prompt), cached=False))
        finally:
            self.reserved.pop(rid, None)
            if w.engine.holds_reservation(rid):
                await asyncio.shield(w.loop.call(w.engine.release_reservation, rid))

    async def _landed(self, res: _Reservation, request, context) -> AuxState:
        try:
            aux, _ = await res.receive
        except (TransferError, ValueError, asyncio.CancelledError) as e:
            if isinstance(e, TransferTimeout):
                self.worker.metrics.timeouts.labels("transfer").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, describe_landing(e))
        if aux.first_token_id != request.first_token_id or aux.prompt_len != len(request.prompt_token_ids):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "first_token_id: differs from the transferred aux state"
            )
        return aux

    async def Stats(self, request, context) -> wpb.StatsResponse:
        return await self.worker.stats_reply()


def _not_reserved(rid: str, expired: dict[str, float]) -> str:
    if rid in expired:
        lease = f"{expired[rid]:g} s"
        return f"request_id: {rid!r} is not reserved: its lease of {lease} ran out first (--lease-s)"
    return f"request_id: {rid!r} is not reserved"


def _refusal(
    request: wpb.DecodeRequest, res: _Reservation | None, expired: dict[str, float]
) -> tuple[grpc.StatusCode, str] | None:
    """Why a Decode of ``request`` against its reservation is refused, or None."""
    if res is None or res.decoding:
        return grpc.StatusCode.NOT_FOUND, _not_reserved(request.request_id, expired)
    if len(request.prompt_token_ids) != res.prompt_len:
        n = len(request.prompt_token_ids)
        return grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: {n} tokens, {res.prompt_len} reserved"
    if res.prompt and list(request.prompt_token_ids) != res.prompt:
        return grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: differ from the tokens reserved"
    return None
