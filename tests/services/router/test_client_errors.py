"""Malformed client input over a real socket: always a 4xx naming the field, never a 500
or a dropped connection."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.metrics import Metrics
from services.router.api import ModelLimits, RouterAPI
from services.router.http import MAX_BODY_BYTES, HttpServer
from services.router.openai_api import OpenAIServer
from tests.services.router.scripted_router import (
    CHAT,
    MODEL,
    TOKENIZER,
    ScriptedRouter,
    call,
    chunk_message,
    complete_message,
)


async def _exchange(raw: bytes) -> bytes:
    """Send ``raw`` to a fresh OpenAI server; the bytes until it answers once and closes."""
    router = ScriptedRouter([chunk_message("a"), complete_message()])
    server = HttpServer(OpenAIServer(router).routes())
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(1 << 20), 10)
    finally:
        writer.close()
        await server.close()


def _answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = asyncio.run(_exchange(raw)).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _post(body: bytes, headers: str = "") -> bytes:
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def _completion(**fields) -> bytes:
    return _post(json.dumps({"model": MODEL, "prompt": "x", **fields}).encode())


def test_a_well_formed_request_is_served():
    assert asyncio.run(_exchange(_completion(max_tokens=2))).startswith(b"HTTP/1.1 200 OK")


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 2**70),
        ("max_tokens", 2**32),
        ("seed", 2**70),
        ("top_k", -5),
        ("top_k", 2**40),
        ("min_tokens", 2**33),
        ("num_spec_tokens", 2**32),
        ("logprobs", 2**70),
    ],
)
def test_an_out_of_range_integer_is_a_400_naming_it(field, value):
    status, error = _answer(_completion(**{field: value}))
    assert (status, error["param"]) == (400, field) and error["message"].startswith(f"{field}: ")


def test_an_out_of_range_token_id_is_a_400_naming_the_prompt():
    status, error = _answer(_post(json.dumps({"model": MODEL, "prompt": [1, 2**32]}).encode()))
    assert (status, error["param"]) == (400, "prompt")


def test_a_lone_surrogate_is_a_400_naming_where_it_is():
    body = b'{"model": "%s", "prompt": "x", "stop": ["ok", "\\ud800"]}' % MODEL.encode()
    status, error = _answer(_post(body))
    assert (status, error["param"]) == (400, "stop[1]")
    assert error["message"] == "stop[1]: a lone UTF-16 surrogate (U+D800) is not text"


def test_deeply_nested_json_is_a_400_naming_the_body():
    status, error = _answer(_post(b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    assert (status, error["param"]) == (400, "body") and "nested" in error["message"]


def test_an_integer_literal_too_long_to_parse_is_a_400_naming_the_body():
    status, error = _answer(_post(b'{"max_tokens": ' + b"9" * 5000 + b"}"))
    assert (status, error["param"]) == (400, "body")


@pytest.mark.parametrize(
    "length, message",
    [
        ("-1", "content-length: not a non-negative integer"),
        ("1_0", "content-length: not a non-negative integer"),
        ("+5", "content-length: not a non-negative integer"),
        ("5, 6", "content-length: not a non-negative integer"),
        (str(MAX_BODY_BYTES + 1), f"content-length: the body is over the {MAX_BODY_BYTES}-byte limit"),
    ],
)
def test_a_bad_content_length_is_refused(length, message):
    raw = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    status, error = _answer(raw)
    assert (status, error["message"]) == (413 if "limit" in message else 400, message)


def _chunked(chunks: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks


@pytest.mark.parametrize(
    "chunks, message",
    [
        (b"zz\r\n", "body: malformed chunk size"),
        (b"-5\r\nabc\r\n0\r\n\r\n", "body: malformed chunk size"),
        (b"0x3\r\nabc\r\n0\r\n\r\n", "body: malformed chunk size"),
        (b"3\r\nabcXY0\r\n\r\n", "body: a chunk does not end with CRLF"),
        (b"f" * 70_000 + b"\r\n", "body: a chunk size line: too long"),
    ],
)
def test_bad_chunked_framing_is_a_400(chunks, message):
    status, error = _answer(_chunked(chunks))
    assert (status, error["message"]) == (400, message)


def test_a_chunked_body_over_the_limit_is_a_413():
    status, error = _answer(_chunked(b"%x\r\n" % (MAX_BODY_BYTES + 1)))
    assert status == 413 and error["message"] == f"body: over the {MAX_BODY_BYTES}-byte limit"


def test_an_unknown_transfer_coding_is_a_501():
    raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
    assert _answer(raw)[0] == 501


# ---------------------------------------------------------------------- the router's caps


def _real_router() -> RouterAPI:
    return RouterAPI(
        ModelLimits(model_id=MODEL, vocab_size=264, max_model_len=32), Metrics("router"), tokenizer=TOKENIZER
    )


def test_too_many_or_too_long_stop_strings_are_a_400_naming_stop():
    server = OpenAIServer(_real_router())
    for stop, message in [
        (["x"] * 17, "stop: at most 16 stop strings, got 17"),
        (["x", "y" * 257], "stop: at most 256 characters, got 257"),
    ]:
        response = call(
            server, "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 2, "stop": stop}
        )
        error = json.loads(response.body)["error"]
        assert (response.status, error["param"], error["message"]) == (400, "stop", message)


def test_text_too_long_to_tokenize_is_refused_untokenized_naming_the_prompt():
    server = OpenAIServer(_real_router(), CHAT)
    response = call(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 1025, "max_tokens": 1})
    error = json.loads(response.body)["error"]
    assert (response.status, error["param"]) == (400, "prompt")
    assert error["message"] == (
        "prompt: 1025 characters are over the router's cap of 1024 (32 a token of the "
        "32-token context); send token ids"
    )
    messages = [{"role": "user", "content": "x" * 1024}]
    response = call(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    error = json.loads(response.body)["error"]
    assert (response.status, error["param"]) == (400, "messages")
    assert error["message"].startswith("messages: 1047 characters are over the router's cap of 1024")
