"""OpenAI request bodies -> tandem.v1 GenerateRequest, with OpenAI-style 400s naming the field.

Defaults follow OpenAI's API reference: ``temperature`` 1, ``top_p`` 1, and for
``/v1/completions`` ``max_tokens`` 16. Chat without ``max_completion_tokens`` /
``max_tokens`` gets the room the prompt leaves in the context, as vLLM (ModelInfo's
``default_max_tokens``, 0 = that room). ``n`` (1..MAX_N) choices are n requests
(openai_choices.py). Vendor fields (send them with the SDK's ``extra_body``): ``ignore_eos`` and
``num_spec_tokens`` (draft tokens per step, at most the server's K; 0 = no speculation).
Sampling: OpenAI's ``presence_penalty`` and ``frequency_penalty`` ([-2, 2]) and vLLM's extra
fields ``top_k`` (-1 or 0 = off), ``min_p`` ([0, 1]), ``repetition_penalty`` (> 0, 1 = off)
and ``min_tokens`` (at most max_tokens). Logprobs: completions take ``logprobs`` (0..20
alternatives per token), chat takes ``logprobs: true`` with ``top_logprobs`` (0..20); the
values are the target's log-softmax over its raw logits, as vLLM returns them.
Structured outputs (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``)
become ``sampling.structured`` (openai_structured.py). Every other field is one of
openai_surface.py's table: honoured (the vLLM extras the OpenAI
layer serves itself are openai_extras.py's), refused by name unless neutral, or unknown and
refused by name.

Chat: messages are rendered with the model's chat template (chat_template.py, as
transformers' ``apply_chat_template(..., add_generation_prompt=True)``, or as the request's
``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs`` say) and
tokenized without adding special tokens; the request then carries token ids. A model
without a template refuses chat with a 400 naming ``messages``. A message is an object with a string ``role``
(any role the template accepts) and a ``content`` that is a string, null (rendered as "") or
a list of ``{"type": "text", "text": ...}`` parts (joined without separator); its other
fields reach the template unchanged.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from proto.tandem.v1 import client_pb2 as cpb
from services.grammar import constraint_to_proto
from services.router.chat_template import DEFAULT_RENDER, ChatTemplate, ChatTemplateError, RenderOptions
from services.router.openai_extras import (
    OutputRules,
    output_rules,
    render_options,
    response_id,
    stream_options,
)
from services.router.openai_fields import (
    MAX_UINT32,
    as_object,
    boolean,
    integer,
    invalid,
    is_int,
    number,
    served_model,
)
from services.router.openai_structured import read_structured
from services.router.openai_surface import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from services.router.openai_tools import ToolRequest, read_tools, template_tool_calls
from services.router.validation import MAX_LOGPROBS, RequestError, check_text_length

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_N = 16  # choices per request (each one a request of its own to the workers)
MAX_SEED = 2**64 - 1


@dataclass(slots=True)
class OpenAIRequest:
    """One parsed request: what to generate and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    generate: cpb.GenerateRequest
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    params: dict[str, str] = field(default_factory=dict)  # router field -> OpenAI field
    rules: OutputRules = OutputRules()  # what the OpenAI layer does to the output
    add_special_tokens: bool = True  # a text prompt gets the model's (a BOS): completions only
    tools: ToolRequest | None = None  # chat: the request's tools, and whether calls are parsed
    n: int = 1  # choices asked for: n > 1 runs n requests (openai_choices.py)
    index: int = 0  # which choice this request answers (one of n)
    response_id: str = ""  # the response's id when it is not generate.request_id (a choice of n)


def parse_completion(body, model_id: str) -> OpenAIRequest:
    body = as_object(body)
    check_fields(body, COMPLETION_FIELDS)
    request = _common(body, model_id, "completion")
    _set_prompt(request.generate, body)
    request.add_special_tokens = boolean(body, "add_special_tokens", True)
    request.generate.sampling.max_tokens = integer(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, low=1)
    logprobs = integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    if logprobs is not None:
        request.generate.sampling.logprobs = logprobs
    request.params.update(
        {"prompt": "prompt", "sampling.max_tokens": "max_tokens", "sampling.logprobs": "logprobs"}
    )
    return request


def parse_chat(body, model_id: str, chat: ChatTemplate | None, max_model_len: int = 0) -> OpenAIRequest:
    """``max_model_len`` > 0 caps the rendered text before it is tokenized
    (validation.check_text_length)."""
    body = as_object(body)
    check_fields(body, CHAT_FIELDS)
    request = _common(body, model_id, "chat")
    options = render_options(body)
    request.tools = read_tools(body)
    if request.tools and request.tools.forced:  # the answer kept to the calls' JSON schema
        if request.generate.sampling.HasField("structured"):
            raise invalid(
                "tool_choice", "a required or named tool choice excludes a structured-output constraint"
            )
        constraint_to_proto(request.tools.constraint(), request.generate.sampling.structured)
        request.params["sampling.structured"] = "tool_choice"
    messages = chat_messages(body.get("messages"))
    if chat is None:
        raise invalid(
            "messages",
            "no chat template is configured for this model (its "
            "tokenizer_config.json has no chat_template); start the server with "
            "--chat-template FILE, or use /v1/completions",
        )
    text = render_chat(messages, chat, options)
    if max_model_len:
        try:
            check_text_length("messages", len(text), max_model_len)
        except RequestError as e:
            raise invalid("messages", str(e).partition(": ")[2]) from None
    request.generate.token_ids.ids.extend(chat_ids(messages, chat, options))
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request.generate.sampling.max_tokens = integer(body, limit, 0, low=1)
    top = integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if boolean(body, "logprobs", False):
        request.generate.sampling.logprobs = top or 0
    elif top:
        raise invalid("top_logprobs", "needs logprobs: true")
    request.params.update(
        {"prompt": "messages", "sampling.max_tokens": limit, "sampling.logprobs": "top_logprobs"}
    )
    return request


def chat_messages(messages) -> list[dict]:
    """The messages as the template sees them: content joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{i}].role", f"must be a non-empty string; got {role!r}")
        message = template_tool_calls(message, f"messages[{i}]")
        out.append({**message, "content": _content(message.get("content"), f"messages[{i}].content")})
    return out


def render_chat(messages: list[dict], chat: ChatTemplate, options: RenderOptions = DEFAULT_RENDER) -> str:
    """The prompt text of ``chat_messages(...)``; a template error is a 400 on messages."""
    try:
        return chat.render(messages, options)
    except ChatTemplateError as e:
        raise invalid("messages", f"the chat template refused them: {e}") from None


def chat_ids(messages: list[dict], chat: ChatTemplate, options: RenderOptions = DEFAULT_RENDER) -> list[int]:
    """The prompt's token ids (the messages' own special-token text as plain text)."""
    try:
        return chat.token_ids(messages, options)
    except ChatTemplateError as e:
        raise invalid("messages", f"the chat template refused them: {e}") from None


def router_param(request: OpenAIRequest, router_field: str) -> str:
    """The OpenAI field behind a router validation field (``sampling.stop[1]`` -> ``stop``)."""
    name = router_field.split("[")[0]
    for prefix, param in request.params.items():
        if name == prefix or name.startswith(prefix + "."):
            return param
    return name.rsplit(".", 1)[-1]


# ---------------------------------------------------------------------- shared fields


def _common(body: dict, model_id: str, kind: str) -> OpenAIRequest:
    model = served_model(body, model_id)
    n = integer(body, "n", 1, low=1, high=MAX_N)
    stream = boolean(body, "stream", False)
    include_usage, continuous_usage = stream_options(body, stream)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    request = OpenAIRequest(
        kind,
        model,
        cpb.GenerateRequest(request_id=response_id(body, prefix, uuid.uuid4().hex)),
        stream,
        include_usage,
        rules=output_rules(body, continuous_usage),
        n=n,
        params={
            "sampling.temperature": "temperature",
            "sampling.top_p": "top_p",
            "sampling.stop": "stop",
            "speculative.num_spec_tokens": "num_spec_tokens",
        },
    )
    _set_sampling(request.generate, body)
    constraint, where = read_structured(body)
    if constraint is not None:
        constraint_to_proto(constraint, request.generate.sampling.structured)
        request.params["sampling.structured"] = where
    return request


def _set_sampling(generate: cpb.GenerateRequest, body: dict) -> None:
    sampling = generate.sampling
    sampling.temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    sampling.top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if sampling.top_p == 0:
        raise invalid("top_p", "must be in (0, 1], got 0")
    seed = integer(body, "seed", None, low=0, high=MAX_SEED)
    if seed is not None:
        sampling.seed = seed
    sampling.stop.extend(_stop(body.get("stop")))
    sampling.ignore_eos = boolean(body, "ignore_eos", False)
    top_k = integer(body, "top_k", 0, low=-1)
    sampling.top_k = max(top_k, 0)  # -1 and 0 both mean off
    sampling.min_p = number(body, "min_p", 0.0, 0.0, 1.0)
    sampling.repetition_penalty = number(body, "repetition_penalty", 1.0, 0.0, math.inf)
    if sampling.repetition_penalty == 0:
        raise invalid("repetition_penalty", "must be > 0 (1 = off), got 0")
    sampling.presence_penalty = number(body, "presence_penalty", 0.0, -2.0, 2.0)
    sampling.frequency_penalty = number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    sampling.min_tokens = integer(body, "min_tokens", 0, low=0)
    k = integer(body, "num_spec_tokens", None, low=0)
    if k is not None:
        generate.speculative.num_spec_tokens = k


def _set_prompt(generate: cpb.GenerateRequest, body: dict) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "empty")
        generate.text = prompt
    elif isinstance(prompt, list) and prompt and all(is_int(t) and 0 <= t <= MAX_UINT32 for t in prompt):
        generate.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"a batch of {len(prompt)} prompts; this server takes one prompt per request")
    else:
        raise invalid("prompt", "must be a non-empty string or a non-empty list of token ids")


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}]", 'only {"type": "text", "text": ...} parts are supported')
        texts.append(part["text"])
    return "".join(texts)


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "must be a non-empty string or a list of non-empty strings")
    return stop
