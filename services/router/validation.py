"""Client-request validation: every bad field is named, nothing reaches a worker."""

from __future__ import annotations

import math

from proto.tandem.v1 import client_pb2 as cpb
from services.grammar import check_constraint, constraint_from_proto

MAX_LOGPROBS = 20  # top alternatives per token: the engine's bound (vLLM's default max_logprobs)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI), as in the engine
MAX_STOP_STRINGS = 16  # stop strings per request, as the engine allows (OpenAI takes 4)
MAX_STOP_CHARS = 256  # characters per stop string, as the engine allows
# A text prompt is tokenized on the router's event loop, holding the GIL (16 MiB of text
# took 37 s): text longer than the context times this many characters is refused untokenized.
MAX_CHARS_PER_TOKEN = 32


class RequestError(ValueError):
    """A request field is invalid; the message starts with the field's path."""


def validate_generate(request: cpb.GenerateRequest, limits, tokenizer) -> list[int]:
    """Check a GenerateRequest against the model's limits; returns the prompt's token ids.

    An unset ``sampling.max_tokens`` (0) is filled in with the room the prompt leaves in the
    context (vLLM's default), or the server's ``default_max_tokens`` when that is smaller, so
    the workers always get an explicit value that fits (they never apply a default of their
    own to the router's requests); an explicit one over the room is refused."""
    token_ids = _prompt_ids(request, limits, tokenizer)
    if len(token_ids) >= limits.max_model_len:
        raise RequestError(
            f"prompt: {len(token_ids)} tokens leave no room in the model's "
            f"{limits.max_model_len}-token context"
        )
    room = limits.max_model_len - len(token_ids)
    if request.sampling.max_tokens > room:
        raise RequestError(
            f"sampling.max_tokens: {request.sampling.max_tokens} exceeds the {room} tokens left "
            f"in the {limits.max_model_len}-token context after the {len(token_ids)}-token prompt"
        )
    _check_kv(len(token_ids), request.sampling.max_tokens, limits.max_request_tokens)
    if limits.max_request_tokens:
        room = min(room, limits.max_request_tokens - len(token_ids))
    _check_sampling(request.sampling)
    if not request.sampling.max_tokens:
        request.sampling.max_tokens = min(limits.default_max_tokens or room, room)
    _check_min_tokens(request.sampling, request.sampling.max_tokens)
    spec = request.speculative
    if spec.HasField("num_spec_tokens") and spec.num_spec_tokens > limits.num_spec_tokens:
        raise RequestError(
            f"speculative.num_spec_tokens: {spec.num_spec_tokens} exceeds the "
            f"server's K = {limits.num_spec_tokens}"
        )
    if len(request.request_id) > 128:
        raise RequestError("request_id: at most 128 characters")
    return token_ids


def _prompt_ids(request: cpb.GenerateRequest, limits, tokenizer) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestError("prompt: set either text or token_ids")
    if kind == "text":
        if not request.text:
            raise RequestError("prompt.text: empty")
        check_text_length("prompt.text", len(request.text), limits.max_model_len)
        if tokenizer is None:
            raise RequestError("prompt.text: this router has no tokenizer; send token_ids")
        ids = tokenizer.encode_text(request.text)  # the model's BOS added; typed specials are text
        if not ids:
            raise RequestError("prompt.text: encodes to no tokens")
        if max(ids) >= limits.vocab_size:
            raise RequestError(
                f"prompt.text: the tokenizer gave id {max(ids)}, outside the "
                f"model's vocabulary [0, {limits.vocab_size})"
            )
        return ids
    ids = list(request.token_ids.ids)
    if not ids:
        raise RequestError("prompt.token_ids: empty")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt.token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return ids


def check_text_length(name: str, num_chars: int, max_model_len: int) -> None:
    """Text to tokenize is at most max_model_len * MAX_CHARS_PER_TOKEN characters."""
    cap = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > cap:
        raise RequestError(
            f"{name}: {num_chars} characters are over the router's cap of {cap} "
            f"({MAX_CHARS_PER_TOKEN} a token of the {max_model_len}-token context); send token ids"
        )


def _check_kv(prompt_len: int, max_tokens: int, kv_tokens: int) -> None:
    """Prompt plus ``max_tokens`` fit ``kv_tokens``, the most one request may hold in the
    smallest worker's KV cache (0 = unknown: nothing to check). A request over it could
    never be placed, so it is refused now rather than queued."""
    if not kv_tokens:
        return
    if prompt_len >= kv_tokens:
        raise RequestError(
            f"prompt: {prompt_len} tokens leave no room in the {kv_tokens} tokens the "
            "workers' KV cache holds for one request"
        )
    if prompt_len + max_tokens > kv_tokens:
        raise RequestError(
            f"sampling.max_tokens: {prompt_len} prompt tokens + {max_tokens} = "
            f"{prompt_len + max_tokens} exceed the {kv_tokens} tokens the workers' KV cache "
            "holds for one request"
        )


def _check_sampling(sampling: cpb.SamplingParams) -> None:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise RequestError(f"sampling.temperature: must be >= 0, got {sampling.temperature}")
    if not math.isfinite(sampling.top_p) or not 0 <= sampling.top_p <= 1:
        raise RequestError(f"sampling.top_p: must be in (0, 1] (0 reads as 1), got {sampling.top_p}")
    _check_stop(sampling.stop)
    if not math.isfinite(sampling.min_p) or not 0 <= sampling.min_p <= 1:
        raise RequestError(f"sampling.min_p: must be in [0, 1], got {sampling.min_p}")
    r = sampling.repetition_penalty
    if not math.isfinite(r) or r < 0:
        raise RequestError(f"sampling.repetition_penalty: must be > 0 (0 reads as 1), got {r}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise RequestError(f"sampling.{name}: must be in [-2, 2], got {value}")
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise RequestError(f"sampling.logprobs: at most {MAX_LOGPROBS}, got {sampling.logprobs}")
    _check_structured(sampling.structured)


def _check_structured(message: cpb.StructuredOutput) -> None:
    """A constraint that does not compile is refused here, before any worker sees it."""
    try:
        constraint = constraint_from_proto(message)
        if constraint is not None:
            check_constraint(constraint)
    except ValueError as e:  # ConstraintError, or an unknown kind
        raise RequestError(f"sampling.structured: {e}") from None


def _check_min_tokens(sampling: cpb.SamplingParams, max_tokens: int) -> None:
    if sampling.min_tokens > max_tokens:
        raise RequestError(f"sampling.min_tokens: {sampling.min_tokens} exceeds max_tokens ({max_tokens})")


def _check_stop(stop) -> None:
    """At most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise RequestError(f"sampling.stop[{i}]: empty stop string")
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"sampling.stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(s)}")
