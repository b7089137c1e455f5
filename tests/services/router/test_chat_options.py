"""A chat request's template fields (add_generation_prompt, continue_final_message,
chat_template_kwargs) render as transformers' apply_chat_template renders them."""

from __future__ import annotations

import pytest

from services.router.chat_template import RenderOptions, load_chat_template
from services.router.http import HttpError
from services.router.openai_protocol import parse_chat
from services.tokenization.tokenizer import load_tokenizer
from tests.services.router.test_chat_template import CONVERSATION, LLAMA3, QWEN, _folder

transformers = pytest.importorskip("transformers")

# Qwen3's generation prompt: with enable_thinking false the template writes an empty thought
QWEN3 = QWEN.replace(
    "{{- '<|im_start|>assistant\\n' }}\n",
    "{{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n",
)
PARTIAL = [*CONVERSATION[:2], {"role": "assistant", "content": "def fib(n):  "}]  # trailing spaces


def _reference(folder, messages, **kwargs):
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    kwargs.setdefault("add_generation_prompt", True)
    text = ref.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ref.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    return text, list(ids)


CASES = [
    ("qwen3", {}, RenderOptions()),
    ("qwen3", {"enable_thinking": False}, RenderOptions(variables={"enable_thinking": False})),
    ("qwen3", {"enable_thinking": True}, RenderOptions(variables={"enable_thinking": True})),
    ("qwen3", {"add_generation_prompt": False}, RenderOptions(add_generation_prompt=False)),
    (
        "qwen3",
        {"add_generation_prompt": False, "continue_final_message": True},
        RenderOptions(add_generation_prompt=False, continue_final_message=True),
    ),
    (  # the template trims the content: the tag loses its space, the cut strips the rest
        "llama3",
        {"add_generation_prompt": False, "continue_final_message": True},
        RenderOptions(add_generation_prompt=False, continue_final_message=True),
    ),
]


@pytest.mark.parametrize("template, kwargs, options", CASES, ids=lambda c: str(c)[:40])
def test_render_options_equal_apply_chat_templates_keywords(tmp_path, template, kwargs, options):
    folder = _folder(tmp_path, QWEN3 if template == "qwen3" else LLAMA3)
    chat = load_chat_template(load_tokenizer(str(folder)))
    messages = PARTIAL if options.continue_final_message else CONVERSATION
    text, ids = _reference(folder, messages, **kwargs)
    assert chat.render(messages, options) == text
    assert chat.token_ids(messages, options) == ids


def test_enable_thinking_false_reaches_the_template_through_the_request(tmp_path):
    folder = _folder(tmp_path, QWEN3)
    chat = load_chat_template(load_tokenizer(str(folder)))
    body = {"model": "m", "messages": CONVERSATION[1:2]}
    thinking = parse_chat(body, "m", chat).generate.token_ids.ids
    plain = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}}, "m", chat)
    assert (
        list(plain.generate.token_ids.ids) == _reference(folder, body["messages"], enable_thinking=False)[1]
    )
    assert chat.tokenizer.decode(list(plain.generate.token_ids.ids)).endswith("<think>\n\n</think>\n\n")
    assert list(thinking) != list(plain.generate.token_ids.ids)


def test_continue_final_message_names_a_template_that_drops_the_content(tmp_path):
    folder = _folder(tmp_path, "{% for m in messages %}{{ m.role }}{% endfor %}")
    chat = load_chat_template(load_tokenizer(str(folder)))
    body = {"model": "m", "messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True}
    with pytest.raises(HttpError) as e:
        parse_chat(body, "m", chat)
    error = e.value.body["error"]
    assert error["param"] == "messages" and "continue_final_message" in error["message"]
