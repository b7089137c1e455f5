"""One request's output constraint, and its protobuf form (``tandem.v1.StructuredOutput``).

A Constraint is frozen and hashable: equal constraints share one compiled grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.tandem.v1 import client_pb2 as cpb

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """``kind`` one of KINDS; ``value``: the schema's JSON text, the regex, the grammar's
    text, the choices (a tuple), or "" for json_object. ``whitespace``: JSON kinds only,
    a regex for the whitespace allowed between JSON tokens ("" = any JSON whitespace)."""

    kind: str
    value: str | tuple[str, ...] = ""
    whitespace: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured: unknown kind {self.kind!r}; one of {', '.join(KINDS)}")


def constraint_from_proto(message: cpb.StructuredOutput) -> Constraint | None:
    """None when no kind is set (unconstrained)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(kind, tuple(message.choice.choices), message.whitespace_pattern)
    if kind == "json_object":
        return Constraint(kind, "", message.whitespace_pattern) if message.json_object else None
    return Constraint(kind, getattr(message, kind), message.whitespace_pattern)


def constraint_to_proto(constraint: Constraint, message: cpb.StructuredOutput) -> None:
    """Fill ``message`` (a GenerateRequest's ``sampling.structured``) with ``constraint``."""
    message.whitespace_pattern = constraint.whitespace
    if constraint.kind == "choice":
        message.choice.choices.extend(constraint.value)
    elif constraint.kind == "json_object":
        message.json_object = True
    else:
        setattr(message, constraint.kind, constraint.value)
