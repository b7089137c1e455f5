"""Structured outputs in requests: every spelling becomes ``sampling.structured``, one per
request, and a bad constraint is a 400 naming the field it came in (OpenAI) or
``sampling.structured`` (gRPC)."""

from __future__ import annotations

import json

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.grammar import Constraint, constraint_from_proto
from services.router.capacity import ModelLimits
from services.router.http import HttpError
from services.router.openai_protocol import parse_completion
from services.router.validation import RequestError, validate_generate
from tests.services.router.scripted_router import MODEL

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parsed(**fields) -> Constraint | None:
    request = parse_completion({"model": MODEL, "prompt": "x", **fields}, MODEL)
    return constraint_from_proto(request.generate.sampling.structured)


def refused(**fields) -> tuple[str, str]:
    with pytest.raises(HttpError) as e:
        parse_completion({"model": MODEL, "prompt": "x", **fields}, MODEL)
    error = e.value.body["error"]
    assert e.value.status == 400 and error["message"].startswith(error["param"] + ": ")
    return error["param"], error["message"]


@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            Constraint("json_schema", json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[0-9]+"}}, Constraint("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, Constraint("choice", ("a", "b"))),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint("grammar", 'root ::= "a"')),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}},
            Constraint("json_object", "", " ?"),
        ),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
            Constraint("json_schema", json.dumps(SCHEMA)),
        ),
        ({"guided_regex": "a+", "guided_decoding_backend": "guidance"}, Constraint("regex", "a+")),
        ({"guided_choice": ["yes", "no"]}, Constraint("choice", ("yes", "no"))),
        ({"guided_grammar": 'start: "x"'}, Constraint("grammar", 'start: "x"')),
        (
            {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "[ ]?"},
            Constraint("json_object", "", "[ ]?"),
        ),
        ({}, None),
    ],
)
def test_every_spelling_becomes_the_constraint(fields, expected):
    assert parsed(**fields) == expected


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "invalid constraint",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": "json"}, "response_format", "object"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_regex": "(a"}, "guided_regex", "regex"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "not implemented",
        ),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "only one",
        ),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(fields, param, words):
    got, message = refused(**fields)
    assert got == param and words in message, message


def _validate(structured: cpb.StructuredOutput) -> None:
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=[1, 2]), sampling=cpb.SamplingParams(max_tokens=4, structured=structured)
    )
    validate_generate(request, ModelLimits(max_model_len=64, default_max_tokens=8), None)


def test_grpc_requests_are_checked_as_sampling_structured():
    _validate(cpb.StructuredOutput(regex="[a-z]+"))
    _validate(cpb.StructuredOutput(choice=cpb.ChoiceList(choices=["a"])))
    for bad in (cpb.StructuredOutput(json_schema='{"type": 7}'), cpb.StructuredOutput(grammar="root ::= (")):
        with pytest.raises(RequestError, match=r"^sampling\.structured: "):
            _validate(bad)
