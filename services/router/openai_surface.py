"""Every request field the OpenAI endpoints know, and what becomes of it.

Three sources: OpenAI's API, vLLM's extra parameters (what clients written for vLLM send in
``extra_body``) and Tandem's own (``num_spec_tokens``). A field is either

- honoured: openai_protocol.py / openai_extras.py parse it and it acts as documented; or
- refused (a 400 naming it, "not implemented") unless it holds its neutral value: absent
  and null are neutral, and so is the value that asks for nothing (``echo: false``,
  ``priority: 0``, ``response_format: {"type": "text"}``); or
- unknown: refused by name, as OpenAI's API refuses an unrecognized argument, so no
  vendor field is silently dropped.

docs/deploy.md lists the same table; a test checks that they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.router.openai_fields import invalid


@dataclass(frozen=True, slots=True)
class Refused:
    """A field served only at its neutral value; ``what``: the feature it would ask for."""

    neutral: Callable[[object], bool]
    what: str


HONOURED = "honoured"


def _none(v) -> bool:
    return v is None


def _false(v) -> bool:
    return v in (None, False)


def _true(v) -> bool:
    return v in (None, True)


def _empty(v) -> bool:
    return v is None or v in ({}, [], "")


def _one(v) -> bool:
    return v is None or (v == 1 and not isinstance(v, bool))


def _zero(v) -> bool:
    return v is None or (v == 0 and not isinstance(v, bool))


TOOLS = "tool calls"

_GRAMMAR_FIELDS = (  # openai_structured.py
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)

_COMMON: dict[str, str | Refused] = {
    # OpenAI
    "model": HONOURED,
    "max_tokens": HONOURED,
    "temperature": HONOURED,
    "top_p": HONOURED,
    "n": HONOURED,  # 1..MAX_N choices (openai_choices.py)
    "stream": HONOURED,
    "stream_options": HONOURED,  # its keys: STREAM_OPTIONS
    "stop": HONOURED,
    "seed": HONOURED,
    "presence_penalty": HONOURED,
    "frequency_penalty": HONOURED,
    "logprobs": HONOURED,
    "user": HONOURED,  # an end-user id for the caller's records: no effect on the answer
    "logit_bias": Refused(_empty, "logit biases"),
    # vLLM's sampling parameters
    "top_k": HONOURED,
    "min_p": HONOURED,
    "repetition_penalty": HONOURED,
    "stop_token_ids": HONOURED,
    "include_stop_str_in_output": HONOURED,
    "ignore_eos": HONOURED,
    "min_tokens": HONOURED,
    "use_beam_search": Refused(_false, "beam search"),
    "length_penalty": Refused(_one, "beam search's length penalty"),
    "skip_special_tokens": Refused(_true, "special tokens in the output text (they are always skipped)"),
    "spaces_between_special_tokens": Refused(_true, "special tokens in the output text"),
    "truncate_prompt_tokens": Refused(_none, "prompt truncation"),
    "allowed_token_ids": Refused(_none, "restricting the vocabulary"),
    "bad_words": Refused(_empty, "banned words"),
    "prompt_logprobs": Refused(_none, "prompt logprobs"),
    "logits_processors": Refused(_empty, "logits processors"),
    # vLLM's extra parameters
    "request_id": HONOURED,
    "return_tokens_as_token_ids": HONOURED,
    "return_token_ids": Refused(_false, "token ids in the response"),
    "response_format": HONOURED,  # openai_structured.py
    **dict.fromkeys(_GRAMMAR_FIELDS, HONOURED),
    "structural_tag": Refused(_none, "structural tags"),
    "priority": Refused(_zero, "priority scheduling"),
    "cache_salt": Refused(_none, "per-tenant prefix caches"),
    "kv_transfer_params": Refused(_none, "an external KV connector"),
    "vllm_xargs": Refused(_empty, "vLLM's custom extension arguments"),
    # Tandem
    "num_spec_tokens": HONOURED,
}

COMPLETION_FIELDS: dict[str, str | Refused] = {
    **_COMMON,
    "prompt": HONOURED,
    "add_special_tokens": HONOURED,
    "best_of": Refused(_one, "best-of-n sampling"),
    "echo": Refused(_false, "echoing the prompt"),
    "suffix": Refused(_empty, "insertion (a suffix)"),
    "prompt_embeds": Refused(_none, "embeddings as the prompt"),
}

CHAT_FIELDS: dict[str, str | Refused] = {
    **_COMMON,
    "messages": HONOURED,
    "max_completion_tokens": HONOURED,
    "top_logprobs": HONOURED,
    "add_generation_prompt": HONOURED,
    "continue_final_message": HONOURED,
    "chat_template_kwargs": HONOURED,
    "documents": HONOURED,
    "prompt_cache_key": HONOURED,  # a caching hint: the router routes by prompt prefix anyway
    "safety_identifier": HONOURED,  # an end-user id, like ``user``
    "tools": HONOURED,  # rendered by the template; calls parsed by --tool-call-parser
    "tool_choice": HONOURED,  # auto, none, required, a named function (openai_tools.py)
    "parallel_tool_calls": HONOURED,
    "functions": Refused(_empty, TOOLS),
    "function_call": Refused(lambda v: v in (None, "none"), TOOLS),
    "best_of": Refused(_one, "best-of-n sampling"),
    "echo": Refused(_false, "echoing the last message"),
    "add_special_tokens": Refused(_false, "special tokens added on top of the chat template's"),
    "chat_template": Refused(_none, "a chat template sent with the request (start with --chat-template)"),
    "mm_processor_kwargs": Refused(_empty, "multimodal inputs"),
    "audio": Refused(_none, "audio output"),
    "modalities": Refused(lambda v: v is None or v == ["text"], "output other than text"),
    "prediction": Refused(_none, "predicted outputs"),
    "reasoning_effort": Refused(_none, "a reasoning effort (use chat_template_kwargs)"),
    "verbosity": Refused(_none, "a verbosity"),
    "web_search_options": Refused(_none, "web search"),
    "service_tier": Refused(lambda v: v in (None, "auto", "default"), "service tiers"),
    "store": Refused(_false, "storing completions"),
    "metadata": Refused(_empty, "stored completions' metadata"),
}

STREAM_OPTIONS: dict[str, str | Refused] = {
    "include_usage": HONOURED,
    "continuous_usage_stats": HONOURED,
    "include_obfuscation": Refused(_false, "obfuscation padding"),
}


# /tokenize (a prompt or messages) and /detokenize, as vLLM's
TOKENIZE_PROMPT_FIELDS: dict[str, str | Refused] = dict.fromkeys(
    ("model", "prompt", "add_special_tokens", "return_token_strs"), HONOURED
)
TOKENIZE_CHAT_FIELDS: dict[str, str | Refused] = {
    **dict.fromkeys(("model", "messages", "return_token_strs"), HONOURED),
    **{k: CHAT_FIELDS[k] for k in ("add_generation_prompt", "continue_final_message", "documents")},
    **{k: CHAT_FIELDS[k] for k in ("chat_template_kwargs", "add_special_tokens", "chat_template")},
    **{k: CHAT_FIELDS[k] for k in ("tools", "mm_processor_kwargs")},
}
DETOKENIZE_FIELDS: dict[str, str | Refused] = dict.fromkeys(("model", "tokens"), HONOURED)


def check_fields(body: dict, fields: dict[str, str | Refused], prefix: str = "") -> None:
    """A 400 naming the first field of ``body`` that ``fields`` does not know, or refuses
    at a value other than its neutral one."""
    for name, value in body.items():
        rule = fields.get(name)
        param = prefix + name
        if rule is None:
            raise invalid(param, "unrecognized request argument (docs/deploy.md lists the fields served)")
        if isinstance(rule, Refused) and not rule.neutral(value):
            raise invalid(param, f"not implemented by this server: {rule.what}")
