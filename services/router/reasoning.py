"""A chat answer's reasoning split from its content: ``<think>...</think>`` -> reasoning_content.

``--reasoning-parser`` names the model family's rule (vLLM's names; none by default, and
then the text is left as it is):

- ``qwen3``: an answer that opens with ``<think>`` reasons up to ``</think>``; the rest is
  content. One that does not open with it is all content (Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}``).
- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the answer starts in
  reasoning (a leading ``<think>`` is dropped) up to ``</think>``; the rest is content.

The tags themselves are in neither part. A ``</think>`` that never comes (max_tokens reached
mid-thought) leaves all after the opening as reasoning. Streamed, tags may arrive cut across
chunks: a tail that may begin a tag is held until the next chunk or the end.
Invariant: for any cutting of a text into chunks, the pushes joined with the flush equal
``split(text)``.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> whether the answer starts in reasoning
_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class ReasoningSplitter:
    """One answer's text, split as it streams in (see the module doc)."""

    def __init__(self, parser: str) -> None:
        self.starts_reasoning = PARSERS[parser]
        self.state = _OPENING
        self.held = ""  # a tail that may begin the tag the current state waits for

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) ``text`` adds now."""
        buffer, self.held = self.held + text, ""
        if self.state == _OPENING:
            if START.startswith(buffer):  # still possibly the opening tag (or nothing yet)
                self.held = buffer
                return "", ""
            opened = buffer.startswith(START)
            buffer = buffer.removeprefix(START)
            self.state = _REASONING if opened or self.starts_reasoning else _CONTENT
        if self.state == _CONTENT:
            return "", buffer
        reasoning, end, content = buffer.partition(END)
        if end:
            self.state = _CONTENT
            return reasoning, content
        keep = _tag_prefix_length(buffer, END)
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], ""

    def flush(self) -> tuple[str, str]:
        """At the end: the held text, as what it turned out to be."""
        held, self.held = self.held, ""
        if self.state == _REASONING or (self.state == _OPENING and self.starts_reasoning):
            return held.removeprefix(START), ""
        return "", held if held != START else ""


def split(parser: str, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = ReasoningSplitter(parser)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2


def _tag_prefix_length(text: str, tag: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
