"""Constraints: their protobuf form, and the checks the router runs before any worker."""

from __future__ import annotations

import re

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.grammar import (
    Constraint,
    ConstraintError,
    check_constraint,
    constraint_from_proto,
    constraint_to_proto,
)
from services.grammar.llg import literal_regex

CASES = [
    Constraint("json_schema", '{"type": "object"}', "[ ]?"),
    Constraint("json_object"),
    Constraint("regex", "[a-z]+"),
    Constraint("choice", ("yes", "no")),
    Constraint("grammar", 'root ::= "a" | "b"'),
]


@pytest.mark.parametrize("constraint", CASES, ids=lambda c: c.kind)
def test_a_constraint_goes_through_its_proto_unchanged_and_compiles(constraint):
    message = cpb.StructuredOutput()
    constraint_to_proto(constraint, message)
    assert constraint_from_proto(message) == constraint
    assert check_constraint(constraint)


def test_an_unset_message_is_no_constraint():
    assert constraint_from_proto(cpb.StructuredOutput()) is None
    assert constraint_from_proto(cpb.StructuredOutput(json_object=False)) is None


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint("json_schema", '{"type": "nope"}'), "nope"),
        (Constraint("json_schema", "{not json"), "not JSON"),
        (Constraint("json_schema", "[1]"), "object"),
        (Constraint("regex", "a("), "unclosed"),
        (Constraint("choice", ()), "non-empty"),
        (Constraint("grammar", "root ::= ("), "grammar"),
        (Constraint("regex", ""), "non-empty"),
    ],
)
def test_a_bad_constraint_says_why(constraint, words):
    with pytest.raises(ConstraintError, match=words):
        check_constraint(constraint)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown kind"):
        Constraint("xml", "x")


@pytest.mark.parametrize("text", ["a.b", "x-y [z] (w)", "q\"'\\", "#&~ é\t\n", "$^*+?{}|"])
def test_literal_regex_matches_its_text_only(text):
    assert re.fullmatch(literal_regex(text), text)
