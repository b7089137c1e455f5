"""X-Request-Id on the OpenAI HTTP API: it names the request (``cmpl-`` + it, over the
body's request_id) and is echoed as sent, on errors too; without one the response tells
the id the router gave."""

from __future__ import annotations

import asyncio
import json

from services.router.http import HttpServer, Request
from services.router.openai_api import OpenAIServer
from tests.services.router.scripted_router import (
    ScriptedRouter,
    chunk_message,
    complete_message,
    request_body,
)

BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "request_id": "from-body"}


def _post(router: ScriptedRouter, headers: dict[str, str], body: dict | None = None):
    http = HttpServer(OpenAIServer(router).routes())
    request = Request("POST", "/v1/completions", "", headers, request_body(body or BODY))
    return asyncio.run(http.handle(request))


def test_the_header_names_the_request_and_is_echoed():
    router = ScriptedRouter([chunk_message("a"), complete_message()])
    response = _post(router, {"x-request-id": "trace-42"})
    assert response.status == 200 and response.headers["X-Request-Id"] == "trace-42"
    assert router.requests[0].request_id == "cmpl-trace-42"
    assert json.loads(response.body)["id"] == "cmpl-trace-42"


def test_without_the_header_the_response_tells_the_routers_id():
    router = ScriptedRouter([chunk_message("a"), complete_message()])
    response = _post(router, {}, {k: v for k, v in BODY.items() if k != "request_id"})
    rid = router.requests[0].request_id
    assert (
        rid.startswith("cmpl-") and response.headers["X-Request-Id"] == rid == json.loads(response.body)["id"]
    )


def test_a_bad_header_is_refused_by_name_and_echoed_still():
    router = ScriptedRouter([chunk_message("a"), complete_message()])
    response = _post(router, {"x-request-id": "x" * 300})
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == "x-request-id"
    assert response.headers["X-Request-Id"] == "x" * 300 and not router.requests
