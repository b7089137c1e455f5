"""The prefill worker: runs prompts, pushes their pages of every group to the decode
worker that reserved them, and returns the first token.

Prefill(request, reservation): prefill-only run in the engine (pages parked) -> transfer
of target and draft pages plus aux state over UCX, acknowledged -> pages released to the
prefix cache, whatever happened.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from kvcore.transfer.kv_transfer import AuxState
from kvcore.transfer.ucx import TransferError, TransferTimeout
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.faults import delay
from services.common.peering import PeerRegistry
from services.common.worker import FINISH_REASONS, WorkerBase, logprobs_to_proto, sampling_from_proto


class PrefillServicer(wpb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: WorkerBase, peers: PeerRegistry) -> None:
        self.worker = worker
        self.peers = peers

    async def Prefill(self, request: wpb.PrefillRequest, context) -> wpb.PrefillResponse:
        w, rid = self.worker, request.request_id
        decode_id = request.reservation.decode_instance_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: empty")
        if not decode_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reservation.decode_instance_id: empty")
        if not request.reservation.groups:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reservation.groups: empty")
        for i, g in enumerate(request.reservation.groups):
            if g.num_held > len(g.page_ids):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"reservation.groups[{i}].num_held: {g.num_held} of {len(g.page_ids)} pages",
                )
        if decode_id not in self.peers.peers:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reservation.decode_instance_id: {decode_id!r} is not a paired peer",
            )
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        prompt = list(request.prompt_token_ids)
        start = time.monotonic()
        final = None
        try:
            submit = lambda: w.engine.add_request(prompt, sampling, rid, prefill_only=True)  # noqa: E731
            async for out in w.loop.outputs(rid, submit):
                final = out
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        w.metrics.ttft.labels("prefill").observe(time.monotonic() - start)
        try:
            dest = {g.group: list(g.page_ids) for g in request.reservation.groups}
            held = {g.group: g.num_held for g in request.reservation.groups}
            usage = await self._transfer(rid, prompt, final, decode_id, dest, held, context)
        finally:
            if final is not None and final.finish_reason == "prefilled":
                await w.loop.call(w.engine.release, rid)
        w.metrics.requests.labels("prefill", "ok").inc()
        response = wpb.PrefillResponse(
            first_token_id=final.token_ids[0],
            finish_reason=FINISH_REASONS.get(final.finish_reason, 0),
            usage=usage,
        )
        if final.logprobs:
            response.first_token_logprobs.CopyFrom(logprobs_to_proto(final.logprobs[:1])[0])
        return response

    async def _transfer(self, rid, prompt, final, decode_id, dest, held, context) -> cpb.Usage:
        w = self.worker
        usage = self._usage(prompt, final.usage.cached_tokens)
        if final.finish_reason != "prefilled":  # finished at its first token: nothing to move
            return usage
        aux = AuxState(len(prompt), final.aux.first_token_id, final.aux.hidden, w.config.instance_id)
        if delay("prefill.before_send"):
            await asyncio.sleep(delay("prefill.before_send"))
        start = time.monotonic()
        try:
            moved = await w.agent.send_request(
                rid, len(prompt), decode_id, aux, w.config.transfer_timeout_s, dest, held
            )
        except TransferError as e:
            for group in w.engine.manager.groups:
                w.metrics.transfer_failures.labels(group).inc()
            if isinstance(e, TransferTimeout):
                w.metrics.timeouts.labels("transfer").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"transfer to {decode_id}: {e}")
        w.metrics.transfer_seconds.observe(time.monotonic() - start)
        for group, n in moved.bytes.items():
            w.metrics.transfer_bytes.labels(group).inc(n)
            w.metrics.transfer_pages.labels(group, "sent").inc(moved.pages[group])
            w.metrics.transfer_pages.labels(group, "held").inc(moved.held[group])
            usage.transfers.append(
                cpb.GroupTransfer(
                    group=group,
                    num_bytes=n,
                    seconds=moved.seconds[group],
                    num_pages=moved.pages[group],
                    num_held_pages=moved.held[group],
                )
            )
        return usage

    @staticmethod
    def _usage(prompt: list[int], cached: dict[str, int]) -> cpb.Usage:
        usage = cpb.Usage(prompt_tokens=len(prompt), cached_tokens=cached.get("target", 0))
        for group, n in cached.items():
            usage.cached_tokens_per_group.append(cpb.GroupTokens(group=group, num_tokens=n))
        return usage

    async def Stats(self, request, context) -> wpb.StatsResponse:
        return await self.worker.stats_reply()
