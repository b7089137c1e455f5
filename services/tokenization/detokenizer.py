"""Incremental detokenization: text as tokens arrive, equal in the end to ``decode(ids)``.

vLLM's prefix/read offset scheme: ``ids[prefix_offset:read_offset]`` is a short window of
tokens whose text was already emitted; each push decodes that window plus the new tokens
and emits what the new tokens add. The offsets move on only when the added text is
complete: text that ends in U+FFFD (an incomplete multi-byte character) or in a ByteFallback
``<0xXX>`` piece (whose run decodes as a whole, so later pieces may still change it) is
held back, so no chunk ends inside a character. ``flush`` emits what is
still held at the end (an invalid sequence that never completed stays U+FFFD, as
``decode`` gives it). Invariant: ``"".join(pushes) + flush() == tokenizer.decode(ids)``
(the tests check it on byte-level and BPE vocabularies). Special tokens are skipped.
"""

from __future__ import annotations

from services.tokenization.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decoded window
        self.read_offset = 0  # ids before it have had their text emitted
        self._emitted: list[str] = []  # everything emitted so far, in pieces (``text`` joins them)
        self._text = ""  # "".join(self._emitted[: self._joined])
        self._joined = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._held = ""  # text the ids after read_offset add so far (ends in U+FFFD)

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        window = self.tokenizer.decode(self.ids[self.prefix_offset :])
        added = window[len(self._prefix_text) :]
        if not added or added.endswith(REPLACEMENT) or self._in_byte_run:
            self._held = added
            return ""
        self._prefix_text = self.tokenizer.decode(self.ids[self.read_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._held = ""
        self._emitted.append(added)
        return added

    @property
    def text(self) -> str:
        """Everything emitted so far. Joined when read, so a reader that never asks (the
        router streams what ``push`` returns) pays nothing per token for a long output."""
        if self._joined < len(self._emitted):
            self._text += "".join(self._emitted[self._joined :])
            self._joined = len(self._emitted)
        return self._text

    @property
    def stable_text(self) -> str:
        """The emitted text plus the held text up to its trailing U+FFFD run: what later
        tokens can no longer change (stop strings are matched on it)."""
        return self.text + ("" if self._in_byte_run else self._held.rstrip(REPLACEMENT))

    @property
    def _in_byte_run(self) -> bool:
        return bool(self.ids) and self.ids[-1] in self.tokenizer.byte_piece_ids

    def flush(self) -> str:
        """At the end of the request: the held text, as ``decode`` renders it."""
        rest, self._held = self._held, ""
        self._emitted.append(rest)
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = ""
        return rest
