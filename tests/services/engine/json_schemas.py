"""Twenty JSON schemas of the shapes structured outputs meet: nested objects, enums, arrays,
bounded strings and numbers, optional keys, anyOf, const and patterns. Every string and
array is bounded, so a small model's answer ends."""

from __future__ import annotations

STR = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": -50, "maximum": 500}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS = [
    obj({"name": STR}),
    obj({"ok": {"type": "boolean"}, "count": INT}),
    obj({"kind": {"enum": ["module", "class", "function"]}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": INT, "y": INT})}),
    obj({"a": obj({"b": obj({"c": {"enum": ["x", "y"]}})})}),
    obj({"items": {"type": "array", "items": obj({"id": INT, "done": {"type": "boolean"}}), "maxItems": 2}}),
    obj({"name": STR, "alias": STR}, required=["name"]),
    obj({"value": {"anyOf": [INT, {"type": "null"}]}}),
    obj({"version": {"const": "1.0"}, "build": INT}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    {"type": "array", "items": {"enum": ["os", "sys", "re"]}, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
    obj(
        {"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}
    ),
    obj(
        {
            "user": obj(
                {"name": STR, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}}
            )
        }
    ),
    obj({"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}}),
    obj({"path": {"type": "string", "maxLength": 12}, "line": INT, "col": INT}),
    obj({"status": {"enum": [200, 404, 500]}, "body": STR}),
    {"type": "integer", "minimum": 0, "maximum": 9999},
]
