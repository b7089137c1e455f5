"""/tokenize, /detokenize (vLLM's shapes), /v1/models/{id} and /version."""

from __future__ import annotations

import json

import pytest

from services.common.metrics import Metrics
from services.router.api import ModelLimits, RouterAPI, RouterSettings
from services.router.openai_api import OpenAIServer
from tests.services.router.scripted_router import CHAT, MODEL, TOKENIZER, call

MESSAGES = [{"role": "user", "content": "hi"}]


def _server(token: str = "") -> OpenAIServer:
    limits = ModelLimits(model_id=MODEL, vocab_size=264, max_model_len=32)
    settings = RouterSettings(startup_wait_s=0.0, token=token, service_secret="s" if token else "")
    return OpenAIServer(RouterAPI(limits, Metrics("router"), settings, tokenizer=TOKENIZER), CHAT)


def _json(server, path, payload=None) -> tuple[int, dict]:
    response = call(server, path, payload)
    return response.status, json.loads(response.body)


def test_tokenize_a_prompt_as_a_completion_sends_it():
    status, body = _json(_server(), "/tokenize", {"model": MODEL, "prompt": "ab"})
    assert (status, body) == (
        200,
        {"count": 3, "max_model_len": 32, "tokens": [256, 97, 98], "token_strs": None},
    )
    _, bare = _json(
        _server(), "/tokenize", {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True}
    )
    assert (bare["tokens"], bare["token_strs"]) == ([97, 98], ["a", "b"])


def test_tokenize_messages_as_a_chat_sends_them():
    _, body = _json(_server(), "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert body["tokens"] == CHAT.token_ids(MESSAGES) and body["count"] == len(body["tokens"])
    _, bare = _json(_server(), "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert TOKENIZER.decode(bare["tokens"]) == "user: hi\n"


def test_detokenize_keeps_special_tokens_as_vllm():
    assert _json(_server(), "/detokenize", {"model": MODEL, "tokens": [256, 104, 105]}) == (
        200,
        {"prompt": "<bos>hi"},
    )


@pytest.mark.parametrize(
    "path, payload, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/tokenize", {"prompt": "x" * 1025}, "prompt"),
        ("/detokenize", {"tokens": [1, 999]}, "tokens"),
        ("/detokenize", {"tokens": "ab"}, "tokens"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)
def test_bad_bodies_name_the_field(path, payload, param):
    status, body = _json(_server(), path, payload)
    assert (status in (400, 404), body["error"]["param"]) == (True, param)


def test_a_model_by_id_and_an_unknown_id_as_openai_answers_it():
    status, card = _json(_server(), f"/v1/models/{MODEL}")
    assert (status, card["id"], card["object"]) == (200, MODEL, "model")
    assert card == _json(_server(), "/v1/models")[1]["data"][0] | {"created": card["created"]}
    status, error = _json(_server(), "/v1/models/org%2Fother")
    assert (status, error["error"]["code"], error["error"]["param"]) == (404, "model_not_found", "model")
    assert (
        error["error"]["message"]
        == f"model: the model 'org/other' does not exist; this server serves '{MODEL}'"
    )
    assert _json(_server(), "/v1/models/a/b")[0] == 404  # an id with a slash reaches the handler


def test_version_is_served_without_the_client_token():
    status, body = _json(_server(token="t"), "/version")
    assert status == 200 and body["version"]
    assert call(_server(token="t"), "/tokenize", {"prompt": "x"}).status == 401
