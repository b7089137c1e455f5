"""The OpenAI sampling surface: top_k, min_p, penalties, min_tokens, logprobs (parsing,
refusals naming the field, router validation, and the response shapes)."""

from __future__ import annotations

import json
import re

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.engine.sampling import params as sampling
from services.router import validation
from services.router.api import ModelLimits
from services.router.http import HttpError
from services.router.openai_api import OpenAIServer
from services.router.openai_protocol import parse_completion, router_param
from services.router.stream_text import StreamText
from services.router.validation import RequestError, validate_generate
from tests.services.router.scripted_router import CHAT, MODEL, ScriptedRouter, call, complete_message
from tests.services.router.test_openai_protocol import TOKENIZER, _parse_chat


def _completion(**fields) -> cpb.GenerateRequest:
    return parse_completion({"model": MODEL, "prompt": [1, 2], **fields}, MODEL).generate


def _refusal(parse, body) -> dict:
    with pytest.raises(HttpError) as e:
        parse(body, MODEL)
    assert e.value.status == 400
    return e.value.body["error"]


def test_vllm_extra_fields_and_penalties_reach_the_sampling_params():
    s = _completion(
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=-0.5,
        frequency_penalty=2,
        min_tokens=4,
        logprobs=3,
    ).sampling
    assert (
        s.top_k,
        s.min_p,
        s.repetition_penalty,
        s.presence_penalty,
        s.frequency_penalty,
        s.min_tokens,
        s.logprobs,
    ) == pytest.approx((5, 0.1, 1.3, -0.5, 2.0, 4, 3))
    neutral = _completion(top_k=-1).sampling
    assert (neutral.top_k, neutral.min_p, neutral.repetition_penalty, neutral.min_tokens) == (0, 0.0, 1.0, 0)
    assert not neutral.HasField("logprobs")
    assert _completion(logprobs=0).sampling.HasField("logprobs")


def test_chat_logprobs_take_a_flag_and_top_logprobs():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert not _parse_chat(body, MODEL).generate.sampling.HasField("logprobs")
    chat = _parse_chat({**body, "logprobs": True}, MODEL)
    assert chat.generate.sampling.HasField("logprobs") and chat.generate.sampling.logprobs == 0
    assert _parse_chat({**body, "logprobs": True, "top_logprobs": 4}, MODEL).generate.sampling.logprobs == 4
    assert router_param(chat, "sampling.logprobs") == "top_logprobs"
    assert _refusal(_parse_chat, {**body, "top_logprobs": 2})["param"] == "top_logprobs"
    assert _refusal(_parse_chat, {**body, "logprobs": 1})["param"] == "logprobs"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "x"}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_bad_or_unsupported_completion_fields_name_themselves(patch, param):
    error = _refusal(parse_completion, {"model": MODEL, "prompt": "x", **patch})
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(
    "patch",
    [
        {"functions": [{"name": "f"}]},
        {"structural_tag": '{"type": "structural_tag"}'},
        {"logit_bias": {"3": 1}},
    ],
)
def test_unsupported_chat_fields_stay_refused(patch):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **patch}
    assert _refusal(_parse_chat, body)["param"] == next(iter(patch))


def _validate(**sampling) -> None:
    request = cpb.GenerateRequest(token_ids=cpb.TokenIds(ids=[1, 2]), sampling=cpb.SamplingParams(**sampling))
    validate_generate(request, ModelLimits(max_model_len=64, default_max_tokens=8), None)


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"repetition_penalty": -1}, "sampling.repetition_penalty"),
        ({"presence_penalty": 3}, "sampling.presence_penalty"),
        ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty"),
        ({"min_tokens": 9}, "sampling.min_tokens"),  # past the default max_tokens of 8
        ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"stop": ["x"] * 17}, "sampling.stop"),
        ({"stop": ["x", "y" * 257]}, "sampling.stop[1]"),
    ],
)
def test_the_router_validates_the_new_fields_by_name(sampling, field):
    with pytest.raises(RequestError, match=f"^{re.escape(field)}: "):
        _validate(**sampling)


def test_the_router_accepts_their_neutral_and_edge_values():
    _validate(
        top_k=1,
        min_p=1.0,
        repetition_penalty=0,
        presence_penalty=-2,
        frequency_penalty=2,
        min_tokens=8,
        logprobs=20,
        stop=["s" * 256] * 16,
    )


def test_streamed_text_searches_stop_strings_only_after_the_min_tokens_text():
    """As the engine: a stop string counts only where it begins after the text of the first
    min_tokens tokens (one byte-level token per character here)."""
    text = StreamText(TOKENIZER, ["b"], min_tokens=3)
    assert [text.push(list(b"ab")), text.push(list(b"cab")), text.push(list(b"x")), text.flush()] == [
        "ab",
        "ca",
        "",
        "",
    ]
    plain = StreamText(TOKENIZER, ["b"])
    assert [plain.push(list(b"ab")), plain.flush()] == ["a", ""]
    held = StreamText(TOKENIZER, ["cd"], min_tokens=1)
    assert [held.push(list(b"ac")), held.push(list(b"e")), held.flush()] == ["a", "ce", ""]


# ---------------------------------------------------------------- response shapes


class _Tokens:
    """decode([id]) -> a letter per id: 1 -> "a", 2 -> "b", ..."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i - 1) for i in ids)


def _lp(token: int, logprob: float, *top: tuple[int, float]) -> cpb.TokenLogprobs:
    return cpb.TokenLogprobs(
        token_id=token, logprob=logprob, top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top]
    )


SCRIPT = [
    cpb.GenerateResponse(
        chunk=cpb.Chunk(token_ids=[1], text="a", logprobs=[_lp(1, -0.5, (1, -0.5), (2, -1.5))])
    ),
    cpb.GenerateResponse(
        chunk=cpb.Chunk(
            token_ids=[3, 2],
            text="cb",
            logprobs=[_lp(3, -2.0, (2, -0.25), (3, -2.0)), _lp(2, float("-inf"), (1, -0.75), (4, -1.0))],
        )
    ),
    complete_message(),
]


def _router() -> ScriptedRouter:
    router = ScriptedRouter(SCRIPT)
    router.tokenizer = _Tokens()
    return router


def test_completion_logprobs_have_openais_legacy_shape():
    response = call(
        OpenAIServer(_router()), "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}
    )
    choice = json.loads(response.body)["choices"][0]
    assert choice["text"] == "acb"
    assert choice["logprobs"] == {
        "tokens": ["a", "c", "b"],
        "token_logprobs": [-0.5, -2.0, -9999.0],
        "top_logprobs": [
            {"a": -0.5, "b": -1.5},
            {"c": -2.0, "b": -0.25},
            {"b": -9999.0, "a": -0.75, "d": -1.0},
        ],
        "text_offset": [0, 1, 2],
    }


def test_chat_logprobs_have_the_content_shape():
    response = call(
        OpenAIServer(_router(), CHAT),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
    )
    content = json.loads(response.body)["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "b", "logprob": -1.5, "bytes": [98]},
        ],
    }
    assert [c["token"] for c in content] == ["a", "c", "b"] and content[2]["logprob"] == -9999.0


def test_streamed_logprobs_come_with_their_chunks_and_offsets_run_on():
    events = call(
        OpenAIServer(_router()),
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logprobs": 1, "stream": True},
    )
    lps = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"]]
    assert [lp["tokens"] for lp in lps[:2]] == [["a"], ["c", "b"]]
    assert [lp["text_offset"] for lp in lps[:2]] == [[0], [1, 2]]
    assert lps[2] is None  # the finish chunk
    chat = call(
        OpenAIServer(_router(), CHAT),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "stream": True},
    )
    deltas = [e["choices"][0] for e in chat[:-1]]
    assert deltas[0]["logprobs"] is None  # the role
    assert [t["token"] for t in deltas[2]["logprobs"]["content"]] == ["c", "b"]


def test_without_logprobs_the_field_stays_null():
    response = call(OpenAIServer(_router()), "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert json.loads(response.body)["choices"][0]["logprobs"] is None


def test_the_routers_sampling_bounds_are_the_engines():
    assert (validation.MAX_LOGPROBS, validation.MAX_PENALTY) == (sampling.MAX_LOGPROBS, sampling.MAX_PENALTY)
    assert (validation.MAX_STOP_STRINGS, validation.MAX_STOP_CHARS) == (
        sampling.MAX_STOP_STRINGS,
        sampling.MAX_STOP_CHARS,
    )
