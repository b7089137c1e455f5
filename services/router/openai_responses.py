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


def completion_chunk(rid: str, created: int, model: str, text: str,
                     reason: int | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": None if reason is None else finish_reason(reason)}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_chunk(rid: str, created: int, model: str, delta: dict,
               reason: int | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None,
              "finish_reason": None if reason is None else finish_reason(reason)}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: cpb.Usage) -> dict:
    """The last chunk under ``stream_options.include_usage``: no choices, only usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_json(usage)}


def error_json(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
