"""Constraints -> llguidance grammars, and their validation.

The grammar text is what ``llguidance.LLMatcher`` compiles: JSON schemas through
llguidance's JSON compiler (between two JSON tokens, DEFAULT_JSON_WHITESPACE: at most one
line break and 32 spaces or tabs, eight levels of four-space indentation, so a model
cannot loop in whitespace; a constraint's own ``whitespace`` pattern replaces it), regexes as they are,
choices as a regex of their literal alternatives, grammars in GBNF/EBNF or Lark. Validation
needs no tokenizer, so the router refuses a bad constraint before any worker sees it.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from services.grammar.constraint import Constraint

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar of at most 1 MiB of text
DEFAULT_JSON_WHITESPACE = r"(\r?\n)?[ \t]{0,32}"
REGEX_META = set("\\.+*?()|[]{}^$-&~#")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of ``c``; raises ConstraintError when it cannot be built."""
    if c.kind in ("json_schema", "json_object"):
        return _json_grammar(c)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_text(c.value))
    if c.kind == "choice":
        if not c.value or not all(isinstance(s, str) and s for s in c.value):
            raise ConstraintError("choice must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({literal_regex(s)})" for s in c.value))
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(_text(c.value)))
    except Exception as e:  # the GBNF converter raises its own errors
        raise ConstraintError(f"grammar does not parse: {e}") from None


def check_constraint(c: Constraint) -> str:
    """The grammar text of a valid ``c``; ConstraintError naming the problem otherwise."""
    text = grammar_text(c)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ConstraintError(_first_line(error))
    return text


def literal_regex(s: str) -> str:
    """A regex matching exactly ``s``."""
    return "".join("\\" + ch if ch in REGEX_META else ch for ch in s)


def _json_grammar(c: Constraint) -> str:
    if c.kind == "json_object":
        schema: object = {"type": "object"}
    else:
        try:
            schema = json.loads(_text(c.value))
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("the schema must be a JSON object (or a boolean)")
    options = {"whitespace_flexible": True, "whitespace_pattern": c.whitespace or DEFAULT_JSON_WHITESPACE}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        raise ConstraintError(str(e)) from None


def _text(value) -> str:
    if not isinstance(value, str) or not value:
        raise ConstraintError("must be a non-empty string")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"at most {MAX_CONSTRAINT_CHARS} characters")
    return value


def _first_line(error: str) -> str:
    """The error on one line, its whitespace collapsed, at most 300 characters."""
    return " ".join(error.split())[:300]
