"""The vLLM extras the OpenAI layer serves itself, over a scripted router: stop_token_ids,
include_stop_str_in_output, continuous usage stats, return_tokens_as_token_ids,
request_id and a completion's add_special_tokens."""

from __future__ import annotations

import json

from proto.tandem.v1 import client_pb2 as cpb
from services.router.openai_api import OpenAIServer
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    TOKENIZER,
    USAGE,
    ScriptedRouter,
    call,
    complete_message,
)


class _Router(ScriptedRouter):
    """A scripted router with the model's (byte-level) tokenizer."""

    tokenizer = TOKENIZER


def _chunk(text: str, logprobs: bool = False) -> cpb.GenerateResponse:
    """A chunk of one token per character (the byte-level tokenizer's ids are the bytes)."""
    ids = list(text.encode())
    entries = [cpb.TokenLogprobs(token_id=t, logprob=-0.5) for t in ids] if logprobs else []
    return cpb.GenerateResponse(chunk=cpb.Chunk(token_ids=ids, text=text, logprobs=entries))


SCRIPT = [_chunk("hi", True), _chunk("!.x", True), _chunk("yz"), complete_message(cpb.FINISH_REASON_LENGTH)]


def _complete(router, **fields) -> dict:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 9, **fields}
    response = call(OpenAIServer(router), "/v1/completions", body)
    assert response.status == 200, response.body
    return json.loads(response.body)


def test_a_stop_token_ends_the_text_before_it_aborts_the_worker_and_finishes_stop():
    router = _Router(SCRIPT)
    payload = _complete(router, stop_token_ids=[ord(".")], logprobs=0)
    choice = payload["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("hi!", "stop")
    assert choice["logprobs"]["tokens"] == ["h", "i", "!", "."]  # the stop token counts, its text does not
    assert router.aborted == [payload["id"]]
    assert (payload["usage"]["prompt_tokens"], payload["usage"]["completion_tokens"]) == (2, 4)
    assert list(router.requests[0].token_ids.ids) == TOKENIZER.encode_text("x")  # tokenized here


def test_a_stop_token_is_kept_in_the_text_with_include_stop_str_in_output():
    payload = _complete(_Router(SCRIPT), stop_token_ids=[ord("."), ord("y")], include_stop_str_in_output=True)
    assert payload["choices"][0]["text"] == "hi!."


def test_a_stop_token_ends_a_stream_too():
    router = _Router([_chunk("hi"), _chunk("!.x"), complete_message()])
    events = call(
        OpenAIServer(router),
        "/v1/completions",
        {"model": MODEL, "prompt": [1], "stream": True, "stop_token_ids": [ord("!")]},
    )
    texts = [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]]
    assert texts == [("hi", None), ("", "stop")] and router.aborted == [events[0]["id"]]


def test_output_without_a_stop_token_is_the_routers():
    router = _Router(SCRIPT)
    payload = _complete(router, stop_token_ids=[ord("q")])
    assert payload["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "text": "hi!.xyz",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert payload["usage"]["completion_tokens"] == USAGE.completion_tokens and router.aborted == []


def test_include_stop_str_in_output_keeps_the_stop_string():
    script = [_chunk("hi"), _chunk(" END"), complete_message(cpb.FINISH_REASON_STOP)]
    kept = _complete(_Router(script), stop=["EN"], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == "hi EN"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    router = _Router(SCRIPT)
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = call(
        OpenAIServer(router),
        "/v1/completions",
        {"model": MODEL, "prompt": "ab", "stream": True, "stream_options": options},
    )[:-1]
    assert [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in events[:-1]] == [
        (3, 2),
        (3, 5),
        (3, 7),
        (3, 7),  # the finish chunk
    ]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == USAGE.completion_tokens


def test_continuous_usage_stats_in_a_chat_stream_start_at_the_role():
    router = _Router(SCRIPT[:1] + SCRIPT[-1:])
    events = call(
        OpenAIServer(router, CHAT),
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )[:-1]
    prompt = len(router.requests[0].token_ids.ids)
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 2, 2]
    assert {e["usage"]["prompt_tokens"] for e in events} == {prompt}


def test_return_tokens_as_token_ids_names_tokens_by_id():
    payload = _complete(_Router(SCRIPT[:1] + SCRIPT[-1:]), logprobs=0, return_tokens_as_token_ids=True)
    assert payload["choices"][0]["logprobs"]["tokens"] == ["token_id:104", "token_id:105"]


def test_request_id_names_the_response_and_the_routers_request():
    router = _Router(SCRIPT)
    assert _complete(router, request_id="job-7")["id"] == "cmpl-job-7"
    assert router.requests[0].request_id == "cmpl-job-7"


def test_add_special_tokens_false_sends_the_prompt_without_the_bos():
    router = _Router(SCRIPT)
    _complete(router, prompt="ab", add_special_tokens=False)
    assert list(router.requests[0].token_ids.ids) == [ord("a"), ord("b")]
    _complete(router, prompt="ab")
    assert router.requests[1].text == "ab"  # the router tokenizes it, BOS and all
