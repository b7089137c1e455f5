"""The router in process: what its gRPC servicers and the OpenAI HTTP server both call.

``RouterAPI`` speaks the client protos (tandem.v1 client.proto): ``generate`` yields a
request's GenerateResponse messages; ``health``, ``model_info`` and ``abort`` answer as
the RPCs of the same names. A refusal is a ``RouterError(code, message)``; each caller
maps it to its own status (gRPC in server.py, HTTP in openai_api.py).

Invariants:
- Every coroutine runs on the router's event loop (the registry is not thread-safe).
- ``generate`` raises ALREADY_EXISTS (the id is running), INVALID_ARGUMENT (the message
  names the field) or UNAVAILABLE (the router is shutting down: ``refusing``) before it
  yields anything; UNAVAILABLE when a worker died under a request that had streamed
  tokens. Otherwise its last message is the complete.
- Every request is logged once when it ends (request_log.py), its lines carrying its id
  (services/common/request_context.py); a failure's line names its cause, and nothing
  else here logs it again.
- A flow cut short by a shutdown (``RequestFlow.cut``) ends with an error naming the
  cause, then a complete with FINISH_REASON_ERROR, not as a client's abort.
- ``tandem_requests_running{role="router"}`` counts the requests between admission and
  their end; each ends counted once in ``tandem_requests_total{status}`` (the finish
  reason, "error" or "unavailable") and ``tandem_e2e_request_latency_seconds``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from services.common.metrics import Metrics
from services.common.request_context import bind_request
from services.common.security import TlsConfig
from services.router import messages as msg
from services.router.capacity import ModelLimits, longest_request, served_limits
from services.router.cluster import Cluster
from services.router.dispatch import QUEUE_TIMEOUT_S, RequestFlow
from services.router.errors import ErrorCode, RouterError
from services.router.health import (
    STATS_MISSES,
    STATS_TIMEOUT_S,
    HealthMonitor,
    health_response,
    pair_statuses,
)
from services.router.registration import Registration
from services.router.registry import Registry
from services.router.request_log import RequestEnd, log_end, log_refused
from services.router.step_failures import STARTUP_WAIT_S
from services.router.stream_text import StreamText
from services.router.validation import RequestError, validate_generate
from services.tokenization.tokenizer import Tokenizer


@dataclass(slots=True)
class RouterSettings:
    tokens_per_page: int = 16  # the workers' page size: the prefix index hashes whole pages
    token: str = ""  # the client token: what client calls carry; "" = none
    service_secret: str = ""  # workers' tokens derive from it (services/common/security.py); "" = none
    tls: TlsConfig | None = None  # mutual TLS on the channels to workers
    model_id: str = ""  # the target folder's name every worker must publish; "" = any
    health_timeout_s: float = STATS_TIMEOUT_S  # each Stats poll's deadline
    health_misses: int = STATS_MISSES  # timed-out polls in a row before a worker is lost
    queue_timeout_s: float = QUEUE_TIMEOUT_S  # how long a request waits for free pages
    startup_wait_s: float = STARTUP_WAIT_S  # how long a new router's requests wait for its first workers

    def __post_init__(self) -> None:
        if self.token and not (self.service_secret or self.tls):
            raise ValueError(
                "service_secret: required with a client token (clients and workers hold separate "
                "credentials): give --service-token, or mutual TLS"
            )


class RouterAPI:
    def __init__(
        self,
        limits: ModelLimits,
        metrics: Metrics,
        options: RouterSettings | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``tokenizer``: the model's, for text prompts and streamed text; None = token-id
        prompts only, and chunks carry no text."""
        options = options or RouterSettings()
        self.limits = limits
        self.metrics = metrics
        self.token = options.token
        self.tokenizer = tokenizer
        self.queue_timeout_s = options.queue_timeout_s
        self.log_requests = True  # an INFO line per finished request (failures are logged anyway)
        self.refusing = ""  # why new requests are refused (shutting down); "" = admitting
        self.token_totals = [0, 0]  # prompt and completion tokens of the requests that completed
        self.cluster = Cluster(Registry(options.tokens_per_page), options.tls, options.service_secret)
        self.cluster.startup_wait_s = options.startup_wait_s
        self.registration = Registration(self.cluster, metrics, model_contract(options))
        # the requests in flight, by (owner, request id): one client's ids are its own, so
        # another's running id is no answer (ALREADY_EXISTS only for the same client's)
        self.flows: dict[tuple[str, str], RequestFlow] = {}
        if metrics.ready_pairs is not None:  # read when scraped
            metrics.ready_pairs.set_function(lambda: self.cluster.registry.num_serving())
            metrics.step_streams.set_function(lambda: sum(link.ready for link in self.cluster.links.values()))
            self.cluster.count_step_chunks = metrics.step_stream_chunks.inc
        self.health_monitor = HealthMonitor(
            self.cluster, self.flows, options.health_timeout_s, options.health_misses, self.registration.heal
        )

    async def generate(
        self, request: cpb.GenerateRequest, owner: str = ""
    ) -> AsyncIterator[cpb.GenerateResponse]:
        """One request's messages: chunks (text trimmed of stop strings), maybe an error,
        then its complete. ``owner``: the client it runs for; only it may ``abort`` it."""
        try:
            flow = self._admit(request, owner)
        except RouterError as e:
            log_refused(request.request_id or "(none)", e.message, self.log_requests)
            raise
        bind_request(flow.rid)
        self.flows[(owner, flow.rid)] = flow
        self.metrics.running.labels("router").inc()
        status, end = "error", RequestEnd(flow.rid, "error", len(flow.token_ids), flow.start)
        try:
            async for message in flow.run():
                kind = message.WhichOneof("payload")
                if (
                    kind == "complete"
                    and flow.cut
                    and message.complete.finish_reason == cpb.FINISH_REASON_ABORT
                ):
                    end.cause = flow.cut
                    yield cpb.GenerateResponse(request_id=flow.rid, error=cpb.Error(message=flow.cut))
                    message = msg.complete(flow.rid, cpb.FINISH_REASON_ERROR, message.complete.usage)
                yield message
                if kind == "complete":
                    status = cpb.FinishReason.Name(message.complete.finish_reason).split("_")[-1].lower()
                    end.usage = message.complete.usage
                    self._count_tokens(message.complete.usage)
                elif kind == "error":
                    end.cause = message.error.message
        except RouterError as e:
            status, end.cause = "unavailable", str(e)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            end.status, end.cause = "cancelled", "the client went away"
            raise
        finally:
            flow.finish()
            self.flows.pop((owner, flow.rid), None)
            self.metrics.running.labels("router").dec()
            self.metrics.requests.labels("router", status).inc()
            self.metrics.e2e.labels("router").observe(time.monotonic() - flow.start)
            if end.status != "cancelled":
                end.status = status
            end.first_token_at, end.workers, end.attempts = flow.first_token_at, flow.placed_on, flow.attempts
            log_end(end, self.log_requests)

    def _count_tokens(self, usage: cpb.Usage) -> None:
        self.token_totals[0] += usage.prompt_tokens
        self.token_totals[1] += usage.completion_tokens
        self.metrics.prompt_tokens.labels("router").inc(usage.prompt_tokens)
        self.metrics.generation_tokens.labels("router").inc(usage.completion_tokens)

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Abort a running request of ``owner`` (it ends with FINISH_REASON_ABORT); False if
        none of its requests runs under that id (another client's is not told apart)."""
        flow = self.flows.get((owner, request_id))
        if flow is None:
            return False
        flow.abort()
        return True

    def is_running(self, request_id: str, owner: str = "") -> bool:
        return (owner, request_id) in self.flows

    async def health(self) -> cpb.HealthResponse:
        """The cluster's health; NOT_SERVING with the reason once the router refuses requests."""
        response = health_response(self.cluster.registry)
        if self.refusing:
            response.status = cpb.SERVING_STATUS_NOT_SERVING
            response.message = self.refusing
        return response

    async def model_info(self) -> cpb.ModelInfoResponse:
        """The served model and its limits (K and the longest request as the workers serve
        them: ``served``); the drafter as the first registered worker says;
        forced acceptance (benchmarks only) as the first worker that forces it says. The
        workers' RankInfos without where to reach them (gRPC address, transfer endpoint): this is a
        client call, and clients have no business with the workers' endpoints."""
        lim = self.served()
        workers = [_without_addresses(w.info) for w in self.cluster.registry.workers.values()]
        first = workers[0] if workers else rpb.RankInfo()
        info = cpb.ModelInfoResponse(
            model_id=lim.model_id or first.model_id,
            drafter_id=first.drafter_id,
            drafter_kind=first.drafter_kind,
            num_spec_tokens=lim.num_spec_tokens,
            max_model_len=longest_request(lim),
            vocab_size=lim.vocab_size,
            default_max_tokens=lim.default_max_tokens,
            workers=workers,
            pairs=pair_statuses(self.cluster.registry),
        )
        forced = [w.unsafe_forced_acceptance for w in workers if w.HasField("unsafe_forced_acceptance")]
        if forced:
            info.unsafe_forced_acceptance = forced[0]
        return info

    def served(self) -> ModelLimits:
        """The router's limits lowered to what its workers serve (capacity.served_limits):
        K (0 where one serves without a drafter), the context and the KV cache's bound."""
        return served_limits(self.limits, self.cluster.registry.workers.values())

    async def close(self) -> None:
        await self.cluster.close()

    def _admit(self, request: cpb.GenerateRequest, owner: str) -> RequestFlow:
        """The request's flow, once its id is free (among ``owner``'s) and its fields are valid."""
        rid = request.request_id or uuid.uuid4().hex
        if self.refusing:
            raise RouterError(ErrorCode.UNAVAILABLE, self.refusing)
        if (owner, rid) in self.flows:
            raise RouterError(ErrorCode.ALREADY_EXISTS, f"request_id: {rid!r} is running")
        try:
            token_ids = validate_generate(request, self.served(), self.tokenizer)
        except RequestError as e:
            raise RouterError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        text = None
        if self.tokenizer is not None:
            sampling = request.sampling
            text = StreamText(self.tokenizer, list(sampling.stop), sampling.min_tokens)
        flow = RequestFlow(rid, token_ids, request, text, self.cluster, self.metrics, self.queue_timeout_s)
        flow.serial = self.cluster.next_serial()
        return flow


def _without_addresses(info: rpb.RankInfo) -> rpb.RankInfo:
    shown = rpb.RankInfo()
    shown.CopyFrom(info)
    shown.ClearField("grpc_address")
    shown.ClearField("transfer_endpoint")
    return shown


def model_contract(options: RouterSettings) -> rpb.RankInfo:
    """What every worker's RankInfo must say: this schema, the router's page size and model."""
    return rpb.RankInfo(schema_version=1, tokens_per_page=options.tokens_per_page, model_id=options.model_id)
