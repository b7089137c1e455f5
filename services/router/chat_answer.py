"""How a chat answer's text becomes its message: the reasoning split off
(``--reasoning-parser``, reasoning.py), then tool calls parsed out of the content
(``--tool-call-parser`` when the request's ``tool_choice`` is auto, tool_calls.py).

Streamed or whole, the same: ``push`` each chunk's text, ``finish`` at the end. The message
has ``reasoning_content`` under a reasoning parser and ``tool_calls`` when the answer made
calls; its ``content`` is then null when empty (blank, beside calls), as vLLM's, and the
text as it came otherwise. An answer that made calls and stopped by itself finishes with ``tool_calls``.
"""

from __future__ import annotations

from services.router.reasoning import ReasoningSplitter
from services.router.tool_calls import ToolCall, ToolCallStream


class ChatAnswer:
    """One chat answer's text, split as it streams in."""

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", parallel: bool = True) -> None:
        """Empty parser names: that part is off."""
        self.splitter = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.calls = ToolCallStream(tool_parser) if tool_parser else None
        self.parallel = parallel

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) ``text`` lets out now."""
        reasoning, content = self.splitter.push(text) if self.splitter else ("", text)
        return reasoning, self.calls.push(content) if self.calls else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """What was held: (reasoning, content, the answer's tool calls)."""
        reasoning, content = self.splitter.flush() if self.splitter else ("", "")
        if self.calls is None:
            return reasoning, content, []
        content = self.calls.push(content)
        rest, calls = self.calls.finish()
        return reasoning, content + rest, calls if self.parallel else calls[:1]

    def message(self, text: str) -> dict:
        """The whole answer's message (this answer not pushed before)."""
        r1, c1 = self.push(text)
        r2, c2, calls = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        message = {"role": "assistant", "content": content}
        if self.splitter is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
        if calls:
            message["content"] = content if content.strip() else None
        elif self.splitter is not None:
            message["content"] = content or None
        return message


def finish_name(reason: str | None, calls: list[ToolCall] | dict | None) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` for an answer that made calls and stopped."""
    return "tool_calls" if calls and reason == "stop" else reason
