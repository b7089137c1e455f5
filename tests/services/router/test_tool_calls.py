"""Tool calls: --tool-call-parser's formats parsed whole and streamed (any cutting gives the
same content and calls), the request's tools checked and rendered by the chat template as
transformers renders them, and the OpenAI answer's tool_calls, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest
import transformers

from proto.tandem.v1 import client_pb2 as cpb
from services.router.chat_template import load_chat_template
from services.router.openai_api import OpenAIOptions, OpenAIServer
from services.router.openai_protocol import parse_chat
from services.router.tool_calls import ToolCallStream, parse
from services.tokenization.tokenizer import load_tokenizer
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    ScriptedRouter,
    call,
    chunk_message,
    complete_message,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CASES = {  # parser -> [(answer, content, [(name, arguments)])]
    "hermes": [
        (
            f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
            "Let me check.\n",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
            "",
            [("a", "{}"), ("b", '{"x": 1}')],
        ),
        ("a plain answer <tool", "a plain answer <tool", []),
        ("<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "é"}}',
            "",
            [("a", "{}"), ("b", '{"q": "é"}')],
        ),
        ("Sure: it is sunny.", "Sure: it is sunny.", []),
        ("{not json", "{not json", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "", [("f", '{"a": 1}')]),
        (
            '[{"name": "f", "arguments": "{\\"a\\": 1}"}]',
            "",
            [("f", '{"a": 1}')],
        ),  # the tag skipped as special
        ('Hello [TOOL_CALLS][{"name": "g", "arguments": {}}]', "Hello ", [("g", "{}")]),
        ("a list [x]", "a list [x]", []),
    ],
}
FLAT = [(parser, *case) for parser, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("parser, text, content, calls", FLAT)
def test_a_whole_answer_parses_to_its_content_and_calls(parser, text, content, calls):
    got_content, got_calls = parse(parser, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(calls) and all(
        c.id.startswith("chatcmpl-tool-") for c in got_calls
    )


@pytest.mark.parametrize("parser, text, content, calls", FLAT)
def test_any_cutting_into_chunks_streams_the_same(parser, text, content, calls):
    rng = random.Random(len(text))
    cuttings = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        cuttings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for chunks in cuttings:
        stream = ToolCallStream(parser)
        passed = "".join(stream.push(c) for c in chunks)
        rest, got = stream.finish()
        assert passed + rest == content, chunks
        assert [(c.name, c.arguments) for c in got] == calls


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
TOOL_TEMPLATE = (  # a Hermes/Qwen-style template: tools in the system turn, calls and results in the turns
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    '{%- for call in m.tool_calls or [] %}<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}'
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def test_tools_and_earlier_calls_render_as_transformers_renders_them(tmp_path):
    write_folder(tmp_path, trained_bpe(300), TOOL_TEMPLATE)
    chat = load_chat_template(load_tokenizer(str(tmp_path)))
    request = parse_chat({"model": MODEL, "messages": HISTORY, "tools": TOOLS}, MODEL, chat)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        *HISTORY[:1],
        {
            **HISTORY[1],
            "tool_calls": [
                {
                    **HISTORY[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        HISTORY[2],
    ]
    want = reference.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert request.generate.token_ids.ids[:] == reference(want, add_special_tokens=False)["input_ids"]
    assert '"city": "Paris"' in want and "get_weather" in want


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
        ({"tool_choice": {"type": "function", "function": {"name": "nothing"}}}, "tool_choice.function.name"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(patch, field):
    server = OpenAIServer(
        ScriptedRouter([complete_message()]), CHAT, OpenAIOptions(tool_call_parser="hermes")
    )
    response = call(server, "/v1/chat/completions", {**BODY, **patch})
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == field


def test_tool_choice_auto_needs_a_parser():
    response = call(OpenAIServer(ScriptedRouter([complete_message()]), CHAT), "/v1/chat/completions", BODY)
    assert response.status == 400 and "--tool-call-parser" in json.loads(response.body)["error"]["message"]


SCRIPT = [
    chunk_message("Checking. <tool"),
    chunk_message('_call>{"name": "get_weather", '),
    chunk_message('"arguments": {"city": "Paris"}}</tool_call>'),
    complete_message(cpb.FINISH_REASON_STOP),
]


def _server(parallel_script=SCRIPT) -> OpenAIServer:
    return OpenAIServer(ScriptedRouter(parallel_script), CHAT, OpenAIOptions(tool_call_parser="hermes"))


def test_an_answer_with_a_call_has_tool_calls_and_finishes_with_tool_calls():
    choice = json.loads(call(_server(), "/v1/chat/completions", BODY).body)["choices"][0]
    calls = choice["message"].pop("tool_calls")
    assert choice["message"] == {"role": "assistant", "content": "Checking. "}
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    ]
    assert choice["finish_reason"] == "tool_calls"


def test_a_streamed_answer_sends_content_then_the_calls_then_the_finish():
    events = call(_server(), "/v1/chat/completions", {**BODY, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert deltas[0] == {"content": "Checking. "}
    (call_delta,) = deltas[1]["tool_calls"]
    assert call_delta["index"] == 0 and call_delta["function"]["arguments"] == '{"city": "Paris"}'
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone():
    body = {**BODY, "tool_choice": "none"}
    message = json.loads(call(_server(), "/v1/chat/completions", body).body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(m.chunk.text for m in SCRIPT[:-1])}


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = [
        chunk_message(
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
        ),
        complete_message(cpb.FINISH_REASON_STOP),
    ]
    body = {**BODY, "parallel_tool_calls": False}
    message = json.loads(call(_server(two), "/v1/chat/completions", body).body)["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"] and message["content"] is None


@pytest.mark.parametrize(
    "choice, answer, calls",
    [
        (
            "required",
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city": "Paris"}',
            [("get_weather", '{"city": "Paris"}')],
        ),
    ],
)
def test_a_forced_choice_constrains_the_answer_and_reads_it_as_calls(choice, answer, calls):
    """required and a named function: the answer kept to a JSON schema of the calls, read as
    calls whatever the server's parser (here none)."""
    body = {**BODY, "tool_choice": choice}
    request = parse_chat(body, MODEL, CHAT)
    schema = json.loads(request.generate.sampling.structured.json_schema)
    assert schema["type"] == ("array" if choice == "required" else "object")
    server = OpenAIServer(
        ScriptedRouter([chunk_message(answer), complete_message(cpb.FINISH_REASON_STOP)]), CHAT
    )
    choice_json = json.loads(call(server, "/v1/chat/completions", body).body)["choices"][0]
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in choice_json["message"]["tool_calls"]]
    assert got == calls and choice_json["message"]["content"] is None
    assert choice_json["finish_reason"] == "tool_calls"
