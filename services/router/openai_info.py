"""The OpenAI server's endpoints about the model rather than a generation: ``/v1/models``
(and one model by id), ``/tokenize``, ``/detokenize``, ``/version``, ``/health``, ``/metrics``.

The model card is OpenAI's (``id``, ``object``, ``created``, ``owned_by``) plus vLLM's
``root`` and ``max_model_len``, Tandem's drafter under ``tandem``, and which sampling
defaults and reasoning parser the chat and completion endpoints apply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proto.tandem.v1 import client_pb2 as cpb
from services.router.api import RouterAPI
from services.router.chat_template import ChatTemplate
from services.router.generation_defaults import SamplingDefaults
from services.router.http import HttpError, Request, Response
from services.router.openai_fields import not_found
from services.router.openai_responses import error_json
from services.router.openai_tokenize import detokenize, tokenize
from services.tokenization.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class OpenAIOptions:
    """How the OpenAI layer serves the model beyond its template."""

    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # for unset fields
    reasoning_parser: str = ""  # a reasoning.PARSERS name; "" = none, the text as it comes
    tool_call_parser: str = ""  # a tool_calls.PARSERS name; "" = none: tool_choice auto refused


class ModelEndpoints:
    def __init__(
        self, router: RouterAPI, chat: ChatTemplate | None = None, options: OpenAIOptions | None = None
    ) -> None:
        """``chat``: the model's chat template; None refuses /v1/chat/completions (400)."""
        self.router = router
        self.chat = chat
        self.options = options or OpenAIOptions()
        self.created = int(time.time())  # reported as the model's creation time

    async def models(self, http: Request) -> Response:
        return Response.json({"object": "list", "data": [await self._model_card()]})

    async def model(self, http: Request) -> Response:
        """One model by id (``/v1/models/{id}``, the id URL-decoded); another is a 404."""
        card = await self._model_card()
        model = unquote(http.path.removeprefix("/v1/models/"))
        if model != card["id"]:
            raise not_found(model, card["id"])
        return Response.json(card)

    async def tokenize(self, http: Request) -> Response:
        info = await self.router.model_info()
        tokenizer = self._tokenizer()
        return Response.json(tokenize(http.json(), info.model_id, info.max_model_len, tokenizer, self.chat))

    async def detokenize(self, http: Request) -> Response:
        info = await self.router.model_info()
        return Response.json(detokenize(http.json(), info.model_id, info.vocab_size, self._tokenizer()))

    async def version(self, http: Request) -> Response:
        """The installed package's version (vLLM's ``{"version"}``)."""
        try:
            return Response.json({"version": version("tandem")})
        except PackageNotFoundError:
            return Response.json({"version": "unknown (not installed)"})

    async def _model_card(self) -> dict:
        info = await self.router.model_info()
        return {
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
            "sampling_defaults": self.options.defaults.as_json(),
            "reasoning_parser": self.options.reasoning_parser or None,
            "tool_call_parser": self.options.tool_call_parser or None,
        }

    async def health(self, http: Request) -> Response:
        """200 while the router can serve (a ready prefill/decode pair, or a live aggregated
        worker), else 503; the body is its Health as JSON."""
        h = await self.router.health()
        serving = h.status == cpb.SERVING_STATUS_SERVING
        body = {
            "status": "serving" if serving else "not_serving",
            "num_prefill_workers": h.num_prefill_workers,
            "num_decode_workers": h.num_decode_workers,
            "num_ready_pairs": h.num_ready_pairs,
            "num_aggregated_workers": h.num_aggregated_workers,
            "message": h.message,
        }
        return Response.json(body, 200 if serving else 503)

    async def metrics(self, http: Request) -> Response:
        return Response(200, generate_latest(self.router.metrics.registry), CONTENT_TYPE_LATEST)

    def _tokenizer(self) -> Tokenizer:
        if self.router.tokenizer is None:
            raise HttpError(400, error_json("tokenizer: this router has none", "invalid_request_error"))
        return self.router.tokenizer
