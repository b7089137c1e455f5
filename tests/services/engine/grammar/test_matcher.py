"""A request's grammar on the bundled tokenizer: row masks over drafts leave the state where
it was (rollback), feeding moves it, the end allows only EOS, and refused drafts ban nothing
after them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.grammar import GrammarCompiler
from services.engine.sampling.sampler import RowParams, probs_for_rows
from services.grammar import Constraint
from services.tokenization.tokenizer import load_tokenizer

TINY = Path(__file__).resolve().parents[4] / "models" / "tiny-target"
VOCAB, EOS = 264, 257


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(load_tokenizer(str(TINY), ""), VOCAB, frozenset({EOS}))


def allowed(banned_row: torch.Tensor) -> list[int]:
    return (~banned_row).nonzero()[:, 0].tolist()


def b(text: str) -> list[int]:
    return list(text.encode())


def test_choice_rows_follow_the_drafts_and_the_state_does_not_move(compiler):
    g = compiler.matcher(Constraint("choice", ("yes", "no")))
    rows = g.banned([[], b("y"), b("ye"), b("n"), b("yes")])
    assert [allowed(r) for r in rows] == [sorted(b("yn")), b("e"), b("s"), b("o"), [EOS]]
    assert allowed(g.banned([[]])[0]) == sorted(b("yn"))  # rolled back: still at the start


def test_feeding_moves_the_state_and_masks_start_from_it(compiler):
    g = compiler.matcher(Constraint("regex", "ab+c"))
    assert g.feed(b("ab"))
    assert allowed(g.banned([[]])[0]) == sorted(b("bc"))
    assert allowed(g.banned([b("c")])[0]) == [EOS]
    assert g.feed(b("abbc")) and g.consumed == 4
    assert allowed(g.banned([[]])[0]) == [EOS]


def test_a_refused_draft_bans_nothing_after_it_and_leaves_the_state(compiler):
    g = compiler.matcher(Constraint("choice", ("yes",)))
    rows = g.banned([[], b("x"), b("xy"), b("y")])
    assert allowed(rows[0]) == b("y") and allowed(rows[3]) == b("e")
    assert not rows[1].any() and not rows[2].any()
    assert allowed(g.banned([[]])[0]) == b("y") and not g.failed


def test_a_refused_output_token_fails_the_grammar(compiler):
    g = compiler.matcher(Constraint("choice", ("yes",)))
    assert not g.feed(b("x")) and g.failed


def test_cut_keeps_tokens_through_the_first_eos(compiler):
    g = compiler.matcher(Constraint("json_object"))
    assert g.cut([1, 2, EOS, 3, EOS]) == [1, 2, EOS]
    assert g.cut([1, 2]) == [1, 2]


def test_equal_constraints_compile_once_and_matchers_are_independent(compiler):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    before = compiler.compiled
    one, two = (
        compiler.matcher(Constraint("json_schema", schema)),
        compiler.matcher(Constraint("json_schema", schema)),
    )
    assert compiler.compiled == before + 1
    assert one.feed(b('{"a":'))
    assert allowed(two.banned([[]])[0]) == b("{")  # two is still at the start


def test_a_constraint_that_does_not_compile_names_structured(compiler):
    with pytest.raises(ValueError, match="^structured: "):
        compiler.matcher(Constraint("regex", "a("))


def test_a_row_left_without_tokens_by_a_reduced_vocabulary_samples_what_the_grammar_allows():
    """A drafter's logits are -inf outside its draft vocabulary: where the grammar's tokens
    all lie outside, the row draws uniformly over them rather than NaN."""
    logits = torch.full((2, 6), float("-inf"))
    logits[:, :3] = torch.tensor([1.0, 2.0, 3.0])  # the draft vocabulary: ids 0..2
    banned = torch.tensor([[True, True, True, True, False, False], [False, True, True, True, True, True]])
    params = RowParams(torch.tensor([1.0, 0.0]), torch.ones(2), banned=banned, any_grammar=True)
    probs = probs_for_rows(logits, params)
    assert torch.allclose(probs[0], torch.tensor([0, 0, 0, 0, 0.5, 0.5]))
    assert probs[1].tolist() == [1, 0, 0, 0, 0, 0]
