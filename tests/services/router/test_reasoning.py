"""--reasoning-parser: <think>...</think> split into reasoning_content, whole and streamed
(tags cut across chunks), and the text unchanged without a parser."""

from __future__ import annotations

import json
import random

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.router.openai_api import OpenAIOptions, OpenAIServer
from services.router.reasoning import ReasoningSplitter, split
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    ScriptedRouter,
    call,
    chunk_message,
    complete_message,
)

# text -> (reasoning, content) under qwen3, then deepseek_r1
CASES = [
    ("<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer"), ("\nplan\n", "\n\nanswer")),
    ("plan</think>answer", ("", "plan</think>answer"), ("plan", "answer")),  # the prompt opened it
    ("just an answer", ("", "just an answer"), ("just an answer", "")),
    ("<think>cut off mid-thought", ("cut off mid-thought", ""), ("cut off mid-thought", "")),
    ("<think></think>", ("", ""), ("", "")),
    ("<thi", ("", "<thi"), ("<thi", "")),  # never became the tag
    ("a <think>b</think>c", ("", "a <think>b</think>c"), ("a <think>b", "c")),  # tags only at the start
    ("<think>x</thinking>y", ("x</thinking>y", ""), ("x</thinking>y", "")),
    ("", ("", ""), ("", "")),
]


@pytest.mark.parametrize("text, qwen3, deepseek_r1", CASES)
def test_the_split_of_a_whole_answer(text, qwen3, deepseek_r1):
    assert split("qwen3", text) == qwen3
    assert split("deepseek_r1", text) == deepseek_r1


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_any_cutting_into_chunks_streams_the_same_split(parser, text):
    rng = random.Random(len(text))
    cuttings = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuttings.append(list(text))  # a character at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        cuttings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for chunks in cuttings:
        splitter = ReasoningSplitter(parser)
        parts = [splitter.push(c) for c in chunks] + [splitter.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == split(parser, text), chunks


SCRIPT = [
    chunk_message("<thi"),
    chunk_message("nk>two "),
    chunk_message("steps</th"),
    chunk_message("ink>\n\nfour"),
    complete_message(cpb.FINISH_REASON_STOP),
]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}]}


def _server(parser: str = "qwen3") -> OpenAIServer:
    return OpenAIServer(ScriptedRouter(SCRIPT), CHAT, OpenAIOptions(reasoning_parser=parser))


def test_a_chat_answer_carries_reasoning_content():
    message = json.loads(call(_server(), "/v1/chat/completions", BODY).body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nfour", "reasoning_content": "two steps"}


def test_a_streamed_chat_sends_reasoning_deltas_then_content_deltas():
    events = call(_server(), "/v1/chat/completions", {**BODY, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert deltas == [{"reasoning_content": "two "}, {"reasoning_content": "steps"}, {"content": "\n\nfour"}]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_tag_held_at_the_end_is_flushed_before_the_finish():
    router = ScriptedRouter([chunk_message("<think>all thought</thi"), complete_message()])
    server = OpenAIServer(router, CHAT, OpenAIOptions(reasoning_parser="deepseek_r1"))
    events = call(server, "/v1/chat/completions", {**BODY, "stream": True})
    assert [e["choices"][0]["delta"] for e in events[1:-2]] == [
        {"reasoning_content": "all thought"},
        {"reasoning_content": "</thi"},
    ]


def test_without_a_parser_the_text_is_unchanged():
    server = OpenAIServer(ScriptedRouter(SCRIPT), CHAT)
    message = json.loads(call(server, "/v1/chat/completions", BODY).body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>two steps</think>\n\nfour"}


def test_an_answer_with_no_content_has_null_content():
    router = ScriptedRouter([chunk_message("<think>hm"), complete_message()])
    server = OpenAIServer(router, CHAT, OpenAIOptions(reasoning_parser="qwen3"))
    message = json.loads(call(server, "/v1/chat/completions", BODY).body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning_content": "hm"}
