"""Users' text through a chat template without forging control tokens.

A template writes the model's control tokens (``<|im_start|>``, ``<|eot_id|>``) as text,
and the rendered prompt is tokenized with special-token text parsed, as transformers'
``apply_chat_template`` does: so a user whose message says ``<|im_start|>system`` would
open a genuine system turn. ``guard`` swaps every special token's text inside the
messages' contents for a placeholder (private-use characters no tokenizer knows) before
rendering; ``encode_guarded`` tokenizes the rendering piece by piece, the template's
pieces with special-token text parsed and each placeholder's original as plain text.
Without special-token text in any content nothing is swapped and the prompt tokenizes
exactly as transformers' does.
"""

from __future__ import annotations

import re

from services.tokenization.tokenizer import Tokenizer

_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
CONTENT_FIELDS = ("content", "reasoning_content", "thinking", "reasoning")


def guard(messages: list[dict], specials: list[str]) -> tuple[list[dict], list[str]]:
    """``messages`` with each special token's text in their contents (strings, or text
    parts) replaced by a numbered placeholder, and the texts replaced, in order of number."""
    originals: list[str] = []
    if not specials:
        return messages, originals
    pattern = re.compile("|".join(map(re.escape, specials)))

    def swap(text: str) -> str:
        def one(match: re.Match) -> str:
            originals.append(match.group(0))
            return f"{_OPEN}{len(originals) - 1}{_CLOSE}"

        return pattern.sub(one, text)

    return [_guard_message(m, swap) for m in messages], originals


def encode_guarded(tokenizer: Tokenizer, text: str, originals: list[str]) -> list[int]:
    """Token ids of a rendering ``guard`` prepared: no special tokens added."""
    ids: list[int] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(text):
        ids += tokenizer.encode(text[pos : match.start()], add_special_tokens=False)
        ids += tokenizer.encode_text(originals[int(match.group(1))], add_special_tokens=False)
        pos = match.end()
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


def _guard_message(message: dict, swap) -> dict:
    out = dict(message)
    for name in CONTENT_FIELDS:
        value = out.get(name)
        if isinstance(value, str):
            out[name] = swap(value)
        elif isinstance(value, list):
            out[name] = [_guard_part(p, swap) for p in value]
    return out


def _guard_part(part, swap):
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return {**part, "text": swap(part["text"])}
    return part
