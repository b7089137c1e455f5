"""Stop conditions, applied token by token as a step's tokens are appended."""

from __future__ import annotations

from services.engine.request import Request
from services.engine.tokenizer import ByteTokenizer


def append_tokens(req: Request, token_ids: list[int], tokenizer: ByteTokenizer,
                  eos_ids: frozenset[int]) -> list[int]:
    """Append tokens until one finishes the request; returns those appended. Sets
    ``finish_reason`` ("stop" or "length") and, for a stop string, ``stop_text_len``."""
    sp = req.sampling
    appended = []
    for t in token_ids:
        req.output_ids.append(t)
        appended.append(t)
        if (t in eos_ids and not sp.ignore_eos) or t in sp.stop_token_ids:
            req.finish_reason = "stop"
        elif sp.stop and _match_stop_string(req, tokenizer):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= sp.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            break
    return appended


def _match_stop_string(req: Request, tokenizer: ByteTokenizer) -> bool:
    """Searches only the text that the newest token can have completed."""
    text = tokenizer.decode(req.output_ids)
    longest = max(len(s) for s in req.sampling.stop)
    tail_start = max(0, len(text) - longest - 4)
    hits = [i for s in req.sampling.stop if (i := text.find(s, tail_start)) >= 0]
    if not hits:
        return False
    req.stop_text_len = min(hits)
    return True


def output_text(req: Request, tokenizer: ByteTokenizer) -> str:
    text = tokenizer.decode(req.output_ids)
    return text if req.stop_text_len is None else text[:req.stop_text_len]
