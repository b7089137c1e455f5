"""``n`` > 1 over a scripted router: n requests (ids <id>-<i>, seeds seed + i), choice 0
sent first, one body with n choices and the prompt counted once, or one stream whose
events carry each choice's index, with one usage chunk and one DONE."""

from __future__ import annotations

import asyncio
import json

from proto.tandem.v1 import client_pb2 as cpb
from services.router.http import Request
from services.router.openai_api import OpenAIServer
from services.router.openai_choices import choice_requests, merged_usage
from services.router.openai_protocol import parse_completion
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    ScriptedRouter,
    call,
    chunk_message,
    complete_message,
    error_message,
    request_body,
)


def test_each_choice_is_a_request_with_its_own_id_and_the_next_seed():
    request = parse_completion({"model": MODEL, "prompt": "x", "n": 3, "seed": 2**64 - 2}, MODEL)
    choices = choice_requests(request)
    rid = request.generate.request_id
    assert [c.generate.request_id for c in choices] == [f"{rid}-0", f"{rid}-1", f"{rid}-2"]
    assert [c.generate.sampling.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]
    assert [(c.index, c.n, c.response_id) for c in choices] == [(0, 1, rid), (1, 1, rid), (2, 1, rid)]
    unseeded = choice_requests(parse_completion({"model": MODEL, "prompt": "x", "n": 2}, MODEL))
    assert not any(c.generate.sampling.HasField("seed") for c in unseeded)


def test_n_completions_are_one_body_with_the_prompt_counted_once():
    router = ScriptedRouter([chunk_message("ab"), complete_message()])
    response = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x", "n": 3})
    payload = json.loads(response.body)
    assert [c["index"] for c in payload["choices"]] == [0, 1, 2]
    assert all(c["text"] == "ab" for c in payload["choices"])
    assert payload["usage"]["prompt_tokens"] == 4 and payload["usage"]["completion_tokens"] == 9
    assert payload["usage"]["total_tokens"] == 13
    assert [r.request_id for r in router.requests] == [f"{payload['id']}-{i}" for i in range(3)]


def test_n_streamed_chats_carry_each_choice_index_then_one_usage_and_done():
    router = ScriptedRouter([chunk_message("hi"), complete_message(cpb.FINISH_REASON_STOP)])
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "yo"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = call(OpenAIServer(router, CHAT), "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 6
    by_index: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + (c["delta"].get("content") or "")
    assert by_index == {0: "hi", 1: "hi"}
    assert len({e["id"] for e in events[:-1]}) == 1


def test_an_error_before_choice_zeros_first_token_is_the_response_and_starts_no_other():
    router = ScriptedRouter([error_message("worker lost")])
    response = call(OpenAIServer(router), "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2})
    assert response.status == 500 and b"worker lost" in response.body
    assert len(router.requests) == 1 and not router.inflight


def test_merged_usage_keeps_choice_zeros_figures():
    a, b = cpb.Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=3), cpb.Usage(completion_tokens=4)
    assert merged_usage([a, b]) == cpb.Usage(prompt_tokens=5, completion_tokens=6, cached_tokens=3)


def test_a_client_gone_mid_stream_ends_every_choice():
    router = ScriptedRouter([chunk_message("a"), chunk_message("b")], hold=True)

    async def scenario():
        handler = OpenAIServer(router).routes()["/v1/completions"]["POST"]
        body = request_body({"model": MODEL, "prompt": "x", "stream": True, "n": 2})
        response = await handler(Request("POST", "/v1/completions", "", {}, body))
        first = await anext(response.chunks)
        await response.chunks.aclose()  # what the server does when the client goes away
        return first

    first = asyncio.run(scenario())
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "a"
    assert len(router.requests) == 2 and router.inflight == {}  # both ended (cancelled or aborted)
