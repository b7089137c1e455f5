# ruff: noqa: E501  (the Qwen template is quoted as published)
"""Chat templates render as transformers' apply_chat_template does, and the OpenAI chat
endpoint's refusals (no template, a template's raise_exception) name ``messages``."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from services.router.chat_template import ChatTemplateError, load_chat_template
from services.router.http import HttpError
from services.router.openai_protocol import chat_messages, parse_chat
from services.tokenization.tokenizer import load_tokenizer
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

transformers = pytest.importorskip("transformers")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral-style: roles must alternate, else the template raises.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)

# Loop controls, tojson of non-ASCII and HTML characters, a dict and a namespace.
FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}"
    "{% endif %}{% if ns.n == 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ m | tojson }}\n{% endfor %}{{ dict(a=1) | tojson }}{% if add_generation_prompt %}>{% endif %}"
)

SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
CONVERSATION = [
    {"role": "system", "content": "You write Python.  "},
    {"role": "user", "content": "héllo <wörld> & “quotes” 😀"},
    {"role": "assistant", "content": "def fib(n):\n    return n"},
    {"role": "user", "content": "Again, shorter."},
]


def _folder(tmp_path, template, **config):
    tok = trained_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return write_folder(tmp_path, tok, template, **config)


def _reference(folder, messages, **kwargs):
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    ids = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
    )["input_ids"]
    return text, ids


@pytest.mark.parametrize("template", [LLAMA3, QWEN, FEATURES], ids=["llama3", "qwen", "features"])
def test_rendering_and_token_ids_equal_apply_chat_template(tmp_path, template):
    folder = _folder(tmp_path, template)
    chat = load_chat_template(load_tokenizer(str(folder)))
    messages = CONVERSATION + [{"role": "skip", "content": "x"}] if template is FEATURES else CONVERSATION
    text, ids = _reference(folder, messages)
    assert chat.render(messages) == text
    assert chat.token_ids(messages) == ids


def test_qwen_without_a_system_message_gets_its_default_one(tmp_path):
    folder = _folder(tmp_path, QWEN)
    chat = load_chat_template(load_tokenizer(str(folder)))
    messages = CONVERSATION[1:2]
    assert chat.render(messages) == _reference(folder, messages)[0]
    assert chat.render(messages).startswith("<|im_start|>system\nYou are Qwen")


def test_a_template_error_carries_the_templates_message(tmp_path):
    folder = _folder(tmp_path, ALTERNATING, bos_token="<s>", eos_token="</s>")
    chat = load_chat_template(load_tokenizer(str(folder)))
    good = CONVERSATION[1:4]
    assert chat.render(good) == _reference(folder, good)[0]
    with pytest.raises(ChatTemplateError, match="^Conversation roles must alternate"):
        chat.render(CONVERSATION)
    with pytest.raises(HttpError) as e:
        parse_chat({"model": "m", "messages": CONVERSATION}, "m", chat)
    error = e.value.body["error"]
    assert (e.value.status, error["param"]) == (400, "messages")
    assert error["message"] == (
        "messages: the chat template refused them: Conversation roles "
        "must alternate user/assistant/user/assistant/..."
    )


def test_a_model_without_a_template_refuses_chat_naming_messages(tmp_path):
    chat = load_chat_template(load_tokenizer(str(_folder(tmp_path, None))))
    assert chat is None
    with pytest.raises(HttpError) as e:
        parse_chat({"model": "m", "messages": CONVERSATION}, "m", chat)
    error = e.value.body["error"]
    assert (e.value.status, error["param"]) == (400, "messages")
    assert error["message"].startswith("messages: no chat template is configured for this model")


def test_where_the_template_comes_from(tmp_path):
    folder = _folder(
        tmp_path / "model",
        [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}],
    )
    tokenizer = load_tokenizer(str(folder))
    assert load_chat_template(tokenizer).render(CONVERSATION) == "D4"  # the list's "default"
    override = tmp_path / "mine.jinja"
    override.write_text("O{{ messages[0].role }}")
    assert load_chat_template(tokenizer, str(override)).render(CONVERSATION) == "Osystem"
    (folder / "chat_template.jinja").write_text("J")  # beside the tokenizer: it wins, as in HF
    assert load_chat_template(tokenizer).render(CONVERSATION) == "J"
    with pytest.raises(ValueError, match="^chat_template: '/nope' is not a file"):
        load_chat_template(tokenizer, "/nope")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="^tokenizer_config.json: chat_template: expected"):
        load_chat_template(load_tokenizer(str(folder)))


def test_content_parts_are_joined_and_any_string_role_reaches_the_template(tmp_path):
    messages = chat_messages(
        [
            {
                "role": "tool",
                "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}],
                "name": "calc",
            }
        ]
    )
    assert messages == [{"role": "tool", "content": "42", "name": "calc"}]
    chat = load_chat_template(load_tokenizer(str(_folder(tmp_path, QWEN))))
    assert "<tool_response>\n42\n</tool_response>" in chat.render(messages)
