"""Tool calls through a running cluster and the openai SDK: a Qwen-style folder whose chat
template renders tools, served 1P+1D with its drafter and ``--tool-call-parser hermes``. The
prompt the workers get is transformers' rendering with the tools (counted in usage), a
streamed answer joins to the whole one, a required or named tool choice makes even a random
model call the tool (its answer kept to the calls' JSON schema), and a choice naming no tool
is a 400 naming the field. (The parsers' formats are tested on scripted answers in
tests/services/router/test_tool_calls.py.)"""

from __future__ import annotations

import json

import openai
import pytest
import transformers

from tests.e2e.test_hf_models import pair_cluster, published_drafter
from tests.services.engine.models.hf_models import hf_checkpoint
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder
from tests.services.router.test_tool_calls import HISTORY, TOOL_TEMPLATE, TOOLS

pytestmark = pytest.mark.slow
BOUNDED = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the folder's transformers tokenizer, an openai client of a running cluster)."""
    root = tmp_path_factory.mktemp("tools")
    tok = trained_bpe(400)
    model = hf_checkpoint(
        root / "target",
        "qwen3",
        seed=21,
        vocab_size=tok.get_vocab_size(),
        num_hidden_layers=4,
        max_position_embeddings=960,  # within what the 8 MiB KV cache holds
    )
    write_folder(root / "target", tok, TOOL_TEMPLATE)
    published_drafter(root / "drafter", model.config, draft_vocab=96, seed=22)
    cluster = pair_cluster(root, drafter=True, router_extra=("--tool-call-parser", "hermes"))
    try:
        url = cluster.http_address + "/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            yield transformers.AutoTokenizer.from_pretrained(root / "target"), client
    finally:
        cluster.stop()


def test_the_prompt_is_rendered_with_the_tools_and_a_stream_joins_to_the_answer(served):
    hf_tok, client = served
    model = client.models.list().data[0].id
    args = dict(model=model, messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0)
    answer = client.chat.completions.create(**args)
    calls_history = [
        {**HISTORY[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    ]
    text = hf_tok.apply_chat_template(
        [HISTORY[0], *calls_history, HISTORY[2]], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert answer.usage.prompt_tokens == len(hf_tok(text, add_special_tokens=False)["input_ids"])
    streamed = client.chat.completions.create(**args, stream=True)
    content, calls, reasons = "", [], []
    for chunk in streamed:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    message = answer.choices[0].message
    assert content == (message.content or "") and len(calls) == len(message.tool_calls or [])
    assert reasons[-1] == answer.choices[0].finish_reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_choice_makes_the_model_call_a_tool(served, choice):
    """Even a random model calls: its answer is kept to the calls' JSON schema (the city an
    enum, so the random model's answer ends)."""
    _, client = served
    model = client.models.list().data[0].id
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": BOUNDED}}]
    answer = client.chat.completions.create(
        model=model,
        messages=HISTORY[:1],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,  # one call: a random model would add calls to the list forever
        max_tokens=600,
        temperature=0,
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert answer.choices[0].finish_reason == "tool_calls"


def test_a_forced_choice_naming_no_tool_is_refused_by_name(served):
    _, client = served
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=HISTORY[:1],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nothing"}},
            max_tokens=4,
        )
    assert e.value.body["param"] == "tool_choice.function.name"
