"""The router's OpenAI-compatible HTTP API: completions, chat, models, tokenize, version,
health, metrics.

Requests are served on the router's own asyncio loop by calling the in-process
``RouterAPI`` (``generate``, ``health``, ``model_info``, ``abort``): no extra network hop.
Errors before the first token become HTTP errors (400 naming the field, 404 for an
unknown model, 409 for a request id already running, 503 when no prefill/decode pair is
ready or a worker died, 500 otherwise); an error after streaming started is sent as an SSE
event ``{"error": {...}}``. A streaming client that disconnects aborts its request; a
non-streaming one's handler is cancelled by the HTTP server (http.py), and its request with it.
A client's ``X-Request-Id`` names the request (request_header.py); the response echoes it,
or the id the router gave the request when the client sent none.

A request's body first gets the model's sampling defaults in the fields it leaves unset
(generation_defaults.py); its output then passes its OutputRules (openai_output.py) and,
for chat under a reasoning parser, the reasoning split (reasoning.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from proto.tandem.v1 import client_pb2 as cpb
from services.common.request_context import about_request, bind_request
from services.common.security import same_token
from services.router.chat_answer import ChatAnswer, finish_name
from services.router.errors import ErrorCode, RouterError
from services.router.http import HttpError, Request, Response, StreamingResponse
from services.router.openai_choices import choice_requests, interleaved, merged_payload, merged_usage
from services.router.openai_fields import invalid
from services.router.openai_info import ModelEndpoints, OpenAIOptions
from services.router.openai_output import RuledOutput, prepare_prompt, tokenized_here
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
from services.router.request_header import HEADER, client_request_id
from services.router.stream_text import StreamText

ABANDON_TIMEOUT_S = 5.0
Started = tuple[OpenAIRequest, AsyncGenerator, cpb.GenerateResponse]  # a choice, its messages, the first
SHUT_DOWN = "router shut down"  # how a request cut short by a shutdown's error begins (shutdown.py)


__all__ = ["OpenAIOptions", "OpenAIServer"]


class OpenAIServer(ModelEndpoints):
    """The model's endpoints (openai_info.py), and completions and chat."""

    def routes(self) -> dict:
        """/v1/* and the tokenizer's endpoints need the client token (when the router has
        one); /health and /version do not."""
        guard = self._authorized
        return {
            "/v1/completions": {"POST": guard(self.completions)},
            "/v1/chat/completions": {"POST": guard(self.chat_completions)},
            "/v1/models": {"GET": guard(self.models)},
            "/v1/models/{model}": {"GET": guard(self.model)},
            "/tokenize": {"POST": guard(self.tokenize)},
            "/detokenize": {"POST": guard(self.detokenize)},
            "/version": {"GET": self.version},
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
        rid = client_request_id(http.headers)
        info = await self.router.model_info()
        request = parse_completion(self.options.defaults.fill(http.json()), info.model_id)
        _name(request, rid)
        if tokenized_here(request):
            prepare_prompt(request, self.router.tokenizer, info.max_model_len)
        return await self._serve(request, rid is None)

    async def chat_completions(self, http: Request) -> Response | StreamingResponse:
        rid = client_request_id(http.headers)
        info = await self.router.model_info()
        body = self.options.defaults.fill(http.json())
        request = parse_chat(body, info.model_id, self.chat, info.max_model_len)
        if (
            request.tools
            and request.tools.parse
            and not request.tools.forced
            and not self.options.tool_call_parser
        ):
            raise invalid(
                "tool_choice",
                "auto needs the server to parse tool calls: start it with --tool-call-parser "
                "(hermes, llama3_json, mistral), or send tool_choice none",
            )
        _name(request, rid)
        return await self._serve(request, rid is None)

    # ------------------------------------------------------------------ generation

    async def _serve(self, request: OpenAIRequest, tell_id: bool = True) -> Response | StreamingResponse:
        """The request's response; ``tell_id``: it carries the request's id as X-Request-Id
        (else http.py echoes the client's own)."""
        bind_request(request.generate.request_id)
        if request.n > 1:
            response = await self._serve_choices(request)
        else:
            messages = self._generate(request)
            first = await self._first(request, messages)
            if request.stream:
                response = StreamingResponse(self._events(request, first, messages))
            else:
                response = Response.json(await self._collect(request, first, messages))
        if tell_id:
            response.headers[HEADER] = request.generate.request_id
        return response

    async def _serve_choices(self, request: OpenAIRequest) -> Response | StreamingResponse:
        """n > 1: choice 0 first, the others once its first token came (openai_choices.py)."""
        started: list[Started] = []
        choices = choice_requests(request)
        try:
            for group in (choices[:1], choices[1:]):
                gens = [self._generate(c) for c in group]
                firsts = await asyncio.gather(
                    *(self._first(c, g) for c, g in zip(group, gens, strict=True)), return_exceptions=True
                )
                started += [
                    (c, g, f)
                    for c, g, f in zip(group, gens, firsts, strict=True)
                    if isinstance(f, cpb.GenerateResponse)
                ]
                if failed := [f for f in firsts if isinstance(f, BaseException)]:
                    raise failed[0]
            if request.stream:
                return StreamingResponse(self._choice_stream(request, started))
            payloads = await _all_or_none([self._collect(c, f, g) for c, g, f in started])
        except BaseException:
            for c, g, _ in started:
                await self._abandon(c.generate.request_id, g)
            raise
        return Response.json(merged_payload(list(payloads), request.generate.request_id))

    async def _choice_stream(
        self, request: OpenAIRequest, started: list[Started]
    ) -> AsyncGenerator[bytes, None]:
        """The n choices' events, interleaved as they come, then the usage and DONE."""
        chunks = [self._chunks(c) for c, _, _ in started]
        streams = [self._choice_events(c, k, f, g) for (c, g, f), k in zip(started, chunks, strict=True)]
        merged = interleaved(streams)
        with about_request(request.generate.request_id):
            try:
                async for event in merged:
                    yield event
                usages = [k.final_usage for k in chunks]
                if request.include_usage and all(u is not None for u in usages):
                    yield chunks[0].usage(merged_usage(usages))
                yield DONE
            finally:  # a client gone closes this generator: every choice's request ends now
                await merged.aclose()
                for stream in streams:
                    await stream.aclose()
                for c, g, _ in started:
                    await self._abandon(c.generate.request_id, g)

    async def _generate(self, request: OpenAIRequest) -> AsyncGenerator[cpb.GenerateResponse, None]:
        """The router's messages as the request's OutputRules shape them; a stop token aborts
        the router's request."""
        output, aborted = self._ruled_output(request), False
        try:
            async for message in self.router.generate(request.generate):
                if output is None:
                    yield message
                    continue
                ruled = output.apply(message)
                if output.stopped and not aborted:
                    aborted = True
                    await self.router.abort(request.generate.request_id)
                for out in ruled:
                    yield out
        except RouterError as e:
            raise _rejection(request, e) from None

    def _ruled_output(self, request: OpenAIRequest) -> RuledOutput | None:
        rules = request.rules
        if not rules.own_text:
            return None
        text = None
        if self.router.tokenizer is not None:
            sampling = request.generate.sampling
            stops, min_tokens = list(sampling.stop), sampling.min_tokens
            text = StreamText(self.router.tokenizer, stops, min_tokens, rules.include_stop_str)
        return RuledOutput(rules, text, len(request.generate.token_ids.ids))

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
        chat = request.kind == "chat"
        logprobs = None
        if request.generate.sampling.HasField("logprobs"):
            logprobs = (chat_logprobs if chat else completion_logprobs)(entries, self._decoder(request))
        head = (request.generate.request_id, _now(), request.model)
        text = "".join(texts)
        if not chat:
            return completion_json(*head, text, reason, usage, logprobs)
        payload = chat_json(*head, text, reason, usage, logprobs)
        if answer := self._answer(request):
            choice = payload["choices"][0]
            choice["message"] = answer.message(text)
            choice["finish_reason"] = finish_name(
                choice["finish_reason"], choice["message"].get("tool_calls")
            )
        return payload

    def _answer(self, request: OpenAIRequest) -> ChatAnswer | None:
        """The chat answer's parsers (none: the text as it comes)."""
        tools = ""
        if request.tools and request.tools.parse:
            tools = request.tools.parser or self.options.tool_call_parser
        if request.kind != "chat" or not (self.options.reasoning_parser or tools):
            return None
        return ChatAnswer(
            self.options.reasoning_parser, tools, request.tools is None or request.tools.parallel
        )

    def _decode(self, token_ids: list[int]) -> str:
        """A token's string in logprobs."""
        return self.router.tokenizer.decode(token_ids)

    def _decoder(self, request: OpenAIRequest):
        """How logprobs name a token: its text, or ``token_id:<id>`` (return_tokens_as_token_ids)."""
        return _token_id_name if request.rules.token_ids_as_text else self._decode

    async def _events(self, request: OpenAIRequest, first, messages) -> AsyncGenerator[bytes, None]:
        """The SSE events, sent from the connection's task: its lines name the request."""
        rid = request.generate.request_id
        events = self._stream(request, first, messages)
        with about_request(rid):
            try:
                async for event in events:
                    yield event
            finally:  # a client gone closes this generator: its request must end now
                await events.aclose()

    async def _stream(self, request: OpenAIRequest, first, messages) -> AsyncGenerator[bytes, None]:
        chunks = self._chunks(request)
        try:
            async for event in self._choice_events(request, chunks, first, messages):
                yield event
            if request.include_usage and chunks.final_usage is not None:
                yield chunks.usage(chunks.final_usage)
            yield DONE
        finally:
            await self._abandon(request.generate.request_id, messages)

    def _chunks(self, request: OpenAIRequest) -> StreamChunks:
        """The SSE events of the request's choice (its index; the response's id)."""
        rid = request.response_id or request.generate.request_id
        chunks = StreamChunks(request.kind, rid, _now(), request.model, self._decoder(request))
        chunks.index = request.index
        if request.rules.continuous_usage:
            chunks.count_usage(len(request.generate.token_ids.ids))
        return chunks

    async def _choice_events(
        self, request: OpenAIRequest, chunks: StreamChunks, first, messages
    ) -> AsyncGenerator[bytes, None]:
        """One choice's events up to its finish (its usage left in ``chunks.final_usage``),
        or up to an error event."""
        answer = self._answer(request)
        if chunks.chat:
            yield chunks.role()
        try:
            async for message in _chain(first, messages):
                kind = message.WhichOneof("payload")
                if kind == "chunk":  # text the router trimmed of stop strings
                    chunks.tokens(len(message.chunk.token_ids))
                    if event := _delta(chunks, answer, message.chunk.text, message.chunk.logprobs):
                        yield event
                elif kind == "error":
                    yield sse(_stream_error(request, message.error).body)
                    return
                else:
                    reasoning, content, calls = answer.finish() if answer else ("", "", [])
                    if reasoning or content:
                        yield chunks.text(content, (), reasoning)
                    if calls:
                        yield chunks.tool_calls(calls)
                    yield chunks.finish(message.complete.finish_reason, bool(calls))
                    chunks.final_usage = message.complete.usage
        except HttpError as e:  # the router ended the stream (e.g. its decode worker died)
            yield sse(e.body)

    async def _abandon(self, rid: str, messages: AsyncGenerator) -> None:
        """Abort the request if it still runs, let the router finish it, close the stream."""
        if self.router.is_running(rid):
            await self.router.abort(rid)
            try:
                await asyncio.wait_for(_drain(messages), ABANDON_TIMEOUT_S)
            except (TimeoutError, HttpError):
                pass
        await messages.aclose()


def _name(request: OpenAIRequest, client_id: str | None) -> None:
    """Name the request by the client's X-Request-Id (``cmpl-``/``chatcmpl-`` + it), if given."""
    if client_id is not None:
        prefix = "chatcmpl-" if request.kind == "chat" else "cmpl-"
        request.generate.request_id = prefix + client_id


def _now() -> int:
    return int(time.time())


def _token_id_name(token_ids: list[int]) -> str:
    return f"token_id:{token_ids[0]}"


def _delta(chunks: StreamChunks, answer: ChatAnswer | None, text: str, logprobs) -> bytes | None:
    """A chunk's event (its text split into reasoning and content, tool calls held, under
    the parsers); None when it has nothing to tell yet."""
    if answer is None:
        return chunks.text(text, logprobs) if text or logprobs else None
    reasoning, content = answer.push(text)
    return chunks.text(content, logprobs, reasoning) if reasoning or content or logprobs else None


async def _all_or_none(coroutines: list) -> list:
    """Their results in order; the first to raise cancels the others (whose streams the
    caller then abandons) and its error propagates."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
    if error.message.startswith(SHUT_DOWN):
        return HttpError(503, error_json(error.message, "server_error", code="shutting_down"))
    return HttpError(500, error_json(error.message, "server_error"))
