"""A chat answer's tool calls parsed out of its text, in the model family's format.

``--tool-call-parser`` names the format (vLLM's names; none by default):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; the text before the first block is content.
- ``llama3_json`` (Llama 3.1-3.3): the answer is one JSON object ``{"name": ...,
  "parameters": {...}}`` (or several joined by ``;``), optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``;
  the text before it is content. ``[TOOL_CALLS]`` is a special token, which the output text
  skips: an answer that is a JSON list of such objects is read the same.

Two readers serve ``tool_choice`` ``required`` and a named function, whose answers a grammar
kept to JSON (openai_tools.py): ``required`` reads a list of ``{"name", "parameters"}``,
``named:<function>`` reads the function's arguments object.

A call whose JSON does not parse, or lacks a string ``name``, leaves the whole answer as
content (as vLLM does). Streamed, content passes through until a format's opening could
begin; from there the text is held, and the calls are emitted at the end.
Invariant: for any cutting of an answer into chunks, the content the stream passes joined
with :meth:`ToolCallStream.finish`'s equals :func:`parse`'s, and so do the calls.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON string (OpenAI's form)."""

    name: str
    arguments: str
    id: str = ""

    def to_json(self, index: int | None = None) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        call = {"id": self.id, "type": "function", "function": function}
        return call if index is None else {"index": index, **call}


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls means the text is all content."""
    start = opening(parser, text)
    if start < 0:
        return text, []
    calls = _calls(parser, text[start:])
    if calls is None:
        return text, []
    named = [ToolCall(c.name, c.arguments, f"chatcmpl-tool-{secrets.token_hex(8)}") for c in calls]
    return text[:start], named


def opening(parser: str, text: str) -> int:
    """Where ``text``'s tool calls begin (-1: none)."""
    if parser == "required" or parser.startswith("named:"):
        return 0  # the whole answer is the calls
    if parser == "hermes":
        return text.find(HERMES_OPEN)
    stripped = text.lstrip()
    if parser == "mistral":
        tagged = text.find(MISTRAL_OPEN)
        return tagged if tagged >= 0 else (len(text) - len(stripped) if stripped.startswith("[{") else -1)
    return len(text) - len(stripped) if stripped.startswith(("{", PYTHON_TAG)) else -1


def may_open(parser: str, text: str) -> int:
    """Where a tool call may begin in ``text`` as it streams (-1: nowhere yet): at its
    opening, or at a tail that could grow into one."""
    start = opening(parser, text)
    if start >= 0:
        return start
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    if parser == "llama3_json" or (parser == "mistral" and stripped in ("", "[")):
        held = parser == "llama3_json" and stripped and PYTHON_TAG.startswith(stripped)
        return lead if held or stripped == "[" else (len(text) if not stripped else -1)
    tag = HERMES_OPEN if parser == "hermes" else MISTRAL_OPEN
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return len(text) - n
    return -1


def _calls(parser: str, text: str) -> list[ToolCall] | None:
    """The calls from the opening on; None when any fails to parse."""
    if parser.startswith("named:"):
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [ToolCall(parser.removeprefix("named:"), json.dumps(arguments, ensure_ascii=False))]
    try:
        if parser == "required":
            objects, key = json.loads(text), "parameters"
        elif parser == "hermes":
            blocks = [b.split(HERMES_CLOSE, 1)[0] for b in text.split(HERMES_OPEN)[1:]]
            objects = [json.loads(b.strip()) for b in blocks]
            key = "arguments"
        elif parser == "mistral":
            objects = json.loads(text.removeprefix(MISTRAL_OPEN).strip())
            key = "arguments"
        else:
            body = text.strip().removeprefix(PYTHON_TAG)
            objects = [json.loads(part) for part in body.split(";") if part.strip()]
            key = "parameters"
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(objects, list) or not objects:
        return None
    calls = []
    for o in objects:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        args = o.get(key, o.get("arguments", {}))
        text_args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(o["name"], text_args))
    return calls


class ToolCallStream:
    """One streamed answer: content passes until a call may begin, then is held."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""  # the whole answer so far
        self.passed = 0  # how much of it went out as content

    def push(self, text: str) -> str:
        """The content ``text`` lets out now."""
        self.text += text
        start = may_open(self.parser, self.text)
        end = len(self.text) if start < 0 else start
        out, self.passed = self.text[self.passed : max(end, self.passed)], max(end, self.passed)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the content still held (none if calls parsed) and the calls."""
        content, calls = parse(self.parser, self.text)
        return content[self.passed :], calls
