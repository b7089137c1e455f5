"""The prefill worker: runs prompts, answers with their first token, then pushes their
pages of every group to the decode worker that reserved them.

Prefill(request, reservation), a stream of two messages: the reservation checked once as a
transfer target -> prefill-only run in the engine (pages parked) -> the first token, sent
before any page moves (the client's first token does not wait for the transfer) ->
transfer of target and draft pages plus aux state over the worker's transport (UCX),
acknowledged -> the usage, and the call ends OK. The pages go to the prefix cache whatever
happened: a cancel mid-run aborts the request in the engine, one mid-transfer releases it;
both shielded, so a cancel landing again cannot skip them. ``first_token_id`` (a retry
whose first token the client already has) replaces the sampled token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvcore.transfer import TransferError, TransferTarget, TransferTimeout, TransferUsage
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.faults import delay
from services.common.grpc_server import write_stream
from services.common.transfer_failure import describe
from services.engine.request import RequestOutput
from services.worker.outputs import FINISH_REASONS, add_cached_tokens, logprobs_to_proto
from services.worker.peering import PeerRegistry
from services.worker.request_rpc import request_rpc
from services.worker.transfer_proto import target_of
from services.worker.worker import WorkerBase, sampling_from_proto

log = logging.getLogger(__name__)


class Refused(Exception):
    """A Prefill refused before any work: its status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class PrefillServicer(wpb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: WorkerBase, peers: PeerRegistry) -> None:
        self.worker = worker
        self.peers = peers
        self._releases: set[asyncio.Task] = set()  # releases of parked requests, running

    @request_rpc(new_work=True)
    async def Prefill(self, request: wpb.PrefillRequest, context) -> None:
        """Written, not yielded (as Decode): a cancel lands here and the request is freed at once."""
        await write_stream(self._prefill(request, context), context)

    async def _prefill(self, request: wpb.PrefillRequest, context) -> AsyncIterator[wpb.PrefillResponse]:
        w, rid = self.worker, request.request_id
        try:
            target = self._target(request)
        except Refused as e:
            await context.abort(e.code, e.message)
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        prompt = list(request.prompt_token_ids)
        first = request.first_token_id if request.HasField("first_token_id") else None
        start = time.monotonic()
        final = None
        try:
            submit = lambda: w.engine.add_request(  # noqa: E731
                prompt, sampling, rid, prefill_only=True, first_token_id=first
            )
            async for out in w.loop.outputs(rid, submit):
                final = out
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        w.metrics.ttft.labels("prefill").observe(time.monotonic() - start)
        try:
            yield _first_token(final, _prompt_usage(request, final))
            usage = await self._transfer(request, target, final, context)
        finally:  # whatever ends the call (a cancel too), the parked request is released
            if final is not None and final.finish_reason == "prefilled":
                self._release(rid)
        w.record_finished(final, "ok", generated=1)  # the first token
        yield wpb.PrefillResponse(usage=usage)

    def _release(self, rid: str) -> None:
        """Give a parked request's pages to the prefix cache, in the background: the engine
        thread runs it between two steps, and the router's answer (the first token) need
        not wait for the step it is in (half a prefill step on average under load). Engine
        calls run in the order asked, so a later request's submit comes after it; a
        worker's pages are counted free once it ran (``busy_pages``, which shutdown waits
        for)."""
        task = asyncio.ensure_future(self.worker.loop.call(self.worker.engine.release, rid))
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the loop stopped first
            log.warning("release of a prefilled request failed: %s", task.exception())

    def _target(self, request: wpb.PrefillRequest) -> TransferTarget:
        """Where ``request``'s pages go, once the request is valid and its reservation names a
        paired peer; Refused naming the field otherwise. (A reservation on another transfer
        backend than this worker's fails at the send: its decode worker passed pairing.)"""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.request_id:
            raise Refused(bad, "request_id: empty")
        if not request.prompt_token_ids:
            raise Refused(bad, "prompt_token_ids: empty")
        try:
            target = target_of(request.reservation)
        except ValueError as e:
            raise Refused(bad, f"reservation.{e}") from None
        if target.peer_id not in self.peers.peers:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reservation.decode_instance_id: {target.peer_id!r} is not a paired peer",
            )
        return target

    async def _transfer(
        self, request: wpb.PrefillRequest, target: TransferTarget, final: RequestOutput, context
    ) -> cpb.Usage:
        """Send the parked request's pages and aux state to ``target``, the decode worker that
        reserved them (not when it finished at its first token); the usage, transfers included."""
        w, n = self.worker, len(request.prompt_token_ids)
        usage = _prompt_usage(request, final)
        if final.finish_reason != "prefilled":  # finished at its first token: nothing to move
            return usage
        decode_id = target.peer_id
        aux = dataclasses.replace(final.aux, sender_id=w.config.instance_id)
        if delay("prefill.before_send"):
            await asyncio.sleep(delay("prefill.before_send"))
        start = time.monotonic()
        try:
            moved = await w.agent.send_to(target, request.request_id, n, aux, w.config.transfer_timeout_s)
        except (TransferError, ValueError) as e:  # every transfer failure is retryable elsewhere
            self._count_failure(e)
            log.warning(
                "transfer of request %s (%d tokens) %s->%s failed after %.2f s: %s",
                request.request_id,
                n,
                w.config.instance_id,
                decode_id,
                time.monotonic() - start,
                e,
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, describe(decode_id, e))
        w.metrics.transfer_seconds.observe(time.monotonic() - start)
        self._count_moved(moved)
        usage.transfers.extend(_transfers(moved))
        return usage

    def _count_failure(self, error: Exception) -> None:
        m = self.worker.metrics
        for group in self.worker.engine.manager.groups:
            m.transfer_failures.labels(group).inc()
        if isinstance(error, TransferTimeout):
            m.timeouts.labels("transfer").inc()

    def _count_moved(self, moved: TransferUsage) -> None:
        m = self.worker.metrics
        for group, n in moved.bytes.items():
            m.transfer_bytes.labels(group).inc(n)
            m.transfer_pages.labels(group, "sent").inc(moved.pages[group])
            m.transfer_pages.labels(group, "held").inc(moved.held[group])

    async def Stats(self, request, context) -> wpb.StatsResponse:
        return await self.worker.stats_reply()


def _transfers(moved: TransferUsage) -> list[cpb.GroupTransfer]:
    return [
        cpb.GroupTransfer(
            group=group,
            num_bytes=n,
            seconds=moved.seconds[group],
            num_pages=moved.pages[group],
            num_held_pages=moved.held[group],
        )
        for group, n in moved.bytes.items()
    ]


def _prompt_usage(request: wpb.PrefillRequest, final: RequestOutput) -> cpb.Usage:
    """The prompt's tokens and, per group, those its prefix cache held."""
    usage = cpb.Usage(prompt_tokens=len(request.prompt_token_ids))
    return add_cached_tokens(usage, final.usage.cached_tokens)


def _first_token(final: RequestOutput, usage: cpb.Usage) -> wpb.PrefillResponse:
    """The stream's first message: the first token, its logprobs, whether it ended the
    request, and the prompt's usage."""
    response = wpb.PrefillResponse(
        first_token_id=final.token_ids[0],
        finish_reason=FINISH_REASONS.get(final.finish_reason, 0),
        usage=usage,
    )
    if final.logprobs:
        response.first_token_logprobs.CopyFrom(logprobs_to_proto(final.logprobs[:1])[0])
    return response
