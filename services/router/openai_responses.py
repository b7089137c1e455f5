"""OpenAI response bodies (JSON and SSE) built from tandem.v1 messages.

``usage`` carries OpenAI's counts plus Tandem's own under the vendor key ``tandem``:
acceptance length (tokens per target forward in decode), drafts, draft and accepted
tokens, cached prompt tokens per layer group, and the KV bytes and seconds moved per
group from the prefill to the decode worker (empty in aggregated serving).

``logprobs`` (when asked for) take OpenAI's shapes: completions ``{tokens, token_logprobs,
top_logprobs, text_offset}`` (each top_logprobs entry maps the chosen token and the top-N
to their logprobs), chat ``{content: [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}]}``. Token strings are ``decode([id])``; logprobs below -9999 (or -inf)
read -9999, as vLLM sends them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from proto.tandem.v1 import client_pb2 as cpb
from services.router.chat_answer import finish_name
from services.router.tool_calls import ToolCall

FINISH_REASONS = {
    cpb.FINISH_REASON_STOP: "stop",
    cpb.FINISH_REASON_LENGTH: "length",
    cpb.FINISH_REASON_ABORT: "abort",
    cpb.FINISH_REASON_ERROR: "error",
}
DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0
Decode = Callable[[list[int]], str]


def sse(payload: dict) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def usage_json(usage: cpb.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "tandem": {
            "acceptance_length": round(usage.acceptance_length, 6),
            "num_drafts": usage.num_drafts,
            "num_draft_tokens": usage.num_draft_tokens,
            "num_accepted_tokens": usage.num_accepted_tokens,
            "cached_tokens_per_group": {g.group: g.num_tokens for g in usage.cached_tokens_per_group},
            "transfer_bytes": {t.group: t.num_bytes for t in usage.transfers},
            "transfer_seconds": {t.group: t.seconds for t in usage.transfers},
        },
    }


def finish_reason(reason: int) -> str | None:
    return FINISH_REASONS.get(reason)


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(entries: Sequence[cpb.TokenLogprobs], decode: Decode, offset: int = 0) -> dict:
    """Completions' logprobs of ``entries``; ``offset``: text_offset of the first token."""
    tokens = [decode([e.token_id]) for e in entries]
    top = []
    for e, token in zip(entries, tokens, strict=True):
        alternatives = {token: _lp(e.logprob)}
        for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True):
            alternatives.setdefault(decode([t]), _lp(lp))
        top.append(alternatives)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[cpb.TokenLogprobs], decode: Decode) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = decode([token_id])
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {
                **item(e.token_id, e.logprob),
                "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)],
            }
            for e in entries
        ]
    }


def completion_json(
    rid: str, created: int, model: str, text: str, reason: int, usage: cpb.Usage, logprobs: dict | None = None
) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_json(usage),
    }


def chat_json(
    rid: str, created: int, model: str, text: str, reason: int, usage: cpb.Usage, logprobs: dict | None = None
) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_json(usage),
    }


def reasoning_message(reasoning: str, content: str) -> dict:
    """A chat answer's message under a reasoning parser: an empty part is null (as vLLM's)."""
    return {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None}


class StreamChunks:
    """The SSE events of one streamed completion or chat, all with one id and time."""

    def __init__(self, kind: str, rid: str, created: int, model: str, decode: Decode | None = None) -> None:
        """``decode``: token strings for logprobs (needed only when chunks carry them)."""
        self.index = 0  # the choice's index (n > 1: one StreamChunks per choice)
        self.final_usage: cpb.Usage | None = None  # the usage its complete message brought
        self.chat = kind == "chat"
        self.decode = decode
        self.offset = 0  # completions' text_offset of the next token
        self.running: list[int] | None = None  # [prompt, completion] tokens: see count_usage
        self.head = {
            "id": rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }

    def count_usage(self, prompt_tokens: int) -> None:
        """Every chunk from now on carries the usage so far (vLLM's continuous_usage_stats);
        ``tokens`` advances its completion count."""
        self.running = [prompt_tokens, 0]

    def tokens(self, n: int) -> None:
        if self.running is not None:
            self.running[1] += n

    def role(self) -> bytes:
        """A chat stream opens with the assistant's role and no text."""
        return self._choice({"delta": {"role": "assistant", "content": ""}})

    def text(
        self, text: str, logprobs: Sequence[cpb.TokenLogprobs] = (), reasoning: str | None = None
    ) -> bytes:
        """A text delta, with the logprobs of the chunk's tokens when there are any; chat's
        ``reasoning`` (from a reasoning parser) goes in ``reasoning_content``, and then the
        delta has ``content`` only when there is some."""
        lp = None
        if logprobs and self.chat:
            lp = chat_logprobs(logprobs, self.decode)
        elif logprobs:
            lp = completion_logprobs(logprobs, self.decode, self.offset)
            self.offset += sum(len(t) for t in lp["tokens"])
        if not self.chat:
            return self._choice({"text": text}, logprobs=lp)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if text or not reasoning:
            delta["content"] = text
        return self._choice({"delta": delta}, logprobs=lp)

    def tool_calls(self, calls: Sequence[ToolCall]) -> bytes:
        """A chat delta with the answer's tool calls, whole (the SDKs join deltas by index)."""
        return self._choice({"delta": {"tool_calls": [c.to_json(i) for i, c in enumerate(calls)]}})

    def finish(self, reason: int, made_calls: bool = False) -> bytes:
        name = finish_name(finish_reason(reason), made_calls)
        return self._choice({"delta": {}} if self.chat else {"text": ""}, name)

    def usage(self, usage: cpb.Usage) -> bytes:
        """The last chunk under ``stream_options.include_usage``: no choices, only usage."""
        return sse({**self.head, "choices": [], "usage": usage_json(usage)})

    def _choice(self, body: dict, reason: str | None = None, logprobs: dict | None = None) -> bytes:
        choice = {"index": self.index, **body, "logprobs": logprobs, "finish_reason": reason}
        event = {**self.head, "choices": [choice]}
        if self.running is not None:
            prompt, completion = self.running
            event["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return sse(event)


def error_json(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
