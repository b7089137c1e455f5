"""Stop conditions, applied token by token as a step's tokens are appended.

Stop strings are matched on the request's incrementally decoded text (see detokenizer.py),
so a stop string spanning tokens is found as soon as its last character is complete. The
output text ends before the first match; the router's StopTrimmer cuts streamed text at
the same place.
"""

from __future__ import annotations

from services.engine.request import Request
from services.tokenization.detokenizer import Detokenizer


def append_tokens(
    req: Request, token_ids: list[int], detok: Detokenizer | None, eos_ids: frozenset[int]
) -> list[int]:
    """Append tokens until one finishes the request; returns those appended. Sets
    ``finish_reason`` ("stop" or "length") and, for a stop string, ``stop_text_len``.
    ``detok``: the request's text so far, which stop strings need; None when nobody reads
    the text and the request has no stop strings."""
    sp = req.sampling
    appended = []
    for t in token_ids:
        req.output_ids.append(t)
        appended.append(t)
        searched = len(detok.stable_text) if sp.stop else 0
        if sp.stop:
            detok.push([t])
        stoppable = len(req.output_ids) > sp.min_tokens  # min_tokens: the first never stop
        if stoppable and ((t in eos_ids and not sp.ignore_eos) or t in sp.stop_token_ids):
            req.finish_reason = "stop"
        elif stoppable and sp.stop and _match_stop_string(req, detok.stable_text, searched):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= sp.max_tokens:
            req.finish_reason = "length"
        if not stoppable and sp.stop:  # a stop string must begin after their text
            req.stop_search_floor = len(detok.stable_text)
        if req.finish_reason is not None:
            break
    if not sp.stop and detok is not None:
        detok.push(appended)
    return appended


def _match_stop_string(req: Request, text: str, searched: int) -> bool:
    """Searches only matches that end past ``searched`` (the text seen before this token)."""
    longest = max(len(s) for s in req.sampling.stop)
    tail_start = max(req.stop_search_floor, searched - longest + 1)
    hits = [i for s in req.sampling.stop if (i := text.find(s, tail_start)) >= 0]
    if not hits:
        return False
    req.stop_text_len = min(hits)
    return True


def output_text(req: Request, detok: Detokenizer, finished: bool) -> str:
    """The output's text so far: the detokenizer's (flushed once finished), cut before a
    matched stop string."""
    text = detok.text + detok.flush() if finished else detok.text
    return text if req.stop_text_len is None else text[: req.stop_text_len]
