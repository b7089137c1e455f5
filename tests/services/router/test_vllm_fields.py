"""Every documented vLLM extra parameter (and OpenAI field) is honoured or a 400 naming it.

The tables below are written from vLLM's docs ("Extra Parameters" of its Completions and
Chat APIs), not from the server's own table: each field is sent with a value that asks for
something, and either the parsed request shows the effect, or the answer is a 400 whose
``param`` is the field and whose message says it is not implemented.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.router.chat_template import ChatTemplate
from services.router.http import HttpError
from services.router.openai_protocol import parse_chat, parse_completion
from services.router.openai_surface import CHAT_FIELDS, COMPLETION_FIELDS, HONOURED
from tests.services.router.scripted_router import MODEL, TOKENIZER

# a template that shows its variables: documents, a chat_template_kwargs flag, the prompt
TEMPLATE = ChatTemplate(
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if documents %}docs={{ documents | length }}\n{% endif %}{% if flag %}F\n{% endif %}"
    "{% if add_generation_prompt %}assistant: {% endif %}",
    TOKENIZER,
)
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

# vLLM's sampling and extra parameters shared by both APIs, each with a value asking for something
SHARED = {
    "use_beam_search": True,
    "top_k": 5,
    "min_p": 0.25,
    "repetition_penalty": 1.5,
    "length_penalty": 0.5,
    "stop_token_ids": [7, 9],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "min_tokens": 2,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4,
    "allowed_token_ids": [1, 2],
    "prompt_logprobs": 1,
    "bad_words": ["x"],
    "response_format": {"type": "json_object"},
    "structured_outputs": {"json": {"type": "object"}},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"',
    "structural_tag": '{"type": "structural_tag"}',
    "guided_decoding_backend": "guidance",
    "guided_whitespace_pattern": " ",
    "priority": 3,
    "request_id": "mine",
    "logits_processors": ["pkg.Processor"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "cache_salt": "tenant",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "logit_bias": {"5": 1.0},
}
COMPLETION_ONLY = {
    "add_special_tokens": False,
    "prompt_embeds": "AAAA",
    "echo": True,
    "best_of": 2,
    "suffix": "end",
}
CHAT_ONLY = {
    "echo": True,
    "best_of": 2,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"flag": True},
    "mm_processor_kwargs": {"num_crops": 4},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "x"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "service_tier": "flex",
    "store": True,
    "metadata": {"k": "v"},
}


def _sampling(name, value):
    return lambda r: getattr(r.generate.sampling, name) == pytest.approx(value)


def _structured(kind: str, value=None):
    def check(r) -> bool:
        s = r.generate.sampling.structured
        return s.WhichOneof("kind") == kind and (value is None or value(s))

    return check


def _ids(r) -> str:
    return TOKENIZER.backend.decode(list(r.generate.token_ids.ids), skip_special_tokens=False)


# what each honoured field does to the parsed request
EFFECTS = {
    "top_k": _sampling("top_k", 5),
    "min_p": _sampling("min_p", 0.25),
    "repetition_penalty": _sampling("repetition_penalty", 1.5),
    "ignore_eos": _sampling("ignore_eos", True),
    "min_tokens": _sampling("min_tokens", 2),
    "stop_token_ids": lambda r: r.rules.stop_token_ids == {7, 9},
    "include_stop_str_in_output": lambda r: r.rules.include_stop_str,
    "return_tokens_as_token_ids": lambda r: r.rules.token_ids_as_text,
    "request_id": lambda r: r.generate.request_id in ("cmpl-mine", "chatcmpl-mine"),
    "add_special_tokens": lambda r: not r.add_special_tokens,  # completions (chat refuses true)
    "add_generation_prompt": lambda r: _ids(r) == "<bos>user: hi\nassistant: ok\n",
    "continue_final_message": lambda r: _ids(r) == "<bos>user: hi\nassistant: ok",
    "documents": lambda r: "docs=1\n" in _ids(r),
    "chat_template_kwargs": lambda r: "F\n" in _ids(r),
    "tools": lambda r: r.tools.parse and r.tools.tools[0]["function"]["name"] == "f",
    "tool_choice": lambda r: not r.tools.parse,  # none: rendered, not parsed
    "parallel_tool_calls": lambda r: not r.tools.parallel,
    "response_format": _structured("json_object"),
    "structured_outputs": _structured("json_schema"),
    "guided_json": _structured("json_schema"),
    "guided_regex": _structured("regex", lambda s: s.regex == "a+"),
    "guided_choice": _structured("choice", lambda s: list(s.choice.choices) == ["a", "b"]),
    "guided_grammar": _structured("grammar"),
    "guided_decoding_backend": lambda r: r.generate.sampling.structured.WhichOneof("kind") is None,
    "guided_whitespace_pattern": _structured("json_schema", lambda s: s.whitespace_pattern == " "),
}
# continue_final_message needs add_generation_prompt: false (as vLLM)
COMPANIONS = {
    "continue_final_message": {"add_generation_prompt": False},
    "tool_choice": {"tools": CHAT_ONLY["tools"]},
    "parallel_tool_calls": {"tools": CHAT_ONLY["tools"]},
    "guided_whitespace_pattern": {"guided_json": {"type": "object"}},
}


def _parse(kind: str, fields: dict):
    if kind == "completion":
        return parse_completion({"model": MODEL, "prompt": "x", **fields}, MODEL)
    return parse_chat({"model": MODEL, "messages": MESSAGES, **fields}, MODEL, TEMPLATE)


def _walk(kind: str, name: str, value) -> str:
    """ "honoured" (the effect checked) or "refused" (the 400 checked)."""
    try:
        request = _parse(kind, {name: value, **COMPANIONS.get(name, {})})
    except HttpError as error:
        assert (error.status, error.body["error"]["param"]) == (400, name)
        message = error.body["error"]["message"]
        assert message.startswith(f"{name}: not implemented by this server"), message
        return "refused"
    assert name in EFFECTS, f"{name} was accepted but no effect is known for it"
    assert EFFECTS[name](request), name
    return "honoured"


@pytest.mark.parametrize("name", sorted({**SHARED, **COMPLETION_ONLY}))
def test_each_completion_field_is_honoured_or_refused_by_name(name):
    value = {**SHARED, **COMPLETION_ONLY}[name]
    assert _walk("completion", name, value) == (
        "honoured" if COMPLETION_FIELDS[name] == HONOURED else "refused"
    )


@pytest.mark.parametrize("name", sorted({**SHARED, **CHAT_ONLY}))
def test_each_chat_field_is_honoured_or_refused_by_name(name):
    value = {**SHARED, **CHAT_ONLY}[name]
    assert _walk("chat", name, value) == ("honoured" if CHAT_FIELDS[name] == HONOURED else "refused")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_neutral_values_of_refused_fields_are_accepted(kind):
    neutral = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "priority": 0,
        "response_format": {"type": "text"},
        "guided_json": None,
        "logit_bias": {},
        "best_of": 1,
        "echo": False,
        "return_token_ids": False,
    }
    _parse(kind, neutral)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_unknown_field_is_refused_by_name_as_openai_does(kind):
    with pytest.raises(HttpError) as e:
        _parse(kind, {"regex": "a+"})  # SGLang's spelling: never silently dropped
    error = e.value.body["error"]
    assert (e.value.status, error["param"]) == (400, "regex")
    assert error["message"].startswith("regex: unrecognized request argument")


@pytest.mark.parametrize(
    "options, param",
    [
        ({"include_usage": True, "continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
        ({"include_obfuscation": True}, "stream_options.include_obfuscation"),
        ({"chunk_size": 4}, "stream_options.chunk_size"),
    ],
)
def test_stream_options_are_checked_key_by_key(options, param):
    with pytest.raises(HttpError) as e:
        _parse("completion", {"stream": True, "stream_options": options})
    assert e.value.body["error"]["param"] == param


def test_continuous_usage_stats_is_honoured():
    request = _parse("completion", {"stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert request.rules.continuous_usage and not request.include_usage


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [5], "min_tokens": 2}, "stop_token_ids"),
        ({"request_id": 5}, "request_id"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": "x"}, "documents"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
    ],
)
def test_bad_values_of_honoured_fields_name_them(fields, param):
    with pytest.raises(HttpError) as e:
        _parse("chat", fields)
    assert (e.value.status, e.value.body["error"]["param"]) == (400, param)


DOCS = Path(__file__).resolve().parents[3] / "docs" / "deploy.md"


def _documented() -> dict[str, tuple[str, str]]:
    """docs/deploy.md's "Every request field" table: field -> (endpoints, served)."""
    section = DOCS.read_text().split("#### Every request field", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines()[2:]:
        names, _, endpoints, served = (cell.strip() for cell in line.strip("|").split("|"))
        for name in re.findall(r"`([a-z_]+)`", names):
            rows[name] = (endpoints, served)
    return rows


def test_the_docs_list_every_field_with_its_endpoints_and_whether_it_is_honoured():
    rows = _documented()
    assert sorted(rows) == sorted({*COMPLETION_FIELDS, *CHAT_FIELDS})
    for name, (endpoints, served) in rows.items():
        where = {"completions": name in COMPLETION_FIELDS, "chat": name in CHAT_FIELDS}
        expected = "both" if all(where.values()) else next(k for k, v in where.items() if v)
        honoured = HONOURED in (COMPLETION_FIELDS.get(name), CHAT_FIELDS.get(name))
        assert (endpoints, served.startswith("honoured")) == (expected, honoured), name
