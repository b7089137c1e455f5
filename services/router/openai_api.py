"""The router's OpenAI-compatible HTTP API: completions, chat, models, health, metrics.

Requests are served on the router's own asyncio loop by calling the in-process
``RouterAPI`` (``generate``, ``health``, ``model_info``, ``abort``): no extra network hop.
Errors before the first token become HTTP errors (400 naming the field, 404 for an
unknown model, 409 for a request id already running, 503 when no prefill/decode pair is
ready or a worker died, 500 otherwise); an error after streaming started is sent as an SSE
event ``{"error": {...}}``. A streaming client that disconnects aborts its request; a
non-streaming one's handler is cancelled by the HTTP server (http.py), and its request with it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proto.tandem.v1 import client_pb2 as cpb
from services.common.security import same_token
from services.router.api import RouterAPI
from services.router.chat_template import ChatTemplate
from services.router.errors import ErrorCode, RouterError
from services.router.http import HttpError, Request, Response, StreamingResponse
from services.router.openai_protocol import OpenAIRequest, parse_chat, parse_completion, router_param
from services.router.openai_responses import (
    DONE,
    StreamChunks,
    chat_json,
    chat_logprobs,
    completion_json,
    completion_logprobs,
    error_json,
    sse,
)

ABANDON_TIMEOUT_S = 5.0


class OpenAIServer:
    def __init__(self, router: RouterAPI, chat: ChatTemplate | None = None) -> None:
        """``chat``: the model's chat template; None refuses /v1/chat/completions (400)."""
        self.router = router
        self.chat = chat
        self.created = int(time.time())  # reported as the model's creation time

    def routes(self) -> dict:
        guard = self._authorized
        return {
            "/v1/completions": {"POST": guard(self.completions)},
            "/v1/chat/completions": {"POST": guard(self.chat_completions)},
            "/v1/models": {"GET": guard(self.models)},
            "/health": {"GET": self.health},
            "/metrics": {"GET": guard(self.metrics)},
        }

    def _authorized(self, handler):
        """With a router token, /v1/* needs ``Authorization: Bearer <token>`` (else 401)."""

        async def checked(http: Request):
            token = self.router.token
            if token and not same_token(http.headers.get("authorization", ""), f"Bearer {token}"):
                raise HttpError(
                    401,
                    {
                        "error": {
                            "message": "authorization: missing or wrong bearer token",
                            "type": "authentication_error",
                            "param": "authorization",
                            "code": 401,
                        }
                    },
                )
            return await handler(http)

        return checked

    # ------------------------------------------------------------------ endpoints

    async def completions(self, http: Request) -> Response | StreamingResponse:
        return await self._serve(parse_completion(http.json(), await self._model_id()))

    async def chat_completions(self, http: Request) -> Response | StreamingResponse:
        info = await self.router.model_info()
        return await self._serve(parse_chat(http.json(), info.model_id, self.chat, info.max_model_len))

    async def models(self, http: Request) -> Response:
        info = await self.router.model_info()
        model = {
            "id": info.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "root": info.model_id,
            "max_model_len": info.max_model_len,
            "tandem": {
                "drafter_id": info.drafter_id,
                "drafter_kind": info.drafter_kind,
                "num_spec_tokens": info.num_spec_tokens,
                # benchmarks only: N when a worker forces acceptance (outputs are NOT the
                # target's, AL = N + 1); null when every worker verifies losslessly
                "unsafe_forced_acceptance": (
                    info.unsafe_forced_acceptance if info.HasField("unsafe_forced_acceptance") else None
                ),
            },
        }
        return Response.json({"object": "list", "data": [model]})

    async def health(self, http: Request) -> Response:
        """200 while at least one prefill/decode pair is ready, else 503."""
        h = await self.router.health()
        serving = h.status == cpb.SERVING_STATUS_SERVING
        body = {
            "status": "serving" if serving else "not_serving",
            "num_prefill_workers": h.num_prefill_workers,
            "num_decode_workers": h.num_decode_workers,
            "num_ready_pairs": h.num_ready_pairs,
            "message": h.message,
        }
        return Response.json(body, 200 if serving else 503)

    async def metrics(self, http: Request) -> Response:
        return Response(200, generate_latest(self.router.metrics.registry), CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ generation

    async def _model_id(self) -> str:
        return (await self.router.model_info()).model_id

    async def _serve(self, request: OpenAIRequest) -> Response | StreamingResponse:
        prefix = "chatcmpl-" if request.kind == "chat" else "cmpl-"
        request.generate.request_id = prefix + uuid.uuid4().hex
        messages = self._generate(request)
        first = await self._first(request, messages)
        if request.stream:
            return StreamingResponse(self._events(request, first, messages))
        return Response.json(await self._collect(request, first, messages))

    async def _generate(self, request: OpenAIRequest) -> AsyncGenerator[cpb.GenerateResponse, None]:
        try:
            async for message in self.router.generate(request.generate):
                yield message
        except RouterError as e:
            raise _rejection(request, e) from None

    async def _first(self, request: OpenAIRequest, messages) -> cpb.GenerateResponse:
        """The first message; an error before any token is raised as an HttpError."""
        first = await anext(messages)
        if first.WhichOneof("payload") == "error":
            await self._abandon(request.generate.request_id, messages)
            raise _stream_error(request, first.error)
        return first

    async def _collect(self, request: OpenAIRequest, first, messages) -> dict:
        texts, reason, usage = [], cpb.FINISH_REASON_UNSPECIFIED, cpb.Usage()
        entries: list[cpb.TokenLogprobs] = []
        async for message in _chain(first, messages):
            kind = message.WhichOneof("payload")
            if kind == "chunk":
                texts.append(message.chunk.text)  # the router trimmed stop strings
                entries.extend(message.chunk.logprobs)
            elif kind == "error":
                await self._abandon(request.generate.request_id, messages)
                raise _stream_error(request, message.error)
            else:
                reason, usage = message.complete.finish_reason, message.complete.usage
        build = chat_json if request.kind == "chat" else completion_json
        logprobs = None
        if request.generate.sampling.HasField("logprobs"):
            as_json = chat_logprobs if request.kind == "chat" else completion_logprobs
            logprobs = as_json(entries, self._decode)
        return build(
            request.generate.request_id, _now(), request.model, "".join(texts), reason, usage, logprobs
        )

    def _decode(self, token_ids: list[int]) -> str:
        """A token's string in logprobs."""
        return self.router.tokenizer.decode(token_ids)

    async def _events(self, request: OpenAIRequest, first, messages) -> AsyncGenerator[bytes, None]:
        rid = request.generate.request_id
        chunks = StreamChunks(request.kind, rid, _now(), request.model, self._decode)
        try:
            if chunks.chat:
                yield chunks.role()
            try:
                async for message in _chain(first, messages):
                    kind = message.WhichOneof("payload")
                    if kind == "chunk":  # text the router trimmed of stop strings
                        if message.chunk.text or message.chunk.logprobs:
                            yield chunks.text(message.chunk.text, message.chunk.logprobs)
                    elif kind == "error":
                        yield sse(_stream_error(request, message.error).body)
                        break
                    else:
                        yield chunks.finish(message.complete.finish_reason)
                        if request.include_usage:
                            yield chunks.usage(message.complete.usage)
            except HttpError as e:  # the router ended the stream (e.g. its decode worker died)
                yield sse(e.body)
            yield DONE
        finally:
            await self._abandon(rid, messages)

    async def _abandon(self, rid: str, messages: AsyncGenerator) -> None:
        """Abort the request if it still runs, let the router finish it, close the stream."""
        if self.router.is_running(rid):
            await self.router.abort(rid)
            try:
                await asyncio.wait_for(_drain(messages), ABANDON_TIMEOUT_S)
            except (TimeoutError, HttpError):
                pass
        await messages.aclose()


def _now() -> int:
    return int(time.time())


async def _chain(first: cpb.GenerateResponse, rest: AsyncGenerator):
    yield first
    async for message in rest:
        yield message


async def _drain(messages: AsyncGenerator) -> None:
    async for _ in messages:
        pass


HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.UNAVAILABLE: 503,
}


def _rejection(request: OpenAIRequest, e: RouterError) -> HttpError:
    """The router refused the request (validation, duplicate id) or lost its worker."""
    field, sep, problem = e.message.partition(": ")
    if e.code == ErrorCode.INVALID_ARGUMENT and sep:
        param = router_param(request, field)
        return HttpError(400, error_json(f"{param}: {problem}", "invalid_request_error", param))
    status = HTTP_STATUS.get(e.code, 500)
    return HttpError(
        status, error_json(e.message, "invalid_request_error" if status < 500 else "server_error")
    )


def _stream_error(request: OpenAIRequest, error: cpb.Error) -> HttpError:
    """An error message from the router: a bad field (400), no capacity (503), or else 500."""
    if error.field:
        param = router_param(request, error.field)
        return HttpError(400, error_json(error.message, "invalid_request_error", param))
    if error.message.startswith("no ready prefill/decode pair"):
        return HttpError(503, error_json(error.message, "server_error", code="no_ready_pair"))
    return HttpError(500, error_json(error.message, "server_error"))
