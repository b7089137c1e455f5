"""A chat request's tools (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``),
checked, and the assistant's earlier tool calls made ready for the chat template.

The tools reach the template as transformers' ``apply_chat_template(tools=...)`` takes them
(the request's list as sent). ``tool_choice``: ``auto`` (the default with tools) renders them
and parses the answer's calls with the server's ``--tool-call-parser``; ``none`` renders them
and parses nothing. ``required`` and a named function constrain the answer (as vLLM does):
to a JSON list of ``{"name", "parameters"}`` calls of the given tools, or to the named
function's parameters, by a JSON-schema grammar; the answer is then the calls, whatever
the server's parser. ``parallel_tool_calls: false`` keeps the first call of an answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.grammar import Constraint
from services.router.openai_fields import invalid

NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The request's tools as the template gets them, and whether to parse calls."""

    tools: list[dict]
    parse: bool  # tool_choice auto, required or named: the answer's calls are read
    parallel: bool
    forced: str = ""  # "required", or the named function's name; "" = auto or none

    @property
    def parser(self) -> str:
        """tool_calls.py's reader of a forced answer ("" when the server's parser reads)."""
        return "" if not self.forced else "required" if self.forced == "required" else f"named:{self.forced}"

    def constraint(self) -> Constraint:
        """The JSON schema a forced answer keeps to: the named function's parameters, or a
        non-empty list of ``{"name": <a tool>, "parameters": <its schema>}`` (of one call
        without parallel tool calls)."""
        schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools
        }
        if self.forced != "required":
            return Constraint("json_schema", json.dumps(schemas[self.forced]))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:  # one call: the list ends after it
            schema["maxItems"] = 1
        return Constraint("json_schema", json.dumps(schema))


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
    if isinstance(choice, dict):
        return ToolRequest(tools, True, parallel is not False, _named(choice, tools))
    if choice not in (None, "auto", "none", "required"):
        raise invalid("tool_choice", f"must be auto, none, required or a named function; got {choice!r}")
    return ToolRequest(
        tools, choice != "none", parallel is not False, "required" if choice == "required" else ""
    )


def _named(choice: dict, tools: list[dict]) -> str:
    """The name of ``{"type": "function", "function": {"name": ...}}``, one of ``tools``."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice.function.name", f"{name!r} is not one of the request's tools")
    return name


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
