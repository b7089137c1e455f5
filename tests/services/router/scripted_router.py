"""A scripted RouterAPI and a one-call driver for the OpenAI endpoint tests.

``ScriptedRouter.generate`` answers every request with its script of GenerateResponse
messages; ``call`` sends one request through the HTTP routes of an OpenAIServer and returns
the response, or a streamed response's events read whole in the same event loop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from proto.tandem.v1 import client_pb2 as cpb
from services.common.metrics import Metrics
from services.router.chat_template import load_chat_template
from services.router.http import HttpServer, Request, StreamingResponse
from services.router.openai_api import OpenAIServer
from services.tokenization.tokenizer import load_tokenizer

MODEL = "tiny"
TOKENIZER = load_tokenizer(str(Path(__file__).resolve().parents[3] / "models" / "tiny-target"))
CHAT = load_chat_template(TOKENIZER)
USAGE = cpb.Usage(
    prompt_tokens=4,
    cached_tokens=2,
    completion_tokens=3,
    acceptance_length=1.5,
    num_drafts=2,
    num_draft_tokens=6,
    num_accepted_tokens=1,
    cached_tokens_per_group=[cpb.GroupTokens(group="target", num_tokens=2)],
    transfers=[
        cpb.GroupTransfer(group="target", num_bytes=4096, seconds=0.25),
        cpb.GroupTransfer(group="draft", num_bytes=1024, seconds=0.5),
    ],
)


def chunk_message(text: str) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(chunk=cpb.Chunk(token_ids=[1], text=text))


def complete_message(reason=cpb.FINISH_REASON_LENGTH, usage=USAGE) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(complete=cpb.Complete(finish_reason=reason, usage=usage))


def error_message(message: str) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(error=cpb.Error(message=message))


class ScriptedRouter:
    """A RouterAPI whose ``generate`` answers with ``script``; ``hold`` parks it after the
    first message."""

    def __init__(self, script: list[cpb.GenerateResponse], hold: bool = False) -> None:
        self.script, self.hold = script, hold
        self.token = ""  # no bearer token required
        self.metrics = Metrics("router")
        self.inflight: dict[str, object] = {}
        self.requests: list[cpb.GenerateRequest] = []
        self.aborted: list[str] = []
        self.released = asyncio.Event()

    async def model_info(self):
        return cpb.ModelInfoResponse(
            model_id=MODEL, drafter_id="draft", drafter_kind="eagle3", num_spec_tokens=3, max_model_len=64
        )

    async def health(self):
        return cpb.HealthResponse(
            status=cpb.SERVING_STATUS_NOT_SERVING,
            num_decode_workers=1,
            message="no ready prefill/decode pair. ",
        )

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.released.set()
        return True

    def is_running(self, request_id):
        return request_id in self.inflight

    async def generate(self, request):
        self.requests.append(request)
        self.inflight[request.request_id] = object()
        try:
            for i, message in enumerate(self.script):
                yield message
                if self.hold and i == 0:
                    await self.released.wait()
                    yield complete_message(cpb.FINISH_REASON_ABORT, cpb.Usage())
                    return
        finally:
            del self.inflight[request.request_id]


def request_body(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def call(server: OpenAIServer, path: str, payload: dict | None = None):
    """Answer one request; a streamed response is read whole in the same event loop and
    returned as its list of events (JSON objects, then "[DONE]")."""
    method = "GET" if payload is None else "POST"
    http = HttpServer(server.routes())

    async def run():
        response = await http.handle(Request(method, path, "", {}, request_body(payload or {})))
        if isinstance(response, StreamingResponse):
            return parse_events(b"".join([chunk async for chunk in response.chunks]))
        return response

    return asyncio.run(run())


def parse_events(raw: bytes) -> list:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
