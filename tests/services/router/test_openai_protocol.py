"""OpenAI request bodies -> GenerateRequest, and the 400s that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.chat_template import load_chat_template
from services.router.http import HttpError
from services.router.openai_protocol import (
    chat_messages,
    parse_chat,
    parse_completion,
    render_chat,
    router_param,
)
from services.tokenization.tokenizer import load_tokenizer

MODEL = "tiny"
TOKENIZER = load_tokenizer(str(Path(__file__).resolve().parents[3] / "models" / "tiny-target"))
CHAT = load_chat_template(TOKENIZER)


def _parse_chat(body, model_id):
    return parse_chat(body, model_id, CHAT)


def _error(parse, body) -> tuple[int, dict]:
    with pytest.raises(HttpError) as e:
        parse(body, MODEL)
    return e.value.status, e.value.body["error"]


def test_completion_fields_map_to_sampling_with_openai_defaults():
    request = parse_completion({"model": MODEL, "prompt": "def f("}, MODEL)
    g = request.generate
    assert (g.text, g.sampling.max_tokens, g.sampling.temperature, g.sampling.top_p) == (
        "def f(",
        16,
        1.0,
        1.0,
    )
    assert not g.sampling.HasField("seed") and not g.speculative.HasField("num_spec_tokens")
    assert (request.kind, request.stream, request.include_usage) == ("completion", False, False)


def test_every_supported_completion_field_is_carried():
    body = {
        "model": MODEL,
        "prompt": [[1, 2, 3]],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 7,
        "stop": "\n\n",
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "num_spec_tokens": 0,
        "user": "ignored",
    }
    request = parse_completion(body, MODEL)
    g = request.generate
    assert list(g.token_ids.ids) == [1, 2, 3] and g.WhichOneof("prompt") == "token_ids"
    assert (g.sampling.max_tokens, g.sampling.temperature, g.sampling.top_p, g.sampling.seed) == (
        5,
        0.0,
        0.5,
        7,
    )
    assert list(g.sampling.stop) == ["\n\n"] and g.sampling.ignore_eos
    assert g.speculative.HasField("num_spec_tokens") and g.speculative.num_spec_tokens == 0
    assert request.stream and request.include_usage


def test_the_bundled_chat_template_is_role_colon_content_lines_then_the_assistant_prompt():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    assert (
        render_chat(chat_messages(messages), CHAT)
        == "<bos>system: Be brief.\nuser: Hi there\nassistant: \nassistant: "
    )


def test_chat_takes_max_completion_tokens_over_max_tokens_and_defaults_to_the_server():
    messages = [{"role": "user", "content": "x"}]
    chat = _parse_chat({"model": MODEL, "messages": messages}, MODEL)
    assert list(chat.generate.token_ids.ids) == TOKENIZER.encode("user: x\nassistant: ")
    assert chat.generate.sampling.max_tokens == 0
    chat = _parse_chat(
        {"model": MODEL, "messages": messages, "max_tokens": 3, "max_completion_tokens": 9}, MODEL
    )
    assert chat.generate.sampling.max_tokens == 9
    assert router_param(chat, "sampling.max_tokens") == "max_completion_tokens"
    assert router_param(chat, "prompt.token_ids") == "messages"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"n": 17}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"echo": True}, "echo"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"model": None}, "model"),
        ({"num_spec_tokens": -1}, "num_spec_tokens"),
    ],
)
def test_bad_completion_fields_are_400s_naming_the_field(patch, param):
    status, error = _error(parse_completion, {"model": MODEL, "prompt": "x", **patch})
    assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"json": {"type": 1}}}, "structured_outputs"),
        ({"n": 17}, "n"),
    ],
)
def test_bad_chat_fields_are_400s_naming_the_field(patch, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **patch}
    status, error = _error(_parse_chat, body)
    assert (status, error["param"]) == (400, param)


def test_an_unknown_model_is_a_404_model_not_found():
    status, error = _error(parse_completion, {"model": "gpt-9", "prompt": "x"})
    assert (status, error["param"], error["code"]) == (404, "model", "model_not_found")


def test_a_body_that_is_not_an_object_is_a_400():
    assert _error(parse_completion, [1, 2])[1]["param"] == "body"


def test_router_fields_map_back_to_openai_names():
    request = parse_completion({"model": MODEL, "prompt": "x"}, MODEL)
    assert [
        router_param(request, f)
        for f in (
            "prompt.token_ids",
            "sampling.max_tokens",
            "sampling.temperature",
            "sampling.stop[2]",
            "speculative.num_spec_tokens",
            "request_id",
        )
    ] == ["prompt", "max_tokens", "temperature", "stop", "num_spec_tokens", "request_id"]
