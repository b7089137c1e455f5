"""Structured outputs in the engine, on the bundled pair: greedy output under a grammar is
the same with speculation off (K = 0) and on (K = 3), matches its schema, regex or choice,
and no drafted token ever breaks the grammar; sampled output matches too, and an
unconstrained request batched with constrained ones is untouched by their masks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import services.engine.engine as engine_module
from services.engine import Engine, EngineConfig, SamplingParams
from services.grammar import Constraint
from tests.services.engine.json_schemas import SCHEMAS as TWENTY
from tests.services.engine.test_lossless import TINY

pytestmark = pytest.mark.skipif(
    not (TINY / "tiny-drafter" / "model.safetensors").is_file(), reason="the bundled tiny pair is not present"
)

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["module", "class", "function"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "ok", "kind", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "path": {"type": "array", "items": {"enum": ["os", "sys", "re"]}, "minItems": 1, "maxItems": 3},
            "meta": {
                "type": "object",
                "properties": {"line": {"type": "integer", "maximum": 99}, "tag": {"enum": ["a", "b"]}},
                "required": ["line", "tag"],
                "additionalProperties": False,
            },
        },
        "required": ["path", "meta"],
        "additionalProperties": False,
    },
]
PROMPTS = ["import json\nconfig = ", "def load(path):\n    return "]
# prompts whose greedy JSON (under the default whitespace rule) ends within 300 tokens: the
# bundled model, trained on Python source, likes to indent
JSON_PROMPTS = {
    "flat": ["import json\nconfig = ", "# settings\nsettings = "],
    "nested": ["import json\nconfig = ", "data = json.loads("],
}


@pytest.fixture(scope="module")
def engine():
    return Engine(
        EngineConfig(
            model=str(TINY / "tiny-target"),
            drafter=str(TINY / "tiny-drafter"),
            num_spec_tokens=3,
            num_pages=(512, 256),
        )
    )


def run(engine: Engine, prompts: list[str], params: list[SamplingParams], k: int) -> list:
    ids = [engine.add_request(p, s, num_spec_tokens=k) for p, s in zip(prompts, params, strict=True)]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[i] for i in ids]


def greedy(constraint: Constraint | None, max_tokens: int = 300) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=constraint)


@pytest.mark.parametrize(
    "schema, prompts", list(zip(SCHEMAS, JSON_PROMPTS.values(), strict=True)), ids=list(JSON_PROMPTS)
)
def test_greedy_json_schema_is_the_same_with_and_without_speculation_and_valid(engine, schema, prompts):
    c = Constraint("json_schema", json.dumps(schema))
    params = [greedy(c)] * len(prompts)
    plain, spec = run(engine, prompts, params, 0), run(engine, prompts, params, 3)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
        jsonschema.validate(json.loads(a.text), schema)
    assert sum(o.usage.acceptance_length for o in spec) / len(spec) > 1.5  # speculation still pays


@pytest.mark.parametrize(
    "constraint, check",
    [
        (
            Constraint("choice", ("import os", "import sys", "pass")),
            lambda t: t in ("import os", "import sys", "pass"),
        ),
        (Constraint("regex", r"def [a-z_]{1,12}\(self(, [a-z]{1,8}){0,2}\):"), None),
        (Constraint("grammar", 'root ::= "x = " [0-9]{1,4}'), lambda t: re.fullmatch(r"x = [0-9]{1,4}", t)),
    ],
    ids=["choice", "regex", "grammar"],
)
def test_choice_regex_and_grammar_hold_with_and_without_speculation(engine, constraint, check):
    params = [greedy(constraint, 64)] * len(PROMPTS)
    plain, spec = run(engine, PROMPTS, params, 0), run(engine, PROMPTS, params, 3)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == "stop"
        assert check(a.text) if check else re.fullmatch(constraint.value, a.text), a.text


def test_no_draft_breaks_the_grammar(engine, monkeypatch):
    """Every chain the drafter proposes is taken whole by the request's grammar, up to its
    first EOS (what follows an EOS is never emitted)."""
    seen = []
    draft = engine_module.draft

    def checked(runner, requests, k, eos_ids):
        drafts = draft(runner, requests, k, eos_ids)
        for req, chain in zip(requests, drafts.token_ids.tolist(), strict=True):
            if req.grammar is not None:
                chain = req.grammar.cut(chain)
                seen.append(len(chain))
                body = [t for t in chain if t not in eos_ids]  # at most a last EOS
                m = req.grammar.matcher
                assert m.validate_tokens(body) == len(body), chain
                if len(body) < len(chain):  # an EOS only where the grammar is complete
                    assert m.consume_tokens(body) and m.is_accepting(), chain
                    m.rollback(len(body))
        return drafts

    monkeypatch.setattr(engine_module, "draft", checked)
    c = Constraint("json_schema", json.dumps(SCHEMAS[1]))
    run(engine, JSON_PROMPTS["nested"], [greedy(c)] * 2, 3)
    assert len(seen) > 4


def test_sampled_output_matches_the_schema(engine):
    schema = SCHEMAS[0]
    c = Constraint("json_schema", json.dumps(schema), whitespace=" ?")  # at most one space a gap
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured=c) for s in range(4)]
    for o in run(engine, PROMPTS * 2, params, 3):
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)


def test_an_unconstrained_request_in_the_batch_is_untouched(engine):
    free = greedy(None, 40)
    alone = run(engine, PROMPTS[:1], [free], 3)[0]
    c = Constraint("choice", ("yes", "no"))
    mixed = run(engine, PROMPTS[:1] + PROMPTS, [free, greedy(c), greedy(c)], 3)
    assert mixed[0].token_ids == alone.token_ids
    assert all(o.text in ("yes", "no") for o in mixed[1:])


def test_a_complete_grammar_wins_over_min_tokens_and_ignore_eos_stops_at_its_end(engine):
    c = Constraint("choice", ("yes", "no"))
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, ignore_eos=True, structured=c)
    out = run(engine, PROMPTS[:1], [params], 3)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_bad_constraint_is_refused_naming_structured(engine):
    with pytest.raises(ValueError, match="^structured: "):
        engine.add_request("x", greedy(Constraint("json_schema", '{"type": 3}')))
    assert not engine.has_unfinished()


def test_twenty_schemas_greedy_equal_with_and_without_speculation_and_valid(engine):
    """One batch of twenty schemas (at most one space between JSON tokens, so the answers
    end): every answer validates, with speculation on and off alike."""
    constraints = [Constraint("json_schema", json.dumps(s), whitespace=" ?") for s in TWENTY]
    params = [greedy(c, 200) for c in constraints]
    prompts = [PROMPTS[i % 2] for i in range(len(TWENTY))]
    plain, spec = run(engine, prompts, params, 0), run(engine, prompts, params, 3)
    for schema, a, b in zip(TWENTY, plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == "stop", (schema, a.text)
        jsonschema.validate(json.loads(a.text), schema)


def test_twenty_schemas_sampled_with_speculation_are_valid(engine):
    constraints = [Constraint("json_schema", json.dumps(s), whitespace=" ?") for s in TWENTY]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=200, structured=c)
        for i, c in enumerate(constraints)
    ]
    prompts = [PROMPTS[i % 2] for i in range(len(TWENTY))]
    for schema, out in zip(TWENTY, run(engine, prompts, params, 3), strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
