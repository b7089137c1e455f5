"""The model's chat template, rendered as ``transformers``' ``apply_chat_template`` does.

    chat = load_chat_template(tokenizer, override="")   # None when the model has none
    ids = chat.token_ids(messages)   # rendered with add_generation_prompt=True, then
                                     # tokenized without adding special tokens
    ids = chat.token_ids(messages, RenderOptions(variables={"enable_thinking": False}))

The template comes from ``--chat-template FILE`` when given, else ``chat_template.jinja``
beside the tokenizer (it takes priority, as in transformers), else ``tokenizer_config.json``'s
``chat_template``: a string, or a list of ``{name, template}`` of which "default" is used.
Rendering: a jinja2 ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension and a pass-through ``{% generation %}`` tag; ``tojson`` as
transformers defines it (no HTML escaping, ``ensure_ascii=False``); ``raise_exception`` and
``strftime_now``; the special tokens (``bos_token``, ``eos_token``, ...) as variables.
Messages' ``reasoning_content`` / ``thinking`` / ``reasoning`` are aliased as transformers
does. A template error (``raise_exception`` included) is a ``ChatTemplateError`` carrying
the template's message.

``RenderOptions`` are apply_chat_template's keywords a request may set (vLLM's chat fields):
``add_generation_prompt``, ``continue_final_message`` (the rendering ends inside the last
message, cut where its content ends, as transformers 5 finds it: a tag appended to the
content, rendered, and cut there; if the template trimmed the space after it, the text
before it is stripped on the right), ``documents`` and more template variables
(``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``), which override the special
tokens' names as in transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.router.special_text import encode_guarded, guard
from services.tokenization.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the last message ends


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """How to render a conversation: apply_chat_template's keywords (see the module doc)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # never with add_generation_prompt (as transformers)
    documents: list[dict] | None = None
    tools: list[dict] | None = None  # OpenAI's tools, as apply_chat_template(tools=...) takes them
    variables: dict = field(default_factory=dict)  # more template variables (chat_template_kwargs)


DEFAULT_RENDER = RenderOptions()


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed while rendering it."""


class ChatTemplate:
    def __init__(self, source: str, tokenizer: Tokenizer, origin: str = "") -> None:
        """``origin``: where ``source`` came from, for error messages."""
        self.source, self.tokenizer, self.origin = source, tokenizer, origin
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: {origin or 'template'} line {e.lineno}: {e.message}") from None

    def render(self, messages: list[dict], options: RenderOptions = DEFAULT_RENDER) -> str:
        """The prompt text; raises ChatTemplateError with the template's message."""
        if not options.continue_final_message:
            return self._render(messages, options)
        if options.add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        final = messages[-1] if messages else {}
        if not isinstance(final.get("content"), str) or "content" not in self.source:
            raise ChatTemplateError("continue_final_message: the final message has no content to continue")
        tagged = [*messages[:-1], {**final, "content": final["content"] + CONTINUE_TAG}]
        return _cut_at_tag(self._render(tagged, options), final["content"])

    def _render(self, messages: list[dict], options: RenderOptions) -> str:
        variables = {
            **self.tokenizer.special_tokens,
            **options.variables,
            "messages": _alias_reasoning(messages),
            "tools": options.tools,
            "documents": options.documents,
            "add_generation_prompt": options.add_generation_prompt,
        }
        try:
            return self.template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def token_ids(self, messages: list[dict], options: RenderOptions = DEFAULT_RENDER) -> list[int]:
        """Rendered as ``options`` say, tokenized without special tokens (the template
        writes them), as transformers' ``apply_chat_template(tokenize=True)``; but
        special-token text inside the messages' contents stays plain text unless the
        tokenizer allows it (``special_in_text``): services/router/special_text.py."""
        if self.tokenizer.special_in_text:
            return self.tokenizer.encode(self.render(messages, options), add_special_tokens=False)
        guarded, originals = guard(messages, self.tokenizer.special_texts())
        return encode_guarded(self.tokenizer, self.render(guarded, options), originals)


def load_chat_template(tokenizer: Tokenizer, override: str = "") -> ChatTemplate | None:
    """The template of ``override`` (a file) or of the tokenizer's folder; None if none.
    Raises ValueError naming the file or field that is unreadable."""
    if override:
        if not os.path.isfile(override):
            raise ValueError(f"chat_template: {override!r} is not a file")
        with open(override, encoding="utf-8") as f:
            return ChatTemplate(f.read(), tokenizer, override)
    path = os.path.join(tokenizer.folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), tokenizer, path)
    source = _config_template(tokenizer.config.get("chat_template"))
    if source is None:
        return None
    return ChatTemplate(source, tokenizer, "tokenizer_config.json")


def _config_template(value) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(
            f"tokenizer_config.json: chat_template: a list of templates needs one "
            f"named 'default'; got {sorted(map(str, named))}"
        )
    raise ValueError(
        f"tokenizer_config.json: chat_template: expected a string or a list of "
        f"{{name, template}}, got {type(value).__name__}"
    )


def _cut_at_tag(rendered: str, content: str) -> str:
    """The rendering up to where the final message's ``content`` ends (transformers 5)."""
    tag = CONTINUE_TAG.strip()
    if content.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat "
            "(the template changes it)"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
    masks in transformers): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
