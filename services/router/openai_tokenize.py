"""``/tokenize`` and ``/detokenize`` in vLLM's shapes.

- ``/tokenize`` takes ``{"model", "prompt"}`` (``add_special_tokens``, default true: the
  model's BOS, as a completion's prompt gets it) or ``{"model", "messages"}`` (rendered as
  a chat request's, with its template fields) and answers ``{"count", "max_model_len",
  "tokens", "token_strs"}``: the token ids a completion or chat request would send, and with
  ``return_token_strs`` the vocabulary's piece of each (else null).
- ``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``: their text with
  the special tokens kept (as vLLM's).

``model`` is optional (as vLLM's); another model's id is a 404. Text is capped as a
prompt's (validation.check_text_length).
"""

from __future__ import annotations

from services.router.chat_template import ChatTemplate
from services.router.openai_extras import render_options
from services.router.openai_fields import MAX_UINT32, as_object, boolean, invalid, is_int, served_model
from services.router.openai_protocol import chat_ids, chat_messages
from services.router.openai_surface import (
    DETOKENIZE_FIELDS,
    TOKENIZE_CHAT_FIELDS,
    TOKENIZE_PROMPT_FIELDS,
    check_fields,
)
from services.router.validation import RequestError, check_text_length
from services.tokenization.tokenizer import Tokenizer


def tokenize(
    body, model_id: str, max_model_len: int, tokenizer: Tokenizer, chat: ChatTemplate | None
) -> dict:
    """The answer to a /tokenize body."""
    body = as_object(body)
    chat_form = "messages" in body
    check_fields(body, TOKENIZE_CHAT_FIELDS if chat_form else TOKENIZE_PROMPT_FIELDS)
    served_model(body, model_id, required=False)
    if chat_form:
        ids = _chat_tokens(body, chat, max_model_len)
    else:
        ids = _prompt_tokens(body, tokenizer, max_model_len)
    strs = (
        [tokenizer.backend.id_to_token(t) for t in ids] if boolean(body, "return_token_strs", False) else None
    )
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, model_id: str, vocab_size: int, tokenizer: Tokenizer) -> dict:
    """The answer to a /detokenize body."""
    body = as_object(body)
    check_fields(body, DETOKENIZE_FIELDS)
    served_model(body, model_id, required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t <= MAX_UINT32 for t in tokens):
        raise invalid("tokens", "must be a list of token ids")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise invalid("tokens", f"id {bad} is outside the vocabulary [0, {vocab_size})")
    return {"prompt": tokenizer.backend.decode(tokens, skip_special_tokens=False)}


def _prompt_tokens(body: dict, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be a string (or send messages)")
    _cap("prompt", prompt, max_model_len)
    return tokenizer.encode_text(prompt, add_special_tokens=boolean(body, "add_special_tokens", True))


def _chat_tokens(body: dict, chat: ChatTemplate | None, max_model_len: int) -> list[int]:
    if chat is None:
        raise invalid("messages", "no chat template is configured for this model")
    messages = chat_messages(body.get("messages"))
    _cap("messages", "".join(m["content"] for m in messages), max_model_len)
    return chat_ids(messages, chat, render_options(body))


def _cap(name: str, text: str, max_model_len: int) -> None:
    try:
        check_text_length(name, len(text), max_model_len)
    except RequestError as e:
        raise invalid(name, str(e).partition(": ")[2]) from None
