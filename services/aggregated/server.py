"""The aggregated worker: prefill and decode in one process, serving the client API itself
(the router forwards to it). The A/B baseline against disaggregated serving."""

from __future__ import annotations

import functools
import uuid

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import write_stream
from services.worker.outputs import OutputStream
from services.worker.request_rpc import request_rpc
from services.worker.step_streams import StepsClosed, StepStreams
from services.worker.worker import WorkerBase, sampling_from_proto, spec_tokens_from_proto


class AggregatedStats(wpb_grpc.PrefillWorkerServicer):
    """Stats alone (as any worker serves them), so the router's health poll sees this worker."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    async def Stats(self, request, context) -> wpb.StatsResponse:
        return await self.worker.stats_reply()


class AggregatedServicer(cpb_grpc.TandemServicer):
    def __init__(self, worker: WorkerBase, steps: StepStreams | None = None) -> None:
        """``steps``: the worker's Steps streams, which a Generate's metadata may name."""
        self.worker = worker
        self.steps = steps or StepStreams()

    @request_rpc(new_work=True)
    async def Generate(self, request: cpb.GenerateRequest, context) -> None:
        await write_stream(self._generate(request, context), context)

    async def _generate(self, request: cpb.GenerateRequest, context):
        w, rid = self.worker, request.request_id or f"agg-{uuid.uuid4().hex}"
        prompt = list(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else request.text
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        stream = OutputStream()
        outbox = self.steps.bound(context)
        try:
            k = spec_tokens_from_proto(request.speculative)
            submit = lambda: w.engine.add_request(prompt, sampling, rid, num_spec_tokens=k)  # noqa: E731
            if outbox is None:
                async for chunk in stream.chunks(w.loop, rid, submit):
                    yield cpb.GenerateResponse(request_id=rid, chunk=chunk)
            else:
                await stream.send(w.loop, rid, submit, functools.partial(outbox.put, rid))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StepsClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        w.record_spec_metrics()
        w.record_finished(stream.last, stream.last.finish_reason or "stop", stream.streamed)
        yield cpb.GenerateResponse(request_id=rid, complete=stream.complete(stream.last.usage.prompt_tokens))

    async def Abort(self, request, context) -> cpb.AbortResponse:
        found = await self.worker.loop.call(self.worker.engine.abort, request.request_id)
        return cpb.AbortResponse(found=found)

    async def Health(self, request, context) -> cpb.HealthResponse:
        return cpb.HealthResponse(
            status=cpb.SERVING_STATUS_SERVING,
            num_prefill_workers=1,
            num_decode_workers=1,
            num_aggregated_workers=1,
        )
