"""Request bodies as JSON, refusing what parses but is not text: every failure is a
``JsonError`` whose ``param`` names where (``body``, or the path of a bad string)."""

from __future__ import annotations

import json
import re

# what a lone surrogate can come from: a \uDxxx escape, its UTF-8-like bytes (the parser
# decodes with surrogatepass), or a UTF-16/32 body; only such bodies are walked
_MAYBE_SURROGATE = re.compile(rb"\\u[dD]|\xed|\x00")


class JsonError(ValueError):
    """The body is not acceptable JSON; ``param`` is ``body`` or the path of the bad value."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def parse(body: bytes):
    """The body's JSON value. Refused: bytes that are not UTF-8 JSON, nesting deeper than
    the parser's recursion limit, integer literals over Python's digit limit, and strings
    (keys included) holding a lone UTF-16 surrogate, which JSON escapes allow but no
    UTF-8 text, tokenizer or protobuf string can carry."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise JsonError("body", "nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        raise JsonError("body", f"not valid JSON ({e})") from None
    if _MAYBE_SURROGATE.search(body):
        _check_text(value)
    return value


def _check_text(value) -> None:
    """Walks the value without recursion (its depth is the client's choice)."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            _check_string(path or "body", item)
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                _check_string(path or "body", key)
                stack.append((f"{path}.{key}" if path else key, v))


def _check_string(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JsonError(path, f"a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) is not text") from None
