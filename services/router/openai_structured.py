"""Structured outputs in OpenAI and vLLM requests -> one ``Constraint``.

Spellings taken (at most one of them per request, else a 400 naming the second):
- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: one of ``json`` (a schema object or its JSON text),
  ``regex``, ``choice``, ``grammar`` (GBNF/EBNF or Lark), ``json_object: true``, with
  ``whitespace_pattern`` for JSON;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  with ``guided_whitespace_pattern`` (for any JSON constraint, ``response_format``'s too)
  and ``guided_decoding_backend`` (``auto``,
  ``guidance`` or ``llguidance``: the only engine served).
The constraint is checked here (llguidance compiles it without a tokenizer): a bad schema,
regex or grammar is a 400 naming the field it came in.
"""

from __future__ import annotations

import json
from dataclasses import replace

from services.grammar import Constraint, ConstraintError, check_constraint
from services.router.openai_fields import invalid

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
BACKENDS = (None, "auto", "guidance", "llguidance")


def read_structured(body: dict) -> tuple[Constraint | None, str]:
    """The request's constraint (None = unconstrained) and the field it came in."""
    found: list[tuple[Constraint, str]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append((rf, "response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    if so is not None:
        found.append((so, "structured_outputs"))
    whitespace = _string_or_none(body, "guided_whitespace_pattern")
    for name, kind in GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((_constraint(kind, value, name), name))
    if body.get("guided_decoding_backend") not in BACKENDS:
        raise invalid("guided_decoding_backend", f"this server's engine is llguidance; one of {BACKENDS[1:]}")
    if len(found) > 1:
        raise invalid(found[1][1], f"only one structured-output constraint per request; {found[0][1]} is set")
    if not found:
        if whitespace is not None:
            raise invalid("guided_whitespace_pattern", "needs a JSON constraint")
        return None, ""
    constraint, field = found[0]
    if whitespace is not None:
        if constraint.kind not in ("json_schema", "json_object"):
            raise invalid("guided_whitespace_pattern", "applies to JSON constraints only")
        constraint = replace(constraint, whitespace=whitespace)
    try:
        check_constraint(constraint)
    except ConstraintError as e:
        raise invalid(field, f"invalid constraint: {e}") from None
    return constraint, field


def _response_format(value) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise invalid("response_format.type", f"must be text, json_object or json_schema; got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "must be an object with a schema")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise invalid("response_format.json_schema.schema", "missing")
    return _constraint("json_schema", schema, "response_format.json_schema.schema")


def _structured_outputs(value) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("structured_outputs", "must be an object")
    known = {*STRUCTURED_KEYS, "json_object", "whitespace_pattern", "disable_any_whitespace"}
    for key in value:
        if key not in known:
            raise invalid(f"structured_outputs.{key}", "not implemented by this server")
    if value.get("disable_any_whitespace"):
        raise invalid("structured_outputs.disable_any_whitespace", "not implemented; use whitespace_pattern")
    whitespace = value.get("whitespace_pattern")
    if whitespace is not None and not isinstance(whitespace, str):
        raise invalid("structured_outputs.whitespace_pattern", "must be a string")
    kinds = [k for k in (*STRUCTURED_KEYS, "json_object") if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(
            "structured_outputs",
            f"needs exactly one of json, regex, choice, grammar, json_object; got {kinds}",
        )
    if kinds[0] == "json_object":
        return Constraint("json_object", "", whitespace or "")
    key = kinds[0]
    return _constraint(STRUCTURED_KEYS[key], value[key], f"structured_outputs.{key}", whitespace)


def _constraint(kind: str, value, where: str, whitespace: str | None = None) -> Constraint:
    if kind == "json_schema" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
            raise invalid(where, "must be a non-empty list of non-empty strings")
        value = tuple(value)
    elif not isinstance(value, str) or not value:
        raise invalid(
            where, "must be a non-empty string" + (" or a schema object" if kind == "json_schema" else "")
        )
    return Constraint(kind, value, whitespace or "")


def _string_or_none(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(name, "must be a string")
    return value
