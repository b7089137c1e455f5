"""vLLM's extra request fields that the OpenAI layer honours itself, beyond tandem.v1's.

- ``stop_token_ids``: the workers do not take them, so the OpenAI layer ends the output at
  the first one (openai_output.py): the token counts in ``completion_tokens`` and its text
  is left out unless ``include_stop_str_in_output``; the worker's request is aborted and
  the finish reason is "stop". vLLM masks them before ``min_tokens``, which the workers
  cannot do, so the two together are refused.
- ``include_stop_str_in_output``: the matched stop string (or stop token's text) stays in
  the text.
- ``stream_options.continuous_usage_stats``: every streamed chunk carries the usage so far.
- ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>``.
- ``request_id``: the response's id is ``cmpl-<request_id>`` / ``chatcmpl-<request_id>``.
- Chat: ``add_generation_prompt`` (default true), ``continue_final_message`` (default false;
  only with ``add_generation_prompt: false``, as vLLM), ``documents`` and
  ``chat_template_kwargs`` reach the chat template (chat_template.RenderOptions).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.chat_template import RenderOptions
from services.router.openai_fields import MAX_UINT32, boolean, invalid, is_int
from services.router.openai_surface import STREAM_OPTIONS, check_fields
from services.router.openai_tools import read_tools

# template variables a request sets through its own fields, never chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = ("messages", "documents", "add_generation_prompt", "continue_final_message")


@dataclass(frozen=True, slots=True)
class OutputRules:
    """What the OpenAI layer does to a request's output (see the module doc)."""

    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str: bool = False
    continuous_usage: bool = False
    token_ids_as_text: bool = False  # return_tokens_as_token_ids

    @property
    def own_text(self) -> bool:
        """Whether the OpenAI layer detokenizes the output itself (the router's text, cut
        before stop strings at token boundaries it does not know, would not do)."""
        return bool(self.stop_token_ids) or self.include_stop_str


def output_rules(body: dict, continuous_usage: bool) -> OutputRules:
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t <= MAX_UINT32 for t in stop_ids):
        raise invalid("stop_token_ids", "must be a list of token ids (non-negative integers)")
    if stop_ids and body.get("min_tokens"):
        raise invalid(
            "stop_token_ids",
            "not implemented together with min_tokens (the stop tokens would have to be masked "
            "until min_tokens); send one of them",
        )
    return OutputRules(
        frozenset(stop_ids),
        boolean(body, "include_stop_str_in_output", False),
        continuous_usage,
        boolean(body, "return_tokens_as_token_ids", False),
    )


def stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``stream_options``' (include_usage, continuous_usage_stats)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    check_fields(options, STREAM_OPTIONS, "stream_options.")
    return (
        boolean(options, "include_usage", False, "stream_options.include_usage"),
        boolean(options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats"),
    )


def response_id(body: dict, prefix: str, fresh: str) -> str:
    """``prefix`` + the client's ``request_id``, else + ``fresh``."""
    rid = body.get("request_id")
    if rid is None:
        return prefix + fresh
    if not isinstance(rid, str) or not rid:
        raise invalid("request_id", "must be a non-empty string")
    return prefix + rid


def render_options(body: dict) -> RenderOptions:
    """The chat template's options of a chat request."""
    add = boolean(body, "add_generation_prompt", True)
    cont = boolean(body, "continue_final_message", False)
    if add and cont:
        raise invalid("continue_final_message", "needs add_generation_prompt: false (as vLLM)")
    tools = read_tools(body)
    return RenderOptions(
        add, cont, _documents(body.get("documents")), tools.tools if tools else None, _template_kwargs(body)
    )


def _documents(documents) -> list[dict] | None:
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise invalid("documents", "must be a list of objects (e.g. {title, text})")
    return documents


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "must be an object of template variables")
    if "tools" in kwargs:
        raise invalid("chat_template_kwargs.tools", "give tools in the request's tools field")
    for name in RESERVED_TEMPLATE_VARIABLES:
        if name in kwargs:
            raise invalid(
                f"chat_template_kwargs.{name}", "set by the request itself, not a template variable"
            )
    return kwargs
