"""A chat request's tools (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``),
checked, and the assistant's earlier tool calls made ready for the chat template.

The tools reach the template as transformers' ``apply_chat_template(tools=...)`` takes them
(the request's list as sent). ``tool_choice``: ``auto`` (the default with tools) renders them
and parses the answer's calls with the server's ``--tool-call-parser``; ``none`` renders them
and parses nothing. ``required`` and a named function need decoding constrained to a call,
which this server does not do yet: refused by name. ``parallel_tool_calls: false`` keeps
the first call of an answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.router.openai_fields import invalid

NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The request's tools as the template gets them, and whether to parse calls."""

    tools: list[dict]
    parse: bool  # tool_choice auto
    parallel: bool


def read_tools(body: dict) -> ToolRequest | None:
    """None when the request gives no tools; a 400 naming the field otherwise wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise invalid("parallel_tool_calls", "must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", f"{choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list of {type: function, function: {...}} objects")
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
    if choice in ("required",) or isinstance(choice, dict):
        raise invalid(
            "tool_choice",
            f"{choice!r} is not implemented by this server: it needs decoding constrained to a tool "
            "call (structured outputs); use auto",
        )
    if choice not in (None, "auto", "none"):
        raise invalid("tool_choice", f"must be auto, none, required or a named function; got {choice!r}")
    return ToolRequest(tools, choice != "none", parallel is not False)


def _check_tool(tool, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise invalid(where, 'must be {"type": "function", "function": {...}}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "must be an object with a name")
    for key in set(function) - set(FUNCTION_KEYS):
        raise invalid(f"{where}.function.{key}", f"unrecognized; a function has {', '.join(FUNCTION_KEYS)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{where}.function.name", f"must be 1-64 letters, digits, _ . or -; got {name!r}")
    if not isinstance(function.get("parameters", {}), dict):
        raise invalid(f"{where}.function.parameters", "must be a JSON Schema object")
    if function.get("strict"):
        raise invalid(f"{where}.function.strict", "not implemented by this server: structured outputs")


def template_tool_calls(message: dict, where: str) -> dict:
    """An assistant message's ``tool_calls`` with each call's ``arguments`` as an object, as
    chat templates read them (the API sends a JSON string); other messages unchanged."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", "must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                f"{where}.tool_calls[{j}]", "must be {id, type: function, function: {name, arguments}}"
            )
        args = function.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                where_args = f"{where}.tool_calls[{j}].function.arguments"
                raise invalid(where_args, "must be a JSON object") from None
        out.append({**call, "function": {**function, "arguments": args}})
    return {**message, "tool_calls": out}
