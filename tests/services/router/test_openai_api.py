"""The OpenAI endpoints over a scripted router (exact bodies) and the real one (refusals)."""

from __future__ import annotations

import asyncio
import json

from proto.tandem.v1 import client_pb2 as cpb
from services.common.metrics import Metrics
from services.router.api import ModelLimits, RouterAPI, RouterSettings
from services.router.errors import ErrorCode, RouterError
from services.router.http import HttpServer, Request, Response
from services.router.openai_api import OpenAIServer
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    TOKENIZER,
    ScriptedRouter,
    call,
    chunk_message,
    complete_message,
    error_message,
    request_body,
)


def _stable(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if k not in ("id", "created")}


# scripted_router.USAGE (the default of complete_message) as the OpenAI usage object
TANDEM_USAGE = {
    "prompt_tokens": 4,
    "completion_tokens": 3,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 2},
    "tandem": {
        "acceptance_length": 1.5,
        "num_drafts": 2,
        "num_draft_tokens": 6,
        "num_accepted_tokens": 1,
        "cached_tokens_per_group": {"target": 2},
        "transfer_bytes": {"target": 4096, "draft": 1024},
        "transfer_seconds": {"target": 0.25, "draft": 0.5},
    },
}


def test_a_completion_joins_the_chunks_and_reports_usage_with_tandem_extras():
    router = ScriptedRouter([chunk_message("ab"), chunk_message(""), chunk_message("c"), complete_message()])
    response = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x"})
    payload = json.loads(response.body)
    assert response.status == 200 and payload["id"].startswith("cmpl-")
    assert _stable(payload) == {
        "object": "text_completion",
        "model": MODEL,
        "usage": TANDEM_USAGE,
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
    }
    assert router.requests[0].request_id == payload["id"]


def test_a_chat_completion_answers_as_the_assistant():
    router = ScriptedRouter([chunk_message("hi"), complete_message(cpb.FINISH_REASON_STOP)])
    response = call(
        OpenAIServer(router, CHAT),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "yo"}]},
    )
    payload = json.loads(response.body)
    assert payload["object"] == "chat.completion" and payload["id"].startswith("chatcmpl-")
    assert payload["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert list(router.requests[0].token_ids.ids) == TOKENIZER.encode("user: yo\nassistant: ")


def test_a_streamed_completion_sends_text_deltas_a_finish_chunk_usage_and_done():
    router = ScriptedRouter([chunk_message("a"), chunk_message(""), chunk_message("b"), complete_message()])
    events = call(
        OpenAIServer(router),
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    assert [e["choices"] for e in events[:-1]] == [
        [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        [],
    ]
    assert events[3]["usage"] == TANDEM_USAGE
    assert len({e["id"] for e in events[:-1]}) == 1


def test_a_streamed_chat_opens_with_the_role_and_closes_with_an_empty_delta():
    router = ScriptedRouter([chunk_message("hi"), complete_message(cpb.FINISH_REASON_STOP)])
    events = call(
        OpenAIServer(router, CHAT),
        "/v1/chat/completions",
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "yo"}]},
    )
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "hi"}, None),
        ({}, "stop"),
    ]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in events[-2]


def test_an_error_before_the_first_token_is_an_http_error():
    router = ScriptedRouter(
        [
            error_message("no ready prefill/decode pair"),
            complete_message(cpb.FINISH_REASON_ERROR, cpb.Usage()),
        ]
    )
    response = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert isinstance(response, Response) and response.status == 503
    assert json.loads(response.body)["error"]["code"] == "no_ready_pair"
    assert router.inflight == {}


def test_an_error_after_streaming_started_is_an_sse_error_event():
    router = ScriptedRouter(
        [
            chunk_message("a"),
            error_message("decode worker d: INTERNAL: x"),
            complete_message(cpb.FINISH_REASON_ERROR, cpb.Usage()),
        ]
    )
    events = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert events[1] == {
        "error": {
            "message": "decode worker d: INTERNAL: x",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert events[2:] == ["[DONE]"] and router.inflight == {}


def test_a_stream_closed_early_aborts_its_request():
    router = ScriptedRouter([chunk_message("a"), chunk_message("b")], hold=True)

    async def scenario():
        handler = OpenAIServer(router).routes()["/v1/completions"]["POST"]
        response = await handler(
            Request(
                "POST",
                "/v1/completions",
                "",
                {},
                request_body({"model": MODEL, "prompt": "x", "stream": True}),
            )
        )
        first = await anext(response.chunks)
        await response.chunks.aclose()  # what the server does when the client goes away
        return first

    first = asyncio.run(scenario())
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "a"
    assert router.aborted == [router.requests[0].request_id] and router.inflight == {}


def test_models_lists_the_served_model_with_its_drafter():
    payload = json.loads(call(OpenAIServer(ScriptedRouter([])), "/v1/models").body)
    model = payload["data"][0]
    assert payload["object"] == "list" and len(payload["data"]) == 1
    assert (model["id"], model["object"], model["owned_by"], model["max_model_len"]) == (
        MODEL,
        "model",
        "tandem",
        64,
    )
    assert model["tandem"] == {
        "drafter_id": "draft",
        "drafter_kind": "eagle3",
        "num_spec_tokens": 3,
        "unsafe_forced_acceptance": None,  # every worker verifies losslessly
    }


def test_health_is_503_without_a_ready_pair():
    response = call(OpenAIServer(ScriptedRouter([])), "/health")
    assert response.status == 503
    assert json.loads(response.body) == {
        "status": "not_serving",
        "num_prefill_workers": 0,
        "num_decode_workers": 1,
        "num_ready_pairs": 0,
        "num_aggregated_workers": 0,
        "message": "no ready prefill/decode pair. ",
    }


def test_metrics_serves_the_router_registry_in_prometheus_text():
    router = ScriptedRouter([])
    router.metrics.requests.labels("router", "stop").inc()
    response = call(OpenAIServer(router), "/metrics")
    assert response.content_type.startswith("text/plain")
    assert b'tandem_requests_total{role="router",status="stop"} 1.0' in response.body


# ---------------------------------------------------------------------- the real RouterAPI


def _real_router() -> RouterAPI:
    """A router with no worker, which does not wait for one (startup_wait_s 0)."""
    limits = ModelLimits(model_id=MODEL, vocab_size=264, max_model_len=32)
    return RouterAPI(limits, Metrics("router"), RouterSettings(startup_wait_s=0.0), tokenizer=TOKENIZER)


def test_the_routers_own_validation_is_a_400_under_the_openai_field_name():
    response = call(
        OpenAIServer(_real_router()),
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100},
    )
    error = json.loads(response.body)["error"]
    assert response.status == 400 and error["param"] == "max_tokens"
    assert error["message"] == (
        "max_tokens: 100 exceeds the 29 tokens left in the 32-token context after the 3-token prompt"
    )


def test_chat_prompt_overflow_names_messages():
    response = call(
        OpenAIServer(_real_router(), CHAT),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40}]},
    )
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == "messages"


def test_no_ready_pair_is_a_503_and_counted_by_the_router():
    router = _real_router()
    response = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert response.status == 503
    assert json.loads(response.body)["error"]["message"] == "no ready prefill/decode pair"
    assert router.metrics.requests.labels("router", "error")._value.get() == 1
    assert router.flows == {}


def test_a_router_refusal_maps_to_a_status():
    class Refusing(ScriptedRouter):
        async def generate(self, request):
            raise RouterError(ErrorCode.UNAVAILABLE, "decode worker d is unavailable")
            yield  # an async generator, like RouterAPI.generate

    response = call(OpenAIServer(Refusing([])), "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert response.status == 503
    assert json.loads(response.body)["error"]["message"] == "decode worker d is unavailable"


def test_a_non_streaming_client_that_disconnects_ends_its_generation():
    router = ScriptedRouter([chunk_message("a"), chunk_message("b")], hold=True)

    async def scenario():
        server = HttpServer(OpenAIServer(router).routes())
        port = await server.start("127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        body = request_body({"model": MODEL, "prompt": "x"})
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        while not router.inflight:
            await asyncio.sleep(0.01)
        writer.close()
        for _ in range(200):
            if not router.inflight:
                break
            await asyncio.sleep(0.01)
        await server.close()

    asyncio.run(scenario())
    assert len(router.requests) == 1 and router.inflight == {}
