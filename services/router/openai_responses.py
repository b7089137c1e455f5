"""OpenAI response bodies (JSON and SSE) built from tandem.v1 messages.

``usage`` carries OpenAI's counts plus Tandem's own under the vendor key ``tandem``:
acceptance length (tokens per target forward in decode), drafts, draft and accepted
tokens, cached prompt tokens per layer group, and the KV bytes and seconds moved per
group from the prefill to the decode worker (empty in aggregated serving).
"""

from __future__ import annotations

import json

from proto.tandem.v1 import client_pb2 as cpb

FINISH_REASONS = {cpb.FINISH_REASON_STOP: "stop", cpb.FINISH_REASON_LENGTH: "length",
                  cpb.FINISH_REASON_ABORT: "abort", cpb.FINISH_REASON_ERROR: "error"}
DONE = b"data: [DONE]\n\n"


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
            "cached_tokens_per_group": {g.group: g.num_tokens
                                        for g in usage.cached_tokens_per_group},
            "transfer_bytes": {t.group: t.num_bytes for t in usage.transfers},
            "transfer_seconds": {t.group: t.seconds for t in usage.transfers},
        },
    }


def finish_reason(reason: int) -> str | None:
    return FINISH_REASONS.get(reason)


def completion_json(rid: str, created: int, model: str, text: str, reason: int,
                    usage: cpb.Usage) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_json(usage)}


def chat_json(rid: str, created: int, model: str, text: str, reason: int,
              usage: cpb.Usage) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish_reason(reason)}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_json(usage)}


class StreamChunks:
    """The SSE events of one streamed completion or chat, all with one id and time."""

    def __init__(self, kind: str, rid: str, created: int, model: str) -> None:
        self.chat = kind == "chat"
        self.head = {"id": rid, "object": "chat.completion.chunk" if self.chat
                     else "text_completion", "created": created, "model": model}

    def role(self) -> bytes:
        """A chat stream opens with the assistant's role and no text."""
        return self._choice({"delta": {"role": "assistant", "content": ""}})

    def text(self, text: str) -> bytes:
        return self._choice({"delta": {"content": text}} if self.chat else {"text": text})

    def finish(self, reason: int) -> bytes:
        return self._choice({"delta": {}} if self.chat else {"text": ""}, finish_reason(reason))

    def usage(self, usage: cpb.Usage) -> bytes:
        """The last chunk under ``stream_options.include_usage``: no choices, only usage."""
        return sse({**self.head, "choices": [], "usage": usage_json(usage)})

    def _choice(self, body: dict, reason: str | None = None) -> bytes:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": reason}
        return sse({**self.head, "choices": [choice]})


def error_json(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
